"""The package map as rules, and the layout measures: file sizes, import cycles, upward imports.

``ALLOWED`` is the one statement of which package may import which (``tests/test_layers.py``
enforces it on every module; docs/architecture.md draws it). Imports are read with ``ast``, so a
lazy import inside a function counts as much as one at the top of a module.

``python -m toolkv.tools.layout`` prints the measures; ``toolkv docs --layout`` writes the same
block into docs/architecture.md, and ``tests/test_docs.py`` fails when the two disagree.
Standard library only.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

PKG = Path(__file__).resolve().parents[1]

# package -> the toolkv packages it may import besides itself ("toolkv" is the top-level
# ``__init__``: ``__version__``). ``tools`` is the top layer and may import anything; nothing
# imports it.
ALLOWED: dict[str, set[str]] = {
    "toolkv": set(),
    "toolkv.errors": set(),
    "toolkv.argtypes": set(),  # bounded values of the command lines and the TOOLKV_* settings
    "toolkv.workload": set(),
    "toolkv.core": {"toolkv", "toolkv.errors", "toolkv.argtypes"},
    # the client builds its requests from the core's request types and reads its phases and record
    # keys (toolkv.core.requests, .result, .session.phases: the standard library and transitions)
    "toolkv.client": {"toolkv", "toolkv.errors", "toolkv.core"},
    "toolkv.testing": {"toolkv"},
    "toolkv.sglang": {"toolkv", "toolkv.errors", "toolkv.argtypes", "toolkv.core"},
    "toolkv.verify": {"toolkv", "toolkv.errors", "toolkv.argtypes", "toolkv.core", "toolkv.testing"},
    # the twin drives the real caches (testing) and toolkv's scheduler side (sglang) under the
    # agent workload; only the command line (tools) imports it
    "toolkv.twin": {
        "toolkv",
        "toolkv.errors",
        "toolkv.argtypes",
        "toolkv.core",
        "toolkv.sglang",
        "toolkv.testing",
        "toolkv.workload",
    },
    "toolkv.tools": set(),  # top layer: anything (checked separately: nothing imports it)
}
TOP = "toolkv.tools"

# Floors inside a package: floor -> the floors of the same package it may import besides itself.
# A module's floor is the longest key that is its name or a prefix of it ending at a dot; the
# package's modules under no other key are its ground floor (the package's own name). Between
# packages ``ALLOWED`` rules; these order the imports that stay inside one.
FLOORS: dict[str, dict[str, set[str]]] = {
    "toolkv.core": {
        # ground: the data every floor reads (lifecycle, phases, record, treeops, timers, policy,
        # settings, config, result, capabilities)
        "toolkv.core": set(),
        "toolkv.core.backends": {"toolkv.core"},  # move the KV; read records and trees
        "toolkv.core.session": {"toolkv.core", "toolkv.core.backends"},  # the session machine
        "toolkv.core.calls": {"toolkv.core", "toolkv.core.session"},  # the call policies over it
        # the front door, and the one place that picks a backend
        "toolkv.core.manager": {
            "toolkv.core",
            "toolkv.core.backends",
            "toolkv.core.session",
            "toolkv.core.calls",
        },
    },
}

BIG_LINES = 600  # a file over this many lines is listed, and needs a reason below
# why a file is over BIG_LINES lines: one sentence each; a large file without one is a measure
# (``unreasoned``), so the next one that grows past 600 lines is split or says why it is not
REASONS: dict[str, str] = {
    "toolkv/verify/toolkv/world.py": "the refinement world: one method per spec action over the real caches, "
    "each with its checks; splitting it would split the mapping from the spec",
    "toolkv/verify/toolkv/spec.py": "the executable spec, action for action with ToolKV.tla, so the two read side by side",
    "toolkv/verify/toolkv/fuzzing.py": "one Hypothesis state machine: its rules are the spec's actions",
    "toolkv/verify/toolkv/conformance.py": "the replay of TLC's state graph: the walk, the edge checks and their report",
    "toolkv/verify/storage/world.py": "the L3 tier's refinement world, as toolkv/world.py is toolkv's",
    "toolkv/tools/soak.py": "one command: the soak's loop, its checks and its report (a tool, not a library)",
    "toolkv/twin/storage.py": "the L3 tier on the twin's clock: sglang's storage threads replaced by timed "
    "operations in one place, so their timing is one model",
    "toolkv/sglang/plugin.py": "every hook toolkv registers with sglang, in one file so the whole "
    "attachment to a server can be read and audited at once",
    "toolkv/sglang/scheduler_side.py": "the scheduler process's side of every session call and hook",
}
# what only the one server stand-in may build (toolkv/twin/server.py): the scheduler model
# (``make_scheduler``, the one factory) and sglang's requests (``Req``, the one request builder)
STAND_IN_CALLS = frozenset({"make_scheduler", "Req"})
HUGE_LINES = 1000
COMMAND = "toolkv docs --layout"
BEGIN, END = "<!-- BEGIN layout (generated: toolkv docs --layout) -->", "<!-- END layout -->"


def layer_of(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "toolkv"
    cand = ".".join(parts[:2])
    return cand if cand in ALLOWED else "toolkv"


def floor_of(module: str) -> str:
    """The floor of ``module`` inside its package (the package itself where it has no floors)."""
    pkg = layer_of(module)
    floors = FLOORS.get(pkg, {})
    hits = [f for f in floors if module == f or module.startswith(f + ".")]
    return max(hits, key=len) if hits else pkg


def module_name(path: Path, pkg: Path = PKG) -> str:
    rel = path.relative_to(pkg.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every toolkv import in ``path``, lazy ones included. ``from toolkv import
    x`` names ``toolkv.x`` (a submodule or ``__version__``)."""
    out: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "toolkv"]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "toolkv":
            if node.module == "toolkv":
                out += [(node.lineno, f"toolkv.{a.name}") for a in node.names]
            else:
                out.append((node.lineno, node.module))
    return out


