"""Host room from mirrors (spec ``Unmirror``: ``MirrorRoom``, ``HostUnmirror``) on sglang 0.5.23's
Python tree core: the walk of :mod:`toolkv.core.backends.mirrors` with the FULL component's node
facts, and the tree core's own free of a host duplicate as the drop (docs/sglang_versions.md,
"Host room from mirrors on 0.5.23"). The Rust core's backend switches it off
(``RustUnifiedBackend._unmirrors``)."""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING, Any

from toolkv.core.backends.mirrors import mirror_room
from toolkv.core.treeops import Tree, TreeNode, path_to

FULL = 0  # sglang ComponentType.FULL


def host_copy(node: TreeNode) -> Any:
    """A ``UnifiedTreeNode``'s FULL host copy (None: none): where :mod:`~toolkv.core.backends.mirrors`
    finds a node's host copy on this tree."""
    return node.component_data[FULL].host_value


class UnifiedMirrors:
    """The ``Unmirror`` half of :class:`~toolkv.core.backends.unified.UnifiedBackend`."""

    tree: Tree
    unmirror: bool

    if TYPE_CHECKING:  # OwnLoads's

        def loading_chains(self) -> list[tuple[TreeNode, list[TreeNode]]]: ...

    def _unmirrors(self) -> bool:
        """Spec ``Unmirror``, where it pays, as on 0.5.16: under ``write_through`` (and
        ``write_through_selective``) sglang writes a dropped mirror again when a later insert hits
        the node (unified_tree_core.py ``_inc_hit_count_and_check``: not backed up, hit count at
        the threshold); under ``write_back`` sglang reclaims such duplicates itself, in the
        ``evict_host`` that spec ``HostRoom`` calls (``drive_host_eviction`` ->
        ``_reclaim_full_host_duplicates``)."""
        return self.unmirror and not self._write_back()

    def _write_back(self) -> bool:
        controller = getattr(self.tree, "cache_controller", None)
        return getattr(controller, "write_policy", None) == "write_back"

    def _mirror_room(self, path: Collection[TreeNode]) -> list[TreeNode]:
        """Spec ``MirrorRoom`` of a ``tool_start`` of ``path`` (the walk of
        :func:`~toolkv.core.backends.mirrors.mirror_room`, with this tree's node facts)."""
        loading = self._loading_ids()
        return mirror_room(
            self.tree, path, lambda m, tree, own: self._mirror_ok(m, own, loading), host=host_copy
        )

    def _mirror_ok(self, m: TreeNode, own: Collection[int], loading: Collection[int]) -> bool:
        """Spec ``MirrorOk`` on 0.5.23's Python core (a method, so a seeded defect can replace
        it): on both tiers and locked on the device by a request; no host lock on any component
        (toolkv's protections, a load's anchor lock, sglang's own); no write in flight
        (``write_through_pending_id``) and no load (``loading``: the paths of the loads in flight,
        which under write_through mark no node); off the offloading path (``own``, by ``id()``)."""
        d = m.component_data[FULL]
        return (
            d.host_value is not None
            and d.value is not None
            and d.lock_ref > 0
            and all(cd.host_lock_ref == 0 for cd in m.component_data)
            and id(m) not in own
            and m.write_through_pending_id is None
            and m.load_back_pending_id is None
            and m.id not in loading
        )

    def _loading_ids(self) -> set[int]:
        """Ids of the nodes a load in flight fills or reads: this backend's chains and, for a
        request's own load (keyed by its anchor), the anchor's whole path, as :meth:`_node_loading`."""
        ids = {n.id for _, chain in self.loading_chains() for n in chain}
        core = self.tree.tree_core
        for anchor_id in self.tree.ongoing_load_back:
            try:
                anchor = core.node_by_id(anchor_id)
            except KeyError:
                continue
            ids.update(n.id for n in path_to(self.tree, anchor))
        return ids

    def _drop_mirror(self, m: TreeNode) -> int:
        """Free ``m``'s FULL host copy, its device copy staying, with the tree core's own free of a
        host duplicate (unified_tree_core.py ``_release_full_host_duplicate``: it asserts no host
        lock and no write or load marked on the node, records the CPU removal event and adds the
        node to the duplicate-reclaim digest that ``loading_check`` compares across TP ranks),
        drained as ``evict_host`` drains its result. Returns the tokens freed."""
        from sglang.srt.mem_cache.unified_cache.unified_tree_core_interface import DriveHostEvictionResult

        d = m.component_data[FULL]
        assert d.value is not None and d.lock_ref > 0, "not a mirror of a locked device copy"
        assert not any(host_copy(c) is not None for c in m.children.values()), "a child keeps a host copy"
        core = self.tree.tree_core
        result = DriveHostEvictionResult()
        core._release_full_host_duplicate(
            m, result.tracker, result.device_frees, result.host_frees, cache_actions=result.cache_actions
        )
        self.tree._apply_eviction_result(result)
        core._update_duplicate_tracking(m)  # no longer on both tiers
        return int(result.tracker[FULL])
