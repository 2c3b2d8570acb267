"""sglang plugin entry point: ``[project.entry-points."sglang.srt.plugins"] toolkv = ...:register``.

sglang calls :func:`register` through ``load_plugins()`` in the CLI process (launch_server.py:64-66,
cli/serve.py:97-99) and at the top of every scheduler process (scheduler.py:4589-4590), then
``HookRegistry.apply_hooks()`` patches the targets below before ``Scheduler(...)`` is built. Hook
targets (sglang 0.5.16, verified against the installed source):

| target | type | role |
|---|---|---|
| managers/scheduler.py:313 ``Scheduler.__init__`` | AFTER | refuse unsupported configs and unapplied hooks; build the rank's manager (rank/size from ``Scheduler.ps``, l.379) and its metrics; add ``ToolKVReqInput`` to ``_request_dispatcher`` (built at l.536); log the effective config and check the host pool size |
| managers/scheduler.py:1663 ``Scheduler.process_input_requests`` | AFTER | the tick: once per iteration, every loop type, every rank |
| managers/scheduler.py:2072 ``Scheduler.handle_generate_request`` | BEFORE | a session's next request restores its KV |
| managers/scheduler.py:2829 ``Scheduler.get_new_batch_prefill`` | AFTER | the requests of the new prefill batch were admitted (prefix matched and locked by ``PrefillAdder``): their sessions' hand-overs end; what each recomputes of evicted KV is counted (:mod:`toolkv.sglang.ghost`) |
| managers/scheduler.py:3876 ``Scheduler.get_internal_state`` | AFTER | handshake: ``internal_state["toolkv"]`` |
| mem_cache/radix_cache.py:437 ``RadixCache.cache_finished_req`` | AROUND | record the finished turn's session leaf (HiRadixCache inherits it); every request's inserted blocks enter the eviction-harm ghost |
| mem_cache/radix_cache.py:331 ``RadixCache.reset`` | AFTER | tree replaced (HiRadixCache.reset calls it last, hiradix_cache.py:780); the ghost is cleared |
| entrypoints/http_server.py:2648 ``launch_server`` | BEFORE | main process only: refuse unsupported configs; add the HTTP routes |
| entrypoints/openai/serving_chat.py:1437/1198 | AROUND | main process, TOOLKV_ZERO_CHANGE=1 only: see finish_reason "tool_calls" |
| managers/tokenizer_manager.py:624 ``TokenizerManager.generate_request`` | BEFORE | main process, TOOLKV_SESSION_HEADER set only: a request whose body has no ``session_id`` is labelled from that header (:func:`label_from_header`) |

On sglang 0.5.23 (verified against the installed 0.5.23 source; the two tree rows are replaced, the
rest keep their names at new lines):

| target | type | role |
|---|---|---|
| managers/scheduler.py:465 ``Scheduler.__init__`` | AFTER | as above; rank/size from ``runtime_context.get_parallel()`` (1285): 0.5.23's Scheduler has no ``ps``; ``_request_dispatcher`` is built by ``init_request_dispatcher`` (1828) |
| managers/scheduler.py:2224 / 2943 / 5549 | AFTER / BEFORE / AFTER | ``process_input_requests`` / ``handle_generate_request`` / ``get_internal_state``, as above |
| managers/scheduler.py:4052 ``Scheduler.get_new_batch_prefill`` | AFTER | as above (returns a ``NextBatchPlan``, schedule_batch.py:4138) |
| mem_cache/unified_radix_cache.py:1159 ``UnifiedRadixCache.checkpoint`` | AFTER | record the finished turn: ``release_kv_cache`` (mem_cache/common.py:400-445) refreshes the fill ids (430) and calls ``checkpoint(req, up_to=owned_kv_len)`` (431) for a finished request; ``checkpoint_into_tree`` inserts ``req.full_untruncated_fill_ids[:up_to]`` (1170), page-aligned (1232), under ``req.extra_key`` and ``req.cache_salt`` (1204-1209) |
| mem_cache/unified_radix_cache.py:416 ``UnifiedRadixCache.reset`` | AFTER | tree replaced (flush_cache) |
| entrypoints/http_server.py:3125 ``launch_server``; serving_chat.py:2807/2441; tokenizer_manager.py:895 ``generate_request`` | BEFORE; AROUND; BEFORE | as above |
| managers/scheduler_components/output_streamer.py:135 ``SchedulerOutputStreamer.stream_output`` | BEFORE | ``kv_hints``: apply the toolkv action of each finished request (``Req.kv_hints``, schedule_batch.py:1416) and put the outcome in ``Req.customized_info`` (:mod:`toolkv.sglang.kv_hints`) |
| managers/tokenizer_manager.py:2823 ``TokenizerManager.update_request_meta_info`` | AFTER | main process: a non-streamed response's ``meta_info["toolkv"]`` as one object |
| entrypoints/openai/serving_chat.py:2807/2413 ``_handle_non_streaming_request`` / ``_handle_streaming_request`` | AROUND | main process: carry ``kv_hints`` from the chat body (``ChatCompletionRequest`` has no such field) |

Nothing is registered unless ``TOOLKV_ENABLE=1``: an installed entry point activates for every
sglang launch in the environment, so the plugin must be inert by default. Once enabled it is
fail-closed (:mod:`toolkv.sglang.startup`): a bad setting, a missing dependency, an unsupported
sglang release or a hook sglang could not apply stops the launch with the cause.
"""

