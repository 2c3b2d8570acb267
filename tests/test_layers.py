"""The package map of ``toolkv/__init__`` and docs/architecture.md holds: every import inside toolkv
points down (or sideways within its own package), and no two packages import each other. The rules
are ``toolkv.tools.layout.ALLOWED``; imports are read with ``ast``, so lazy imports inside functions
count too."""

from __future__ import annotations

from pathlib import Path

import pytest

from toolkv.tools.layout import (
    ALLOWED,
    BIG_LINES,
    FLOORS,
    PKG,
    REASONS,
    TOP,
    imports_of,
    layer_of,
    measures,
    module_cycles,
    module_name,
    modules,
    package_cycles,
    package_graph,
    stand_ins,
    upward_imports,
)

MODULES = modules()


@pytest.mark.parametrize("path", MODULES, ids=[module_name(p) for p in MODULES])
def test_imports_point_down(path: Path) -> None:
    me = layer_of(module_name(path))
    if me == TOP:
        return
    bad = []
    for line, target in imports_of(path):
        other = layer_of(target)
        if other != me and other not in ALLOWED[me]:
            bad.append(f"{path.name}:{line} imports {target} ({other} is not below {me})")
    assert not bad, "\n".join(bad)


def test_every_module_has_a_layer() -> None:
    """A new top-level module or package must be placed in ALLOWED deliberately."""
    top = {module_name(p) for p in PKG.glob("*.py")} | {module_name(p) for p in PKG.glob("*/__init__.py")}
    assert top <= set(ALLOWED), sorted(top - set(ALLOWED))


def test_no_package_imports_the_command_line() -> None:
    """``tools`` is the top: nothing imports it (the twin imports the workload, never tools)."""
    importers = sorted(a for a, bs in package_graph().items() if TOP in bs)
    assert importers == [], importers


def test_the_twin_is_imported_by_the_command_line_only() -> None:
    importers = sorted(a for a, bs in package_graph().items() if "toolkv.twin" in bs)
    assert importers in ([], [TOP]), importers


def test_the_package_never_imports_the_checkout_research() -> None:
    """``research/`` (sglang's decode-side offload, a feature toolkv refuses) is not in the wheel, so
    no module of the package may import it, lazily or not."""
    import ast

    bad = []
    for path in MODULES:
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            bad += [
                f"{module_name(path)}:{node.lineno} imports {n}"
                for n in names
                if n.split(".")[0] == "research"
            ]
    assert not bad, "\n".join(bad)


def test_no_import_cycles() -> None:
    """No two packages import each other (around any loop, lazy imports included), and no module
    imports itself back at import time."""
    assert package_cycles() == []
    assert module_cycles() == []


def test_wire_errors_are_one_class_on_both_sides() -> None:
    """The server raises them from ``toolkv.errors``; agents keep importing them from the client."""
    from toolkv import client, errors

    assert client.ToolKVUnavailable is errors.ToolKVUnavailable
    assert client.SchedulerTimeout is errors.SchedulerTimeout
    assert {"ToolKVUnavailable", "SchedulerTimeout"} <= set(client.__all__)


def test_rules_have_no_cycle() -> None:
    """The map itself is a stack: the allowed imports form no loop."""
    seen: set[str] = set()

    def below(p: str, path: tuple[str, ...]) -> None:
        assert p not in path, " -> ".join((*path, p))
        if p in seen:
            return
        for q in ALLOWED[p] - {p}:
            below(q, (*path, p))
        seen.add(p)

    for p in ALLOWED:
        below(p, ())


def test_checker_catches_an_upward_import(tmp_path: Path) -> None:
    """The check itself can fail: an upward import in core is reported, and so is the twin
    importing the command line."""
    f = tmp_path / "x.py"
    f.write_text(
        "def f():\n    from toolkv.verify.tla.tlc import run_tlc\n    import toolkv.tools.value_report\n"
    )
    targets = [t for _, t in imports_of(f)]
    assert [layer_of(t) for t in targets] == ["toolkv.verify", TOP]
    assert "toolkv.verify" not in ALLOWED["toolkv.core"]
    assert TOP not in ALLOWED["toolkv.twin"]


def test_cycle_finder_finds_a_cycle(tmp_path: Path) -> None:
    pkg = tmp_path / "toolkv"
    (pkg / "core").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "core" / "__init__.py").write_text("")
    (pkg / "core" / "a.py").write_text("import toolkv.core.b\n")
    (pkg / "core" / "b.py").write_text("from toolkv.core import a\n")
    assert module_cycles(pkg) == [["toolkv.core.a", "toolkv.core.b"]]


def test_one_server_stand_in() -> None:
    """Only ``toolkv.twin.server`` builds the scheduler model and sglang's requests: the twin, the
    fleet, the L3 map, the soak and the demo all drive that one stand-in."""
    assert stand_ins() == ["toolkv.twin.server"]


def test_every_stated_reason_is_for_a_large_file() -> None:
    """A reason for a file that is no longer over the limit is stale."""
    big = {f for f, _n in measures().big}
    stale = sorted(f for f in REASONS if f not in big)
    assert not stale, f"not over {BIG_LINES} lines any more, drop from REASONS: {stale}"


def test_every_large_file_states_why() -> None:
    """A file over the limit is split, or says in ``REASONS`` why it is one piece."""
    assert measures().unreasoned == []


def test_floors_point_down_and_the_checker_sees_one_that_does_not(tmp_path: Path) -> None:
    """Inside core the floors order the imports (``FLOORS``): the ground floor's data under the
    backends, the backends under the session machine, that under the call policies and the
    manager. The package holds it, the map is a stack, and a backend that imports the session
    machine (as the records once made every backend do) is reported."""
    assert upward_imports() == []
    for pkg, floors in FLOORS.items():
        assert pkg in floors and set().union(*floors.values()) <= set(floors), pkg
        order = sorted(floors, key=lambda f: len(floors[f]))
        for i, f in enumerate(order):
            assert floors[f] <= set(order[:i]), f"{f} may import a floor that is not below it"

    def package(name: str, pin: str) -> Path:
        root = tmp_path / name / "toolkv"
        for sub in ("core", "core/backends", "core/session"):
            (root / sub).mkdir(parents=True, exist_ok=True)
            (root / sub / "__init__.py").write_text("")
        (root / "__init__.py").write_text("")
        (root / "core" / "record.py").write_text("")
        (root / "core" / "backends" / "pin.py").write_text(pin)
        (root / "core" / "session" / "machine.py").write_text("from toolkv.core.backends.pin import y\n")
        return root

    assert upward_imports(package("good", "from toolkv.core.record import x\n")) == []
    bad = package("bad", "from toolkv.core.session.machine import z\n")
    assert upward_imports(bad) == [
        "toolkv.core.backends.pin:1 imports toolkv.core.session.machine"
        " (toolkv.core.session is not below toolkv.core.backends)"
    ]
    assert package_cycles(bad) == [["toolkv.core.backends", "toolkv.core.session"]]
