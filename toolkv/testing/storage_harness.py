"""A real HiRadixCache with sglang 0.5.16's L3 storage tier attached: the ``file`` backend.

:class:`StorageCacheHarness` is :class:`~toolkv.testing.harness.CacheHarness` (the same real pools,
tree, controller and CPU doubles) built with ``--hicache-storage-backend file``: the controller
creates sglang's ``HiCacheFile`` over a directory the test chooses and starts its real storage
threads (the backup thread, the prefetch thread and its I/O thread). Two harnesses built over the
same directory, one after the other, are two servers sharing one L3 (``file`` on a shared path
stands in for Mooncake): what the first writes to storage, the second can prefetch.

Nothing of the storage path is doubled. The threads run on their own time, as on a server; the
helpers here only wait for them (bounded) and then run what the scheduler runs each iteration
(``check_hicache_events``: ``writing_check``, ``loading_check``, ``drain_storage_control_queues``).
They map onto ``spec/storage/StorageTier.tla``: :meth:`await_store_acks` covers the spec's
``StorePage`` steps and ``StoreAck``; :meth:`prefetch` covers ``ToolEnd``'s prefetch, the
``ReadPage`` steps and ``PrefetchAck``; :meth:`load_to_device` is the host->GPU load and ``LoadAck``.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from array import array
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any
from unittest import mock

import torch

from toolkv.testing import harness as _harness
from toolkv.testing.harness import CacheHarness, HarnessConfig

#: the served model name both servers use; HiCacheFile keys files by it (and by TP rank/size)
MODEL_NAME = "toolkv-l3-test"
_WAIT_S = 20.0


@contextlib.contextmanager
def env(name: str, value: str) -> Iterator[None]:
    """Set one environment variable for the duration (HiCacheFile reads its directory from it)."""
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


class StorageWaits:
    """Waiting for sglang's storage threads, shared by the 0.5.16 and 0.5.23 storage harnesses
    (the threads run on their own time, as on a server; the helpers wait for them, bounded, then
    run the scheduler's per-iteration step, ``check_events``)."""

    tree: Any
    controller: Any
    backend: Any
    storage_dir: Path

    def check_events(self) -> None:
        raise NotImplementedError

    def _wait(self, done: Callable[[], bool], what: str) -> None:
        """Poll ``done`` until it holds: the storage threads run on their own time, as on a server."""
        deadline = time.monotonic() + _WAIT_S
        while not done():
            if time.monotonic() > deadline:
                raise TimeoutError(f"sglang's storage thread never {what}")
            time.sleep(0.001)

    def await_store_acks(self) -> int:
        """Wait until the backup thread has written every queued write-to-storage operation and
        acknowledged it, then drain the acks (the source's protection returned). Returns how many
        operations this call saw acknowledged: 0 when the scheduler's last iteration already
        drained them (the backup thread is fast and runs on its own time)."""
        n = len(self.tree.ongoing_backup)
        self._wait(
            lambda: self.controller.ack_backup_queue.qsize() >= len(self.tree.ongoing_backup),
            "acked a backup",
        )
        self.check_events()
        assert not self.tree.ongoing_backup, "every backup acknowledged"
        return n

    def stored_keys(self) -> list[str]:
        """The page keys (hash values) HiCacheFile holds, without the model/rank suffix."""
        suffix = self.backend.config_suffix + ".bin"
        return sorted(p.name[: -len(suffix)] for p in self.storage_dir.iterdir() if p.name.endswith(suffix))


class StorageCacheHarness(StorageWaits, CacheHarness):
    """One real HiRadixCache whose controller has sglang's ``HiCacheFile`` storage backend.

    ``prefetch_policy`` is sglang's ``--hicache-storage-prefetch-policy``; the default
    ``wait_complete`` makes ``check_prefetch_progress`` wait until every page that storage
    reported as present has been read, which is what a session restore needs (``best_effort``
    would terminate the prefetch at the first check). ``prefetch_threshold`` (tokens) is sglang's
    storage-backend extra-config key: below it sglang does not prefetch at all.
    """

    def __init__(
        self,
        cfg: HarnessConfig | None,
        storage_dir: Path,
        *,
        prefetch_policy: str = "wait_complete",
        prefetch_threshold: int = 1,
        seed: int = 0,
    ) -> None:
        self.storage_dir = Path(storage_dir)
        self.prefetch_policy = prefetch_policy
        self.prefetch_threshold = prefetch_threshold
        super().__init__(cfg, seed=seed)

    def _server_args(self, cfg: HarnessConfig) -> Any:
        """The base harness's ``ServerArgs`` with the storage flags a server would be started with."""
        args = _REAL_MAKE_SERVER_ARGS(cfg)
        args.hicache_storage_backend = "file"
        args.hicache_storage_prefetch_policy = self.prefetch_policy
        args.hicache_storage_backend_extra_config = json.dumps(
            {"prefetch_threshold": self.prefetch_threshold}
        )
        args.served_model_name = MODEL_NAME
        return args

    def _build(self) -> None:
        """Build the base stack with storage on: the server flags, HiCacheFile's directory (read
        from its environment variable at construction) and the TP rank/size its storage config
        asks the runtime context for (world size 1)."""
        from sglang.srt.runtime_context import get_parallel

        if self.cfg.kind != "hiradix":
            raise ValueError("the storage tier exists only under HiRadixCache")
        self.storage_dir.mkdir(parents=True, exist_ok=True)
        with (
            env("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", str(self.storage_dir)),
            get_parallel().override(
                tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_tp_rank=0, attn_tp_size=1
            ),
            mock.patch.object(_harness, "make_server_args", self._server_args),
        ):
            super()._build()
        self.controller: Any = self.tree.cache_controller
        self.backend: Any = self.controller.storage_backend

    def close(self) -> None:
        """Stop sglang's storage threads (``detach_storage_backend``) before the CPU doubles go:
        a thread still running would copy through a double that is no longer installed."""
        tree = getattr(self, "tree", None)
        if tree is not None and getattr(tree, "enable_storage", False):
            with contextlib.suppress(Exception):
                tree.detach_storage_backend()
        super().close()

    # ---- the scheduler's per-iteration storage step ------------------------------------------------
    def check_events(self) -> None:
        """``check_hicache_events`` as the scheduler runs it every iteration: write and load acks,
        then the storage control queues (prefetch revokes, prefetch hits → host allocation,
        backup acks → ``release_host``, host slots a prefetch did not use)."""
        self.tree.writing_check()
        self.tree.loading_check()
        self.tree.drain_storage_control_queues()

    def storage_hit_tokens(self, tokens: Sequence[int]) -> int:
        """How many leading tokens of ``tokens`` storage holds (sglang's ``query_storage_hit_length``
        from the root, the hit query the prefetch thread runs)."""
        return int(self.tree.query_storage_hit_length(self.tree.root_node, array("q", tokens)))

    def prefetch(self, rid: str, tokens: Sequence[int]) -> int:
        """Prefetch ``tokens`` (the part after the host-cached prefix) from storage into the host
        pool as the scheduler does for a waiting request: ``prefetch_from_storage``, then every
        iteration ``check_hicache_events`` and ``check_prefetch_progress`` until it says the
        prefetch is done (its pages are then in the host tree). Returns the tokens loaded from
        storage (``pop_prefetch_loaded_tokens``)."""
        m = self.match(tokens)
        host_node = m.last_host_node
        done_len = len(m.device_indices) + int(m.host_hit_length)
        rest = array("q", tokens[done_len:])  # sglang's radix keys hold typed arrays
        self.tree.prefetch_from_storage(rid, host_node, rest, host_node.get_last_hash_value())
        if rid not in self.tree.ongoing_prefetch:
            return 0  # below the threshold, or rate limited: sglang does not prefetch

        def finished() -> bool:
            self.check_events()
            return bool(self.tree.check_prefetch_progress(rid))

        self._wait(finished, "finished the prefetch")
        self.check_events()  # host slots of pages not read are released through a queue
        return int(self.tree.pop_prefetch_loaded_tokens(rid))

    def load_to_device(self, tokens: Sequence[int]) -> torch.Tensor:
        """Load the host-only part of ``tokens``'s path to the device as a prefill batch does
        (``match_prefix`` → ``init_load_back`` → ``ready_to_load_host_cache``), finish the copy and
        process its ack; returns the device indices of the whole match."""
        from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams

        m = self.match(tokens)
        self.tree.init_load_back(
            InitLoadBackParams(best_match_node=m.best_match_node, host_hit_length=m.host_hit_length)
        )
        self.tree.ready_to_load_host_cache()
        self.synchronize()
        self.check_events()  # loading_check: the load's lock on the path ends with its ack
        out: torch.Tensor = self.match(tokens).device_indices
        return out


_REAL_MAKE_SERVER_ARGS = _harness.make_server_args


class MooncakeCacheHarness(StorageCacheHarness):
    """:class:`StorageCacheHarness` with sglang's ``mooncake`` backend (``MooncakeStore``) instead of
    ``file``: the server flags ``--hicache-storage-backend mooncake`` and
    ``--hicache-storage-backend-extra-config`` naming a running master (``store``, a
    :class:`~toolkv.testing.mooncake.MooncakeStore`). sglang's client registers the host pool with
    the transfer engine and reads and writes over loopback TCP; the objects live on the store's
    storage node, so they outlive this server."""

    def __init__(
        self,
        cfg: HarnessConfig | None,
        store: Any,
        *,
        prefetch_policy: str = "wait_complete",
        prefetch_threshold: int = 1,
        seed: int = 0,
    ) -> None:
        self.store = store
        super().__init__(
            cfg,
            store.workdir / "unused",
            prefetch_policy=prefetch_policy,
            prefetch_threshold=prefetch_threshold,
            seed=seed,
        )

    def _server_args(self, cfg: HarnessConfig) -> Any:
        args = super()._server_args(cfg)
        args.hicache_storage_backend = "mooncake"
        args.hicache_storage_backend_extra_config = self.store.extra_config_json(
            prefetch_threshold=self.prefetch_threshold
        )
        return args

    def stored_keys(self) -> list[str]:
        """Not listable through sglang's client: use :meth:`storage_hit_tokens` instead."""
        raise NotImplementedError("Mooncake's client has no listing; query by key")
