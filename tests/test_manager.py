"""ToolKVManager on the real HiRadixCache / RadixCache CPU harness: lifecycle, byte-exact
restores, typed errors that change nothing, and every lock/host ref/slot returned."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from toolkv.core.manager import ManagerConfig, ToolKVManager
from toolkv.errors import (
    BadRequest,
    DeviceMemoryFull,
    HostMemoryFull,
    SessionKVLost,
    StaleEpoch,
    UnknownSession,
    WrongState,
)
from toolkv.testing.harness import CacheHarness, HarnessConfig

SHARED = list(range(1, 33))


def turn(h: CacheHarness, m: ToolKVManager, sid: str, tokens: list[int]) -> torch.Tensor:
    """A turn finishes: its KV lands in the tree (like cache_finished_req) and is recorded."""
    idx = h.alloc(len(tokens))
    assert idx is not None
    h.insert(tokens, idx)
    m.insert(sid, tokens)
    return h.device_kv(h.match(tokens).device_indices).clone()


def step(h: CacheHarness, m: ToolKVManager, now: float, *, writes: bool = False, loads: bool = False) -> None:
    """One scheduler iteration: the tick (it starts queued loads), optionally let copies finish,
    sglang's ack checks, then the next tick sees the acks."""
    if loads:
        m.tick(now)
    if writes:
        h.complete("write")
    if loads:
        h.complete("load")
    h.check_events()
    m.tick(now)


@pytest.fixture(params=[1, 16], ids=["page1", "page16"])
def hh(request: pytest.FixtureRequest) -> Iterator[CacheHarness]:
    h = CacheHarness(HarnessConfig(page_size=request.param))
    yield h
    h.close()


def test_full_cycle_restores_identical_bytes_and_returns_everything(hh: CacheHarness) -> None:
    h = hh
    initial = h.accounting()
    m = ToolKVManager(h.tree, config=ManagerConfig.eager())
    a = SHARED + list(range(100, 132))
    b = SHARED + list(range(200, 232))
    kv_a = turn(h, m, "a", a)
    turn(h, m, "b", b)

    r = m.tool_start("a")
    assert r["state"] == "Offloading" and r["epoch"] == 1 and r["protected"] is True
    step(h, m, 1)
    assert m.kv_meta("a")["state"] == "Offloading", "the GPU copy is never freed before the write ack"
    device_free_before = h.allocator.available_size()
    step(h, m, 2, writes=True)
    meta = m.kv_meta("a")
    assert meta["state"] == "Offloaded" and meta["tier"] == "CpuProtected"
    assert h.allocator.available_size() - device_free_before == 32, "only a's exclusive suffix is freed"
    assert meta["device_tokens"] == 32 and meta["host_tokens"] == 64

    h.scribble_unreferenced()
    with pytest.raises(StaleEpoch):
        m.tool_end("a", 0)
    assert m.kv_meta("a")["state"] == "Offloaded"
    r = m.tool_end("a", 1)
    assert r["state"] == "Restoring" and r["tier"] == "Loading"
    step(h, m, 3)
    assert m.kv_meta("a")["state"] == "Restoring", "not runnable before the load ack"
    step(h, m, 4, loads=True)
    assert m.kv_meta("a")["state"] == "Handover", "pinned until the next request holds the path"
    assert m.admit("a") and m.kv_meta("a")["state"] == "Runnable"
    assert torch.equal(h.device_kv(h.match(a).device_indices), kv_a)

    m.close("a")
    m.close("b")
    h.drain()
    assert h.accounting() == initial


@pytest.mark.parametrize(
    "defect", [frozenset(), frozenset({"ClosedKeepsRef"})], ids=["fixed", "ClosedKeepsRef"]
)
def test_a_closed_record_lets_its_path_be_freed(hh: CacheHarness, defect: frozenset[str]) -> None:
    """The closed history (``TOOLKV_CLOSED_HISTORY``, 10,000 records by default) is bounded by
    count, not bytes: a record that kept its node would keep the node object and, through its
    parent link, every evicted ancestor with its token key alive for as long as it is remembered
    (at 64K-token contexts, megabytes a record). Spec ``Close`` drops ``ref``
    (``ClosedHoldsNoNode``); with the defect back (``ClosedKeepsRef``) the evicted path outlives
    the tree."""
    import gc
    import weakref

    from toolkv.verify.toolkv.mutants import mutant_manager

    h = hh
    m = mutant_manager(h.tree, caveats=defect)
    tokens = SHARED + list(range(300, 332))
    turn(h, m, "s", tokens)
    assert m.tool_start("s")["epoch"] == 1
    step(h, m, 1, writes=True)
    leaf = weakref.ref(m.sessions["s"].node)
    m.close("s")
    meta = m.kv_meta("s")
    assert (meta["state"], meta["epoch"]) == ("Closed", 1), "the record still answers and fences epochs"
    h.drain()  # sglang evicts the whole path from both tiers
    gc.collect()
    assert (leaf() is None) == (not defect), "a closed record must not keep its evicted path alive"


