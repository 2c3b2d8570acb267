"""The client's failure handling (issue: a refusal must not stall or break the agent).

Over the real HTTP app and scheduler side on the real HiRadixCache (as tests/test_http.py), with an
``httpx.MockTransport`` in front that loses replies or connections the way a network does:

* no refusal is retried by default (tool_end's 503 and 507: a retry only delays the next turn);
* transport failures are typed errors, never raw ``httpx`` exceptions;
* every call is idempotent by epoch: a re-sent tool_start whose first reply was lost is answered
  with the call's record (``replayed``) -- also under ``TOOLKV_POLICY=auto``, where it was Kept;
* ``tool_call`` never raises on a refusal or a failure, and still ends the call when the tool raises.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from _turns import LoopbackChannel, finish_turn, iteration
from fastapi.testclient import TestClient

from toolkv.client import (
    NO_RETRY,
    AsyncToolKVClient,
    NoReply,
    RetryPolicy,
    ServerUnreachable,
    ToolKVClient,
    TransportError,
)
from toolkv.errors import DeviceMemoryFull, HostMemoryFull, UnknownSession, WrongState
from toolkv.sglang.config import ToolKVConfig
from toolkv.sglang.http_api import build_app
from toolkv.sglang.scheduler_side import SchedulerToolKV
from toolkv.testing.harness import CacheHarness, HarnessConfig

PROMPT = list(range(1, 65))


class Net:
    """The scheduler side behind the real app, and a network in front of it that can lose
    things: ``lose(op)`` makes the next ``op`` request reach the server (it is applied) while its
    answer never comes back (a read timeout); ``refuse_all`` makes every connection fail."""

    def __init__(self, h: CacheHarness, config: ToolKVConfig | None = None) -> None:
        self.h = h
        # the restore path under test needs the GPU copy freed at the write ack (TOOLKV_LAZY_FREE=0)
        self.tk = SchedulerToolKV(
            h.tree, config=config if config is not None else ToolKVConfig(lazy_free=False)
        )
        h.tree._toolkv = self.tk
        self.app = build_app(LoopbackChannel(self.tk))
        self.inner = TestClient(self.app)._transport
        self.sent: list[str] = []
        self._lose: list[str] = []
        self.refuse_all = False

    def lose(self, *ops: str) -> None:
        self._lose.extend(ops)

    def handler(self, request: httpx.Request) -> httpx.Response:
        op = request.url.path.rsplit("/", 1)[-1]
        self.sent.append(op)
        if self.refuse_all:
            raise httpx.ConnectError("[Errno 111] Connection refused", request=request)
        response = self.inner.handle_request(request)
        response.read()
        if op in self._lose:
            self._lose.remove(op)
            raise httpx.ReadTimeout("timed out", request=request)
        return response

    def client(self, **kw: Any) -> ToolKVClient:
        slept: list[float] = []
        kw.setdefault("sleep", slept.append)
        c = ToolKVClient("http://t", transport=httpx.MockTransport(self.handler), **kw)
        c.slept = slept  # type: ignore[attr-defined]
        return c

    def snapshot(self) -> Any:
        m = self.tk.manager
        return self.h.accounting(), {sid: m.kv_meta(sid) for sid in m.sessions}


@pytest.fixture
def net() -> Iterator[Net]:
    with CacheHarness(HarnessConfig()) as h:
        n = Net(h)
        assert finish_turn(h, "s1", PROMPT, [65, 66])
        yield n


@pytest.fixture
def auto_net() -> Iterator[Net]:
    with CacheHarness(HarnessConfig()) as h:
        n = Net(h, ToolKVConfig(policy="auto", lazy_free=False))
        assert finish_turn(h, "s1", PROMPT, [65, 66])
        yield n


def _hog(n: Net) -> Any:
    """Another request holds every free slot, on a server without load-adaptive protection
    (``TOOLKV_ADAPTIVE=0``), where a tool_end the device cannot take is a 503."""
    from dataclasses import replace

    n.tk.manager.config = replace(n.tk.manager.config, adaptive=False)
    hog = n.h.alloc(n.h.allocator.available_size())  # another request holds every free slot
    assert hog is not None
    return hog


# ---- refusals are answers: not retried by default ----------------------------------------------------
def test_tool_end_device_full_is_not_retried_and_changes_nothing(net: Net) -> None:
    with net.client() as c:
        m = c.tool_start("s1")
        iteration(net.h, net.tk, writes=True)
        _hog(net)
        before, sent = net.snapshot(), len(net.sent)
        with pytest.raises(DeviceMemoryFull):
            c.tool_end("s1", m.epoch)
        assert net.sent[sent:] == ["tool_end"] and c.slept == []  # type: ignore[attr-defined]
        assert net.snapshot() == before and c.kv_meta("s1").state == "Offloaded"


def test_tool_start_host_full_is_not_retried(net: Net) -> None:
    net.tk.manager.backend.host_budget_tokens = 1  # type: ignore[attr-defined]
    with net.client() as c, pytest.raises(HostMemoryFull):
        c.tool_start("s1")
    assert net.sent == ["tool_start"]


# ---- transport failures are typed ----------------------------------------------------------------
def test_connection_refused_is_server_unreachable_and_bounded(net: Net) -> None:
    net.refuse_all = True
    with net.client() as c:
        with pytest.raises(ServerUnreachable) as ei:
            c.kv_meta("s1")
        assert not ei.value.applied_unknown and isinstance(ei.value.__cause__, httpx.ConnectError)
        assert c.slept == [0.1, 0.2]  # type: ignore[attr-defined]
        with pytest.raises(TransportError):  # tool_end is never re-sent by default
            c.tool_end("s1", 1)
    assert net.sent == ["kv_meta"] * 3 + ["tool_end"]


def test_lost_tool_end_reply_is_no_reply_without_a_resend(net: Net) -> None:
    with net.client() as c:
        m = c.tool_start("s1")
        iteration(net.h, net.tk, writes=True)
        net.lose("tool_end")
        with pytest.raises(NoReply) as ei:
            c.tool_end("s1", m.epoch)
        assert ei.value.applied_unknown and ei.value.code == "no_reply"
    assert net.sent == ["tool_start", "tool_end"]  # the next request restores it: no round trip more


# ---- idempotent by epoch -------------------------------------------------------------------------
def test_resent_tool_start_with_prior_epoch_is_replayed_over_http(net: Net) -> None:
    """What the server recognises: the session is one epoch past the client's ``prior_epoch``
    and in a tool call, so this tool_start was applied; the answer is its record, nothing moves."""
    http = TestClient(net.app)
    first = http.post("/session/tool_start", json={"session_id": "s1", "prior_epoch": 0}).json()
    before = net.snapshot()
    again = http.post("/session/tool_start", json={"session_id": "s1", "prior_epoch": 0})
    assert again.status_code == 200, again.text
    body = again.json()
    assert body["replayed"] is True and (body["epoch"], body["state"]) == (first["epoch"], first["state"])
    assert net.snapshot() == before and net.tk.manager.counters["tool_start"] == 1
    # without prior_epoch (or with the current epoch) it is a new call, refused as before
    assert http.post("/session/tool_start", json={"session_id": "s1"}).json()["error"] == "wrong_state"
    r = http.post("/session/tool_start", json={"session_id": "s1", "prior_epoch": 1})
    assert r.json()["error"] == "wrong_state"
    bad = http.post("/session/tool_start", json={"session_id": "s1", "prior_epoch": -1})
    assert bad.status_code == 400 and net.snapshot() == before


def test_policy_auto_kept_tool_start_whose_reply_was_lost(auto_net: Net) -> None:
    """The issue's case: TOOLKV_POLICY=auto keeps a short call on the GPU (Kept); its reply is
    lost. The client reads kv_meta before re-sending and answers with the Kept record."""
    n = auto_net
    with n.client() as c:
        n.lose("tool_start")
        m = c.tool_start("s1", tool="calc", expected_s=0.0)
        assert m.state == "Kept" and m.epoch == 1
        assert n.sent == ["tool_start", "kv_meta"]
        assert c.tool_end("s1", m.epoch).state in ("Runnable", "Handover")  # Handover: pinned until admitted


def test_lost_reply_and_lost_probe_resend_is_replayed(auto_net: Net) -> None:
    """The reply and the kv_meta read are both lost: the client re-sends with the epoch it knew,
    and the server answers the applied call's record instead of wrong_state."""
    n = auto_net
    with n.client() as c:
        first = c.tool_start("s1", tool="calc", expected_s=0.0)
        c.tool_end("s1", first.epoch)
        assert finish_turn(n.h, "s1", [*PROMPT, 65, 66], [67, 68])  # the next turn: Running again
        n.sent.clear()
        n.lose("tool_start", "kv_meta")
        m = c.tool_start("s1", tool="calc", expected_s=0.0)
    assert n.sent == ["tool_start", "kv_meta", "tool_start"]
    assert m.replayed and (m.state, m.epoch) == ("Kept", 2)
    assert n.tk.manager.sessions["s1"].epoch == 2, "applied once, not twice"


