"""``TOOLKV_SESSION_HEADER``: a request without a body ``session_id`` is labelled from a header.

Why it exists: sglang's router (sglang-router 0.3.2) re-serialises each body from its own types,
which have no ``session_id``, and forwards the header it routes by (``X-SMG-Routing-Key``). With
the setting, toolkv's BEFORE hook on ``TokenizerManager.generate_request`` copies that header into
``GenerateReqInput.session_id``, in the HTTP process, before sglang normalises the request.

What is real: sglang's ``HookRegistry`` (and, in a fresh interpreter, sglang's plugin loader)
patching the real ``TokenizerManager.generate_request``; the real ``GenerateReqInput`` and its
``normalize_batch_and_arguments``; a real Starlette ``Request`` carrying the header. What is not:
uvloop, which sglang's tokenizer manager imports and this CPU box lacks (:func:`uvloop_stand_in`),
and a constructed ``TokenizerManager`` (it needs a model): the patched method is called on a bare
instance, and the async generator it returns is not run (the hook has done its work by then).

Runs on both releases: in ``.venv`` (sglang 0.5.16) and in ``make test-0523`` (sglang 0.5.23).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import subprocess
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from toolkv.errors import StartupRefused
from toolkv.sglang.config import ToolKVConfig
from toolkv.sglang.plugin import TOKENIZER, hooks

SGLANG = Path(str(__import__("sglang").__file__)).parent
TARGET = f"{TOKENIZER}.generate_request"
HEADER = "X-SMG-Routing-Key"


def uvloop_stand_in() -> None:
    """sglang's tokenizer manager imports uvloop (and installs its loop policy). TEST DOUBLE where
    uvloop is not installed: asyncio's default policy."""
    try:
        import uvloop  # noqa: F401
    except ImportError:
        mod = types.ModuleType("uvloop")
        mod.EventLoopPolicy = asyncio.DefaultEventLoopPolicy  # type: ignore[attr-defined]
        sys.modules["uvloop"] = mod


@contextlib.contextmanager
def hooked(config: ToolKVConfig) -> Iterator[Any]:
    """The main process's ``generate_request`` rows of the plugin for ``config``, applied by
    sglang's real ``HookRegistry`` alone (other registrations set aside); yields the
    ``TokenizerManager`` class. Undone after."""
    uvloop_stand_in()
    from sglang.srt.managers.tokenizer_manager import TokenizerManager
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    original = TokenizerManager.__dict__["generate_request"]
    saved_hooks = {k: list(v) for k, v in HookRegistry._hooks.items()}
    saved_patched = set(HookRegistry._patched)
    HookRegistry._hooks.clear()
    HookRegistry._patched.clear()
    for target, hook, kind in hooks(main_process=True, config=config):
        if target == TARGET:
            HookRegistry.register(target, hook, getattr(HookType, kind))
    HookRegistry.apply_hooks()
    try:
        yield TokenizerManager
    finally:
        TokenizerManager.generate_request = original
        HookRegistry._hooks.clear()
        HookRegistry._hooks.update(saved_hooks)
        HookRegistry._patched.clear()
        HookRegistry._patched.update(saved_patched)


def http_request(headers: dict[str, str]) -> Any:
    """A real Starlette request as sglang's ASGI server builds it (header names lower-cased)."""
    from starlette.requests import Request

    raw = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]
    return Request({"type": "http", "method": "POST", "path": "/generate", "headers": raw})


def call(tm_cls: Any, obj: Any, request: Any) -> None:
    """What sglang's routes do: ``tokenizer_manager.generate_request(obj, request)``. The BEFORE
    hook runs when the method is called; the returned async generator is not run."""
    gen = tm_cls.generate_request(object.__new__(tm_cls), obj, request)
    assert type(gen).__name__ == "async_generator"


def gri(**kw: Any) -> Any:
    from sglang.srt.managers.io_struct import GenerateReqInput

    kw.setdefault("input_ids", [1, 2, 3])
    return GenerateReqInput(**kw)


ON = ToolKVConfig(enable=True, session_header="x-smg-routing-key")


