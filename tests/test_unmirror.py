"""Host room from mirrors (spec ``Unmirror``: ``MirrorRoom``, ``HostUnmirror``), on the real
HiRadixCache under ``write_through``: a tool_start the host cannot take, with nothing
``evict_host`` may free, drops the host mirror of KV another request locks on the device, instead of
answering 507. The device copy stays; sglang writes the mirror again when that request finishes;
the offloaded session's restore brings back its bytes; every lock, host reference and slot comes
back. The seeded defects ``UnmirrorProtected`` and ``UnmirrorInFlight`` (the spec's mutants of the
same names) lose data here, so the tests cannot pass on them."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from _cycle import step, turn

from toolkv.core.backends.mirrors import mirror_room
from toolkv.core.manager import ManagerConfig, ToolKVManager
from toolkv.errors import HostMemoryFull
from toolkv.testing.harness import CacheHarness, HarnessConfig
from toolkv.verify.toolkv.mutants import mutant_manager

R = list(range(50_000, 50_900))  # another request's prompt: 900 tokens, mirrored, then running
A = list(range(1, 201))  # the session's: its write-through finds no host room


@pytest.fixture
def h() -> Iterator[CacheHarness]:
    # a host pool of 1,024 tokens next to a device pool of 2,048: the mirror of a 900-token
    # request leaves no room for a 200-token session's copy
    with CacheHarness(HarnessConfig(device_tokens=2048, host_ratio=0.5)) as harness:
        yield harness


def running(h: CacheHarness, tokens: list[int]) -> object:
    """A request over ``tokens`` has run once (sglang's write-through mirrored it, acknowledged)
    and is running again: PrefillAdder locked its prefix. Returns the locked node."""
    assert h.run_request(tokens, deterministic=True)
    h.complete("write")
    h.check_events()
    node = h.match(tokens).last_device_node
    h.tree.inc_lock_ref(node)
    return node


def manager(h: CacheHarness, *, unmirror: bool, caveats: frozenset[str] = frozenset()) -> ToolKVManager:
    """The plugin's free (lazy: an offloaded GPU copy is left to sglang's LRU) with ``unmirror``."""
    return mutant_manager(h.tree, caveats=caveats, config=ManagerConfig(unmirror=unmirror, lazy_free=True))


@pytest.mark.parametrize("unmirror", [True, False], ids=["unmirror", "off"])
def test_a_tool_start_takes_the_mirror_of_a_running_request_for_room(h: CacheHarness, unmirror: bool) -> None:
    initial = h.accounting()
    node = running(h, R)
    m = manager(h, unmirror=unmirror)
    kv = turn(h, m, "a", A)
    assert h.match(A).last_device_node.host_value is None, "the session's write-through found no room"
    assert int(h.host_pool.available_size()) < len(A)
    room = mirror_room(h.tree, [])
    assert sum(len(n.host_value) for n in room) == len(R), "the running request's mirror, whole"
    if not unmirror:
        with pytest.raises(HostMemoryFull) as ei:
            m.tool_start("a")
        assert ei.value.details["host_evictable_tokens"] == 0
        assert m.kv_meta("a")["state"] == "Running" and node.host_value is not None, "nothing changed"
    else:
        ep = int(m.tool_start("a")["epoch"])  # type: ignore[call-overload]
        assert m.backend.counters_unmirrored_tokens >= len(A)  # type: ignore[attr-defined]
        dropped = [n for n in h.iter_nodes() if n is not h.tree.root_node and n.host_value is None]
        assert all(n.value is not None for n in dropped), "a dropped mirror's device copy stays"
        assert h.device_kv(h.match(R).device_indices).equal(h.expected_kv(R)), "the request's KV intact"
        step(h, m, 0.0, writes=True)
        h.evict_device(10**6)  # other requests take the device: the session's GPU copy goes
        assert h.match(A).device_indices.numel() == 0
        h.scribble_unreferenced()
        assert m.tool_end("a", ep)["state"] == "Restoring"
        step(h, m, 1.0, loads=True)
        assert torch.equal(h.device_kv(h.match(A).device_indices), kv), "restored bytes equal"
        m.close("a")
        h.evict_device(10**6)  # a's copy, unprotected now, leaves the device: evict_host may take it
    h.tree.dec_lock_ref(node)  # the request finishes: cache_finished_req inserts it again ...
    assert h.run_request(R, deterministic=True)
    h.complete("write")
    h.check_events()
    assert int(h.match(R).host_hit_length) == 0 and h.match(R).last_device_node.host_value is not None, (
        "... and sglang's write-through mirrors it again"
    )
    if not unmirror:
        m.close("a")
    h.drain()
    assert h.accounting() == initial, "every lock, host reference and slot returned"


@pytest.mark.parametrize(
    "caveats", [frozenset(), frozenset({"UnmirrorProtected"})], ids=["fixed", "UnmirrorProtected"]
)
def test_a_protected_copy_is_never_a_mirror_to_drop(caveats: frozenset[str]) -> None:
    """Session b is offloaded (protected, its GPU copy left to sglang's LRU) and a request that
    shares b's path locks it on the device; a's tool_start then finds only b's copy to take. The
    fixed manager answers 507; ``UnmirrorProtected`` drops b's protected copy, and b's restore
    after that request finds nothing on the host."""
    if True:
        with CacheHarness(HarnessConfig(device_tokens=2048, host_ratio=0.5)) as g:
            initial = g.accounting()
            m = manager(g, unmirror=True, caveats=caveats)
            b = list(range(70_000, 70_900))
            kv_b = turn(g, m, "b", b, ack_writes=True)
            ep = int(m.tool_start("b")["epoch"])  # type: ignore[call-overload]
            step(g, m, 0.0, writes=True)
            other = g.match(b).last_device_node
            g.tree.inc_lock_ref(other)  # a request with b's prefix runs
            turn(g, m, "a", A)
            if not caveats:
                with pytest.raises(HostMemoryFull):
                    m.tool_start("a")
            else:
                m.tool_start("a")  # the defect: b's protected copy was the room
                assert g.match(b).last_device_node.host_value is None
            g.tree.dec_lock_ref(other)
            g.evict_device(10**6)
            g.scribble_unreferenced()
            if not caveats:
                m.tool_end("b", ep)
                step(g, m, 1.0, loads=True)
                assert torch.equal(g.device_kv(g.match(b).device_indices), kv_b), "b's bytes back"
                for sid in ("a", "b"):
                    m.close(sid)
                g.drain()
                assert g.accounting() == initial
            else:
                r = g.match(b)
                assert r.device_indices.numel() + int(r.host_hit_length) < len(b), (
                    "the defect lost b's KV: neither tier holds it whole"
                )


@pytest.mark.parametrize(
    "caveats", [frozenset(), frozenset({"UnmirrorInFlight"})], ids=["fixed", "UnmirrorInFlight"]
)
def test_a_mirror_whose_write_is_in_flight_is_never_dropped(caveats: frozenset[str]) -> None:
    """The running request's mirror is still being written (its ack not in): the fixed manager has
    no room and answers 507; ``UnmirrorInFlight`` frees the slots the copy engine is writing, and
    another copy then lands in them."""
    if True:
        with CacheHarness(HarnessConfig(device_tokens=2048, host_ratio=0.5)) as g:
            assert g.run_request(R, deterministic=True)  # mirrored, the write NOT acknowledged
            node = g.match(R).last_device_node
            assert node.id in g.tree.ongoing_write_through
            g.tree.inc_lock_ref(node)
            m = manager(g, unmirror=True, caveats=caveats)
            turn(g, m, "a", A)
            if not caveats:
                with pytest.raises(HostMemoryFull):
                    m.tool_start("a")
                assert node.host_value is not None
            else:
                m.tool_start("a")
                assert node.host_value is None and node.id in g.tree.ongoing_write_through, (
                    "the defect freed the host slots of a write still in flight"
                )
            g.tree.dec_lock_ref(node)
            m.close("a")
