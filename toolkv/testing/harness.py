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
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch

from toolkv.testing.base import (
    WRITE_POLICIES,
    Accounting,
    TreeHarness,
    UnpinnedHostPool,
    check_stack_shape,
    copy_primitive_doubles,
    cuda_available,
    ensure_process_group,
    rkey,
)
from toolkv.testing.transfer import ControlledDeviceModule, ControlledTransferEngine

CacheKind = Literal["hiradix", "radix"]


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
        check_stack_shape(self.write_policy, self.device_tokens, self.page_size)


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


_UnpinnedHostPool = UnpinnedHostPool  # the name decode and storage harnesses knew


@contextlib.contextmanager
def cpu_doubles(engine: ControlledTransferEngine) -> Iterator[None]:
    """Install the three CPU test doubles into sglang's modules; restore on exit."""
    import sglang.srt.managers.cache_controller as cc
    import sglang.srt.mem_cache.hiradix_cache as hr

    saved_dm = cc.device_module
    saved_get = hr.get_mha_host_pool_cls
    cc.device_module = ControlledDeviceModule(engine)
    hr.get_mha_host_pool_cls = lambda device_pool: UnpinnedHostPool(saved_get(device_pool))
    try:
        with copy_primitive_doubles(engine):
            yield
    finally:
        cc.device_module = saved_dm
        hr.get_mha_host_pool_cls = saved_get


class CacheHarness(TreeHarness):
    """One real cache stack plus helpers to fill, inspect and drive it.

    Exactly one CPU harness may be live per process, because the CPU doubles are installed into
    sglang's module globals for its lifetime. Call :meth:`close` (or use it as a context manager).
    The KV oracle and the accounting are :class:`~toolkv.testing.base.TreeHarness`'s; what is
    0.5.16's is below: how the stack is built, and that a node's facts are its own attributes.
    """

    _live_cpu: ClassVar[TreeHarness | None] = None
    _live_label: ClassVar[str] = "CPU CacheHarness"
    cfg: HarnessConfig

    def __init__(self, cfg: HarnessConfig | None = None, *, seed: int = 0) -> None:
        super().__init__(cfg or HarnessConfig(), seed=seed)

    def _cpu_doubles(self, engine: ControlledTransferEngine) -> contextlib.AbstractContextManager[None]:
        return cpu_doubles(engine)

    def _build(self) -> None:
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams

        cfg = self.cfg
        group = ensure_process_group()
        self.server_args = make_server_args(cfg)
        self._build_pools(cfg.device)
        params = CacheInitParams(
            disable=False,
            req_to_token_pool=self.req_pool,
            token_to_kv_pool_allocator=self.allocator,
            page_size=cfg.page_size,
            tp_cache_group=group,
        )
        if cfg.kind == "hiradix":
            from sglang.srt.mem_cache.hiradix_cache import HiRadixCache

            self.tree = HiRadixCache(params, self.server_args)
            self.host_pool = self.tree.token_to_kv_pool_host
        else:
            from sglang.srt.mem_cache.radix_cache import RadixCache

            self.tree = RadixCache(params)
            self.host_pool = None

    def _release_host(self) -> None:
        # sglang never unregisters its pinned host buffer; a second host pool in the same process
        # then fails with cudaHostRegister rc=712. Unregister ours (idempotent).
        if self.cfg.device.startswith("cuda") and self.host_pool is not None:
            self.host_pool.destroy()

    def __enter__(self) -> CacheHarness:
        return self

    @property
    def is_hi(self) -> bool:
        return self.cfg.kind == "hiradix"

    # ---- node facts: attributes of 0.5.16's TreeNode ---------------------------------------------
    def _device_value(self, node: Any) -> torch.Tensor | None:
        value: torch.Tensor | None = node.value
        return value

    def _host_value(self, node: Any) -> torch.Tensor | None:
        value: torch.Tensor | None = getattr(node, "host_value", None)
        return value

    def _lock_ref(self, node: Any) -> int:
        return int(node.lock_ref)

    def _host_ref(self, node: Any) -> int:
        return int(node.host_ref_counter)

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

    def evict_host(self, n_tokens: int) -> None:
        assert self.is_hi, "host eviction exists only on HiRadixCache"
        self.tree.evict_host(n_tokens)

    def check_events(self) -> None:
        """What the scheduler does every iteration: process whatever acks are ready."""
        if self.is_hi:
            self.tree.writing_check()
            self.tree.loading_check()


__all__ = [
    "WRITE_POLICIES",
    "Accounting",
    "CacheHarness",
    "CacheKind",
    "HarnessConfig",
    "cpu_doubles",
    "cuda_available",
    "ensure_process_group",
    "make_server_args",
    "rkey",
]
