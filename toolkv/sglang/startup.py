"""Start-up guards: what must hold before toolkv hooks anything into sglang.

toolkv's hooks target private sglang internals (file:line in :mod:`toolkv.sglang.plugin`), and
sglang's plugin machinery forgives everything: the loader logs an exception from a plugin and
serves on without it, and the hook registry logs a target it cannot patch and moves on. With
``TOOLKV_ENABLE=1`` that would leave a server that looks fine and silently lacks toolkv (or has
half of it). So every guard here raises :class:`~toolkv.errors.StartupRefused`, which the loader
does not catch, and names the cause.

This module imports only the standard library and :mod:`toolkv.errors`: it runs before anything
else of toolkv is known to be importable.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable

from toolkv.errors import StartupRefused

# sglang releases whose internals every hook target and every primitive toolkv calls were verified
# against (release -> what was verified). Adding a release is one line here, once its backend and
# hook targets are checked (tests/test_plugin.py reads the targets from the installed source).
SUPPORTED: dict[str, str] = {
    "0.5.16": "RadixCache/HiRadixCache backends; Scheduler, RadixCache and HTTP hook targets",
}

# import name -> the requirement that provides it. toolkv's own runtime dependencies; sglang and
# torch come from the serving environment. A ``pip install --no-deps`` skips these.
DEPENDENCIES: dict[str, str] = {
    "transitions": "transitions>=0.9,<0.10",
    "prometheus_client": "prometheus-client>=0.20",
}


def installed_sglang_version() -> str:
    """The running sglang's release string. sglang's own loader has imported ``sglang`` already
    when the entry point runs, so this import costs nothing there."""
    from sglang.version import __version__

    return str(__version__)


def check_sglang_version(version: str) -> None:
    if version not in SUPPORTED:
        raise StartupRefused(
            f"sglang {version} is not a release toolkv supports (supported: {', '.join(sorted(SUPPORTED))}). "
            "toolkv patches sglang internals that change between releases; unset TOOLKV_ENABLE to serve "
            "without toolkv, or install a supported sglang"
        )


def missing_dependencies(names: Iterable[str] = DEPENDENCIES) -> list[str]:
    """Requirements whose module cannot be found, without importing them: importing
    ``prometheus_client`` here, before sglang sets ``PROMETHEUS_MULTIPROC_DIR``, would switch the
    HTTP process's metrics to single-process mode."""
    missing = []
    for name in names:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):  # ValueError: present in sys.modules as None / no spec
            found = False
        if not found:
            missing.append(DEPENDENCIES.get(name, name))
    return missing


def check_dependencies() -> None:
    missing = missing_dependencies()
    if missing:
        raise StartupRefused(
            f"missing dependencies {missing}: install toolkv with its dependencies "
            f"(pip install toolkv, not --no-deps) or pip install {' '.join(repr(m) for m in missing)}"
        )


def unapplied(targets: Iterable[str]) -> list[str]:
    """The hook targets sglang's registry did not patch (it logs such a failure and goes on)."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    return [t for t in targets if t not in HookRegistry._patched]
