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


class Handle:
    """One node of a tree core that is addressed by node id alone (sglang 0.5.23's default Rust
    ``TreeCore``, whose ``node_by_id`` and ``root_node`` raise): its id, identity, and the facts
    ``collect_path_info`` reported when the handle was read. Two handles of one id are the same
    node (``==``, ``hash``): the Rust core never reuses an id, a split keeps the deeper node's id
    (the new prefix gets a new one), so an id either names the node it named or no node at all.

    ``key`` is the node's token span (``len(handle.key)`` is its token count, as for a node object);
    ``parent`` is the handle of the node above it on the path it was read with (None: the root)."""

    __slots__ = ("end", "full_value_len", "id", "num_children", "parent", "parent_id", "start")

    def __init__(self, info: Any, parent: Handle | None) -> None:
        self.id: int = int(info.node_id)
        self.parent_id: int = int(info.parent_id)
        self.start: int = int(info.path_start)
        self.end: int = int(info.path_end)
        self.full_value_len: int | None = info.full_value_len
        self.num_children: int = int(info.num_children)
        self.parent = parent

    @property
    def key(self) -> range:
        return range(self.start, self.end)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Handle) and other.id == self.id

    def __hash__(self) -> int:
        return hash(("handle", self.id))

    def __repr__(self) -> str:
        return f"Handle({self.id}, tokens {self.start}..{self.end})"


def handle_tree(tree: Tree) -> bool:
    """Whether ``tree``'s nodes are reached through handles only (a tree core without node
    objects: sglang 0.5.23's Rust ``TreeCore``)."""
    core = getattr(tree, "tree_core", None)
    return core is not None and type(core).__name__ == "RustUnifiedTreeCore"


def node_key(node: TreeNode) -> Any:
    """A dictionary key for ``node`` that outlives the Python object it was read through (a
    handle is re-read on every walk; a node object is the node)."""
    return ("handle", node.id) if isinstance(node, Handle) else id(node)


def same_node(a: TreeNode | None, b: TreeNode | None) -> bool:
    """``a`` and ``b`` are the same node (identity for node objects, id for handles)."""
    return a == b if isinstance(a, Handle) else a is b


def is_root(tree: Tree, node: TreeNode | None) -> bool:
    """``node`` is the tree's root (a handle path has no root entry: its root is ``None``)."""
    if node is None:
        return True
    if isinstance(node, Handle):
        return False
    return node is tree.root_node


def _handle_path(tree: Tree, node_id: int) -> list[Handle]:
    try:
        infos = tree.tree_core.collect_path_info([node_id])[0]
    except KeyError:  # no such node any more (evicted from both tiers, or a reset)
        return []
    out: list[Handle] = []
    parent: Handle | None = None
    for info in infos:
        parent = Handle(info, parent)
        out.append(parent)
    return out


def attached(tree: Tree, node: TreeNode | None) -> bool:
    """True iff ``node`` is reachable from the tree's current root by parent/child links.

    ``hasattr(node, "id")`` proves nothing: Python keeps a detached node alive while referenced,
    with stale ``value``/``host_value`` (caveat 5). Node ids restart at 0 after a reset, so they
    prove nothing either. Object identity along the parent chain does.
    """
    if node is None:
        return False
    if isinstance(node, Handle):  # the id still names a node ending where it ended (a split
        path = _handle_path(tree, node.id)  # above it moves its start, never its end)
        return bool(path) and path[-1].end == node.end
    root = tree.root_node
    page = tree.page_size
    while node is not root:
        parent = node.parent
        if parent is None or parent.children.get(node.key.child_key(page)) is not node:
            return False
        node = parent
    return True


def path_to(tree: Tree, node: TreeNode) -> list[TreeNode]:
    """Root-excluded path from the root down to ``node`` (top-down); a handle's path is read
    fresh off the tree core (``collect_path_info``), empty for an id that names no node."""
    if isinstance(node, Handle):
        return list(_handle_path(tree, node.id))
    if node is None or handle_tree(tree):
        return []
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

    if handle_tree(tree):
        return _walk_handles(tree, RadixKey(array("q", tokens), extra_key))
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


def _walk_handles(tree: Tree, key: Any) -> tuple[TreeNode, int]:
    """:func:`walk` on a handle tree: the tree core's read-only ``match_full_device_prefix``
    (the one lookup that does not split; it sees the device part of the tree only, so a path
    whose suffix lives on host alone is found up to its device part). A match that ends inside
    a node stops at its parent, as the object walk does. (None, 0): nothing matched."""
    matched, node_id, _ = tree.tree_core.match_full_device_prefix(key)
    path = _handle_path(tree, int(node_id)) if matched else []
    while path and path[-1].end > matched:
        path.pop()
    return (path[-1], path[-1].end) if path else (None, 0)


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