def test_offload_finishes_at_once_when_nothing_is_in_flight(hh: CacheHarness) -> None:
    h = hh
    m = ToolKVManager(h.tree)
    turn(h, m, "a", SHARED + list(range(50, 82)))
    step(h, m, 1, writes=True)  # write-through already finished
    assert m.tool_start("a")["state"] == "Offloaded"


def test_errors_are_typed_and_change_nothing(hh: CacheHarness) -> None:
    h = hh
    m = ToolKVManager(h.tree)
    turn(h, m, "a", SHARED)
    before = (h.accounting(), m.kv_meta("a"))
    with pytest.raises(UnknownSession):
        m.tool_start("nope")
    with pytest.raises(BadRequest):
        m.tool_start("")
    with pytest.raises(WrongState):
        m.tool_end("a", 0)  # running, not offloaded
    with pytest.raises(StaleEpoch):
        m.tool_end("a", 5)
    with pytest.raises(BadRequest):
        m.tool_end("a", "0")  # type: ignore[arg-type]
    assert (h.accounting(), m.kv_meta("a")) == before
    m.tool_start("a")
    with pytest.raises(WrongState):
        m.tool_start("a")


def test_host_pool_full_refuses_without_changes() -> None:
    with CacheHarness(
        HarnessConfig(device_tokens=256, host_ratio=0.2, write_policy="write_through_selective")
    ) as h:
        m = ToolKVManager(h.tree)
        turn(h, m, "a", list(range(1, 129)))  # selective: no write-through on the first hit
        before = (h.accounting(), m.kv_meta("a"))
        with pytest.raises(HostMemoryFull) as ei:
            m.tool_start("a")
        assert ei.value.http_status == 507
        assert (h.accounting(), m.kv_meta("a")) == before


def test_a_tool_start_asks_whether_it_may_demote_only_when_the_host_is_full(hh: CacheHarness) -> None:
    """The call policies' answer to "may this tool_start demote others?" reads the device pressure
    (a walk of the whole tree): a ``tool_start`` asks it once the host turns out full, and only then."""
    asked: list[str] = []

    def may_demote(sid: str) -> bool:
        asked.append(sid)
        return False

    h = hh
    m = ToolKVManager(h.tree, config=ManagerConfig(host_budget_tokens=40))
    turn(h, m, "a", list(range(1, 33)))
    assert m.offload("a", demote=lambda: may_demote("a"))["state"] in ("Offloading", "Offloaded")
    assert asked == [], "the host had room: nothing to ask"
    turn(h, m, "b", list(range(500, 532)))
    with pytest.raises(HostMemoryFull):
        m.offload("b", demote=lambda: may_demote("b"))  # 32 + 32 > budget 40, and no leave to demote
    assert asked == ["b"], "asked once, when the host was full"
    assert m.kv_meta("a")["state"] in ("Offloading", "Offloaded"), "refused leave: nothing demoted"


def test_host_budget_refuses_without_changes(hh: CacheHarness) -> None:
    h = hh
    m = ToolKVManager(h.tree, config=ManagerConfig(host_budget_tokens=40))
    turn(h, m, "a", SHARED + list(range(100, 132)))
    with pytest.raises(HostMemoryFull):
        m.tool_start("a")
    assert m.kv_meta("a")["state"] == "Running" and m.kv_meta("a")["epoch"] == 0


def test_restore_without_device_memory_stays_offloaded_and_protected(hh: CacheHarness) -> None:
    h = hh
    initial = h.accounting()
    m = ToolKVManager(h.tree, config=ManagerConfig.eager())
    turn(h, m, "a", list(range(1, 65)))
    step(h, m, 1, writes=True)
    m.tool_start("a")
    hog = h.alloc(h.allocator.available_size())  # another request takes all free device memory
    assert hog is not None
    with pytest.raises(DeviceMemoryFull) as ei:
        m.tool_end("a", 1)
    assert ei.value.http_status == 503
    meta = m.kv_meta("a")
    assert meta["state"] == "Offloaded" and meta["protected"] is True
    h.allocator.free(hog)
    assert m.tool_end("a", 1)["state"] == "Restoring"  # the retry works
    step(h, m, 2, loads=True)
    assert m.kv_meta("a")["state"] == "Handover"
    m.close("a")
    h.drain()
    assert h.accounting() == initial


