"""The package layers of ``toolkv/__init__``: every import inside toolkv points down (or sideways
within its own package). Read with ``ast``, so lazy imports inside functions count too."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "toolkv"

# package -> the toolkv packages it may import (besides itself)
ALLOWED: dict[str, set[str]] = {
    "toolkv": set(),
    "toolkv.errors": set(),
    "toolkv.core": {"toolkv", "toolkv.errors"},
    "toolkv.client": {"toolkv", "toolkv.errors"},
    "toolkv.testing": {"toolkv"},
    "toolkv.sglang": {"toolkv", "toolkv.errors", "toolkv.core", "toolkv.client"},
    "toolkv.verify": {"toolkv", "toolkv.errors", "toolkv.core", "toolkv.testing"},
    "toolkv.tools": set(),  # top layer: anything
    # the twin drives the real cache (testing), toolkv's scheduler side and the benchmark's workload
    # and metrics (tools); only the command line imports it
    "toolkv.twin": {
        "toolkv",
        "toolkv.errors",
        "toolkv.core",
        "toolkv.sglang",
        "toolkv.testing",
        "toolkv.tools",
    },
}


def layer_of(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "toolkv"
    cand = ".".join(parts[:2])
    return cand if cand in ALLOWED else "toolkv"


def module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path) -> list[tuple[int, str]]:
    out: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "toolkv"]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "toolkv":
            if node.module == "toolkv":  # `from toolkv import x` names a submodule or __version__
                out += [(node.lineno, f"toolkv.{a.name}") for a in node.names]
            else:
                out.append((node.lineno, node.module))
    return out


MODULES = sorted(PKG.rglob("*.py"))


@pytest.mark.parametrize("path", MODULES, ids=[module_name(p) for p in MODULES])
def test_imports_point_down(path: Path) -> None:
    me = layer_of(module_name(path))
    if me == "toolkv.tools":
        return
    bad = []
    for line, target in imports_of(path):
        other = layer_of(target)
        if other != me and other not in ALLOWED[me]:
            bad.append(f"{path.name}:{line} imports {target} ({other} is not below {me})")
    assert not bad, "\n".join(bad)


def test_every_module_has_a_layer() -> None:
    """A new top-level module must be placed in ALLOWED deliberately."""
    top = {module_name(p) for p in PKG.glob("*.py")} | {module_name(p) for p in PKG.glob("*/__init__.py")}
    assert top <= set(ALLOWED), sorted(top - set(ALLOWED))


def test_checker_catches_an_upward_import(tmp_path: Path) -> None:
    """The check itself can fail: an upward import in core is reported."""
    f = tmp_path / "x.py"
    f.write_text("def f():\n    from toolkv.verify.tla import run_tlc\n")
    targets = [t for _, t in imports_of(f)]
    assert [layer_of(t) for t in targets] == ["toolkv.verify"]
    assert "toolkv.verify" not in ALLOWED["toolkv.core"]
