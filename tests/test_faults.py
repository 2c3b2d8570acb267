"""The CPU fault table on sglang 0.5.16's REAL caches: each test injects one fault, checks what the
client saw over toolkv's HTTP routes, the session's state after, the bytes and tokens, and that
every counter returns to its initial value; each one is also a row of the generated table in
``docs/reliability.md`` (``tests/test_docs_reliability.py`` checks the table against the rows).

The first two are the reproduction of a defect: sglang runs a deferred ``/flush_cache?timeout=T``
in ``check_pending()`` at the end of ``process_input_requests`` -- after its ack check retired a
session's last write or load in the previous iteration, but before toolkv's tick (the AFTER hook of
``process_input_requests``) processed it. toolkv used to close such a session (``Closed``, an ERROR
line, ``reset_mid_copy``); the spec's order is WriteAck/LoadAck, then TreeReset.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from _faultbench import Bench, Row, record

from toolkv.testing.soak import Stack0516, toolkv_cache_hooks

R = "0.5.16"
PROMPT = list(range(1000, 1064))
OUT = [5001, 5002, 5003]
TURN = PROMPT + OUT[:-1]  # the tokens with KV after the first turn


@pytest.fixture
def bench(request: pytest.FixtureRequest) -> Iterator[Bench]:
    kind = getattr(request, "param", "hiradix")
    with toolkv_cache_hooks("radix"):
        stack = Stack0516(kind, device_tokens=512, host_ratio=2.0, context_len=1024)
        b = Bench(stack)
        try:
            yield b
        finally:
            b.close()
            stack.close()


def _kv_bytes(b: Bench, tokens: list[int]) -> int:
    """Check the session's device KV byte for byte; returns the bytes compared."""
    before = b.stack.bytes_checked, b.stack.byte_mismatches
    idx, _ = b.stack.match_device(tokens)
    assert len(idx) == len(tokens), f"only {len(idx)} of {len(tokens)} tokens are on the device"
    assert b.stack.verify_prefix(tokens, idx), "the device KV differs from the turn's KV"
    assert b.stack.byte_mismatches == before[1]
    return b.stack.bytes_checked - before[0]


# ---- the deferred flush between sglang's ack check and toolkv's tick --------------------------------
def test_deferred_flush_after_the_last_write_ack_marks_the_session_lost(bench: Bench) -> None:
    b = bench
    b.turn("s1", PROMPT, OUT)
    st, body = b.call("tool_start", session_id="s1")
    assert (st, body["state"]) == (200, "Offloading")
    assert b.sched.request_flush(timeout_s=30.0) is None, "not idle (a write is pending): deferred"
    b.iteration(writes=True)  # the copy engine finishes the write
    b.iteration()  # sglang's writing_check retires the ack; toolkv's tick came before it
    assert b.h.tree.ongoing_write_through == {} and b.meta("s1")["state"] == "Offloading"
    b.iteration()  # check_pending: idle -> flush_cache -> reset -> toolkv's hook, then the tick
    assert [o.success for o in b.sched.flush_replies.sent] == [True]
    meta = b.meta("s1")
    counters = b.tk.manager.counters
    assert b.errors == [], b.errors
    assert meta["state"] == "Lost", meta
    assert counters["reset_mid_copy"] == 0 and counters["lost"] == 1
    st, body = b.call("tool_end", session_id="s1", epoch=1)
    assert (st, body["error"], body["state"]) == (409, "wrong_state", "Lost")
    # the next turn recomputes: the session runs again on freshly computed, correct KV
    b.turn("s1", [*TURN, OUT[-1], 6000, 6001], [6002, 6003])
    assert b.meta("s1")["state"] == "Running"
    checked = _kv_bytes(b, [*TURN, OUT[-1], 6000, 6001, 6002])
    leaks = b.leaks()
    assert leaks == []
    record(
        Row(
            R,
            "hiradix",
            "flush deferred over an offload (write retired, not yet ticked)",
            "`/flush_cache?timeout=30` asked while Offloading; the write finishes; sglang's "
            "`writing_check` retires the ack; `check_pending()` flushes before toolkv's tick",
            f"flush `success=True`; `tool_end` {st} `wrong_state` (`Lost`)",
            "Lost (was: Closed, ERROR, `reset_mid_copy=1`); next turn recomputes -> Running",
            f"{checked:,} KV bytes of the recomputed turn equal",
            "none",
            "tests/test_faults.py::test_deferred_flush_after_the_last_write_ack_marks_the_session_lost",
        ),
    )


def test_deferred_flush_after_the_load_ack_hands_the_session_over(bench: Bench) -> None:
    b = bench
    b.turn("s1", PROMPT, OUT)
    b.call("tool_start", session_id="s1")
    b.iteration(writes=True)
    b.iteration()
    b.iteration()
    assert b.meta("s1")["state"] == "Offloaded"
    st, body = b.call("tool_end", session_id="s1", epoch=1)
    assert (st, body["state"]) == (200, "Restoring")
    assert b.sched.request_flush(timeout_s=30.0) is None, "not idle (a load is pending): deferred"
    b.iteration(loads=True)  # the tick starts the load; the copy engine finishes it
    b.iteration()  # sglang's loading_check retires the ack after toolkv's tick
    assert b.h.tree.ongoing_load_back == {} and b.meta("s1")["state"] == "Restoring"
    b.iteration()  # check_pending flushes before the tick
    assert [o.success for o in b.sched.flush_replies.sent] == [True]
    assert b.errors == [], b.errors
    m = b.tk.manager
    # spec: LoadAck (-> Handover), then TreeReset (a handed-over session's KV and pin went with the tree)
    assert b.meta("s1")["state"] == "Lost"
    assert (m.counters["reset_mid_copy"], m.counters["handover"], m.counters["lost"]) == (0, 1, 1)
    b.turn("s1", [*TURN, OUT[-1], 7000], [7001, 7002])
    checked = _kv_bytes(b, [*TURN, OUT[-1], 7000, 7001])
    assert b.leaks() == []
    record(
        Row(
            R,
            "hiradix",
            "flush deferred over a restore (load retired, not yet ticked)",
            "`/flush_cache?timeout=30` asked while Restoring; the load finishes; `loading_check` "
            "retires it; `check_pending()` flushes before toolkv's tick",
            "flush `success=True`; the next request is served (recomputed)",
            "LoadAck -> Handover, then TreeReset -> Lost (was: Closed, ERROR); next turn -> Running",
            f"{checked:,} KV bytes of the recomputed turn equal",
            "none",
            "tests/test_faults.py::test_deferred_flush_after_the_load_ack_hands_the_session_over",
        ),
    )


def test_deferred_flush_after_a_load_whose_request_was_admitted_is_runnable(bench: Bench) -> None:
    """The session's next request was admitted while its load ran (the hand-over is then due at
    the load ack): LoadAck, Admit, TreeReset leaves it Runnable."""
    b = bench
    b.turn("s1", PROMPT, OUT)
    b.call("tool_start", session_id="s1")
    b.settle(3)
    b.call("tool_end", session_id="s1", epoch=1)
    assert b.tk.manager.admitted("s1") is False  # admitted while Restoring: ends at the load ack
    assert b.sched.request_flush(timeout_s=30.0) is None
    b.iteration(loads=True)
    b.iteration()
    b.iteration()
    assert b.errors == [] and b.meta("s1")["state"] == "Runnable"
    assert b.tk.manager.counters["admitted"] == 1
    assert b.leaks() == []
