"""Read-only operations on sglang's radix tree, and the derived tier of a node.

Nothing here mutates the tree: no split, no LRU bump, no lock. That matters because the manager
must be able to look at the tree at any time (kv_meta, validation) without changing what the
scheduler will do next — and identically on every tensor-parallel rank.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from enum import StrEnum
from typing import Any

TreeNode = Any  # sglang.srt.mem_cache.radix_cache.TreeNode (kept untyped: sglang ships no stubs)
Tree = Any  # RadixCache | HiRadixCache


class Tier(StrEnum):
    """Where a node's KV lives, named as in ``spec/ToolKV.tla``'s ``Tier(n)``."""

    GPU = "GPU"  # device copy valid, no transfer in flight
    BACKING_UP = "BackingUp"  # device copy valid, GPU→host write not yet acknowledged
    LOADING = "Loading"  # device slots assigned, host→GPU load not yet acknowledged
    CPU_PROTECTED = "CpuProtected"  # host copy only, protected from host eviction by a session
    CPU_UNPROTECTED = "CpuUnprotected"  # host copy only: sglang may evict it from host at any time
    EVICTED = "Evicted"  # not in the current tree (deleted, or the tree was reset)


def attached(tree: Tree, node: TreeNode | None) -> bool:
    """True iff ``node`` is reachable from the tree's current root by parent/child links.

    ``hasattr(node, "id")`` proves nothing: Python keeps a detached node alive while referenced,
    with stale ``value``/``host_value`` (caveat 5). Node ids restart at 0 after a reset, so they
    prove nothing either. Object identity along the parent chain does.
    """
    if node is None:
        return False
    root = tree.root_node
    page = tree.page_size
    while node is not root:
        parent = node.parent
        if parent is None or parent.children.get(node.key.child_key(page)) is not node:
            return False
        node = parent
    return True


def path_to(tree: Tree, node: TreeNode) -> list[TreeNode]:
    """Root-excluded path from the root down to ``node`` (top-down)."""
    out: list[TreeNode] = []
    root = tree.root_node
    while node is not root and node is not None:  # None: a detached node of an old tree
        out.append(node)
        node = node.parent
    out.reverse()
    return out


def walk(tree: Tree, tokens: Sequence[int], extra_key: str | None = None) -> tuple[TreeNode, int]:
    """Deepest node whose full key is a prefix of ``tokens``; returns (node, matched tokens).

    Uses ``children.get`` because ``TreeNode.children`` is a ``defaultdict``: indexing a missing
    key would silently insert a bogus child into the live tree.
    """
    from sglang.srt.mem_cache.radix_cache import RadixKey

    page = tree.page_size
    key = RadixKey(array("q", tokens), extra_key).page_aligned(page)
    node, matched = tree.root_node, 0
    while matched < len(key):
        rest = key[matched:]
        child = node.children.get(rest.child_key(page))
        if child is None:
            break
        plen = child.key.match(rest, page_size=page)
        if plen < len(child.key):
            break
        node, matched = child, matched + plen
    return node, matched


def is_loading(tree: Tree, node: TreeNode) -> bool:
    """A host→GPU load that ends at ``node`` is not acknowledged yet (sglang keys it by node id,
    so compare identity: ids are reused after a reset)."""
    pending = getattr(tree, "ongoing_load_back", None)
    return pending is not None and pending.get(node.id) is node


def tier(tree: Tree, node: TreeNode | None, loading: bool = False, checked: bool = False) -> Tier:
    """The derived tier. ``loading`` is passed by the caller that knows a load covers ``node``
    (a load is keyed by its deepest node only); ``checked`` says the caller already verified that
    the node is attached."""
    if node is None or not (checked or attached(tree, node)):
        return Tier.EVICTED
    if node.value is not None:
        if loading or is_loading(tree, node):
            return Tier.LOADING
        if getattr(node, "write_through_pending_id", None) is not None:
            return Tier.BACKING_UP
        return Tier.GPU
    if getattr(node, "host_value", None) is not None:
        return Tier.CPU_PROTECTED if node.host_ref_counter > 0 else Tier.CPU_UNPROTECTED
    return Tier.EVICTED