def test_ttl_releases_an_abandoned_protection(hh: CacheHarness) -> None:
    h = hh
    initial = h.accounting()
    m = ToolKVManager(h.tree, config=ManagerConfig.eager(ttl_s=10))
    turn(h, m, "a", list(range(1, 65)))
    m.tool_start("a")
    step(h, m, 5, writes=True)
    assert m.kv_meta("a")["state"] == "Offloaded"
    step(h, m, 9.9)
    assert m.kv_meta("a")["protected"] is True
    step(h, m, 10)
    meta = m.kv_meta("a")
    assert meta["state"] == "Expired" and meta["protected"] is False and meta["tier"] == "CpuUnprotected"
    with pytest.raises(WrongState):
        m.tool_end("a", 1)
    m.close("a")
    h.drain()
    assert h.accounting() == initial


@pytest.mark.parametrize("when", ["Offloading", "Offloaded", "Restoring"])
def test_close_releases_in_every_protecting_state(hh: CacheHarness, when: str) -> None:
    h = hh
    initial = h.accounting()
    m = ToolKVManager(h.tree, config=ManagerConfig.eager())
    turn(h, m, "a", list(range(1, 65)))
    m.tool_start("a")
    if when != "Offloading":
        step(h, m, 1, writes=True)
    if when == "Restoring":
        m.tool_end("a", 1)
    assert m.kv_meta("a")["state"] == when
    m.close("a")
    assert m.kv_meta("a")["state"] == "Closed"
    with pytest.raises(WrongState):
        m.close("a")
    step(h, m, 2, loads=True)  # a queued load still runs after the close; its ack frees sglang's lock
    h.drain()
    assert h.accounting() == initial


def test_tree_reset_loses_offloaded_sessions_and_stale_nodes_are_rewalked(hh: CacheHarness) -> None:
    h = hh
    m = ToolKVManager(h.tree)
    turn(h, m, "a", list(range(1, 65)))
    turn(h, m, "b", list(range(300, 364)))
    m.tool_start("a")
    step(h, m, 1, writes=True)  # flush_cache runs only on an idle scheduler: the offload has finished
    assert m.kv_meta("a")["state"] == "Offloaded"
    h.tree.reset()
    m.tree_reset()
    assert m.kv_meta("a")["state"] == "Lost"
    with pytest.raises(SessionKVLost):
        m.tool_start("b")  # its node is gone and the token walk finds nothing
    # the same tokens come back (another request recomputed them): the walk re-finds them
    turn(h, m, "b", list(range(300, 364)))
    assert m.tool_start("b")["state"] in ("Offloading", "Offloaded")


def test_split_keeps_the_protected_leaf(hh: CacheHarness) -> None:
    h = hh
    initial = h.accounting()
    m = ToolKVManager(h.tree)
    a = list(range(1, 65))
    kv = turn(h, m, "a", a)
    m.tool_start("a")
    step(h, m, 1, writes=True)
    h.match(a[:32])  # a diverging request splits a's node; the leaf object keeps the suffix
    m.tool_end("a", 1)
    step(h, m, 2, loads=True)
    assert m.kv_meta("a")["state"] == "Handover"
    assert torch.equal(h.device_kv(h.match(a).device_indices), kv)
    m.close("a")
    h.drain()
    assert h.accounting() == initial


def test_idle_tick_does_nothing(hh: CacheHarness) -> None:
    h = hh
    m = ToolKVManager(h.tree)
    turn(h, m, "a", SHARED)
    before = h.accounting()
    for t in range(100):
        m.tick(float(t))
    assert h.accounting() == before and m.kv_meta("a")["state"] == "Running"
    with pytest.raises(ValueError):
        m.tick(1.0)  # the agreed clock never goes back


