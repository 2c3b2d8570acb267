"""Misconfiguration is refused or said at start-up, naming the variable (it used to run silently).

Refused, through sglang's real plugin loader (``load_plugins`` -> the entry point -> ``register``):
a misspelt ``TOOLKV_*`` name (``TOOLKV_TTL=300`` with toolkv enabled; ``TOOLKV_ENABLED=1``, a
misspelt switch, even though ``TOOLKV_ENABLE`` is unset), ``TOOLKV_TTL_S=0``,
``TOOLKV_HOST_BUDGET_TOKENS=0``, ``TOOLKV_HANDOVER_TTL_S=0``, ``TOOLKV_KEEP_TTL_S=0``, a reply timeout
below a second and a credential header (``X-Api-Key``) as the session header. Warned: sglang 0.5.16 without ``--enable-hierarchical-cache``
(toolkv only pins; the launching process's check says so) and a host budget larger
than the host pool (the scheduler's start-up line, with the numbers).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from types import SimpleNamespace
from typing import Any

import pytest

from toolkv.errors import StartupRefused
from toolkv.sglang.config import TOOLING_VARIABLES, ToolKVConfig
from toolkv.sglang.sizing import PoolSizes, budget_warning
from toolkv.sglang.startup import fallback_warnings

_SCENARIOS = r"""
import json, logging, os, sys
import sglang.srt.plugins as plugins
from sglang.srt.plugins.hook_registry import HookRegistry

def attempt(name, env):
    for k in [k for k in os.environ if k.upper().startswith("TOOLKV_")]:
        del os.environ[k]
    os.environ.update(env)
    plugins._plugins_loaded = False  # load_plugins() runs once per process; each scenario is a launch
    if "toolkv.sglang.plugin" in sys.modules:
        sys.modules["toolkv.sglang.plugin"]._registered = False
    before = sum(len(v) for v in HookRegistry._hooks.values())
    try:
        plugins.load_plugins()  # sglang's loader: entry point -> register() -> apply_hooks()
        out = {"exit": None, "message": ""}
    except SystemExit as e:  # what ends the launching process
        out = {"exit": type(e).__name__, "message": str(e.code)}
    out["hooks"] = sum(len(v) for v in HookRegistry._hooks.values()) - before
    print("SCENARIO " + json.dumps({"name": name, **out}), flush=True)

attempt("misspelt switch", {"TOOLKV_ENABLED": "1"})
attempt("misspelt switch, lower case", {"toolkv_enable": "yes"})
attempt("misspelt switch, off", {"TOOLKV_ENABLED": "0"})
attempt("misspelt name", {"TOOLKV_ENABLE": "1", "TOOLKV_TTL": "300"})
attempt("ttl zero", {"TOOLKV_ENABLE": "1", "TOOLKV_TTL_S": "0"})
attempt("budget zero", {"TOOLKV_ENABLE": "1", "TOOLKV_HOST_BUDGET_TOKENS": "0"})
attempt("tooling knob", {"TOOLKV_ENABLE": "1", "TOOLKV_DEBUG": "1"})
attempt("handover zero", {"TOOLKV_ENABLE": "1", "TOOLKV_HANDOVER_TTL_S": "0"})
attempt("keep zero", {"TOOLKV_ENABLE": "1", "TOOLKV_KEEP_TTL_S": "0"})
attempt("reply timeout tiny", {"TOOLKV_ENABLE": "1", "TOOLKV_REPLY_TIMEOUT_S": "0.001"})
attempt("api key header", {"TOOLKV_ENABLE": "1", "TOOLKV_SESSION_HEADER": "X-Api-Key"})

