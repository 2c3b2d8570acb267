"""A new ``TOOLKV_*`` setting is a change in one file, ``toolkv/core/settings.py``: its declaration
and its field. Shown on a copy of the package: one setting added there (a manager switch) and
nothing else edited, the plugin's parser reads it and refuses a bad value by name, the library's
``ManagerConfig`` and the plugin's ``ToolKVConfig`` carry it with its default, the manager gets
the plugin's value, and the operations table (``toolkv docs --settings``) has its row."""

from __future__ import annotations

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
        "a switch added by tests/test_new_setting.py",
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


def _package_with(tmp: Path, *, entry: bool, field: bool) -> Path:
    pkg = tmp / "toolkv"
    shutil.copytree(ROOT / "toolkv", pkg, ignore=shutil.ignore_patterns("__pycache__"))
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


def _run(site: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", CHECK], cwd=site, env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"},
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


def test_a_new_setting_is_one_file(tmp_path: Path) -> None:
    site = _package_with(tmp_path, entry=True, field=True)
    p = _run(site)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr[-2000:]
    changed = [
        str(f.relative_to(site))
        for f in sorted((site / "toolkv").rglob("*.py"))
        if f.read_text() != (ROOT / f.relative_to(site)).read_text()
    ]
    assert changed == ["toolkv/core/settings.py"], changed


def test_a_declaration_without_its_field_fails_at_import(tmp_path: Path) -> None:
    """The half-done change is refused when the package loads, naming the layer."""
    p = _run(_package_with(tmp_path, entry=True, field=False))
    assert p.returncode != 0 and "ManagerSettings fields" in p.stderr, p.stderr[-2000:]
