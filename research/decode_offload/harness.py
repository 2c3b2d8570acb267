"""Build sglang 0.5.16's REAL decode-side offload stack for tests: ``DecodeKVCacheOffloadManager``.

Real: the manager itself, ``MHATokenToKVPool``, ``TokenToKVPoolAllocator`` /
``PagedTokenToKVPoolAllocator``, ``ReqToTokenPool``, ``ChunkCache`` (a decode server's tree by
default) or ``RadixCache`` (``--disaggregation-decode-enable-radix-cache``), the manager's own
``MHATokenToKVPoolHost`` and ``HiCacheController``, sglang's ``file`` storage backend
(``HiCacheFile``) writing into a temporary directory, its real backup thread, sglang's page
hashing (``get_hash_str``, a C++ extension torch compiles on first use), real ``Req`` objects, a
real ``ServerArgs`` and a real gloo process group (world size 1, or the 2-rank group of a TP test).

Test doubles, each for something a CPU machine lacks or a test must decide (``docs/testing.md``,
``docs/decode_offload.md``):

1. pinned host memory -> the same host-pool class, unpinned (``base.UnpinnedHostPool``);
2. sgl-kernel's copy primitives -> torch indexing (``toolkv.testing.transfer``);
3. the GPU copy engine -> :class:`~toolkv.testing.transfer.ControlledTransferEngine`: a
   device->host copy of an increment completes only when the test says (or when sglang
   synchronizes on it);
4. the storage backend's latency -> :class:`ControlledStorage`: the real backup thread reads the
   host copy and writes the real file backend only when the test lets one backup through, so the
   moment each backup acknowledgement lands is the test's choice, as the copy engine's is.

The manager is driven exactly as the scheduler drives it; see ``research.decode_offload.world``.
The KV oracle (the bytes a token's KV must have, the bytes the pools hold) is
:mod:`toolkv.testing.base`'s, as the prefix harnesses'.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import threading
import time
from array import array
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

from toolkv.testing.base import DECODE_CODE, PoolHarness, UnpinnedHostPool, ensure_process_group, model_kv
from toolkv.testing.harness import HarnessConfig, cpu_doubles, make_server_args
from toolkv.testing.transfer import ControlledTransferEngine

MODEL_NAME = "toolkv-decode-test"
_WAIT_S = 20.0


@dataclass(frozen=True)
class DecodeHarnessConfig:
    """Shape of one decode server's offload stack. Sizes are in tokens."""

    page_size: int = 1
    device_tokens: int = 32
    host_ratio: float = 0.25  # the manager's host pool: int(device_tokens * ratio), rounded up a page
    stride_tokens: int | None = None  # SGLANG_HICACHE_DECODE_OFFLOAD_STRIDE (None: one page)
    radix_cache: bool = False  # RadixCache (decode radix cache) instead of ChunkCache
    layers: int = 2
    heads: int = 2
    head_dim: int = 4
    dtype: torch.dtype = torch.float32
    max_reqs: int = 8
    context_len: int = 256

    def __post_init__(self) -> None:
        if self.page_size < 1 or self.device_tokens % self.page_size:
            raise ValueError("device_tokens must be a positive multiple of page_size")
        if self.stride_tokens is not None and self.stride_tokens < 1:
            raise ValueError("stride_tokens must be >= 1 (or None for one page)")
        if not self.host_ratio > 0:
            raise ValueError("host_ratio must be > 0")


def token_kv(tokens: Sequence[int], layers: int, heads: int, head_dim: int) -> torch.Tensor:
    """The KV a model computes for ``tokens``, as ``[2, layers, n, heads, head_dim]`` float32.

    Stands in for the model: a function of the token id only (the workloads use ids unique per
    request and position), so the same token always has the same bytes and a byte that differs
    was copied from the wrong slot or read after the slot was reused (:func:`~toolkv.testing.base.model_kv`
    with the decode harness's own code)."""
    return model_kv(tokens, layers, heads, head_dim, DECODE_CODE)


