"""An L3 storage tier for the twin, shaped like sglang HiCache's ``--hicache-storage-backend file``.

What sglang does with a storage backend (``mem_cache/hiradix_cache.py``, 0.5.16), and so what this
module reproduces:

- **write**: every node HiCache has backed up to the host is also written to storage
  (``write_backup_storage``), asynchronously; a page is readable once its write completed. Here a
  session's context is queued for writing when its turn ends (only the tokens not queued before:
  storage is keyed by page hash, so a prefix already stored is not written again) and becomes
  readable, up to the tokens written, when the write finishes on the server's storage link.
- **read** (``prefetch_from_storage``): when a request arrives, the part of its prompt that is in
  neither the device nor the host tree but is in storage is read into freshly allocated host slots
  (``mem_pool_host.alloc``, ``evict_host`` when short) under a host protection of the last host
  node, then inserted into the host tree with sglang's own ``_insert_helper_host`` (what
  ``check_prefetch_progress`` does), from where the request's admission loads it to the GPU
  (``load_back``, a modelled host->device copy). Stock HiCache starts this read only when the
  request arrives; the request waits for it (prefetch policy ``wait_complete``, so the read is
  on the critical path and the reuse is the most stock can get; ``best_effort``, sglang's default,
  would stop the read as soon as the request could be scheduled and reuse less).

Only time and capacity are modelled: a storage link per server moves ``kv_bytes_per_token`` per
token at ``read_gbps``/``write_gbps`` (FIFO per direction, like the twin's copy engines), and the
store holds at most ``capacity_gb``, dropping the least recently used session's copy when full
(never one being read). The bandwidth is a parameter, not a calibration: nothing in this
repository measured a storage backend.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

GB = 1e9


@dataclass(frozen=True)
class L3Config:
    """The storage tier's parameters, and when a session's KV is read back from it.

    ``read_gbps``/``write_gbps``: one server's link to the store (default 5 GB/s: one NVMe drive
    reads 3-7 GB/s, the ``file`` backend on a local drive gets at most that, and a shared store
    over a 100-200 Gb/s NIC 12-25 GB/s; the low end makes a read of a 75K-token session take
    about 2 s, a cost a policy has to hide). ``capacity_gb``: the shared store (default 4 TB, so
    the store never fills in the measured runs). ``prefetch``: ``arrival`` (stock HiCache: read
    when the request arrives) or ``predicted`` (toolkv: read ahead of the predicted return, see
    :mod:`toolkv.twin.fleet`). ``margin_s``: toolkv starts a read this much earlier than its own
    time needs. ``long_s``: toolkv demotes to L3 a session whose tool's learned median is at least
    this (30 s: fifteen times a 75K-token session's read at 5 GB/s, so the read is a small part
    of the call).
    ``threshold_tokens``: sglang's ``prefetch_threshold`` (smaller misses are not read)."""

    read_gbps: float = 5.0
    write_gbps: float = 5.0
    capacity_gb: float = 4000.0
    prefetch: str = "arrival"
    margin_s: float = 1.0
    long_s: float = 30.0
    threshold_tokens: int = 256

    def __post_init__(self) -> None:
        if self.read_gbps <= 0 or self.write_gbps <= 0 or self.capacity_gb <= 0:
            raise ValueError("L3 bandwidths and capacity must be positive")
        if self.prefetch not in ("arrival", "predicted"):
            raise ValueError(f"prefetch must be arrival or predicted, got {self.prefetch!r}")
        if self.margin_s < 0:
            raise ValueError("margin_s must be >= 0")


class Link:
    """One direction of one server's storage link: a FIFO that moves tokens at a rate."""

    def __init__(self, gbps: float, kv_bytes_per_token: int) -> None:
        self.s_per_token = kv_bytes_per_token / (gbps * GB)
        self.free_at = 0.0
        self.tokens = 0  # moved or queued, for the conservation checks

    def schedule(self, now: float, tokens: int) -> float:
        """Queue a transfer of ``tokens``; returns when it finishes."""
        start = max(now, self.free_at)
        self.tokens += tokens
        self.free_at = start + tokens * self.s_per_token
        return self.free_at


