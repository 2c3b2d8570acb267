"""The manager drives the L3 storage tier (issue 27, item 2) over sglang 0.5.16's REAL file backend
(``HiCacheFile``) and storage threads, on CPU (``toolkv.testing.storage_harness``).

When the host must make room (the host budget is reached), an ``Offloaded`` session predicted
back later is not dropped: its host copy is stored to L3 (spec ``Store``), and the host copy is
released only at the ``StoreAck`` of a whole copy. Its ``tool_end`` prefetches it back into the
host pool (``StoragePrefetch`` … ``PrefetchAck``) and then restores host→GPU and hands it over as
usual. A close or TTL during a store or a prefetch returns every lock, host reference, slot and
storage pin; a stale epoch changes nothing. The implementation mutants ``TrustShortAck`` and
``ReleaseDropsPin`` (``toolkv.verify.backend_mutants``) must lose.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from _cycle import step, turn

from toolkv.core.backends.hiradix import HiRadixBackend
from toolkv.core.manager import ManagerConfig, ToolKVManager
from toolkv.errors import HostMemoryFull, StaleEpoch, WrongState
from toolkv.testing.harness import HarnessConfig
from toolkv.testing.storage_harness import StorageCacheHarness
from toolkv.verify.backend_mutants import ReleaseDropsPinBackend, TrustShortAckBackend

CFG = HarnessConfig(device_tokens=256, host_ratio=2.0, page_size=4)
A = list(range(1, 97))  # 96 tokens: 24 pages of 4
B = list(range(1001, 1097))  # another session, no shared prefix
BUDGET = 150  # host tokens toolkv may protect: one session fits, two do not
TTL = 100.0


def until(
    h: StorageCacheHarness, m: ToolKVManager, done: Callable[[], bool], timeout_s: float = 30.0
) -> None:
    """Scheduler iterations until ``done``: ``check_hicache_events``, copies finished, the tick.
    sglang's storage threads run on their own time, so the test waits for them as a server does."""
    deadline = time.monotonic() + timeout_s
    while True:
        step(h, m, m.now, writes=True, loads=True)
        if done():
            return
        assert time.monotonic() < deadline, "never happened"
        time.sleep(0.001)


def setup(
    h: StorageCacheHarness, backend: type[HiRadixBackend] = HiRadixBackend
) -> tuple[ToolKVManager, HiRadixBackend, int, torch.Tensor]:
    """Session ``a`` offloaded to host (its write and HiCache's own write to storage acked), then
    session ``b``'s turn. Returns the manager, its backend, ``a``'s epoch and its KV."""
    be = backend(h.tree, host_budget_tokens=BUDGET)
    m = ToolKVManager(h.tree, be, config=ManagerConfig(ttl_s=TTL, host_budget_tokens=BUDGET))
    kv = turn(h, m, "a", A)
    epoch = int(m.tool_start("a")["epoch"])  # type: ignore[call-overload]
    step(h, m, 0.0, writes=True)
    assert m.kv_meta("a")["state"] == "Offloaded"
    h.await_store_acks()
    turn(h, m, "b", B)
    return m, be, epoch, kv


def demote_a(h: StorageCacheHarness, m: ToolKVManager) -> None:
    """``b``'s tool_start finds the host budget reached: ``a`` goes to L3 (its pages are in storage
    already, so the StoreAck comes at once), ``b`` is offloaded; HiCache then evicts ``a``'s host
    copy, which nothing protects any more."""
    m.tool_start("b", expected_s=0.0)  # back before a: a is the one to yield
    meta = m.kv_meta("a")
    assert (meta["state"], meta["tier"], meta["l3"], meta["protected"]) == (
        "Offloaded",
        "l3",
        "stored",
        False,
    )
    assert m.counters["demoted_l3"] == 1 and m.counters["demoted"] == 0, "stored, not dropped"
    step(h, m, 1.0, writes=True)
    assert m.kv_meta("b")["state"] == "Offloaded"
    h.evict_host(10**6)
    assert h.match(A).host_hit_length == 0, "a's host copy is gone: only L3 holds it"
    assert int(h.match(B).host_hit_length) == len(B), "b's protected host copy stays"


def settle(h: StorageCacheHarness, m: ToolKVManager) -> None:
    """Close what is left and let every copy, store and prefetch finish."""
    for sid in list(m.sessions):
        m.close(sid)
    until(h, m, lambda: not h.tree.ongoing_prefetch and not h.tree.ongoing_backup)
    h.drain()


