"""Spec ↔ code conformance: replay TLC's state graph on the real manager + HiRadixCache.

TLC dumps the full state graph of a small model (``-dump dot,actionlabels``; every state carries
the history variable ``act`` with the action's parameters). :class:`Replayer` executes one spec
action at a time on the implementation — manager actions through ``ToolKVManager``, environment
actions through the real sglang calls the scheduler would make — and after every step compares the
implementation's abstract state (``refinement.abstract_state``) with the spec state the edge leads
to. :func:`cover` walks the graph until every edge was replayed.

The environment is the replayer's to choose, as it is TLC's: which node sglang evicts (by making it
the least recently used), when a copy finishes (the controllable copy engine), and how much memory
other requests hold ("ballast" allocations that make a ToolStart find the host full, or a ToolEnd
find no device memory, exactly when the spec's slot counters say so). Spec slots are node-sized;
token capacity is mapped onto them only at those two decisions.

sglang processes acknowledgements in issue order (``writing_check``/``loading_check`` stop at the
first unfinished ack); the spec lets acks arrive in any order. An edge that acknowledges a later
transfer first cannot happen in sglang: the replayer reports it as *unrealizable* instead of
pretending, and :func:`cover` looks for another path to the same edge.
"""

from __future__ import annotations

import itertools
import random
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from toolkv.core.manager import ManagerConfig, ToolKVManager
from toolkv.core.treeops import TreeNode, attached, path_to, walk
from toolkv.errors import ToolKVError
from toolkv.testing.harness import CacheHarness, HarnessConfig, rkey
from toolkv.verify.refinement import (
    CORE,
    NO_NODE,
    ROOT,
    Bounds,
    NodeMap,
    abstract_state,
    check_invariants,
    check_step,
)
from toolkv.verify.tla import StateGraph, to_plain

CORE_VARS = CORE


class Unrealizable(Exception):
    """The spec step cannot happen in sglang (e.g. an ack out of issue order)."""


class Mismatch(AssertionError):
    """The implementation's abstract state differs from the spec state after a step."""


@dataclass
class StepResult:
    action: tuple[Any, ...]
    error: str | None  # the typed error the manager answered with, if any
    violations: list[str]

    @property
    def fits(self) -> bool:
        """The capacity decision the implementation took (for trace validation)."""
        return self.error not in ("host_memory_full", "device_memory_full")