from __future__ import annotations

import logging
import multiprocessing
from collections.abc import AsyncIterator, Callable
from typing import Any

from toolkv.errors import StartupRefused, Unsupported
from toolkv.sglang.config import ToolKVConfig
from toolkv.sglang.ghost import namespace
from toolkv.sglang.startup import (
    SUPPORTED,
    check_dependencies,
    check_environment,
    check_sglang_version,
    installed_sglang_version,
    unapplied,
)

log = logging.getLogger("toolkv")

SCHED = "sglang.srt.managers.scheduler.Scheduler"
RADIX = "sglang.srt.mem_cache.radix_cache.RadixCache"
HIRADIX = "sglang.srt.mem_cache.hiradix_cache.HiRadixCache"
UNIFIED = "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache"
HTTP = "sglang.srt.entrypoints.http_server"
CHAT = "sglang.srt.entrypoints.openai.serving_chat.OpenAIServingChat"
STREAMER = "sglang.srt.managers.scheduler_components.output_streamer.SchedulerOutputStreamer"
TOKENIZER = "sglang.srt.managers.tokenizer_manager.TokenizerManager"

_registered = False
_transport: Any = None  # the HTTP process's TokenizerManagerTransport, once routes are installed


def register() -> None:
    """The entry point. Idempotent; a no-op unless TOOLKV_ENABLE=1.

    Fail-closed once enabled: a bad ``TOOLKV_*`` value, a missing dependency or an sglang release
    toolkv does not support raises :class:`~toolkv.errors.StartupRefused`, which sglang's loader
    does not catch, so the launch stops with the cause instead of serving without toolkv. Nothing
    here imports toolkv's runtime (or ``prometheus_client``, see :mod:`toolkv.sglang.startup`)."""
    global _registered
    if _registered:
        return
    try:
        if not ToolKVConfig.enabled_in():
            return
        cfg = ToolKVConfig.from_env()
    except ValueError as e:
        raise StartupRefused(f"{e} (unset TOOLKV_ENABLE to serve without toolkv)") from None
    check_dependencies()
    version = installed_sglang_version()
    release = check_sglang_version(version)
    check_environment(version)
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from toolkv.sglang.ipc import register_wire_types

    register_wire_types()
    main = multiprocessing.parent_process() is None
    for target, hook, kind in hooks(main_process=main, config=cfg, tree=release.tree):
        HookRegistry.register(target, hook, getattr(HookType, kind))
    _registered = True
    log.info("toolkv enabled (sglang %s): %s", version, _config_line(cfg))


def _config_line(cfg: ToolKVConfig) -> str:
    return " ".join(f"{k}={v}" for k, v in cfg.describe().items() if k != "enable")


def _check_hooks_applied(main_process: bool) -> None:
    """sglang's registry logs a target it could not patch and goes on; a half-installed toolkv
    must not serve. Runs in the first hook of each process, after ``apply_hooks``; checks the
    hooks this process's :func:`register` handed to the registry (none when a hook is called
    directly, as unit tests do)."""
    if not _registered:
        return
    targets = [t for t, _, _ in hooks(main_process=main_process, config=ToolKVConfig.from_env())]
    missing = unapplied(targets)
    if missing:
        raise Unsupported(
            f"sglang did not apply toolkv's hooks to {missing} (see the 'Failed to apply hooks' error above); "
            "unset TOOLKV_ENABLE to serve without toolkv",
            targets=missing,
        )


