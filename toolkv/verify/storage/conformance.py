"""Spec ↔ code conformance for the storage tier: TLC's state graph of
``spec/storage/StorageTier.tla`` replayed on the real ``HiCacheFile`` stack.

The same machinery as the main model's replay (:mod:`toolkv.verify.toolkv.conformance`): TLC dumps the
full state graph of a ``[[conformance]]`` entry of ``spec/storage/configs.toml``, the walks of a
path cover are planned once (:class:`~toolkv.verify.tla.pathcover.Cover`) and run round by round
(:func:`~toolkv.verify.toolkv.conformance.run_cover`), and after every step the refinement mapping of
the real objects (:meth:`StorageWorld.abstract`) must equal the spec state the edge leads to
(:func:`~toolkv.verify.toolkv.conformance.diff_states`; the history variable ``viaL3`` aside), and the
checks on the real objects must pass (KV bytes of every copy, sglang's host references). Between
two walks the world settles: every lock, host reference, slot and storage record must be back.

What differs from the main model: StorageTier has no ``act`` history variable, so an edge carries
only the action's name (TLC's ``actionlabels``); its parameters (the session, the page) are found
with the Python copy of the actions (:mod:`toolkv.verify.storage.spec`), which must explain every
edge. An edge sglang cannot take (a host copy freed while its device copy is there; the one
backup or I/O thread serving another session first) is tried along other walks, then counted as
unrealizable with its reason.
"""

from __future__ import annotations

import itertools
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from toolkv.verify.storage import spec as storage_spec
from toolkv.verify.storage.spec import HISTORY, Act, StorageBounds
from toolkv.verify.storage.world import StorageWorld, Unrealizable, WorldFailure
from toolkv.verify.tla.pathcover import Cover, Edge
from toolkv.verify.tla.tlc import StateGraph, Toolchain, cfg_constants, to_plain
from toolkv.verify.toolkv.conformance import (
    CoverReport,
    GraphConfig,
    diff_states,
    dump_module_graph,
    run_cover,
)

MODULE = "StorageTier.tla"


def dump_storage_graph(
    tools: Toolchain, spec_dir: Path, gc: GraphConfig, work: Path
) -> tuple[StateGraph, StorageBounds]:
    """TLC's full state graph of a storage ``[[conformance]]`` entry, and its bounds."""
    text = gc.cfg_text(spec_dir)
    return dump_module_graph(tools, spec_dir, MODULE, gc.name, text, work), StorageBounds.from_cfg(
        cfg_constants(text)
    )


def edge_actions(graph: StateGraph, b: StorageBounds) -> dict[Edge, Act]:
    """Each edge's action with its parameters: the one instance of the edge's action (TLC's label)
    whose successor in :mod:`storage_spec` is the edge's target. Raises if the Python copy explains
    an edge by no instance of its action, or by two that differ (the replay would not know which
    to run)."""
    out: dict[Edge, Act] = {}
    for u, v, label in graph.edges:
        src, dst = graph.states[u], graph.states[v]
        cands: list[Act] = []
        for s in b.sessions:
            if label == "L3Evict":
                cands += [("L3Evict", s, p) for p in range(1, b.pages + 1)]
            else:
                cands.append((label, s))
        hits = [a for a in cands if storage_spec.step(src, a, b) == dst]
        if not hits:
            raise ValueError(f"the Python copy of StorageTier does not explain the {label} edge {u} -> {v}")
        if len(hits) > 1 and (u, v) not in out:
            raise ValueError(f"the {label} edge {u} -> {v} is ambiguous: {hits}")
        out[(u, v)] = hits[0]
    return out


