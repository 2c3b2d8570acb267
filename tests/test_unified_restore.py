"""On sglang 0.5.23's UnifiedRadixCache, restores behave as on the HiRadixCache (tests/test_restore.py)
and the per-call policy runs there too (tests/test_policy_manager.py):

* a full device pool of unlocked cache is evicted to make room (as sglang's own ``load_back`` does);
  only when free + evictable - promised cannot take the load is the answer 503, with nothing changed;
* an exclusive suffix under ``load_back_threshold`` is left to recompute: the session runs on its
  device prefix;
* the host budget counts a prefix shared by two sessions once;
* keep pins a resident path and tool_end returns the pin; an early restore is Kept only after its
  load is acknowledged, with byte-identical KV.

Runs in the 0.5.23 environment (``make venv-0523``); skips with an older sglang.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from toolkv.testing.unified_harness import has_unified_radix_cache, sglang_version

if not has_unified_radix_cache():
    pytest.skip(
        f"needs sglang >= 0.5.21 (UnifiedRadixCache), found {sglang_version()}", allow_module_level=True
    )

from toolkv.core.backends.unified import full
from toolkv.core.manager import ManagerConfig, ToolKVManager
from toolkv.core.policy import PolicyConfig
from toolkv.errors import DeviceMemoryFull
from toolkv.testing.unified_harness import UnifiedCacheHarness, UnifiedHarnessConfig

SHARED = list(range(1, 33))


@pytest.fixture
def h() -> Iterator[UnifiedCacheHarness]:
    with UnifiedCacheHarness(UnifiedHarnessConfig(page_size=1, device_tokens=512)) as harness:
        yield harness


def turn(h: UnifiedCacheHarness, m: ToolKVManager, sid: str, tokens: list[int]) -> None:
    idx = h.allocator.alloc(len(tokens))
    assert idx is not None
    h.fill_kv(idx, tokens)
    h.insert(tokens, idx)
    m.insert(sid, tokens)


def path_kv(h: UnifiedCacheHarness, m: ToolKVManager, sid: str) -> torch.Tensor:
    return h.device_kv(h.tree.path_device_indices(m.sessions[sid].node.id)).float()


def step(
    h: UnifiedCacheHarness, m: ToolKVManager, now: float, *, writes: bool = False, loads: bool = False
) -> None:
    h.check_events()
    m.tick(now)
    if writes:
        h.complete("write")
    if loads:
        h.complete("load")
    h.check_events()
    m.tick(now)


def offloaded(h: UnifiedCacheHarness, m: ToolKVManager, sid: str, now: float) -> int:
    epoch = int(m.tool_start(sid)["epoch"])  # type: ignore[call-overload]
    step(h, m, now, writes=True)
    assert m.kv_meta(sid)["state"] == "Offloaded"
    return epoch


def fill_with_other_requests(h: UnifiedCacheHarness) -> None:
    """Other requests' finished KV fills the device pool; once written through, it is evictable."""
    k = 0
    while h.allocator.available_size() >= 32:
        assert h.run_request(list(range(10_000 + 100 * k, 10_000 + 100 * k + 32)))
        k += 1
    h.check_events()
    h.complete("write")
    h.check_events()


def test_restore_evicts_unlocked_cache_to_make_room(h: UnifiedCacheHarness) -> None:
    m = ToolKVManager(h.tree, config=ManagerConfig.eager())
    a = list(range(100, 228))
    turn(h, m, "a", a)
    before = path_kv(h, m, "a").clone()
    ep = offloaded(h, m, "a", 1.0)
    fill_with_other_requests(h)
    assert h.allocator.available_size() < 128 <= h.tree.evictable_size()
    r = m.tool_end("a", ep)
    assert r["state"] == "Restoring" and r["restore"] == "loading" and r["restored_tokens"] == 128
    step(h, m, 2.0, loads=True)
    assert m.kv_meta("a")["state"] == "Handover"
    assert torch.equal(path_kv(h, m, "a"), before)


