"""The L3 shared by a fleet when it is Mooncake (``spec/storage/SharedTier.tla``), on CPU with real
parts: one real ``mooncake_master`` (its HTTP metadata server) and one ``mooncake_client`` storage
node on loopback TCP, started and stopped by the test; two servers, each a real HiRadixCache over
sglang's own ``mooncake`` backend (``MooncakeStore``) with toolkv's manager.

A session is offloaded and stored on server A, A is drained (its toolkv records go with it), the
tier is filled past its capacity by another client (the master's own eviction runs), and the
session's ``tool_end`` on server B, which never saw it, adopts it from the tier: a stale epoch is
still refused, its next request reads the tier at arrival, and the bytes equal the ones A computed.
Skipped with the reason when Mooncake cannot start here (package or ``libibverbs1`` missing);
``REQUIRE_MOONCAKE=1`` (``make test``) makes that a failure instead.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import pytest
import torch
from _cycle import step, turn

from toolkv.core.backends.hiradix import HiRadixBackend
from toolkv.core.backends.mooncake_tier import MANIFEST_PREFIX
from toolkv.core.config import ManagerConfig
from toolkv.core.manager import ToolKVManager
from toolkv.errors import StaleEpoch, UnknownSession
from toolkv.testing.harness import HarnessConfig
from toolkv.testing.mooncake import MooncakeStore, MooncakeUnavailable, running
from toolkv.testing.storage_harness import MooncakeCacheHarness

CFG = HarnessConfig(
    device_tokens=256, host_ratio=2.0, page_size=4, layout="page_first"
)  # sglang: MHA on Mooncake needs page_first
A = list(range(1, 97))  # 96 tokens: 24 pages of 4
B = list(range(1001, 1097))  # another session, no shared prefix
BUDGET = 150  # host tokens toolkv may protect: one session fits, two do not
TTL = 100.0
SEGMENT = 32 << 20  # the storage node's memory (Mooncake's client refuses 8 MiB: INVALID_PARAMS)


@pytest.fixture(scope="module")
def mooncake() -> Iterator[MooncakeStore]:
    try:
        with running(segment_bytes=SEGMENT) as store:
            yield store
    except MooncakeUnavailable as e:
        if os.environ.get("REQUIRE_MOONCAKE") == "1":
            raise
        pytest.skip(f"Mooncake cannot run here: {e}")


def manager(h: MooncakeCacheHarness) -> tuple[ToolKVManager, HiRadixBackend]:
    be = HiRadixBackend(h.tree, host_budget_tokens=BUDGET)
    cfg = ManagerConfig(ttl_s=TTL, host_budget_tokens=BUDGET, l3_read_at_arrival=True)
    return ToolKVManager(h.tree, be, config=cfg), be


def fill_tier(h: MooncakeCacheHarness, n: int, size: int = 256 << 10) -> int:
    """Another tenant's puts, unpinned, until the master must evict (``n`` objects of ``size``:
    more than the node holds). Returns how many were refused."""
    blob = b"\x5a" * size
    refused = 0
    for i in range(n):
        refused += int(h.backend.store.put(f"other-{i}", blob)) != 0
        if i % 16 == 15:
            time.sleep(0.02)  # the master's eviction thread runs on its own time
    return refused


def test_a_session_stored_on_a_drained_server_is_adopted_and_read_on_another(mooncake: MooncakeStore) -> None:
    # ---- server A: the session's turn, tool_start, stored to Mooncake when the host is full ----------
    with MooncakeCacheHarness(CFG, mooncake) as a:
        initial_a = a.accounting()
        m, _be = manager(a)
        kv = turn(a, m, "a", A)
        epoch = int(m.tool_start("a")["epoch"])  # type: ignore[call-overload]
        step(a, m, 0.0, writes=True)
        a.await_store_acks()
        turn(a, m, "b", B)
        m.tool_start("b", expected_s=0.0)  # back before a: a yields its host room, stored
        assert m.kv_meta("a")["l3"] == "stored" and m.counters["demoted_l3"] == 1
        assert a.backend.store.is_exist(MANIFEST_PREFIX + "a") == 1, "the manifest is in the tier"
        step(a, m, 1.0, writes=True)
        m.close("b")
        a.await_store_acks()
        a.drain()  # server A goes: its toolkv records ("a" among them) go with it
        assert a.accounting() == initial_a
    # ---- server B never saw the session -----------------------------------------------------------
    with MooncakeCacheHarness(CFG, mooncake) as b:
        initial_b = b.accounting()
        refused = fill_tier(b, 4 * SEGMENT // (256 << 10))
        m, _be = manager(b)
        assert b.storage_hit_tokens(A) == len(A), (
            f"the soft-pinned copy survived the master's eviction ({refused} puts refused)"
        )
        assert b.backend.store.is_exist("other-0") == 0, "an unpinned object was evicted"
        with pytest.raises(UnknownSession):
            m.tool_end("never-stored", 1)
        with pytest.raises(StaleEpoch):
            m.tool_end("a", epoch - 1)
        meta = m.tool_end("a", epoch)
        assert meta["state"] == "Running" and not meta["protected"], meta
        assert m.counters["tool_end_adopted"] == 1
        with pytest.raises(StaleEpoch):
            m.tool_end("a", epoch - 1)  # the fence holds on the adopting server too
        # the next request arrives on B: sglang's prefetch reads the tier, then its load_back
        assert b.prefetch("req-a", A) == len(A), "every token came from the shared tier"
        dev = b.load_to_device(A)
        assert torch.equal(b.device_kv(dev), kv), "B's bytes = the bytes A computed"
        turn(b, m, "a", A + list(range(2001, 2009)))  # the next turn on B continues the session
        assert int(m.tool_start("a")["epoch"]) == epoch + 1  # type: ignore[call-overload]
        step(b, m, 2.0, writes=True)
        m.close("a")
        b.await_store_acks()
        b.drain()
        assert b.accounting() == initial_b, "server B: every lock, host reference and slot returned"
