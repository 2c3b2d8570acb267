"""toolkv as the consumer of sglang's ``kv_hints`` on sglang 0.5.23, through sglang's real request
path on CPU: a ``GenerateReqInput`` normalised by sglang (its ``decode_kv_hints_envelope``), a
``Req`` built with ``kv_hints`` as the scheduler builds it, the turn finished through
``release_kv_cache`` into the hooked ``UnifiedRadixCache.checkpoint``, the hooked
``SchedulerOutputStreamer.stream_output`` applying the action, and ``meta_info`` built by the
hooked ``TokenizerManager.update_request_meta_info`` from the streamer's real payload
(``tests/agent_stand_in_0523.py`` names what is a test double).

Runs in the 0.5.23 environment (``make test-0523``); skips where an older sglang is installed.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from toolkv.testing.unified_harness import has_unified_radix_cache, sglang_version

if not has_unified_radix_cache():
    pytest.skip(
        f"needs sglang >= 0.5.21 (UnifiedRadixCache, kv_hints), found {sglang_version()}",
        allow_module_level=True,
    )

import torch
from agent_stand_in_0523 import StandIn0523, hooked
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from fastapi.testclient import TestClient
from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest  # the route's body model

from toolkv.client import kv_hints, kv_hints_outcome
from toolkv.sglang.config import ToolKVConfig
from toolkv.sglang.kv_hints import (
    ACTION_TYPES,
    HintAction,
    Rejected,
    carry_chat_kv_hints,
    flatten_meta,
    kv_hints_supported,
    toolkv_actions,
)
from toolkv.sglang.plugin import CHAT, STREAMER, TOKENIZER, hooks

SGLANG = Path(str(__import__("sglang").__file__)).parent
PROMPT = list(range(1, 41))


@pytest.fixture(params=["python", "rust"])
def s(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[StandIn0523]:
    """The stand-in server on each 0.5.23 tree core (the Rust one is sglang's default)."""
    for k in ("TOOLKV_POLICY", "TOOLKV_ZERO_CHANGE", "TOOLKV_TTL_S"):
        monkeypatch.delenv(k, raising=False)
    with hooked(), StandIn0523(tree_core=request.param) as stand_in:
        yield stand_in


def turn(s: StandIn0523, sid: str | None, hints: Any = None, *, stream: bool = False) -> dict[str, Any]:
    """One finished request of ``sid`` extending its previous turn; returns its ``meta_info``."""
    prev = s.__dict__.setdefault("_history", {}).get(sid, PROMPT)
    body: dict[str, Any] = {"input_ids": [*prev, 7, 8], "session_id": sid, "stream": stream}
    if hints is not None:
        body["kv_hints"] = hints
    out = s.generate(body)
    s._history[sid] = [*body["input_ids"], *out["output_ids"]]  # type: ignore[attr-defined]
    meta: dict[str, Any] = out["meta_info"]
    return meta


def state(s: StandIn0523, sid: str) -> str:
    return str(s.tk.manager.kv_meta(sid)["state"])


# ---- sglang's channel, as installed ------------------------------------------------------------------
def test_sglang_carries_kv_hints_to_the_req_and_nothing_else_reads_it() -> None:
    """The facts the design rests on, read from the installed 0.5.23 source."""
    io = (SGLANG / "srt/managers/io_struct.py").read_text()
    assert "decode_kv_hints_envelope(self.kv_hints) if self.kv_hints else None" in io
    assert "kv_hints=recv_req.kv_hints," in (SGLANG / "srt/managers/scheduler.py").read_text()
    assert "kv_hints=obj.kv_hints," in (SGLANG / "srt/managers/tokenizer_manager.py").read_text()
    assert (
        "self.kv_hints: Optional[KvHintsEnvelope] = kv_hints"
        in (SGLANG / "srt/managers/schedule_batch.py").read_text()
    )
    # the chat route builds its GenerateReqInput without kv_hints: toolkv's chat hook carries it
    chat = (SGLANG / "srt/entrypoints/openai/serving_chat.py").read_text()
    assert "kv_hints" not in chat
    # every mention outside kv_hints.py is a declaration or a copy: nothing acts on it
    mentions = {
        str(p.relative_to(SGLANG)): p.read_text(errors="ignore").count("kv_hints")
        for p in (SGLANG / "srt").rglob("*.py")
        if "kv_hints" in p.read_text(errors="ignore") and p.name != "kv_hints.py"
    }
    assert set(mentions) == {
        "srt/managers/io_struct.py",
        "srt/managers/schedule_batch.py",
        "srt/managers/scheduler.py",
        "srt/managers/tokenizer_manager.py",
        "srt/entrypoints/engine.py",
    }
    assert mentions["srt/managers/scheduler.py"] == 2 and mentions["srt/managers/tokenizer_manager.py"] == 2
    # the outcome channel: Req.customized_info -> streamer payload -> meta_info
    streamer = (SGLANG / "srt/managers/scheduler_components/output_streamer.py").read_text()
    assert "if req.customized_info is not None:" in streamer
    assert kv_hints_supported()


def test_the_kv_hints_hook_targets_exist_in_the_installed_source() -> None:
    def defs(path: Path, cls: str) -> set[str]:
        tree = ast.parse(path.read_text())
        body = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls).body
        return {n.name for n in body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}

    targets = [t for t, _, _ in hooks(main_process=True, config=ToolKVConfig(), tree="unified")]
    assert f"{STREAMER}.stream_output" in targets
    assert f"{TOKENIZER}.update_request_meta_info" in targets
    assert {f"{CHAT}._handle_non_streaming_request", f"{CHAT}._handle_streaming_request"} <= set(targets)
    assert "stream_output" in defs(
        SGLANG / "srt/managers/scheduler_components/output_streamer.py", "SchedulerOutputStreamer"
    )
    assert "update_request_meta_info" in defs(
        SGLANG / "srt/managers/tokenizer_manager.py", "TokenizerManager"
    )
    chat = defs(SGLANG / "srt/entrypoints/openai/serving_chat.py", "OpenAIServingChat")
    assert {"_handle_non_streaming_request", "_handle_streaming_request"} <= chat
    # the 0.5.16 hook set has none of them (sglang 0.5.16 has no kv_hints)
    old = [t for t, _, _ in hooks(main_process=True, config=ToolKVConfig(), tree="radix")]
    assert not [t for t in old if t.startswith((STREAMER, TOKENIZER))]
    assert f"{CHAT}._handle_streaming_request" not in old


