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
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Generator, Iterator
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Generic, Literal, TypeVar

import httpx

from toolkv import errors
from toolkv.core.requests import Close, Drain, KvMetaQuery, Request, StatusQuery, ToolEnd, ToolStart
from toolkv.core.result import OPEN_CALL, RECORD_KEYS
from toolkv.core.session.phases import Phase

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

log = logging.getLogger("toolkv.client")
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


class _Plan:
    """The retry logic of one call, shared by the sync and the async client (they differ only in
    how they send, sleep and probe). ``prior`` is tool_start's ``prior_epoch``."""

    def __init__(
        self,
        client: _Base,
        op: str,
        session_id: str | None,
        epoch: int | None,
        deadline: float | None = None,
    ) -> None:
        self.client, self.op, self.session_id, self.epoch = client, op, session_id, epoch
        self.prior = client._epochs.get(session_id) if op == "tool_start" and session_id else None
        self.attempt = 0
        self.resent = False
        # the overall deadline (time.monotonic()); None: each attempt has the client's timeout_s
        self.deadline = deadline
        self.sent = 0  # requests that left (attempts and probes), for DeadlineExceeded's details
        self.maybe_applied = False  # an attempt's outcome is unknown: it may still take effect

    def left(self) -> float:
        """Seconds left before the deadline (infinite without one)."""
        return float("inf") if self.deadline is None else self.deadline - time.monotonic()

    def extensions(self, base: httpx.Timeout) -> dict[str, Any]:
        """The request's extensions: the deadline's clipped timeouts (none without a deadline).
        Raises :class:`DeadlineExceeded` when nothing is left, so nothing is sent."""
        if self.deadline is None:
            return {}
        if self.left() <= 0:
            raise self.expired(None)
        self.sent += 1
        return {"timeout": _TimeLeft(base, self.deadline)}

    def expired(self, last: errors.ToolKVError | None) -> DeadlineExceeded:
        """The error for a deadline that ran out, after ``last`` (the last attempt's error)."""
        if last is not None:
            self.maybe_applied = self.maybe_applied or _outcome_unknown(last)
        after = f"; last: {last.code} ({last})" if last is not None else ""
        err = DeadlineExceeded(
            f"{self.op}: no answer within the deadline ({self.sent} request(s) sent{after})",
            attempts=self.attempt + 1,
        )
        err.applied_unknown = self.maybe_applied
        err.__cause__ = last
        return err

    def settle(self, err: errors.ToolKVError) -> errors.ToolKVError:
        """``err`` as the call's error: a timeout the deadline cut short is :class:`DeadlineExceeded`."""
        self.maybe_applied = self.maybe_applied or _outcome_unknown(err)
        if self.deadline is not None and isinstance(err, TransportError) and self.left() <= _SPENT_S:
            return self.expired(err)
        return err

    def wait(self, response: httpx.Response | None, last: errors.ToolKVError) -> float:
        """The pause before the next attempt; :class:`DeadlineExceeded` when it would end past the
        deadline (an attempt with no time left could only fail)."""
        delay = self.client.retry.delay(self.attempt, response)
        if delay >= self.left():
            raise self.expired(last)
        return delay

    def body(self, body: dict[str, Any] | None) -> dict[str, Any] | None:
        if body is not None and self.op == "tool_start" and self.prior is not None:
            return {**body, "prior_epoch": self.prior}
        return body

    def must_probe(self, err: errors.ToolKVError) -> bool:
        """Read kv_meta before deciding: the outcome is unknown, or a re-sent call was refused
        as wrong_state (its first attempt may be what moved the session). Not once the deadline
        has run out: the read could only fail."""
        if self.op not in _MUTATING or self.session_id is None or self.op not in self.client.retry.ops:
            return False  # not re-sent under this policy: one more round trip would only delay
        if self.left() <= _SPENT_S:
            return False
        return _outcome_unknown(err) or (self.resent and isinstance(err, errors.WrongState))

    def settled(self, meta: KVMeta | None) -> bool:
        """After a probe: True when ``meta`` shows the call applied (it is the answer)."""
        if meta is None:
            return False
        if _applied(self.op, meta, self.epoch, self.prior):
            return True
        if self.op == "tool_start" and meta.state == Phase.RUNNING:
            self.prior = meta.epoch  # a re-send carries it: the server recognises it if the first lands
        return False

    def again(self, err: errors.ToolKVError) -> bool:
        if self.attempt >= self.client.retry.retries or not self.client.retry.retries_on(self.op, err):
            return False
        return not (self.resent and isinstance(err, errors.WrongState))