def test_restore_that_eviction_cannot_fit_is_refused_with_nothing_changed(h: UnifiedCacheHarness) -> None:
    m = ToolKVManager(h.tree, config=ManagerConfig.eager())
    turn(h, m, "a", list(range(100, 228)))
    ep = offloaded(h, m, "a", 1.0)
    hog = h.allocator.alloc(h.allocator.available_size() - 30)  # 30 free, nothing evictable
    assert hog is not None
    m.backend.headroom = lambda: 5  # type: ignore[attr-defined]
    before = (h.accounting(), m.kv_meta("a"))
    with pytest.raises(DeviceMemoryFull, match=r"30 free and 0 evictable on device, 5 promised"):
        m.tool_end("a", ep)
    assert (h.accounting(), m.kv_meta("a")) == before


def test_a_suffix_below_the_load_threshold_is_left_to_recompute(h: UnifiedCacheHarness) -> None:
    m = ToolKVManager(h.tree, config=ManagerConfig.eager())
    turn(h, m, "b", SHARED + list(range(500, 540)))  # keeps the shared prefix on the device
    turn(h, m, "a", [*SHARED, 7, 8, 9, 10, 11, 12])  # a 6-token exclusive suffix
    ep = offloaded(h, m, "a", 1.0)
    assert m.kv_meta("a")["device_tokens"] == 32
    r = m.tool_end("a", ep)
    assert r["state"] == "Handover" and r["restore"] == "below_load_back_threshold"
    assert r["recompute_tokens"] == 6 and r["restored_tokens"] == 0 and r["protected"] is False
    assert m.kv_meta("a")["tokens"] == 32 and m.kv_meta("a")["device_tokens"] == 32


def test_the_host_budget_counts_a_shared_prefix_once(h: UnifiedCacheHarness) -> None:
    m = ToolKVManager(h.tree, config=ManagerConfig(host_budget_tokens=50))
    turn(h, m, "a", SHARED + list(range(200, 216)))
    turn(h, m, "b", SHARED + list(range(300, 302)))
    offloaded(h, m, "a", 1.0)
    offloaded(h, m, "b", 1.0)  # 32 + 16 + 2 = 50 tokens, not 82
    assert m.backend.protected_tokens == 50  # type: ignore[attr-defined]
    m.close("a")
    assert m.backend.protected_tokens == 34  # type: ignore[attr-defined]  # b still holds the prompt


def test_the_policy_keeps_and_restores_early_on_the_unified_tree(h: UnifiedCacheHarness) -> None:
    m = ToolKVManager(
        h.tree,
        config=ManagerConfig.eager(
            policy="auto", policy_config=PolicyConfig(min_offload_tokens=64), restore_tokens_per_s=1000.0
        ),
    )
    a, b = list(range(100, 228)), list(range(1000, 1128))
    turn(h, m, "a", a)
    turn(h, m, "b", b)
    step(h, m, 0.0, writes=True)
    kv_b = path_kv(h, m, "b").clone()
    r = m.tool_start("a", expected_s=0.1)
    assert (r["state"], r["decision"]) == ("Kept", "keep") and full(m.sessions["a"].node).lock_ref == 1
    r = m.tool_start("b", expected_s=5.0)
    assert r["decision"] == "offload"
    step(h, m, 0.1, writes=True)
    assert m.kv_meta("b")["state"] == "Offloaded" and m.kv_meta("b")["device_tokens"] == 0
    assert m.tool_end("a", 1)["state"] == "Handover" and full(m.sessions["a"].node).lock_ref == 1
    assert m.admit("a") and full(m.sessions["a"].node).lock_ref == 0
    h.scribble_unreferenced()
    m.tick(m.sessions["b"].prefetch_at)
    assert m.kv_meta("b")["state"] == "Prefetching", "never Kept before the load ack"
    step(h, m, 4.9, loads=True)
    assert m.kv_meta("b")["state"] == "Kept" and m.kv_meta("b")["protected"] is False
    assert m.tool_end("b", 1)["state"] == "Handover"
    assert torch.equal(path_kv(h, m, "b"), kv_b)
    m.close("a")
    m.close("b")
    h.drain()
    acc = h.accounting()
    assert acc.lock_refs == () and acc.host_refs == () and acc.pending_loads == 0