# ---- parsing ------------------------------------------------------------------------------------------
def test_envelope_parsing_ignores_other_types_and_rejects_bad_toolkv_actions() -> None:
    from sglang.srt.managers.kv_hints import decode_kv_hints_envelope

    env = decode_kv_hints_envelope(
        {
            "protocol_version": "1",
            "message_id": "m1",
            "actions": [
                {
                    "action_id": "v",
                    "action_type": "vllm.set_priority",
                    "action_version": "1",
                    "payload": {"x": 1},
                },
                {
                    "action_id": "a",
                    "action_type": "toolkv.tool_start",
                    "action_version": "1",
                    "payload": {"tool": "grep"},
                },
                {"action_id": "b", "action_type": "toolkv.pin", "action_version": "1"},
                {"action_id": "c", "action_type": "toolkv.retain", "action_version": "2"},
                {"action_id": "d", "action_type": "toolkv.prefetch", "action_version": "1", "payload": {}},
                {
                    "action_id": "e",
                    "action_type": "toolkv.tool_start",
                    "action_version": "1",
                    "payload": {"ttl": 5},
                },
                {
                    "action_id": "f",
                    "action_type": "toolkv.tool_start",
                    "action_version": "1",
                    "payload": {"expected_s": -1},
                },
            ],
        }
    )
    got = toolkv_actions(env)
    assert got[0] == HintAction("a", "toolkv.tool_start", tool="grep")
    assert all(isinstance(r, Rejected) for r in got[1:]) and len(got) == 6
    reasons = {r.action_id: r.reason for r in got[1:] if isinstance(r, Rejected)}
    assert "unknown toolkv action type 'toolkv.pin'" in reasons["b"]
    assert "unsupported action_version '2'" in reasons["c"]
    assert "missing payload field(s) expected_s" in reasons["d"]
    assert "unknown payload field(s) ttl" in reasons["e"]
    assert "expected_s must be a finite number" in reasons["f"]
    other = toolkv_actions(
        {"protocol_version": "2", "message_id": "m", "actions": [got and {"action_type": "toolkv.retain"}]}
    )
    assert isinstance(other[0], Rejected) and "protocol_version '2'" in other[0].reason
    assert toolkv_actions(None) == [] and toolkv_actions({"actions": "x"}) == []


