"""What crosses the wire, as the client reads it: the typed errors (rebuilt from the server's error
code, or made for a request that got no answer), the answers (``KVMeta``, ``ServerMeta``,
``DrainStatus``, ``ServerStatus``), the retry policy and the deadline's clipped timeouts. No I/O.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, TypeVar

import httpx

from toolkv import errors
from toolkv.core.phases import Phase
from toolkv.core.requests import Close, KvMetaQuery, ToolEnd, ToolStart
from toolkv.core.result import OPEN_CALL, RECORD_KEYS
from toolkv.errors import SchedulerTimeout, ToolKVUnavailable

_T = TypeVar("_T")


class Unauthorized(errors.ToolKVError):
    """401/403: the server runs with ``--api-key`` and the key is missing or wrong."""

    http_status = 401
    code = "unauthorized"


_BY_CODE: dict[str, type[errors.ToolKVError]] = {
    cls.code: cls
    for cls in (
        errors.BadRequest,
        errors.UnsupportedMediaType,
        errors.PayloadTooLarge,
        errors.UnknownSession,
        errors.StaleEpoch,
        errors.WrongState,
        errors.SessionKVLost,
        errors.HostMemoryFull,
        errors.Unsupported,
        errors.DeviceMemoryFull,
        errors.Draining,
        ToolKVUnavailable,
        SchedulerTimeout,
        Unauthorized,
    )
}


class TransportError(errors.ToolKVError):
    """No HTTP answer came back (``http_status`` 0). ``applied_unknown`` says whether the server
    may have applied the call: False when the request never left (connection refused), True when
    it was sent and the answer was lost (timeout, dropped connection). The ``httpx`` exception is
    the ``__cause__``."""

    http_status = 0
    code = "transport_error"
    applied_unknown = True


class ServerUnreachable(TransportError):
    """The request never reached the server (connection refused, DNS, connect timeout, no
    connection free in the pool): nothing changed there."""

    code = "server_unreachable"
    applied_unknown = False


class NoReply(TransportError):
    """The request was sent but no complete answer came back within ``timeout_s`` (or the
    connection dropped): the call may have been applied. Check ``kv_meta``, or send it again:
    every call is idempotent by epoch."""

    code = "no_reply"


class DeadlineExceeded(TransportError):
    """The call's overall deadline (``deadline_s``; ``tool_call``'s ``tool_call_deadline_s``) ran
    out before an answer came: ``tool_call`` then runs the tool anyway. ``applied_unknown`` is True
    when an attempt that may have reached the scheduler was cut off (its ``tool_start`` may still
    take effect: the session's next request restores it, or the TTL releases it), False when no
    attempt got that far. ``details["attempts"]`` counts the requests sent."""

    code = "deadline_exceeded"


# The shortest wait an HTTP phase is given once the deadline is (nearly) spent: a positive timeout
# (0 would make the socket non-blocking, a different error), short enough not to matter.
_MIN_WAIT_S = 0.001
# A timeout that fires with less than this left was the deadline's (clocks poll in milliseconds).
_SPENT_S = 0.01
DEFAULT_TOOL_CALL_DEADLINE_S = 5.0


def _deadline_s(value: float) -> float:
    """A deadline in seconds, refused here (``ValueError``) rather than as a call that never waits."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise ValueError(f"a deadline must be a finite number of seconds > 0, not {value!r}")
    return float(value)


def _at(deadline_s: float | None) -> float | None:
    """The ``time.monotonic()`` instant ``deadline_s`` seconds from now (None: no deadline)."""
    return None if deadline_s is None else time.monotonic() + _deadline_s(deadline_s)


class _TimeLeft(dict[str, float | None]):
    """httpcore's per-request ``timeout`` extension whose values are computed when they are read.

    httpx's timeouts apply per phase (wait for a pooled connection, connect, write, read): four
    phases with a fixed value each could together wait four times the time left. httpcore reads
    each phase's timeout from this mapping when that phase starts, so each one gets the client's
    own timeout clipped to what is left of the deadline *then*, and a slow connect leaves the read
    less time instead of a full allowance."""

    def __init__(self, base: httpx.Timeout, deadline: float) -> None:
        super().__init__(base.as_dict())
        self._deadline = deadline

    def _clip(self, cap: float | None) -> float:
        left = max(_MIN_WAIT_S, self._deadline - time.monotonic())
        return left if cap is None else min(cap, left)

    def get(self, key: str, default: Any = None) -> float:  # type: ignore[override]
        return self._clip(super().get(key, default))

    def __getitem__(self, key: str) -> float:
        return self._clip(super().__getitem__(key))


_NOT_SENT: tuple[type[Exception], ...] = (
    httpx.ConnectError,
    httpx.ConnectTimeout,
    httpx.PoolTimeout,
    httpx.UnsupportedProtocol,
    httpx.ProxyError,
)


def transport_error(exc: Exception, what: str) -> TransportError:
    """The typed error for an ``httpx`` failure without a response (``what``: the call)."""
    if isinstance(exc, _NOT_SENT):
        err: TransportError = ServerUnreachable(f"{what}: server not reachable ({type(exc).__name__}: {exc})")
    else:
        err = NoReply(f"{what}: no answer ({type(exc).__name__}: {exc}); it may have been applied")
    err.__cause__ = exc
    return err


# Where no tool_end was applied at the session's epoch (a tool_end there is refused).
_NOT_ENDED = OPEN_CALL | {Phase.NEW, Phase.EXPIRED, Phase.LOST, Phase.CLOSED}
_MUTATING = frozenset({ToolStart.op, ToolEnd.op, Close.op})
ALL_OPS = frozenset({*_MUTATING, KvMetaQuery.op})
# Refusal codes: an answer about the session, not a fault; the tool_call helper logs them at DEBUG.
REFUSALS = frozenset(
    {
        errors.UnknownSession.code,
        errors.StaleEpoch.code,
        errors.WrongState.code,
        errors.SessionKVLost.code,
        errors.HostMemoryFull.code,
        errors.DeviceMemoryFull.code,
        errors.Draining.code,  # the operator drains the server: the tool runs without toolkv
    }
)


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

    def json(self) -> dict[str, Any]:
        """The record as the server sent it (its fixed keys over the rest)."""
        return {**self.extra, **{k: getattr(self, k) for k in RECORD_KEYS}}

    @property
    def replayed(self) -> bool:
        """The server recognised a re-sent call it had already applied and changed nothing."""
        return bool(self.extra.get("replayed", False))


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


@dataclass(frozen=True)
class DrainStatus:
    """``POST /session/drain``'s answer (and part of :class:`ServerStatus`): whether new tool calls
    are refused, and what is still held. ``drained``: draining and nothing held any more, so
    toolkv can be switched off or sglang upgraded without cutting a tool call off."""

    draining: bool
    drained: bool
    held_sessions: int
    held_tokens: int
    drain_refused: int
    drain_since: float | None
    states: dict[str, int]
    raw: dict[str, Any]

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> DrainStatus:
        since = d.get("drain_since")
        return cls(
            draining=bool(d.get("draining", False)),
            drained=bool(d.get("drained", False)),
            held_sessions=int(d.get("held_sessions") or 0),
            held_tokens=int(d.get("held_tokens") or 0),
            drain_refused=int(d.get("drain_refused") or 0),
            drain_since=None if since is None else float(since),
            states=dict(d.get("states") or {}),
            raw=d,
        )


@dataclass(frozen=True)
class HeldSession:
    """A session that holds KV in :class:`ServerStatus`: its record, and the seconds left before
    its TTL releases it (None: no TTL runs, e.g. a restore in flight)."""

    meta: KVMeta
    ttl_left_s: float | None

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> HeldSession:
        left = d.get("ttl_left_s")
        return cls(meta=KVMeta.from_json(d), ttl_left_s=None if left is None else float(left))


@dataclass(frozen=True)
class ServerStatus:
    """``GET /session/status`` (``toolkv doctor``): toolkv's and sglang's releases, the backend,
    every setting in force, the drain, sessions by state and those that hold KV (soonest expiry
    first, at most the ``limit`` asked for; ``drain.held_sessions`` counts them all)."""

    version: str
    sglang: str
    backend: str
    tp_size: int
    settings: dict[str, Any]
    sessions: int
    states: dict[str, int]
    counters: dict[str, int]
    drain: DrainStatus
    held: list[HeldSession]
    raw: dict[str, Any]

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ServerStatus:
        try:
            return cls(
                version=str(d.get("version", "")),
                sglang=str(d.get("sglang", "")),
                backend=str(d.get("backend", "")),
                tp_size=int(d.get("tp_size") or 1),
                settings=dict(d.get("settings") or {}),
                sessions=int(d.get("sessions") or 0),
                states=dict(d.get("states") or {}),
                counters=dict(d.get("counters") or {}),
                drain=DrainStatus.from_json(d),
                held=[HeldSession.from_json(h) for h in d.get("held") or ()],
                raw=d,
            )
        except (KeyError, TypeError, ValueError) as e:
            raise HTTPFailure(f"the answer is not toolkv's status ({type(e).__name__}: {e})") from None


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


@dataclass(frozen=True)
class RetryPolicy:
    """Which failures the client sends again, and how long it waits in between.

    Retried, for the operations in ``ops`` only: failures whose outcome is unknown or transient,
    i.e. no answer (:class:`TransportError`), 504 (the scheduler did not answer in time), 503
    ``toolkv_unavailable`` (toolkv still starting) and a proxy's 502/503. A refusal (a 4xx,
    ``device_memory_full``, ``host_memory_full``) is an answer and is not retried unless its code
    is in ``refusals``.

    The default leaves ``tool_end`` out of ``ops`` because a retried ``tool_end`` only delays the
    agent's next turn: when it fails, the next request restores the session on arrival
    (``TOOLKV_RESTORE_ON_REQUEST``) or sglang's own load-back serves its prefix. Waits
    ``backoff_s * 2**attempt`` seconds, or the server's ``Retry-After``, never more than
    ``max_backoff_s``; at most ``retries`` retries. Before re-sending a call whose outcome is
    unknown, the client reads ``kv_meta`` and returns it when it already shows the call's effect."""

    retries: int = 2
    backoff_s: float = 0.1
    max_backoff_s: float = 1.0
    ops: frozenset[str] = frozenset({ToolStart.op, KvMetaQuery.op, Close.op})
    refusals: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        if self.retries < 0 or self.backoff_s < 0 or self.max_backoff_s < 0:
            raise ValueError("retries and backoff must be >= 0")
        unknown = set(self.ops) - ALL_OPS
        if unknown:
            raise ValueError(f"unknown operation(s) {sorted(unknown)}; known: {sorted(ALL_OPS)}")

    def delay(self, attempt: int, response: httpx.Response | None = None) -> float:
        wait: float = self.backoff_s * float(2**attempt)
        after = None if response is None else response.headers.get("retry-after")
        if after is not None:
            with contextlib.suppress(ValueError):
                wait = float(after)
        return max(0.0, min(wait, self.max_backoff_s))

    def retries_on(self, op: str, err: errors.ToolKVError) -> bool:
        """Whether ``err`` from ``op`` is worth sending again under this policy."""
        if op not in self.ops:
            return False
        if err.code in self.refusals:
            return True
        if isinstance(err, (TransportError, SchedulerTimeout)):
            return True
        if isinstance(err, ToolKVNotRunning):  # the route does not exist: a retry cannot help
            return False
        if isinstance(err, ToolKVUnavailable):
            return True
        return isinstance(err, HTTPFailure) and err.http_status in (502, 503)


# the first answer, as it came: no re-send and no kv_meta read to reconcile a lost one
NO_RETRY = RetryPolicy(retries=0, ops=frozenset())


def _outcome_unknown(err: errors.ToolKVError) -> bool:
    return isinstance(err, SchedulerTimeout) or (isinstance(err, TransportError) and err.applied_unknown)


def _applied(op: str, meta: KVMeta, epoch: int | None, prior: int | None = None) -> bool:
    """Does ``kv_meta`` show that ``op`` took effect (after an answer that does not say)?

    ``tool_start``: the session is in a tool call, at the epoch after ``prior`` when the client
    knew it. ``tool_end``: the call of ``epoch`` is over (whatever phase follows: Restoring,
    Runnable, the next turn's Running, ...). ``close``: Closed."""
    if op == "tool_start":
        if prior is None:
            return meta.state in OPEN_CALL
        return meta.epoch == prior + 1 and meta.state not in (Phase.NEW, Phase.RUNNING, Phase.CLOSED)
    if op == "tool_end":
        return meta.epoch == epoch and meta.state not in _NOT_ENDED
    if op == "close":
        return meta.state == Phase.CLOSED
    return False


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _body(r: httpx.Response) -> dict[str, Any]:
    """A 200's JSON object; a success without one (a proxy's page) is an :class:`HTTPFailure`."""
    try:
        data = r.json()
    except ValueError:
        data = None
    if not isinstance(data, dict):
        err = HTTPFailure(f"HTTP {r.status_code} without toolkv's JSON body: {r.text[:200]!r}")
        err.http_status = r.status_code
        raise err
    return data


def _as_meta(data: dict[str, Any]) -> KVMeta:
    try:
        return KVMeta.from_json(data)
    except (KeyError, TypeError, ValueError) as e:
        raise HTTPFailure(f"the answer is not a session record ({type(e).__name__}: {e})") from None
