"""sglang 0.5.23's scheduler over its real ``UnifiedRadixCache`` (the twin's other half of
:mod:`toolkv.twin.scheduler`, which models 0.5.16).

The same split as for 0.5.16: sglang's own ``Req`` (``init_next_round_input`` ->
``mem_cache/common.py::match_kv_cache``), ``PrefillAdder`` (``managers/schedule_policy.py``),
``SchedulePolicy.calc_priority``, ``NewTokenRatioTracker``, the allocators
(``mem_cache/allocation.py::alloc_req_slots`` / ``alloc_token_slots``), the release paths
(``mem_cache/common.py::release_kv_cache`` / ``checkpoint_kv_cache``, ``schedule_batch.py::
release_req``), ``ScheduleBatch.check_decode_mem`` / ``_get_decode_retraction_order`` are called;
the batch building that needs a model and forward buffers is re-implemented, once, in
:class:`~toolkv.twin.scheduler.TwinScheduler`. What 0.5.23 does differently from 0.5.16, each in
the function named, is what this class's overrides of that class's release hooks do:

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
  ``cache_unfinished_req``; HiCache events are processed first (``_process_hicache_events``);
  the merged running batch drops its finished requests at once (``filter_batch``).
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

from toolkv.twin.scheduler import TwinScheduler


class TwinScheduler0523(TwinScheduler):
    """:class:`TwinScheduler` with 0.5.23's admission, allocation and release: its release hooks,
    each naming the 0.5.23 function it models; the walk that calls them is the base class's."""

    # ---- construction ----------------------------------------------------------------------------
    def _apply_server_args(self) -> None:
        """Nothing: 0.5.23's ServerArgs are read-only once resolved; the scheduler passes the
        chunk, prefill and running sizes to ``PrefillAdder`` itself (``_get_new_batch_prefill_raw``),
        and nothing the twin calls reads them from the args."""

    def _new_token_ratio_tracker(self) -> Any:
        """``NewTokenRatioTracker.from_config`` (0.5.23 reads the environment, not the args)."""
        from sglang.srt.managers.scheduler_components.new_token_ratio_tracker import (
            NewTokenRatioTracker,
        )

        return NewTokenRatioTracker.from_config()

    # ---- get_next_batch_to_run (0.5.23) ----------------------------------------------------------
    def _before_next_batch(self) -> None:
        """``get_next_batch_to_run`` processes HiCache events first (``_process_hicache_events``)."""
        if self.hicache:
            self.tree.check_hicache_events()

    def _stash_chunked_request(self, chunked: Any) -> None:
        """``stash_chunked_request`` -> ``common.py::checkpoint_kv_cache`` (the tree's
        ``checkpoint``, where toolkv's 0.5.23 hook ``after_checkpoint`` records finished turns)."""
        if chunked.extend_end > chunked.prefix_len:
            from sglang.srt.mem_cache.common import checkpoint_kv_cache

            checkpoint_kv_cache(chunked, self.tree)

    def _filter_running_batch(self) -> None:
        """``running_batch.filter_batch()`` after the merge: finished requests leave, and a batch
        that shrank is no longer full."""
        rb = self.running_batch
        before = len(rb.reqs)
        rb.reqs = [r for r in rb.reqs if not r.finished()]
        if len(rb.reqs) < before:
            rb.batch_is_full = False

    # ---- _get_new_batch_prefill_raw (0.5.23) -----------------------------------------------------
    def _begin_prefill(self, rb: Any) -> None:
        """An empty running batch clears ``batch_is_full`` before anything else (0.5.16 kept it
        set, which could stall a server for good)."""
        if not rb.reqs:
            rb.batch_is_full = False

    def _limit_chunked_req(self, adder: Any, chunked: Any) -> None:
        """The chunked request's next chunk is capped by ``SchedulePolicy.shortest_prefill_chunk_limit``."""
        adder.chunked_req_limit = self.policy.shortest_prefill_chunk_limit(
            chunked, self.waiting_queue, adder.rem_chunk_tokens or 0, self.page_size
        )

    def _budget_spent(self, adder: Any) -> bool:
        """The walk stops when ``PrefillAdder.budget_state()`` is ``OTHER``."""
        from sglang.srt.managers.schedule_policy import AddReqResult

        return bool(adder.budget_state() == AddReqResult.OTHER)

    def _held_rows(self, can_run: list[Any]) -> int:
        """``get_num_allocatable_reqs(num_held_rows=...)``: rows the admitted requests hold."""
        return sum(r.kv.holds_kv for r in can_run)

    def _full_on_no_token(self, adder: Any, rb: Any) -> bool:
        """``NO_TOKEN`` sets ``batch_is_full`` when something was admitted or runs, with or without
        HiCache (0.5.16 set it unconditionally without HiCache)."""
        return len(adder.can_run_list) > 0 or bool(rb.reqs)

    # ---- allocation.py (0.5.23, page size 1) -----------------------------------------------------
    def _extend_span(self, req: Any) -> tuple[int, int, torch.Tensor]:
        """``alloc_for_extend``'s ``_prefix_kv_indices``: a request that holds a row reads its
        prefix from it, one without a row from ``tree_cache.prefix_device_indices``."""
        r2t = self.h.req_pool.req_to_token
        if req.kv.holds_kv:
            prefix = r2t[req.kv.req_pool_idx, : req.prefix_len].to(torch.int64)
        elif req.prefix_len == 0:
            prefix = torch.empty(0, dtype=torch.int64)
        else:
            prefix = self.tree.prefix_device_indices(req)
        return req.prefix_len, req.extend_end, prefix

    def _req_row(self, req: Any) -> int:
        """The row lives in ``req.kv``."""
        return int(req.kv.req_pool_idx)

    def _commit_extend(self, req: Any, seq: int) -> None:
        """``kv_allocated_len``/``kv_committed_len`` live in ``req.kv``;
        ``tree_cache.maybe_hand_to_session`` runs per request; ``extend_batch_idx`` counts."""
        req.kv.kv_allocated_len = seq
        req.kv.kv_committed_len = seq
        self.tree.maybe_hand_to_session(req)
        req.extend_batch_idx += 1

    def _committed_len(self, req: Any) -> int:
        """The committed KV length lives in ``req.kv``."""
        return int(req.kv.kv_committed_len)

    def _commit_decode(self, req: Any) -> None:
        """``alloc_for_decode_default``'s bookkeeping: the lengths in ``req.kv``, and
        ``decode_batch_idx``."""
        req.kv.kv_allocated_len += 1
        req.kv.kv_committed_len += 1
        req.decode_batch_idx += 1

    # ---- update_running_batch / retract_decode (0.5.23) ------------------------------------------
    def _retraction_order(self, reqs: list[Any]) -> list[int]:
        """``ScheduleBatch._get_decode_retraction_order``: the same order, without server args."""
        from sglang.srt.managers.schedule_batch import ScheduleBatch

        order: list[int] = ScheduleBatch._get_decode_retraction_order(reqs)
        return order

    def _release_retracted(self, req: Any, remaining: int) -> None:
        """``release_req`` without server args."""
        from sglang.srt.managers.schedule_batch import release_req

        release_req(
            req=req, remaing_req_count=remaining, req_to_token_pool=self.h.req_pool,
            token_to_kv_pool_allocator=self.h.allocator, tree_cache=self.tree, hisparse_coordinator=None,
        )  # fmt: skip

    # ---- process_batch_result_prefill / _decode (0.5.23) -----------------------------------------
    def _release_finished(self, req: Any) -> None:
        """A finished request: ``release_kv_cache(checkpoint=True)``."""
        from sglang.srt.mem_cache.common import release_kv_cache

        release_kv_cache(req, self.tree, checkpoint=True)

    def _cache_unfinished(self, req: Any) -> None:
        """An unfinished prefill: ``checkpoint_kv_cache``."""
        from sglang.srt.mem_cache.common import checkpoint_kv_cache

        checkpoint_kv_cache(req, self.tree)
