"""UnifiedRadixCache backend (sglang 0.5.21+): offload into the unified cache's own host tier, with
its own primitives.

From 0.5.21 on, ``--enable-hierarchical-cache`` builds a ``UnifiedRadixCache`` whose tree lives in
a tree core and is addressed by ``NodeId`` handles; every primitive takes a handle and returns a
*receipt* that the matching release must hand back. The spec actions map onto them as follows:

* ToolStart: ``_execute_and_commit_kv_backup(BackupKV(...))`` root-down on the path nodes without
  a host copy (the primitive sglang's own write-through and its test kit use; all or nothing against
  the free host slots, checked first). It commits the host slots, locks each node until its ack and
  queues the copy; sglang submits it at the next ``check_hicache_events``. Then
  ``inc_host_lock_ref`` on the one recorded leaf (receipt kept). Once every write on the path is
  acknowledged (``write_through_pending_id`` cleared by sglang's ``writing_check``), the GPU copies
  are freed bottom-up (spec ``FreeSet``) with ``_evict_device_leaf``, which demotes a backed-up
  device leaf and asserts that it is one (unlocked, no child on device).
* ToolEnd: ``load_back`` only. In 0.5.23 it locks the path, takes a host lock of its own on the
  anchor, allocates device slots and queues the copy on ``cache_controller.load_queue``; nothing
  moves until a start. :meth:`start_loads` (once per scheduler tick) starts the queue only when no
  load is in flight, the same condition as the 0.5.16 backend, read off ``ack_load_queue``, whose
  length is equal on every rank (sglang reaps acks in lockstep).
* HostRoom / HostUnmirror (``unmirror``, under write_through): ``evict_host`` for the shortfall,
  then the host mirrors of device copies running requests lock, dropped leaf first with the tree
  core's ``_release_full_host_duplicate`` (:meth:`_drop_mirror`); the copies to write are read
  again after the room is made (under write_back ``evict_host`` reclaims host duplicates first).
* LoadAck: sglang's ``loading_check`` releases the load's locks; then the manager unpins and
  releases the protection.
* Park / Unpin to Parked (load-adaptive protection): the host lock stays (or is taken again by
  :meth:`reprotect`) and nothing is loaded; the session's next request brings the KV in through
  sglang's own admission: ``match_kv_cache`` reports the host part as ``host_hit_length`` at
  ``best_match_node``, ``PrefillAdder.add_one_req`` calls ``init_load_back`` on it (which runs the
  same ``load_back``, with a host lock and a path lock of its own) and the scheduler starts the copy
  with ``ready_to_load_host_cache`` when it builds the batch. The host lock only keeps the host
  eviction off the copy: device eviction of a host-locked, backed-up node still demotes it
  (``_is_device_leaf`` reads ``lock_ref`` alone), so a parked path gives its device room back.

Differences from 0.5.16 that the spec's tier relation must account for (see
``docs/sglang_versions.md``): a host lock is a *segment* lock (a split of the protected node
copies ``host_lock_ref`` to the new prefix and the release walks the segment), and a load holds
a host lock on its anchor until its ack.

Node facts (device value, host value, locks, pending write) are read off the Python tree core's
``UnifiedTreeNode`` objects; the Rust tree core exposes no node objects, so :func:`check_tree`
refuses it with the setting that selects the Python core.

The L3 storage tier (``--hicache-storage-backend``; ``spec/storage/StorageTier.tla``, with 0.5.23's
read in ``UnifiedRead.tla``) is :class:`~toolkv.core.backends.unified_storage.UnifiedStorage`, the
same steps as on the HiRadixCache over 0.5.23's primitives, on either tree core.

Never touched: ``ongoing_write_through``/``ongoing_load_back`` (read only), the ack queues,
``writing_check``/``loading_check``/``check_hicache_events`` (the scheduler runs them).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from toolkv.core.backends.base import (
    Agreement,
    HostRestore,
    LocalAgreement,
    OwnLoads,
    ProtectionLedger,
    device_pressure,
    device_spare,
    free_set,
    host_evictable_tokens,
    host_full,
    offload_lock_cost,
    path_resident,
    record_freed,
)
from toolkv.core.backends.hicache_storage import StorageCopy
from toolkv.core.backends.mirrors import drop_order, mirror_tokens
from toolkv.core.backends.unified_mirrors import UnifiedMirrors, host_copy
from toolkv.core.backends.unified_storage import UnifiedStorage
from toolkv.core.policy import Pressure
from toolkv.core.record import SessionRecord
from toolkv.core.treeops import Tier, Tree, TreeNode, attached, path_to
from toolkv.errors import Unsupported

FULL = 0  # sglang ComponentType.FULL: the KV component every unified tree has


def is_unified_tree(tree: Tree) -> bool:
    """True for sglang's ``UnifiedRadixCache`` (0.5.21+), told apart by its handle-based API."""
    return hasattr(tree, "tree_core") and hasattr(tree, "inc_host_lock_ref")