def test_a_session_demoted_to_l3_when_the_host_is_full_comes_back_byte_identical(tmp_path: Path) -> None:
    with StorageCacheHarness(CFG, tmp_path / "l3") as h:
        initial = h.accounting()
        m, be, epoch, kv = setup(h)
        demote_a(h, m)
        meta = m.tool_end("a", epoch)
        assert (meta["state"], meta["l3"]) == ("Offloaded", "fetching"), "reading from L3"
        with pytest.raises(WrongState):
            m.tool_end("a", epoch)  # accepted already: never a second restore
        assert m.admitted("a") is False  # the next request came early: the hand-over ends at once
        until(h, m, lambda: m.kv_meta("a")["state"] not in ("Offloaded", "Restoring", "Handover"))
        meta = m.kv_meta("a")
        assert meta["state"] == "Runnable" and meta["restore"] == "loading" and meta["recompute_tokens"] == 0
        dev = h.match(A).device_indices
        assert dev.numel() == len(A)
        assert torch.equal(h.device_kv(dev), kv), "restored device bytes = offloaded bytes"
        assert not be.storage_copies and m.counters["l3_restored"] == 1
        settle(h, m)
        assert h.accounting() == initial, "every lock, host reference and slot returned"


def test_a_prefetch_that_stops_short_restores_what_came_back(tmp_path: Path) -> None:
    """A page of the L3 copy is gone (another tenant, an evictor): the pages before it are restored
    with the right bytes and the next turn recomputes the rest, never read as whole."""
    with StorageCacheHarness(CFG, tmp_path / "l3") as h:
        initial = h.accounting()
        m, _, epoch, kv = setup(h)
        demote_a(h, m)
        keys = list(h.controller.get_hash_str(A, None, page_size=CFG.page_size))
        (tmp_path / "l3" / f"{keys[10]}{h.backend.config_suffix}.bin").unlink()
        m.tool_end("a", epoch)
        until(h, m, lambda: m.kv_meta("a")["state"] == "Handover")
        meta = m.kv_meta("a")
        got = 10 * CFG.page_size
        assert (meta["restored_tokens"], meta["recompute_tokens"]) == (got, len(A) - got)
        dev = h.match(A).device_indices
        assert dev.numel() == got
        assert torch.equal(h.device_kv(dev), kv[:, :, :got]), "the pages that came back are right"
        assert m.counters["l3_prefetch_short"] == 1
        settle(h, m)
        assert h.accounting() == initial


@pytest.mark.parametrize("end", ["close", "ttl"])
def test_a_close_or_ttl_during_a_store_returns_everything(tmp_path: Path, end: str) -> None:
    """The storage lost HiCache's copy, so ``a``'s store writes every page: ``b`` finds no room
    while it runs (the host copy goes only at the ack) and ``a`` ends mid-store."""
    with StorageCacheHarness(CFG, tmp_path / "l3") as h:
        initial = h.accounting()
        m, be, _, _ = setup(h)
        for f in (tmp_path / "l3").iterdir():
            f.unlink()
        with pytest.raises(HostMemoryFull):
            m.tool_start("b", expected_s=0.0)
        meta = m.kv_meta("a")
        assert (meta["l3"], meta["protected"], meta["tier"]) == ("storing", True, "CpuProtected")
        assert m.counters["demoted"] == 0 and be.storage_copies, "protected in both tiers until the ack"
        if end == "close":
            m.close("a")
        else:
            m.tick(TTL + 1)
            assert m.kv_meta("a")["state"] == "Expired"
        assert not be.storage_copies and not m._storing
        settle(h, m)
        assert h.accounting() == initial


@pytest.mark.parametrize("backend", [HiRadixBackend, TrustShortAckBackend], ids=["fixed", "TrustShortAck"])
def test_a_store_the_backend_cuts_short_keeps_the_host_copy(
    tmp_path: Path, backend: type[HiRadixBackend]
) -> None:
    """Spec ``StoreRefused``: the backend refuses a page; the store's ack finds the copy short and
    ``a`` stays on its protected host copy, restored whole. Mutant ``TrustShortAck`` lets the host
    copy go and restores a prefix: KV lost."""
    with StorageCacheHarness(CFG, tmp_path / "l3") as h:
        initial = h.accounting()
        m, _, epoch, kv = setup(h, backend)
        keys = list(h.controller.get_hash_str(A, None, page_size=CFG.page_size))
        (tmp_path / "l3" / f"{keys[5]}{h.backend.config_suffix}.bin").unlink()
        real_set = h.backend.set

        def full(key: str, *a: object, **k: object) -> bool:
            return False if key == keys[5] else bool(real_set(key, *a, **k))

        h.backend.set = full
        with pytest.raises(HostMemoryFull):
            m.tool_start("b", expected_s=0.0)  # a's store is in flight: no room yet
        h.await_store_acks()
        m.tick(1.0)
        h.evict_host(10**6)
        m.tool_end("a", epoch)
        until(h, m, lambda: m.kv_meta("a")["state"] == "Handover")
        dev = h.match(A).device_indices
        if backend is TrustShortAckBackend:
            assert m.counters["demoted_l3"] == 1 and dev.numel() == 5 * CFG.page_size < len(A), "KV lost"
        else:
            assert m.counters["l3_store_short"] == 1 and m.counters["demoted_l3"] == 0
            assert dev.numel() == len(A) and torch.equal(h.device_kv(dev), kv), "whole, from the host copy"
        settle(h, m)
        assert h.accounting() == initial


