"""Build the REAL sglang 0.5.16 cache stack — HiRadixCache or plain RadixCache — for tests.

Real: ``MHATokenToKVPool``, ``TokenToKVPoolAllocator`` / ``PagedTokenToKVPoolAllocator``,
``ReqToTokenPool``, ``MHATokenToKVPoolHost``, ``HiCacheController``, ``HiRadixCache`` /
``RadixCache``, ``ServerArgs`` and sglang's own hicache option normalisation, a real gloo process
group. On a CPU-only machine three things cannot exist and are replaced by named test doubles
(see ``docs/testing.md``):

1. pinned host memory (``cudaHostRegister`` needs CUDA) → the same host-pool class, unpinned;
2. sgl-kernel's direct copy primitives → torch-indexing versions (``toolkv.testing.transfer``);
3. the GPU's asynchronous copy engine → :class:`~toolkv.testing.transfer.ControlledTransferEngine`,
   whose writes and loads complete only when the test says so.

With ``device="cuda"`` none of the doubles is installed: pools live on the GPU, the host pool is
pinned, ``io_backend="kernel"`` uses sgl-kernel, and acknowledgements arrive when the GPU finishes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from toolkv.testing.transfer import (
    ControlledDeviceModule,
    ControlledTransferEngine,
    make_transfer_kv_all_layer_direct_lf_pf,
    make_transfer_kv_direct,
    make_transfer_kv_per_layer_direct_pf_lf,
)

CacheKind = Literal["hiradix", "radix"]
WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")


@dataclass(frozen=True)
class HarnessConfig:
    """Shape of one cache stack. Defaults are tiny so that many stacks fit in one process."""

    kind: CacheKind = "hiradix"
    page_size: int = 1
    device_tokens: int = 256
    host_ratio: float = 2.0
    write_policy: str = "write_through"
    layout: str = "layer_first"
    io_backend: str = "direct"
    layers: int = 2
    heads: int = 2
    head_dim: int = 4
    dtype: torch.dtype = torch.float32
    device: str = "cpu"
    max_reqs: int = 8
    context_len: int = 1024

    def __post_init__(self) -> None:
        if self.write_policy not in WRITE_POLICIES:
            raise ValueError(f"write_policy must be one of {WRITE_POLICIES}, got {self.write_policy!r}")
        if self.device_tokens % self.page_size:
            raise ValueError("device_tokens must be a multiple of page_size")


def ensure_process_group() -> torch.distributed.ProcessGroup:
    """A single-process gloo group (world size 1 issues no collective), or the one already set up."""
    dist = torch.distributed
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 20000))
        dist.init_process_group("gloo", rank=0, world_size=1)
    group = dist.group.WORLD
    assert group is not None
    return group


def make_server_args(cfg: HarnessConfig) -> Any:
    """A real ``ServerArgs`` with its dataclass defaults, without resolving a model from disk or hub."""
    from sglang.srt.server_args import ServerArgs

    args = object.__new__(ServerArgs)
    for f in dataclasses.fields(ServerArgs):
        if f.default is not dataclasses.MISSING:
            value: Any = f.default
        elif f.default_factory is not dataclasses.MISSING:
            value = f.default_factory()
        else:
            value = None
        object.__setattr__(args, f.name, value)
    args.enable_hierarchical_cache = cfg.kind == "hiradix"
    args.hicache_ratio = cfg.host_ratio
    args.hicache_size = 0
    args.hicache_write_policy = cfg.write_policy
    args.hicache_io_backend = cfg.io_backend
    args.hicache_mem_layout = cfg.layout
    args.hicache_storage_backend = None
    args.page_size = cfg.page_size
    args._handle_hicache()  # sglang's own normalisation of layout/io-backend combinations
    return args


class _UnpinnedHostPool:
    """TEST DOUBLE factory: the real host-pool class, constructed with ``pin_memory=False``."""

    def __init__(self, cls: type) -> None:
        self.cls = cls

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        kwargs["pin_memory"] = False
        return self.cls(*args, **kwargs)


@contextlib.contextmanager
def cpu_doubles(engine: ControlledTransferEngine) -> Iterator[None]:
    """Install the three CPU test doubles into sglang's modules; restore on exit."""
    import sglang.srt.managers.cache_controller as cc
    import sglang.srt.mem_cache.hiradix_cache as hr
    import sglang.srt.mem_cache.pool_host.mha as mha

    saved_dm = cc.device_module
    saved_get = hr.get_mha_host_pool_cls
    prims = {
        "transfer_kv_direct": make_transfer_kv_direct(engine),
        "transfer_kv_all_layer_direct_lf_pf": make_transfer_kv_all_layer_direct_lf_pf(engine),
        "transfer_kv_per_layer_direct_pf_lf": make_transfer_kv_per_layer_direct_pf_lf(engine),
    }
    saved_prims = {name: getattr(mha, name, None) for name in prims}
    cc.device_module = ControlledDeviceModule(engine)
    hr.get_mha_host_pool_cls = lambda device_pool: _UnpinnedHostPool(saved_get(device_pool))
    for name, fn in prims.items():
        setattr(mha, name, fn)
    try:
        yield
    finally:
        cc.device_module = saved_dm
        hr.get_mha_host_pool_cls = saved_get
        for name, old in saved_prims.items():
            if old is None:
                delattr(mha, name)
            else:
                setattr(mha, name, old)