def _parallel(sched: Any) -> Any:
    """The object holding this scheduler's ranks: ``Scheduler.ps``, a ``ParallelState``, on 0.5.16
    (scheduler.py:379-397); on 0.5.23 the Scheduler has no ``ps`` and every rank is read from the
    process-wide ``runtime_context.get_parallel()`` (runtime_context.py:1285, scheduler.py:1316)."""
    ps = getattr(sched, "ps", None)
    if ps is not None:
        return ps
    try:
        from sglang.srt.runtime_context import get_parallel
    except ImportError:
        raise Unsupported(
            "this sglang Scheduler has no ParallelState (Scheduler.ps) and no runtime_context"
        ) from None
    return get_parallel()


def tp_rank_size(sched: Any) -> tuple[int, int]:
    """(tp_rank, tp_size) of a scheduler; the Scheduler itself has no ``tp_rank`` (see
    :func:`_parallel` for where each release keeps them)."""
    ps = _parallel(sched)
    return int(ps.tp_rank), int(ps.tp_size)


def _installed_tree() -> str:
    """The cache API of the installed sglang (``radix`` for a release toolkv does not know: only
    reached by callers that run after :func:`register` has refused such a release)."""
    release = SUPPORTED.get(installed_sglang_version())
    return "radix" if release is None else release.tree


def hooks(
    *, main_process: bool, config: ToolKVConfig, tree: str | None = None
) -> list[tuple[str, Callable[..., Any], str]]:
    """(target, hook, HookType name) for this process. Scheduler-side hooks are registered in
    every process (in the HTTP process the targets are imported anyway and never run); HTTP-side
    hooks only in the main process, so scheduler processes do not import the HTTP server.
    ``tree`` picks the turn-capture and reset targets of the release's cache API (default: the
    installed sglang's)."""
    tree = tree or _installed_tree()
    out: list[tuple[str, Callable[..., Any], str]] = [
        (f"{SCHED}.__init__", after_scheduler_init, "AFTER"),
        (f"{SCHED}.process_input_requests", after_process_input_requests, "AFTER"),
        (f"{SCHED}.handle_generate_request", before_handle_generate_request, "BEFORE"),
        (f"{SCHED}.get_internal_state", after_get_internal_state, "AFTER"),
        (f"{SCHED}.get_new_batch_prefill", after_get_new_batch_prefill, "AFTER"),
    ]
    if tree == "unified":
        out += [
            (f"{UNIFIED}.checkpoint", after_checkpoint, "AFTER"),
            (f"{UNIFIED}.reset", after_tree_reset, "AFTER"),
            (f"{STREAMER}.stream_output", before_stream_output, "BEFORE"),  # kv_hints (0.5.21+)
        ]
    else:
        out += [
            (f"{RADIX}.cache_finished_req", around_cache_finished_req, "AROUND"),
            (f"{RADIX}.reset", after_tree_reset, "AFTER"),
            (f"{HIRADIX}.writing_check", around_writing_check, "AROUND"),  # write_back's drain
        ]
    if main_process:
        out.append((f"{HTTP}.launch_server", before_launch_server, "BEFORE"))
        if config.session_header:
            out.append(
                (f"{TOKENIZER}.generate_request", session_header_hook(config.session_header), "BEFORE")
            )
        if config.zero_change:
            out.append((f"{CHAT}._handle_non_streaming_request", around_chat_non_streaming, "AROUND"))
            out.append((f"{CHAT}._generate_chat_stream", around_chat_stream, "AROUND"))
        if tree == "unified":  # kv_hints (0.5.21+); after the zero-change rows: the outer AROUND
            out += [
                (f"{TOKENIZER}.update_request_meta_info", after_update_request_meta_info, "AFTER"),
                (f"{CHAT}._handle_non_streaming_request", around_chat_kv_hints, "AROUND"),
                (f"{CHAT}._handle_streaming_request", around_chat_kv_hints, "AROUND"),
            ]
    return out


