"""Spec ↔ code conformance on the real HiRadixCache.

1. Every edge of TLC's state graph of ``spec/MC_dump.cfg`` is replayed on ``ToolKVManager`` over
   the real sglang cache (CPU harness, controllable copy engine); after every step the
   implementation's abstract state (``toolkv/refinement.py``) must equal the spec state.
2. The error trace of each spec mutant, replayed on the correspondingly broken implementation
   (a test-only caveat switch), reproduces the violation; replayed on the correct implementation
   it does not.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from toolkv.verify.conformance import Replayer, cfg_constants, cover, replay_trace
from toolkv.verify.refinement import Bounds
from toolkv.verify.tla import Toolchain, read_dot, run_tlc

SPEC = Path(__file__).resolve().parents[1] / "spec"
pytestmark = pytest.mark.tlc


def _tools() -> Toolchain:
    try:
        return Toolchain.locate()
    except Exception as exc:  # pragma: no cover - environment dependent
        pytest.skip(f"TLC toolchain unavailable: {exc}")


def test_every_edge_of_the_state_graph_replays_on_the_real_cache(tmp_path: Path) -> None:
    tools = _tools()
    dot = tmp_path / "graph.dot"
    res = run_tlc(tools, SPEC / "ToolKV.tla", SPEC / "MC_dump.cfg", dump_dot=dot)
    assert res.outcome == "pass", res.output[-2000:]
    graph = read_dot(dot)
    bounds = Bounds.from_cfg(cfg_constants((SPEC / "MC_dump.cfg").read_text()))
    budget = float(os.environ.get("TOOLKV_CONFORMANCE_BUDGET_S", "0")) or None

    def progress(r: Any) -> None:
        if r.paths % 2000 == 0:
            print(
                f"  conformance: {r.covered}/{r.edges} edges, {r.steps} steps, {r.paths} paths",
                file=sys.stderr,
            )

    rep = cover(graph, bounds, budget_s=budget, progress=progress)
    summary = {
        "states": rep.states,
        "edges": rep.edges,
        "covered": rep.covered,
        "unrealizable": rep.unrealizable,
        "coverage": rep.coverage,
        "mismatches": len(rep.mismatches),
        "violations": len(rep.violations),
        "steps": rep.steps,
        "paths": rep.paths,
        "seconds": round(rep.seconds, 1),
        "by_action": rep.by_action,
    }
    print("conformance:", json.dumps(summary))
    out = os.environ.get("TOOLKV_CONFORMANCE_REPORT")
    if out:
        Path(out).write_text(json.dumps({**summary, "first_mismatches": rep.mismatches[:5]}, indent=2))
    assert not rep.mismatches, json.dumps(rep.mismatches[:3], indent=1, default=str)
    assert not rep.violations, rep.violations[:3]
    if budget is None:
        assert rep.coverage == 1.0, f"{rep.edges - rep.covered - rep.unrealizable} edges not replayed"


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
    "EarlyRunnable": (frozenset({"EarlyRunnable"}), frozenset(), {"RunnableOnlyWhenLoaded"}),
    "NoEpochCheck": (frozenset({"NoEpochCheck"}), frozenset(), {"StaleEpochNoop"}),
    "EpochReuse": (frozenset({"EpochReuse"}), frozenset(), {"EpochMonotone"}),
}


@pytest.mark.parametrize("mutant", sorted(MUTANTS))
def test_mutant_trace_reproduces_on_the_broken_implementation_only(mutant: str) -> None:
    tools = _tools()
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
