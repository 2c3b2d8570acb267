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


def _row(config: str, seed: int, reuse: tuple[int, int], moved: tuple[int, int]) -> dict[str, object]:
    return {
        "servers": 8, "config": config, "seed": seed, "reuse": reuse[0] / reuse[1], "reuse_tokens": list(reuse),
        "ttft_p50_s": 1.0 + seed, "ttft_p90_s": 5.0, "moved_turns": 2,
        "moved_reuse": moved[0] / moved[1] if moved[1] else None, "moved_reuse_tokens": list(moved), "passed": True,
    }  # fmt: skip


def test_the_seeds_summary_pools_tokens_and_counts_each_seed_against_stock() -> None:
    """``l3report --seeds``: reuse pooled over the seeds' tokens (a seed with more moved tokens
    weighs more), and per seed whether toolkv's moved reuse was above, equal to or below
    stock's on the same seed."""
    from toolkv.twin.l3report import seeds_table

    rows = [
        _row("stock-mc", 0, (50, 100), (10, 100)), _row("toolkv-mc", 0, (60, 100), (20, 100)),
        _row("stock-mc", 1, (50, 100), (0, 300)), _row("toolkv-mc", 1, (40, 100), (0, 300)),
        _row("stock-mc", 2, (50, 100), (30, 100)), _row("toolkv-mc", 2, (50, 100), (10, 100)),
    ]  # fmt: skip
    lines = {ln.split(" | ")[1]: ln.split(" | ") for ln in seeds_table(rows).splitlines()[2:]}
    tk, st = lines["toolkv-mc"], lines["stock-mc"]
    assert tk[2] == "0,1,2" and tk[3] == "50 %" and tk[4] == "50 % (40 %-60 %)"
    assert tk[8] == "6 %" and st[8] == "8 %", "moved reuse pooled: 30/500 and 40/500"
    assert tk[10] == "1 / 1 / 1" and st[10] == "-"
    assert tk[5] == "2.00 (1.00-3.00)"


SEEDS = ROOT / "docs" / "results" / "fleet_mc_seeds"


def test_the_seeds_table_is_the_recorded_runs() -> None:
    """The over-seeds table is ``l3report --seeds`` of the recorded runs; every run passed its
    checks, its drained server held nothing at the end, and ran the command the docs give: 3
    sessions a server, 12 GB of store a server, one server drained at 300 s."""
    from toolkv.twin.l3report import rows_of, seeds_table

    files = sorted(SEEDS.glob("*.json"))
    assert files, "no recorded runs"
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    block = re.search(
        r"<!-- BEGIN fleet-mooncake-seeds -->\n(.*?)\n<!-- END fleet-mooncake-seeds -->", text, re.S
    )
    assert block is not None and block.group(1) == seeds_table(rows_of(files)[1]), (
        "regenerate: python -m toolkv.twin.l3report --seeds docs/results/fleet_mc_seeds/*.json"
    )
    for f in files:
        data = json.loads(f.read_text())
        a, (r,) = data["args"], data["rows"]
        assert f.name == f"s{r['servers']}_{r['config']}_seed{a['seed']}.json", f.name
        assert (a["sessions"], a["duration"], a["drain_share"], a["drain_at"]) == (3, 600.0, 0.01, 300.0), a
        assert a["l3_capacity_gb"] == 12.0 * r["servers"] and a["l3_pin_share"] is None, a
        assert r["passed"] and r["crashed"] is None and r["drained_leaks"]["leaked"] == 0, (
            f.name,
            r["checks"],
        )
