"""Load-adaptive protection (spec ``Park``, ``Unpin``, ``Admit`` of a parked session) on sglang's
real HiRadixCache.

Under overload the next request of a session whose tool returned waits behind tens of others.
A restore at its tool_end would load the KV and pin it on the GPU for that whole wait, taking the
room the running and queued requests need (the twin measured the server at 0.77x stock's
throughput with it, docs/benchmarks.md). With ``adaptive`` the tool_end parks the session instead:
the host copy stays protected, nothing is loaded or pinned, and sglang's own ``init_load_back``
brings the KV in when the request is admitted, which ends the protection. A hand-over already
pinned gives its pin up when queued requests need the room.

Every test checks what is held (locks, host references, loads) and that the bytes the request
reads are the bytes that were offloaded.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from toolkv.core.manager import ManagerConfig, ToolKVManager
from toolkv.core.treeops import path_to
from toolkv.errors import BadRequest, WrongState
from toolkv.testing.harness import CacheHarness, HarnessConfig

TOKS = list(range(1, 129))


@pytest.fixture
def h() -> Iterator[CacheHarness]:
    with CacheHarness(HarnessConfig(device_tokens=512)) as harness:
        yield harness


def offloaded(h: CacheHarness, cfg: ManagerConfig) -> tuple[ToolKVManager, int, torch.Tensor]:
    """A session ``a`` whose 128 tokens were offloaded (GPU copy freed); its KV as written."""
    m = ToolKVManager(h.tree, config=cfg)
    idx = h.alloc(len(TOKS))
    assert idx is not None
    h.fill_kv(idx, TOKS)
    kv = h.device_kv(idx).clone()
    h.insert(TOKS, idx)
    m.insert("a", TOKS)
    m.tick(1)
    ep = int(m.tool_start("a")["epoch"])  # type: ignore[call-overload]
    h.complete("write")
    h.check_events()
    m.tick(2)
    assert m.kv_meta("a")["state"] == "Offloaded" and h.match(TOKS).device_indices.numel() == 0
    return m, ep, kv


def admit(h: CacheHarness, m: ToolKVManager, sid: str, now: float = 3.0) -> tuple[torch.Tensor, object]:
    """The session's next request is admitted as sglang's PrefillAdder admits it: match the prefix,
    ``init_load_back`` the host part, lock the path; then the scheduler's hook (spec Admit)."""
    from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams

    res = h.match(TOKS)
    values, last = h.tree.init_load_back(
        InitLoadBackParams(best_match_node=res.last_host_node, host_hit_length=res.host_hit_length)
    )
    h.tree.inc_lock_ref(last)
    m.admit(sid)
    h.tree.ready_to_load_host_cache()  # the prefill batch is built: sglang starts its loads
    h.complete("load")
    h.check_events()
    m.tick(now)
    return torch.cat([res.device_indices, values]), last


def test_tool_end_parks_when_queued_requests_need_the_room(h: CacheHarness) -> None:
    m, ep, kv = offloaded(h, ManagerConfig(adaptive=True, lazy_free=False))
    m.queued_demand = lambda: 10**6  # the waiting requests need more than the whole device
    before = h.accounting()
    meta = m.tool_end("a", ep)
    assert meta["state"] == "Parked" and meta["protected"] is True and meta["restore"] == "parked"
    assert h.accounting() == before, "a park loads nothing, pins nothing and keeps the protection"
    with pytest.raises(WrongState):  # the call is over: a retried tool_end is refused, changes nothing
        m.tool_end("a", ep)
    assert h.accounting() == before
    # while it waits, sglang evicts what it likes; the protected host copy stays
    h.evict_host(10**9)
    assert h.match(TOKS).host_hit_length == len(TOKS)
    indices, last = admit(h, m, "a")
    assert m.kv_meta("a")["state"] == "Runnable" and m.kv_meta("a")["protected"] is False
    assert torch.equal(h.device_kv(indices), kv), "the request reads the bytes that were offloaded"
    h.tree.dec_lock_ref(last)  # the request finished
    acc = h.accounting()
    assert acc.lock_refs == () and acc.host_refs == () and acc.pending_loads == 0
    assert m.counters["parked"] == 1 and m.counters["admitted_parked"] == 1


