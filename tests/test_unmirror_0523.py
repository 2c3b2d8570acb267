"""Host room from mirrors (spec ``Unmirror``: ``MirrorRoom``, ``HostUnmirror``) on sglang 0.5.23's
real ``UnifiedRadixCache`` under ``write_through``, on both tree cores.

Python core: as on the HiRadixCache (``tests/test_unmirror.py``), a tool_start the host cannot
take, with nothing ``evict_host`` may free, drops the host mirror of KV another request locks on
the device (the tree core's ``_release_full_host_duplicate``) instead of answering 507. The device
copy stays; when that request finishes, its insert hits the node and sglang writes the mirror
again; the offloaded session's restore brings back its bytes; every lock, host lock and slot
comes back. The seeded defects ``UnmirrorProtected`` and ``UnmirrorInFlight`` (the spec's mutants
of the same names) choose a copy that may not go: sglang's own guard in the free then stops the
tool_start, so they cannot pass here.

Rust core (sglang's default): the mechanism is not offered there (no by-id free of a host copy
whose device copy stays, no lock counts: ``toolkv.core.backends.unified_rust``), and the same
tool_start answers 507 with nothing changed. Runs in the 0.5.23 environment; skips with an older
sglang.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from toolkv.testing.unified_harness import has_unified_radix_cache, sglang_version

if not has_unified_radix_cache():
    pytest.skip(
        f"needs sglang >= 0.5.21 (UnifiedRadixCache), found {sglang_version()}", allow_module_level=True
    )

import torch

from toolkv.core.manager import ManagerConfig, ToolKVManager
from toolkv.errors import HostMemoryFull
from toolkv.testing.unified_harness import UnifiedCacheHarness, UnifiedHarnessConfig
from toolkv.verify.toolkv.mutants import mutant_manager

R = list(range(50_000, 50_900))  # another request's prompt: 900 tokens, mirrored, then running
A = list(range(1, 201))  # the session's: its write-through finds no host room
B = list(range(70_000, 70_900))  # a second session's, offloaded and protected
CORES = ["python", "rust"]


def harness(core: str) -> UnifiedCacheHarness:
    # a host pool of 1,024 tokens next to a device pool of 2,048: the mirror of a 900-token
    # request leaves no room for a 200-token session's copy
    return UnifiedCacheHarness(UnifiedHarnessConfig(device_tokens=2048, host_ratio=0.5, tree_core=core))


@pytest.fixture(params=CORES)
def h(request: pytest.FixtureRequest) -> Iterator[UnifiedCacheHarness]:
    with harness(request.param) as hh:
        yield hh


def manager(
    h: UnifiedCacheHarness, *, unmirror: bool, caveats: frozenset[str] = frozenset()
) -> ToolKVManager:
    """The plugin's free (lazy: an offloaded GPU copy is left to sglang's LRU) with ``unmirror``."""
    return mutant_manager(h.tree, caveats=caveats, config=ManagerConfig(unmirror=unmirror, lazy_free=True))


def kv(h: UnifiedCacheHarness, tokens: list[int]) -> torch.Tensor:
    """The device KV of ``tokens``' path (on either core: by node id)."""
    return h.device_kv(h.tree.path_device_indices(h.match(tokens).last_device_node)).clone()


def turn(h: UnifiedCacheHarness, m: ToolKVManager, sid: str, tokens: list[int]) -> torch.Tensor:
    """A finished turn of ``sid`` (its request admitted first, as sglang's scheduler does);
    returns its KV."""
    m.admit(sid)
    assert h.run_request(tokens)
    m.insert(sid, tokens)
    return kv(h, tokens)


def step(
    h: UnifiedCacheHarness, m: ToolKVManager, now: float, *, writes: bool = False, loads: bool = False
) -> None:
    """One scheduler iteration: sglang's events, the tick, copies finish, events, tick."""
    h.check_events()
    m.tick(now)
    if writes:
        h.complete("write")
    if loads:
        h.complete("load")
    h.check_events()
    m.tick(now)


def lock(h: UnifiedCacheHarness, tokens: list[int]) -> tuple[Any, Any]:
    """A request over ``tokens`` is running: PrefillAdder locked its prefix. Returns (node id,
    the lock's receipt)."""
    node = h.match(tokens).last_device_node
    return node, h.tree.inc_lock_ref(node).to_dec_params()


