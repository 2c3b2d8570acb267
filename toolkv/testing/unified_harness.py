"""Build the REAL sglang 0.5.23 cache stack — ``UnifiedRadixCache`` with HiCache — for tests.

sglang 0.5.21 removed ``HiRadixCache``; from then on the hierarchical cache is a
``UnifiedRadixCache`` (``mem_cache/unified_radix_cache.py``) whose tree lives in a *tree core*
(Python ``UnifiedTreeCore`` or the bundled Rust core, chosen by
``SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND``) and whose host tier is attached by
``init_hicache`` (``HostPoolGroup`` + ``HybridCacheController``). This module builds that stack the
way sglang's ``create_unified_radix_cache`` does, with the same three named CPU test doubles as
:mod:`toolkv.testing.harness` (see ``docs/testing.md``):

1. pinned host memory → the same host-pool class, constructed with ``pin_memory=False``
   (wrapping ``hybrid_pool_assembler.get_mha_host_pool_cls``);
2. sgl-kernel's three direct copy primitives → :mod:`toolkv.testing.transfer`'s torch versions;
3. the GPU copy engine → :class:`~toolkv.testing.transfer.ControlledTransferEngine`. In 0.5.23
   streams and events come from two module globals: ``managers/cache_controller.device_module``
   (the layer-done ring's events) and ``mem_cache/l2_transfer.device_module`` (the D2H/H2D
   streams and ack events); both are replaced.

Everything else is sglang's code: pools, allocators, the tree core, the controller, write-through
on insert, ``load_back``, ``check_hicache_events`` and its ack retirement.

Node facts live in ``component_data[ComponentType.FULL]`` of a ``UnifiedTreeNode`` (Python core);
:func:`full` and the ``node_*`` helpers read them. With ``tree_core="rust"`` nodes are opaque
handles: the harness still builds and drives the stack, but nothing that needs node objects
(toolkv's manager, the KV checks here) works on it.
"""

from __future__ import annotations

import atexit
import contextlib
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

TreeCoreName = Literal["python", "rust"]
WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")


def sglang_version() -> str:
    """The installed sglang version (without importing its heavy modules)."""
    from importlib.metadata import version

    return version("sglang")


MIN_UNIFIED_VERSION = "0.5.21"  # HiRadixCache gone; --enable-hierarchical-cache builds UnifiedRadixCache


def has_unified_radix_cache() -> bool:
    """True when the installed sglang builds its hierarchical cache as the handle-based
    ``UnifiedRadixCache`` this harness and the ``unified`` backend drive (0.5.21 and later; the
    class of the same name in older releases has another API)."""
    from packaging.version import Version

    return Version(sglang_version()) >= Version(MIN_UNIFIED_VERSION)


@dataclass(frozen=True)
class UnifiedHarnessConfig:
    """Shape of one stack. Defaults are tiny so that many stacks fit in one process."""

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
    tree_core: TreeCoreName = "python"
    hicache: bool = True  # False: the plain (device-only) UnifiedRadixCache sglang builds without HiCache

    def __post_init__(self) -> None:
        if self.write_policy not in WRITE_POLICIES:
            raise ValueError(f"write_policy must be one of {WRITE_POLICIES}, got {self.write_policy!r}")
        if self.device_tokens % self.page_size:
            raise ValueError("device_tokens must be a multiple of page_size")
        if self.tree_core not in ("python", "rust"):
            raise ValueError(f"tree_core must be 'python' or 'rust', got {self.tree_core!r}")


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


def make_server_args(cfg: UnifiedHarnessConfig) -> Any:
    """A real ``ServerArgs`` for a dummy model (no model is resolved), published as the process's
    config the way the scheduler publishes it (0.5.23 reads HiCache options through
    ``runtime_context.get_memory()``, not through the ``ServerArgs`` argument)."""
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    args = ServerArgs(
        model_path="dummy",
        page_size=cfg.page_size,
        enable_hierarchical_cache=cfg.hicache,
        hicache_ratio=cfg.host_ratio,
        hicache_write_policy=cfg.write_policy,
        hicache_io_backend=cfg.io_backend,
        hicache_mem_layout=cfg.layout,
    )
    set_global_server_args_for_scheduler(args)
    return args


class _UnpinnedHostPool:
    """TEST DOUBLE factory: the real host-pool class, constructed with ``pin_memory=False``."""

    def __init__(self, cls: type) -> None:
        self.cls = cls

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        kwargs["pin_memory"] = False
        return self.cls(*args, **kwargs)


