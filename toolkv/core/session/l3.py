"""The L3 storage tier's sub-machine (``spec/storage/StorageTier.tla``): the session machine's
actions on it. Its phases and transition table are ground-floor data in :mod:`toolkv.core.phases`
(``L3``, ``L3_TRANSITIONS``, ``fire_l3``), read by the records and the backends too.

An ``Offloaded`` session's copy can go down to sglang's storage backend
(``--hicache-storage-backend``) instead of being dropped when the host must make room. The session
stays ``Offloaded`` in the main machine (a protected copy below the GPU, left by tool_end, the TTL,
close or a tree reset) and ``rec.l3`` says where that copy is, in the storage spec's phases:

=========== ==================== =========================================================
``rec.l3``  StorageTier.tla      meaning
=========== ==================== =========================================================
``""``      Offloaded            on its protected host copy (or not offloaded at all)
storing     Storing              ``Store``: written to L3, the host copy still protected
stored      Stored               ``StoreAck`` whole: host protection released, L3 copy kept
fetching    Prefetching          ``StoragePrefetch``: sglang reads it back, the copy pinned
=========== ==================== =========================================================

``rec.l3_then`` says what a fetch leads to at its ack: the restore of a tool_end (``"tool_end"``)
or an early restore (``"prefetch"``). Every move of ``rec.l3`` goes through :func:`fire_l3`, which
refuses one that :data:`L3_TRANSITIONS` (the spec's relation, checked against TLC's state graph by
``model_tests/test_l3_table.py``) or :data:`L3_OUTSIDE` does not have. Every answer read off an
asynchronous event is agreed across TP ranks inside the backend (``store_ack`` and
``prefetch_ack`` read sglang's lockstep queues, drained with an all-reduce MIN), and the calls run
in the same order on every rank.
"""

from __future__ import annotations

import heapq
from array import array
from collections.abc import Callable, Sequence

from toolkv.core.capabilities import StorageTier
from toolkv.core.lifecycle import fire
from toolkv.core.phases import L3, Phase, fire_l3
from toolkv.core.policy import l3_store_early
from toolkv.core.record import SessionRecord
from toolkv.core.result import SessionView
from toolkv.core.session.loads import Loads
from toolkv.core.session.policy_actions import PolicyActions
from toolkv.core.session.state import MachineState, log
from toolkv.errors import DeviceMemoryFull, StaleEpoch, UnknownSession, WrongState


