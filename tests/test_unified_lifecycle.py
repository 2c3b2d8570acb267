"""ToolKVManager over the REAL sglang 0.5.23 UnifiedRadixCache (CPU harness): offload frees device
tokens only after the write ack, restore gives byte-identical KV, stale epochs and full pools are
refused without changing anything, the TTL releases, and every lock, host lock and slot returns.

Runs in the 0.5.23 environment (``make venv-0523``); skips in an environment with an older sglang.
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

from toolkv.core.backends.unified import UnifiedBackend, full
from toolkv.core.manager import ManagerConfig, ToolKVManager
from toolkv.core.treeops import path_to, walk
from toolkv.errors import DeviceMemoryFull, HostMemoryFull, StaleEpoch, Unsupported, WrongState
from toolkv.testing.unified_harness import UnifiedCacheHarness, UnifiedHarnessConfig

SHARED = list(range(1, 33))


@pytest.fixture(params=[1, 16], ids=["page1", "page16"])
def h(request: pytest.FixtureRequest) -> Iterator[UnifiedCacheHarness]:
    with UnifiedCacheHarness(UnifiedHarnessConfig(page_size=request.param, device_tokens=512)) as harness:
        yield harness


def make(h: UnifiedCacheHarness, ttl: float = 60.0) -> ToolKVManager:
    # the base spec's eager path: the offload frees the GPU copy at its ack, tool_end restores it
    return ToolKVManager(h.tree, config=ManagerConfig.eager(ttl_s=ttl))


def turn(h: UnifiedCacheHarness, m: ToolKVManager, sid: str, tokens: list[int]) -> None:
    """A turn finishes: the model's KV for ``tokens`` lands in the tree and the turn is recorded."""
    idx = h.allocator.alloc(len(tokens))
    assert idx is not None
    h.fill_kv(idx, tokens)
    h.insert(tokens, idx)
    m.insert(sid, tokens)


def path_kv(h: UnifiedCacheHarness, m: ToolKVManager, sid: str) -> torch.Tensor:
    idx = h.tree.path_device_indices(m.sessions[sid].node.id)
    return h.device_kv(idx).float()


def settle_writes(h: UnifiedCacheHarness, m: ToolKVManager, now: float) -> None:
    """Scheduler iterations: submit the queued writes, the copy engine finishes them, sglang
    retires the acks, the manager's tick reacts."""
    h.check_events()
    h.complete("write")
    h.check_events()
    m.tick(now)


def settle_loads(h: UnifiedCacheHarness, m: ToolKVManager, now: float) -> None:
    m.tick(now)  # starts the queued load (the ring is idle)
    h.complete("load")
    h.check_events()
    m.tick(now)


def tokens_of(n: int, ps: int, start: int = 1000) -> list[int]:
    """``n`` pages of fresh tokens, at least 16 (sglang does not load back fewer than 10)."""
    return list(range(start, start + max(n * ps, 16)))


def test_make_backend_picks_unified_and_refuses_what_it_cannot_drive(h: UnifiedCacheHarness) -> None:
    from toolkv.core.backends.unified_rust import RustUnifiedBackend

    assert type(make(h).backend) is UnifiedBackend
    h.close()
    rust = UnifiedHarnessConfig(tree_core="rust")  # sglang's default core: the handle backend
    with UnifiedCacheHarness(rust) as r:
        assert isinstance(make(r).backend, RustUnifiedBackend)
    plain = UnifiedHarnessConfig(hicache=False)
    with UnifiedCacheHarness(plain) as p, pytest.raises(Unsupported, match="--enable-hierarchical-cache"):
        make(p)


def test_offload_frees_device_tokens_only_after_the_write_ack(h: UnifiedCacheHarness) -> None:
    m = make(h)
    toks = SHARED + tokens_of(4, h.cfg.page_size)
    turn(h, m, "a", toks)
    free0 = h.allocator.available_size()
    r = m.tool_start("a")
    # write-through on insert queued the backup; it has not been acknowledged yet
    assert r["state"] == "Offloading" and r["tier"] == "BackingUp"
    assert h.allocator.available_size() == free0
    h.check_events()  # sglang submits the queued write; the copy engine holds it
    m.tick(1.0)
    assert m.kv_meta("a")["state"] == "Offloading" and h.allocator.available_size() == free0
    settle_writes(h, m, 2.0)
    meta = m.kv_meta("a")
    assert meta["state"] == "Offloaded" and meta["tier"] == "CpuProtected"
    assert meta["device_tokens"] == 0 and meta["host_tokens"] == len(toks)
    assert h.allocator.available_size() == free0 + len(toks)
    leaf = m.sessions["a"].node
    assert full(leaf).host_lock_ref == 1 and full(leaf).value is None