def test_the_client_envelope_is_what_sglang_decodes_and_toolkv_reads() -> None:
    from sglang.srt.managers.io_struct import GenerateReqInput

    for action, kw in [
        ("tool_start", {"tool": "web", "prior_epoch": 2}),
        ("retain", {}),
        ("prefetch", {"expected_s": 4}),
    ]:
        obj = GenerateReqInput(input_ids=[1, 2, 3], session_id="s", kv_hints=kv_hints(action, **kw))
        obj.normalize_batch_and_arguments()  # sglang's own decode
        (a,) = toolkv_actions(obj.kv_hints)
        assert (
            isinstance(a, HintAction)
            and a.action_type == f"toolkv.{action}"
            and a.action_type in ACTION_TYPES
        )
    with pytest.raises(ValueError, match="expected_s"):
        kv_hints("prefetch")
    with pytest.raises(ValueError, match="action must be"):
        kv_hints("pin")
    with pytest.raises(ValueError, match="Malformed kv_hints"):
        GenerateReqInput(input_ids=[1], kv_hints={"actions": 3}).normalize_batch_and_arguments()


# ---- applied on the turn's finish, through sglang's request path ------------------------------------------
def test_tool_start_hint_offloads_and_its_epoch_ends_the_call(s: StandIn0523) -> None:
    initial = s.h.accounting()
    meta = turn(s, "s1")
    assert "toolkv" not in meta and state(s, "s1") == "Running"  # no hint: nothing in meta
    meta = turn(s, "s1", kv_hints("tool_start", tool="search", expected_s=3))
    out = kv_hints_outcome(meta)
    assert meta["toolkv"] == out  # a response that is not streamed: one object
    assert out is not None and out["outcome"] == "accepted" and out["epoch"] == 1
    assert out["state"] == "Offloading" and out["action_type"] == "toolkv.tool_start"
    s.iterate(2)
    rec = s.tk.manager.kv_meta("s1")
    # the plugin's default (lazy free): the copy stays on the GPU, unlocked, until sglang evicts it
    assert rec["state"] == "Offloaded" and rec["tool"] == "search"
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    s.h.tree.evict(EvictParams(num_tokens=s.h.tree.evictable_size()))
    assert s.tk.manager.kv_meta("s1")["device_tokens"] == 0
    turn_tokens = s._history["s1"][:-1]  # type: ignore[attr-defined]
    # the same fence as the HTTP tool_end: a stale epoch changes nothing, the outcome's epoch ends it
    assert s.tk.handle("tool_end", {"session_id": "s1", "epoch": 7})[0] == 409
    code, ended = s.tk.handle("tool_end", {"session_id": "s1", "epoch": out["epoch"]})
    assert code == 200 and ended["state"] == "Restoring"
    s.iterate(2)
    node = s.tk.manager.sessions["s1"].node
    restored = s.h.device_kv(s.h.tree.path_device_indices(node.id)).float()
    assert torch.equal(restored, s.h.expected_kv(turn_tokens)), "restored KV differs from the turn's"
    assert s.tk.handle("close", {"session_id": "s1"})[0] == 200
    s.h.drain()
    assert s.h.accounting() == initial