class L3Tier:
    """The session machine's actions on the storage tier.

    L3 as capacity, not only overflow: an ``Offloaded`` session predicted to stay away longer than
    :func:`~toolkv.core.policy.l3_horizon_s` is stored at the first tick after it is offloaded
    (:meth:`store_early`), and its host copy, unprotected at the whole ``StoreAck``, is host room
    (sglang's ``evict_host`` may take it). Before its predicted return it is read back to the host
    (:meth:`run_l3_readaheads`), so the host holds the sessions due soon. Every time-dependent
    choice reads the agreed clock ``now`` and the duration model every rank feeds alike."""

    def __init__(
        self,
        s: MachineState,
        policy: PolicyActions,
        loads: Loads,
        insert: Callable[[str, Sequence[int], str | None], None],
        close: Callable[[str], object],
    ) -> None:
        self.s = s
        self.policy = policy  # a full host's victim is demoted; a tool_end at arrival demotes
        self.loads = loads  # a copy read back to the host is restored or prefetched from there
        self.insert = insert  # spec Insert of an adopted session's turn (the machine's)
        self.close = close  # spec Close of a session a drained server lets go (the machine's)
        # sessions offloaded since the last tick, by id (insertion order: the same on every rank):
        # the tick decides whether each goes to L3 now (store_early), once its call is noted
        self._store_check: dict[str, tuple[int, SessionRecord]] = {}
        # (when, seq, session id, epoch): reads back to the host ahead of the predicted return
        self._readahead: list[tuple[float, int, str, int]] = []
        # Mooncake's soft pin outlives the TTL (spec/storage/SharedTier.tla, mutant PinTtlShort):
        # it may lapse only once toolkv no longer relies on the copy
        if hasattr(s.backend, "pin_ttl_ms"):
            s.backend.pin_ttl_ms = int(2000 * max(s.config.ttl_s, 1.0))
        # what this server's puts may hold soft-pinned (SharedTier.tla's PinBudget)
        if hasattr(s.backend, "pin_budget_tokens"):
            s.backend.pin_budget_tokens = s.config.l3_pin_tokens
        # a server the router sends nothing new (SharedTier.tla's LetGo): it lets go of its sessions
        self.draining = False
        self._drain_stored: set[str] = set()  # sessions the drain has stored once already

    def _storage(self) -> StorageTier:
        storage = self.s.caps.storage
        assert storage is not None, "an L3 action on a backend without a storage tier"
        return storage

    # ---- Store, StoreAck ------------------------------------------------------------------------------
    def can_store(self, rec: SessionRecord) -> bool:
        return rec.state == Phase.OFFLOADED and not rec.l3 and self.s._storage_on()

    def store(self, session_id: str) -> SessionView:
        """Spec ``Store`` of the storage tier on its own: write an ``Offloaded`` session's protected
        host copy to L3; the host copy stays protected until a whole ``StoreAck``, which the tick
        takes. It is what the host-room rule does to a victim (``yield_host``), callable as
        ``demote`` is, so that the storage-tier conformance replay and fuzz campaign can take the
        spec's ``Store`` step through the manager. Refused (``WrongState``) unless the session is
        ``Offloaded`` on its host copy and a storage tier is on; a backend that cannot store it now
        (a host write in flight, no page hashes, a backend that evicts on its own) changes nothing
        (``l3_store_refused``)."""
        rec = self.s._get(session_id)
        if not self.can_store(rec):
            raise WrongState(
                f"store needs an Offloaded session on its host copy and a storage tier; {session_id!r} is "
                f"{rec.state}" + (f" ({rec.l3})" if rec.l3 else ""),
                state=rec.state,
            )
        self._store(rec)
        return self.s.view(rec)

    def yield_host(self, session_id: str, returns_at: float = float("inf")) -> bool:
        """Make host room with one victim: with a storage tier, Store its host copy to L3 (the host
        copy goes only after the StoreAck; if sglang holds every page already the ack comes at
        once). Else, or if the backend refuses or cuts the write short, ``demote`` (drop) it, but
        only a victim predicted back after ``returns_at`` (the session that needs the room): with
        a storage tier any offloaded session may be a victim, since storing is not dropping, and
        one due sooner is never dropped for a later one. False: the victim changed nothing."""
        rec = self.s.sessions[session_id]
        if self.s._storage_on() and self._store(rec, "host_room") and rec.l3:
            return True
        if self.s._predicted_end(rec) <= returns_at:
            return False
        self.policy.demote(session_id)
        return True

    def _store(self, rec: SessionRecord, why: str = "") -> bool:
        """Spec ``Store`` (then ``StoreAck`` at once if nothing is in flight). False: refused,
        nothing changed. ``why`` (a manager's own move: "l3_early", "host_room") is counted and
        told to :attr:`on_store`."""
        capped = int(getattr(self.s.backend, "pin_cap_refused", 0))
        if not self._storage().store(rec):
            self.s.counters["l3_store_refused"] += 1
            if int(getattr(self.s.backend, "pin_cap_refused", 0)) > capped:
                self.s.counters["l3_store_pin_cap"] += 1  # refused by the pin budget
            return False
        fire_l3(rec, "store", L3.STORING)
        self.s._storing[rec.session_id] = rec
        self.s.counters["l3_store"] += 1
        if why:
            self.s.counters[f"l3_store_{why}"] += 1
            self.s.on_store(rec.session_id, why)
        if why == "l3_early":
            self.s._early.add(rec.session_id)
        self._store_ack(rec)
        return True

    # ---- Store by predicted return (L3 as capacity) ---------------------------------------------------
    def offloaded(self, rec: SessionRecord) -> None:
        """The session just became ``Offloaded`` (tool_start or write_ack): the next tick, once the
        call policy has noted its tool call, decides whether it goes to L3 at once."""
        if self.s._storage_on() and not rec.l3:
            self._store_check[rec.session_id] = (rec.epoch, rec)

    def can_store_early(self, rec: SessionRecord) -> bool:
        """Spec ``Store``'s guard as the policy takes it without a full host: an ``Offloaded``
        session on its host copy (:meth:`can_store`) that is not due soon — predicted away longer
        than writing it to L3 and reading it back, with the margin (``policy.l3_store_early``)."""
        if not self.can_store(rec):
            return False
        remaining = self.s._predicted_end(rec) - self.s.now
        return l3_store_early(
            remaining, rec.offload_tokens, self.s.config.policy_config, self.s.config.l3_read_tokens_per_s
        )

    def store_early(self, session_id: str) -> bool:
        """Spec ``Store`` taken by predicted return: a session that will not be back for longer
        than its L3 round trip goes to L3 now, so that its host copy is room for sessions due
        sooner (counted as such once the ``StoreAck`` releases its protection). Its read back to
        the host is armed ahead of the predicted return (:meth:`run_l3_readaheads`). False: not
        eligible (:meth:`can_store_early`), or the backend refused; nothing changed."""
        rec = self.s._get(session_id)
        if not self.can_store_early(rec):
            return False
        return self._store(rec, "l3_early")

    def run_store_checks(self) -> int:
        """Once per tick on every rank: :meth:`store_early` for each session offloaded since the
        last tick that is still ``Offloaded`` at the same epoch. Returns how many were stored."""
        checks, self._store_check = self._store_check, {}
        n = 0
        for sid, (epoch, rec) in checks.items():
            if self.s.sessions.get(sid) is rec and rec.epoch == epoch and self.store_early(sid):
                n += 1
        return n

    def _arm_readahead(self, rec: SessionRecord) -> None:
        """Read a session stored in L3 back to the host ahead of its predicted return: its L3 read
        time plus the margin before it (agreed clock and model: the same time on every rank).
        Sessions with an early restore of their own (``prefetch_at``) read L3 through it."""
        read_s = rec.offload_tokens / self.s.config.l3_read_tokens_per_s
        when = max(
            self.s.now, self.s._predicted_end(rec) - read_s - self.s.config.policy_config.l3_store_margin_s
        )
        heapq.heappush(self._readahead, (when, self.s.timers.next_seq(), rec.session_id, rec.epoch))

    def run_l3_readaheads(self) -> int:
        """Once per tick on every rank: start the reads back to the host that are due (spec
        ``StoragePrefetch`` of a ``Stored`` session; ``ToolEndFromHost`` when its host copy is
        still there: protected again). At the ack the session is ``Offloaded`` on its protected
        host copy, and its tool_end restores from the host. Returns how many were started."""
        n = 0
        while self._readahead and self._readahead[0][0] <= self.s.now:
            _when, _seq, sid, epoch = heapq.heappop(self._readahead)
            rec = self.s.sessions.get(sid)
            if rec is None or rec.epoch != epoch or rec.state != Phase.OFFLOADED or rec.l3 != L3.STORED:
                continue
            if rec.l3_then or rec.prefetch_at != float("inf"):
                continue
            self._fetch(rec, "host")
            self.s.counters["l3_readahead"] += 1
            self.s.on_store(sid, "l3_readahead")
            n += 1
        return n

    def _store_ack(self, rec: SessionRecord) -> bool | None:
        """Spec ``StoreAck``: whole → the copy lives in L3 (``stored``); short → the session stays
        on its protected host copy (never restored from an incomplete write). None: in flight."""
        got = self._storage().store_ack(rec)
        if got is None:
            return None
        del self.s._storing[rec.session_id]
        early = rec.session_id in self.s._early
        self.s._early.discard(rec.session_id)
        if got:
            fire_l3(rec, "store_ack", L3.STORED)
            self.s.counters["demoted_l3"] += 1
            self.s.counters["l3_stored_tokens"] += rec.offload_tokens
            if rec.prefetch_at != float("inf"):  # the early restore now reads L3 first: start sooner
                lead = rec.offload_tokens / self.s.config.l3_read_tokens_per_s
                self.s.timers.arm_prefetch(rec, max(self.s.now, rec.prefetch_at - lead))
            elif early and not self.s.config.l3_read_at_arrival:  # read it back before its return
                self._arm_readahead(rec)
            log.debug("session %s demoted to L3", rec.session_id)
        else:
            fire_l3(rec, "store_ack", L3.NONE)
            self.s.counters["l3_store_short"] += 1
        return got

    # ---- ToolEnd from L3: StoragePrefetch, ToolEndFromHost --------------------------------------------
    def _fetch(self, rec: SessionRecord, then: str) -> str:
        """Spec ``ToolEnd`` of a stored session (``then`` = "tool_end"), an early restore of one
        ("prefetch") or a read back to the host ahead of its return ("host"): ``storage_prefetch``. "host": the host copy was still there and is protected
        again (the caller restores from it); "prefetching": sglang reads it into the host pool,
        :meth:`process_storage_acks` goes on at its ack; "refused": retried at the next tick."""
        rid = f"toolkv-l3:{rec.session_id}:{rec.epoch}:{self.s.timers.next_seq()}"  # the same on every rank
        got: str = self._storage().storage_prefetch(rec, rid)
        rec.l3_then = then
        rec.prefetch_at = float("inf")  # the read is the early restore, or tool_end came first
        if got == "host":
            fire_l3(rec, "tool_end_from_host", L3.NONE)
            rec.l3_then = ""
            self.s._fetching.pop(rec.session_id, None)
            self.s.counters["l3_from_host"] += 1
            return got
        self.s._fetching[rec.session_id] = rec  # "refused" stays "stored": retried by the tick
        if got == "prefetching":
            fire_l3(rec, "storage_prefetch", L3.FETCHING)
            rec.restore_started_at = self.s.now
            self.s.counters["l3_prefetch"] += 1
        else:
            self.s.counters["l3_prefetch_refused"] += 1
        return got

    def tool_end_l3(self, rec: SessionRecord) -> bool:
        """tool_end of a session with an L3 copy. True: handled here (the restore goes on at the
        prefetch's ack, or sglang's read at arrival brings it); False: the host copy is protected,
        restore from it as usual."""
        if rec.l3 == L3.STORING and self._store_left_for_host(rec):  # ToolEndFromHost
            return False
        if rec.l3 == L3.STORED and not rec.l3_then and self.s.config.l3_read_at_arrival:
            return self._tool_end_at_arrival(rec)
        if rec.l3_then == "tool_end":  # this call's tool_end was accepted already
            raise WrongState(
                f"tool_end already accepted; {rec.session_id!r} is being restored from L3", state=rec.state
            )
        if rec.l3 == L3.FETCHING:  # an early restore from L3 is reading: it becomes the restore
            rec.l3_then = "tool_end"
        elif self._fetch(rec, "tool_end") == "host":
            return False
        self.s._observe_call(rec)
        self.s.counters["tool_end"] += 1
        self.s.counters["tool_end_l3"] += 1
        return True

    def _tool_end_at_arrival(self, rec: SessionRecord) -> bool:
        """``l3_read_at_arrival``: the tool_end of a session stored whole in L3 reads nothing
        itself. Spec ``Demote`` (its protection and L3 sub-phase end; the copy stays in sglang's
        storage), then ``ToolEnd`` of the ``Released`` session (→ ``Running``): sglang's own
        prefetch at the next request's arrival reads what its storage holds, into whatever host
        room its LRU makes, where toolkv's read into a host full of protected copies came back
        short. StorageTier.tla's ``ToolEndAtArrival`` (``ReadAtArrival``): the L3 sub-phase ends
        through its own row, the protections go as a demotion's do (mutant ``ArrivalKeepsPin``
        keeps the storage one), and the main machine moves Offloaded → Released → Running through
        ToolKV.tla's ``Demote`` and ``ToolEnd`` rows."""
        self._arrival_release(rec)
        self.s._settle(rec, "tool_end_at_arrival")
        fire(rec, "demote", Phase.RELEASED)
        self.s.counters["demoted"] += 1
        self.s.on_demote(rec.session_id)
        fire(rec, "tool_end", Phase.RUNNING)
        self.s._observe_call(rec)
        self.s.counters["tool_end"] += 1
        self.s.counters["tool_end_l3_arrival"] += 1
        return True

    def _arrival_release(self, rec: SessionRecord) -> None:
        """What the tool_end at arrival gives back: what a demotion does (the host protection, the
        storage copy's protection; a Stored copy has no prefetch pin). On Mooncake the copy's soft
        pins stay for sglang's read (``hold_pins_for_read``)."""
        self._storage().hold_pins_for_read(rec)
        self.policy.demote_release(rec)

    def prefetch_l3(self, rec: SessionRecord) -> bool:
        """The early restore (spec ``Prefetch``) of a session with an L3 copy. True: handled here
        (a storage prefetch, then the host→GPU prefetch at its ack)."""
        if rec.l3 == L3.STORING and self._store_left_for_host(rec):  # prefetch from the host copy
            return False
        if rec.l3 == L3.FETCHING or rec.l3_then:
            raise WrongState(f"session {rec.session_id!r} is being read from L3 already", state=rec.state)
        return self._fetch(rec, "prefetch") != "host"

    def _store_left_for_host(self, rec: SessionRecord) -> bool:
        """A session whose store is still in flight is read back from its host copy, which is whole
        and still protected, and the store is let go (spec ``ToolEndFromHost`` from ``Storing``):
        never from a storage copy whose write is not acknowledged whole (``RestoreSourceWhole``;
        mutant ``RestoreBeforeStoreAck`` reads it). True: restore from the host copy."""
        self._storage().drop_storage(rec)
        self.s._storing.pop(rec.session_id, None)
        self.s._early.discard(rec.session_id)
        fire_l3(rec, "tool_end_from_host", L3.NONE)
        return True

    # ---- ToolEnd on a server that does not know the session (SharedTier.tla) ----------------------
    def adopt(self, session_id: str, epoch: int, unknown: UnknownSession) -> SessionRecord:
        """SharedTier.tla's ``ToolEnd`` on a server with ``owner = NoServer``: the session was
        stored whole by a server that is gone (drained), so no record of it is here. The shared
        tier's manifest names its epoch and tokens: a tool_end of that epoch adopts it, a record
        at that epoch in ``Running`` (ToolKV.tla's ``Insert`` of the session's turn, its KV
        in the tier), and the next request's arrival reads the tier (sglang's prefetch), as
        StorageTier.tla's ``ToolEndAtArrival`` leaves a session stored on this server. Any other
        epoch is ``StaleEpoch`` (the fence holds across servers; mutant ``NoEpochFence``); no
        manifest (never stored whole, or its pin lapsed and the master evicted it) is the
        ``UnknownSession`` it was. Nothing is held: the pin lapses at its deadline."""
        storage = self.s.caps.storage
        shared = getattr(storage, "shared_tier", None) if self.s.config.l3 else None
        tier = shared() if shared is not None else None
        manifest = tier.find_manifest(session_id) if tier is not None else None
        if isinstance(epoch, bool) or not isinstance(epoch, int):
            raise unknown
        if tier is None or manifest is None or manifest.session_id != session_id:
            raise unknown
        if epoch > manifest.epoch:  # a newer store never completed (its server went mid-store)
            raise UnknownSession(
                f"unknown session {session_id!r}: the shared tier holds it only at epoch {manifest.epoch}; "
                f"the store of epoch {epoch} was never acknowledged whole",
                session_id=session_id,
            )
        if not manifest.pinned():  # its pin lapsed: the master may have evicted a page already
            raise UnknownSession(
                f"unknown session {session_id!r}: its copy in the shared tier is past its soft pin's deadline",
                session_id=session_id,
            )
        if epoch != manifest.epoch:
            self.s.counters["stale_epoch"] += 1
            raise StaleEpoch(
                f"epoch {epoch} is stale for session {session_id!r} (current {manifest.epoch}, from the shared tier)",
                current_epoch=manifest.epoch,
            )
        self.insert(session_id, manifest.tokens, manifest.extra_key)
        rec = self.s.sessions[session_id]
        rec.epoch = manifest.epoch
        rec.tokens = array("q", manifest.tokens)  # this server's tree holds none of it yet
        rec.restore = "l3_at_arrival"
        tier.drop_manifest(session_id)
        self.s.counters["turns"] -= 1  # not a turn of this server's: the adoption of one
        self.s.counters["tool_end"] += 1
        self.s.counters["tool_end_adopted"] += 1
        log.info("session %s adopted from the shared tier at epoch %d", session_id, rec.epoch)
        return rec

    # ---- a drained server that stays up (SharedTier.tla's LetGo) -------------------------------------
    def routed_away(self) -> None:
        """The router sends this server nothing new from now on (the fleet drains it; the
        operator's drain is another thing: there the sessions' calls still come here): each tick
        (:meth:`run_drain`) it lets go of the sessions it holds. A session's next tool_end and
        turn reach another server, so what this one keeps for it serves nobody until its TTL."""
        self.draining = True

    def run_drain(self) -> int:
        """Once per tick on a drained server, every rank alike. A session the shared tier holds
        whole (``Stored``, no read of it in flight) is let go (SharedTier.tla's ``LetGo``): its
        record goes, its copy and manifest stay pinned for the server that adopts it. One on its
        host copy is stored first when the tier is shared (``Store``; let go at its whole ack).
        Any other that holds something, once no copy of it is in flight (no shared tier, its
        store short or refused, an early restore kept, a hand-over whose request went
        elsewhere), is closed (``Release``): nothing of it is anywhere another server reads, and
        its next turn there recomputes it. Returns how many were let go or closed."""
        n = 0
        tier = self._shared_tier()
        for sid, rec in list(self.s.sessions.items()):
            if rec.state not in (Phase.OFFLOADED, Phase.KEPT, Phase.HANDOVER, Phase.PARKED):
                continue  # holds nothing, or a copy is in flight: looked at again next tick
            if rec.l3 == L3.STORED and sid not in self.s._fetching and self._storage().let_go_storage(rec):
                self.close(sid)
                self.s.counters["drain_let_go"] += 1
                n += 1
                continue
            if rec.l3:
                continue  # storing or reading: its ack first
            if rec.state == Phase.OFFLOADED and tier is not None and sid not in self._drain_stored:
                self._drain_stored.add(sid)
                if self._store(rec, "drain"):
                    continue
            self._drain_stored.discard(sid)
            self.close(sid)
            self.s.counters["drain_closed"] += 1
            n += 1
        return n

    def _shared_tier(self) -> object | None:
        """The shared tier (Mooncake's semantics) when the storage tier is on, else None."""
        if not self.s._storage_on():
            return None
        shared = getattr(self.s.caps.storage, "shared_tier", None)
        return shared() if shared is not None else None

    # ---- StoreAck, PrefetchAck (the tick) -------------------------------------------------------------
    def process_storage_acks(self) -> int:
        """Once per tick on every rank: ``StoreAck`` of the stores in flight, ``PrefetchAck`` of the
        prefetches (then the host→GPU restore, or the early restore), and the prefetches of
        released sessions (``poll_storage``: their pins end at their own acks). Returns how many
        acks were taken."""
        storage = self._storage()
        n = 0
        if self._store_check:
            self.run_store_checks()
        if self._readahead:
            self.run_l3_readaheads()
        for rec in list(self.s._storing.values()):
            if self._store_ack(rec) is not None:
                n += 1
        for rec in list(self.s._fetching.values()):
            if rec.l3 == L3.STORED:  # sglang refused the prefetch last time: ask again
                then = rec.l3_then
                if self._fetch(rec, then) == "host":
                    self._after_fetch(rec, then)
                continue
            got = storage.prefetch_ack(rec)
            if got is None:
                continue
            n += 1
            then = rec.l3_then
            del self.s._fetching[rec.session_id]
            fire_l3(rec, "prefetch_ack", L3.NONE)
            rec.l3_then = ""
            if got:
                self.s.counters["l3_restored"] += 1
            else:  # a page was missing: restore what came back, the next turn recomputes the rest
                self.s.counters["l3_prefetch_short"] += 1
                if not storage.protect_host_prefix(rec):
                    self._nothing_came_back(rec, then)
                    continue
            self._after_fetch(rec, then)
        n += storage.poll_storage()
        return n

    def _after_fetch(self, rec: SessionRecord, then: str) -> None:
        """The session's copy is on host again, protected: restore it to the GPU (tool_end), or
        start the early restore (prefetch). A device that cannot take it leaves the session
        Offloaded on its protected host copy: the early restore is tried again later; the
        tool_end's restore is left to sglang's own load-back of the next request or the TTL."""
        whole = rec.offload_tokens
        if then == "host":  # a read-ahead: the protected host copy waits for the tool_end
            return
        try:
            if then == "tool_end":
                self.loads.restore_from_host(rec)
                if rec.restore:
                    rec.recompute_tokens = max(rec.recompute_tokens, whole - self.s._path_tokens(rec))
            else:  # spec Prefetch of a session back on its host copy (its L3 sub-phase is over)
                if rec.state != Phase.OFFLOADED:
                    raise WrongState(
                        f"prefetch needs an Offloaded session; {rec.session_id!r} is {rec.state}",
                        state=rec.state,
                    )
                assert not rec.l3, rec.l3
                self.loads.prefetch_from_host(rec)
        except DeviceMemoryFull:
            rec.admit_pending = False  # nothing to hand over: the request runs on what sglang has
            if then != "tool_end":
                self.s.counters["prefetch_deferred"] += 1
                self.s._defer_prefetch(rec, 0.25)

    def _nothing_came_back(self, rec: SessionRecord, then: str) -> None:
        """A prefetch that read no page: nothing is held; the next turn recomputes it all."""
        self.s.backend.release(rec)
        self.s._settle(rec, "prefetch_ack")
        rec.admit_pending = False
        fire(rec, "demote", Phase.RELEASED)
        if then == "tool_end":
            fire(rec, "tool_end", Phase.RUNNING)
        rec.recompute_tokens, rec.restored_tokens, rec.restore = rec.offload_tokens, 0, "recompute"
