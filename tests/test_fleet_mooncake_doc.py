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


def test_the_pin_budget_runs_are_their_tables_and_commands() -> None:
    """The two 8-server reruns of ``toolkv-mc`` with the pin budget (``--l3-pin-share``): each
    table is its JSON, each command its arguments, every check passed, the drained server held
    nothing, the cap refused stores (``l3_store_pin_cap``) and the store refused no page."""
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    for tag in ("05", "09"):
        path = ROOT / "docs" / "results" / f"fleet_mooncake_pin{tag}.json"
        block = re.search(
            rf"<!-- BEGIN fleet-mooncake-pin{tag} -->\n(.*?)\n<!-- END fleet-mooncake-pin{tag} -->",
            text,
            re.S,
        )
        assert block is not None and block.group(1) == table_of(path), tag
        data = json.loads(path.read_text())
        a = data["args"]
        cmd = (
            f"toolkv twin fleet --servers {','.join(map(str, a['servers']))} --configs {a['configs']} "
            f"--sessions {a['sessions']} --duration {a['duration']:g} --drain-share {a['drain_share']:g} "
            f"--drain-at {a['drain_at']:g} --l3-capacity-gb {a['l3_capacity_gb']:g} "
            f"--l3-pin-share {a['l3_pin_share']:g} --out docs/results/fleet_mooncake_pin{tag}.json"
        )
        assert cmd in text, cmd
        for r in data["rows"]:
            assert r["passed"] and r["crashed"] is None and r["drained_leaks"]["leaked"] == 0, r["checks"]
            assert r["toolkv_l3"]["l3_store_pin_cap"] > 0 and r["l3"]["refused_pages"] == 0, r["toolkv_l3"]
