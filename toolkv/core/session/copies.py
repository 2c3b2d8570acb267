"""The copy path of ``spec/ToolKV.tla``: ``ToolStart``, ``WriteAck``, ``ToolEnd``, ``LoadAck`` and
the early restore ``Prefetch`` — the actions that move a session's KV GPU→host and back.

Each action is a method named as the spec's (``ToolStart`` → :meth:`tool_start`); ``can_<action>``
is the part of its guard that reads the session's phase alone (what a caller may ask before
calling). The rest of a guard needs the tree (is the KV still there, does the device have room)
and is checked inside the action, which raises before changing anything when it fails.
"""

from __future__ import annotations

from collections.abc import Callable

from toolkv.core.lifecycle import fire
from toolkv.core.phases import OFFLOADED, Phase
from toolkv.core.policy import keep_fits
from toolkv.core.record import SessionRecord
from toolkv.core.result import SessionView
from toolkv.core.session.handover import Handover
from toolkv.core.session.l3 import L3Tier
from toolkv.core.session.loads import Loads
from toolkv.core.session.policy_actions import PolicyActions
from toolkv.core.session.state import MachineState, log
from toolkv.core.timers import Timers
from toolkv.errors import DeviceMemoryFull, HostMemoryFull, SessionKVLost, UnknownSession, WrongState

#: a ``tool_start``'s leave to demote other sessions for room: a bool, or a callable asked only
#: once the host turns out full (the call policies' answer reads the device pressure)
Demote = bool | Callable[[], bool]


