"""Start-up guards: what must hold before toolkv hooks anything into sglang.

toolkv's hooks target private sglang internals (file:line in :mod:`toolkv.sglang.plugin`), and
sglang's plugin machinery forgives everything: the loader logs an exception from a plugin and
serves on without it, and the hook registry logs a target it cannot patch and moves on. With
``TOOLKV_ENABLE=1`` that would leave a server that looks fine and silently lacks toolkv (or has
half of it). So every guard here raises :class:`~toolkv.errors.StartupRefused`, which the loader
does not catch, and names the cause.

The server features toolkv cannot share a server with (decode-side KV offload:
:func:`decode_offload_reasons`) are decided here too, from the server arguments alone.

This module imports only the standard library and :mod:`toolkv.errors`: it runs before anything
else of toolkv is known to be importable.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from toolkv.errors import StartupRefused


@dataclass(frozen=True)
class Release:
    """What one verified sglang release needs from the launch, beyond toolkv's own settings.

    ``tree`` names the cache API the release builds and therefore the hook set the plugin installs
    (:func:`toolkv.sglang.plugin.hooks`): ``radix`` = ``RadixCache``/``HiRadixCache`` with
    ``cache_finished_req``; ``unified`` = ``UnifiedRadixCache`` with ``checkpoint``. ``env`` and
    ``flags`` are the settings without which the release builds a cache toolkv cannot drive; a
    launch that lacks one is refused at start-up with the setting named, instead of failing (or
    silently degrading) once the first scheduler has built its tree."""

    verified: str
    tree: Literal["radix", "unified"]
    env: tuple[tuple[str, str, str], ...] = ()  # (variable, required value, why)
    flags: tuple[tuple[str, str, str], ...] = ()  # (ServerArgs attribute that must be on, CLI flag, why)


# sglang releases whose internals every hook target and every primitive toolkv calls were verified
# against. Adding a release is one entry here, once its backend and hook targets are checked
# (tests/test_plugin.py and tests/test_plugin_0523.py read the targets from the installed source).
SUPPORTED: dict[str, Release] = {
    "0.5.16": Release(
        verified="RadixCache/HiRadixCache backends; Scheduler, RadixCache and HTTP hook targets",
        tree="radix",
    ),
    "0.5.23": Release(
        verified="UnifiedRadixCache backend; Scheduler, UnifiedRadixCache.checkpoint/reset and HTTP hook targets",
        tree="unified",
        flags=(
            (
                "enable_hierarchical_cache",
                "--enable-hierarchical-cache",
                "without it the UnifiedRadixCache has no host tier to offload into",
            ),
        ),
    ),
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


def check_sglang_version(version: str) -> Release:
    """The verified release ``version`` is, or a refusal: toolkv patches sglang internals that
    change between releases, and an unverified one may have moved any of them."""
    release = SUPPORTED.get(version)
    if release is None:
        raise StartupRefused(
            f"sglang {version} is not a release toolkv supports (supported: {', '.join(sorted(SUPPORTED))}). "
            "toolkv patches sglang internals that change between releases; unset TOOLKV_ENABLE to serve "
            "without toolkv, or install a supported sglang"
        )
    return release


def environment_reasons(version: str, environ: Mapping[str, str] | None = None) -> list[str]:
    """The environment settings the release needs and the launch lacks, one sentence each.

    Read from the launching process's environment: sglang's scheduler processes inherit it, so a
    setting present here is present where the tree is built."""
    env = os.environ if environ is None else environ
    out = []
    for name, want, why in SUPPORTED[version].env:
        got = env.get(name)
        if got != want:
            shown = "unset" if got is None else f"{got!r}"
            out.append(f"sglang {version} needs {name}={want} (it is {shown}): {why}")
    return out


def check_environment(version: str, environ: Mapping[str, str] | None = None) -> None:
    reasons = environment_reasons(version, environ)
    if reasons:
        raise StartupRefused(
            "; ".join(reasons) + ". Set it for the server, or unset TOOLKV_ENABLE to serve without toolkv"
        )


def flag_reasons(version: str, server_args: Any) -> list[str]:
    """The server flags the release needs and ``server_args`` lacks, one sentence each (read in
    both the HTTP and the scheduler processes, where ``ServerArgs`` exists)."""
    return [
        f"{flag} is required with sglang {version}: {why}"
        for attr, flag, why in SUPPORTED[version].flags
        if not getattr(server_args, attr, False)
    ]


def fallback_warnings(version: str, server_args: Any, environ: Mapping[str, str] | None = None) -> list[str]:
    """Start-up WARNING lines for a launch that works but gives toolkv no host tier.

    sglang 0.5.16 without ``--enable-hierarchical-cache`` builds a plain ``RadixCache``: toolkv
    then pins a session's KV on the GPU (or shadows it) instead of offloading it, which frees no
    device memory during a tool call. That is a supported fallback, but not what an operator who
    enabled toolkv for host offload expects, so it is said once, at start-up, unless
    ``TOOLKV_FALLBACK`` names the fallback explicitly. (0.5.23 refuses such a launch outright:
    :data:`SUPPORTED`'s ``flags``.)"""
    env = os.environ if environ is None else environ
    release = SUPPORTED.get(version)
    if release is None or release.tree != "radix" or env.get("TOOLKV_FALLBACK"):
        return []
    if getattr(server_args, "enable_hierarchical_cache", False) or getattr(
        server_args, "disable_radix_cache", False
    ):
        return []
    return [
        f"toolkv: sglang {version} runs without --enable-hierarchical-cache, so there is no host tier: "
        "tool_start keeps each session's KV pinned on the GPU (TOOLKV_FALLBACK=pin) instead of offloading "
        "it, and frees no device memory during tool calls. Give --enable-hierarchical-cache (with "
        "--hicache-size) for host offload, or set TOOLKV_FALLBACK=pin or shadow to choose the fallback "
        "and silence this"
    ]


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
    """Refuse to start without toolkv's own runtime dependencies, naming how to get them. No
    package index has toolkv: it is installed from the wheel built in a checkout (README,
    "Operating it"), which brings them unless it was installed with ``--no-deps``."""
    missing = missing_dependencies()
    if missing:
        from toolkv import __version__

        wheel = f"dist/toolkv-{__version__}-py3-none-any.whl"
        raise StartupRefused(
            f"missing dependencies {missing}: pip install {' '.join(repr(m) for m in missing)}, or install "
            f"toolkv's wheel with its dependencies (pip install {wheel}, without --no-deps; the wheel is "
            "built in a toolkv checkout with: python -m pip wheel --no-deps -w dist .)"
        )


def unapplied(targets: Iterable[str]) -> list[str]:
    """The hook targets sglang's registry did not patch (it logs such a failure and goes on)."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    return [t for t in targets if t not in HookRegistry._patched]


# ---- server features toolkv cannot share a server with ---------------------------------------------
# Decided from the server arguments alone. Pure functions: they read attributes of an sglang ``ServerArgs`` (or anything with the same
# attribute names; a missing attribute counts as the feature being off) and return reasons. The
# plugin refuses to start when any reason is returned, before any process is spawned.
#
# Decode-side KV offload (``--disaggregation-decode-enable-offload-kvcache``, sglang's
# ``DecodeKVCacheOffloadManager``) is refused on a server with toolkv, for three reasons each
# checked against sglang 0.5.16 (``docs/decode_offload.md``):
#
# 1. With it enabled, a finished request is released by the offload manager instead of
#    ``release_kv_cache`` (batch_result_processor.py:889-892), so ``cache_finished_req`` never
#    runs: no turn's KV ever enters the radix tree, and toolkv, which manages a session's KV
#    in that tree, has nothing to offload or restore.
# 2. The manager keeps its own host pool and ``HiCacheController`` (a second pinned pool next
#    to HiCache's) whose acks toolkv's agreement does not see.
# 3. Together with ``--disaggregation-decode-enable-radix-cache``, its release frees device slots
#    the radix cache still owns and never unlocks the matched prefix (an upstream bug, reproduced
#    in ``tests/test_decode_upstream.py``), which would corrupt the tree toolkv walks.

DECODE_OFFLOAD_FLAG = "--disaggregation-decode-enable-offload-kvcache"
DECODE_RADIX_FLAG = "--disaggregation-decode-enable-radix-cache"


def _on(server_args: Any, name: str) -> bool:
    value = getattr(server_args, name, False)
    if not isinstance(value, bool | None):
        raise TypeError(f"server_args.{name} must be a bool, got {type(value).__name__}: {value!r}")
    return bool(value)


def decode_offload_reasons(server_args: Any) -> list[str]:
    """Why toolkv cannot run next to decode-side KV offload with these arguments ([] if it can).

    Raises ``TypeError`` when a flag holds something other than a bool (a mis-parsed argument
    must not silently read as "off")."""
    if not _on(server_args, "disaggregation_decode_enable_offload_kvcache"):
        return []
    out = [
        f"decode-side KV offload ({DECODE_OFFLOAD_FLAG}) releases finished requests without "
        "cache_finished_req, so no turn's KV reaches the radix tree toolkv manages, and it keeps "
        "its own host pool and cache controller"
    ]
    if _on(server_args, "disaggregation_decode_enable_radix_cache"):
        out.append(
            f"with {DECODE_RADIX_FLAG} as well, sglang 0.5.16's offload release frees slots the "
            "radix cache still owns and never unlocks the matched prefix"
        )
    return out
