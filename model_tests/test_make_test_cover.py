"""What ``make test`` leaves to ``make test-long`` is covered by something ``make test`` still runs.

``make test`` runs every test not marked ``slow``; ``make test-long`` runs all of them. A check moved
to ``make test-long`` for time (docs/testing.md, "How long `make test` takes") must leave behind a
cheaper one of the same property. The checks below are the premises of each such move, so a change
that breaks one (a graph renamed, a backend added, a cover test removed) fails here instead of
leaving the property unchecked by ``make test``:

* **Conformance replays** (``model_tests/test_conformance.py``, ``LONG_CASES``): every graph keeps
  at least one replay, every backend and every policy keeps at least one, every moved replay names
  its cover, and the covers it names exist and are not ``slow``. That every spec action is still
  replayed on the kept replays is ``test_every_spec_action_is_replayed`` itself, under
  ``make test``.
* **Tests marked slow from** ``conftest.py`` (``LONG``): each names its cover, a test that exists
  and is not ``slow``; a kill-table search moved is covered by TLC's counterexample for the same
  defect replayed on the same broken implementation (the same caveat and environment switches).
"""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def _module(rel: str) -> ModuleType:
    path = ROOT / rel
    name = "_cover_" + path.stem
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def _tests(rel: str) -> dict[str, list[str]]:
    """The test functions of a module (without importing it) -> the names of their decorators."""
    tree = ast.parse((ROOT / rel).read_text())
    out: dict[str, list[str]] = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
            out[node.name] = [ast.unparse(d) for d in node.decorator_list]
    return out


def _not_slow(rel: str, name: str) -> bool:
    tests = _tests(rel)
    assert name in tests, f"{rel} has no {name}"
    return not any("slow" in d for d in tests[name])


def test_every_graph_backend_and_policy_keeps_a_replay_in_make_test() -> None:
    conf = _module("model_tests/test_conformance.py")
    cases, moved = set(conf.CASES), set(conf.LONG_CASES)
    assert moved <= cases, f"LONG_CASES names replays that do not exist: {moved - cases}"
    kept = cases - moved
    for i, what in enumerate(("graph", "backend", "policy")):
        every, left = {c[i] for c in cases}, {c[i] for c in kept}
        assert every == left, f"no replay of {what} {every - left} left in make test"
    assert all(reason.strip() for reason in conf.LONG_CASES.values())


def test_the_moved_split_replays_are_covered_by_the_split_tests() -> None:
    """A Split on a plain RadixCache backend (pin, shadow) is replayed only on the split graph; its
    cover is ``tests/test_backends_split.py``, which checks each step against the spec's successor
    on each backend."""
    conf = _module("model_tests/test_conformance.py")
    rel = "tests/test_backends_split.py"
    tests = _tests(rel)
    for graph, backend, _ in conf.LONG_CASES:
        if graph != "split":
            continue
        covers = [t for t in tests if t.startswith(f"test_{backend}_split")]
        assert covers, f"no {rel} test of a split on {backend}"
        assert all(_not_slow(rel, t) for t in covers), covers
        assert rel in conf.LONG_CASES[(graph, backend, "offload")]


def test_the_moved_policy_replays_leave_their_covers_in_make_test() -> None:
    """The policy graph on the plain backends and with ``auto``: the graph stays replayed on the
    HiRadixCache, each backend on the locks graph, ``auto`` on policy_auto and in the campaign."""
    conf = _module("model_tests/test_conformance.py")
    kept = set(conf.CASES) - set(conf.LONG_CASES)
    for graph, backend, policy in conf.LONG_CASES:
        if graph != "policy":
            continue
        assert ("policy", "hiradix", "offload") in kept
        if policy == "auto":
            assert any(g != graph and p == "auto" for g, _, p in kept), "auto replayed nowhere else"
            assert "TestToolKVMachineAuto" in (ROOT / "fuzz" / "test_stateful.py").read_text()
        else:
            assert ("locks", backend, "offload") in kept, f"{backend}: no locks replay in make test"


def _node(nodeid: str) -> tuple[str, str, str | None]:
    path, _, rest = nodeid.partition("::")
    name, _, param = rest.partition("[")
    return path, name, param.rstrip("]") or None


def test_every_test_moved_from_conftest_names_a_cover_that_make_test_runs() -> None:
    long = _module("conftest.py").LONG
    for moved, cover in long.items():
        path, name, _ = _node(moved)
        assert name in _tests(path), f"LONG names a test that does not exist: {moved}"
        cpath, cname, _ = _node(cover)
        assert (cpath, cname) != (path, name), moved
        assert _not_slow(cpath, cname), f"the cover of {moved} is not run by make test: {cover}"


def test_a_moved_kill_search_is_covered_by_the_same_defects_tlc_trace() -> None:
    from toolkv.tools.fuzz_cli import MUTANTS as KILL

    conf = _module("model_tests/test_conformance.py")
    trace = "model_tests/test_conformance.py::test_mutant_trace_reproduces_on_the_broken_implementation_only"
    for moved, cover in _module("conftest.py").LONG.items():
        path, name, mutant = _node(moved)
        if (path, name) != ("fuzz/test_stateful.py", "test_every_mutant_is_killed"):
            continue
        assert mutant in KILL and cover == f"{trace}[{mutant}]", (moved, cover)
        assert mutant in conf.MUTANTS, f"no TLC trace of {mutant} is replayed"
        caveats, env_bugs, _ = KILL[mutant]
        assert conf.MUTANTS[mutant][:2] == (caveats, env_bugs), f"{mutant}: other switches"
