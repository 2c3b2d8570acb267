"""The host→GPU loads of ``spec/ToolKV.tla``'s ``ToolEnd`` and ``Prefetch``: restore a protected
host copy to the GPU (or park it when the device cannot take it), and the early restore's load.

Both the copy path (:mod:`toolkv.core.session.copies`: a tool_end or an early restore of a session
on its host copy) and the L3 sub-machine (:mod:`toolkv.core.session.l3`: the same once a storage
prefetch has put the copy back on the host) start them, so they are a part of their own, below
both: it calls only the hand-over (:class:`~toolkv.core.session.handover.Handover`) and the state.
"""

from __future__ import annotations

from toolkv.core.lifecycle import fire
from toolkv.core.phases import Phase
from toolkv.core.record import SessionRecord
from toolkv.core.session.handover import Handover
from toolkv.core.session.state import MachineState, log
from toolkv.errors import DeviceMemoryFull


class Loads:
    """ToolEnd's restore from a protected host copy (or its Park), and Prefetch's load."""

    def __init__(self, s: MachineState, handover: Handover) -> None:
        self.s = s
        self.handover = handover

    # ---- ToolEnd from the host copy -------------------------------------------------------------------
    def restore_from_host(self, rec: SessionRecord) -> None:
        """Spec ``ToolEnd`` from a protected host copy: the host→GPU load, or the hand-over at once
        when nothing is to load. When the device cannot take it now, spec ``Park`` (with
        ``adaptive``): the host copy stays protected and the next request's admission loads it;
        without ``adaptive``, ``DeviceMemoryFull`` (nothing changed)."""
        session_id = rec.session_id
        try:
            self.handover.check_pin_room(rec, queued=self.s.config.adaptive)
            runnable = self.s.backend.restore(rec)  # raises DeviceMemoryFull before changing anything
        except DeviceMemoryFull:
            if self.s.config.adaptive and self.handover.parks():
                self.handover.park_step(rec)
                return
            self._restore_refused(rec)
            raise
        self.s._offloading.pop(session_id, None)
        if runnable:  # nothing to load: pin what is resident until the next request holds it
            self.s._settle(rec, "tool_end")
            self.handover.pin_for_handover(rec)
            self.handover.hand_over(rec, "tool_end")
        else:
            fire(rec, "tool_end", Phase.RESTORING)
            self.s._restoring[session_id] = rec
            rec.restore_started_at = self.s.now
        self.s.counters["restored_tokens"] += rec.restored_tokens
        if rec.recompute_tokens:  # nothing worth loading: the next request recomputes the suffix
            self.s.counters["restore_below_threshold"] += 1
        log.debug("tool_end %s epoch=%d state=%s", session_id, rec.epoch, rec.state)

    def _restore_refused(self, rec: SessionRecord) -> None:
        """The backend refused the restore before changing anything: the session stays offloaded
        and protected (caveat 1: its host protection is kept, for a retry or the TTL to release)."""
        self.s.counters["restore_deferred"] += 1

    # ---- Prefetch's load -------------------------------------------------------------------------------
    def prefetch_from_host(self, rec: SessionRecord) -> None:
        """Spec ``Prefetch`` of a session on its protected host copy (the guard was checked by the
        caller): the load starts, or the path is resident already and is pinned at once (``Kept``).
        Raises ``DeviceMemoryFull`` (nothing changed) when the device cannot take it now."""
        runnable = self.s.backend.restore(rec)  # raises DeviceMemoryFull before changing anything
        rec.prefetch_at = float("inf")
        if runnable:  # nothing to load: the path is resident; pin it (the pin backend's offload pin is it)
            kept = rec.pinned is not None or (rec.node is not None and self.s.backend.keep(rec, rec.node))
            assert kept, "a restored path must be resident"
            fire(rec, "prefetch", Phase.KEPT)
            self.s._arm_warm(rec)
        elif self.s._prefetch_readable(rec):  # never, with a load in flight (restore pinned the path)
            self.s.backend.release_protection(rec)
            fire(rec, "prefetch", Phase.KEPT)
            self.s._arm_warm(rec)
        else:
            fire(rec, "prefetch", Phase.PREFETCHING)
            self.s._prefetching[rec.session_id] = rec
            rec.restore_started_at = self.s.now
        self.s.counters["prefetched"] += 1
