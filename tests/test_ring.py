"""sglang's load-slot ring on the REAL HiRadixCache: toolkv's restores, bunched together and mixed
with sglang's own prefill loads, never make ``LayerDoneCounter.update_producer`` reuse a producer
slot whose load is still in flight (spec ``RingBounded``).

The counter, its events and the controller are sglang's own; on CPU the events come from the
copy-engine double, so a load's events fire only when the test lets the copy finish, as on a GPU.
sglang's own loads follow its cadence (scheduler.py:3064-3068 starts at most one per prefill batch,
and overlap scheduling keeps at most one of its batches, hence loads, in flight): the machine
below starts one only when at most one of its earlier ones is unfinished (spec ``SysStart``).
The same machine must fail on the two seeded defects (spec mutants RingOverrun, RingTwoFree).
"""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from toolkv.core.backends.hiradix import HiRadixBackend
from toolkv.core.manager import ToolKVManager
from toolkv.errors import DeviceMemoryFull, HostMemoryFull, SessionKVLost
from toolkv.testing.harness import CacheHarness, HarnessConfig
from toolkv.verify.toolkv.mutants import RingOverrunBackend, RingTwoFreeBackend

SESSIONS = 4
BACKGROUND = 3
RING_CRASH = "Producer finish event should be ready before being reused"


def tokens_of(base: int, n: int = 40) -> list[int]:
    return list(range(base, base + n))


class RingWorld:
    """One real cache stack, a manager on ``backend_cls``, sessions with one turn each, and
    host-only background prefixes that sglang's own prefill batches load back."""

    def __init__(self, backend_cls: type[HiRadixBackend]) -> None:
        self.h = CacheHarness(HarnessConfig(device_tokens=1024, host_ratio=2.0))
        self.initial = self.h.accounting()
        self.m = ToolKVManager(self.h.tree, backend_cls(self.h.tree))
        self.now = 0.0
        self.kv: dict[str, torch.Tensor] = {}
        self.toks: dict[str, list[int]] = {}
        self.sys_acks: list[Any] = []
        self.restored_checks = 0
        for i in range(SESSIONS):
            sid = f"s{i}"
            self.toks[sid] = tokens_of(1 + 1000 * i)
            self.kv[sid] = self._turn(sid, self.toks[sid])
        self.bg = [tokens_of(50_001 + 1000 * j) for j in range(BACKGROUND)]
        for t in self.bg:
            idx = self.h.alloc(len(t))
            assert idx is not None
            self.h.fill_kv(idx, t)
            self.h.insert(t, idx)
        self.h.complete("write")
        self.h.check_events()
        self.m.tick(self.now)
        self.h.evict_device(10**6)  # background prefixes live on host only, until a batch hits them

    def _turn(self, sid: str, toks: list[int]) -> torch.Tensor:
        idx = self.h.alloc(len(toks))
        assert idx is not None
        self.h.fill_kv(idx, toks)
        self.h.insert(toks, idx)
        self.m.insert(sid, toks)
        return self.h.expected_kv(toks)

    # ---- spec actions ------------------------------------------------------------------------------
    def tool_start(self, sid: str) -> None:
        state = self.m.kv_meta(sid)["state"]
        if state in ("Handover", "Runnable"):  # the agent's next turn is admitted, reuses the prefix
            self.m.admit(sid)
            self.m.insert(sid, self.toks[sid])
            state = "Running"
        if state == "Running":
            with contextlib.suppress(HostMemoryFull, SessionKVLost):  # refused, nothing changed
                self.m.tool_start(sid)

    def tool_end(self, sid: str) -> None:
        meta = self.m.kv_meta(sid)
        if meta["state"] in ("Offloading", "Offloaded"):
            with contextlib.suppress(DeviceMemoryFull):  # stays offloaded; retried later
                self.m.tool_end(sid, int(meta["epoch"]))  # type: ignore[call-overload]

    def sys_in_flight(self) -> int:
        return sum(1 for a in self.sys_acks if not a.finish_event.query())

    def sys_start(self, j: int) -> None:
        """A prefill batch whose request hits background prefix ``j`` on host: sglang's
        init_load_back then ready_to_load_host_cache (which starts the whole queue)."""
        if self.sys_in_flight() > 1:
            return  # sglang's cadence: its batch before last has finished
        m = self.h.match(self.bg[j])
        node = m.best_match_node if hasattr(m, "best_match_node") else m.last_host_node
        if node is self.h.tree.root_node or not node.evicted or len(m.device_indices) > 0:
            return
        if self.h.tree.load_back(node) is None:
            return
        if self.h.tree.ready_to_load_host_cache() >= 0:
            self.sys_acks.append(self.h.tree.cache_controller.ack_load_queue[-1])

    def ring_done(self) -> None:
        self.h.complete("load", 1)  # the load stream runs in order: the oldest load finishes

    def writes_done(self) -> None:
        self.h.complete("write")

    def iteration(self) -> None:
        """sglang's ack checks, then toolkv's tick (which starts queued loads if the ring is idle)."""
        before = {s: self.m.kv_meta(s)["state"] for s in self.toks}
        self.h.check_events()
        self.now += 1
        self.m.tick(self.now)
        for s, was in before.items():
            if was == "Restoring" and self.m.kv_meta(s)["state"] == "Handover":
                got = self.h.device_kv(self.h.match(self.toks[s]).device_indices)
                assert torch.equal(got, self.kv[s].to(got.dtype)), f"restored KV of {s} differs"
                self.restored_checks += 1

    def sys_evict(self) -> None:
        """sglang evicts unlocked device copies (backed-up ones stay on host)."""
        self.h.evict_device(10**6)

    def settle_and_check(self) -> None:
        """Everything finishes; every session closes; every counter is back where it started."""
        for _ in range(8):
            self.h.synchronize()
            self.iteration()
        for s in self.toks:
            self.m.close(s)
        for _ in range(4):
            self.h.synchronize()
            self.iteration()
        self.h.drain()
        assert self.h.accounting() == self.initial

    def close(self) -> None:
        self.h.close()


