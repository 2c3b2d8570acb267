"""The same state machine and round trips on real CUDA pools (GPU machine only).

With ``device="cuda"`` the harness installs no test double: the device pool is on the GPU, the host
pool is pinned, copies are sgl-kernel's ``kernel`` io backend on real streams, and an ack is ready
when the GPU has finished the copy.
"""

from __future__ import annotations

import pytest
import torch

from toolkv.core.manager import ManagerConfig, ToolKVManager
from toolkv.testing.harness import CacheHarness, HarnessConfig
from toolkv.tools.fuzz_cli import campaign

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("page_size", [1, 16])
def test_offload_restore_round_trip_on_cuda(page_size: int) -> None:
    cfg = HarnessConfig(
        device="cuda",
        io_backend="kernel",
        page_size=page_size,
        device_tokens=4096,
        layers=4,
        heads=8,
        head_dim=128,
        dtype=torch.bfloat16,
    )
    with CacheHarness(cfg) as h:
        h.tree.write_through_threshold = 10**9
        initial = h.accounting()
        # the eager path (the base spec): the offload frees the device copy, so the restore loads it
        m = ToolKVManager(h.tree, config=ManagerConfig(adaptive=False, lazy_free=False))
        tokens = list(range(1, 1025))
        idx = h.allocator.alloc(1024)
        assert idx is not None
        h.fill_kv(idx, tokens)
        h.insert(tokens, idx)
        m.insert("a", tokens)
        before = h.device_kv(idx).float()
        r = m.tool_start("a")
        h.synchronize()
        h.check_events()
        m.tick(1)
        assert m.kv_meta("a")["state"] == "Offloaded"
        h.scribble_unreferenced()
        m.tool_end("a", int(r["epoch"]))
        h.synchronize()
        h.check_events()
        m.tick(2)
        assert m.kv_meta("a")["state"] == "Runnable"
        assert torch.equal(h.device_kv(h.match(tokens).device_indices).float(), before)
        m.close("a")
        h.evict_device(10**6)
        h.check_events()
        h.evict_host(10**6)
        assert h.accounting() == initial


def test_stateful_campaign_on_cuda() -> None:
    r = campaign(profile="gpu", device="cuda", seed=5)
    assert r["failure"] is None, r["failure"]
