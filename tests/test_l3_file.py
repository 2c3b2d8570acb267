"""The L3 storage tier over sglang 0.5.16's REAL file backend (``HiCacheFile``), on CPU: a session's
KV written to storage on one server is prefetched into another server's host pool and loaded to its
device, byte for byte (``spec/storage/StorageTier.tla``: ``Store`` … ``StoreAck`` on server A,
``StoragePrefetch`` … ``PrefetchAck`` … ``LoadAck`` on server B); and the backend's own steps of
that path (``HiRadixBackend.store`` / ``store_ack`` / ``storage_prefetch`` / ``prefetch_ack``) on
one server.

Two :class:`~toolkv.testing.storage_harness.StorageCacheHarness` caches share one HiCacheFile
directory, as two servers share one L3 (``file`` on a shared path stands in for Mooncake). They
are built one after the other, because the CPU doubles of the copy engine live in sglang's module
globals (one CPU harness per process); the second server starting after the first is gone is the
"its server was drained" case of issue 27.

Nothing of the storage path is doubled or re-implemented: sglang's own ``HiCacheController``
threads run on CPU. The write to storage is the one HiRadixCache issues itself when a host write is
acknowledged (``_finish_write_through_ack`` → ``write_backup_storage`` → ``write_storage``; the
backup thread's ``_page_backup`` → ``HiCacheFile.batch_set``), with sglang's ``protect_host`` on
the source until the backup ack is drained. The restore is the scheduler's path for a waiting
request: ``prefetch_from_storage`` (the prefetch thread's hit query, the host allocation in
``drain_storage_control_queues``, the I/O thread's ``HiCacheFile.get`` per page),
``check_prefetch_progress`` under the ``wait_complete`` policy (the pages enter the host tree), then
``init_load_back`` host→device.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from _cycle import step, turn

from toolkv.core.backends.hiradix import HiRadixBackend
from toolkv.core.manager import ManagerConfig, ToolKVManager
from toolkv.core.record import SessionRecord
from toolkv.testing.harness import HarnessConfig
from toolkv.testing.storage_harness import StorageCacheHarness
from toolkv.verify.toolkv.mutants import ReleaseDropsPinBackend, TrustShortAckBackend

CFG = HarnessConfig(device_tokens=256, host_ratio=2.0, page_size=4)
TOKENS = list(range(1, 97))  # 96 tokens: 24 pages of 4

# spec/storage/StorageTier.tla's machine, which these tests check: toolkv reads an L3 copy back itself
# at tool_end, the offload frees the GPU copy at its ack and a tool_end restores (no LazyFree, no Park)
STORAGE_SPEC = ManagerConfig.eager(l3_read_at_arrival=False)


@pytest.fixture
def shared_l3(tmp_path: Path) -> Iterator[Path]:
    """The directory both servers' HiCacheFile backends use."""
    d = tmp_path / "l3"
    d.mkdir()
    yield d


def offload_to_storage(storage_dir: Path, tokens: list[int]) -> torch.Tensor:
    """Server A: a session's turn, ``tool_start`` (GPU→host, GPU copy freed at the ack), and the
    host copy written to storage by sglang's backup thread; then the session closes and server A
    is drained. Asserts that every page is in storage and that A returned every lock, host
    reference and slot. Returns the session's KV bytes as computed on A."""
    with StorageCacheHarness(CFG, storage_dir) as a:
        initial = a.accounting()
        m = ToolKVManager(a.tree, config=STORAGE_SPEC)
        kv = turn(a, m, "s", tokens)
        m.tool_start("s")
        step(a, m, 0.0, writes=True)
        assert m.kv_meta("s")["state"] == "Offloaded"
        assert a.match(tokens).device_indices.numel() == 0, "the GPU copy was freed"
        a.await_store_acks()  # the host write's ack queued a write to storage (maybe acked already)
        leaf = a.match(tokens).last_host_node
        chain = leaf.get_prefix_hash_values(leaf)  # the whole path's page keys, root first
        assert chain == page_keys(a, tokens), "sglang's chained page hashes of the session's tokens"
        assert set(chain) <= set(a.stored_keys()), "every page of the session is in storage"
        assert torch.equal(a.host_kv(torch.cat(host_path(a, tokens))), kv), "host copy = offloaded KV"
        m.close("s")  # the session's next turn goes to another server
        a.drain()
        assert a.accounting() == initial, "server A: every lock, host reference and slot returned"
        return kv


def page_keys(h: StorageCacheHarness, tokens: list[int]) -> list[str]:
    """sglang's storage keys of ``tokens`` from the root: one chained hash per page."""
    return list(h.controller.get_hash_str(tokens, None, page_size=CFG.page_size))


def host_path(h: StorageCacheHarness, tokens: list[int]) -> list[torch.Tensor]:
    """The host indices of ``tokens``'s path, root first."""
    node = h.match(tokens).last_host_node
    out: list[torch.Tensor] = []
    while node is not h.tree.root_node:
        out.insert(0, node.host_value)
        node = node.parent
    return out


