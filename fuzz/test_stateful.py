"""The stateful campaign (CI quick run) and the mutant kill table.

``TestToolKVMachine`` is the Hypothesis state machine as a plain ``unittest.TestCase`` (pytest and
``python -m unittest`` both run it) under the active settings profile (``HYPOTHESIS_PROFILE``:
``ci`` in ``make test``, ``dev`` locally, ``long`` in ``make test-long``). The correct
implementation must survive it; every caveat switch must be killed within the kill budget; traces
of a campaign must be legal spec behaviours, and a broken one must be caught.

Replaying a failure: locally (``dev`` profile) the failing example is saved in ``.hypothesis/`` and
replayed first on the next run; every profile prints ``@reproduce_failure('<version>', b'<blob>')``,
and ``toolkv fuzz --reproduce '<blob>'`` runs exactly that example again.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from toolkv.tools.fuzz_cli import LAZY_MUTANTS, MUTANTS, campaign
from toolkv.verify.toolkv.fuzzing import machine_class
from toolkv.verify.toolkv.refinement import Bounds
from toolkv.verify.toolkv.tracecheck import check_trace
from toolkv.verify.toolkv.world import Replayer

KILL_EXAMPLES = 400  # every mutant must be killed within this many examples (the documented claim)

TestToolKVMachine = machine_class().TestCase
# the per-call policy deciding every tool_start (keep / offload / let go, demotions for room):
# its choice is checked as the spec step it stands for, at every step
TestToolKVMachineAuto = machine_class(policy="auto").TestCase
# the production default on HiRadixCache: finished offloads leave their GPU copies to sglang's
# eviction (spec LazyFree), so tool_end often finds the path resident and hands it over unloaded
TestToolKVMachineLazy = machine_class(policy="auto", lazy_free=True).TestCase


def test_campaign_reaches_every_action() -> None:
    """Hypothesis's own per-example statistics (events) show every spec action performed."""
    r = campaign(examples=15, steps=120, seed=1234, profile="ci")  # long enough to reach HostEvict
    print("fuzz:", json.dumps({k: r[k] for k in ("examples", "steps", "seconds", "kv_bytes_checked")}))
    assert r["failure"] is None, r["failure"]
    for action in ("Insert", "ToolStart", "WriteAck", "ToolEnd", "LoadAck", "GpuEvict", "Split", "TtlSweep"):
        assert r["actions"].get(action, 0) > 0, f"the campaign never performed {action}: {r['actions']}"


# Mutants the campaign cannot kill, with the reason (strict: the day the campaign kills one, this
# fails). None: OrphanHost (caveat 3) dies since the state machine favours backed-up device
# leaves for write-through and GPU eviction.
_SURVIVES: dict[str, str] = {}


@pytest.mark.parametrize(
    "mutant",
    [pytest.param(m, marks=pytest.mark.xfail(reason=_SURVIVES[m], strict=True)) if m in _SURVIVES else m
     for m in sorted(MUTANTS)],
)  # fmt: skip
def test_every_mutant_is_killed(mutant: str) -> None:
    caveats, env_bugs, caveat = MUTANTS[mutant]
    # kill detection only (no shrinking: Hypothesis may shrink for minutes); the shrunk lengths are in
    # the documented kill table, from `toolkv fuzz --mutants`.
    r = campaign(
        examples=KILL_EXAMPLES,
        steps=60,
        profile="ci",
        caveats=caveats,
        env_bugs=env_bugs,
        seed=7,
        label=mutant,
        shrink=False,
        lazy_free=mutant in LAZY_MUTANTS,
    )
    print(f"kill {mutant}: {json.dumps({k: r[k] for k in ('examples_to_kill', 'failure')})}")
    assert r["failure"] is not None, f"mutant {mutant} (caveat {caveat}) survived {r['examples']} examples"


@pytest.mark.parametrize(
    "examples", [pytest.param(1, id="one"), pytest.param(4, id="four", marks=pytest.mark.slow)]
)
def test_campaign_traces_are_spec_behaviours(tmp_path: Path, examples: int) -> None:
    """TLC itself checks every step of campaign traces against the spec (every step of every
    campaign is already checked against ``specstep``, the Python copy; this keeps TLC's word at
    campaign sizes in CI, and more of it in ``make test-long``)."""
    r = campaign(examples=examples, steps=40, seed=99, profile="ci", trace_dir=tmp_path)
    assert r["failure"] is None
    traces = sorted(tmp_path.glob("*.jsonl"))
    assert traces
    for t in traces:
        res = check_trace(t)
        assert res.ok, res.message


