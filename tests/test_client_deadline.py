"""``tool_call``'s deadline (issue 36, item 3): a scheduler that does not answer must not hold an
agent. Before it, one ``tool_call`` made three ``tool_start`` attempts and three ``kv_meta`` checks,
each waiting up to ``TOOLKV_REPLY_TIMEOUT_S`` (30 s), before the tool ran.

Against real server sockets, never a mocked transport: a listening socket that accepts and never
answers; toolkv's real HTTP app under uvicorn over the real scheduler side and HiRadixCache, with a
scheduler channel that stops answering some operations (the HTTP side then waits its reply timeout
before it answers 504); and a socket that sends its answer a byte at a time. The elapsed time is
asserted as an upper bound because the bound is the feature: each case would otherwise take 30 s
or more (the clients here are built with ``timeout_s=60``).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import uvicorn
from _turns import finish_turn

from toolkv.client import (
    AsyncToolKVClient,
    DeadlineExceeded,
    NoReply,
    RetryPolicy,
    ToolKVClient,
)
from toolkv.sglang.http_api import ChannelTransport, build_app
from toolkv.sglang.ipc import ToolKVReqInput
from toolkv.sglang.scheduler_side import SchedulerToolKV
from toolkv.testing.harness import CacheHarness, HarnessConfig

DEADLINE_S = 1.0
# what the bound may overshoot by on a loaded 2-core machine: far below the 30-60 s without it
SLACK_S = 1.0
PROMPT = list(range(1, 65))


# ---- servers -------------------------------------------------------------------------------------
class SilentServer:
    """A listening socket whose thread accepts every connection and never reads or writes."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.1)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.accepted: list[socket.socket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(TimeoutError):
                conn, _ = self.sock.accept()
                self.accepted.append(conn)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        for c in self.accepted:
            c.close()
        self.sock.close()


class TrickleServer(SilentServer):
    """Answers every request with a status line and headers sent one byte every 50 ms, forever
    (a read never times out: bytes keep coming)."""

    HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n" + b"X-Pad: " + b"a" * 10_000

    def _serve(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(TimeoutError):
                conn, _ = self.sock.accept()
                self.accepted.append(conn)
                threading.Thread(target=self._trickle, args=(conn,), daemon=True).start()

    def _trickle(self, conn: socket.socket) -> None:
        with contextlib.suppress(OSError):
            conn.recv(65536)
            for b in self.HEAD:
                if self._stop.wait(0.05):
                    return
                conn.sendall(bytes([b]))


class StallingChannel(ChannelTransport):
    """sglang's tokenizer-manager -> scheduler channel with the real scheduler side behind it,
    in-process; an operation in ``stalled`` reaches nobody, as when the scheduler is stuck, so the
    HTTP side waits ``timeout_s`` and answers 504 ``scheduler_timeout``."""

    def __init__(self, tk: SchedulerToolKV, timeout_s: float) -> None:
        super().__init__(timeout_s=timeout_s)
        self.tk = tk
        self.stalled: set[str] = set()
        self.seen: list[str] = []

    def _send(self, req: ToolKVReqInput) -> None:
        self.seen.append(req.op)
        if req.op in self.stalled:
            return
        out = self.tk.ipc_handler(req)
        self.tk.tick()
        asyncio.get_running_loop().call_soon(self.replies.resolve, out)


class LiveApp:
    """toolkv's HTTP app served by uvicorn on a real port, in a thread."""

    def __init__(self, channel: StallingChannel) -> None:
        config = uvicorn.Config(
            build_app(channel),
            host="127.0.0.1",
            port=0,
            log_level="warning",
            timeout_graceful_shutdown=1,
            loop="asyncio",  # not "auto": a test double may stand in for uvloop (test_session_header.py)
        )
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self.server.run, daemon=True)
        self._thread.start()
        t0 = time.monotonic()
        while not self.server.started:
            assert time.monotonic() - t0 < 30, "uvicorn did not start"
            time.sleep(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"

    def close(self) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=10)


@pytest.fixture
def silent() -> Iterator[SilentServer]:
    s = SilentServer()
    yield s
    s.close()


@pytest.fixture
def live() -> Iterator[tuple[LiveApp, StallingChannel]]:
    with CacheHarness(HarnessConfig()) as h:
        tk = SchedulerToolKV(h.tree)
        h.tree._toolkv = tk
        assert finish_turn(h, "s1", PROMPT, [65, 66])
        channel = StallingChannel(tk, timeout_s=30.0)  # TOOLKV_REPLY_TIMEOUT_S's default
        app = LiveApp(channel)
        yield app, channel
        app.close()


# ---- a server that never answers -----------------------------------------------------------------
def test_tool_call_runs_the_tool_when_the_server_never_answers(silent: SilentServer) -> None:
    ran = False
    t0 = time.monotonic()
    kv = ToolKVClient(silent.url, timeout_s=60, tool_call_deadline_s=DEADLINE_S)
    with kv, kv.tool_call("s1", tool="search") as call:
        ran = True
    elapsed = time.monotonic() - t0
    assert ran and elapsed < DEADLINE_S + SLACK_S, elapsed
    assert silent.accepted, "the call reached the server"
    assert (call.start_outcome, call.end_outcome) == ("deadline_exceeded", "not_sent")
    assert call.deadline_exceeded and call.start is None and call.end is None
    (err,) = call.failures
    assert isinstance(err, DeadlineExceeded) and err.applied_unknown  # sent: it may still apply
    assert isinstance(err.__cause__, NoReply)