def test_resent_tool_end_and_close_are_recognised(net: Net) -> None:
    everything = RetryPolicy(ops=frozenset({"tool_start", "tool_end", "kv_meta", "close"}))
    with net.client(retry=everything) as c:
        m = c.tool_start("s1")
        iteration(net.h, net.tk, writes=True)
        net.lose("tool_end", "kv_meta")  # applied; the answer and the first read are lost
        end = c.tool_end("s1", m.epoch)
        assert end.state == "Restoring" and end.epoch == m.epoch
        assert net.sent[-4:] == ["tool_end", "kv_meta", "tool_end", "kv_meta"]
        net.lose("close", "kv_meta")
        assert c.close_session("s1").state == "Closed"


# ---- the tool_call helper ------------------------------------------------------------------------
@pytest.mark.parametrize(
    "trouble",
    ["unknown session", "device full", "host full", "unreachable", "tool_end reply lost"],
)
def test_tool_call_never_raises_on_a_refusal(net: Net, trouble: str) -> None:
    sid = "ghost" if trouble == "unknown session" else "s1"
    setups: dict[str, Callable[[], None]] = {
        "device full": lambda: None,
        "host full": lambda: setattr(net.tk.manager.backend, "host_budget_tokens", 1),
        "unreachable": lambda: setattr(net, "refuse_all", True),
        "tool_end reply lost": lambda: net.lose("tool_end"),
    }
    setups.get(trouble, lambda: None)()
    with net.client(retry=NO_RETRY) as c, c.tool_call(sid, tool="search") as call:
        if trouble == "device full":
            iteration(net.h, net.tk, writes=True)
            _hog(net)
        ran = True
    assert ran and call.end is None and call.failures
    expected = {
        "unknown session": UnknownSession,
        "device full": DeviceMemoryFull,
        "host full": HostMemoryFull,
        "unreachable": ServerUnreachable,
        "tool_end reply lost": NoReply,
    }[trouble]
    assert isinstance(call.failures[-1], expected)


