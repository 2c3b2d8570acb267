"""The install that README's "Operating it" step 1 and docs/operations.md §1 describe, followed as
written: the commands are read out of the two documents, not restated here.

toolkv is on no package index, so the documents say to build the wheel from a checkout and install
that file, plain on the server and with the ``client`` extra where agents run. This test copies the
checkout, runs the documented build command in the copy (adding ``--no-build-isolation``, the
documented variant for a machine without a package index), installs the file it made into two
fresh virtual environments with the documented ``pip install`` commands (adding ``--no-deps
--no-index``: nothing is fetched), and runs the documented checks there, comparing each with the
output the document shows after ``# ->``. The runtime dependencies the plain install would fetch
are checked in the wheel's metadata instead, and the consequence the documents state for
``--no-deps`` (an enabled plugin refuses to start, naming what is missing) is run.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import venv
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
OPERATIONS = ROOT / "docs" / "operations.md"


@dataclass(frozen=True)
class Step:
    argv: list[str]
    expect: str | None  # the document's "# -> ..." line after the command, if any


def documented_steps() -> list[Step]:
    """The commands of operations.md §1's first bash block, each with the output shown after it."""
    text = OPERATIONS.read_text()
    section = text[text.index("## 1. Install\n") : text.index("\n## 2. ")]
    m = re.search(r"```bash\n(.*?)```", section, re.S)
    assert m, "operations.md §1 has no bash block"
    steps: list[Step] = []
    for raw in m.group(1).splitlines():
        line = raw.strip()
        if line.startswith("# -> "):
            assert steps and steps[-1].expect is None, f"an output line with no command before it: {raw}"
            steps[-1] = Step(steps[-1].argv, line.removeprefix("# -> "))
        elif line and not line.startswith("#"):
            steps.append(Step(shlex.split(line, comments=True), None))
    return steps


def one(steps: list[Step], prefix: list[str], pattern: str = "") -> Step:
    found = [
        s
        for s in steps
        if s.argv[: len(prefix)] == prefix and (not pattern or re.search(pattern, " ".join(s.argv)))
    ]
    assert len(found) == 1, f"expected one documented {' '.join(prefix)} {pattern}: {found}"
    return found[0]


def readme_install_item() -> str:
    text = README.read_text()
    start = text.index("1. **Install**")
    return text[start : text.index("\n2. **", start)]


def test_the_documents_say_how_to_install_without_an_index() -> None:
    """README step 1 gives the same three commands operations.md §1 runs, and neither tells anyone
    to install toolkv by name from an index."""
    steps = documented_steps()
    build = one(steps, ["python", "-m", "pip", "wheel"])
    server = one(steps, ["pip", "install"], r"\.whl$")
    client = one(steps, ["pip", "install"], r"\.whl\[client\]$")
    item = readme_install_item()
    spans = [shlex.split(c) for c in re.findall(r"`([^`]+)`", item)]
    for step in (build, server, client):
        assert step.argv in spans, f"README step 1 lacks `{shlex.join(step.argv)}`"
    installs = [a for a in spans if a[:2] == ["pip", "install"]] + [
        s.argv for s in steps if s.argv[:2] == ["pip", "install"]
    ]
    for argv in installs:  # toolkv is on no index: every install names the wheel file
        assert re.fullmatch(r"dist/toolkv-[^/\s]+\.whl(\[\w+\])?", argv[-1]), shlex.join(argv)
    assert "--no-build-isolation" in OPERATIONS.read_text()  # the variant this test runs


def _copy_checkout(dst: Path) -> None:
    """The tracked files as they are in the work tree (what a fresh clone has, plus local edits)."""
    p = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=False, timeout=60)
    files = [f for f in p.stdout.decode().split("\0") if f] if p.returncode == 0 else []
    if not files:  # not a git checkout: everything but the environments and caches
        skip = {".git", ".venv", ".tox", "build", "dist", "__pycache__", ".hypothesis"}
        files = [
            str(f.relative_to(ROOT))
            for f in ROOT.rglob("*")
            if f.is_file() and not skip & set(f.relative_to(ROOT).parts) and not f.name.startswith(".venv")
        ]
    for rel in files:
        src = ROOT / rel
        if src.is_file():
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / rel)