def test_the_next_request_restores_without_a_tool_end(s: StandIn0523) -> None:
    turn(s, "s1")
    turn(s, "s1", kv_hints("tool_start"))
    s.iterate(2)
    assert state(s, "s1") == "Offloaded"
    meta = turn(s, "s1")  # the BEFORE hook of handle_generate_request restores; the turn is recorded
    assert state(s, "s1") == "Running" and meta["cached_tokens"] > len(PROMPT)


def test_bad_and_foreign_hints_never_fail_the_request(s: StandIn0523) -> None:
    turn(s, "s1")
    foreign = {
        "protocol_version": "1",
        "message_id": "m",
        "actions": [
            {"action_id": "x", "action_type": "lmcache.retain", "action_version": "1", "payload": {}}
        ],
    }
    assert "toolkv" not in turn(s, "s1", foreign) and state(s, "s1") == "Running"
    bad = kv_hints("tool_start")
    bad["actions"][0]["payload"] = {"tool": 5}
    out = kv_hints_outcome(turn(s, "s1", bad))
    assert out is not None and out["outcome"] == "rejected" and "tool must be" in out["reason"]
    assert state(s, "s1") == "Running" and s.tk.manager.sessions["s1"].epoch == 0
    out = kv_hints_outcome(turn(s, None, kv_hints("tool_start")))
    assert out is not None and out["outcome"] == "rejected" and out["reason"].startswith("no_session")
    # two toolkv actions: the first applies, the second is reported rejected
    two = kv_hints("tool_start", tool="a")
    two["actions"].append(kv_hints("retain", action_id="second")["actions"][0])
    out = kv_hints_outcome(turn(s, "s1", two))
    assert out is not None and out["outcome"] == "accepted" and out["epoch"] == 1
    assert out["others"] == [
        {
            "outcome": "rejected",
            "action_id": "second",
            "action_type": "toolkv.retain",
            "reason": "one toolkv action per request",
        }
    ]


def test_an_unknown_session_and_an_aborted_turn_are_rejected(s: StandIn0523) -> None:
    from sglang.srt.managers.io_struct import GenerateReqInput

    turn(s, "s1")
    obj = GenerateReqInput(
        input_ids=[*PROMPT, 9, 9], session_id="s1", kv_hints=kv_hints("tool_start"), rid="ab"
    )
    out = kv_hints_outcome(s.generate_obj(obj, [5, 6, 7], abort=True)["meta_info"])
    assert out is not None and out["outcome"] == "rejected" and out["reason"].startswith("aborted")
    assert state(s, "s1") == "Running"
    # keyed under a cache_salt: toolkv does not record the turn, so there is no session to act on
    salted = GenerateReqInput(
        input_ids=[*PROMPT, 3],
        session_id="salt",
        cache_salt="tenant",
        kv_hints=kv_hints("tool_start"),
        rid="x",
    )
    out = kv_hints_outcome(s.generate_obj(salted, [4, 5])["meta_info"])
    assert out is not None and out["outcome"] == "rejected" and out["reason"].startswith("unknown_session")
    out = kv_hints_outcome(turn(s, "s1", kv_hints("tool_start", prior_epoch=5)))
    assert out is not None and out["outcome"] == "accepted"  # prior_epoch 5 is not a replay of epoch 1


def test_a_replayed_tool_start_hint_is_recognised_by_the_epoch_fence(s: StandIn0523) -> None:
    turn(s, "s1")
    out = kv_hints_outcome(turn(s, "s1", kv_hints("tool_start", prior_epoch=0)))
    assert out is not None and out["outcome"] == "accepted" and out["epoch"] == 1
    # the same call again (the agent lost the response): the record, marked replayed, nothing new
    code, again = s.tk.handle("tool_start", {"session_id": "s1", "prior_epoch": 0})
    assert code == 200 and again["replayed"] and again["epoch"] == 1


