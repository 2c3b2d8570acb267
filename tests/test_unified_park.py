"""Load-adaptive protection (spec ``Park``, ``Unpin`` to ``Parked``, ``Admit`` of a parked session)
on sglang 0.5.23's real ``UnifiedRadixCache`` with HiCache.

A parked session holds no device room: its host copy stays protected (a host lock) and nothing is
loaded or pinned. That is only worth anything if sglang's *own* admission brings the KV in, so the
admission here is sglang's: a real ``Req`` matches its prefix with ``init_next_round_input``
(``match_kv_cache``: the protected copy is a host hit at ``best_match_node``), the real
``PrefillAdder.add_one_req`` calls ``init_load_back`` on it and locks the path, and the copy
starts with ``ready_to_load_host_cache``, as ``Scheduler.get_new_batch_prefill`` does when it
builds the batch. Only then does the scheduler's hook tell toolkv (``admitted``), which ends the
protection.

Every test checks that the request reads the bytes that were offloaded (the freed device slots are
scribbled first, so right bytes cannot come from a stale slot) and that everything taken (locks,
host locks, loads, slots) is returned. The counters and the ``Parked`` phase make them fail on a
backend that does not park (``Capabilities.parks`` false: tool_end answers 503 and an unpin makes
the session ``Runnable``).

The hypothesis run at the end is ``tests/test_unified_stateful.py``'s machine with the spec's
``Park``, ``Unpin`` and a parked session's admission through the ``PrefillAdder`` added, and the
invariant ``ParkedKeepsKV``; the seeded defect ``ParkUnprotected`` must make it fail.

Runs in the 0.5.23 environment (``make test-0523``); skips with an older sglang.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator
from typing import Any, ClassVar

import pytest

from toolkv.testing.unified_harness import has_unified_radix_cache, sglang_version

if not has_unified_radix_cache():
    pytest.skip(
        f"needs sglang >= 0.5.21 (UnifiedRadixCache), found {sglang_version()}", allow_module_level=True
    )

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant
from test_unified_stateful import SESSIONS, UNIT, UnifiedManagerMachine

from toolkv.core.backends.unified import UnifiedBackend, full
from toolkv.core.capabilities import Parking
from toolkv.core.manager import ManagerConfig, ToolKVManager
from toolkv.core.treeops import attached, path_to
from toolkv.testing.unified_harness import UnifiedCacheHarness, UnifiedHarnessConfig
from toolkv.verify.toolkv.mutants import mutant_manager

TOKS = list(range(1, 129))
NEXT = [5001, 5002, 5003]  # the next turn's new tokens after the tool result


@pytest.fixture
def h() -> Iterator[UnifiedCacheHarness]:
    with UnifiedCacheHarness(UnifiedHarnessConfig(page_size=1, device_tokens=512)) as harness:
        yield harness


# ---- sglang's admission, as the scheduler runs it ----------------------------------------------------
def admit_through_prefill_adder(
    h: UnifiedCacheHarness, m: ToolKVManager | None, sid: str, prompt: list[int]
) -> Any:
    """The session's next request is admitted by sglang 0.5.23's own code: a real ``Req`` matches
    its prefix (``init_next_round_input`` -> ``match_kv_cache``), the real ``PrefillAdder`` admits
    it (``add_one_req``: ``init_load_back`` of the host hit, ``req.lock`` on the path), then the
    scheduler's AFTER hook on ``get_new_batch_prefill`` calls ``admitted`` and the batch starts its
    load (``ready_to_load_host_cache``). Returns the request, which holds ``req.lock`` until
    :func:`finish`. Not started when the adder does not admit it (no room: the request waits)."""
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.managers.schedule_policy import AddReqResult, PrefillAdder
    from sglang.srt.sampling.sampling_params import SamplingParams

    req = Req(
        f"r-{sid}-{len(prompt)}", "", array("q", prompt), SamplingParams(max_new_tokens=4), session_id=sid
    )
    req.init_next_round_input(h.tree)
    adder = PrefillAdder(
        page_size=h.cfg.page_size,
        tree_cache=h.tree,
        token_to_kv_pool_allocator=h.allocator,
        running_batch=None,
        new_token_ratio=0.0,
        rem_input_tokens=4096,
        rem_chunk_tokens=None,
    )
    res = adder.add_one_req(req, has_chunked_req=False, truncation_align_size=None)
    if res != AddReqResult.CONTINUE or req not in adder.can_run_list:
        return None
    if m is not None:
        m.admit(sid)
    h.tree.ready_to_load_host_cache()
    return req


def forward_done(h: UnifiedCacheHarness, m: ToolKVManager, now: float) -> None:
    """The prefill forward waited on the batch's load (one H2D stream: every earlier load is done
    too); the next iteration's ``check_hicache_events`` retires the acks, then toolkv's tick."""
    h.complete("load")
    h.check_events()
    m.tick(now)


def finish(h: UnifiedCacheHarness, req: Any) -> None:
    """The request is done with its prefix: its lock goes (what ``release_kv_cache`` does last)."""
    h.tree.unlock(req.lock)
    req.lock = None


def request_kv(h: UnifiedCacheHarness, req: Any) -> torch.Tensor:
    """The KV the request's prefill reads for its matched prefix: the device slots of its path."""
    return h.device_kv(h.tree.path_device_indices(req.last_node)).float()


