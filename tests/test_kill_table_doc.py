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


def test_the_slowest_kill_over_the_seeds_is_the_recorded_one() -> None:
    """The seeds run (docs/results/kill_seeds/) killed every mutant, and the docs quote their
    slowest kill."""
    runs = sorted((ROOT / "docs" / "results" / "kill_seeds").glob("seed_*.json"))
    assert len(runs) == 5, runs
    kills = [r for run in runs for r in json.loads(run.read_text())]
    assert all(r["failure"] is not None for r in kills), [r["label"] for r in kills if r["failure"] is None]
    slowest = max(r["examples_to_kill"] for r in kills)
    for doc in ("caveats.md", "testing.md"):
        text = " ".join((ROOT / "docs" / doc).read_text().split())
        assert f"slowest kill{':' if doc == 'caveats.md' else ' took'} {slowest} examples" in text, doc
