"""Seeded defects applied from outside the production code: subclasses of the real session
machine and backends that put a fixed bug back, for tests that must fail on it (mutation
testing). Named as in the spec's BUG constant. Nothing in ``toolkv.core`` or ``toolkv.sglang``
imports this module.

Each defect overrides one small production method that holds the correct behaviour (the session
machine's ``_epoch_matches``, ``_node_current``, ...; one of its parts', as the copy path's
``_free_at_tool_start``; the backends' ``_take_host_protection``, ``_free_candidate_ready``, ...),
so the defective variant is a few lines and the production method bodies exist once. A defect in
a part is a machine whose ``*_class`` attribute names the defective part. :func:`mutant_manager` builds a manager (and, when it builds the backend too,
the backend) with any set of defects switched on, by composing these subclasses; the mutation
runner, the conformance replay and the fuzz campaigns construct their managers through it.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from functools import cache
from typing import Any

from toolkv.core.backends.base import Agreement, Backend, LocalAgreement
from toolkv.core.backends.hicache_storage import StorageCopy
from toolkv.core.backends.hiradix import HiRadixBackend
from toolkv.core.backends.unified import UnifiedBackend
from toolkv.core.backends.unified_rust import RustUnifiedBackend
from toolkv.core.manager import ManagerConfig, ToolKVManager, make_backend
from toolkv.core.record import SessionRecord
from toolkv.core.result import SessionView
from toolkv.core.session.copies import Copies
from toolkv.core.session.handover import Handover
from toolkv.core.session.l3 import L3Tier
from toolkv.core.session.loads import Loads
from toolkv.core.session.machine import SessionMachine
from toolkv.core.session.policy_actions import PolicyActions
from toolkv.core.treeops import Tree, TreeNode, path_to
from toolkv.errors import DeviceMemoryFull

# ---- manager defects --------------------------------------------------------------------------------


class HostLockLeakLoads(Loads):
    def _restore_refused(self, rec: SessionRecord) -> None:
        super()._restore_refused(rec)
        self.s._settle(rec)
        rec.state = "Expired"


class HostLockLeakMachine(SessionMachine):
    """Caveat 1 (``HostLockLeak``): a refused restore gives the session up without releasing its
    host protection."""

    loads_class = HostLockLeakLoads


class DoubleLoadCopies(Copies):
    def _tool_end_not_offloaded(self, rec: SessionRecord) -> SessionView:
        if rec.state == "Restoring":
            self.s.backend.restore(rec)
            return self.s._meta(rec)
        return super()._tool_end_not_offloaded(rec)


class DoubleLoadMachine(SessionMachine):
    """Caveat 2 (``DoubleLoad``): a retried tool_end of a restoring session issues a second load
    for a node already loading."""

    copies_class = DoubleLoadCopies


class StaleNodeMachine(SessionMachine):
    """Caveat 5 (``StaleNode``): the session's node is used without checking that it is still in
    the current tree."""

    def _node_current(self, rec: SessionRecord, node: Any) -> bool:
        return True


class NoTtlMachine(SessionMachine):
    """Caveat 6 (``NoTtl``): the TTL sweep never runs."""

    def ttl_sweep(self) -> int:
        return 0


class FreeBeforeAckCopies(Copies):
    def _free_at_tool_start(self, clean: bool) -> bool:
        return True


class FreeBeforeAckMachine(SessionMachine):
    """Caveat 7 (``FreeBeforeAck``, manager half): tool_start frees the GPU copies at once, with
    the writes still in flight (the backend half skips the per-node ack check)."""

    copies_class = FreeBeforeAckCopies


class NoEpochCheckMachine(SessionMachine):
    """``NoEpochCheck``: tool_end ignores the epoch, so a late tool_end of an older call acts."""

    def _epoch_matches(self, rec: SessionRecord, epoch: int) -> bool:
        return True


class EpochReuseMachine(SessionMachine):
    """``EpochReuse``: expiry resets the epoch, so an old epoch becomes valid again."""

    def _expire(self, rec: SessionRecord) -> None:
        super()._expire(rec)
        rec.epoch = 0


class DemoteKeepsRefPolicy(PolicyActions):
    def demote_release(self, rec: SessionRecord) -> None:
        return None


class DemoteKeepsRefMachine(SessionMachine):
    """``DemoteKeepsRef`` (policy): a demoted session keeps its host protection — released in
    name, protected in fact, and the host budget never recovers."""

    policy_class = DemoteKeepsRefPolicy


class EarlyKeptMachine(SessionMachine):
    """``EarlyKept`` (policy): an early restore counts as done at any load ack, before its own
    load is acknowledged, so a kept session may be served KV still in flight."""

    def _prefetch_readable(self, rec: SessionRecord) -> bool:
        return True


class KeepFullTtlMachine(SessionMachine):
    """``KeepFullTtl`` (keep TTL): a kept session is armed with the full TTL of a host protection,
    so a client that vanished mid-call pins the GPU for the TTL, not the keep TTL."""

    def _keep_ttl(self) -> float:
        return self.config.ttl_s


class WarmFullTtlMachine(SessionMachine):
    """``WarmFullTtl`` (keep TTL): an early restore that becomes Kept keeps the offload's full-TTL
    deadline instead of the keep TTL."""

    def _arm_warm(self, rec: SessionRecord) -> None:
        return None


class EarlyReleaseHandover(Handover):
    def hand_over(self, rec: SessionRecord, trigger: str) -> None:
        self.s.backend.unpin(rec)
        super().hand_over(rec, trigger)


class EarlyReleaseMachine(SessionMachine):
    """``EarlyRelease`` (the manager before the hand-over): a restored or kept session lets go of
    its pin at the load ack / tool_end, so while its next request waits in sglang's queue the KV
    it was restored for may be evicted."""

    handover_class = EarlyReleaseHandover


class ResidentNoPinHandover(Handover):
    def pin_for_handover(self, rec: SessionRecord) -> None:
        if rec.restore == "resident":
            return
        super().pin_for_handover(rec)


class ResidentNoPinMachine(SessionMachine):
    """``ResidentNoPin`` (with ``lazy_free``): a tool_end that finds the offloaded path still on the
    GPU takes no hand-over pin ("nothing to load, nothing to hold"), so sglang may evict the path
    before the session's next request holds it -- the usual case once offloads leave their GPU
    copies to sglang's eviction."""

    handover_class = ResidentNoPinHandover


