"""toolkv next to sglang's decode-side KV offload on one server: refused, with reasons that are
checked here against the real classes where they can be."""

from __future__ import annotations

import dataclasses
import logging
from array import array
from types import SimpleNamespace

import pytest

from toolkv.sglang.startup import DECODE_OFFLOAD_FLAG, DECODE_RADIX_FLAG, decode_offload_reasons

pytestmark = pytest.mark.filterwarnings("ignore")


def _args(**kw: object) -> SimpleNamespace:
    base = {
        "disaggregation_decode_enable_offload_kvcache": False,
        "disaggregation_decode_enable_radix_cache": False,
    }
    return SimpleNamespace(**{**base, **kw})


def test_no_decode_offload_no_reason() -> None:
    assert decode_offload_reasons(_args()) == []
    assert decode_offload_reasons(SimpleNamespace()) == [], "an sglang without the flag has no decode offload"
    assert decode_offload_reasons(_args(disaggregation_decode_enable_radix_cache=True)) == []


def test_decode_offload_is_refused_with_its_flag_named() -> None:
    (reason,) = decode_offload_reasons(_args(disaggregation_decode_enable_offload_kvcache=True))
    assert DECODE_OFFLOAD_FLAG in reason and "radix tree" in reason


def test_with_the_decode_radix_cache_the_upstream_bug_is_named_too() -> None:
    reasons = decode_offload_reasons(
        _args(
            disaggregation_decode_enable_offload_kvcache=True, disaggregation_decode_enable_radix_cache=True
        )
    )
    assert len(reasons) == 2 and DECODE_RADIX_FLAG in reasons[1]


def test_a_flag_that_is_not_a_bool_is_an_error() -> None:
    with pytest.raises(TypeError, match="disaggregation_decode_enable_offload_kvcache must be a bool"):
        decode_offload_reasons(_args(disaggregation_decode_enable_offload_kvcache="yes"))


def test_real_server_args() -> None:
    from sglang.srt.server_args import ServerArgs

    defaults = {
        f.name: f.default for f in dataclasses.fields(ServerArgs) if f.default is not dataclasses.MISSING
    }
    args = SimpleNamespace(**defaults)
    assert decode_offload_reasons(args) == []
    args.disaggregation_decode_enable_offload_kvcache = True
    assert len(decode_offload_reasons(args)) == 1


def test_a_request_released_by_the_offload_manager_never_reaches_the_radix_tree() -> None:
    """Reason 1 on the real classes: after the manager released a finished request (the proposed
    fix applied, so the tree is not corrupted), the tree holds none of the request's tokens."""
    from sglang.srt.managers.schedule_batch import FINISH_LENGTH
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    from research.decode_offload.fixes import radix_prefix_release
    from research.decode_offload.harness import DecodeHarnessConfig, DecodeOffloadHarness

    logging.disable(logging.ERROR)
    try:
        with DecodeOffloadHarness(DecodeHarnessConfig(radix_cache=True)) as h, radix_prefix_release():
            m = h.manager
            req = h.new_request("t", [501, 502, 503], 8)
            assert h.admit(req, 504)
            for t in (505, 506):
                assert h.decode_step(req, t)
            req.finished_reason = FINISH_LENGTH(length=3)
            if not m.offload_kv_cache(req):
                m.finalize_release_on_finish(req)
            while h.complete_copy():
                pass
            m.check_offload_progress()
            assert req.req_pool_idx is None
            hit = h.tree.match_prefix(MatchPrefixParams(key=RadixKey(array("q", h.all_tokens(req)))))
            assert len(hit.device_indices) == 0 and h.tree.evictable_size() == 0
    finally:
        logging.disable(logging.NOTSET)
