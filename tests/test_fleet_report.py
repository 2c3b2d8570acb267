"""The GPU fleet run's table in docs/benchmarks.md is the committed run's (``scripts/gpu_fleet.py
--report``), and that run passed every check and left nothing held on the survivor."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest
from _generated import ROOT, doc_block, load_script

RUN = ROOT / "docs" / "results" / "fleet"


def _fleet() -> ModuleType:
    return load_script(ROOT / "scripts" / "gpu_fleet.py")


def test_the_docs_table_is_the_committed_run(capsys: pytest.CaptureFixture[str]) -> None:
    fleet = _fleet()
    assert fleet.report(["--report", str(RUN)]) == 0  # type: ignore[attr-defined]
    printed = capsys.readouterr().out.strip()
    block = doc_block("benchmarks.md", "fleet-gpu", fence="text")
    assert block is not None and block.strip() == printed, (
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


def test_a_missing_run_is_an_error_not_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _fleet().report(["--report", str(tmp_path)]) == 2  # type: ignore[attr-defined]
    assert "cannot read" in capsys.readouterr().err
