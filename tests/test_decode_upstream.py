"""sglang 0.5.16's DecodeKVCacheOffloadManager on the real classes: the upstream bug this project
found (a minimal reproducer, marked as a known upstream bug, and the fix that makes it pass), and
the two bugs the class's own comments record as fixed, re-introduced as patches and observed.

The spec side of each is in ``spec/decode/``: ``decode_upstream_RadixPrefix`` (TLC finds the
bug), ``decode_radix_fix`` (the fix is safe), ``decode_mut_NoReleaseGuardDouble`` and
``decode_guard_redundant``.
"""

from __future__ import annotations

import logging
from array import array
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from research.decode_offload import fixes as decode_fixes
from research.decode_offload import mutants as decode_mutants
from research.decode_offload.harness import DecodeHarnessConfig, DecodeOffloadHarness

pytestmark = pytest.mark.filterwarnings("ignore")
PREFIX = [7001, 7002, 7003, 7004]


@pytest.fixture
def radix() -> Iterator[DecodeOffloadHarness]:
    logging.disable(logging.ERROR)
    with DecodeOffloadHarness(DecodeHarnessConfig(radix_cache=True, device_tokens=32, host_ratio=0.25)) as h:
        yield h
    logging.disable(logging.NOTSET)


def _cache_prefix(h: DecodeOffloadHarness) -> torch.Tensor:
    """An earlier request left PREFIX's KV in the decode radix cache (unlocked, evictable)."""
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    slots = h.allocator.alloc(len(PREFIX))
    assert slots is not None
    exp = h.kv(PREFIX)
    for layer in range(h.cfg.layers):
        h.kv_pool.k_buffer[layer][slots] = exp[0, layer]
        h.kv_pool.v_buffer[layer][slots] = exp[1, layer]
    h.tree.insert(InsertParams(key=RadixKey(array("q", PREFIX)), value=slots))
    return slots


def _match(h: DecodeOffloadHarness, tokens: list[int]) -> Any:
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    return h.tree.match_prefix(MatchPrefixParams(key=RadixKey(array("q", tokens))))


def _decode_and_finish(h: DecodeOffloadHarness, prefix_hit: bool) -> Any:
    """A request whose prompt starts with PREFIX is admitted with the radix cache's match (as
    ``_match_prefix_and_lock`` does), decodes, finishes; the scheduler's finish hook runs and the
    acks are drained."""
    from sglang.srt.managers.schedule_batch import FINISH_LENGTH

    m = h.manager
    prompt = [*PREFIX, 7005, 7006]
    req = h.new_request("q", prompt, 8)
    match = _match(h, prompt)
    assert len(match.device_indices) == len(PREFIX)
    assert h.admit(req, 7007, prefix=match if prefix_hit else None)
    assert h.tree.protected_size() == (len(PREFIX) if prefix_hit else 0)
    for t in (7008, 7009):
        assert h.decode_step(req, t)
        m.offload_kv_cache(req)
    req.finished_reason = FINISH_LENGTH(length=3)
    if not m.offload_kv_cache(req):
        m.finalize_release_on_finish(req)
    while h.complete_copy():
        pass
    m.check_offload_progress()
    assert h.storage is not None
    h.storage.complete(100)
    m.check_offload_progress()
    assert req.req_pool_idx is None, "the request was not released"
    return match


def _assert_tree_intact(h: DecodeOffloadHarness, cached: torch.Tensor) -> None:
    free = set(h.free_device_slots().tolist())
    assert not free & set(cached.tolist()), "the radix cache's prefix slots are on the allocator's free list"
    node = _match(h, PREFIX).last_device_node
    assert node.lock_ref == 0, f"the matched prefix is still locked (lock_ref {node.lock_ref})"
    assert h.tree.protected_size() == 0 and h.tree.evictable_size() == len(PREFIX)
    assert h.allocator.available_size() + len(PREFIX) == h.cfg.device_tokens