# what the launch_server hook toolkv registered runs first (the hook itself also imports the HTTP
# server, which needs uvloop, not installed on CPU), on a 0.5.16 launch without HiCache
records = []
handler = logging.Handler()
handler.emit = records.append
logging.getLogger("toolkv").addHandler(handler)
from toolkv.testing.harness import HarnessConfig, make_server_args
from toolkv.sglang import plugin
from toolkv.sglang.scheduler_side import check_server_args
target = "sglang.srt.entrypoints.http_server.launch_server"
assert [fn for kind, fn, _ in HookRegistry._hooks[target] if kind.name == "BEFORE"] == [plugin.before_launch_server]
before_hook = check_server_args
for name, kind, env in [("no hicache", "radix", {}), ("no hicache, fallback chosen", "radix", {"TOOLKV_FALLBACK": "pin"}),
                        ("hicache", "hiradix", {})]:
    os.environ.pop("TOOLKV_FALLBACK", None)
    os.environ.update(env)
    records.clear()
    before_hook(make_server_args(HarnessConfig(kind=kind)))
    print("SCENARIO " + json.dumps({"name": name, "warnings": [r.getMessage() for r in records if r.levelno == logging.WARNING]}), flush=True)
"""


def _scenarios() -> dict[str, dict[str, Any]]:
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("TOOLKV_")}
    env["OMP_NUM_THREADS"] = "1"
    p = subprocess.run(
        [sys.executable, "-c", _SCENARIOS], capture_output=True, text=True, env=env, timeout=300, check=False
    )
    found = {}
    for line in p.stdout.splitlines():
        if line.startswith("SCENARIO "):
            d = json.loads(line[len("SCENARIO ") :])
            found[d.pop("name")] = d
    assert len(found) == 14, p.stdout[-2000:] + p.stderr[-4000:]
    return found


def test_misconfiguration_through_sglangs_plugin_loader() -> None:
    r = _scenarios()
    for name, words in [
        ("misspelt switch", ["TOOLKV_ENABLED=1", "TOOLKV_ENABLE", "toolkv would not run"]),
        ("misspelt switch, lower case", ["toolkv_enable=yes", "TOOLKV_ENABLE"]),
        ("misspelt name", ["TOOLKV_TTL is not a toolkv variable (did you mean TOOLKV_TTL_S?)"]),
        ("ttl zero", ["TOOLKV_TTL_S='0': expected a finite number > 0"]),
        (
            "budget zero",
            ["TOOLKV_HOST_BUDGET_TOKENS='0': expected an integer >= 1", "unset it for no budget"],
        ),
        ("handover zero", ["TOOLKV_HANDOVER_TTL_S='0': expected a finite number > 0", "evicted unused"]),
        ("keep zero", ["TOOLKV_KEEP_TTL_S='0': expected a finite number > 0", "would keep nothing"]),
        ("reply timeout tiny", ["TOOLKV_REPLY_TIMEOUT_S='0.001': expected a finite number >= 1", "504"]),
        (
            "api key header",
            ["TOOLKV_SESSION_HEADER='X-Api-Key'", "a credential header cannot be a session id"],
        ),
    ]:
        assert r[name]["exit"] == "StartupRefused", (name, r[name])
        assert "refusing to start" in r[name]["message"], r[name]
        assert all(w in r[name]["message"] for w in words), (name, r[name]["message"])
        assert r[name]["hooks"] == 0, "nothing may be hooked before the guards pass"
    assert r["misspelt switch, off"] == {"exit": None, "message": "", "hooks": 0}
    assert r["tooling knob"]["exit"] is None and r["tooling knob"]["hooks"] > 0
    (warning,) = r["no hicache"]["warnings"]
    assert "--enable-hierarchical-cache" in warning and "pinned on the GPU" in warning
    assert "TOOLKV_FALLBACK" in warning
    assert r["no hicache, fallback chosen"]["warnings"] == [] and r["hicache"]["warnings"] == []


@pytest.mark.slow  # ~15 s; the loader scenarios above cover the refusal itself in CI
def test_a_misspelt_switch_stops_sglang_launch_server() -> None:
    """What the operator runs: the launch ends with the message before any model is touched."""
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("TOOLKV_")}
    env.update(TOOLKV_ENABLED="1", OMP_NUM_THREADS="1")
    p = subprocess.run(
        [sys.executable, "-m", "sglang.launch_server", "--model-path", "/nonexistent/model"],
        capture_output=True, text=True, env=env, timeout=300, check=False,
    )  # fmt: skip
    assert p.returncode == 1, (p.returncode, p.stderr[-3000:])
    assert "toolkv: refusing to start: TOOLKV_ENABLED=1 looks like the switch TOOLKV_ENABLE" in p.stderr
    assert "Traceback" not in p.stderr


# ---- the checks themselves ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("env", "words"),
    [
        ({"TOOLKV_TTL": "300"}, "TOOLKV_TTL is not a toolkv variable (did you mean TOOLKV_TTL_S?)"),
        ({"TOOLKV_HOST_BUDGET": "5"}, "did you mean TOOLKV_HOST_BUDGET_TOKENS?"),
        ({"TOOLKV_ZERO_CHANGES": "1"}, "did you mean TOOLKV_ZERO_CHANGE?"),
        ({"TOOLKV_XYZZY": "1"}, "TOOLKV_XYZZY is not a toolkv variable. Known"),
        ({"TOOLKV_TTL_S": "0"}, "TOOLKV_TTL_S='0': expected a finite number > 0"),
        ({"TOOLKV_HOST_BUDGET_TOKENS": "0"}, "TOOLKV_HOST_BUDGET_TOKENS='0': expected an integer >= 1"),
        (
            {"TOOLKV_HANDOVER_TTL_S": "0"},
            "TOOLKV_HANDOVER_TTL_S='0': expected a finite number > 0 (0 would unpin",
        ),
        (
            {"TOOLKV_HANDOVER_TTL_S": "-1"},
            "TOOLKV_HANDOVER_TTL_S='-1': expected a finite number > 0 (0 would",
        ),
        (
            {"TOOLKV_KEEP_TTL_S": "0"},
            "TOOLKV_KEEP_TTL_S='0': expected a finite number > 0 (0 would drop every GPU pin",
        ),
        (
            {"TOOLKV_REPLY_TIMEOUT_S": "0.001"},
            "TOOLKV_REPLY_TIMEOUT_S='0.001': expected a finite number >= 1 (",
        ),
        ({"TOOLKV_REPLY_TIMEOUT_S": "0.5"}, "one iteration with a long prefill chunk"),
    ],
)
def test_config_refuses_naming_the_variable(env: dict[str, str], words: str) -> None:
    with pytest.raises(ValueError) as ei:
        ToolKVConfig.from_env({"TOOLKV_ENABLE": "1", **env})
    assert words in str(ei.value)


def test_the_smallest_sane_values_are_accepted() -> None:
    """The floors refuse nonsense, not short settings: a tenth of a second of hand-over or keep, and
    the reply timeout's floor itself, still start."""
    c = ToolKVConfig.from_env(
        {"TOOLKV_HANDOVER_TTL_S": "0.1", "TOOLKV_KEEP_TTL_S": "0.1", "TOOLKV_REPLY_TIMEOUT_S": "1"}
    )
    assert (c.handover_ttl_s, c.keep_ttl_s, c.reply_timeout_s) == (0.1, 0.1, 1.0)