class Copies:
    """ToolStart, WriteAck, ToolEnd, LoadAck, Prefetch: the top part, which calls the others (the
    hand-over's room checks and hand-over, the policy's demotion order, the loads, the L3 tier)."""

    def __init__(
        self, s: MachineState, handover: Handover, policy: PolicyActions, loads: Loads, l3: L3Tier
    ) -> None:
        self.s = s
        self.handover = handover
        self.policy = policy
        self.loads = loads
        self.l3 = l3

    # ---- ToolStart ------------------------------------------------------------------------------------
    def can_tool_start(self, rec: SessionRecord) -> bool:
        return rec.state == Phase.RUNNING

    def tool_start(
        self, session_id: str, *, demote: Demote = False, returns_at: float = float("inf")
    ) -> SessionView:
        """Spec ``ToolStart``: offload the session's KV to the host. With ``demote`` (a callable
        is asked once, and only when the host is full: the call policy's answer reads the
        device's pressure, a walk of the whole tree), a host that
        is full (pool or budget) demotes offloaded sessions predicted back after ``returns_at``,
        the latest first, until it fits (their copies become evictable: spec ``Demote`` then
        ``HostRoom``); with an L3 tier any offloaded session may yield, the latest first, and is
        stored (spec ``Store``), never dropped unless predicted back after ``returns_at``; a 507
        only when none can yield. Once ``Offloaded`` the session itself may go to L3 at the next
        tick if it is away long (``L3Tier.store_early``)."""
        rec = self.s._get(session_id)
        if not self.can_tool_start(rec):
            raise WrongState(
                f"tool_start needs a Running session; {session_id!r} is {rec.state}", state=rec.state
            )
        node = self.s._live_node(rec)
        if node is None:
            had = rec.node is not None
            rec.node = None
            self.s.counters["kv_lost"] += 1
            raise SessionKVLost(
                f"session {session_id!r} has no KV in the cache" + (" any more" if had else " yet"),
                session_id=session_id,
            )
        rec.node, rec.tree_gen = node, self.s.tree_gen
        self.handover.check_offload_room(rec, node)  # raises DeviceMemoryFull before changing anything
        tried: set[str] = set()  # each victim once: one whose store is refused stays a candidate
        may_demote: bool | None = None
        while True:
            try:
                clean = self.s.backend.offload(rec, node)  # raises HostMemoryFull before changing anything
                break
            except HostMemoryFull:  # agreed across ranks: so is asking ``demote`` here
                if may_demote is None:
                    may_demote = bool(demote() if callable(demote) else demote)
                cands = self.policy.demotion_candidates(session_id, returns_at) if may_demote else []
                victims = [v for v in cands if v not in tried]
                if not victims:
                    raise
                tried.add(victims[0])
                self.l3.yield_host(victims[0], returns_at)
        rec.epoch += 1
        self.s._arm_deadline(rec)
        if self._free_at_tool_start(clean):
            self._free_or_leave([rec])
            fire(rec, "tool_start", Phase.OFFLOADED)
            self.l3.offloaded(rec)
        else:
            fire(rec, "tool_start", Phase.OFFLOADING)
            self.s._offloading[session_id] = rec
        self.s.counters["tool_start"] += 1
        self.s.counters["offloaded_tokens"] += rec.offload_tokens
        log.debug(
            "tool_start %s epoch=%d state=%s tokens=%d", session_id, rec.epoch, rec.state, rec.offload_tokens
        )
        return self.s.view(rec)

    def _free_at_tool_start(self, clean: bool) -> bool:
        """Whether ``tool_start`` frees the GPU copies itself: only when no write on the path is
        in flight (caveat 7: a GPU copy is freed only after its write is acknowledged; otherwise
        ``write_ack`` frees it once sglang has retired the ack)."""
        return clean

    def _free_or_leave(self, recs: list[SessionRecord]) -> None:
        """The GPU copies of finished offloads: freed (spec ``FreeSet``), or with ``lazy_free`` left
        to sglang's eviction (spec ``LazyFree``) on a backend whose eviction keeps the host copy.
        Freeing buys room nobody may need: the regime map found that with few sessions stock
        sglang kept the copies toolkv had freed, and reused more. Left, they cost nothing that
        sglang cannot take back the moment it needs the room."""
        lazy = self.s.caps.lazy_free
        if self.s.config.lazy_free and lazy is not None:
            lazy.leave_gpu(recs)
            for r in recs:
                r.freed_tokens = 0
                self.s.counters["left_tokens"] += r.offload_tokens
        else:
            self.s.backend.free_gpu(recs)

    # ---- WriteAck -------------------------------------------------------------------------------------
    def write_ack(self) -> int:
        """Spec ``WriteAck``: finish every offload whose path writes are all acknowledged (its GPU
        copies are freed); returns how many."""
        if not self.s._offloading:
            return 0
        done = [r for r in self.s._offloading.values() if not self.s.backend.offload_pending(r)]
        if not done:
            return 0
        self._free_or_leave(done)
        for rec in done:
            del self.s._offloading[rec.session_id]
            fire(rec, "write_ack", Phase.OFFLOADED)
            self.l3.offloaded(rec)
            self.s.counters["freed_tokens"] += rec.freed_tokens
        return len(done)

    # ---- ToolEnd --------------------------------------------------------------------------------------
    def can_tool_end(self, rec: SessionRecord) -> bool:
        return rec.state in (Phase.KEPT, Phase.PREFETCHING, Phase.RELEASED) or rec.state in OFFLOADED

    def tool_end(self, session_id: str, epoch: int) -> SessionView:
        """Spec ``ToolEnd``: the tool call of ``epoch`` is over; bring the KV back for the next turn
        (restore from host or L3, hand a kept or early-restored path over, or nothing to do for a
        released one). A stale epoch changes nothing (``StaleEpoch``)."""
        try:
            rec = self.s._get(session_id)
        except UnknownSession as unknown:  # stored by a server that is gone: SharedTier.tla
            return self.s.view(self.l3.adopt(session_id, epoch, unknown))
        self.s._check_epoch(rec, epoch, count=True)
        if rec.state == Phase.KEPT:  # the pin stays until the next request holds the path
            self.s._settle(rec, "tool_end")
            self.handover.hand_over(rec, "tool_end")
            self._tool_end_done(rec)
            return self.s.view(rec)
        if rec.state == Phase.PREFETCHING:  # the early restore becomes the restore
            del self.s._prefetching[session_id]
            self.s._restoring[session_id] = rec
            fire(rec, "tool_end", Phase.RESTORING)
            self._tool_end_done(rec)
            return self.s.view(rec)
        if rec.state == Phase.RELEASED:  # nothing was held: the next turn recomputes what is missing
            fire(rec, "tool_end", Phase.RUNNING)
            self._tool_end_done(rec)
            return self.s.view(rec)
        if rec.state not in OFFLOADED:
            return self._tool_end_not_offloaded(rec)
        if rec.l3 and self.l3.tool_end_l3(rec):
            return self.s.view(rec)
        self.loads.restore_from_host(rec)
        self._tool_end_done(rec)
        return self.s.view(rec)

    def _tool_end_done(self, rec: SessionRecord) -> None:
        self.s._observe_call(rec)
        self.s.counters["tool_end"] += 1

    def _tool_end_not_offloaded(self, rec: SessionRecord) -> SessionView:
        """A current-epoch tool_end for a session that is not offloaded (already restoring, or
        never offloaded): refused, so no node is ever loaded twice (caveat 2). Always raises."""
        raise WrongState(
            f"tool_end needs an offloaded session; {rec.session_id!r} is {rec.state}", state=rec.state
        )

    # ---- LoadAck --------------------------------------------------------------------------------------
    def load_ack(self) -> int:
        """Spec ``LoadAck``: forget acknowledged loads; every restoring session whose path is now
        readable is handed over (its protection is released, the load's pin stays), every early
        restore that is readable is ``Kept`` until its tool_end."""
        if not self.s._restoring and not self.s._prefetching and not self.s.backend.loads_in_flight():
            return 0
        self.s.backend.poll_loads()
        done = [r for r in self.s._restoring.values() if not self.s.backend.restore_pending(r)]
        warm = [r for r in self.s._prefetching.values() if self.s._prefetch_readable(r)]
        for rec in done:  # readable: the load's pin stays as the hand-over's, the protection goes
            self.s.backend.release_protection(rec)
            self.s._settle(rec, "load_ack")
            self.handover.hand_over(rec, "load_ack")
            self.s._measured_restore(rec)
        for rec in warm:  # an early restore is readable: Kept (pinned) until its tool_end
            self.s.backend.release_protection(rec)
            del self.s._prefetching[rec.session_id]
            fire(rec, "load_ack", Phase.KEPT)
            self.s._measured_restore(rec)
            self.s._arm_warm(rec)
        return len(done) + len(warm)

    # ---- Prefetch -------------------------------------------------------------------------------------
    def can_prefetch(self, rec: SessionRecord) -> bool:
        return rec.state == Phase.OFFLOADED

    def prefetch(self, session_id: str) -> SessionView:
        """Spec ``Prefetch``: start the restore of an offloaded session before its tool_end, so
        that the KV is on the GPU when the tool returns. The session keeps its protection until
        the load is acknowledged, then it is Kept (pinned) until tool_end or the TTL. Raises
        ``DeviceMemoryFull`` (nothing changed) when the device cannot take it now."""
        rec = self.s._get(session_id)
        if not self.can_prefetch(rec):
            raise WrongState(
                f"prefetch needs an Offloaded session; {session_id!r} is {rec.state}", state=rec.state
            )
        if rec.l3 and self.l3.prefetch_l3(rec):
            return self.s.view(rec)
        self.loads.prefetch_from_host(rec)
        return self.s.view(rec)

    def run_prefetches(self) -> int:
        """Start the early restores that are due (policy ``auto``). A device that cannot take one
        now defers it to a later tick; a suffix sglang would not load is left to tool_end."""
        n = 0
        for when, _seq, sid in Timers.due(self.s.timers.prefetch_due, self.s.now):
            rec = self.s.sessions.get(sid)
            if rec is None or rec.prefetch_at != when or rec.state not in OFFLOADED:
                continue
            if rec.l3 == "fetching" or rec.l3_then:  # being read back from L3 already
                continue
            if rec.state == Phase.OFFLOADING:  # its writes are still in flight: look again shortly
                self.s._defer_prefetch(rec, 0.05)
                break
            if not rec.l3 and not self.s.backend.worth_prefetching(rec):
                continue
            try:
                if not self._spare_for(rec):
                    # An early restore makes room by evicting other sessions' cache for a session
                    # that is not back yet: only into spare room (under load it cost more than it
                    # saved); otherwise its tool_end restores it.
                    raise DeviceMemoryFull("no spare device room for an early restore")
                self.prefetch(sid)
                n += 1
            except DeviceMemoryFull:
                self.s.counters["prefetch_deferred"] += 1
                self.s._defer_prefetch(rec, 0.25)
                break  # the device is full for the others too; try again later
        return n

    def _spare_for(self, rec: SessionRecord) -> bool:
        """Whether the device has spare room for the session's KV by the keep rule
        (``policy.keep_fits``: free after promised and queued tokens, less the reserve).
        Backends without the notion always have room."""
        if self.s.backend.pressure().device_spare_tokens is None:  # the backend's kind: alike on all ranks
            return True
        p = self.s.pressure()  # agreed across TP ranks: every rank restores early, or none
        return keep_fits(p, rec.offload_tokens, self.s.config.policy_config.device_reserve)