@pytest.mark.xfail(
    strict=True,
    raises=AssertionError,
    reason="known upstream bug (sglang 0.5.16): with --disaggregation-decode-enable-radix-cache, "
    "DecodeKVCacheOffloadManager._release_finished_req frees the radix cache's prefix slots and "
    "never unlocks the prefix (docs/decode_offload.md)",
)
def test_release_leaves_the_radix_cache_prefix_alone(radix: DecodeOffloadHarness) -> None:
    cached = _cache_prefix(radix)
    _decode_and_finish(radix, prefix_hit=True)
    _assert_tree_intact(radix, cached)


def test_the_proposed_fix_leaves_the_radix_cache_prefix_alone(radix: DecodeOffloadHarness) -> None:
    cached = _cache_prefix(radix)
    with decode_fixes.radix_prefix_release():
        _decode_and_finish(radix, prefix_hit=True)
    _assert_tree_intact(radix, cached)
    # and the tree still serves the right bytes for the prefix
    assert torch.equal(
        radix.device_kv(_match(radix, PREFIX).device_indices.to(torch.int64)), radix.kv(PREFIX)
    )


def test_without_a_prefix_hit_the_shipped_release_is_correct(radix: DecodeOffloadHarness) -> None:
    """The bug needs the prefix hit: the same request admitted without it releases cleanly."""
    cached = _cache_prefix(radix)
    _decode_and_finish(radix, prefix_hit=False)
    _assert_tree_intact(radix, cached)


# ---- the two bugs upstream's comments record as fixed --------------------------------------------------
@pytest.fixture
def chunk() -> Iterator[DecodeOffloadHarness]:
    logging.disable(logging.ERROR)
    with DecodeOffloadHarness(DecodeHarnessConfig(device_tokens=32, host_ratio=0.25)) as h:
        yield h
    logging.disable(logging.NOTSET)


def _finish_with_an_increment_in_flight(h: DecodeOffloadHarness) -> Any:
    from sglang.srt.managers.schedule_batch import FINISH_LENGTH

    m = h.manager
    req = h.new_request("g", [8001, 8002, 8003], 8)
    assert h.admit(req, 8004)
    assert h.decode_step(req, 8005)
    assert m.offload_kv_cache(req)  # one increment in flight
    req.finished_reason = FINISH_LENGTH(length=2)
    assert not m.offload_kv_cache(req)  # nothing new: the scheduler calls finalize
    m.finalize_release_on_finish(req)
    return req


@pytest.mark.parametrize("mutant", [None, "NoReleaseGuard"])
def test_a_second_release_frees_the_request_twice_without_the_guard(
    chunk: DecodeOffloadHarness, mutant: str | None
) -> None:
    with decode_mutants.apply(mutant):
        req = _finish_with_an_increment_in_flight(chunk)
        released_at_finish = req.req_pool_idx is None
        chunk.complete_copy()
        chunk.manager.check_offload_progress()  # the write ack: finished and nothing in flight
    slots = chunk.req_pool.free_slots
    if mutant is None:
        assert not released_at_finish, "0.5.16 waits for the in-flight increment"
        assert len(set(slots)) == len(slots) == chunk.cfg.max_reqs
    else:
        assert released_at_finish
        assert len(set(slots)) < len(slots), "the request slot was not freed twice"


def test_eager_prefill_free_hands_a_decoding_request_s_slots_to_others(chunk: DecodeOffloadHarness) -> None:
    m = chunk.manager
    with decode_mutants.apply("EagerPrefillFree"):
        req = chunk.new_request("e", [9001, 9002, 9003], 8)
        assert chunk.admit(req, 9004)
        assert chunk.decode_step(req, 9005)
        m.offload_kv_cache(req)  # the first call frees the prompt's slots mid-decode
    prompt_slots = chunk.req_pool.req_to_token[req.req_pool_idx, :3].tolist()
    assert set(prompt_slots) <= set(chunk.free_device_slots().tolist())
    chunk.scribble()  # another request is admitted into them
    slots = chunk.req_pool.req_to_token[req.req_pool_idx, :3].to(torch.int64)
    assert not torch.equal(chunk.device_kv(slots), chunk.kv([9001, 9002, 9003])), "cross-pollinated KV"
