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
import json
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch

from toolkv.testing.base import (
    Accounting,
    TreeHarness,
    UnpinnedHostPool,
    check_stack_shape,
    copy_primitive_doubles,
    ensure_process_group,
    rkey,
)
from toolkv.testing.transfer import ControlledDeviceModule, ControlledTransferEngine

TreeCoreName = Literal["python", "rust"]


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
        check_stack_shape(self.write_policy, self.device_tokens, self.page_size)
        if self.tree_core not in ("python", "rust"):
            raise ValueError(f"tree_core must be 'python' or 'rust', got {self.tree_core!r}")


def make_server_args(cfg: UnifiedHarnessConfig, **extra: Any) -> Any:
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
        **extra,
    )
    set_global_server_args_for_scheduler(args)
    return args


@contextlib.contextmanager
def unified_cpu_doubles(engine: ControlledTransferEngine) -> Iterator[None]:
    """Install the three CPU test doubles into sglang 0.5.23's modules; restore on exit."""
    import sglang.srt.managers.cache_controller as cc
    import sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler as hpa
    import sglang.srt.mem_cache.l2_transfer as l2

    saved = {"cc": cc.device_module, "l2": l2.device_module, "get": hpa.get_mha_host_pool_cls}
    module = ControlledDeviceModule(engine)
    get = saved["get"]
    cc.device_module = module
    l2.device_module = module
    hpa.get_mha_host_pool_cls = lambda info: UnpinnedHostPool(get(info))
    try:
        with copy_primitive_doubles(engine):
            yield
    finally:
        cc.device_module = saved["cc"]
        l2.device_module = saved["l2"]
        hpa.get_mha_host_pool_cls = saved["get"]


def full(node: Any) -> Any:
    """The FULL component's data of a ``UnifiedTreeNode``: ``value`` (device indices or None),
    ``host_value``, ``lock_ref``, ``host_lock_ref``."""
    from sglang.srt.mem_cache.unified_cache.components import ComponentType

    return node.component_data[ComponentType.FULL]


@dataclass(frozen=True)
class UnifiedAccounting(Accounting):
    """:class:`~toolkv.testing.base.Accounting` plus the loads 0.5.23 queues before it starts them:
    ``load_back`` puts a load on ``cache_controller.load_queue`` and only the next
    ``ready_to_load_host_cache`` submits it, so a load toolkv queued and forgot holds host slots
    without being in flight."""

    queued_loads: int  # load_back'ed but not started (cache_controller.load_queue)