def modules(pkg: Path = PKG) -> list[Path]:
    return sorted(p for p in pkg.rglob("*.py") if "__pycache__" not in p.parts)


@cache
def _edges(pkg: Path = PKG) -> tuple[tuple[str, int, str], ...]:
    """(importing module, line, imported module) for every toolkv import in the package."""
    return tuple((module_name(p, pkg), line, t) for p in modules(pkg) for line, t in imports_of(p))


def upward_imports(pkg: Path = PKG) -> list[str]:
    """Imports that break ``ALLOWED`` (a package importing one that is not below it) or
    ``FLOORS`` (a module importing a floor of its own package that is not below its own)."""
    bad = []
    for mod, line, target in _edges(pkg):
        me, other = layer_of(mod), layer_of(target)
        if me == TOP:
            continue
        if other == me:
            mine, theirs = floor_of(mod), floor_of(target)
            if mine != theirs and theirs not in FLOORS[me][mine]:
                bad.append(f"{mod}:{line} imports {target} ({theirs} is not below {mine})")
            continue
        if other not in ALLOWED[me]:
            bad.append(f"{mod}:{line} imports {target} ({other} is not below {me})")
    return bad


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def package_graph(pkg: Path = PKG) -> dict[str, set[str]]:
    g: dict[str, set[str]] = {}
    for mod, _line, target in _edges(pkg):
        a, b = layer_of(mod), layer_of(target)
        if a != b:
            g.setdefault(a, set()).add(b)
    return g


def floor_graph(pkg: Path = PKG) -> dict[str, set[str]]:
    """The imports between packages and between the floors of one (``FLOORS``)."""
    g: dict[str, set[str]] = {}
    for mod, _line, target in _edges(pkg):
        a, b = floor_of(mod), floor_of(target)
        if a != b:
            g.setdefault(a, set()).add(b)
    return g


def package_cycles(pkg: Path = PKG) -> list[list[str]]:
    """Packages, or floors of one, that import each other, directly or around a loop (lazy
    imports included)."""
    return _cycles(floor_graph(pkg))


def module_cycles(pkg: Path = PKG) -> list[list[str]]:
    """Modules that import each other at import time (a lazy import inside a function is how a
    module breaks such a loop, so only module-level imports count here)."""
    known = {module_name(p, pkg) for p in modules(pkg)}
    g: dict[str, set[str]] = {}
    for p in modules(pkg):
        mod = module_name(p, pkg)
        for node in ast.parse(p.read_text()).body:
            targets: Iterable[str] = ()
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # `from pkg import sub` imports the submodule when there is one
                targets = [
                    f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module
                    for a in node.names
                ]
            for t in targets:
                if t in known and t != mod:
                    g.setdefault(mod, set()).add(t)
    return _cycles(g)


