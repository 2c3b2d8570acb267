"""The Python copy of the spec's actions (``toolkv.verify.toolkv.spec``) equals TLC's next-state relation.

The fuzz campaign trusts ``successor(u, act)`` as the spec on every step, so it is checked against
TLC itself: on every distinct transition of every conformance graph, the Python successor of the
source state under the edge's action is exactly the target state (history variables included);
and no action instance that TLC does not take from a state is enabled in Python (sampled states).
"""

from __future__ import annotations

import itertools
import random
from typing import Any

import pytest

from toolkv.verify.toolkv.refinement import Bounds
from toolkv.verify.toolkv.spec import ACTIONS, successor

pytestmark = pytest.mark.tlc


def _core_key(st: dict[str, Any]) -> tuple[int, ...]:
    # the graph reader shares one value object per distinct printed conjunct: identity is equality
    return tuple(id(st[k]) for k in sorted(st) if k not in ("act", "tgt"))


def _instances(b: Bounds) -> list[list[Any]]:
    nodes, sess, root = list(b.nodes), list(b.sessions), ["Root"]
    out: list[list[Any]] = [["TtlSweep"], ["TreeReset"], ["Tick"], ["StartLoads"], ["SysStart"], ["RingDone"]]
    out += [
        [a, s]
        for a in ("ToolStart", "Close", "Keep", "LetGo", "Demote", "Prefetch", "Admit", "Unpin")
        for s in sess
    ]
    out += [["Park", s, e] for s in sess for e in range(1, b.max_epoch + 1)]
    out += [[a, s, n] for a in ("HostRoom", "HostUnmirror") for s in sess for n in nodes]
    out += [["ToolEnd", s, e] for s in sess for e in range(b.max_epoch + 1)]
    out += [
        [a, n]
        for a in ("WriteAck", "LoadAck", "Lock", "Unlock", "GpuEvict", "HostEvict", "WriteThrough")
        for n in nodes
    ]
    out += [["Split", n, m] for n, m in itertools.product(nodes, nodes)]
    out += [["Insert", s, p, n] for s in sess for p in root + nodes for n in nodes]
    return out


@pytest.mark.parametrize("graph", ["dump", "split", "loadring", "policy", "policy_auto", "promise"])
def test_python_successor_equals_tlc_on_every_transition(graphs: Any, graph: str) -> None:
    g, b = graphs.get(graph)
    rules = b.rules()
    seen: set[tuple[tuple[int, ...], tuple[Any, ...]]] = set()
    checked = 0
    for u, v, _ in g.edges:
        su, sv = g.states[u], g.states[v]
        key = (_core_key(su), tuple(sv["act"]))
        if key in seen:
            continue
        seen.add(key)
        got = successor(su, sv["act"], rules)
        assert got == sv, f"{sv['act']} from {su}: Python {got} != TLC {sv}"
        checked += 1
    print(f"{graph}: {checked} distinct transitions equal")
    assert checked > 0


@pytest.mark.parametrize("graph", ["dump", "split", "loadring", "policy", "policy_auto", "promise"])
def test_python_enables_nothing_tlc_does_not(graphs: Any, graph: str) -> None:
    g, b = graphs.get(graph)
    rules = b.rules()
    taken: dict[int, set[tuple[Any, ...]]] = {}
    for u, v, _ in g.edges:
        taken.setdefault(u, set()).add(tuple(g.states[v]["act"]))
    sample = random.Random(0).sample(sorted(g.states), min(2000, len(g.states)))
    inst = _instances(b)
    assert {i[0] for i in inst} == set(ACTIONS)
    for u in sample:
        for act in inst:
            if successor(g.states[u], act, rules) is not None:
                assert tuple(act) in taken.get(u, set()), (
                    f"Python enables {act} in a state where TLC does not"
                )
