"""The hand-over of ``spec/ToolKV.tla``: ``Handover``, ``Admit``, and load-adaptive protection's
``Park`` and ``Unpin``.

A tool call is over and its KV is on the GPU; between that and the next request's admission the
KV must not be evicted (else the restore was for nothing), so the session pins its path
(``Handover``) until sglang admits the request and its own lock holds the path (``Admit``). Under
load that pin takes room queued requests need: ``Park`` leaves the restore to sglang's own
``load_back`` at admission, and ``Unpin`` gives a waiting pin up.
"""

from __future__ import annotations

from collections.abc import Callable

from toolkv.core.backends.base import device_full, offload_room_full
from toolkv.core.lifecycle import fire
from toolkv.core.phases import OFFLOADED, Phase
from toolkv.core.record import SessionRecord
from toolkv.core.result import SessionView
from toolkv.core.session.state import MachineState, log
from toolkv.core.treeops import Tree, TreeNode
from toolkv.errors import WrongState


class Handover:
    """Handover, Admit, Park, Unpin, and the device-room checks a pin or a write lock needs. Calls
    only the state: the other parts call it."""

    def __init__(self, s: MachineState) -> None:
        self.s = s

    # ---- Park -----------------------------------------------------------------------------------------
    def can_park(self, rec: SessionRecord) -> bool:
        return rec.state in OFFLOADED and not rec.l3 and self.parks()

    def park(self, session_id: str, epoch: int) -> SessionView:
        """Spec ``Park`` as an explicit call: the tool call of ``epoch`` is over and the session's
        KV stays protected on host until its next request is admitted. :meth:`tool_end` parks on
        its own when the device cannot take the restore next to the queued requests; the
        conformance replay takes the spec's step with this call. Refused (nothing changed) for a
        stale epoch or a session that is not ``Offloading``/``Offloaded`` on its host copy."""
        rec = self.s._get(session_id)
        self.s._check_epoch(rec, epoch, count=False)
        if not self.can_park(rec):
            raise WrongState(
                f"park needs an offloaded session on a backend with a host tier; {session_id!r} is {rec.state}",
                state=rec.state,
            )
        self.park_step(rec)
        self.s._observe_call(rec)
        self.s.counters["tool_end"] += 1
        return self.s.view(rec)

    def parks(self) -> bool:
        """Whether the backend can leave a restore to sglang's own load-back: only on HiCache, whose
        host copy lives in the tree (a plain RadixCache's pin or shadow copy has none to load)."""
        return self.s.caps.parks

    def park_step(self, rec: SessionRecord) -> None:
        """Spec ``Park``: the tool call is over but its next request would wait behind others (the
        device cannot take the restore's pin next to what running and queued requests need).
        Loading now would hold device room for a request that is not running; so nothing is
        loaded or pinned: the host copy stays protected (a write still in flight finishes, and
        frees nothing), and sglang's own ``load_back`` brings the KV in when the request is
        admitted (spec ``Admit`` of a parked session), which ends the protection. The TTL bounds
        a request that never comes."""
        self.s._offloading.pop(rec.session_id, None)  # its write ack frees nothing: the request is coming
        fire(rec, "park", Phase.PARKED)
        self.s._arm_deadline(rec)
        rec.restore, rec.restored_tokens, rec.recompute_tokens = "parked", 0, 0
        self.s.counters["parked"] += 1
        log.debug(
            "tool_end %s epoch=%d parked (device room is needed by queued requests)",
            rec.session_id,
            rec.epoch,
        )

    # ---- the device room a pin takes --------------------------------------------------------------------
    def check_pin_room(self, rec: SessionRecord, *, queued: bool = False) -> None:
        """The hand-over pins the session's whole path, which takes its resident part out of
        what sglang may evict. sglang has promised running requests device tokens it counts on
        finding free or evictable (the rest of a chunked prefill over-commits otherwise, and the
        allocation fails with "Out of memory"): refuse the restore (``DeviceMemoryFull``, nothing
        changed; sglang's own load-back serves the next request) unless free + evictable, less
        what was promised, still covers what the pin takes: the path's unlocked resident tokens
        and the ones still to load (``pin_cost``). With ``queued``, the tokens the waiting
        requests need count as promised too: a pin taken while they queue takes their room.
        Agreed across ranks."""
        priced = self.s.caps.pin_priced
        if priced is None or rec.node is None:
            return
        need = int(priced.pin_cost(rec.node))
        free, evictable, reserved = self._device_room(queued=queued)
        if not self.s.agree.all_true(need + reserved <= free + evictable):
            raise device_full(rec, need, free, evictable, reserved)

    def check_offload_room(self, rec: SessionRecord, leaf: TreeNode) -> None:
        """Spec ``ToolStart``'s device guard (``PromiseFits``): the offload's locks (a write locks
        the node it copies and its path until the ack) take the path's resident unlocked tokens out
        of what sglang may evict, while sglang counts on free + evictable covering what it promised
        running requests: the rest of a chunked prefill, whose next chunk it admits without a check
        once its budget is spent, and which then fails to allocate ("Out of memory", the scheduler
        exits). Refuse the offload (``DeviceMemoryFull``, nothing changed: the KV stays in sglang's
        cache) unless free + evictable, less what was promised, still covers what the locks take.
        Agreed across ranks."""
        priced = self.s.caps.lock_priced
        if priced is None:
            return
        need = int(priced.offload_lock_cost(leaf))
        if need == 0:
            return
        free, evictable, reserved = self._room_of(priced.tree, priced.headroom)
        if not self.s.agree.all_true(need + reserved <= free + evictable):
            self.s.counters["offload_room_refused"] += 1
            raise offload_room_full(rec, need, free, evictable, reserved)

    def _device_room(self, *, queued: bool) -> tuple[int, int, int]:
        """(free, evictable, promised) device tokens; ``queued``: the waiting requests' count as
        promised too."""
        priced = self.s.caps.pin_priced
        assert priced is not None, "only a backend that prices pins has a device room to check"
        free, evictable, reserved = self._room_of(priced.tree, priced.headroom)
        if queued:
            reserved += int(self.s.queued_demand())
        return free, evictable, reserved

    @staticmethod
    def _room_of(tree: Tree, headroom: Callable[[], int]) -> tuple[int, int, int]:
        """(free, evictable, promised) device tokens of ``tree``, as sglang's prefill budget reads
        them (``PrefillBudget._available_and_evictable``)."""
        free = int(tree.token_to_kv_pool_allocator.available_size())
        evictable = int(tree.evictable_size())
        return free, evictable, int(headroom())

    def _room_short(self) -> bool:
        """Whether the device is short for what running and queued requests need: free and
        evictable tokens less than the promised and queued ones. Agreed across ranks: short when
        any rank is short (a queued request needs its room on every rank; the pin's room check,
        :meth:`check_pin_room`, refuses by the same rule)."""
        free, evictable, reserved = self._device_room(queued=True)
        return not self.s.agree.all_true(reserved <= free + evictable)

    # ---- Unpin ------------------------------------------------------------------------------------------
    def unpin_for_room(self) -> int:
        """Spec ``Unpin``, once per tick while hand-overs wait: when queued requests need the room
        that hand-over pins hold, give the pins up, the latest hand-over first, until the room is
        there or none is left. A session whose path is backed up on host is protected there
        again (``Parked``: its admission loads whatever sglang evicted meanwhile); one that is
        not (a kept path never written) is ``Runnable``. Returns how many pins went."""
        if not self.s._handover or not self.s.config.adaptive or not self.parks():
            return 0
        n = 0
        for rec in reversed(list(self.s._handover.values())):
            if not self._room_short():
                break
            self._unpin(rec)
            n += 1
        return n

    def can_unpin(self, rec: SessionRecord) -> bool:
        return rec.state == Phase.HANDOVER

    def unpin(self, session_id: str) -> SessionView:
        """Spec ``Unpin`` of one hand-over, as an explicit call (the conformance replay takes the
        spec's step with it; the tick's :meth:`unpin_for_room` decides when on a server)."""
        rec = self.s._get(session_id)
        if not self.can_unpin(rec):
            raise WrongState(
                f"unpin needs a Handover session; {session_id!r} is {rec.state}", state=rec.state
            )
        self._unpin(rec)
        return self.s.view(rec)

    def _unpin(self, rec: SessionRecord) -> None:
        assert rec.state == Phase.HANDOVER, rec.state
        self.s.backend.unpin(rec)
        self.s._handover.pop(rec.session_id, None)
        parking = self.s.caps.parking
        if parking is not None and parking.reprotect(rec):
            fire(rec, "unpin", Phase.PARKED)
            self.s._arm_deadline(rec)
            self.s.counters["unpinned_parked"] += 1
        else:
            fire(rec, "unpin", Phase.RUNNABLE)
            self.s.counters["unpinned_runnable"] += 1

    # ---- Handover ---------------------------------------------------------------------------------------
    def pin_for_handover(self, rec: SessionRecord) -> None:
        """A restore that needed no load returned the protection and holds no pin yet: pin the
        resident path (the recorded node, possibly the device prefix left below sglang's
        ``load_back_threshold``) so that it survives until the next request holds it."""
        if rec.node is not None and rec.pinned is None and not self.s.backend.keep(rec, rec.node):
            # never with a correct backend (the restore found the path resident); a backend that
            # says so with a load in flight (mutant EarlyRunnable) is caught by HandoverResident
            log.error("session %s: the restored path is not resident; handed over unpinned", rec.session_id)

    def hand_over(self, rec: SessionRecord, trigger: str) -> None:
        """The tool call is over and the KV is on the GPU, pinned (spec ``Handover``): armed with
        the hand-over TTL. A request already admitted while the load ran ends it at once."""
        fire(rec, trigger, Phase.HANDOVER)
        self.s._handover[rec.session_id] = rec
        self.s._arm_deadline(rec, min(self.s.config.ttl_s, self.s.config.handover_ttl_s))
        self.s.counters["handover"] += 1
        if rec.admit_pending:
            self._admit(rec)

    # ---- Admit ------------------------------------------------------------------------------------------
    def admit(self, session_id: str) -> bool:
        """Spec ``Admit``: the session's next request was admitted: sglang matched its prefix and
        locked it (the scheduler calls this after the prefill batch is formed). Its own lock now
        keeps the path on the GPU, so the hand-over's pin goes. A request admitted while the load
        is still in flight (Restoring) ends the hand-over as soon as the load is acknowledged.
        Returns True when a hand-over ended; anything else is a no-op (the request is served
        whatever toolkv holds)."""
        rec = self.s.sessions.get(session_id)
        if rec is None:
            return False
        if rec.state == Phase.RESTORING or (rec.l3 == "fetching" and rec.l3_then == "tool_end"):
            rec.admit_pending = True
            return False
        if rec.state == Phase.PARKED:  # sglang's load_back took the host copy; the request's lock holds it
            self.s.backend.release_protection(rec)
            self.s._settle(rec, "admit")
            fire(rec, "admit", Phase.RUNNABLE)
            self.s.counters["admitted_parked"] += 1
            return True
        if rec.state != Phase.HANDOVER:
            return False
        self._admit(rec)
        return True

    def _admit(self, rec: SessionRecord) -> None:
        self.s.backend.unpin(rec)
        self.s._handover.pop(rec.session_id, None)
        rec.admit_pending = False
        fire(rec, "admit", Phase.RUNNABLE)
        self.s.counters["admitted"] += 1