# ---- scheduler process ------------------------------------------------------------------------------
def after_scheduler_init(_result: None, sched: Any, *args: Any, **kwargs: Any) -> None:
    """Build this rank's toolkv. Raises ``Unsupported`` for configurations toolkv cannot serve
    correctly: inside ``Scheduler.__init__`` the exception makes sglang's
    ``run_scheduler_process`` log it and SIGQUIT the launcher (scheduler.py:4636-4640), so the
    server does not start."""
    from sglang.utils import TypeBasedDispatcher

    from toolkv.sglang.ipc import ToolKVReqInput
    from toolkv.sglang.scheduler_side import SchedulerToolKV, check_server_args, check_tree
    from toolkv.sglang.sizing import budget_warning, host_pool_warning, pool_sizes
    from toolkv.sglang.tp import ProcessGroupAgreement

    _check_hooks_applied(main_process=False)
    cfg = ToolKVConfig.from_env()
    sa = sched.server_args
    check_server_args(sa)
    tree = sched.tree_cache
    check_tree(tree)
    rank, size = tp_rank_size(sched)
    group = getattr(sched, "tp_cpu_group", None)
    tk = SchedulerToolKV(
        tree,
        config=cfg,
        agree=ProcessGroupAgreement(group),
        tp_size=size,
        tp_rank=rank,
        metrics=make_metrics(sa, sched),
    )
    sched._toolkv = tk
    tree._toolkv = tk
    tk.bind_scheduler(sched)
    sched._request_dispatcher += TypeBasedDispatcher([(ToolKVReqInput, tk.ipc_handler)])
    sizes = pool_sizes(tree)
    log.info(
        "toolkv enabled on scheduler tp_rank=%d tp_size=%d: backend=%s%s metrics=%s %s%s",
        rank,
        size,
        tk.manager.backend.name,
        tree_core_note(tree, cfg.lazy_free, cfg.unmirror),
        "on" if tk.decisions.metrics is not None else "off",
        _config_line(cfg),
        ""
        if sizes is None
        else f" device_pool_tokens={sizes.device_tokens} host_pool_tokens={sizes.host_tokens}"
        f" kv_bytes_per_token={sizes.bytes_per_token}",
    )
    for warning in (host_pool_warning(sizes), budget_warning(sizes, cfg.host_budget_tokens)):
        if warning is not None and rank == 0:
            log.warning(warning)


def tree_core_note(tree: Any, lazy_free: bool, unmirror: bool = False) -> str:
    """`` tree_core=rust|python`` for a UnifiedRadixCache (sglang 0.5.23 picks its tree core with
    ``SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND``, default ``rust``; toolkv runs on either), with what
    the Rust core cannot do that was asked for; empty for other trees."""
    core = getattr(tree, "tree_core", None)
    if core is None:
        return ""
    from toolkv.core.treeops import handle_tree

    if not handle_tree(tree):
        return " tree_core=python"
    return (
        " tree_core=rust"
        + (
            ""
            if lazy_free
            else " (TOOLKV_LAZY_FREE=0 not honoured: the Rust core leaves GPU copies to sglang)"
        )
        + (" (TOOLKV_UNMIRROR not honoured: the Rust core cannot drop a host mirror)" if unmirror else "")
    )


def make_metrics(server_args: Any, sched: Any) -> Any:
    """Collectors when sglang serves metrics (``--enable-metrics``) and this rank is one sglang
    reports from (attention-TP rank 0, or every rank with ``--enable-metrics-for-all-schedulers``),
    else None."""
    if not getattr(server_args, "enable_metrics", False):
        return None
    ps = _parallel(sched)
    if getattr(ps, "attn_tp_rank", 0) != 0 and not getattr(
        server_args, "enable_metrics_for_all_schedulers", False
    ):
        return None
    from toolkv.sglang.metrics import ToolKVMetrics

    rank, _ = tp_rank_size(sched)
    return ToolKVMetrics(
        {"model_name": str(getattr(server_args, "served_model_name", "")), "tp_rank": str(rank)}
    )


def after_process_input_requests(_result: None, sched: Any, *args: Any, **kwargs: Any) -> None:
    tk = getattr(sched, "_toolkv", None)
    if tk is not None:
        tk.bind_schedule_stream(getattr(sched, "schedule_stream", None))
        tk.tick()
        unblock_idle_queue(sched)