# ---- setting up -----------------------------------------------------------------------------------------
def offloaded(
    h: UnifiedCacheHarness, cfg: ManagerConfig, **kw: Any
) -> tuple[ToolKVManager, int, torch.Tensor]:
    """Session ``a``'s 128 tokens, offloaded (write acknowledged, device copy freed); its KV."""
    m = ToolKVManager(h.tree, config=cfg, **kw)
    idx = h.allocator.alloc(len(TOKS))
    assert idx is not None
    h.fill_kv(idx, TOKS)
    kv = h.device_kv(idx).float().clone()
    assert torch.equal(kv, h.expected_kv(TOKS))
    h.insert(TOKS, idx)
    m.insert("a", TOKS)
    m.tick(1.0)
    ep = int(m.tool_start("a")["epoch"])  # type: ignore[call-overload]
    h.check_events()
    h.complete("write")
    h.check_events()
    m.tick(2.0)
    meta = m.kv_meta("a")
    assert meta["state"] == "Offloaded" and meta["device_tokens"] == 0 and meta["host_tokens"] == 128
    return m, ep, kv


def host_copy(h: UnifiedCacheHarness, m: ToolKVManager, sid: str) -> torch.Tensor:
    """The bytes of the session's host copy, root to leaf."""
    path = path_to(h.tree, m.sessions[sid].node)
    return torch.cat([h.host_kv(full(n).host_value) for n in path], dim=2).float()


def restored_and_handed_over(h: UnifiedCacheHarness, m: ToolKVManager, ep: int, now: float) -> None:
    """tool_end on an idle server: the plain restore, load acknowledged, pinned until admission."""
    assert m.tool_end("a", ep)["state"] == "Restoring"
    m.tick(now)  # spec StartLoads: the ring is idle
    forward_done(h, m, now + 0.5)
    assert m.kv_meta("a")["state"] == "Handover"


def nothing_held(h: UnifiedCacheHarness) -> None:
    acc = h.accounting()
    assert acc.lock_refs == () and acc.host_refs == (), acc
    assert acc.pending_loads == 0 and acc.pending_writes == 0 and h.controller.load_queue == []


class OtherRankSaysNo:
    """TEST DOUBLE for a second tensor-parallel rank (one process cannot have two): every vote is
    this rank's answer, except that ``veto`` votes from now on are answered no by the other rank
    (its host budget or tree said so)."""

    def __init__(self) -> None:
        self.veto = 0

    def all_true(self, ok: bool) -> bool:
        if self.veto > 0:
            self.veto -= 1
            return False
        return ok

    def max_time(self, t: float) -> float:
        return t


# ---- the tests ------------------------------------------------------------------------------------------
def test_the_unified_backend_parks(h: UnifiedCacheHarness) -> None:
    m = ToolKVManager(h.tree)
    assert isinstance(m.backend, UnifiedBackend) and isinstance(m.backend, Parking)
    assert m.caps.parks and m.caps.parking is m.backend


