"""docs/caveats.md's kill table is the recorded run (docs/results/kill_cpu.json), row for row."""

from __future__ import annotations

import json
from pathlib import Path

from toolkv.tools.fuzz_cli import kill_table

ROOT = Path(__file__).resolve().parents[1]


def test_the_kill_table_in_the_docs_is_the_recorded_run() -> None:
    results = json.loads((ROOT / "docs" / "results" / "kill_cpu.json").read_text())
    doc = (ROOT / "docs" / "caveats.md").read_text().splitlines()
    rows = [line for line in doc if line.startswith("| `") and line.count(" | ") >= 4 and line.endswith(" |")]
    table = [line for line in rows if line.split(" | ")[2] in ("yes", "NO")]
    assert "\n".join(table) == kill_table(results)