def test_retain_pins_on_spare_room_and_is_clipped_to_a_tool_start_without(s: StandIn0523) -> None:
    turn(s, "s1")
    out = kv_hints_outcome(turn(s, "s1", kv_hints("retain", tool="fast")))
    assert out is not None and out["outcome"] == "accepted" and out["state"] == "Kept" and out["epoch"] == 1
    code, _ = s.tk.handle("tool_end", {"session_id": "s1", "epoch": 1})
    assert code == 200
    turn(s, "s2")
    s.tk.manager.queued_demand = lambda: 10**9  # the waiting queue needs every free device token
    out = kv_hints_outcome(turn(s, "s2", kv_hints("retain")))
    assert out is not None and out["outcome"] == "clipped" and out["reason"].startswith("no_device_room")
    assert out["state"] in ("Offloading", "Offloaded")


def test_prefetch_is_deferred_under_the_auto_policy_and_clipped_without_early_restore(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TOOLKV_POLICY", "auto")
    with hooked(), StandIn0523() as s:
        turn(s, "s1")
        s.tk.manager.queued_demand = lambda: 10**9  # no room to keep it: the policy offloads
        out = kv_hints_outcome(turn(s, "s1", kv_hints("prefetch", tool="build", expected_s=120)))
        assert out is not None and out["outcome"] == "deferred", out
        assert out["state"] in ("Offloading", "Offloaded") and 0 < out["restore_in_s"] <= 120
    monkeypatch.setenv("TOOLKV_POLICY", "offload")
    monkeypatch.setenv("TOOLKV_TTL_S", "60")
    with hooked(), StandIn0523() as s:
        turn(s, "s1")
        out = kv_hints_outcome(turn(s, "s1", kv_hints("prefetch", expected_s=5)))
        assert (
            out is not None and out["outcome"] == "clipped" and out["reason"].startswith("no_early_restore")
        )
        turn(s, "s2")
        out = kv_hints_outcome(turn(s, "s2", kv_hints("tool_start", expected_s=600)))
        assert (
            out is not None
            and out["outcome"] == "clipped"
            and out["reason"].startswith("ttl: held at most 60s")
        )


def test_a_streamed_response_keeps_sglangs_per_token_list(s: StandIn0523) -> None:
    turn(s, "s1")
    meta = turn(s, "s1", kv_hints("tool_start"), stream=True)
    value = meta["toolkv"]
    assert isinstance(value, list) and value[:-1] == [None] * (len(value) - 1)
    out = kv_hints_outcome(meta)
    assert out is not None and out["outcome"] == "accepted" and out == value[-1]


def test_the_hint_is_applied_once_when_the_streamer_sees_the_request_twice(s: StandIn0523) -> None:
    """Overlap scheduling streams a finished request twice; the streamer skips it the second time
    (``finished_output``) and so does toolkv."""
    from toolkv.sglang.kv_hints import apply_finished_hints

    turn(s, "s1")
    req = SimpleNamespace(
        finished=lambda: True,
        finished_output=False,
        finished_reason=None,
        customized_info=None,
        kv_hints=kv_hints("tool_start"),
        session_id="s1",
        session=None,
        output_ids_through_stop=[1, 2],
    )
    assert apply_finished_hints(s.tk, [req]) == 1
    assert apply_finished_hints(s.tk, [req]) == 0  # already carries its outcome
    req.finished_output = True
    req.customized_info = None
    assert apply_finished_hints(s.tk, [req]) == 0
    assert s.tk.manager.sessions["s1"].epoch == 1


def test_chat_hook_carries_kv_hints_from_the_body() -> None:
    from sglang.srt.managers.io_struct import GenerateReqInput

    adapted = GenerateReqInput(input_ids=[1, 2], session_id="s")
    assert carry_chat_kv_hints(adapted, {"kv_hints": kv_hints("retain")})
    assert type(adapted.kv_hints).__name__ == "KvHintsEnvelope"
    assert not carry_chat_kv_hints(GenerateReqInput(input_ids=[1]), {"messages": []})
    with pytest.raises(ValueError, match="Malformed kv_hints"):
        carry_chat_kv_hints(GenerateReqInput(input_ids=[1]), {"kv_hints": {"message_id": 3}})


def test_flatten_meta_and_the_client_reader() -> None:
    meta: dict[str, Any] = {"toolkv": [None, None, {"outcome": "accepted", "epoch": 2}]}
    flatten_meta(meta)
    assert meta == {"toolkv": {"outcome": "accepted", "epoch": 2}}
    empty: dict[str, Any] = {"toolkv": [None]}
    flatten_meta(empty)
    assert empty == {}
    assert kv_hints_outcome({"id": "x"}) is None and kv_hints_outcome(None) is None


def test_status_and_server_kv_meta_say_kv_hints_is_supported(s: StandIn0523) -> None:
    assert s.tk.status()["kv_hints"] is True
    assert s.tk.handle("kv_meta", {})[1]["kv_hints"] is True


def test_the_chat_route_drops_kv_hints_and_the_chat_hook_carries_it_from_the_parsed_body() -> None:
    """sglang's chat route binds the body to ``ChatCompletionRequest`` (http_server.py:1870-1879),
    which has no ``kv_hints``; the plugin's AROUND hook reads it back with ``raw_request.json()``,
    the body FastAPI already parsed. Checked with sglang's own request model on the FastAPI and
    Starlette releases sglang 0.5.23 pins (the route itself imports uvloop, absent here)."""
    from sglang.srt.managers.io_struct import GenerateReqInput

    from toolkv.sglang.plugin import around_chat_kv_hints

    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def route(request: ChatCompletionRequest, raw_request: Request) -> JSONResponse:
        assert request.session_id == "s1" and not hasattr(request, "kv_hints")  # dropped by the model
        adapted = GenerateReqInput(input_ids=[1, 2, 3], session_id=request.session_id)

        async def original(_serving: Any, adapted_request: Any, _request: Any, _raw: Any) -> JSONResponse:
            env = adapted_request.kv_hints
            return JSONResponse({"types": None if env is None else [a.action_type for a in env.actions]})

        try:
            out: JSONResponse = await around_chat_kv_hints(original, None, adapted, request, raw_request)
        except ValueError as e:  # OpenAIServingBase.handle_request answers it with a 400
            return JSONResponse({"message": str(e)}, status_code=400)
        return out

    c = TestClient(app)
    body: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "session_id": "s1"}
    r = c.post("/v1/chat/completions", json={**body, "kv_hints": kv_hints("retain")})
    assert r.status_code == 200 and r.json() == {"types": ["toolkv.retain"]}
    assert c.post("/v1/chat/completions", json=body).json() == {"types": None}
    r = c.post("/v1/chat/completions", json={**body, "kv_hints": {"protocol_version": 1}})
    assert r.status_code == 400 and "Malformed kv_hints" in r.json()["message"]


