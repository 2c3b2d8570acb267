"""The one sglang server stand-in in one process, every driver's: the twin, the fleet and the L3
map (:class:`~toolkv.twin.run.Twin`, on modelled GPU time) and the byte-checking drivers (the soak,
the fault bench, the demo). It is sglang's real cache (a CPU harness of :mod:`toolkv.testing`), the
scheduler model every driver runs (:func:`~toolkv.twin.scheduler.make_scheduler`, the one factory),
the one request builder (:meth:`Server.request`), the forward that writes and checks KV bytes
(:class:`~toolkv.twin.forward.KVForward`; the twin, which counts tokens, runs without it), the ``Scheduler`` object
sglang's own flush code and toolkv's hooks receive (:class:`SchedulerStandIn`), and toolkv's
scheduler side attached the way the plugin attaches it (:meth:`Server.attach`, which the twin's
:func:`~toolkv.twin.stack.build` shares through :func:`attach_toolkv`).

The plugin's cache hooks (the turn capture) are applied by the caller through
:func:`toolkv.sglang.cache_hooks.toolkv_cache_hooks`, once, around the servers it opens.
"""

from __future__ import annotations

import contextlib
import random
from array import array
from collections import deque
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any, Literal

import torch

from toolkv.twin.forward import KVForward
from toolkv.twin.scheduler import Batch, TwinScheduler, make_scheduler, sampled_id

ServerKind = Literal["hiradix", "pin", "shadow", "unified"]


def attach_toolkv(
    tree: Any, config: Any, *, now: Callable[[], float], agree: Any = None, metrics: Any = None
) -> Any:
    """toolkv's scheduler side on ``tree`` as the plugin's ``after_scheduler_init`` builds it
    (``SchedulerToolKV`` with ``config``, the tree's ``_toolkv``), its tick on an agreed clock
    that reads ``now`` every ``config.sweep_every`` ticks; one rank (``LocalAgreement``) unless
    ``agree`` says otherwise; ``metrics`` (a ``ToolKVMetrics``) when something serves them."""
    from toolkv.core.backends.base import LocalAgreement
    from toolkv.sglang.scheduler_side import SchedulerToolKV
    from toolkv.sglang.tp import AgreedClock

    agree = agree if agree is not None else LocalAgreement()
    clock = AgreedClock(agree, every=config.sweep_every, source=now)
    tk = SchedulerToolKV(tree, config=config, agree=agree, clock=clock, metrics=metrics)
    tree._toolkv = tk
    return tk


# ---- the scheduler: the twin's scheduler model, and a stand-in that runs sglang's own flush code -----
class FlushReplies:
    """TEST DOUBLE of ``SchedulerIpcChannels.send_to_tokenizer``: records what a deferred
    ``flush_cache`` answers (the reply the client of ``/flush_cache`` sees)."""

    def __init__(self) -> None:
        self.sent: list[Any] = []

    def send_output(self, output: Any, req: Any = None) -> None:
        self.sent.append(output)


