"""HTTP side: the routes, and the tokenizer-manager end of the control channel.

Routes (added to sglang's own FastAPI ``app``, so sglang's API-key middleware covers them):

* ``POST /session/tool_start`` ``{"session_id"[, "tool", "expected_s", "prior_epoch", "policy"]}`` -> session
  kv_meta (with the new ``epoch``; ``replayed`` when ``prior_epoch`` shows it was already applied)
* ``POST /session/tool_end`` ``{"session_id", "epoch"}`` -> session kv_meta
* ``GET /session/kv_meta[?session_id=]`` -> one session, or server-wide metrics
* ``POST /session/close`` ``{"session_id"}`` -> session kv_meta (releases everything it holds)
* ``GET /session/status[?limit=]`` -> the operator's view (``toolkv doctor``): server-wide kv_meta,
  the sglang release, the settings in force, the drain, the sessions that hold KV and their TTL left
* ``POST /session/drain`` ``{"drain": true|false}`` -> the drain's state: while draining,
  ``tool_start`` answers 503 ``draining``; calls in flight finish or expire as usual

Status codes: 400 malformed body or query, 413 a body over 4,096 bytes (refused while it is read), 415 a body not declared ``application/json``, 404 unknown session, 409 stale epoch / wrong state / KV lost,
507 host budget or pool exhausted, 503 device memory full, toolkv not loaded in the scheduler, or
the server draining (tool_start),
504 scheduler did not answer in time, 401 without the server's ``--api-key`` (sglang's
middleware). Every error body is ``{"error": code, "message": text, ...details}`` and, except
504, the call changed nothing.

Bodies are parsed by hand rather than by FastAPI's parameter binding: sglang's app turns binding
errors into its own error shape, and toolkv's contract (a 400 with toolkv's error body) should not
depend on the host app's exception handlers. Each route builds its request
(:mod:`toolkv.core.requests`), which checks itself; the pydantic models below are generated from
the same field declarations and only publish them (docs/openapi.json).
"""

from __future__ import annotations

import asyncio
import logging
import re
import uuid
from collections.abc import Callable
from enum import Enum
from typing import Any, Literal, Protocol

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, create_model

from toolkv.core.phases import L3, Phase
from toolkv.core.requests import (
    Arg,
    Close,
    Drain,
    KvMetaQuery,
    Request,
    StatusQuery,
    ToolEnd,
    ToolStart,
)
from toolkv.core.result import TIERS
from toolkv.core.settings import POLICY_NAMES, SETTINGS, PolicyName
from toolkv.errors import (
    SchedulerTimeout,
    ToolKVError,
    ToolKVUnavailable,
)
from toolkv.sglang.http_input import QueryParam, parse_body, parse_query
from toolkv.sglang.ipc import ToolKVReqInput, ToolKVReqOutput

log = logging.getLogger("toolkv")


# ---- schemas (OpenAPI), generated from the request types ---------------------------------------------
def _annotation(a: Arg) -> tuple[Any, dict[str, Any]]:
    """The pydantic annotation and ``Field`` bounds of a request field's declaration."""
    bounds = {k: v for k, v in (("min_length", a.min_length), ("max_length", a.max_length),
                                ("ge", a.ge), ("le", a.le)) if v is not None}  # fmt: skip
    if a.kind is PolicyName:  # the enum's values inline (a $ref'd enum leaves schemathesis no invalid body)
        ann: Any = Literal[POLICY_NAMES]
    else:
        ann = a.kind
    if a.kind is float:
        bounds["allow_inf_nan"] = False
    return (ann | None if a.nullable else ann), bounds


def body_model(kind: type[Request]) -> type[BaseModel]:
    """The pydantic model of ``kind``'s JSON body, from its declared fields (the published schema;
    the check itself is the request's own, :meth:`Request.from_body`)."""
    fields: dict[str, Any] = {
        name: (ann, Field(default=default if a.optional else ..., description=a.description, **bounds))
        for name, a, default in kind.args()
        for ann, bounds in (_annotation(a),)
    }
    model: type[BaseModel] = create_model(
        f"{kind.__name__}Body", __config__=ConfigDict(extra="forbid", strict=True), **fields
    )
    return model


