"""The sglang plugin on CPU: configuration, registration through sglang's real plugin loader,
start-up refusals, the scheduler-side hooks over a real HiRadixCache/RadixCache, zero-change."""

from __future__ import annotations

import ast
import asyncio
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from _turns import LoopbackChannel, finish_turn, iteration

from toolkv.errors import Unsupported
from toolkv.sglang.config import ToolKVConfig
from toolkv.sglang.ipc import ToolKVReqInput, ToolKVReqOutput
from toolkv.sglang.plugin import after_scheduler_init, after_tree_reset, around_chat_non_streaming, hooks
from toolkv.sglang.scheduler_side import (
    SchedulerToolKV,
    check_server_args,
    check_tree,
    decide_on_request,
    decide_on_tool_calls,
    unsupported_reasons,
)
from toolkv.testing.harness import CacheHarness, HarnessConfig, ensure_process_group, make_server_args

SGLANG = Path(__import__("sglang").__file__).parent
PROMPT = list(range(1, 41))


@pytest.fixture
def hh() -> Iterator[CacheHarness]:
    h = CacheHarness(HarnessConfig())
    yield h
    h.close()


def fake_scheduler(h: CacheHarness, *, tp_rank: int = 0, tp_size: int = 1, **args: Any) -> Any:
    """The attributes of sglang's Scheduler the init hook reads, with sglang's own types: a real
    ServerArgs, the real tree, a gloo group, and rank/size in a real ``ParallelState`` at
    ``Scheduler.ps`` (scheduler.py:379) -- the Scheduler has no ``tp_rank``/``tp_size`` of its own."""
    from sglang.srt.distributed.parallel_state_wrapper import ParallelState
    from sglang.utils import TypeBasedDispatcher

    sa = make_server_args(h.cfg)
    for k, v in args.items():
        setattr(sa, k, v)
    return SimpleNamespace(
        server_args=sa,
        tree_cache=h.tree,
        tp_cpu_group=ensure_process_group(),
        ps=ParallelState.trivial(tp_rank=tp_rank, tp_size=tp_size),
        _request_dispatcher=TypeBasedDispatcher([(int, lambda x: x)]),
    )


# ---- configuration ----------------------------------------------------------------------------------
def test_config_defaults_and_parsing() -> None:
    assert ToolKVConfig.from_env({}) == ToolKVConfig()
    c = ToolKVConfig.from_env(
        {
            "TOOLKV_ENABLE": "1",
            "TOOLKV_TTL_S": "30",
            "TOOLKV_HOST_BUDGET_TOKENS": "1000",
            "TOOLKV_FALLBACK": "shadow",
            "TOOLKV_ZERO_CHANGE": "yes",
            "TOOLKV_SWEEP_EVERY": "8",
        }
    )
    assert (c.enable, c.ttl_s, c.host_budget_tokens, c.fallback, c.zero_change, c.sweep_every) == (
        True,
        30.0,
        1000,
        "shadow",
        True,
        8,
    )
    assert c.manager_config().ttl_s == 30.0


@pytest.mark.parametrize(
    "env",
    [
        {"TOOLKV_ENABLE": "maybe"},
        {"TOOLKV_TTL_S": "-1"},
        {"TOOLKV_TTL_S": "nan"},
        {"TOOLKV_HOST_BUDGET_TOKENS": "lots"},
        {"TOOLKV_FALLBACK": "disk"},
        {"TOOLKV_SWEEP_EVERY": "0"},
    ],
)
def test_config_errors_name_the_variable(env: dict[str, str]) -> None:
    with pytest.raises(ValueError, match=next(iter(env))):
        ToolKVConfig.from_env(env)


# ---- registration -----------------------------------------------------------------------------------
def test_register_is_inert_unless_enabled(monkeypatch: pytest.MonkeyPatch) -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry

    import toolkv.sglang.plugin as plugin

    monkeypatch.delenv("TOOLKV_ENABLE", raising=False)
    before = {k: list(v) for k, v in HookRegistry._hooks.items()}
    plugin.register()
    assert {k: list(v) for k, v in HookRegistry._hooks.items()} == before
    assert not plugin._registered


_LOADER = r"""
import importlib.metadata, json, os, sys
eps = [ep.value for ep in importlib.metadata.entry_points(group="sglang.srt.plugins") if ep.name == "toolkv"]
from sglang.srt.plugins import load_plugins
load_plugins()  # sglang's own loader: entry point -> register() -> HookRegistry.apply_hooks()
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.mem_cache.radix_cache import RadixCache
from sglang.srt.mem_cache.hiradix_cache import HiRadixCache
names = ["__init__", "process_input_requests", "handle_generate_request", "get_internal_state"]
out = {"eps": eps}
out.update({f"Scheduler.{n}": getattr(getattr(Scheduler, n), "__wrapped__", None) is not None for n in names})
out.update({f"RadixCache.{n}": hasattr(getattr(RadixCache, n), "__wrapped__") for n in ["cache_finished_req", "reset"]})
out["HiRadixCache inherits"] = HiRadixCache.cache_finished_req is RadixCache.cache_finished_req
out["HiRadixCache.reset calls super"] = "super().reset()" in __import__("inspect").getsource(HiRadixCache.reset)
print("RESULT" + json.dumps(out))
"""