def test_a_parked_session_is_loaded_by_sglangs_own_admission_with_the_offloaded_bytes(
    h: UnifiedCacheHarness,
) -> None:
    initial = h.accounting()
    m, ep, kv = offloaded(h, ManagerConfig(adaptive=True, lazy_free=False))
    m.queued_demand = lambda: 10**6  # the waiting requests need more than the whole device
    before = h.accounting()
    meta = m.tool_end("a", ep)
    assert meta["state"] == "Parked" and meta["protected"] is True and meta["restore"] == "parked"
    assert meta["tier"] == "CpuProtected" and m.counters["parked"] == 1
    assert h.accounting() == before, "a park loads nothing, pins nothing and keeps the host lock"
    # while the request waits, sglang's host eviction takes what it likes: not the parked copy
    h.evict_host(10**9)
    assert h.match(TOKS).host_hit_length == len(TOKS)
    assert torch.equal(host_copy(h, m, "a"), kv)
    assert h.scribble_unreferenced() > 0  # the freed device slots hold no right bytes by luck

    req = admit_through_prefill_adder(h, m, "a", TOKS + NEXT)
    assert req is not None and req.host_hit_length == len(TOKS) and req.host_loaded_length == len(TOKS)
    meta = m.kv_meta("a")
    assert meta["state"] == "Runnable" and meta["protected"] is False, "the protection ends at admission"
    assert m.counters["admitted_parked"] == 1
    leaf = m.sessions["a"].node
    assert full(leaf).host_lock_ref == 1, "only sglang's own load holds a host lock now"
    assert h.accounting().pending_loads == 1, "the request's load is sglang's, not toolkv's"
    assert not m.backend.loads_in_flight()
    forward_done(h, m, 3.0)
    assert torch.equal(request_kv(h, req), kv), "the request reads the bytes that were offloaded"
    assert torch.equal(request_kv(h, req), host_copy(h, m, "a"))
    finish(h, req)
    nothing_held(h)
    m.close("a")
    h.drain()
    assert h.accounting() == initial


def test_without_queued_requests_the_same_tool_end_restores(h: UnifiedCacheHarness) -> None:
    """On an idle server the adaptive tool_end is the plain restore: load now, pin until admission."""
    m, ep, kv = offloaded(h, ManagerConfig(adaptive=True, lazy_free=False))
    restored_and_handed_over(h, m, ep, 2.5)
    assert m.counters["parked"] == 0 and m.counters["unpinned_parked"] == 0
    req = admit_through_prefill_adder(h, m, "a", TOKS + NEXT)
    assert req is not None and req.host_hit_length == 0, "the restored KV is on the device already"
    assert m.kv_meta("a")["state"] == "Runnable" and torch.equal(request_kv(h, req), kv)
    finish(h, req)
    nothing_held(h)


def test_a_hand_over_gives_its_pin_up_to_queued_requests_and_is_parked(h: UnifiedCacheHarness) -> None:
    initial = h.accounting()
    m, ep, kv = offloaded(h, ManagerConfig(adaptive=True, lazy_free=False))
    restored_and_handed_over(h, m, ep, 2.5)
    leaf = m.sessions["a"].node
    assert all(full(n).lock_ref == 1 and full(n).host_lock_ref == 0 for n in path_to(h.tree, leaf))
    m.tick(4.0)  # nothing queued: the pin stays
    assert m.kv_meta("a")["state"] == "Handover"
    hog = h.allocator.alloc(h.allocator.available_size())  # running requests took every free slot ...
    assert hog is not None
    m.queued_demand = lambda: 64  # ... and a queued one needs more than the evictable room
    m.tick(5.0)  # spec Unpin
    meta = m.kv_meta("a")
    assert meta["state"] == "Parked" and meta["protected"] is True, "the pin goes, the host copy is locked"
    assert m.counters["unpinned_parked"] == 1 and m.counters["unpinned_runnable"] == 0
    assert all(full(n).lock_ref == 0 for n in path_to(h.tree, leaf)), "no device pin while it waits"
    assert full(leaf).host_lock_ref == 1
    # sglang evicts the unpinned KV for the queued requests: a host-locked node still demotes
    assert h.evict_device(10**9) >= len(TOKS)
    assert m.kv_meta("a")["device_tokens"] == 0 and m.kv_meta("a")["host_tokens"] == len(TOKS)
    h.allocator.free(hog)
    m.queued_demand = lambda: 0
    h.evict_host(10**9)  # and its host eviction cannot take the parked copy
    assert h.scribble_unreferenced() > 0
    req = admit_through_prefill_adder(h, m, "a", TOKS + NEXT)
    assert req is not None and req.host_loaded_length == len(TOKS)
    assert m.kv_meta("a")["state"] == "Runnable" and m.counters["admitted_parked"] == 1
    forward_done(h, m, 6.0)
    assert torch.equal(request_kv(h, req), kv)
    finish(h, req)
    nothing_held(h)
    m.close("a")
    h.drain()
    assert h.accounting() == initial


