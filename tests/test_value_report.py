"""The value table in docs/benchmarks.md is the value report of the saved GPU runs (never typed by
hand), and the report's figures are what the per-turn records say."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from toolkv.tools.value_report import load, main, stats

ROOT = Path(__file__).resolve().parents[1]
RUNS = ROOT / "docs" / "results" / "value"


def test_the_docs_table_is_the_reports_output(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(RUNS)]) == 0
    printed = capsys.readouterr().out.strip()
    doc = (ROOT / "docs" / "benchmarks.md").read_text()
    block = re.search(r"<!-- BEGIN value -->\n(.*?)\n<!-- END value -->", doc, re.S)
    assert block is not None and block.group(1).strip() == printed, (
        "regenerate the table in docs/benchmarks.md"
    )


def test_ratios_are_against_the_stock_run_of_the_same_host_size() -> None:
    rows = {r["config"]: r for r in load([RUNS])}
    assert rows["stock16"]["tps_vs_stock"] == 1.0 and rows["stock64"]["tps_vs_stock"] == 1.0
    o = rows["offload16"]
    assert o["tps_vs_stock"] == pytest.approx(o["closed_turns_per_s"] / rows["stock16"]["closed_turns_per_s"])
    assert o["p90_vs_stock"] == pytest.approx(o["resumed_ttft_p90_s"] / rows["stock16"]["resumed_ttft_p90_s"])


def test_the_figures_follow_the_turn_records(tmp_path: Path) -> None:
    """A hand-made run of 10 turns: t90 is the 9th end, reuse the cached share of resumed prompts."""
    turns = [
        {"turn": i % 2, "start_s": float(i), "e2e_s": 1.0, "status": 200, "ttft_s": 0.1 * i,
         "prompt_tokens": 100, "cached_tokens": 50 if i % 2 else 0}
        for i in range(10)
    ]  # fmt: skip
    res = {"config": "stock16", "turns": turns, "summary": {"calls": {}}, "events": []}
    s = stats(res)
    assert s["t90_s"] == pytest.approx(9.0) and s["closed_turns_per_s"] == pytest.approx(1.0)
    assert s["reuse"] == pytest.approx(0.5) and s["resumed_turns"] == 5
    bad = tmp_path / "x.json"
    bad.write_text(json.dumps({"nothing": 1}))
    assert main([str(bad)]) == 2
