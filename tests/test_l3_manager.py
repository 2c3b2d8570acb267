"""The manager drives the L3 storage tier (issue 27, item 2) over sglang 0.5.16's REAL file backend
(``HiCacheFile``) and storage threads, on CPU (``toolkv.testing.storage_harness``).

When the host must make room (the host budget is reached), an ``Offloaded`` session predicted
back later is not dropped: its host copy is stored to L3 (spec ``Store``), and the host copy is
released only at the ``StoreAck`` of a whole copy. Its ``tool_end`` prefetches it back into the
host pool (``StoragePrefetch`` … ``PrefetchAck``) and then restores host→GPU and hands it over as
usual. A close or TTL during a store or a prefetch returns every lock, host reference, slot and
storage pin; a stale epoch changes nothing. The implementation mutants ``TrustShortAck`` and
``ReleaseDropsPin`` (``toolkv.verify.toolkv.mutants``) must lose.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from _cycle import step, turn

from toolkv.core.backends.hiradix import HiRadixBackend
from toolkv.core.manager import ManagerConfig, ToolKVManager
from toolkv.core.policy import PolicyConfig
from toolkv.errors import HostMemoryFull, StaleEpoch, WrongState
from toolkv.testing.harness import HarnessConfig
from toolkv.testing.storage_harness import StorageCacheHarness
from toolkv.verify.toolkv.mutants import ReleaseDropsPinBackend, TrustShortAckBackend

CFG = HarnessConfig(device_tokens=256, host_ratio=2.0, page_size=4)
A = list(range(1, 97))  # 96 tokens: 24 pages of 4
B = list(range(1001, 1097))  # another session, no shared prefix
BUDGET = 150  # host tokens toolkv may protect: one session fits, two do not
TTL = 100.0
# L3 only for a full host's victims (no store by predicted return: tests/test_l3_capacity.py has those)
VICTIMS_ONLY = PolicyConfig(l3_store_margin_s=1e9)


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


def storage_spec(**kw: Any) -> ManagerConfig:
    """spec/storage/StorageTier.tla's machine, which these tests check: toolkv reads an L3 copy back
    itself at tool_end (not sglang at the request's arrival), the offload frees the GPU copy at its
    ack and a tool_end restores (no LazyFree, no Park)."""
    return ManagerConfig.eager(l3_read_at_arrival=False, **kw)


def setup(
    h: StorageCacheHarness, backend: type[HiRadixBackend] = HiRadixBackend
) -> tuple[ToolKVManager, HiRadixBackend, int, torch.Tensor]:
    """Session ``a`` offloaded to host (its write and HiCache's own write to storage acked), then
    session ``b``'s turn. Returns the manager, its backend, ``a``'s epoch and its KV."""
    be = backend(h.tree, host_budget_tokens=BUDGET)
    m = ToolKVManager(h.tree, be, config=storage_spec(ttl_s=TTL, host_budget_tokens=BUDGET))
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
    step(h, m, m.now + 1.0, writes=True)
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
        assert m.admit("a") is False  # the next request came early: the hand-over ends at once
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


def test_the_predicted_return_restores_an_l3_session_early(tmp_path: Path) -> None:
    """Policy ``auto``: ``a``'s tool is predicted long, so its early restore is scheduled from the
    predicted return; once its copy lives in L3 the restore starts sooner by the L3 read's time
    and reads storage → host → GPU before the tool_end."""
    with StorageCacheHarness(CFG, tmp_path / "l3") as h:
        initial = h.accounting()
        cfg = storage_spec(
            ttl_s=TTL,
            host_budget_tokens=BUDGET,
            policy="auto",
            l3_read_tokens_per_s=10.0,
            policy_config=VICTIMS_ONLY,
        )
        m = ToolKVManager(h.tree, HiRadixBackend(h.tree, host_budget_tokens=BUDGET), config=cfg)
        kv = turn(h, m, "a", A)
        meta = m.tool_start("a", tool="crawl", expected_s=60.0)
        assert meta["decision"] == "offload", meta
        epoch = int(meta["epoch"])  # type: ignore[call-overload]
        due = m.sessions["a"].prefetch_at
        assert 0 < due < 60.0
        step(h, m, 0.0, writes=True)
        h.await_store_acks()
        turn(h, m, "b", B)
        assert m.tool_start("b", tool="grep", expected_s=20.0)["decision"] == "offload"
        assert m.kv_meta("a")["l3"] == "stored"
        assert m.sessions["a"].prefetch_at == max(0.0, due - len(A) / 10.0), "sooner by the L3 read"
        step(h, m, 1.0, writes=True)
        h.evict_host(10**6)
        assert h.match(A).host_hit_length == 0
        m.tick(m.sessions["a"].prefetch_at)
        assert m.kv_meta("a")["l3"] == "fetching", "the early restore reads L3"
        until(h, m, lambda: m.kv_meta("a")["state"] == "Kept")
        dev = h.match(A).device_indices
        assert dev.numel() == len(A) and torch.equal(h.device_kv(dev), kv)
        assert m.tool_end("a", epoch)["state"] == "Handover"
        settle(h, m)
        assert h.accounting() == initial


def test_a_tool_end_before_the_predicted_return_takes_over_the_early_restore(tmp_path: Path) -> None:
    """The tool returns before its early restore was due: the tool_end's read is the only one,
    and the early restore's due time passing while it reads does nothing."""
    with StorageCacheHarness(CFG, tmp_path / "l3") as h:
        initial = h.accounting()
        cfg = storage_spec(ttl_s=TTL, host_budget_tokens=BUDGET, policy="auto", policy_config=VICTIMS_ONLY)
        m = ToolKVManager(h.tree, HiRadixBackend(h.tree, host_budget_tokens=BUDGET), config=cfg)
        kv = turn(h, m, "a", A)
        epoch = int(m.tool_start("a", tool="crawl", expected_s=60.0)["epoch"])  # type: ignore[call-overload]
        step(h, m, 0.0, writes=True)
        h.await_store_acks()
        turn(h, m, "b", B)
        m.tool_start("b", tool="grep", expected_s=20.0)
        assert m.kv_meta("a")["l3"] == "stored"
        m.tick(2.0)
        h.evict_host(10**6)
        assert m.tool_end("a", epoch)["l3"] == "fetching"
        m.tick(59.99)  # past the early restore's due time, the read still in flight
        assert m.kv_meta("a")["l3"] == "fetching" and len(h.tree.ongoing_prefetch) == 1
        until(h, m, lambda: m.kv_meta("a")["state"] == "Runnable" or m.kv_meta("a")["state"] == "Handover")
        dev = h.match(A).device_indices
        assert dev.numel() == len(A) and torch.equal(h.device_kv(dev), kv)
        assert m.counters["prefetched"] == 0 and m.counters["l3_prefetch"] == 1
        settle(h, m)
        assert h.accounting() == initial


def test_l3_off_drops_as_without_a_storage_tier(tmp_path: Path) -> None:
    with StorageCacheHarness(CFG, tmp_path / "l3") as h:
        initial = h.accounting()
        be = HiRadixBackend(h.tree, host_budget_tokens=BUDGET)
        m = ToolKVManager(h.tree, be, config=ManagerConfig(host_budget_tokens=BUDGET, l3=False))
        turn(h, m, "a", A)
        m.tool_start("a", expected_s=600.0)
        step(h, m, 0.0, writes=True)
        h.await_store_acks()
        turn(h, m, "b", B)
        m.queued_demand = lambda: 10**6  # queued requests need the room b holds: a demotion pays
        m.tool_start("b", expected_s=30.0)
        assert m.kv_meta("a")["state"] == "Released" and "l3" not in m.kv_meta("a")
        assert m.counters["demoted"] == 1 and not be.storage_copies
        settle(h, m)
        assert h.accounting() == initial


def test_the_l3_variables_are_validated_at_start_up() -> None:
    from toolkv.sglang.config import ToolKVConfig

    assert ToolKVConfig.from_env({}).manager_config().l3 is True
    cfg = ToolKVConfig.from_env({"TOOLKV_L3": "0", "TOOLKV_L3_READ_TOKENS_PER_S": "5e4"}).manager_config()
    assert (cfg.l3, cfg.l3_read_tokens_per_s) == (False, 5e4)
    for bad in ({"TOOLKV_L3": "maybe"}, {"TOOLKV_L3_READ_TOKENS_PER_S": "0"}, {"TOOLKV_L3_READ_TOKENS": "1"}):
        with pytest.raises(ValueError, match="TOOLKV_L3"):
            ToolKVConfig.from_env(bad)
    with pytest.raises(ValueError, match="l3_read_tokens_per_s"):
        ManagerConfig(l3_read_tokens_per_s=float("inf"))


def test_restore_on_request_reads_an_l3_session_back_once(tmp_path: Path) -> None:
    """The session's next request is its tool's end (``TOOLKV_RESTORE_ON_REQUEST``): the first one
    starts the L3 read, a second one while it reads changes nothing (no second tool_end)."""
    from toolkv.sglang.config import ToolKVConfig
    from toolkv.sglang.scheduler_side import SchedulerToolKV

    with StorageCacheHarness(CFG, tmp_path / "l3") as h:
        initial = h.accounting()
        tk = SchedulerToolKV(
            h.tree,
            config=ToolKVConfig(
                ttl_s=TTL, host_budget_tokens=BUDGET, lazy_free=False, l3_read_at_arrival=False
            ),
        )
        m = tk.manager
        kv = turn(h, m, "a", A)
        m.tool_start("a")
        step(h, m, m.now, writes=True)
        h.await_store_acks()
        turn(h, m, "b", B)
        demote_a(h, m)
        tk.on_request("a")
        assert m.kv_meta("a")["l3"] == "fetching" and m.counters["tool_end_l3"] == 1
        tk.on_request("a")
        assert m.counters["tool_end_l3"] == 1 and m.counters["tool_end"] == 1
        until(h, m, lambda: m.kv_meta("a")["state"] == "Handover")
        dev = h.match(A).device_indices
        assert dev.numel() == len(A) and torch.equal(h.device_kv(dev), kv)
        settle(h, m)
        assert h.accounting() == initial


def test_the_decision_log_of_an_l3_round_trip_is_a_spec_behaviour(tmp_path: Path) -> None:
    """Through the scheduler side's logged calls: a session demoted to L3, its ``tool_end``
    accepted while it stays ``Offloaded`` (``l3=fetching``: the read runs first), then restored
    and handed over without a line. ``toolkv trace-check --decisions`` must accept the log; and a
    copy where the session jumps to Restoring without having asked stays refused."""
    import logging

    from toolkv.sglang.config import ToolKVConfig
    from toolkv.sglang.scheduler_side import SchedulerToolKV
    from toolkv.verify.toolkv.decisions import check_logs

    log_path = tmp_path / "server.log"
    handler = logging.FileHandler(log_path, mode="w", encoding="utf-8")
    handler.setFormatter(logging.Formatter("[%(asctime)s TP0] %(message)s"))
    logger = logging.getLogger("toolkv")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        with StorageCacheHarness(CFG, tmp_path / "l3") as h:
            tk = SchedulerToolKV(
                h.tree,
                config=ToolKVConfig(
                    ttl_s=TTL, host_budget_tokens=BUDGET, lazy_free=False, l3_read_at_arrival=False
                ),
            )
            m = tk.manager
            turn(h, m, "a", A)
            epoch = int(tk.handle("tool_start", {"session_id": "a"})[1]["epoch"])
            step(h, m, m.now, writes=True)
            h.await_store_acks()
            turn(h, m, "b", B)
            tk.handle("tool_start", {"session_id": "b", "expected_s": 0.0})  # a yields to L3
            assert m.kv_meta("a")["l3"] == "stored"
            step(h, m, m.now + 1.0, writes=True)
            h.evict_host(10**6)  # HiCache takes back a's host copy, which nothing protects now
            ended = tk.handle("tool_end", {"session_id": "a", "epoch": epoch})[1]
            assert (ended["state"], ended["l3"]) == ("Offloaded", "fetching")
            until(h, m, lambda: m.kv_meta("a")["state"] == "Handover")
            tk.handle("close", {"session_id": "a"})
            tk.handle("close", {"session_id": "b"})
            settle(h, m)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        handler.close()
    text = log_path.read_text()
    assert "l3=fetching" in text, text
    res = check_logs([log_path])
    assert res.ok, res.to_json()
    # the same log without the L3 field reads as a tool_end that left the session Offloaded: illegal
    bad = tmp_path / "bad.log"
    bad.write_text(text.replace(" l3=fetching", ""))
    assert not check_logs([bad]).ok


def test_read_at_arrival_leaves_a_stored_sessions_read_to_sglang(tmp_path: Path) -> None:
    """``l3_read_at_arrival`` (TOOLKV_L3_READ_AT_ARRIVAL): the tool_end of a session stored whole in
    L3 reads nothing itself (spec Demote, then ToolEnd of the Released session: ``Running``, no
    protection, no storage pin); sglang's own read at the next request's arrival brings the copy
    back from storage, byte for byte, and every lock, host reference and slot is returned. A stale
    epoch still changes nothing. (Without the knob the same tool_end reads L3 itself:
    ``test_a_session_demoted_to_l3_when_the_host_is_full_comes_back_byte_identical``.)"""
    with StorageCacheHarness(CFG, tmp_path / "l3") as h:
        initial = h.accounting()
        be = HiRadixBackend(h.tree, host_budget_tokens=BUDGET)
        m = ToolKVManager(
            h.tree,
            be,
            config=ManagerConfig.eager(ttl_s=TTL, host_budget_tokens=BUDGET, l3_read_at_arrival=True),
        )
        kv = turn(h, m, "a", A)
        epoch = int(m.tool_start("a")["epoch"])  # type: ignore[call-overload]
        step(h, m, 0.0, writes=True)
        h.await_store_acks()
        turn(h, m, "b", B)
        demote_a(h, m)
        with pytest.raises(StaleEpoch):
            m.tool_end("a", epoch - 1)
        assert m.kv_meta("a")["l3"] == "stored", "a stale epoch changed nothing"
        meta = m.tool_end("a", epoch)
        assert meta["state"] == "Running" and "l3" not in meta and not meta["protected"], meta
        assert (m.counters["tool_end_l3_arrival"], m.counters["tool_end_l3"], m.counters["l3_prefetch"]) == (
            1,
            0,
            0,
        )
        assert not be.storage_copies, "toolkv holds no storage pin for it"
        with pytest.raises(WrongState):
            m.tool_end("a", epoch)  # the call is over: never a second restore
        # the next request arrives: sglang's prefetch reads the copy from storage, then its load_back
        assert h.prefetch("req-a", A) > 0, "sglang's own arrival read found the copy in storage"
        dev = h.load_to_device(A)
        assert dev.numel() == len(A)
        assert torch.equal(h.device_kv(dev), kv), "the bytes sglang read back = the offloaded bytes"
        settle(h, m)
        assert h.accounting() == initial, "every lock, host reference and slot returned"