class ControlledStorage:
    """TEST DOUBLE for storage latency: the real backup thread runs the real page write (which
    reads the host copy and writes sglang's file backend) only when the test lets it.

    ``HiCacheController.backup_thread_func`` takes each staged increment from ``backup_queue``
    and calls ``page_set_func`` (``_generic_page_set``: read the host pages, ``batch_set`` them
    into the backend), then puts the operation on ``ack_backup_queue``. This class wraps
    ``page_set_func`` with a gate: each :meth:`complete` lets exactly one staged increment through
    and waits until its acknowledgement is queued. Everything else is sglang's code.

    ``unwritten`` says how many staged increments have no acknowledgement yet (for the offload
    manager: ``len(ongoing_backup) - ack_backup_queue.qsize()``).
    """

    def __init__(self, controller: Any, unwritten: Callable[[], int]) -> None:
        self.controller = controller
        self.unwritten = unwritten
        self._real: Callable[..., bool] = controller.page_set_func
        self._cv = threading.Condition()
        self._entered = 0  # page writes the thread has started (at the gate or past it)
        self._granted = 0  # permits handed out so far
        self._open = False
        self.writes = 0  # page writes completed
        controller.page_set_func = self._gated

    def _gated(self, hash_values: Any, host_indices: Any, extra_info: Any = None) -> bool:
        with self._cv:
            self._entered += 1
            me = self._entered
            self._cv.notify_all()
            while not self._open and self._granted < me:
                self._cv.wait()
        try:
            return self._real(hash_values, host_indices, extra_info)
        finally:
            with self._cv:
                self.writes += 1
                self._cv.notify_all()

    def complete(self, n: int = 1) -> int:
        """Let the oldest ``n`` staged increments be written; returns how many were."""
        done = 0
        for _ in range(n):
            if self.unwritten() <= 0:
                break
            acks = self.controller.ack_backup_queue
            before = acks.qsize()
            deadline = time.monotonic() + _WAIT_S
            with self._cv:
                while self._entered <= self._granted:  # wait for the thread to reach the gate
                    if time.monotonic() > deadline:
                        raise TimeoutError("the backup thread never took the staged increment")
                    self._cv.wait(0.05)
                self._granted += 1
                self._cv.notify_all()
            while acks.qsize() == before:  # the thread queues the ack right after the write
                if time.monotonic() > deadline:
                    raise TimeoutError("the backup acknowledgement never arrived")
                time.sleep(0.0002)
            done += 1
        return done

    def open(self) -> None:
        """Let every write through from now on (teardown)."""
        with self._cv:
            self._open = True
            self._cv.notify_all()


