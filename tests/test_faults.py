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

from toolkv.sglang.cache_hooks import toolkv_cache_hooks
from toolkv.twin.server import Server0516

R = "0.5.16"
PROMPT = list(range(1000, 1064))
OUT = [5001, 5002, 5003]
TURN = PROMPT + OUT[:-1]  # the tokens with KV after the first turn


@pytest.fixture
def bench(request: pytest.FixtureRequest) -> Iterator[Bench]:
    kind = getattr(request, "param", "hiradix")
    with toolkv_cache_hooks("radix"):
        stack = Server0516(kind, device_tokens=512, host_ratio=2.0, context_len=1024)
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
    assert b.tk.manager.admit("s1") is False  # admitted while Restoring: ends at the load ack
    assert b.sched.request_flush(timeout_s=30.0) is None
    b.iteration(loads=True)
    b.iteration()
    b.iteration()
    assert b.errors == [] and b.meta("s1")["state"] == "Runnable"
    assert b.tk.manager.counters["admitted"] == 1
    assert b.leaks() == []


# ---- the rest of the CPU fault table --------------------------------------------------------------
def _offloaded(b: Bench, sid: str = "s1", prompt: list[int] = PROMPT) -> int:
    """A turn of ``sid`` and its tool_start, writes acknowledged; returns the epoch."""
    b.turn(sid, prompt, OUT)
    st, body = b.call("tool_start", session_id=sid)
    assert st == 200, body
    b.settle(3)
    assert b.meta(sid)["state"] == "Offloaded"
    return int(body["epoch"])


def test_client_disconnect_while_offloading_then_the_resent_call_is_replayed(bench: Bench) -> None:
    b = bench
    b.turn("s1", PROMPT, OUT)
    b.tk.handle("tool_start", {"session_id": "s1"})  # applied; the reply never reached the client
    assert b.meta("s1")["state"] == "Offloading"
    st, body = b.call("tool_start", session_id="s1", prior_epoch=0)  # re-sent after reconnecting
    assert (st, body["replayed"], body["epoch"]) == (200, True, 1)
    assert b.tk.manager.counters["tool_start"] == 1, "the re-sent call changed nothing"
    b.settle(3)
    st2, body2 = b.call("tool_end", session_id="s1", epoch=1)
    assert (st2, body2["state"]) == (200, "Restoring")
    b.settle(3)
    assert b.meta("s1")["state"] == "Handover"
    checked = _kv_bytes(b, TURN)
    assert b.leaks() == []
    record(
        Row(
            R,
            "hiradix",
            "client disconnect while Offloading",
            "`tool_start` applied, its reply dropped; the client re-sends it with `prior_epoch=0`",
            f"re-send {st} `replayed: true`, epoch 1; `tool_end` {st2} `Restoring`",
            "Offloading -> Offloaded -> Restoring -> Handover; one tool call counted",
            f"{checked:,} restored KV bytes equal",
            "none",
            "tests/test_faults.py::test_client_disconnect_while_offloading_then_the_resent_call_is_replayed",
        )
    )


def test_request_aborted_while_restoring_ends_the_handover_by_its_ttl(bench: Bench) -> None:
    b = bench
    epoch = _offloaded(b)
    b.call("tool_end", session_id="s1", epoch=epoch)
    # the next request arrives (toolkv's BEFORE hook sees it) and is aborted before admission
    from types import SimpleNamespace

    from toolkv.sglang.plugin import before_handle_generate_request

    before_handle_generate_request(b.sched, SimpleNamespace(session_id="s1", session_params=None))
    b.settle(3)
    assert b.meta("s1")["state"] == "Handover", "restored and pinned, waiting for a request that is gone"
    assert b.h.tree.protected_size() == len(TURN), "the hand-over pin holds the path"
    for _ in range(60):  # the hand-over TTL (5 s) passes
        b.iteration(dt=0.1)
    assert b.meta("s1")["state"] == "Runnable" and b.h.tree.protected_size() == 0
    assert b.tk.manager.counters["handover_expired"] == 1
    b.turn("s1", [*TURN, OUT[-1], 42], [43, 44])  # the agent's retry: a full prefix hit
    checked = _kv_bytes(b, [*TURN, OUT[-1], 42, 43])
    assert b.leaks() == []
    record(
        Row(
            R,
            "hiradix",
            "request abort while Restoring",
            "`tool_end` (Restoring); the next request reaches the scheduler and is aborted before admission",
            "the request: aborted; a retry is served from cache",
            "Handover (pinned) -> Runnable at the hand-over TTL; the pin is returned",
            f"{len(TURN)} tokens pinned then 0 locked; {checked:,} KV bytes of the retry equal",
            "none",
            "tests/test_faults.py::test_request_aborted_while_restoring_ends_the_handover_by_its_ttl",
        )
    )