class UnifiedCacheHarness(TreeHarness):
    """One real 0.5.23 stack plus helpers to fill, inspect and drive it (the same surface as
    :class:`toolkv.testing.harness.CacheHarness` where the two versions agree: the KV oracle and
    the accounting are :class:`~toolkv.testing.base.TreeHarness`'s for both).

    What is 0.5.23's: the stack is built as ``create_unified_radix_cache`` builds it, a node's facts
    are its FULL component's (:func:`full`), the scheduler's per-iteration step is
    ``check_hicache_events``, and writes and loads wait in queues until sglang submits them.

    Exactly one CPU harness may be live per process: the doubles live in sglang's module globals
    for its lifetime. Call :meth:`close` (or use it as a context manager).
    """

    _live_cpu: ClassVar[TreeHarness | None] = None
    _live_label: ClassVar[str] = "CPU UnifiedCacheHarness"
    _kv_pool_options: ClassVar[dict[str, Any]] = {}
    cfg: UnifiedHarnessConfig

    def __init__(self, cfg: UnifiedHarnessConfig | None = None, *, seed: int = 0) -> None:
        super().__init__(cfg or UnifiedHarnessConfig(), seed=seed)

    def _server_args(self, cfg: UnifiedHarnessConfig) -> Any:
        """The server's flags (a subclass adds its own)."""
        return make_server_args(cfg)

    def _cpu_doubles(self, engine: ControlledTransferEngine) -> contextlib.AbstractContextManager[None]:
        return unified_cpu_doubles(engine)

    def _build(self) -> None:
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.unified_cache.components import ComponentType
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

        cfg = self.cfg
        group = ensure_process_group()
        self.server_args = self._server_args(cfg)
        self._build_pools(cfg.device)
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

    def _release_host(self) -> None:
        tree = self.tree
        if tree is not None and tree.cache_controller is not None:
            tree.release_host_resources()  # unregisters a pinned host buffer on a GPU
            self.tree = None

    def __enter__(self) -> UnifiedCacheHarness:
        return self

    @property
    def is_hi(self) -> bool:
        return self.cfg.hicache

    @property
    def controller(self) -> Any:
        return self.tree.cache_controller

    # ---- node facts: the FULL component of a UnifiedTreeNode (Python tree core) ---------------------
    def node(self, node_id: int) -> Any:
        """The ``UnifiedTreeNode`` behind a handle (Python tree core only)."""
        return self.tree.tree_core.node_by_id(node_id)

    def _device_value(self, node: Any) -> torch.Tensor | None:
        value: torch.Tensor | None = full(node).value
        return value

    def _host_value(self, node: Any) -> torch.Tensor | None:
        value: torch.Tensor | None = full(node).host_value
        return value

    def _lock_ref(self, node: Any) -> int:
        return int(full(node).lock_ref)

    def _host_ref(self, node: Any) -> int:
        # The root is left out on 0.5.23, as this harness always did: in write_back mode sglang may
        # host-lock any anchor, the root included (FULL's acquire_component_lock), and that lock
        # is sglang's, not a session's. On 0.5.16 the root's host_ref_counter is counted.
        return 0 if node is self.tree.root_node else int(full(node).host_lock_ref)

    def _submit_queued(self) -> None:
        """Writes wait in ``pending_backups`` until ``flush_pending_backups`` and loads in
        ``load_queue`` until ``ready_to_load_host_cache``: hand both to the copy engine."""
        if self.is_hi:
            self.tree.flush_pending_backups()
            if self.controller.load_queue:
                self.tree.ready_to_load_host_cache()

    # ---- tree operations in sglang's calling conventions -----------------------------------------------
    def insert(self, tokens: Sequence[int], value: torch.Tensor, extra_key: str | None = None) -> int:
        """Insert a freshly computed ``value`` like ``cache_finished_req``. In 0.5.23 the insert
        itself frees the slots of the part already in the tree (``FreeDeviceKV`` from
        ``prev_prefix_len`` on), so nothing is freed here. Returns that part's length."""
        from sglang.srt.mem_cache.base_prefix_cache import InsertParams

        res = self.tree.insert(InsertParams(key=rkey(tokens, extra_key), value=value))
        return int(res.prefix_len)

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

    def evict_host(self, n_tokens: int) -> int:
        assert self.is_hi, "host eviction needs HiCache"
        return int(self.tree.evict_host(n_tokens))

    def check_events(self) -> None:
        """What the scheduler does every iteration: submit queued writes, retire finished acks."""
        if self.is_hi:
            self.tree.check_hicache_events()

    # ---- accounting ---------------------------------------------------------------------------------
    def accounting(self) -> UnifiedAccounting:
        """The base counters plus the loads queued but not started. On the Rust tree core per-node
        lock counts are not readable (no node objects): the lock and host-lock entries stay empty
        and the pool and size totals carry the comparison (every lock returned leaves
        ``protected`` as it was; every host lock returned lets the host eviction free the pool)."""
        queued = len(self.controller.load_queue) if self.is_hi else 0
        if self.cfg.tree_core == "rust":
            from toolkv.testing.base import Accounting

            hi = self.is_hi
            base = Accounting(
                device_free=int(self.allocator.available_size()),
                host_free=int(self.host_pool.available_size()) if hi else 0,
                evictable=int(self.tree.evictable_size()),
                protected=int(self.tree.protected_size()),
                lock_refs=(),
                host_refs=(),
                pending_writes=len(self.tree.ongoing_write_through) if hi else 0,
                pending_loads=len(self.tree.ongoing_load_back) if hi else 0,
            )
            return UnifiedAccounting(**asdict(base), queued_loads=queued)
        return UnifiedAccounting(**asdict(super().accounting()), queued_loads=queued)


