"""One fuzz campaign: a Hypothesis state machine run under a profile, its statistics read through
Hypothesis's observability callbacks. It lives in the verify layer because the storage tier's
machine (``toolkv.verify.storage.fuzzing``) runs through it as well as ``toolkv fuzz``."""

from __future__ import annotations

import os
import re
import sys
import time
import traceback
from pathlib import Path
from typing import Any


def _portable(text: str) -> str:
    """A traceback without this machine's paths (the results are read elsewhere): the package's
    files relative to its parent, the installed packages' relative to site-packages."""
    import sysconfig

    here = str(Path(__file__).resolve().parents[2]) + os.sep
    site = sysconfig.get_paths()["purelib"] + os.sep
    return text.replace(site, "site-packages" + os.sep).replace(here, "")


def campaign(
    *,
    examples: int | None = None,
    steps: int | None = None,
    profile: str | None = None,
    caveats: frozenset[str] = frozenset(),
    env_bugs: frozenset[str] = frozenset(),
    device: str = "cpu",
    page_size: int = 1,
    trace_dir: Path | None = None,
    seed: int | None = None,
    every: int = 0,
    label: str = "correct",
    shrink: bool = True,
    reproduce: str | None = None,
    machine: Any = None,
    lazy_free: bool = False,
) -> dict[str, Any]:
    """Run one campaign under a Hypothesis profile; returns a summary (``failure`` is None when
    nothing was found). Statistics come from Hypothesis: each example reports its action counts as
    ``event``s, read here through Hypothesis's observability callbacks (one per test case).
    ``machine``: another state machine class to run (the storage tier's,
    ``toolkv.verify.storage.fuzzing``); the machine options above are then its own business.
    ``lazy_free``: finished offloads leave their GPU copies to sglang's eviction (spec LazyFree)."""
    from hypothesis import Phase, reproduce_failure, settings
    from hypothesis import __version__ as hypothesis_version
    from hypothesis import seed as hseed
    from hypothesis.internal.observability import with_observability_callback
    from hypothesis.stateful import run_state_machine_as_test

    from toolkv.verify import profiles
    from toolkv.verify.toolkv.fuzzing import machine_class

    profiles.register()
    base = settings.get_profile(profile or os.environ.get("HYPOTHESIS_PROFILE") or profiles.DEFAULT)
    cls: Any = machine or machine_class(
        caveats=caveats,
        env_bugs=env_bugs,
        device=device,
        page_size=page_size,
        trace_dir=trace_dir,
        lazy_free=lazy_free,
    )
    if reproduce is not None:
        cls = reproduce_failure(hypothesis_version, reproduce.encode())(cls)
    if seed is not None:
        # on the machine class: run_state_machine_as_test copies @seed from it to the test it
        # builds (on any other callable the seed would be ignored, and derandomize's own seed used)
        cls = hseed(seed)(cls)
    t0 = time.monotonic()
    seen: dict[str, Any] = {
        "examples": 0,
        "steps": 0,
        "actions": {},
        "kv": 0,
        "first_failure": None,
        "other": {},
    }

    def observe(obs: Any) -> None:
        if getattr(obs, "type", None) != "test_case" or obs.status == "gave_up":
            return
        seen["examples"] += 1
        for name, payload in obs.features.items():
            if name.startswith("action ") and isinstance(payload, int):
                key = name[len("action ") :]
                seen["actions"][key] = seen["actions"].get(key, 0) + payload
                seen["steps"] += payload
            elif name == "kv bytes checked" and isinstance(payload, int):
                seen["kv"] += payload
            elif isinstance(payload, int):  # a machine's own counters (e.g. "restored from L3")
                seen["other"][name] = seen["other"].get(name, 0) + payload
        if obs.status == "failed" and seen["first_failure"] is None:
            seen["first_failure"] = seen["examples"]
            # what the first failing example raised, as Hypothesis saw it: when its replay at the
            # end of the campaign goes otherwise (a flaky failure), this is the one that counts
            tb = str(getattr(getattr(obs, "metadata", None), "traceback", "") or "")
            last = tb.strip().splitlines()[-1] if tb.strip() else ""
            seen["first_reason"] = (last or str(getattr(obs, "status_reason", "") or ""))[:2000]
        if every and seen["examples"] % every == 0:
            print(
                f"  [{label}] {seen['examples']} examples, {seen['steps']} steps, {time.monotonic() - t0:.0f}s",
                file=sys.stderr,
                flush=True,
            )

    # Without shrinking the campaign stops at the first failure (kill detection); with it, Hypothesis
    # minimises the failing sequence (up to its own time limit). One bug per campaign either way.
    phases = [Phase.explicit, Phase.reuse, Phase.generate] + ([Phase.shrink] if shrink else [])
    over: dict[str, Any] = {"phases": phases}
    if examples is not None:
        over["max_examples"] = examples
    if steps is not None:
        over["stateful_step_count"] = steps
    if seed is not None:
        over["derandomize"] = True
    s = settings(base, **over)
    failure: str | None = None
    detail: str | None = None
    shrunk_len: int | None = None
    with with_observability_callback(observe):
        try:
            run_state_machine_as_test(cls, settings=s)
        except BaseException as exc:  # a found failure: the campaign's result, not a crash of the tool
            if isinstance(exc, KeyboardInterrupt):
                raise
            text = str(exc)
            first = text.strip().splitlines()[0] if text.strip() else ""
            failure = f"{type(exc).__name__}: {first}"[:300]
            detail = _portable("".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))[-6000:]
            m = re.findall(r"^state\.step\(", text, re.M)
            shrunk_len = len(m) or None
    return {
        "label": label,
        "profile": profile or os.environ.get("HYPOTHESIS_PROFILE") or profiles.DEFAULT,
        "examples": seen["examples"],
        "steps": seen["steps"],
        "seconds": round(time.monotonic() - t0, 1),
        "failure": failure,
        "detail": detail,
        "examples_to_kill": seen["first_failure"],
        "first_failure": seen.get("first_reason"),
        "shrunk_steps": shrunk_len if shrink else None,
        "actions": dict(sorted(seen["actions"].items())),
        "kv_bytes_checked": seen["kv"],
        "counters": dict(sorted(seen["other"].items())),
        "device": device,
    }