def backed_up(h: UnifiedCacheHarness, tokens: list[int]) -> bool:
    return bool(h.tree.tree_core.is_backuped(h.match(tokens).last_device_node))


@pytest.mark.parametrize("unmirror", [True, False], ids=["unmirror", "off"])
def test_a_tool_start_takes_the_mirror_of_a_running_request_for_room(
    h: UnifiedCacheHarness, unmirror: bool
) -> None:
    initial = h.accounting()
    assert h.run_request(R)  # sglang's write-through mirrors it ...
    h.check_events()
    h.complete("write")
    h.check_events()  # ... acknowledged
    kv_r = kv(h, R)
    node, receipt = lock(h, R)  # and the request runs again
    m = manager(h, unmirror=unmirror)
    kv_a = turn(h, m, "a", A)
    h.check_events()
    assert not backed_up(h, A), "the session's write-through found no room"
    assert int(h.host_pool.available_size()) < len(A)
    mechanism = unmirror and h.cfg.tree_core == "python"
    if not mechanism:
        before = h.accounting()
        with pytest.raises(HostMemoryFull) as ei:
            m.tool_start("a")
        assert ei.value.details["host_evictable_tokens"] == 0
        assert m.kv_meta("a")["state"] == "Running" and backed_up(h, R), "nothing changed"
        assert h.accounting() == before
    else:
        ep = int(m.tool_start("a")["epoch"])  # type: ignore[call-overload]
        assert m.backend.counters_unmirrored_tokens == len(R)  # type: ignore[attr-defined]
        assert not backed_up(h, R) and torch.equal(kv(h, R), kv_r), "the mirror went, the device copy stayed"
        step(h, m, 0.0, writes=True)
        assert m.kv_meta("a")["state"] == "Offloaded"
        h.evict_device(10**6)  # other requests take the device: the session's GPU copy goes
        assert int(h.match(A).device_prefix_len) == 0
        h.scribble_unreferenced()
        assert m.tool_end("a", ep)["state"] == "Restoring"
        step(h, m, 1.0, loads=True)
        assert torch.equal(kv(h, A), kv_a), "restored bytes equal"
        m.close("a")
        h.evict_device(10**6)  # a's copy, unprotected now, leaves the device: evict_host may take it
    h.tree.dec_lock_ref(node, receipt)  # the request finishes: cache_finished_req inserts it again ...
    assert h.run_request(R)
    h.check_events()
    h.complete("write")
    h.check_events()
    assert backed_up(h, R) and torch.equal(kv(h, R), kv_r), "... and sglang's write-through mirrors it again"
    if not mechanism:
        m.close("a")
    h.drain()
    assert h.accounting() == initial, "every lock, host lock and slot returned"


@pytest.mark.parametrize(
    "caveats", [frozenset(), frozenset({"UnmirrorProtected"})], ids=["fixed", "UnmirrorProtected"]
)
def test_a_protected_copy_is_never_a_mirror_to_drop(caveats: frozenset[str]) -> None:
    """Session b is offloaded (protected, its GPU copy left to sglang's LRU) and a request with
    b's prefix locks it on the device; a's tool_start then finds only b's copy to take. The fixed
    manager answers 507 and b comes back byte for byte; ``UnmirrorProtected`` takes b's protected
    copy for the room, which sglang's free refuses (it asserts no host lock)."""
    with harness("python") as g:
        initial = g.accounting()
        m = manager(g, unmirror=True, caveats=caveats)
        kv_b = turn(g, m, "b", B)
        step(g, m, 0.0, writes=True)
        ep = int(m.tool_start("b")["epoch"])  # type: ignore[call-overload]
        step(g, m, 0.0, writes=True)
        assert m.kv_meta("b")["state"] == "Offloaded"
        node, receipt = lock(g, B)  # a request with b's prefix runs
        turn(g, m, "a", A)
        if caveats:
            with pytest.raises(AssertionError) as ei:
                m.tool_start("a")
            assert ei.traceback[-1].name == "_release_full_host_duplicate", (
                "the defect reached sglang's guard"
            )
            assert backed_up(g, B), "sglang's guard kept b's copy"
            g.tree.dec_lock_ref(node, receipt)
            return
        with pytest.raises(HostMemoryFull):
            m.tool_start("a")
        g.tree.dec_lock_ref(node, receipt)
        g.evict_device(10**6)
        g.scribble_unreferenced()
        m.tool_end("b", ep)
        step(g, m, 1.0, loads=True)
        assert torch.equal(kv(g, B), kv_b), "b's bytes back"
        for sid in ("a", "b"):
            m.close(sid)
        g.drain()
        assert g.accounting() == initial