def file_sizes(pkg: Path = PKG, over: int = BIG_LINES) -> list[tuple[str, int]]:
    """(path under the package's parent, lines) of every file over ``over`` lines, largest first."""
    sizes = [(str(p.relative_to(pkg.parent)), len(p.read_text().splitlines())) for p in modules(pkg)]
    return sorted(((f, n) for f, n in sizes if n > over), key=lambda x: (-x[1], x[0]))


def stand_ins(pkg: Path = PKG) -> list[str]:
    """Modules that build a server stand-in's parts themselves: a call of ``make_scheduler`` or
    of sglang's ``Req`` (one module, ``toolkv.twin.server``, when there is one stand-in)."""
    out = []
    for p in modules(pkg):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Call):
                f = node.func
                name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
                if name in STAND_IN_CALLS:
                    out.append(module_name(p, pkg))
                    break
    return sorted(out)


@dataclass(frozen=True)
class Measures:
    files: int
    lines: int
    big: list[tuple[str, int]]  # files over BIG_LINES lines, largest first
    package_cycles: list[list[str]]
    module_cycles: list[list[str]]
    upward_imports: list[str]
    stand_ins: list[str]  # modules that build the scheduler model or sglang's requests

    @property
    def unreasoned(self) -> list[str]:
        """Files over BIG_LINES lines without a sentence in REASONS."""
        return sorted(f for f, _n in self.big if f not in REASONS)


def measures(pkg: Path = PKG) -> Measures:
    files = modules(pkg)
    return Measures(
        files=len(files),
        lines=sum(len(p.read_text().splitlines()) for p in files),
        big=file_sizes(pkg, BIG_LINES),
        package_cycles=package_cycles(pkg),
        module_cycles=module_cycles(pkg),
        upward_imports=upward_imports(pkg),
        stand_ins=stand_ins(pkg),
    )


def _list(items: list[str]) -> str:
    return ", ".join(items) if items else "none"


def _cycle_list(cycles: list[list[str]]) -> str:
    return _list([" <-> ".join(c) for c in cycles])


def block(pkg: Path = PKG) -> str:
    """The block docs/architecture.md shows: the command, then one line per measure. Large files
    are named by threshold, not by line count, so an edit that keeps a file on the same side of
    600 and 1,000 lines leaves the block as it is."""
    m = measures(pkg)
    huge = sorted(f for f, n in m.big if n > HUGE_LINES)
    mid = sorted(f for f, n in m.big if n <= HUGE_LINES)
    return "\n".join(
        [
            BEGIN,
            f"`{COMMAND}` (prints the same with line counts: `python -m toolkv.tools.layout`):",
            "",
            f"- files over {HUGE_LINES:,} lines: {len(huge)} ({_list(huge)})",
            f"- files of {BIG_LINES + 1}-{HUGE_LINES:,} lines: {len(mid)} ({_list(mid)})",
            f"- package import cycles, lazy imports included: {len(m.package_cycles)} ({_cycle_list(m.package_cycles)})",
            f"- module import cycles at import time: {len(m.module_cycles)} ({_cycle_list(m.module_cycles)})",
            f"- upward imports against the map: {len(m.upward_imports)} ({_list(m.upward_imports)})",
            f"- files over {BIG_LINES} lines without a stated reason (`REASONS`): {len(m.unreasoned)} ({_list(m.unreasoned)})",
            f"- server stand-ins (modules that build the scheduler model or sglang's `Req`): {len(m.stand_ins)} ({_list(m.stand_ins)})",
            END,
        ]
    )


def main(argv: list[str] | None = None) -> int:
    """Print the measures, with each large file's line count."""
    del argv
    m = measures()
    print(f"{m.files} modules, {m.lines:,} lines; over {BIG_LINES} lines:")
    for f, n in m.big:
        print(f"  {n:>6,}  {f}  ({REASONS.get(f, 'no reason stated')})")
    print(block())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
