"""KV sizes read off the pools sglang built, and the start-up check of HiCache's host pool.

toolkv parks paused sessions in HiCache's host pool, the same pool sglang's write-through copies
live in. A host pool no larger than the device pool (sglang's default ratio is 2, but a small
``--hicache-size`` on a large GPU inverts it) leaves no room for both: ``tool_start`` answers 507
as soon as write-through has filled it. sglang warns about the ratio too, in terms of its own L2
hit rate; this check says what it means for toolkv and what to set instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

GB = 1e9  # sglang's --hicache-size unit: int(host_size * 1e9 // size_per_token) (pool_host/base.py:106)


def host_pool(tree: Any) -> Any:
    """The KV host pool of a tree with a host tier, else None. ``HiRadixCache`` (0.5.16) keeps it
    at ``token_to_kv_pool_host``; ``UnifiedRadixCache`` (0.5.23) behind its controller, as the
    anchor entry of a ``HostPoolGroup`` (mem_cache/pool_host/group.py:46), the pool the FULL
    component's host indices live in."""
    host = getattr(tree, "token_to_kv_pool_host", None)
    if host is not None:
        return host
    group = getattr(getattr(tree, "cache_controller", None), "mem_pool_host", None)
    anchor = getattr(group, "anchor_entry", None)
    return getattr(anchor, "host_pool", None)


def kv_bytes_per_token(tree: Any) -> int | None:
    """Bytes one token's KV takes on this rank: the host pool's own figure when there is one,
    else K and V of every layer of the device pool (MHA layout). None when unknown."""
    host = host_pool(tree)
    if host is not None and getattr(host, "size_per_token", None):
        return int(host.size_per_token)
    alloc = getattr(tree, "token_to_kv_pool_allocator", None)
    pool: Any = alloc.get_kvcache() if alloc is not None and hasattr(alloc, "get_kvcache") else None
    try:
        dtype = pool.store_dtype
        return int(2 * pool.layer_num * pool.head_num * pool.head_dim * dtype.itemsize)
    except AttributeError:
        return None


@dataclass(frozen=True)
class PoolSizes:
    device_tokens: int
    host_tokens: int
    bytes_per_token: int

    @property
    def host_gb(self) -> float:
        return self.host_tokens * self.bytes_per_token / GB

    @property
    def device_gb(self) -> float:
        return self.device_tokens * self.bytes_per_token / GB

    def suggested_hicache_size(self, ratio: float = 2.0) -> int:
        """``--hicache-size`` (GB, per rank) for a host pool ``ratio`` times the device pool."""
        return max(1, math.ceil(ratio * self.device_gb))


def pool_sizes(tree: Any) -> PoolSizes | None:
    """Device and host pool sizes of a tree with a host tier; None for a tree without one."""
    host = host_pool(tree)
    alloc = getattr(tree, "token_to_kv_pool_allocator", None)
    bpt = kv_bytes_per_token(tree)
    if host is None or alloc is None or not bpt:
        return None
    return PoolSizes(device_tokens=int(alloc.size), host_tokens=int(host.size), bytes_per_token=bpt)


def host_pool_warning(sizes: PoolSizes | None) -> str | None:
    """The start-up WARNING line when the host pool is not larger than the device pool."""
    if sizes is None or sizes.host_tokens > sizes.device_tokens:
        return None
    return (
        f"toolkv: HiCache host pool holds {sizes.host_tokens:,} tokens ({sizes.host_gb:.1f} GB at "
        f"{sizes.bytes_per_token:,} bytes/token), not more than the device pool's {sizes.device_tokens:,} "
        f"tokens ({sizes.device_gb:.1f} GB): sessions offloaded by tool_start share it with sglang's "
        "write-through copies, and tool_start answers 507 once it is full. Give --hicache-size "
        f"{sizes.suggested_hicache_size()} (GB per rank, 2x the device pool) or more; see docs/operations.md, "
        "'Size host memory'"
    )


def budget_warning(sizes: PoolSizes | None, budget_tokens: int | None) -> str | None:
    """The start-up WARNING line when ``TOOLKV_HOST_BUDGET_TOKENS`` exceeds the host pool: the
    budget can never bind (the pool refuses first, and sglang's write-through shares it), so the
    operator's cap is not the one in force."""
    if sizes is None or budget_tokens is None or budget_tokens <= sizes.host_tokens:
        return None
    return (
        f"toolkv: TOOLKV_HOST_BUDGET_TOKENS={budget_tokens:,} is larger than the HiCache host pool "
        f"({sizes.host_tokens:,} tokens): the budget never binds, and tool_start answers 507 when the pool "
        f"is full instead. Set it to about 60% of the pool ({int(0.6 * sizes.host_tokens):,}) or give a "
        "larger --hicache-size; see docs/operations.md, 'Size host memory'"
    )
