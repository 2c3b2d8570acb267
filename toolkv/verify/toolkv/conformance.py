"""Spec ↔ code conformance: replay TLC's state graph on the real caches.

TLC dumps the full state graph of a small model (``-dump dot,actionlabels``; every state carries
the history variable ``act`` with the action's parameters). The walks of a path cover planned once
(:mod:`toolkv.verify.tla.pathcover`) are executed on a real cache stack by a
:class:`~toolkv.verify.toolkv.world.Replayer`, and after every step the implementation's state is
compared with the spec state the edge leads to:

* on a HiRadixCache (``backend="hiradix"``) every spec variable, through the refinement mapping
  (``refinement.abstract_state``): a missing mapping for a spec variable is an error;
* on a plain RadixCache (``pin``, ``shadow``) the sessions' view — phase, epoch, deadline, whether
  a runnable session's KV is readable, whether an offloaded session holds its protection — because
  those backends have no host tier: the spec's in-flight phases collapse onto the settled ones
  (``Offloading`` → ``Offloaded``, ``Restoring`` → ``Handover``), and the steps they cannot share
  (:func:`radix_shares`) are left out before planning, with the reason counted.

An edge that cannot happen in sglang (an ack out of issue order) or that a backend cannot share at
run time is retried along another walk before it is reported. Per-action edge counts are reported
so that an action the graph never enables, or the replay never reached, shows.
"""

from __future__ import annotations

import contextlib
import itertools
import shutil
import time
import tomllib
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from toolkv.core.settings import POLICY_NAMES
from toolkv.core.treeops import attached, walk
from toolkv.errors import ToolKVError
from toolkv.verify.tla.pathcover import Cover, Edge
from toolkv.verify.tla.tlc import (
    StateGraph,
    Toolchain,
    cfg_constants,
    read_dot,
    run_tlc,
    to_plain,
    with_constants,
)
from toolkv.verify.toolkv import spec as specstep
from toolkv.verify.toolkv.refinement import HISTORY, NO_NODE, Bounds, check_invariants, check_step
from toolkv.verify.toolkv.world import BACKENDS, NotApplicable, Replayer, StepResult, Unrealizable

__all__ = [
    "NO_NODE",
    "Bounds",
    "CoverReport",
    "GraphConfig",
    "Replayer",
    "StepResult",
    "Unrealizable",
    "cfg_constants",
    "diff_states",
    "dump_graph",
    "dump_module_graph",
    "load_conformance",
    "load_graph",
    "radix_shares",
    "replay_graph",
    "replay_trace",
    "run_cover",
    "spec_actions",
]


class Mismatch(AssertionError):
    """The implementation's state differs from the spec state after a step."""


def load_graph(dot: Path) -> StateGraph:
    """A dumped graph with plain (JSON-like) state values, as the replay compares them."""
    return read_dot(dot, plain=True)


# ---- what is compared --------------------------------------------------------------------------------
def diff_states(spec: Mapping[str, Any], impl: Mapping[str, Any], keys: Iterable[str]) -> dict[str, Any]:
    """Where ``impl`` differs from ``spec`` on ``keys``: per key (spec value, implementation value),
    narrowed to the differing entries of a function (dict) value."""
    return _diff(spec, impl, keys)