def test_a_session_offloaded_to_storage_on_one_server_is_restored_on_another(shared_l3: Path) -> None:
    kv = offload_to_storage(shared_l3, TOKENS)
    with StorageCacheHarness(CFG, shared_l3) as b:
        initial = b.accounting()
        assert b.match(TOKENS).host_hit_length == 0, "server B starts cold"
        assert b.storage_hit_tokens(TOKENS) == len(TOKENS)
        assert b.prefetch("s-turn2", TOKENS) == len(TOKENS), "every token came from storage"
        m = b.match(TOKENS)
        assert int(m.host_hit_length) == len(TOKENS), "the prefetched pages are in B's host tree"
        assert torch.equal(b.host_kv(torch.cat(host_path(b, TOKENS))), kv), "host bytes = offloaded bytes"
        dev = b.load_to_device(TOKENS)
        assert dev.numel() == len(TOKENS)
        assert torch.equal(b.device_kv(dev), kv), "restored device bytes = offloaded bytes"
        assert not b.tree.ongoing_prefetch and b.controller.prefetch_tokens_occupied == 0
        b.drain()
        assert b.accounting() == initial, "server B: every lock, host reference and slot returned"


def test_a_page_missing_from_storage_ends_the_restore_at_the_page_before_it(shared_l3: Path) -> None:
    """The backend evicted one page of the copy (HiCacheFile's LRU evictor, or another tenant):
    sglang's hit query stops at the first missing page, so B restores exactly the pages before it,
    with the right bytes, and a session restore must count it as short (spec: ``PrefetchAck``
    with fewer than ``P`` pages read → ``Lost``), never as whole."""
    kv = offload_to_storage(shared_l3, TOKENS)
    with StorageCacheHarness(CFG, shared_l3) as b:
        initial = b.accounting()
        keys = page_keys(b, TOKENS)
        cut = 10  # pages 0..9 stay
        (shared_l3 / f"{keys[cut]}{b.backend.config_suffix}.bin").unlink()
        got = b.prefetch("s-turn2", TOKENS)
        assert got == cut * CFG.page_size < len(TOKENS)
        dev = b.load_to_device(TOKENS)
        assert dev.numel() == got
        assert torch.equal(b.device_kv(dev), kv[:, :, :got]), "the pages that came back are right"
        b.drain()
        assert b.accounting() == initial


# ---- the backend's storage steps (toolkv.core.backends.hiradix), one server ---------------------------


def offloaded(
    h: StorageCacheHarness, sid: str = "s", backend: type[HiRadixBackend] = HiRadixBackend
) -> tuple[ToolKVManager, HiRadixBackend, SessionRecord, torch.Tensor]:
    """A session offloaded to host by the manager (``tool_start``, write acked, GPU copy freed), and
    HiCache's own write of that host copy to storage acknowledged. Returns the manager, its
    HiRadix backend (``backend``: the fixed one or a mutant), the session's record and its KV."""
    be = backend(h.tree)
    m = ToolKVManager(h.tree, be, config=STORAGE_SPEC)
    kv = turn(h, m, sid, TOKENS)
    m.tool_start(sid)
    step(h, m, 0.0, writes=True)
    h.await_store_acks()
    return m, be, m.sessions[sid], kv


def until(h: StorageCacheHarness, done: Callable[[], bool], timeout_s: float = 30.0) -> None:
    """Scheduler iterations (``check_hicache_events``, then ``done``) until ``done`` holds: sglang's
    prefetch threads run on their own time, so the test waits for them as the scheduler does."""
    deadline = time.monotonic() + timeout_s
    while True:
        h.check_events()
        if done():
            return
        assert time.monotonic() < deadline, "sglang's prefetch threads never finished"
        time.sleep(0.001)


def prefetched(h: StorageCacheHarness, be: HiRadixBackend, rec: SessionRecord) -> bool:
    """Scheduler iterations until ``prefetch_ack`` answers; returns its answer (whole or short)."""
    got: list[bool | None] = []

    def acked() -> bool:
        got.append(be.prefetch_ack(rec))
        return got[-1] is not None

    until(h, acked)
    return bool(got[-1])


def test_the_backend_stores_a_session_and_brings_it_back_through_the_host(shared_l3: Path) -> None:
    with StorageCacheHarness(CFG, shared_l3) as h:
        initial = h.accounting()
        m, be, rec, kv = offloaded(h)
        for f in shared_l3.iterdir():  # the backend lost HiCache's copy: store must write it all
            f.unlink()
        evictor = h.backend._evictor
        evictor._eviction_enabled = True  # HiCacheFile with a size cap: its LRU evictor ignores toolkv
        assert be.store(rec) is False and not be.storage_copies, "a protection it cannot honour: refused"
        evictor._eviction_enabled = False
        assert be.store(rec) is True
        assert be.store_ack(rec) is None, "the writes are in flight until the scheduler drains their acks"
        h.await_store_acks()
        assert be.store_ack(rec) is True
        assert rec.protected is None, "the host protection is released: HiCache may evict the copy"
        assert set(page_keys(h, TOKENS)) <= set(h.stored_keys())
        h.evict_host(10**6)
        assert h.match(TOKENS).host_hit_length == 0, "the host copy is gone"
        assert be.storage_prefetch(rec, "s-restore") == "prefetching"
        assert be.storage_copies["s"].rid == "s-restore", "the prefetch pins the storage copy"
        assert prefetched(h, be, rec) is True and rec.protected is rec.node and not be.storage_copies
        assert int(h.match(TOKENS).host_hit_length) == len(TOKENS), "the whole path is back on host"
        assert be.restore(rec) is False, "loading: pinned until the load is acknowledged"
        be.start_loads()
        h.synchronize()
        h.check_events()
        be.poll_loads()
        assert not be.restore_pending(rec)
        assert torch.equal(h.device_kv(h.match(TOKENS).device_indices), kv), (
            "restored bytes = offloaded bytes"
        )
        m.close("s")
        h.drain()
        assert h.accounting() == initial and not h.tree.ongoing_prefetch