class ClosedKeepsRefMachine(SessionMachine):
    """``ClosedKeepsRef``: a closed record keeps its node reference (the manager before), so the
    bounded closed history keeps each closed session's node and, through its parent links, every
    evicted ancestor alive (spec invariant ``ClosedHoldsNoNode``)."""

    def _forget_tokens(self, rec: SessionRecord) -> None:
        node = rec.node
        super()._forget_tokens(rec)
        rec.node = node


# ---- backend defects (mixins for HiRadixBackend and UnifiedBackend) --------------------------------


class RoomIgnoredMixin:
    """``RoomIgnored`` (the host-room rule before): tool_start counts only the free host slots, so
    it refuses while unprotected host copies that sglang would evict fill the pool."""

    def host_evictable_tokens(self) -> int:
        return 0


class UnmirrorProtectedMixin:
    """``UnmirrorProtected`` (spec mutant of the same name): the mirrors a tool_start drops for host
    room may be protected copies, so another session's protected KV loses its host copy while a
    request locks its device copy, and the restore after that request finds nothing to load."""

    @staticmethod
    def _mirror_ok(m: TreeNode, tree: Any, own: Collection[int]) -> bool:
        return m.host_value is not None and m.value is not None and m.lock_ref > 0 and id(m) not in own


class UnmirrorInFlightMixin:
    """``UnmirrorInFlight`` (spec mutant of the same name): a mirror whose write is still in flight
    may be dropped: its host slots go back to the pool while the copy engine still writes them."""

    @staticmethod
    def _mirror_ok(m: TreeNode, tree: Any, own: Collection[int]) -> bool:
        return (
            m.host_value is not None and m.value is not None and m.lock_ref > 0 and m.host_ref_counter == 0
            and id(m) not in own
        )  # fmt: skip


