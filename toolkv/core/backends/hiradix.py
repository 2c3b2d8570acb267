"""HiRadixCache backend: offload into sglang's own host tier, with sglang's own primitives.

ToolStart: ``write_backup`` root-down on the path nodes without a host copy (all or nothing
against the free host slots), ``protect_host`` on the one recorded leaf. Once every write on the
path is acknowledged (sglang's ``writing_check`` clears ``write_through_pending_id``), free the GPU
copies with ``_evict_backuped``: only unlocked nodes whose device children are freed too, bottom-up
(spec ``FreeSet``). ToolEnd: ``load_back`` only, which enqueues the copy on sglang's load queue; the
session is Runnable only after sglang's ``loading_check`` has processed the load ack.

Starting a load takes a producer slot of sglang's layer-done counter, a ring of three
(``LayerDoneCounter.update_producer`` asserts the slot's previous load has finished, and the
assertion takes the whole server down). sglang itself starts at most one load per prefill batch
and keeps at most one of its own in flight. So toolkv never starts a load in a request handler:
the scheduler tick (:meth:`start_loads`) starts the whole queue only when no load at all is in
flight (spec ``StartLoads``), and otherwise leaves it to sglang's next prefill batch, which merges
it into its own start (spec ``SysStart``). Either way the ring can never come round to a busy slot
(spec invariant ``RingBounded``).

Never touched: ``ongoing_write_through``/``ongoing_load_back`` (read only), the ack queues,
``writing_check``/``loading_check`` (they contain collectives; the scheduler runs them).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Sequence
from typing import Any

from toolkv.core.backends.base import (
    Agreement,
    HostRestore,
    LocalAgreement,
    LockPins,
    OwnLoads,
    ProtectionLedger,
    device_pressure,
    device_spare,
    free_set,
    host_evictable_tokens,
    host_full,
    offload_lock_cost,
    record_freed,
)
from toolkv.core.backends.hicache_storage import HiCacheStorage, StorageCopy, _ntok
from toolkv.core.backends.mirrors import drop_mirror, drop_order, mirror_ok, mirror_room, mirror_tokens
from toolkv.core.policy import Pressure
from toolkv.core.record import SessionRecord
from toolkv.core.treeops import Tier, Tree, TreeNode, attached, is_loading, path_to, tier


class HiRadixBackend(HostRestore, OwnLoads, LockPins, HiCacheStorage):
    """Host offload on a ``HiRadixCache``. The steps a seeded defect would change are small
    methods of their own (:meth:`_take_host_protection`, :meth:`_free_candidate_ready`,
    :meth:`_readable_after_load_back`), so mutation testing overrides them from outside
    (``toolkv.verify.toolkv.mutants``) instead of switching inside these methods."""

    name = "hiradix"

    def __init__(
        self,
        tree: Tree,
        *,
        agree: Agreement | None = None,
        host_budget_tokens: int | None = None,
        schedule_stream: Any = None,
        unmirror: bool = False,
    ) -> None:
        self.tree = tree
        # Spec Unmirror: a tool_start short of host room may drop host mirrors of device copies
        # running requests lock (toolkv.core.backends.mirrors)
        self.unmirror = unmirror
        self.agree = agree or LocalAgreement()
        self.host_budget_tokens = host_budget_tokens
        self.schedule_stream = schedule_stream
        # Device tokens sglang has promised but not yet allocated (the rest of a chunked prefill,
        # the running batch's decode growth). sglang's own allocations are budgeted against
        # them; a restore is not, so it must leave them free or the next chunk finds no memory
        # (sglang raises "Out of memory" and the server exits). Bound by the scheduler side.
        self.headroom: Callable[[], int] = lambda: 0
        # Loads this manager issued: id(leaf) -> (leaf, boundary). The load fills the chain from the
        # leaf up to, not including, the boundary (the deepest ancestor already on device at
        # load_back time). Kept as a chain, not a node list: a split while the load is in flight
        # inserts a new node into the chain, and that node is loading too.
        self._loads: dict[int, tuple[TreeNode, TreeNode]] = {}
        self._ledger = ProtectionLedger()
        self.counters_host_room = 0  # tool_starts that had evict_host make room (spec HostRoom)
        self.counters_unmirrored_tokens = 0  # host tokens of mirrors dropped for room (spec HostUnmirror)
        # Sessions' copies in the L3 storage tier, by session id (spec/storage/StorageTier.tla).
        self._l3: dict[str, StorageCopy] = {}
        self._held: dict[str, list[str]] = {}
        self._reading: set[str] = set()
        self.pins_left = 0
        self.pin_cap_refused = 0
        # Under write_back: this manager's writes in flight, by ack id (sglang's ``node.id`` of the
        # written node, the key of ``ongoing_write_through``) -> the node the write locked
        self._drain_locks: dict[int, TreeNode] = {}

    @property
    def protected_tokens(self) -> int:
        """Host tokens toolkv protects now, a node shared by several sessions counted once."""
        return self._ledger.tokens

    # ---- ToolStart ------------------------------------------------------------------------------------
    def offload(self, rec: SessionRecord, leaf: TreeNode) -> bool:
        tree = self.tree
        path = path_to(tree, leaf)
        to_write = [m for m in path if m.host_value is None]
        need = _ntok(to_write)
        pool = tree.token_to_kv_pool_host
        host_free = int(pool.available_size())
        # Spec HostFits: free slots plus the unprotected host copies sglang's evict_host can free
        # (counted only when the free slots are short: it walks the tree), plus (Unmirror) the
        # mirrors of device copies running requests lock, counted only when those are short too.
        room = self.host_evictable_tokens() if need > host_free else 0
        unmirror = self._unmirrors()
        mirrors = mirror_room(tree, path, self._mirror_ok) if unmirror and need > host_free + room else []
        extra, budget = self._ledger.extra(path), self.host_budget_tokens
        room += mirror_tokens(mirrors)
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
        # spec HostRoom, repeated: evict_host frees LRU unprotected leaves. Every rank evicts the
        # largest shortfall of any rank (an all-reduce MAX, on every rank: a rank whose own free
        # slots suffice must still take part, and evict as much): the same count on the same LRU
        # order evicts the same nodes, so the ranks' trees stay equal
        short = int(self.agree.max_time(float(need - host_free)))
        if short > 0:
            tree.evict_host(short)
            self.counters_host_room += 1
            # spec HostUnmirror, repeated: mirrors leaf first, in LRU order; the shortfall left is
            # agreed on every rank that evicted (all of them: the count above is agreed)
            short = int(self.agree.max_time(float(need - int(pool.available_size())))) if unmirror else 0
            if short > 0:
                for m in drop_order(mirrors):
                    if short <= 0:
                        break
                    freed = drop_mirror(tree, m)
                    short -= freed
                    self.counters_unmirrored_tokens += freed
            assert int(pool.available_size()) >= need, "the host room made is less than was counted"
        for m in to_write:  # root-down: write_backup needs a backed-up parent
            written = tree.write_backup(m)
            assert written == len(m.key), f"write_backup refused a node after the capacity check ({written})"
            if self._write_back():  # write_back's drain would keep this write's lock (around_writing_check)
                self._drain_locks[m.id] = m
        self._take_host_protection(rec, leaf)
        rec.protected = leaf
        rec.offload_tokens = _ntok(path)
        self._ledger.take(rec.session_id, path)
        return not self.offload_pending(rec)

    def _unmirrors(self) -> bool:
        """Spec ``Unmirror``, where it pays: under ``write_through`` and ``write_through_selective``
        sglang writes a dropped mirror again at the request's finish, asynchronously; under
        ``write_back`` only its eviction would, in a blocking drain of every write in flight
        (``_evict_write_back`` -> ``writing_check(write_back=True)``), which the twin measured as a
        worse p90 (docs/twin.md, "Where the host pool goes")."""
        return self.unmirror and not self._write_back()

    @staticmethod
    def _mirror_ok(m: TreeNode, tree: Tree, own: Collection[int]) -> bool:
        """Spec ``MirrorOk`` (a method, so a seeded defect can replace it)."""
        return mirror_ok(m, tree, own)

    def _write_back(self) -> bool:
        """Whether the server runs ``--hicache-write-policy write_back``: then sglang's eviction can
        finish toolkv's writes without releasing their locks (:meth:`around_writing_check`)."""
        controller = getattr(self.tree, "cache_controller", None)
        return getattr(controller, "write_policy", None) == "write_back"

    def around_writing_check(self, call: Callable[[], Any], write_back: bool) -> Any:
        """Run sglang's ``writing_check`` (``call``), then release the locks of this manager's
        writes that a write_back drain finished (the plugin's AROUND hook on
        ``HiRadixCache.writing_check``).

        A tool_start copy is a locked write (``write_backup(m)`` -> ``inc_lock_ref``), released at
        its ack by the scheduler's ``writing_check()`` (``_finish_write_through_ack(release_lock=True)``).
        Under write_back, sglang's eviction also drains every write in flight with
        ``writing_check(write_back=True)`` (hiradix_cache.py ``_evict_write_back`` ->
        ``flush_staged``), which finishes each ack with ``release_lock=False``: a toolkv copy still
        in flight then kept its lock for good (the twin's 96-session named-tool load: 81 of 171
        tool_start copies, the device filled with locked paths and admission stopped). Writing
        unlocked and waiting within the tool_start avoids the leak too, but holds the scheduler for
        every copy (0.98x stock's throughput at 48 named-tool sessions); releasing here keeps the
        copy asynchronous, as under write_through."""
        if not self._drain_locks:
            return call()
        ongoing = self.tree.ongoing_write_through
        # the node each write locked is its entry's lock node (a split keeps it: the suffix)
        in_flight = {k: ongoing[k][0] for k in self._drain_locks if k in ongoing} if write_back else {}
        try:
            return call()
        finally:
            for k, locked in in_flight.items():
                if k not in ongoing:  # finished by the drain, its lock kept: release it
                    self.tree.dec_lock_ref(locked)
            for k in [k for k in self._drain_locks if k not in ongoing]:
                del self._drain_locks[k]

    def pin_cost(self, leaf: TreeNode) -> int:
        """Device tokens a pin of ``leaf``'s path takes from what sglang may evict or allocate:
        the resident unlocked nodes (evictable until pinned) and the evicted ones (to load)."""
        return _ntok([m for m in path_to(self.tree, leaf) if m.value is None or m.lock_ref == 0])

    def offload_lock_cost(self, leaf: TreeNode) -> int:
        """Device tokens a ``tool_start`` of ``leaf``'s path takes from what sglang may evict while
        its writes are in flight: ``write_backup`` locks each node it copies, and with it the path
        above (hiradix_cache.py ``write_backup`` -> ``inc_lock_ref``), until the ack; so the
        resident unlocked nodes from the root to the deepest node without a host copy (under every
        write policy: under write_back too the lock holds until the ack or the drain)."""
        return offload_lock_cost(path_to(self.tree, leaf), lambda m: m.host_value is None, self._evictable)

    @staticmethod
    def _evictable(m: TreeNode) -> bool:
        return m.value is not None and m.lock_ref == 0

    def host_need(self, leaf: TreeNode) -> int:
        """Host tokens an offload of ``leaf``'s path would add: the unbacked ones to write, or the
        host budget's share if that is larger (the two limits ``offload`` checks)."""
        path = path_to(self.tree, leaf)
        write = _ntok([m for m in path if m.host_value is None])
        return max(write, self._ledger.extra(path)) if self.host_budget_tokens is not None else write

    def host_evictable_tokens(self) -> int:
        """Tokens of the host copies sglang's ``evict_host`` would free if asked for everything
        (spec ``HostEvictable``): nodes off the device (hiradix_cache.py ``evict_host`` skips
        ``not x.evicted``), unlocked (``_update_host_leaf_status``), with no protected node in their
        subtree (it frees leaves, and skips ``host_ref_counter > 0``, so a protected descendant
        keeps its ancestors). One walk over the tree."""
        return host_evictable_tokens(self.tree.root_node)

    def _take_host_protection(self, rec: SessionRecord, leaf: TreeNode) -> None:
        """Protect the path's host copy until tool_end or the TTL (caveat 4): ``protect_host``
        on the leaf keeps sglang's ``evict_host`` off the leaf, and so off its ancestors, which
        are never host-evicted while they have a child."""
        leaf.protect_host()

    def _drop_host_protection(self, rec: SessionRecord) -> None:
        """Undo :meth:`_take_host_protection` (exactly once per protection)."""
        assert rec.protected is not None
        rec.protected.release_host()

    def offload_pending(self, rec: SessionRecord) -> bool:
        assert rec.node is not None
        return any(m.write_through_pending_id is not None for m in path_to(self.tree, rec.node))

    def _node_loading(self, m: TreeNode) -> bool:
        if self._in_own_load(m):
            return True
        # Loads issued by sglang itself (a request's init_load_back) are keyed by their deepest node;
        # conservatively treat every node on such a path as loading.
        # sglang's reset() does not clear ongoing_load_back: skip entries of an old tree.
        for x in self.tree.ongoing_load_back.values():
            if id(x) not in self._loads and attached(self.tree, x) and m in path_to(self.tree, x):
                return True
        return False

    def free_gpu(self, recs: Sequence[SessionRecord]) -> None:
        """Spec ``FreeSet``: the fixpoint of "free m if it is backed up, acked, unlocked, not
        loading, and every child still on device is freed too", grown from the leaves."""
        leaves = [r.node for r in recs if r.node is not None]
        if not leaves:
            return
        order = free_set(self.tree, leaves, data=lambda m: m, ready=self._free_candidate_ready)
        for m in order:  # children before their parents
            self.tree._evict_backuped(m)
        record_freed(self.tree, recs, order)

    def leave_gpu(self, recs: Sequence[SessionRecord]) -> None:
        """Spec ``LazyFree``: the nodes ``free_gpu`` would free stay on the device, unlocked and
        backed up, in sglang's LRU order as they are. HiCache's ``evict`` takes a backed-up node
        with ``_evict_backuped`` (the host copy, protected, stays), so the room is taken only when
        sglang needs it, and a session whose copy survives comes back with nothing to load.

        Their eviction order is deliberately not changed. Ranking them as sglang's first victims
        (the session predicted back last first) was measured in the twin: at 24 sessions on an 8 GB
        host it gave back less than half of what leaving them gained over freeing (resumed TTFT p90
        1.19x stock instead of 0.98x, on one seed), and at 192 sessions the three did not differ;
        the LRU order already takes the longest-paused sessions first."""
        del recs  # nothing to do: not freeing is the whole action

    def _free_candidate_ready(self, m: TreeNode) -> bool:
        """Spec ``FreeSet``'s per-node guard besides the tree shape: the write is acknowledged
        (caveat 7: a slot freed before the ack is reused while the copy still reads it), no
        request holds the node, and no load is filling it."""
        return m.write_through_pending_id is None and m.lock_ref == 0 and not self._node_loading(m)

    # ---- ToolEnd (``HostRestore.restore`` with HiRadixCache's primitives) ---------------------------
    def _on_device(self, m: TreeNode) -> bool:
        return m.value is not None

    def _host_backed(self, m: TreeNode) -> bool:
        return m.host_value is not None

    def _lock_boundary(self, boundary: TreeNode) -> Callable[[], None]:
        self.tree.inc_lock_ref(boundary)  # a no-op for the root
        return lambda: self.tree.dec_lock_ref(boundary)

    def _queue_load(self, rec: SessionRecord, leaf: TreeNode, boundary: TreeNode, need: int) -> None:
        dev = self.tree.load_back(leaf)  # enqueues only: the DMA starts in start_loads or sglang's batch
        assert dev is not None and len(dev) == need, "load_back refused after the capacity check"
        self._loads[id(leaf)] = (leaf, boundary)
        # The session's next request is due: make the restored path the most recently used, or
        # sglang's LRU eviction takes it first (its access time is from the previous turn).
        stamp = time.monotonic()
        for m in path_to(self.tree, leaf):
            m.last_access_time = stamp

    def _pin_path(self, rec: SessionRecord, leaf: TreeNode) -> None:
        self.tree.inc_lock_ref(leaf)
        rec.pinned = leaf

    def _readable_after_load_back(self, path: Sequence[TreeNode]) -> bool:
        """True when no load into ``path`` is in flight, so the session may run now (caveat 7:
        never runnable before the load's acknowledgement; otherwise it is pinned until then)."""
        return not any(self._node_loading(m) for m in path)

    def start_loads(self) -> bool:
        """Spec ``StartLoads``: start every queued host->GPU load in one producer slot, only when
        no load is in flight on any rank (the ring then keeps two free slots for sglang's own
        cadence). Called once per scheduler tick on every rank. Returns True if it started one."""
        ctrl = self.tree.cache_controller
        if not ctrl.load_queue:  # the same on every rank: load_back runs in lockstep
            return False
        idle = all(ev.finish_event.query() for ev in ctrl.layer_done_counter.events)
        if not self.agree.all_true(idle):  # event queries are local: agree before acting
            return False
        self.tree.ready_to_load_host_cache()
        if self.schedule_stream is not None:
            # No batch is this load's consumer: order every later forward after it instead.
            self.schedule_stream.wait_event(ctrl.ack_load_queue[-1].finish_event)
        return True

    def loads_in_flight(self) -> bool:
        return bool(self._loads)

    def poll_loads(self) -> None:
        for key, (leaf, _) in list(self._loads.items()):
            if not is_loading(self.tree, leaf):
                del self._loads[key]

    def restore_pending(self, rec: SessionRecord) -> bool:
        assert rec.node is not None
        return any(m.value is None or self._node_loading(m) for m in path_to(self.tree, rec.node))

    # ---- release --------------------------------------------------------------------------------------
    def release(self, rec: SessionRecord) -> None:
        self.unpin(rec)
        self._release_protection(rec)
        self._release_storage(rec)

    # load-adaptive protection: sglang's own load_back at admission reads the protected host copy
    parks = True

    # ---- the per-call policy ----------------------------------------------------------------------------
    def _resident(self, m: TreeNode) -> bool:
        return m.value is not None and not self._node_loading(m)

    def worth_prefetching(self, rec: SessionRecord) -> bool:
        assert rec.node is not None
        need = _ntok([m for m in path_to(self.tree, rec.node) if m.value is None])
        return self.agree.all_true(need == 0 or need >= self.tree.load_back_threshold)

    def pressure(self) -> Pressure:
        dev_total, dev_avail = device_pressure(self.tree, int(self.headroom()))
        pool = self.tree.token_to_kv_pool_host
        host_total = int(getattr(pool, "size", 0)) or int(pool.available_size())
        # room = free + what evict_host can free (spec HostFits), never another session's protected copy
        host_avail = min(host_total, int(pool.available_size()) + self.host_evictable_tokens())
        # and the mirrors a tool_start may drop (spec MirrorRoom)
        if host_avail < host_total and self._unmirrors():
            host_avail = min(
                host_total, host_avail + mirror_tokens(mirror_room(self.tree, (), self._mirror_ok))
            )
        if self.host_budget_tokens is not None:
            host_total = min(host_total, self.host_budget_tokens)
            host_avail = min(host_avail, max(0, self.host_budget_tokens - self._ledger.tokens))
        spare = device_spare(self.tree, int(self.headroom()))
        return Pressure(dev_total, dev_avail, host_total, min(host_avail, host_total), min(spare, dev_avail))

    def forget(self, rec: SessionRecord) -> None:
        self._ledger.give(rec.session_id)
        self._l3.pop(rec.session_id, None)
        rec.protected = None
        rec.pinned = None

    def reset(self) -> None:
        self._loads.clear()
        self._l3.clear()  # sglang's reset drops its prefetch and backup queues with the tree
        self._drain_locks.clear()  # and its writes (reset runs only with none in flight)

    def describe(self, rec: SessionRecord) -> dict[str, object]:
        node = rec.node
        if node is None or not attached(self.tree, node):
            return {"tier": Tier.EVICTED.value, "tokens": 0, "device_tokens": 0, "host_tokens": 0}
        tokens = dev = host = 0
        m = node
        root = self.tree.root_node
        while m is not root:  # one walk up the path
            n = len(m.key)
            tokens += n
            dev += n if m.value is not None else 0
            host += n if m.host_value is not None else 0
            m = m.parent
        return {
            "tier": tier(self.tree, node, loading=self._node_loading(node), checked=True).value,
            "tokens": tokens,
            "device_tokens": dev,
            "host_tokens": host,
        }
