"""L3 as capacity, not only overflow (issue 37 item 1), on sglang 0.5.16's REAL HiRadixCache with its
``file`` storage backend (``HiCacheFile``) and storage threads, on CPU
(``toolkv.testing.storage_harness``).

* A session predicted away longer than its L3 round trip (``policy.l3_horizon_s``) is stored to L3
  at the tick after it is ``Offloaded`` (spec ``Store``), with no full host asking for it; its
  host copy, released at the whole ``StoreAck``, is host room; it is read back to the host ahead
  of its predicted return and restored byte-identical.
* A session due soon is never stored early.
* A copy whose store is still in flight is still protected: it is never counted as room (neither
  by sglang's ``evict_host`` count nor by the demotions a tool_start may make), so the newcomer
  gets a 507 until the ``StoreAck``.
* With an L3 tier, a full host may store any offloaded session (the latest predicted return
  first), even one due before the newcomer: storing is not dropping. Without one, it is a 507.

Every lock, host reference and slot is returned at the end of each test.
"""

from __future__ import annotations

import os
from pathlib import Path
from unittest import mock

import pytest
import torch
from _cycle import step, turn
from test_l3_manager import BUDGET, CFG, TTL, A, B, settle, until

from toolkv.core.backends.hiradix import HiRadixBackend
from toolkv.core.manager import ManagerConfig, ToolKVManager
from toolkv.core.policy import PolicyConfig, l3_horizon_s, l3_store_early
from toolkv.errors import HostMemoryFull
from toolkv.testing.storage_harness import StorageCacheHarness

READ = 1_000.0  # tokens/s the manager assumes for L3 reads: A's 96 tokens read in 0.096 s
POLICY = PolicyConfig(l3_store_margin_s=5.0, l3_write_tokens_per_s=1_000.0)


def manager(h: StorageCacheHarness, *, l3: bool = True, budget: int | None = BUDGET) -> ToolKVManager:
    """A manager over the harness's tree with the host budget (one session fits, two do not)."""
    # spec/storage/StorageCapacity.tla's machine: toolkv reads the L3 copy back ahead of the
    # predicted return, the offload frees the GPU copy at its ack (no LazyFree, no Park)
    cfg = ManagerConfig.eager(
        ttl_s=TTL, host_budget_tokens=budget, l3=l3, l3_read_tokens_per_s=READ, policy_config=POLICY,
        l3_read_at_arrival=False,
    )  # fmt: skip
    return ToolKVManager(h.tree, HiRadixBackend(h.tree, host_budget_tokens=budget), config=cfg)


def l3of(m: ToolKVManager, sid: str) -> str:
    """The session's L3 sub-phase ("" when it has no copy in L3: kv_meta leaves the field out)."""
    return str(m.kv_meta(sid).get("l3", ""))


def offload(h: StorageCacheHarness, m: ToolKVManager, sid: str, expected_s: float, now: float) -> int:
    """``sid``'s tool_start with a duration hint, its host write acknowledged (write_ack at the
    tick); sglang's own write of the copy to storage is left in flight. Returns the epoch."""
    epoch = int(m.tool_start(sid, expected_s=expected_s)["epoch"])  # type: ignore[call-overload]
    h.complete("write")
    h.tree.writing_check()  # the host write's ack; HiCache queues its write to storage
    m.tick(now)
    assert m.kv_meta(sid)["state"] == "Offloaded"
    return epoch


def test_the_horizon_is_the_round_trip_plus_the_margin() -> None:
    assert l3_horizon_s(1_000, POLICY, READ) == pytest.approx(1.0 + 1.0 + 5.0)
    assert l3_store_early(7.01, 1_000, POLICY, READ) and not l3_store_early(7.0, 1_000, POLICY, READ)
    with pytest.raises(ValueError):
        PolicyConfig(l3_store_margin_s=-1.0)
    with pytest.raises(ValueError):
        PolicyConfig(l3_write_tokens_per_s=0.0)


def test_a_long_tool_goes_to_l3_early_and_comes_back_byte_identical(tmp_path: Path) -> None:
    with StorageCacheHarness(CFG, tmp_path / "l3") as h:
        initial = h.accounting()
        m = manager(h)
        stored: list[tuple[str, str]] = []
        m.machine.on_store = lambda sid, why: stored.append((sid, why))
        kv = turn(h, m, "a", A)
        epoch = offload(h, m, "a", 60.0, 0.0)  # 60 s away: far beyond the 5.2 s horizon
        assert l3of(m, "a") in ("storing", "stored"), "stored at the tick after Offloaded"
        assert m.counters["l3_store_l3_early"] == 1 and stored == [("a", "l3_early")]
        h.await_store_acks()
        until(h, m, lambda: l3of(m, "a") == "stored")
        assert m.kv_meta("a")["protected"] is False
        be = m.backend
        assert isinstance(be, HiRadixBackend)
        assert be.host_evictable_tokens() >= len(A), "its host copy is room now"
        h.evict_host(10**6)
        assert h.match(A).host_hit_length == 0, "only L3 holds it"
        # read back to the host ahead of the predicted return (60 s - 0.096 s read - 5 s margin)
        m.tick(54.0)
        assert l3of(m, "a") == "stored", "not yet due"
        m.tick(55.0)
        assert l3of(m, "a") == "fetching" and m.counters["l3_readahead"] == 1
        assert stored[-1] == ("a", "l3_readahead")
        until(h, m, lambda: l3of(m, "a") == "")
        meta = m.kv_meta("a")
        assert (meta["state"], meta["protected"]) == ("Offloaded", True), "back on its protected host copy"
        assert int(h.match(A).host_hit_length) == len(A)
        m.tool_end("a", epoch)
        assert m.admit("a") is False
        until(h, m, lambda: m.kv_meta("a")["state"] == "Runnable")
        dev = h.match(A).device_indices
        assert dev.numel() == len(A) and torch.equal(h.device_kv(dev), kv), "restored bytes = offloaded"
        settle(h, m)
        assert h.accounting() == initial, "every lock, host reference and slot returned"