def test_without_queued_demand_tool_end_restores_and_hands_over(h: CacheHarness) -> None:
    """The same call on an idle server is the plain restore: load now, pin until admission."""
    m, ep, _kv = offloaded(h, ManagerConfig(adaptive=True, lazy_free=False))
    assert m.tool_end("a", ep)["state"] == "Restoring"
    m.tick(2.5)  # spec StartLoads
    h.complete("load")
    h.check_events()
    m.tick(3)
    assert m.kv_meta("a")["state"] == "Handover" and m.counters["parked"] == 0


def test_without_adaptive_a_full_device_is_a_503_that_changes_nothing(h: CacheHarness) -> None:
    from toolkv.errors import DeviceMemoryFull

    m, ep, _kv = offloaded(h, ManagerConfig.eager())
    hog = h.alloc(h.allocator.available_size())
    before = h.accounting()
    with pytest.raises(DeviceMemoryFull):
        m.tool_end("a", ep)
    assert h.accounting() == before and m.kv_meta("a")["state"] == "Offloaded"
    h.allocator.free(hog)


def test_a_parked_session_whose_request_never_comes_is_released_by_the_ttl(h: CacheHarness) -> None:
    m, ep, _kv = offloaded(h, ManagerConfig(adaptive=True, lazy_free=False, ttl_s=5.0))
    m.queued_demand = lambda: 10**6
    assert m.tool_end("a", ep)["state"] == "Parked"
    m.tick(2 + 5.0)
    meta = m.kv_meta("a")
    assert meta["state"] == "Runnable" and meta["protected"] is False
    assert h.accounting().host_refs == () and m.counters["parked_expired"] == 1


def test_a_hand_over_gives_its_pin_up_when_queued_requests_need_the_room(h: CacheHarness) -> None:
    m, ep, kv = offloaded(h, ManagerConfig(adaptive=True, lazy_free=False))
    m.tool_end("a", ep)
    m.tick(2.5)  # spec StartLoads
    h.complete("load")
    h.check_events()
    m.tick(3)
    assert m.kv_meta("a")["state"] == "Handover"
    leaf = m.sessions["a"].node
    assert leaf is not None and all(n.lock_ref == 1 for n in path_to(h.tree, leaf))
    m.tick(4)  # nothing queued: the pin stays
    assert m.kv_meta("a")["state"] == "Handover"
    hog = h.alloc(h.allocator.available_size())  # running requests took every free slot ...
    m.queued_demand = lambda: 64  # ... and a queued one needs more than the evictable room
    m.tick(5)
    meta = m.kv_meta("a")
    assert meta["state"] == "Parked" and meta["protected"] is True, "the pin goes, the host copy is protected"
    assert all(n.lock_ref == 0 for n in path_to(h.tree, leaf))
    h.allocator.free(hog)
    h.evict_device(10**9)  # sglang evicts the unpinned KV for the queued requests
    indices, last = admit(h, m, "a", now=6.0)
    assert m.kv_meta("a")["state"] == "Runnable" and torch.equal(h.device_kv(indices), kv)
    h.tree.dec_lock_ref(last)
    acc = h.accounting()
    assert acc.lock_refs == () and acc.host_refs == ()
    assert m.counters["unpinned_parked"] == 1


def test_the_policy_of_one_call_can_be_chosen_and_is_checked(h: CacheHarness) -> None:
    m = ToolKVManager(h.tree, config=ManagerConfig(policy="auto"))
    idx = h.alloc(len(TOKS))
    assert idx is not None
    h.insert(TOKS, idx)
    m.insert("a", TOKS)
    before = h.accounting()
    with pytest.raises(BadRequest):
        m.tool_start("a", policy="sometimes")
    assert h.accounting() == before and m.kv_meta("a")["state"] == "Running"
    meta = m.tool_start("a", policy="offload")
    assert meta["state"] in ("Offloading", "Offloaded") and meta["reason"] == "policy_offload"
    m.close("a")
