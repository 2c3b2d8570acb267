"""Host mirrors a ``tool_start`` may drop for room (spec ``MirrorRoom``, ``HostUnmirror``).

Under ``write_through`` sglang writes every node it inserts to the host (``insert`` ->
``_inc_hit_count`` -> ``write_backup``), so the host pool holds a *mirror* of what running requests
lock on the device, and ``evict_host`` never frees a copy whose node is still on the device
(hiradix_cache.py ``evict_host``: ``if not x.evicted: continue``). On the twin's value load that
mirror is 40-75 % of a 16 GB host (docs/twin.md, "Where the host pool goes"), and it is what the
``507``s of ``tool_start`` run into. A mirror of a node a request locks is the one copy that can go
without losing anything: the device copy cannot be evicted while the lock holds, and sglang writes
the host copy again when the request finishes (``cache_finished_req`` -> ``insert`` hits the node,
``_inc_hit_count`` -> ``write_backup`` of a node not backed up) or, under ``write_back``, when
eviction would drop it. sglang 0.5.23 reclaims such duplicates itself under ``write_back``
(``_reclaim_full_host_duplicates``).

A mirror may go when its node is on the device and locked, its copy is no write's target still in
flight (``ongoing_write_through``) nor a load's source (``ongoing_load_back``), nobody protects it
(``host_ref_counter``: toolkv's protections and sglang's own, e.g. a storage backup), it is not on
the offloading session's own path, and every host copy below it may go too (copies leave leaf
first, so the backed-up prefix stays contiguous from the root, as ``write_backup`` requires).

The room and the drop order are the same walk on sglang 0.5.23's Python tree core, whose
``UnifiedTreeNode`` keeps a node's copies in its FULL component: the callers pass ``host`` (where a
node's host copy is) and their own ``ok`` (``UnifiedBackend._mirror_ok``); :func:`drop_mirror` is
0.5.16's free, 0.5.23's is ``UnifiedBackend._drop_mirror``.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Collection, Iterator
from typing import Any

from toolkv.core.backends.base import closed_subtrees
from toolkv.core.treeops import Tree, TreeNode

HostValue = Callable[[TreeNode], Any]


def hiradix_host(m: TreeNode) -> Any:
    """A ``HiRadixCache`` node's host copy (None: none)."""
    return m.host_value


def mirror_ok(m: TreeNode, tree: Tree, own: Collection[int]) -> bool:
    """Spec ``MirrorOk``: the node's own conditions (the closure is :func:`mirror_room`'s);
    ``own``: ``id()`` of the offloading path's nodes."""
    return (
        m.host_value is not None
        and m.value is not None
        and m.lock_ref > 0
        and m.host_ref_counter == 0
        and id(m) not in own
        and m.id not in tree.ongoing_write_through
        # a load is keyed by its deepest node; the chain above it is loading too, and the
        # closure of mirror_room keeps it (the deepest node's host copy cannot go)
        and m.id not in tree.ongoing_load_back
    )


def mirror_room(
    tree: Tree,
    own_path: Collection[TreeNode],
    ok: Callable[[TreeNode, Tree, Collection[int]], bool] = mirror_ok,
    host: HostValue = hiradix_host,
) -> list[TreeNode]:
    """Spec ``MirrorRoom``: the nodes whose host copies may be dropped for a ``tool_start`` of
    ``own_path``, each with every host copy of its subtree droppable (``ok`` for each: a seeded
    defect replaces it); a node without a host copy stands in nobody's way."""
    own = {id(m) for m in own_path}
    below = closed_subtrees(tree.root_node, lambda m: host(m) is None or ok(m, tree, own))
    return [m for m in below if host(m) is not None]


def mirror_tokens(nodes: Collection[TreeNode], host: HostValue = hiradix_host) -> int:
    return sum(len(v) for v in map(host, nodes) if v is not None)


def drop_order(room: Collection[TreeNode]) -> Iterator[TreeNode]:
    """The mirrors of ``room`` leaf first (spec ``HostUnmirror``: no child keeps a host copy), least
    recently used first, ties by sglang's node id: the same order on every TP rank, whose trees
    are equal."""
    members = {id(m) for m in room}
    kids: dict[int, int] = {}
    for m in room:
        kids[id(m)] = sum(1 for c in m.children.values() if id(c) in members)
    heap = [(m.last_access_time, m.id, m) for m in room if kids[id(m)] == 0]
    heapq.heapify(heap)
    while heap:
        _, _, m = heapq.heappop(heap)
        yield m
        p = m.parent
        if p is not None and id(p) in members:
            kids[id(p)] -= 1
            if kids[id(p)] == 0:
                heapq.heappush(heap, (p.last_access_time, p.id, p))


def drop_mirror(tree: Tree, m: TreeNode) -> int:
    """Free ``m``'s host copy (its device copy stays), as sglang frees a host copy: the
    controller's ``evict_host``, then the host-leaf bookkeeping of ``m`` and its parent. Returns
    the tokens freed."""
    assert m.value is not None and m.lock_ref > 0, "not a mirror of a locked device copy"
    assert not any(c.host_value is not None for c in m.children.values()), "a child keeps a host copy"
    record = getattr(tree, "_record_remove_event", None)
    if record is not None:  # the KV-event stream's "gone from CPU" (the router's host-tier index)
        from sglang.srt.disaggregation.kv_events import StorageMedium

        record(m, medium=StorageMedium.CPU)
    freed = int(tree.cache_controller.evict_host(m.host_value))
    m.host_value = None
    tree._update_host_leaf_status(m)
    if m.parent is not None:
        tree._update_host_leaf_status(m.parent)
    return freed