def test_an_unpin_the_host_budget_cannot_take_is_runnable(h: UnifiedCacheHarness) -> None:
    """Reprotecting counts against ``host_budget_tokens`` like an offload: when another session's
    copy fills it, the unpinned session is Runnable and holds nothing (its next request recomputes
    whatever sglang evicts meanwhile)."""
    m, ep, _kv = offloaded(h, ManagerConfig(adaptive=True, lazy_free=False, host_budget_tokens=200))
    b = list(range(3000, 3128))
    idx = h.allocator.alloc(len(b))
    assert idx is not None
    h.fill_kv(idx, b)
    h.insert(b, idx)
    m.insert("b", b)
    restored_and_handed_over(h, m, ep, 2.5)
    m.tool_start("b")  # b's 128 protected tokens leave 72 of the budget
    h.check_events()
    h.complete("write")
    h.check_events()
    m.tick(3.0)
    assert m.kv_meta("b")["state"] == "Offloaded" and m.backend.protected_tokens == 128  # type: ignore[attr-defined]
    m.unpin("a")
    meta = m.kv_meta("a")
    assert meta["state"] == "Runnable" and meta["protected"] is False
    assert m.counters["unpinned_runnable"] == 1 and m.counters["unpinned_parked"] == 0
    leaf = m.sessions["a"].node
    assert all(full(n).lock_ref == 0 and full(n).host_lock_ref == 0 for n in path_to(h.tree, leaf))
    assert m.backend.protected_tokens == 128  # type: ignore[attr-defined]
    m.close("b")
    nothing_held(h)


def test_a_reprotect_any_rank_refuses_changes_nothing(h: UnifiedCacheHarness) -> None:
    """The reprotect's answer (is every node backed up, does the budget take it) is local; it is
    agreed across ranks before any rank takes a host lock, or the ranks' trees would differ."""
    agree = OtherRankSaysNo()
    m, ep, _kv = offloaded(h, ManagerConfig(adaptive=True, lazy_free=False), agree=agree)
    restored_and_handed_over(h, m, ep, 2.5)
    agree.veto = 1  # the other rank says no to the one vote the explicit unpin takes
    m.unpin("a")
    assert m.kv_meta("a")["state"] == "Runnable" and m.counters["unpinned_runnable"] == 1
    assert agree.veto == 0, "reprotect asked the other ranks"
    nothing_held(h)


def test_a_parked_session_whose_request_never_comes_is_released_by_the_ttl(h: UnifiedCacheHarness) -> None:
    m, ep, _kv = offloaded(h, ManagerConfig(adaptive=True, lazy_free=False, ttl_s=5.0))
    m.queued_demand = lambda: 10**6
    assert m.tool_end("a", ep)["state"] == "Parked"
    m.tick(2.0 + 5.0)
    meta = m.kv_meta("a")
    assert meta["state"] == "Runnable" and meta["protected"] is False
    assert m.counters["parked_expired"] == 1
    nothing_held(h)


