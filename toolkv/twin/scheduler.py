"""sglang 0.5.16's scheduler, the part that decides what the GPU runs, over the REAL cache.

What is sglang's own code here, called as the scheduler calls it:

- ``Req`` (managers/schedule_batch.py) for every request, with its real ``SamplingParams``;
  ``Req.init_next_round_input`` matches the prefix in the real tree (device and host hits).
- ``PrefillAdder`` (managers/schedule_policy.py): the prefill token budget, ``rem_total_tokens``
  with ``new_token_ratio``, chunked prefill, ``add_one_req``'s lock and HiCache ``init_load_back``,
  ``add_chunked_req``. Its running batch is a real ``ScheduleBatch`` holding the running ``Req``s.
- ``SchedulePolicy.calc_priority`` (fcfs, the server default), ``NewTokenRatioTracker``
  (managers/scheduler_components/new_token_ratio_tracker.py): init, decay per decode step, the
  estimate after a retraction.
- Memory: ``alloc_req_slots`` / ``alloc_token_slots`` (mem_cache/allocation.py, which evict from
  the tree when short), ``release_kv_cache`` / ``maybe_cache_unfinished_req`` (mem_cache/common.py:
  ``cache_finished_req`` / ``cache_unfinished_req`` of the tree, so write-through and toolkv's
  ``on_finished`` hook run), ``release_req`` (schedule_batch.py) for a retraction,
  ``ScheduleBatch.check_decode_mem`` and ``_get_decode_retraction_order``.
- HiCache: ``check_hicache_events`` every iteration, ``ready_to_load_host_cache`` when a prefill
  batch is built, ``flush_write_through_acks`` before a decode step.

What is re-implemented, because sglang builds it from a model and GPU tensors (``ScheduleBatch.
init_new``/``prepare_for_extend``/``prepare_for_decode`` need a ``ModelConfig`` and forward
buffers), in the order sglang runs it:

- ``Scheduler.get_next_batch_to_run`` (managers/scheduler.py): stash the chunked request
  (``stash_chunked_request``), merge the last prefill batch into the running batch, prefill first
  if one can be built, else ``update_running_batch``;
- ``Scheduler._get_new_batch_prefill_raw``: the waiting-queue walk, ``batch_is_full``;
- ``alloc_for_extend`` / ``alloc_for_decode`` (mem_cache/allocation.py): the token slots go
  through sglang's ``alloc_token_slots``; only the ``req_to_token`` write is ours;
- ``prepare_for_extend``'s ``cached_tokens`` bookkeeping (what ``meta_info.cached_tokens``
  reports), ``retract_decode`` (schedule_batch.py) without ``filter_batch``'s tensors;
- ``process_batch_result_prefill``/``_decode`` (scheduler_components/batch_result_processor.py):
  the first token, ``update_finish_state``, then release or cache-unfinished.

Not modelled: overlap scheduling (a batch's results are processed before the next is built),
mixed chunks (off by default), priorities, LoRA, grammar, speculative decoding.

The walk above is written once, here; what a release does differently (which ``Req`` fields hold
the KV lengths, which release function caches a request, the admission rules 0.5.23 changed) is
in small hooks (the ``# ---- release hooks`` section) that :mod:`toolkv.twin.scheduler_0523`
overrides, so both releases' schedulers are the same walk by construction.

It is the scheduler model of the drivers that run a server on their own time: a driver calls
:meth:`TwinScheduler.next_batch`, moves its clock by what its :class:`~toolkv.twin.clock.Clock`
says the iteration took, then :meth:`TwinScheduler.finish_batch` (the twin:
:class:`~toolkv.twin.clock.ModelledGpuTime`; the fleet's servers and the L3 scheduler are the
twin's). Time is not this class's business: it never reads a clock.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

Hook = Callable[[Any], None]
Sampler = Callable[[Any], int]  # the next output token of a request (the model's sample)


def sampled_id(req: Any) -> int:
    """The twin's sample: a fixed id per output position (the twin counts tokens, not their ids)."""
    return 1000 + len(req.output_ids)