class UnmirrorProtectedUnifiedMixin:
    """``UnmirrorProtected`` on 0.5.23's Python core: the mirror test ignores host locks, so a
    protected session's host copy may be the room."""

    def _mirror_ok(self, m: TreeNode, own: Collection[int], loading: Collection[int]) -> bool:
        d = m.component_data[0]  # FULL
        return d.host_value is not None and d.value is not None and d.lock_ref > 0 and id(m) not in own


class UnmirrorInFlightUnifiedMixin:
    """``UnmirrorInFlight`` on 0.5.23's Python core: a mirror whose write is still in flight may
    be the room."""

    def _mirror_ok(self, m: TreeNode, own: Collection[int], loading: Collection[int]) -> bool:
        d = m.component_data[0]  # FULL
        return (
            d.host_value is not None and d.value is not None and d.lock_ref > 0
            and all(cd.host_lock_ref == 0 for cd in m.component_data) and id(m) not in own
        )  # fmt: skip


class HostRefLeakMixin:
    """``HostRefLeak`` (the Rust core's backend): a protection's release drops the receipt without
    returning the host lock, so the session's host copy can never be evicted again."""

    def _drop_host_protection(self, rec: SessionRecord) -> None:
        self._receipts(rec).host = None  # type: ignore[attr-defined]


class EvictProtectedMixin:
    """Caveat 4 (``EvictProtected``): the backend records a protection it never takes, so host
    eviction may take the protected copy."""

    def _take_host_protection(self, rec: SessionRecord, leaf: TreeNode) -> None:
        return None

    def _drop_host_protection(self, rec: SessionRecord) -> None:
        return None


class EvictProtectedUnifiedMixin(EvictProtectedMixin):
    """``EvictProtected`` on the unified tree: the session's receipts exist, as after a real
    offload, with no host lock in them."""

    def _take_host_protection(self, rec: SessionRecord, leaf: TreeNode) -> None:
        self._receipts(rec)  # type: ignore[attr-defined]


class FreeBeforeAckMixin:
    """Caveat 7 (``FreeBeforeAck``, backend half): a GPU copy is freed with its write in flight,
    locked or loading."""

    def _free_candidate_ready(self, m: TreeNode) -> bool:
        return True


class FreeBeforeAckUnifiedMixin(FreeBeforeAckMixin):
    """``FreeBeforeAck`` on the unified tree: also bypass sglang's device-leaf assertion (demote
    directly), so the defect reaches the state checks instead of stopping at sglang's assert."""

    def _free_device_copy(self, m: TreeNode, tracker: dict[Any, int]) -> None:
        self.tree._demote(m.id, tracker)  # type: ignore[attr-defined]


class KeepNoPinMixin:
    """``KeepNoPin`` (policy): keep takes no path lock, so HiCache may evict the KV that the
    session was promised to find on the GPU."""

    def keep(self, rec: SessionRecord, leaf: TreeNode) -> bool:
        return True


class EarlyRunnableMixin:
    """Caveat 7 (``EarlyRunnable``): runnable before the load is acknowledged."""

    def _readable_after_load_back(self, path: Sequence[TreeNode]) -> bool:
        return True


class ParkUnprotectedHandover(Handover):
    def park_step(self, rec: SessionRecord) -> None:
        super().park_step(rec)
        self.s.backend.release_protection(rec)


class ParkUnprotectedMachine(SessionMachine):
    """Load-adaptive protection (``ParkUnprotected``, as the spec's BUG): a parked session's host
    protection is dropped at the park, so HiCache may evict the host copy while its request
    waits in the queue (spec invariant ``ParkedKeepsKV``)."""

    handover_class = ParkUnprotectedHandover


class WriteLockFreeHandover(Handover):
    def check_offload_room(self, rec: SessionRecord, leaf: TreeNode) -> None:
        return None


class WriteLockFreeMachine(SessionMachine):
    """``WriteLockFree`` (the 0.5.23 crash): tool_start counts its writes as free of device room,
    though each write locks the resident node it copies, and its path, until the ack; under a
    promise (a chunked prefill's rest) the unchecked next chunk then finds nothing to evict."""

    handover_class = WriteLockFreeHandover