# ---- the hypothesis run with Park, Unpin and a parked session's admission --------------------------------
class UnifiedParkMachine(UnifiedManagerMachine):
    """``UnifiedManagerMachine`` with load-adaptive protection on (``adaptive``) and the spec's
    ``Park``, ``Unpin``, a queue whose demand comes and goes (the tick's ``unpin_for_room`` and the
    tool_end's park act on it), and a parked or handed-over session's next request admitted
    through sglang's ``PrefillAdder`` (its lock is an other request's lock from then on)."""

    def __init__(self) -> None:
        super().__init__()
        # no session exists yet: the manager can be replaced without leaving anything behind
        self.queued = 0
        self.mgr = mutant_manager(
            self.h.tree, config=ManagerConfig(ttl_s=8.0, adaptive=True, lazy_free=False), caveats=self.caveats
        )
        self.mgr.queued_demand = lambda: self.queued
        self.admitted_parked = 0

    def park(self, d: st.DataObject) -> None:
        s = d.draw(st.sampled_from(self.biased(("Offloading", "Offloaded"))))
        rec = self.mgr.sessions.get(s)
        self.act(self.mgr.park, s, rec.epoch if rec else 0)

    def unpin(self, d: st.DataObject) -> None:
        self.act(self.mgr.unpin, d.draw(st.sampled_from(self.biased(("Handover",)))))

    def queue(self, d: st.DataObject) -> None:
        self.queued = d.draw(st.sampled_from((0, 0, 0, 2 * UNIT, 10**6)))

    def admit_request(self, d: st.DataObject) -> None:
        """The next request of a parked or handed-over session is admitted by sglang; the forward
        that reads it waits on its load."""
        s = d.draw(st.sampled_from(self.biased(("Parked", "Handover"))))
        rec = self.mgr.sessions.get(s)
        if rec is None or rec.state not in ("Parked", "Handover") or rec.node is None:
            return
        if not attached(self.h.tree, rec.node):
            return
        tokens = self.tokens(rec.node)
        parked = rec.state == "Parked"
        req = admit_through_prefill_adder(self.h, self.mgr, s, [*tokens, 9_000_000 + self.fresh])
        self.fresh += 1
        if req is None:
            return  # no room: the request keeps waiting, the session keeps its phase
        self.ext.append(req.lock)
        if parked:
            self.admitted_parked += 1
            assert self.mgr.sessions[s].protected is None, "the protection ends at admission"
        if self.h.engine is not None:
            self.h.complete("load")  # the forward waits on the batch's load (one H2D stream)

    WEIGHTS: ClassVar[dict[str, int]] = {
        **UnifiedManagerMachine.WEIGHTS,
        "park": 2,
        "unpin": 3,
        "queue": 2,
        "admit_request": 4,
    }
    CHOICES: ClassVar[list[str]] = [a for a, w in WEIGHTS.items() for _ in range(w)]

    @invariant()
    def parked_keeps_kv(self) -> None:
        """Spec ``ParkedKeepsKV``: a parked session's path is in the tree with a host copy whole,
        under its own host lock, and holds no device pin."""
        for rec in self.mgr.sessions.values():
            if rec.state != "Parked":
                continue
            assert rec.node is not None and attached(self.h.tree, rec.node), "ParkedKeepsKV: node gone"
            assert all(full(m).host_value is not None for m in path_to(self.h.tree, rec.node)), (
                "ParkedKeepsKV: host copy gone"
            )
            assert rec.protected is rec.node and rec.pinned is None, "ParkedKeepsKV: not protected"

    @invariant()
    def steps_and_slots(self) -> None:
        """The base invariant, with the spec's one exception: a parked session's admitted request
        reads through sglang's own load, so it is Runnable before that load's ack."""
        for s in SESSIONS:
            rec = self.mgr.sessions.get(s)
            if rec is not None and rec.state == "Runnable" and self.phases[s] == "Parked":
                self.phases[s] = "Runnable"
        super().steps_and_slots()


class UnifiedParkMachinePage16(UnifiedParkMachine):
    page_size = 16


_SETTINGS = settings(
    max_examples=int(__import__("os").environ.get("TOOLKV_UNIFIED_EXAMPLES", "25")),
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    derandomize=True,
)
TestUnifiedPark = UnifiedParkMachine.TestCase
TestUnifiedPark.settings = _SETTINGS
TestUnifiedParkPage16 = UnifiedParkMachinePage16.TestCase
TestUnifiedParkPage16.settings = _SETTINGS


def test_the_run_takes_park_unpin_and_parked_admissions() -> None:
    """The run above is only worth something if it reaches the parked phases: one example, forced
    through park and admission, shows the rules are live on this backend (a backend that cannot
    park refuses ``park`` with WrongState and the session never becomes Parked)."""
    from hypothesis.stateful import run_state_machine_as_test

    seen: dict[str, int] = {"parked": 0, "admitted_parked": 0, "unpinned_parked": 0}

    class Counting(UnifiedParkMachine):
        def teardown(self) -> None:
            for k in seen:
                seen[k] += self.mgr.counters[k]
            super().teardown()

    run_state_machine_as_test(
        Counting,
        settings=settings(
            _SETTINGS, max_examples=25, phases=[p for p in _SETTINGS.phases if p.name != "shrink"]
        ),
    )
    assert seen["parked"] > 0 and seen["admitted_parked"] > 0 and seen["unpinned_parked"] > 0, seen


def test_the_seeded_defect_park_unprotected_is_caught() -> None:
    """With the protection dropped at the park (spec BUG ``ParkUnprotected``) sglang's host
    eviction may take the copy the waiting request needs: this run must fail, on a spec
    invariant (not on some error of the environment, which would pass a bare ``raises``)."""
    from hypothesis.stateful import run_state_machine_as_test

    machine = type(
        "Mutant_ParkUnprotected", (UnifiedParkMachine,), {"caveats": frozenset({"ParkUnprotected"})}
    )
    quick = settings(_SETTINGS, max_examples=60, phases=[p for p in _SETTINGS.phases if p.name != "shrink"])
    with pytest.raises(AssertionError, match=r"ParkedKeepsKV|HostRefAccounting|ProtectionOwned"):
        run_state_machine_as_test(machine, settings=quick)