def test_request_aborted_while_offloading_cancels_the_offload(bench: Bench) -> None:
    b = bench
    b.turn("s1", PROMPT, OUT)
    b.call("tool_start", session_id="s1")
    from types import SimpleNamespace

    from toolkv.sglang.plugin import before_handle_generate_request

    # the next request arrives while the write is in flight: it is the tool's end (restore on request)
    before_handle_generate_request(b.sched, SimpleNamespace(session_id="s1", session_params=None))
    state = b.meta("s1")["state"]
    assert state == "Handover", "nothing was freed yet: handed over in place"
    st, body = b.call("tool_end", session_id="s1", epoch=1)  # the client's own tool_end, late
    assert (st, body["error"]) == (409, "wrong_state")
    for _ in range(60):  # the request was aborted: the hand-over TTL returns the pin
        b.iteration(writes=True, dt=0.1)
    assert b.meta("s1")["state"] == "Runnable" and b.h.tree.protected_size() == 0
    checked = _kv_bytes(b, TURN)
    assert b.leaks() == []
    record(
        Row(
            R,
            "hiradix",
            "request abort while Offloading",
            "`tool_start` (write in flight); the next request arrives (restore on request) and is aborted",
            f"late `tool_end` {st} `wrong_state`; the request: aborted",
            "Offloading -> Handover (nothing freed) -> Runnable at the hand-over TTL",
            f"the KV never left the device: {checked:,} bytes equal",
            "none",
            "tests/test_faults.py::test_request_aborted_while_offloading_cancels_the_offload",
        )
    )


def test_tool_end_racing_the_next_request(bench: Bench) -> None:
    b = bench
    epoch = _offloaded(b)
    run = b.admit("s1", [*TURN, OUT[-1], 77], [78, 79])  # the request wins: restore on request
    assert run is not None
    st, body = b.call("tool_end", session_id="s1", epoch=epoch)  # the agent's tool_end, second
    assert (st, body["error"]) == (409, "wrong_state")
    b.stack.finish(run)
    b.settle(3)
    assert b.meta("s1")["state"] == "Running"
    checked = _kv_bytes(b, [*TURN, OUT[-1], 77, 78])
    assert b.leaks() == []
    record(
        Row(
            R,
            "hiradix",
            "tool_end racing the next request",
            "the next request reaches the scheduler before the agent's `tool_end`",
            f"the request is served; `tool_end` {st} `wrong_state` (already restored)",
            "Offloaded -> Handover (restore on request) -> Runnable (admitted) -> Running",
            f"{checked:,} KV bytes the request reused and computed equal",
            "none",
            "tests/test_faults.py::test_tool_end_racing_the_next_request",
        )
    )


@pytest.fixture
def small_host() -> Iterator[Bench]:
    with toolkv_cache_hooks("radix"):
        stack = Server0516("hiradix", device_tokens=512, host_ratio=1.0, context_len=1024)
        b = Bench(stack)
        try:
            yield b
        finally:
            b.close()
            stack.close()


def test_host_pool_filling_during_an_offload_is_a_507_that_changes_nothing(small_host: Bench) -> None:
    b = small_host
    sids = [f"s{i}" for i in range(8)]
    refused: tuple[str, dict[str, object]] | None = None
    for i, sid in enumerate(sids):
        b.turn(sid, [10_000 * (i + 1) + t for t in range(120)], [1, 2])
        before = (b.h.allocator.available_size(), b.h.host_pool.available_size(), b.meta(sid)["state"])
        # every session already offloaded is expected back before this one: none may be demoted
        # for it (a newcomer expected back sooner would demote the latest-back instead of a 507)
        st, body = b.call("tool_start", session_id=sid, expected_s=10.0 * (i + 1))
        if st != 200:
            refused = (sid, body)
            assert st == 507 and body["error"] == "host_memory_full", body
            after = (b.h.allocator.available_size(), b.h.host_pool.available_size(), b.meta(sid)["state"])
            assert after == before == (before[0], before[1], "Running"), "a refusal changes nothing"
            break
        b.settle(3)
    assert refused is not None, "the host pool never filled"
    sid, body = refused
    held = b.tk.manager.backend.protected_tokens  # type: ignore[attr-defined]
    assert held <= b.h.host_pool.size
    assert b.leaks() == []
    record(
        Row(
            R,
            "hiradix",
            "host pool filling during an offload",
            "sessions offloaded into a host pool the size of the device pool until it is full of "
            "protected copies, each expected back before the next",
            f"`tool_start` 507 `host_memory_full` (need {body.get('need_tokens')}, free {body.get('host_free_tokens')})",
            "Running, its KV on the device; the others stay Offloaded",
            f"device and host free counts unchanged by the refusal; {held} tokens protected",
            "none",
            "tests/test_faults.py::test_host_pool_filling_during_an_offload_is_a_507_that_changes_nothing",
        )
    )


