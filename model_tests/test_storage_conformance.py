"""The storage tier (``spec/storage/StorageTier.tla``) against the real ``HiCacheFile`` stack.

1. The Python copy of the model (``toolkv.verify.storage.spec``, the fuzz campaign's oracle) is
   TLC's: from every state of two TLC graphs it has exactly TLC's successors, by the action TLC
   names, and its invariants hold there; on each spec mutant's error trace it reports the
   invariant TLC reports.
2. Every edge of TLC's state graph of each ``[[conformance]]`` entry of
   ``spec/storage/configs.toml`` is replayed on ``ToolKVManager`` + ``HiRadixBackend`` over sglang's
   real ``HiCacheFile`` backend and storage threads (CPU); after every step the refinement mapping
   of the real objects must equal the edge's target state, the KV bytes of every copy must be
   right, and between walks everything must be returned. Only edges sglang cannot take may be
   left out, each with its reason; every action must be replayed.
3. The replay can fail: each storage defect of ``toolkv.verify.toolkv.mutants`` diverges from the
   graph at the step that acts on it.
4. The TLC error trace of a spec mutant, replayed on the implementation, reproduces the violation
   with the matching defect switched on, and not on the correct implementation.

``TOOLKV_CONFORMANCE_REPORT=DIR`` writes the replay's summary there as JSON.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from toolkv.verify.storage import spec as storage_spec
from toolkv.verify.storage.conformance import (
    dump_storage_graph,
    replay_storage_graph,
    replay_storage_trace,
    trace_actions,
)
from toolkv.verify.storage.spec import StorageBounds
from toolkv.verify.tla.tlc import StateGraph, Toolchain, cfg_constants, run_tlc, to_plain
from toolkv.verify.toolkv.conformance import GraphConfig, load_conformance

SPEC = Path(__file__).resolve().parents[1] / "spec" / "storage"
pytestmark = [pytest.mark.tlc, pytest.mark.filterwarnings("ignore")]

#: why a spec step cannot happen on sglang (the only reasons a replayed edge may be left out)
#: the actions ReadAtArrival disables (no toolkv read from storage)
ARRIVAL_OFF = {"StoragePrefetch", "ReadPage", "PrefetchAck"}
SGLANG_CANNOT = {"Unrealizable: sglang frees a host copy only once its device copy is gone"}
#: a second graph for the Python copy: two sessions sharing a host of three pages, no refusals
TWO_SESSIONS = GraphConfig(
    "storage_two",
    "MC_dump.cfg",
    (("Sessions", "{s1, s2}"), ("HostSlots", "3"), ("StoreFails", "FALSE")),
    ("hiradix",),
)


@pytest.fixture(scope="module")
def storage_graphs(
    tools: Toolchain, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, tuple[StateGraph, StorageBounds]]:
    """TLC's graph of every storage ``[[conformance]]`` entry, and of :data:`TWO_SESSIONS`."""
    out = {}
    for gc in [*load_conformance(SPEC)[0], TWO_SESSIONS]:
        work = tmp_path_factory.mktemp(gc.name)
        out[gc.name] = dump_storage_graph(tools, SPEC, gc, work)
    return out


def test_the_python_copy_of_the_model_is_tlcs(
    storage_graphs: dict[str, tuple[StateGraph, StorageBounds]],
) -> None:
    for name, (g, b) in storage_graphs.items():
        index = {json.dumps(st, sort_keys=True): sid for sid, st in g.states.items()}
        tlc: dict[int, set[tuple[str, int]]] = {}
        for u, v, label in g.edges:
            tlc.setdefault(u, set()).add((label, v))
        assert [storage_spec.init(b)] == [g.states[s] for s in g.initial], name
        for sid, st in g.states.items():
            mine = {
                (str(a[0]), index.get(json.dumps(n, sort_keys=True), -1))
                for a, n in storage_spec.successors(st, b)
            }
            assert mine == tlc.get(sid, set()), f"{name}: state {st}: {mine ^ tlc.get(sid, set())}"
            assert not storage_spec.violations(st, b), (
                f"{name}: TLC's state {st} violates the Python invariants"
            )
        print(f"{name}: {len(g.states)} states, {len(g.edges)} edges: the Python copy agrees")


@pytest.mark.parametrize(
    ("bug", "invariant"),
    [("RestoreBeforeStoreAck", "RestoreSourceWhole"), ("ReleaseDropsPin", "ReadSourcePresent"),
     ("TrustShortAck", "StoredWhole"), ("LateL3Protect", "StoredWhole"),
     ("ArrivalKeepsPin", "ReleasedHoldsNothing")],
)  # fmt: skip
def test_the_python_invariants_catch_what_tlc_catches(tools: Toolchain, bug: str, invariant: str) -> None:
    """On the spec mutant's TLC error trace the Python copy takes the same steps and its invariants
    fail in the last state only, with the invariant TLC names."""
    cfg = SPEC / f"mut_{bug}.cfg"
    res = run_tlc(tools, SPEC / "StorageTier.tla", cfg)
    assert res.trace is not None and res.violated == invariant, (res.outcome, res.violated)
    b = StorageBounds.from_cfg(cfg_constants(cfg.read_text()))
    states = [to_plain(dict(s.values)) for s in res.trace.states]
    acts = trace_actions(states, [s.action for s in res.trace.states], b)
    assert len(acts) == len(states) - 1
    assert all(not storage_spec.violations(st, b) for st in states[:-1])
    assert invariant in storage_spec.violations(states[-1], b)