def _write(path: Path, r: Replayer, steps: list[dict[str, object]]) -> None:
    header = {
        "nodes": list(r.b.nodes),
        "sessions": list(r.b.sessions),
        "ttl": r.b.ttl,
        "dev_slots": r.b.dev_slots,
        "host_slots": r.b.host_slots,
        "max_time": r.b.max_time,
        "max_epoch": r.b.max_epoch,
    }
    path.write_text("\n".join(json.dumps(x) for x in [{"header": header}, *steps]) + "\n")


@pytest.mark.parametrize(
    "caveats", [frozenset(), frozenset({"EarlyRunnable"})], ids=["correct", "EarlyRunnable"]
)
def test_trace_check_finds_the_first_illegal_step(tmp_path: Path, caveats: frozenset[str]) -> None:
    """The same scenario traced on the correct and on a broken implementation: only the broken
    trace is refused, at the tool_end that made the session runnable before its load ack."""
    b = Bounds(
        nodes=("n1",),
        sessions=("s1",),
        dev_slots=10**6,
        host_slots=10**6,
        max_time=10**6,
        ttl=5,
        max_epoch=10**6,
    )
    r = Replayer(b, caveats=caveats, capacity="real", device_tokens=1024)
    try:
        steps: list[dict[str, object]] = [{"act": ["Init"], "fits": True, "state": r.abstract()}]
        for act in (
            ["Insert", "s1", "Root", "n1"],
            ["ToolStart", "s1"],
            ["WriteAck", "n1"],
            ["ToolEnd", "s1", 1],
            ["LoadAck", "n1"],
        ):
            try:
                res = r.apply(act)
            except Exception:
                break
            steps.append({"act": act, "fits": res.fits, "state": r.abstract()})
    finally:
        r.close()
    f = tmp_path / "t.jsonl"
    _write(f, r, steps)
    res = check_trace(f)
    if caveats:
        assert not res.ok and res.first_illegal == 4 and res.action == ["ToolEnd", "s1", 1], res
    else:
        assert res.ok, res.message


def test_the_environments_eviction_victim_is_strictly_the_least_recently_used() -> None:
    """The campaign's draws must depend only on Hypothesis's data: a replayed example has to take
    the same steps. sglang builds its LRU heap from a ``set`` of leaves, ordered by the nodes'
    addresses, so two leaves with equal access times are evicted in an order the run picks, not
    the step. The environment used to mark every victim with one constant, and a node GPU-evicted
    and then loaded back by a parked session's admission (sglang's ``load_back`` keeps its access
    time) met the next victim at that constant: a tie. Here every step is the spec's own, and the
    second victim must be the only least recently used leaf."""
    b = Bounds(
        nodes=("n1", "n2"), sessions=("s1", "s2"), dev_slots=2, host_slots=2, max_time=1, ttl=1, policy=True
    )
    r = Replayer(b, capacity="spec", fill=False)
    try:
        for act in (
            ["Insert", "s1", "Root", "n1"],
            ["Insert", "s2", "Root", "n2"],
            ["WriteThrough", "n1"],
            ["WriteAck", "n1"],
            ["GpuEvict", "n1"],  # the environment's first victim: n1 keeps its host copy
            ["ToolStart", "s1"],  # already backed up: offloaded at once, protected
            ["Park", "s1", "1"],
            ["Admit", "s1"],  # sglang's load_back brings n1 back, its access time unchanged
            ["LoadAck", "n1"],
            ["Unlock", "n1"],  # the request is done: n1 is an evictable device leaf again
        ):
            res = r.apply(act)
            assert res.error is None and not res.violations, (act, res.error, res.violations)
        tree = r.h.tree
        n1, n2 = r.obj("n1"), r.obj("n2")
        assert {n1, n2} <= tree.evictable_leaves
        r.make_lru(n2)  # what GpuEvict n2 does before sglang's evict
        prio = sorted(tree.eviction_strategy.get_priority(x) for x in tree.evictable_leaves)
        assert prio[0] == n2.last_access_time and prio[0] < prio[1], (
            n1.last_access_time,
            n2.last_access_time,
        )
    finally:
        r.close()