ToolStartBody = body_model(ToolStart)
ToolEndBody = body_model(ToolEnd)
CloseBody = body_model(Close)
DrainBody = body_model(Drain)


class SessionMeta(BaseModel):
    """One session's record: lifecycle state, epoch, and where its KV is."""

    model_config = ConfigDict(extra="allow")
    session_id: str
    state: str = Field(description="|".join(Phase))
    epoch: int
    backend: str = Field(description="hiradix (host offload), pin or shadow")
    protected: bool
    deadline: float | None = Field(description="TTL deadline (agreed server clock) while protected")
    tier: str = Field(description="|".join(TIERS))
    l3: str | None = Field(
        default=None,
        description="An offloaded session's copy relative to the storage tier (L3): "
        + "|".join(p for p in L3 if p),
    )
    tokens: int
    device_tokens: int
    host_tokens: int


class ServerMeta(BaseModel):
    """Server-wide view: counts by state, lifetime counters, memory toolkv holds."""

    model_config = ConfigDict(extra="allow")
    backend: str
    sessions: int
    states: dict[str, int]
    counters: dict[str, int]
    now: float


class DrainMeta(BaseModel):
    """The drain's state: poll it until ``drained`` before switching toolkv off or upgrading sglang."""

    model_config = ConfigDict(extra="allow")
    draining: bool = Field(description="new tool_start calls are refused (503 draining)")
    drained: bool = Field(description="draining, and no session holds KV any more: safe to switch off")
    drain_since: float | None = Field(description="when the drain began (agreed server clock)")
    drain_refused: int = Field(description="tool calls refused since the drain began")
    held_sessions: int = Field(description="sessions in a phase that holds KV (protected or pinned)")
    held_tokens: int = Field(description="tokens toolkv holds now")
    states: dict[str, int]
    now: float


class HeldSession(SessionMeta):
    """A session that holds KV, with the time left before its TTL releases it."""

    ttl_left_s: float | None = Field(
        description="seconds until the TTL releases it (agreed clock); null: no TTL"
    )


def _settings_model() -> type[BaseModel]:
    """``settings`` of ``GET /session/status``: one field per declared ``TOOLKV_*`` setting, its
    description the declaration's reason (``toolkv.core.settings``)."""
    fields: dict[str, Any] = {
        s.field: (s.kind | None, Field(default=None, description=f"{s.name}: {s.reason}")) for s in SETTINGS
    }
    model: type[BaseModel] = create_model(
        "Settings", __config__=ConfigDict(extra="allow"), __doc__="Every TOOLKV_* setting in force", **fields
    )
    return model


Settings = _settings_model()


class StatusMeta(DrainMeta):
    """The operator's view (``toolkv doctor``): everything of the server-wide kv_meta, and more."""

    version: str = Field(description="toolkv's version")
    sglang: str = Field(description="the sglang release the server runs")
    backend: str
    tp_size: int
    sessions: int
    counters: dict[str, int]
    settings: Settings = Field(description="every TOOLKV_* setting in force, by field name")  # type: ignore[valid-type]
    held: list[HeldSession] = Field(description="sessions holding KV, soonest expiry first, at most limit")


class ErrorBody(BaseModel):
    model_config = ConfigDict(extra="allow")
    error: str = Field(description="stable machine-readable code, e.g. stale_epoch")
    message: str


_ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorBody, "description": "Malformed body or parameter"},
    413: {"model": ErrorBody, "description": "Body over 4,096 bytes (refused as it is read)"},
    415: {"model": ErrorBody, "description": "Body not declared as application/json"},
    401: {"description": "Missing or wrong API key (sglang --api-key)"},
    404: {"model": ErrorBody, "description": "Unknown session"},
    409: {"model": ErrorBody, "description": "Stale epoch, wrong lifecycle state, or KV lost"},
    503: {
        "model": ErrorBody,
        "description": "Device memory full / no load slot (retry), toolkv unavailable, or the server is "
        "draining (tool_start: error draining)",
    },
    504: {"model": ErrorBody, "description": "Scheduler did not answer in time"},
    507: {"model": ErrorBody, "description": "Host pool or toolkv host budget exhausted"},
}


