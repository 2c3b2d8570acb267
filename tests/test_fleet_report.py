"""The GPU fleet run's table in docs/benchmarks.md is the committed run's (``scripts/gpu_fleet.py
--report``), and that run passed every check and left nothing held on the survivor."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUN = ROOT / "docs" / "results" / "fleet"


def _fleet() -> object:
    spec = importlib.util.spec_from_file_location("gpu_fleet", ROOT / "scripts" / "gpu_fleet.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gpu_fleet"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_the_docs_table_is_the_committed_run(capsys: pytest.CaptureFixture[str]) -> None:
    fleet = _fleet()
    assert fleet.report(["--report", str(RUN)]) == 0  # type: ignore[attr-defined]
    printed = capsys.readouterr().out.strip()
    doc = (ROOT / "docs" / "benchmarks.md").read_text()
    block = re.search(r"<!-- BEGIN fleet-gpu -->\n```text\n(.*?)\n```\n<!-- END fleet-gpu -->", doc, re.S)
    assert block is not None and block.group(1).strip() == printed, (
        "regenerate the fleet table in docs/benchmarks.md: python scripts/gpu_fleet.py --report docs/results/fleet"
    )


def test_the_committed_run_passed_and_the_survivor_held_nothing() -> None:
    fleet = _fleet()
    res = json.loads((RUN / "fleet.json").read_text())
    assert res["passed"] and res["checks"] and all(res["checks"].values())
    moved = [r for rnd in res["rounds"].values() for r in rnd["sessions"] if r.get("moved")]
    assert moved and all(r["turn2 equals twin"] for r in moved)
    for rnd in res["rounds"].values():
        meta = rnd["survivor_meta_end"]
        assert all(meta[k] == 0 for k in fleet.HELD_KEYS), meta  # type: ignore[attr-defined]


def test_a_missing_run_is_an_error_not_a_traceback(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _fleet().report(["--report", str(tmp_path)]) == 2  # type: ignore[attr-defined]
    assert "cannot read" in capsys.readouterr().err