@pytest.mark.parametrize(
    "header",
    ["Authorization", "cookie", "X-Api-Key", "api-key", "Proxy-Authorization", "Set-Cookie", "X-Auth-Token",
     "X-OpenAI-Api-Key", "X-Amz-Security-Token", "x-goog-api-key", "Ocp-Apim-Subscription-Key", "X-Client-Secret"],
)  # fmt: skip
def test_credential_headers_are_refused_as_the_session_header(header: str) -> None:
    with pytest.raises(ValueError, match="a credential header cannot be a session id") as ei:
        ToolKVConfig.from_env({"TOOLKV_ENABLE": "1", "TOOLKV_SESSION_HEADER": header})
    assert str(ei.value).startswith(f"TOOLKV_SESSION_HEADER={header!r}")


@pytest.mark.parametrize("header", ["X-SMG-Routing-Key", "X-Session-ID", "x-conversation"])
def test_routing_headers_are_accepted_as_the_session_header(header: str) -> None:
    assert ToolKVConfig.from_env({"TOOLKV_SESSION_HEADER": header}).session_header == header.lower()


def test_known_variables_follow_the_config_fields() -> None:
    names = ToolKVConfig.variables()
    assert {"TOOLKV_ENABLE", "TOOLKV_TTL_S", "TOOLKV_HOST_BUDGET_TOKENS", "TOOLKV_KEEP_TTL_S"} <= names
    assert not names & TOOLING_VARIABLES
    everything = {n: "1" for n in TOOLING_VARIABLES} | {"TOOLKV_ENABLE": "1", "TOOLKV_TTL_S": "0.5"}
    assert ToolKVConfig.from_env(everything).ttl_s == 0.5  # tooling knobs are neither read nor refused


