"""The session machine: ``spec/ToolKV.tla``'s manager actions, one method per action, named as
the spec's (``ToolStart`` → :meth:`tool_start`).

========================= =====================================================================
spec action               method (``can_<action>``: the phase part of its guard)
========================= =====================================================================
``Insert``                :meth:`insert`
``ToolStart``             :meth:`tool_start` (``HostRoom``: the room it makes, through a
                          demotion or an L3 store of a victim and sglang's ``evict_host``)
``WriteAck``              :meth:`write_ack`
``ToolEnd``               :meth:`tool_end`
``LoadAck``               :meth:`load_ack`
``StartLoads``            :meth:`start_loads`
``Keep``/``LetGo``        :meth:`keep`, :meth:`let_go`
``Demote``/``Prefetch``   :meth:`demote`, :meth:`prefetch` (the tick's :meth:`run_prefetches`)
``Handover``/``Admit``    the hand-over at ``ToolEnd``/``LoadAck``; :meth:`admit`
``Park``/``Unpin``        :meth:`park`, :meth:`unpin` (the tick's :meth:`unpin_for_room`)
``TtlSweep``              :meth:`ttl_sweep` (and the idle expiry, :meth:`forget_idle`)
``Close``                 :meth:`close`
``TreeReset``             :meth:`tree_reset`
``Tick``                  :meth:`tick`, once per scheduler iteration: the clock moves
                          (:meth:`set_clock`, the bare step the conformance replay takes), then
                          every enabled action
``Store`` (StorageTier)   :meth:`store`; ``StoreAck``/``PrefetchAck`` in
                          :meth:`process_storage_acks` (``toolkv.core.session.l3``)
========================= =====================================================================

The machine is the state (:class:`~toolkv.core.session.state.MachineState`) and owns the parts
that hold the actions, each built with the state and the parts it calls, nothing else:

============ ======================================== =========================================
part         actions                                   calls
============ ======================================== =========================================
``handover`` Handover, Admit, Park, Unpin; room checks (the state only)
``policy``   Keep, LetGo, Demote; demotion order       ``handover`` (a keep's room check)
``loads``    ToolEnd's restore or Park, Prefetch's load ``handover``
``l3``       Store, StoreAck, StoragePrefetch, ...     ``policy``, ``loads``, the machine's Insert
``copies``   ToolStart, WriteAck, ToolEnd, LoadAck,    all four
             Prefetch
============ ======================================== =========================================

Insert, TtlSweep, Close, TreeReset and Tick are the machine's own; every other action is one line
here that calls its part, so the manager above speaks to one object in the spec's words. A seeded
defect (``verify.toolkv.mutants``) is a part, or the machine, with one method put back wrong: the
``*_class`` attributes name the parts a machine builds.

Which of ``ToolStart``, ``Keep`` and ``LetGo`` a tool call gets is not the machine's business: the
call policies of ``toolkv.core.calls`` decide it, and the manager (``toolkv.core.manager``) is the
front door that routes a call to them.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import ClassVar

from toolkv.core.backends.base import Agreement, Backend
from toolkv.core.config import ManagerConfig
from toolkv.core.lifecycle import EXPIRING, HOLDING, fire
from toolkv.core.phases import IDLE, RESET_LOSES, Phase
from toolkv.core.record import SessionRecord
from toolkv.core.result import SessionView
from toolkv.core.session.copies import Copies, Demote
from toolkv.core.session.handover import Handover
from toolkv.core.session.l3 import L3Tier
from toolkv.core.session.loads import Loads
from toolkv.core.session.policy_actions import PolicyActions
from toolkv.core.session.state import MachineState, log
from toolkv.core.timers import Timers
from toolkv.core.treeops import Tree, walk
from toolkv.errors import BadRequest, WrongState


class SessionMachine(MachineState):
    """Every session's phase, moved only by the spec's actions (``lifecycle.fire`` checks each
    move against the table that ``model_tests/test_tables.py`` checks against TLC)."""

    handover_class: ClassVar[type[Handover]] = Handover
    policy_class: ClassVar[type[PolicyActions]] = PolicyActions
    loads_class: ClassVar[type[Loads]] = Loads
    l3_class: ClassVar[type[L3Tier]] = L3Tier
    copies_class: ClassVar[type[Copies]] = Copies
    #: the ``*_class`` attributes, in the order the parts are built
    PARTS: ClassVar[tuple[str, ...]] = ("handover", "policy", "loads", "l3", "copies")

    def __init__(self, tree: Tree, backend: Backend, *, config: ManagerConfig, agree: Agreement) -> None:
        super().__init__(tree, backend, config=config, agree=agree)
        self.handover = self.handover_class(self)
        self.policy = self.policy_class(self, self.handover)
        self.loads = self.loads_class(self, self.handover)
        self.l3 = self.l3_class(self, self.policy, self.loads, self.insert, self.close)
        self.copies = self.copies_class(self, self.handover, self.policy, self.loads, self.l3)

    # ---- the parts' actions, in the spec's words ------------------------------------------------------
    def tool_start(
        self, session_id: str, *, demote: Demote = False, returns_at: float = float("inf")
    ) -> SessionView:
        """Spec ``ToolStart`` (:meth:`Copies.tool_start`)."""
        return self.copies.tool_start(session_id, demote=demote, returns_at=returns_at)

    def write_ack(self) -> int:
        """Spec ``WriteAck`` (:meth:`Copies.write_ack`)."""
        return self.copies.write_ack()

    def tool_end(self, session_id: str, epoch: int) -> SessionView:
        """Spec ``ToolEnd`` (:meth:`Copies.tool_end`)."""
        return self.copies.tool_end(session_id, epoch)

    def load_ack(self) -> int:
        """Spec ``LoadAck`` (:meth:`Copies.load_ack`)."""
        return self.copies.load_ack()

    def prefetch(self, session_id: str) -> SessionView:
        """Spec ``Prefetch`` (:meth:`Copies.prefetch`)."""
        return self.copies.prefetch(session_id)

    def run_prefetches(self) -> int:
        """The early restores that are due (:meth:`Copies.run_prefetches`)."""
        return self.copies.run_prefetches()

    def keep(self, session_id: str) -> SessionView:
        """Spec ``Keep`` (:meth:`PolicyActions.keep`)."""
        return self.policy.keep(session_id)

    def let_go(self, session_id: str) -> SessionView:
        """Spec ``LetGo`` (:meth:`PolicyActions.let_go`)."""
        return self.policy.let_go(session_id)

    def demote(self, session_id: str) -> SessionView:
        """Spec ``Demote`` (:meth:`PolicyActions.demote`)."""
        return self.policy.demote(session_id)

    def park(self, session_id: str, epoch: int) -> SessionView:
        """Spec ``Park`` (:meth:`Handover.park`)."""
        return self.handover.park(session_id, epoch)

    def unpin(self, session_id: str) -> SessionView:
        """Spec ``Unpin`` (:meth:`Handover.unpin`)."""
        return self.handover.unpin(session_id)

    def unpin_for_room(self) -> int:
        """Spec ``Unpin`` of the hand-overs whose pins queued requests need."""
        return self.handover.unpin_for_room()

    def admit(self, session_id: str) -> bool:
        """Spec ``Admit`` (:meth:`Handover.admit`)."""
        return self.handover.admit(session_id)

    def store(self, session_id: str) -> SessionView:
        """StorageTier.tla's ``Store`` (:meth:`L3Tier.store`)."""
        return self.l3.store(session_id)

    def process_storage_acks(self) -> int:
        """StorageTier.tla's ``StoreAck`` and ``PrefetchAck`` (:meth:`L3Tier.process_storage_acks`)."""
        return self.l3.process_storage_acks()

    # ---- Insert ---------------------------------------------------------------------------------------
    def can_insert(self, rec: SessionRecord | None) -> bool:
        return rec is None or rec.state in IDLE

    def insert(self, session_id: str, tokens: Sequence[int], extra_key: str | None = None) -> None:
        """Spec ``Insert``: a turn of the session finished and its KV landed in the tree
        (``cache_finished_req``)."""
        if not isinstance(session_id, str) or not session_id:
            raise BadRequest("session_id must be a non-empty string")
        rec = self.sessions.get(session_id)
        if not self.can_insert(rec):
            assert rec is not None
            raise WrongState(
                f"session {session_id!r} is {rec.state}; a turn cannot end while its KV is offloaded"
                " (call tool_end first)",
                state=rec.state,
            )
        if rec is None:
            old = self._closed.pop(session_id, None)
            rec = SessionRecord(session_id=session_id)
            if old is not None:
                # A reused id continues the old epochs: a tool_end from before the close stays
                # stale (spec EpochMonotone; Closed never goes back to Running under one record).
                rec.epoch = old.epoch
        node, matched = walk(self.tree, tokens, extra_key)
        self.sessions[session_id] = rec
        rec.tokens = array("q", tokens[:matched])
        rec.extra_key = extra_key
        rec.node = node if matched else None
        rec.tree_gen = self.tree_gen
        if rec.state != Phase.RUNNING:
            fire(rec, "insert", Phase.RUNNING)
        self._touch(rec)
        self.counters["turns"] += 1

    # ---- StartLoads -----------------------------------------------------------------------------------
    def start_loads(self) -> bool:
        """Spec ``StartLoads``: queued host→GPU copies start when sglang's load ring is idle."""
        return self.backend.start_loads()

    # ---- TtlSweep -------------------------------------------------------------------------------------
    def ttl_sweep(self) -> int:
        """Spec ``TtlSweep``: release every protection past its deadline. O(1) when none is due,
        O(k log n) for k."""
        n = 0
        for _deadline, seq, sid in Timers.due(self.timers.deadlines, self.now):
            rec = self.sessions.get(sid)
            if rec is None or rec.deadline_seq != seq or rec.state not in EXPIRING:
                continue  # lazily deleted entry, or tool_end accepted (Restoring: its load ends it)
            self._expire(rec)
            n += 1
        return n

    def _expire(self, rec: SessionRecord) -> None:
        """Spec ``TtlSweep`` for one session: release what it holds, ``Expired``. The epoch is
        kept (``EpochMonotone``): a tool_end of the expired call must stay stale. A hand-over
        whose request never came is ``Runnable``: its KV stays in the tree, unpinned."""
        self.backend.release(rec)
        self._settle(rec, "expire")
        self._touch(rec)  # the idle clock restarts at the expiry: forgotten idle_ttl_s after it
        if rec.state in (Phase.HANDOVER, Phase.PARKED):
            self.counters["handover_expired" if rec.state == Phase.HANDOVER else "parked_expired"] += 1
            rec.admit_pending = False
            fire(rec, "ttl_sweep", Phase.RUNNABLE)
            return
        fire(rec, "ttl_sweep", Phase.EXPIRED)
        self.counters["expired"] += 1
        log.debug("session %s expired after %.1fs without tool_end", rec.session_id, self.config.ttl_s)

    def forget_idle(self) -> int:
        """Spec ``Close`` of every session that holds nothing and was idle for ``idle_ttl_s``:
        its record goes to the bounded closed history (tokens and node dropped). O(1) when none
        is due."""
        n = 0
        for _due, _seq, sid in Timers.due(self.timers.idle, self.now):
            rec = self.sessions.get(sid)
            if rec is None or rec.last_active + self.config.idle_ttl_s > self.now:
                continue  # closed already, or active since (a newer entry is queued)
            if rec.state not in IDLE:
                self._touch(rec)  # holds something: the TTL ends that first; look again later
                continue
            self.close(sid)
            self.counters["forgotten"] += 1
            n += 1
        return n

    # ---- Close ----------------------------------------------------------------------------------------
    def can_close(self, rec: SessionRecord) -> bool:
        return rec.state != Phase.CLOSED

    def routed_away(self) -> None:
        """The router sends this server nothing new: it lets go of its sessions (SharedTier.tla's
        ``LetGo``, :meth:`L3Tier.run_drain` at every tick)."""
        self.l3.routed_away()

    def close(self, session_id: str) -> SessionView:
        """Spec ``Close``: release everything the session holds; its record stays (bounded) to
        answer kv_meta and fence old epochs."""
        rec = self._get(session_id)
        if not self.can_close(rec):
            raise WrongState(f"session {session_id!r} is already closed", state=rec.state)
        self.backend.release(rec)
        self._settle(rec, "close")
        fire(rec, "close", Phase.CLOSED)
        self._forget_tokens(rec)
        del self.sessions[session_id]
        self._closed[session_id] = rec
        while len(self._closed) > self.config.closed_history:
            self._closed.popitem(last=False)
        self.counters["closed"] += 1
        return self.view(rec)

    # ---- TreeReset ------------------------------------------------------------------------------------
    def tree_reset(self) -> None:
        """Spec ``TreeReset``: the tree was replaced (flush_cache): every node object is gone, so
        drop references without releasing; offloaded and kept sessions lose their KV.

        sglang flushes only a fully idle scheduler (no write or load pending), but "pending" is
        what its own ack checks left: ``writing_check``/``loading_check`` retire a copy in one
        iteration, and toolkv's tick (the AFTER hook of ``process_input_requests``) sees it in the
        next, after ``check_pending()`` at the end of ``process_input_requests`` may already have
        run a deferred ``/flush_cache?timeout=T``. Such a session has, in the spec, already taken
        its ``WriteAck``/``LoadAck`` step, and ``TreeReset`` (enabled only with ``WriteKeys = {}``
        and no load ack pending) comes after it. So this step is, in spec actions:

        1. ``WriteAck`` for every ``Offloading`` session whose writes sglang retired (→
           ``Offloaded``), ``LoadAck`` for every ``Restoring`` one whose load it retired (→
           ``Handover``, then ``Admit`` → ``Runnable`` when its request was admitted during the
           load) and every ``Prefetching`` one (→ ``Kept``): :meth:`_take_retired_acks`, on the
           records only (the nodes are gone: the GPU copies ``WriteAck`` frees and the pins
           ``LoadAck``/``Admit`` hand over went with the reset, as the spec's ``TreeReset`` clears
           ``dev`` and ``lockRef``);
        2. ``TreeReset``: every session in ``Holding`` becomes ``Lost`` (the KV is gone), the
           others keep their phase (a stale node reference, re-resolved by the next walk).

        A session whose copy sglang had NOT retired would be a reset the spec does not allow
        (only a future sglang could do it): it is closed with an error line instead of taking
        the scheduler down."""
        self._take_retired_acks()
        self.tree_gen += 1
        self.backend.reset()
        mid_copy: list[str] = []
        for rec in self.sessions.values():
            self.backend.forget(rec)
            if rec.state in RESET_LOSES:
                self._settle(rec, "tree_reset")
                rec.admit_pending = False
                fire(rec, "tree_reset", Phase.LOST)
                self.counters["lost"] += 1
            elif rec.state in HOLDING:
                mid_copy.append(rec.session_id)
        for sid in mid_copy:
            log.error("tree reset while session %s was %s: closing it", sid, self.sessions[sid].state)
            self.counters["reset_mid_copy"] += 1
            self.close(sid)
        self._offloading.clear()
        self._restoring.clear()
        self._prefetching.clear()
        self._storing.clear()
        self._fetching.clear()

    def _take_retired_acks(self) -> None:
        """Spec ``WriteAck``/``LoadAck`` (and ``Admit``) for the copies sglang retired before a
        reset that no tick has processed yet, read off the old tree's nodes before the backend
        forgets its loads (see :meth:`tree_reset`). Nothing here touches a cache: the nodes
        belong to the replaced tree, whose memory the reset already returned. A write counts as
        retired when no path node carries a ``write_through_pending_id`` (both releases clear it
        at the ack and leave it on the old nodes); a load when the backend's own ack processing
        finds none in flight: 0.5.16's reset keeps ``ongoing_load_back``, so an unretired load
        shows; 0.5.23's empties it, so there sglang's own idle check is the only witness."""
        for rec in list(self._offloading.values()):
            if rec.node is not None and not self.backend.offload_pending(rec):
                del self._offloading[rec.session_id]
                fire(rec, "write_ack", Phase.OFFLOADED)
        if not (self._restoring or self._prefetching):
            return
        self.backend.poll_loads()
        for rec in list(self._restoring.values()):
            if rec.node is not None and not self.backend.restore_pending(rec):
                self._settle(rec, "load_ack")
                fire(rec, "load_ack", Phase.HANDOVER)
                self.counters["handover"] += 1
                if rec.admit_pending:
                    rec.admit_pending = False
                    fire(rec, "admit", Phase.RUNNABLE)
                    self.counters["admitted"] += 1
        for rec in list(self._prefetching.values()):
            if rec.node is None or not self._prefetch_readable(rec):
                continue
            del self._prefetching[rec.session_id]
            fire(rec, "load_ack", Phase.KEPT)
            self._arm_warm(rec)

    # ---- Tick -----------------------------------------------------------------------------------------
    def set_clock(self, now: float) -> None:
        """Spec ``Tick`` as the bare step: the agreed clock moves to ``now`` (never back)."""
        if now < self.now:
            raise ValueError(f"the agreed clock went backwards ({now} < {self.now})")
        self.now = now

    def tick(self, now: float) -> None:
        """Spec ``Tick`` as a scheduler iteration takes it, after sglang processed its acks: the
        clock moves (:meth:`set_clock`), then every enabled manager action runs. ``now`` must
        already be agreed across ranks. Idle cost: a few emptiness checks."""
        self.set_clock(now)
        if self._offloading:
            self.write_ack()
        if self.caps.storage is not None:  # the L3 tier: store and prefetch acks, released prefetches
            self.process_storage_acks()
        if Timers.any_due(self.timers.prefetch_due, now):
            self.run_prefetches()
        if self._restoring or self._prefetching or self.backend.loads_in_flight():
            # spec StartLoads (only when sglang's load ring is idle), then LoadAck. A load whose
            # session was closed meanwhile still has to run: it holds sglang's locks and slots.
            self.start_loads()
            self.load_ack()
        if self._handover:
            self.unpin_for_room()
        if Timers.any_due(self.timers.deadlines, now):
            self.ttl_sweep()
        if Timers.any_due(self.timers.idle, now):
            self.forget_idle()
        if self.l3.draining:
            self.l3.run_drain()
