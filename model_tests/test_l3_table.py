"""The L3 sub-machine's table (``toolkv.core.phases.L3_TRANSITIONS``) is the storage spec's relation.

``spec/storage/StorageTier.tla``'s phases ``Storing``, ``Stored`` and ``Prefetching`` are the
sub-phases ``rec.l3`` of an offloaded session (``storing``, ``stored``, ``fetching``); every other
phase is outside the sub-machine (``""``). As ``test_tables.py`` does for ``spec/ToolKV.tla``:

1. From TLC's full state graphs of the storage conformance models, extract for every edge each
   session's sub-phase change, labelled with the action (snake_case): that relation must equal the
   table (every row is reached, and nothing else is).
2. At the safety bounds (``MC_safety.cfg``, and ``MC_arrival.cfg`` with ``ReadAtArrival``) TLC checks an action property generated from the
   table: every sub-phase change any action makes is a row of it.

Changing the table or the spec without the other fails one of these.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import pytest

from toolkv.core import phases
from toolkv.core.lifecycle import relation
from toolkv.verify.storage.conformance import dump_storage_graph
from toolkv.verify.tla.tlc import StateGraph, Toolchain, run_tlc
from toolkv.verify.toolkv.conformance import GraphConfig, load_conformance

SPEC = Path(__file__).resolve().parents[1] / "spec" / "storage"
pytestmark = pytest.mark.tlc

#: a second graph: two sessions sharing a host of three pages, no refusals (as the storage replay's)
TWO_SESSIONS = GraphConfig(
    "storage_two",
    "MC_dump.cfg",
    (("Sessions", "{s1, s2}"), ("HostSlots", "3"), ("StoreFails", "FALSE")),
    ("hiradix",),
)


def snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def camel(name: str) -> str:
    return "".join(p.capitalize() for p in name.split("_"))


def _rows() -> set[tuple[str, str, str]]:
    """The table as (source, dest, trigger) over the sub-phases' values."""
    return {(str(a), str(b), t) for a, b, t in relation(phases.L3_TRANSITIONS)}


@pytest.fixture(scope="module")
def dumped(tools: Toolchain, tmp_path_factory: pytest.TempPathFactory) -> set[tuple[str, str, str]]:
    """Sub-phase changes on every edge of the storage conformance graphs."""
    graphs: list[StateGraph] = []
    for gc in [*load_conformance(SPEC)[0], TWO_SESSIONS]:
        g, _ = dump_storage_graph(tools, SPEC, gc, tmp_path_factory.mktemp(gc.name))
        graphs.append(g)
    out: set[tuple[str, str, str]] = set()
    for g in graphs:
        for u, v, label in g.edges:
            a: dict[str, Any] = g.states[u]
            b: dict[str, Any] = g.states[v]
            for s, phase in a["phase"].items():
                x, y = phases.of_spec_phase(phase), phases.of_spec_phase(b["phase"][s])
                if x != y:
                    out.add((x.value, y.value, snake(label)))
    return out


def test_the_table_is_the_storage_specs_relation(dumped: set[tuple[str, str, str]]) -> None:
    rows = _rows()
    assert not dumped - rows, f"spec sub-phase changes missing from L3_TRANSITIONS: {sorted(dumped - rows)}"
    assert not rows - dumped, f"L3_TRANSITIONS rows the spec never takes: {sorted(rows - dumped)}"


def test_the_sub_phases_are_the_specs() -> None:
    text = (SPEC / "StorageTier.tla").read_text()
    for phase in phases.SPEC_PHASE.values():
        assert f'"{phase}"' in text, phase
    assert {snake(m) for m in re.findall(r"^([A-Z][A-Za-z]*)\(s\) ==", text, re.M)} >= {
        t for _, _, t in _rows()
    }, "every trigger of the table is an action of StorageTier.tla"


def _module() -> str:
    sub = " [] ".join(f'p = "{phase}" -> "{k.value}"' for k, phase in phases.SPEC_PHASE.items())
    triggers = sorted({t for _, _, t in _rows()})
    acts = " [] ".join(f'a = "{t}" -> {camel(t)}(s)' for t in triggers)
    table = ", ".join(f'<<"{a}", "{b}", "{t}">>' for a, b, t in sorted(_rows()))
    return f"""---- MODULE L3Table ----
EXTENDS StorageTier
Sub(p) == CASE {sub} [] OTHER -> ""
Act(a, s) == CASE {acts} [] OTHER -> FALSE
Triggers == {{{", ".join(f'"{t}"' for t in triggers)}}}
L3Table == {{{table}}}
Moved(s) == Sub(phase[s]) # Sub(phase'[s])
\\* a sub-phase change is made by one of the table's actions, and is a row of it for that action
L3Rows == [][\\A s \\in Sessions : Moved(s) =>
               \\E a \\in Triggers : Act(a, s) /\\ <<Sub(phase[s]), Sub(phase'[s]), a>> \\in L3Table]_vars
====
"""


@pytest.mark.parametrize("cfg_name", ["MC_safety.cfg", "MC_arrival.cfg"])
def test_every_sub_phase_change_is_a_row_at_safety_bounds(
    tools: Toolchain, tmp_path: Path, cfg_name: str
) -> None:
    for f in SPEC.glob("*.tla"):
        shutil.copy(f, tmp_path / f.name)
    (tmp_path / "L3Table.tla").write_text(_module())
    cfg = (SPEC / cfg_name).read_text()
    if "PROPERTIES" in cfg:
        cfg = re.sub(r"PROPERTIES", "PROPERTIES\n    L3Rows", cfg, count=1)
    else:
        cfg += "\nPROPERTIES\n    L3Rows\n"
    (tmp_path / "L3Table.cfg").write_text(cfg)
    res = run_tlc(tools, tmp_path / "L3Table.tla", tmp_path / "L3Table.cfg")
    assert res.outcome == "pass", (
        f"a reachable sub-phase change is not in the L3 table:\n{res.output[-3000:]}"
    )