def test_a_drain_refuses_new_tool_calls_and_lets_the_held_ones_finish(s: StandIn0523) -> None:
    """``POST /session/drain`` on 0.5.23 (each tree core): a tool call in flight finishes (its
    ``tool_end`` restores), a new one is refused with 503 ``draining`` and changes nothing, and the
    drain reads ``drained`` once nothing is held."""
    turn(s, "s1")
    turn(s, "s2")
    code, started = s.tk.handle("tool_start", {"session_id": "s1"})
    assert code == 200 and started["epoch"] == 1
    assert s.tk.handle("drain", {"drain": True})[1]["draining"] is True
    code, refused = s.tk.handle("tool_start", {"session_id": "s2"})
    assert (code, refused["error"]) == (503, "draining") and state(s, "s2") == "Running"
    s.iterate(2)
    code, ended = s.tk.handle("tool_end", {"session_id": "s1", "epoch": 1})
    assert code == 200, ended
    turn(s, "s1")  # the next turn is admitted: the hand-over ends, nothing is held
    status = s.tk.handle("drain", {"drain": True})[1]
    assert status["held_sessions"] == 0 and status["drained"] is True, status
    assert s.tk.handle("drain", {"drain": False})[1]["draining"] is False
    assert s.tk.handle("tool_start", {"session_id": "s2"})[0] == 200