def test_a_session_due_soon_is_never_stored_early(tmp_path: Path) -> None:
    with StorageCacheHarness(CFG, tmp_path / "l3") as h:
        initial = h.accounting()
        m = manager(h)
        turn(h, m, "a", A)
        offload(h, m, "a", 5.0, 0.0)  # back in 5 s: under the 5.2 s horizon
        h.await_store_acks()
        for t in (0.5, 1.0, 2.0):
            step(h, m, t, writes=True)
        meta = m.kv_meta("a")
        assert (meta.get("l3", ""), meta["protected"]) == ("", True), "kept on its protected host copy"
        assert m.counters["l3_store"] == 0 and m.counters["l3_store_l3_early"] == 0
        settle(h, m)
        assert h.accounting() == initial


def test_a_copy_whose_store_is_in_flight_is_not_room(tmp_path: Path) -> None:
    """``a`` is stored early while sglang's own write of its copy to storage is still in flight:
    ``Storing``, its host copy protected. ``b``'s tool_start finds no room (a 507, changing
    nothing) until the ``StoreAck`` releases ``a``'s protection; then it fits."""
    with StorageCacheHarness(CFG, tmp_path / "l3") as h:
        initial = h.accounting()
        m = manager(h)
        turn(h, m, "a", A)
        offload(h, m, "a", 60.0, 0.0)
        assert l3of(m, "a") == "storing" and m.kv_meta("a")["protected"] is True
        turn(h, m, "b", B)
        be = m.backend
        assert isinstance(be, HiRadixBackend)
        assert m.machine.policy.demotable_tokens("b", 0.0) == 0, "a copy on its way to L3 is not room yet"
        assert be.host_evictable_tokens() < len(A) or int(h.match(A).host_hit_length) == len(A)
        with pytest.raises(HostMemoryFull):
            m.tool_start("b", expected_s=1.0)
        assert m.kv_meta("b")["state"] == "Running" and l3of(m, "a") == "storing"
        h.await_store_acks()
        m.tick(1.0)
        assert l3of(m, "a") == "stored"
        assert m.tool_start("b", expected_s=1.0)["state"] in ("Offloaded", "Offloading")
        settle(h, m)
        assert h.accounting() == initial


@pytest.mark.parametrize("l3", [True, False])
def test_a_full_host_stores_even_a_session_due_before_the_newcomer(tmp_path: Path, l3: bool) -> None:
    """``a`` is back in 2 s (not stored early), ``b`` in 100 s: a full host used to answer ``b``
    507 (no session predicted back after it). With L3 ``a`` yields its host copy to L3 instead;
    without L3 ``a`` is never dropped for ``b`` and ``b`` gets its 507."""
    with StorageCacheHarness(CFG, tmp_path / "l3") as h:
        initial = h.accounting()
        m = manager(h, l3=l3)
        turn(h, m, "a", A)
        offload(h, m, "a", 2.0, 0.0)
        h.await_store_acks()
        step(h, m, 0.1, writes=True)
        assert l3of(m, "a") == ""
        turn(h, m, "b", B)
        if l3:
            m.tool_start("b", expected_s=100.0)
            assert l3of(m, "a") == "stored" and m.counters["l3_store_host_room"] == 1
            assert m.kv_meta("a")["state"] == "Offloaded" and m.counters["demoted"] == 0
        else:
            with pytest.raises(HostMemoryFull):
                m.tool_start("b", expected_s=100.0)
            assert m.kv_meta("a")["state"] == "Offloaded" and m.kv_meta("a")["protected"] is True
        settle(h, m)
        assert h.accounting() == initial


def test_a_file_backend_with_a_free_space_floor_refuses_every_store(tmp_path: Path) -> None:
    """The GPU run's setting (docs/results/l3_capacity: ``SGLANG_HICACHE_FILE_BACKEND_MIN_FREE_SPACE``
    set) turns HiCacheFile's own LRU evictor on, which may delete a page toolkv protects (spec
    ``L3Evict`` takes only unprotected pages), so toolkv refuses to store there at all: neither the
    early store nor a full host's victim goes to L3 (``l3_store_refused``), and a victim due before
    the newcomer is not dropped either. This is why toolkv16l3 stored nothing on the GPU."""
    with mock.patch.dict(os.environ, {"SGLANG_HICACHE_FILE_BACKEND_MIN_FREE_SPACE": "1M"}):
        h = StorageCacheHarness(CFG, tmp_path / "l3")
    with h:
        initial = h.accounting()
        assert h.backend._evictor.enabled, "the floor turns HiCacheFile's evictor on"
        m = manager(h)
        turn(h, m, "a", A)
        offload(h, m, "a", 60.0, 0.0)
        assert l3of(m, "a") == "" and m.counters["l3_store_refused"] == 1
        h.await_store_acks()
        turn(h, m, "b", B)
        with pytest.raises(HostMemoryFull):
            m.tool_start("b", expected_s=100.0)  # a (back at 60 s) is before b: kept, not dropped
        assert m.counters["l3_store_refused"] == 2 and m.kv_meta("a")["protected"] is True
        settle(h, m)
        assert h.accounting() == initial