class Replayer:
    """One real cache stack driven by spec actions. Create a fresh one per path."""

    def __init__(
        self,
        bounds: Bounds,
        *,
        caveats: frozenset[str] = frozenset(),
        env_bugs: frozenset[str] = frozenset(),
        page_size: int = 1,
        seed: int = 0,
        capacity: str = "spec",
        device_tokens: int | None = None,
        host_ratio: float = 1.0,
        device: str = "cpu",
        io_backend: str = "direct",
        ttl: float | None = None,
        kv_shape: tuple[int, int, int] = (2, 2, 4),
        dtype: torch.dtype = torch.float32,
    ) -> None:
        """``capacity="spec"`` maps the spec's node-granular slots onto the token pools with ballast
        (conformance replay); ``capacity="real"`` leaves the pools alone: refusals happen when the
        real pools are full, and the step result reports the decision (fuzzing, trace validation)."""
        self.b = bounds
        self.capacity = capacity
        # Environment defects: what a misconfigured sglang does. "OrphanHost": a backed-up leaf is
        # deleted with its host copy still allocated (SessionRadixCache's release path + HiCache,
        # which the plugin refuses to run with).
        self.env_bugs = env_bugs
        self.ps = page_size
        self.unit = 4 * max(16, page_size)  # tokens per spec node: halves of splits stay >= 10 (load_back)
        cap = device_tokens or (len(bounds.nodes) + bounds.dev_slots + 4) * self.unit
        self.h = CacheHarness(
            HarnessConfig(
                page_size=page_size,
                device_tokens=cap,
                host_ratio=host_ratio,
                write_policy="write_through",
                device=device,
                io_backend=io_backend,
                layers=kv_shape[0],
                heads=kv_shape[1],
                head_dim=kv_shape[2],
                dtype=dtype,
            ),
            seed=seed,
        )
        # HiCache's own write-through is the spec's explicit WriteThrough action here.
        self.h.tree.write_through_threshold = 10**9
        self.mgr = ToolKVManager(
            self.h.tree,
            config=ManagerConfig(ttl_s=float(ttl if ttl is not None else bounds.ttl)),
            caveats=caveats,
        )
        self.nodes = NodeMap()
        self.ext: set[str] = set()
        self.resets = 0
        self._fresh = 1
        self._ballast_dev: torch.Tensor | None = None
        self._ballast_host: torch.Tensor | None = None
        self.env_host_slots: set[int] = set()  # host slots held by other requests (fuzz memory pressure)

    def close(self) -> None:
        self.h.close()

    # ---- state ----------------------------------------------------------------------------------------
    def abstract(self) -> dict[str, Any]:
        st = abstract_state(
            self.mgr,
            self.nodes,
            self.b,
            ext_locks=self.ext,
            resets=self.resets,
            env_host_slots=self.env_host_slots,
        )
        st["extLock"] = {n: n in self.ext for n in self.b.nodes}
        return st

    def _obj(self, name: str) -> TreeNode:
        return self.nodes.obj[name]

    def _tokens_of(self, node: TreeNode) -> list[int]:
        out: list[int] = []
        for m in path_to(self.h.tree, node):
            out.extend(m.key.token_ids)
        return out

    # ---- ballast: how much memory other requests hold ------------------------------------------------
    def _release_ballast(self) -> None:
        if self._ballast_dev is not None:
            self.h.allocator.free(self._ballast_dev)
            self._ballast_dev = None
        if self._ballast_host is not None:
            self.h.host_pool.free(self._ballast_host)
            self._ballast_host = None

    def _device_free_exactly(self, tokens: int) -> None:
        if self.capacity != "spec":
            return
        extra = self.h.allocator.available_size() - max(tokens, 0)
        if extra > 0:
            self._ballast_dev = self.h.allocator.alloc(extra)
            assert self._ballast_dev is not None

    def _host_free_exactly(self, tokens: int) -> None:
        if self.capacity != "spec":
            return
        extra = self.h.host_pool.available_size() - max(tokens, 0)
        if extra > 0:
            self._ballast_host = self.h.host_pool.alloc(extra)
            assert self._ballast_host is not None

    # ---- acks ------------------------------------------------------------------------------------------
    def _complete_ack(self, queue: list[Any], name: str) -> None:
        rid = self._obj(name).id
        pending = [a for a in queue if not a.finish_event.query()]
        for i, ack in enumerate(queue):
            if rid in ack.node_ids:
                if any(a is not ack for a in queue[:i]):
                    raise Unrealizable(f"ack for {name} is not the oldest one in flight")
                ack.finish_event.synchronize()
                return
        raise Unrealizable(f"no ack in flight for {name} ({len(pending)} pending)")

    # ---- one spec action -------------------------------------------------------------------------------
    def apply(self, act: Sequence[Any], pre: Mapping[str, Any] | None = None) -> StepResult:
        """Execute spec action ``act`` (e.g. ``("ToolStart", "s1")``). ``pre`` is the abstract state
        before it (computed if not given): the environment's memory choices depend on it."""
        pre = pre if pre is not None else self.abstract()
        name, args = str(act[0]), [str(a) for a in act[1:]]
        self._release_ballast()
        error: str | None = None
        tree, mgr = self.h.tree, self.mgr
        try:
            if name == "Insert":
                self._insert(args[0], args[1], args[2])
            elif name == "ToolStart":
                s = args[0]
                rec = mgr.sessions.get(s)
                if rec is not None and rec.node is not None and attached(tree, rec.node):
                    w = [m for m in path_to(tree, rec.node) if m.host_value is None]
                    if len(w) > pre["hostFree"]:
                        self._host_free_exactly(sum(len(m.key) for m in w) - self.ps)
                mgr.tool_start(s)
            elif name == "WriteAck":
                self._complete_ack(tree.cache_controller.ack_write_queue, args[0])
                tree.writing_check()
                mgr.process_write_acks()
            elif name == "ToolEnd":
                s, e = args[0], int(args[1])
                rec = mgr.sessions.get(s)
                if rec is not None and rec.node is not None and attached(tree, rec.node):
                    c = [m for m in path_to(tree, rec.node) if m.value is None]
                    if len(c) > pre["devFree"]:
                        self._device_free_exactly(sum(len(m.key) for m in c) - self.ps)
                mgr.tool_end(s, e)
            elif name == "LoadAck":
                self._complete_ack(tree.cache_controller.ack_load_queue, args[0])
                tree.loading_check()
                mgr.process_load_acks()
            elif name == "TtlSweep":
                if pre["now"] >= self.b.max_time:
                    # the spec's clock saturates at MaxTime ("MaxTime or later") and clamps deadlines to
                    # it: every armed deadline is due there. Real time simply moves on that far.
                    due = [
                        r.deadline
                        for r in mgr.sessions.values()
                        if r.state in ("Offloading", "Offloaded", "Restoring")
                    ]
                    mgr.set_clock(max([mgr.now, *due]))
                mgr.ttl_sweep()
            elif name == "Close":
                mgr.close(args[0])
            elif name == "Lock":
                tree.inc_lock_ref(self._obj(args[0]))
                self.ext.add(args[0])
            elif name == "Unlock":
                tree.dec_lock_ref(self._obj(args[0]))
                self.ext.discard(args[0])
            elif (
                name == "GpuEvict"
                and "OrphanHost" in self.env_bugs
                and self._obj(args[0]).host_value is not None
            ):
                o = self._obj(args[0])
                tree.cache_controller.mem_pool_device_allocator.free(o.value)
                tree._delete_leaf(o)
            elif name == "GpuEvict":
                o = self._obj(args[0])
                o.last_access_time = -1e18  # the environment picks the victim: make it the LRU leaf
                self.h.evict_device(len(o.key))
                if o.value is not None and attached(tree, o):
                    raise Unrealizable(f"sglang would not GPU-evict {args[0]}")
            elif name == "HostEvict":
                o = self._obj(args[0])
                o.last_access_time = -1e18
                self.h.evict_host(len(o.key))
                if attached(tree, o):
                    raise Unrealizable(f"sglang would not host-evict {args[0]}")
            elif name == "WriteThrough":
                o = self._obj(args[0])
                if tree.write_backup(o) != len(o.key):
                    raise Unrealizable("host pool full: sglang skips the write-through")
            elif name == "Split":
                self._split(args[0], args[1])
            elif name == "TreeReset":
                # flush_cache only runs when the scheduler is fully idle, which counts sglang's in-flight
                # writes and loads as busy: they have finished and been retired (reset() itself does not
                # clear ongoing_write_through / ongoing_load_back).
                self.h.synchronize()
                tree.writing_check()
                tree.loading_check()
                tree.reset()
                self.h.allocator.clear()
                self.resets += 1
                mgr.on_tree_reset()
            elif name == "Tick":
                mgr.set_clock(mgr.now + 1)
            else:
                raise ValueError(f"unknown spec action {name}")
        except ToolKVError as exc:
            error = exc.code
        finally:
            self._release_ballast()
        post = self.abstract()
        return StepResult(
            tuple(act), error, check_invariants(post, self.b) + check_step(pre, post, self.b, tuple(act))
        )

    def _insert(self, s: str, p: str, n: str) -> None:
        tree = self.h.tree
        prefix_tokens: list[int] = [] if p == ROOT else self._tokens_of(self._obj(p))
        fresh = list(range(self._fresh, self._fresh + self.unit))
        self._fresh += self.unit
        tokens = prefix_tokens + fresh
        new = self.h.allocator.alloc(self.unit)
        if new is None:
            if self.capacity == "spec":
                raise AssertionError("the replayer sized the device pool too small")
            raise Unrealizable("no device memory for the turn")
        self.h.fill_kv(new, fresh)
        prefix_idx = (
            torch.cat([m.value for m in path_to(tree, self._obj(p))]).to(new.device) if p != ROOT else new[:0]
        )
        from sglang.srt.mem_cache.base_prefix_cache import InsertParams

        res = tree.insert(InsertParams(key=rkey(tokens), value=torch.cat([prefix_idx, new])))
        assert int(res.prefix_len) == len(prefix_tokens), "insert matched more than the parent path"
        leaf, matched = walk(tree, tokens)
        assert matched == len(tokens)
        self.nodes.add(n, leaf, self.mgr.tree_gen)
        self.mgr.record_turn(s, tokens)

    def _split(self, n: str, m: str) -> None:
        from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams

        o = self._obj(n)
        half = (len(o.key) // 2) // self.ps * self.ps
        assert half > 0, "node too short to split"
        tokens = self._tokens_of(o.parent) if o.parent is not self.h.tree.root_node else []
        tokens += list(o.key.token_ids[:half])
        self.h.tree.match_prefix(MatchPrefixParams(key=rkey(tokens)))
        assert len(o.key) == len(o.key.token_ids) and o.parent is not None
        self.nodes.add(m, o.parent, self.mgr.tree_gen)


# ---- comparing states --------------------------------------------------------------------------------
def spec_core(state: Mapping[str, Any]) -> dict[str, Any]:
    plain = to_plain(dict(state))
    return {k: plain[k] for k in CORE_VARS}


def diff(spec: Mapping[str, Any], impl: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    out = {}
    for k in CORE_VARS:
        if spec[k] != impl[k]:
            if isinstance(spec[k], dict):
                out[k] = (
                    {x: v for x, v in spec[k].items() if impl[k].get(x) != v},
                    {x: v for x, v in impl[k].items() if spec[k].get(x) != v},
                )
            else:
                out[k] = (spec[k], impl[k])
    return out


# ---- covering the graph --------------------------------------------------------------------------------
@dataclass
class CoverReport:
    states: int = 0
    edges: int = 0
    covered: int = 0
    unrealizable: int = 0
    mismatches: list[dict[str, Any]] = field(default_factory=list)
    violations: list[dict[str, Any]] = field(default_factory=list)
    paths: int = 0
    steps: int = 0
    seconds: float = 0.0
    by_action: dict[str, list[int]] = field(default_factory=dict)  # action -> [edges, covered]

    @property
    def coverage(self) -> float:
        realizable = self.edges - self.unrealizable
        return self.covered / realizable if realizable else 1.0


def _edge_key(src: int, dst: int) -> tuple[int, int]:
    return (src, dst)


def cover(
    graph: StateGraph,
    bounds: Bounds,
    *,
    caveats: frozenset[str] = frozenset(),
    page_size: int = 1,
    max_path: int = 40,
    seed: int = 0,
    budget_s: float | None = None,
    progress: Callable[[CoverReport], None] | None = None,
) -> CoverReport:
    """Replay walks through ``graph`` until every edge was taken once (or proven unrealizable)."""
    rng = random.Random(seed)
    t0 = time.monotonic()
    out_edges: dict[int, list[tuple[int, str]]] = {}
    all_edges: set[tuple[int, int]] = set()
    for src, dst, label in graph.edges:
        if (src, dst) in all_edges:
            continue
        all_edges.add((src, dst))
        out_edges.setdefault(src, []).append((dst, label))
    rep = CoverReport(states=len(graph.states), edges=len(all_edges))
    for _, _, label in graph.edges:
        rep.by_action.setdefault(label, [0, 0])
    for _, dst in all_edges:
        rep.by_action[_label(graph, dst)][0] += 1
    uncovered = set(all_edges)
    failed_attempts: dict[tuple[int, int], int] = {}
    core_cache: dict[int, dict[str, Any]] = {}

    def core(sid: int) -> dict[str, Any]:
        c = core_cache.get(sid)
        if c is None:
            c = core_cache[sid] = spec_core(graph.states[sid])
        return c

    def route(start: int) -> list[int] | None:
        """Shortest path of states from ``start`` to a state with an uncovered out-edge."""
        prev: dict[int, int | None] = {start: None}
        q = deque([start])
        while q:
            u = q.popleft()
            if any((u, d) in uncovered for d, _ in out_edges.get(u, ())):
                path = [u]
                while prev[path[-1]] is not None:
                    path.append(prev[path[-1]])  # type: ignore[arg-type]
                return path[::-1]
            for d, _ in out_edges.get(u, ()):
                if d not in prev:
                    prev[d] = u
                    q.append(d)
        return None

    init = sorted(graph.initial)
    while uncovered:
        if budget_s is not None and time.monotonic() - t0 > budget_s:
            break
        start = rng.choice(init)
        r = Replayer(bounds, caveats=caveats, page_size=page_size, seed=rep.paths)
        rep.paths += 1
        try:
            impl0 = r.abstract()
            if diff(core(start), impl0):
                rep.mismatches.append(
                    {"edge": None, "state": start, "diff": _jsonable(diff(core(start), impl0))}
                )
                break
            cur, steps, pre = start, 0, impl0
            while steps < max_path:
                travel = route(cur)
                if travel is None:
                    break
                # walk to the state that has an uncovered edge (replaying covered edges on the way)
                moved: dict[str, Any] | None = pre
                for a, b in itertools.pairwise(travel):
                    moved = _replay_edge(r, graph, a, b, pre, rep, uncovered, core)
                    if moved is None:
                        break
                    pre = moved
                    steps += 1
                if moved is None:
                    break
                u = travel[-1]
                choices = [d for d, _ in out_edges[u] if (u, d) in uncovered]
                d = rng.choice(choices)
                res = _replay_edge(r, graph, u, d, pre, rep, uncovered, core)
                steps += 1
                if res is None:
                    if rep.mismatches and rep.mismatches[-1].get("edge") == [u, d]:
                        return _finish(rep, t0)
                    failed_attempts[(u, d)] = failed_attempts.get((u, d), 0) + 1
                    if failed_attempts[(u, d)] >= 3:
                        uncovered.discard((u, d))
                        rep.unrealizable += 1
                    break
                pre, cur = res, d
        finally:
            r.close()
        if progress is not None:
            progress(rep)
        if rep.mismatches:
            break
    return _finish(rep, t0)


def _finish(rep: CoverReport, t0: float) -> CoverReport:
    rep.seconds = time.monotonic() - t0
    return rep


def _label(graph: StateGraph, dst: int) -> str:
    act = graph.states[dst].get("act")
    return str(to_plain(act)[0]) if act is not None else "?"


def _jsonable(x: Any) -> Any:
    return to_plain(x) if not isinstance(x, dict) else {str(k): _jsonable(v) for k, v in x.items()}


def _replay_edge(
    r: Replayer,
    graph: StateGraph,
    u: int,
    v: int,
    pre: dict[str, Any],
    rep: CoverReport,
    uncovered: set[tuple[int, int]],
    core: Callable[[int], dict[str, Any]],
) -> dict[str, Any] | None:
    act = to_plain(graph.states[v]["act"])
    try:
        res = r.apply(act, pre)
    except Unrealizable:
        return None
    rep.steps += 1
    post = r.abstract()
    d = diff(core(v), post)
    if d:
        rep.mismatches.append({"edge": [u, v], "action": act, "diff": _jsonable(d)})
        return None
    if res.violations:
        rep.violations.append({"edge": [u, v], "action": act, "violations": res.violations})
    if (u, v) in uncovered:
        uncovered.discard((u, v))
        rep.covered += 1
        rep.by_action[str(act[0])][1] += 1
    return post


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
    sts = list(states)
    r = Replayer(bounds, caveats=caveats, env_bugs=env_bugs, page_size=page_size)
    results: list[StepResult] = []
    diffs: list[dict[str, Any]] = []
    try:
        pre = r.abstract()
        for st in sts[1:]:
            act = to_plain(st["act"])
            try:
                res = r.apply(act, pre)
            except Unrealizable as exc:  # the implementation's world refuses this step: the trace ends
                results.append(StepResult(tuple(act), f"diverged: {exc}", []))
                break
            except Exception as exc:  # a crash inside sglang is a failure of the broken variant
                results.append(StepResult(tuple(act), f"crash: {type(exc).__name__}: {exc}", ["Crash"]))
                break
            pre = r.abstract()
            results.append(res)
            diffs.append(_jsonable(diff(spec_core(st), pre)))
        else:
            if then is not None:
                results.append(StepResult(("then",), None, then(r)))
    finally:
        r.close()
    return results, diffs


__all__ = ["NO_NODE", "Bounds", "CoverReport", "Replayer", "cover", "replay_trace"]


def cfg_constants(cfg_text: str) -> dict[str, Any]:
    """``NAME = value`` assignments of a TLC config, values parsed as TLA+ (model values stay names)."""
    import re

    from toolkv.verify.tla import parse_value

    out: dict[str, Any] = {}
    for line in re.sub(r"\\\*.*", "", cfg_text).splitlines():
        m = re.match(r"^\s*([A-Za-z_]\w*)\s*=\s*(.+?)\s*$", line)
        if m:
            try:
                out[m.group(1)] = to_plain(parse_value(m.group(2)))
            except Exception:
                out[m.group(1)] = m.group(2)
    return out