@contextlib.contextmanager
def _env(values: dict[str, str | None]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    for k, v in values.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    try:
        yield
    finally:
        for k, old in saved.items():
            if old is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = old


class DecodeOffloadHarness(PoolHarness):
    """One decode server's real offload stack plus the scheduler-side operations on requests.

    One harness at a time per process (the CPU doubles live in sglang's module globals, and the
    request hook ``effective_kv_committed_len`` reads sglang's process-wide server args)."""

    _live_cpu: ClassVar[PoolHarness | None] = None
    _live_label: ClassVar[str] = "DecodeOffloadHarness"
    cfg: DecodeHarnessConfig
    engine: ControlledTransferEngine  # always the CPU double: a decode harness has no GPU mode

    def __init__(
        self,
        cfg: DecodeHarnessConfig | None = None,
        *,
        group: Any = None,
        rank: int = 0,
        world: int = 1,
        storage_dir: Path | None = None,
    ) -> None:
        self._claim_process()
        self.cfg = cfg = cfg or DecodeHarnessConfig()
        self.rank, self.world = rank, world
        self.engine = ControlledTransferEngine()
        self._stack = contextlib.ExitStack()
        self._own_dir = storage_dir is None
        self.storage_dir = Path(storage_dir or tempfile.mkdtemp(prefix="toolkv-decode-store-"))
        self.storage: ControlledStorage | None = None
        self.manager: Any = None
        try:
            self._build(group)
        except BaseException:
            self.close()
            raise

    # ---- construction -----------------------------------------------------------------------------
    def _build(self, group: Any) -> None:
        import sglang.srt.disaggregation.decode_kvcache_offload_manager as dm
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.runtime_context import get_context, get_parallel

        cfg = self.cfg
        self._stack.enter_context(cpu_doubles(self.engine))
        # the manager imported the host-pool factory into its own module: unpinned there too
        saved_get = dm.get_mha_host_pool_cls
        dm.get_mha_host_pool_cls = lambda pool: UnpinnedHostPool(saved_get(pool))
        self._stack.callback(setattr, dm, "get_mha_host_pool_cls", saved_get)

        self.group = group if group is not None else ensure_process_group()
        base = HarnessConfig(
            kind="radix", page_size=cfg.page_size, device_tokens=cfg.device_tokens, host_ratio=cfg.host_ratio
        )
        sa = make_server_args(base)
        sa.disaggregation_mode = "decode"
        sa.disaggregation_decode_enable_offload_kvcache = True
        sa.disaggregation_decode_enable_radix_cache = cfg.radix_cache
        sa.disable_radix_cache = not cfg.radix_cache
        sa.hicache_storage_backend = "file"
        sa.hicache_ratio = cfg.host_ratio
        sa.hicache_size = 0
        sa.served_model_name = MODEL_NAME
        sa._handle_hicache()  # sglang's own layout/io-backend normalisation (decode-offload path)
        self.server_args = sa
        ctx = get_context()
        saved_args = getattr(ctx, "_server_args", None)
        ctx.set_server_args(sa)
        self._stack.callback(setattr, ctx, "_server_args", saved_args)

        self._build_pools("cpu")
        params = CacheInitParams(
            disable=not cfg.radix_cache,
            req_to_token_pool=self.req_pool,
            token_to_kv_pool_allocator=self.allocator,
            page_size=cfg.page_size,
            tp_cache_group=self.group,
        )
        if cfg.radix_cache:
            from sglang.srt.mem_cache.radix_cache import RadixCache

            self.tree: Any = RadixCache(params)
        else:
            from sglang.srt.mem_cache.chunk_cache import ChunkCache

            self.tree = ChunkCache(params)

        stride = None if cfg.stride_tokens is None else str(cfg.stride_tokens)
        with (
            _env(
                {
                    "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": str(self.storage_dir),
                    "SGLANG_HICACHE_DECODE_OFFLOAD_STRIDE": stride,
                }
            ),
            get_parallel().override(
                tp_rank=self.rank,
                tp_size=self.world,
                pp_rank=0,
                pp_size=1,
                attn_tp_rank=self.rank,
                attn_tp_size=self.world,
            ),
        ):
            self.manager = dm.DecodeKVCacheOffloadManager(
                req_to_token_pool=self.req_pool,
                token_to_kv_pool_allocator=self.allocator,
                tp_group=self.group,
                tree_cache=self.tree,
                server_args=sa,
            )
        self.controller: Any = self.manager.cache_controller
        self.host_pool: Any = self.manager.decode_host_mem_pool
        self.backend: Any = self.controller.storage_backend
        mgr = self.manager
        self.storage = ControlledStorage(
            self.controller, lambda: len(mgr.ongoing_backup) - int(self.controller.ack_backup_queue.qsize())
        )

    # ---- lifecycle ----------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the storage threads, restore sglang's globals, delete the storage directory."""
        if self.storage is not None:
            self.storage.open()
        if self.manager is not None:
            with contextlib.suppress(Exception):
                self.manager.cache_controller.detach_storage_backend()
            self.manager = None
        self._stack.close()
        if self._own_dir:
            shutil.rmtree(self.storage_dir, ignore_errors=True)
        self._release_process()

    def __enter__(self) -> DecodeOffloadHarness:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- sizes --------------------------------------------------------------------------------------
    @property
    def page_size(self) -> int:
        return self.cfg.page_size

    @property
    def stride(self) -> int:
        """The stride the manager computed from the environment (tokens)."""
        return int(self.manager.offload_stride)

    def kv(self, tokens: Sequence[int]) -> torch.Tensor:
        return token_kv(tokens, self.cfg.layers, self.cfg.heads, self.cfg.head_dim)

    # ---- requests, as the decode scheduler handles them --------------------------------------------
    def new_request(self, rid: str, prompt: Sequence[int], max_new_tokens: int) -> Any:
        """A real ``Req`` as the decode server receives it (not yet admitted)."""
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.sampling.sampling_params import SamplingParams

        req = Req(
            rid=rid,
            origin_input_text="",
            origin_input_ids=array("q", prompt),
            sampling_params=SamplingParams(max_new_tokens=max_new_tokens),
        )
        req.prefix_indices = torch.empty((0,), dtype=torch.int64)
        return req

    def admit(self, req: Any, first_token: int, prefix: Any = None) -> bool:
        """Pre-allocate the request's slots and receive its prompt KV from the prefill side.

        ``prefix`` is a decode radix cache's match (``MatchResult``) whose device indices become
        the request's first slots, locked as ``_match_prefix_and_lock`` does. Returns False and
        changes nothing when the device pool cannot hold the prompt."""
        from sglang.srt.managers.schedule_batch import ReqKvInfo

        ps = self.page_size
        n = len(req.origin_input_ids)
        pre = 0 if prefix is None else len(prefix.device_indices)
        need = -(-(n - pre) // ps) * ps
        if self.req_pool.available_size() < 1 or self.allocator.available_size() < need:
            return False
        self.req_pool.alloc([req])
        slots = self.allocator.alloc(need) if need else torch.empty((0,), dtype=torch.int64)
        assert slots is not None
        if prefix is not None:
            self.tree.inc_lock_ref(prefix.last_device_node)
            req.last_node = prefix.last_device_node
            req.prefix_indices = prefix.device_indices.to(torch.int64)
            self.req_pool.write((req.req_pool_idx, slice(0, pre)), prefix.device_indices)
        self.req_pool.write((req.req_pool_idx, slice(pre, pre + need)), slots.to(torch.int32))
        self.fill(req, pre, n)
        req.kv = ReqKvInfo(kv_allocated_len=pre + need, swa_evicted_seqlen=0)
        req.kv_committed_len = n
        req.output_ids.append(first_token)
        return True

    def decode_step(self, req: Any, next_token: int) -> bool:
        """One decode iteration: the forward pass writes the KV of the last sampled token into the
        next slot (allocating a page when the request crosses into one), then samples
        ``next_token``. Returns False and changes nothing when no page is free."""
        ps = self.page_size
        pos = int(req.kv_committed_len)
        if pos >= req.kv.kv_allocated_len:
            if self.allocator.available_size() < ps:
                return False
            page = self.allocator.alloc(ps)
            assert page is not None
            self.req_pool.write((req.req_pool_idx, slice(pos, pos + ps)), page.to(torch.int32))
            req.kv.kv_allocated_len = pos + ps
        self.fill(req, pos, pos + 1)
        req.kv_committed_len = pos + 1
        req.output_ids.append(next_token)
        return True

    def all_tokens(self, req: Any) -> list[int]:
        """The tokens whose KV exists (``origin_input_ids + output_ids[:-1]``)."""
        return list(req.origin_input_ids) + list(req.output_ids[:-1])

    def fill(self, req: Any, lo: int, hi: int) -> None:
        """Write the KV of positions ``lo..hi-1`` into the request's slots (a forward pass)."""
        if hi <= lo:
            return
        toks = (list(req.origin_input_ids) + list(req.output_ids))[lo:hi]
        idx = self.req_pool.req_to_token[req.req_pool_idx, lo:hi].to(torch.int64)
        exp = self.kv(toks).to(self.cfg.dtype)
        for layer in range(self.cfg.layers):
            self.kv_pool.k_buffer[layer][idx] = exp[0, layer]
            self.kv_pool.v_buffer[layer][idx] = exp[1, layer]

    def device_kv(self, slots: torch.Tensor) -> torch.Tensor:
        """The device pool's bytes at ``slots`` as ``[2, layers, n, heads, dim]``, float32 (compared
        with :meth:`kv`, which is float32 whatever the pool's dtype)."""
        return super().device_kv(slots).float()

    def host_kv(self, host_indices: torch.Tensor) -> torch.Tensor:
        """The manager's host pool bytes at ``host_indices`` as ``[2, layers, n, heads, dim]``."""
        return super().host_kv(host_indices.to(torch.int64))

    # ---- the world around the manager --------------------------------------------------------------
    def free_device_slots(self) -> torch.Tensor:
        """Device slots the allocator would hand out now (page ids expanded to slots)."""
        a = self.allocator
        pages = torch.cat([a.free_pages, a.release_pages]).to(torch.int64)
        if self.page_size == 1:
            return pages
        return (pages.view(-1, 1) * self.page_size + torch.arange(self.page_size).view(1, -1)).flatten()

    def free_host_slots(self) -> torch.Tensor:
        hp = self.host_pool
        return torch.cat([hp.free_slots, *hp.release_slots]).to(torch.int64)

    def scribble(self, value: float = -3.0) -> None:
        """Other requests reuse every free device slot and the manager's next writes every free
        host slot: overwrite them, so that a read of a freed slot cannot see the right bytes."""
        dev = self.free_device_slots()
        for layer in range(self.cfg.layers):
            self.kv_pool.k_buffer[layer][dev] = value
            self.kv_pool.v_buffer[layer][dev] = value
        host = self.free_host_slots()
        if host.numel():
            self.host_pool.kv_buffer[:, :, host] = value

    def _copy_controller(self) -> Any:
        return self.controller

    def pending_copies(self) -> list[Any]:
        """Write acks whose device->host copy has not executed yet, oldest first."""
        return self._unfinished("write")

    def complete_copy(self) -> bool:
        """The copy engine finishes the oldest pending device->host copy."""
        return self.complete("write", 1) > 0

    # ---- storage ------------------------------------------------------------------------------------
    def stored_pages(self) -> dict[str, torch.Tensor]:
        """Every page this rank's file backend holds: page hash -> bytes as
        ``[2, layers, page_size, heads, dim]``, read back through the backend's own ``get``."""
        suffix = self.backend.config_suffix + ".bin"
        out: dict[str, torch.Tensor] = {}
        for name in sorted(os.listdir(self.storage_dir)):
            if not name.endswith(suffix):
                continue
            key = name[: -len(suffix)]
            buf = self.host_pool.get_dummy_flat_data_page()
            got = self.backend.get(key, buf)
            if got is None:
                raise OSError(f"stored page {key} cannot be read back")
            c = self.cfg
            out[key] = got.view(2, c.layers, self.page_size, c.heads, c.head_dim).float().clone()
        return out

    def hash_chain(self, tokens: Sequence[int]) -> list[str]:
        """sglang's own page-hash chain over ``tokens`` (whole pages), from no prior hash."""
        out: list[str] = []
        prior: str | None = None
        ps = self.page_size
        for off in range(0, len(tokens) // ps * ps, ps):
            prior = self.controller.get_hash_str(list(tokens[off : off + ps]), prior)
            assert prior is not None
            out.append(prior)
        return out


__all__ = [
    "MODEL_NAME",
    "ControlledStorage",
    "DecodeHarnessConfig",
    "DecodeOffloadHarness",
    "token_kv",
]
