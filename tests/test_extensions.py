"""What a new setting and a new call policy cost, shown on a copy of the package.

A new ``TOOLKV_*`` setting is a change in one file, ``toolkv/core/settings.py``: its declaration
and its field. With one setting added there (a manager switch) and nothing else edited, the
plugin's parser reads it and refuses a bad value by name, the library's ``ManagerConfig`` and the
plugin's ``ToolKVConfig`` carry it with its default, the manager gets the plugin's value, and the
operations table (``toolkv docs --settings``) has its row.

A new call policy is one new file of ``core``: ``toolkv/core/calls/<name>.py`` with its class as
``POLICY`` (``settings.POLICY_NAMES`` reads the names off that folder without importing it: the
settings are read before toolkv's dependencies are known to be installed). With that file alone,
``TOOLKV_POLICY`` accepts it, the operations table lists it, a ``tool_start`` body may name it, and
a manager over sglang's real HiRadixCache runs a ``tool_start`` under it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

ENTRY = """    Setting(
        "demo_switch",
        bool,
        False,
        "a switch added by tests/test_extensions.py",
        layer="manager",
        doc="what the switch does, in the operations table",
    ),
"""
FIELD = '    demo_switch: bool = default("demo_switch")\n'

CHECK = textwrap.dedent(
    """
    from toolkv.core.config import ManagerConfig
    from toolkv.core.settings import table
    from toolkv.sglang.config import ToolKVConfig

    assert ManagerConfig().demo_switch is False and ToolKVConfig().demo_switch is False
    on = ToolKVConfig.from_env({"TOOLKV_DEMO_SWITCH": "1"})
    assert on.demo_switch is True and on.manager_config().demo_switch is True
    try:
        ToolKVConfig.from_env({"TOOLKV_DEMO_SWITCH": "maybe"})
    except ValueError as e:
        assert "TOOLKV_DEMO_SWITCH='maybe'" in str(e), e
    else:
        raise AssertionError("a bad value was accepted")
    assert "`TOOLKV_DEMO_SWITCH`" in table() and "what the switch does" in table()
    print("ok")
    """
)


def _copy(tmp: Path) -> Path:
    pkg = tmp / "toolkv"
    shutil.copytree(ROOT / "toolkv", pkg, ignore=shutil.ignore_patterns("__pycache__"))
    return pkg


def _changed(site: Path) -> list[str]:
    """The package's files the copy changed or added."""
    out = []
    for f in sorted((site / "toolkv").rglob("*.py")):
        ours = ROOT / f.relative_to(site)
        if not ours.exists() or f.read_text() != ours.read_text():
            out.append(str(f.relative_to(site)))
    return out


def _package_with(tmp: Path, *, entry: bool, field: bool) -> Path:
    pkg = _copy(tmp)
    settings = pkg / "core" / "settings.py"
    text = settings.read_text()
    if entry:  # the declaration: one more entry at the end of SETTINGS
        head, sep, tail = text.partition("\n)\n\nBY_FIELD")
        assert sep, "SETTINGS' closing line moved: update this test"
        text = head + "\n" + ENTRY.rstrip("\n") + sep + tail
    if field:  # the field: last of the manager layer's dataclass
        marker = "\n\n\n@dataclass(frozen=True)\nclass PolicySettings:"
        assert marker in text, "the layer dataclasses moved: update this test"
        text = text.replace(marker, "\n" + FIELD.rstrip("\n") + marker)
    settings.write_text(text)
    return tmp


def _run(site: Path, check: str = CHECK) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", check], cwd=site, env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"},
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


def test_a_new_setting_is_one_file(tmp_path: Path) -> None:
    site = _package_with(tmp_path, entry=True, field=True)
    p = _run(site)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr[-2000:]
    assert _changed(site) == ["toolkv/core/settings.py"], _changed(site)


def test_a_declaration_without_its_field_fails_at_import(tmp_path: Path) -> None:
    """The half-done change is refused when the package loads, naming the layer."""
    p = _run(_package_with(tmp_path, entry=True, field=False))
    assert p.returncode != 0 and "ManagerSettings fields" in p.stderr, p.stderr[-2000:]


POLICY_FILE = '''"""A call policy added by tests/test_extensions.py: every tool_start offloads."""

from toolkv.core.calls.offload import Offload
from toolkv.core.settings import PolicyName


class Quiet(Offload):
    """Offload's, under another name."""

    name = PolicyName("quiet")


POLICY = Quiet
'''
POLICY_CHECK = textwrap.dedent(
    """
    from toolkv.core.manager import ToolKVManager
    from toolkv.core.requests import ToolStart
    from toolkv.core.settings import table
    from toolkv.sglang.config import ToolKVConfig
    from toolkv.testing.harness import CacheHarness, HarnessConfig

    assert ToolKVConfig.from_env({"TOOLKV_POLICY": "quiet"}).policy == "quiet"
    assert "`quiet`" in table()
    req = ToolStart.from_body({"session_id": "a", "policy": "quiet"})
    with CacheHarness(HarnessConfig()) as h:
        m = ToolKVManager(h.tree)
        tokens = list(range(1, 65))
        h.insert(tokens, h.alloc(len(tokens)))
        m.insert("a", tokens)
        out = m.start(req)
        assert out["state"] in ("Offloading", "Offloaded"), out
    print("ok")
    """
)


def _child_env(site: Path) -> dict[str, str]:
    """This environment for a child that builds its own harness: the copy first on the path, and
    no rendezvous port of this process's gloo group (the child's harness picks its own)."""
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    return {**env, "PYTHONPATH": str(site)}


def _package_with_policy(tmp: Path, *, cls: bool) -> Path:
    pkg = _copy(tmp)
    body = POLICY_FILE if cls else POLICY_FILE.replace("\n\nPOLICY = Quiet\n", "\n")
    (pkg / "core" / "calls" / "quiet.py").write_text(body)
    return tmp


def test_a_new_call_policy_is_one_core_file(tmp_path: Path) -> None:
    site = _package_with_policy(tmp_path, cls=True)
    p = subprocess.run(
        [sys.executable, "-c", POLICY_CHECK], cwd=site, env=_child_env(site),
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert p.returncode == 0 and p.stdout.strip().endswith("ok"), p.stderr[-3000:]
    assert _changed(site) == ["toolkv/core/calls/quiet.py"], _changed(site)


def test_a_policy_file_without_its_class_is_refused(tmp_path: Path) -> None:
    """The half-done change (a file with no ``POLICY``) fails when a manager is built, saying why."""
    site = _package_with_policy(tmp_path, cls=False)
    p = subprocess.run(
        [sys.executable, "-c", POLICY_CHECK], cwd=site, env=_child_env(site),
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert p.returncode != 0 and "quiet.py defines no POLICY" in p.stderr, p.stderr[-3000:]