def check_tree(tree: Tree) -> None:
    """Refuse, with the fix in the message, a unified tree this backend cannot drive."""
    if getattr(tree, "cache_controller", None) is None:
        raise Unsupported(
            "UnifiedRadixCache without a host tier: launch sglang with --enable-hierarchical-cache"
        )
    core = type(tree.tree_core).__name__
    if core != "UnifiedTreeCore":
        raise Unsupported(
            f"the {core} tree core exposes no tree nodes; toolkv needs the Python tree core: set "
            "SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=python for the server (or run with "
            "--enable-session-radix-cache, which selects it too)"
        )


def full(node: TreeNode) -> Any:
    """The FULL component's data of a ``UnifiedTreeNode`` (value, host_value, lock_ref,
    host_lock_ref)."""
    return node.component_data[FULL]


def _ntok(nodes: Sequence[TreeNode]) -> int:
    return sum(len(n.key) for n in nodes)


@dataclass(slots=True)
class Receipts:
    """The release receipts (sglang ``DecLockRefParams``) of what one session holds."""

    host: Any = None  # from inc_host_lock_ref on the protected leaf
    pin: Any = None  # from inc_lock_ref on the restoring leaf


class UnifiedBackend(UnifiedMirrors, HostRestore, OwnLoads, UnifiedStorage):
    """Host offload on a ``UnifiedRadixCache`` with HiCache. The steps a seeded defect would
    change are small methods of their own (:meth:`_take_host_protection`,
    :meth:`_free_candidate_ready`, :meth:`_free_device_copy`, :meth:`_readable_after_load_back`),
    overridden from outside by ``toolkv.verify.toolkv.mutants`` for mutation testing."""

    name = "unified"

    def __init__(
        self,
        tree: Tree,
        *,
        agree: Agreement | None = None,
        host_budget_tokens: int | None = None,
        schedule_stream: Any = None,
        unmirror: bool = False,
    ) -> None:
        check_tree(tree)
        self._init_state(
            tree,
            agree=agree,
            host_budget_tokens=host_budget_tokens,
            schedule_stream=schedule_stream,
            unmirror=unmirror,
        )

    def _init_state(
        self,
        tree: Tree,
        *,
        agree: Agreement | None,
        host_budget_tokens: int | None,
        schedule_stream: Any,
        unmirror: bool = False,
    ) -> None:
        """Everything but the tree check (the Rust core's backend checks its own)."""
        self.tree = tree
        # Spec Unmirror: a tool_start short of host room may drop host mirrors of device copies
        # running requests lock (toolkv.core.backends.mirrors; :meth:`_unmirrors` says where)
        self.unmirror = unmirror
        self.counters_unmirrored_tokens = 0  # host tokens of mirrors dropped for room (spec HostUnmirror)
        self.agree = agree or LocalAgreement()
        self.host_budget_tokens = host_budget_tokens
        self.schedule_stream = schedule_stream
        # Loads this manager issued: leaf id -> (leaf, boundary). The load fills the chain from the
        # leaf up to, not including, the boundary (the deepest ancestor on device at load_back
        # time); a split during the load inserts a node into the chain, and it is loading too.
        self._loads: dict[int, tuple[TreeNode, TreeNode]] = {}
        self._ledger = ProtectionLedger()
        # Sessions' copies in the L3 storage tier, by session id (spec/storage/StorageTier.tla).
        self._l3: dict[str, StorageCopy] = {}
        self._held: dict[str, list[str]] = {}
        self._reading: set[str] = set()
        self.pins_left = 0
        self.pin_cap_refused = 0
        self.counters_host_room = 0  # tool_starts that had the host eviction make room (spec HostRoom)
        # Device tokens sglang has promised but not allocated yet (bound by the scheduler side): a
        # restore leaves them free, as on the HiRadixCache.
        self.headroom: Callable[[], int] = lambda: 0

    @property
    def protected_tokens(self) -> int:
        """Host tokens toolkv protects now, a node shared by several sessions counted once."""
        return self._ledger.tokens

    @staticmethod
    def _receipts(rec: SessionRecord) -> Receipts:
        if not isinstance(rec.backend_state, Receipts):
            rec.backend_state = Receipts()
        return rec.backend_state

    # ---- ToolStart ------------------------------------------------------------------------------------
    def offload(self, rec: SessionRecord, leaf: TreeNode) -> bool:
        from sglang.srt.mem_cache.unified_cache.cache_action import BackupKV

        tree = self.tree
        path = path_to(tree, leaf)
        to_write = [m for m in path if full(m).host_value is None]
        need = _ntok(to_write)
        pool = tree.cache_controller.mem_pool_host
        host_free = int(pool.available_size())
        # Spec HostFits: free slots plus the unprotected host leaves sglang's evict_host can free,
        # plus (Unmirror) the mirrors of device copies running requests lock, each counted only
        # when what comes before it is short (they walk the tree)
        room = self.host_evictable_tokens() if need > host_free else 0
        unmirror = self._unmirrors()
        mirrors = self._mirror_room(path) if unmirror and need > host_free + room else []
        room += mirror_tokens(mirrors, host_copy)
        extra, budget = self._ledger.extra(path), self.host_budget_tokens
        fits = need <= host_free + room and (budget is None or self._ledger.tokens + extra <= budget)
        if not self.agree.all_true(fits):
            raise host_full(
                rec,
                need=need,
                host_free=host_free,
                extra=extra,
                protected=self._ledger.tokens,
                budget=budget,
                evictable=room,
            )
        # spec HostRoom: the largest shortfall of any rank, evicted on every rank (the all-reduce
        # runs on every rank, also one whose own free slots suffice), the same LRU order
        short = int(self.agree.max_time(float(need - host_free)))
        made_room = short > 0
        if made_room:
            tree.evict_host(short)
            self.counters_host_room += 1
            # spec HostUnmirror, repeated: mirrors leaf first, in LRU order; the shortfall left is
            # agreed on every rank (all of them evicted: the count above is agreed)
            left = int(self.agree.max_time(float(need - int(pool.available_size())))) if unmirror else 0
            for m in drop_order(mirrors):
                if left <= 0:
                    break
                freed = self._drop_mirror(m)
                left -= freed
                self.counters_unmirrored_tokens += freed
            to_write, need, host_free = self._copies_after_room(path, to_write)
        if made_room and not self.agree.all_true(need <= host_free):  # only unprotected copies were freed
            raise host_full(
                rec,
                need=need,
                host_free=host_free,
                extra=extra,
                protected=self._ledger.tokens,
                budget=budget,
            )
        if to_write:  # root-down: a backup needs a backed-up parent
            tree._execute_and_commit_kv_backup(BackupKV(node_ids=[m.id for m in to_write]))
            lost = [m.id for m in to_write if full(m).host_value is None]
            assert not lost, f"backup refused nodes {lost} after the capacity check"
        self._take_host_protection(rec, leaf)
        rec.protected = leaf
        rec.offload_tokens = _ntok(path)
        self._ledger.take(rec.session_id, path)
        return not self.offload_pending(rec)

    def _copies_after_room(
        self, path: Sequence[TreeNode], to_write: list[TreeNode]
    ) -> tuple[list[TreeNode], int, int]:
        """The path's copies to write, their tokens and the free host slots, read again once
        ``evict_host`` made room (spec ``ToolStart`` reads ``W`` after ``HostRoom``): under
        write_back 0.5.23's ``evict_host`` reclaims host duplicates first (unified_tree_core.py
        ``drive_host_eviction`` -> ``_reclaim_full_host_duplicates``; the Rust core's too), the
        path's own backed-up nodes among them. While that grows the copies to write, the rest is
        asked for (each round takes at least one path node's copy: one round per node at most)."""
        pool = self.tree.cache_controller.mem_pool_host
        host_free = int(pool.available_size())
        need = _ntok(to_write)
        for _ in path:
            again = [m for m in path if not self._host_backed(m)]
            grown, to_write, need = len(again) > len(to_write), again, _ntok(again)
            short = int(self.agree.max_time(float(need - host_free)))
            if not grown or short <= 0:
                break
            self.tree.evict_host(short)
            host_free = int(pool.available_size())
        return to_write, need, host_free

    def pin_cost(self, leaf: TreeNode) -> int:
        """Device tokens a pin of ``leaf``'s path takes from what sglang may evict or allocate."""
        return _ntok(
            [
                m
                for m in path_to(self.tree, leaf)
                if full(m).value is None or all(cd.lock_ref == 0 for cd in m.component_data)
            ]
        )

    def offload_lock_cost(self, leaf: TreeNode) -> int:
        """Device tokens a ``tool_start`` of ``leaf``'s path takes from what sglang may evict while
        its writes are in flight: ``_execute_and_commit_kv_backup`` locks each node it copies, and
        its path, until the ack (unified_radix_cache.py ``inc_lock_ref`` after ``commit_backup``);
        so the resident unlocked nodes from the root to the deepest node without a host copy."""
        return offload_lock_cost(
            path_to(self.tree, leaf),
            lambda m: full(m).host_value is None,
            lambda m: full(m).value is not None and all(cd.lock_ref == 0 for cd in m.component_data),
        )

    def host_need(self, leaf: TreeNode) -> int:
        """Host tokens an offload of ``leaf``'s path would add (unbacked, or the budget's share)."""
        path = path_to(self.tree, leaf)
        write = _ntok([m for m in path if full(m).host_value is None])
        return max(write, self._ledger.extra(path)) if self.host_budget_tokens is not None else write

    def host_evictable_tokens(self) -> int:
        """Tokens the tree core's host eviction can free (spec ``HostEvictable``): its H-leaf rule
        (unified_tree_core.py ``_is_host_leaf``: evicted, backed up, no host or device lock on any
        component) applied to whole subtrees, since it evicts leaf by leaf."""

        def ok(m: TreeNode) -> bool:
            return bool(m.evicted and m.backuped) and all(
                cd.host_lock_ref == 0 and cd.lock_ref == 0 for cd in m.component_data
            )

        return host_evictable_tokens(self.tree.root_node, ok)

    def _take_host_protection(self, rec: SessionRecord, leaf: TreeNode) -> None:
        """Protect the path's host copy until tool_end or the TTL (caveat 4): a host lock on the
        leaf (a segment lock in 0.5.23), its receipt kept for the release."""
        self._receipts(rec).host = self.tree.inc_host_lock_ref(leaf.id).to_dec_params()

    def _drop_host_protection(self, rec: SessionRecord) -> None:
        """Undo :meth:`_take_host_protection` with its receipt (exactly once)."""
        assert rec.protected is not None
        receipts = self._receipts(rec)
        if receipts.host is not None:
            self.tree.dec_host_lock_ref(rec.protected.id, receipts.host)
            receipts.host = None

    def offload_pending(self, rec: SessionRecord) -> bool:
        assert rec.node is not None
        return any(self._writing(m) for m in path_to(self.tree, rec.node))

    def _writing(self, m: TreeNode) -> bool:
        """A write of ``m`` to host is in flight (sglang clears the id at its ack)."""
        return m.write_through_pending_id is not None

    def _node_of(self, node_id: int) -> TreeNode | None:
        """The ``UnifiedTreeNode`` behind a node id (the Python core's arena)."""
        node: TreeNode = self.tree.tree_core.node_by_id(node_id)
        return node

    # ---- loads ----------------------------------------------------------------------------------------
    def _node_loading(self, m: TreeNode) -> bool:
        if self._in_own_load(m):
            return True
        # Loads a request started itself (init_load_back) are keyed by their anchor only:
        # conservatively, every node on the anchor's path is loading.
        core = self.tree.tree_core
        for anchor_id in self.tree.ongoing_load_back:
            if anchor_id in self._loads:
                continue
            try:
                anchor = core.node_by_id(anchor_id)
            except KeyError:
                continue
            if m in path_to(self.tree, anchor):
                return True
        return False

    # ---- WriteAck -------------------------------------------------------------------------------------
    def free_gpu(self, recs: Sequence[SessionRecord]) -> None:
        """Spec ``FreeSet``: the fixpoint of "free m if it is backed up, acked, unlocked, not
        loading, and every child still on device is freed too", grown from the leaves."""
        leaves = [r.node for r in recs if r.node is not None]
        if not leaves:
            return
        order = free_set(self.tree, leaves, data=full, ready=self._free_candidate_ready)
        tracker: dict[Any, int] = {ct: 0 for ct in self.tree.tree_components}
        for m in order:  # children before their parents
            self._free_device_copy(m, tracker)
        record_freed(self.tree, recs, order)

    def leave_gpu(self, recs: Sequence[SessionRecord]) -> None:
        """Spec ``LazyFree`` on 0.5.23: the nodes ``free_gpu`` would free stay on the device,
        unlocked and backed up, in sglang's LRU order. The unified cache's eviction demotes a
        backed-up device leaf whatever its host lock (``_is_device_leaf`` reads ``lock_ref``
        alone, unified_tree_core.py), so sglang takes the room when it needs it and the session's
        protected host copy stays; a session whose copy survives comes back with nothing to load."""
        del recs  # nothing to do: not freeing is the whole action

    def _free_candidate_ready(self, m: TreeNode) -> bool:
        """Spec ``FreeSet``'s per-node guard besides the tree shape: the write is acknowledged
        (caveat 7), no request holds the node, and no load is filling it."""
        return m.write_through_pending_id is None and full(m).lock_ref == 0 and not self._node_loading(m)

    def _free_device_copy(self, m: TreeNode, tracker: dict[Any, int]) -> None:
        """Free one backed-up device copy with sglang's ``_evict_device_leaf``, which asserts it
        is an unlocked device leaf: a second line of defence behind :meth:`_free_candidate_ready`."""
        self.tree._evict_device_leaf(m.id, tracker)

    # ---- ToolEnd (``HostRestore.restore`` with sglang 0.5.23's primitives) --------------------------
    def _on_device(self, m: TreeNode) -> bool:
        return full(m).value is not None

    def _host_backed(self, m: TreeNode) -> bool:
        return full(m).host_value is not None

    def _lock_boundary(self, boundary: TreeNode) -> Callable[[], None]:
        tree = self.tree
        if boundary is tree.root_node:
            return lambda: None
        receipt = tree.inc_lock_ref(boundary.id).to_dec_params()
        return lambda: tree.dec_lock_ref(boundary.id, receipt)

    def _queue_load(self, rec: SessionRecord, leaf: TreeNode, boundary: TreeNode, need: int) -> None:
        queued = self.tree.load_back(leaf.id)  # enqueues only: the copy starts in start_loads or a batch
        assert queued, "load_back refused after the capacity check"
        self._loads[leaf.id] = (leaf, boundary)
        # The session's next request is due: make the restored path the most recently used
        # (a tree walk on the recorded tokens, which end on a node boundary: no split).
        from sglang.srt.mem_cache.radix_cache import RadixKey

        self.tree.touch_prefix(RadixKey(rec.tokens, rec.extra_key))

    def _pin_path(self, rec: SessionRecord, leaf: TreeNode) -> None:
        self._receipts(rec).pin = self.tree.inc_lock_ref(leaf.id).to_dec_params()
        rec.pinned = leaf

    def _readable_after_load_back(self, path: Sequence[TreeNode]) -> bool:
        """True when no load into ``path`` is in flight, so the session may run now (caveat 7:
        never runnable before the load's acknowledgement; otherwise it is pinned until then)."""
        return not any(self._node_loading(m) for m in path)

    def start_loads(self) -> bool:
        """Spec ``StartLoads``: start every queued host->GPU load in one producer slot of sglang's
        layer-done ring, only when no load is in flight (the ring then keeps two free slots for
        sglang's own once-per-prefill-batch starts, which do not check it). Returns True if it
        started one."""
        ctrl = self.tree.cache_controller
        if not ctrl.load_queue:  # the same on every rank: load_back runs in lockstep
            return False
        if not self.agree.all_true(not ctrl.ack_load_queue):
            return False
        self.tree.ready_to_load_host_cache()
        if self.schedule_stream is not None:
            # No batch is this load's consumer: order every later forward after it instead.
            self.schedule_stream.wait_event(ctrl.ack_load_queue[-1].finish_event)
        return True

    def loads_in_flight(self) -> bool:
        return bool(self._loads)

    def poll_loads(self) -> None:
        done = [k for k in self._loads if k not in self.tree.ongoing_load_back]  # retired by loading_check
        for k in done:
            del self._loads[k]

    def restore_pending(self, rec: SessionRecord) -> bool:
        assert rec.node is not None
        return any(full(m).value is None or self._node_loading(m) for m in path_to(self.tree, rec.node))

    # ---- release --------------------------------------------------------------------------------------
    def release(self, rec: SessionRecord) -> None:
        self.unpin(rec)
        self._release_protection(rec)
        self._release_storage(rec)

    # ---- load-adaptive protection (spec ``Park``, ``Unpin`` to ``Parked``) ----------------------------
    #: A parked session's next request is served by sglang 0.5.23's own admission: ``match_kv_cache``
    #: sees the protected host copy as a host hit and ``PrefillAdder`` calls ``init_load_back`` on
    #: it (schedule_policy.py, ``add_one_req``), as on 0.5.16's HiRadixCache.
    parks = True

    # ---- the per-call policy ----------------------------------------------------------------------------
    def keep(self, rec: SessionRecord, leaf: TreeNode) -> bool:
        """Spec ``Keep``: one path lock on the leaf (its receipt kept) if the path is resident."""
        assert rec.pinned is None, f"session {rec.session_id!r} holds a pin already"
        resident = path_resident(
            self.tree, leaf, on_device=lambda m: full(m).value is not None and not self._node_loading(m)
        )
        if not self.agree.all_true(resident):
            return False
        self._receipts(rec).pin = self.tree.inc_lock_ref(leaf.id).to_dec_params()
        rec.pinned = leaf
        return True

    def unpin(self, rec: SessionRecord) -> None:
        if rec.pinned is not None:
            receipts = self._receipts(rec)
            self.tree.dec_lock_ref(rec.pinned.id, receipts.pin)
            receipts.pin = None
            rec.pinned = None

    def worth_prefetching(self, rec: SessionRecord) -> bool:
        assert rec.node is not None
        need = _ntok([m for m in path_to(self.tree, rec.node) if full(m).value is None])
        return self.agree.all_true(need == 0 or need >= self.tree.load_back_threshold)

    def pressure(self) -> Pressure:
        dev_total, dev_avail = device_pressure(self.tree)
        pool = self.tree.cache_controller.mem_pool_host
        host_total = int(getattr(pool, "size", 0)) or int(pool.available_size())
        # room = free + what the host eviction can free (spec HostFits), then toolkv's own budget
        host_avail = min(host_total, int(pool.available_size()) + self.host_evictable_tokens())
        # and the mirrors a tool_start may drop (spec MirrorRoom)
        if host_avail < host_total and self._unmirrors():
            host_avail = min(host_total, host_avail + mirror_tokens(self._mirror_room(()), host_copy))
        if self.host_budget_tokens is not None:
            host_total = min(host_total, self.host_budget_tokens)
            host_avail = min(host_avail, max(0, self.host_budget_tokens - self.protected_tokens))
        spare = device_spare(self.tree, int(self.headroom()))
        return Pressure(dev_total, dev_avail, host_total, min(host_avail, host_total), min(spare, dev_avail))

    def forget(self, rec: SessionRecord) -> None:
        self._ledger.give(rec.session_id)
        self._l3.pop(rec.session_id, None)
        rec.protected = None
        rec.pinned = None
        rec.backend_state = Receipts()

    def reset(self) -> None:
        self._loads.clear()
        self._l3.clear()  # sglang's reset drops its prefetch and backup records with the tree

    # ---- kv_meta --------------------------------------------------------------------------------------
    def tier(self, node: TreeNode | None) -> Tier:
        """The spec's ``Tier(n)`` read off a unified tree node."""
        if node is None or not attached(self.tree, node):
            return Tier.EVICTED
        d = full(node)
        if d.value is not None:
            if self._node_loading(node):
                return Tier.LOADING
            if node.write_through_pending_id is not None:
                return Tier.BACKING_UP
            return Tier.GPU
        if d.host_value is not None:
            return Tier.CPU_PROTECTED if d.host_lock_ref > 0 else Tier.CPU_UNPROTECTED
        return Tier.EVICTED

    def describe(self, rec: SessionRecord) -> dict[str, object]:
        node = rec.node
        if node is None or not attached(self.tree, node):
            return {"tier": Tier.EVICTED.value, "tokens": 0, "device_tokens": 0, "host_tokens": 0}
        tokens = dev = host = 0
        for m in path_to(self.tree, node):
            n, d = len(m.key), full(m)
            tokens += n
            dev += n if d.value is not None else 0
            host += n if d.host_value is not None else 0
        return {"tier": self.tier(node).value, "tokens": tokens, "device_tokens": dev, "host_tokens": host}