@dataclass
class Batch:
    """One forward: ``chunks`` holds (cached prefix, new tokens) per request for a prefill, and
    ``context`` the summed sequence length for a decode step."""

    mode: str  # "prefill" | "decode"
    reqs: list[Any]
    chunks: list[tuple[int, int]] = field(default_factory=list)
    context: int = 0
    loads: bool = False  # a HiCache load into this batch's prefixes was started

    def is_empty(self) -> bool:
        """``ScheduleBatch.is_empty`` (what ``Scheduler.is_fully_idle`` asks of ``last_batch``)."""
        return not self.reqs


class TwinScheduler:
    """The scheduling half of sglang's ``Scheduler`` over one real tree.

    ``on_admitted(req)`` is called for every request of a new prefill batch once the batch is
    formed (``PrefillAdder`` matched and locked its prefix, its memory is allocated): where the
    plugin's AFTER hook on ``get_new_batch_prefill`` runs; ``on_first_token(req)`` and ``on_finished(req)``
    when a result is processed; ``on_retracted(req)`` when decode memory ran out. ``sample(req)``
    is the token a forward samples for a request (the twin's fixed ids by default; a driver that
    checks KV bytes passes the ids its client expects).

    The methods up to ``# ---- release hooks`` are the walk both releases share; the hooks below
    it are 0.5.16's, and :class:`~toolkv.twin.scheduler_0523.TwinScheduler0523` overrides them."""

    def __init__(
        self,
        harness: Any,
        *,
        chunked_prefill_size: int = 8192,
        max_prefill_tokens: int = 16384,
        max_running_requests: int = 256,
        on_admitted: Hook | None = None,
        on_first_token: Hook | None = None,
        on_finished: Hook | None = None,
        on_retracted: Hook | None = None,
        sample: Sampler = sampled_id,
    ) -> None:
        from sglang.srt.managers.schedule_policy import SchedulePolicy

        self.h = harness
        self.tree = harness.tree
        self.hicache = harness.is_hi
        self.server_args = args = harness.server_args
        self.page_size = harness.cfg.page_size
        self.chunked_prefill_size = chunked_prefill_size
        self.max_prefill_tokens = max_prefill_tokens
        self.max_running_requests = max_running_requests
        self._apply_server_args()  # before anything below reads the (global) server args
        self.ratio = self._new_token_ratio_tracker()
        self.policy = SchedulePolicy(args.schedule_policy, self.tree, self.hicache, False, False)
        self.waiting_queue: list[Any] = []
        self.running_batch = self._new_batch([])
        self.chunked_req: Any = None
        self.last_batch: Batch | None = None
        self.on_admitted = on_admitted
        self.on_first_token = on_first_token
        self.on_finished = on_finished
        self.on_retracted = on_retracted
        self.sample = sample
        self.retractions = 0
        self.prefill_tokens = 0  # computed prompt tokens (new KV written by prefill)
        self.cached_tokens = 0  # prompt tokens served from cache at admission

    def _new_batch(self, reqs: list[Any]) -> Any:
        """A real ``ScheduleBatch`` that only holds the running requests: what ``PrefillAdder``,
        ``check_decode_mem`` and toolkv's ``promised_tokens`` read from it."""
        from sglang.srt.managers.schedule_batch import ScheduleBatch
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        return ScheduleBatch(
            reqs=reqs,
            req_to_token_pool=self.h.req_pool,
            token_to_kv_pool_allocator=self.h.allocator,
            tree_cache=self.tree,
            spec_algorithm=SpeculativeAlgorithm.NONE,
        )

    # ---- requests --------------------------------------------------------------------------------
    def add_request(self, req: Any) -> None:
        """``_add_request_to_queue``: the waiting queue is FIFO (retracted requests go to its end)."""
        self.waiting_queue.append(req)

    @property
    def stalled(self) -> bool:
        """sglang never serves again: ``batch_is_full`` is set (a plain RadixCache's NO_TOKEN sets
        it unconditionally) while nothing runs, and only a running or last prefill batch that
        shrinks, or ``update_running_batch`` on a non-empty batch, ever clears it."""
        rb = self.running_batch
        return bool(rb.batch_is_full and not rb.reqs and self.chunked_req is None and self.waiting_queue)

    @property
    def busy(self) -> bool:
        return bool(self.waiting_queue or self.running_batch.reqs or self.chunked_req is not None)

    # ---- one iteration ---------------------------------------------------------------------------
    def next_batch(self) -> Batch | None:
        """``get_next_batch_to_run``: returns the forward to run now, with its memory allocated."""
        self._before_next_batch()
        chunked = self.chunked_req
        if chunked is not None:
            self._stash_chunked_request(chunked)
        last = self.last_batch
        self.last_batch = None
        if last is not None and last.mode == "prefill":
            keep = [r for r in last.reqs if r is not chunked and not r.finished()]
            if len(keep) < len(last.reqs):
                self.running_batch.batch_is_full = False
            if keep and not self.running_batch.reqs:
                # ``running_batch = last_batch``: a new batch object, so its batch_is_full is False
                self.running_batch = self._new_batch(keep)
            else:
                self.running_batch.reqs.extend(keep)
        self._filter_running_batch()
        batch = self._new_prefill()
        if batch is None and self.running_batch.reqs:
            batch = self._decode()
        self.last_batch = batch
        return batch

    def _allocatable(self, held: int = 0) -> int:
        """``get_num_allocatable_reqs``: the running-request budget and the free request rows
        (plus ``held``, rows the admitted requests already hold: 0.5.23's ``num_held_rows``)."""
        running = len(self.running_batch.reqs)
        rows = max(int(self.h.req_pool.available_size()) + held, 0)
        return min(self.max_running_requests - running, rows)

    def _new_prefill(self) -> Batch | None:
        """``_get_new_batch_prefill_raw`` (scheduler.py), fcfs, no LoRA/grammar/priorities."""
        from sglang.srt.managers.schedule_policy import AddReqResult, PrefillAdder

        rb = self.running_batch
        self._begin_prefill(rb)
        if (rb.batch_is_full or not self.waiting_queue) and self.chunked_req is None:
            return None
        if self._allocatable() <= 0 and self.chunked_req is None:
            rb.batch_is_full = True
            return None
        self.policy.calc_priority(self.waiting_queue, rb)
        adder = PrefillAdder(
            self.page_size, self.tree, self.h.allocator, rb, self.ratio.current,
            self.max_prefill_tokens, self.chunked_prefill_size, 0, 0,
            max_running_requests=self.max_running_requests, waiting_queue_len=len(self.waiting_queue),
        )  # fmt: skip
        if self.chunked_req is not None:
            self.chunked_req.init_next_round_input()
            self._limit_chunked_req(adder, self.chunked_req)
            self.chunked_req = adder.add_chunked_req(self.chunked_req)
        for req in self.waiting_queue:
            if self._budget_spent(adder):
                break
            if len(adder.can_run_list) >= self._allocatable(self._held_rows(adder.can_run_list)):
                rb.batch_is_full = True
            if rb.batch_is_full:
                break
            req.init_next_round_input(self.tree)
            res = adder.add_one_req(
                req, has_chunked_req=self.chunked_req is not None, truncation_align_size=None
            )
            if res != AddReqResult.CONTINUE:
                if res == AddReqResult.NO_TOKEN:
                    rb.batch_is_full = self._full_on_no_token(adder, rb)
                break
        can_run = adder.can_run_list
        if not can_run:
            return None
        chosen = set(map(id, can_run))
        self.waiting_queue = [r for r in self.waiting_queue if id(r) not in chosen]
        if adder.new_chunked_req is not None:
            assert self.chunked_req is None
            self.chunked_req = adder.new_chunked_req
        if self.chunked_req is not None:
            self.chunked_req.inflight_middle_chunks += 1
        loads = False
        if self.hicache:
            before = self._pending_loads()
            self.tree.ready_to_load_host_cache()
            loads = self._pending_loads() > before or before > 0
        chunks = self._alloc_extend(can_run)
        if self.on_admitted is not None:  # the plugin's AFTER hook on get_new_batch_prefill
            for req in can_run:
                self.on_admitted(req)
        return Batch("prefill", list(can_run), chunks=chunks, loads=loads)

    def _pending_loads(self) -> int:
        ctrl = self.tree.cache_controller
        return sum(1 for a in ctrl.ack_load_queue if not a.finish_event.query())

    def _alloc_extend(self, reqs: list[Any]) -> list[tuple[int, int]]:
        """``prepare_for_extend`` + ``alloc_for_extend``: slots, KV, ``cached_tokens``."""
        from sglang.srt.mem_cache.allocation import alloc_req_slots, alloc_token_slots

        spans = [self._extend_span(r) for r in reqs]  # read before alloc_req_slots gives rows
        ext = [seq - p for p, seq, _ in spans]
        alloc_req_slots(self.h.req_pool, reqs, self.tree)
        out = alloc_token_slots(self.tree, sum(ext)) if sum(ext) else torch.empty(0, dtype=torch.int64)
        r2t = self.h.req_pool.req_to_token
        at = 0
        chunks = []
        for r, (p, seq, prefix), n in zip(reqs, spans, ext, strict=True):
            row = self._req_row(r)
            if p:
                r2t[row, :p] = prefix.to(r2t.dtype)
            r2t[row, p:seq] = out[at : at + n].to(r2t.dtype)
            at += n
            self._commit_extend(r, seq)
            if not r.retracted_stain:  # prepare_for_extend: cached_tokens counted once
                new_cached = p - r.already_computed
                r.cached_tokens += new_cached
                self.cached_tokens += new_cached
                r.already_computed = seq
            r.is_retracted = False
            self.prefill_tokens += n
            chunks.append((p, n))
        return chunks

    def _decode(self) -> Batch | None:
        """``update_running_batch`` + ``prepare_for_decode``/``alloc_for_decode`` (0.5.23:
        ``alloc_for_decode_default``)."""
        from sglang.srt.mem_cache.allocation import alloc_token_slots

        rb = self.running_batch
        initial = len(rb.reqs)
        rb.reqs = [r for r in rb.reqs if not r.finished()]
        if not rb.reqs:
            rb.batch_is_full = False
            return None
        if self.hicache and hasattr(self.tree, "flush_write_through_acks"):
            self.tree.flush_write_through_acks()
        if not rb.check_decode_mem():
            self._retract()
        else:
            self.ratio.decay_step()
        if len(rb.reqs) < initial:
            rb.batch_is_full = False
        if not rb.reqs:
            return None
        out = alloc_token_slots(self.tree, len(rb.reqs))
        r2t = self.h.req_pool.req_to_token
        context = 0
        for i, r in enumerate(rb.reqs):
            r2t[self._req_row(r), self._committed_len(r)] = int(out[i])
            self._commit_decode(r)
            context += self._committed_len(r)
        return Batch("decode", list(rb.reqs), context=context)

    def _retract(self) -> None:
        """``ScheduleBatch.retract_decode``: retract the least preferred requests (fewest output
        tokens, then longest input, kept last) until the next step fits; never the last one
        (0.5.23 aborts a last one that still does not fit: never reached here, the twin's
        requests are far smaller than the pool)."""
        from sglang.srt.managers.scheduler_components.new_token_ratio_tracker import (
            NewTokenRatioTracker,
        )

        rb = self.running_batch
        order = self._retraction_order(rb.reqs)
        retracted = []
        first = True
        while first or not rb.check_decode_mem(selected_indices=order):
            if len(order) == 1:
                break
            first = False
            idx = order.pop()
            req = rb.reqs[idx]
            retracted.append(req)
            self._release_retracted(req, len(order))
        keep = set(order)
        rb.reqs = [r for i, r in enumerate(rb.reqs) if i in keep]
        self.ratio.current = NewTokenRatioTracker.estimate_new_token_ratio_after_retract(rb.reqs)
        for req in retracted:
            self.retractions += 1
            if self.on_retracted is not None:
                self.on_retracted(req)
            self.add_request(req)

    # ---- results ---------------------------------------------------------------------------------
    def finish_batch(self, batch: Batch) -> None:
        """``process_batch_result_prefill``/``_decode``: one new token per request that is not a
        middle chunk; a finished request releases its KV into the tree (``cache_finished_req``),
        an unfinished one is cached for the next round (prefill)."""
        for req in batch.reqs:
            if req.finished() or req.is_retracted:
                continue
            if batch.mode == "prefill" and req.inflight_middle_chunks > 0:
                req.inflight_middle_chunks -= 1
                continue
            first = len(req.output_ids) == 0
            req.output_ids.append(self.sample(req))
            if first and self.on_first_token is not None:
                self.on_first_token(req)
            req.update_finish_state()
            if req.finished():
                self._release_finished(req)
                if self.on_finished is not None:
                    self.on_finished(req)
            elif batch.mode == "prefill":
                self._cache_unfinished(req)

    # ---- release hooks: sglang 0.5.16 (scheduler_0523.TwinScheduler0523 overrides them) ----------
    def _apply_server_args(self) -> None:
        """The scheduler's sizes go into the server args, made the global ones that ``Req`` and
        ``PrefillAdder`` read (``set_global_server_args_for_scheduler``)."""
        from sglang.srt.server_args import set_global_server_args_for_scheduler

        args = self.server_args
        args.chunked_prefill_size = self.chunked_prefill_size
        args.max_prefill_tokens = self.max_prefill_tokens
        args.max_running_requests = self.max_running_requests
        args.pp_max_micro_batch_size = self.max_running_requests
        set_global_server_args_for_scheduler(args)  # Req/PrefillAdder read the global args

    def _new_token_ratio_tracker(self) -> Any:
        """``NewTokenRatioTracker.from_server_args``."""
        from sglang.srt.managers.scheduler_components.new_token_ratio_tracker import (
            NewTokenRatioTracker,
        )

        return NewTokenRatioTracker.from_server_args(self.server_args)

    def _before_next_batch(self) -> None:
        """What ``get_next_batch_to_run`` does before stashing the chunked request: nothing in
        0.5.16 (HiCache events are checked in ``_begin_prefill``)."""

    def _stash_chunked_request(self, chunked: Any) -> None:
        """``stash_chunked_request``: a chunked request with new tokens caches them in the tree
        (``maybe_cache_unfinished_req(chunked=True)``), so its next chunk matches them."""
        if chunked.extend_range.end > len(chunked.prefix_indices):
            from sglang.srt.mem_cache.common import maybe_cache_unfinished_req

            maybe_cache_unfinished_req(chunked, self.tree, chunked=True)

    def _filter_running_batch(self) -> None:
        """``get_next_batch_to_run``'s filter of the merged running batch: none in 0.5.16
        (finished requests leave it in ``update_running_batch``, :meth:`_decode`)."""

    def _begin_prefill(self, rb: Any) -> None:
        """The start of ``get_new_batch_prefill``: HiCache's events (finished copies) first."""
        if self.hicache:
            self.tree.check_hicache_events()

    def _limit_chunked_req(self, adder: Any, chunked: Any) -> None:
        """A cap on the chunked request's next chunk before ``add_chunked_req``: none in 0.5.16."""

    def _budget_spent(self, adder: Any) -> bool:
        """The waiting-queue walk stops before a request on the adder's budget: not in 0.5.16
        (only ``add_one_req``'s answer stops it)."""
        return False

    def _held_rows(self, can_run: list[Any]) -> int:
        """Request rows the admitted requests already hold, for :meth:`_allocatable`: 0.5.16
        does not count them."""
        return 0

    def _full_on_no_token(self, adder: Any, rb: Any) -> bool:
        """``batch_is_full`` after ``add_one_req`` answered ``NO_TOKEN``: with HiCache only when
        something was admitted or runs; without, unconditionally (which can stall a server)."""
        if self.hicache:
            return len(adder.can_run_list) > 0 or bool(rb.reqs)
        return True

    def _extend_span(self, req: Any) -> tuple[int, int, torch.Tensor]:
        """(prefix length, sequence end, prefix KV indices) of a request about to be extended:
        ``prefix_indices`` and ``extend_range`` (schedule_batch.py)."""
        p, seq = len(req.prefix_indices), req.extend_range.end
        assert seq - p == req.extend_range.length
        return p, seq, req.prefix_indices

    def _req_row(self, req: Any) -> int:
        """The request's row in ``req_to_token`` (``req.req_pool_idx``)."""
        return int(req.req_pool_idx)

    def _commit_extend(self, req: Any, seq: int) -> None:
        """``alloc_for_extend``'s bookkeeping once the row is written: ``req.kv`` (a
        ``ReqKvInfo``, made on the first extend) and ``req.kv_committed_len``."""
        from sglang.srt.managers.schedule_batch import ReqKvInfo

        if req.kv is None:
            req.kv = ReqKvInfo(kv_allocated_len=seq, swa_evicted_seqlen=0)
        else:
            req.kv.kv_allocated_len = seq
        req.kv_committed_len = seq

    def _committed_len(self, req: Any) -> int:
        """The request's committed KV length (``req.kv_committed_len``)."""
        return int(req.kv_committed_len)

    def _commit_decode(self, req: Any) -> None:
        """``alloc_for_decode``'s bookkeeping for the one new token."""
        req.kv_committed_len += 1
        req.kv.kv_allocated_len += 1

    def _retraction_order(self, reqs: list[Any]) -> list[int]:
        """``ScheduleBatch._get_decode_retraction_order`` (with the server args, policy sort on)."""
        from sglang.srt.managers.schedule_batch import ScheduleBatch

        order: list[int] = ScheduleBatch._get_decode_retraction_order(
            reqs, self.server_args, allow_policy_sort=True
        )
        return order

    def _release_retracted(self, req: Any, remaining: int) -> None:
        """``release_req`` (schedule_batch.py): a retracted request gives back its row and KV."""
        from sglang.srt.managers.schedule_batch import release_req

        release_req(
            req=req, remaing_req_count=remaining, server_args=self.server_args,
            req_to_token_pool=self.h.req_pool, token_to_kv_pool_allocator=self.h.allocator,
            tree_cache=self.tree, hisparse_coordinator=None,
        )  # fmt: skip

    def _release_finished(self, req: Any) -> None:
        """``release_kv_cache`` (mem_cache/common.py): the tree's ``cache_finished_req``, where
        write-through and toolkv's ``on_finished`` hook run."""
        from sglang.srt.mem_cache.common import release_kv_cache

        release_kv_cache(req, self.tree)

    def _cache_unfinished(self, req: Any) -> None:
        """``maybe_cache_unfinished_req`` (mem_cache/common.py): an unfinished prefill's tokens
        go into the tree for its next round."""
        from sglang.srt.mem_cache.common import maybe_cache_unfinished_req

        maybe_cache_unfinished_req(req, self.tree)


def make_scheduler(
    harness: Any, scheduler_class: type[TwinScheduler] | None = None, **kwargs: Any
) -> TwinScheduler:
    """The scheduler of ``harness``'s release: :class:`TwinScheduler` (or ``scheduler_class``, a
    subclass such as the L3 server's) over sglang 0.5.16's caches,
    :class:`~toolkv.twin.scheduler_0523.TwinScheduler0523` over a ``UnifiedRadixCache`` (0.5.21+);
    ``kwargs`` are :class:`TwinScheduler`'s."""
    from toolkv.testing.unified_harness import UnifiedCacheHarness

    if isinstance(harness, UnifiedCacheHarness):
        if scheduler_class is not None:
            raise ValueError(f"{scheduler_class.__name__} models sglang 0.5.16's scheduler, not 0.5.23's")
        from toolkv.twin.scheduler_0523 import TwinScheduler0523

        return TwinScheduler0523(harness, **kwargs)
    return (scheduler_class or TwinScheduler)(harness, **kwargs)
