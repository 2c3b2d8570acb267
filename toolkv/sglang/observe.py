"""What operators see of toolkv's decisions: one structured log line each, and the metrics.

:class:`DecisionLog` sits between the scheduler-side handler and the manager. It is told every
control decision with its result (accepted, refused with a code, skipped with a reason) and, from
the tick, when an accepted offload or restore completes and when the TTL sweep or a tree reset
ends a protection. Each decision is one logfmt line on the ``toolkv`` logger::

    toolkv decision op=tool_start session=agent-7 epoch=3 state=Offloading tokens=2048 outcome=ok reason=- rank=0

``outcome`` is ``ok``, ``refused`` or ``skipped``; ``reason`` the refusal code or skip reason.
A ``tool_end`` line also names the epoch the call carried (``asked=``, after ``rank``), so that a
stale-epoch refusal can be checked (``toolkv trace-check --decisions``, :mod:`toolkv.verify.toolkv.decisions`).
TP rank 0 logs at INFO, the other ranks (which take the same decisions) at DEBUG.

Completion times are measured with the local monotonic clock: they are reported, never decided on,
so they need no agreement across ranks. The idle tick costs one truth test of a dict.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Callable, Mapping
from typing import Any

from toolkv.core.lifecycle import HOLDING
from toolkv.core.manager import ToolKVManager
from toolkv.core.phases import Phase
from toolkv.sglang.metrics import ToolKVMetrics

log = logging.getLogger("toolkv")

_PLAIN = re.compile(r"[A-Za-z0-9_.:/@+-]{1,128}")
# (op whose acceptance starts it, state it waits in, state that completes it, metrics kind)
_INFLIGHT: dict[str, tuple[str, str]] = {
    Phase.OFFLOADING: (Phase.OFFLOADED, "offload"),
    # readable: handed over to the next request (or already Runnable)
    Phase.RESTORING: (Phase.HANDOVER, "restore"),
    Phase.PREFETCHING: (Phase.KEPT, "restore"),  # an early restore: done when the KV is readable
}


# completed inside the call (nothing to copy, or the pin/shadow backends): the metrics kind
_DONE_AT_ONCE: dict[str, str] = {
    Phase.OFFLOADED: "offload",
    Phase.RUNNABLE: "restore",
    Phase.HANDOVER: "restore",
}
_ENDED = frozenset(
    {Phase.EXPIRED, Phase.LOST}
)  # a protection the TTL sweep or a tree reset ended (a line each)


def fmt(value: object) -> str:
    """A logfmt value: plain words as they are, anything else JSON-quoted (session ids come from
    clients and may hold spaces, quotes or newlines)."""
    if value is None or value == "":
        return "-"
    s = str(value)
    return s if _PLAIN.fullmatch(s) else json.dumps(s)


class DecisionLog:
    def __init__(
        self,
        manager: ToolKVManager,
        *,
        tp_rank: int = 0,
        metrics: ToolKVMetrics | None = None,
        bytes_per_token: int | None = None,
        snapshot: Callable[[], Mapping[str, Any]] | None = None,
    ) -> None:
        self.manager = manager
        self.snapshot = snapshot or manager.kv_meta  # the server-wide kv_meta the gauges read
        self.tp_rank = tp_rank
        self.metrics = metrics
        self.bytes_per_token = bytes_per_token
        self.level = logging.INFO if tp_rank == 0 else logging.DEBUG
        self._inflight: dict[str, tuple[str, float, int, int]] = {}  # sid -> (state, t0, epoch, tokens)
        self._protecting: set[str] = set()
        self._ended = (0, 0)  # manager counters expired, lost when last looked

    # ---- decisions ---------------------------------------------------------------------------------
    def decided(
        self,
        op: str,
        session_id: str | None,
        result: Mapping[str, Any] | None,
        outcome: str,
        reason: str = "",
        extra: Mapping[str, object] | None = None,
    ) -> None:
        """One decision. ``result`` is the session's kv_meta after an accepted call; its policy
        reason (why keep / offload / let go) is logged when the caller gives none. ``extra``:
        fields appended after ``rank`` (``tool_end``: ``asked``, the epoch the call carried); a
        session whose copy is in L3 also gets ``l3=`` (``storing``, ``stored``, ``fetching``)."""
        m = self.manager
        if not reason and result and isinstance(result.get("reason"), str):
            reason = result["reason"]
        rec = m.sessions.get(session_id) if session_id else None
        state = result.get("state") if result else (rec.state if rec is not None else None)
        epoch = result.get("epoch") if result else (rec.epoch if rec is not None else None)
        tokens = result.get("tokens") if result else (len(rec.tokens) if rec is not None else None)
        if log.isEnabledFor(self.level):
            fields: dict[str, object] = dict(extra or {})
            if rec is not None and rec.l3:  # the session's copy is in L3: storing, stored, fetching
                fields["l3"] = rec.l3
            more = "".join(f" {k}={fmt(v)}" for k, v in fields.items())
            log.log(
                self.level,
                "toolkv decision op=%s session=%s epoch=%s state=%s tokens=%s outcome=%s reason=%s rank=%d%s",
                op, fmt(session_id), fmt(epoch), fmt(state), fmt(tokens), outcome, fmt(reason), self.tp_rank,
                more,
            )  # fmt: skip
        if self.metrics is not None:
            self.metrics.decision(op, "ok" if outcome == "ok" else reason or outcome)
        if outcome == "ok" and session_id and isinstance(state, str):
            self._track(session_id, state, epoch, tokens)

    def _track(self, sid: str, state: str, epoch: Any, tokens: Any) -> None:
        if state in HOLDING:
            self._protecting.add(sid)
        else:
            self._protecting.discard(sid)
        now = time.monotonic()
        n = int(tokens or 0)
        if state in _INFLIGHT:
            self._inflight[sid] = (state, now, int(epoch or 0), n)
        else:
            self._inflight.pop(sid, None)
            kind = _DONE_AT_ONCE.get(state)
            if kind is not None:
                self._complete(kind, 0.0, n)

    def _complete(self, kind: str, seconds: float, tokens: int) -> None:
        if self.metrics is not None:
            nbytes = tokens * self.bytes_per_token if self.bytes_per_token else None
            self.metrics.completed(kind, seconds, nbytes)

    # ---- per tick ----------------------------------------------------------------------------------
    def after_tick(self) -> None:
        if self._inflight:
            self._settle_inflight()
        c = self.manager.counters
        ended = (c["expired"], c["lost"])
        if ended != self._ended:
            self._ended = ended
            self._log_ended()
        if self.metrics is not None and self.metrics.due():
            self.metrics.refresh(self.snapshot())

    def _settle_inflight(self) -> None:
        now = time.monotonic()
        for sid, (state, t0, epoch, tokens) in list(self._inflight.items()):
            rec = self.manager.sessions.get(sid)
            if rec is not None and rec.epoch == epoch and rec.state == state:
                continue  # still copying
            del self._inflight[sid]
            # an in-flight copy ended by the TTL or a flush (Expired, Lost) stays for _log_ended,
            # which writes its line in this same tick; without this its protection ended unlogged
            if rec is None or rec.state not in HOLDING | _ENDED:
                self._protecting.discard(sid)
            done, kind = _INFLIGHT[state]
            finished = rec is not None and (
                rec.state == done or (done == Phase.HANDOVER and rec.state == Phase.RUNNABLE)
            )
            if rec is not None and rec.epoch == epoch and finished:
                self._complete(kind, now - t0, tokens)
                log.debug("toolkv %s done session=%s epoch=%d seconds=%.4f", kind, fmt(sid), epoch, now - t0)

    def _log_ended(self) -> None:
        """The TTL sweep or a tree reset ended protections: one decision line per session."""
        for sid in list(self._protecting):
            rec = self.manager.sessions.get(sid)
            if rec is None or rec.state in HOLDING:
                continue
            self._protecting.discard(sid)
            self._inflight.pop(sid, None)
            if rec.state in (Phase.EXPIRED, Phase.LOST):
                op = "ttl_sweep" if rec.state == Phase.EXPIRED else "tree_reset"
                self.decided(op, sid, None, "ok", rec.state.lower())
