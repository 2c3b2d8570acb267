"""``toolkv bench overhead`` runs to its end on the real HiRadixCache with the manager as it is
(its loop walks every phase a copy-path call passes, the hand-over's ``Admit`` included), and its
JSON holds a row per call. Times are the benchmark's to report, not this test's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

CALLS = ("tool_start", "tick_write_ack", "tool_end", "tick_load_start", "tick_load_ack")


def test_the_overhead_bench_runs_through_every_call(tmp_path: Path) -> None:
    out = tmp_path / "overhead.json"
    p = subprocess.run(
        [sys.executable, "-m", "toolkv.tools.cli", "bench", "overhead", "--sizes", "50", "--samples", "30",
         "--out", str(out)],
        capture_output=True, text=True, timeout=300, check=False, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    data = json.loads(out.read_text())
    rows = data["results"] if isinstance(data, dict) and "results" in data else data
    (row,) = rows
    assert row["sessions"] == 50
    for call in CALLS:
        assert row[call]["n"] > 0, (call, row[call])


def test_the_docs_tables_are_the_recorded_run() -> None:
    """docs/benchmarks.md's control-path tables are the committed run's JSON, rendered."""
    import re

    from toolkv.tools.bench import overhead_tables

    root = Path(__file__).resolve().parents[1]
    data = json.loads((root / "docs" / "bench" / "overhead.json").read_text())
    text = (root / "docs" / "benchmarks.md").read_text()
    block = re.search(r"<!-- BEGIN overhead [^\n]*-->\n(.*?)\n<!-- END overhead -->", text, re.S)
    assert block is not None and block.group(1) == overhead_tables(data), (
        "rerun: toolkv bench overhead --sizes 1000,10000,100000 --samples 1000 --out docs/bench/overhead.json"
    )
