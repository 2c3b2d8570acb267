"""docs/benchmarks.md's fleet-twin table on a shared tier with Mooncake's semantics is the recorded
sweep (docs/results/fleet_mooncake.json), rendered by the tool that ran it
(``python -m toolkv.twin.l3report docs/results/fleet_mooncake.json``)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from toolkv.twin.l3report import table_of

ROOT = Path(__file__).resolve().parents[1]
RESULT = ROOT / "docs" / "results" / "fleet_mooncake.json"


def test_the_fleet_mooncake_table_is_the_recorded_sweep() -> None:
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    m = re.search(r"<!-- BEGIN fleet-mooncake -->\n(.*?)\n<!-- END fleet-mooncake -->", text, re.S)
    assert m is not None, "docs/benchmarks.md has no fleet-mooncake block"
    assert m.group(1) == table_of(RESULT)


def test_the_recorded_sweep_is_the_command_beside_it() -> None:
    """One server was drained in each run, every check passed, the drained server held nothing at
    the end (it lets go of its sessions: SharedTier.tla's ``LetGo``), and the command in the docs
    names the sweep's own arguments."""
    data = json.loads(RESULT.read_text())
    assert data["kind"] == "fleet" and all(r["drained"] == 1 and r["crashed"] is None for r in data["rows"])
    for r in data["rows"]:
        assert r["passed"], (r["config"], r["servers"], r["checks"], r["leaks"])
        assert r["drained_leaks"]["leaked"] == 0, (r["config"], r["servers"], r["drained_leaks"])
    a = data["args"]
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    cmd = (
        f"toolkv twin fleet --servers {','.join(map(str, a['servers']))} --configs {a['configs']} "
        f"--sessions {a['sessions']} --duration {a['duration']:g} --drain-share {a['drain_share']:g} "
        f"--drain-at {a['drain_at']:g} --l3-capacity-gb {a['l3_capacity_gb']:g}"
    )
    assert cmd in text, cmd
