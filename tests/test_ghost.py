"""The eviction-harm count (``toolkv:kv_recomputed_after_evict_tokens_total``) on sglang 0.5.16's
real HiRadixCache (tests/_ghost.py drives it; tests/test_ghost_0523.py runs the same checks on
0.5.23's UnifiedRadixCache)."""

from __future__ import annotations

import pytest
from _ghost import check_counts_recomputed_after_eviction, check_ghost_bounded, rig
from prometheus_client import CollectorRegistry

from toolkv.sglang.ghost import EvictionGhost, block_size
from toolkv.sglang.metrics import ToolKVMetrics


def test_counts_recomputed_after_eviction_by_requester() -> None:
    with rig() as r:
        assert not r.stack.unified and r.h.is_hi
        check_counts_recomputed_after_eviction(r)


def test_ghost_stays_bounded() -> None:
    with rig() as r:
        check_ghost_bounded(r)


def test_tree_reset_is_not_an_eviction() -> None:
    g = EvictionGhost(4)
    g.cached(list(range(8)))
    g.reset()
    assert g.admitted(list(range(8)), 0, "other") == 0 and len(g) == 0


def test_blocks_are_whole_pages_and_chained() -> None:
    assert block_size(1) == 16 and block_size(64) == 64 and block_size(5) == 20
    g = EvictionGhost(4)
    g.cached([1, 2, 3, 4, 5, 6, 7, 8])
    # the same second block after a different first block is another prefix: not counted
    assert g.admitted([9, 9, 9, 9, 5, 6, 7, 8], 0, "other") == 0
    assert g.admitted([1, 2, 3, 4, 5, 6, 7, 8], 2, "session") == 4  # only blocks wholly past 2
    assert g.admitted([1, 2, 3, 4], 0, "other", extra_key="lora") == 0  # another key space
    with pytest.raises(ValueError):
        g.admitted([1], 0, "everyone")


def test_metric_series_exists_at_zero_and_follows_kv_meta() -> None:
    reg = CollectorRegistry()
    m = ToolKVMetrics({"model_name": "m", "tp_rank": "0"}, registry=reg)
    name = "toolkv:kv_recomputed_after_evict_tokens_total"
    labels = {"model_name": "m", "tp_rank": "0"}
    assert reg.get_sample_value(name, {**labels, "requester": "session"}) == 0
    assert reg.get_sample_value(name, {**labels, "requester": "other"}) == 0
    m.refresh({"recomputed_after_evict_tokens": {"session": 96, "other": 16}})
    m.refresh({"recomputed_after_evict_tokens": {"session": 112, "other": 16}})
    assert reg.get_sample_value(name, {**labels, "requester": "session"}) == 112
    assert reg.get_sample_value(name, {**labels, "requester": "other"}) == 16