def test_entry_point_loads_through_sglangs_plugin_loader() -> None:
    """In a fresh interpreter (hooks patch classes process-wide): sglang's ``load_plugins`` finds
    the entry point, runs ``register`` and patches every scheduler-side target."""
    env = dict(os.environ, TOOLKV_ENABLE="1", OMP_NUM_THREADS="1")
    p = subprocess.run(
        [sys.executable, "-c", _LOADER], capture_output=True, text=True, env=env, timeout=240, check=False
    )
    line = [x for x in p.stdout.splitlines() if x.startswith("RESULT")]
    assert line, p.stdout[-2000:] + p.stderr[-4000:]
    import json

    res = json.loads(line[0][len("RESULT") :])
    assert res.pop("eps") == ["toolkv.sglang.plugin:register"]
    assert all(res.values()), res


def test_http_side_targets_exist_in_sglang_source() -> None:
    """The HTTP process targets cannot be imported on this CPU box (uvloop), so check the source."""

    def defs(path: Path, cls: str | None) -> set[str]:
        tree = ast.parse(path.read_text())
        body: list[ast.stmt] = tree.body
        if cls is not None:
            body = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls).body
        return {n.name for n in body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}

    assert "launch_server" in defs(SGLANG / "srt/entrypoints/http_server.py", None)
    chat = defs(SGLANG / "srt/entrypoints/openai/serving_chat.py", "OpenAIServingChat")
    assert {"_handle_non_streaming_request", "_generate_chat_stream"} <= chat
    targets = {t for t, _, _ in hooks(main_process=True, config=ToolKVConfig(zero_change=True))}
    assert len(targets) == 11  # with HiRadixCache.writing_check (write_back's drain)
    assert {t for t, _, _ in hooks(main_process=False, config=ToolKVConfig(zero_change=True))} < targets


# ---- start-up refusals ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("flag", "value", "words"),
    [
        ("enable_streaming_session", True, "streaming sessions"),
        ("pp_size", 2, "pipeline parallelism"),
        ("enable_dp_attention", True, "DP attention"),
        ("tokenizer_worker_num", 2, "tokenizer workers"),
        ("enable_session_radix_cache", True, "session-radix-cache"),
        ("dp_size", 2, "data parallelism"),
    ],
)
def test_unsupported_configurations_are_refused(flag: str, value: object, words: str) -> None:
    sa = make_server_args(HarnessConfig())  # hierarchical cache on
    assert unsupported_reasons(sa) == []
    setattr(sa, flag, value)
    with pytest.raises(Unsupported, match=words) as ei:
        check_server_args(sa)
    assert ei.value.http_status == 501 and "TOOLKV_ENABLE" in ei.value.message


def test_only_exact_radix_and_hiradix_trees_are_accepted(hh: CacheHarness) -> None:
    check_tree(hh.tree)

    class Wrapped:  # e.g. StreamingSession, UnifiedRadixCache: anything else is refused
        pass

    with pytest.raises(Unsupported, match="Wrapped"):
        check_tree(Wrapped())


def test_scheduler_init_hook_refuses_unsupported_config(hh: CacheHarness) -> None:
    sched = fake_scheduler(hh, enable_streaming_session=True)
    with pytest.raises(Unsupported, match="streaming"):
        after_scheduler_init(None, sched)
    assert not hasattr(sched, "_toolkv")


# ---- scheduler-side hooks over the real cache -------------------------------------------------------
def call(sched: Any, op: str, **body: Any) -> ToolKVReqOutput:
    out = sched._request_dispatcher(ToolKVReqInput(rid=f"r-{op}", op=op, body=body))
    assert isinstance(out, ToolKVReqOutput) and out.rid == f"r-{op}"
    return out