def _report(name: str, summary: dict[str, object]) -> None:
    out = os.environ.get("TOOLKV_CONFORMANCE_REPORT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        Path(out, f"{name}-hiradix+file.json").write_text(json.dumps(summary, indent=2, default=str))


@pytest.mark.parametrize("graph", [c.name for c in load_conformance(SPEC)[0]])
def test_every_edge_replays_on_the_real_file_backend(
    storage_graphs: dict[str, tuple[StateGraph, StorageBounds]], graph: str, tmp_path: Path
) -> None:
    g, b = storage_graphs[graph]
    rep = replay_storage_graph(g, b, storage_dir=tmp_path)
    summary = rep.summary()
    print(f"storage conformance {graph}:", json.dumps(summary))
    _report(graph, {**summary, "first_mismatches": rep.mismatches[:3]})
    assert not rep.mismatches, json.dumps(rep.mismatches[:1], indent=1, default=str)
    assert not rep.violations, rep.violations[:3]
    assert set(rep.failed) <= SGLANG_CANNOT, rep.failed
    assert rep.covered + rep.unrealizable == rep.todo and rep.covered > 0
    never = [a for a, (n, covered) in rep.by_action.items() if n and not covered]
    assert not never, f"actions with edges but none replayed: {never}"
    # ReadAtArrival: a Stored session's tool_end is ToolEndAtArrival, and nothing reads storage
    off = ARRIVAL_OFF if b.read_at_arrival else {"ToolEndAtArrival"}
    assert set(rep.by_action) == set(storage_spec.ACTION_NAMES) - off, "every action of Next has edges"


@pytest.mark.parametrize(
    ("mutant", "diverges", "graph"),
    [("RestoreBeforeStoreAck", "RestoreSourceWhole", "storage"), ("TrustShortAck", "StoredWhole", "storage"),
     ("ReleaseDropsPin", "pin", "storage"), ("ArrivalKeepsPin", "ReleasedHoldsNothing", "storage_arrival")],
)  # fmt: skip
def test_storage_defects_fail_the_replay(
    storage_graphs: dict[str, tuple[StateGraph, StorageBounds]],
    mutant: str,
    diverges: str,
    graph: str,
    tmp_path: Path,
) -> None:
    """The replay is not vacuous: each defect is a mismatch (the replay stops at the first), where
    the implementation's state breaks the spec invariant the defect is about — or, for
    ``ReleaseDropsPin``, where it has let go of the prefetch's pin (the invariant breaks only
    once the backend deletes a page the prefetch has still to read, which the fuzz campaign does).
    ``ArrivalKeepsPin`` acts only on the tool_end at arrival: it is replayed on the
    ``ReadAtArrival`` graph."""
    g, b = storage_graphs[graph]
    rep = replay_storage_graph(g, b, mutant=mutant, storage_dir=tmp_path)
    assert rep.mismatches, f"{mutant} replayed {rep.steps} steps without a mismatch"
    first = rep.mismatches[0]
    assert diverges in first["violations"] or diverges in first["diff"], first
    print(
        f"{mutant}: mismatch after {rep.steps} steps at {first['action']}: {first['diff']} {first['violations']}"
    )


@pytest.mark.parametrize(
    ("bug", "mutant", "invariant"),
    [("TrustShortAck", "TrustShortAck", "StoredWhole"), ("ReleaseDropsPin", "ReleaseDropsPin", "ReadSourcePresent"),
     ("LateL3Protect", None, "StoredWhole"), ("ArrivalKeepsPin", "ArrivalKeepsPin", "ReleasedHoldsNothing")],
)  # fmt: skip
def test_mutant_trace_reproduces_on_the_broken_implementation_only(
    tools: Toolchain, bug: str, mutant: str | None, invariant: str, tmp_path: Path
) -> None:
    """TLC's error trace of spec mutant ``bug`` (two sessions) on the implementation: with the
    matching defect on, the implementation's state breaks ``invariant``; the correct
    implementation never does (it leaves the trace where it refuses the defect's step).
    ``LateL3Protect`` has no implementation defect: the correct implementation protects the copy
    from ``Store`` on, so the backend may not delete the page the trace deletes. (The
    ``RestoreBeforeStoreAck`` trace reads the copy before a page is written: sglang's hit query
    then finds nothing and the broken implementation falls back to the host copy; the graph
    replay above and the fuzz campaign catch it where a page was written first.)"""
    cfg = SPEC / f"mut_{bug}.cfg"
    res = run_tlc(tools, SPEC / "StorageTier.tla", cfg)
    assert res.trace is not None
    b = StorageBounds.from_cfg(cfg_constants(cfg.read_text()))
    states = [to_plain(dict(s.values)) for s in res.trace.states]
    acts = trace_actions(states, [s.action for s in res.trace.states], b)
    if mutant is not None:
        seen, _ = replay_storage_trace(acts, b, mutant=mutant, storage_dir=tmp_path / "broken")
        assert invariant in seen, f"{mutant} did not reproduce {invariant}: {seen}"
    seen, left = replay_storage_trace(acts, b, storage_dir=tmp_path / "fixed")
    assert not seen, f"the correct implementation broke {seen} on {bug}'s trace"
    print(f"{bug}: the correct implementation {'left the trace at ' + left if left else 'took every step'}")