@pytest.mark.parametrize("end", ["close", "ttl"])
@pytest.mark.parametrize(
    "backend", [HiRadixBackend, ReleaseDropsPinBackend], ids=["fixed", "ReleaseDropsPin"]
)
def test_a_close_or_ttl_during_a_prefetch_returns_every_pin(
    tmp_path: Path, backend: type[HiRadixBackend], end: str
) -> None:
    """The session ends while sglang reads its copy: the prefetch's pin holds the copy until its own
    ack, which the tick takes (``poll_storage``), and then every host slot, host reference and lock
    is back. Mutant ``ReleaseDropsPin`` drops the pin at once: nobody finishes the prefetch."""
    with StorageCacheHarness(CFG, tmp_path / "l3") as h:
        initial = h.accounting()
        m, be, epoch, _ = setup(h, backend)
        demote_a(h, m)
        m.tool_end("a", epoch)
        (rid,) = list(h.tree.ongoing_prefetch)
        if end == "close":
            m.close("a")
        else:
            m.tick(TTL + 1)
            assert m.kv_meta("a")["state"] == "Expired"
        m.close("b")
        if backend is ReleaseDropsPinBackend:
            op = h.tree.ongoing_prefetch[rid][2]
            until(
                h,
                m,
                lambda: op.hash_value != [] and op.completed_tokens == len(op.hash_value) * CFG.page_size,
            )
            step(h, m, m.now)
            assert not be.storage_copies and rid in h.tree.ongoing_prefetch, "nobody holds the prefetch"
            h.drain()
            assert h.accounting() != initial, "leaked"
            assert h.tree.check_prefetch_progress(rid)  # clean up for the teardown
            return
        assert be.storage_copies["a"].released, "closed, still pinned by its prefetch"
        until(h, m, lambda: not be.storage_copies and not h.tree.ongoing_prefetch)
        settle(h, m)
        assert h.accounting() == initial


def test_a_stale_epoch_changes_nothing(tmp_path: Path) -> None:
    with StorageCacheHarness(CFG, tmp_path / "l3") as h:
        initial = h.accounting()
        m, be, epoch, _ = setup(h)
        demote_a(h, m)
        before = (m.kv_meta("a"), dict(be.storage_copies))
        with pytest.raises(StaleEpoch):
            m.tool_end("a", epoch - 1)
        assert (m.kv_meta("a"), dict(be.storage_copies)) == before and not h.tree.ongoing_prefetch
        m.tool_end("a", epoch)
        before = (m.kv_meta("a"), be.storage_copies["a"].rid)
        with pytest.raises(StaleEpoch):
            m.tool_end("a", epoch + 1)
        assert (m.kv_meta("a"), be.storage_copies["a"].rid) == before, "the prefetch is unchanged"
        settle(h, m)
        assert h.accounting() == initial


def test_an_early_restore_from_l3_is_on_the_gpu_before_tool_end(tmp_path: Path) -> None:
    """Spec ``Prefetch`` of a session in L3: storage → host, then host → GPU (``Kept``); its
    tool_end hands it over with nothing left to load."""
    with StorageCacheHarness(CFG, tmp_path / "l3") as h:
        initial = h.accounting()
        m, _, epoch, kv = setup(h)
        demote_a(h, m)
        assert m.prefetch("a")["l3"] == "fetching"
        until(h, m, lambda: m.kv_meta("a")["state"] == "Kept")
        dev = h.match(A).device_indices
        assert dev.numel() == len(A) and torch.equal(h.device_kv(dev), kv)
        assert m.tool_end("a", epoch)["state"] == "Handover"
        settle(h, m)
        assert h.accounting() == initial