def _body_spec(model: type[BaseModel]) -> dict[str, Any]:
    return {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": model.model_json_schema()}},
        }
    }


# the two operator routes cannot be refused for a session: no 404, 409 or 507
_OPERATOR_ERRORS: dict[int | str, dict[str, Any]] = {
    k: v for k, v in _ERRORS.items() if k not in (404, 409, 507)
}
_OPERATOR_ERRORS[503] = {
    "model": ErrorBody,
    "description": "toolkv unavailable (not loaded in the scheduler)",
}


STATUS_LIMIT = QueryParam.of(StatusQuery, "limit")
KV_META_SESSION_ID = QueryParam.of(KvMetaQuery, "session_id")


def _query_spec(*params: QueryParam) -> dict[str, Any]:
    return {"parameters": [p.openapi() for p in params]}


_STATUS_QUERY = _query_spec(STATUS_LIMIT)
_KV_META_QUERY = _query_spec(KV_META_SESSION_ID)


# ---- reply registry and transports ------------------------------------------------------------------
class ReplyRegistry:
    """rid -> future. Replies for unknown rids (timed out, fire-and-forget) are dropped and
    counted, never delivered to another caller — unlike a queueing communicator."""

    def __init__(self) -> None:
        self._waiting: dict[str, asyncio.Future[ToolKVReqOutput]] = {}
        self.dropped = 0

    def expect(self, rid: str) -> asyncio.Future[ToolKVReqOutput]:
        fut: asyncio.Future[ToolKVReqOutput] = asyncio.get_running_loop().create_future()
        self._waiting[rid] = fut
        return fut

    def resolve(self, out: ToolKVReqOutput) -> None:
        fut = self._waiting.pop(out.rid, None) if out.rid is not None else None
        if fut is None or fut.done():
            self.dropped += 1
            return
        fut.set_result(out)

    def drop(self, rid: str) -> None:
        self._waiting.pop(rid, None)

    def __len__(self) -> int:
        return len(self._waiting)


class Transport(Protocol):
    async def call(self, req: Request) -> tuple[int, dict[str, Any]]: ...

    async def send_nowait(self, req: Request) -> None: ...


class ChannelTransport:
    """rid-keyed request/reply over a one-way send; subclasses provide ``_send``. The channel
    carries a request as its ``op`` and :meth:`Request.to_body` (a plain dict: either of sglang's
    wire formats encodes it); the scheduler rebuilds it (``Request.from_wire``)."""

    def __init__(self, *, timeout_s: float = 30.0) -> None:
        self.timeout_s = timeout_s
        self.replies = ReplyRegistry()

    async def ensure_ready(self) -> None:
        return None

    def _send(self, req: ToolKVReqInput) -> None:
        raise NotImplementedError

    async def call(self, req: Request) -> tuple[int, dict[str, Any]]:
        await self.ensure_ready()
        rid = f"toolkv-{uuid.uuid4().hex}"
        fut = self.replies.expect(rid)
        try:
            self._send(ToolKVReqInput(rid=rid, op=req.op, body=req.to_body()))
            out = await asyncio.wait_for(fut, self.timeout_s)
        except TimeoutError:
            raise SchedulerTimeout(
                f"scheduler did not answer {req.op} within {self.timeout_s}s; it may still apply (check kv_meta)"
            ) from None
        finally:
            self.replies.drop(rid)
        return int(out.status), dict(out.body)

    async def send_nowait(self, req: Request) -> None:
        """Send without waiting for the reply (its rid is not registered, so it is dropped)."""
        await self.ensure_ready()
        self._send(ToolKVReqInput(rid=f"toolkv-nowait-{uuid.uuid4().hex}", op=req.op, body=req.to_body()))