def test_selective_policy_tool_start_writes_the_path_itself() -> None:
    cfg = UnifiedHarnessConfig(write_policy="write_through_selective")
    with UnifiedCacheHarness(cfg) as h:
        m = make(h)
        turn(h, m, "a", SHARED)
        node = m.sessions["a"].node
        assert full(node).host_value is None and not h.tree.ongoing_write_through  # no write-through
        r = m.tool_start("a")
        assert r["state"] == "Offloading" and node.write_through_pending_id is not None
        settle_writes(h, m, 1.0)
        assert m.kv_meta("a")["state"] == "Offloaded" and full(node).value is None


def test_restore_is_byte_identical_and_runnable_only_after_the_load_ack(h: UnifiedCacheHarness) -> None:
    m = make(h)
    toks = SHARED + tokens_of(4, h.cfg.page_size)
    turn(h, m, "a", toks)
    before = path_kv(h, m, "a").clone()
    assert torch.equal(before, h.expected_kv(toks))
    m.tool_start("a")
    settle_writes(h, m, 1.0)
    h.scribble_unreferenced()
    r = m.tool_end("a", 1)
    assert r["state"] == "Restoring" and h.controller.load_queue  # queued, not started
    m.tick(2.0)  # starts it
    assert not h.controller.load_queue and h.pending("load") == 1
    assert not torch.equal(path_kv(h, m, "a"), before)  # the copy has not run: stale bytes
    assert m.kv_meta("a")["state"] == "Restoring" and m.kv_meta("a")["tier"] == "Loading"
    h.complete("load")
    h.check_events()
    m.tick(3.0)
    assert m.kv_meta("a")["state"] == "Handover" and m.kv_meta("a")["tier"] == "GPU"
    assert torch.equal(path_kv(h, m, "a"), before)
    assert h.match(toks).device_prefix_len == len(toks)  # the next turn reuses the prefix


def test_stale_epoch_and_wrong_state_change_nothing(h: UnifiedCacheHarness) -> None:
    m = make(h)
    turn(h, m, "a", SHARED)
    m.tool_start("a")
    settle_writes(h, m, 1.0)
    acc, meta = h.accounting(), m.kv_meta("a")
    with pytest.raises(StaleEpoch):
        m.tool_end("a", 0)
    with pytest.raises(WrongState):
        m.tool_start("a")
    assert h.accounting() == acc and m.kv_meta("a") == meta


def test_host_full_refused_before_anything_changes() -> None:
    cfg = UnifiedHarnessConfig(write_policy="write_through_selective")
    with UnifiedCacheHarness(cfg) as h:
        m = make(h)
        turn(h, m, "a", SHARED)
        ballast = h.host_pool.alloc(h.host_pool.available_size() - 8)
        acc, meta = h.accounting(), m.kv_meta("a")
        with pytest.raises(HostMemoryFull):
            m.tool_start("a")
        assert h.accounting() == acc and m.kv_meta("a") == meta
        h.host_pool.free(ballast)
        assert m.tool_start("a")["state"] == "Offloading"


def test_device_full_keeps_the_session_offloaded_and_protected(h: UnifiedCacheHarness) -> None:
    m = make(h)
    turn(h, m, "a", SHARED)
    m.tool_start("a")
    settle_writes(h, m, 1.0)
    ballast = h.allocator.alloc(h.allocator.available_size() - h.cfg.page_size)
    acc = h.accounting()
    with pytest.raises(DeviceMemoryFull):
        m.tool_end("a", 1)
    assert h.accounting() == acc and m.kv_meta("a")["state"] == "Offloaded"
    assert m.kv_meta("a")["tier"] == "CpuProtected"
    h.allocator.free(ballast)
    m.tool_end("a", 1)
    settle_loads(h, m, 2.0)
    assert m.kv_meta("a")["state"] == "Handover"


def test_ttl_releases_the_host_lock(h: UnifiedCacheHarness) -> None:
    m = make(h, ttl=5.0)
    turn(h, m, "a", SHARED)
    m.tool_start("a")
    settle_writes(h, m, 1.0)
    leaf = m.sessions["a"].node
    assert full(leaf).host_lock_ref == 1
    m.tick(4.0)
    assert m.kv_meta("a")["state"] == "Offloaded"
    m.tick(6.0)
    assert m.kv_meta("a")["state"] == "Expired" and full(leaf).host_lock_ref == 0
    assert m.kv_meta("a")["tier"] == "CpuUnprotected"
    assert h.evict_host(10**9) > 0  # now sglang may take it


