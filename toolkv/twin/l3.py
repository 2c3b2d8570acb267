"""The twin's L3 timing model: a storage link per server, a FIFO per direction at a rate.

The L3 tier itself is sglang's (:mod:`toolkv.twin.storage`: HiCache's storage path over an in-memory
``HiCacheStorage``, toolkv's manager driving its own L3 path on it); what cannot exist on CPU is the
time a storage operation takes, and that is this: each server has a link to the store that moves
``kv_bytes_per_token`` bytes a token at ``read_gbps``/``write_gbps``, one operation after another
in each direction, like the twin's copy engines (:mod:`toolkv.twin.copies`).

The bandwidth is a parameter, not a calibration: nothing in this repository measured a storage
backend. The default, 5 GB/s each way, is one local NVMe drive (3-7 GB/s sequential), which bounds
sglang's ``file`` backend on it; a shared store over a 100-200 Gb/s NIC gets 12-25 GB/s.
"""

from __future__ import annotations

from dataclasses import dataclass

GB = 1e9


@dataclass(frozen=True)
class L3Config:
    """A server's storage link (GB/s each way) and the store's capacity (None: it never fills in
    the measured runs; a full store refuses a page, as ``HiCacheFile`` without room does)."""

    read_gbps: float = 5.0
    write_gbps: float = 5.0
    capacity_gb: float | None = None
    #: on a shared Mooncake store: the share of its capacity toolkv's servers may keep soft-pinned,
    #: split evenly (each server's TOOLKV_L3_PIN_TOKENS); None: no cap
    pin_share: float | None = None

    def __post_init__(self) -> None:
        if (
            self.read_gbps <= 0
            or self.write_gbps <= 0
            or (self.capacity_gb is not None and self.capacity_gb <= 0)
        ):
            raise ValueError("L3 bandwidths and capacity must be positive")
        if self.pin_share is not None and not 0 < self.pin_share <= 1:
            raise ValueError("the pin share must be in (0, 1]")

    def pin_tokens(self, servers: int, kv_bytes_per_token: int) -> int | None:
        """One server's pin budget in tokens: its even part of ``pin_share`` of the capacity (the
        operator's arithmetic for TOOLKV_L3_PIN_TOKENS); None without a share or a capacity."""
        if self.pin_share is None or self.capacity_gb is None:
            return None
        return max(1, int(self.pin_share * self.capacity_gb * 1e9 / kv_bytes_per_token / servers))


class Link:
    """One direction of one server's storage link: a FIFO that moves tokens at a rate."""

    def __init__(self, tokens_per_s: float) -> None:
        if tokens_per_s <= 0:
            raise ValueError("a link's rate must be positive")
        self.tokens_per_s = tokens_per_s
        self.free_at = 0.0
        self.tokens = 0  # moved or queued, for the conservation checks

    @classmethod
    def of_gbps(cls, gbps: float, kv_bytes_per_token: int) -> Link:
        return cls(gbps * GB / kv_bytes_per_token)

    def schedule(self, now: float, tokens: int) -> float:
        """Queue a transfer of ``tokens``; returns when it finishes."""
        start = max(now, self.free_at)
        self.tokens += tokens
        self.free_at = start + tokens / self.tokens_per_s
        return self.free_at