def test_async_tool_call_runs_the_tool_when_the_server_never_answers(silent: SilentServer) -> None:
    async def run() -> tuple[bool, Any, float]:
        ran = False
        t0 = time.monotonic()
        kv = AsyncToolKVClient(silent.url, timeout_s=60)
        async with kv, kv.tool_call("s1", tool="search", deadline_s=DEADLINE_S) as call:
            ran = True
        return ran, call, time.monotonic() - t0

    ran, call, elapsed = asyncio.run(run())
    assert ran and elapsed < DEADLINE_S + SLACK_S, elapsed
    assert call.start_outcome == "deadline_exceeded" and call.deadline_s == DEADLINE_S
    assert isinstance(call.failures[0], DeadlineExceeded)


def test_async_deadline_holds_against_an_answer_that_trickles() -> None:
    """Every read gets a byte, so no per-read timeout ever fires: only the overall deadline ends it."""
    server = TrickleServer()
    try:

        async def run() -> tuple[Any, float]:
            t0 = time.monotonic()
            kv = AsyncToolKVClient(server.url, timeout_s=60, tool_call_deadline_s=DEADLINE_S)
            async with kv, kv.tool_call("s1") as call:
                pass
            return call, time.monotonic() - t0

        call, elapsed = asyncio.run(run())
    finally:
        server.close()
    assert elapsed < DEADLINE_S + SLACK_S, elapsed
    assert call.start_outcome == "deadline_exceeded"


# ---- toolkv's app with a scheduler that stops answering -------------------------------------------
def test_attempts_and_kv_meta_checks_share_one_deadline(live: tuple[LiveApp, StallingChannel]) -> None:
    """The scheduler answers neither tool_start nor kv_meta, and the HTTP side answers 504 after
    0.4 s: three attempts, their checks and the back-off would take 2.7 s; the deadline ends them
    at 1 s."""
    app, channel = live
    channel.timeout_s = 0.4
    channel.stalled |= {"tool_start", "kv_meta"}
    t0 = time.monotonic()
    with ToolKVClient(app.url, timeout_s=60) as kv, kv.tool_call("s1", deadline_s=DEADLINE_S) as call:
        ran = True
    elapsed = time.monotonic() - t0
    assert ran and elapsed < DEADLINE_S + SLACK_S, elapsed
    assert channel.seen[:2] == ["tool_start", "kv_meta"], channel.seen  # the check after the 504 ran
    assert call.start_outcome == "deadline_exceeded" and call.end_outcome == "not_sent"


def test_a_back_off_longer_than_the_time_left_is_not_waited(live: tuple[LiveApp, StallingChannel]) -> None:
    """After the 504 and a kv_meta check that shows nothing applied, the next attempt would come
    after a 30 s back-off: the call gives up at once instead of sleeping into the deadline."""
    app, channel = live
    channel.timeout_s = 0.2
    channel.stalled.add("tool_start")
    slept: list[float] = []
    patient = RetryPolicy(backoff_s=30.0, max_backoff_s=30.0)
    kv = ToolKVClient(app.url, timeout_s=60, retry=patient, sleep=slept.append)
    with kv, kv.tool_call("s1", deadline_s=5.0) as call:
        pass
    assert slept == [] and channel.seen == ["tool_start", "kv_meta"]
    assert call.start_outcome == "deadline_exceeded"
    err = call.failures[0]
    assert isinstance(err, DeadlineExceeded) and err.applied_unknown and err.details["attempts"] == 1


def test_tool_end_that_gets_no_answer_ends_at_the_deadline(live: tuple[LiveApp, StallingChannel]) -> None:
    """tool_start is answered (the session offloads); the scheduler then stops answering tool_end:
    leaving the block waits at most the deadline, and the session is left to its next request."""
    app, channel = live
    with ToolKVClient(app.url, timeout_s=60, tool_call_deadline_s=DEADLINE_S) as kv:
        with kv.tool_call("s1", tool="search") as call:
            assert call.start is not None and call.start_outcome == "accepted"
            channel.stalled.add("tool_end")
            t0 = time.monotonic()
        elapsed = time.monotonic() - t0
    assert elapsed < DEADLINE_S + SLACK_S, elapsed
    assert call.start.state == "Offloading" and call.end is None
    assert call.end_outcome == "deadline_exceeded" and isinstance(call.failures[0], DeadlineExceeded)


def test_an_answered_call_reports_accepted_on_both_sides(live: tuple[LiveApp, StallingChannel]) -> None:
    app, _ = live

    async def run() -> Any:
        async with AsyncToolKVClient(app.url) as kv, kv.tool_call("s1", tool="search") as call:
            pass
        return call

    call = asyncio.run(run())
    assert (call.start_outcome, call.end_outcome) == ("accepted", "accepted") and not call.deadline_exceeded
    assert call.end is not None and call.failures == []


# ---- the setting ---------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [0, -1.0, float("inf"), float("nan"), True])
def test_a_deadline_must_be_a_positive_number_of_seconds(bad: Any) -> None:
    with pytest.raises(ValueError, match="deadline"):
        ToolKVClient("http://127.0.0.1:9", tool_call_deadline_s=bad)
    with pytest.raises(ValueError, match="deadline"):
        AsyncToolKVClient("http://127.0.0.1:9", tool_call_deadline_s=bad)
    with ToolKVClient("http://127.0.0.1:9") as kv:
        assert kv.tool_call_deadline_s == 5.0
        with pytest.raises(ValueError, match="deadline"), kv.tool_call("s1", deadline_s=bad):
            pass
