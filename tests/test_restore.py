"""tool_end on a busy server, and the host budget of shared prefixes (issue 12, items 3 and 4).

On the real HiRadixCache (CPU harness):

* a full device pool of unlocked cache is the normal state under load: a restore evicts it, as
  sglang's own ``load_back`` does, instead of answering 503; locked KV, the session's own device
  prefix and the device tokens promised to running requests are left alone;
* only when free + evictable - promised cannot take the load is the answer 503, with nothing
  evicted and nothing changed;
* an exclusive suffix under sglang's ``load_back_threshold`` is not worth loading (sglang never
  loads one): the session becomes runnable on its device prefix, kv_meta says the suffix is left
  to recompute; when nothing is missing, kv_meta says so too;
* the host budget counts a prefix shared by several sessions once, and the 507 names the numbers.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from _cycle import step, turn

from toolkv.core.manager import ManagerConfig, ToolKVManager
from toolkv.core.treeops import path_to
from toolkv.errors import DeviceMemoryFull, HostMemoryFull
from toolkv.testing.harness import CacheHarness, HarnessConfig


def offloaded(h: CacheHarness, m: ToolKVManager, sid: str, now: float) -> int:
    """tool_start, the write acks, the GPU copies freed; returns the epoch."""
    epoch: int = m.tool_start(sid)["epoch"]  # type: ignore[assignment]
    step(h, m, now, writes=True)
    assert m.kv_meta(sid)["state"] == "Offloaded"
    return epoch


@pytest.fixture
def h() -> Iterator[CacheHarness]:
    with CacheHarness(HarnessConfig(device_tokens=1024)) as harness:
        yield harness


def test_restore_evicts_unlocked_cache_but_not_locked_kv_nor_promised_tokens(h: CacheHarness) -> None:
    m = ToolKVManager(h.tree, config=ManagerConfig.eager())
    shared = list(range(1, 65))
    kv_a = turn(h, m, "a", [*shared, *range(100, 228)])  # 64 shared + 128 exclusive
    turn(h, m, "b", [*shared, *range(300, 364)])  # keeps the shared prefix on device
    ep = offloaded(h, m, "a", 1)
    # A running request holds a prefix of its own; other requests' finished KV fills the rest.
    running = list(range(5000, 5100))
    assert h.run_request(running)
    held = h.match(running).last_device_node
    h.tree.inc_lock_ref(held)
    k = 0
    while h.allocator.available_size() >= 64:
        assert h.run_request(list(range(10_000 + 1000 * k, 10_000 + 1000 * k + 64)))
        k += 1
    h.complete("write")  # write-through of the other requests' KV finished: unlocked, evictable
    h.check_events()
    promised = 40
    m.backend.headroom = lambda: promised  # type: ignore[attr-defined]
    free, evictable = h.allocator.available_size(), h.tree.evictable_size()
    assert free < 128 + promised <= free + evictable  # full of cache: the old restore answered 503 here
    shared_node = path_to(h.tree, h.match(shared).last_device_node)[-1]

    meta = m.tool_end("a", ep)

    assert meta["state"] == "Restoring" and meta["restore"] == "loading" and meta["restored_tokens"] == 128
    assert h.allocator.available_size() >= promised  # the promised tokens stay free
    assert held.value is not None and held.lock_ref > 0  # the running request's KV is untouched
    assert shared_node.value is not None  # the session's own device prefix was not evicted
    step(h, m, 2, loads=True)
    assert m.kv_meta("a")["state"] == "Handover"
    assert torch.equal(h.device_kv(h.match([*shared, *range(100, 228)]).device_indices), kv_a)
    h.tree.dec_lock_ref(held)
    for sid in ("a", "b"):
        m.close(sid)
    h.drain()
    acc = h.accounting()
    assert acc.lock_refs == acc.host_refs == () and acc.pending_loads == 0  # nothing left held


def test_restore_that_eviction_cannot_fit_is_refused_with_nothing_evicted(h: CacheHarness) -> None:
    m = ToolKVManager(h.tree, config=ManagerConfig.eager())
    turn(h, m, "a", list(range(1, 129)))
    ep = offloaded(h, m, "a", 1)
    assert h.run_request(list(range(2000, 2064)))  # 64 evictable tokens of another request
    h.complete("write")
    h.check_events()
    hog = h.alloc(h.allocator.available_size() - 30)  # 30 free: 30 + 64 < 128
    assert hog is not None
    before = (h.accounting(), m.kv_meta("a"))
    with pytest.raises(DeviceMemoryFull, match=r"30 free and 64 evictable on device, 0 promised") as ei:
        m.tool_end("a", ep)
    assert ei.value.http_status == 503 and ei.value.details["device_evictable_tokens"] == 64
    assert (h.accounting(), m.kv_meta("a")) == before  # nothing evicted, still offloaded and protected
    h.allocator.free(hog)
    assert m.tool_end("a", ep)["state"] == "Restoring"  # the retry fits
    step(h, m, 2, loads=True)
    m.close("a")


def test_a_suffix_below_the_load_back_threshold_is_left_to_recompute(h: CacheHarness) -> None:
    m = ToolKVManager(h.tree, config=ManagerConfig.eager())
    shared = list(range(1, 101))
    turn(h, m, "a", [*shared, *range(500, 508)])  # an 8-token exclusive suffix: under sglang's 10
    turn(h, m, "b", [*shared, *range(600, 664)])  # keeps the shared prefix on device
    ep = offloaded(h, m, "a", 1)
    assert m.kv_meta("a")["device_tokens"] == 100  # the suffix was freed, the prefix stays

    meta = m.tool_end("a", ep)  # the old restore answered a 503 that no retry could satisfy

    assert meta["state"] == "Handover" and meta["protected"] is False  # its device prefix is pinned
    assert meta["restore"] == "below_load_back_threshold"
    assert meta["restored_tokens"] == 0 and meta["recompute_tokens"] == 8
    assert meta["tokens"] == meta["device_tokens"] == 100  # runnable on its device prefix
    counters: dict[str, int] = m.kv_meta()["counters"]  # type: ignore[assignment]
    assert counters["restore_below_threshold"] == 1
    assert all(n.host_ref_counter == 0 for n in h.iter_nodes())  # the protection is released
    # The next turn is admitted and recomputes the suffix (sglang's own prefill) and offloads as usual.
    assert m.admit("a")
    turn(h, m, "a", [*shared, *range(500, 540)])
    assert m.kv_meta("a")["state"] == "Running"
    for sid in ("a", "b"):
        m.close(sid)


def test_nothing_to_load_is_said_so(h: CacheHarness) -> None:
    m = ToolKVManager(h.tree)
    turn(h, m, "a", list(range(1, 65)))
    ep = int(m.tool_start("a")["epoch"])  # type: ignore[call-overload]
    meta = m.tool_end("a", ep)  # the write is still in flight: the GPU copy was never freed
    assert meta["state"] == "Handover"
    assert (meta["restore"], meta["restored_tokens"], meta["recompute_tokens"]) == ("resident", 0, 0)
    step(h, m, 1, writes=True)
    m.close("a")


def test_the_host_budget_counts_a_shared_prefix_once() -> None:
    with CacheHarness(HarnessConfig(device_tokens=4096)) as h:
        m = ToolKVManager(h.tree, config=ManagerConfig(host_budget_tokens=1100))
        prompt = list(range(1, 1001))
        turn(h, m, "a", [*prompt, *range(2000, 2020)])
        turn(h, m, "b", [*prompt, *range(3000, 3020)])
        turn(h, m, "c", list(range(5000, 5100)))
        m.tool_start("a")
        m.tool_start("b")  # the old budget counted the prompt twice: 2,040 > 1,100, a 507
        assert m.backend.protected_tokens == 1040  # type: ignore[attr-defined]
        with pytest.raises(HostMemoryFull) as ei:
            m.tool_start("c")
        msg = str(ei.value)
        assert "host_budget_tokens is 1100, 1040 are protected and the session would add 100" in msg
        assert ei.value.http_status == 507 and ei.value.details["budget_extra_tokens"] == 100
        step(h, m, 1, writes=True)
        m.close("a")
        assert m.backend.protected_tokens == 1020  # type: ignore[attr-defined]  # b still holds the prompt
        m.close("b")
        assert m.backend.protected_tokens == 0  # type: ignore[attr-defined]
        m.tool_start("c")  # fits now
        assert m.backend.protected_tokens == 100  # type: ignore[attr-defined]
        m.close("c")


def test_the_ttl_stops_once_tool_end_is_accepted(h: CacheHarness) -> None:
    """A session whose tool_end was accepted is Restoring until its load is acknowledged, however
    long that takes: the client came back, nothing is abandoned (spec ``Expiring``). A session
    still Offloaded past its deadline expires as before."""
    m = ToolKVManager(h.tree, config=ManagerConfig.eager(ttl_s=10.0))
    kv = turn(h, m, "back", list(range(1, 129)))
    turn(h, m, "gone", list(range(500, 628)))
    ep = offloaded(h, m, "back", 1)
    offloaded(h, m, "gone", 1)
    assert m.tool_end("back", ep)["state"] == "Restoring"
    m.tick(1_000.0)  # far past both deadlines; no load has finished yet
    assert m.kv_meta("back")["state"] == "Restoring" and m.kv_meta("back")["deadline"] is None
    assert m.kv_meta("gone")["state"] == "Expired"
    step(h, m, 1_001.0, loads=True)
    assert m.kv_meta("back")["state"] == "Handover"
    leaf = m.sessions["back"].node
    assert leaf is not None
    assert torch.equal(h.device_kv(torch.cat([n.value for n in path_to(h.tree, leaf)])), kv)
    assert m.counters["expired"] == 1
