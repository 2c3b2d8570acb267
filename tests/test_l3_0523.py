"""The L3 storage tier on sglang 0.5.23's ``UnifiedRadixCache``, over its REAL file backend
(``HiCacheFile``) and storage threads, on CPU (``toolkv.testing.unified_harness.UnifiedStorageHarness``),
on both tree cores (the Python ``UnifiedTreeCore`` and sglang's default Rust core).

As on 0.5.16 (``tests/test_l3_manager.py``): a session offloaded to host is stored to L3 when the
host must make room (spec ``Store``; HiCache wrote its pages to storage already, so the
``StoreAck`` is at once and the host protection goes), HiCache evicts its host copy, and its
``tool_end`` prefetches it back through the host (``StoragePrefetch`` … ``PrefetchAck``), restores
it host→GPU and hands it over: the bytes equal the offloaded bytes, and at the end every lock,
host reference, slot and sglang storage record is returned. A stale epoch changes nothing; a
release while the prefetch reads keeps the prefetch's pin until its ack (mutant
``ReleaseDropsPin`` loses); with ``l3_read_at_arrival`` sglang's own read at the request's arrival
brings the copy back. Runs in the 0.5.23 environment; skips with an older sglang.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from toolkv.testing.unified_harness import has_unified_radix_cache, sglang_version

if not has_unified_radix_cache():
    pytest.skip(
        f"needs sglang >= 0.5.21 (UnifiedRadixCache), found {sglang_version()}", allow_module_level=True
    )

import torch

from toolkv.core.backends.base import LocalAgreement
from toolkv.core.backends.unified import UnifiedBackend
from toolkv.core.manager import ManagerConfig, ToolKVManager, make_backend
from toolkv.errors import StaleEpoch, WrongState
from toolkv.testing.unified_harness import UnifiedHarnessConfig, UnifiedStorageHarness
from toolkv.verify.toolkv.mutants import release_drops_pin, trust_whole_read

A = list(range(1, 97))  # 96 tokens: 24 pages of 4
B = list(range(1001, 1097))  # another session, no shared prefix
BUDGET = 150  # host tokens toolkv may protect: one session fits, two do not
TTL = 100.0
CORES = ["python", "rust"]
NO_RECORDS = {
    "ongoing_backup": 0,
    "ongoing_prefetch": 0,
    "prefetch_tokens_occupied": 0,
    "prefetch_loaded_tokens": 0,
    "prefetch_loaded_start": 0,
    "prefetch_wait": 0,
    "prefetch_retries": 0,
    "prefetch_hit_accounting": 0,
}


@pytest.fixture(params=CORES)
def h(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[UnifiedStorageHarness]:
    cfg = UnifiedHarnessConfig(page_size=4, device_tokens=256, host_ratio=2.0, tree_core=request.param)
    with UnifiedStorageHarness(cfg, tmp_path / "l3") as harness:
        yield harness


def manager(
    h: UnifiedStorageHarness, *, mutant: Callable[[type], type] | None = None, read_at_arrival: bool = False
) -> tuple[ToolKVManager, UnifiedBackend]:
    config = ManagerConfig(ttl_s=TTL, host_budget_tokens=BUDGET, l3_read_at_arrival=read_at_arrival)
    be = make_backend(h.tree, config=config, agree=LocalAgreement())
    assert isinstance(be, UnifiedBackend) and be.storage_enabled()
    if mutant is not None:
        be.__class__ = mutant(type(be))
    return ToolKVManager(h.tree, be, config=config), be


def turn(h: UnifiedStorageHarness, m: ToolKVManager, sid: str, tokens: list[int]) -> torch.Tensor:
    """A finished turn of ``sid`` (its KV computed and inserted, as sglang does); returns its KV."""
    m.admit(sid)
    assert h.run_request(tokens)
    m.insert(sid, tokens)
    rec = m.sessions[sid]
    return h.device_kv(h.tree.path_device_indices(rec.node.id)).clone()


def step(h: UnifiedStorageHarness, m: ToolKVManager, now: float) -> None:
    """One scheduler iteration: sglang's events (storage queues drained), copies finished, the tick."""
    h.check_events()
    m.tick(now)
    h.complete("write")
    h.complete("load")
    h.check_events()
    m.tick(now)


def until(
    h: UnifiedStorageHarness, m: ToolKVManager, done: Callable[[], bool], timeout_s: float = 30.0
) -> None:
    """Scheduler iterations until ``done`` (sglang's storage threads run on their own time)."""
    deadline = time.monotonic() + timeout_s
    while True:
        step(h, m, m.now)
        if done():
            return
        assert time.monotonic() < deadline, "never happened"
        time.sleep(0.001)


