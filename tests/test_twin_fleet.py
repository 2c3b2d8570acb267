"""More than one twin server behind a session-id router sharing one L3 (toolkv/twin/fleet.py): the
L3 is sglang's storage tier on every server, the store shared by name, and toolkv's L3 decisions
are its manager's; the fleet adds routing and draining only."""

from __future__ import annotations

from typing import Any

import pytest

from toolkv.twin.profile import default_profile
from toolkv.twin.run import Options
from toolkv.workload.plan import Workload

# long tools (1-10 minutes), 6 sessions, a 1 GB host (7,630 tokens): the idle sessions do not fit
L3W = Workload(initial_sessions=6, ramp_s=2.0, turns_median=4, first_tokens=2400, growth_per_turn=400,
               output_tokens=20, max_context=8000, tool_shape="long", duration_s=700.0, seed=1)  # fmt: skip
L3OPTS = Options(
    device_tokens=6000, chunked_prefill_size=1024, max_prefill_tokens=2048, max_running_requests=16
)


def fleet_run(name: str, n: int = 1, drain: list[tuple[float, int]] | None = None) -> dict[str, Any]:
    from toolkv.twin.fleet import fleet_config, simulate_fleet

    return simulate_fleet(L3W, fleet_config(name, 1.0), default_profile(), L3OPTS, n=n, drain=drain,
                          window=(3.0, L3W.duration_s))  # fmt: skip


def test_moved_sessions_are_read_from_the_shared_l3_not_recomputed() -> None:
    """Two servers, one drained part-way: its sessions' next turns land on the other. Without L3
    they are recomputed (no cached token); with the shared L3, sglang's arrival read on the new
    server finds what the old one wrote through; a moved session's tool_end gets a 404 there."""
    from toolkv.twin.storage import STORES

    drain = [(100.0, 0)]
    bare = fleet_run("stock", n=2, drain=drain)
    tk = fleet_run("toolkv-l3", n=2, drain=drain)
    for r in (bare, tk):
        assert r["passed"], (r["checks"], r["crashed"], r["leaks"])
        assert r["drained"] == 1 and r["moved_turns"] > 0
        assert r["drained_leaks"]["leaked"] == 0, r["drained_leaks"]
    assert bare["moved_reuse"] == 0.0 and bare["l3"] is None
    assert tk["moved_reuse"] > 0.5
    assert tk["l3"]["read_tokens"] > 0 and tk["l3"]["stored_pages"] > 0
    assert tk["calls"].get("tool_end 404", 0) > 0
    assert not STORES  # the fleet's store is forgotten with it


def test_route_moves_only_the_sessions_of_a_server_that_went_away() -> None:
    from toolkv.twin.fleet import route

    sids = [f"s{i}" for i in range(200)]
    before = {s: route(s, [0, 1, 2, 3]) for s in sids}
    after = {s: route(s, [0, 2, 3]) for s in sids}
    assert {s for s in sids if before[s] != after[s]} == {s for s in sids if before[s] == 1}


def test_l3_and_fleet_command_lines_refuse_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    """``toolkv twin l3``/``fleet`` check their arguments before simulating anything."""
    from toolkv.twin.__main__ import main

    for argv in (
        ["fleet", "--configs", "stock,nope"],
        ["l3", "--l3-read-gbps", "0"],
        ["fleet", "--drain-share", "1.0"],
    ):
        try:
            code = main(argv)
        except SystemExit as e:  # argparse's one-line refusal
            code = e.code
        assert code == 2, argv
    err = capsys.readouterr().err
    assert "'stock,nope'" in err and "--l3-read-gbps" in err and "--drain-share" in err


def test_the_store_with_mooncakes_semantics_evicts_lru_and_never_a_pinned_page() -> None:
    """``L3Pages(mooncake=True)``: a put into a full store makes the master evict the least recently
    used pages that hold no soft pin (an access moves a page to the end); pinned pages survive until
    their deadline; with every page pinned a put is refused."""
    import torch

    from toolkv.twin.storage import L3Pages

    s = L3Pages(capacity_pages=20, mooncake=True)
    page = torch.zeros(1)
    for i in range(20):
        assert s.put(f"p{i}", page, pin_until=10.0 if i < 5 else None)
    s.touch("p5")  # p5 is the most recently used now
    assert s.put("new", page)
    assert s.evicted == 1 and "p6" not in s.pages and "p5" in s.pages
    assert all(f"p{i}" in s.pages for i in range(5)), "a pinned page is never evicted"
    s.now = 11.0  # the pins' deadline passed: the pinned pages are the oldest
    assert s.put("newer", page) and "p0" not in s.pages
    full = L3Pages(capacity_pages=3, mooncake=True)
    for i in range(3):
        full.put(f"q{i}", page, pin_until=99.0)
    assert not full.put("q3", page) and full.refused == 1 and len(full) == 3
    plain = L3Pages(capacity_pages=3)  # no evictor: refused once full
    for i in range(3):
        plain.put(f"r{i}", page)
    assert not plain.put("r3", page) and plain.evicted == 0


def test_on_mooncake_a_moved_session_is_adopted_and_its_pinned_copy_read() -> None:
    """Two servers sharing a store with Mooncake's semantics at a capacity that makes the master
    evict, one drained part-way. Stock sglang's L3 loses moved sessions' pages to the master's LRU;
    toolkv's soft pins keep what it stored whole, a moved session's tool_end on the other server is
    adopted from its manifest, and the moved turns reuse more."""
    from toolkv.twin.fleet import fleet_config, simulate_fleet
    from toolkv.twin.l3 import L3Config

    def run(name: str) -> dict[str, Any]:
        return simulate_fleet(L3W, fleet_config(name, 1.0), default_profile(), L3OPTS, n=2, drain=[(100.0, 0)],
                              l3=L3Config(capacity_gb=2.0), window=(3.0, L3W.duration_s))  # fmt: skip

    stock, tk = run("stock-mc"), run("toolkv-mc")
    for r in (stock, tk):
        assert r["passed"], (r["checks"], r["crashed"], r["leaks"])
        assert r["moved_turns"] > 0 and r["l3"]["evicted_pages"] > 0, r["l3"]
        # the drained server stays up: it let go of every session it held (SharedTier.tla's LetGo)
        assert r["drained_leaks"]["leaked"] == 0 and r["drained_leaks"]["sessions_holding"] == 0, r[
            "drained_leaks"
        ]
        # and soon, not at the sessions' TTL (600 s): within the longest tool call's store and ack
        assert r["drained_held_s"] < 60.0, r["drained_held_s"]
    assert tk["toolkv_l3"].get("tool_end_adopted", 0) > 0, tk["toolkv_l3"]
    assert tk["toolkv_l3"].get("drain_let_go", 0) + tk["toolkv_l3"].get("l3_store_drain", 0) > 0, tk[
        "toolkv_l3"
    ]
    assert tk["moved_reuse"] > stock["moved_reuse"], (tk["moved_reuse"], stock["moved_reuse"])
