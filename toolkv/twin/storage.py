"""The twin's L3 tier: sglang's real HiCache storage path over an in-memory store, its I/O timed
on the twin's clock.

What is sglang's own code, run unchanged:

- ``HiRadixCache`` built with ``--hicache-storage-backend dynamic`` (the backend class below,
  loaded by sglang's ``StorageBackendFactory`` as any out-of-tree backend is), so its tree computes
  page hashes, writes every acknowledged host copy through to storage
  (``_finish_write_through_ack`` → ``write_backup_storage``), and reads from storage with
  ``prefetch_from_storage`` / ``check_prefetch_progress`` / ``drain_storage_control_queues``;
- ``HiCacheController``'s storage operations: ``write_storage``, ``prefetch``, the hit query
  ``_storage_hit_query``, ``_page_backup`` and ``_page_transfer`` (with the zero-copy page
  functions, ``interface_v1``), ``append_host_mem_release``;
- toolkv's real L3 path (``toolkv/core/session/l3.py`` over ``core/backends/hicache_storage.py``): it sees
  a tree with ``enable_storage`` and drives it as on a server.

What is not sglang's:

- :class:`TwinL3Backend`, the storage backend: a ``HiCacheStorage`` that keeps each page's bytes in
  memory (a dict by page hash; one store object may be shared by several servers, as a shared
  Mooncake or a ``file`` backend on a shared path is). By default it has no evictor: like
  ``HiCacheFile`` without a size cap it never deletes a page, and with ``capacity_tokens`` set it
  refuses a page once full, as ``HiCacheFile.set`` does when its evictor finds no room. With
  ``mooncake`` it has Mooncake's semantics instead (``spec/storage/SharedTier.tla``): a put that
  finds the store full makes the master evict (``eviction_ratio`` of the capacity, least recently
  used first, skipping soft-pinned pages whose deadline is ahead), and refuses only what still does
  not fit; toolkv's soft pins and session manifests go through :class:`TwinSharedTier`, the
  twin's stand-in for ``MooncakeTier`` (the same calls, on the store's memory and the twin's
  clock).
- :class:`TimedStorageIO`, a **timing double** for the controller's three storage threads (the
  prefetch thread, its I/O thread and the backup thread). On a server they run on their own time;
  here they must run on the twin's clock, so the controller is built without them
  (:func:`no_storage_threads`: the same queues, no threads) and :meth:`TimedStorageIO.pump` does
  what each thread's loop does with one operation, at the simulated instant the operation would
  have finished on a storage link of ``read``/``write`` tokens per second (a FIFO per direction,
  :class:`toolkv.twin.l3.Link`, like the twin's copy engines). The hit query is answered when it
  is queued (metadata, no modelled time; re-implemented from ``prefetch_thread_func``, which also
  holds an all-reduce);
  a read takes its pages' time on the read link, from when the scheduler allocated its host slots;
  a write takes the time of the pages the store does not hold yet on the write link. A written
  page becomes visible to the hit query when its whole operation has finished.
- :class:`L3Scheduler`'s two storage calls of sglang's ``Scheduler``: ``_prefetch_kvcache`` when a
  request is queued (re-implemented: importing sglang's scheduler module costs seconds) and the
  waiting-queue walk's ``check_prefetch_progress`` skip (the walk is the twin's; a request whose
  prefetch is not done is left out of it, in its place, as sglang's ``continue`` leaves it).
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import json
import types
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from queue import Empty, Queue
from typing import Any
from unittest import mock

import torch

from toolkv.twin.l3 import Link
from toolkv.twin.scheduler import Batch, TwinScheduler

GB = 1e9
MODEL_NAME = "toolkv-twin"
#: stores shared between servers (a fleet's), by name: each server's backend instance finds its
#: store here through the storage backend's extra config ("store")
STORES: dict[str, L3Pages] = {}


@dataclass(frozen=True)
class StorageLink:
    """One server's link to the store: tokens per second each way (from GB/s and the model's
    KV bytes per token), and the store's capacity (None: unlimited)."""

    read_tokens_per_s: float
    write_tokens_per_s: float
    capacity_tokens: int | None = None
    prefetch_threshold: int = 256  # sglang's storage extra-config key (tokens)
    store: str = ""  # the name of a store several servers share ("": the server's own)
    mooncake: bool = False  # the store has Mooncake's master eviction and soft pins

    @classmethod
    def of_gbps(
        cls, read_gbps: float, write_gbps: float, kv_bytes_per_token: int, capacity_gb: float | None = None,
        store: str = "", mooncake: bool = False,
    ) -> StorageLink:  # fmt: skip
        if read_gbps <= 0 or write_gbps <= 0 or (capacity_gb is not None and capacity_gb <= 0):
            raise ValueError("L3 bandwidths and capacity must be positive")
        cap = int(capacity_gb * GB // kv_bytes_per_token) if capacity_gb else None
        return cls(
            read_gbps * GB / kv_bytes_per_token, write_gbps * GB / kv_bytes_per_token, cap, store=store,
            mooncake=mooncake,
        )  # fmt: skip


#: Mooncake master's ``-eviction_ratio`` default: the share of the capacity one eviction frees
EVICTION_RATIO = 0.05


@dataclass
class L3Pages:
    """The store's contents: each page's bytes by page hash (the key sglang's hit query asks).
    With ``mooncake``: the master's LRU order (a read, an exists or a write makes a page the most
    recently used: ``_seq``), ``pins`` the soft pins' deadlines on the twin's clock (``now``, the
    latest time any server's storage I/O ran), ``manifests`` toolkv's session manifests (small
    objects: not counted against the capacity).

    The LRU order is a heap of ``(last use, page)`` with stale entries skipped, and a pinned page
    the eviction met waits in ``_parked`` until its deadline or its unpin: a store holding millions
    of pages, most of them pinned, evicts without walking past the pinned ones again each time (the
    same pages, in the same order, as walking the whole LRU order would)."""

    capacity_pages: int | None = None
    pages: dict[str, torch.Tensor] = field(default_factory=dict)
    refused: int = 0  # pages refused for capacity
    mooncake: bool = False
    now: float = 0.0
    pins: dict[str, float] = field(default_factory=dict)
    manifests: dict[str, tuple[bytes, float]] = field(default_factory=dict)
    evicted: int = 0  # pages the master evicted
    pinned_writes: int = 0  # pages toolkv's pinned put wrote that the store did not hold
    unpinned: int = 0  # pins toolkv released (a store not acknowledged whole)
    _seq: dict[str, int] = field(default_factory=dict)  # page -> its last use (Mooncake: LRU order)
    # heaps: (last use, page), stale entries skipped; (pin deadline, last use, page)
    _lru: list[tuple[int, str]] = field(default_factory=list)
    _parked: list[tuple[float, int, str]] = field(default_factory=list)
    _clock: itertools.count[int] = field(default_factory=itertools.count)

    def __len__(self) -> int:
        return len(self.pages)

    def touch(self, key: str) -> None:
        """An access (Mooncake: the page becomes the most recently used)."""
        if self.mooncake and key in self.pages:
            t = next(self._clock)
            self._seq[key] = t
            heapq.heappush(self._lru, (t, key))
            if len(self._lru) > 4 * len(self._seq) + 1024:  # stale entries: rebuild from the live ones
                self._lru = [(t, k) for k, t in self._seq.items()]
                heapq.heapify(self._lru)
                self._parked = []

    def pinned(self, key: str) -> bool:
        return self.pins.get(key, -1.0) > self.now

    def unpin(self, key: str) -> bool:
        """The page's soft pin ends (``SoftPinAction.DISABLE``); False: it had none."""
        if self.pins.pop(key, None) is None:
            return False
        if key in self._seq:  # evictable again at its place in the LRU order
            heapq.heappush(self._lru, (self._seq[key], key))
        return True

    def put(self, key: str, data: torch.Tensor, pin_until: float | None = None) -> bool:
        """Write one page (an upsert when it is there); False: refused, the store is full."""
        if key not in self.pages:
            cap = self.capacity_pages
            if cap is not None and len(self.pages) >= cap and self.mooncake:
                self.evict()
            if cap is not None and len(self.pages) >= cap:
                self.refused += 1
                return False
        self.pages[key] = data
        self.touch(key)
        if pin_until is not None:
            self.pins[key] = max(self.pins.get(key, -1.0), pin_until)
        return True

    def evict(self) -> int:
        """Mooncake's ``BatchEvict``: up to ``EVICTION_RATIO`` of the capacity, least recently used
        first, skipping soft-pinned pages (``-allow_evict_soft_pinned_objects=false``)."""
        want = max(1, int(EVICTION_RATIO * (self.capacity_pages or len(self.pages))))
        lru, parked, seq, pins, now = self._lru, self._parked, self._seq, self.pins, self.now
        while parked and parked[0][0] <= now:  # deadlines passed: back in the LRU order
            _, t, k = heapq.heappop(parked)
            heapq.heappush(lru, (t, k))
        gone: list[str] = []
        while lru and len(gone) < want:
            t, k = heapq.heappop(lru)
            if seq.get(k) != t:
                continue  # used again since, or gone
            deadline = pins.get(k, -1.0)
            if deadline > now:
                heapq.heappush(parked, (deadline, t, k))
                continue
            gone.append(k)
            del seq[k]
        for k in gone:
            del self.pages[k]
            self.pins.pop(k, None)
        self.evicted += len(gone)
        return len(gone)


def _backend_class() -> type:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

    class TwinL3Backend(HiCacheStorage):  # type: ignore[misc]
        """An in-memory ``HiCacheStorage`` with the zero-copy page interface (``interface_v1``):
        ``batch_set_v1`` copies the pages' bytes out of the host pool, ``batch_get_v1`` copies them
        back into the host slots sglang allocated. Instant: the time is :class:`TimedStorageIO`'s."""

        def __init__(self, storage_config: Any, kwargs: Any = None) -> None:
            extra = dict(storage_config.extra_config or {})
            name = str(extra.get("store", ""))
            if name and name in STORES:
                self.store = STORES[name]
            else:
                cap = extra.get("capacity_pages")
                self.store = L3Pages(int(cap) if cap else None, mooncake=bool(extra.get("mooncake")))
                if name:
                    STORES[name] = self.store
            self.mem_pool_host: Any = None
            self.io: Any = None  # the server's TimedStorageIO (it charges toolkv's pin writes)
            self.pin_landing: dict[str, float] = {}  # toolkv's pinned puts in flight: when each lands

        def toolkv_shared_tier(self, pin_ttl_ms: int) -> TwinSharedTier | None:
            """What ``HiCacheStorage.shared_tier`` asks a backend for: the Mooncake calls toolkv
            makes, on a store with Mooncake's semantics; None on a plain one (file-like)."""
            return TwinSharedTier(self, pin_ttl_ms) if self.store.mooncake else None

        # host pool layout "layer_first": kv_buffer (2, layers, slots, heads, head_dim)
        def _slots(self, host_indices: torch.Tensor) -> torch.Tensor:
            return host_indices.to(torch.int64)

        def batch_set_v1(
            self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None
        ) -> list[bool]:
            pages = self.store.pages
            ps = self.mem_pool_host.page_size
            data = self.mem_pool_host.kv_buffer[:, :, self._slots(host_indices)]
            out = []
            for i, k in enumerate(keys):
                if k in pages:
                    self.store.touch(k)
                    out.append(True)
                    continue
                out.append(self.store.put(k, data[:, :, i * ps : (i + 1) * ps].clone()))
            return out

        def batch_get_v1(
            self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None
        ) -> list[bool]:
            pages = self.store.pages
            ps = self.mem_pool_host.page_size
            idx = self._slots(host_indices)
            buf = self.mem_pool_host.kv_buffer
            out = []
            for i, k in enumerate(keys):
                page = pages.get(k)
                if page is None:
                    out.append(False)
                    continue
                buf[:, :, idx[i * ps : (i + 1) * ps]] = page
                self.store.touch(k)
                out.append(True)
            return out

        def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
            pages = self.store.pages
            for i, k in enumerate(keys):
                if k not in pages:
                    return i
                self.store.touch(k)
            return len(keys)

        def exists(self, key: str) -> bool:
            return key in self.store.pages

        # the deprecated generic interface: not used with interface_v1
        def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
            raise NotImplementedError("TwinL3Backend serves the zero-copy interface (interface_v1)")

        def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None) -> Any:
            raise NotImplementedError("TwinL3Backend serves the zero-copy interface (interface_v1)")

        def set(
            self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None
        ) -> bool:
            raise NotImplementedError("TwinL3Backend serves the zero-copy interface (interface_v1)")

        def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                      target_sizes: Any = None) -> bool:  # fmt: skip
            raise NotImplementedError("TwinL3Backend serves the zero-copy interface (interface_v1)")

        def get_stats(self) -> None:
            return None

    return TwinL3Backend