@pytest.mark.parametrize(
    "caveats", [frozenset(), frozenset({"UnmirrorInFlight"})], ids=["fixed", "UnmirrorInFlight"]
)
def test_a_mirror_whose_write_is_in_flight_is_never_dropped(caveats: frozenset[str]) -> None:
    """The running request's mirror is still being written (its ack not in): the fixed manager
    has no room and answers 507; ``UnmirrorInFlight`` takes the slots the copy engine is writing,
    which sglang's free refuses (it asserts no write in flight)."""
    with harness("python") as g:
        initial = g.accounting()
        assert g.run_request(R)  # mirrored, the write NOT acknowledged
        g.check_events()
        assert g.tree.ongoing_write_through, "the mirror's write is in flight"
        node, receipt = lock(g, R)
        m = manager(g, unmirror=True, caveats=caveats)
        turn(g, m, "a", A)
        with pytest.raises(AssertionError if caveats else HostMemoryFull) as ei:
            m.tool_start("a")
        if caveats:
            assert ei.traceback[-1].name == "_release_full_host_duplicate", (
                "the defect reached sglang's guard"
            )
        assert backed_up(g, R) and g.tree.ongoing_write_through, "the write and its slots kept"
        g.tree.dec_lock_ref(node, receipt)
        m.close("a")
        g.drain()
        assert g.accounting() == initial


@pytest.mark.parametrize("core", CORES)
def test_under_write_back_the_copies_to_write_are_read_after_the_host_room(core: str) -> None:
    """Under ``write_back`` 0.5.23's ``evict_host`` reclaims host duplicates first (a host copy
    whose device copy is there, not host-locked: unified_tree_core.py ``drive_host_eviction`` ->
    ``_reclaim_full_host_duplicates``), the offloading session's own backed-up prefix among them.
    So a tool_start reads its path's copies to write again after it made room (spec ``ToolStart``
    reads ``W`` after ``HostRoom``) and asks for the rest: it backs up the whole path, never
    offloading with a path node that has no host copy."""
    p, lb, la = (list(range(k, k + 64)) for k in (1_000, 2_000, 3_000))
    c = list(range(4_000, 4_096))
    cfg = UnifiedHarnessConfig(device_tokens=512, host_ratio=0.5, write_policy="write_back", tree_core=core)
    with UnifiedCacheHarness(cfg) as g:
        initial = g.accounting()
        # eager free: an offloaded GPU copy is freed at its write's ack (c becomes host-only; on
        # the Rust core, lazy free only, c stays a duplicate, which the reclaim may take too)
        m = mutant_manager(g.tree, config=ManagerConfig(lazy_free=False))
        for sid, tokens in (("b", p + lb), ("c", c)):  # offloaded, then let go: host copies unprotected
            turn(g, m, sid, tokens)
            m.tool_start(sid)
            step(g, m, 0.0, writes=True)
            m.close(sid)
        turn(g, m, "a", p + la)
        assert backed_up(g, p) and not backed_up(g, p + la)
        assert int(g.host_pool.available_size()) < len(la), "a's copy needs room ..."
        if core == "python":  # (host copies evict_host can free are not readable on the Rust core)
            assert m.backend.host_evictable_tokens() >= len(la), "... which evict_host can make"  # type: ignore[attr-defined]
        m.tool_start("a")
        assert backed_up(g, p) and backed_up(g, p + la), "the whole path has a host copy"
        step(g, m, 0.0, writes=True)
        assert m.kv_meta("a")["state"] == "Offloaded"
        m.close("a")
        g.drain()
        assert g.accounting() == initial


def test_the_start_up_line_says_where_unmirror_is_not_honoured(h: UnifiedCacheHarness) -> None:
    from toolkv.sglang.plugin import tree_core_note

    note = tree_core_note(h.tree, lazy_free=True, unmirror=True)
    assert ("TOOLKV_UNMIRROR not honoured" in note) == (h.cfg.tree_core == "rust"), note
    assert "TOOLKV_UNMIRROR" not in tree_core_note(h.tree, lazy_free=True, unmirror=False)
