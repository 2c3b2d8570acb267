"""Spec ↔ code conformance on the real caches.

1. Every edge of TLC's state graph of each ``[[conformance]]`` model in ``spec/configs.toml`` is
   replayed on ``ToolKVManager`` over the real sglang cache (CPU harness, controllable copy
   engine), once per listed backend and policy; after every step the implementation's state must
   equal the spec state (HiRadixCache: every spec variable; pin/shadow: the sessions' view). With
   ``policy="auto"`` the spec's ToolStart, Keep and LetGo are the production ``tool_start``: where
   the policy takes other spec steps than the edge's, those steps are checked and the edge is
   left to another walk (``PolicyChose``); the two-session graph must see it demote another
   session for room.
2. Every action of the spec (as TLC lists it) is replayed on some graph, or is listed as pending
   with its reason.
3. The error trace of each spec mutant, replayed on the correspondingly broken implementation
   (a test-only caveat switch), reproduces the violation; replayed on the correct implementation
   it does not.
4. The load-ring defects (backend subclasses in ``toolkv.verify.toolkv.mutants``) fail the replay
   of the ring graph: the one that starts its load in ``tool_end`` at that step, the one that starts
   when two slots are free at the tick probe (``start_loads`` where ``StartLoads`` is not enabled).

``TOOLKV_CONFORMANCE_REPORT=DIR`` writes each replay's summary there as JSON.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from toolkv.verify.tla.tlc import Toolchain, cfg_constants, run_tlc
from toolkv.verify.toolkv.conformance import (
    CoverReport,
    Replayer,
    load_conformance,
    replay_graph,
    replay_trace,
    spec_actions,
)
from toolkv.verify.toolkv.refinement import Bounds

SPEC = Path(__file__).resolve().parents[1] / "spec"
pytestmark = pytest.mark.tlc

ORDER = "Unrealizable: ack out of issue order (sglang retires acks oldest first)"
CHOSE = "PolicyChose: "  # policy auto: tool_start took other spec steps than the edge's (checked)
RING_GRAPH = "loadring"  # the [[conformance]] graph with sglang's load-slot ring (Ring = 3)
CASES = [(c.name, b, p) for c in load_conformance(SPEC)[0] for b, p in c.cases()]
REPLAYED: dict[tuple[str, str, str], CoverReport] = {}

#: Replays ``make test`` leaves to ``make test-long`` (marked ``slow``), each with what covers it in
#: ``make test``. ``make test`` keeps at least one replay of every graph, and every backend and every
#: policy in at least one replay (``model_tests/test_make_test_cover.py``); on the replays it keeps,
#: ``test_every_spec_action_is_replayed`` still finds every spec action replayed (docs/testing.md).
LONG_CASES: dict[tuple[str, str, str], str] = {
    ("split", "pin", "offload"): "Split on the pin backend: tests/test_backends_split.py, each step "
    "checked against the spec's successor; the split graph's every edge on the HiRadixCache",
    ("split", "shadow", "offload"): "Split on the shadow backend: tests/test_backends_split.py, each "
    "step checked against the spec's successor; the split graph's every edge on the HiRadixCache",
    ("policy", "pin", "offload"): "the policy graph's every edge on the HiRadixCache; the pin backend's "
    "every edge of the locks graph",
    ("policy", "shadow", "offload"): "the policy graph's every edge on the HiRadixCache; the shadow "
    "backend's every edge of the locks graph",
    ("policy", "hiradix", "auto"): "the policy graph's every edge on the HiRadixCache (offload); the "
    "production tool_start's choice as spec steps on the two-session graph policy_auto, and at every "
    "step of the fuzz campaign TestToolKVMachineAuto",
}


def _case_param(g: str, b: str, p: str) -> Any:
    marks = [pytest.mark.slow] if (g, b, p) in LONG_CASES else []
    return pytest.param(g, b, p, id=f"{g}-{b}" + ("-auto" if p == "auto" else ""), marks=marks)


def _progress(rep: CoverReport) -> None:
    if rep.walks % 5000 == 0:
        print(f"  conformance {rep.backend}: {rep.walks} walks, {rep.steps} steps", file=sys.stderr)


@pytest.mark.parametrize(("graph", "backend", "policy"), [_case_param(*c) for c in CASES])
def test_every_edge_replays_on_the_real_cache(graphs: Any, graph: str, backend: str, policy: str) -> None:
    g, bounds = graphs.get(graph)
    rep = replay_graph(g, bounds, backend=backend, policy=policy, progress=_progress)
    REPLAYED[(graph, backend, policy)] = rep
    summary = rep.summary()
    tag = f"{graph}/{backend}" + ("/auto" if policy == "auto" else "")
    print(f"conformance {tag}:", json.dumps(summary))
    out = os.environ.get("TOOLKV_CONFORMANCE_REPORT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        Path(out, f"{tag.replace('/', '-')}.json").write_text(
            json.dumps({**summary, "first_mismatches": rep.mismatches[:3]}, indent=2, default=str)
        )
    assert not rep.mismatches, json.dumps(rep.mismatches[:1], indent=1, default=str)
    assert not rep.violations, rep.violations[:3]
    # The spec lets acks arrive in any order; sglang retires them oldest first. An edge that acks a
    # younger transfer first (and whatever lies only behind such edges) cannot happen: nothing else
    # may keep an edge from being replayed.
    if backend == "hiradix":
        assert {why for why in rep.failed if not why.startswith(CHOSE)} <= {ORDER}, rep.failed
        if policy == "offload":
            assert not any(why.startswith(CHOSE) for why in rep.failed), rep.failed
    else:  # a plain RadixCache backend shares part of the spec's world; never an ack-order failure
        assert all(why.startswith("NotApplicable") for why in rep.failed), rep.failed
    assert rep.covered + rep.unrealizable == rep.todo
    assert rep.unrealizable == 0 or rep.failed, "edges left unreplayed without a failed step"
    never = [a for a, (n, covered) in rep.by_action.items() if n and not covered]
    assert not never, f"actions with edges but none replayed: {never}"
    if bounds.ring > 0 and backend == "hiradix":  # the tick was probed where StartLoads is disabled
        assert rep.idle_ticks > 0, "no state with a queued load behind a load in flight"
    if policy == "auto" and len(bounds.sessions) > 1:  # the demotion candidates met another session
        # the policy met a full host with another session offloaded: it demotes when the device
        # needs the newcomer's room, else lets the call go as host-full (calls.demote_for_room)
        assert any(
            why.startswith(CHOSE) and ("Demote" in why or "LetGo (host_full)" in why) for why in rep.failed
        ), rep.failed


def test_every_spec_action_is_replayed(graphs: Any, tools: Toolchain, tmp_path: Path) -> None:
    """The action list comes from TLC (every disjunct of Next); each must have replayed edges on
    the HiRadixCache, unless it is listed as pending in spec/configs.toml (and then it must not).
    Under ``make test`` the replays are those it keeps (not ``LONG_CASES``): every action must be
    replayed on them alone."""
    missing = [c for c in CASES if c not in REPLAYED and c not in LONG_CASES]
    if missing:
        pytest.skip(f"run with the replays: {missing} did not run in this session")
    actions = spec_actions(tools, SPEC, tmp_path)
    replayed = {
        a
        for (_, backend, _), rep in REPLAYED.items()
        if backend == "hiradix"
        for a, (_, covered) in rep.by_action.items()
        if covered > 0
    }
    print(
        "replayed edges per action:",
        {a: sum(r.by_action.get(a, [0, 0])[1] for r in REPLAYED.values()) for a in actions},
    )
    pending = graphs.pending
    assert not (set(pending) - set(actions)), (
        f"pending actions the spec does not have: {set(pending) - set(actions)}"
    )
    never = [a for a in actions if a not in replayed and a not in pending]
    assert not never, f"spec actions with no replayed edge on any graph: {never}"
    stale = [a for a in pending if a in replayed]
    assert not stale, f"replayed, so no longer pending in spec/configs.toml: {stale}"


@pytest.mark.parametrize("mutant", ["RingOverrunBackend", "RingTwoFreeBackend"])
def test_ring_defects_fail_the_replay(graphs: Any, mutant: str) -> None:
    """The replay of the ring graph is not vacuous: each seeded load-ring defect diverges from the
    spec (the replay stops at the first mismatch, so this is quick)."""
    from toolkv.verify.toolkv import mutants as backend_mutants

    g, bounds = graphs.get(RING_GRAPH)
    rep = replay_graph(g, bounds, hi_backend=getattr(backend_mutants, mutant))
    assert rep.mismatches, f"{mutant} replayed {rep.steps} steps without a mismatch"
    diff = rep.mismatches[0]["diff"]
    assert "ring" in diff and "queued" in diff, diff
    print(f"{mutant}: mismatch after {rep.steps} steps at {rep.mismatches[0]['action']}")


def _no_ttl_check(r: Replayer) -> list[str]:
    """Liveness, made finite: let time run past every deadline and sweep. A protection that is
    still held has not been (and never will be) released."""
    mgr = r.mgr
    mgr.set_clock(mgr.now + 10 * r.b.ttl + 10)
    mgr.ttl_sweep()
    return ["ProtectionReleased"] if any(x.protected is not None for x in mgr.sessions.values()) else []


# spec mutant -> (implementation caveats, environment defects, violations that count as reproduced)
MUTANTS: dict[str, tuple[frozenset[str], frozenset[str], set[str]]] = {
    "HostLockLeak": (frozenset({"HostLockLeak"}), frozenset(), {"ProtectionOwned"}),
    "DoubleLoad": (frozenset({"DoubleLoad"}), frozenset(), {"LoadAckSane", "LockAccounting", "Crash"}),
    "OrphanHost": (frozenset(), frozenset({"OrphanHost"}), {"NoOrphanHost"}),
    "EvictProtected": (frozenset({"EvictProtected"}), frozenset(), {"ProtectedHasHost"}),
    "StaleNode": (frozenset({"StaleNode"}), frozenset(), {"ProtectedHasHost", "NoOrphanHost", "TreeShape"}),
    "NoTtl": (frozenset({"NoTtl"}), frozenset(), {"ProtectionReleased"}),
    "FreeBeforeAck": (frozenset({"FreeBeforeAck"}), frozenset(), {"NoFreeWhilePending"}),
    "EarlyRunnable": (
        frozenset({"EarlyRunnable"}),
        frozenset(),
        {"RunnableOnlyWhenLoaded", "HandoverResident"},
    ),
    "NoEpochCheck": (frozenset({"NoEpochCheck"}), frozenset(), {"StaleEpochNoop"}),
    "EpochReuse": (frozenset({"EpochReuse"}), frozenset(), {"EpochMonotone"}),
    "KeepNoPin": (frozenset({"KeepNoPin"}), frozenset(), {"LockAccounting", "KeptIsResident"}),
    "DemoteKeepsRef": (
        frozenset({"DemoteKeepsRef"}),
        frozenset(),
        {"ProtectionOwned", "ReleasedHoldsNothing"},
    ),
    "EarlyKept": (frozenset({"EarlyKept"}), frozenset(), {"KeptIsResident"}),
    "KeepFullTtl": (frozenset({"KeepFullTtl"}), frozenset(), {"KeptWithinKeepTTL"}),
    "WarmFullTtl": (frozenset({"WarmFullTtl"}), frozenset(), {"KeptWithinKeepTTL"}),
}


@pytest.mark.parametrize("mutant", sorted(MUTANTS))
def test_mutant_trace_reproduces_on_the_broken_implementation_only(tools: Toolchain, mutant: str) -> None:
    cfg = SPEC / "mutants" / f"{mutant}.cfg"
    res = run_tlc(tools, SPEC / "ToolKV.tla", cfg)
    assert res.trace is not None, f"TLC gave no trace for {mutant}: {res.output[-1500:]}"
    states = [s.values for s in res.trace.states]
    bounds = Bounds.from_cfg(cfg_constants(cfg.read_text()))
    caveats, env_bugs, expected = MUTANTS[mutant]
    then = _no_ttl_check if mutant == "NoTtl" else None

    broken, _ = replay_trace(states, bounds, caveats=caveats, env_bugs=env_bugs, then=then)
    seen = {v for step in broken for v in step.violations}
    assert seen & expected, f"{mutant}: broken implementation did not reproduce {expected}; saw {seen}"

    fixed, _ = replay_trace(states, bounds, then=then)
    seen_fixed = {v for step in fixed for v in step.violations}
    assert not seen_fixed, f"{mutant}: the correct implementation violated {seen_fixed} on the same trace"