# ---- the setting ------------------------------------------------------------------------------------
def test_setting_is_off_by_default_and_case_insensitive() -> None:
    assert ToolKVConfig.from_env({}).session_header == ""
    assert ToolKVConfig.from_env({"TOOLKV_SESSION_HEADER": " "}).session_header == ""
    assert ToolKVConfig.from_env({"TOOLKV_SESSION_HEADER": HEADER}).session_header == "x-smg-routing-key"
    assert "TOOLKV_SESSION_HEADER" in ToolKVConfig.variables()
    assert ToolKVConfig.from_env({"TOOLKV_SESSION_HEADER": HEADER}).describe()["session_header"] == (
        "x-smg-routing-key"
    )


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ("X-SMG-Routing-Key: agent-7", "expected an HTTP header name"),
        ("X SMG", "expected an HTTP header name"),
        ("x-smg-routing-kéy", "expected an HTTP header name"),
        ("Authorization", "a credential header cannot be a session id"),
        ("cookie", "a credential header cannot be a session id"),
    ],
)
def test_bad_value_is_refused_naming_the_variable(value: str, words: str) -> None:
    with pytest.raises(ValueError, match=re.escape(words)) as ei:
        ToolKVConfig.from_env({"TOOLKV_ENABLE": "1", "TOOLKV_SESSION_HEADER": value})
    assert str(ei.value).startswith("TOOLKV_SESSION_HEADER=")


def test_bad_value_stops_the_plugin_with_a_typed_startup_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """``register`` (sglang's entry point) turns it into ``StartupRefused``, a ``SystemExit`` that
    sglang's loader does not swallow, before anything is registered."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    import toolkv.sglang.plugin as plugin

    monkeypatch.setattr(plugin, "_registered", False)
    monkeypatch.setenv("TOOLKV_ENABLE", "1")
    monkeypatch.setenv("TOOLKV_SESSION_HEADER", "X-SMG-Routing-Key: agent-7")
    before = {k: list(v) for k, v in HookRegistry._hooks.items()}
    with pytest.raises(StartupRefused, match="TOOLKV_SESSION_HEADER=") as ei:
        plugin.register()
    assert isinstance(ei.value, SystemExit) and "unset TOOLKV_ENABLE" in ei.value.message
    assert {k: list(v) for k, v in HookRegistry._hooks.items()} == before
    assert not plugin._registered


def test_hook_only_when_set_and_only_in_the_main_process() -> None:
    """Off: no hook (the tokenizer manager is not touched). On: one BEFORE row, in the main
    process only: the tokenizer manager lives there, and a scheduler process never imports it."""
    assert TARGET not in {t for t, _, _ in hooks(main_process=True, config=ToolKVConfig(enable=True))}
    rows = [(t, k) for t, _, k in hooks(main_process=True, config=ON) if t == TARGET]
    assert rows == [(TARGET, "BEFORE")]
    assert TARGET not in {t for t, _, _ in hooks(main_process=False, config=ON)}


# ---- the hook on the real registry ------------------------------------------------------------------
def test_header_labels_a_request_without_a_session() -> None:
    with hooked(ON) as tm:
        obj = gri()
        call(tm, obj, http_request({HEADER: "agent-7"}))
    assert obj.session_id == "agent-7"
    obj.normalize_batch_and_arguments()  # sglang takes it as if the body had carried it
    assert obj.session_id == "agent-7"


def test_the_bodys_own_session_wins() -> None:
    with hooked(ON) as tm:
        obj = gri(session_id="from-body")
        call(tm, obj, http_request({HEADER: "agent-7"}))
    assert obj.session_id == "from-body"


def test_sglang_session_params_are_left_alone() -> None:
    """A body with sglang's own ``session_params`` names its session there, and sglang refuses
    ``session_id`` together with it: the header must not add one."""
    with hooked(ON) as tm:
        obj = gri(session_params={"id": "sglang-session"})
        call(tm, obj, http_request({HEADER: "agent-7"}))
    assert obj.session_id is None
    obj.normalize_batch_and_arguments()


@pytest.mark.parametrize("headers", [{}, {HEADER: ""}, {"X-Other": "agent-7"}])
def test_no_header_changes_nothing(headers: dict[str, str]) -> None:
    with hooked(ON) as tm:
        obj = gri()
        call(tm, obj, http_request(headers))
        no_request = gri()
        call(tm, no_request, None)  # the engine API and the warm-up pass no HTTP request
    assert obj.session_id is None and no_request.session_id is None


def test_setting_off_leaves_the_header_unread() -> None:
    with hooked(ToolKVConfig(enable=True)) as tm:
        assert not hasattr(tm.generate_request, "__wrapped__")
        obj = gri()
        call(tm, obj, http_request({HEADER: "agent-7"}))
    assert obj.session_id is None


def test_a_batch_is_one_request_with_one_session() -> None:
    """sglang's ``session_id`` is one string per request; every item of a batch inherits it
    (``GenerateReqInput.__getitem__``), as with a body ``session_id``."""
    with hooked(ON) as tm:
        obj = gri(input_ids=[[1, 2, 3], [4, 5, 6]])
        call(tm, obj, http_request({HEADER: "agent-7"}))
    obj.normalize_batch_and_arguments()
    assert not obj.is_single and [obj[i].session_id for i in range(2)] == ["agent-7", "agent-7"]


def test_a_configured_mixed_case_name_matches() -> None:
    cfg = ToolKVConfig.from_env({"TOOLKV_SESSION_HEADER": "X-Session-ID"})
    with hooked(cfg) as tm:
        obj = gri()
        call(tm, obj, http_request({"x-session-id": "agent-9"}))
    assert obj.session_id == "agent-9"


# ---- where sglang calls it ----------------------------------------------------------------------------
def test_every_route_passes_the_http_request_to_generate_request() -> None:
    """The label reaches every route toolkv serves because each one calls
    ``generate_request(<GenerateReqInput>, <the HTTP request>)``: ``/generate`` with its body, the
    OpenAI chat and completion routes with the ``GenerateReqInput`` they build, copying the body's
    ``session_id`` (so a body id still wins there)."""
    http = (SGLANG / "srt/entrypoints/http_server.py").read_text()
    assert len(re.findall(r"tokenizer_manager\.generate_request\(\s*obj, request\s*\)", http)) >= 3
    for name in ("serving_chat.py", "serving_completions.py"):
        src = (SGLANG / "srt/entrypoints/openai" / name).read_text()
        assert len(re.findall(r"generate_request\(\s*adapted_request, raw_request\s*\)", src)) == 2, name
        assert "session_id=request.session_id," in src, name
    tm = (SGLANG / "srt/managers/tokenizer_manager.py").read_text()
    assert re.search(r"async def generate_request\(\s*self,\s*obj: [^\n]+,\s*request: Optional", tm)
    # the label travels to the scheduler with the tokenized request
    assert "session_id=obj.session_id," in tm


_LOADER = r"""
import asyncio, json, sys, types
try:
    import uvloop