def _diff(spec: Mapping[str, Any], impl: Mapping[str, Any], keys: Iterable[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k in keys:
        want, have = spec[k], impl[k]
        if want != have:
            if isinstance(want, dict) and isinstance(have, dict):
                out[k] = (
                    {x: v for x, v in want.items() if have.get(x) != v},
                    {x: v for x, v in have.items() if want.get(x) != v},
                )
            else:
                out[k] = (want, have)
    return out


MERGED = {"Offloading": "Offloaded", "Restoring": "Handover", "Prefetching": "Kept"}


def radix_view_spec(st: Mapping[str, Any], b: Bounds) -> dict[str, Any]:
    """The sessions' view of a spec state, as a synchronous backend (no transfers) must show it."""
    view: dict[str, Any] = {"now": st["now"], "resets": st["resets"]}
    for s in b.sessions:
        ph = MERGED.get(st["phase"][s], st["phase"][s])
        row: dict[str, Any] = {"phase": ph, "epoch": st["epoch"][s]}
        if ph == "Offloaded":
            row["deadline"] = st["deadline"][s]
        if st["phase"][s] in ("Running", "Runnable", "Handover"):  # not Restoring: its loads are in flight
            row["kv"] = st["ref"][s] != NO_NODE and specstep.path_valid(st, st["ref"][s], len(b.nodes))
        view[s] = row
    return view


def radix_view_impl(r: Replayer) -> dict[str, Any]:
    """The same view read off the manager and the real tree."""
    mgr, tree, b = r.mgr, r.h.tree, r.b
    view: dict[str, Any] = {"now": int(min(mgr.now, b.max_time)), "resets": r.resets}
    known = {**mgr._closed, **mgr.sessions}
    for s in b.sessions:
        rec = known.get(s)
        if rec is None:
            view[s] = {"phase": "New", "epoch": 0}
            continue
        row: dict[str, Any] = {"phase": rec.state, "epoch": rec.epoch}
        if rec.state == "Offloaded":
            row["deadline"] = int(min(rec.deadline, b.max_time))
        if rec.state in ("Running", "Runnable", "Handover"):
            node, matched = walk(tree, rec.tokens, rec.extra_key) if rec.tokens else (None, 0)
            row["kv"] = bool(rec.tokens) and matched == len(rec.tokens) and attached(tree, node)
        view[s] = row
    return view


def radix_invariants(r: Replayer) -> list[str]:
    """Backend accounting a view cannot show: every offloaded session holds exactly its own
    protection (pin: one path lock on its leaf; shadow: one snapshot), nothing else does, and every
    lock on the tree is one the environment or a pin took."""
    bad: list[str] = []
    holding = {
        s: (rec.protected is not None if r.backend_name == "pin" else rec.backend_state is not None)
        for s, rec in r.mgr.sessions.items()
    }
    for s, rec in r.mgr.sessions.items():
        if holding[s] != (rec.state == "Offloaded"):
            bad.append(f"ProtectionOwned({s})")
    locks: Counter[int] = Counter()
    for name in r.ext:
        o = r.resolve(name)
        if o is not None:
            for m in _up(r, o):
                locks[id(m)] += 1
    for rec in r.mgr.sessions.values():
        held = [rec.pinned] if rec.pinned is not None else []  # a kept session's pin (any backend)
        if r.backend_name == "pin" and rec.protected is not None:
            held.append(rec.protected)
        for o in held:
            for m in _up(r, o):
                locks[id(m)] += 1
    for node in r.h.iter_nodes():
        if node is not r.h.tree.root_node and node.lock_ref != locks[id(node)]:
            bad.append("LockAccounting")
            break
    return bad


def _up(r: Replayer, node: Any) -> Iterable[Any]:
    root = r.h.tree.root_node
    while node is not None and node is not root:
        yield node
        node = node.parent


def radix_shares(u: Mapping[str, Any], v: Mapping[str, Any], b: Bounds) -> str | None:
    """Why a plain RadixCache backend cannot share spec step ``u -> v`` (None: it can).

    These are the places where a synchronous backend without a host tier differs by design: a
    backed-up node that the spec keeps host-only is deleted; a session the spec still has
    ``Restoring`` is already runnable, so a sweep or a reset that the spec applies to it does not;
    a session the policy released (let go, demoted) keeps its KV on the device, where the spec
    may have moved it to the host or lost it; and load-adaptive protection (Park, Unpin) leaves a
    session's KV to sglang's own load-back from the host tier, which a plain RadixCache lacks (its
    tool_end restores or answers 503, as without ``adaptive``)."""
    act = v["act"]
    name = act[0]
    restoring = [s for s in b.sessions if u["phase"][s] == "Restoring"]
    if name == "GpuEvict" and u["host"][act[1]]:
        return "eviction keeps a host copy"
    if name == "TtlSweep" and any(u["deadline"][s] <= u["now"] for s in restoring):
        return "sweep expires a restoring session"
    if name == "TreeReset" and restoring:
        return "reset loses a restoring session"
    if name in ("Park", "Unpin"):
        return "load-adaptive protection needs HiCache's host tier and load-back"
    if name == "ToolEnd" and u["phase"][act[1]] == "Released":
        n = v["ref"][act[1]]
        if n == NO_NODE or not specstep.path_valid(v, n, len(b.nodes)):
            return "a released session's KV stays on the device"
    return None


# ---- the report --------------------------------------------------------------------------------------
@dataclass
class CoverReport:
    backend: str = "hiradix"
    policy: str = "offload"
    states: int = 0
    edges: int = 0  # distinct edges of the graph
    todo: int = 0  # edges this replay had to take (all, or the focus)
    covered: int = 0
    unrealizable: int = 0  # edges no walk could take on the real stack (failed, or behind one)
    failed: dict[str, int] = field(default_factory=dict)  # why a step could not run -> edges
    not_shared: dict[str, int] = field(default_factory=dict)  # reason -> edges left out
    mismatches: list[dict[str, Any]] = field(default_factory=list)
    violations: list[dict[str, Any]] = field(default_factory=list)
    walks: int = 0
    steps: int = 0
    idle_ticks: int = 0  # start_loads probed where the spec's StartLoads is not enabled (Ring > 0)
    refusals: int = 0  # policy auto: calls probed where the spec does not enable them (must stutter)
    rounds: int = 0
    seconds: float = 0.0
    by_action: dict[str, list[int]] = field(default_factory=dict)  # action -> [edges in todo, covered]

    @property
    def coverage(self) -> float:
        realizable = self.todo - self.unrealizable
        return self.covered / realizable if realizable else 1.0

    @property
    def edges_per_s(self) -> float:
        return self.steps / self.seconds if self.seconds else 0.0

    def summary(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "policy": self.policy,
            "states": self.states,
            "edges": self.edges,
            "todo": self.todo,
            "covered": self.covered,
            "unrealizable": self.unrealizable,
            "failed": self.failed,
            "not_shared": self.not_shared,
            "mismatches": len(self.mismatches),
            "violations": len(self.violations),
            "walks": self.walks,
            "steps": self.steps,
            "idle_ticks": self.idle_ticks,
            "refusals": self.refusals,
            "seconds": round(self.seconds, 1),
            "steps_per_s": round(self.edges_per_s),
            "by_action": self.by_action,
        }


# ---- the replay ----------------------------------------------------------------------------------------
def replay_graph(
    graph: StateGraph,
    bounds: Bounds,
    *,
    backend: str = "hiradix",
    focus: Sequence[str] = (),
    caveats: frozenset[str] = frozenset(),
    page_size: int = 1,
    seed: int = 0,
    rounds: int = 4,
    budget_s: float | None = None,
    progress: Callable[[CoverReport], None] | None = None,
    fresh_every: int = 2000,
    hi_backend: Callable[[Any], Any] | None = None,
    policy: str = "offload",
) -> CoverReport:
    """Replay every edge of ``graph`` (or, with ``focus``, every edge of those actions and every
    edge leaving their targets) on a real ``backend`` stack, comparing states after every step.
    ``hi_backend`` replaces the HiRadixCache backend (a seeded defect in a backend subclass).
    ``policy="auto"`` (HiRadixCache, a graph with ``Policy``): the spec's ``ToolStart``, ``Keep``
    and ``LetGo`` of a running session are the production ``tool_start``, whose choice may be
    other spec steps than the edge's (``PolicyChose``: checked, and the edge left to another walk).

    Stops at the first mismatch. Edges that fail as unrealizable (or not shareable at run time) are
    re-planned along other walks for ``rounds`` rounds, then counted as unrealizable."""

    def stack(seed: int) -> Replayer:
        return Replayer(
            bounds,
            backend=backend,
            caveats=caveats,
            page_size=page_size,
            seed=seed,
            fill=False,
            hi_backend=hi_backend,
            policy=policy,
        )

    r = stack(seed)
    t0 = time.monotonic()  # after the first stack: importing sglang is not the replay's cost
    states = graph.states
    label = {sid: str(st["act"][0]) for sid, st in states.items()}
    all_edges = {(u, v) for u, v, _ in graph.edges}
    rep = CoverReport(backend=backend, states=len(states), edges=len(all_edges), policy=policy)
    allowed = set(all_edges)
    if backend != "hiradix":
        for u, v in all_edges:
            why = radix_shares(states[u], states[v], bounds)
            if why is not None:
                allowed.discard((u, v))
                rep.not_shared[why] = rep.not_shared.get(why, 0) + 1
    if focus:
        hit = {(u, v) for u, v in allowed if label[v] in focus}
        targets = {v for _, v in hit}
        todo = hit | {(u, v) for u, v in allowed if u in targets}
    else:
        todo = set(allowed)
    cover = Cover(allowed, graph.initial, seed=seed)
    for e in [e for e in todo if e[0] not in cover.dist]:  # not reachable along shareable edges
        todo.discard(e)
        rep.not_shared["unreachable"] = rep.not_shared.get("unreachable", 0) + 1
    rep.todo = len(todo)
    for _, v in todo:
        rep.by_action.setdefault(label[v], [0, 0])[0] += 1

    keys = [k for k in states[next(iter(graph.initial))] if k not in HISTORY]
    failures: Counter[Edge] = Counter()
    reasons: dict[Edge, str] = {}
    probed: set[int] = set()
    done: set[Edge] = set()

    def restart() -> None:
        nonlocal r
        if rep.walks and rep.walks % fresh_every == 0:  # bound the copy engine's history
            r.close()
            r = stack(rep.walks)
        else:
            r.restart()

    def walk(walk_states: list[int]) -> bool:
        return _walk(r, walk_states, states, keys, bounds, rep, done, failures, reasons, probed)

    try:
        run_cover(
            cover, todo, rep, restart, walk, done, failures, reasons, lambda e: label[e[1]],
            rounds=rounds, budget_s=budget_s, t0=t0, progress=progress,
        )  # fmt: skip
    finally:
        r.close()
    return _finish(rep, t0)


def run_cover(
    cover: Cover,
    todo: set[Edge],
    rep: CoverReport,
    restart: Callable[[], None],
    walk: Callable[[list[int]], bool],
    done: set[Edge],
    failures: Counter[Edge],
    reasons: dict[Edge, str],
    label: Callable[[Edge], str],
    *,
    rounds: int,
    budget_s: float | None,
    t0: float,
    progress: Callable[[CoverReport], None] | None = None,
) -> bool:
    """The rounds of a replay, whatever the model: plan walks over the edges of ``todo`` not yet
    taken (round 1 in BFS order, later rounds randomised, so that an edge that failed is tried
    along another walk), and for each walk ``restart`` the stack and ``walk`` it (``walk`` adds the
    edges it took to ``done``, and an edge it could not take to ``failures`` with its reason).
    Then tally the report. False if a walk stopped the replay (a mismatch) or the budget ran out
    (the report is then not tallied)."""
    for rnd in range(rounds):
        left = todo - done - {e for e, k in failures.items() if k >= rounds}
        if not left:
            break
        rep.rounds = rnd + 1
        plan = cover.plan(left, randomize=rnd > 0)
        for walk_states in plan.walks:
            if budget_s is not None and time.monotonic() - t0 > budget_s:
                return False
            restart()
            rep.walks += 1
            if not walk(walk_states):
                return False
            if progress is not None:
                progress(rep)
    rep.unrealizable = len(todo - done)
    rep.covered = len(todo & done)
    for e, why in reasons.items():
        if e not in done:
            rep.failed[why] = rep.failed.get(why, 0) + 1
    for e in todo & done:
        rep.by_action[label(e)][1] += 1
    return True


def _walk(
    r: Replayer,
    walk_states: list[int],
    states: Mapping[int, Mapping[str, Any]],
    keys: list[str],
    b: Bounds,
    rep: CoverReport,
    done: set[Edge],
    failures: Counter[Edge],
    reasons: dict[Edge, str],
    probed: set[int] | None = None,
) -> bool:
    """Execute one walk; False on a mismatch (the replay stops there). ``probed``: the states whose
    refused calls were probed already (policy ``auto``)."""
    probed = probed if probed is not None else set()
    hi = r.backend_name == "hiradix"
    first = states[walk_states[0]]
    if not _matches(r, first, keys, b, rep, None, walk_states[:1]):
        return False
    for i, (u, v) in enumerate(itertools.pairwise(walk_states)):
        act = states[v]["act"]
        try:
            res = r.apply(act, states[u], check=False)
        except (Unrealizable, NotApplicable) as exc:
            failures[(u, v)] += 1
            reasons[(u, v)] = f"{type(exc).__name__}: {exc.args[0] if exc.args else ''}"
            return True
        rep.steps += 1
        if not _matches(r, states[v], keys, b, rep, act, walk_states[: i + 2]):
            if hi:  # the spec's properties on the implementation's state, to say what broke
                post = r.abstract()
                rep.mismatches[-1]["violations"] = check_invariants(post, b) + check_step(
                    states[u], post, b, tuple(act)
                )
            return False
        if hi and not _idle_tick_stutters(r, states[v], keys, b, rep, walk_states[: i + 2]):
            return False
        if hi and r.policy == "auto" and b.policy and v not in probed:
            probed.add(v)
            if not _refusals_stutter(r, states[v], keys, b, rep, walk_states[: i + 2]):
                return False
        if res.error is not None and act[0] not in ("ToolStart", "ToolEnd", "Close"):
            rep.violations.append({"edge": [u, v], "action": act, "error": res.error})
        done.add((u, v))
    return True


#: policy auto: the calls probed in each state where the spec does not enable them
REFUSED_CALLS = ("Keep", "LetGo", "Demote", "Prefetch", "ToolStart")


def _refusals_stutter(
    r: Replayer,
    spec: Mapping[str, Any],
    keys: list[str],
    b: Bounds,
    rep: CoverReport,
    walk_states: list[int],
) -> bool:
    """Policy ``auto``: in every state reached (once per state), each of the policy's calls for each
    session that the spec does not enable there — ``keep``, ``let_go``, ``demote``, ``prefetch``,
    and ``tool_start`` outside ``Running`` — must be refused and change nothing (a stuttering
    step), whatever the policy's candidate lists would admit. ``prefetch`` of an offloaded session
    is left out: its refusal is the spec's ``DevFits``, and device room is sized to the spec only
    at the steps that need it. False (and a mismatch) if a refused call moved the state."""
    rules = b.rules()
    mgr = r.mgr

    def tool_start(s: str) -> dict[str, object]:
        return mgr.tool_start(s, expected_s=0.0)

    calls: dict[str, Callable[[str], dict[str, object]]] = {
        "Keep": mgr.keep,
        "LetGo": mgr.let_go,
        "Demote": mgr.demote,
        "Prefetch": mgr.prefetch,
        "ToolStart": tool_start,
    }
    for s in b.sessions:
        phase = spec["phase"][s]
        for name in REFUSED_CALLS:
            if name == "Prefetch" and phase == "Offloaded":
                continue
            if name == "ToolStart" and phase == "Running":
                continue
            if name in ("Keep", "LetGo") and spec["epoch"][s] >= b.max_epoch:
                continue  # the model's bound on tool calls, not a refusal
            if specstep.successor(spec, [name, s], rules) is not None:
                continue
            with contextlib.suppress(ToolKVError):
                calls[name](s)
            rep.refusals += 1
            if not _matches(r, spec, keys, b, rep, [f"refused {name}", s], walk_states):
                return False
    return True


def _idle_tick_stutters(
    r: Replayer,
    spec: Mapping[str, Any],
    keys: list[str],
    b: Bounds,
    rep: CoverReport,
    walk_states: list[int],
) -> bool:
    """With a load queued where the spec's ``StartLoads`` is not enabled (a load is in flight),
    the tick's ``start_loads`` must be a stuttering step; False (and a mismatch) if it moved."""
    if b.ring == 0 or not spec["queued"] or specstep.successor(spec, ["StartLoads"], b.rules()) is not None:
        return True
    r.idle_tick()
    rep.idle_ticks += 1
    return _matches(r, spec, keys, b, rep, ["tick: start_loads where StartLoads is not enabled"], walk_states)


def _matches(
    r: Replayer,
    spec: Mapping[str, Any],
    keys: list[str],
    b: Bounds,
    rep: CoverReport,
    act: Any,
    walk_states: list[int],
) -> bool:
    if r.backend_name == "hiradix":
        d = _diff(spec, r.abstract(), keys)
    else:
        want, have = radix_view_spec(spec, b), radix_view_impl(r)
        for s in b.sessions:  # compare what the spec's view says (a restoring session: no kv yet)
            have[s] = {k: have[s].get(k) for k in want[s]}
        d = _diff(want, have, ["now", "resets", *b.sessions])
        bad = radix_invariants(r)
        if bad:
            d["invariants"] = bad
    if d:
        rep.mismatches.append({"action": act, "diff": to_plain(d), "walk": walk_states})
        return False
    return True


def _finish(rep: CoverReport, t0: float) -> CoverReport:
    rep.seconds = time.monotonic() - t0
    return rep


# ---- the graphs: which models are replayed on which backends (spec/configs.toml) ----------------------
@dataclass(frozen=True)
class GraphConfig:
    """One ``[[conformance]]`` entry of ``spec/configs.toml``."""

    name: str
    cfg: str
    constants: tuple[tuple[str, str], ...]
    backends: tuple[str, ...]
    policies: tuple[str, ...] = ("offload",)  # "auto": on the HiRadixCache only (replay_graph)

    def cases(self) -> list[tuple[str, str]]:
        """(backend, policy) pairs to replay: every backend with ``offload``, ``auto`` on the
        HiRadixCache (the pressure it reads is HiCache's)."""
        return [(b, p) for b in self.backends for p in self.policies if p == "offload" or b == "hiradix"]

    def cfg_text(self, spec_dir: Path) -> str:
        return with_constants((spec_dir / self.cfg).read_text(), dict(self.constants))


def load_conformance(spec_dir: Path) -> tuple[list[GraphConfig], dict[str, str]]:
    """The graphs to replay and the actions not replayed yet (action -> reason)."""
    with (spec_dir / "configs.toml").open("rb") as fh:
        data = tomllib.load(fh)
    out = []
    for raw in data.get("conformance", []):
        backends = tuple(str(x) for x in raw["backends"])
        unknown = set(backends) - set(BACKENDS)
        if unknown:
            raise ValueError(f"conformance {raw['name']}: unknown backends {sorted(unknown)}")
        consts = tuple((str(k), str(v)) for k, v in raw.get("constants", {}).items())
        policies = tuple(str(x) for x in raw.get("policies", ["offload"]))
        if set(policies) - set(POLICY_NAMES):
            raise ValueError(f"conformance {raw['name']}: unknown policies {sorted(set(policies))}")
        out.append(GraphConfig(str(raw["name"]), str(raw["cfg"]), consts, backends, policies))
    pending = {str(k): str(v) for k, v in data.get("conformance_pending", {}).items()}
    return out, pending


def dump_graph(tools: Toolchain, spec_dir: Path, gc: GraphConfig, work: Path) -> tuple[StateGraph, Bounds]:
    """TLC's full state graph of ``gc`` (its modules copied into ``work``) and its bounds."""
    text = gc.cfg_text(spec_dir)
    return dump_module_graph(tools, spec_dir, "ToolKV.tla", gc.name, text, work), Bounds.from_cfg(
        cfg_constants(text)
    )


def dump_module_graph(
    tools: Toolchain, spec_dir: Path, module: str, name: str, cfg_text: str, work: Path
) -> StateGraph:
    """TLC's full state graph of ``module`` of ``spec_dir`` under config ``cfg_text`` (written as
    ``work/name.cfg``; the modules are copied into ``work``), read as the replay compares it."""
    for f in spec_dir.glob("*.tla"):
        shutil.copy(f, work / f.name)
    cfg = work / f"{name}.cfg"
    cfg.write_text(cfg_text)
    res = run_tlc(tools, work / module, cfg, dump_dot=work / f"{name}-graph")
    if res.outcome != "pass":
        raise RuntimeError(f"TLC on conformance graph {name}: {res.outcome} {res.error_lines[-3:]}")
    return load_graph(work / f"{name}-graph")


def spec_actions(tools: Toolchain, spec_dir: Path, work: Path) -> list[str]:
    """Every action of the spec's next-state relation, as TLC lists it (``-coverage``), on the
    smallest model: TLC lists an action even when the model never enables it."""
    for f in spec_dir.glob("*.tla"):
        shutil.copy(f, work / f.name)
    tiny = with_constants((spec_dir / "MC_dump.cfg").read_text(), {"Nodes": "{n1}", "Sessions": "{s1}"})
    cfg = work / "actions.cfg"
    cfg.write_text(tiny)
    res = run_tlc(tools, work / "ToolKV.tla", cfg, coverage=True)
    if res.outcome != "pass" or not res.coverage:
        raise RuntimeError(f"TLC listed no actions: {res.outcome} {res.error_lines[-3:]}")
    return list(res.coverage)


# ---- replaying one trace (TLC error traces of the mutants) -----------------------------------------
def replay_trace(
    states: Iterable[Mapping[str, Any]],
    bounds: Bounds,
    *,
    caveats: frozenset[str] = frozenset(),
    env_bugs: frozenset[str] = frozenset(),
    page_size: int = 1,
    then: Callable[[Replayer], list[str]] | None = None,
) -> tuple[list[StepResult], list[dict[str, Any]]]:
    """Replay a TLC error trace (states with ``act``) on the implementation; returns every step's
    result and the per-step state differences (empty where the implementation matched). ``then``
    runs after the last step (e.g. a liveness check) and may add violations."""
    sts = [to_plain(dict(s)) for s in states]
    r = Replayer(bounds, caveats=caveats, env_bugs=env_bugs, page_size=page_size)
    results: list[StepResult] = []
    diffs: list[dict[str, Any]] = []
    keys = [k for k in sts[0] if k not in HISTORY]
    try:
        pre = r.abstract()
        for st in sts[1:]:
            act = st["act"]
            try:
                res = r.apply(act, pre)
            except Unrealizable as exc:  # the implementation's world refuses this step: the trace ends
                results.append(StepResult(tuple(act), f"diverged: {exc}", []))
                break
            except Exception as exc:  # a crash inside sglang is a failure of the broken variant
                results.append(StepResult(tuple(act), f"crash: {type(exc).__name__}: {exc}", ["Crash"]))
                break
            assert res.post is not None
            pre = res.post
            results.append(res)
            diffs.append(to_plain(_diff(st, pre, keys)))
        else:
            if then is not None:
                results.append(StepResult(("then",), None, then(r)))
    finally:
        r.close()
    return results, diffs
