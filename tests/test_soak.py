"""The CPU soak on sglang 0.5.16's REAL caches (``toolkv.tools.soak``): toolkv's scheduler side
and its HTTP routes in one process, agent sessions from the agent workload with tool calls,
hand-overs, abandoned sessions, aborted requests, tool_end racing the next request, lost replies
re-sent, deferred flushes, and (on a plain RadixCache) other requests re-inserting an offloaded
session's branch. Pool occupancy, protected tokens and RSS are sampled and must stay flat after
warm-up; every counter must be back at its initial value at the end; every reused prefix, restored
ones included, must hold its tokens' exact KV bytes.

The 0.5.23 half (``UnifiedRadixCache``) is ``tests/test_soak_0523.py`` (``make test-0523``);
``make soak-long`` runs 100,000 calls per stack and plots them.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from toolkv.core.backends.shadow import ShadowBackend
from toolkv.sglang.cache_hooks import toolkv_cache_hooks
from toolkv.tools.soak import SoakConfig, problems, run_soak
from toolkv.twin.server import Server0516

# 10,000 calls on the HiRadixCache; the fallbacks share the budget (no copies in flight there).
CASES = [("hiradix", 10_000, 200), ("pin", 1_500, 100), ("shadow", 1_500, 100)]


@pytest.mark.parametrize(("stack", "calls", "sessions"), CASES, ids=[c[0] for c in CASES])
def test_soak(stack: str, calls: int, sessions: int) -> None:
    # the short runs flush and expire sooner, so that both happen within them
    short = {"flush_every": calls // 2, "ttl_s": 60.0} if calls < 10_000 else {}
    cfg = SoakConfig(stack=stack, tool_calls=calls, **short)  # type: ignore[arg-type]
    r = run_soak(cfg)
    bad = problems(r, min_calls=calls, min_sessions=sessions)
    summary = (
        f"{stack}: {r.tool_calls} calls, {r.sessions} sessions, {r.iterations} iterations, {r.seconds:.1f}s,"
        f" restores verified {r.restores_verified}, bytes checked {r.bytes_checked:,},"
        f" events {dict(r.events)}, flushes {dict(r.flushes)}, counters {r.counters}"
    )
    assert not bad, "\n".join(bad) + "\n" + summary


@pytest.fixture
def shadow_stack() -> Iterator[Server0516]:
    with toolkv_cache_hooks("radix"):
        stack = Server0516("shadow", device_tokens=512, host_ratio=2.0, context_len=1024)
        try:
            yield stack
        finally:
            stack.close()


def test_shadow_restore_into_a_repopulated_branch_frees_its_duplicate_slots(shadow_stack: Server0516) -> None:
    """While a session's branch is a shadow snapshot on the host, another request computes the same
    tokens and re-inserts the branch. The restore then finds every token already in the tree: the
    slots it allocated for the snapshot are duplicates and must all go back to the allocator."""
    from _faultbench import Bench, Row, record

    b = Bench(shadow_stack)
    try:
        prompt, out = list(range(2000, 2048)), [9001, 9002]
        b.turn("s1", prompt, out)
        tokens = [*prompt, 9001]
        st, body = b.call("tool_start", session_id="s1")
        assert (st, body["state"], body["host_tokens"]) == (200, "Offloaded", 49)
        assert b.stack.match_device(tokens)[0].numel() == 0, "the branch left the tree"
        b.turn(None, tokens, [1])  # another request: the same tokens, freshly computed
        free_before = b.h.allocator.available_size()
        st, body = b.call("tool_end", session_id="s1", epoch=1)
        assert (st, body["state"]) == (200, "Handover")
        assert b.h.allocator.available_size() == free_before, "the restore kept duplicate slots"
        idx, _ = b.stack.match_device(tokens)
        assert len(idx) == 49 and b.stack.verify_prefix(tokens, idx)
        b.turn("s1", [*tokens, 9002, 9003], [9004])
        leaks = b.leaks()
        assert leaks == []
        record(
            Row(
                "0.5.16",
                "shadow",
                "branch re-inserted by another request while offloaded",
                "a request without a session runs the offloaded session's tokens; then `tool_end`",
                f"`tool_end` {st} `Handover`",
                "Handover -> Runnable at the next request; nothing re-inserted twice",
                f"device free slots equal before/after the restore; {b.stack.bytes_checked:,} KV bytes equal",
                "none (every duplicate slot freed)",
                "tests/test_soak.py::test_shadow_restore_into_a_repopulated_branch_frees_its_duplicate_slots",
            )
        )
    finally:
        b.close()


def test_the_soak_notices_a_shadow_restore_that_keeps_its_duplicates(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check has teeth: with the duplicate free taken out of the shadow restore (a seeded
    defect: inside ``restore`` the allocator's ``free`` does nothing), a short soak reports the
    slots as a leak."""
    original = ShadowBackend.restore

    class _NoFree:
        def __init__(self, alloc: Any) -> None:
            self._alloc = alloc

        def free(self, idx: Any) -> None:
            return None

        def __getattr__(self, name: str) -> Any:
            return getattr(self._alloc, name)

    def leaky(self: ShadowBackend, rec: Any) -> bool:
        real = self.allocator
        self.allocator = _NoFree(real)
        try:
            return original(self, rec)
        finally:
            self.allocator = real

    monkeypatch.setattr(ShadowBackend, "restore", leaky)
    r = run_soak(SoakConfig(stack="shadow", tool_calls=300, repopulate_p=0.5, flush_every=10**9))
    assert r.events["repopulated"] > 0
    # the slots either show at the end, or fill the device first and the run stalls
    assert any(x.startswith(("cache accounting", "stalled")) for x in r.leaks), (r.leaks, dict(r.events))


def test_records_of_sessions_never_closed_are_forgotten_after_the_idle_ttl() -> None:
    """Agents that finish without ``close`` (15 % here, and every session of an agent that
    crashed) would leave their record in ``ToolKVManager.sessions`` for good; the idle TTL
    (``TOOLKV_IDLE_TTL_S``, 1 h by default: shortened here to fit the run's simulated time) forgets
    a session that holds nothing and has been silent that long, so the records stay near the live
    population (12) instead of growing with the run (22 left open with the default 1 h)."""
    r = run_soak(SoakConfig(stack="pin", tool_calls=1_500, flush_every=750, ttl_s=60.0, idle_ttl_s=30.0))
    assert r.left_open > r.config["concurrent"] + 5, r.left_open
    # every agent has finished by now: a bounded manager holds a handful of records at most
    assert r.tracked_at_end <= r.config["concurrent"], (r.tracked_at_end, r.left_open)
