"""``SPEC_CHECK_TLC_CACHE``: a TLC run read back instead of run again (toolkv.verify.tla.tlc.run_tlc).

``make test`` sets it to a directory it empties first, so the mutants ``toolkv spec-check`` ran
are not run again by the trace replays, and a conformance graph is dumped once for both pytest
workers. What must hold: only a run with the same inputs (the modules beside the root module, the
config, the options) is read back, it reads back the same verdict, trace and dumped graph, and a
run that did not finish is never reused.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from toolkv.verify.tla import tlc as tla

pytestmark = pytest.mark.tlc

TOY = """---- MODULE Toy ----
EXTENDS Naturals, Helper
CONSTANT Limit
VARIABLE x
Init == x = 0
Next == x < Limit /\\ x' = Step(x)
Small == x < 2
====
"""
HELPER = "---- MODULE Helper ----\nEXTENDS Naturals\nStep(v) == v + 1\n====\n"


CFG = "CONSTANT Limit = 3\nINIT Init\nNEXT Next\nINVARIANT Small\n"


def _write(folder: Path, toy: str = TOY, helper: str = HELPER, cfg: str = CFG) -> tuple[Path, Path]:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "Toy.tla").write_text(toy)
    (folder / "Helper.tla").write_text(helper)
    (folder / "Toy.cfg").write_text(cfg)
    return folder / "Toy.tla", folder / "Toy.cfg"


@pytest.fixture(scope="module")
def first(tools: tla.Toolchain, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, tla.TlcResult]:
    """The toy's first run, into a cache the module's tests share (one TLC run for all of them)."""
    base = tmp_path_factory.mktemp("tlc-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(tla.CACHE_ENV, str(base / "cache"))
        res = tla.run_tlc(tools, *_write(base / "spec"))
    assert not res.cached and (res.outcome, res.violated) == ("invariant", "Small"), res.output[-800:]
    return base / "cache", res


@pytest.fixture
def cache(first: tuple[Path, tla.TlcResult], monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(tla.CACHE_ENV, str(first[0]))
    return first[0]


def test_the_same_inputs_are_read_back_with_the_same_verdict_and_trace(
    tools: tla.Toolchain, first: tuple[Path, tla.TlcResult], cache: Path, tmp_path: Path
) -> None:
    # the same inputs in another directory (a pytest worker's own copy of the modules): read back
    again = tla.run_tlc(tools, *_write(tmp_path))
    res = first[1]
    assert again.cached
    assert (again.outcome, again.violated, again.distinct, again.exit_code, again.version) == (
        res.outcome,
        res.violated,
        res.distinct,
        res.exit_code,
        res.version,
    )
    assert again.trace is not None and res.trace is not None
    assert [s.values for s in again.trace.states] == [s.values for s in res.trace.states]


@pytest.mark.parametrize("change", ["cfg", "extended module", "option"])
def test_other_inputs_run_tlc_again(
    tools: tla.Toolchain, first: tuple[Path, tla.TlcResult], cache: Path, tmp_path: Path, change: str
) -> None:
    if change == "cfg":
        module, cfg = _write(tmp_path, cfg=CFG.replace("INVARIANT Small\n", ""))
    elif change == "extended module":
        module, cfg = _write(tmp_path, helper=HELPER.replace("v + 1", "v + 2"))
    else:
        module, cfg = _write(tmp_path)
    res = tla.run_tlc(tools, module, cfg, coverage=change == "option")
    assert not res.cached
    assert res.outcome == ("pass" if change == "cfg" else "invariant")
    if change == "extended module":  # Step(0) = 2 now: the counterexample is one step shorter
        assert res.trace is not None and first[1].trace is not None
        assert len(res.trace.states) == len(first[1].trace.states) - 1
    if change == "option":
        assert res.coverage is not None and "Next" in res.coverage


def test_a_dumped_graph_is_read_back_whole(tools: tla.Toolchain, cache: Path, tmp_path: Path) -> None:
    module, cfg = _write(tmp_path / "spec")
    g1 = tla.run_tlc(tools, module, cfg, dump_dot=tmp_path / "one")  # a dump: not the first run's
    g2 = tla.run_tlc(tools, module, cfg, dump_dot=tmp_path / "two")
    assert not g1.cached and g2.cached and g1.outcome == g2.outcome == "invariant"
    one, two = tla.read_dot(tmp_path / "one"), tla.read_dot(tmp_path / "two")
    assert len(one.states) >= 3 and (one.states, one.edges, one.initial) == (
        two.states,
        two.edges,
        two.initial,
    )


def test_a_run_that_did_not_finish_is_not_kept(
    tools: tla.Toolchain, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(tla.CACHE_ENV, str(tmp_path / "cache"))
    cut = tla.run_tlc(tools, *_write(tmp_path / "spec"), timeout=0.01)
    assert cut.outcome == "error" and not cut.cached
    assert not list((tmp_path / "cache").glob("*.json"))


def test_unset_means_every_call_runs_tlc(
    tools: tla.Toolchain, first: tuple[Path, tla.TlcResult], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(tla.CACHE_ENV, raising=False)
    res = tla.run_tlc(tools, *_write(tmp_path))  # the first run's inputs, in the cache: not read
    assert not res.cached and res.outcome == "invariant"
