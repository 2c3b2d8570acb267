"""The CPU soak and the deferred-flush fault rows on sglang 0.5.23's REAL ``UnifiedRadixCache``
(HiCache, Python tree core): the 0.5.23 half of ``tests/test_soak.py`` and ``tests/test_faults.py``.

Runs in the 0.5.23 environment (``make test-0523``); skips where an older sglang is installed.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from toolkv.testing.unified_harness import has_unified_radix_cache, sglang_version

if not has_unified_radix_cache():
    pytest.skip(
        f"needs sglang >= 0.5.21 (UnifiedRadixCache), found {sglang_version()}", allow_module_level=True
    )

from _faultbench import Bench, Row, record

from toolkv.sglang.cache_hooks import toolkv_cache_hooks
from toolkv.tools.soak import SoakConfig, problems, run_soak
from toolkv.twin.server import Server0523

R = "0.5.23"
PROMPT = list(range(1000, 1064))
OUT = [5001, 5002, 5003]
TURN = [*PROMPT, *OUT[:-1]]


# UnifiedRadixCache costs about three times HiRadixCache per tool call on CPU (sglang's own
# checkpoint insert alone ~2.7 ms a turn), so 10,000 calls would take this file past the CI
# budget of both releases together; 5,000 calls over 200+ sessions here, 10,000 on 0.5.16 in
# tests/test_soak.py, and `make soak-long` runs 100,000 on each.
CALLS = 5_000


def test_soak_unified() -> None:
    r = run_soak(SoakConfig(stack="unified", tool_calls=CALLS, flush_every=CALLS // 2))
    bad = problems(r, min_calls=CALLS, min_sessions=200)
    summary = (
        f"unified: {r.tool_calls} calls, {r.sessions} sessions, {r.iterations} iterations, {r.seconds:.1f}s,"
        f" restores verified {r.restores_verified}, bytes checked {r.bytes_checked:,},"
        f" events {dict(r.events)}, flushes {dict(r.flushes)}, counters {r.counters}"
    )
    assert not bad, "\n".join(bad) + "\n" + summary


@pytest.fixture
def bench() -> Iterator[Bench]:
    with toolkv_cache_hooks("unified"):
        stack = Server0523(device_tokens=512, host_ratio=2.0, context_len=1024)
        b = Bench(stack)
        try:
            yield b
        finally:
            b.close()
            stack.close()


def _writes_retired(b: Bench) -> None:
    b.iteration()  # check_hicache_events submits the queued backup
    b.iteration(writes=True)  # the copy engine finishes it
    b.iteration()  # check_hicache_events retires the ack, after toolkv's tick


def test_deferred_flush_after_the_last_write_ack_marks_the_session_lost(bench: Bench) -> None:
    b = bench
    b.turn("s1", PROMPT, OUT)
    st, body = b.call("tool_start", session_id="s1")
    assert (st, body["state"]) == (200, "Offloading")
    assert b.sched.request_flush(timeout_s=30.0) is None, "a write is pending: deferred"
    _writes_retired(b)
    assert b.h.tree.ongoing_write_through == {} and b.meta("s1")["state"] == "Offloading"
    b.iteration()  # check_pending flushes before toolkv's tick
    assert [o.success for o in b.sched.flush_replies.sent] == [True]
    assert b.errors == [], b.errors
    assert b.meta("s1")["state"] == "Lost" and b.tk.manager.counters["reset_mid_copy"] == 0
    st, body = b.call("tool_end", session_id="s1", epoch=1)
    assert (st, body["error"]) == (409, "wrong_state")
    b.turn("s1", [*TURN, OUT[-1], 6000], [6001, 6002])
    tokens = [*TURN, OUT[-1], 6000, 6001]
    idx, _ = b.stack.match_device(tokens)
    assert len(idx) == len(tokens) and b.stack.verify_prefix(tokens, idx)
    assert b.leaks() == []
    record(
        Row(
            R,
            "unified",
            "flush deferred over an offload (write retired, not yet ticked)",
            "`/flush_cache?timeout=30` while Offloading; the backup is submitted, finishes, and "
            "`check_hicache_events` retires it; `check_pending()` flushes before toolkv's tick",
            f"flush `success=True`; `tool_end` {st} `wrong_state` (`Lost`)",
            "Lost (was: Closed, ERROR); next turn recomputes -> Running",
            f"{b.stack.bytes_checked:,} KV bytes of the recomputed turn equal",
            "none",
            "tests/test_soak_0523.py::test_deferred_flush_after_the_last_write_ack_marks_the_session_lost",
        )
    )


def test_deferred_flush_after_the_load_ack_hands_the_session_over(bench: Bench) -> None:
    b = bench
    b.turn("s1", PROMPT, OUT)
    b.call("tool_start", session_id="s1")
    _writes_retired(b)
    b.iteration()
    assert b.meta("s1")["state"] == "Offloaded"
    st, body = b.call("tool_end", session_id="s1", epoch=1)
    assert (st, body["state"]) == (200, "Restoring")
    assert b.sched.request_flush(timeout_s=30.0) is None, "a load is pending: deferred"
    b.iteration(loads=True)  # the tick starts the load; the copy engine finishes it
    b.iteration()  # check_hicache_events retires the load ack after toolkv's tick
    assert b.meta("s1")["state"] == "Restoring"
    b.iteration()  # check_pending flushes before the tick
    assert [o.success for o in b.sched.flush_replies.sent] == [True]
    assert b.errors == [], b.errors
    m = b.tk.manager
    assert b.meta("s1")["state"] == "Lost"
    assert (m.counters["reset_mid_copy"], m.counters["handover"]) == (0, 1)
    assert b.leaks() == []
    record(
        Row(
            R,
            "unified",
            "flush deferred over a restore (load retired, not yet ticked)",
            "`/flush_cache?timeout=30` while Restoring; the load finishes and is retired; "
            "`check_pending()` flushes before toolkv's tick",
            "flush `success=True`",
            "LoadAck -> Handover, then TreeReset -> Lost (was: Closed, ERROR)",
            "tokens: device and host pools back to their initial free counts",
            "none",
            "tests/test_soak_0523.py::test_deferred_flush_after_the_load_ack_hands_the_session_over",
        )
    )
