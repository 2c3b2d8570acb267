"""UnifiedRadixCache's L3 storage tier for toolkv (sglang 0.5.23; ``spec/storage/StorageTier.tla``):
the :class:`~toolkv.core.capabilities.StorageTier` abilities of
:class:`~toolkv.core.backends.unified.UnifiedBackend` and of its Rust-core variant.

The spec's actions are :class:`~toolkv.core.backends.hicache_storage.HiCacheStorage`'s, unchanged:
0.5.23 keeps 0.5.16's storage path (a backup thread writing acknowledged host copies, a prefetch
thread with a hit query and an I/O thread, acks drained by ``drain_storage_control_queues`` in
``check_hicache_events``), behind node ids and request handles. What differs is how a node's facts
are read and how the primitives are called, and only that is here (file:line into the sglang
0.5.23 wheel; ``URC`` is ``mem_cache/unified_radix_cache.py``, ``cc`` is
``managers/cache_controller.py``; ``docs/sglang_versions.md`` has the table):

* page keys: ``tree_core.get_hash_values(node_id)`` (``unified_tree_core.py:606``; the Rust
  adapter's ``rust_tree_core/adapter.py:1067``), one hash per page;
* Store: ``URC.write_backup_storage(node_id)`` (1990), which sglang also calls itself for every
  acknowledged host write (1814-1818): ``write_storage`` queues the pages for the backup thread and
  the write holds a *host lock* on the node (``inc_host_lock_ref``, 2017-2020) until its ack, where
  0.5.16 held ``protect_host``; a write in flight is an entry of ``URC.ongoing_backup`` naming the
  node id;
* StoreAck: the backup acks are drained by ``_drain_backup`` (3240), which returns the write's host
  lock (3251); the copy is whole when the backend's ``batch_exists`` counts every key;
* StoragePrefetch: ``URC.prefetch_from_storage(CacheRequestHandle, anchor_id, tokens, last_hash,
  prefix_keys, matched_prefix_tokens, extra_key)`` (2081), as the scheduler calls it
  (``managers/scheduler.py:3381``). Below ``prefetch_threshold`` it declines (2150); else it takes
  a host lock on the anchor (2168) and records the prefetch (2237); ``has_ongoing_prefetch``
  (2315) says it started. The host slots are allocated when the hit query's answer is drained
  (``allocate_storage_hit``, 3109), where 0.5.16 allocated them at the call;
* PrefetchAck: ``URC.check_prefetch_progress(handle)`` (2391; ``wait_complete`` waits, 2298) — or
  already sglang's own ack drain (3229), before toolkv's tick — inserts the pages into the host
  tree (``_handle_prefetch_result`` 2422: ``insert_host`` 2473) and returns the anchor's host lock
  (2514): the pages are unprotected host copies until toolkv's ``prefetch_ack`` protects them
  (``spec/storage/UnifiedRead.tla``: a read may come back short, so the host tree is read, never
  the read's count). The request's own records are let go as sglang's admission does
  (``pop_prefetch_loaded_tokens`` 2755, ``finish_storage_prefetch_admission`` 2726,
  ``storage_prefetch_retries.cancel``, ``mem_cache/storage_prefetch.py:37``);
* lookups: ``URC.match_prefix`` (613), which sees host-only nodes on both cores (the read-only
  ``match_full_device_prefix`` that :func:`~toolkv.core.treeops.walk` uses on the Rust core stops
  at the device part).

Where toolkv cannot keep its guarantee it does not store: a backend that evicts on its own
(HiCacheFile with a size cap or a free-space watermark: its ``LRUFileEvictor``,
``mem_cache/hicache_storage.py:805-812``), and Mooncake, whose soft pin and session manifests
(``spec/storage/SharedTier.tla``) toolkv drives through 0.5.16's client only; the session then stays
protected on its host copy (``store`` returns False, nothing changed).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Any

from toolkv.core.backends.hicache_storage import HiCacheStorage
from toolkv.core.backends.mooncake_tier import MooncakeTier, is_mooncake
from toolkv.core.treeops import TreeNode, is_root


def request_handle(rid: str) -> Any:
    """sglang 0.5.23's request handle for a prefetch toolkv issues (``mem_cache/base_prefix_cache.py:46``):
    the request id and attempt 0, the same on every rank."""
    from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle

    return CacheRequestHandle(rid, 0)


class UnifiedStorage(HiCacheStorage):
    """The storage-tier steps on a ``UnifiedRadixCache``: :class:`HiCacheStorage`'s actions over
    0.5.23's primitives (module docstring). A mixin over the unified backend's tree, agreement,
    ledger and storage records; node facts through ``_host_backed`` / ``_writing`` / ``_node_of``,
    which the Rust-core backend reads through handles."""

    def _writing(self, m: TreeNode) -> bool:
        raise NotImplementedError  # the unified backend's (a host write in flight)

    def _node_of(self, node_id: int) -> TreeNode | None:
        raise NotImplementedError  # the unified backend's (a node object, or a handle)

    def shared_tier(self) -> MooncakeTier | None:
        """None: Mooncake's soft pin is not driven on 0.5.23 (a Mooncake backend is refused by
        :meth:`_evicts_on_its_own`, so nothing is stored that toolkv could not pin)."""
        return None

    def _evicts_on_its_own(self) -> bool:
        """HiCacheFile with an evictor (as on 0.5.16), or Mooncake: its master evicts what no soft
        pin holds, and toolkv's pin is not ported to 0.5.23 (the safe outcome: no store)."""
        return super()._evicts_on_its_own() or is_mooncake(self._storage())

    def _page_keys(self, path: Sequence[TreeNode]) -> list[list[str]] | None:
        tree = self.tree
        page = tree.page_size
        if not all(self._host_backed(m) and not self._writing(m) for m in path):
            return None
        keys = [list(tree.tree_core.get_hash_values(m.id)) for m in path]
        if any(len(k) != len(m.key) // page for m, k in zip(path, keys, strict=True)):
            return None
        return keys

    def _write_to_storage(self, m: TreeNode) -> None:
        """``URC.write_backup_storage`` (1990): the backup thread writes the pages; a host lock on
        the node until the ack (2019)."""
        self.tree.write_backup_storage(m.id)

    def _storing(self, m: TreeNode) -> bool:
        return any(node_id == m.id for node_id, _ in self.tree.ongoing_backup.values())

    def _lookup(self, tokens: Sequence[int], extra_key: str | None) -> tuple[TreeNode, int]:
        """``URC.match_prefix`` (613): the deepest node accepted on device or host
        (``best_match_node``) and the tokens matched on both; it may split a node at the end of
        ``tokens``, as every admission's match does."""
        from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
        from sglang.srt.mem_cache.radix_cache import RadixKey

        m = self.tree.match_prefix(MatchPrefixParams(key=RadixKey(array("q", tokens), extra_key)))
        matched = int(m.device_prefix_len) + int(m.host_hit_length)
        node = self._node_of(int(m.best_match_node))
        return node, (0 if is_root(self.tree, node) else matched)

    def _start_prefetch(
        self, rid: str, host_node: TreeNode, tokens: Sequence[int], extra_key: str | None
    ) -> bool:
        """``URC.prefetch_from_storage`` (2081) as the scheduler calls it (``scheduler.py:3381``):
        the anchor's hash chain, the tokens below it, the tokens matched above it."""
        tree = self.tree
        anchor = tree.tree_core.root_node_handle(extra_key) if is_root(tree, host_node) else host_node.id
        depth = self._host_depth(host_node)
        prefix_keys = tree.get_prefix_hash_values(anchor) if tree.hicache_storage_pass_prefix_keys else None
        handle = request_handle(rid)
        tree.prefetch_from_storage(
            handle,
            anchor,
            array("q", tokens[depth:]),
            tree.get_last_hash_value(anchor),
            prefix_keys,
            matched_prefix_tokens=array("q", tokens[:depth]),
            extra_key=extra_key,
        )
        return bool(tree.has_ongoing_prefetch(handle))  # lockstep state: the same on every rank

    def _prefetch_finished(self, rid: str) -> bool:
        """``URC.check_prefetch_progress`` (2391; collectives: every rank, the same step), then the
        request's records let go as admission does (module docstring)."""
        tree = self.tree
        handle = request_handle(rid)
        if not tree.check_prefetch_progress(handle):
            return False
        loaded = int(tree.pop_prefetch_loaded_tokens(handle))
        tree.finish_storage_prefetch_admission(handle, loaded, None)
        tree.storage_prefetch_retries.cancel(rid)
        return True


__all__ = ["UnifiedStorage", "request_handle"]
