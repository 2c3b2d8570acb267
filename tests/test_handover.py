"""The outcome under load, on the real HiRadixCache: a restored session's KV survives until its
next request holds it (spec ``Handover``/``Admit``), and a tool_start finds host room that HiCache
can free (spec ``HostFits``/``HostRoom``). Each test also runs the variant with the old behaviour
(``toolkv.verify.toolkv.mutants``: ``EarlyRelease``, ``RoomIgnored``) and requires it to lose
what the fixed manager keeps, so none of them can pass on the defect."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from _cycle import step, turn

from toolkv.core.backends.base import host_evictable_tokens
from toolkv.core.manager import ManagerConfig, ToolKVManager
from toolkv.errors import HostMemoryFull
from toolkv.testing.harness import CacheHarness, HarnessConfig
from toolkv.verify.toolkv.mutants import mutant_manager

FIXED: frozenset[str] = frozenset()


@pytest.fixture
def h() -> Iterator[CacheHarness]:
    with CacheHarness(HarnessConfig(device_tokens=1024, host_ratio=2.0)) as harness:
        yield harness


def cached_after_pressure(h: CacheHarness, m: ToolKVManager, tokens: list[int]) -> int:
    """Other requests need the whole device while the session's next request waits in the queue
    (sglang's eviction runs with LRU order); returns how many of ``tokens`` that request then
    finds on the device when it is admitted."""
    h.evict_device(10**6)
    return int(h.match(tokens).device_indices.numel())


@pytest.mark.parametrize("caveats", [FIXED, frozenset({"EarlyRelease"})], ids=["fixed", "EarlyRelease"])
def test_a_restored_session_keeps_its_kv_until_its_request_is_admitted(
    h: CacheHarness, caveats: frozenset[str]
) -> None:
    initial = h.accounting()
    m = mutant_manager(h.tree, caveats=caveats, config=ManagerConfig.eager(handover_ttl_s=30.0))
    a = list(range(1, 301))
    kv = turn(h, m, "a", a)
    ep = int(m.tool_start("a")["epoch"])  # type: ignore[call-overload]
    step(h, m, 0.0, writes=True)
    assert m.tool_end("a", ep)["state"] == "Restoring"
    step(h, m, 0.1, loads=True)
    assert m.kv_meta("a")["state"] == "Handover"
    found = cached_after_pressure(h, m, a)  # the request queues for seconds under load
    if caveats:
        assert found == 0, "the old manager let go at the load ack: the restored KV was evicted"
    else:
        assert found == 300, "the hand-over keeps the whole path on the device"
        assert torch.equal(h.device_kv(h.match(a).device_indices), kv), "restored bytes equal"
    h.tree.inc_lock_ref(h.match(a).last_device_node)  # the request admitted: PrefillAdder locks
    assert m.admit("a") is True and m.kv_meta("a")["state"] == "Runnable"
    assert m.counters["admitted"] == 1
    h.tree.dec_lock_ref(h.match(a).last_device_node)
    m.close("a")
    h.drain()
    assert h.accounting() == initial, "every lock, host reference and slot returned"


@pytest.mark.parametrize("caveats", [FIXED, frozenset({"EarlyRelease"})], ids=["fixed", "EarlyRelease"])
def test_a_kept_session_stays_pinned_after_tool_end(h: CacheHarness, caveats: frozenset[str]) -> None:
    initial = h.accounting()
    m = mutant_manager(h.tree, caveats=caveats)
    a = list(range(1, 201))
    turn(h, m, "a", a, ack_writes=True)  # HiCache's own write-through is done: nothing else holds it
    assert m.keep("a")["state"] == "Kept"
    assert m.tool_end("a", 1)["state"] == "Handover"
    found = cached_after_pressure(h, m, a)
    assert found == (0 if caveats else 200)
    turn(h, m, "a", [*a, 5, 6, 7])  # admitted, runs, finishes: the next turn records as usual
    assert m.kv_meta("a")["state"] == "Running"
    m.close("a")
    h.drain()
    assert h.accounting() == initial


def test_a_request_admitted_during_the_load_ends_the_hand_over_at_the_ack(h: CacheHarness) -> None:
    initial = h.accounting()
    m = ToolKVManager(h.tree, config=ManagerConfig.eager())
    a = list(range(1, 201))
    turn(h, m, "a", a)
    ep = int(m.tool_start("a")["epoch"])  # type: ignore[call-overload]
    step(h, m, 0.0, writes=True)
    m.tool_end("a", ep)
    assert m.admit("a") is False and m.sessions["a"].admit_pending  # Restoring: noted
    step(h, m, 0.1, loads=True)
    assert m.kv_meta("a")["state"] == "Runnable", "no pin left waiting for a request already running"
    assert m.counters["handover"] == 1 and m.counters["admitted"] == 1
    m.close("a")
    h.drain()
    assert h.accounting() == initial


def test_the_hand_over_ttl_ends_a_wait_for_a_request_that_never_comes(h: CacheHarness) -> None:
    initial = h.accounting()
    m = ToolKVManager(h.tree, config=ManagerConfig.eager(ttl_s=600.0, handover_ttl_s=5.0))
    a = list(range(1, 201))
    turn(h, m, "a", a)
    ep = int(m.tool_start("a")["epoch"])  # type: ignore[call-overload]
    step(h, m, 0.0, writes=True)
    m.tool_end("a", ep)
    step(h, m, 1.0, loads=True)
    meta = m.kv_meta("a")
    assert meta["state"] == "Handover" and meta["deadline"] == 6.0, "the hand-over TTL, not the tool TTL"
    m.tick(5.9)
    assert m.kv_meta("a")["state"] == "Handover"
    m.tick(6.0)
    assert m.kv_meta("a")["state"] == "Runnable" and m.counters["handover_expired"] == 1
    assert all(n.lock_ref == 0 for n in h.iter_nodes() if n is not h.tree.root_node), "the pin is returned"
    assert h.match(a).device_indices.numel() == 200, "the KV stays in the tree, just unpinned"
    m.close("a")
    h.drain()
    assert h.accounting() == initial


def fill_host_with_unprotected_copies(h: CacheHarness, m: ToolKVManager, start: int) -> int:
    """Sessions that came and went: their backed-up copies fill the host pool, host-only and
    unprotected (their GPU copies evicted), as after a burst of traffic. Returns the tokens held."""
    held = 0
    base = start
    while h.host_pool.available_size() >= 200:
        toks = list(range(base, base + 200))
        base += 200
        assert h.run_request(toks)
        assert h.tree.write_backup(h.match(toks).last_device_node) == 200  # HiCache's backup of it
        h.complete("write")
        h.check_events()
        h.evict_device(200)
        held += 200
    return held


@pytest.fixture
def hs() -> Iterator[CacheHarness]:
    """Selective write-through: a session's KV has no host copy until toolkv writes it."""
    with CacheHarness(
        HarnessConfig(device_tokens=1024, host_ratio=2.0, write_policy="write_through_selective")
    ) as harness:
        yield harness


@pytest.mark.parametrize("caveats", [FIXED, frozenset({"RoomIgnored"})], ids=["fixed", "RoomIgnored"])
def test_tool_start_evicts_unprotected_host_copies_for_room(
    hs: CacheHarness, caveats: frozenset[str]
) -> None:
    h = hs
    initial = h.accounting()
    m = mutant_manager(h.tree, caveats=caveats)
    fill_host_with_unprotected_copies(h, m, 10_000)
    a = list(range(1, 301))
    kv = turn(h, m, "a", a)
    b = list(range(100_000, 100_301))
    turn(h, m, "b", b)
    free = int(h.host_pool.available_size())
    room = host_evictable_tokens(h.tree.root_node)  # what sglang's evict_host can free
    assert free < 301 and room >= 602, "full of copies HiCache can free"
    if caveats:
        with pytest.raises(HostMemoryFull):
            m.tool_start("b")  # the old rule: a 507, and the session loses its KV
        m.close("a")
        m.close("b")
        h.drain()
        return
    m.tool_start("b")  # b is protected on the host: never evicted to make room for a
    step(h, m, 0.0, writes=True)
    assert m.kv_meta("b")["state"] == "Offloaded"
    assert int(h.host_pool.available_size()) < 300
    r = m.tool_start("a")
    assert r["state"] in ("Offloading", "Offloaded") and r["protected"] is True
    assert m.backend.counters_host_room == 2  # type: ignore[attr-defined]
    step(h, m, 1.0, writes=True)
    assert m.kv_meta("b")["host_tokens"] == 301, "another session's protected copy is untouched"
    h.scribble_unreferenced()
    m.tool_end("a", int(r["epoch"]))  # type: ignore[call-overload]
    step(h, m, 2.0, loads=True)
    assert torch.equal(h.device_kv(h.match(a).device_indices), kv), "restored bytes equal"
    m.close("a")
    m.close("b")
    h.drain()
    assert h.accounting() == initial


def test_a_refusal_names_the_evictable_room(hs: CacheHarness) -> None:
    h = hs
    m = ToolKVManager(h.tree)
    b = list(range(100_000, 101_000))  # protected: nothing else to evict
    turn(h, m, "b", b)
    m.tool_start("b", expected_s=0.01)  # both due back before "a" would be: nobody yields to it
    step(h, m, 0.0, writes=True)
    turn(h, m, "c", list(range(200_000, 201_000)))
    m.tool_start("c", expected_s=0.01)
    step(h, m, 0.0, writes=True)
    a = list(range(1, 301))
    turn(h, m, "a", a)
    with pytest.raises(HostMemoryFull) as ei:
        m.tool_start("a")
    assert ei.value.details["host_evictable_tokens"] == 0 and "0 evictable" in str(ei.value)
    assert m.kv_meta("a")["state"] == "Running", "a refusal changes nothing"
    for sid in ("a", "b", "c"):
        m.close(sid)


def test_a_full_host_demotes_the_session_predicted_back_last(hs: CacheHarness) -> None:
    """Spec Demote then HostRoom: with the host full of protected copies, the newcomer's offload
    demotes the offloaded session whose tool is predicted to return last (one far past its median:
    a heavy-tailed call that long is likely a long one), never one predicted back sooner."""
    h = hs
    initial = h.accounting()
    size = int(h.host_pool.available_size()) // 3 + 10  # two fit on the host, a third does not
    m = ToolKVManager(h.tree)
    toks = {
        sid: list(range(10_000 * (i + 1), 10_000 * (i + 1) + size))
        for i, sid in enumerate(("old", "new", "c"))
    }
    turn(h, m, "old", toks["old"])
    m.tool_start("old", tool="t")
    step(h, m, 0.0, writes=True)
    m.set_clock(60.0)  # "old" has run 60 s: far past the prior median (0.6 s)
    kv_new = turn(h, m, "new", toks["new"])
    m.tool_start("new", tool="t", expected_s=0.5)  # the client says: back in half a second
    step(h, m, 60.0, writes=True)
    turn(h, m, "c", toks["c"])
    m.set_clock(60.1)
    r = m.tool_start("c", tool="t")  # no free or evictable room: a demotion makes it
    assert r["state"] in ("Offloading", "Offloaded")
    assert m.kv_meta("old")["state"] == "Released", "predicted back last: demoted"
    assert m.kv_meta("new")["state"] == "Offloaded", "due back sooner: kept on the host"
    assert m.counters["demoted"] == 1
    step(h, m, 61.0, writes=True)
    h.scribble_unreferenced()
    m.tool_end("new", int(m.kv_meta("new")["epoch"]))  # type: ignore[call-overload]
    step(h, m, 62.0, loads=True)
    assert torch.equal(h.device_kv(h.match(toks["new"]).device_indices), kv_new), "restored bytes equal"
    for sid in ("old", "new", "c"):
        m.close(sid)
    h.drain()
    assert h.accounting() == initial


def test_nothing_predicted_back_later_means_a_refusal(hs: CacheHarness) -> None:
    h = hs
    size = int(h.host_pool.available_size()) // 3 + 10
    m = ToolKVManager(h.tree)
    toks = {
        sid: list(range(10_000 * (i + 1), 10_000 * (i + 1) + size)) for i, sid in enumerate(("a", "b", "c"))
    }
    for sid in ("a", "b"):
        turn(h, m, sid, toks[sid])
        m.tool_start(sid, tool="t", expected_s=0.05)  # both due back at once
        step(h, m, 0.0, writes=True)
    turn(h, m, "c", toks["c"])
    m.set_clock(0.01)
    with pytest.raises(HostMemoryFull):
        m.tool_start("c", tool="t")  # both others are due back before c: nobody yields
    assert m.counters["demoted"] == 0 and m.kv_meta("c")["state"] == "Running"
    for sid in ("a", "b", "c"):
        m.close(sid)
