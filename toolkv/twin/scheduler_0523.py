"""sglang 0.5.23's scheduler over its real ``UnifiedRadixCache`` (the twin's other half of
:mod:`toolkv.twin.scheduler`, which models 0.5.16).

The same split as for 0.5.16: sglang's own ``Req`` (``init_next_round_input`` ->
``mem_cache/common.py::match_kv_cache``), ``PrefillAdder`` (``managers/schedule_policy.py``),
``SchedulePolicy.calc_priority``, ``NewTokenRatioTracker``, the allocators
(``mem_cache/allocation.py::alloc_req_slots`` / ``alloc_token_slots``), the release paths
(``mem_cache/common.py::release_kv_cache`` / ``checkpoint_kv_cache``, ``schedule_batch.py::
release_req``), ``ScheduleBatch.check_decode_mem`` / ``_get_decode_retraction_order`` are called;
the batch building that needs a model and forward buffers is re-implemented. What 0.5.23 does
differently from 0.5.16, each in the function named:

- ``scheduler.py::Scheduler._get_new_batch_prefill_raw``: an empty running batch clears
  ``batch_is_full`` before anything else (0.5.16 kept it set, which could stall a server for
  good); ``NO_TOKEN`` sets ``batch_is_full`` when something was admitted or runs, with or without
  HiCache (0.5.16 set it unconditionally without HiCache); the walk stops when
  ``PrefillAdder.budget_state()`` is ``OTHER``; a chunked request's next chunk is capped by
  ``SchedulePolicy.shortest_prefill_chunk_limit``; the allocatable count subtracts rows the
  admitted requests already hold (``get_num_allocatable_reqs(num_held_rows=...)``).
- ``scheduler.py::Scheduler.get_next_batch_to_run``: the chunked request is stashed with
  ``stash_chunked_request`` -> ``common.py::checkpoint_kv_cache`` (the tree's ``checkpoint``,
  where toolkv's 0.5.23 hook ``after_checkpoint`` records finished turns), not
  ``cache_unfinished_req``; HiCache events are processed first (``_process_hicache_events``).
- ``allocation.py::alloc_for_extend``: the prefix comes from ``tree_cache.prefix_device_indices``
  for a request without a row; ``kv_allocated_len``/``kv_committed_len`` live in ``req.kv``;
  ``tree_cache.maybe_hand_to_session`` runs per request.
- ``scheduler.py::Scheduler.update_running_batch`` / ``schedule_batch.py::retract_decode``: the
  same retraction order; a last request that still does not fit is aborted (never reached here:
  the twin's requests are far smaller than the pool).
- ``batch_result_processor.py::process_batch_result_prefill`` / ``_decode``: a finished request
  ``release_kv_cache(checkpoint=True)``, an unfinished prefill ``checkpoint_kv_cache``.
"""

from __future__ import annotations

from typing import Any

import torch

from toolkv.twin.scheduler import Batch, Hook, TwinScheduler