def test_full_cycle_through_the_hooks_returns_every_resource(
    hh: CacheHarness, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TOOLKV_LAZY_FREE", "0")  # the host->GPU restore path (lazy free: test_lazy_free.py)
    h = hh
    initial = h.accounting()
    sched = fake_scheduler(h)
    after_scheduler_init(None, sched)
    tk: SchedulerToolKV = sched._toolkv
    assert h.tree._toolkv is tk and tk.manager.backend.name == "hiradix"

    assert finish_turn(h, "s1", PROMPT, [41, 42, 43, 44])
    meta = call(sched, "kv_meta", session_id="s1")
    assert meta.ok and meta.body["state"] == "Running" and meta.body["tokens"] == 43
    assert finish_turn(h, None, [900, 901, 902], [903])  # no session label: not tracked
    assert call(sched, "kv_meta").body["sessions"] == 1

    started = call(sched, "tool_start", session_id="s1")
    assert started.ok and started.body["epoch"] == 1
    free0 = h.allocator.available_size()
    iteration(h, tk, writes=True)
    assert call(sched, "kv_meta", session_id="s1").body["state"] == "Offloaded"
    assert h.allocator.available_size() - free0 == 43, "the session's device tokens were freed"

    ended = call(sched, "tool_end", session_id="s1", epoch=1)
    assert ended.ok and ended.body["state"] == "Restoring"
    iteration(h, tk, loads=True)
    assert call(sched, "kv_meta", session_id="s1").body["state"] == "Handover"

    # the next turn is admitted (the get_new_batch_prefill hook), extends the session; its record follows the new leaf
    assert finish_turn(h, "s1", [*PROMPT, 41, 42, 43, 44, 50, 51], [52, 53], slot=1)
    assert call(sched, "kv_meta", session_id="s1").body["tokens"] == 47

    assert call(sched, "close", session_id="s1").ok
    h.drain()
    assert h.accounting() == initial


def test_errors_travel_as_typed_replies(hh: CacheHarness) -> None:
    sched = fake_scheduler(hh)
    after_scheduler_init(None, sched)
    assert finish_turn(hh, "s1", PROMPT, [41])
    assert call(sched, "tool_start", session_id="nope").status == 404
    r = call(sched, "tool_end", session_id="s1", epoch=3)
    assert (r.ok, r.status, r.body["error"], r.body["current_epoch"]) == (False, 409, "stale_epoch", 0)
    assert call(sched, "tool_end", session_id="s1", epoch=0).body["error"] == "wrong_state"
    assert call(sched, "tool_start").status == 400
    assert call(sched, "frobnicate", session_id="s1").status == 400
    assert call(sched, "kv_meta", session_id="s1").body["state"] == "Running"


def test_tree_reset_hook_marks_offloaded_sessions_lost(hh: CacheHarness) -> None:
    sched = fake_scheduler(hh)
    after_scheduler_init(None, sched)
    assert finish_turn(hh, "s1", PROMPT, [41])
    call(sched, "tool_start", session_id="s1")
    iteration(hh, hh.tree._toolkv, writes=True)  # flush_cache needs an idle scheduler: the offload finished
    assert call(sched, "kv_meta", session_id="s1").body["state"] == "Offloaded"
    hh.tree.reset()  # what flush_cache does (scheduler.py:3851)
    after_tree_reset(None, hh.tree)  # the AFTER hook on RadixCache.reset
    assert call(sched, "kv_meta", session_id="s1").body["state"] == "Lost"
    assert call(sched, "tool_end", session_id="s1", epoch=1).status == 409


@pytest.mark.parametrize("fallback", ["pin", "shadow"])
def test_plain_radix_cache_uses_the_configured_fallback(
    fallback: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TOOLKV_FALLBACK", fallback)
    with CacheHarness(HarnessConfig(kind="radix")) as h:
        initial = h.accounting()
        sched = fake_scheduler(h)
        after_scheduler_init(None, sched)
        assert sched._toolkv.manager.backend.name == fallback
        assert finish_turn(h, "s1", PROMPT, [41, 42])
        r = call(sched, "tool_start", session_id="s1")
        assert r.ok and r.body["state"] == "Offloaded"
        assert call(sched, "tool_end", session_id="s1", epoch=1).body["state"] == "Handover"
        call(sched, "close", session_id="s1")
        h.drain()
        assert h.accounting() == initial


# ---- zero-change -------------------------------------------------------------------------------------
def test_zero_change_decision_tables() -> None:
    assert decide_on_tool_calls("Running", zero_change=True) == "offload"
    assert decide_on_tool_calls("Running", zero_change=False) == "skip:disabled"
    assert decide_on_tool_calls(None, zero_change=True) == "skip:untracked"
    for s in ("Offloading", "Offloaded", "Restoring", "Closed"):
        assert decide_on_tool_calls(s, zero_change=True) == f"skip:{s}"
    for s in ("Offloading", "Offloaded"):
        assert decide_on_request(s, restore_on_request=True) == "restore"
        assert decide_on_request(s, restore_on_request=False) == "none"
    for s in (None, "Running", "Restoring", "Runnable", "Expired", "Lost"):
        assert decide_on_request(s, restore_on_request=True) == "none"


def test_zero_change_offloads_on_tool_calls_and_next_request_restores(hh: CacheHarness) -> None:
    h = hh
    initial = h.accounting()
    tk = SchedulerToolKV(h.tree, config=ToolKVConfig(zero_change=True, lazy_free=False))
    h.tree._toolkv = tk
    assert finish_turn(h, "agent", PROMPT, [41, 42])
    assert tk.handle("auto_offload", {"session_id": "agent"})[1]["state"] == "Offloading"
    iteration(h, tk, writes=True)
    assert tk.manager.kv_meta("agent")["tier"] == "CpuProtected"
    # the tool result comes back as the session's next chat request: its arrival restores
    tk.on_request("agent")
    assert tk.manager.kv_meta("agent")["state"] == "Restoring"
    iteration(h, tk, loads=True)
    assert finish_turn(h, "agent", [*PROMPT, 41, 42, 60, 61], [62], slot=1)
    meta = tk.manager.kv_meta("agent")
    assert meta["state"] == "Running" and meta["epoch"] == 1 and meta["tokens"] == 44
    # untracked sessions and a disabled server are skipped, never errors
    assert tk.handle("auto_offload", {"session_id": "ghost"}) == (200, {"skipped": "skip:untracked"})
    tk.manager.close("agent")
    h.drain()
    assert h.accounting() == initial


def test_turn_finishing_while_offloaded_settles_and_keeps_the_epoch(hh: CacheHarness) -> None:
    """A client that never calls tool_end, and whose restore is deferred (no device memory): the
    next turn still records, toolkv releases what it held and the old epoch stays stale."""
    h = hh
    initial = h.accounting()
    tk = SchedulerToolKV(h.tree, config=ToolKVConfig(restore_on_request=False, lazy_free=False))
    h.tree._toolkv = tk
    assert finish_turn(h, "s", PROMPT, [41])
    tk.handle("tool_start", {"session_id": "s"})
    iteration(h, tk, writes=True)
    assert tk.manager.kv_meta("s")["state"] == "Offloaded"
    assert finish_turn(h, "s", [*PROMPT, 41, 70], [71], slot=1)  # recomputed / reloaded by sglang
    meta = tk.manager.kv_meta("s")
    assert meta["state"] == "Running" and meta["epoch"] == 1 and meta["protected"] is False
    assert tk.handle("tool_end", {"session_id": "s", "epoch": 1})[0] == 409
    tk.manager.close("s")
    h.drain()
    assert h.accounting() == initial


def test_http_side_zero_change_hook_sends_auto_offload(hh: CacheHarness) -> None:
    import toolkv.sglang.plugin as plugin

    tk = SchedulerToolKV(hh.tree, config=ToolKVConfig(zero_change=True, lazy_free=False))
    hh.tree._toolkv = tk
    assert finish_turn(hh, "agent", PROMPT, [41])
    channel = LoopbackChannel(tk)
    plugin._transport, saved = channel, plugin._transport
    try:
        response = SimpleNamespace(choices=[SimpleNamespace(finish_reason="tool_calls")])

        async def original(serving: Any, adapted: Any, request: Any, raw: Any) -> Any:
            return response

        async def run() -> Any:
            req = SimpleNamespace(session_id="agent")
            got = await around_chat_non_streaming(original, object(), object(), req, object())
            await asyncio.sleep(0)
            return got

        assert asyncio.run(run()) is response
    finally:
        plugin._transport = saved
    assert [r.op for r in channel.sent] == ["auto_offload"]
    assert tk.manager.kv_meta("agent")["state"] == "Offloading"


def test_zero_change_names_the_models_tool_for_the_policy(hh: CacheHarness) -> None:
    import toolkv.sglang.plugin as plugin

    tk = SchedulerToolKV(hh.tree, config=ToolKVConfig(zero_change=True, policy="auto", lazy_free=False))
    hh.tree._toolkv = tk
    assert finish_turn(hh, "agent", PROMPT, [41])
    channel = LoopbackChannel(tk)
    plugin._transport, saved = channel, plugin._transport
    try:
        call = SimpleNamespace(function=SimpleNamespace(name="web_search", arguments="{}"))
        msg = SimpleNamespace(tool_calls=[call])
        response = SimpleNamespace(choices=[SimpleNamespace(finish_reason="tool_calls", message=msg)])

        async def original(serving: Any, adapted: Any, request: Any, raw: Any) -> Any:
            return response

        async def run() -> Any:
            got = await around_chat_non_streaming(
                original, object(), object(), SimpleNamespace(session_id="agent"), object()
            )
            await asyncio.sleep(0)
            return got

        assert asyncio.run(run()) is response
    finally:
        plugin._transport = saved
    assert [r.body for r in channel.sent] == [{"session_id": "agent", "tool": "web_search"}]
    meta = tk.manager.kv_meta("agent")
    assert meta["tool"] == "web_search" and meta["decision"] in ("keep", "offload", "let_go")


def test_zero_change_offloads_the_session_a_header_labelled(hh: CacheHarness) -> None:
    """Behind sglang's router the chat body has no ``session_id``; with TOOLKV_SESSION_HEADER the
    ``GenerateReqInput`` the chat route built was labelled from the header before it was served
    (tests/test_session_header.py), and the zero-change offload goes to that session."""
    from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest
    from sglang.srt.managers.io_struct import GenerateReqInput
    from starlette.requests import Request

    import toolkv.sglang.plugin as plugin

    tk = SchedulerToolKV(hh.tree, config=ToolKVConfig(zero_change=True, lazy_free=False))
    hh.tree._toolkv = tk
    assert finish_turn(hh, "agent", PROMPT, [41])
    raw = Request({"type": "http", "headers": [(b"x-smg-routing-key", b"agent")]})
    chat = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}])
    adapted = GenerateReqInput(input_ids=PROMPT, session_id=chat.session_id)  # as serving_chat builds it
    channel = LoopbackChannel(tk)
    plugin._transport, saved = channel, plugin._transport
    try:
        response = SimpleNamespace(choices=[SimpleNamespace(finish_reason="tool_calls")])

        async def original(serving: Any, adapted: Any, request: Any, raw: Any) -> Any:
            assert plugin.label_from_header(adapted, raw, "x-smg-routing-key")  # generate_request's hook
            return response

        async def run() -> Any:
            got = await around_chat_non_streaming(original, object(), adapted, chat, raw)
            await asyncio.sleep(0)
            return got

        assert asyncio.run(run()) is response
    finally:
        plugin._transport = saved
    assert chat.session_id is None and [r.body for r in channel.sent] == [{"session_id": "agent"}]
    assert tk.manager.kv_meta("agent")["state"] == "Offloading"


