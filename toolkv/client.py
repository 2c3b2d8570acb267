"""Typed clients for the toolkv session API (sync and async, over httpx).

Errors come back as the same exception classes the server raises (``toolkv.errors``), rebuilt
from the response's ``error`` code, so agent code can ``except StaleEpoch`` on either side of the
wire. This module imports neither torch nor sglang: agents install toolkv without the server.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import httpx

from toolkv import errors

__all__ = [
    "AsyncToolKVClient",
    "KVMeta",
    "SchedulerTimeout",
    "ServerMeta",
    "ToolKVClient",
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


def error_from_response(r: httpx.Response) -> errors.ToolKVError:
    """The typed exception for a non-2xx response (falls back on the status code)."""
    try:
        body = r.json()
    except ValueError:
        body = {}
    if not isinstance(body, dict):
        body = {}
    if r.status_code in (401, 403):
        return Unauthorized(str(body.get("error") or body.get("message") or "unauthorized"))
    code = str(body.get("error", ""))
    cls = _BY_CODE.get(code)
    if cls is None:
        cls = next((c for c in _BY_CODE.values() if c.http_status == r.status_code), errors.ToolKVError)
    message = str(body.get("message") or r.text or f"HTTP {r.status_code}")
    details = {k: v for k, v in body.items() if k not in ("error", "message")}
    err = cls(message, **details)
    err.http_status = r.status_code
    return err


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _meta(r: httpx.Response) -> KVMeta:
    if r.status_code != 200:
        raise error_from_response(r)
    return KVMeta.from_json(r.json())


class ToolKVClient:
    """Blocking client. ``base_url`` is the sglang server (e.g. ``http://127.0.0.1:30000``)."""

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        timeout_s: float = 60.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self._http = httpx.Client(
            base_url=base_url, headers=_headers(api_key), timeout=timeout_s, transport=transport
        )

    def tool_start(self, session_id: str) -> KVMeta:
        """Offload the session's KV while a tool runs; keep ``.epoch`` for :meth:`tool_end`."""
        return _meta(self._http.post("/session/tool_start", json={"session_id": session_id}))

    def tool_end(self, session_id: str, epoch: int) -> KVMeta:
        """Restore the session's KV. ``DeviceMemoryFull`` is retryable; the next request of the
        session also restores it."""
        return _meta(self._http.post("/session/tool_end", json={"session_id": session_id, "epoch": epoch}))

    def kv_meta(self, session_id: str) -> KVMeta:
        return _meta(self._http.get("/session/kv_meta", params={"session_id": session_id}))

    def server_meta(self) -> ServerMeta:
        r = self._http.get("/session/kv_meta")
        if r.status_code != 200:
            raise error_from_response(r)
        return ServerMeta.from_json(r.json())

    def close_session(self, session_id: str) -> KVMeta:
        return _meta(self._http.post("/session/close", json={"session_id": session_id}))

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> ToolKVClient:
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class AsyncToolKVClient:
    """The asyncio twin of :class:`ToolKVClient`."""

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        timeout_s: float = 60.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self._http = httpx.AsyncClient(
            base_url=base_url, headers=_headers(api_key), timeout=timeout_s, transport=transport
        )

    async def tool_start(self, session_id: str) -> KVMeta:
        return _meta(await self._http.post("/session/tool_start", json={"session_id": session_id}))

    async def tool_end(self, session_id: str, epoch: int) -> KVMeta:
        return _meta(
            await self._http.post("/session/tool_end", json={"session_id": session_id, "epoch": epoch})
        )

    async def kv_meta(self, session_id: str) -> KVMeta:
        return _meta(await self._http.get("/session/kv_meta", params={"session_id": session_id}))

    async def server_meta(self) -> ServerMeta:
        r = await self._http.get("/session/kv_meta")
        if r.status_code != 200:
            raise error_from_response(r)
        return ServerMeta.from_json(r.json())

    async def close_session(self, session_id: str) -> KVMeta:
        return _meta(await self._http.post("/session/close", json={"session_id": session_id}))

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncToolKVClient:
        return self

    async def __aexit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()
