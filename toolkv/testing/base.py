"""What every CPU harness shares, whatever sglang release it builds: the KV oracle and the accounting.

The three harnesses (:mod:`toolkv.testing.harness` for 0.5.16's ``HiRadixCache`` / ``RadixCache``,
:mod:`toolkv.testing.unified_harness` for 0.5.23's ``UnifiedRadixCache``,
:mod:`research.decode_offload.harness` for 0.5.16's decode-side offload) build different sglang
objects, but they answer the same two questions, and a test is only as good as those answers:

* **the KV oracle** — what bytes each token's KV must have (:func:`model_kv`, a function of the
  token id standing in for the model), and what bytes the device and host pools hold now
  (:meth:`PoolHarness.device_kv`, :meth:`PoolHarness.host_kv`), so that a restore can be checked
  byte for byte against what was offloaded and a read of a freed or not yet loaded slot is caught;
* **the accounting** — every counter a correct manager returns to its initial value once nothing
  is held (:class:`Accounting`, :meth:`TreeHarness.accounting`): free device and host slots,
  evictable and protected sizes, every node's lock and host reference, the writes and loads in
  flight.

Kept once here so that the oracle cannot drift between releases: a check that is stricter on one
release than on the other would let a leak through on the lenient one. The subclasses say only
where the releases differ, as small overrides in the style of sglang's own cache classes (a
derived flag such as :attr:`TreeHarness.is_hi`, a node-fact reader such as
:meth:`TreeHarness._lock_ref`); the base raises on the states it cannot account for (a host layout
it does not know, a second live harness) instead of returning a number that looks right.

May import nothing of toolkv but :mod:`toolkv.testing.transfer`.
"""

from __future__ import annotations

import contextlib
import functools
import os
from abc import ABC, abstractmethod
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch

from toolkv.testing.transfer import (
    ControlledTransferEngine,
    make_transfer_kv_all_layer_direct_lf_pf,
    make_transfer_kv_direct,
    make_transfer_kv_per_layer_direct_pf_lf,
)

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")

Copy = Literal["write", "load"]


# ---- one process, one sglang -----------------------------------------------------------------------
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


def rkey(tokens: Sequence[int], extra_key: str | None = None) -> Any:
    """A ``RadixKey`` over ``array('q')`` token ids (sglang requires the typed array)."""
    from sglang.srt.mem_cache.radix_cache import RadixKey

    return RadixKey(array("q", tokens), extra_key)


def check_stack_shape(write_policy: str, device_tokens: int, page_size: int) -> None:
    """The shape checks both radix-cache configs make: sglang would accept these values and fail
    later, far from the mistake (an unknown write policy, a pool that is not whole pages)."""
    if write_policy not in WRITE_POLICIES:
        raise ValueError(f"write_policy must be one of {WRITE_POLICIES}, got {write_policy!r}")
    if device_tokens % page_size:
        raise ValueError("device_tokens must be a multiple of page_size")


@functools.cache
def cuda_available() -> bool:
    """Whether a GPU is there (asked once: CUDA initialisation is slow)."""
    return bool(torch.cuda.is_available())


# ---- the CPU test doubles both releases share -------------------------------------------------------
class UnpinnedHostPool:
    """TEST DOUBLE factory: the real host-pool class, constructed with ``pin_memory=False``
    (``cudaHostRegister`` needs CUDA)."""

    def __init__(self, cls: type) -> None:
        self.cls = cls

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        kwargs["pin_memory"] = False
        return self.cls(*args, **kwargs)


@contextlib.contextmanager
def copy_primitive_doubles(engine: ControlledTransferEngine) -> Iterator[None]:
    """Replace sgl-kernel's three direct copy primitives in ``pool_host.mha`` (the same module in
    both releases) by :mod:`toolkv.testing.transfer`'s torch versions on ``engine``; put back on exit
    what was there before (nothing, on a machine without sgl-kernel)."""
    import sglang.srt.mem_cache.pool_host.mha as mha

    prims = {
        "transfer_kv_direct": make_transfer_kv_direct(engine),
        "transfer_kv_all_layer_direct_lf_pf": make_transfer_kv_all_layer_direct_lf_pf(engine),
        "transfer_kv_per_layer_direct_pf_lf": make_transfer_kv_per_layer_direct_pf_lf(engine),
    }
    saved_prims = {name: getattr(mha, name, None) for name in prims}
    for name, fn in prims.items():
        setattr(mha, name, fn)
    try:
        yield
    finally:
        for name, old in saved_prims.items():
            if old is None:
                delattr(mha, name)
            else:
                setattr(mha, name, old)


# ---- the KV oracle ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class KVCode:
    """The coefficients of :func:`model_kv`'s code: ``(token * token + kv * kv + layer * layer +
    head * head + dim * dim) % modulus``, scaled into ``[0, 1)``. Two sets exist so that the prefix
    harnesses and the decode harness keep the bytes they have always had."""

    token: int
    kv: int
    layer: int
    head: int
    dim: int
    modulus: int


