"""docs/benchmarks.md's tree-core cost tables are the recorded run (docs/results/core_cost.json),
rendered by the tool that measured them (``python -m toolkv.tools.core_cost``)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from toolkv.tools.core_cost import table

ROOT = Path(__file__).resolve().parents[1]


def test_the_core_cost_tables_are_the_recorded_run() -> None:
    res = json.loads((ROOT / "docs" / "results" / "core_cost.json").read_text())
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    m = re.search(r"<!-- BEGIN core-cost -->\n(.*?)\n<!-- END core-cost -->", text, re.S)
    assert m is not None, "docs/benchmarks.md has no core-cost block"
    assert m.group(1) == table(res)


def test_the_recorded_run_kept_the_simulation_the_same_on_both_cores() -> None:
    """The twin is deterministic: each cell's repetitions simulated the same run, and the stock
    cells are the same schedule on both cores (the core changes CPU time, not sglang's decisions)."""
    res = json.loads((ROOT / "docs" / "results" / "core_cost.json").read_text())
    assert all(c["same_simulation"] and c["passed"] and c["crashed"] is None for c in res["twin"])
    stock = {(c["sessions"], c["core"]): c for c in res["twin"] if c["config"] == "stock"}
    for n in {s for s, _ in stock}:
        py, rs = stock[(n, "python")], stock[(n, "rust")]
        assert (py["closed_turns_per_s"], py["resumed_ttft_p90_s"]) == (
            rs["closed_turns_per_s"],
            rs["resumed_ttft_p90_s"],
        )