def __getattr__(name: str) -> Any:
    """``TwinL3Backend``, the class sglang's dynamic loader asks this module for, made on first use
    (sglang's ``HiCacheStorage`` is imported lazily: importing the twin does not import sglang)."""
    if name == "TwinL3Backend":
        cls = _backend_class()
        globals()["TwinL3Backend"] = cls
        return cls
    raise AttributeError(name)


class TwinSharedTier:
    """The twin's stand-in for :class:`toolkv.core.backends.mooncake_tier.MooncakeTier` (the same
    four calls toolkv's storage tier makes), on :class:`L3Pages` with ``mooncake``: the soft pin's
    deadline is on the twin's clock (``store.now`` + the pin TTL), the pin upsert writes again the
    pages the master evicted since the check (their write is charged to the server's write link),
    the manifest is a small object beside the pages, pinned alike."""

    def __init__(self, backend: Any, pin_ttl_ms: int) -> None:
        self.backend = backend
        self.store: L3Pages = backend.store
        self.pin_ttl_ms = int(pin_ttl_ms)

    def _until(self) -> float:
        return self.store.now + self.pin_ttl_ms / 1000.0

    def pin_deadline_ms(self) -> int:
        """The deadline written into the manifest (wall clock, as ``MooncakeTier``'s); the twin's
        :meth:`find_manifest` answers by the store's own clock instead."""
        import time

        return int(time.time() * 1000) + self.pin_ttl_ms

    def put_pinned(self, keys: Sequence[str], host_indices: torch.Tensor) -> list[str]:
        """``MooncakeTier.put_pinned``: every page upserted with the soft pin (a page not in the
        store is written from the host copy; one that is keeps its bytes, as an upsert of the
        same bytes does). The whole upsert takes its time on the server's write link, and
        :meth:`landed` says when it has finished. Returns the keys written and pinned (a full
        store whose every page is pinned refuses the rest)."""
        host = self.backend.mem_pool_host
        ps = int(host.page_size)
        idx = host_indices.to(torch.int64)
        until = self._until()
        rewritten = 0
        done: list[str] = []
        for i, k in enumerate(keys):
            data = self.store.pages.get(k)
            if data is None:
                data = host.kv_buffer[:, :, idx[i * ps : (i + 1) * ps]].clone()
                rewritten += 1
            if not self.store.put(k, data, pin_until=until):
                break
            done.append(k)
        self.store.pinned_writes += rewritten
        if self.backend.io is not None and keys:
            self.backend.pin_landing[keys[-1]] = self.backend.io.charge_write(len(done) * ps)
        return done

    def unpin_pages(self, keys: Sequence[str], host_indices: torch.Tensor, which: set[str]) -> None:
        """``MooncakeTier.unpin_pages``: the pins of pages ``which`` end (an upsert with
        ``SoftPinAction.DISABLE``, its write charged to the link)."""
        n = 0
        for k in keys:
            if k in which and self.store.unpin(k):
                n += 1
        self.store.unpinned += n
        if n and self.backend.io is not None:
            self.backend.io.charge_write(n * int(self.backend.mem_pool_host.page_size))

    def landed(self, keys: Sequence[str]) -> bool:
        """The pinned put of ``keys`` has finished on the write link (the twin's clock)."""
        due = self.backend.pin_landing.get(keys[-1]) if keys else None
        if due is None:
            return True
        io = self.backend.io
        if due > (io.now if io is not None else self.store.now) + 1e-12:
            return False
        del self.backend.pin_landing[keys[-1]]
        return True

    def put_manifest(self, m: Any) -> bool:
        self.store.manifests[m.session_id] = (m.encode(), self._until())
        return True

    def find_manifest(self, session_id: str) -> Any:
        import time

        from toolkv.core.backends.mooncake_tier import Manifest

        got = self.store.manifests.get(session_id)
        if got is None:
            return None
        raw, until = got
        if until <= self.store.now:  # its pin lapsed: the master may evict it any time
            return None
        m = Manifest.decode(raw)
        left_ms = (until - self.store.now) * 1000
        return Manifest(m.session_id, m.epoch, m.tokens, m.extra_key, int(time.time() * 1000 + left_ms))

    def drop_manifest(self, session_id: str) -> None:
        self.store.manifests.pop(session_id, None)