def test_restore_while_locked_requests_hold_the_device_pool(bench: Bench) -> None:
    b = bench
    epoch = _offloaded(b)
    hog = b.admit(None, [50_000 + t for t in range(470)], [1])  # a running request holds the pool
    assert hog is not None
    before = b.stack.accounting()
    st, body = b.call("tool_end", session_id="s1", epoch=epoch)
    assert (st, body["state"]) == (200, "Parked"), body  # its request would wait: nothing loaded
    meta = b.meta("s1")
    assert meta["protected"] is True and b.stack.accounting() == before, "protected, nothing loaded or pinned"
    b.stack.finish(hog)  # the request finishes and unlocks
    b.settle(3)  # its write-through is acknowledged: its KV is evictable
    run = b.admit("s1", [*TURN, OUT[-1], 77], [78, 79])  # the next turn: sglang's load_back brings it in
    assert run is not None
    b.settle(3)
    state = b.meta("s1")["state"]
    b.stack.finish(run)
    b.settle(3)
    checked = _kv_bytes(b, [*TURN, OUT[-1], 77, 78])
    assert b.leaks() == []
    record(
        Row(
            R,
            "hiradix",
            "restore while locked requests hold the device pool",
            "a running request locks 470 of 512 device slots; then `tool_end`",
            f"`tool_end` {st} `{body['state']}` (nothing loaded or pinned); the next request loads it back",
            f"Parked and protected until the next request is admitted; then {state}",
            f"nothing evicted by the park; {checked:,} KV bytes of the next turn equal",
            "none",
            "tests/test_faults.py::test_restore_while_locked_requests_hold_the_device_pool",
        )
    )


def test_flush_under_load_waits_for_the_requests_then_loses_held_kv(bench: Bench) -> None:
    b = bench
    _offloaded(b, "s1")
    b.turn("s2", [3000 + t for t in range(40)], [1, 2])
    run = b.admit(None, [60_000 + t for t in range(100)], [1])  # a request is running
    assert run is not None
    assert b.sched.request_flush(timeout_s=30.0) is None, "not idle: deferred"
    b.iteration()
    assert b.sched.flush_replies.sent == [] and b.meta("s1")["state"] == "Offloaded"
    b.stack.finish(run)
    b.iteration(writes=True)
    b.iteration()
    b.iteration()
    assert [o.success for o in b.sched.flush_replies.sent] == [True]
    assert b.errors == []
    assert (b.meta("s1")["state"], b.meta("s2")["state"]) == ("Lost", "Running")
    st, body = b.call("tool_start", session_id="s2")  # its node went with the tree
    assert (st, body["error"]) == (409, "kv_lost")
    assert b.h.allocator.available_size() == b.h.allocator.size
    assert b.leaks() == []
    record(
        Row(
            R,
            "hiradix",
            "flush under load",
            "`/flush_cache?timeout=30` while a request runs and a session is Offloaded",
            f"flush deferred, then `success=True` once the request finished; `tool_start` {st} `kv_lost`",
            "Offloaded -> Lost; Running stays Running (its next turn recomputes)",
            "device pool entirely free after the flush; host protection ledger 0",
            "none",
            "tests/test_faults.py::test_flush_under_load_waits_for_the_requests_then_loses_held_kv",
        )
    )


def test_ttl_under_load_releases_an_abandoned_session(bench: Bench) -> None:
    b = bench
    epoch = _offloaded(b, "s1")  # the agent is gone: no tool_end will come
    host_protected = b.tk.manager.backend.protected_tokens  # type: ignore[attr-defined]
    assert host_protected == len(TURN)
    for i in range(700):  # 70 s of other requests (TTL 60 s)
        b.turn(None, [70_000 + 100 * (i % 20) + t for t in range(30)], [1])
        b.iteration(writes=True, dt=0.1)
    assert b.meta("s1")["state"] == "Expired"
    assert b.tk.manager.backend.protected_tokens == 0  # type: ignore[attr-defined]
    st, body = b.call("tool_end", session_id="s1", epoch=epoch)
    assert (st, body["error"]) == (409, "wrong_state")
    assert b.leaks() == []
    record(
        Row(
            R,
            "hiradix",
            "TTL under load",
            "a session Offloaded and abandoned while other requests run every iteration for 70 s (TTL 60 s)",
            f"a late `tool_end` {st} `wrong_state` (`Expired`)",
            "Offloaded -> Expired at the TTL; its host copy is evictable again",
            f"protected host tokens {host_protected} -> 0",
            "none",
            "tests/test_faults.py::test_ttl_under_load_releases_an_abandoned_session",
        )
    )