def test_tool_call_ends_the_call_when_the_tool_raises(net: Net) -> None:
    with net.client() as c:
        with pytest.raises(ZeroDivisionError), c.tool_call("s1", tool="calc") as call:
            iteration(net.h, net.tk, writes=True)
            _ = 1 / 0
        assert call.offloaded and call.end is not None and call.end.state == "Restoring"
        assert call.failures == []


def test_async_tool_call_and_typed_errors(net: Net) -> None:
    asgi = httpx.ASGITransport(app=net.app)

    async def handler(request: httpx.Request) -> httpx.Response:
        net.sent.append(request.url.path.rsplit("/", 1)[-1])
        if net.refuse_all:
            raise httpx.ConnectError("[Errno 111] Connection refused", request=request)
        r = await asgi.handle_async_request(request)
        return httpx.Response(r.status_code, headers=r.headers, content=await r.aread())

    async def run() -> tuple[str, str, type[Exception]]:
        transport = httpx.MockTransport(handler)
        slept: list[float] = []

        async def sleep(s: float) -> None:
            slept.append(s)

        async with AsyncToolKVClient("http://t", transport=transport, sleep=sleep) as c:
            async with c.tool_call("s1", tool="search") as call:
                iteration(net.h, net.tk, writes=True)
            assert call.start is not None and call.end is not None
            net.refuse_all = True
            try:
                await c.kv_meta("s1")
            except Exception as e:  # the type is what is checked
                kind = type(e)
            async with c.tool_call("s1") as again:
                pass
            assert again.start is None and isinstance(again.failures[0], ServerUnreachable)
            return call.start.state, call.end.state, kind

    assert asyncio.run(run()) == ("Offloading", "Restoring", ServerUnreachable)


def test_retry_policy_refuses_unknown_ops() -> None:
    with pytest.raises(ValueError, match="tool_stop"):
        RetryPolicy(ops=frozenset({"tool_stop"}))
    assert not RetryPolicy().retries_on("tool_end", NoReply("x"))
    assert not RetryPolicy().retries_on("tool_start", WrongState("x"))
    assert RetryPolicy().retries_on("tool_start", NoReply("x"))
