"""The installed package is complete: built as a wheel and used from outside the checkout, it has
the TLA+ spec `toolkv spec-check` needs, and its metadata declares what its code and tests import."""

from __future__ import annotations

import ast
import importlib.metadata
import os
import re
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

from _wheel import build_wheel

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
# provided by the serving environment, deliberately not declared (see pyproject.toml)
SERVING_STACK = {
    "torch",
    "sglang",
    "uvloop",
    "transformers",
}  # uvloop: sglang's HTTP server (a stand-in imports it if present); transformers: sglang's tokenizer
# loader (the GPU staging's tokenizer test loads the built tokenizer the way sglang does)


def _third_party_imports(paths: list[Path]) -> set[str]:
    mods: set[str] = set()
    for f in paths:
        for n in ast.walk(ast.parse(f.read_text())):
            if isinstance(n, ast.Import):
                mods |= {a.name.split(".")[0] for a in n.names}
            elif isinstance(n, ast.ImportFrom) and n.module and n.level == 0:
                mods.add(n.module.split(".")[0])
    local = {"toolkv", "conftest", "research"} | {
        p.stem for p in (ROOT / "tests").glob("*.py")
    }  # test helper modules
    return {m for m in mods if m not in sys.stdlib_module_names and m not in local}


def _dists(requirements: list[str]) -> set[str]:
    out = set()
    for r in requirements:
        m = re.match(r"[A-Za-z0-9_.-]+", r)
        assert m, r
        out.add(m.group(0).lower().replace("_", "-"))
    return out


def _dist_of(module: str) -> str:
    names = importlib.metadata.packages_distributions().get(module, [module])
    return names[0].lower().replace("_", "-")


def test_metadata_declares_what_the_code_and_tests_import() -> None:
    project = PYPROJECT["project"]
    deps = _dists(project["dependencies"])
    extras = {k: _dists(v) for k, v in project["optional-dependencies"].items()}
    assert {"transitions", "prometheus-client"} <= deps
    client = {_dist_of(m) for m in _third_party_imports(sorted((ROOT / "toolkv" / "client").glob("*.py")))}
    assert client <= deps | extras["client"], client - deps - extras["client"]
    tests = [*ROOT.glob("tests/*.py"), *ROOT.glob("fuzz/*.py"), *ROOT.glob("model_tests/*.py")]
    needed = {_dist_of(m) for m in _third_party_imports(tests) - SERVING_STACK}
    assert needed <= deps | extras["test"], needed - deps - extras["test"]


def test_every_package_is_listed() -> None:
    listed = set(PYPROJECT["tool"]["setuptools"]["packages"])
    on_disk = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "toolkv").rglob("__init__.py")}
    assert on_disk <= listed, f"add to [tool.setuptools] packages: {sorted(on_disk - listed)}"


def test_installed_wheel_carries_the_spec_and_spec_check_finds_it(tmp_path: Path) -> None:
    wheel = build_wheel(tmp_path)
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as z:  # a pure-Python wheel is installed by unpacking it
        names = z.namelist()
        z.extractall(site)
    manifest = tomllib.loads((ROOT / "spec" / "configs.toml").read_text())
    needed = {c["cfg"] for c in manifest["config"]} | {c["module"] for c in manifest["config"]}
    needed |= set(manifest.get("sany", []))
    shipped = {n.removeprefix("toolkv/spec_files/") for n in names if n.startswith("toolkv/spec_files/")}
    assert {"ToolKV.tla", "configs.toml"} <= shipped
    # what the plugin and its commands run, nothing else: the checkout's research code (a model of
    # sglang's decode-side offload, which toolkv refuses) and its spec stay out of the wheel
    assert not [n for n in names if n.startswith("research/")], "research/ is not part of the package"
    assert not [n for n in shipped if n.startswith("decode/")], "spec/decode is checked from a checkout"
    assert needed <= shipped, sorted(needed - shipped)
    env = dict(os.environ, PYTHONPATH=str(site))
    p = subprocess.run(
        [sys.executable, "-c",
         "import toolkv, sys; from toolkv.tools.cli import main; print(toolkv.__file__);"
         " sys.exit(main(['spec-check', '--list']))"],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300, check=False,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.splitlines()[0].startswith(str(site)), "the installed copy, not the checkout"
    assert "mut_HostLockLeak" in p.stdout and "safety" in p.stdout
