"""UnifiedRadixCache on sglang 0.5.23's default Rust tree core: the unified backend through node
handles alone.

The Rust ``TreeCore`` has no node objects (``node_by_id`` and ``root_node`` raise), no per-node
lock counts, no children and no read-only host lookup. Everything toolkv *does* to the tree is a
handle call both cores implement (``tests/test_tree_core_0523.py``): the backup of a path's unbacked
nodes, the host lock and its receipt, ``load_back`` and its ack, a device lock and its receipt.
What toolkv *reads* comes from the interface too:

* a path and each node's device residency: ``collect_path_info`` (token spans, whether the FULL
  device value is there, a child count), read fresh as :class:`~toolkv.core.treeops.Handle`\\ s;
* whether a node has a host copy: ``is_backuped``; a write in flight: the cache's own
  ``ongoing_write_through`` (kept by the cache, not the core); a load in flight:
  ``ongoing_load_back`` and its anchors' paths;
* the session's node, found again after a split or a reset: the id recorded at the turn (a split
  keeps the deeper node's id, the Rust core never reuses one) checked against its token span, else
  the read-only ``match_full_device_prefix`` walk of the recorded tokens;
* what a lock takes from what sglang may evict (a hand-over pin, the offload's write locks):
  measured, not computed, since per-node locks are not readable — the lock is taken, the
  tree's own ``evictable_size`` read, and the lock returned with its receipt, in one call
  (:meth:`_lock_cost`); nothing else runs in between, so the tree is as it was.

Where a fact is truly unavailable the safe outcome is chosen:

* **Lazy free only.** Freeing a session's GPU copy itself (spec ``FreeSet``) needs every child's
  residency and every lock; a device-leaf eviction the Rust core refuses poisons it for good
  (``Rust TreeCore panicked: node N is not a D-leaf``). So a finished offload always leaves its
  copy to sglang's eviction (spec ``LazyFree``; ``TOOLKV_LAZY_FREE=0`` is not honoured here and the
  start-up line says so).
* **Host room.** Which host copies sglang's ``evict_host`` would free (spec ``HostEvictable``) needs
  host lock counts of every node; here ``tool_start`` asks sglang's host eviction for the shortfall
  and then decides on the free slots alone (spec ``HostRoom`` then ``ToolStart``; a call refused
  after that has made room for nobody in particular, never freed a protected copy).
* **No host room from mirrors** (spec ``Unmirror``, ``TOOLKV_UNMIRROR``): a ``tool_start`` the
  host cannot take after ``HostRoom`` answers ``507`` as before. Dropping a mirror needs two things
  the Rust core does not offer by node id: a free of one node's host copy that leaves its device
  copy (the Python core's ``_release_full_host_duplicate``; the Rust binding frees host copies
  only inside ``drive_host_eviction``, by a token count, its duplicate reclaim there only under
  ``write_back`` and in its own order), and each node's device and host lock counts (whether a
  request locks it, whether anyone protects it: ``collect_path_info`` reports ids, spans, the
  device value and a child count only).
* **L3.** The storage tier's steps take node ids (``write_backup_storage``, the hash values, the
  prefetch's anchor) and look a path up with ``match_prefix``, which sees host-only nodes on this
  core too (``toolkv.core.backends.unified_storage``); nothing of it reads a node object. Mooncake
  is not stored to (as on the Python core): the session stays on its protected host copy.
* **A host-only suffix** is not found by the device-only lookup: a session whose recorded node
  went away (and whose tokens' device match stops short) is ``SessionKVLost`` (its next turn
  recomputes), never acted on through a stale id.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from toolkv.core.backends.base import Agreement, host_full, offload_lock_cost, path_resident
from toolkv.core.backends.unified import UnifiedBackend, _ntok
from toolkv.core.record import SessionRecord
from toolkv.core.treeops import Handle, Tier, Tree, TreeNode, attached, handle_tree, path_to
from toolkv.errors import Unsupported


def check_rust_tree(tree: Tree) -> None:
    """Refuse, with the fix in the message, a handle tree this backend cannot drive."""
    if getattr(tree, "cache_controller", None) is None:
        raise Unsupported(
            "UnifiedRadixCache without a host tier: launch sglang with --enable-hierarchical-cache"
        )
    if not handle_tree(tree):
        raise Unsupported(f"the {type(tree.tree_core).__name__} tree core is not the Rust TreeCore")


class RustUnifiedBackend(UnifiedBackend):
    """Host offload on a ``UnifiedRadixCache`` whose tree core is sglang's Rust ``TreeCore``. The
    node facts of :class:`UnifiedBackend` are read through handles here; its actions (backup,
    host lock, ``load_back``, pins) are the same calls."""

    name = "unified"
    tree_core = "rust"

    def __init__(
        self,
        tree: Tree,
        *,
        agree: Agreement | None = None,
        host_budget_tokens: int | None = None,
        schedule_stream: Any = None,
        unmirror: bool = False,
    ) -> None:
        check_rust_tree(tree)
        self._init_state(
            tree,
            agree=agree,
            host_budget_tokens=host_budget_tokens,
            schedule_stream=schedule_stream,
            unmirror=unmirror,
        )

    def _unmirrors(self) -> bool:
        """Never on this core, whatever was asked (see the module docstring: no by-id free of a
        host copy whose device copy stays, no lock counts): ``tool_start`` answers 507 as before."""
        return False

    # ---- node facts, through the interface ---------------------------------------------------------
    def _on_device(self, m: TreeNode) -> bool:
        return m.full_value_len is not None

    def _host_backed(self, m: TreeNode) -> bool:
        return bool(self.tree.tree_core.is_backuped(m.id))

    def _writing(self, m: TreeNode) -> bool:
        """A write of ``m`` to host is in flight (the cache's ``ongoing_write_through``)."""
        return any(m.id in w.publish_node_ids for w in self.tree.ongoing_write_through.values())

    def _node_loading(self, m: TreeNode) -> bool:
        if self._in_own_load(m):
            return True
        for anchor_id in self.tree.ongoing_load_back:  # a request's own load: its anchor's path
            if anchor_id in self._loads:
                continue
            if any(p.id == m.id for p in path_to(self.tree, _by_id(self.tree, int(anchor_id)))):
                return True
        return False

    def _node_of(self, node_id: int) -> TreeNode | None:
        """The handle of ``node_id`` as the tree core reports it now (None: the root)."""
        return _by_id(self.tree, node_id)

    def _lock_cost(self, leaf: TreeNode) -> int:
        """Device tokens a path lock on ``leaf`` takes from what sglang may evict, measured: lock,
        read ``evictable_size``, unlock with the receipt (see the module docstring)."""
        tree = self.tree
        before = int(tree.evictable_size())
        receipt = tree.inc_lock_ref(leaf.id).to_dec_params()
        try:
            return before - int(tree.evictable_size())
        finally:
            tree.dec_lock_ref(leaf.id, receipt)

    # ---- ToolStart -----------------------------------------------------------------------------------
    def offload(self, rec: SessionRecord, leaf: TreeNode) -> bool:
        from sglang.srt.mem_cache.unified_cache.cache_action import BackupKV

        tree = self.tree
        path = path_to(tree, leaf)
        to_write = [m for m in path if not self._host_backed(m)]
        need = _ntok(to_write)
        pool = tree.cache_controller.mem_pool_host
        extra, budget = self._ledger.extra(path), self.host_budget_tokens
        if not self.agree.all_true(budget is None or self._ledger.tokens + extra <= budget):
            raise host_full(
                rec, need=need, host_free=int(pool.available_size()), extra=extra,
                protected=self._ledger.tokens, budget=budget,
            )  # fmt: skip
        host_free = int(pool.available_size())
        # spec HostRoom: sglang's host eviction frees unprotected copies, the largest shortfall of
        # any rank on every rank (the all-reduce runs on every rank, also one with room enough)
        short = int(self.agree.max_time(float(need - host_free)))
        if short > 0:
            tree.evict_host(short)
            self.counters_host_room += 1
            to_write, need, host_free = self._copies_after_room(path, to_write)
        if not self.agree.all_true(need <= host_free):
            raise host_full(
                rec, need=need, host_free=host_free, extra=extra, protected=self._ledger.tokens, budget=budget
            )
        if to_write:  # root-down: a backup needs a backed-up parent
            tree._execute_and_commit_kv_backup(BackupKV(node_ids=[m.id for m in to_write]))
            lost = [m.id for m in to_write if not self._host_backed(m)]
            assert not lost, f"backup refused nodes {lost} after the capacity check"
        self._take_host_protection(rec, leaf)
        rec.protected = leaf
        rec.offload_tokens = _ntok(path)
        self._ledger.take(rec.session_id, path)
        return not self.offload_pending(rec)

    def offload_lock_cost(self, leaf: TreeNode) -> int:
        """What the offload's write locks take (they lock the path down to the deepest node without
        a host copy): measured as a lock on that node would take it."""
        path = path_to(self.tree, leaf)
        deepest = [m for m in path if not self._host_backed(m)]
        return self._lock_cost(deepest[-1]) if deepest else 0

    def pin_cost(self, leaf: TreeNode) -> int:
        """What a pin of ``leaf``'s path takes: the tokens to load plus the resident ones a lock
        takes out of what sglang may evict (measured)."""
        path = path_to(self.tree, leaf)
        to_load = _ntok([m for m in path if not self._on_device(m)])
        return to_load + (self._lock_cost(leaf) if not to_load else self._resident_lock_cost(path))

    def _resident_lock_cost(self, path: Sequence[TreeNode]) -> int:
        """The lock cost of a path's device prefix (a lock on an evicted node is refused)."""
        resident = [m for m in path if self._on_device(m)]
        top: list[TreeNode] = []
        for m in resident:  # the device prefix: contiguous from the root
            if top and top[-1].end != m.start:
                break
            top.append(m)
        return self._lock_cost(top[-1]) if top else 0

    def host_need(self, leaf: TreeNode) -> int:
        path = path_to(self.tree, leaf)
        write = _ntok([m for m in path if not self._host_backed(m)])
        return max(write, self._ledger.extra(path)) if self.host_budget_tokens is not None else write

    def host_evictable_tokens(self) -> int:
        """Not readable on the Rust core (host lock counts of every node): 0, the safe count
        (``tool_start`` asks sglang's host eviction itself; a policy's estimate never counts on it)."""
        return 0

    def offload_pending(self, rec: SessionRecord) -> bool:
        assert rec.node is not None
        return any(self._writing(m) for m in path_to(self.tree, rec.node))

    # ---- WriteAck: lazy free only ------------------------------------------------------------------
    def free_gpu(self, recs: Sequence[SessionRecord]) -> None:
        """Spec ``LazyFree`` whatever was asked (see the module docstring): nothing is freed."""
        for r in recs:
            r.freed_tokens = 0

    # ---- ToolEnd -----------------------------------------------------------------------------------
    def _lock_boundary(self, boundary: TreeNode) -> Callable[[], None]:
        if boundary is None:  # the root (a handle path has no root entry)
            return lambda: None
        tree = self.tree
        receipt = tree.inc_lock_ref(boundary.id).to_dec_params()
        return lambda: tree.dec_lock_ref(boundary.id, receipt)

    def restore_pending(self, rec: SessionRecord) -> bool:
        assert rec.node is not None
        return any(not self._on_device(m) or self._node_loading(m) for m in path_to(self.tree, rec.node))

    def keep(self, rec: SessionRecord, leaf: TreeNode) -> bool:
        assert rec.pinned is None, f"session {rec.session_id!r} holds a pin already"
        resident = path_resident(
            self.tree, leaf, on_device=lambda m: self._on_device(m) and not self._node_loading(m)
        )
        if not self.agree.all_true(resident):
            return False
        self._receipts(rec).pin = self.tree.inc_lock_ref(leaf.id).to_dec_params()
        rec.pinned = leaf
        return True

    def worth_prefetching(self, rec: SessionRecord) -> bool:
        assert rec.node is not None
        need = _ntok([m for m in path_to(self.tree, rec.node) if not self._on_device(m)])
        return self.agree.all_true(need == 0 or need >= self.tree.load_back_threshold)

    # ---- kv_meta -----------------------------------------------------------------------------------
    def tier(self, node: TreeNode | None) -> Tier:
        if node is None or not attached(self.tree, node):
            return Tier.EVICTED
        m = path_to(self.tree, node)[-1]
        if self._on_device(m):
            if self._node_loading(m):
                return Tier.LOADING
            if self._writing(m):
                return Tier.BACKING_UP
            return Tier.GPU
        if self._host_backed(m):  # host lock counts are not readable: describe() knows its own
            return Tier.CPU_UNPROTECTED
        return Tier.EVICTED

    def describe(self, rec: SessionRecord) -> dict[str, object]:
        node = rec.node
        if node is None or not attached(self.tree, node):
            return {"tier": Tier.EVICTED.value, "tokens": 0, "device_tokens": 0, "host_tokens": 0}
        tokens = dev = host = 0
        for m in path_to(self.tree, node):
            n = len(m.key)
            tokens += n
            dev += n if self._on_device(m) else 0
            host += n if self._host_backed(m) else 0
        tier = self.tier(node)
        if tier == Tier.CPU_UNPROTECTED and rec.protected is not None:
            tier = Tier.CPU_PROTECTED  # the session's own host lock (lock counts are not readable)
        return {"tier": tier.value, "tokens": tokens, "device_tokens": dev, "host_tokens": host}


def _by_id(tree: Tree, node_id: int) -> Handle | None:
    """The handle of ``node_id`` as the tree core reports it now (None: no such node)."""
    from toolkv.core.treeops import _handle_path

    path = _handle_path(tree, node_id)
    return path[-1] if path else None


__all__ = ["RustUnifiedBackend", "check_rust_tree", "offload_lock_cost"]