def bunched_scenario(backend_cls: type[HiRadixBackend]) -> RingWorld:
    """Every session offloads, then all tool_ends land in one iteration together with two of
    sglang's prefill batches that load from host (what the crashed server saw)."""
    w = RingWorld(backend_cls)
    for s in w.toks:
        w.tool_start(s)
    w.writes_done()
    w.iteration()
    w.sys_evict()
    for s in w.toks:
        w.tool_end(s)
    w.sys_start(0)
    w.iteration()
    w.sys_start(1)
    w.iteration()
    return w


def staggered_scenario(backend_cls: type[HiRadixBackend]) -> RingWorld:
    """Two restores in consecutive iterations while the first load is still running, then two
    of sglang's prefill batches with host loads (the rule "the next two slots are free" fails)."""
    w = RingWorld(backend_cls)
    for s in ("s0", "s1"):
        w.tool_start(s)
    w.writes_done()
    w.iteration()
    w.tool_end("s0")
    w.iteration()
    w.tool_end("s1")
    w.iteration()
    w.sys_start(0)
    w.sys_start(1)
    return w


SCENARIOS = {"bunched": (bunched_scenario, SESSIONS), "staggered": (staggered_scenario, 2)}


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_restores_and_sglang_loads_share_the_ring(name: str) -> None:
    scenario, restored = SCENARIOS[name]
    w = scenario(HiRadixBackend)
    try:
        w.settle_and_check()
        assert w.restored_checks == restored, "every restore finished with byte-identical KV"
    finally:
        w.close()