def replay_storage_graph(
    graph: StateGraph,
    b: StorageBounds,
    *,
    mutant: str | None = None,
    storage_dir: Path | None = None,
    rounds: int = 4,
    seed: int = 0,
    budget_s: float | None = None,
    progress: Callable[[CoverReport], None] | None = None,
) -> CoverReport:
    """Replay every edge of ``graph`` on a :class:`StorageWorld` (``mutant``: a storage defect of
    ``toolkv.verify.toolkv.mutants.STORAGE_MUTANTS``). Stops at the first mismatch, with the spec's invariants
    that the implementation's state violates (``violations`` of the mismatch)."""
    work = Path(storage_dir or tempfile.mkdtemp(prefix="toolkv-l3-conformance-"))
    acts = edge_actions(graph, b)
    states = graph.states
    world = StorageWorld(b, work / "l3", mutant=mutant, seed=seed)
    t0 = time.monotonic()  # after the first stack: importing sglang is not the replay's cost
    edges = set(acts)
    rep = CoverReport(backend="hiradix+file", states=len(states), edges=len(edges))
    cover = Cover(edges, graph.initial, seed=seed)
    todo = {e for e in edges if e[0] in cover.dist}
    rep.todo = len(todo)
    for e in todo:
        rep.by_action.setdefault(str(acts[e][0]), [0, 0])[0] += 1
    keys = [k for k in states[next(iter(graph.initial))] if k not in HISTORY]
    failures: Counter[Edge] = Counter()
    reasons: dict[Edge, str] = {}
    done: set[Edge] = set()
    last: list[list[int]] = []  # the walk before this one (its end is what a settle checks)

    def mismatch(act: Any, spec: dict[str, Any] | None, walk_states: list[int], **extra: Any) -> bool:
        post = world.abstract()
        d = diff_states(spec, post, keys) if spec is not None else {}
        rep.mismatches.append(
            {"action": act, "diff": to_plain(d), "violations": storage_spec.violations(post, b),
             "steps": [list(acts[e]) for e in itertools.pairwise(walk_states)], **extra}
        )  # fmt: skip
        return False

    def walk(walk_states: list[int]) -> bool:
        if last:
            try:
                world.restart()
            except WorldFailure as exc:  # something was not returned at the end of the last walk
                return mismatch("settle", None, last[-1], real=[str(exc)])
        last[:] = [walk_states]
        if diff_states(states[walk_states[0]], world.abstract(), keys):
            return mismatch("Init", states[walk_states[0]], walk_states[:1])
        for i, (u, v) in enumerate(itertools.pairwise(walk_states)):
            act = acts[(u, v)]
            try:
                res = world.apply(act)
            except Unrealizable as exc:
                failures[(u, v)] += 1
                reasons[(u, v)] = f"Unrealizable: {exc}"
                return True
            except WorldFailure as exc:  # the implementation could not take a step the spec enables
                return mismatch(list(act), states[v], walk_states[: i + 2], real=[str(exc)])
            rep.steps += 1
            bad = world.check_real()
            if bad or diff_states(states[v], world.abstract(), keys):
                return mismatch(list(act), states[v], walk_states[: i + 2], real=bad, error=res.error)
            if res.error is not None:  # refused, yet the state is the spec's: never for an enabled step
                rep.violations.append({"edge": [u, v], "action": list(act), "error": res.error})
            done.add((u, v))
        return True

    try:
        finished = run_cover(
            cover, todo, rep, lambda: None, walk, done, failures, reasons, lambda e: str(acts[e][0]),
            rounds=rounds, budget_s=budget_s, t0=t0, progress=progress,
        )  # fmt: skip
        if finished:
            try:
                world.settle()
            except WorldFailure as exc:
                mismatch("settle", None, last[-1] if last else [], real=[str(exc)])
    finally:
        world.close()
    rep.seconds = time.monotonic() - t0
    return rep


# ---- one TLC error trace of a spec mutant ------------------------------------------------------------
def trace_actions(states: list[Mapping[str, Any]], names: list[str | None], b: StorageBounds) -> list[Act]:
    """The actions (with parameters) of a TLC trace whose steps TLC names ``names`` (``names[i]``
    led to ``states[i]``), under the trace's own bounds (its ``BUG`` included)."""
    out: list[Act] = []
    for pre, post, name in zip(states, states[1:], names[1:], strict=False):
        cands: list[Act] = [
            a
            for s in b.sessions
            for a in (
                [("L3Evict", s, p) for p in range(1, b.pages + 1)] if name == "L3Evict" else [(name, s)]
            )
        ]
        hits = [a for a in cands if storage_spec.step(dict(pre), a, b) == post]
        if not hits:
            raise ValueError(f"the Python copy of StorageTier does not explain the trace's {name} step")
        out.append(hits[0])
    return out


def replay_storage_trace(
    acts: list[Act], b: StorageBounds, *, mutant: str | None = None, storage_dir: Path | None = None
) -> tuple[list[str], str | None]:
    """Replay the actions of a TLC error trace on a :class:`StorageWorld` (``b``'s ``BUG`` is not
    the world's: ``mutant`` says which implementation runs). Returns the spec invariants and real
    checks that failed on the implementation's state after any step, and where the
    implementation left the trace (None: it took every step)."""
    work = Path(storage_dir or tempfile.mkdtemp(prefix="toolkv-l3-trace-"))
    world = StorageWorld(
        StorageBounds(b.sessions, b.pages, b.host_slots, b.store_fails, read_at_arrival=b.read_at_arrival),
        work / "l3",
        mutant=mutant,
    )
    seen: list[str] = []
    diverged: str | None = None
    try:
        for act in acts:
            try:
                world.apply(act)
            except (Unrealizable, WorldFailure) as exc:
                diverged = f"{list(act)}: {type(exc).__name__}: {exc}"
                break
            post = world.abstract()
            seen += [v for v in storage_spec.violations(post, world.b) + world.check_real() if v not in seen]
    finally:
        world.close()
    return seen, diverged


__all__ = [
    "MODULE",
    "dump_storage_graph",
    "edge_actions",
    "replay_storage_graph",
    "replay_storage_trace",
    "trace_actions",
]
