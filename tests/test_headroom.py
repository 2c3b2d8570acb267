"""Restores leave free the device memory sglang has promised but not allocated.

On the H200, 48 agent sessions with explicit tool calls ran the scheduler into
``RuntimeError: Out of memory`` two minutes in: ``PrefillAdder.add_chunked_req`` takes the next
chunk of a request that is being prefilled in pieces even when the budget is exhausted, counting
on memory that no one else allocates in between, and a restore's ``load_back`` did allocate it.
The backend now refuses a restore (503, nothing changes) unless it fits next to those tokens.
"""

from __future__ import annotations

from array import array
from types import SimpleNamespace

import pytest
import torch

from toolkv.core.manager import ManagerConfig, ToolKVManager
from toolkv.errors import DeviceMemoryFull
from toolkv.sglang.scheduler_side import CLIP_MAX_NEW_TOKENS, promised_tokens
from toolkv.testing.harness import CacheHarness, HarnessConfig


def real_req(rid: str, prompt: int, max_new: int, prefilled: int = 0, decoded: int = 0) -> object:
    """sglang's own ``Req``, in the state the scheduler leaves it after ``prefilled`` prompt tokens
    (a chunked prefill) and ``decoded`` output tokens."""
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    ids = list(range(1, prompt + 1))
    r = Req(
        rid=rid,
        origin_input_text="",
        origin_input_ids=ids,
        sampling_params=SamplingParams(max_new_tokens=max_new),
    )
    r.full_untruncated_fill_ids = array("q", ids)
    r.prefix_indices = torch.arange(prefilled, dtype=torch.int64)
    r.output_ids.extend(range(decoded))
    return r


def scheduler(chunked: object | None, running: list[object]) -> SimpleNamespace:
    """TEST DOUBLE of the two Scheduler fields ``promised_tokens`` reads (a Scheduler needs a GPU)."""
    return SimpleNamespace(chunked_req=chunked, running_batch=SimpleNamespace(reqs=running))


def test_promised_tokens_counts_the_chunked_rest_and_the_decode_growth() -> None:
    s = scheduler(
        real_req("c", prompt=10_000, max_new=32, prefilled=8_192),
        [real_req("a", 3000, 32, 3000, 10), real_req("b", 100, 10**6, 100, 5)],
    )
    assert promised_tokens(s) == (10_000 - 8_192) + (32 - 10) + CLIP_MAX_NEW_TOKENS
    assert promised_tokens(scheduler(None, [])) == 0
    assert promised_tokens(SimpleNamespace()) == 0  # before the first batch exists


@pytest.mark.parametrize("promised", [0, 200])
def test_restore_fits_next_to_promised_tokens_or_changes_nothing(promised: int) -> None:
    with CacheHarness(HarnessConfig(device_tokens=512)) as h:
        m = ToolKVManager(h.tree, config=ManagerConfig.eager())
        toks = list(range(1, 129))
        idx = h.alloc(len(toks))
        assert idx is not None
        h.insert(toks, idx)
        m.insert("a", toks)
        h.complete("write")
        h.check_events()
        m.tick(1)
        ep = int(m.tool_start("a")["epoch"])  # type: ignore[call-overload]
        h.complete("write")
        h.check_events()
        m.tick(2)
        hog = h.alloc(h.allocator.available_size() - 250)  # 250 free: fits 128, not 128 + 200
        m.backend.headroom = lambda: promised  # type: ignore[attr-defined]
        before = (h.accounting(), m.kv_meta("a"))
        if promised:
            with pytest.raises(DeviceMemoryFull, match="promised to running requests"):
                m.tool_end("a", ep)
            assert (h.accounting(), m.kv_meta("a")) == before
        else:
            assert m.tool_end("a", ep)["state"] == "Restoring"
        h.allocator.free(hog)