@contextlib.contextmanager
def unified_cpu_doubles(engine: ControlledTransferEngine) -> Iterator[None]:
    """Install the three CPU test doubles into sglang 0.5.23's modules; restore on exit."""
    import sglang.srt.managers.cache_controller as cc
    import sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler as hpa
    import sglang.srt.mem_cache.l2_transfer as l2
    import sglang.srt.mem_cache.pool_host.mha as mha

    saved = {"cc": cc.device_module, "l2": l2.device_module, "get": hpa.get_mha_host_pool_cls}
    prims = {
        "transfer_kv_direct": make_transfer_kv_direct(engine),
        "transfer_kv_all_layer_direct_lf_pf": make_transfer_kv_all_layer_direct_lf_pf(engine),
        "transfer_kv_per_layer_direct_pf_lf": make_transfer_kv_per_layer_direct_pf_lf(engine),
    }
    saved_prims = {name: getattr(mha, name, None) for name in prims}
    module = ControlledDeviceModule(engine)
    get = saved["get"]
    cc.device_module = module
    l2.device_module = module
    hpa.get_mha_host_pool_cls = lambda info: _UnpinnedHostPool(get(info))
    for name, fn in prims.items():
        setattr(mha, name, fn)
    try:
        yield
    finally:
        cc.device_module = saved["cc"]
        l2.device_module = saved["l2"]
        hpa.get_mha_host_pool_cls = saved["get"]
        for name, old in saved_prims.items():
            if old is None:
                delattr(mha, name)
            else:
                setattr(mha, name, old)


def full(node: Any) -> Any:
    """The FULL component's data of a ``UnifiedTreeNode``: ``value`` (device indices or None),
    ``host_value``, ``lock_ref``, ``host_lock_ref``."""
    from sglang.srt.mem_cache.unified_cache.components import ComponentType

    return node.component_data[ComponentType.FULL]


def rkey(tokens: Sequence[int], extra_key: str | None = None) -> Any:
    """A ``RadixKey`` over ``array('q')`` token ids (sglang requires the typed array)."""
    from sglang.srt.mem_cache.radix_cache import RadixKey

    return RadixKey(array("q", tokens), extra_key)


@dataclass(frozen=True)
class UnifiedAccounting:
    """Every counter a correct manager must return to its initial value."""

    device_free: int
    host_free: int
    evictable: int
    protected: int
    lock_refs: tuple[tuple[int, int], ...]  # (node id, lock_ref) for nodes with lock_ref != 0, root excluded
    host_refs: tuple[tuple[int, int], ...]  # (node id, host_lock_ref) for nodes with a nonzero count
    pending_writes: int
    pending_loads: int
    queued_loads: int  # load_back'ed but not started (cache_controller.load_queue)