# ---- fail-closed start-up, through sglang's real loader -------------------------------------------
_SCENARIOS = r"""
import json, os, sys
import sglang.srt.plugins as plugins
from sglang.srt.plugins.hook_registry import HookRegistry

def attempt(name, env, prepare=None):
    for k in [k for k in os.environ if k.startswith("TOOLKV_")]:
        del os.environ[k]
    os.environ.update(env)
    plugins._plugins_loaded = False  # load_plugins() runs once per process; each scenario is a launch
    if "toolkv.sglang.plugin" in sys.modules:
        sys.modules["toolkv.sglang.plugin"]._registered = False
    if prepare:
        prepare()
    before = sum(len(v) for v in HookRegistry._hooks.values())
    try:
        plugins.load_plugins()  # sglang's loader: entry point -> register() -> apply_hooks()
        out = {"exit": None, "message": ""}
    except SystemExit as e:  # what ends the launching process
        out = {"exit": type(e).__name__, "message": str(e.code)}
    out["hooks"] = sum(len(v) for v in HookRegistry._hooks.values()) - before
    print("SCENARIO " + json.dumps({"name": name, **out}), flush=True)

def no_transitions():
    sys.modules["transitions"] = None  # not installed (a --no-deps install)

def restore_transitions():
    del sys.modules["transitions"]

def other_sglang():
    import sglang.version
    sglang.version.__version__ = "0.5.99"

def this_sglang():
    import sglang.version
    sglang.version.__version__ = "0.5.16"

attempt("disabled, bad value", {"TOOLKV_TTL_S": "ten"})
attempt("missing dependency", {"TOOLKV_ENABLE": "1"}, no_transitions)
restore_transitions()
attempt("bad value", {"TOOLKV_ENABLE": "1", "TOOLKV_TTL_S": "ten"})
attempt("bad switch", {"TOOLKV_ENABLE": "maybe"})
attempt("unsupported sglang", {"TOOLKV_ENABLE": "1"}, other_sglang)
this_sglang()

# a target sglang cannot patch: the registry logs it and goes on; toolkv's first hook refuses
from sglang.srt.managers.scheduler import Scheduler
saved = Scheduler.__dict__["get_internal_state"]
del Scheduler.get_internal_state
attempt("hook not applied", {"TOOLKV_ENABLE": "1"})
Scheduler.get_internal_state = saved
from toolkv.sglang import plugin
try:
    plugin._check_hooks_applied(main_process=False)
    print("SCENARIO " + json.dumps({"name": "hook check", "exit": None, "message": ""}))
except Exception as e:
    print("SCENARIO " + json.dumps({"name": "hook check", "exit": type(e).__name__, "message": str(e)}))
"""