class _Base:
    retry: RetryPolicy
    tool_call_deadline_s: float
    _epochs: dict[str, int]
    _said_not_running: bool = False  # tool_call has logged a server without toolkv (see _quiet)

    def _note(self, data: dict[str, Any]) -> None:
        """Remember the latest epoch per session (tool_start's ``prior_epoch``)."""
        sid, epoch = data.get("session_id"), data.get("epoch")
        if isinstance(sid, str) and isinstance(epoch, int) and not isinstance(epoch, bool):
            if data.get("state") == Phase.CLOSED:
                self._epochs.pop(sid, None)
            else:
                self._epochs[sid] = epoch

    def _tool_call(self, session_id: str, tool: str | None, deadline_s: float | None) -> ToolCall:
        """The record of one ``tool_call``, with the deadline each side of it has."""
        limit = self.tool_call_deadline_s if deadline_s is None else _deadline_s(deadline_s)
        return ToolCall(session_id, tool, deadline_s=limit)

    @contextlib.contextmanager
    def _side(self, call: ToolCall, op: str) -> Iterator[None]:
        """One side of a ``tool_call``: a toolkv error is kept in ``call``, logged, never raised."""
        try:
            yield
        except errors.ToolKVError as e:
            call._failed(op, e, quiet=op == "tool_start" and self._quiet(e))

    def _quiet(self, err: errors.ToolKVError) -> bool:
        """Whether :meth:`ToolCall._failed` logs ``err`` at DEBUG instead of WARNING: a server
        without toolkv (:class:`ToolKVNotRunning`) is said once per client at WARNING. Once an
        operator switches toolkv off (``TOOLKV_ENABLE=0``) every tool call gets that answer, and an
        agent's log should say so once, not once per tool call."""
        if not isinstance(err, ToolKVNotRunning):
            return False
        said = self._said_not_running
        self._said_not_running = True
        return said


# What one side of a tool call came to: ``accepted`` (toolkv answered; the record says what it did),
# ``refused`` (an answer about the session: unknown, stale epoch, host or device full, ...),
# ``failed`` (no usable answer: unreachable, 5xx, wrong API key), ``deadline_exceeded`` (no answer
# within the deadline: the tool ran anyway), ``not_sent``.
Outcome = Literal["accepted", "refused", "failed", "deadline_exceeded", "not_sent"]


@dataclass
class ToolCall:
    """One tool call under :meth:`ToolKVClient.tool_call`: what toolkv answered, for the record.

    ``start`` is tool_start's answer (None when it was refused or failed: the KV then stays where
    sglang keeps it), ``end`` tool_end's (None when refused or failed: the next request restores
    the session, or sglang reloads its prefix), ``failures`` every error swallowed on the way.
    ``start_outcome`` and ``end_outcome`` say what each side came to (:data:`Outcome`); tool_end is
    ``not_sent`` when tool_start got no answer (there is no epoch to end). ``deadline_s`` is the
    deadline each side had."""

    session_id: str
    tool: str | None = None
    start: KVMeta | None = None
    end: KVMeta | None = None
    failures: list[errors.ToolKVError] = field(default_factory=list)
    deadline_s: float = DEFAULT_TOOL_CALL_DEADLINE_S
    start_outcome: Outcome = "not_sent"
    end_outcome: Outcome = "not_sent"

    @property
    def offloaded(self) -> bool:
        return self.start is not None and self.start.state in (Phase.OFFLOADING, Phase.OFFLOADED)

    @property
    def deadline_exceeded(self) -> bool:
        """Either side ran out of time: toolkv did not answer within ``deadline_s``."""
        return "deadline_exceeded" in (self.start_outcome, self.end_outcome)

    def _answered(self, op: str, meta: KVMeta) -> None:
        if op == "tool_start":
            self.start, self.start_outcome = meta, "accepted"
        else:
            self.end, self.end_outcome = meta, "accepted"

    def _failed(self, op: str, err: errors.ToolKVError, *, quiet: bool = False) -> None:
        self.failures.append(err)
        outcome: Outcome = (
            "deadline_exceeded"
            if isinstance(err, DeadlineExceeded)
            else "refused"
            if err.code in REFUSALS
            else "failed"
        )
        if op == "tool_start":
            self.start_outcome = outcome
        else:
            self.end_outcome = outcome
        level = logging.DEBUG if outcome == "refused" or quiet else logging.WARNING
        log.log(
            level, "toolkv %s for session %s: %s (%s); the agent goes on", op, self.session_id, err.code, err
        )