#: the radix-cache harnesses' code (``CacheHarness.expected_kv``, ``UnifiedCacheHarness.expected_kv``)
PREFIX_CODE = KVCode(token=1_000_003, kv=104_729, layer=7_919, head=131, dim=1, modulus=65_521)
#: the decode harness's code (``research.decode_offload.harness.token_kv``, outside the package)
DECODE_CODE = KVCode(token=7_368_787, kv=6_700_417, layer=1_009, head=97, dim=13, modulus=104_729)


def model_kv(tokens: Sequence[int], layers: int, heads: int, head_dim: int, code: KVCode) -> torch.Tensor:
    """The KV a model computes for ``tokens``, as ``[2, layers, n, heads, head_dim]`` float32.

    Stands in for the model: a function of the token id only (the workloads use ids unique per
    prefix position), so the same token always has the same bytes, a recomputation writes identical
    bytes, and a byte that differs was lost, copied from the wrong slot or read before its load."""
    t = torch.tensor(list(tokens), dtype=torch.int64).view(1, 1, -1, 1, 1)
    kv = torch.arange(2).view(2, 1, 1, 1, 1)
    layer = torch.arange(layers).view(1, -1, 1, 1, 1)
    h = torch.arange(heads).view(1, 1, 1, -1, 1)
    d = torch.arange(head_dim).view(1, 1, 1, 1, -1)
    c = code
    value = (t * c.token + kv * c.kv + layer * c.layer + h * c.head + d * c.dim) % c.modulus
    return value.to(torch.float32) / float(c.modulus)