class PinPricedByLoadMixin:
    """``PinPricedByLoad``: the restore's room check prices the pin by the tokens to load alone,
    as if the resident path it locks stayed evictable (with lazy free the whole path is usually
    resident, so the pin takes room the check never saw)."""

    def pin_cost(self, leaf: TreeNode) -> int:
        backend: Any = self
        tokens = 0
        for m in path_to(backend.tree, leaf):
            tokens += 0 if backend._on_device(m) else len(m.key)
        return tokens


# defect -> the session machine that seeds it (a manager runs it as its ``machine_class``)
MANAGER_MUTANTS: dict[str, type[SessionMachine]] = {
    "HostLockLeak": HostLockLeakMachine,
    "DoubleLoad": DoubleLoadMachine,
    "StaleNode": StaleNodeMachine,
    "NoTtl": NoTtlMachine,
    "FreeBeforeAck": FreeBeforeAckMachine,
    "NoEpochCheck": NoEpochCheckMachine,
    "EpochReuse": EpochReuseMachine,
    "DemoteKeepsRef": DemoteKeepsRefMachine,
    "EarlyKept": EarlyKeptMachine,
    "EarlyRelease": EarlyReleaseMachine,
    "KeepFullTtl": KeepFullTtlMachine,
    "WarmFullTtl": WarmFullTtlMachine,
    "ParkUnprotected": ParkUnprotectedMachine,
    "ResidentNoPin": ResidentNoPinMachine,
    "ClosedKeepsRef": ClosedKeepsRefMachine,
    "WriteLockFree": WriteLockFreeMachine,
}


def _manager_running(name: str, machine: type[SessionMachine]) -> type[ToolKVManager]:
    """The manager class whose session machine is ``machine``."""
    return type(name + "Manager", (ToolKVManager,), {"machine_class": machine})


# backend class -> defect -> the mixin that seeds it there
BACKEND_MUTANTS: dict[type, dict[str, type]] = {
    HiRadixBackend: {
        "EvictProtected": EvictProtectedMixin,
        "FreeBeforeAck": FreeBeforeAckMixin,
        "EarlyRunnable": EarlyRunnableMixin,
        "KeepNoPin": KeepNoPinMixin,
        "RoomIgnored": RoomIgnoredMixin,
        "PinPricedByLoad": PinPricedByLoadMixin,
        "UnmirrorProtected": UnmirrorProtectedMixin,
        "UnmirrorInFlight": UnmirrorInFlightMixin,
    },
    RustUnifiedBackend: {
        "EvictProtected": EvictProtectedUnifiedMixin,
        "HostRefLeak": HostRefLeakMixin,
        "PinPricedByLoad": PinPricedByLoadMixin,
    },
    UnifiedBackend: {
        "EvictProtected": EvictProtectedUnifiedMixin,
        "FreeBeforeAck": FreeBeforeAckUnifiedMixin,
        "EarlyRunnable": EarlyRunnableMixin,
        "KeepNoPin": KeepNoPinMixin,
        "PinPricedByLoad": PinPricedByLoadMixin,
        "UnmirrorProtected": UnmirrorProtectedUnifiedMixin,
        "UnmirrorInFlight": UnmirrorInFlightUnifiedMixin,
    },
}

# Every implementation defect, named as in the spec's BUG constant.
CAVEATS = frozenset(MANAGER_MUTANTS) | {name for table in BACKEND_MUTANTS.values() for name in table}


@cache
def manager_class(caveats: frozenset[str]) -> type[ToolKVManager]:
    """The manager with the manager halves of ``caveats`` switched on (the production class for
    none). Cached: the conformance replay builds a manager per walk."""
    bases = tuple(MANAGER_MUTANTS[c] for c in sorted(caveats) if c in MANAGER_MUTANTS)
    if not bases:
        return ToolKVManager
    name = "".join(sorted(c for c in caveats if c in MANAGER_MUTANTS))
    return _manager_running(name, type(name + "Machine", bases, _composed_parts(name, bases)))