def test_protection_of_a_split_node_covers_both_fragments_and_is_returned_whole(
    h: UnifiedCacheHarness,
) -> None:
    """0.5.23's host lock is a segment lock: a split copies host_lock_ref to the new prefix (the
    spec's SplitCopiesHostRef, correct here because the release walks the segment)."""
    m = make(h)
    ps = h.cfg.page_size
    toks = tokens_of(8, ps)
    turn(h, m, "a", toks)
    m.tool_start("a")
    settle_writes(h, m, 1.0)
    leaf = m.sessions["a"].node
    h.match(toks[: 4 * ps])  # a request diverging inside the node splits it
    prefix = leaf.parent
    assert prefix is not h.tree.root_node and len(leaf.key) == len(toks) - 4 * ps
    assert full(prefix).host_lock_ref == 1 and full(leaf).host_lock_ref == 1
    assert h.evict_host(10**9) == 0  # neither fragment may go
    m.close("a")
    assert full(prefix).host_lock_ref == 0 and full(leaf).host_lock_ref == 0


def test_a_second_restore_waits_for_the_load_ring(h: UnifiedCacheHarness) -> None:
    """Loads start only while no load is in flight (the producer ring's assertion never fires)."""
    m = make(h)
    ps = h.cfg.page_size
    turn(h, m, "a", tokens_of(4, ps))
    turn(h, m, "b", tokens_of(4, ps, 5000))
    for sid in ("a", "b"):
        m.tool_start(sid)
    settle_writes(h, m, 1.0)
    m.tool_end("a", 1)
    m.tick(2.0)
    assert h.pending("load") == 1
    m.tool_end("b", 1)
    for _ in range(3):
        m.tick(3.0)  # "a" still in flight: "b" stays queued
    assert h.controller.load_queue and len(h.controller.ack_load_queue) == 1
    h.complete("load")
    h.check_events()
    m.tick(4.0)  # "a" retired, "b" starts in the same tick
    assert m.kv_meta("a")["state"] == "Handover" and not h.controller.load_queue
    settle_loads(h, m, 5.0)
    assert m.kv_meta("b")["state"] == "Handover"


def test_shared_prefix_freed_only_when_no_device_child_remains(h: UnifiedCacheHarness) -> None:
    m = make(h)
    ps = h.cfg.page_size
    base = tokens_of(4, ps)
    turn(h, m, "a", base + tokens_of(4, ps, 7000))
    turn(h, m, "b", base + tokens_of(4, ps, 8000))
    m.tool_start("a")
    settle_writes(h, m, 1.0)
    shared, _ = walk(h.tree, base)
    assert full(shared).value is not None  # b's branch still reads it
    assert full(m.sessions["a"].node).value is None
    m.tool_start("b")
    settle_writes(h, m, 2.0)
    assert all(full(n).value is None for n in path_to(h.tree, m.sessions["b"].node))


def test_every_lock_host_lock_and_slot_is_returned(h: UnifiedCacheHarness) -> None:
    initial = h.accounting()
    m = make(h, ttl=10.0)
    ps = h.cfg.page_size
    turn(h, m, "a", SHARED + tokens_of(2, ps))
    turn(h, m, "b", SHARED + tokens_of(2, ps, 9000))
    turn(h, m, "c", tokens_of(3, ps, 6000))
    for sid in ("a", "b", "c"):
        m.tool_start(sid)
    settle_writes(h, m, 1.0)
    m.tool_end("a", 1)
    m.tick(2.0)  # a's load in flight
    m.tool_end("b", 1)  # queued behind it
    m.tick(20.0)  # c expires by TTL; a and b still restoring
    assert m.kv_meta("c")["state"] == "Expired"
    for sid in ("a", "b", "c"):
        m.close(sid)
    h.drain()
    m.tick(21.0)  # the manager forgets retired loads
    assert not m.backend.loads_in_flight()
    h.drain()
    assert h.accounting() == initial


@pytest.mark.parametrize("core", ["python", "rust"])
def test_a_tool_start_asks_whether_it_may_demote_only_when_the_host_is_full(core: str) -> None:
    """On 0.5.23's Python and (the default) Rust tree cores, under the plugin's defaults: the call
    policies' leave to demote is asked once the host turns out full, and only then."""
    import dataclasses

    from toolkv.sglang.config import ToolKVConfig

    asked: list[str] = []

    def may_demote(sid: str) -> bool:
        asked.append(sid)
        return False

    cfg = UnifiedHarnessConfig(tree_core=core, device_tokens=512)
    with UnifiedCacheHarness(cfg) as hc:
        m = ToolKVManager(
            hc.tree, config=dataclasses.replace(ToolKVConfig().manager_config(), host_budget_tokens=40)
        )
        turn(hc, m, "a", list(range(1, 33)))
        assert m.offload("a", demote=lambda: may_demote("a"))["state"] in ("Offloading", "Offloaded")
        assert asked == [], "the host had room: nothing to ask"
        turn(hc, m, "b", list(range(500, 532)))
        with pytest.raises(HostMemoryFull):
            m.offload("b", demote=lambda: may_demote("b"))  # 32 + 32 > budget 40, no leave to demote
        assert asked == ["b"], "asked once, when the host was full"
