"""Proposed fixes for bugs found in sglang 0.5.16's ``DecodeKVCacheOffloadManager``, as patches the
tests apply to the real class to show the reproducer passes with them (``docs/decode_offload.md``).

``radix_prefix_release``: with ``--disaggregation-decode-enable-radix-cache``, a request's first
``len(prefix_indices)`` slots are the radix cache's (matched and locked by
``_match_prefix_and_lock``). ``_release_finished_req`` frees ``req_to_token[:prefill_len]``,
which includes them, and subtracts ``len(prefix_indices)`` from ``protected_size_`` without
unlocking the node: the tree keeps pointing at slots the allocator hands to other requests, and
the prefix stays locked (unevictable) forever. The fix frees only the request's own slots and
releases the prefix with ``dec_lock_ref`` (which also restores ``protected_size_`` and
``evictable_size_``). Written here from the description above, not copied.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


def _release_own_slots(self: Any, req: Any, start_offset: int) -> None:
    """``_release_finished_req`` freeing only the request's own slots and unlocking its prefix."""
    from sglang.srt.utils.common import ceil_align

    if req.req_pool_idx is None or req.req_pool_idx == -1:
        return
    row = self.req_to_token_pool.req_to_token[req.req_pool_idx]
    n_prefix = len(req.prefix_indices)
    committed = req.effective_kv_committed_len()
    self.token_to_kv_pool_allocator.free(row[n_prefix:committed])
    start_p, end_p = committed, req.kv.kv_allocated_len
    if self.page_size > 1:
        start_p = ceil_align(start_p, self.page_size)
    if start_p < end_p:
        self.token_to_kv_pool_allocator.free(row[start_p:end_p])
    self.req_to_token_pool.free(req)
    req.kv = None
    if n_prefix:
        self.tree_cache.dec_lock_ref(req.last_node)
    self.offloaded_state.pop(req.rid, None)


@contextlib.contextmanager
def radix_prefix_release() -> Iterator[None]:
    from sglang.srt.disaggregation.decode_kvcache_offload_manager import DecodeKVCacheOffloadManager as cls

    saved = cls.__dict__["_release_finished_req"]
    cls._release_finished_req = _release_own_slots
    try:
        yield
    finally:
        cls._release_finished_req = saved


__all__ = ["radix_prefix_release"]