class TokenizerManagerTransport(ChannelTransport):
    """sglang's own TM -> scheduler channel: ``tm._dispatch_to_scheduler`` (tokenizer_manager.py:435)
    out, ``tm._result_dispatcher`` (built l.602, called from handle_loop l.1895) back.

    Before the first send it checks, through ``tm.get_internal_state()``, that every scheduler
    reports ``toolkv`` (plugin hook on ``Scheduler.get_internal_state``): a scheduler without the
    plugin would raise on the unknown request type (sglang/utils.py:677) and die.
    """

    def __init__(self, get_tm: Callable[[], Any], *, timeout_s: float = 30.0) -> None:
        super().__init__(timeout_s=timeout_s)
        self._get_tm = get_tm
        self._attached: Any = None
        self._ready = False
        self._lock: asyncio.Lock | None = None

    def _tm(self) -> Any:
        tm = self._get_tm()
        if tm is None:
            raise ToolKVUnavailable("the server is still starting")
        if self._attached is not tm:
            from sglang.utils import TypeBasedDispatcher

            tm._result_dispatcher += TypeBasedDispatcher([(ToolKVReqOutput, self.replies.resolve)])
            self._attached = tm
        return tm

    async def ensure_ready(self) -> None:
        if self._ready:
            return
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self._ready:
                return
            tm = self._tm()
            states = await tm.get_internal_state()
            bad = [i for i, s in enumerate(states) if not isinstance(s, dict) or "toolkv" not in s]
            if not states or bad:
                raise ToolKVUnavailable(
                    f"scheduler(s) {bad} do not run toolkv: is TOOLKV_ENABLE=1 set for the whole server?"
                )
            self._ready = True

    def _send(self, req: ToolKVReqInput) -> None:
        tm = self._tm()
        tm.auto_create_handle_loop()
        tm._dispatch_to_scheduler(req)


# ---- routes -----------------------------------------------------------------------------------------
def _error(e: ToolKVError) -> JSONResponse:
    return JSONResponse(status_code=e.http_status, content=e.to_dict())


async def _forward(transport: Transport, req: Request) -> JSONResponse:
    try:
        status, out = await transport.call(req)
    except ToolKVError as e:
        return _error(e)
    return JSONResponse(status_code=status, content=out)