class PoolHarness(ABC):
    """What every harness is: one real device KV pool and host pool read back as bytes, the copy
    engine test double, and the rule of one live harness per process.

    The rule exists because the CPU doubles are sglang module globals for the harness's lifetime:
    a second harness would install its doubles over the first one's and the first one's copies
    would land on the wrong engine. The class that declares ``_live_cpu`` owns the slot (its
    subclasses share it) and :attr:`_live_label` names it in the error."""

    _live_cpu: ClassVar[PoolHarness | None] = None
    _live_owner: ClassVar[type[PoolHarness]]
    #: how the error names the harness a process may hold one of
    _live_label: ClassVar[str] = "harness"
    #: extra ``MHATokenToKVPool`` arguments: 0.5.16's harnesses turn the alternate stream off, the
    #: 0.5.23 harness keeps sglang's default (it only exists on CUDA)
    _kv_pool_options: ClassVar[dict[str, Any]] = {"enable_alt_stream": False}

    cfg: Any  # the subclass's frozen config: page_size, device_tokens, layers, heads, head_dim, dtype, ...
    kv_pool: Any
    allocator: Any
    req_pool: Any
    host_pool: Any
    engine: ControlledTransferEngine | None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "_live_cpu" in cls.__dict__:
            cls._live_owner = cls

    def _claim_process(self) -> None:
        """Become the process's live harness; raises if another one is live (nothing is built yet)."""
        owner = self._live_owner
        if owner._live_cpu is not None:
            raise RuntimeError(f"one {self._live_label} at a time per process: close() the previous one")
        owner._live_cpu = self

    def _release_process(self) -> None:
        """Give the slot back (idempotent; a harness that never got it leaves it alone)."""
        owner = self._live_owner
        if owner._live_cpu is self:
            owner._live_cpu = None

    def _build_pools(self, device: str) -> None:
        """The real device KV pool, its allocator (paged when pages are longer than one token) and
        the request-to-token pool, sized by the config: the same constructors in both releases."""
        from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool

        cfg = self.cfg
        self.kv_pool = MHATokenToKVPool(
            size=cfg.device_tokens,
            page_size=cfg.page_size,
            dtype=cfg.dtype,
            head_num=cfg.heads,
            head_dim=cfg.head_dim,
            layer_num=cfg.layers,
            device=device,
            enable_memory_saver=False,
            **self._kv_pool_options,
        )
        sizes = {"size": cfg.device_tokens, "dtype": cfg.dtype, "device": device, "kvcache": self.kv_pool}
        if cfg.page_size == 1:
            self.allocator = TokenToKVPoolAllocator(**sizes, need_sort=False)
        else:
            self.allocator = PagedTokenToKVPoolAllocator(**sizes, page_size=cfg.page_size, need_sort=False)
        self.req_pool = ReqToTokenPool(
            size=cfg.max_reqs, max_context_len=cfg.context_len, device=device, enable_memory_saver=False
        )

    # ---- the bytes in the pools ----------------------------------------------------------------------
    def device_kv(self, indices: torch.Tensor) -> torch.Tensor:
        """The KV bytes of ``indices`` across all layers, K then V: ``[2, layers, n, heads, dim]``."""
        layers = range(self.cfg.layers)
        k = torch.stack([self.kv_pool.k_buffer[i][indices] for i in layers])
        v = torch.stack([self.kv_pool.v_buffer[i][indices] for i in layers])
        return torch.stack([k, v]).cpu()

    def host_kv(self, host_indices: torch.Tensor) -> torch.Tensor:
        """The host pool's bytes for ``host_indices`` in the same ``[2, layers, n, heads, dim]`` shape,
        float32, from either host layout sglang's direct io backend uses. Another layout raises:
        reading it with these strides would return bytes that look like KV and are not."""
        hp = self.host_pool
        if hp.layout not in ("layer_first", "page_first_direct"):
            raise NotImplementedError(f"host layout {hp.layout}")
        c = self.cfg
        out = torch.empty((2, c.layers, len(host_indices), c.heads, c.head_dim))
        for kv, buf in enumerate((hp.k_buffer, hp.v_buffer)):
            for layer in range(c.layers):
                if hp.layout == "layer_first":
                    out[kv, layer] = buf[layer][host_indices].float()
                else:  # page_first_direct: [page, layer, page_size, heads, dim]
                    ps = c.page_size
                    for j, h in enumerate(host_indices.tolist()):
                        out[kv, layer, j] = buf[h // ps, layer, h % ps].float()
        return out

    # ---- the copy engine -----------------------------------------------------------------------------
    @abstractmethod
    def _copy_controller(self) -> Any:
        """The ``HiCacheController`` whose ack queues this harness's copies land on."""

    def _unfinished(self, which: Copy) -> list[Any]:
        """Acks of this kind whose copy has not finished, oldest first."""
        ctrl = self._copy_controller()
        q = ctrl.ack_write_queue if which == "write" else ctrl.ack_load_queue
        return [ack for ack in q if not ack.finish_event.query()]

    def pending(self, which: Copy) -> int:
        """How many acknowledgements of this kind are queued but not yet complete."""
        return len(self._unfinished(which))

    def complete(self, which: Copy, n: int | None = None) -> int:
        """Let the copy engine finish the oldest ``n`` (default: all) transfers of one kind."""
        assert self.engine is not None, "transfers complete on their own on a real GPU"
        todo = self._unfinished(which)
        if n is not None:
            todo = todo[:n]
        for ack in todo:
            ack.finish_event.synchronize()
        return len(todo)


@dataclass(frozen=True)
class Accounting:
    """Every counter that a correct manager must return to its initial value."""

    device_free: int
    host_free: int
    evictable: int
    protected: int
    lock_refs: tuple[tuple[int, int], ...]  # (node id, lock_ref) for nodes with lock_ref != 0, root excluded
    host_refs: tuple[tuple[int, int], ...]  # (node id, host reference count) for nodes with a nonzero count
    pending_writes: int
    pending_loads: int


class TreeHarness(PoolHarness):
    """A radix-tree cache stack (0.5.16's ``HiRadixCache`` / ``RadixCache``, 0.5.23's
    ``UnifiedRadixCache``): the KV oracle over its tree and the accounting a test compares before
    and after.

    A subclass builds the stack (:meth:`_build`, :meth:`_cpu_doubles`), releases what sglang does
    not (:meth:`_release_host`), and says where its release keeps a node's facts
    (:meth:`_device_value`, :meth:`_host_value`, :meth:`_lock_ref`, :meth:`_host_ref`) and what the
    scheduler runs each iteration (:meth:`check_events`).
    """

    tree: Any

    def __init__(self, cfg: Any, *, seed: int = 0) -> None:
        self.cfg = cfg
        self.rng = torch.Generator().manual_seed(seed)
        self.engine = None
        self._doubles: contextlib.ExitStack | None = None
        self.tree = None
        self.host_pool = None
        if cfg.device == "cpu":
            self._claim_process()
        try:
            if cfg.device == "cpu":
                self.engine = ControlledTransferEngine()
                self._doubles = contextlib.ExitStack()
                self._doubles.enter_context(self._cpu_doubles(self.engine))
            self._build()
        except BaseException:
            self.close()
            raise

    # ---- what a release says ---------------------------------------------------------------------------
    @abstractmethod
    def _cpu_doubles(self, engine: ControlledTransferEngine) -> contextlib.AbstractContextManager[None]:
        """Install this release's CPU test doubles into sglang's module globals; restore on exit."""

    @abstractmethod
    def _build(self) -> None:
        """Build the real pools, allocator and tree (``kv_pool``, ``allocator``, ``tree``, ``host_pool``)."""

    def _release_host(self) -> None:
        """Release what sglang keeps past the tree's life (a pinned host buffer); idempotent."""

    @property
    @abstractmethod
    def is_hi(self) -> bool:
        """Whether the tree has a host tier (HiCache): without one there is no host pool, no host
        eviction, no copies in flight, and their counters are 0."""

    @abstractmethod
    def _device_value(self, node: Any) -> torch.Tensor | None:
        """The node's device slots, or None when its KV is not on the device."""

    @abstractmethod
    def _host_value(self, node: Any) -> torch.Tensor | None:
        """The node's host slots, or None when it has no host copy."""

    @abstractmethod
    def _lock_ref(self, node: Any) -> int:
        """The node's device lock count (requests and toolkv pins holding its KV on the device)."""

    @abstractmethod
    def _host_ref(self, node: Any) -> int:
        """The node's host reference count (protections holding its host copy), or 0 where the
        release does not account it on this node."""

    @abstractmethod
    def check_events(self) -> None:
        """What the scheduler does every iteration: process whatever acks are ready."""

    @abstractmethod
    def evict_host(self, n_tokens: int) -> Any:
        """Evict ``n_tokens`` of host copies as sglang's host eviction does."""

    def _submit_queued(self) -> None:
        """Hand sglang's queued but not yet submitted copies to the copy engine (a release that
        submits at once has none)."""

    # ---- lifecycle -------------------------------------------------------------------------------------
    def close(self) -> None:
        """Release the host buffer, take the doubles out of sglang's modules, free the process slot."""
        self._release_host()
        if self._doubles is not None:
            self._doubles.close()
            self._doubles = None
        self._release_process()

    def __enter__(self) -> TreeHarness:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _copy_controller(self) -> Any:
        return self.tree.cache_controller

    # ---- KV data ---------------------------------------------------------------------------------------
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
        """Deterministic KV of ``tokens`` in the ``device_kv`` layout ``[2, layers, n, heads, dim]``,
        rounded through the pool's dtype (what the pool can hold of it).

        A model computes the same KV for the same prefix; the harness stands in for the model with
        a function of the token id (tokens are unique per prefix position in the fuzz workloads), so
        a recomputation writes identical bytes and any byte that differs was lost or read early."""
        c = self.cfg
        return model_kv(tokens, c.layers, c.heads, c.head_dim, PREFIX_CODE).to(c.dtype).float()

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
        root = self.tree.root_node
        for n in self.iter_nodes():
            v = self._device_value(n)
            if n is not root and v is not None:
                used[v.cpu()] = True
        free = (~used).nonzero().flatten().to(self.kv_pool.k_buffer[0].device)
        for layer in range(self.cfg.layers):
            self.kv_pool.k_buffer[layer][free] = value
            self.kv_pool.v_buffer[layer][free] = value
        return int(free.numel())

    # ---- tree operations shared by both releases -------------------------------------------------------
    def match(self, tokens: Sequence[int], extra_key: str | None = None) -> Any:
        """sglang's ``match_prefix`` of ``tokens`` (its ``MatchResult``)."""
        from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams

        return self.tree.match_prefix(MatchPrefixParams(key=rkey(tokens, extra_key)))

    def evict_device(self, n_tokens: int) -> int:
        """sglang's device eviction of ``n_tokens`` (unlocked, least recently used first); returns
        how many it evicted."""
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        res = self.tree.evict(EvictParams(num_tokens=n_tokens))
        return int(getattr(res, "num_tokens_evicted", 0) or 0)

    def synchronize(self) -> None:
        """Wait for every transfer (real GPU) or finish them all (CPU double)."""
        if self.engine is not None:
            self.engine.complete_all()
        elif self.cfg.device.startswith("cuda"):
            torch.cuda.synchronize()

    def drain(self) -> None:
        """Submit and finish every copy, process the acks, then evict every device and host copy:
        with no session holding anything, every :class:`Accounting` counter must be back at its
        initial value."""
        self._submit_queued()
        self.synchronize()
        self.check_events()
        self.evict_device(10**9)
        if self.is_hi:
            self.check_events()
            self.evict_host(10**9)

    # ---- accounting ------------------------------------------------------------------------------------
    def iter_nodes(self) -> Iterator[Any]:
        """Every node of the tree, the root first."""
        stack = [self.tree.root_node]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def accounting(self) -> Accounting:
        """The counters now; compare with the ones taken before the test's sessions started."""
        root = self.tree.root_node
        locks = tuple(
            sorted((n.id, r) for n in self.iter_nodes() if n is not root and (r := self._lock_ref(n)))
        )
        hrefs = tuple(sorted((n.id, r) for n in self.iter_nodes() if (r := self._host_ref(n))))
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
        root = self.tree.root_node
        for n in self.iter_nodes():
            if n is root:
                continue
            d, h = self._device_value(n), self._host_value(n)
            dev += len(d) if d is not None else 0
            host += len(h) if h is not None else 0
        return dev, host