@dataclass(frozen=True)
class Accounting:
    """Every counter that a correct manager must return to its initial value."""

    device_free: int
    host_free: int
    evictable: int
    protected: int
    lock_refs: tuple[tuple[int, int], ...]  # (node id, lock_ref) for nodes with lock_ref != 0, root excluded
    host_refs: tuple[tuple[int, int], ...]  # (node id, host_ref_counter) for nodes with a nonzero counter
    pending_writes: int
    pending_loads: int


def rkey(tokens: Sequence[int], extra_key: str | None = None) -> Any:
    """A ``RadixKey`` over ``array('q')`` token ids (sglang requires the typed array)."""
    from sglang.srt.mem_cache.radix_cache import RadixKey

    return RadixKey(array("q", tokens), extra_key)


class CacheHarness:
    """One real cache stack plus helpers to fill, inspect and drive it.

    Exactly one CPU harness may be live per process, because the CPU doubles are installed into
    sglang's module globals for its lifetime. Call :meth:`close` (or use it as a context manager).
    """

    _live_cpu: CacheHarness | None = None

    def __init__(self, cfg: HarnessConfig | None = None, *, seed: int = 0) -> None:
        self.cfg = cfg = cfg or HarnessConfig()
        self.rng = torch.Generator().manual_seed(seed)
        self.engine: ControlledTransferEngine | None = None
        self._doubles: contextlib.ExitStack | None = None
        if cfg.device == "cpu":
            if CacheHarness._live_cpu is not None:
                raise RuntimeError("one CPU CacheHarness at a time per process: close() the previous one")
            self.engine = ControlledTransferEngine()
            self._doubles = contextlib.ExitStack()
            self._doubles.enter_context(cpu_doubles(self.engine))
            CacheHarness._live_cpu = self
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        from sglang.srt.mem_cache.allocator import (
            PagedTokenToKVPoolAllocator,
            TokenToKVPoolAllocator,
        )
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool

        cfg = self.cfg
        group = ensure_process_group()
        self.server_args = make_server_args(cfg)
        self.kv_pool = MHATokenToKVPool(
            size=cfg.device_tokens,
            page_size=cfg.page_size,
            dtype=cfg.dtype,
            head_num=cfg.heads,
            head_dim=cfg.head_dim,
            layer_num=cfg.layers,
            device=cfg.device,
            enable_memory_saver=False,
            enable_alt_stream=False,
        )
        if cfg.page_size == 1:
            self.allocator: Any = TokenToKVPoolAllocator(
                cfg.device_tokens, cfg.dtype, cfg.device, self.kv_pool, need_sort=False
            )
        else:
            self.allocator = PagedTokenToKVPoolAllocator(
                cfg.device_tokens, cfg.page_size, cfg.dtype, cfg.device, self.kv_pool, need_sort=False
            )
        self.req_pool = ReqToTokenPool(cfg.max_reqs, cfg.context_len, cfg.device, enable_memory_saver=False)
        params = CacheInitParams(
            disable=False,
            req_to_token_pool=self.req_pool,
            token_to_kv_pool_allocator=self.allocator,
            page_size=cfg.page_size,
            tp_cache_group=group,
        )
        if cfg.kind == "hiradix":
            from sglang.srt.mem_cache.hiradix_cache import HiRadixCache

            self.tree: Any = HiRadixCache(params, self.server_args)
            self.host_pool: Any = self.tree.token_to_kv_pool_host
        else:
            from sglang.srt.mem_cache.radix_cache import RadixCache

            self.tree = RadixCache(params)
            self.host_pool = None

    # ---- lifecycle --------------------------------------------------------------------------------
    def close(self) -> None:
        # sglang never unregisters its pinned host buffer; a second host pool in the same process
        # then fails with cudaHostRegister rc=712. Unregister ours (idempotent).
        if self.cfg.device.startswith("cuda") and getattr(self, "host_pool", None) is not None:
            self.host_pool.destroy()
        if self._doubles is not None:
            self._doubles.close()
            self._doubles = None
        if CacheHarness._live_cpu is self:
            CacheHarness._live_cpu = None

    def __enter__(self) -> CacheHarness:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def is_hi(self) -> bool:
        return self.cfg.kind == "hiradix"

    # ---- KV data ----------------------------------------------------------------------------------
    def alloc(self, n_tokens: int) -> torch.Tensor | None:
        """Allocate device slots for ``n_tokens`` (page-aligned) and fill them with random KV."""
        assert n_tokens % self.cfg.page_size == 0, "allocate whole pages"
        idx: torch.Tensor | None = self.allocator.alloc(n_tokens)
        if idx is None:
            return None
        for layer in range(self.cfg.layers):
            for buf in (self.kv_pool.k_buffer[layer], self.kv_pool.v_buffer[layer]):
                shape = (n_tokens, *buf.shape[1:])
                buf[idx] = (
                    torch.randn(shape, generator=self.rng, dtype=torch.float32).to(buf.dtype).to(buf.device)
                )
        return idx

    def expected_kv(self, tokens: Sequence[int]) -> torch.Tensor:
        """Deterministic KV of ``tokens`` in the ``device_kv`` layout ``[2, layers, n, heads, dim]``.

        A model computes the same KV for the same prefix; the harness stands in for the model with
        a function of the token id (tokens are unique per prefix position in the fuzz workloads), so
        a recomputation writes identical bytes and any byte that differs was lost or read early."""
        c = self.cfg
        t = torch.tensor(list(tokens), dtype=torch.int64).view(1, 1, -1, 1, 1)
        kv = torch.arange(2).view(2, 1, 1, 1, 1)
        layer = torch.arange(c.layers).view(1, -1, 1, 1, 1)
        h = torch.arange(c.heads).view(1, 1, 1, -1, 1)
        d = torch.arange(c.head_dim).view(1, 1, 1, 1, -1)
        code = (t * 1_000_003 + kv * 104_729 + layer * 7_919 + h * 131 + d) % 65_521
        return (code.to(torch.float32) / 65_521.0).to(c.dtype).float()

    def fill_kv(self, indices: torch.Tensor, tokens: Sequence[int]) -> None:
        """Write the deterministic KV of ``tokens`` into device slots ``indices`` (a "forward pass")."""
        exp = self.expected_kv(tokens).to(self.kv_pool.k_buffer[0].device)
        for layer in range(self.cfg.layers):
            self.kv_pool.k_buffer[layer][indices] = exp[0, layer].to(self.cfg.dtype)
            self.kv_pool.v_buffer[layer][indices] = exp[1, layer].to(self.cfg.dtype)

    def scribble_unreferenced(self, value: float = -7.0) -> int:
        """Overwrite every device slot no tree node references, as other requests reusing freed
        memory would. Without this a freed-and-reallocated slot may still hold the old bytes by
        luck, and a premature read would go unnoticed. Returns the number of slots written."""
        used = torch.zeros(self.kv_pool.size + self.cfg.page_size, dtype=torch.bool)
        used[0] = True  # padding slot
        for n in self.iter_nodes():
            if n is not self.tree.root_node and n.value is not None:
                used[n.value.cpu()] = True
        free = (~used).nonzero().flatten().to(self.kv_pool.k_buffer[0].device)
        for layer in range(self.cfg.layers):
            self.kv_pool.k_buffer[layer][free] = value
            self.kv_pool.v_buffer[layer][free] = value
        return int(free.numel())

    def device_kv(self, indices: torch.Tensor) -> torch.Tensor:
        """The KV bytes of ``indices`` across all layers, K then V: ``[2, layers, n, heads, dim]``."""
        k = torch.stack([self.kv_pool.k_buffer[i][indices] for i in range(self.cfg.layers)])
        v = torch.stack([self.kv_pool.v_buffer[i][indices] for i in range(self.cfg.layers)])
        return torch.stack([k, v]).cpu()

    def host_kv(self, host_indices: torch.Tensor) -> torch.Tensor:
        """The host pool's bytes for ``host_indices`` in the same ``[2, layers, n, heads, dim]`` shape."""
        hp = self.host_pool
        assert hp is not None, "no host pool on a plain RadixCache"
        out = torch.empty((2, self.cfg.layers, len(host_indices), self.cfg.heads, self.cfg.head_dim))
        for kv, buf in enumerate((hp.k_buffer, hp.v_buffer)):
            for layer in range(self.cfg.layers):
                if hp.layout == "layer_first":
                    out[kv, layer] = buf[layer][host_indices].float()
                else:  # page_first_direct: [page, layer, page_size, heads, dim]
                    ps = self.cfg.page_size
                    for j, h in enumerate(host_indices.tolist()):
                        out[kv, layer, j] = buf[h // ps, layer, h % ps].float()
        return out

    # ---- tree operations (thin wrappers that keep sglang's calling conventions) -----------------
    def insert(self, tokens: Sequence[int], value: torch.Tensor, extra_key: str | None = None) -> int:
        """Insert like ``cache_finished_req`` does; returns the length already present (duplicates
        are freed by the caller in sglang, and here)."""
        from sglang.srt.mem_cache.base_prefix_cache import InsertParams

        res = self.tree.insert(InsertParams(key=rkey(tokens, extra_key), value=value))
        prefix_len = res.prefix_len if hasattr(res, "prefix_len") else int(res)
        if prefix_len:
            self.allocator.free(value[:prefix_len])
        return int(prefix_len)

    def run_request(
        self, tokens: Sequence[int], extra_key: str | None = None, *, deterministic: bool = False
    ) -> bool:
        """One request's KV lifecycle as the scheduler runs it: match the cached prefix and lock it,
        allocate (evicting if needed) and compute the rest, then ``cache_finished_req``-style
        insert, free the duplicates, unlock. Returns False when there is no memory for it now.

        The computed KV is random unless ``deterministic``: then it is :meth:`expected_kv` of the
        tokens, as a model's would be, so that a prefix evicted and computed again by another
        request has the bytes it had before (what a restore that compares bytes needs)."""
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        ps = self.cfg.page_size
        n = len(tokens) // ps * ps
        tokens = list(tokens[:n])
        m = self.match(tokens, extra_key)
        prefix = m.device_indices
        last = m.last_device_node
        self.tree.inc_lock_ref(last)
        try:
            need = n - len(prefix)
            new = self.alloc(need) if need else prefix[:0]
            if new is None:
                self.tree.evict(EvictParams(num_tokens=need))
                new = self.alloc(need)
            if new is None:
                return False
            if deterministic and need:
                self.fill_kv(new, tokens[len(prefix) :])
            from sglang.srt.mem_cache.base_prefix_cache import InsertParams

            value = torch.cat([prefix, new.to(prefix.device)])
            res = self.tree.insert(InsertParams(key=rkey(tokens, extra_key), value=value))
            prefix_len = int(res.prefix_len if hasattr(res, "prefix_len") else res)
            if prefix_len > len(prefix):
                self.allocator.free(value[len(prefix) : prefix_len])
            return True
        finally:
            self.tree.dec_lock_ref(last)

    def match(self, tokens: Sequence[int], extra_key: str | None = None) -> Any:
        from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams

        return self.tree.match_prefix(MatchPrefixParams(key=rkey(tokens, extra_key)))

    def evict_device(self, n_tokens: int) -> int:
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        res = self.tree.evict(EvictParams(num_tokens=n_tokens))
        return int(getattr(res, "num_tokens_evicted", 0) or 0)

    def evict_host(self, n_tokens: int) -> None:
        assert self.is_hi, "host eviction exists only on HiRadixCache"
        self.tree.evict_host(n_tokens)

    def check_events(self) -> None:
        """What the scheduler does every iteration: process whatever acks are ready."""
        if self.is_hi:
            self.tree.writing_check()
            self.tree.loading_check()

    # ---- controllable transfers (CPU double only) -------------------------------------------------
    def _stream(self, which: str) -> Any:
        ctrl = self.tree.cache_controller
        return ctrl.write_stream if which == "write" else ctrl.load_stream

    def pending(self, which: Literal["write", "load"]) -> int:
        """How many acknowledgements of this kind are queued but not yet complete."""
        ctrl = self.tree.cache_controller
        q = ctrl.ack_write_queue if which == "write" else ctrl.ack_load_queue
        return sum(1 for ack in q if not ack.finish_event.query())

    def complete(self, which: Literal["write", "load"], n: int | None = None) -> int:
        """Let the copy engine finish the oldest ``n`` (default: all) transfers of one kind."""
        assert self.engine is not None, "transfers complete on their own on a real GPU"
        ctrl = self.tree.cache_controller
        q = ctrl.ack_write_queue if which == "write" else ctrl.ack_load_queue
        todo = [a for a in q if not a.finish_event.query()]
        if n is not None:
            todo = todo[:n]
        moved = 0
        for ack in todo:
            ack.finish_event.synchronize()
            moved += 1
        return moved

    def drain(self) -> None:
        """Let every copy finish, process the acks, then evict every device and host copy: with no
        session holding anything, every ``Accounting`` counter must be back at its initial value."""
        self.synchronize()
        self.check_events()
        self.evict_device(10**9)
        if self.is_hi:
            self.check_events()
            self.evict_host(10**9)

    def synchronize(self) -> None:
        """Wait for every transfer (real GPU) or finish them all (CPU double)."""
        if self.engine is not None:
            self.engine.complete_all()
        elif self.cfg.device.startswith("cuda"):
            torch.cuda.synchronize()

    # ---- accounting ---------------------------------------------------------------------------------
    def iter_nodes(self) -> Iterator[Any]:
        stack = [self.tree.root_node]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def accounting(self) -> Accounting:
        root = self.tree.root_node
        locks = tuple(sorted((n.id, n.lock_ref) for n in self.iter_nodes() if n is not root and n.lock_ref))
        hrefs = tuple(sorted((n.id, n.host_ref_counter) for n in self.iter_nodes() if n.host_ref_counter))
        hi = self.is_hi
        return Accounting(
            device_free=int(self.allocator.available_size()),
            host_free=int(self.host_pool.available_size()) if hi else 0,
            evictable=int(self.tree.evictable_size()),
            protected=int(self.tree.protected_size()),
            lock_refs=locks,
            host_refs=hrefs,
            pending_writes=len(self.tree.ongoing_write_through) if hi else 0,
            pending_loads=len(self.tree.ongoing_load_back) if hi else 0,
        )

    def tree_token_counts(self) -> tuple[int, int]:
        """(tokens on device, tokens on host) summed over the tree, for cross-checking sglang's counters."""
        dev = host = 0
        for n in self.iter_nodes():
            if n is self.tree.root_node:
                continue
            if n.value is not None:
                dev += len(n.value)
            if getattr(n, "host_value", None) is not None:
                host += len(n.host_value)
        return dev, host


@functools.cache
def cuda_available() -> bool:
    return bool(torch.cuda.is_available())
