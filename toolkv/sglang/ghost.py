"""The eviction-harm count: prompt tokens a request recomputes whose KV the cache held earlier.

Upstream sglang's name for this count is ``kv_recomputed_after_evict_tokens_total`` (a ghost list
of evicted entries, consulted at the next miss); toolkv exports the same count as
``toolkv:kv_recomputed_after_evict_tokens_total{requester}`` (docs/operations.md, "Metrics"),
split by who paid it: ``session`` (a request of a session toolkv can track: it carries a session
id) and ``other`` (every other request). It is how an operator sees on a live server what toolkv
saves its sessions and what it costs everyone else.

The ghost is a bounded LRU of chained hashes of token blocks (``block_tokens`` tokens each, a
whole number of the tree's pages; the hash of block *i* covers every token before it and the
request's ``extra_key`` namespace, so a hash stands for one exact prefix). A block enters when the
tree caches it (the plugin's turn-capture hooks: ``cache_finished_req`` on 0.5.16,
``UnifiedRadixCache.checkpoint`` on 0.5.21+, for every request, session or not) and is refreshed
each time it is cached again. When a request is admitted into a prefill batch (the plugin's AFTER
hook on ``get_new_batch_prefill``), the tokens it computes are those past its matched prefix
(device hit plus what HiCache loaded back from the host): every whole block of them the ghost
holds is KV that was in the cache and is not any more, i.e. it was evicted from every tier, and its
tokens are counted. A block still in the tree is matched and never reaches the count (a radix
match takes every cached prefix), so the ghost need not see the evictions themselves: that is why
it works the same on both releases, whose eviction paths differ, without hooking them.

Bounded: at most ``capacity`` block hashes (default 65,536: about 1M tokens of history at 16-token
blocks, a few MB), the least recently cached dropped first. A block evicted after it fell off the
ghost is not counted (the count is a lower bound). A tree reset (``flush_cache``) clears it: a
flush is not an eviction. The count is per rank and local: it decides nothing, so it needs no
agreement across TP ranks (every rank sees the same batches anyway).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

BLOCK_TOKENS = 16
CAPACITY_BLOCKS = 65_536
REQUESTERS = ("session", "other")


def block_size(page_size: int, at_least: int = BLOCK_TOKENS) -> int:
    """The ghost's block: the smallest whole number of pages holding ``at_least`` tokens (the tree
    caches whole pages only, so a block never straddles a cached and an uncached page)."""
    page = max(1, int(page_size))
    return page * -(-at_least // page)


class EvictionGhost:
    """Hashes of cached token blocks, and the recomputed-after-evict count they give."""

    def __init__(self, block_tokens: int = BLOCK_TOKENS, capacity: int = CAPACITY_BLOCKS) -> None:
        if block_tokens < 1 or capacity < 1:
            raise ValueError(f"block_tokens and capacity must be >= 1, got {block_tokens}, {capacity}")
        self.block_tokens = block_tokens
        self.capacity = capacity
        self._blocks: OrderedDict[int, None] = OrderedDict()
        self.recomputed: dict[str, int] = dict.fromkeys(REQUESTERS, 0)

    def __len__(self) -> int:
        return len(self._blocks)

    def _hashes(self, tokens: Sequence[int], extra_key: Any) -> list[int]:
        """The chained hash of every whole block of ``tokens``."""
        b = self.block_tokens
        h = hash(("toolkv-ghost", extra_key))
        out = []
        for i in range(0, len(tokens) - b + 1, b):
            h = hash((h, tuple(tokens[i : i + b])))
            out.append(h)
        return out

    def cached(self, tokens: Sequence[int], extra_key: Any = None) -> None:
        """The tree just cached ``tokens`` (its whole blocks enter, or move to the recent end)."""
        blocks = self._blocks
        for h in self._hashes(tokens, extra_key):
            blocks[h] = None
            blocks.move_to_end(h)
        while len(blocks) > self.capacity:
            blocks.popitem(last=False)
        assert len(blocks) <= self.capacity

    def admitted(self, tokens: Sequence[int], start: int, requester: str, extra_key: Any = None) -> int:
        """A request computes ``tokens[start:]`` (its matched prefix is ``tokens[:start]``): count,
        for ``requester``, the tokens of its whole blocks past ``start`` that the ghost holds.
        Returns the tokens counted."""
        if requester not in REQUESTERS:
            raise ValueError(f"requester must be one of {REQUESTERS}, got {requester!r}")
        b = self.block_tokens
        first = -(-max(0, start) // b)  # the first block wholly past the match
        n = sum(b for h in self._hashes(tokens, extra_key)[first:] if h in self._blocks)
        self.recomputed[requester] += n
        return n

    def reset(self) -> None:
        """The tree was flushed: nothing cached before is an eviction's loss any more."""
        self._blocks.clear()


def namespace(req: Any) -> tuple[Any, Any]:
    """The key space a request's KV is cached under besides its tokens: ``extra_key`` (LoRA and
    the like) and, on 0.5.21+, ``cache_salt`` (unified_radix_cache.py:1204-1209)."""
    return getattr(req, "extra_key", None), getattr(req, "cache_salt", None)


def computed_span(req: Any) -> tuple[Sequence[int], int] | None:
    """(the tokens of a request just admitted to a prefill batch, up to the end of this extend;
    where its computed part starts), from sglang's own ``Req`` fields: 0.5.16's ``prefix_indices``
    and ``extend_range``, 0.5.21+'s ``prefix_len`` and ``extend_end``. None when neither is there."""
    fill = getattr(req, "full_untruncated_fill_ids", None)
    if fill is None or len(fill) == 0:
        fill = list(getattr(req, "origin_input_ids", ())) + list(getattr(req, "output_ids", ()))
    rng = getattr(req, "extend_range", None)
    if rng is not None and getattr(req, "prefix_indices", None) is not None:
        return fill[: rng.end], len(req.prefix_indices)
    end = getattr(req, "extend_end", None)
    if end is not None and hasattr(req, "prefix_len"):
        return fill[:end], int(req.prefix_len)
    return None
