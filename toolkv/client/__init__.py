"""Typed clients for the toolkv session API (sync and async, over httpx).

Errors come back as the same exception classes the server raises (``toolkv.errors``), rebuilt
from the response's ``error`` code, so agent code can ``except StaleEpoch`` on either side of the
wire; a request that got no HTTP answer at all raises :class:`TransportError` (never a raw
``httpx`` exception). This module imports neither torch nor sglang: agents install toolkv
without the server.

Two rules shape the retries (:class:`RetryPolicy`):

* **Idempotent by epoch.** A call whose reply was lost may be sent again. ``tool_start`` carries
  the epoch the client last saw (``prior_epoch``); the server answers a re-sent one that it has
  already applied with the session's record (``replayed``) instead of ``wrong_state``. A re-sent
  ``tool_end`` or ``close`` that the server refuses as ``wrong_state`` is checked against
  ``kv_meta``: if the session shows the call's effect at the same epoch, that record is the answer.
* **Never retry what only delays the next turn.** ``tool_end`` is not retried by default, and no
  refusal is (``device_memory_full`` 503: sglang's own load-back serves the next request;
  ``host_memory_full`` 507: the session simply stays on the GPU). Only the outcome-unknown
  failures of ``tool_start``, ``kv_meta`` and ``close`` are (no answer, 504, toolkv starting).

:meth:`ToolKVClient.tool_call` wraps one tool call and never raises on a refusal: the agent's
turn goes on whatever toolkv answers. It also never waits long for toolkv: everything it sends
before the tool runs (every ``tool_start`` attempt, every ``kv_meta`` check, the waits between
them) shares one deadline (``tool_call_deadline_s``, 5 s by default), and so does ``tool_end``
after it. Each HTTP wait is clipped to the time left. toolkv only makes the next turn faster; a
scheduler that does not answer must not hold the agent for the minutes its retries and
``TOOLKV_REPLY_TIMEOUT_S`` would otherwise add up to.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from types import TracebackType
from typing import TypeVar

import httpx

from toolkv.client.exchange import (
    Outcome,
    ToolCall,
    _Base,
    _Call,
    _server_status,
    _Sleep,
    _Steps,
    _tool_start,
)
from toolkv.client.hints import kv_hints, kv_hints_outcome
from toolkv.client.wire import (
    DEFAULT_TOOL_CALL_DEADLINE_S,
    NO_RETRY,
    DeadlineExceeded,
    DrainStatus,
    HeldSession,
    HTTPFailure,
    KVMeta,
    NoReply,
    RetryPolicy,
    ServerMeta,
    ServerStatus,
    ServerUnreachable,
    ToolKVNotRunning,
    TransportError,
    Unauthorized,
    _as_meta,
    _at,
    _deadline_s,
    _headers,
    error_from_response,
)
from toolkv.core.requests import Close, Drain, KvMetaQuery, ToolEnd

# the server answers these too (toolkv.sglang.http_api); re-exported here for agents
from toolkv.errors import SchedulerTimeout, ToolKVUnavailable

__all__ = [
    "DEFAULT_TOOL_CALL_DEADLINE_S",
    "NO_RETRY",
    "AsyncToolKVClient",
    "DeadlineExceeded",
    "DrainStatus",
    "HTTPFailure",
    "HeldSession",
    "KVMeta",
    "NoReply",
    "Outcome",
    "RetryPolicy",
    "SchedulerTimeout",
    "ServerMeta",
    "ServerStatus",
    "ServerUnreachable",
    "ToolCall",
    "ToolKVClient",
    "ToolKVNotRunning",
    "ToolKVUnavailable",
    "TransportError",
    "Unauthorized",
    "error_from_response",
    "kv_hints",
    "kv_hints_outcome",
]


_T = TypeVar("_T")


class ToolKVClient(_Base):
    """Blocking client. ``base_url`` is the sglang server (e.g. ``http://127.0.0.1:30000``).

    Failures are retried under ``retry`` (see :class:`RetryPolicy`); ``sleep`` is how the client
    waits between attempts; ``timeout_s`` bounds each HTTP wait of a call without a deadline.
    ``tool_call_deadline_s`` is :meth:`tool_call`'s deadline for each side of the tool (see
    there). Every error is a :class:`toolkv.errors.ToolKVError`."""

    _http: httpx.Client

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        timeout_s: float = 60.0,
        retry: RetryPolicy | None = None,
        transport: httpx.BaseTransport | None = None,
        sleep: Callable[[float], None] = time.sleep,
        tool_call_deadline_s: float = DEFAULT_TOOL_CALL_DEADLINE_S,
    ) -> None:
        self.tool_call_deadline_s = _deadline_s(tool_call_deadline_s)
        self._http = httpx.Client(
            base_url=base_url, headers=_headers(api_key), timeout=timeout_s, transport=transport
        )
        self.retry = retry or RetryPolicy()
        self._sleep = sleep
        self._epochs = {}

    def _run(self, call: _Call[_T], deadline: float | None = None) -> _T:
        """The call, sent with this client's httpx client, retried with its sleep."""
        steps = _Steps(self, call, deadline)
        for effect in steps:
            if isinstance(effect, _Sleep):
                self._sleep(effect.seconds)
                continue
            with steps.answering(effect):
                steps.answer = self._http.request(
                    effect.method,
                    effect.path,
                    json=effect.json,
                    params=effect.params,
                    extensions=effect.extensions,
                )
        return steps.value

    def tool_start(
        self,
        session_id: str,
        *,
        tool: str | None = None,
        expected_s: float | None = None,
        deadline_s: float | None = None,
    ) -> KVMeta:
        """Offload the session's KV while a tool runs; keep ``.epoch`` for :meth:`tool_end`. ``tool``
        and ``expected_s`` are optional hints for the server's per-call policy. Sends the epoch
        this client last saw for the session, so a re-send is recognised (``.replayed``).
        ``deadline_s``: every attempt, check and wait of this call ends within it
        (:class:`DeadlineExceeded` after); None: only each HTTP wait is bounded (``timeout_s``)."""
        return self._run(_tool_start(session_id, tool, expected_s), _at(deadline_s))

    def tool_end(self, session_id: str, epoch: int, *, deadline_s: float | None = None) -> KVMeta:
        """Restore the session's KV. Not retried by default: ``DeviceMemoryFull`` means the
        session stays offloaded and its next request restores it (sglang loads it back).
        ``deadline_s`` as in :meth:`tool_start`."""
        return self._run(_Call.post(ToolEnd(session_id, epoch), _as_meta), _at(deadline_s))

    def kv_meta(self, session_id: str) -> KVMeta:
        return self._run(_Call.get(KvMetaQuery(session_id), _as_meta))

    def server_meta(self) -> ServerMeta:
        return self._run(_Call.get(KvMetaQuery(), ServerMeta.from_json))

    def server_status(self, *, limit: int | None = None) -> ServerStatus:
        """The operator's view (``GET /session/status``): read-only, retried like ``kv_meta``.
        ``limit``: how many of the sessions that hold KV to list (server default 20, at most 1000)."""
        return self._run(_server_status(limit))

    def drain(self, on: bool = True) -> DrainStatus:
        """Start (``on``) or end the drain (``POST /session/drain``); idempotent, so an operator
        sends it again rather than have it retried. While draining the server refuses new tool
        calls with :class:`toolkv.errors.Draining` (``tool_call`` runs the tool anyway)."""
        return self._run(_Call.post(Drain(on), DrainStatus.from_json))

    def close_session(self, session_id: str) -> KVMeta:
        return self._run(_Call.post(Close(session_id), _as_meta))

    @contextlib.contextmanager
    def tool_call(
        self,
        session_id: str,
        *,
        tool: str | None = None,
        expected_s: float | None = None,
        deadline_s: float | None = None,
    ) -> Iterator[ToolCall]:
        """``with kv.tool_call(sid, tool="search") as call: result = run_tool()``.

        tool_start before the block, tool_end after it (also when the block raises: the KV
        comes back for the turn that reports the error). Never raises a toolkv error: a refusal
        or a failure of either call is logged and kept in ``call.failures``, and the agent's turn
        goes on exactly as it would without toolkv. Exceptions of the block itself propagate.

        Never waits long: everything sent before the block (each tool_start attempt, each kv_meta
        check, the back-off between them) ends within ``deadline_s`` (default: the client's
        ``tool_call_deadline_s``, 5 s), each HTTP wait clipped to the time left; then the block
        runs whatever toolkv did (``call.start_outcome == "deadline_exceeded"``). tool_end after
        the block has a deadline of the same length. The one thing a deadline cannot clip is a
        server that sends its answer a few bytes at a time: each read waits at most the time that
        was left when the answer began (the async client's bound is exact)."""
        call = self._tool_call(session_id, tool, deadline_s)
        with self._side(call, "tool_start"):
            start = self.tool_start(session_id, tool=tool, expected_s=expected_s, deadline_s=call.deadline_s)
            call._answered("tool_start", start)
        try:
            yield call
        finally:
            if call.start is not None:
                with self._side(call, "tool_end"):
                    call._answered(
                        "tool_end", self.tool_end(session_id, call.start.epoch, deadline_s=call.deadline_s)
                    )

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> ToolKVClient:
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class AsyncToolKVClient(_Base):
    """The asyncio twin of :class:`ToolKVClient` (same retries, same ``tool_call``, same
    deadlines; here a deadline also cancels whatever is still waiting when it runs out)."""

    _http: httpx.AsyncClient

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        timeout_s: float = 60.0,
        retry: RetryPolicy | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        tool_call_deadline_s: float = DEFAULT_TOOL_CALL_DEADLINE_S,
    ) -> None:
        self.tool_call_deadline_s = _deadline_s(tool_call_deadline_s)
        self._http = httpx.AsyncClient(
            base_url=base_url, headers=_headers(api_key), timeout=timeout_s, transport=transport
        )
        self.retry = retry or RetryPolicy()
        self._sleep = sleep
        self._epochs = {}

    async def _run(self, call: _Call[_T], deadline: float | None = None) -> _T:
        """Drive :func:`_exchange` with this client's httpx client and sleep; cut off at
        ``deadline``: whatever it still awaits then (a read that trickles, a sleep) is cancelled
        and the call fails with :class:`DeadlineExceeded`."""
        if deadline is None:
            return await self._steps(call, None)
        try:
            async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                return await self._steps(call, deadline)
        except TimeoutError:
            err = DeadlineExceeded(f"{call.op}: no answer within the deadline (cut off while waiting)")
            err.applied_unknown = True  # a request may have been in flight
            raise err from None

    async def _steps(self, call: _Call[_T], deadline: float | None) -> _T:
        steps = _Steps(self, call, deadline)
        for effect in steps:
            if isinstance(effect, _Sleep):
                await self._sleep(effect.seconds)
                continue
            with steps.answering(effect):
                steps.answer = await self._http.request(
                    effect.method,
                    effect.path,
                    json=effect.json,
                    params=effect.params,
                    extensions=effect.extensions,
                )
        return steps.value

    async def tool_start(
        self,
        session_id: str,
        *,
        tool: str | None = None,
        expected_s: float | None = None,
        deadline_s: float | None = None,
    ) -> KVMeta:
        return await self._run(_tool_start(session_id, tool, expected_s), _at(deadline_s))

    async def tool_end(self, session_id: str, epoch: int, *, deadline_s: float | None = None) -> KVMeta:
        return await self._run(_Call.post(ToolEnd(session_id, epoch), _as_meta), _at(deadline_s))

    async def kv_meta(self, session_id: str) -> KVMeta:
        return await self._run(_Call.get(KvMetaQuery(session_id), _as_meta))

    async def server_meta(self) -> ServerMeta:
        return await self._run(_Call.get(KvMetaQuery(), ServerMeta.from_json))

    async def server_status(self, *, limit: int | None = None) -> ServerStatus:
        return await self._run(_server_status(limit))

    async def drain(self, on: bool = True) -> DrainStatus:
        return await self._run(_Call.post(Drain(on), DrainStatus.from_json))

    async def close_session(self, session_id: str) -> KVMeta:
        return await self._run(_Call.post(Close(session_id), _as_meta))

    @contextlib.asynccontextmanager
    async def tool_call(
        self,
        session_id: str,
        *,
        tool: str | None = None,
        expected_s: float | None = None,
        deadline_s: float | None = None,
    ) -> AsyncIterator[ToolCall]:
        """``async with kv.tool_call(sid, tool=...) as call:`` (see :meth:`ToolKVClient.tool_call`;
        here the deadline holds whatever the server does, a trickled answer included)."""
        call = self._tool_call(session_id, tool, deadline_s)
        with self._side(call, "tool_start"):
            start = await self.tool_start(
                session_id, tool=tool, expected_s=expected_s, deadline_s=call.deadline_s
            )
            call._answered("tool_start", start)
        try:
            yield call
        finally:
            if call.start is not None:
                with self._side(call, "tool_end"):
                    end = await self.tool_end(session_id, call.start.epoch, deadline_s=call.deadline_s)
                    call._answered("tool_end", end)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncToolKVClient:
        return self

    async def __aexit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()
