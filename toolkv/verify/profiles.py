"""Hypothesis settings profiles for every campaign, registered once (``conftest.py`` and
``toolkv fuzz`` both call :func:`register`); ``HYPOTHESIS_PROFILE`` picks one.

| profile | for | examples × steps | database | deterministic |
|---|---|---|---|---|
| ``dev`` (default) | local runs: a failure is saved and replayed first on the next run | 60 × 60 | ``.hypothesis/`` | no |
| ``ci`` | ``make test``: the same run on every machine, and a failure prints its replay blob | 60 × 60 | none | yes |
| ``long`` | ``make test-long`` / ``toolkv fuzz --profile long``: a search, not a gate | 2000 × 80 | ``.hypothesis/`` | no |
| ``gpu`` | the CUDA campaign on the GPU machine (a step costs several CPU steps) | 40 × 60 | none | yes |

Health checks: only ``too_slow`` is suppressed, because every example builds a real cache stack
and every step runs real sglang code between draws — generation is interleaved with execution, so
Hypothesis's "data generation is slow" timer measures sglang, not the strategies. The rest stay on.
``deadline`` is off: a step's cost depends on the tree it meets, not on a regression.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, Verbosity, settings
from hypothesis.database import DirectoryBasedExampleDatabase

PROFILES = ("dev", "ci", "long", "gpu")
DEFAULT = "dev"
_registered = False


def register() -> None:
    """Register the profiles (idempotent)."""
    global _registered
    if _registered:
        return
    common = settings(
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
        print_blob=True,
        report_multiple_bugs=False,
    )
    local_db = DirectoryBasedExampleDatabase(os.path.join(".hypothesis", "examples"))
    settings.register_profile("dev", common, max_examples=60, stateful_step_count=60, database=local_db)
    settings.register_profile(
        "ci", common, max_examples=60, stateful_step_count=60, database=None, derandomize=True
    )
    settings.register_profile(
        "long",
        common,
        max_examples=2000,
        stateful_step_count=80,
        database=local_db,
        verbosity=Verbosity.normal,
    )
    settings.register_profile(
        "gpu", common, max_examples=40, stateful_step_count=60, database=None, derandomize=True
    )
    _registered = True


def load(name: str | None = None) -> str:
    """Register, then load ``name`` (default: ``HYPOTHESIS_PROFILE``, else ``dev``); returns it."""
    register()
    chosen = name or os.environ.get("HYPOTHESIS_PROFILE") or DEFAULT
    if chosen not in PROFILES:
        raise ValueError(f"unknown Hypothesis profile {chosen!r}; expected one of {PROFILES}")
    settings.load_profile(chosen)
    return chosen


__all__ = ["DEFAULT", "PROFILES", "load", "register"]