def _scenarios(script: str, env: dict[str, str] | None = None) -> dict[str, dict[str, Any]]:
    import json

    full = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    full.pop("TOOLKV_ENABLE", None)
    p = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=full, timeout=300, check=False
    )
    found = {}
    for line in p.stdout.splitlines():
        if line.startswith("SCENARIO "):
            d = json.loads(line[len("SCENARIO ") :])
            found[d.pop("name")] = d
    assert found, p.stdout[-2000:] + p.stderr[-4000:]
    return found


def test_startup_is_fail_closed_through_sglangs_plugin_loader() -> None:
    """sglang's loader catches every Exception of a plugin and serves on without it; toolkv,
    once enabled, stops the launch instead and names the cause. Disabled, it stays inert."""
    r = _scenarios(_SCENARIOS)
    assert r["disabled, bad value"] == {"exit": None, "message": "", "hooks": 0}
    for name, words in [
        ("missing dependency", "transitions>=0.9"),
        ("bad value", "TOOLKV_TTL_S='ten'"),
        ("bad switch", "TOOLKV_ENABLE='maybe'"),
        ("unsupported sglang", "sglang 0.5.99 is not a release toolkv supports (supported: 0.5.16, 0.5.23)"),
    ]:
        assert r[name]["exit"] == "StartupRefused", (name, r[name])
        assert words in r[name]["message"] and "refusing to start" in r[name]["message"], r[name]
        assert r[name]["hooks"] == 0, "nothing may be hooked before the guards pass"
    assert r["hook not applied"]["exit"] is None and r["hook not applied"]["hooks"] > 0
    assert r["hook check"]["exit"] == "Unsupported"
    assert "Scheduler.get_internal_state" in r["hook check"]["message"]