def _composed_parts(name: str, machines: Sequence[type[SessionMachine]]) -> dict[str, type]:
    """The ``*_class`` attributes of a machine with every defect of ``machines`` on: where two
    defects are in the same part, a part class made of both (each defect overrides its own
    method, so their composition is each one's)."""
    out: dict[str, type] = {}
    for part in SessionMachine.PARTS:
        attr = f"{part}_class"
        own = [vars(m)[attr] for m in machines if attr in vars(m)]
        if len(own) > 1:
            out[attr] = type(name + own[0].__mro__[-2].__name__, tuple(own), {})
    return out


@cache
def backend_class(kind: type, caveats: frozenset[str]) -> type:
    """``kind`` (HiRadixBackend or UnifiedBackend) with the backend halves of ``caveats`` on."""
    table = BACKEND_MUTANTS[kind]
    mixins = tuple(table[c] for c in sorted(caveats) if c in table)
    if not mixins:
        return kind
    return type("".join(sorted(c for c in caveats if c in table)) + kind.__name__, (*mixins, kind), {})


def mutant_manager(
    tree: Tree,
    backend: Backend | None = None,
    *,
    caveats: frozenset[str] = frozenset(),
    config: ManagerConfig | None = None,
    agree: Agreement | None = None,
) -> ToolKVManager:
    """A manager with the seeded defects ``caveats`` (empty: the production manager, unchanged).
    With ``backend`` None the backend is chosen as production chooses it and, on a HiRadixCache or
    UnifiedRadixCache, built with the backend halves of ``caveats``; a given backend is used as it
    is (pin and shadow have no backend defects)."""
    unknown = caveats - CAVEATS
    if unknown:
        raise ValueError(f"unknown caveats {sorted(unknown)}")
    config = config or ManagerConfig()
    agree = agree or LocalAgreement()
    if backend is None:
        backend = make_backend(tree, config=config, agree=agree)
        kind = type(backend)
        if kind in BACKEND_MUTANTS and caveats & set(BACKEND_MUTANTS[kind]):
            cls: Any = backend_class(kind, caveats)
            backend = cls(
                tree, agree=agree, host_budget_tokens=config.host_budget_tokens, unmirror=config.unmirror
            )
    return manager_class(caveats)(tree, backend, config=config, agree=agree)


# ---- load-ring defects (backends given to the manager directly) -----------------------------------


class RingOverrunBackend(HiRadixBackend):
    """Mutant ``RingOverrun``: the restore that took the server down. Each ``tool_end`` starts its
    load at once, in the request handler, after checking only that the *next* producer slot of
    sglang's layer-done counter is free; bunched restores plus sglang's own prefill loads then
    come round to a slot whose load is still in flight."""

    def restore(self, rec: SessionRecord) -> bool:
        counter = self.tree.cache_controller.layer_done_counter
        nxt = (counter.producer_index + 1) % counter.num_counters
        if not self.agree.all_true(bool(counter.events[nxt].finish_event.query())):
            raise DeviceMemoryFull(f"load slot busy; session {rec.session_id!r} stays offloaded")
        runnable = super().restore(rec)
        if self.tree.cache_controller.load_queue:
            self.tree.ready_to_load_host_cache()
        return runnable

    def start_loads(self) -> bool:
        return False


class RingTwoFreeBackend(HiRadixBackend):
    """Mutant ``RingTwoFree``: the tick starts the queue when the next two producer slots are
    free (instead of the whole ring). Two such starts in a row leave sglang one slot, and its own
    next-but-one prefill load reuses a busy slot."""

    def start_loads(self) -> bool:
        ctrl = self.tree.cache_controller
        if not ctrl.load_queue:
            return False
        c = ctrl.layer_done_counter
        nxt = [(c.producer_index + i) % c.num_counters for i in (1, 2)]
        if not self.agree.all_true(all(c.events[i].finish_event.query() for i in nxt)):
            return False
        self.tree.ready_to_load_host_cache()
        return True


# ---- the L3 storage tier (spec/storage/StorageTier.tla; tests/test_l3_file.py) ---------------------


class TrustShortAckBackend(HiRadixBackend):
    """``TrustShortAck``: ``store_ack`` takes a write the storage backend cut short for a whole
    copy and gives up the host protection, so once HiCache evicts the host copy only the pages
    before the refused one can come back."""

    def _store_whole(self, copy: StorageCopy) -> bool:
        return True


