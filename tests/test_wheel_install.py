"""The built wheel, installed with pip into a fresh virtual environment without sglang, torch or
the test extras (what installing toolkv's wheel gives on a machine that only runs the CLI): every
command runs once and ends with its result or a one-line error, never a traceback; a command
whose dependencies are missing names the extra to install.

The environment is built offline: pip installs the wheel itself (``--no-deps``, so the console
script and the metadata are pip's), and toolkv's two pure-Python runtime dependencies are
copied from the test environment's site-packages.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import subprocess
import venv
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from _wheel import build_wheel

ROOT = Path(__file__).resolve().parents[1]
RUNTIME = ("transitions", "six", "prometheus-client")  # toolkv's dependencies and theirs


@dataclass(frozen=True)
class Installed:
    root: Path
    site: Path
    env: dict[str, str]

    @property
    def toolkv(self) -> Path:
        return self.root / "bin" / "toolkv"

    def run(self, *argv: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(self.toolkv), *argv], capture_output=True, text=True, env=self.env, cwd=cwd,
            timeout=timeout, check=False,
        )  # fmt: skip


def _copy_distribution(name: str, site: Path) -> None:
    dist = importlib.metadata.distribution(name)
    for f in dist.files or ():
        src = Path(str(dist.locate_file(f)))
        if f.parts[0] == ".." or not src.is_file():
            continue  # console scripts etc. outside site-packages
        dst = site / f
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dst)


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Installed]:
    tmp = tmp_path_factory.mktemp("wheel")
    wheel = build_wheel(tmp)
    root = tmp / "venv"
    venv.EnvBuilder(with_pip=True, clear=True).create(root)
    py = root / "bin" / "python"
    subprocess.run(
        [str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    site = Path(
        subprocess.run(
            [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True, capture_output=True, text=True,
        ).stdout.strip()
    )  # fmt: skip
    for name in RUNTIME:
        _copy_distribution(name, site)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TOOLKV_", "PYTHON", "VIRTUAL_ENV"))}
    env["PATH"] = f"{root / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    yield Installed(root, site, env)


def test_the_fresh_environment_has_no_serving_stack(installed: Installed) -> None:
    py = installed.root / "bin" / "python"
    probe = "import importlib.util as u, json; print(json.dumps({m: u.find_spec(m) is not None for m in "
    probe += "['toolkv', 'transitions', 'prometheus_client', 'sglang', 'torch', 'hypothesis', 'httpx']}))"
    p = subprocess.run([str(py), "-c", probe], capture_output=True, text=True, env=installed.env, check=True)
    found = json.loads(p.stdout)
    assert found == {"toolkv": True, "transitions": True, "prometheus_client": True, "sglang": False,
                     "torch": False, "hypothesis": False, "httpx": False}  # fmt: skip
    assert (installed.site / "toolkv-0.1.0.dist-info" / "LICENSE").is_file()


def test_every_command_once(installed: Installed, tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("not a trace\n")
    (tmp_path / "bad.json").write_text("{}")
    cases: list[tuple[list[str], int, list[str]]] = [
        (["--version"], 0, ["toolkv 0.1.0"]),
        (["--help"], 0, ["spec-check", "trace-check"]),
        (
            ["demo"],
            2,
            ["toolkv demo: error: needs", "pip install 'dist/toolkv-0.1.0-py3-none-any.whl[sglang]'"],
        ),
        (
            ["fuzz", "--examples", "1"],
            2,
            ["toolkv fuzz: error: needs", "pip install 'dist/toolkv-0.1.0-py3-none-any.whl["],
        ),
        (["bench", "overhead"], 2, ["toolkv bench: error: needs", "toolkv-0.1.0-py3-none-any.whl[sglang]'"]),
        (["bench", "transfer", "--device", "cuda"], 2, ["toolkv-0.1.0-py3-none-any.whl[sglang]'"]),
        (["bench", "agent", "--url", "http://127.0.0.1:9", "--out", "a.json"], 2, ["no healthy server at"]),
        (["fuzz-http", "http://127.0.0.1:9", "--session", "s"], 2, ["toolkv-0.1.0-py3-none-any.whl[test]"]),
        (["doctor", "http://127.0.0.1:9"], 2, ["toolkv doctor: error: needs httpx", "whl[client]'"]),
        (["trace-check", "notes.txt"], 2, ["toolkv trace-check: error: notes.txt: line 1 is not JSON"]),
        (["diagram", "sessions"], 0, ["stateDiagram"]),
        (["spec-check", "--list"], 0, ["mut_HostLockLeak"]),
        (["docs", "--spec-check", "bad.json"], 2, ["toolkv docs: error:", "checkout"]),
    ]
    failures = []
    for argv, rc, words in cases:
        p = installed.run(*argv, cwd=tmp_path)
        out = p.stdout + p.stderr
        if p.returncode != rc or not all(w in out for w in words) or "Traceback" in out:
            failures.append(f"toolkv {' '.join(argv)}: rc={p.returncode}\n{out[-1500:]}")
    assert not failures, "\n\n".join(failures)


def test_installed_trace_check_reads_the_installed_spec(installed: Installed, tmp_path: Path) -> None:
    """The cause of 'every trace ILLEGAL': trace-check looked for spec/ next to the package."""
    py = installed.root / "bin" / "python"
    p = subprocess.run(
        [str(py), "-c", "from toolkv.verify.toolkv.tracecheck import spec_files; print(spec_files())"],
        capture_output=True, text=True, env=installed.env, cwd=tmp_path, check=True,
    )  # fmt: skip
    spec = Path(p.stdout.strip())
    assert spec == installed.site / "toolkv" / "spec_files" and (spec / "ToolKV.tla").is_file()


@pytest.mark.slow
@pytest.mark.tlc
def test_installed_trace_check_accepts_a_campaign_trace(installed: Installed, tmp_path: Path) -> None:
    """End to end (slow: the campaign needs sglang, here in the test environment): a trace the
    checkout's fuzz campaign wrote is a spec behaviour for the installed ``toolkv trace-check``."""
    from toolkv.tools.fuzz_cli import campaign
    from toolkv.verify.tla.tlc import find_jar

    r = campaign(examples=1, steps=6, seed=3, profile="ci", trace_dir=tmp_path)
    assert r["failure"] is None
    (trace,) = tmp_path.glob("*.jsonl")
    env = dict(installed.env, TOOLKV_TLA_JAR=str(find_jar()))
    p = subprocess.run(
        [str(installed.toolkv), "trace-check", str(trace)], capture_output=True, text=True, env=env,
        cwd=tmp_path, timeout=600, check=False,
    )  # fmt: skip
    assert p.returncode == 0, p.stdout + p.stderr
    assert "every step is a spec step" in p.stdout + p.stderr