def _clean_env(root: Path) -> dict[str, str]:
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("TOOLKV_", "PYTHON", "VIRTUAL_ENV", "PIP_"))
    }
    env["PATH"] = f"{root / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["PIP_CONFIG_FILE"] = os.devnull  # this machine's pip configuration (e.g. find-links) plays no part
    return env


def _run(
    argv: list[str], *, cwd: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=300, check=False)


def _pip_install(step: Step, target: Path, cwd: Path) -> None:
    """A documented ``pip install FILE`` into the virtual environment ``target`` (pip's ``--python``:
    the environment needs no pip of its own), nothing fetched."""
    assert step.argv[:2] == ["pip", "install"]
    argv = [sys.executable, "-m", "pip", "--python", str(target / "bin" / "python"), "install"]
    argv += [*step.argv[2:], "--no-deps", "--no-index", "-q"]
    p = _run(argv, cwd=cwd, env=_clean_env(target))
    assert p.returncode == 0, f"{shlex.join(step.argv)}:\n{p.stdout}{p.stderr}"


def test_the_documented_install_works(tmp_path: Path) -> None:
    steps = documented_steps()
    src = tmp_path / "checkout"
    _copy_checkout(src)

    build = one(steps, ["python", "-m", "pip", "wheel"])
    p = _run([sys.executable, *build.argv[1:], "--no-build-isolation", "-q"], cwd=src)
    assert p.returncode == 0, p.stdout + p.stderr
    assert build.expect, "the document shows the file the build makes"
    wheel = src / build.expect
    assert sorted(src.glob("dist/*.whl")) == [wheel], "the build made the file the document names"

    server, client = tmp_path / "server", tmp_path / "agent"
    for target in (server, client):
        venv.EnvBuilder(with_pip=False, clear=True).create(target)
    _pip_install(one(steps, ["pip", "install"], r"\.whl$"), server, src)
    _pip_install(one(steps, ["pip", "install"], r"\.whl\[client\]$"), client, src)

    env = _clean_env(server)
    checks = [
        s
        for s in steps
        if s.argv[0] in ("python", "toolkv") and s.argv[:4] != ["python", "-m", "pip", "wheel"]
    ]
    assert {s.argv[0] for s in checks} == {"python", "toolkv"} and all(s.expect for s in checks)
    for step in checks:
        p = _run([str(server / "bin" / step.argv[0]), *step.argv[1:]], cwd=tmp_path, env=env)
        assert p.returncode == 0, f"{shlex.join(step.argv)}:\n{p.stdout}{p.stderr}"
        assert p.stdout.strip() == step.expect, f"{shlex.join(step.argv)}: {p.stdout!r}"
        assert "Traceback" not in p.stderr

    # what the plain install fetches, and what the client extra adds
    meta = (
        "import importlib.metadata as m, json; d = m.distribution('toolkv'); "
        "print(json.dumps({'requires': d.requires, 'file': d.locate_file('toolkv').as_posix()}))"
    )
    for target in (server, client):
        p = _run([str(target / "bin" / "python"), "-c", meta], cwd=tmp_path, env=_clean_env(target))
        assert p.returncode == 0, p.stderr
        assert str(target) in p.stdout, "toolkv comes from the fresh environment, not the checkout"
    requires = json.loads(p.stdout)["requires"]
    plain = {r for r in requires if "extra ==" not in r}
    assert {re.split(r"[<>=;]", r)[0] for r in plain} == {"transitions", "prometheus-client"}
    assert any(r.startswith("httpx") and 'extra == "client"' in r for r in requires)

    # installed with --no-deps, an enabled plugin refuses to start and names what is missing
    load = "import importlib.metadata as m; (ep,) = m.entry_points(group='sglang.srt.plugins'); ep.load()()"
    p = _run([str(server / "bin" / "python"), "-c", load], cwd=tmp_path, env=dict(env, TOOLKV_ENABLE="1"))
    assert p.returncode != 0 and "Traceback" not in p.stderr, p.stderr
    assert "refusing to start" in p.stderr and "transitions" in p.stderr, p.stderr
    p = _run([str(server / "bin" / "python"), "-c", load], cwd=tmp_path, env=env)
    assert p.returncode == 0, p.stderr  # not enabled: the entry point does nothing