class SchedulerStandIn:
    """TEST DOUBLE of sglang's ``Scheduler`` object (it needs a model runner, which CPU lacks):
    exactly the attributes that the REAL ``Scheduler.is_fully_idle`` and ``Scheduler.flush_cache``
    read, with those two functions bound to it, and sglang's REAL ``SchedulerFlushWrapper`` over
    them. The queues and batches are the scheduler model's (:class:`~toolkv.twin.scheduler.
    TwinScheduler`, the one scheduler every driver runs), so "idle" means what it means in sglang:
    no request waiting or running and (HiCache) no write or load pending."""

    def __init__(self, sched: TwinScheduler, *, hicache: bool) -> None:
        from sglang.srt.disaggregation.utils import DisaggregationMode
        from sglang.srt.managers.scheduler import Scheduler
        from sglang.srt.managers.scheduler_components.flush_wrapper import SchedulerFlushWrapper

        self.model = sched
        self.dllm_manager = SimpleNamespace(any_staging_reqs=lambda: False)
        self.enable_overlap = False
        self.result_queue: deque[Any] = deque()
        self.ps = SimpleNamespace(pp_size=1)
        self.grammar_manager = SimpleNamespace(grammar_queue=[], clear=lambda: None)
        self.disaggregation_mode = DisaggregationMode.NULL
        self.enable_hisparse = False
        self.decode_offload_manager = None
        self.enable_hierarchical_cache = hicache
        self.tree_cache = sched.tree
        self.req_to_token_pool = sched.h.req_pool
        self.token_to_kv_pool_allocator = sched.h.allocator
        self.metrics_reporter = SimpleNamespace(reset_metrics=lambda: None, is_stats_logging_rank=False)
        self.draft_worker = None
        self.cur_batch_for_debug = None
        self._engine_paused = False
        self._toolkv: Any = None  # toolkv's scheduler side, once attached
        self._pp_microbatches_drained: Callable[[], bool] = Scheduler._pp_microbatches_drained.__get__(self)
        self.is_fully_idle: Callable[..., bool] = Scheduler.is_fully_idle.__get__(self)
        self.flush_cache: Callable[..., bool] = Scheduler.flush_cache.__get__(self)
        self.flush_replies = FlushReplies()
        import inspect

        params = inspect.signature(SchedulerFlushWrapper.__init__).parameters
        # 0.5.16 answers through ipc_channels.send_to_tokenizer, 0.5.23 through a send_output callable
        reply: dict[str, Any] = (
            {"send_output": self.flush_replies.send_output}
            if "send_output" in params
            else {"ipc_channels": SimpleNamespace(send_to_tokenizer=self.flush_replies)}
        )
        self.flush_wrapper = SchedulerFlushWrapper(
            flush_cache=self.flush_cache, is_fully_idle=self.is_fully_idle, **reply
        )

    # the scheduler model's state, under the names sglang's Scheduler gives it
    @property
    def waiting_queue(self) -> list[Any]:
        return self.model.waiting_queue

    @property
    def running_batch(self) -> Any:
        return self.model.running_batch

    @property
    def chunked_req(self) -> Any:
        return self.model.chunked_req

    @property
    def last_batch(self) -> Any:
        return self.model.last_batch

    @last_batch.setter
    def last_batch(self, value: Any) -> None:
        self.model.last_batch = value

    def request_flush(self, timeout_s: float) -> Any:
        """``/flush_cache?timeout=T`` as the scheduler receives it: answered now (idle, or
        ``timeout_s`` 0) or deferred to ``check_pending`` (None)."""
        from sglang.srt.managers.io_struct import FlushCacheReqInput

        return self.flush_wrapper.handle(FlushCacheReqInput(timeout_s=timeout_s))


# ---- the server ---------------------------------------------------------------------------------------
VOCAB = 128_256  # Llama-3.1-8B's; the drivers' ids are below 120,000
Hook = Callable[[Any], None]


