"""The session API's requests as typed objects, declared once: what each call carries and its bounds.

Each request is a frozen dataclass whose fields are declared with :func:`arg` (kind, bound, the
one line the published schema shows). Everything else reads these declarations:

* the HTTP routes (``toolkv.sglang.http_api``) build a request from the body or the query with
  :meth:`Request.from_body`: the one check at the edge, a 400 :class:`~toolkv.errors.BadRequest`
  naming the field;
* the pydantic models of docs/openapi.json are generated from the same fields
  (``http_api.body_model``), so the schema and the check cannot disagree;
* the control channel carries a request as its ``op`` and :meth:`Request.to_body`, and the
  scheduler rebuilds it with :meth:`Request.from_wire` without checking it again (it was checked
  when it was built); in-process callers (the twin, ``kv_hints``, the tests) go through
  :func:`parse`, which checks;
* the scheduler side dispatches by type through a table (``SchedulerToolKV._handlers``), and the
  manager takes a :class:`ToolStart` as it is (``ToolKVManager.start``): it checks nothing again.

Standard library only (and :mod:`toolkv.core.settings`, :mod:`toolkv.errors`): the client builds
its bodies from these types too, and it is installed without the server.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import MISSING, Field, dataclass, field, fields
from typing import Any, ClassVar, TypeVar

from toolkv.core.settings import BY_FIELD, POLICY_NAMES, PolicyName
from toolkv.errors import BadRequest

MAX_SESSION_ID = 512  # characters of a session id
MAX_TOOL_NAME = 256  # characters of a tool's name
STATUS_LIMIT_DEFAULT = 20  # GET /session/status lists this many of the sessions that hold KV
STATUS_LIMIT_MAX = 1000  # ... and never more: the reply travels through sglang's ZMQ channel

Kind = type[str] | type[int] | type[float] | type[bool] | type[PolicyName]


@dataclass(frozen=True)
class Arg:
    """One field of a request: its JSON kind, its bounds and the line the schema shows. ``optional``:
    the field may be left out (its default applies); ``nullable``: it may be null (its default is)."""

    kind: Kind
    description: str
    optional: bool = False
    nullable: bool = False
    min_length: int | None = None
    max_length: int | None = None
    ge: int | float | None = None
    le: int | float | None = None

    def refusal(self, name: str) -> BadRequest:
        if self.kind is str:
            what = f"a string of {self.min_length} to {self.max_length} characters"
        elif self.kind is PolicyName:
            what = f"one of {', '.join(POLICY_NAMES)}"
        elif self.kind is bool:
            what = "true or false"
        elif self.kind is int:
            what = "an integer " + (
                f"from {self.ge} to {self.le}" if self.le is not None else f">= {self.ge}"
            )
        else:
            what = f"a finite number >= {self.ge}"
        return BadRequest(f"{name} must be {what}", field=name)

    def check(self, name: str, value: object) -> object:
        """``value`` if it is what the field accepts (a policy's name as :class:`PolicyName`), else
        the :class:`BadRequest` naming the field. JSON's kinds, strictly: no bool for a number, no
        float for an integer, no string for anything else."""
        if value is None:
            if self.nullable:
                return None
            raise BadRequest(f"{name}: field required", field=name)
        if self.kind is bool:
            ok = isinstance(value, bool)
        elif self.kind is str:
            ok = isinstance(value, str) and (self.min_length or 0) <= len(value) <= (
                self.max_length or math.inf
            )
        elif self.kind is PolicyName:
            ok = isinstance(value, str) and value in POLICY_NAMES
        elif isinstance(value, bool):
            ok = False
        elif self.kind is int:
            ok = isinstance(value, int) and self._in_range(value)
        else:
            ok = isinstance(value, (int, float)) and math.isfinite(value) and self._in_range(value)
        if not ok:
            raise self.refusal(name)
        return PolicyName(str(value)) if self.kind is PolicyName else value

    def _in_range(self, value: float) -> bool:
        return (self.ge is None or value >= self.ge) and (self.le is None or value <= self.le)


def arg(kind: Kind, description: str, *, default: object = MISSING, **bounds: Any) -> Any:
    """A request field declared with its :class:`Arg` (a default makes it optional)."""
    spec = Arg(kind, description, optional=default is not MISSING, nullable=default is None, **bounds)
    return field(default=default, metadata={"arg": spec})


R = TypeVar("R", bound="Request")


@dataclass(frozen=True)
class Request:
    """A request of the session API. ``op`` is its name on the control channel; ``decides``: a call
    that can change something (one decision line and one ``decisions_total`` sample each)."""

    op: ClassVar[str]
    decides: ClassVar[bool] = False
    path: ClassVar[str] = ""  # its HTTP route ("": none, a call from inside the server)

    def __post_init__(self) -> None:
        for f in fields(self):
            value = arg_of(f).check(f.name, getattr(self, f.name))
            if value is not getattr(self, f.name):
                object.__setattr__(self, f.name, value)

    @classmethod
    def from_body(cls: type[R], body: Mapping[str, object]) -> R:
        """The request a JSON object (a body, or a route's query) asks for; unknown fields refused."""
        missing = [f.name for f in fields(cls) if f.name not in body and not arg_of(f).optional]
        if missing:
            raise BadRequest(f"{missing[0]}: field required", field=missing[0])
        names = {f.name for f in fields(cls)}
        extra = [k for k in body if k not in names]
        if extra:
            raise BadRequest(f"{extra[0]}: extra inputs are not permitted", field=extra[0])
        return cls(**body)  # type: ignore[arg-type]

    @classmethod
    def from_wire(cls: type[R], body: Mapping[str, object]) -> R:
        """The request as the control channel carries it (:meth:`to_body` of one that was checked
        when it was built): rebuilt without checking it again."""
        out = object.__new__(cls)
        for f in fields(cls):
            value = body.get(f.name, f.default)
            if arg_of(f).kind is PolicyName and value is not None:
                value = PolicyName(str(value))
            object.__setattr__(out, f.name, value)
        return out

    def to_body(self) -> dict[str, object]:
        """The JSON object that asks for this request (fields left at None are left out)."""
        out: dict[str, object] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None:
                out[f.name] = value.value if isinstance(value, PolicyName) else value
        return out

    @classmethod
    def check(cls, name: str, value: object) -> object:
        """``value`` checked as the field ``name`` (what the ``kv_hints`` payloads share with the
        HTTP bodies)."""
        return arg_of(next(f for f in fields(cls) if f.name == name)).check(name, value)

    @classmethod
    def args(cls) -> list[tuple[str, Arg, object]]:
        """(name, declaration, default) of each field, in order (the schema generator reads them)."""
        return [(f.name, arg_of(f), None if f.default is MISSING else f.default) for f in fields(cls)]


def arg_of(f: Field[Any]) -> Arg:
    spec: Arg = f.metadata["arg"]
    return spec


_SESSION_ID = "The session label used on generate/chat requests"
_POLICY_DOC = (
    "The policy of this call (optional), overriding the server's TOOLKV_POLICY: " + BY_FIELD["policy"].reason
)


def _session_id(description: str = _SESSION_ID) -> Any:
    return arg(str, description, min_length=1, max_length=MAX_SESSION_ID)


@dataclass(frozen=True)
class ToolStart(Request):
    """``POST /session/tool_start``: offload (or, by the call's policy, keep or let go) the KV."""

    op: ClassVar[str] = "tool_start"
    path: ClassVar[str] = "/session/tool_start"
    decides: ClassVar[bool] = True
    session_id: str = _session_id()
    tool: str | None = arg(
        str, "The tool's name (optional): the per-call policy learns its durations",
        default=None, min_length=1, max_length=MAX_TOOL_NAME,
    )  # fmt: skip
    expected_s: float | None = arg(
        float, "The client's own estimate of the tool's duration", default=None, ge=0
    )
    prior_epoch: int | None = arg(
        int, "The session's epoch the client last saw (optional). A tool_start already applied "
        "since then (its reply was lost) is answered with the session's record, marked replayed, "
        "instead of 409 wrong_state", default=None, ge=0,
    )  # fmt: skip
    policy: PolicyName | None = arg(PolicyName, _POLICY_DOC, default=None)  # noqa: RUF009 (a field)


@dataclass(frozen=True)
class ToolEnd(Request):
    """``POST /session/tool_end``: bring the KV back for the tool call ``epoch``."""

    op: ClassVar[str] = "tool_end"
    path: ClassVar[str] = "/session/tool_end"
    decides: ClassVar[bool] = True
    session_id: str = _session_id()
    epoch: int = arg(int, "The epoch returned by the matching tool_start", ge=0)


@dataclass(frozen=True)
class Close(Request):
    """``POST /session/close``: forget the session and release everything it holds."""

    op: ClassVar[str] = "close"
    path: ClassVar[str] = "/session/close"
    decides: ClassVar[bool] = True
    session_id: str = _session_id()


@dataclass(frozen=True)
class AutoOffload(Request):
    """Zero-change: a chat turn ended in tool calls. Like a tool_start, but a no-op (not an error)
    for sessions toolkv does not track or that are busy."""

    op: ClassVar[str] = "auto_offload"
    decides: ClassVar[bool] = True
    session_id: str = _session_id()
    tool: str | None = arg(str, "The model's tool name", default=None, min_length=1, max_length=MAX_TOOL_NAME)


@dataclass(frozen=True)
class KvMetaQuery(Request):
    """``GET /session/kv_meta``: one session's record, or (no ``session_id``) server-wide metrics."""

    op: ClassVar[str] = "kv_meta"
    path: ClassVar[str] = "/session/kv_meta"
    session_id: str | None = arg(
        str, "Omit for server-wide metrics", default=None, min_length=1, max_length=MAX_SESSION_ID
    )


@dataclass(frozen=True)
class StatusQuery(Request):
    """``GET /session/status``: the operator's view (``toolkv doctor``)."""

    op: ClassVar[str] = "server_status"
    path: ClassVar[str] = "/session/status"
    limit: int = arg(
        int, "How many of the sessions that hold KV to list (soonest expiry first)",
        default=STATUS_LIMIT_DEFAULT, ge=0, le=STATUS_LIMIT_MAX,
    )  # fmt: skip


@dataclass(frozen=True)
class Drain(Request):
    """``POST /session/drain``: start or end the drain."""

    op: ClassVar[str] = "drain"
    path: ClassVar[str] = "/session/drain"
    drain: bool = arg(
        bool,
        "true (the default): refuse new tool_start calls until the drain ends; false: end it",
        default=True,
    )


@dataclass(frozen=True)
class Handshake(Request):
    """What the HTTP side checks before its first call (the plugin's ``get_internal_state``)."""

    op: ClassVar[str] = "status"


#: every request by its name on the control channel: the one list of the operations
REQUESTS: dict[str, type[Request]] = {
    r.op: r for r in (ToolStart, ToolEnd, KvMetaQuery, Close, AutoOffload, Handshake, Drain, StatusQuery)
}
#: the calls that can change something (one decision line each)
DECIDING: frozenset[str] = frozenset(op for op, r in REQUESTS.items() if r.decides)


def parse(op: str, body: Mapping[str, object]) -> Request:
    """The request ``op`` with ``body``, checked (in-process callers of the scheduler side)."""
    kind = REQUESTS.get(op)
    if kind is None:
        raise BadRequest(f"unknown toolkv operation {op!r}")
    if not isinstance(body, Mapping):
        raise BadRequest("request body must be a JSON object")
    return kind.from_body(body)


def from_wire(op: str, body: Mapping[str, object]) -> Request:
    """The request the control channel carried (see :meth:`Request.from_wire`)."""
    kind = REQUESTS.get(op)
    if kind is None:
        raise BadRequest(f"unknown toolkv operation {op!r}")
    return kind.from_wire(body)