def test_bad_config_stops_sglang_launch_server() -> None:
    """The launch an operator runs: ``python -m sglang.launch_server`` loads plugins before it
    parses its arguments, so a typo in TOOLKV_* ends the process with the message, before any
    model is touched (the model path here does not exist)."""
    env = dict(os.environ, TOOLKV_ENABLE="1", TOOLKV_TTL_S="ten", OMP_NUM_THREADS="1")
    p = subprocess.run(
        [sys.executable, "-m", "sglang.launch_server", "--model-path", "/nonexistent/model"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert p.returncode == 1, (p.returncode, p.stderr[-3000:])
    assert "toolkv: refusing to start: TOOLKV_TTL_S='ten': expected a finite number" in p.stderr
    assert "Traceback" not in p.stderr


def test_unsupported_version_table_is_one_place() -> None:
    from toolkv.errors import StartupRefused
    from toolkv.sglang.startup import SUPPORTED, check_sglang_version

    assert set(SUPPORTED) == {"0.5.16", "0.5.23"}
    assert check_sglang_version("0.5.16") is SUPPORTED["0.5.16"]
    with pytest.raises(StartupRefused, match=r"0\.5\.15"):
        check_sglang_version("0.5.15")


def test_release_0516_needs_no_extra_setting_and_hooks_the_radix_cache() -> None:
    """The 0.5.16 row of the release table, against the installed 0.5.16: no environment setting
    and no server flag is required (a plain RadixCache falls back to pinning), and the turn is
    captured on ``RadixCache.cache_finished_req``, not on 0.5.23's ``checkpoint``."""
    from toolkv.sglang.startup import SUPPORTED, check_environment, environment_reasons, flag_reasons

    assert __import__("sglang").__version__ == "0.5.16"
    assert SUPPORTED["0.5.16"].tree == "radix"
    assert environment_reasons("0.5.16", {}) == []
    check_environment("0.5.16", {"SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND": "rust"})  # not read on 0.5.16
    sa = make_server_args(HarnessConfig(kind="radix"))
    assert not sa.enable_hierarchical_cache and flag_reasons("0.5.16", sa) == []
    assert unsupported_reasons(sa) == []
    targets = {t for t, _, _ in hooks(main_process=False, config=ToolKVConfig())}
    assert "sglang.srt.mem_cache.radix_cache.RadixCache.cache_finished_req" in targets
    assert not any("UnifiedRadixCache" in t for t in targets)


# ---- TP rank/size, start-up lines, host sizing --------------------------------------------------------
def test_tp_rank_and_size_come_from_sglangs_parallel_state(
    hh: CacheHarness, caplog: pytest.LogCaptureFixture
) -> None:
    sched = fake_scheduler(hh, tp_rank=1, tp_size=2)
    assert not hasattr(sched, "tp_size") and not hasattr(sched, "tp_rank")
    with caplog.at_level("INFO", logger="toolkv"):
        after_scheduler_init(None, sched)
    tk: SchedulerToolKV = sched._toolkv
    assert (tk.status()["tp_rank"], tk.status()["tp_size"]) == (1, 2)
    assert (tk.metrics()["tp_rank"], tk.metrics()["tp_size"]) == (1, 2)
    assert "toolkv enabled on scheduler tp_rank=1 tp_size=2: backend=hiradix" in caplog.text


def test_startup_line_has_the_effective_config(hh: CacheHarness, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("INFO", logger="toolkv"):
        after_scheduler_init(None, fake_scheduler(hh))
    line = next(r.getMessage() for r in caplog.records if "toolkv enabled on scheduler" in r.getMessage())
    # the effective settings, layer by layer (toolkv.core.settings: plugin, manager, policy)
    assert "fallback=pin zero_change=False" in line and "ttl_s=600.0 host_budget_tokens=None" in line
    # 2 layers x 2 KV heads x 4 dim x fp32 x (K, V) = 128 bytes; host pool = 2x device + 1 page
    assert "device_pool_tokens=256 host_pool_tokens=513 kv_bytes_per_token=128" in line
    assert not [r for r in caplog.records if r.levelname == "WARNING"]


def test_small_host_pool_warns_once_with_the_numbers(caplog: pytest.LogCaptureFixture) -> None:
    with CacheHarness(HarnessConfig(host_ratio=0.5)) as h, caplog.at_level("INFO", logger="toolkv"):
        after_scheduler_init(None, fake_scheduler(h))
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and r.name == "toolkv"]
    assert len(warnings) == 1
    assert "host pool holds 129 tokens" in warnings[0] and "device pool's 256 tokens" in warnings[0]
    assert "128 bytes/token" in warnings[0] and "--hicache-size 1" in warnings[0]


def test_host_sizing_for_the_8b_example() -> None:
    """The worked example of docs/operations.md: Llama-3.1-8B shape, bf16, one GPU."""
    from toolkv.sglang.sizing import PoolSizes, host_pool_warning

    bpt = 32 * 8 * 128 * 2 * 2
    assert bpt == 128 * 1024
    host_tokens = int(16 * 1e9 // bpt)  # --hicache-size 16, as sglang computes it
    assert host_tokens == 122_070
    s = PoolSizes(device_tokens=120_000, host_tokens=host_tokens, bytes_per_token=bpt)
    assert s.suggested_hicache_size() == 32
    w = host_pool_warning(s)
    assert w is None  # 122,070 > 120,000: larger, just
    w = host_pool_warning(PoolSizes(device_tokens=122_880, host_tokens=host_tokens, bytes_per_token=bpt))
    assert (
        w is not None and "122,070 tokens (16.0 GB at 131,072 bytes/token)" in w and "--hicache-size 33" in w
    )


# ---- structured decision log ----------------------------------------------------------------------
def _decisions(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("toolkv decision ")]


def test_every_decision_is_one_structured_line(hh: CacheHarness, caplog: pytest.LogCaptureFixture) -> None:
    h = hh
    tk = SchedulerToolKV(h.tree, config=ToolKVConfig(ttl_s=5.0, sweep_every=1, lazy_free=False), clock=None)
    h.tree._toolkv = tk
    assert finish_turn(h, "s1", PROMPT, [41, 42])
    assert finish_turn(h, 'we"ird id', [*range(500, 520)], [521], slot=1)
    with caplog.at_level("INFO", logger="toolkv"):
        tk.handle("tool_start", {"session_id": "s1"})
        tk.handle("tool_end", {"session_id": "s1", "epoch": 9})
        tk.handle("kv_meta", {"session_id": "s1"})  # a read: no decision line
        tk.handle("tool_start", {"session_id": "ghost"})
        tk.handle("auto_offload", {"session_id": "ghost"})
        tk.handle("tool_start", {"session_id": 'we"ird id'})
        iteration(h, tk, writes=True)
        tk.clock.source = lambda: 1e12  # far past every deadline: the TTL sweep ends both protections
        iteration(h, tk)
    lines = _decisions(caplog)
    assert lines[:5] == [
        "toolkv decision op=tool_start session=s1 epoch=1 state=Offloading tokens=41 outcome=ok reason=policy_offload rank=0",
        "toolkv decision op=tool_end session=s1 epoch=1 state=Offloading tokens=41 outcome=refused reason=stale_epoch rank=0 asked=9",
        "toolkv decision op=tool_start session=ghost epoch=- state=- tokens=- outcome=refused reason=unknown_session rank=0",
        "toolkv decision op=auto_offload session=ghost epoch=- state=- tokens=- outcome=skipped reason=skip:disabled rank=0",
        'toolkv decision op=tool_start session="we\\"ird id" epoch=1 state=Offloading tokens=20 outcome=ok reason=policy_offload rank=0',
    ]
    assert sorted(lines[5:]) == [  # both expire in the same sweep
        'toolkv decision op=ttl_sweep session="we\\"ird id" epoch=1 state=Expired tokens=20 outcome=ok reason=expired rank=0',
        "toolkv decision op=ttl_sweep session=s1 epoch=1 state=Expired tokens=41 outcome=ok reason=expired rank=0",
    ]


def test_other_ranks_log_decisions_at_debug(hh: CacheHarness, caplog: pytest.LogCaptureFixture) -> None:
    tk = SchedulerToolKV(hh.tree, tp_rank=1, tp_size=2)
    hh.tree._toolkv = tk
    assert finish_turn(hh, "s1", PROMPT, [41])
    with caplog.at_level("DEBUG", logger="toolkv"):
        tk.handle("tool_start", {"session_id": "s1"})
    (rec,) = [r for r in caplog.records if r.getMessage().startswith("toolkv decision ")]
    assert rec.levelname == "DEBUG" and rec.getMessage().endswith("rank=1")


# ---- Prometheus metrics ---------------------------------------------------------------------------
_SCHEDULER_RANK = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
from _turns import finish_turn, iteration
from toolkv.sglang.metrics import ToolKVMetrics
from toolkv.sglang.scheduler_side import SchedulerToolKV
from toolkv.testing.harness import CacheHarness, HarnessConfig

with CacheHarness(HarnessConfig()) as h:
    tk = SchedulerToolKV(h.tree, metrics=ToolKVMetrics({"model_name": "m", "tp_rank": "0"}, refresh_s=0))
    h.tree._toolkv = tk
    assert finish_turn(h, "s1", list(range(1, 41)), [41, 42])
    assert finish_turn(h, "s2", list(range(100, 120)), [121], slot=1)
    assert tk.handle("tool_start", {"session_id": "s1"})[0] == 200
    assert tk.handle("tool_end", {"session_id": "s1", "epoch": 5})[0] == 409
    iteration(h, tk, writes=True)
    assert tk.handle("tool_end", {"session_id": "s1", "epoch": 1})[0] == 200
    iteration(h, tk, loads=True)
    assert tk.handle("tool_start", {"session_id": "s2"})[0] == 200
    iteration(h, tk)
    print("META " + json.dumps(tk.metrics()))
"""


def test_metrics_are_scraped_from_sglangs_metrics_route(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A scheduler rank (its own process, as in sglang) writes toolkv's collectors into
    PROMETHEUS_MULTIPROC_DIR; the HTTP side serves them through sglang's own /metrics mount
    (``add_prometheus_middleware``, what ``--enable-metrics`` installs) on the app with toolkv's
    routes."""
    import json
    import socket

    from fastapi.testclient import TestClient
    from prometheus_client.parser import text_string_to_metric_families
    from sglang.srt.utils.common import add_prometheus_middleware

    from toolkv.sglang.http_api import build_app

    with socket.socket() as s:  # the child's own gloo store: not the port this process's group holds
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(tmp_path), OMP_NUM_THREADS="1", MASTER_PORT=port)
    p = subprocess.run(
        [sys.executable, "-c", _SCHEDULER_RANK, str(Path(__file__).parent)],
        capture_output=True, text=True, env=env, timeout=300, check=False,
    )  # fmt: skip
    meta_line = [x for x in p.stdout.splitlines() if x.startswith("META ")]
    assert p.returncode == 0 and meta_line, p.stderr[-4000:]
    meta = json.loads(meta_line[0][5:])

    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    app = build_app(LoopbackChannel(None))
    add_prometheus_middleware(app)
    r = TestClient(app).get("/metrics")
    assert r.status_code == 200
    got: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("model_name", "tp_rank")))
            got[(s.name, labels)] = s.value

    def g(name: str, **labels: str) -> float:
        return got[(name, tuple(sorted(labels.items())))]

    # s1 restored (pinned until its next request: Handover); s2 was backed up already: offloaded at once
    assert meta["states"] == {"Handover": 1, "Offloaded": 1}
    assert g("toolkv:sessions", state="Handover") == 1 and g("toolkv:sessions", state="Offloaded") == 1
    assert g("toolkv:sessions", state="Expired") == 0
    assert g("toolkv:decisions_total", op="tool_start", outcome="ok") == 2
    assert g("toolkv:decisions_total", op="tool_end", outcome="stale_epoch") == 1
    assert g("toolkv:decisions_total", op="tool_end", outcome="ok") == 1
    assert g("toolkv:offload_seconds_count") == 2 and g("toolkv:restore_seconds_count") == 1
    assert g("toolkv:offload_bytes_sum") == (41 + 20) * 128  # 128 bytes/token in this shape
    assert g("toolkv:restore_bytes_sum") == 41 * 128
    assert g("toolkv:events_total", event="turns") == 2 and g("toolkv:events_total", event="stale_epoch") == 1
    assert g("toolkv:tokens_total", kind="offloaded") == 41 + 20
    assert g("toolkv:protected_tokens") == meta["protected_tokens"] == 20
    assert g("toolkv:device_free_tokens") == meta["device_free_tokens"]
    assert g("toolkv:host_total_tokens") == meta["host_total_tokens"]
    assert g("toolkv:host_used_tokens") == meta["host_total_tokens"] - meta["host_free_tokens"]


def test_metrics_follow_sglangs_enable_metrics(hh: CacheHarness) -> None:
    from toolkv.sglang.plugin import make_metrics

    assert make_metrics(make_server_args(hh.cfg), fake_scheduler(hh)) is None  # no --enable-metrics
    from sglang.srt.distributed.parallel_state_wrapper import ParallelState

    sa = make_server_args(hh.cfg)
    sa.enable_metrics = True
    other = SimpleNamespace(ps=ParallelState.trivial(tp_rank=1, tp_size=2, attn_tp_rank=1, attn_tp_size=2))
    assert make_metrics(sa, other) is None  # sglang reports from attention-TP rank 0 only