@pytest.mark.parametrize("page_size", [1, 16])
def test_pin_backend_on_plain_radix_cache(page_size: int) -> None:
    with CacheHarness(HarnessConfig(kind="radix", page_size=page_size)) as h:
        initial = h.accounting()
        m = ToolKVManager(h.tree, config=ManagerConfig(host_budget_tokens=100))
        turn(h, m, "a", list(range(1, 65)))
        r = m.tool_start("a")
        assert r["backend"] == "pin" and r["state"] == "Offloaded" and r["pinned"] is True
        assert h.evict_device(10**6) == 0, "a pinned session survives eviction pressure"
        turn(h, m, "b", list(range(500, 564)))
        with pytest.raises(HostMemoryFull):
            m.tool_start("b")  # 64 + 64 > budget 100
        assert m.tool_end("a", 1)["state"] == "Handover"
        h.evict_device(10**6)  # b's turn goes; a's path is pinned until its next request
        assert h.match(list(range(1, 65))).device_indices.numel() == 64, "the hand-over keeps the pin"
        assert m.admit("a") and m.kv_meta("a")["state"] == "Runnable"
        m.close("a")
        m.close("b")
        h.evict_device(10**6)
        assert h.accounting() == initial


@pytest.mark.parametrize("page_size", [1, 16])
def test_shadow_backend_frees_gpu_and_reinserts_identical_bytes(page_size: int) -> None:
    from toolkv.core.backends.shadow import ShadowBackend

    with CacheHarness(HarnessConfig(kind="radix", page_size=page_size)) as h:
        initial = h.accounting()
        m = ToolKVManager(h.tree, ShadowBackend(h.tree))
        a = SHARED + list(range(100, 132))
        kv_a = turn(h, m, "a", a)
        turn(h, m, "b", SHARED + list(range(200, 232)))
        free0 = h.allocator.available_size()
        assert m.tool_start("a")["state"] == "Offloaded"
        assert h.allocator.available_size() - free0 == 32, "a's exclusive branch left the GPU"
        assert h.match(a).device_indices.numel() == 32
        h.scribble_unreferenced()
        assert m.tool_end("a", 1)["state"] == "Handover"
        assert torch.equal(h.device_kv(h.match(a).device_indices), kv_a)
        m.close("a")
        m.close("b")
        h.evict_device(10**6)
        assert h.accounting() == initial


def test_a_reused_session_id_keeps_old_epochs_stale(hh: CacheHarness) -> None:
    """Close, then the same id starts over: an epoch handed out before the close is still refused."""
    h = hh
    m = ToolKVManager(h.tree)
    turn(h, m, "a", list(range(1, 65)))
    step(h, m, 1, writes=True)
    old = int(m.tool_start("a")["epoch"])  # type: ignore[call-overload]
    m.close("a")
    turn(h, m, "a", list(range(1, 65)))
    new = int(m.tool_start("a")["epoch"])  # type: ignore[call-overload]
    assert new > old
    with pytest.raises(StaleEpoch):
        m.tool_end("a", old)
    assert m.kv_meta("a")["state"] in ("Offloading", "Offloaded")
    m.close("a")


def test_abandoned_sessions_are_forgotten_and_memory_stays_bounded() -> None:
    """100,000 sessions that never call close (zero-change mode never does): each is forgotten
    idle_ttl_s after its last turn or call, its closed record keeps no tokens and no node, and the
    closed history is bounded, so the manager's tables stay bounded whatever the run's length."""
    import tracemalloc

    with CacheHarness(HarnessConfig(kind="radix", device_tokens=4096)) as h:
        m = ToolKVManager(h.tree, config=ManagerConfig(idle_ttl_s=10.0, closed_history=1_000))
        prompt = list(range(1, 65))
        assert h.run_request(prompt)
        tracemalloc.start()
        peak_tables = 0
        for i in range(100_000):
            m.tick(i * 0.01)  # 100 new sessions per simulated second, each idle after one turn
            m.insert(f"agent-{i}", prompt)
            if i == 20_000:
                base = tracemalloc.get_traced_memory()[0]
            peak_tables = max(peak_tables, len(m.sessions) + len(m._closed))
        grown = tracemalloc.get_traced_memory()[0] - base
        tracemalloc.stop()
        assert len(m.sessions) <= 10.0 / 0.01 + 1, "only the sessions active within idle_ttl_s are tracked"
        assert len(m._closed) == 1_000 and peak_tables <= 2_002
        assert m.counters["forgotten"] >= 98_000
        assert all(len(r.tokens) == 0 for r in m._closed.values())
        assert grown < 2_000_000, f"memory grew {grown} bytes over 80,000 abandoned sessions"
        recent = next(reversed(m._closed))
        assert m.kv_meta(recent)["state"] == "Closed"  # a recent one still answers and fences old epochs
        with pytest.raises(UnknownSession):
            m.kv_meta("agent-0")  # beyond the closed history: unknown (404), as documented