def install_routes(app: FastAPI, transport: Transport) -> None:
    """Add the toolkv routes to ``app`` (sglang's, or a bare one in tests / for OpenAPI). Each
    route builds its request (:mod:`toolkv.core.requests`) from the body or the query, the one
    check at the edge, and forwards it."""

    async def tool_start(request: HTTPRequest) -> JSONResponse:
        """Offload (or, with the per-call policy, keep or let go) the session's KV for the duration
        of a tool call. Returns the new epoch and, with the policy, the decision and its reason."""
        try:
            req = ToolStart.from_body(await parse_body(request))
        except ToolKVError as e:
            return _error(e)
        return await _forward(transport, req)

    async def tool_end(request: HTTPRequest) -> JSONResponse:
        """Bring the session's KV back; ``epoch`` must be the one tool_start returned."""
        try:
            req = ToolEnd.from_body(await parse_body(request))
        except ToolKVError as e:
            return _error(e)
        return await _forward(transport, req)

    async def close(request: HTTPRequest) -> JSONResponse:
        """Forget the session and release everything toolkv holds for it."""
        try:
            req = Close.from_body(await parse_body(request))
        except ToolKVError as e:
            return _error(e)
        return await _forward(transport, req)

    async def kv_meta(request: HTTPRequest) -> JSONResponse:
        """One session's record (with ``session_id``), else server-wide metrics."""
        try:
            req = KvMetaQuery.from_body(parse_query(request, KV_META_SESSION_ID))
        except ToolKVError as e:
            return _error(e)
        return await _forward(transport, req)

    async def status(request: HTTPRequest) -> JSONResponse:
        """The operator's view of toolkv on this server (``toolkv doctor``). Read-only."""
        try:
            req = StatusQuery.from_body(parse_query(request, STATUS_LIMIT))
        except ToolKVError as e:
            return _error(e)
        return await _forward(transport, req)

    async def drain(request: HTTPRequest) -> JSONResponse:
        """Start (``{"drain": true}``, the default) or end (``{"drain": false}``) the drain; answers
        the drain's state. Idempotent: poll it, or ``GET /session/status``, until ``drained``."""
        try:
            req = Drain.from_body(await parse_body(request))
        except ToolKVError as e:
            return _error(e)
        return await _forward(transport, req)

    tags: list[str | Enum] = ["toolkv"]
    app.add_api_route(
        "/session/tool_start", tool_start, methods=["POST"], tags=tags, response_model=SessionMeta,
        responses=_ERRORS, openapi_extra=_body_spec(ToolStartBody), summary="Tool call starts: offload KV",
    )  # fmt: skip
    app.add_api_route(
        "/session/tool_end", tool_end, methods=["POST"], tags=tags, response_model=SessionMeta,
        responses=_ERRORS, openapi_extra=_body_spec(ToolEndBody), summary="Tool call ended: restore KV",
    )  # fmt: skip
    app.add_api_route(
        "/session/kv_meta", kv_meta, methods=["GET"], tags=tags, response_model=SessionMeta | ServerMeta,
        responses=_ERRORS, summary="Where a session's KV is, or server-wide metrics", openapi_extra=_KV_META_QUERY,
    )  # fmt: skip
    app.add_api_route(
        "/session/close", close, methods=["POST"], tags=tags, response_model=SessionMeta,
        responses=_ERRORS, openapi_extra=_body_spec(CloseBody), summary="Forget a session",
    )  # fmt: skip
    app.add_api_route(
        "/session/status", status, methods=["GET"], tags=tags, response_model=StatusMeta,
        responses=_OPERATOR_ERRORS, openapi_extra=_STATUS_QUERY,
        summary="toolkv on this server: release, settings, drain, sessions holding KV and their TTL left",
    )  # fmt: skip
    app.add_api_route(
        "/session/drain", drain, methods=["POST"], tags=tags, response_model=DrainMeta,
        responses=_OPERATOR_ERRORS, openapi_extra=_body_spec(DrainBody),
        summary="Refuse new tool calls (or accept them again) and report what is still held",
    )  # fmt: skip


def build_app(transport: Transport) -> FastAPI:
    """A FastAPI app with only toolkv's routes (tests, and the OpenAPI document)."""
    from toolkv import __version__

    app = FastAPI(title="toolkv session API (sglang plugin)", version=__version__)
    install_routes(app, transport)
    return app


class _NoTransport:
    async def call(self, req: Request) -> tuple[int, dict[str, Any]]:
        raise ToolKVUnavailable("documentation-only app")

    async def send_nowait(self, req: Request) -> None:
        raise ToolKVUnavailable("documentation-only app")


def openapi_document() -> dict[str, Any]:
    """The OpenAPI document of toolkv's routes (written to docs/openapi.json)."""
    doc: dict[str, Any] = build_app(_NoTransport()).openapi()
    return doc


_TOOL_CALLS = re.compile(r'"finish_reason"\s*:\s*"tool_calls"')


_TOOL_NAME = re.compile(r'"function"\s*:\s*\{\s*"name"\s*:\s*"([^"\\]{1,256})"')


def tool_call_name(chunk: Any) -> str | None:
    """The first tool's name in an SSE chat chunk (``"function":{"name":...}`` of a tool-call
    delta), or None. The name is what the per-call policy learns durations by."""
    if isinstance(chunk, bytes):
        chunk = chunk.decode("utf-8", "replace")
    if not isinstance(chunk, str):
        return None
    m = _TOOL_NAME.search(chunk)
    return m.group(1) if m else None


def is_tool_calls_chunk(chunk: Any) -> bool:
    """True for an SSE chat chunk whose finish_reason is "tool_calls"."""
    if isinstance(chunk, bytes):
        chunk = chunk.decode("utf-8", "replace")
    return isinstance(chunk, str) and _TOOL_CALLS.search(chunk) is not None