def stored_and_evicted(h: UnifiedStorageHarness, m: ToolKVManager) -> tuple[int, torch.Tensor]:
    """Session ``a`` offloaded (its host write acked, HiCache's own write to storage acked), then
    ``b``'s tool_start finds the host budget reached: ``a`` is stored (spec ``Store``, ``StoreAck``
    at once: its pages are in storage) and its host protection goes; sglang's eviction then takes
    ``a``'s device and host copies. Returns ``a``'s epoch and KV."""
    kv = turn(h, m, "a", A)
    epoch = int(m.tool_start("a")["epoch"])  # type: ignore[call-overload]
    step(h, m, 0.0)
    assert m.kv_meta("a")["state"] == "Offloaded"
    until(h, m, lambda: len(h.stored_keys()) >= len(A) // 4 and not h.tree.ongoing_backup)
    turn(h, m, "b", B)
    m.tool_start("b", expected_s=0.0)  # back before a: a is the one to yield
    meta = m.kv_meta("a")
    assert (meta["state"], meta["l3"], meta["protected"]) == ("Offloaded", "stored", False), meta
    assert m.counters["demoted_l3"] == 1 and m.counters["demoted"] == 0, "stored, not dropped"
    step(h, m, 1.0)
    assert m.kv_meta("b")["state"] == "Offloaded"
    h.evict_device(10**6)
    h.check_events()
    h.evict_host(10**6)
    assert int(h.match(A).device_prefix_len) + int(h.match(A).host_hit_length) == 0, "only L3 holds a"
    assert int(h.match(B).host_hit_length) == len(B), "b's protected host copy stays"
    return epoch, kv


def settle(h: UnifiedStorageHarness, m: ToolKVManager) -> None:
    """Close what is left and let every copy, store and prefetch finish; evict everything."""
    for sid in list(m.sessions):
        m.close(sid)
    until(h, m, lambda: not h.tree.ongoing_prefetch and not h.tree.ongoing_backup)
    h.drain()


def test_a_session_stored_to_l3_comes_back_byte_identical(h: UnifiedStorageHarness) -> None:
    initial = h.accounting()
    m, be = manager(h)
    epoch, kv = stored_and_evicted(h, m)
    meta = m.tool_end("a", epoch)
    assert (meta["state"], meta["l3"]) == ("Offloaded", "fetching"), "reading from L3"
    assert set(be.storage_copies) == {"a"} and be.storage_copies["a"].rid is not None, "pinned"
    with pytest.raises(WrongState):
        m.tool_end("a", epoch)  # accepted already: never a second restore
    assert m.admit("a") is False
    until(h, m, lambda: m.kv_meta("a")["state"] not in ("Offloaded", "Restoring", "Handover"))
    meta = m.kv_meta("a")
    assert meta["state"] == "Runnable" and meta["recompute_tokens"] == 0, meta
    dev = h.tree.path_device_indices(m.sessions["a"].node.id)
    assert dev.numel() == len(A)
    assert torch.equal(h.device_kv(dev), kv), "restored device bytes = offloaded bytes"
    assert not be.storage_copies and m.counters["l3_restored"] == 1
    settle(h, m)
    assert h.storage_records() == NO_RECORDS, "every sglang storage record returned"
    assert h.accounting() == initial, "every lock, host reference and slot returned"


def test_a_stale_epoch_changes_nothing(h: UnifiedStorageHarness) -> None:
    initial = h.accounting()
    m, be = manager(h)
    epoch, _ = stored_and_evicted(h, m)
    before = (m.kv_meta("a"), dict(be.storage_copies), h.storage_records())
    with pytest.raises(StaleEpoch):
        m.tool_end("a", epoch - 1)
    assert (m.kv_meta("a"), dict(be.storage_copies), h.storage_records()) == before
    m.tool_end("a", epoch)
    before = (m.kv_meta("a"), be.storage_copies["a"].rid, len(h.tree.ongoing_prefetch))
    with pytest.raises(StaleEpoch):
        m.tool_end("a", epoch + 1)
    assert (m.kv_meta("a"), be.storage_copies["a"].rid, len(h.tree.ongoing_prefetch)) == before
    settle(h, m)
    assert h.storage_records() == NO_RECORDS
    assert h.accounting() == initial


@pytest.mark.parametrize("mutant", [False, True], ids=["fixed", "ReleaseDropsPin"])
def test_a_close_during_the_prefetch_keeps_its_pin_until_the_ack(
    h: UnifiedStorageHarness, mutant: bool
) -> None:
    """The session closes while sglang reads its copy: toolkv's record of the copy (its storage
    protection and the prefetch's pin) stays until the prefetch's own ack, which the tick takes
    (``poll_storage``); then every record is returned. Mutant ``ReleaseDropsPin`` drops it at the
    close: the copy is unpinned while it is read, and nobody ends the prefetch for sglang (its
    per-request records are left behind)."""
    initial = h.accounting()
    m, be = manager(h, mutant=release_drops_pin if mutant else None)
    epoch, _ = stored_and_evicted(h, m)
    m.tool_end("a", epoch)
    assert h.tree.ongoing_prefetch, "sglang reads the copy"
    m.close("a")
    m.close("b")
    if mutant:
        assert not be.storage_copies and h.tree.ongoing_prefetch, "unpinned while it is read"
        until(h, m, lambda: not h.tree.ongoing_prefetch)
        assert h.storage_records() != NO_RECORDS, "the prefetch's records are left behind"
        return
    assert be.storage_copies["a"].released, "closed, still pinned by its prefetch"
    until(h, m, lambda: not be.storage_copies and not h.tree.ongoing_prefetch)
    settle(h, m)
    assert h.storage_records() == NO_RECORDS
    assert h.accounting() == initial


@pytest.mark.parametrize("mutant", [False, True], ids=["fixed", "TrustWholeRead"])
def test_a_page_evicted_between_sglangs_read_and_toolkvs_ack_is_recomputed(
    h: UnifiedStorageHarness, mutant: bool
) -> None:
    """0.5.23 only (``spec/storage/UnifiedRead.tla``, ``ReadLost``): sglang's ack drain puts the pages
    read into the host tree, unprotected, before toolkv's tick takes the ``PrefetchAck``; its host
    eviction runs in between and takes them. toolkv reads the host tree at the ack: the read is
    short, nothing came back, the session runs and its next turn recomputes it, and everything is
    returned. Mutant ``TrustWholeRead`` takes the whole, pinned copy for a whole read."""
    initial = h.accounting()
    m, be = manager(h, mutant=trust_whole_read if mutant else None)
    epoch, _ = stored_and_evicted(h, m)
    m.tool_end("a", epoch)
    deadline = time.monotonic() + 30.0
    while h.tree.ongoing_prefetch:  # sglang's own drain ends the read (no toolkv tick yet)
        h.check_events()
        assert time.monotonic() < deadline, "the read never ended"
        time.sleep(0.001)
    assert h.evict_host(10**6) >= len(A), "the pages read were unprotected host copies"
    if mutant:
        with pytest.raises(Exception):  # noqa: B017 - any outcome but the fixed one
            step(h, m, 2.0)
            assert m.counters["l3_prefetch_short"] == 1 and m.kv_meta("a")["restore"] == "recompute"
        return
    step(h, m, 2.0)
    meta = m.kv_meta("a")
    assert (meta["state"], meta["restore"], meta["recompute_tokens"]) == ("Running", "recompute", len(A)), (
        meta
    )
    assert m.counters["l3_prefetch_short"] == 1 and m.counters["l3_restored"] == 0
    assert not be.storage_copies
    settle(h, m)
    assert h.storage_records() == NO_RECORDS
    assert h.accounting() == initial


def test_read_at_arrival_leaves_the_read_to_sglang(h: UnifiedStorageHarness) -> None:
    """``l3_read_at_arrival`` (the plugin's default): the tool_end of a session stored whole reads
    nothing itself and holds nothing (spec ``ToolEndAtArrival``); sglang's own prefetch at the
    next request's arrival reads the copy from storage and its load-back brings it to the device,
    byte for byte."""
    initial = h.accounting()
    m, be = manager(h, read_at_arrival=True)
    epoch, kv = stored_and_evicted(h, m)
    with pytest.raises(StaleEpoch):
        m.tool_end("a", epoch - 1)
    meta = m.tool_end("a", epoch)
    assert meta["state"] == "Running" and "l3" not in meta and not meta["protected"], meta
    assert not be.storage_copies and m.counters["tool_end_l3_arrival"] == 1
    assert h.prefetch("req-a", A) == len(A), "sglang's own arrival read found the copy in storage"
    dev = h.load_to_device(A)
    assert torch.equal(h.device_kv(dev), kv), "the bytes sglang read back = the offloaded bytes"
    settle(h, m)
    assert h.storage_records() == NO_RECORDS
    assert h.accounting() == initial


def test_the_plugin_takes_the_l3_settings_on_0523(h: UnifiedStorageHarness) -> None:
    """A 0.5.23 server with ``--hicache-storage-backend file`` and the L3 settings
    (``TOOLKV_L3``, ``TOOLKV_L3_READ_AT_ARRIVAL``, the rates and the margin) is served: nothing in
    the server flags or the tree is refused, and the plugin's manager has the storage tier on."""
    from toolkv.sglang.config import ToolKVConfig
    from toolkv.sglang.scheduler_side import check_tree, unsupported_reasons

    assert h.server_args.hicache_storage_backend == "file"
    assert unsupported_reasons(h.server_args) == []
    check_tree(h.tree)
    env = {
        "TOOLKV_L3": "1",
        "TOOLKV_L3_READ_AT_ARRIVAL": "1",
        "TOOLKV_L3_READ_TOKENS_PER_S": "50000",
        "TOOLKV_L3_WRITE_TOKENS_PER_S": "50000",
        "TOOLKV_L3_STORE_MARGIN_S": "5",
    }
    config = ToolKVConfig.from_env(env).manager_config()
    m = ToolKVManager(h.tree, make_backend(h.tree, config=config, agree=LocalAgreement()), config=config)
    assert m.caps.storage is not None and m.machine._storage_on()
    assert config.l3_read_at_arrival and config.l3_read_tokens_per_s == 50_000