class TwinScheduler0523(TwinScheduler):
    """:class:`TwinScheduler` with 0.5.23's admission, allocation and release."""

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
    ) -> None:
        from sglang.srt.managers.schedule_policy import SchedulePolicy
        from sglang.srt.managers.scheduler_components.new_token_ratio_tracker import (
            NewTokenRatioTracker,
        )

        self.h = harness
        self.tree = harness.tree
        self.hicache = harness.is_hi
        # 0.5.23's ServerArgs are read-only once resolved; the scheduler passes these three to
        # PrefillAdder itself (_get_new_batch_prefill_raw), and nothing the twin calls reads them
        self.server_args = args = harness.server_args
        self.page_size = harness.cfg.page_size
        self.chunked_prefill_size = chunked_prefill_size
        self.max_prefill_tokens = max_prefill_tokens
        self.max_running_requests = max_running_requests
        self.ratio = NewTokenRatioTracker.from_config()
        self.policy = SchedulePolicy(args.schedule_policy, self.tree, self.hicache, False, False)
        self.waiting_queue: list[Any] = []
        self.running_batch = self._new_batch([])
        self.chunked_req: Any = None
        self.last_batch: Batch | None = None
        self.on_admitted = on_admitted
        self.on_first_token = on_first_token
        self.on_finished = on_finished
        self.on_retracted = on_retracted
        self.retractions = 0
        self.prefill_tokens = 0
        self.cached_tokens = 0

    def _new_batch(self, reqs: list[Any]) -> Any:
        from sglang.srt.managers.schedule_batch import ScheduleBatch
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        return ScheduleBatch(
            reqs=reqs,
            req_to_token_pool=self.h.req_pool,
            token_to_kv_pool_allocator=self.h.allocator,
            tree_cache=self.tree,
            spec_algorithm=SpeculativeAlgorithm.NONE,
        )

    # ---- one iteration ---------------------------------------------------------------------------
    def next_batch(self) -> Batch | None:
        """``get_next_batch_to_run`` (0.5.23)."""
        from sglang.srt.mem_cache.common import checkpoint_kv_cache

        if self.hicache:
            self.tree.check_hicache_events()  # _process_hicache_events
        chunked = self.chunked_req
        if chunked is not None and chunked.extend_end > chunked.prefix_len:
            checkpoint_kv_cache(chunked, self.tree)  # stash_chunked_request
        last = self.last_batch
        self.last_batch = None
        rb = self.running_batch
        if last is not None and last.mode == "prefill":
            keep = [r for r in last.reqs if r is not chunked and not r.finished()]
            if len(keep) < len(last.reqs):
                rb.batch_is_full = False
            if keep:
                if not rb.reqs:
                    self.running_batch = rb = self._new_batch(keep)
                else:
                    rb.reqs.extend(keep)
        before = len(rb.reqs)
        rb.reqs = [r for r in rb.reqs if not r.finished()]  # running_batch.filter_batch()
        if len(rb.reqs) < before:
            rb.batch_is_full = False
        batch = self._new_prefill()
        if batch is None and self.running_batch.reqs:
            batch = self._decode()
        self.last_batch = batch
        return batch

    def _allocatable(self, held: int = 0) -> int:
        """``get_num_allocatable_reqs``: pp budget and free request rows (plus rows held)."""
        running = len(self.running_batch.reqs)
        rows = max(int(self.h.req_pool.available_size()) + held, 0)
        return min(self.max_running_requests - running, rows)

    def _new_prefill(self) -> Batch | None:
        """``_get_new_batch_prefill_raw`` (0.5.23), fcfs, no LoRA/grammar/priorities/storage."""
        from sglang.srt.managers.schedule_policy import AddReqResult, PrefillAdder

        rb = self.running_batch
        if not rb.reqs:
            rb.batch_is_full = False
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
            adder.chunked_req_limit = self.policy.shortest_prefill_chunk_limit(
                self.chunked_req, self.waiting_queue, adder.rem_chunk_tokens or 0, self.page_size
            )
            self.chunked_req = adder.add_chunked_req(self.chunked_req)
        for req in self.waiting_queue:
            if adder.budget_state() == AddReqResult.OTHER:
                break
            held = sum(r.kv.holds_kv for r in adder.can_run_list)
            if len(adder.can_run_list) >= self._allocatable(held):
                rb.batch_is_full = True
            if rb.batch_is_full:
                break
            req.init_next_round_input(self.tree)
            res = adder.add_one_req(
                req, has_chunked_req=self.chunked_req is not None, truncation_align_size=None
            )
            if res != AddReqResult.CONTINUE:
                if res == AddReqResult.NO_TOKEN:
                    rb.batch_is_full = len(adder.can_run_list) > 0 or bool(rb.reqs)
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
        if self.on_admitted is not None:
            for req in can_run:
                self.on_admitted(req)
        return Batch("prefill", list(can_run), chunks=chunks, loads=loads)

    def _alloc_extend(self, reqs: list[Any]) -> list[tuple[int, int]]:
        """``prepare_for_extend`` + ``alloc_for_extend`` (0.5.23, page size 1)."""
        from sglang.srt.mem_cache.allocation import alloc_req_slots, alloc_token_slots

        r2t = self.h.req_pool.req_to_token
        prefixes = []
        for r in reqs:  # _prefix_kv_indices
            if r.kv.holds_kv:
                prefixes.append(r2t[r.kv.req_pool_idx, : r.prefix_len].to(torch.int64))
            elif r.prefix_len == 0:
                prefixes.append(torch.empty(0, dtype=torch.int64))
            else:
                prefixes.append(self.tree.prefix_device_indices(r))
        pre = [r.prefix_len for r in reqs]
        seqs = [r.extend_end for r in reqs]
        ext = [s - p for s, p in zip(seqs, pre, strict=True)]
        alloc_req_slots(self.h.req_pool, reqs, self.tree)
        out = alloc_token_slots(self.tree, sum(ext)) if sum(ext) else torch.empty(0, dtype=torch.int64)
        at = 0
        chunks = []
        for r, p, seq, n, prefix in zip(reqs, pre, seqs, ext, prefixes, strict=True):
            row = r.kv.req_pool_idx
            if p:
                r2t[row, :p] = prefix.to(r2t.dtype)
            r2t[row, p:seq] = out[at : at + n].to(r2t.dtype)
            at += n
            r.kv.kv_allocated_len = seq
            r.kv.kv_committed_len = seq
            self.tree.maybe_hand_to_session(r)
            r.extend_batch_idx += 1
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
        """``update_running_batch`` + ``prepare_for_decode``/``alloc_for_decode_default``."""
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
            r2t[r.kv.req_pool_idx, r.kv.kv_committed_len] = int(out[i])
            r.kv.kv_allocated_len += 1
            r.kv.kv_committed_len += 1
            r.decode_batch_idx += 1
            context += r.kv.kv_committed_len
        return Batch("decode", list(rb.reqs), context=context)

    def _retract(self) -> None:
        """``ScheduleBatch.retract_decode`` (0.5.23)."""
        from sglang.srt.managers.schedule_batch import ScheduleBatch, release_req
        from sglang.srt.managers.scheduler_components.new_token_ratio_tracker import (
            NewTokenRatioTracker,
        )

        rb = self.running_batch
        order = ScheduleBatch._get_decode_retraction_order(rb.reqs)
        retracted = []
        first = True
        while first or not rb.check_decode_mem(selected_indices=order):
            if len(order) == 1:
                break
            first = False
            idx = order.pop()
            req = rb.reqs[idx]
            retracted.append(req)
            release_req(
                req=req, remaing_req_count=len(order), req_to_token_pool=self.h.req_pool,
                token_to_kv_pool_allocator=self.h.allocator, tree_cache=self.tree, hisparse_coordinator=None,
            )  # fmt: skip
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
        """``process_batch_result_prefill``/``_decode`` (0.5.23)."""
        from sglang.srt.mem_cache.common import checkpoint_kv_cache, release_kv_cache

        for req in batch.reqs:
            if req.finished() or req.is_retracted:
                continue
            if batch.mode == "prefill" and req.inflight_middle_chunks > 0:
                req.inflight_middle_chunks -= 1
                continue
            first = len(req.output_ids) == 0
            req.output_ids.append(1000 + len(req.output_ids))
            if first and self.on_first_token is not None:
                self.on_first_token(req)
            req.update_finish_state()
            if req.finished():
                release_kv_cache(req, self.tree, checkpoint=True)
                if self.on_finished is not None:
                    self.on_finished(req)
            elif batch.mode == "prefill":
                checkpoint_kv_cache(req, self.tree)