class UnifiedCacheHarness:
    """One real 0.5.23 stack plus helpers to fill, inspect and drive it (the same surface as
    :class:`toolkv.testing.harness.CacheHarness` where the two versions agree).

    Exactly one CPU harness may be live per process: the doubles live in sglang's module globals
    for its lifetime. Call :meth:`close` (or use it as a context manager).
    """

    _live_cpu: UnifiedCacheHarness | None = None

    def __init__(self, cfg: UnifiedHarnessConfig | None = None, *, seed: int = 0) -> None:
        self.cfg = cfg = cfg or UnifiedHarnessConfig()
        self.rng = torch.Generator().manual_seed(seed)
        self.engine: ControlledTransferEngine | None = None
        self._doubles: contextlib.ExitStack | None = None
        self.tree: Any = None
        self.host_pool: Any = None
        if cfg.device == "cpu":
            if UnifiedCacheHarness._live_cpu is not None:
                raise RuntimeError(
                    "one CPU UnifiedCacheHarness at a time per process: close() the previous one"
                )
            self.engine = ControlledTransferEngine()
            self._doubles = contextlib.ExitStack()
            self._doubles.enter_context(unified_cpu_doubles(self.engine))
            UnifiedCacheHarness._live_cpu = self
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
        from sglang.srt.mem_cache.unified_cache.components import ComponentType
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

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
        )
        if cfg.page_size == 1:
            self.allocator: Any = TokenToKVPoolAllocator(
                size=cfg.device_tokens,
                dtype=cfg.dtype,
                device=cfg.device,
                kvcache=self.kv_pool,
                need_sort=False,
            )
        else:
            self.allocator = PagedTokenToKVPoolAllocator(
                size=cfg.device_tokens,
                page_size=cfg.page_size,
                dtype=cfg.dtype,
                device=cfg.device,
                kvcache=self.kv_pool,
                need_sort=False,
            )
        self.req_pool = ReqToTokenPool(
            size=cfg.max_reqs, max_context_len=cfg.context_len, device=cfg.device, enable_memory_saver=False
        )
        self.params = CacheInitParams(
            req_to_token_pool=self.req_pool,
            token_to_kv_pool_allocator=self.allocator,
            page_size=cfg.page_size,
            disable=False,
            tree_components=(ComponentType.FULL,),
            tp_cache_group=group,
            tree_core_backend=cfg.tree_core,
        )
        # What registry.create_unified_radix_cache does for a plain MHA model.
        self.tree = UnifiedRadixCache(params=self.params)
        if self.tree._tree_core_backend != cfg.tree_core:
            raise RuntimeError(
                f"sglang chose the {self.tree._tree_core_backend!r} tree core, not {cfg.tree_core!r}"
            )
        if cfg.hicache:
            self.tree.init_hicache(self.server_args, self.params)
            # Every UnifiedRadixCache with HiCache registers its shutdown at exit, which keeps
            # the host buffer alive; the harness releases it in close() instead.
            atexit.unregister(self.tree.shutdown)
            self.host_pool = self.tree.cache_controller.mem_pool_host.anchor_entry.host_pool

    # ---- lifecycle --------------------------------------------------------------------------------
    def close(self) -> None:
        tree = self.tree
        if tree is not None and tree.cache_controller is not None:
            tree.release_host_resources()  # unregisters a pinned host buffer on a GPU
            self.tree = None
        if self._doubles is not None:
            self._doubles.close()
            self._doubles = None
        if UnifiedCacheHarness._live_cpu is self:
            UnifiedCacheHarness._live_cpu = None

    def __enter__(self) -> UnifiedCacheHarness:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def is_hi(self) -> bool:
        return self.cfg.hicache

    @property
    def controller(self) -> Any:
        return self.tree.cache_controller

    # ---- node facts (Python tree core) --------------------------------------------------------------
    def node(self, node_id: int) -> Any:
        """The ``UnifiedTreeNode`` behind a handle (Python tree core only)."""
        return self.tree.tree_core.node_by_id(node_id)

    def iter_nodes(self) -> Iterator[Any]:
        stack = [self.tree.root_node]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

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
                buf[idx] = torch.randn(shape, generator=self.rng).to(buf.dtype).to(buf.device)
        return idx

    def expected_kv(self, tokens: Sequence[int]) -> torch.Tensor:
        """Deterministic KV of ``tokens`` in the ``device_kv`` layout ``[2, layers, n, heads, dim]``
        (a function of the token id: the workloads use a unique id per prefix position)."""
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
        memory would, so that a premature read cannot see the right bytes by luck."""
        used = torch.zeros(self.kv_pool.size + self.cfg.page_size, dtype=torch.bool)
        used[0] = True  # padding slot
        for n in self.iter_nodes():
            v = full(n).value
            if n is not self.tree.root_node and v is not None:
                used[v.cpu()] = True
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
        assert hp is not None, "no host pool without HiCache"
        c = self.cfg
        out = torch.empty((2, c.layers, len(host_indices), c.heads, c.head_dim))
        for kv, buf in enumerate((hp.k_buffer, hp.v_buffer)):
            for layer in range(c.layers):
                if hp.layout == "layer_first":
                    out[kv, layer] = buf[layer][host_indices].float()
                else:  # page_first_direct: [page, layer, page_size, heads, dim]
                    for j, h in enumerate(host_indices.tolist()):
                        out[kv, layer, j] = buf[h // c.page_size, layer, h % c.page_size].float()
        return out

    # ---- tree operations in sglang's calling conventions -----------------------------------------------
    def insert(self, tokens: Sequence[int], value: torch.Tensor, extra_key: str | None = None) -> int:
        """Insert a freshly computed ``value`` like ``cache_finished_req``. In 0.5.23 the insert
        itself frees the slots of the part already in the tree (``FreeDeviceKV`` from
        ``prev_prefix_len`` on), so nothing is freed here. Returns that part's length."""
        from sglang.srt.mem_cache.base_prefix_cache import InsertParams

        res = self.tree.insert(InsertParams(key=rkey(tokens, extra_key), value=value))
        return int(res.prefix_len)

    def match(self, tokens: Sequence[int], extra_key: str | None = None) -> Any:
        from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams

        return self.tree.match_prefix(MatchPrefixParams(key=rkey(tokens, extra_key)))

    def run_request(self, tokens: Sequence[int], extra_key: str | None = None) -> bool:
        """One request's KV lifecycle: match and lock the cached prefix, allocate (evicting if
        needed) and compute the rest, insert, free duplicates, unlock. False: no memory now."""
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams

        ps = self.cfg.page_size
        n = len(tokens) // ps * ps
        tokens = list(tokens[:n])
        m = self.match(tokens, extra_key)
        prefix = self.tree.path_device_indices(m.last_device_node)[: m.device_prefix_len]
        lock = self.tree.lock(m.last_device_node)
        try:
            need = n - len(prefix)
            new = self.alloc(need) if need else prefix[:0]
            if new is None:
                self.tree.evict(EvictParams(num_tokens=need))
                new = self.alloc(need)
            if new is None:
                return False
            value = torch.cat([prefix, new.to(prefix.device)])
            # prev_prefix_len: the matched prefix is the tree's own; the tree frees duplicates after it
            self.tree.insert(
                InsertParams(key=rkey(tokens, extra_key), value=value, prev_prefix_len=len(prefix))
            )
            return True
        finally:
            self.tree.unlock(lock)

    def evict_device(self, n_tokens: int) -> int:
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        return int(self.tree.evict(EvictParams(num_tokens=n_tokens)).num_tokens_evicted)

    def evict_host(self, n_tokens: int) -> int:
        assert self.is_hi, "host eviction needs HiCache"
        return int(self.tree.evict_host(n_tokens))

    def check_events(self) -> None:
        """What the scheduler does every iteration: submit queued writes, retire finished acks."""
        if self.is_hi:
            self.tree.check_hicache_events()

    # ---- controllable transfers (CPU double only) ---------------------------------------------------
    def pending(self, which: Literal["write", "load"]) -> int:
        """How many acknowledgements of this kind are queued but not yet complete."""
        q = self.controller.ack_write_queue if which == "write" else self.controller.ack_load_queue
        return sum(1 for ack in q if not ack.finish_event.query())

    def complete(self, which: Literal["write", "load"], n: int | None = None) -> int:
        """Let the copy engine finish the oldest ``n`` (default: all) submitted transfers of one kind."""
        assert self.engine is not None, "transfers complete on their own on a real GPU"
        q = self.controller.ack_write_queue if which == "write" else self.controller.ack_load_queue
        todo = [a for a in q if not a.finish_event.query()]
        if n is not None:
            todo = todo[:n]
        for ack in todo:
            ack.finish_event.synchronize()
        return len(todo)

    def synchronize(self) -> None:
        """Wait for every transfer (real GPU) or finish them all (CPU double)."""
        if self.engine is not None:
            self.engine.complete_all()
        elif self.cfg.device.startswith("cuda"):
            torch.cuda.synchronize()

    def drain(self) -> None:
        """Submit and finish every copy, retire the acks, then evict every device and host copy:
        with nothing held, every :class:`UnifiedAccounting` counter is back at its initial value."""
        if self.is_hi:
            self.tree.flush_pending_backups()
            if self.controller.load_queue:
                self.tree.ready_to_load_host_cache()
        self.synchronize()
        self.check_events()
        self.evict_device(10**9)
        if self.is_hi:
            self.check_events()
            self.evict_host(10**9)

    # ---- accounting ---------------------------------------------------------------------------------
    def accounting(self) -> UnifiedAccounting:
        root = self.tree.root_node
        nodes = [n for n in self.iter_nodes() if n is not root]
        hi = self.is_hi
        return UnifiedAccounting(
            device_free=int(self.allocator.available_size()),
            host_free=int(self.host_pool.available_size()) if hi else 0,
            evictable=int(self.tree.evictable_size()),
            protected=int(self.tree.protected_size()),
            lock_refs=tuple(sorted((n.id, full(n).lock_ref) for n in nodes if full(n).lock_ref)),
            host_refs=tuple(sorted((n.id, full(n).host_lock_ref) for n in nodes if full(n).host_lock_ref)),
            pending_writes=len(self.tree.ongoing_write_through),
            pending_loads=len(self.tree.ongoing_load_back),
            queued_loads=len(self.controller.load_queue) if hi else 0,
        )

    def tree_token_counts(self) -> tuple[int, int]:
        """(tokens on device, tokens on host) summed over the tree."""
        dev = host = 0
        for n in self.iter_nodes():
            if n is self.tree.root_node:
                continue
            d = full(n)
            dev += len(d.value) if d.value is not None else 0
            host += len(d.host_value) if d.host_value is not None else 0
        return dev, host
