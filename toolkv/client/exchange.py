"""One call of the session API without I/O, shared by the sync and the async client: the request
(built from ``toolkv.core.requests``), its retries and checks (``_Plan``), and ``_exchange``, a
generator that yields what to send or how long to sleep; each client drives it with its own httpx
client (``_Steps``). Also the record of one ``tool_call`` (:class:`ToolCall`).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, TypeVar

import httpx

from toolkv import errors
from toolkv.client.wire import (
    _MUTATING,
    _SPENT_S,
    DEFAULT_TOOL_CALL_DEADLINE_S,
    REFUSALS,
    DeadlineExceeded,
    KVMeta,
    RetryPolicy,
    ServerStatus,
    ToolKVNotRunning,
    TransportError,
    _applied,
    _as_meta,
    _body,
    _deadline_s,
    _outcome_unknown,
    _TimeLeft,
    error_from_response,
    transport_error,
)
from toolkv.core.phases import Phase
from toolkv.core.requests import KvMetaQuery, Request, StatusQuery, ToolStart

log = logging.getLogger("toolkv.client")
_T = TypeVar("_T")


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
    _http: httpx.Client | httpx.AsyncClient
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

    def __init__(self, client: _Base, call: _Call[_T], deadline: float | None) -> None:
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
