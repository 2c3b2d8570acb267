"""The lifecycle tables in ``toolkv/lifecycle.py`` equal the spec's transition relations.

1. From TLC's full state graphs of the conformance models (``dump``, ``split``), extract for every
   edge each session's phase change and each node's tier change, labelled with the action
   (snake_case): that relation must be contained in the tables.
2. At the safety bounds (3 nodes, 2 sessions) TLC checks an action property generated from the
   tables: every phase and tier change is a table row. Rows the small dump cannot reach must be
   reached there (a witness TLC must refute).

Changing a table or the spec without the other fails one of these.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest

from toolkv.core import lifecycle
from toolkv.verify.tla.tlc import Toolchain, run_tlc

SPEC = Path(__file__).resolve().parents[1] / "spec"

pytestmark = pytest.mark.tlc


def snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def camel(name: str) -> str:
    return "".join(p.capitalize() for p in name.split("_"))


def spec_tier(st: dict[str, Any], n: str) -> str:
    """``Tier(n)`` of ToolKV.tla, over a parsed state."""
    if st["status"][n] == "Unborn":
        return "Unborn"
    if st["status"][n] == "Gone":
        return "Evicted"
    if st["dev"][n] and st["loadKey"][n] != "NoNode":
        return "Loading"
    if st["dev"][n] and st["writeKey"][n] != "NoNode":
        return "BackingUp"
    if st["dev"][n]:
        return "GPU"
    return "CpuProtected" if st["hostRef"][n] > 0 else "CpuUnprotected"


def _toolchain() -> Toolchain:
    try:
        return Toolchain.locate()
    except Exception as exc:  # pragma: no cover - environment dependent
        pytest.skip(f"TLC toolchain unavailable: {exc}")


@pytest.fixture(scope="module")
def dumped(graphs: Any) -> tuple[set[tuple[str, str, str]], set[tuple[str, str, str]]]:
    """Phase and tier changes on every edge of the conformance graphs (``dump``: two sessions;
    ``split``: two slots per tier, where splits happen), shared with the conformance replay."""
    sess: set[tuple[str, str, str]] = set()
    tiers: set[tuple[str, str, str]] = set()
    for name in ("dump", "split", "policy"):
        g, _ = graphs.get(name)
        states = g.states
        for u, v, label in g.edges:
            a, b = states[u], states[v]
            assert b["act"][0] == label, "the act history variable names the edge's action"
            act = snake(label)
            for s in a["phase"]:
                if a["phase"][s] != b["phase"][s]:
                    sess.add((a["phase"][s], b["phase"][s], act))
            for n in a["status"]:
                t1, t2 = spec_tier(a, n), spec_tier(b, n)
                if t1 != t2:
                    tiers.add((t1, t2, act))
    return sess, tiers


def test_dumped_session_relation_is_in_the_table(dumped: Any) -> None:
    sess, _ = dumped
    missing = sess - lifecycle.relation(lifecycle.SESSION_TRANSITIONS)
    assert not missing, f"spec session transitions missing from SESSION_TRANSITIONS: {sorted(missing)}"


def test_dumped_tier_relation_is_in_the_table(dumped: Any) -> None:
    _, tiers = dumped
    missing = tiers - lifecycle.relation(lifecycle.TIER_TRANSITIONS)
    assert not missing, f"spec tier transitions missing from TIER_TRANSITIONS: {sorted(missing)}"


def _tla_rows(rows: Iterable[tuple[str, str, str]]) -> str:
    return "{" + ", ".join(f'<<"{a}", "{b}", "{camel(t)}">>' for a, b, t in sorted(rows)) + "}"


def _module(extra: str) -> str:
    sess = lifecycle.relation(lifecycle.SESSION_TRANSITIONS)
    tiers = lifecycle.relation(lifecycle.TIER_TRANSITIONS)
    return f"""---- MODULE Tables ----
EXTENDS ToolKV
SessionTable == {_tla_rows(sess)}
TierTable == {_tla_rows(tiers)}
SessionRows == [][\\A s \\in Sessions : phase'[s] # phase[s] =>
                      <<phase[s], phase'[s], act'[1]>> \\in SessionTable]_vars
TierRows == [][\\A n \\in Nodes : Tier(n)' # Tier(n) => <<Tier(n), Tier(n)', act'[1]>> \\in TierTable]_vars
{extra}
====
"""


def _check(tmp: Path, extra: str, properties: list[str]) -> Any:
    tools = _toolchain()
    for f in SPEC.glob("*.tla"):
        shutil.copy(f, tmp / f.name)
    (tmp / "Tables.tla").write_text(_module(extra))
    cfg = (SPEC / "MC_policy.cfg").read_text()  # the safety bounds with the policy's actions on
    cfg = re.sub(r"PROPERTIES", "PROPERTIES\n    " + "\n    ".join(properties), cfg, count=1)
    (tmp / "Tables.cfg").write_text(cfg)
    return run_tlc(tools, tmp / "Tables.tla", tmp / "Tables.cfg")


@pytest.mark.slow  # make test-long: the policy config's whole state space again (docs/testing.md)
def test_tables_contain_every_transition_at_safety_bounds(tmp_path: Path) -> None:
    res = _check(tmp_path, "", ["SessionRows", "TierRows"])
    assert res.outcome == "pass", f"a reachable transition is not in the tables:\n{res.output[-3000:]}"


def test_table_rows_beyond_the_dump_are_reachable(dumped: Any, tmp_path: Path) -> None:
    sess, tiers = dumped
    extra_rows = [("phase", r) for r in lifecycle.relation(lifecycle.SESSION_TRANSITIONS) - sess]
    extra_rows += [("tier", r) for r in lifecycle.relation(lifecycle.TIER_TRANSITIONS) - tiers]
    for i, (kind, (a, b, t)) in enumerate(sorted(extra_rows)):
        if kind == "phase":
            body = f'\\A s \\in Sessions : ~(phase[s] = "{a}" /\\ phase\'[s] = "{b}" /\\ act\'[1] = "{camel(t)}")'
        else:
            body = f'\\A n \\in Nodes : ~(Tier(n) = "{a}" /\\ Tier(n)\' = "{b}" /\\ act\'[1] = "{camel(t)}")'
        d = tmp_path / f"w{i}"
        d.mkdir()
        res = _check(d, f"NeverRow == [][{body}]_vars", ["NeverRow"])
        assert res.outcome == "action_property" and res.violated == "NeverRow", (
            f"table row {kind} {a} -> {b} via {t} is unreachable in the spec:\n{res.output[-2000:]}"
        )
