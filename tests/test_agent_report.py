"""The agent-load table in docs/benchmarks.md is what ``toolkv.workload.report`` prints from the
committed results JSON (a stale figure fails here), and the 5xx accounting of the load generator."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from toolkv.tools.agent_bench import unexpected_5xx
from toolkv.workload.report import table

DOCS = Path(__file__).resolve().parents[1] / "docs"
RUNS = ["stock", "explicit", "on_request"]


def test_benchmarks_table_is_generated_from_the_results() -> None:
    generated = table([DOCS / "results" / f"gpu_agent_{r}.json" for r in RUNS])
    assert generated in (DOCS / "benchmarks.md").read_text()


def test_only_undocumented_5xx_count_as_faults() -> None:
    calls = Counter({"tool_start 507": 3, "tool_end 503": 2, "tool_start 409": 1, "tool_end 200": 5})
    assert unexpected_5xx(calls) == 0
    calls["tool_end 500"] += 1
    calls["tool_start 504"] += 2
    assert unexpected_5xx(calls) == 3
