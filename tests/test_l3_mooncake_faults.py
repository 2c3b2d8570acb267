"""Faults of the shared tier when it is Mooncake (``spec/storage/SharedTier.tla``: ``Drain`` of a
Storing session, ``MasterRestart``, the store full), on CPU with real parts: a real
``mooncake_master`` and storage node on loopback, started, restarted and stopped by each test (its
own, so that a restart or a full store touches no other test), servers that are real HiRadixCache
instances over sglang's own ``mooncake`` backend with toolkv's manager.

For each fault: what toolkv acknowledged is not lost (a session whose store did not complete keeps
its protected host copy and is restored from it, bytes equal), nothing leaks (every lock, host
reference and slot returned; the pages of a store nobody acknowledged are not pinned: the master
evicts them), and the refusals are typed errors with a message (``unknown_session``, 404 at the
HTTP edge). Skipped with the reason when Mooncake cannot start here; ``REQUIRE_MOONCAKE=1``
(``make test``) makes that a failure instead.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch
from _cycle import step, turn

from toolkv.core.backends.hiradix import HiRadixBackend
from toolkv.core.backends.mooncake_tier import MANIFEST_PREFIX, soft_pin_config
from toolkv.core.config import ManagerConfig
from toolkv.core.manager import ToolKVManager
from toolkv.errors import HostMemoryFull, UnknownSession
from toolkv.testing.harness import HarnessConfig
from toolkv.testing.mooncake import MooncakeStore, MooncakeUnavailable, running
from toolkv.testing.storage_harness import MooncakeCacheHarness

CFG = HarnessConfig(device_tokens=256, host_ratio=2.0, page_size=4, layout="page_first")
A = list(range(1, 97))  # 96 tokens: 24 pages of 4
A2 = A + list(range(2001, 2033))  # the session's next turn: 8 more pages
B = list(range(1001, 1097))  # another session, no shared prefix
BUDGET = 150  # host tokens toolkv may protect: one session fits, two do not
TTL = 100.0
SEGMENT = 32 << 20  # the storage node's memory
BLOB = 256 << 10


@pytest.fixture
def mooncake() -> Iterator[MooncakeStore]:
    try:
        with running(segment_bytes=SEGMENT) as store:
            yield store
    except MooncakeUnavailable as e:
        if os.environ.get("REQUIRE_MOONCAKE") == "1":
            raise
        pytest.skip(f"Mooncake cannot run here: {e}")


def manager(h: MooncakeCacheHarness) -> ToolKVManager:
    be = HiRadixBackend(h.tree, host_budget_tokens=BUDGET)
    cfg = ManagerConfig(ttl_s=TTL, host_budget_tokens=BUDGET, l3_read_at_arrival=True)
    return ToolKVManager(h.tree, be, config=cfg)


def wait_for_puts(h: MooncakeCacheHarness) -> None:
    """sglang's backup thread has put every queued page and queued its ack, which the scheduler
    has not drained: toolkv's store is in flight (its ``StoreAck`` not taken)."""
    h._wait(lambda: h.controller.ack_backup_queue.qsize() >= len(h.tree.ongoing_backup), "put its pages")
    assert h.tree.ongoing_backup, "a store is in flight"


def fill_tier(h: MooncakeCacheHarness, n: int) -> int:
    """Another tenant's ``n`` unpinned objects of ``BLOB`` bytes (more than the node holds): the
    master evicts the oldest unpinned objects for them. Returns how many puts it refused."""
    import time

    blob = b"\x5a" * BLOB
    refused = 0
    for i in range(n):
        refused += int(h.backend.store.put(f"other-{i}", blob)) != 0
        if i % 16 == 15:
            time.sleep(0.02)  # the master's eviction thread runs on its own time
    return refused


