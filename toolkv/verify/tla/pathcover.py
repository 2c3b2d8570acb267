"""Walks from the initial states that together take every edge of a state graph: planned once.

The implementation cannot be put into an arbitrary spec state, only driven from the start, so
every edge of TLC's graph must be replayed at the end of a walk from an initial state. A walk costs
one fresh cache stack plus one real step per edge it takes; the plan keeps both small:

* every edge's source is reached by a shortest path (one BFS from the initial states, parents
  kept), and those prefix edges count as covered too;
* from there the walk keeps taking edges nobody has taken yet, preferring a successor that itself
  has untaken edges (one step of look-ahead), and when it runs out it bridges to the nearest state
  with untaken edges by a short bounded search instead of starting over;
* sources are served in BFS order, so early walks cover the shallow, shared part of the graph and
  later ones go deep.

Edges may be excluded (``skip``) and re-planned after a replay failed on them (``replan``). The
graph here is plain integers; nothing about TLA+ or the implementation.
"""

from __future__ import annotations

import itertools
import random
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

Edge = tuple[int, int]


@dataclass
class Plan:
    """Walks (each a list of states, starting at an initial state) and what they cover."""

    walks: list[list[int]] = field(default_factory=list)
    covered: set[Edge] = field(default_factory=set)
    unreachable: set[Edge] = field(default_factory=set)  # the source is not reachable from Init

    @property
    def steps(self) -> int:
        return sum(len(w) - 1 for w in self.walks)


class Cover:
    """The graph, its BFS tree from the initial states, and the edges still to take."""

    def __init__(self, edges: Iterable[Edge], initial: Iterable[int], *, seed: int = 0) -> None:
        self.succ: dict[int, list[int]] = {}
        for u, v in dict.fromkeys(edges):  # de-duplicated, order kept
            self.succ.setdefault(u, []).append(v)
        self.initial = sorted(initial)
        self.rng = random.Random(seed)
        self._bfs()

    def _bfs(self) -> None:
        """Distances and *all* shortest-path parents (a re-plan picks a different one)."""
        self.dist: dict[int, int] = {s: 0 for s in self.initial}
        self.parents: dict[int, list[int]] = {s: [] for s in self.initial}
        q = deque(self.initial)
        while q:
            u = q.popleft()
            for v in self.succ.get(u, ()):
                if v not in self.dist:
                    self.dist[v] = self.dist[u] + 1
                    self.parents[v] = [u]
                    q.append(v)
                elif self.dist[v] == self.dist[u] + 1:
                    self.parents[v].append(u)
        self.order = sorted(self.dist, key=self.dist.__getitem__)

    def edges(self) -> set[Edge]:
        return {(u, v) for u, vs in self.succ.items() for v in vs}

    def prefix(self, u: int, randomize: bool) -> list[int]:
        """A shortest walk from an initial state to ``u``."""
        path = [u]
        while self.parents[path[-1]]:
            ps = self.parents[path[-1]]
            path.append(self.rng.choice(ps) if randomize else ps[0])
        return path[::-1]

    def plan(
        self,
        todo: set[Edge],
        *,
        max_len: int = 200,
        bridge: int = 4,
        randomize: bool = False,
    ) -> Plan:
        """Walks that take every edge of ``todo`` at least once (edges outside it may be walked)."""
        plan = Plan()
        left: dict[int, set[int]] = {}
        for u, v in todo:
            if u not in self.dist:
                plan.unreachable.add((u, v))
            else:
                left.setdefault(u, set()).add(v)
        pending = sum(len(vs) for vs in left.values())

        def take(u: int, v: int) -> None:
            nonlocal pending
            vs = left.get(u)
            if vs is not None and v in vs:
                vs.discard(v)
                pending -= 1
                plan.covered.add((u, v))
                if not vs:
                    del left[u]

        cursor = 0
        while pending:
            while self.order[cursor] not in left:
                cursor += 1
            walk = self.prefix(self.order[cursor], randomize)
            for a, b in itertools.pairwise(walk):
                take(a, b)
            while len(walk) <= max_len:
                cur = walk[-1]
                nxt = left.get(cur)
                if nxt:
                    # look-ahead: prefer a successor that has untaken edges of its own
                    v = max(nxt, key=lambda d: (d in left, -d if not randomize else self.rng.random()))
                    take(cur, v)
                    walk.append(v)
                    continue
                hop = self._bridge(cur, left, bridge)
                if hop is None:
                    break
                for b in hop:
                    take(walk[-1], b)
                    walk.append(b)
            plan.walks.append(walk)
        return plan

    def _bridge(self, start: int, left: Mapping[int, set[int]], depth: int) -> list[int] | None:
        """The states after ``start`` on a shortest walk (at most ``depth`` edges) to a state with
        untaken edges, or None."""
        prev: dict[int, int] = {start: start}
        frontier = [start]
        for _ in range(depth):
            nxt: list[int] = []
            for u in frontier:
                for v in self.succ.get(u, ()):
                    if v in prev:
                        continue
                    prev[v] = u
                    if v in left:
                        out = [v]
                        while prev[out[-1]] != start:
                            out.append(prev[out[-1]])
                        return out[::-1]
                    nxt.append(v)
            frontier = nxt
        return None


__all__ = ["Cover", "Edge", "Plan"]