@pytest.mark.parametrize(
    ("name", "mutant"),
    [("bunched", RingOverrunBackend), ("staggered", RingTwoFreeBackend)],
    ids=["bunched-RingOverrun", "staggered-RingTwoFree"],
)
def test_the_seeded_defect_crashes_sglangs_counter(name: str, mutant: type[HiRadixBackend]) -> None:
    """The same scenario on the defective backend: sglang's own assertion fires."""
    try:
        with pytest.raises(AssertionError, match=RING_CRASH):
            SCENARIOS[name][0](mutant)
    finally:
        if CacheHarness._live_cpu is not None:
            CacheHarness._live_cpu.close()


class RingMachine(RuleBasedStateMachine):
    backend_cls: type[HiRadixBackend] = HiRadixBackend

    @initialize()
    def build(self) -> None:
        self.w = RingWorld(self.backend_cls)
        self.broken = False

    def _do(self, fn: Any, *args: Any) -> None:
        """Run one step; remember a failure so teardown does not bury it under a leak report."""
        try:
            fn(*args)
        except BaseException:
            self.broken = True
            raise

    @rule(i=st.integers(0, SESSIONS - 1))
    def tool_start(self, i: int) -> None:
        self._do(self.w.tool_start, f"s{i}")

    @rule(i=st.integers(0, SESSIONS - 1))
    def tool_end(self, i: int) -> None:
        self._do(self.w.tool_end, f"s{i}")

    @rule()
    def tool_start_all(self) -> None:
        for s in self.w.toks:
            self._do(self.w.tool_start, s)

    @rule()
    def tool_end_all(self) -> None:
        """Restores bunched in one iteration, as agents' tool calls often end together."""
        for s in self.w.toks:
            self._do(self.w.tool_end, s)

    @precondition(lambda self: hasattr(self, "w") and self.w.sys_in_flight() <= 1)
    @rule(j=st.integers(0, BACKGROUND - 1))
    def sys_start(self, j: int) -> None:
        self._do(self.w.sys_start, j)

    @precondition(lambda self: hasattr(self, "w") and self.w.h.pending("load") > 0)
    @rule()
    def ring_done(self) -> None:
        self._do(self.w.ring_done)

    @precondition(lambda self: hasattr(self, "w") and self.w.h.pending("write") > 0)
    @rule()
    def writes_done(self) -> None:
        self._do(self.w.writes_done)

    @rule()
    def iteration(self) -> None:
        self._do(self.w.iteration)

    @rule()
    def sys_evict(self) -> None:
        self._do(self.w.sys_evict)

    @invariant()
    def ring_never_overruns(self) -> None:
        if hasattr(self, "w"):
            c = self.w.h.tree.cache_controller.layer_done_counter
            busy = sum(1 for e in c.events if not e.finish_event.query())
            assert busy <= c.num_counters

    def teardown(self) -> None:
        if hasattr(self, "w"):
            try:
                if not self.broken:
                    self.w.settle_and_check()
            finally:
                self.w.close()


SETTINGS = settings(
    max_examples=60,
    stateful_step_count=40,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],  # each step drives a real cache stack
)


def test_ring_machine_on_the_fixed_backend() -> None:
    run_state_machine_as_test(RingMachine, settings=SETTINGS)


@pytest.mark.parametrize("mutant", [RingOverrunBackend], ids=["RingOverrun"])
def test_ring_machine_kills_the_mutant(mutant: type[HiRadixBackend]) -> None:
    """The machine finds the crash of the old restore on its own. (RingTwoFree needs a ten-step
    staggered sequence that a blind search rarely draws; TLC and the staggered scenario kill it.)"""
    machine = type(f"RingMachine_{mutant.__name__}", (RingMachine,), {"backend_cls": mutant})
    # derandomize: the kill is a fixed, reproducible search, not a lucky draw
    with pytest.raises(AssertionError, match=RING_CRASH):
        run_state_machine_as_test(
            machine, settings=settings(SETTINGS, max_examples=300, stateful_step_count=60, derandomize=True)
        )