@pytest.mark.parametrize("backend", [HiRadixBackend, TrustShortAckBackend], ids=["fixed", "TrustShortAck"])
def test_a_write_the_backend_refuses_keeps_the_session_on_its_host_copy(
    shared_l3: Path, backend: type[HiRadixBackend]
) -> None:
    """Spec ``StoreRefused`` then a short ``StoreAck``: sglang's backup stops at the refused page and
    its ack does not say so; ``store_ack`` finds the copy short and keeps the host protection.
    Mutant ``TrustShortAck`` takes the short copy for whole, and once HiCache evicts the host copy
    only the pages before the refused one come back."""
    with StorageCacheHarness(CFG, shared_l3) as h:
        initial = h.accounting()
        m, be, rec, kv = offloaded(h, backend=backend)
        keys = page_keys(h, TOKENS)
        (shared_l3 / f"{keys[5]}{h.backend.config_suffix}.bin").unlink()
        real_set = h.backend.set
        refused = keys[5]

        def full(key: str, *a: object, **k: object) -> bool:
            """HiCacheFile.set when its evictor finds no room for this page."""
            return False if key == refused else bool(real_set(key, *a, **k))

        h.backend.set = full
        assert be.store(rec) is True
        h.await_store_acks()
        if backend is TrustShortAckBackend:
            assert be.store_ack(rec) is True, "the mutant trusts the short write"
            h.evict_host(10**6)
            assert be.storage_prefetch(rec, "s-restore") == "prefetching"
            assert prefetched(h, be, rec) is False, "restoring from a copy never completely written"
            assert int(h.match(TOKENS).host_hit_length) == 5 * CFG.page_size < len(TOKENS), "KV lost"
        else:
            assert be.store_ack(rec) is False
            assert rec.protected is not None and not be.storage_copies, "still on its protected host copy"
            h.evict_host(10**6)
            assert int(h.match(TOKENS).host_hit_length) == len(TOKENS), "the protected host copy stays"
            assert torch.equal(h.host_kv(torch.cat(host_path(h, TOKENS))), kv)
        m.close("s")
        h.drain()
        assert h.accounting() == initial


@pytest.mark.parametrize(
    "backend", [HiRadixBackend, ReleaseDropsPinBackend], ids=["fixed", "ReleaseDropsPin"]
)
def test_a_session_closed_while_its_prefetch_reads_keeps_the_pin_until_the_ack(
    shared_l3: Path, backend: type[HiRadixBackend]
) -> None:
    """Spec ``NeverPinnedAfterClose`` is refuted and ``ReadSourcePresent`` holds: close releases the
    session's storage protection, but the prefetch's pin on the copy lasts until sglang has read
    every page and ``poll_storage`` finishes it. Mutant ``ReleaseDropsPin`` drops the pin at
    close: nothing finishes the prefetch, and sglang's prefetch state, host slots and host
    protection leak."""
    with StorageCacheHarness(CFG, shared_l3) as h:
        initial = h.accounting()
        m, be, rec, _ = offloaded(h, backend=backend)
        assert be.store(rec) is True
        h.await_store_acks()
        assert be.store_ack(rec) is True
        h.evict_host(10**6)
        assert be.storage_prefetch(rec, "s-restore") == "prefetching"
        m.close("s")
        if backend is ReleaseDropsPinBackend:
            op = h.tree.ongoing_prefetch["s-restore"][2]
            until(
                h, lambda: op.hash_value != [] and op.completed_tokens == len(op.hash_value) * CFG.page_size
            )
            assert be.poll_storage() == 0 and not be.storage_copies, "nobody holds the prefetch any more"
            h.drain()
            assert "s-restore" in h.tree.ongoing_prefetch and h.accounting() != initial, "leaked"
            assert h.tree.check_prefetch_progress("s-restore")  # clean up for the teardown
            return
        copy = be.storage_copies["s"]
        assert copy.released and copy.rid == "s-restore", "closed, still pinned by its prefetch"
        until(h, lambda: be.poll_storage() > 0)
        assert not be.storage_copies and not h.tree.ongoing_prefetch
        h.drain()
        assert h.accounting() == initial