def test_switch_misspellings() -> None:
    with pytest.raises(StartupRefused, match="TOOLKV_ENABLED=on"):
        ToolKVConfig.enabled_in({"TOOLKV_ENABLED": "on"})
    assert not ToolKVConfig.enabled_in({"TOOLKV_ENABLED": "1", "TOOLKV_ENABLE": "0"})  # said off: off
    assert not ToolKVConfig.enabled_in({"TOOLKV_TTL": "300"})  # disabled: inert
    assert ToolKVConfig.enabled_in({"TOOLKV_ENABLE": "1"})


def test_budget_larger_than_the_host_pool_warns_with_the_numbers(caplog: pytest.LogCaptureFixture) -> None:
    sizes = PoolSizes(device_tokens=1000, host_tokens=2000, bytes_per_token=128)
    assert budget_warning(sizes, None) is None and budget_warning(sizes, 2000) is None
    assert budget_warning(None, 10**9) is None  # no host tier: nothing to compare with
    w = budget_warning(sizes, 5000)
    assert w is not None and "TOOLKV_HOST_BUDGET_TOKENS=5,000" in w and "2,000 tokens" in w and "(1,200)" in w


def test_scheduler_start_up_line_warns_about_the_budget(caplog: pytest.LogCaptureFixture) -> None:
    """The scheduler-init hook on a real HiRadixCache: a budget above the host pool is a WARNING."""
    from test_plugin import fake_scheduler

    from toolkv.sglang.plugin import after_scheduler_init
    from toolkv.testing.harness import CacheHarness, HarnessConfig

    with CacheHarness(HarnessConfig()) as h, pytest.MonkeyPatch.context() as mp:
        mp.setenv("TOOLKV_HOST_BUDGET_TOKENS", str(10**9))
        caplog.set_level(logging.WARNING, logger="toolkv")
        after_scheduler_init(None, fake_scheduler(h))
    lines = [r.getMessage() for r in caplog.records if "TOOLKV_HOST_BUDGET_TOKENS" in r.getMessage()]
    assert len(lines) == 1 and "1,000,000,000 is larger than the HiCache host pool" in lines[0]


def test_fallback_warning_cases() -> None:
    plain = SimpleNamespace(enable_hierarchical_cache=False, disable_radix_cache=False)
    assert len(fallback_warnings("0.5.16", plain, {})) == 1
    assert fallback_warnings("0.5.16", plain, {"TOOLKV_FALLBACK": "shadow"}) == []
    assert fallback_warnings("0.5.16", SimpleNamespace(enable_hierarchical_cache=True), {}) == []
    assert fallback_warnings("0.5.23", plain, {}) == []  # refused there (a required flag), not warned


def test_a_missing_dependency_names_the_wheel_not_a_package_index(monkeypatch: pytest.MonkeyPatch) -> None:
    """No index has toolkv, so the refusal names the requirement and the wheel built from a checkout."""
    from toolkv.errors import StartupRefused
    from toolkv.sglang import startup

    monkeypatch.setattr(startup, "missing_dependencies", lambda: ["transitions>=0.9,<0.10"])
    with pytest.raises(StartupRefused) as ei:
        startup.check_dependencies()
    msg = ei.value.message
    assert "pip install 'transitions>=0.9,<0.10'" in msg and "pip install toolkv," not in msg
    assert "dist/toolkv-0.1.0-py3-none-any.whl" in msg and "python -m pip wheel --no-deps -w dist ." in msg