class IdleThread:
    """Thread double: what ``HiCacheController`` starts as its storage threads, here a thread that
    never runs (:class:`TimedStorageIO` does their work on the twin's clock)."""

    def __init__(self, target: Any = None, daemon: bool | None = None, **kwargs: Any) -> None:
        self.target = target

    def start(self) -> None:
        pass

    def join(self, timeout: float | None = None) -> None:
        pass

    def is_alive(self) -> bool:
        return False


@contextlib.contextmanager
def no_storage_threads() -> Iterator[None]:
    """Build a ``HiCacheController`` whose storage queues exist but whose storage threads never run:
    ``_start_storage_threads`` and ``reset`` create the same queues as on a server and start
    :class:`IdleThread` s (the controller module's ``threading.Thread`` while the stack is built;
    its ``Event`` and ``Lock`` stay the real ones)."""
    import threading

    import sglang.srt.managers.cache_controller as cc

    ns = types.SimpleNamespace(**{k: getattr(threading, k) for k in dir(threading) if not k.startswith("__")})
    ns.Thread = IdleThread
    with mock.patch.object(cc, "threading", ns):
        yield


def storage_server_args(args: Any, link: StorageLink, store: str = "") -> Any:
    """The server flags of an L3 server: ``--hicache-storage-backend dynamic`` naming
    :class:`TwinL3Backend`, ``--hicache-storage-prefetch-policy wait_complete`` (a request waits
    for the whole read: the most reuse stock gets), the threshold and the store's name."""
    extra: dict[str, Any] = {
        "backend_name": "toolkv-twin", "module_path": __name__, "class_name": "TwinL3Backend",
        "interface_v1": 1, "prefetch_threshold": link.prefetch_threshold, "store": store,
    }  # fmt: skip
    if link.capacity_tokens is not None:
        extra["capacity_pages"] = link.capacity_tokens // max(1, int(args.page_size))
    if link.mooncake:
        extra["mooncake"] = True
    args.hicache_storage_backend = "dynamic"
    args.hicache_storage_prefetch_policy = "wait_complete"
    args.hicache_storage_backend_extra_config = json.dumps(extra)
    args.served_model_name = MODEL_NAME
    return args