# ---- the calls, sans I/O: what both clients send and how they retry, in one place -----------------
@dataclass(frozen=True)
class _Call(Generic[_T]):
    """One call of the session API as both clients send it: the operation (for the retry policy),
    the request, built from ``toolkv.core.requests`` (so checked before it is sent: a bad argument
    is refused here, as the server would), and how the answer's JSON object is read."""

    op: str
    method: str
    path: str
    read: Callable[[dict[str, Any]], _T]
    session_id: str | None = None
    body: dict[str, Any] | None = None
    params: dict[str, Any] | None = None

    @classmethod
    def post(cls, req: Request, read: Callable[[dict[str, Any]], _T]) -> _Call[_T]:
        return cls(req.op, "POST", req.path, read, getattr(req, "session_id", None), req.to_body())

    @classmethod
    def get(cls, req: Request, read: Callable[[dict[str, Any]], _T], params: bool = True) -> _Call[_T]:
        """A read (retried as ``kv_meta``); ``params``: the request's fields go in the query."""
        return cls(KvMetaQuery.op, "GET", req.path, read, params=(req.to_body() or None) if params else None)


def _tool_start(session_id: str, tool: str | None, expected_s: float | None) -> _Call[KVMeta]:
    return _Call.post(ToolStart(session_id, tool=tool, expected_s=expected_s), _as_meta)


def _server_status(limit: int | None) -> _Call[ServerStatus]:
    return _Call.get(
        StatusQuery() if limit is None else StatusQuery(limit), ServerStatus.from_json, limit is not None
    )


@dataclass(frozen=True)
class _Send:
    """An effect of :func:`_exchange`: send this request (its answer, or the typed error of a
    request that got none, goes back into the exchange)."""

    method: str
    path: str
    json: dict[str, Any] | None
    params: dict[str, Any] | None
    extensions: dict[str, Any] | None  # the deadline's clipped timeouts (None: the client's own)


@dataclass(frozen=True)
class _Sleep:
    """An effect of :func:`_exchange`: wait this long before the next attempt."""

    seconds: float


_Effect = _Send | _Sleep
_Exchange = Generator[_Effect, Any, _T]


def _exchange(
    client: _Base, call: _Call[Any], deadline: float | None, timeout: httpx.Timeout
) -> _Exchange[dict[str, Any]]:
    """One call with its retries and its error mapping, without I/O: it yields what to send (or how
    long to sleep) and is sent the answer (or thrown the :class:`TransportError` of a request that
    got none). The sync and the async client each drive it (:class:`_Steps`) with their httpx client.
    A deadline with nothing left raises :class:`DeadlineExceeded` before anything is sent."""
    epoch = None if call.body is None else call.body.get("epoch")
    plan = _Plan(client, call.op, call.session_id, epoch, deadline)
    while True:
        response: httpx.Response | None = None
        try:
            extensions = plan.extensions(timeout) or None
            response = yield _Send(call.method, call.path, plan.body(call.body), call.params, extensions)
            assert response is not None
            if response.status_code == 200:
                data = _body(response)
                client._note(data)
                return data
            err = error_from_response(response)
        except DeadlineExceeded:
            raise
        except errors.ToolKVError as e:
            err = plan.settle(e)
            if isinstance(err, DeadlineExceeded):
                raise err from e
        if plan.must_probe(err) and call.session_id is not None:
            meta = yield from _probe(call.session_id, plan, timeout)
            if plan.settled(meta):
                assert meta is not None
                data = meta.json()
                client._note(data)
                return data
        if not plan.again(err):
            raise err
        yield _Sleep(plan.wait(response, err))
        plan.attempt += 1
        plan.resent = plan.resent or call.op in _MUTATING


def _probe(session_id: str, plan: _Plan, timeout: httpx.Timeout) -> _Exchange[KVMeta | None]:
    """One kv_meta read, no retry; None when it fails (the caller's error stands)."""
    try:
        extensions = plan.extensions(timeout) or None
        r = yield _Send("GET", KvMetaQuery.path, None, {"session_id": session_id}, extensions)
        return _as_meta(_body(r)) if r.status_code == 200 else None
    except errors.ToolKVError:
        return None