class ReleaseDropsPinBackend(HiRadixBackend):
    """``ReleaseDropsPin``: close / the TTL drop the storage record together with the pin of the
    prefetch that reads it, so nothing finishes that prefetch: sglang's ``ongoing_prefetch`` entry,
    its host slots and its protection of the last host node are never returned (and a storage
    backend honouring toolkv's records could delete a page the prefetch has still to read)."""

    def _release_storage(self, rec: SessionRecord) -> None:
        self._l3.pop(rec.session_id, None)


class RestoreBeforeStoreAckL3(L3Tier):
    def _store_left_for_host(self, rec: SessionRecord) -> bool:
        self.s._storing.pop(rec.session_id, None)
        self.s.backend.release_protection(rec)
        rec.l3 = "stored"  # taken for done, as a whole StoreAck would leave it
        return False


class RestoreBeforeStoreAckMachine(SessionMachine):
    """``RestoreBeforeStoreAck`` (manager half): a tool_end while the session's store is in flight
    takes the store for done, gives up the host protection as a whole ``StoreAck`` would, and
    reads the session back from storage instead of from its host copy (``_store_left_for_host``)."""

    l3_class = RestoreBeforeStoreAckL3


class RestoreBeforeStoreAckBackend(HiRadixBackend):
    """``RestoreBeforeStoreAck`` (backend half): a storage copy still being written is the restore
    source: the prefetch reads it from the root, whatever the host holds (``_read_from``). The
    copy was never completely written (spec ``RestoreSourceWhole``)."""

    def _read_from(self, copy: StorageCopy, node: TreeNode, matched: int) -> TreeNode:
        if not copy.whole:
            return self.tree.root_node  # type: ignore[no-any-return]
        return super()._read_from(copy, node, matched)


class ArrivalKeepsPinL3(L3Tier):
    def _arrival_release(self, rec: SessionRecord) -> None:
        pass


class ArrivalKeepsPinMachine(SessionMachine):
    """``ArrivalKeepsPin``: the tool_end at arrival (``l3_read_at_arrival``) of a Stored session
    releases nothing (``_arrival_release``): the session is Running and still holds its storage
    copy's protection (spec ``ReleasedHoldsNothing``), which the backend may then never evict."""

    l3_class = ArrivalKeepsPinL3


# storage-tier defect -> (manager class, HiRadix backend class) that seed it
STORAGE_MUTANTS: dict[str, tuple[type[ToolKVManager], type[HiRadixBackend]]] = {
    "RestoreBeforeStoreAck": (
        _manager_running("RestoreBeforeStoreAck", RestoreBeforeStoreAckMachine),
        RestoreBeforeStoreAckBackend,
    ),
    "TrustShortAck": (ToolKVManager, TrustShortAckBackend),
    "ReleaseDropsPin": (ToolKVManager, ReleaseDropsPinBackend),
    "ArrivalKeepsPin": (_manager_running("ArrivalKeepsPin", ArrivalKeepsPinMachine), HiRadixBackend),
}


def release_drops_pin(base: type[Any]) -> type[Any]:
    """``ReleaseDropsPin`` on any backend with a storage tier (``base``: sglang 0.5.23's unified
    backends, on either tree core), as :class:`ReleaseDropsPinBackend` seeds it on HiRadix."""
    return type(
        f"ReleaseDropsPin{base.__name__}",
        (base,),
        {"_release_storage": ReleaseDropsPinBackend._release_storage},
    )


def trust_whole_read(base: type[Any]) -> type[Any]:
    """``TrustWholeRead`` (``spec/storage/UnifiedRead.tla``): the prefetch of a whole, pinned copy
    is taken for a whole read at its ack, whatever the host tree holds; on 0.5.23 the host
    eviction may have taken a page read before the ack, and the session's "restored" copy is short."""

    def _read_whole(self: Any, copy: StorageCopy, matched: int) -> bool:
        return bool(copy.whole)

    return type(f"TrustWholeRead{base.__name__}", (base,), {"_read_whole": _read_whole})