def build_storage_harness(cfg: Any, link: StorageLink) -> Any:
    """A :class:`~toolkv.testing.harness.CacheHarness` (sglang's real HiRadixCache on CPU) built
    with the L3 flags of :func:`storage_server_args` and without storage threads."""
    from sglang.srt.runtime_context import get_parallel

    from toolkv.testing import harness as _harness
    from toolkv.testing.harness import CacheHarness

    real = _harness.make_server_args
    with (
        get_parallel().override(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_tp_rank=0, attn_tp_size=1),
        mock.patch.object(
            _harness, "make_server_args", lambda c: storage_server_args(real(c), link, link.store)
        ),
        no_storage_threads(),
    ):
        h = CacheHarness(cfg)
    assert h.tree.enable_storage, "the tree was built without its storage tier"
    # the queue the prefetch thread would create when it starts (prefetch_thread_func)
    h.tree.cache_controller.prefetch_buffer = Queue()
    return h


@dataclass(order=True)
class _Op:
    finish: float
    seq: int
    kind: str = field(compare=False)  # "read" | "write"
    op: Any = field(compare=False)
    tokens: int = field(compare=False)


class TimedStorageIO:
    """Timing double for ``HiCacheController``'s storage threads: runs their per-operation work
    at the simulated instant it finishes (see the module docstring). :meth:`pump` once per
    scheduler iteration, before ``check_hicache_events``."""

    def __init__(self, harness: Any, link: StorageLink) -> None:
        self.cc = harness.tree.cache_controller
        self.link = link
        self.page = int(self.cc.page_size)
        self.backend = self.cc.storage_backend
        self.heap: list[_Op] = []
        self._seq = itertools.count()
        self.rlink = Link(link.read_tokens_per_s)
        self.wlink = Link(link.write_tokens_per_s)
        # what moved, for the reports and the conservation checks
        self.stats: dict[str, float] = {
            "write_ops": 0, "write_tokens": 0, "read_ops": 0, "read_tokens": 0, "queries": 0,
            "query_hit_tokens": 0, "revoked": 0, "reads_cut": 0, "read_tokens_cut": 0,
            "toolkv_read_ops": 0, "toolkv_read_tokens": 0, "pin_write_tokens": 0,
        }  # fmt: skip
        self._queued: set[str] = set()  # page keys of writes in flight (not timed twice)
        self.backend.io = self
        self.now = 0.0

    def charge_write(self, tokens: int) -> float:
        """A write made outside sglang's backup thread (toolkv's pinned put): it takes its time on
        the write link (FIFO behind what is queued there). Returns when it finishes."""
        self.stats["pin_write_tokens"] += tokens
        return float(self.wlink.schedule(self.now, tokens))

    # ---- the clock ---------------------------------------------------------------------------------
    def next_finish(self) -> float | None:
        return self.heap[0].finish if self.heap else None

    @property
    def busy(self) -> bool:
        return bool(self.heap) or not self.cc.prefetch_queue.empty() or not self.cc.backup_queue.empty()

    def pump(self, now: float) -> None:
        """Start what was queued since the last call, then finish every operation due by ``now``."""
        self.now = now
        store = self.backend.store
        store.now = max(store.now, now)
        self._queries(now)
        self._start(now)
        while self.heap and self.heap[0].finish <= now + 1e-12:
            x = heapq.heappop(self.heap)
            if x.kind == "write":
                self._finish_write(x)
            else:
                self._finish_read(x)
        self._start(now)

    # ---- the prefetch thread: the hit query ----------------------------------------------------------
    def _queries(self, now: float) -> None:
        """``prefetch_thread_func``'s loop body for every queued prefetch (one rank: its all-reduce
        of the hit count is the identity): below the threshold → revoke, else → the hit queue,
        where the scheduler allocates host slots and hands it to the I/O thread."""
        cc = self.cc
        while True:
            try:
                op = cc.prefetch_queue.get_nowait()
            except Empty:
                return
            if op is None:
                continue
            if op.is_terminated():
                hash_value, hit = [], 0
            else:
                hash_value, hit = cc._storage_hit_query(op)
            self.stats["queries"] += 1
            if hit < cc.prefetch_threshold:
                self.stats["revoked"] += 1
                cc.prefetch_revoke_queue.put(op.request_id)
            else:
                op.hash_value = hash_value[: hit // self.page]
                op.storage_hit_count = hit
                op._twin_hit = hit  # what the query found, before the host allocation
                self.stats["query_hit_tokens"] += hit
                cc.prefetch_hit_queue.put(op)

    # ---- the I/O thread and the backup thread: start on the links ------------------------------------
    def _start(self, now: float) -> None:
        cc = self.cc
        while True:
            try:
                op = cc.prefetch_buffer.get_nowait()
            except Empty:
                break
            if op is None:
                continue
            n = len(op.hash_value) * self.page
            if n < op.storage_hit_count or n < getattr(op, "_twin_hit", n):
                # sglang's memory-pressure fallback (_drain_and_alloc_storage_hit): the host pool
                # had room for a shorter prefix only
                self.stats["reads_cut"] += 1
                self.stats["read_tokens_cut"] += getattr(op, "_twin_hit", n) - n
            heapq.heappush(self.heap, _Op(self.rlink.schedule(now, n), next(self._seq), "read", op, n))
        while True:
            try:
                op = cc.backup_queue.get_nowait()
            except Empty:
                break
            if op is None:
                continue
            new = [k for k in op.hash_value if k not in self._queued and not self.backend.exists(k)]
            self._queued.update(new)
            n = len(new) * self.page
            heapq.heappush(self.heap, _Op(self.wlink.schedule(now, n), next(self._seq), "write", op, n))

    def _finish_write(self, x: _Op) -> None:
        """``backup_thread_func``'s loop body: ``_page_backup`` (the pages into the store), then the
        acknowledgement the scheduler drains (``release_host`` of the source)."""
        cc = self.cc
        if not cc.backup_skip:
            cc._page_backup(x.op)
        self._queued.difference_update(x.op.hash_value)
        cc.ack_backup_queue.put(x.op)
        self.stats["write_ops"] += 1
        self.stats["write_tokens"] += x.tokens

    def _finish_read(self, x: _Op) -> None:
        """``prefetch_io_aux_func``'s loop body: ``_page_transfer`` (the pages into the host slots,
        ``completed_tokens`` up), then the slots of pages not read go back."""
        cc = self.cc
        op = x.op
        cc._page_transfer(op)
        cc.append_host_mem_release(op.host_indices[op.completed_tokens :])
        self.stats["read_ops"] += 1
        self.stats["read_tokens"] += op.completed_tokens
        if str(op.request_id).startswith("toolkv-l3:"):
            self.stats["toolkv_read_ops"] += 1
            self.stats["toolkv_read_tokens"] += op.completed_tokens

    def describe(self) -> dict[str, Any]:
        return {
            **{k: (round(v, 3) if isinstance(v, float) else int(v)) for k, v in self.stats.items()},
            "stored_pages": len(self.backend.store),
            "refused_pages": self.backend.store.refused,
            "evicted_pages": self.backend.store.evicted,
            "read_tokens_per_s": self.link.read_tokens_per_s,
            "write_tokens_per_s": self.link.write_tokens_per_s,
        }


def prefetch_kvcache(tree: Any, req: Any) -> None:
    """sglang's ``Scheduler._prefetch_kvcache`` (managers/scheduler.py, 0.5.16), for a request
    entering the waiting queue: read from storage what its prompt has beyond the device and host
    tree (``prefetch_from_storage``; sglang decides whether to read at all)."""
    req.init_next_round_input(tree, cow_mamba=False)
    last_host_node = req.last_host_node
    if last_host_node.backuped or last_host_node is tree.root_node:
        last_hash = last_host_node.get_last_hash_value()
        matched_len = len(req.prefix_indices) + req.host_hit_length
        match_end = req._compute_max_prefix_len(len(req.full_untruncated_fill_ids))
        new_input_tokens = req.full_untruncated_fill_ids[matched_len:match_end]
        prefix_keys = (
            last_host_node.get_prefix_hash_values(last_host_node.parent)
            if tree.hicache_storage_pass_prefix_keys
            else None
        )
        tree.prefetch_from_storage(req.rid, last_host_node, new_input_tokens, last_hash, prefix_keys)


class L3Scheduler(TwinScheduler):
    """The twin's scheduler with sglang's storage calls (``enable_hicache_storage``): a queued
    request starts its read from storage (:func:`prefetch_kvcache`), and the waiting-queue walk
    skips a request whose read is not done (``check_prefetch_progress``), then records what it
    read (``pop_prefetch_loaded_tokens`` → ``req.storage_hit_length``)."""

    def __init__(self, harness: Any, **kwargs: Any) -> None:
        super().__init__(harness, **kwargs)
        self.storage_hits: dict[str, int] = {}  # request id -> tokens its own prefetch read

    def add_request(self, req: Any) -> None:
        prefetch_kvcache(self.tree, req)
        super().add_request(req)

    def _new_prefill(self) -> Batch | None:
        waiting = self.waiting_queue
        ready = []
        for req in waiting:
            if not self.tree.check_prefetch_progress(req.rid):
                continue  # sglang: "skip staging requests that are ongoing prefetch"
            loaded = self.tree.pop_prefetch_loaded_tokens(req.rid)
            if loaded > 0:
                req.storage_hit_length = loaded
                self.storage_hits[req.rid] = self.storage_hits.get(req.rid, 0) + loaded
            ready.append(req)
        if len(ready) == len(waiting):
            return super()._new_prefill()
        ready_ids = {id(r) for r in ready}
        skipped = {id(r) for r in waiting if id(r) not in ready_ids}
        self.waiting_queue = ready
        try:
            return super()._new_prefill()
        finally:
            # the skipped requests stay where they were: merge back in the original order
            left = {id(r) for r in self.waiting_queue} | skipped
            self.waiting_queue = [r for r in waiting if id(r) in left]
