"""The wheel, built the way a user builds it (``pip wheel``), from a copy of what the build reads.

Not from the checkout itself: setuptools keeps a ``build/`` folder in the source tree, so a build
there packs whatever an earlier build left in it (files since deleted or excluded, a dist-info laid
out by another setuptools), and two test workers building at once would share it."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("pyproject.toml", "README.md", "LICENSE", "toolkv", "spec")  # what pyproject.toml packages


def build_wheel(tmp: Path) -> Path:
    """Build toolkv's wheel into ``tmp / "wheels"`` from a fresh copy of its sources; its path."""
    src = tmp / "src"
    for name in SOURCES:
        s = ROOT / name
        if s.is_dir():
            shutil.copytree(s, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            src.mkdir(parents=True, exist_ok=True)
            shutil.copy2(s, src / name)
    wheels = tmp / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(src), "-w", str(wheels)],
        check=True, capture_output=True, timeout=300, cwd=tmp,
    )  # fmt: skip
    (wheel,) = wheels.glob("toolkv-*.whl")
    return wheel
