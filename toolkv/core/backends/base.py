"""What a backend does for the manager. The manager owns sessions and their lifecycle; a backend
owns the KV: where it goes on ToolStart, how it comes back on ToolEnd, and what is released."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from toolkv.core.session import SessionRecord
from toolkv.core.treeops import Tree, TreeNode


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


class OwnLoads:
    """Loads a backend issued, kept as chains: ``key -> (leaf, boundary)``, the load filling the
    path from ``leaf`` up to, not including, ``boundary`` (the deepest ancestor already on device
    when the load was queued). A chain, not a node list: a split while the load is in flight
    inserts a new node into it, and that node is loading too."""

    tree: Tree
    _loads: dict[int, tuple[TreeNode, TreeNode]]

    def _chain(self, leaf: TreeNode, boundary: TreeNode) -> list[TreeNode]:
        out, node = [], leaf
        while node is not None and node is not boundary and node is not self.tree.root_node:
            out.append(node)
            node = node.parent
        return out

    def loading_chains(self) -> list[tuple[TreeNode, list[TreeNode]]]:
        """Each in-flight load of this backend: (its key node, the nodes it is filling)."""
        return [(leaf, self._chain(leaf, boundary)) for leaf, boundary in self._loads.values()]

    def _in_own_load(self, m: TreeNode) -> bool:
        return any(m in self._chain(leaf, boundary) for leaf, boundary in self._loads.values())


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
