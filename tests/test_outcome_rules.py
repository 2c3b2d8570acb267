"""The rules that decide value under load, on sglang 0.5.16's real HiRadixCache: each test checks
the outcome the rule must give, and runs the same scenario once more with a plausible buggy rule
monkeypatched in (an inverted or dropped condition), which must give another outcome, so the test
is known to fail on that bug.

* ``auto`` with a waiting queue (a real sglang ``Req`` in the scheduler's waiting queue, read by
  the plugin's ``queued_tokens``): a short tool that would be kept on an idle server is offloaded,
  its device room given to the queue (the 0.5.23 stand-in's test in tests/test_kv_hints_0523.py,
  on 0.5.16). Bug: the keep rule ignores the queue.
* a host full of sglang's own unprotected copies (write-through mirrors): under ``auto`` a long
  tool still offloads, its room made by ``evict_host``. Bug: only the free host room counts.
* two demotion candidates with different predicted returns: the one predicted back latest goes.
  Bug: the demotion order reversed (the soonest back goes).
* an admission that arrives while the session's restore is still loading: the hand-over ends at
  the load ack (Runnable, the pin returned), not at a later request or the TTL. Bug: the early
  admission is forgotten.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import _cycle
import pytest
from _cycle import step
from _ghost import DEVICE_TOKENS, GhostRig, prompt

from toolkv.core.manager import ManagerConfig, ToolKVManager
from toolkv.core.policy import PolicyConfig
from toolkv.core.treeops import path_to
from toolkv.testing.harness import CacheHarness, HarnessConfig
from toolkv.twin.configs import TwinConfig
from toolkv.twin.stack import build

BUGS = (None, "bug")


@pytest.fixture
def h() -> Iterator[CacheHarness]:
    with CacheHarness(HarnessConfig(device_tokens=2048)) as harness:
        yield harness


def auto(h: CacheHarness, **kw: Any) -> ToolKVManager:
    policy = kw.pop("policy_config", PolicyConfig(min_offload_tokens=64))
    return ToolKVManager(h.tree, config=ManagerConfig(policy="auto", policy_config=policy, **kw))


def turn(h: CacheHarness, m: ToolKVManager, sid: str, tokens: list[int]) -> None:
    _cycle.turn(h, m, sid, tokens, ack_writes=True)


def locks_on(h: CacheHarness, tokens: list[int]) -> list[int]:
    return [n.lock_ref for n in path_to(h.tree, h.match(tokens).last_device_node)]


# ---- (a) auto with a waiting queue ----------------------------------------------------------------
@pytest.mark.parametrize("bug", BUGS)
def test_auto_gives_a_waiting_queue_the_room_a_short_tool_would_keep(
    bug: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    if bug:  # the keep rule reads the device as if nothing waited
        monkeypatch.setattr("toolkv.core.session.state.with_queued", lambda p, queued: p)
    stack = build(
        TwinConfig("auto", "hiradix", "explicit", policy="auto"),
        device_tokens=DEVICE_TOKENS, kv_bytes_per_token=1024, now=lambda: 0.0,
    )  # fmt: skip
    try:
        r = GhostRig(stack)
        r.tk.bind_scheduler(r.sched)  # as the plugin binds it: queued_tokens reads the waiting queue
        r.run(prompt(1, 64), "s1")
        code, idle = r.tk.handle("tool_start", {"session_id": "s1", "tool": "grep", "expected_s": 0.2})
        assert code == 200, idle
        r.run(prompt(2, 64), "s2")
        from array import array

        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.sampling.sampling_params import SamplingParams

        sp = SamplingParams(max_new_tokens=64, ignore_eos=True, temperature=0)
        sp.normalize(None)
        r.sched.add_request(Req("waiting", "", array("q", prompt(3, 400)), sp, vocab_size=1 << 20))
        assert r.tk.manager.queued_demand() >= 400
        code, busy = r.tk.handle("tool_start", {"session_id": "s2", "tool": "grep", "expected_s": 0.2})
        assert code == 200, busy
        outcome = (idle["decision"], busy["decision"], busy["reason"])
    finally:
        stack.close()
    right = ("keep", "offload", "device_pressure_hint")
    assert (outcome == right) is (bug is None), outcome


# ---- (b) a host full of unprotected copies under auto -------------------------------------------------
def fill_host_with_mirrors(h: CacheHarness, need_free: int) -> None:
    """Requests nobody protects, written through to the host and evicted from the device, until
    the host pool has fewer than ``need_free`` free tokens (sglang's own mirrors fill it)."""
    k = 0
    while h.host_pool.available_size() >= need_free:
        k += 1
        assert h.run_request([100_000 * k + i for i in range(256)])
        h.complete("write")
        h.check_events()
        h.evict_device(256)
        assert k < 100, "the host never filled"


@pytest.mark.parametrize("bug", BUGS)
def test_a_host_full_of_unprotected_copies_still_takes_a_long_tool(
    bug: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``write_back``: sglang copies a node to the host only when its eviction would drop it, so
    the session's own KV is not on the host yet (its offload needs host room) while the pool is
    full of other requests' written-back copies, none of them protected."""
    if bug:  # the host's room counted as its free tokens only, not what evict_host can free
        monkeypatch.setattr(
            "toolkv.core.backends.hiradix.HiRadixBackend.host_evictable_tokens", lambda self: 0
        )
    with CacheHarness(HarnessConfig(device_tokens=2048, write_policy="write_back")) as h:
        check_host_full_of_unprotected_copies(h, bug)


def check_host_full_of_unprotected_copies(h: CacheHarness, bug: str | None) -> None:
    m = auto(h, prefetch=False)
    fill_host_with_mirrors(h, 300)
    a = list(range(1, 301))
    turn(h, m, "a", a)
    assert h.match(a).last_device_node.host_value is None, "a's KV is on the GPU only"
    assert h.host_pool.available_size() < 300 and m.backend.protected_tokens == 0  # type: ignore[attr-defined]
    r = m.tool_start("a", expected_s=600.0)
    offloaded = r["decision"] == "offload" and r["state"] in ("Offloading", "Offloaded")
    assert offloaded is (bug is None), r
    if offloaded:
        step(h, m, 0.0, writes=True)
        assert m.kv_meta("a")["protected"] is True
    m.close("a")
    h.drain()


# ---- (c) two demotion candidates: the one back latest goes ------------------------------------------
@pytest.mark.parametrize("bug", BUGS)
def test_of_two_demotion_candidates_the_one_predicted_back_latest_goes(
    h: CacheHarness, bug: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    if bug:  # the order reversed: the session predicted back soonest is demoted first
        from toolkv.core import policy

        real = policy.demotion_order
        monkeypatch.setattr(
            "toolkv.core.session.policy_actions.demotion_order", lambda c, now: real(c, now)[::-1]
        )
    initial = h.accounting()
    m = auto(h, host_budget_tokens=650, prefetch=False)
    late, soon, new = list(range(1, 301)), list(range(1000, 1300)), list(range(5000, 5300))
    for sid, tokens in (("late", late), ("soon", soon), ("new", new)):
        turn(h, m, sid, tokens)
    m.tool_start("late", expected_s=600.0)  # back in 10 minutes
    m.tool_start("soon", expected_s=120.0)  # back in 2
    step(h, m, 0.0, writes=True)
    m.set_clock(1.0)
    m.queued_demand = lambda: 10**6  # queued requests need the device room "new" holds
    r = m.tool_start("new", expected_s=30.0)  # 300 + 600 > 650: one of the two must go
    m.queued_demand = lambda: 0
    assert r["decision"] == "offload" and m.counters["demoted"] == 1
    gone = {s for s in ("late", "soon") if m.kv_meta(s)["state"] == "Released"}
    assert (gone == {"late"}) is (bug is None), gone
    assert {m.kv_meta(s)["state"] for s in {"late", "soon"} - gone} == {"Offloaded"}
    step(h, m, 1.0, writes=True)
    for sid in ("late", "soon", "new"):
        m.close(sid)
    h.drain()
    assert h.accounting() == initial


# ---- (d) an admission while the restore is still loading ------------------------------------------
@pytest.mark.parametrize("bug", BUGS)
def test_an_admission_during_the_load_ends_the_hand_over_at_the_load_ack(
    h: CacheHarness, bug: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    if bug:  # the admission that came while loading is dropped on the floor
        from toolkv.core.session.handover import Handover

        real = Handover.admit

        def forgetful(self: Any, session_id: str) -> bool:
            rec = self.s.sessions.get(session_id)
            if rec is not None and rec.state == "Restoring":
                return False
            return real(self, session_id)

        monkeypatch.setattr(Handover, "admit", forgetful)
    initial = h.accounting()
    m = auto(h, prefetch=False)
    a = list(range(1, 301))
    turn(h, m, "a", a)
    m.tool_start("a", expected_s=600.0)
    step(h, m, 0.0, writes=True)
    assert m.kv_meta("a")["state"] == "Offloaded"
    h.evict_device(10_000)  # the GPU copy is gone: the restore must load it
    m.set_clock(5.0)
    assert m.tool_end("a", 1)["state"] == "Restoring"
    m.tick(5.0)  # the tick starts the queued load
    assert h.pending("load") > 0, "the load is in flight"
    assert m.admit("a") is False  # not yet: the KV is still arriving
    assert m.kv_meta("a")["state"] == "Restoring"
    step(h, m, 5.1, loads=True)  # the load lands
    state = m.kv_meta("a")["state"]
    assert (state == "Runnable") is (bug is None), state
    if bug is None:
        assert locks_on(h, a) == [0] * len(locks_on(h, a)), "the hand-over's pin is returned"
        assert m.counters["admitted"] == 1  # this one (the turn before ended no hand-over)
    m.close("a")
    h.drain()
    assert h.accounting() == initial
