"""The TTL both ways, on the real manager and in the Python step properties.

``check_step`` must flag a sweep that leaves a due protection in place (``ProtectionReleased``) and
any step that expires a session before its deadline (``NoEarlyExpiry``); the real manager with two
sessions whose deadlines differ must expire each exactly at its own deadline.
"""

from __future__ import annotations

import copy
from typing import Any

from toolkv.verify.toolkv.refinement import Bounds, check_step
from toolkv.verify.toolkv.world import Replayer

B = Bounds(
    nodes=("n1", "n2"), sessions=("s1", "s2"), dev_slots=10**6, host_slots=10**6, max_time=10**6, ttl=5
)


def _offloaded_pair() -> tuple[Replayer, list[dict[str, Any]]]:
    """s1 offloads at t=0 (deadline 5), s2 at t=3 (deadline 8); the states after every step."""
    r = Replayer(B, capacity="real", device_tokens=1024)
    states = [r.abstract()]
    for act in (
        ["Insert", "s1", "Root", "n1"],
        ["Insert", "s2", "Root", "n2"],
        ["ToolStart", "s1"],
        ["Tick"],
        ["Tick"],
        ["Tick"],
        ["ToolStart", "s2"],
    ):
        res = r.apply(act)
        assert not res.violations and res.error is None, (act, res)
        states.append(r.abstract())
    return r, states


def test_two_sessions_expire_each_at_its_own_deadline() -> None:
    r, states = _offloaded_pair()
    try:
        st = states[-1]
        assert st["deadline"] == {"s1": 5, "s2": 8}
        phases = []
        for _ in range(6):  # t = 4 .. 9, a sweep after every tick
            for act in (["Tick"], ["TtlSweep"]):
                pre = r.abstract()
                res = r.apply(act, pre)
                assert not res.violations, (act, res.violations)  # includes NoEarlyExpiry both ways
            now = r.mgr.now
            phases.append((now, r.mgr.sessions["s1"].state, r.mgr.sessions["s2"].state))
        s1_gone = min(t for t, a, _ in phases if a == "Expired")
        s2_gone = min(t for t, _, b in phases if b == "Expired")
        assert (s1_gone, s2_gone) == (5, 8), phases
    finally:
        r.close()


def test_check_step_flags_an_early_expiry_and_a_late_one() -> None:
    r, states = _offloaded_pair()
    r.close()
    pre = states[-1]  # now = 3: nothing is due
    early = copy.deepcopy(pre)
    early["phase"]["s2"] = "Expired"  # s2's deadline is 8
    assert "NoEarlyExpiry" in check_step(pre, early, B, ("TtlSweep",))
    due = copy.deepcopy(pre)
    due["now"] = 5  # s1 is due, and a sweep left it protected
    assert "ProtectionReleased" in check_step(due, due, B, ("TtlSweep",))
    ok = copy.deepcopy(due)
    ok["phase"]["s1"] = "Expired"
    ok["prot"]["s1"] = "NoNode"
    assert check_step(due, ok, B, ("TtlSweep",)) == []