def unblock_idle_queue(sched: Any) -> None:
    """sglang marks the running batch full when the head of the waiting queue does not fit, and
    clears the mark only when a running batch shrinks. toolkv's pins (a kept or handed-over
    session) can be what did not fit, and they end on their own (admission, TTL, close): with
    nothing running, nothing would ever clear the mark and the queue would stall for good. So
    while nothing runs, the mark is cleared each iteration and the next iteration tries again (the
    same on every rank: it reads scheduler state only)."""
    batch = getattr(sched, "running_batch", None)
    if batch is not None and getattr(batch, "batch_is_full", False) and not getattr(batch, "reqs", None):
        batch.batch_is_full = False


def before_handle_generate_request(sched: Any, recv_req: Any, *args: Any, **kwargs: Any) -> None:
    tk = getattr(sched, "_toolkv", None)
    if tk is None:
        return
    sid = getattr(recv_req, "session_id", None)
    params = getattr(recv_req, "session_params", None)
    if sid is None and params is not None:
        sid = getattr(params, "id", None)
    if isinstance(sid, str) and sid:
        try:
            tk.on_request(sid)
        except Exception:  # the request must be served even if toolkv cannot restore first
            log.exception("toolkv: restore on request of session %s failed", sid)


def after_get_new_batch_prefill(result: Any, sched: Any, *args: Any, **kwargs: Any) -> None:
    """The prefill batch just formed holds its requests' prefixes locked (``PrefillAdder`` ran
    ``inc_lock_ref`` on each matched node): the hand-over of each one's session ends. 0.5.16 and
    0.5.23 return a ``NextBatchPlan`` whose ``batch_to_run`` is the batch (or None)."""
    tk = getattr(sched, "_toolkv", None)
    batch = getattr(result, "batch_to_run", result)
    reqs = getattr(batch, "reqs", None)
    if tk is None or not reqs:
        return
    try:
        tk.on_batch(reqs)
    except Exception:  # the batch must run even if toolkv cannot account for it
        log.exception("toolkv: admission hook failed")


def after_get_internal_state(result: Any, sched: Any, *args: Any, **kwargs: Any) -> None:
    tk = getattr(sched, "_toolkv", None)
    state = getattr(result, "internal_state", None)
    if tk is not None and isinstance(state, dict):
        state["toolkv"] = tk.status()


def finished_turn(tree: Any, req: Any, is_insert: bool, kv_len: int | None) -> tuple[str, Any, Any] | None:
    """(session id, token ids, extra_key) of a finished request whose KV was just inserted, or None.
    Mirrors ``cache_finished_req``'s own key (radix_cache.py:455-462)."""
    if not is_insert or getattr(tree, "disable", False) or getattr(tree, "disable_finished_insert", False):
        return None
    from toolkv.sglang.scheduler_side import session_label

    sid = session_label(req)
    if sid is None:
        return None
    tokens = req.origin_input_ids + req.output_ids
    if kv_len is not None:
        tokens = tokens[:kv_len]
    return sid, tokens, getattr(req, "extra_key", None)


def cached_tokens(tk: Any, tree: Any, req: Any, is_insert: bool, kv_len: int | None) -> None:
    """Every request's inserted tokens (session or not) reach the eviction-harm ghost
    (:mod:`toolkv.sglang.ghost`); the same key ``cache_finished_req`` inserts under."""
    if not is_insert or getattr(tree, "disable", False) or getattr(tree, "disable_finished_insert", False):
        return
    on_cached = getattr(tk, "on_cached", None)
    if on_cached is None:
        return
    tokens = req.origin_input_ids + req.output_ids
    if kv_len is not None:
        tokens = tokens[:kv_len]
    try:
        on_cached(tokens, namespace(req))
    except Exception:  # a metric must never fail the request
        log.exception("toolkv: recording cached tokens failed")