class Server:
    """One server over one real cache: the harness ``h``, the scheduler model of its release
    (``sched``, chunked prefill on at CPU sizes), the forward that writes and checks KV bytes
    (``forward``) and the ``Scheduler`` object sglang's code and toolkv's hooks receive
    (``scheduler``). Requests are real ``Req`` objects; a request's output ids are the ones its
    client planned (the forward "samples" them), so a turn's tokens are known before it runs.

    A driver runs the loop with :meth:`iterate` (the soak, the demo); :meth:`admit` and
    :meth:`finish` run one request at a time (the fault bench, ``tests/_faultbench.py``); the
    twin (``kv_forward=False``) runs its own loop on modelled time over :attr:`sched`.
    ``scheduler_class`` replaces the release's scheduler model on 0.5.16 (the L3 server's)."""

    name: str
    tree_api: str  # which cache rows of the plugin capture its turns (toolkv_cache_hooks)

    def __init__(
        self,
        h: Any,
        name: str,
        *,
        chunked_prefill_size: int = 256,
        max_prefill_tokens: int = 1024,
        max_running_requests: int | None = None,
        scheduler_class: type[TwinScheduler] | None = None,
        kv_forward: bool = True,
    ) -> None:
        self.h = h
        self.name = name
        self.sched = make_scheduler(
            h,
            scheduler_class,
            chunked_prefill_size=chunked_prefill_size,
            max_prefill_tokens=max_prefill_tokens,
            max_running_requests=max_running_requests or h.cfg.max_reqs - 1,
            on_admitted=self._admitted,
            on_first_token=self._first_token,
            on_finished=self._finished,
            sample=self._sample,
        )
        self._forward = KVForward(h, self.sched) if kv_forward else None
        self.scheduler = SchedulerStandIn(self.sched, hicache=h.is_hi)
        self.planned: dict[str, list[int]] = {}  # rid -> the output ids its client expects
        self.on_admitted: Hook | None = None  # the driver's: the plugin's AFTER hook runs there
        self.on_first_token: Hook | None = None
        self.on_finished: Hook | None = None
        self.tk: Any = None  # toolkv's scheduler side, once attached
        self._rid = 0
        self._unprocessed: Batch | None = None  # admitted by admit(), its results not yet processed

    def attach(self, config: Any, *, now: Callable[[], float], metrics: Any = None) -> Any:
        """toolkv's scheduler side, attached as the plugin attaches it: on the tree, on the
        ``Scheduler`` object, bound to the scheduler's queues (``bind_scheduler``); ``metrics``
        (a ``ToolKVMetrics``) when the driver serves them (``toolkv serve``'s ``/metrics``)."""
        return self.bind(attach_toolkv(self.h.tree, config, now=now, metrics=metrics))

    def bind(self, tk: Any) -> Any:
        """``tk`` (toolkv's scheduler side, already on the tree) as this server's: on the
        ``Scheduler`` object, bound to the scheduler's queues (``bind_scheduler``)."""
        self.tk = tk
        self.scheduler._toolkv = tk
        tk.bind_scheduler(self.scheduler)
        return tk

    # ---- requests ------------------------------------------------------------------------------------
    def request(
        self,
        sid: str | None,
        prompt: Any,
        output: list[int] | None = None,
        *,
        max_new_tokens: int | None = None,
        sends_session: bool = True,
    ) -> Any:
        """A real ``Req`` for ``prompt`` (``ignore_eos``): it produces ``output`` when given (a
        byte-checking driver's planned ids), else ``max_new_tokens`` of the twin's fixed ids
        (:func:`~toolkv.twin.scheduler.sampled_id`). Its rid is ``<sid>#<n>``; its session id is
        ``sid`` unless ``sends_session`` is False (a stock agent names its session but sends none)."""
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.sampling.sampling_params import SamplingParams

        if (output is None) == (max_new_tokens is None):
            raise ValueError("give a request either its planned output or max_new_tokens")
        n = len(output) if output is not None else max_new_tokens
        sp = SamplingParams(max_new_tokens=n, ignore_eos=True, temperature=0)
        sp.normalize(None)
        self._rid += 1
        rid = f"{sid or 'req'}#{self._rid}"
        if output is not None:
            self.planned[rid] = list(output)
        ids = prompt if isinstance(prompt, array) else array("q", prompt)
        return Req(rid, "", ids, sp, session_id=sid if sends_session else None, vocab_size=VOCAB)

    def _sample(self, req: Any) -> int:
        planned = self.planned.get(req.rid)
        return planned[len(req.output_ids)] if planned is not None else sampled_id(req)

    def _admitted(self, req: Any) -> None:
        if self.on_admitted is not None:
            self.on_admitted(req)

    def _first_token(self, req: Any) -> None:
        if self.on_first_token is not None:
            self.on_first_token(req)

    def _finished(self, req: Any) -> None:
        self.planned.pop(req.rid, None)
        if self.on_finished is not None:
            self.on_finished(req)

    def drop(self, req: Any) -> bool:
        """Take a request out of the waiting queue (an abort before admission); False if it
        is not waiting any more."""
        q = self.sched.waiting_queue
        for i, r in enumerate(q):
            if r is req:
                del q[i]
                self.planned.pop(req.rid, None)
                return True
        return False

    def iterate(self) -> Batch | None:
        """``get_next_batch_to_run``, the forward, the results (one scheduler iteration's
        batch): returns the batch that ran, if any."""
        batch = self.sched.next_batch()
        if batch is not None:
            self.forward.run(batch)
            self.sched.finish_batch(batch)
        return batch

    @property
    def forward(self) -> KVForward:
        """The forward that writes and checks KV bytes (not the twin's: it counts tokens)."""
        if self._forward is None:
            raise RuntimeError(f"{self.name}: a server built with kv_forward=False writes no KV bytes")
        return self._forward

    # ---- one request at a time (the fault bench) ----------------------------------------------------
    def admit(self, sid: str | None, prompt: list[int], output: list[int]) -> Any | None:
        """The request enters the waiting queue and is admitted into a prefill batch, which runs
        its forward; its results wait for :meth:`finish`, so it holds its prefix and memory until
        then. None (and nothing queued) when the scheduler cannot admit it now."""
        self._flush_unprocessed()
        req = self.request(sid, prompt, output)
        self.sched.add_request(req)
        batch = self.sched.next_batch()
        if batch is None or not any(r is req for r in batch.reqs):
            self.drop(req)
            if batch is not None:
                self.forward.run(batch)
                self.sched.finish_batch(batch)
            return None
        self.forward.run(batch)
        self._unprocessed = batch
        return req

    def finish(self, req: Any) -> None:
        """Run the scheduler until ``req`` has its output and is released into the tree (the hooked
        insert records the turn), then the next iteration's merge, so an idle server reads idle."""
        self._flush_unprocessed()
        while not req.finished():
            batch = self.iterate()
            assert batch is not None, f"{req.rid} cannot run: nothing scheduled"
        batch = self.sched.next_batch()
        if batch is not None:
            self.forward.run(batch)
            self._unprocessed = batch

    def _flush_unprocessed(self) -> None:
        if self._unprocessed is not None:
            batch, self._unprocessed = self._unprocessed, None
            self.sched.finish_batch(batch)

    # ---- bytes --------------------------------------------------------------------------------------
    def match_device(self, tokens: list[int]) -> tuple[torch.Tensor, Any]:
        raise NotImplementedError

    def verify_prefix(self, tokens: list[int], indices: torch.Tensor) -> bool:
        """``indices`` hold exactly the KV of ``tokens``' first ``len(indices)`` tokens."""
        return self.forward.equal(tokens, indices)

    @property
    def bytes_checked(self) -> int:
        return self.forward.bytes_checked

    @property
    def byte_mismatches(self) -> int:
        return self.forward.byte_mismatches

    # ---- copies -------------------------------------------------------------------------------------
    def check_events(self) -> None:
        self.h.check_events()

    def progress_copies(self, rng: random.Random) -> None:
        """The copy engine finishes some of what is in flight (oldest first, per stream)."""
        if not self.h.is_hi:
            return
        for which, p_all in (("write", 0.5), ("load", 0.8)):
            n = self.h.pending(which)
            if n:
                self.h.complete(which, n if rng.random() < p_all else rng.randint(0, n))

    def busy(self) -> bool:
        """Anything queued or in flight on the copy engine."""
        if not self.h.is_hi:
            return False
        c = self.h.tree.cache_controller
        return bool(
            self.h.pending("write")
            or self.h.pending("load")
            or c.load_queue
            or c.ack_write_queue
            or c.ack_load_queue
            or getattr(c, "write_queue", None)
            or self.h.tree.ongoing_write_through
            or self.h.tree.ongoing_load_back
        )

    def occupancy(self) -> tuple[int, int]:
        """(device tokens in use, host tokens in use)."""
        dev = int(self.h.allocator.size - self.h.allocator.available_size())
        hp = self.h.host_pool
        host = int(hp.size - hp.available_size()) if hp is not None else 0
        return dev, host

    @property
    def device_size(self) -> int:
        return int(self.h.allocator.size)

    @property
    def host_size(self) -> int:
        return int(self.h.host_pool.size) if self.h.host_pool is not None else 0

    def accounting(self) -> Any:
        return self.h.accounting()

    def drain(self) -> None:
        self.h.drain()

    def close(self) -> None:
        self.h.close()


