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