@dataclass
class Entry:
    """One session's copy in the store: a prefix of its context (sessions share no prefix in the
    agent workload, so the session id names the pages a content hash would)."""

    written: int = 0  # tokens completely written: readable
    queued: int = 0  # tokens written or being written
    readers: int = 0  # reads in flight (the copy is not dropped under them)


@dataclass(order=True)
class Write:
    finish: float
    seq: int
    server: int = field(compare=False)
    sid: str = field(compare=False)
    upto: int = field(compare=False)


class L3Store:
    """The shared store: entries, their writes in flight, capacity, and what moved (for the
    conservation checks: every token read was completely written before, and the bytes each way)."""

    def __init__(self, cfg: L3Config, kv_bytes_per_token: int) -> None:
        self.cfg = cfg
        self.kv_bytes = kv_bytes_per_token
        self.capacity_tokens = int(cfg.capacity_gb * GB // kv_bytes_per_token)
        self.entries: OrderedDict[str, Entry] = OrderedDict()
        self.writes: list[Write] = []
        self._seq = itertools.count()
        self.stats: dict[str, int] = {
            "written_tokens": 0, "read_tokens": 0, "dropped_tokens": 0, "reads": 0,
            "reads_unwritten": 0, "dropped_while_read": 0,
        }  # fmt: skip

    @property
    def used_tokens(self) -> int:
        return sum(e.queued for e in self.entries.values())

    def readable(self, sid: str) -> int:
        e = self.entries.get(sid)
        return e.written if e is not None else 0

    def write(self, link: Link, server: int, sid: str, upto: int, now: float) -> None:
        """Queue the session's context up to ``upto`` tokens (what is not queued yet)."""
        e = self.entries.get(sid)
        if e is None:
            e = self.entries[sid] = Entry()
        self.entries.move_to_end(sid)
        if upto <= e.queued:
            return
        n = upto - e.queued
        e.queued = upto
        heapq.heappush(self.writes, Write(link.schedule(now, n), next(self._seq), server, sid, upto))
        self._fit()

    def complete_writes(self, now: float) -> None:
        while self.writes and self.writes[0].finish <= now + 1e-12:
            w = heapq.heappop(self.writes)
            e = self.entries.get(w.sid)
            if e is None or w.upto > e.queued:  # dropped (or dropped and re-queued shorter) meanwhile
                continue
            self.stats["written_tokens"] += w.upto - e.written if w.upto > e.written else 0
            e.written = max(e.written, w.upto)

    def next_write(self) -> float | None:
        return self.writes[0].finish if self.writes else None

    def begin_read(self, sid: str, tokens: int) -> None:
        """A read of ``tokens`` of the session's copy starts: they must all be written."""
        e = self.entries[sid]
        if tokens > e.written:
            self.stats["reads_unwritten"] += 1
        e.readers += 1
        self.entries.move_to_end(sid)

    def end_read(self, sid: str, tokens: int) -> None:
        e = self.entries.get(sid)
        if e is None:
            self.stats["dropped_while_read"] += 1
            return
        e.readers -= 1
        self.stats["read_tokens"] += tokens
        self.stats["reads"] += 1

    def drop(self, sid: str) -> None:
        """Forget a session's copy (it closed: toolkv knows; stock leaves it to LRU)."""
        e = self.entries.get(sid)
        if e is not None and e.readers == 0:
            self.stats["dropped_tokens"] += e.queued
            del self.entries[sid]

    def _fit(self) -> None:
        """Drop least recently used copies (never one being read) until the store fits."""
        over = self.used_tokens - self.capacity_tokens
        for sid in list(self.entries):
            if over <= 0:
                break
            e = self.entries[sid]
            if e.readers:
                continue
            over -= e.queued
            self.stats["dropped_tokens"] += e.queued
            del self.entries[sid]

    def describe(self) -> dict[str, Any]:
        return {
            "config": self.cfg.__dict__ | {},
            "capacity_tokens": self.capacity_tokens,
            "used_tokens_end": self.used_tokens,
            **self.stats,
        }