class Server0516(Server):
    """sglang 0.5.16: ``HiRadixCache`` (backend hiradix) or a plain ``RadixCache`` (pin, shadow)."""

    tree_api = "radix"

    def __init__(
        self,
        kind: ServerKind,
        *,
        device_tokens: int,
        host_ratio: float,
        context_len: int,
        write_policy: str = "write_through",
        **sizes: Any,
    ) -> None:
        from toolkv.testing.harness import CacheHarness, HarnessConfig

        h = CacheHarness(
            HarnessConfig(
                kind="hiradix" if kind == "hiradix" else "radix",
                device_tokens=device_tokens,
                host_ratio=host_ratio,
                max_reqs=64,
                context_len=context_len,
                write_policy=write_policy,
            )
        )
        super().__init__(h, kind, **sizes)

    def match_device(self, tokens: list[int]) -> tuple[torch.Tensor, Any]:
        m = self.h.match(tokens)
        return m.device_indices, m.last_device_node


class Server0523(Server):
    """sglang 0.5.23: ``UnifiedRadixCache`` with HiCache and the Python tree core."""

    tree_api = "unified"

    def __init__(
        self,
        *,
        device_tokens: int,
        host_ratio: float,
        context_len: int,
        write_policy: str = "write_through",
        tree_core: str = "python",
        **sizes: Any,
    ) -> None:
        from sglang.srt.runtime_context import get_parallel

        from toolkv.testing.unified_harness import UnifiedCacheHarness, UnifiedHarnessConfig

        self._ctx = contextlib.ExitStack()
        self._ctx.enter_context(get_parallel().override(tp_rank=0, attn_tp_rank=0))
        h = UnifiedCacheHarness(
            UnifiedHarnessConfig(
                device_tokens=device_tokens,
                host_ratio=host_ratio,
                max_reqs=64,
                context_len=context_len,
                write_policy=write_policy,
                tree_core=tree_core,  # type: ignore[arg-type]  # checked by UnifiedHarnessConfig
            )
        )
        super().__init__(h, "unified", **sizes)

    def match_device(self, tokens: list[int]) -> tuple[torch.Tensor, Any]:
        m = self.h.match(tokens)
        return self.h.tree.path_device_indices(m.last_device_node)[: m.device_prefix_len], m.last_device_node

    def close(self) -> None:
        self.h.close()
        self._ctx.close()


def make_server(
    kind: ServerKind,
    *,
    device_tokens: int,
    host_ratio: float,
    context_len: int,
    write_policy: str = "write_through",
    tree_core: str = "python",
    **sizes: Any,
) -> Server:
    """The server of ``kind`` (``unified`` needs sglang 0.5.21+, the others 0.5.16), with HiCache's
    ``write_policy``, 0.5.23's ``tree_core`` and the scheduler's ``sizes`` (``chunked_prefill_size``, ...)."""
    shape: dict[str, Any] = dict(device_tokens=device_tokens, host_ratio=host_ratio, context_len=context_len)
    if kind == "unified":
        return Server0523(**shape, write_policy=write_policy, tree_core=tree_core, **sizes)
    return Server0516(kind, **shape, write_policy=write_policy, **sizes)