def around_cache_finished_req(
    original: Callable[..., Any], tree: Any, req: Any, *args: Any, **kwargs: Any
) -> Any:
    result = original(tree, req, *args, **kwargs)
    tk = getattr(tree, "_toolkv", None)
    if tk is None:
        return result
    is_insert = bool(args[0]) if args else bool(kwargs.get("is_insert", True))
    cached_tokens(tk, tree, req, is_insert, kwargs.get("kv_len_to_handle"))
    turn = finished_turn(tree, req, is_insert, kwargs.get("kv_len_to_handle"))
    if turn is not None:
        try:
            tk.on_finished(*turn)
        except Exception:  # deterministic on every rank; never fail the request for toolkv
            log.exception("toolkv: recording the turn of session %s failed", turn[0])
    return result


def around_writing_check(original: Callable[..., Any], tree: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND ``HiRadixCache.writing_check(write_back=False)`` (hiradix_cache.py:981; sglang 0.5.16):
    under ``--hicache-write-policy write_back`` the eviction drains every write in flight with
    ``writing_check(write_back=True)``, which finishes each ack without releasing the lock the write
    took. toolkv's tool_start copies are locked writes; the backend
    (``HiRadixBackend.around_writing_check``) releases the locks of those the drain finished, so
    none is kept for good. Every rank drains the same writes, so the ranks release the same locks."""
    tk = getattr(tree, "_toolkv", None)
    around = getattr(getattr(getattr(tk, "manager", None), "backend", None), "around_writing_check", None)
    if around is None:
        return original(tree, *args, **kwargs)
    write_back = bool(kwargs.get("write_back", args[0] if args else False))
    return around(lambda: original(tree, *args, **kwargs), write_back)


def checkpointed_turn(tree: Any, req: Any, up_to: int | None) -> tuple[str, Any, Any] | None:
    """(session id, token ids, extra_key) of a request that finished and whose KV
    ``UnifiedRadixCache.checkpoint`` just inserted (sglang 0.5.23), or None.

    ``checkpoint`` also runs for requests that are still running (chunked prefill and decode
    checkpoints, ``checkpoint_kv_cache``, mem_cache/common.py:271-278): only a finished request
    ends a turn, the same test ``checkpoint_into_tree`` makes (``req.finished()``, 1169). The tokens
    are the ones it inserts, ``req.full_untruncated_fill_ids[:up_to]`` (1170), which
    ``release_kv_cache`` refreshed to ``origin_input_ids + output_ids`` just before (common.py:430);
    the manager's walk page-aligns them as the insert does (1232). A request with a
    ``cache_salt`` is keyed under the salt as well (1204-1209, radix_cache.py:245-247), which the
    manager's key walk does not carry: it is not recorded (counted as ``skip:cache_salt``)."""
    if getattr(tree, "disable", False) or not req.finished():
        return None
    from toolkv.sglang.scheduler_side import session_label

    sid = session_label(req)
    if sid is None:
        return None
    if getattr(req, "cache_salt", None):
        tk = getattr(tree, "_toolkv", None)
        if tk is not None:
            tk.count_skip("skip:cache_salt")
        return None
    tokens = req.full_untruncated_fill_ids
    if up_to is not None:
        tokens = tokens[:up_to]
    return sid, tokens, getattr(req, "extra_key", None)


def after_checkpoint(_result: None, tree: Any, req: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER ``UnifiedRadixCache.checkpoint(req, *, up_to)``: the 0.5.23 twin of
    :func:`around_cache_finished_req`. Runs with the request's lock still on the inserted leaf
    (``release_kv_cache`` unlocks it after ``checkpoint`` returns, common.py:434), which changes
    nothing for recording; a settle of a still-protected session only ends protections."""
    tk = getattr(tree, "_toolkv", None)
    if tk is None:
        return
    up_to = kwargs.get("up_to", args[0] if args else None)
    if not getattr(tree, "disable", False) and hasattr(tk, "on_cached"):
        tokens = req.full_untruncated_fill_ids
        try:  # every checkpoint inserts (finished or not): the eviction-harm ghost learns it
            tk.on_cached(tokens[:up_to] if up_to is not None else tokens, namespace(req))
        except Exception:  # a metric must never fail the request
            log.exception("toolkv: recording cached tokens failed")
    turn = checkpointed_turn(tree, req, up_to)
    if turn is not None:
        try:
            tk.on_finished(*turn)
        except Exception:  # deterministic on every rank; never fail the request for toolkv
            log.exception("toolkv: recording the turn of session %s failed", turn[0])


def after_tree_reset(_result: None, tree: Any, *args: Any, **kwargs: Any) -> None:
    tk = getattr(tree, "_toolkv", None)  # absent during the tree's own __init__ -> reset()
    if tk is not None:
        tk.on_tree_reset()


def before_stream_output(streamer: Any, reqs: Any, *args: Any, **kwargs: Any) -> None:
    """BEFORE ``SchedulerOutputStreamer.stream_output(reqs, return_logprob, skip_req)``
    (output_streamer.py:135; sglang 0.5.23): the ``kv_hints`` of each request that finished in
    this step. Every finished request has been through ``release_kv_cache`` by now (its turn
    recorded by :func:`after_checkpoint`, its lock released), and its output is not sent yet: the
    toolkv action is applied here and its outcome rides out in the same output
    (:func:`toolkv.sglang.kv_hints.apply_finished_hints`). Every TP rank streams the same batch."""
    tk = getattr(getattr(streamer, "tree_cache", None), "_toolkv", None)
    if tk is None or not reqs:
        return
    from toolkv.sglang.kv_hints import apply_finished_hints

    try:
        apply_finished_hints(tk, reqs)
    except Exception:  # the output must go out even if toolkv cannot read a hint
        log.exception("toolkv: applying kv_hints failed")


# ---- HTTP process -----------------------------------------------------------------------------------
def before_launch_server(server_args: Any, *args: Any, **kwargs: Any) -> None:
    """Refuse unsupported configs before any process starts, then add the routes to sglang's
    FastAPI ``app`` (sglang adds its API-key middleware later, in _setup_and_run_http_server,
    and it covers these routes too)."""
    global _transport
    from sglang.srt.entrypoints import http_server

    from toolkv.sglang.http_api import TokenizerManagerTransport, install_routes
    from toolkv.sglang.scheduler_side import check_server_args

    _check_hooks_applied(main_process=True)
    check_server_args(server_args)
    cfg = ToolKVConfig.from_env()
    if _transport is None:
        _transport = TokenizerManagerTransport(
            lambda: http_server.get_global_state().tokenizer_manager, timeout_s=cfg.reply_timeout_s
        )
        install_routes(http_server.app, _transport)


def label_from_header(obj: Any, request: Any, header: str) -> bool:
    """Set ``obj.session_id`` from the request's ``header``; True if it did.

    Left alone: a request whose body names its session (``session_id``, or sglang's own
    ``session_params``, which sglang refuses together with ``session_id``), one without the header
    or with it empty, one that is not a generate request (``EmbeddingReqInput`` has no
    ``session_id``), and a call with no HTTP request (the engine API, warm-up). A batch is one
    request: sglang's ``session_id`` is one string that every item of the batch inherits
    (``GenerateReqInput.__getitem__``), so the header labels it as a body ``session_id`` would."""
    if not hasattr(obj, "session_id") or obj.session_id is not None:
        return False
    if getattr(obj, "session_params", None) is not None:
        return False
    headers = getattr(request, "headers", None)
    value = headers.get(header) if headers is not None else None
    if not isinstance(value, str) or not value:
        return False
    obj.session_id = value
    return True


def session_header_hook(header: str) -> Callable[..., None]:
    """The BEFORE hook of ``TokenizerManager.generate_request(obj, request=None)`` for
    ``TOOLKV_SESSION_HEADER=header``. Every route that reaches the scheduler (``/generate``, the
    OpenAI chat and completion routes) calls it with the ``GenerateReqInput`` and the HTTP request
    before the tokenizer manager normalises the input, so the label is set where a body
    ``session_id`` would have been. Returns None: sglang passes the arguments on unchanged, ``obj``
    is changed in place."""

    def before_generate_request(
        tm: Any, obj: Any = None, request: Any = None, *args: Any, **kwargs: Any
    ) -> None:
        label_from_header(obj, request, header)

    return before_generate_request


def _first_tool_name(choices: Any) -> str | None:
    """The first tool call's function name in a chat response's choices, if any."""
    for c in choices:
        for call in getattr(getattr(c, "message", None), "tool_calls", None) or []:
            name = getattr(getattr(call, "function", None), "name", None)
            if isinstance(name, str) and 0 < len(name) <= 256:
                return name
    return None


def _chat_session(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """The session of a chat call ``(adapted_request, request, raw_request)``: the chat body's
    ``session_id``, else the ``GenerateReqInput``'s, which ``TOOLKV_SESSION_HEADER`` may have set
    from a header (:func:`label_from_header`) by the time the turn ends."""
    request = args[1] if len(args) > 1 else kwargs.get("request")
    adapted = args[0] if args else kwargs.get("adapted_request")
    for sid in (getattr(request, "session_id", None), getattr(adapted, "session_id", None)):
        if isinstance(sid, str) and sid:
            return sid
    return None


async def _notify_tool_calls(sid: str | None, tool: str | None = None) -> None:
    """Send the zero-change offload, naming the (first) tool the model called: the per-call
    policy learns its durations by name."""
    if _transport is not None and sid:
        from toolkv.core.requests import AutoOffload

        try:
            await _transport.send_nowait(AutoOffload(sid, tool=tool))
        except Exception:
            log.exception("toolkv: zero-change offload of session %s not sent", sid)


async def around_chat_non_streaming(
    original: Callable[..., Any], serving: Any, *args: Any, **kwargs: Any
) -> Any:
    """finish_reason "tool_calls" is decided here in the HTTP process (serving_chat.py:1724/1735),
    after the scheduler already inserted the turn's KV (release_kv_cache runs before the output is
    streamed). The offload request is sent before the response goes out, so the session's next
    request cannot overtake it on the same ZMQ socket."""
    response = await original(serving, *args, **kwargs)
    choices = getattr(response, "choices", None) or []
    if any(getattr(c, "finish_reason", None) == "tool_calls" for c in choices):
        await _notify_tool_calls(_chat_session(args, kwargs), _first_tool_name(choices))
    return response


async def around_chat_stream(
    original: Callable[..., Any], serving: Any, *args: Any, **kwargs: Any
) -> AsyncIterator[Any]:
    """Streaming twin: the finish chunk carries ``"finish_reason":"tool_calls"`` (serving_chat.py:1329-1341)."""
    from toolkv.sglang.http_api import is_tool_calls_chunk, tool_call_name

    sent = False
    tool: str | None = None
    async for chunk in original(serving, *args, **kwargs):
        if not sent:
            tool = tool or tool_call_name(chunk)
            if is_tool_calls_chunk(chunk):
                await _notify_tool_calls(_chat_session(args, kwargs), tool)
                sent = True
        yield chunk


def after_update_request_meta_info(
    _result: None, tm: Any, meta_info: Any, state: Any, *args: Any, **kwargs: Any
) -> None:
    """AFTER ``TokenizerManager.update_request_meta_info(meta_info, state, customized_info, index,
    finish_reason)`` (tokenizer_manager.py:2823; sglang 0.5.23): the toolkv outcome of a response
    that is not streamed becomes one object (:func:`toolkv.sglang.kv_hints.flatten_meta`)."""
    if isinstance(meta_info, dict) and not getattr(getattr(state, "obj", None), "stream", False):
        from toolkv.sglang.kv_hints import flatten_meta

        flatten_meta(meta_info)


async def around_chat_kv_hints(original: Callable[..., Any], serving: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND ``OpenAIServingChat._handle_non_streaming_request`` / ``_handle_streaming_request``
    ``(adapted_request, request, raw_request)`` (serving_chat.py:2807/2413; sglang 0.5.23): the chat
    route drops ``kv_hints`` (``ChatCompletionRequest`` has no such field), so it is copied from the
    request's JSON body onto the ``GenerateReqInput`` before it is sent. ``raw_request.json()`` is
    the body FastAPI already parsed (Starlette caches it: http_server.py:935-936 relies on the same)."""
    from toolkv.sglang.kv_hints import carry_chat_kv_hints

    adapted = args[0] if args else kwargs.get("adapted_request")
    raw = args[2] if len(args) > 2 else kwargs.get("raw_request")
    if adapted is not None and raw is not None and hasattr(raw, "json"):
        try:
            body = await raw.json()
        except Exception:  # not JSON: sglang's own validation answers it
            body = None
        carry_chat_kv_hints(adapted, body)  # a malformed envelope: ValueError -> sglang's 400
    return await original(serving, *args, **kwargs)
