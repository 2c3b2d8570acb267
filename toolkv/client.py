"""Typed clients for the toolkv session API (sync and async, over httpx).

Errors come back as the same exception classes the server raises (``toolkv.errors``), rebuilt
from the response's ``error`` code, so agent code can ``except StaleEpoch`` on either side of the
wire. This module imports neither torch nor sglang: agents install toolkv without the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import httpx

from toolkv import errors

__all__ = [
    "NO_RETRY",
    "AsyncToolKVClient",
    "HTTPFailure",
    "KVMeta",
    "RetryPolicy",
    "SchedulerTimeout",
    "ServerMeta",
    "ToolKVClient",
    "ToolKVNotRunning",
    "ToolKVUnavailable",
    "Unauthorized",
    "error_from_response",
]


class Unauthorized(errors.ToolKVError):
    """401/403: the server runs with ``--api-key`` and the key is missing or wrong."""

    http_status = 401
    code = "unauthorized"


class ToolKVUnavailable(errors.ToolKVError):
    """The scheduler does not run toolkv (the HTTP side's handshake failed) or the server is
    still starting."""

    http_status = 503
    code = "toolkv_unavailable"


class SchedulerTimeout(errors.ToolKVError):
    """No scheduler reply within the timeout. The operation may still take effect: check kv_meta."""

    http_status = 504
    code = "scheduler_timeout"


_BY_CODE: dict[str, type[errors.ToolKVError]] = {
    cls.code: cls
    for cls in (
        errors.BadRequest,
        errors.UnsupportedMediaType,
        errors.UnknownSession,
        errors.StaleEpoch,
        errors.WrongState,
        errors.SessionKVLost,
        errors.HostMemoryFull,
        errors.Unsupported,
        errors.DeviceMemoryFull,
        ToolKVUnavailable,
        SchedulerTimeout,
        Unauthorized,
    )
}


def _start_body(session_id: str, tool: str | None, expected_s: float | None) -> dict[str, Any]:
    body: dict[str, Any] = {"session_id": session_id}
    if tool is not None:
        body["tool"] = tool
    if expected_s is not None:
        body["expected_s"] = expected_s
    return body


@dataclass(frozen=True)
class KVMeta:
    """One session's record, as ``tool_start``/``tool_end``/``kv_meta``/``close`` return it."""

    session_id: str
    state: str
    epoch: int
    backend: str
    protected: bool
    deadline: float | None
    tier: str
    tokens: int
    device_tokens: int
    host_tokens: int
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> KVMeta:
        known = {f for f in cls.__dataclass_fields__ if f != "extra"}
        deadline = d.get("deadline")
        return cls(
            session_id=str(d["session_id"]),
            state=str(d["state"]),
            epoch=int(d["epoch"]),
            backend=str(d.get("backend", "")),
            protected=bool(d.get("protected", False)),
            deadline=None if deadline is None else float(deadline),
            tier=str(d.get("tier", "")),
            tokens=int(d.get("tokens") or 0),
            device_tokens=int(d.get("device_tokens") or 0),
            host_tokens=int(d.get("host_tokens") or 0),
            extra={k: v for k, v in d.items() if k not in known},
        )


@dataclass(frozen=True)
class ServerMeta:
    """Server-wide ``kv_meta``: sessions by state, lifetime counters, memory held."""

    backend: str
    sessions: int
    states: dict[str, int]
    counters: dict[str, int]
    raw: dict[str, Any]

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ServerMeta:
        return cls(
            backend=str(d.get("backend", "")),
            sessions=int(d.get("sessions", 0)),
            states=dict(d.get("states", {})),
            counters=dict(d.get("counters", {})),
            raw=d,
        )


class ToolKVNotRunning(ToolKVUnavailable):
    """The server answered 404 without toolkv's error body: the route does not exist, so toolkv is
    not installed or not enabled there (``TOOLKV_ENABLE=1``). Not an unknown session."""

    http_status = 404
    code = "toolkv_not_running"


_BY_CODE[ToolKVNotRunning.code] = ToolKVNotRunning


class HTTPFailure(errors.ToolKVError):
    """A non-2xx answer without a toolkv error code (a proxy, sglang itself): ``http_status``
    says which; the message carries the body's text."""

    code = "http_error"


def error_from_response(r: httpx.Response) -> errors.ToolKVError:
    """The typed exception for a non-2xx response, chosen by the ``error`` code in toolkv's body.

    The status alone never picks a toolkv class: a plain 404 from the host app (route missing)
    is :class:`ToolKVNotRunning`, toolkv's 404 ``unknown_session`` is ``UnknownSession``."""
    try:
        body = r.json()
    except ValueError:
        body = {}
    if not isinstance(body, dict):
        body = {}
    raw_code = body.get("error")
    cls = _BY_CODE.get(raw_code) if isinstance(raw_code, str) else None
    details = {k: v for k, v in body.items() if k not in ("error", "message")}
    if cls is None:
        if r.status_code in (401, 403):
            return Unauthorized(str(raw_code or body.get("message") or "unauthorized"))
        text = str(body.get("message") or body.get("detail") or r.text or "")
        if r.status_code == 404:
            err: errors.ToolKVError = ToolKVNotRunning(
                f"{r.request.url.path} is not served ({text or 'Not Found'}): toolkv is not installed or "
                "not enabled on this server (TOOLKV_ENABLE=1)"
            )
        else:
            err = HTTPFailure(f"HTTP {r.status_code}: {text}".rstrip(": "), **details)
        err.http_status = r.status_code
        return err
    err = cls(str(body.get("message") or r.text or f"HTTP {r.status_code}"), **details)
    err.http_status = r.status_code
    return err


RETRY_STATUSES = frozenset({503, 504})


@dataclass(frozen=True)
class RetryPolicy:
    """Retries of 503 (device memory full right now, toolkv still starting, an overloaded proxy)
    and 504 (the scheduler did not answer in time), with bounded exponential backoff.

    Waits ``backoff_s * 2**attempt`` seconds, or the server's ``Retry-After`` when it sends one,
    never more than ``max_backoff_s``; at most ``retries`` retries, so the worst case wait is
    bounded. After a 504 the operation may have been applied: the client reads ``kv_meta`` first
    and returns that if it shows the operation's effect, instead of sending it again."""

    retries: int = 3
    backoff_s: float = 0.25
    max_backoff_s: float = 4.0

    def __post_init__(self) -> None:
        if self.retries < 0 or self.backoff_s < 0 or self.max_backoff_s < 0:
            raise ValueError("retries and backoff must be >= 0")

    def delay(self, attempt: int, response: httpx.Response) -> float:
        wait: float = self.backoff_s * float(2**attempt)
        after = response.headers.get("retry-after")
        if after is not None:
            with contextlib.suppress(ValueError):
                wait = float(after)
        return max(0.0, min(wait, self.max_backoff_s))


NO_RETRY = RetryPolicy(retries=0)


def _applied(op: str, meta: KVMeta, epoch: int | None) -> bool:
    """Does ``kv_meta`` show that ``op`` took effect (after a 504, which does not say)?"""
    if op == "tool_start":
        return meta.state in ("Offloading", "Offloaded")
    if op == "tool_end":
        return meta.epoch == epoch and meta.state in ("Restoring", "Runnable", "Running")
    if op == "close":
        return meta.state == "Closed"
    return False


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _meta(r: httpx.Response) -> KVMeta:
    if r.status_code != 200:
        raise error_from_response(r)
    return KVMeta.from_json(r.json())


class ToolKVClient:
    """Blocking client. ``base_url`` is the sglang server (e.g. ``http://127.0.0.1:30000``).

    503 and 504 answers are retried under ``retry`` (see :class:`RetryPolicy`); ``sleep`` is how
    the client waits between attempts."""

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        timeout_s: float = 60.0,
        retry: RetryPolicy | None = None,
        transport: httpx.BaseTransport | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self._http = httpx.Client(
            base_url=base_url, headers=_headers(api_key), timeout=timeout_s, transport=transport
        )
        self.retry = retry or RetryPolicy()
        self._sleep = sleep

    def _send(
        self, method: str, path: str, op: str, *, session_id: str | None = None, **kw: Any
    ) -> httpx.Response:
        epoch = (kw.get("json") or {}).get("epoch")
        for attempt in range(self.retry.retries + 1):
            r = self._http.request(method, path, **kw)
            if r.status_code not in RETRY_STATUSES or attempt == self.retry.retries:
                return r
            self._sleep(self.retry.delay(attempt, r))
            if r.status_code == 504 and session_id is not None and op != "kv_meta":
                probe = self._http.get("/session/kv_meta", params={"session_id": session_id})
                if probe.status_code == 200 and _applied(op, KVMeta.from_json(probe.json()), epoch):
                    return probe
        raise AssertionError("unreachable")

    def tool_start(
        self, session_id: str, *, tool: str | None = None, expected_s: float | None = None
    ) -> KVMeta:
        """Offload the session's KV while a tool runs; keep ``.epoch`` for :meth:`tool_end`. ``tool``
        and ``expected_s`` are optional hints for the server's per-call policy."""
        return _meta(
            self._send("POST", "/session/tool_start", "tool_start", session_id=session_id,
                       json=_start_body(session_id, tool, expected_s))
        )  # fmt: skip

    def tool_end(self, session_id: str, epoch: int) -> KVMeta:
        """Restore the session's KV. ``DeviceMemoryFull`` (503) is retried; if it persists the
        session stays offloaded and its next request restores it."""
        return _meta(
            self._send("POST", "/session/tool_end", "tool_end", session_id=session_id,
                       json={"session_id": session_id, "epoch": epoch})
        )  # fmt: skip

    def kv_meta(self, session_id: str) -> KVMeta:
        return _meta(self._send("GET", "/session/kv_meta", "kv_meta", params={"session_id": session_id}))

    def server_meta(self) -> ServerMeta:
        r = self._send("GET", "/session/kv_meta", "kv_meta")
        if r.status_code != 200:
            raise error_from_response(r)
        return ServerMeta.from_json(r.json())

    def close_session(self, session_id: str) -> KVMeta:
        return _meta(
            self._send(
                "POST", "/session/close", "close", session_id=session_id, json={"session_id": session_id}
            )
        )

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> ToolKVClient:
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class AsyncToolKVClient:
    """The asyncio twin of :class:`ToolKVClient` (same retries)."""

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        timeout_s: float = 60.0,
        retry: RetryPolicy | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self._http = httpx.AsyncClient(
            base_url=base_url, headers=_headers(api_key), timeout=timeout_s, transport=transport
        )
        self.retry = retry or RetryPolicy()
        self._sleep = sleep

    async def _send(
        self, method: str, path: str, op: str, *, session_id: str | None = None, **kw: Any
    ) -> httpx.Response:
        epoch = (kw.get("json") or {}).get("epoch")
        for attempt in range(self.retry.retries + 1):
            r = await self._http.request(method, path, **kw)
            if r.status_code not in RETRY_STATUSES or attempt == self.retry.retries:
                return r
            await self._sleep(self.retry.delay(attempt, r))
            if r.status_code == 504 and session_id is not None and op != "kv_meta":
                probe = await self._http.get("/session/kv_meta", params={"session_id": session_id})
                if probe.status_code == 200 and _applied(op, KVMeta.from_json(probe.json()), epoch):
                    return probe
        raise AssertionError("unreachable")

    async def tool_start(
        self, session_id: str, *, tool: str | None = None, expected_s: float | None = None
    ) -> KVMeta:
        return _meta(
            await self._send("POST", "/session/tool_start", "tool_start", session_id=session_id,
                             json=_start_body(session_id, tool, expected_s))
        )  # fmt: skip

    async def tool_end(self, session_id: str, epoch: int) -> KVMeta:
        return _meta(
            await self._send("POST", "/session/tool_end", "tool_end", session_id=session_id,
                             json={"session_id": session_id, "epoch": epoch})
        )  # fmt: skip

    async def kv_meta(self, session_id: str) -> KVMeta:
        return _meta(
            await self._send("GET", "/session/kv_meta", "kv_meta", params={"session_id": session_id})
        )

    async def server_meta(self) -> ServerMeta:
        r = await self._send("GET", "/session/kv_meta", "kv_meta")
        if r.status_code != 200:
            raise error_from_response(r)
        return ServerMeta.from_json(r.json())

    async def close_session(self, session_id: str) -> KVMeta:
        return _meta(
            await self._send("POST", "/session/close", "close", session_id=session_id,
                             json={"session_id": session_id})
        )  # fmt: skip

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncToolKVClient:
        return self

    async def __aexit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()