except ImportError:  # TEST DOUBLE, as in the test module: sglang's tokenizer manager imports it
    m = types.ModuleType("uvloop"); m.EventLoopPolicy = asyncio.DefaultEventLoopPolicy; sys.modules["uvloop"] = m
import sglang.srt.plugins as plugins
plugins.load_plugins()  # sglang's loader: entry point -> register() -> apply_hooks()
from sglang.srt.plugins.hook_registry import HookRegistry
from sglang.srt.managers.io_struct import GenerateReqInput
from sglang.srt.managers.tokenizer_manager import TokenizerManager
from starlette.requests import Request
target = "sglang.srt.managers.tokenizer_manager.TokenizerManager.generate_request"
obj = GenerateReqInput(input_ids=[1, 2, 3])
req = Request({"type": "http", "headers": [(b"x-smg-routing-key", b"agent-7")]})
TokenizerManager.generate_request(object.__new__(TokenizerManager), obj, req)
print("RESULT " + json.dumps({"patched": target in HookRegistry._patched, "session_id": obj.session_id}))
"""


@pytest.mark.parametrize(("header", "want"), [(HEADER, "agent-7"), (None, None)])
def test_through_sglangs_plugin_loader(header: str | None, want: str | None) -> None:
    """A fresh interpreter (hooks patch classes process-wide) launched as the main process: sglang's
    ``load_plugins`` runs toolkv's entry point, which registers the hook only when the setting is
    on, and sglang's registry patches the real method."""
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("TOOLKV_")}
    env.update(TOOLKV_ENABLE="1", SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND="python", OMP_NUM_THREADS="1")
    if header is not None:
        env["TOOLKV_SESSION_HEADER"] = header
    p = subprocess.run(
        [sys.executable, "-c", _LOADER], capture_output=True, text=True, env=env, timeout=240, check=False
    )
    line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
    assert line, p.stdout[-2000:] + p.stderr[-4000:]
    assert json.loads(line[0][len("RESULT ") :]) == {"patched": header is not None, "session_id": want}