class _Steps(Generic[_T]):
    """Drives :func:`_exchange` for a client: iterate for the effects, set :attr:`answer` inside
    :meth:`answering` (which maps a failed send to its :class:`TransportError`), read :attr:`value`."""

    def __init__(
        self, client: ToolKVClient | AsyncToolKVClient, call: _Call[_T], deadline: float | None
    ) -> None:
        self.call = call
        self.answer: httpx.Response | None = None
        self._steps = _exchange(client, call, deadline, client._http.timeout)
        self._failed: errors.ToolKVError | None = None

    def __iter__(self) -> Iterator[_Effect]:
        try:
            while True:
                failed, answer, self._failed, self.answer = self._failed, self.answer, None, None
                yield self._steps.send(answer) if failed is None else self._steps.throw(failed)
        except StopIteration as done:
            self.value: _T = self.call.read(done.value)

    @contextlib.contextmanager
    def answering(self, send: _Send) -> Iterator[None]:
        try:
            yield
        except httpx.TransportError as e:
            self._failed = transport_error(e, f"{send.method} {send.path}")


class ToolKVClient(_Base):
    """Blocking client. ``base_url`` is the sglang server (e.g. ``http://127.0.0.1:30000``).

    Failures are retried under ``retry`` (see :class:`RetryPolicy`); ``sleep`` is how the client
    waits between attempts; ``timeout_s`` bounds each HTTP wait of a call without a deadline.
    ``tool_call_deadline_s`` is :meth:`tool_call`'s deadline for each side of the tool (see
    there). Every error is a :class:`toolkv.errors.ToolKVError`."""

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


# ---- sglang's own hint channel (kv_hints, sglang 0.5.23) ------------------------------------------
KV_HINTS_ACTIONS = ("tool_start", "retain", "prefetch")


def kv_hints(
    action: str = "tool_start",
    *,
    tool: str | None = None,
    expected_s: float | None = None,
    prior_epoch: int | None = None,
    action_id: str | None = None,
    message_id: str | None = None,
) -> dict[str, Any]:
    """The ``kv_hints`` envelope that asks toolkv for ``action`` when this request finishes, for
    the request body (``extra_body={"session_id": sid, "kv_hints": kv_hints("tool_start",
    tool="search")}`` with the OpenAI client, or a ``/generate`` body): no extra round trip. The
    outcome comes back in the response's ``meta_info`` (:func:`kv_hints_outcome`).

    ``action``: ``tool_start`` (as ``ToolKVClient.tool_start``), ``retain`` (keep the KV on the GPU
    if there is spare room, else a tool_start) or ``prefetch`` (a tool_start whose ``expected_s``,
    required, times an early restore). Needs sglang 0.5.23 on the server: 0.5.16 has no
    ``kv_hints`` and drops the field, so no outcome comes back (use :meth:`ToolKVClient.tool_call`).
    Validated here as the server does, so a bad hint fails in the agent, not as a ``rejected``."""
    if action not in KV_HINTS_ACTIONS:
        raise ValueError(f"action must be one of {', '.join(KV_HINTS_ACTIONS)}, not {action!r}")
    if expected_s is None and action == "prefetch":
        raise ValueError("a prefetch needs expected_s: when the tool is expected back")
    if prior_epoch is not None and action != "tool_start":
        raise ValueError("prior_epoch only goes with a tool_start")
    given = {"tool": tool, "expected_s": expected_s, "prior_epoch": prior_epoch}
    payload: dict[str, Any] = {}
    for name, value in given.items():
        if value is not None:
            try:  # the bounds the server checks: the HTTP tool_start's own (toolkv.core.requests)
                payload[name] = ToolStart.check(name, value)
            except errors.BadRequest as e:
                raise ValueError(e.message) from None
    if expected_s is not None:
        payload["expected_s"] = float(expected_s)
    import uuid

    return {
        "protocol_version": "1",
        "message_id": message_id or uuid.uuid4().hex,
        "actions": [
            {
                "action_id": action_id or f"toolkv-{action}",
                "action_type": f"toolkv.{action}",
                "action_version": "1",
                "payload": payload,
            }
        ],
    }


def kv_hints_outcome(meta_info: Any) -> dict[str, Any] | None:
    """toolkv's answer to a request's ``kv_hints`` from its ``meta_info`` (a ``/generate``
    response's ``meta_info``; a chat completion's ``choices[0].meta_info`` with
    ``return_meta_info: true``; or the last chunk of a stream): ``{"outcome": "accepted" |
    "clipped" | "deferred" | "rejected", "epoch", "state", "reason", ...}``. A streamed response
    keeps sglang's per-token list (the outcome is its last entry). None when the server sent no
    outcome: sglang 0.5.16 (no ``kv_hints``), toolkv not running, or no toolkv action."""
    if not isinstance(meta_info, dict):
        return None
    value = meta_info.get("toolkv")
    if isinstance(value, list):
        value = next((v for v in reversed(value) if isinstance(v, dict)), None)
    return dict(value) if isinstance(value, dict) and "outcome" in value else None
