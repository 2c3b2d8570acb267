"""What a backend does for the manager. The manager owns sessions and their lifecycle; a backend
owns the KV: where it goes on ToolStart, how it comes back on ToolEnd, and what is released."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from toolkv.core.policy import Pressure
from toolkv.core.record import SessionRecord
from toolkv.core.treeops import Tree, TreeNode, attached, is_root, node_key, path_to, same_node
from toolkv.errors import DeviceMemoryFull, HostMemoryFull


class Agreement(Protocol):
    """Agreement across tensor-parallel ranks. Every decision that depends on a local reading
    (free memory, a local CUDA event, the wall clock) goes through here before any rank acts."""

    def all_true(self, ok: bool) -> bool: ...

    def max_time(self, t: float) -> float: ...


class LocalAgreement:
    """A single rank agrees with itself."""

    def all_true(self, ok: bool) -> bool:
        return ok

    def max_time(self, t: float) -> float:
        return t


def agreed_pressure(agree: Agreement, p: Pressure) -> Pressure:
    """``p`` as the tightest TP rank reads it: every count the MIN over the ranks (an all-reduce
    MAX of its negation, one per field, on every rank). The policy's choices on it (keep, let go,
    demote for room, an early restore into spare room) read device memory and sglang's queues,
    local readings; taken on each rank's own numbers, one rank could keep while another
    offloads. The MIN because a pin or a copy must fit on every rank. ``device_spare_tokens`` is
    None on every rank alike (the backend's kind), and stays None."""

    def low(x: int) -> int:
        return int(-agree.max_time(-float(x)))

    spare = p.device_spare_tokens
    return Pressure(
        low(p.device_total_tokens),
        low(p.device_available_tokens),
        low(p.host_total_tokens),
        low(p.host_available_tokens),
        None if spare is None else low(spare),
    )


class OwnLoads:
    """Loads a backend issued, kept as chains: ``key -> (leaf, boundary)``, the load filling the
    path from ``leaf`` up to, not including, ``boundary`` (the deepest ancestor already on device
    when the load was queued). A chain, not a node list: a split while the load is in flight
    inserts a new node into it, and that node is loading too."""

    tree: Tree
    _loads: dict[int, tuple[TreeNode, TreeNode]]

    def _chain(self, leaf: TreeNode, boundary: TreeNode) -> list[TreeNode]:
        out = []
        for node in reversed(path_to(self.tree, leaf)):  # the path as it is now: a split inside counts
            if same_node(node, boundary):
                break
            out.append(node)
        return out

    def loading_chains(self) -> list[tuple[TreeNode, list[TreeNode]]]:
        """Each in-flight load of this backend: (its key node, the nodes it is filling)."""
        return [(leaf, self._chain(leaf, boundary)) for leaf, boundary in self._loads.values()]

    def _in_own_load(self, m: TreeNode) -> bool:
        return any(m in self._chain(leaf, boundary) for leaf, boundary in self._loads.values())


def free_set(
    tree: Tree,
    leaves: Sequence[TreeNode],
    *,
    data: Callable[[TreeNode], Any],
    ready: Callable[[TreeNode], bool],
) -> list[TreeNode]:
    """Spec ``FreeSet``: the fixpoint of "free m if it is backed up, ``ready`` (acked, unlocked,
    not loading), and every child still on device is freed too", grown from ``leaves``. Returns
    the nodes in freeing order, children before their parents. ``data(m)`` is the object holding
    the node's ``value``/``host_value`` (the node itself on HiRadixCache, its FULL component on a
    UnifiedRadixCache)."""
    cand: dict[int, TreeNode] = {}
    for leaf in leaves:
        for m in path_to(tree, leaf):
            cand[id(m)] = m
    leaf_ids = {id(x) for x in leaves}
    freed: dict[int, TreeNode] = {}
    order: list[TreeNode] = []
    # ``ready`` reads nothing this loop changes: asked once per node, not once per pass (a path of
    # L nodes takes up to L passes, and ``ready`` walks the loads in flight)
    is_ready: dict[int, bool] = {}
    changed = True
    while changed:
        changed = False
        for key, m in cand.items():
            d = data(m)
            if key in freed or d.value is None or d.host_value is None:
                continue
            if key not in is_ready:
                is_ready[key] = ready(m)
            if not is_ready[key]:
                continue
            if any(data(c).value is not None and id(c) not in freed for c in m.children.values()):
                continue
            if key in leaf_ids or any(id(c) in freed for c in m.children.values()):
                freed[key] = m
                order.append(m)
                changed = True
    return order


def record_freed(tree: Tree, recs: Sequence[SessionRecord], order: Sequence[TreeNode]) -> None:
    """Each session's ``freed_tokens``: the tokens of its path among the freed nodes."""
    for r in recs:
        on_path = {node_key(m) for m in path_to(tree, r.node)} if r.node is not None else set()
        r.freed_tokens = sum(len(m.key) for m in order if node_key(m) in on_path)


class ProtectionLedger:
    """Host tokens toolkv protects, each path node counted once however many sessions protect a
    path through it (two sessions sharing a 1,000-token prompt hold 1,000 tokens of it, not 2,000):
    the number ``host_budget_tokens`` bounds. A node's tokens are counted as of its first
    protection; a later split leaves them with the suffix object (which keeps its identity), and a
    path through the new prefix counts the prefix again until the older protections are gone:
    never fewer tokens than are held, at most a split's worth more."""

    def __init__(self) -> None:
        self._nodes: dict[Any, list[Any]] = {}  # node_key(node) -> [node, tokens, sessions protecting it]
        self._held: dict[str, list[Any]] = {}  # session id -> node_key of the nodes it protects
        self.tokens = 0

    def extra(self, path: Sequence[TreeNode]) -> int:
        """Tokens protecting ``path`` would add: those of its nodes no session protects yet."""
        return sum(len(m.key) for m in path if node_key(m) not in self._nodes)

    def take(self, session_id: str, path: Sequence[TreeNode]) -> None:
        assert session_id not in self._held, f"session {session_id!r} protects a path already"
        for m in path:
            entry = self._nodes.get(node_key(m))
            if entry is None:
                self._nodes[node_key(m)] = [m, len(m.key), 1]
                self.tokens += len(m.key)
            else:
                entry[2] += 1
        self._held[session_id] = [node_key(m) for m in path]

    def give(self, session_id: str) -> None:
        """Return what ``take`` counted for the session (a no-op if it holds nothing)."""
        for key in self._held.pop(session_id, ()):
            entry = self._nodes[key]
            entry[2] -= 1
            if entry[2] == 0:
                del self._nodes[key]
                self.tokens -= entry[1]
        assert self.tokens >= 0 and (self.tokens == 0) == (not self._nodes)


def hiradix_host_evictable(m: TreeNode) -> bool:
    """HiRadixCache's ``evict_host`` may free ``m`` once it is a leaf: off the device (it skips
    ``not x.evicted``), backed up, unlocked (``_update_host_leaf_status``), unprotected."""
    return m.value is None and m.host_value is not None and m.lock_ref == 0 and m.host_ref_counter == 0


def closed_subtrees(root: TreeNode, node_ok: Callable[[TreeNode], bool]) -> list[TreeNode]:
    """The nodes below ``root`` for which ``node_ok`` holds, and for every node of their subtree:
    the sets sglang frees leaf by leaf (a descendant that may not go keeps its ancestors). One
    post-order walk, no recursion; parents after their children."""
    out: list[TreeNode] = []
    free_below: dict[int, bool] = {}  # id(node) -> its whole subtree is ok
    stack: list[tuple[TreeNode, bool]] = [(root, False)]
    while stack:
        node, done = stack.pop()
        kids = list(node.children.values())
        if not done:
            stack.append((node, True))
            stack.extend((c, False) for c in kids)
            continue
        ok = node is not root and all(free_below[id(c)] for c in kids) and node_ok(node)
        for c in kids:
            del free_below[id(c)]
        free_below[id(node)] = ok
        if ok:
            out.append(node)
    return out


def host_evictable_tokens(
    root: TreeNode, node_ok: Callable[[TreeNode], bool] = hiradix_host_evictable
) -> int:
    """Spec ``HostEvictable``, in tokens: the host copies ``evict_host`` can free on demand. A
    node counts when ``node_ok`` holds for it and for every node of its subtree: ``evict_host``
    frees leaves, so a descendant on the device, locked or protected keeps its ancestors."""
    return sum(len(n.key) for n in closed_subtrees(root, node_ok))


def host_full(
    rec: SessionRecord,
    *,
    need: int,
    host_free: int,
    extra: int,
    protected: int,
    budget: int | None,
    evictable: int = 0,
) -> HostMemoryFull:
    """The 507 for a ToolStart that does not fit, with the numbers of whichever limit refused it:
    the host pool (``need`` unbacked tokens against ``host_free`` plus the ``evictable`` tokens of
    unprotected copies sglang could free) or toolkv's host budget (``extra`` tokens no other
    session protects yet, against ``protected`` of ``budget``)."""
    why = []
    if need > host_free + evictable:
        why.append(
            f"the host pool has {host_free} free tokens and {evictable} evictable, and the path needs"
            f" {need} written"
        )
    if budget is not None and protected + extra > budget:
        why.append(
            f"host_budget_tokens is {budget}, {protected} are protected and the session would add {extra}"
        )
    if not why:  # another rank refused (agreed decision)
        why.append("another tensor-parallel rank has no room")
    return HostMemoryFull(
        f"cannot protect session {rec.session_id!r} on host: " + "; ".join(why),
        need_tokens=need,
        host_free_tokens=host_free,
        host_evictable_tokens=evictable,
        budget_extra_tokens=extra,
        protected_tokens=protected,
    )


def path_resident(tree: Tree, leaf: TreeNode, *, on_device: Callable[[TreeNode], bool]) -> bool:
    """Every node of ``leaf``'s path is on the device and readable (spec ``PathValid``)."""
    return all(on_device(m) for m in path_to(tree, leaf))


def device_pressure(tree: Tree, reserved: int = 0) -> tuple[int, int]:
    """(device pool size, tokens free or evictable minus ``reserved``) of a radix tree's allocator."""
    alloc = tree.token_to_kv_pool_allocator
    total = int(getattr(alloc, "size", 0)) or int(alloc.available_size()) + int(tree.evictable_size())
    avail = int(alloc.available_size()) + int(tree.evictable_size()) - int(reserved)
    return total, max(0, min(avail, total))


def device_spare(tree: Tree, reserved: int = 0) -> int:
    """Tokens free on the device (not merely evictable) after ``reserved`` promised ones."""
    return max(0, int(tree.token_to_kv_pool_allocator.available_size()) - int(reserved))


class LockPins:
    """Spec ``Keep`` on a tree whose locks are ``inc_lock_ref(node)``/``dec_lock_ref(node)``
    (HiRadixCache, RadixCache): the pin is one path lock on the recorded leaf, held in
    ``rec.pinned`` and returned exactly once."""

    tree: Tree
    agree: Agreement

    def _resident(self, m: TreeNode) -> bool:
        return m.value is not None

    def keep(self, rec: SessionRecord, leaf: TreeNode) -> bool:
        assert rec.pinned is None, f"session {rec.session_id!r} holds a pin already"
        if not self.agree.all_true(path_resident(self.tree, leaf, on_device=self._resident)):
            return False
        self.tree.inc_lock_ref(leaf)
        rec.pinned = leaf
        return True

    def unpin(self, rec: SessionRecord) -> None:
        if rec.pinned is not None:
            self.tree.dec_lock_ref(rec.pinned)
            rec.pinned = None


def device_full(rec: SessionRecord, need: int, free: int, evictable: int, reserved: int) -> DeviceMemoryFull:
    """The 503 for a restore that eviction cannot make room for, with the numbers."""
    return DeviceMemoryFull(
        f"cannot load {need} tokens back now: {free} free and {evictable} evictable on device, "
        f"{reserved} promised to running requests; session {rec.session_id!r} stays offloaded",
        need_tokens=need,
        device_free_tokens=free,
        device_evictable_tokens=evictable,
        promised_tokens=reserved,
    )


def offload_lock_cost(
    path: Sequence[TreeNode],
    locked_by_offload: Callable[[TreeNode], bool],
    evictable: Callable[[TreeNode], bool],
) -> int:
    """Tokens of ``path`` (root-down) an offload's locks take from what sglang may evict: a lock on
    a node is a path lock (``inc_lock_ref`` walks to the root), so every ``evictable`` node from
    the root down to the deepest node the offload locks (``locked_by_offload``) stops being
    evictable until the lock goes."""
    deepest = max((i for i, m in enumerate(path) if locked_by_offload(m)), default=-1)
    return sum(len(m.key) for m in path[: deepest + 1] if evictable(m))


def offload_room_full(
    rec: SessionRecord, need: int, free: int, evictable: int, reserved: int
) -> DeviceMemoryFull:
    """The 503 for a ``tool_start`` whose locks would take device room sglang has promised."""
    return DeviceMemoryFull(
        f"cannot offload now: copying session {rec.session_id!r} to host would lock {need} device tokens "
        f"until the copy lands, and {free} free + {evictable} evictable cannot spare them next to the "
        f"{reserved} promised to running requests; its KV stays in the GPU cache (retry the tool_start)",
        need_tokens=need,
        device_free_tokens=free,
        device_evictable_tokens=evictable,
        promised_tokens=reserved,
    )


def make_room(
    tree: Tree,
    agree: Agreement,
    rec: SessionRecord,
    *,
    need: int,
    reserved: int,
    evict: Callable[[int], None],
) -> None:
    """Make ``need`` device tokens free next to ``reserved`` (tokens sglang promised to running
    requests) by evicting unlocked cache with sglang's own eviction (``evict(tokens)``), the way
    its ``load_back`` does. The caller locks what must survive (the session's own device prefix).
    Raises ``DeviceMemoryFull`` before evicting anything when even that cannot make room."""
    alloc = tree.token_to_kv_pool_allocator
    free = int(alloc.available_size())
    evictable = int(tree.evictable_size())
    short = need + reserved - free
    if not agree.all_true(short <= evictable):
        raise device_full(rec, need, free, evictable, reserved)
    # Every rank evicts the largest shortfall of any rank (an all-reduce MAX): the same count on
    # the same LRU order evicts the same nodes, so the ranks' trees stay equal.
    short = int(agree.max_time(float(short)))
    if short > 0:
        evict(short)
        free = int(alloc.available_size())
    if not agree.all_true(need + reserved <= free):  # eviction came up short
        raise device_full(rec, need, free, int(tree.evictable_size()), reserved)


def give_up_suffix(tree: Tree, rec: SessionRecord, boundary: TreeNode, need: int) -> None:
    """Below sglang's ``load_back_threshold`` nothing is worth loading (sglang itself recomputes
    such a suffix): the session runs on its device prefix (up to ``boundary``), so that, as the
    spec requires of a Runnable session, its recorded path is all on device; its next request
    recomputes the suffix. The caller releases the protection."""
    keep = sum(len(m.key) for m in path_to(tree, boundary)) if not is_root(tree, boundary) else 0
    rec.node = boundary if keep else None
    del rec.tokens[keep:]
    rec.restored_tokens, rec.recompute_tokens = 0, need
    rec.restore = "below_load_back_threshold"


class HostRestore:
    """Spec ``ToolEnd`` on a tree with a host tier (HiRadixCache, UnifiedRadixCache): load the
    evicted part of the path back, all or nothing. Three answers besides a load: nothing is
    missing (``resident``); the missing suffix is under sglang's ``load_back_threshold``, which
    sglang never loads (``below_load_back_threshold``: the protection is released, the session
    runs on its device prefix and its next request recomputes the suffix, as sglang does for its
    own requests); or the device cannot take it even after evicting unlocked cache the way
    sglang's own ``load_back`` does (``DeviceMemoryFull``, nothing changed). A backend supplies
    the primitives of its sglang release (the ``_``-methods below).

    The host protection's bookkeeping around those primitives (the ledger that
    ``host_budget_tokens`` bounds, ``rec.protected``) is the same on both releases and is kept
    here once: its release (:meth:`_release_protection`) and its re-take for a parked hand-over
    (:meth:`reprotect`); only how a node's host copy is read and how a path's host copy is locked
    differ (:meth:`_host_backed`, ``_take_host_protection``, ``_drop_host_protection``)."""

    tree: Tree
    agree: Agreement
    headroom: Callable[[], int]
    host_budget_tokens: int | None
    _ledger: ProtectionLedger

    def _on_device(self, m: TreeNode) -> bool:
        raise NotImplementedError

    def _host_backed(self, m: TreeNode) -> bool:
        """Whether the node has a host copy (``host_value``: the node's, or its FULL component's)."""
        raise NotImplementedError

    def _take_host_protection(self, rec: SessionRecord, leaf: TreeNode) -> None:
        """Lock the path's host copy against sglang's ``evict_host`` (the leaf's lock covers the path)."""
        raise NotImplementedError

    def _drop_host_protection(self, rec: SessionRecord) -> None:
        """Undo ``_take_host_protection`` (exactly once per protection)."""
        raise NotImplementedError

    def _lock_boundary(self, boundary: TreeNode) -> Callable[[], None]:
        """Lock the session's device prefix (up to ``boundary``) while room is made; returns the unlock."""
        raise NotImplementedError

    def _queue_load(self, rec: SessionRecord, leaf: TreeNode, boundary: TreeNode, need: int) -> None:
        """``load_back`` the chain below ``boundary`` (enqueue only) and make the path most recent."""
        raise NotImplementedError

    def _pin_path(self, rec: SessionRecord, leaf: TreeNode) -> None:
        """Pin the path until every load into it is acknowledged (``rec.pinned``)."""
        raise NotImplementedError

    def _release_protection(self, rec: SessionRecord) -> None:
        if rec.protected is not None:
            self._drop_host_protection(rec)
            rec.protected = None
            self._ledger.give(rec.session_id)

    def release_protection(self, rec: SessionRecord) -> None:
        self._release_protection(rec)

    def reprotect(self, rec: SessionRecord) -> bool:
        """Protect the session's path on host again (spec ``Unpin`` to ``Parked``): only when every
        node of it has a host copy (a restored path keeps the copies it was loaded from, which
        0.5.23 keeps as duplicates after the load's ack; a kept path may never have been written)
        and the host budget takes it. The protection is the same as an offload's (on 0.5.23 a
        segment host lock, its receipt kept for the release at admission). False: nothing changed."""
        leaf = rec.node
        if leaf is None or rec.protected is not None or not attached(self.tree, leaf):
            return False
        path = path_to(self.tree, leaf)
        backed = all(self._host_backed(m) for m in path)
        budget = self.host_budget_tokens
        fits = budget is None or self._ledger.tokens + self._ledger.extra(path) <= budget
        if not self.agree.all_true(backed and fits):
            return False
        self._take_host_protection(rec, leaf)
        rec.protected = leaf
        self._ledger.take(rec.session_id, path)
        return True

    def _readable_after_load_back(self, path: Sequence[TreeNode]) -> bool:
        raise NotImplementedError

    def restore(self, rec: SessionRecord) -> bool:
        tree = self.tree
        leaf = rec.node
        assert leaf is not None and attached(tree, leaf), "a protected leaf cannot leave the tree"
        path = path_to(tree, leaf)
        missing = [m for m in path if not self._on_device(m)]
        need = sum(len(m.key) for m in missing)
        if missing:
            boundary = missing[0].parent  # the deepest ancestor still on device (or the root)
            if self.agree.all_true(need < tree.load_back_threshold):
                self._release_protection(rec)
                give_up_suffix(tree, rec, boundary, need)
                return True
            self._make_room(rec, need, boundary)  # raises DeviceMemoryFull before changing anything
            self._queue_load(rec, leaf, boundary, need)
        rec.restored_tokens, rec.recompute_tokens = need, 0
        rec.restore = "loading" if missing else "resident"
        if self._readable_after_load_back(path):
            self._release_protection(rec)
            return True
        self._pin_path(rec, leaf)
        return False

    def _make_room(self, rec: SessionRecord, need: int, boundary: TreeNode) -> None:
        """``make_room`` next to ``headroom()`` (tokens sglang promised to running requests). Never
        evicted: locked nodes (running requests, writes and loads in flight, pins) and the
        session's own device prefix (locked here for the duration)."""
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        tree = self.tree
        unlock = self._lock_boundary(boundary)
        try:
            make_room(
                tree,
                self.agree,
                rec,
                need=need,
                reserved=int(self.headroom()),
                evict=lambda n: tree.evict(EvictParams(num_tokens=n)),
            )
        finally:
            unlock()


class SynchronousLoads:
    """For backends whose restore finishes inside ``restore`` (pin, shadow): nothing is ever
    queued or in flight, so the asynchronous-load steps of :class:`Backend` are no-ops."""

    def start_loads(self) -> bool:
        return False

    def loads_in_flight(self) -> bool:
        return False

    def poll_loads(self) -> None:
        return None

    def restore_pending(self, rec: SessionRecord) -> bool:
        return False


class Backend(Protocol):
    name: str
    tree: Tree

    def offload(self, rec: SessionRecord, leaf: TreeNode) -> bool:
        """ToolStart's effect on the KV. Raises before changing anything when it cannot start;
        returns True when nothing is in flight (the offload finished at once)."""
        ...

    def offload_pending(self, rec: SessionRecord) -> bool:
        """True while a GPU→host write on the session's path is unacknowledged."""
        ...

    def free_gpu(self, recs: Sequence[SessionRecord]) -> None:
        """Free the GPU copies that finished offloads allow (bottom-up, unlocked leaves only)."""
        ...

    def restore(self, rec: SessionRecord) -> bool:
        """ToolEnd's effect. Raises before changing anything when it cannot start; returns True
        when the session's KV is readable at once."""
        ...

    def start_loads(self) -> bool:
        """Start queued host->GPU copies when the copy engine's resources allow (once per tick, on
        every rank). Returns True if a start happened."""
        ...

    def loads_in_flight(self) -> bool:
        """True while a load this backend issued is not known to be acknowledged."""
        ...

    def poll_loads(self) -> None:
        """Forget loads whose acknowledgement sglang has processed."""
        ...

    def restore_pending(self, rec: SessionRecord) -> bool:
        """True while some load into the session's path is unacknowledged."""
        ...

    def release(self, rec: SessionRecord) -> None:
        """Return everything the session holds (protection, pin, snapshot) — exactly once."""
        ...

    def forget(self, rec: SessionRecord) -> None:
        """After a tree reset: drop references without releasing (the objects are gone)."""
        ...

    def reset(self) -> None: ...

    def describe(self, rec: SessionRecord) -> dict[str, object]: ...

    # ---- the per-call policy (spec Keep, Demote, Prefetch) ----
    def keep(self, rec: SessionRecord, leaf: TreeNode) -> bool:
        """Spec ``Keep``: pin the path on the GPU (one path lock) if it is all resident and
        readable; False, changing nothing, otherwise."""
        ...

    def unpin(self, rec: SessionRecord) -> None:
        """Return the session's pin, if it holds one (exactly once)."""
        ...

    def release_protection(self, rec: SessionRecord) -> None:
        """Return the session's host protection only (an early restore's load was acknowledged:
        the KV is on the GPU, the pin keeps it there)."""
        ...

    def worth_prefetching(self, rec: SessionRecord) -> bool:
        """Whether an early restore would do anything sglang agrees to do now (a missing suffix
        below ``load_back_threshold`` is never loaded: the tool_end decides that case)."""
        ...

    def pressure(self) -> Pressure:
        """Device and host room as the policy sees it (the same on every rank: pool sizes and
        the tree move in lockstep)."""
        ...
