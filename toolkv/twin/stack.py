"""Build one configuration's server-side stack: the installed sglang's real cache (CPU harness,
tiny tensors, real token counts) with toolkv's real scheduler side attached the way the plugin
attaches it, the tick on an agreed clock that reads the simulated time.

The turn capture is the plugin's own: its cache rows applied by sglang's ``HookRegistry``
(:func:`toolkv.sglang.cache_hooks.toolkv_cache_hooks`), held from :func:`build` until
:meth:`Stack.close`, so the stacks open in one process (a fleet's servers) share one application
and the last one closed undoes it:

- sglang 0.5.16: ``HiRadixCache`` / ``RadixCache`` (:mod:`toolkv.testing.harness`), the AROUND
  hook on ``RadixCache.cache_finished_req``;
- sglang 0.5.21 and later (0.5.23 pinned): ``UnifiedRadixCache`` with or without HiCache
  (:mod:`toolkv.testing.unified_harness`), the AFTER hook on ``UnifiedRadixCache.checkpoint``.
  Chosen as ``make_backend`` chooses its ``unified`` backend: by the installed sglang
  (:func:`unified`)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.metadata import version
from typing import Any, Literal

from toolkv.sglang.cache_hooks import toolkv_cache_hooks
from toolkv.twin.configs import TwinConfig


@dataclass
class Stack:
    harness: Any  # toolkv.testing.harness.CacheHarness
    tk: Any  # toolkv.sglang.scheduler_side.SchedulerToolKV
    device_tokens: int
    host_tokens: int
    unified: bool = False  # sglang 0.5.21+: UnifiedRadixCache, the 0.5.23 scheduler
    storage: Any = None  # an L3 server's storage I/O on the twin's clock (toolkv.twin.storage)
    scheduler_class: Any = None  # the scheduler to run instead of the release's own (L3: L3Scheduler)
    # the plugin's cache hooks, applied while this stack is open (closed by close())
    hooks: contextlib.ExitStack | None = field(default=None, kw_only=True)

    @property
    def sglang(self) -> str:
        return version("sglang")

    def close(self) -> None:
        self.harness.close()
        if self.hooks is not None:
            self.hooks.close()
            self.hooks = None


def quiet() -> None:
    """sglang logs every retraction and toolkv every decision: millions of lines in an hour."""
    for name in ("sglang", "toolkv"):
        logging.getLogger(name).setLevel(logging.ERROR)


def unified() -> bool:
    """True when the installed sglang builds ``UnifiedRadixCache`` (0.5.21+): the twin then runs
    over :mod:`toolkv.testing.unified_harness` and :mod:`toolkv.twin.scheduler_0523`."""
    from toolkv.testing.unified_harness import has_unified_radix_cache

    return has_unified_radix_cache()


def twin_tree_core() -> Literal["python", "rust"]:
    """The 0.5.23 tree core the twin runs: sglang's own setting,
    ``SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND`` (``python`` when unset here, the core the twin's
    recorded results were made on; ``rust`` is sglang's default)."""
    import os

    core = os.environ.get("SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND", "python")
    if core not in ("python", "rust"):
        raise ValueError(f"SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND must be python or rust, got {core!r}")
    return "rust" if core == "rust" else "python"


def build(
    cfg: TwinConfig, *, device_tokens: int, kv_bytes_per_token: int, now: Callable[[], float],
    max_reqs: int = 256, context_len: int = 65_536 + 64,
) -> Stack:  # fmt: skip
    """The cache of ``cfg`` (device pool of ``device_tokens``; host pool of ``cfg.host_gb`` at
    ``kv_bytes_per_token``) with toolkv loaded as in every benchmark configuration
    (``TOOLKV_ENABLE=1 TOOLKV_RESTORE_ON_REQUEST=1`` and the configuration's TTL, policy, budget),
    its turns recorded by the plugin's cache hooks (applied here, undone by :meth:`Stack.close`)."""
    hooks = contextlib.ExitStack()
    hooks.enter_context(toolkv_cache_hooks("unified" if unified() else "radix"))
    try:
        stack = _build(
            cfg, device_tokens=device_tokens, kv_bytes_per_token=kv_bytes_per_token, now=now,
            max_reqs=max_reqs, context_len=context_len,
        )  # fmt: skip
    except BaseException:
        hooks.close()
        raise
    stack.hooks = hooks
    return stack


def _build(
    cfg: TwinConfig, *, device_tokens: int, kv_bytes_per_token: int, now: Callable[[], float],
    max_reqs: int, context_len: int,
) -> Stack:  # fmt: skip
    """:func:`build` once the cache hooks are applied."""
    import torch

    from toolkv.sglang.config import ToolKVConfig
    from toolkv.twin.server import attach_toolkv

    quiet()
    torch.set_num_threads(1)  # tiny tensors: threads only contend (and the machine is shared)
    host_tokens = cfg.host_tokens(kv_bytes_per_token)
    # the harness sizes the host pool as int(device * ratio) + 1 page (pool_host/base.py)
    ratio = (host_tokens - 1 + 0.5) / device_tokens if host_tokens else 2.0
    is_unified = unified()
    if is_unified and cfg.cache != "hiradix":
        # toolkv's unified backend drives only a UnifiedRadixCache with a host tier
        # (core/backends/unified.py ``check_tree``): a 0.5.23 server without
        # --enable-hierarchical-cache does not start with toolkv, so there is nothing to model
        raise ValueError(
            f"{cfg.name}: sglang {version('sglang')} without HiCache is not supported by toolkv "
            "(UnifiedRadixCache without a host tier); the radix and pin configurations need sglang 0.5.16"
        )
    link = cfg.storage_link(kv_bytes_per_token)
    if link is not None and (is_unified or cfg.cache != "hiradix"):
        raise ValueError(f"{cfg.name}: the twin's L3 tier needs sglang 0.5.16's HiRadixCache")
    h: Any
    if is_unified:
        from toolkv.testing.unified_harness import UnifiedCacheHarness, UnifiedHarnessConfig

        h = UnifiedCacheHarness(
            UnifiedHarnessConfig(
                page_size=1, device_tokens=device_tokens, host_ratio=ratio, layers=1, heads=1, head_dim=1,
                dtype=torch.float16, max_reqs=max_reqs, context_len=context_len, hicache=cfg.cache == "hiradix",
                tree_core=twin_tree_core(), write_policy=cfg.write_policy,
            )
        )  # fmt: skip
    else:
        from toolkv.testing.harness import CacheHarness, HarnessConfig

        hcfg = HarnessConfig(
            kind="hiradix" if cfg.cache == "hiradix" else "radix", page_size=1, device_tokens=device_tokens,
            host_ratio=ratio, layers=1, heads=1, head_dim=1, dtype=torch.float16, max_reqs=max_reqs,
            context_len=context_len, write_policy=cfg.write_policy,
        )  # fmt: skip
        if link is not None:
            from toolkv.twin.storage import build_storage_harness

            h = build_storage_harness(hcfg, link)
        else:
            h = CacheHarness(hcfg)
    budget = int(cfg.pin_budget_share * device_tokens) if cfg.pin_budget_share is not None else None
    tcfg = ToolKVConfig(
        enable=True,
        ttl_s=cfg.ttl_s,
        host_budget_tokens=budget,
        restore_on_request=True,
        policy=cfg.policy,
        adaptive=cfg.adaptive,
        # toolkv's L3 knobs set to the link's rates (TOOLKV_L3_READ/WRITE_TOKENS_PER_S)
        **(
            {"l3_read_tokens_per_s": link.read_tokens_per_s, "l3_write_tokens_per_s": link.write_tokens_per_s}
            if link is not None
            else {}
        ),
    )
    if cfg.toolkv_env:
        tcfg = with_env(tcfg, cfg.toolkv_env)
    tk = attach_toolkv(h.tree, tcfg, now=now)  # as the plugin attaches it (the soak's and demo's too)
    # sglang prints the whole tree before raising "Out of memory" (alloc_token_slots): an
    # hour-long tree on stdout would bury the report; the twin records the error instead
    h.tree.pretty_print = lambda: None
    host = int(h.host_pool.size) if h.host_pool is not None else 0
    if link is not None:
        from toolkv.twin.storage import L3Scheduler, TimedStorageIO

        return Stack(h, tk, device_tokens, host, is_unified, TimedStorageIO(h, link), L3Scheduler)
    return Stack(h, tk, device_tokens, host, is_unified)


def with_env(tcfg: Any, env: tuple[tuple[str, str], ...]) -> Any:
    """``tcfg`` with the fields that ``env``'s ``TOOLKV_*`` variables name, parsed and checked as the
    plugin parses an operator's environment (``ToolKVConfig.from_env``: a bad name or value raises
    ``ValueError``); the other fields stay the twin's."""
    from dataclasses import replace

    from toolkv.sglang.config import ToolKVConfig

    parsed = ToolKVConfig.from_env({"TOOLKV_ENABLE": "1", **dict(env)})
    return replace(
        tcfg, **{k[len("TOOLKV_") :].lower(): getattr(parsed, k[len("TOOLKV_") :].lower()) for k, _ in env}
    )
