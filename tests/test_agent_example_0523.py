"""``examples/agent_openai.py`` runs, in each of its modes, against the CPU stand-in of an sglang
0.5.23 server (``tests/agent_stand_in_0523.py``: sglang's real request path and cache, toolkv's
real plugin hooks and session routes). The agent uses the real OpenAI client (installed in both
environments) over an in-process transport, and toolkv's ``ToolKVClient``.

Runs in the 0.5.23 environment (``make test-0523``); skips where an older sglang is installed.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from toolkv.testing.unified_harness import has_unified_radix_cache, sglang_version

if not has_unified_radix_cache():
    pytest.skip(f"needs sglang >= 0.5.21 (kv_hints), found {sglang_version()}", allow_module_level=True)

from _generated import load_script
from agent_stand_in_0523 import StandIn0523, hooked
from fastapi.testclient import TestClient
from openai import OpenAI

from toolkv.client import ToolKVClient
from toolkv.twin.stand_in_model import NAME

ANSWER = f"[{NAME}] answer after 2 tool results"  # the stand-in model's text answer

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "agent_openai.py"


def load_example() -> ModuleType:
    return load_script(EXAMPLE)


@pytest.fixture(params=["python", "rust"])
def core(request: pytest.FixtureRequest) -> str:
    """Each 0.5.23 tree core (the Rust one is sglang's default)."""
    return str(request.param)


@pytest.fixture
def server(
    request: pytest.FixtureRequest, core: str, monkeypatch: pytest.MonkeyPatch
) -> Iterator[StandIn0523]:
    for k in ("TOOLKV_POLICY", "TOOLKV_TTL_S"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("TOOLKV_ZERO_CHANGE", "1" if getattr(request, "param", "") == "zero_change" else "0")
    with hooked(), StandIn0523(tree_core=core) as s:
        yield s


def clients(s: StandIn0523) -> tuple[OpenAI, ToolKVClient]:
    tc = TestClient(s.app)
    llm = OpenAI(base_url="http://testserver/v1", api_key="none", http_client=tc, max_retries=0)
    return llm, ToolKVClient("http://testserver", transport=tc._transport)


def test_kv_hints_mode_gets_outcomes_and_epochs_without_extra_calls(server: StandIn0523) -> None:
    ex = load_example()
    llm, kv = clients(server)
    sent = server.tk.manager.counters.copy()
    run = ex.run_agent(llm, kv, model="m", mode="kv_hints", question="why?", session_id="agent-1")
    assert run.answer == ANSWER and run.tool_calls == 2
    assert [o["outcome"] for o in run.outcomes] == ["accepted", "accepted"]
    assert [o["epoch"] for o in run.outcomes] == [1, 2] == run.epochs  # tool_end used the hint's epoch
    c = server.tk.manager.counters
    assert c["tool_start"] - sent["tool_start"] == 3  # two tool calls, and the final answer's turn
    assert server.tk.manager.kv_meta("agent-1")["state"] == "Closed"


@pytest.mark.parametrize("server", ["zero_change"], indirect=True)
def test_zero_change_mode_offloads_on_tool_calls(server: StandIn0523) -> None:
    ex = load_example()
    llm, kv = clients(server)
    run = ex.run_agent(llm, kv, model="m", mode="zero_change", question="why?", session_id="agent-2")
    assert run.answer == ANSWER and run.tool_calls == 2 and run.outcomes == []
    c = server.tk.manager.counters
    assert c["tool_start"] == 2  # one per turn that ended in tool calls, nothing sent by the agent
    assert server.tk.manager.kv_meta("agent-2")["state"] == "Closed"


def test_explicit_mode_uses_the_http_calls(server: StandIn0523) -> None:
    ex = load_example()
    llm, kv = clients(server)
    run = ex.run_agent(llm, kv, model="m", mode="explicit", question="why?", session_id="agent-3")
    assert run.answer == ANSWER and run.tool_calls == 2 and run.epochs == [1, 2]
    assert server.tk.manager.counters["tool_end"] == 2


def test_kv_hints_mode_falls_back_where_no_outcome_comes_back(server: StandIn0523) -> None:
    """A server that drops ``kv_hints`` (sglang 0.5.16): no outcome in meta_info, so the agent
    switches to the HTTP calls."""
    ex = load_example()
    llm, kv = clients(server)
    real = server.generate_obj

    def drop_hints(obj, output, **kw):  # type: ignore[no-untyped-def]
        obj.kv_hints = None
        return real(obj, output, **kw)

    server.generate_obj = drop_hints  # type: ignore[method-assign]
    run = ex.run_agent(llm, kv, model="m", mode="kv_hints", question="why?", session_id="agent-4")
    assert run.answer == ANSWER and run.outcomes == [] and run.epochs == [1, 2]