def fill_pinned(h: MooncakeCacheHarness) -> int:
    """Fill the store to the brim with soft-pinned objects (the master may evict none of them):
    large ones, then smaller ones into what is left, down to less than a page of KV. Returns how
    many puts were refused."""
    config = soft_pin_config(60_000)
    refused = 0
    for size in (BLOB, 4 << 10, 512):
        in_a_row = 0
        for i in range(SEGMENT // size + 16):
            rc = int(h.backend.store.put(f"pinned-{size}-{i}", b"\x5a" * size, config))
            in_a_row = in_a_row + 1 if rc != 0 else 0
            refused += rc != 0
            if in_a_row == 4:
                break  # this size fits no more
    return refused


def stored_then_back(h: MooncakeCacheHarness, m: ToolKVManager) -> tuple[torch.Tensor, int]:
    """Session "a": a turn, tool_start, then session "b"'s tool_start makes it yield its host room:
    stored whole to the tier (its StoreAck taken). Returns a's KV and its epoch."""
    kv = turn(h, m, "a", A)
    epoch = int(m.tool_start("a")["epoch"])  # type: ignore[call-overload]
    step(h, m, 0.0, writes=True)
    h.await_store_acks()
    turn(h, m, "b", B)
    m.tool_start("b", expected_s=0.0)
    return kv, epoch


def settle(h: MooncakeCacheHarness, m: ToolKVManager, now: float) -> None:
    """Scheduler iterations until no copy and no store is in flight."""
    step(h, m, now, writes=True)
    h.await_store_acks()
    step(h, m, now, writes=True)


def close_all(h: MooncakeCacheHarness, m: ToolKVManager, now: float, *sids: str) -> None:
    for sid in sids:
        m.close(sid)
    settle(h, m, now)
    h.drain()


def test_a_stores_pages_are_pinned_from_their_put_not_from_its_ack(mooncake: MooncakeStore) -> None:
    """SharedTier.tla's ``PutKept``: the master evicts nothing a store put, between its put and its
    ack. Before, the pages went through sglang's backup unpinned and were pinned only at the
    StoreAck: another tenant's puts in between made the master evict them, and the store came
    back short (mutant ``PinAtAck``). Then, once toolkv relies on the copy no longer (closed),
    its pins are released: the master evicts its pages again (``PinsReleased``)."""
    with MooncakeCacheHarness(CFG, mooncake) as a:
        initial = a.accounting()
        m = manager(a)
        be = m.machine.backend
        turn(a, m, "a", A)
        m.tool_start("a")
        step(a, m, 0.0, writes=True)
        a.await_store_acks()  # sglang's own backup of the host copy, unpinned
        fill_tier(a, 4 * SEGMENT // BLOB)  # the master evicts it for another tenant
        assert a.storage_hit_tokens(A) < len(A)
        m.store("a")  # toolkv stores the session
        if a.tree.ongoing_backup:  # a store whose pages sglang's backup puts
            wait_for_puts(a)
        refused = fill_tier(a, 4 * SEGMENT // BLOB)  # before the ack: the master evicts what it may
        settle(a, m, 1.0)
        assert m.counters["l3_store_short"] == 0 and m.counters["demoted_l3"] == 1, (m.counters, refused)
        assert a.storage_hit_tokens(A) == len(A), "every page the store put survived the eviction"
        assert m.kv_meta("a")["l3"] == "stored"
        close_all(a, m, 2.0, "a")
        assert not be.storage_copies and not be._held and be.pins_left == 0, "every pin released"
        fill_tier(a, 4 * SEGMENT // BLOB)
        assert a.storage_hit_tokens(A) < len(A), "the released pages are the master's to evict again"
        assert a.accounting() == initial, "every lock, host reference and slot returned"


def test_master_restarted_mid_store(mooncake: MooncakeStore) -> None:
    with MooncakeCacheHarness(CFG, mooncake) as a:
        initial = a.accounting()
        m = manager(a)
        kv = turn(a, m, "a", A)
        epoch = int(m.tool_start("a")["epoch"])  # type: ignore[call-overload]
        step(a, m, 0.0, writes=True)  # the host copy; sglang's own backup of it to the tier queued
        assert a.tree.ongoing_backup, "sglang's backup is in flight"
        m.store("a")  # toolkv's pinned put of every page; the ack waits for sglang's backup
        assert m.kv_meta("a")["l3"] == "storing", m.kv_meta("a")
        assert a.storage_hit_tokens(A) == len(A), "the pages are in the tier, toolkv's ack not taken"
        mooncake.restart_master()  # mid-store: the master's objects are gone
        settle(a, m, 1.0)
        assert m.counters["l3_store_short"] == 1 and m.counters["demoted_l3"] == 0, m.counters
        meta = m.kv_meta("a")
        assert meta["state"] == "Offloaded" and meta["protected"] and not meta.get("l3"), meta
        assert a.backend.store.is_exist(MANIFEST_PREFIX + "a") != 1, "no manifest names a short store"
        # tool_end on the server that knows it: restored from its host copy, the bytes it computed
        m.tool_end("a", epoch)
        step(a, m, 2.0, loads=True)
        step(a, m, 2.0, loads=True)
        assert torch.equal(a.device_kv(a.match(A).device_indices), kv), "the host copy came back whole"
        close_all(a, m, 3.0, "a")
        assert a.accounting() == initial, "every lock, host reference and slot returned"


def test_a_copy_acknowledged_before_a_restart_is_refused_on_another_server_and_recomputed(
    mooncake: MooncakeStore,
) -> None:
    with MooncakeCacheHarness(CFG, mooncake) as a:
        m = manager(a)
        _kv, epoch = stored_then_back(a, m)
        settle(a, m, 1.0)
        assert m.kv_meta("a")["l3"] == "stored"
        a.drain()  # server A goes with its records
    mooncake.restart_master()  # and the master loses the copy it had acknowledged
    with MooncakeCacheHarness(CFG, mooncake) as b:
        initial = b.accounting()
        m = manager(b)
        with pytest.raises(UnknownSession) as e:
            m.tool_end("a", epoch)
        assert e.value.http_status == 404 and e.value.to_dict()["error"] == "unknown_session"
        assert "'a'" in e.value.message
        assert b.storage_hit_tokens(A) == 0, "the restarted master holds nothing"
        turn(b, m, "a", A)  # the client's next turn is a plain request: recomputed
        close_all(b, m, 2.0, "a")
        assert b.accounting() == initial


def test_a_server_killed_mid_store_leaves_nothing_another_server_adopts(mooncake: MooncakeStore) -> None:
    with MooncakeCacheHarness(CFG, mooncake) as a:
        m = manager(a)
        _kv, e1 = stored_then_back(a, m)
        settle(a, m, 1.0)
        assert m.kv_meta("a")["l3"] == "stored"
        m.tool_end("a", e1)  # on its own server: read at arrival, the manifest goes
        assert a.backend.store.is_exist(MANIFEST_PREFIX + "a") != 1, "the arrival read drops the manifest"
        assert a.prefetch("req-a", A) >= 0
        a.load_to_device(A)
        kv2 = turn(a, m, "a", A2)  # the next turn, then a tool call whose store is in flight
        e2 = int(m.tool_start("a")["epoch"])  # type: ignore[call-overload]
        step(a, m, 2.0, writes=True)  # sglang's own backup of the new pages queued
        assert a.tree.ongoing_backup, "sglang's backup is in flight"
        m.store("a")  # toolkv's pinned put of every page; the ack waits for sglang's backup
        assert m.kv_meta("a")["l3"] == "storing", m.kv_meta("a")
        # server A is killed here: the StoreAck is never taken (no manifest); the pins its puts
        # took stay to their deadline (SharedTier.tla's PutPinLapse: nobody is left to release them)
    with MooncakeCacheHarness(CFG, mooncake) as b:
        initial = b.accounting()
        m = manager(b)
        for epoch in (e2, e1):  # the store of e2 was never acknowledged; e1 is stale
            with pytest.raises(UnknownSession) as e:
                m.tool_end("a", epoch)
            assert e.value.http_status == 404 and e.value.message
        assert m.counters["tool_end_adopted"] == 0
        # the killed store's pages keep their pins to the deadline: the master evicts other objects
        refused = fill_tier(b, 4 * SEGMENT // BLOB)
        assert b.storage_hit_tokens(A2) == len(A2), f"the killed store's pinned pages ({refused} refused)"
        # the next turn's own prefetch (sglang's) reads them: no toolkv record, no adoption
        assert b.prefetch("req-a", A2) == len(A2)
        dev = b.load_to_device(A2)
        assert torch.equal(b.device_kv(dev), kv2), "the bytes A computed"
        turn(b, m, "a", A2)
        close_all(b, m, 3.0, "a")
        assert b.accounting() == initial


def test_the_store_full_leaves_the_session_on_its_host_copy(mooncake: MooncakeStore) -> None:
    with MooncakeCacheHarness(CFG, mooncake) as a:
        initial = a.accounting()
        m = manager(a)
        assert fill_pinned(a) > 0, "the master refused puts once its capacity was spent"
        kv = turn(a, m, "a", A)
        epoch = int(m.tool_start("a")["epoch"])  # type: ignore[call-overload]
        step(a, m, 0.0, writes=True)
        a.await_store_acks()  # sglang's own backup: refused by the full store
        turn(a, m, "b", B)
        # a cannot yield its host room: its store is short, and b is due later than a (a is not
        # dropped for it)
        with pytest.raises(HostMemoryFull) as e:
            m.tool_start("b", expected_s=10_000.0)
        assert e.value.http_status == 507 and e.value.to_dict()["error"] == "host_memory_full"
        assert "'b'" in e.value.message
        settle(a, m, 1.0)  # the StoreAck of a's store: short
        assert m.counters["l3_store_short"] == 1, m.counters
        assert m.counters["demoted_l3"] == 0, m.counters
        meta = m.kv_meta("a")
        assert meta["state"] == "Offloaded" and meta["protected"] and not meta.get("l3"), meta
        assert m.kv_meta("b")["state"] == "Running", "the refused tool_start changed nothing"
        assert a.backend.store.is_exist(MANIFEST_PREFIX + "a") != 1
        m.tool_end("a", epoch)
        step(a, m, 2.0, loads=True)
        step(a, m, 2.0, loads=True)
        assert torch.equal(a.device_kv(a.match(A).device_indices), kv), "restored from the host copy"
        close_all(a, m, 3.0, "a", "b")
        assert a.accounting() == initial, "every lock, host reference and slot returned"


def test_the_pin_budget_refuses_a_store_past_it_and_leaves_the_rest_to_the_master(
    mooncake: MooncakeStore,
) -> None:
    """SharedTier.tla's ``PinFits`` / ``PinsWithinBudget``: the master evicts no soft-pinned page, so
    pinned copies that fill the store make it refuse every later put. With ``l3_pin_tokens`` one
    session's worth, a second session's store is refused (``l3_store_pin_cap``; it keeps its host
    copy, restored from it bytes equal) and only the first's pages stay pinned: another tenant's
    puts evict the second's pages sglang wrote through. Without the cap (mutant ``NoPinCap``) both
    copies are pinned: the pinned pages pass the budget."""
    with MooncakeCacheHarness(CFG, mooncake) as a:
        initial = a.accounting()
        be = HiRadixBackend(a.tree, host_budget_tokens=2 * BUDGET)
        cfg = ManagerConfig(ttl_s=TTL, host_budget_tokens=2 * BUDGET, l3_pin_tokens=len(A))
        m = ToolKVManager(a.tree, be, config=cfg)
        kv = {}
        for sid, toks in (("a", A), ("b", B)):
            kv[sid] = turn(a, m, sid, toks)
            m.tool_start(sid)
            step(a, m, 0.0, writes=True)
            a.await_store_acks()  # sglang's own write-through of the host copies, unpinned
        m.store("a")  # one session's copy fits the budget
        settle(a, m, 1.0)
        assert m.kv_meta("a")["l3"] == "stored", m.counters
        m.store("b")  # refused by the cap: changes nothing
        assert m.counters["l3_store_pin_cap"] == 1 and m.counters["l3_store_refused"] == 1, m.counters
        meta = m.kv_meta("b")
        assert meta["state"] == "Offloaded" and meta["protected"] and not meta.get("l3"), meta
        fill_tier(a, 4 * SEGMENT // BLOB)  # the master evicts what is not pinned
        assert a.storage_hit_tokens(A) == len(A), "the copy within the budget stays pinned"
        assert a.storage_hit_tokens(B) < len(B), "nothing of the refused store is pinned"
        epoch_b = int(m.kv_meta("b")["epoch"])  # type: ignore[call-overload]
        m.tool_end("b", epoch_b)
        step(a, m, 2.0, loads=True)
        step(a, m, 2.0, loads=True)
        assert torch.equal(a.device_kv(a.match(B).device_indices), kv["b"]), "restored from the host copy"
        close_all(a, m, 3.0, "a", "b")
        assert not be.storage_copies and not be._held and be.pins_left == 0, "every pin released"
        assert a.accounting() == initial, "every lock, host reference and slot returned"