class UnifiedStorageHarness(UnifiedCacheHarness):
    """One real 0.5.23 ``UnifiedRadixCache`` whose controller has sglang's ``HiCacheFile`` storage
    backend (``--hicache-storage-backend file``), as
    :class:`~toolkv.testing.storage_harness.StorageCacheHarness` is for 0.5.16: the controller
    creates the backend over a directory the test chooses and starts its real storage threads
    (the backup thread, the prefetch thread and its I/O thread). Nothing of the storage path is
    doubled; the waits are :class:`~toolkv.testing.storage_harness.StorageWaits`'.

    Every acknowledged host write is written to storage by sglang itself
    (``_finish_write_through_ack`` → ``write_backup_storage``), and ``check_hicache_events``
    drains the storage control queues, as the scheduler's every iteration does.
    ``prefetch_policy`` is ``--hicache-storage-prefetch-policy`` (``wait_complete``: every page the
    hit query found is read before the prefetch ends); ``prefetch_threshold`` (tokens) the extra
    config's key below which sglang does not prefetch."""

    def __init__(
        self,
        cfg: UnifiedHarnessConfig | None,
        storage_dir: Path,
        *,
        prefetch_policy: str = "wait_complete",
        prefetch_threshold: int = 1,
        seed: int = 0,
    ) -> None:
        from toolkv.testing.storage_harness import StorageWaits

        self.storage_dir = Path(storage_dir)
        self.prefetch_policy = prefetch_policy
        self.prefetch_threshold = prefetch_threshold
        self._waits = StorageWaits
        super().__init__(cfg, seed=seed)

    def _server_args(self, cfg: UnifiedHarnessConfig) -> Any:
        """The base harness's ``ServerArgs`` with the storage flags a server would be started with
        (set before they are published: 0.5.23 reads them through ``get_memory()``)."""
        from toolkv.testing.storage_harness import MODEL_NAME

        return make_server_args(
            cfg,
            hicache_storage_backend="file",
            hicache_storage_prefetch_policy=self.prefetch_policy,
            hicache_storage_backend_extra_config=json.dumps({"prefetch_threshold": self.prefetch_threshold}),
            served_model_name=MODEL_NAME,
        )

    def _build(self) -> None:
        """The base stack with storage on: HiCacheFile's directory (read from its environment
        variable at construction) and the TP rank/size its storage config asks for (world size 1)."""
        from sglang.srt.runtime_context import get_parallel

        from toolkv.testing.storage_harness import env

        if not self.cfg.hicache:
            raise ValueError("the storage tier needs HiCache's host tier")
        self.storage_dir.mkdir(parents=True, exist_ok=True)
        with (
            env("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", str(self.storage_dir)),
            get_parallel().override(
                tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_tp_rank=0, attn_tp_size=1
            ),
        ):
            super()._build()
        self.backend: Any = self.tree.cache_controller.storage_backend
        assert self.tree.enable_storage, "sglang attached no storage backend"

    def close(self) -> None:
        """Stop sglang's storage threads (``detach_storage_backend``: drain, stop, release what a
        prefetch or backup still holds) before the CPU doubles go."""
        tree = getattr(self, "tree", None)
        if tree is not None and getattr(tree, "enable_storage", False):
            with contextlib.suppress(Exception):
                tree.detach_storage_backend()
        super().close()

    # ---- waits (StorageWaits', bound here: the harness bases differ by release) ---------------------
    def _wait(self, done: Any, what: str) -> None:
        self._waits._wait(self, done, what)  # type: ignore[arg-type]

    def await_store_acks(self) -> int:
        return int(self._waits.await_store_acks(self))  # type: ignore[arg-type]

    def stored_keys(self) -> list[str]:
        return list(self._waits.stored_keys(self))  # type: ignore[arg-type]

    def storage_records(self) -> dict[str, int]:
        """sglang's per-request and per-write storage records, each a count that is 0 when nothing
        is in flight or left behind: writes to storage, prefetches, their reserved span, the
        tokens-read counts and the wait, retry and hit accounting of each request."""
        t = self.tree
        return {
            "ongoing_backup": len(t.ongoing_backup),
            "ongoing_prefetch": len(t.ongoing_prefetch),
            "prefetch_tokens_occupied": int(t.cache_controller.prefetch_tokens_occupied),
            "prefetch_loaded_tokens": len(t.prefetch_loaded_tokens_by_reqid),
            "prefetch_loaded_start": len(t.prefetch_loaded_storage_start_by_reqid),
            "prefetch_wait": len(t._storage_prefetch_wait),
            "prefetch_retries": len(t.storage_prefetch_retries._pending),
            "prefetch_hit_accounting": len(t._storage_prefetch_hit_remaining_by_reqid),
        }

    def prefetch(self, rid: str, tokens: Sequence[int]) -> int:
        """sglang's own read at a request's arrival (``Scheduler._prefetch_kvcache``): match,
        ``prefetch_from_storage`` below the last host node, then every iteration
        ``check_hicache_events`` and ``check_prefetch_progress`` until it is done; the request's
        records let go as admission does. Returns the tokens loaded from storage."""
        from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle

        t = self.tree
        m = self.match(tokens)
        anchor = m.last_host_node
        done_len = int(m.device_prefix_len) + int(m.host_hit_length)
        handle = CacheRequestHandle(rid, 0)  # the request's id, its first attempt
        t.prefetch_from_storage(
            handle,
            anchor,
            array("q", tokens[done_len:]),
            t.get_last_hash_value(anchor),
            None,
            matched_prefix_tokens=array("q", tokens[:done_len]),
        )
        if not t.has_ongoing_prefetch(handle):
            return 0

        def finished() -> bool:
            self.check_events()
            return bool(t.check_prefetch_progress(handle))

        self._wait(finished, "finished the prefetch")
        self.check_events()  # host slots of pages not read are released through a queue
        loaded = int(t.pop_prefetch_loaded_tokens(handle))
        t.finish_storage_prefetch_admission(handle, loaded, None)
        t.storage_prefetch_retries.cancel(rid)
        return loaded

    def load_to_device(self, tokens: Sequence[int]) -> torch.Tensor:
        """Load the host-only part of ``tokens``'s path to the device (``match_prefix``, then the
        ``load_back`` of its best match that a prefill batch's ``init_load_back`` runs, and
        ``ready_to_load_host_cache``), finish the copy and process its ack; returns the device
        indices of the whole match."""
        m = self.match(tokens)
        assert self.tree.load_back(m.best_match_node), "load_back refused"
        self.tree.ready_to_load_host_cache()
        self.synchronize()
        self.check_events()
        m = self.match(tokens)
        out: torch.Tensor = self.tree.path_device_indices(m.last_device_node)[: m.device_prefix_len]
        return out


__all__ = [
    "MIN_UNIFIED_VERSION",
    "TreeCoreName",
    "UnifiedAccounting",
    "UnifiedCacheHarness",
    "UnifiedHarnessConfig",
    "UnifiedStorageHarness",
    "ensure_process_group",
    "full",
    "has_unified_radix_cache",
    "make_server_args",
    "rkey",
    "sglang_version",
    "unified_cpu_doubles",
]
