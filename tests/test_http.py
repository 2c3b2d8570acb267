"""The HTTP contract on CPU: FastAPI's TestClient -> toolkv's routes -> (named test double of the
TM<->scheduler channel) -> the plugin's scheduler-side handler -> the real ToolKVManager over the
real HiRadixCache. Every error has a code and a message and changes nothing."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from _turns import LoopbackChannel, finish_turn, iteration
from fastapi.testclient import TestClient

from toolkv.sglang.config import ToolKVConfig
from toolkv.sglang.http_api import (
    ChannelTransport,
    ReplyRegistry,
    TokenizerManagerTransport,
    build_app,
    is_tool_calls_chunk,
    openapi_document,
    tool_call_name,
)
from toolkv.sglang.ipc import ToolKVReqInput, ToolKVReqOutput
from toolkv.sglang.scheduler_side import SchedulerToolKV
from toolkv.testing.harness import CacheHarness, HarnessConfig

PROMPT = list(range(1, 65))
OPENAPI = Path(__file__).resolve().parents[1] / "docs" / "openapi.json"


class Server:
    def __init__(self, h: CacheHarness, tk: SchedulerToolKV, client: TestClient) -> None:
        self.h, self.tk, self.client = h, tk, client

    def snapshot(self) -> Any:
        return (self.h.accounting(), {sid: self.tk.manager.kv_meta(sid) for sid in self.tk.manager.sessions})


def make_server(h: CacheHarness, config: ToolKVConfig | None = None) -> Server:
    tk = SchedulerToolKV(h.tree, config=config if config is not None else ToolKVConfig(lazy_free=False))
    h.tree._toolkv = tk
    return Server(h, tk, TestClient(build_app(LoopbackChannel(tk))))


@pytest.fixture
def srv() -> Iterator[Server]:
    with CacheHarness(HarnessConfig()) as h:
        s = make_server(h)
        assert finish_turn(h, "s1", PROMPT, [65, 66])
        yield s


def test_tool_call_cycle_over_http(srv: Server) -> None:
    c, h = srv.client, srv.h
    initial_free = h.allocator.available_size()
    r = c.post("/session/tool_start", json={"session_id": "s1"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["state"] == "Offloading" and body["epoch"] == 1 and body["backend"] == "hiradix"
    iteration(h, srv.tk, writes=True)
    meta = c.get("/session/kv_meta", params={"session_id": "s1"}).json()
    assert meta["state"] == "Offloaded" and meta["tier"] == "CpuProtected"
    assert meta["device_tokens"] == 0 and meta["host_tokens"] == 65
    assert h.allocator.available_size() - initial_free == 65
    r = c.post("/session/tool_end", json={"session_id": "s1", "epoch": 1})
    assert r.status_code == 200 and r.json()["state"] == "Restoring"
    iteration(h, srv.tk, loads=True)
    assert (
        c.get("/session/kv_meta", params={"session_id": "s1"}).json()["state"] == "Handover"
    )  # pinned until its next request is admitted
    server = c.get("/session/kv_meta").json()
    assert server["sessions"] == 1 and server["counters"]["tool_start"] == 1 and "host_free_tokens" in server
    assert c.post("/session/close", json={"session_id": "s1"}).json()["state"] == "Closed"


BAD = [
    ("/session/tool_start", b"{not json", "not valid JSON"),
    ("/session/tool_start", b"[1, 2]", "JSON object"),
    ("/session/tool_start", b"", "JSON object"),
    ("/session/tool_start", json.dumps({}).encode(), "session_id"),
    ("/session/tool_start", json.dumps({"session_id": ""}).encode(), "session_id"),
    ("/session/tool_start", json.dumps({"session_id": 7}).encode(), "session_id"),
    ("/session/tool_start", json.dumps({"session_id": "s1", "x": 1}).encode(), "x"),
    ("/session/tool_end", json.dumps({"session_id": "s1"}).encode(), "epoch"),
    ("/session/tool_end", json.dumps({"session_id": "s1", "epoch": "1"}).encode(), "epoch"),
    ("/session/tool_end", json.dumps({"session_id": "s1", "epoch": True}).encode(), "epoch"),
    ("/session/tool_end", json.dumps({"session_id": "s1", "epoch": -1}).encode(), "epoch"),
    ("/session/tool_end", json.dumps({"session_id": "s1", "epoch": 1.5}).encode(), "epoch"),
    ("/session/close", json.dumps({"sid": "s1"}).encode(), "session_id"),
]


@pytest.mark.parametrize(
    ("path", "raw", "words"), BAD, ids=[f"{p.split('/')[-1]}-{i}" for i, (p, _, _) in enumerate(BAD)]
)
def test_malformed_bodies_are_400_and_change_nothing(srv: Server, path: str, raw: bytes, words: str) -> None:
    before = srv.snapshot()
    r = srv.client.post(path, content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    body = r.json()
    assert body["error"] == "bad_request" and words in body["message"]
    assert srv.snapshot() == before


def test_bad_query_is_400(srv: Server) -> None:
    assert srv.client.get("/session/kv_meta", params={"session_id": ""}).status_code == 400
    assert srv.client.get("/session/kv_meta", params={"sid": "s1"}).status_code == 400


DEEP = 100_000


@pytest.mark.parametrize(
    "raw",
    [
        b"[" * DEEP + b"]" * DEEP,
        b'{"session_id": ' + b"[" * DEEP + b"]" * DEEP + b"}",
        b'{"session_id": "s1", "x": ' + b'{"a":' * DEEP + b"1" + b"}" * DEEP + b"}",
    ],
    ids=["array", "session_id", "object"],
)
def test_deeply_nested_bodies_are_refused_not_500(srv: Server, raw: bytes) -> None:
    """These bodies are over the size limit too: refused as they are read, never parsed (the
    nesting under the limit: the next test)."""
    before = srv.snapshot()
    for path in ("/session/tool_start", "/session/tool_end", "/session/close"):
        r = srv.client.post(path, content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 413, (path, r.status_code, r.text[:200])
        assert r.json()["error"] == "payload_too_large"
    assert srv.snapshot() == before


def test_nesting_within_the_size_limit_is_refused_as_nesting(srv: Server) -> None:
    """A body under the size cap that still nests deeper than Python's recursion limit."""
    raw = b"[" * 2000 + b"]" * 2000
    assert len(raw) <= 4096
    r = srv.client.post("/session/tool_start", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400 and "nested too deeply" in r.json()["message"]


@pytest.mark.parametrize(
    "content_type", ["text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded", None]
)
def test_non_json_bodies_are_415_and_do_not_act(srv: Server, content_type: str | None) -> None:
    """The cross-site form: a browser may POST text/plain to any origin without a preflight.
    The body is valid JSON; it must still not offload or close anything."""
    before = srv.snapshot()
    headers = {} if content_type is None else {"content-type": content_type}
    for path, body in [
        ("/session/tool_start", {"session_id": "s1"}),
        ("/session/close", {"session_id": "s1"}),
        ("/session/tool_end", {"session_id": "s1", "epoch": 0}),
    ]:
        r = srv.client.post(path, content=json.dumps(body).encode(), headers=headers)
        assert r.status_code == 415, (path, r.status_code, r.text)
        assert r.json()["error"] == "unsupported_media_type"
    assert srv.snapshot() == before
    ok = srv.client.post(
        "/session/tool_start",
        content=json.dumps({"session_id": "s1"}).encode(),
        headers={"content-type": "application/json; charset=utf-8"},
    )
    assert ok.status_code == 200


def test_oversized_body_is_413(srv: Server) -> None:
    before = srv.snapshot()
    raw = json.dumps({"session_id": "s1", "pad": "x" * 5000}).encode()
    for path in ("/session/tool_start", "/session/tool_end", "/session/close", "/session/drain"):
        r = srv.client.post(path, content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 413, (path, r.status_code, r.text[:200])
        assert r.json()["error"] == "payload_too_large" and "larger than 4096 bytes" in r.json()["message"]
    assert srv.snapshot() == before


CHUNK = 65536
HOSTILE = 256 << 20  # a 256 MiB body


def _asgi_post(app: Any, path: str, *, declared: int | None, total: int) -> tuple[int, dict[str, Any], int]:
    """POST ``total`` bytes to ``app`` straight through ASGI, ``CHUNK`` bytes per receive() (as a
    server hands a body on), with ``Content-Length: declared`` or, for None, chunked (no length).
    Returns the status, the JSON body and how many body bytes the app pulled."""
    headers = [(b"content-type", b"application/json")]
    if declared is not None:
        headers.append((b"content-length", str(declared).encode()))
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": path, "raw_path": path.encode(), "root_path": "", "query_string": b"",
             "headers": headers, "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}  # fmt: skip
    pulled = 0
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        nonlocal pulled
        n = min(CHUNK, total - pulled)
        pulled += n
        return {"type": "http.request", "body": b" " * n, "more_body": pulled < total}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return status, json.loads(body), pulled


@pytest.mark.parametrize(
    "path", ["/session/tool_start", "/session/tool_end", "/session/close", "/session/drain"]
)
def test_a_declared_length_over_the_limit_is_refused_before_any_byte_is_read(srv: Server, path: str) -> None:
    before = srv.snapshot()
    status, body, pulled = _asgi_post(
        build_app(LoopbackChannel(srv.tk)), path, declared=HOSTILE, total=HOSTILE
    )
    assert status == 413 and body["error"] == "payload_too_large" and body["message"], body
    assert pulled == 0
    assert srv.snapshot() == before


@pytest.mark.parametrize(
    "path", ["/session/tool_start", "/session/tool_end", "/session/close", "/session/drain"]
)
def test_a_chunked_body_is_cut_at_the_limit(srv: Server, path: str) -> None:
    """No length declared (chunked transfer): reading stops at the first chunk past 4,096 bytes."""
    before = srv.snapshot()
    status, body, pulled = _asgi_post(build_app(LoopbackChannel(srv.tk)), path, declared=None, total=HOSTILE)
    assert status == 413 and body["error"] == "payload_too_large", body
    assert pulled <= 4096 + CHUNK
    assert srv.snapshot() == before
    # a declared length that lies (more bytes than declared) is cut at the limit too
    status, body, pulled = _asgi_post(build_app(LoopbackChannel(srv.tk)), path, declared=100, total=HOSTILE)
    assert status == 413 and pulled <= 4096 + CHUNK


@pytest.mark.parametrize("value", ["1" * 4301, "1" * 60_000, "0" * 5000, "1" * 17])
def test_a_long_limit_is_400_not_500(srv: Server, value: str) -> None:
    """Python refuses int() of 4,301+ digits (ValueError): the length is bounded before conversion."""
    r = srv.client.get(f"/session/status?limit={value}")
    assert r.status_code == 400, (r.status_code, r.text[:200])
    assert r.json()["error"] == "bad_request" and r.json()["field"] == "limit"


def test_kv_meta_query_is_capped_as_documented(srv: Server) -> None:
    c = srv.client
    before = srv.snapshot()
    assert c.get("/session/kv_meta", params={"session_id": "x" * 512}).status_code == 404
    r = c.get("/session/kv_meta", params={"session_id": "x" * 513})
    assert r.status_code == 400 and r.json()["field"] == "session_id"
    r = c.get("/session/kv_meta?session_id=s1&session_id=s2")
    assert r.status_code == 400 and "more than once" in r.json()["message"]
    schema = openapi_document()["paths"]["/session/kv_meta"]["get"]["parameters"][0]["schema"]
    assert schema["maxLength"] == 512
    assert srv.snapshot() == before


def test_unknown_session_is_404(srv: Server) -> None:
    before = srv.snapshot()
    c = srv.client
    for r in (
        c.post("/session/tool_start", json={"session_id": "ghost"}),
        c.post("/session/tool_end", json={"session_id": "ghost", "epoch": 0}),
        c.get("/session/kv_meta", params={"session_id": "ghost"}),
        c.post("/session/close", json={"session_id": "ghost"}),
    ):
        assert (
            r.status_code == 404 and r.json()["error"] == "unknown_session" and "ghost" in r.json()["message"]
        )
    assert srv.snapshot() == before


def test_stale_epoch_and_wrong_state_are_409_and_change_nothing(srv: Server) -> None:
    c = srv.client
    before = srv.snapshot()
    r = c.post("/session/tool_end", json={"session_id": "s1", "epoch": 0})
    assert r.status_code == 409 and r.json()["error"] == "wrong_state"
    assert srv.snapshot() == before
    assert c.post("/session/tool_start", json={"session_id": "s1"}).status_code == 200
    iteration(srv.h, srv.tk, writes=True)
    before = srv.snapshot()
    r = c.post("/session/tool_end", json={"session_id": "s1", "epoch": 7})
    assert r.status_code == 409 and r.json() == {
        "error": "stale_epoch",
        "message": r.json()["message"],
        "current_epoch": 1,
    }
    r = c.post("/session/tool_start", json={"session_id": "s1"})
    assert r.status_code == 409 and r.json()["error"] == "wrong_state"
    assert srv.snapshot() == before


def test_host_budget_exhausted_is_507_and_changes_nothing() -> None:
    with CacheHarness(HarnessConfig()) as h:
        s = make_server(h, ToolKVConfig(host_budget_tokens=16, lazy_free=False))
        assert finish_turn(h, "s1", PROMPT, [65])
        before = s.snapshot()
        r = s.client.post("/session/tool_start", json={"session_id": "s1"})
        assert r.status_code == 507 and r.json()["error"] == "host_memory_full" and r.json()["message"]
        assert s.snapshot() == before


def test_device_memory_full_is_503_and_retry_works(srv: Server) -> None:
    c, h = srv.client, srv.h
    without_adaptive(srv.tk)
    c.post("/session/tool_start", json={"session_id": "s1"})
    iteration(h, srv.tk, writes=True)
    hog = h.alloc(h.allocator.available_size())  # another request takes every free slot
    assert hog is not None
    before = srv.snapshot()
    r = c.post("/session/tool_end", json={"session_id": "s1", "epoch": 1})
    assert (
        r.status_code == 503 and r.json()["error"] == "device_memory_full" and r.json()["need_tokens"] == 65
    )
    assert srv.snapshot() == before
    h.allocator.free(hog)
    assert c.post("/session/tool_end", json={"session_id": "s1", "epoch": 1}).status_code == 200


def test_api_key_is_enforced_by_sglangs_middleware(srv: Server) -> None:
    """sglang adds its API-key middleware to the app after the plugin added the routes; the
    routes are NORMAL-level endpoints like /generate."""
    from sglang.srt.utils.auth import add_api_key_middleware

    app = build_app(LoopbackChannel(srv.tk))
    add_api_key_middleware(app, api_key="sekrit", admin_api_key=None)
    c = TestClient(app)
    before = srv.snapshot()
    assert c.post("/session/tool_start", json={"session_id": "s1"}).status_code == 401
    assert c.get("/session/kv_meta", params={"session_id": "s1"}).status_code == 401
    bad = {"Authorization": "Bearer wrong"}
    assert c.get("/session/kv_meta", params={"session_id": "s1"}, headers=bad).status_code == 401
    assert srv.snapshot() == before
    ok = {"Authorization": "Bearer sekrit"}
    assert c.get("/session/kv_meta", params={"session_id": "s1"}, headers=ok).status_code == 200


class _Silent(ChannelTransport):
    """A scheduler that never answers (hung, or busy beyond the timeout)."""

    def __init__(self) -> None:
        super().__init__(timeout_s=0.05)
        self.sent: list[ToolKVReqInput] = []

    def _send(self, req: ToolKVReqInput) -> None:
        self.sent.append(req)


def test_timeout_is_504_and_a_late_reply_is_dropped() -> None:
    t = _Silent()
    c = TestClient(build_app(t))
    r = c.post("/session/tool_start", json={"session_id": "s1"})
    assert r.status_code == 504 and r.json()["error"] == "scheduler_timeout"
    assert len(t.replies) == 0
    t.replies.resolve(ToolKVReqOutput(rid=t.sent[0].rid, ok=True, body={}))
    assert t.replies.dropped == 1


def test_reply_registry_routes_by_rid() -> None:
    async def run() -> list[str]:
        reg = ReplyRegistry()
        a, b = reg.expect("a"), reg.expect("b")
        reg.resolve(ToolKVReqOutput(rid="b", ok=True, body={"who": "b"}))
        reg.resolve(ToolKVReqOutput(rid="a", ok=True, body={"who": "a"}))
        return [(await a).body["who"], (await b).body["who"]]

    assert asyncio.run(run()) == ["a", "b"]


class FakeTokenizerManager:
    """TEST DOUBLE of sglang's TokenizerManager surface the transport uses: get_internal_state,
    _result_dispatcher, auto_create_handle_loop, _dispatch_to_scheduler. Dispatch goes to the
    plugin's real scheduler-side handler; the reply comes back through ``_result_dispatcher``."""

    def __init__(self, tk: SchedulerToolKV | None) -> None:
        from sglang.utils import TypeBasedDispatcher

        self.tk = tk
        self._result_dispatcher = TypeBasedDispatcher([(int, lambda x: None)])
        self.dispatched: list[Any] = []

    async def get_internal_state(self) -> list[dict[str, Any]]:
        state: dict[str, Any] = {"page_size": 1}
        if self.tk is not None:
            state["toolkv"] = self.tk.status()  # what the get_internal_state AFTER hook adds
        return [state]

    def auto_create_handle_loop(self) -> None:
        return None

    def _dispatch_to_scheduler(self, obj: Any) -> None:
        self.dispatched.append(obj)
        assert self.tk is not None, "a scheduler without toolkv would crash on this type"
        out = self.tk.ipc_handler(obj)
        asyncio.get_running_loop().call_soon(self._result_dispatcher, out)


def test_handshake_refuses_schedulers_without_toolkv() -> None:
    tm = FakeTokenizerManager(None)
    c = TestClient(build_app(TokenizerManagerTransport(lambda: tm)))
    r = c.get("/session/kv_meta")
    assert r.status_code == 503 and r.json()["error"] == "toolkv_unavailable"
    assert tm.dispatched == [], "nothing may be sent to a scheduler that cannot decode it"
    c2 = TestClient(build_app(TokenizerManagerTransport(lambda: None)))
    assert c2.get("/session/kv_meta").status_code == 503


def test_tokenizer_manager_transport_round_trip(srv: Server) -> None:
    tm = FakeTokenizerManager(srv.tk)
    c = TestClient(build_app(TokenizerManagerTransport(lambda: tm)))
    r = c.post("/session/tool_start", json={"session_id": "s1"})
    assert r.status_code == 200 and r.json()["epoch"] == 1
    assert c.get("/session/kv_meta", params={"session_id": "s1"}).json()["state"] == "Offloading"
    assert [type(x).__name__ for x in tm.dispatched] == ["ToolKVReqInput", "ToolKVReqInput"]


def test_tool_calls_chunk_detection() -> None:
    assert is_tool_calls_chunk('data: {"choices":[{"delta":{},"finish_reason":"tool_calls"}]}\n\n')
    assert is_tool_calls_chunk(b'data: {"finish_reason": "tool_calls"}\n\n')
    assert not is_tool_calls_chunk('data: {"finish_reason":"stop"}\n\n')
    assert not is_tool_calls_chunk("data: [DONE]\n\n")
    delta = 'data: {"choices":[{"delta":{"tool_calls":[{"id":"c1","function":{"name":"run_tests","arguments":""}}]}}]}\n\n'
    assert tool_call_name(delta) == "run_tests" and tool_call_name(delta.encode()) == "run_tests"
    assert tool_call_name('data: {"choices":[{"delta":{"content":"hi"}}]}\n\n') is None
    assert tool_call_name(None) is None


def test_openapi_document_is_current() -> None:
    """docs/openapi.json is generated from the app; regenerate with TOOLKV_WRITE_OPENAPI=1."""
    doc = openapi_document()
    paths = doc["paths"]
    assert set(paths) == {"/session/tool_start", "/session/tool_end", "/session/kv_meta", "/session/close",
                          "/session/status", "/session/drain"}  # fmt: skip
    assert {"400", "404", "409", "503", "507"} <= set(paths["/session/tool_end"]["post"]["responses"])
    text = json.dumps(doc, indent=2, sort_keys=True) + "\n"
    if os.environ.get("TOOLKV_WRITE_OPENAPI") == "1":
        OPENAPI.write_text(text)
    assert OPENAPI.exists() and OPENAPI.read_text() == text, (
        "run TOOLKV_WRITE_OPENAPI=1 pytest tests/test_http.py"
    )


# ---- toolkv.client against the same app ---------------------------------------------------------------
def test_sync_client_typed_results_and_errors(srv: Server) -> None:
    from toolkv.client import ToolKVClient
    from toolkv.errors import StaleEpoch, UnknownSession, WrongState

    tc = TestClient(build_app(LoopbackChannel(srv.tk)))
    with ToolKVClient("http://testserver", transport=tc._transport) as c:
        m = c.tool_start("s1")
        assert (m.state, m.epoch, m.tokens, m.backend) == ("Offloading", 1, 65, "hiradix")
        with pytest.raises(WrongState):
            c.tool_start("s1")
        iteration(srv.h, srv.tk, writes=True)
        with pytest.raises(StaleEpoch) as ei:
            c.tool_end("s1", 0)
        assert ei.value.http_status == 409 and ei.value.details["current_epoch"] == 1
        with pytest.raises(UnknownSession):
            c.kv_meta("ghost")
        assert c.tool_end("s1", m.epoch).state == "Restoring"
        assert c.server_meta().states == {"Restoring": 1}
        assert c.close_session("s1").state == "Closed"


def test_async_client_and_unauthorized(srv: Server) -> None:
    import httpx
    from sglang.srt.utils.auth import add_api_key_middleware

    from toolkv.client import AsyncToolKVClient, Unauthorized

    app = build_app(LoopbackChannel(srv.tk))
    add_api_key_middleware(app, api_key="k", admin_api_key=None)

    async def run() -> tuple[str, int]:
        async with AsyncToolKVClient("http://t", transport=httpx.ASGITransport(app=app)) as anon:
            with pytest.raises(Unauthorized):
                await anon.kv_meta("s1")
        async with AsyncToolKVClient("http://t", api_key="k", transport=httpx.ASGITransport(app=app)) as c:
            m = await c.tool_start("s1")
            return (await c.kv_meta("s1")).state, m.epoch

    assert asyncio.run(run()) == ("Offloading", 1)


# ---- client: toolkv not running vs unknown session; bounded retries --------------------------------
def test_client_tells_missing_toolkv_from_unknown_session(srv: Server) -> None:
    """A server without toolkv answers the route with the host app's plain 404; toolkv's own 404
    carries ``unknown_session``. The client tells them apart by that code."""
    from fastapi import FastAPI

    from toolkv.client import ToolKVClient, ToolKVNotRunning, ToolKVUnavailable
    from toolkv.errors import UnknownSession

    bare = FastAPI()  # what sglang serves when toolkv is not enabled: no /session/* routes
    with ToolKVClient("http://t", transport=TestClient(bare)._transport) as c:
        with pytest.raises(ToolKVNotRunning) as ei:
            c.kv_meta("s1")
        assert ei.value.http_status == 404 and isinstance(ei.value, ToolKVUnavailable)
        assert "TOOLKV_ENABLE" in ei.value.message and not isinstance(ei.value, UnknownSession)
        with pytest.raises(ToolKVNotRunning):
            c.tool_start("s1")
    app = build_app(LoopbackChannel(srv.tk))
    with ToolKVClient("http://t", transport=TestClient(app)._transport) as c, pytest.raises(UnknownSession):
        c.kv_meta("ghost")


def without_adaptive(tk: Any) -> None:
    """The server without load-adaptive protection (``TOOLKV_ADAPTIVE=0``): a tool_end the device
    cannot take is a 503 that changes nothing, as the base spec's ToolEnd refuses it. With it on
    (the default) the same call parks the session (``test_parked_tool_end_*``)."""
    from dataclasses import replace

    tk.manager.config = replace(tk.manager.config, adaptive=False)


def _hogged(srv: Server) -> Any:
    without_adaptive(srv.tk)
    srv.client.post("/session/tool_start", json={"session_id": "s1"})
    iteration(srv.h, srv.tk, writes=True)
    hog = srv.h.alloc(srv.h.allocator.available_size())  # another request holds every free slot
    assert hog is not None
    return hog


# Retrying tool_end's device_memory_full only delays the next turn (sglang's load-back serves it),
# so the default never does; a client that wants it opts in (tests/test_client_calls.py: the default).
RETRY_DEVICE_FULL = dict(
    retries=3,
    backoff_s=0.25,
    max_backoff_s=4.0,
    ops=frozenset({"tool_end"}),
    refusals=frozenset({"device_memory_full"}),
)


def test_client_retries_503_with_backoff_until_memory_frees(srv: Server) -> None:
    from toolkv.client import RetryPolicy, ToolKVClient

    hog = _hogged(srv)
    slept: list[float] = []

    def sleep(s: float) -> None:  # while the client waits, the other request finishes
        slept.append(s)
        srv.h.allocator.free(hog)

    tc = TestClient(build_app(LoopbackChannel(srv.tk)))
    with ToolKVClient(
        "http://t", transport=tc._transport, sleep=sleep, retry=RetryPolicy(**RETRY_DEVICE_FULL)
    ) as c:
        assert c.tool_end("s1", 1).state == "Restoring"
    assert slept == [0.25]


def test_client_retries_are_bounded_then_raise(srv: Server) -> None:
    from toolkv.client import RetryPolicy, ToolKVClient
    from toolkv.errors import DeviceMemoryFull

    _hogged(srv)
    slept: list[float] = []
    before = srv.snapshot()
    tc = TestClient(build_app(LoopbackChannel(srv.tk)))
    with (
        ToolKVClient(
            "http://t", transport=tc._transport, sleep=slept.append, retry=RetryPolicy(**RETRY_DEVICE_FULL)
        ) as c,
        pytest.raises(DeviceMemoryFull) as ei,
    ):
        c.tool_end("s1", 1)
    assert slept == [0.25, 0.5, 1.0] and ei.value.details["need_tokens"] == 65
    assert srv.snapshot() == before
    policy = RetryPolicy(retries=5, backoff_s=1.0, max_backoff_s=3.0)
    assert [policy.delay(i, httpx.Response(503)) for i in range(4)] == [1.0, 2.0, 3.0, 3.0]
    assert policy.delay(0, httpx.Response(503, headers={"retry-after": "2.5"})) == 2.5
    assert policy.delay(0, httpx.Response(503, headers={"retry-after": "600"})) == 3.0


class _LostFirstReply(ChannelTransport):
    """The scheduler applies the call, but its first reply never reaches the HTTP side (504)."""

    def __init__(self, tk: SchedulerToolKV) -> None:
        super().__init__(timeout_s=0.05)
        self.tk = tk
        self.ops: list[str] = []

    def _send(self, req: ToolKVReqInput) -> None:
        self.ops.append(req.op)
        out = self.tk.ipc_handler(req)
        if len(self.ops) > 1:
            asyncio.get_running_loop().call_soon(self.replies.resolve, out)


def test_client_reconciles_a_504_through_kv_meta_instead_of_resending(srv: Server) -> None:
    from toolkv.client import ToolKVClient

    t = _LostFirstReply(srv.tk)
    with ToolKVClient("http://t", transport=TestClient(build_app(t))._transport, sleep=lambda s: None) as c:
        m = c.tool_start("s1")
    assert (m.state, m.epoch) == ("Offloading", 1)
    assert t.ops == ["tool_start", "kv_meta"], "the applied tool_start must not be sent twice"


def test_async_client_retries_too(srv: Server) -> None:
    from toolkv.client import AsyncToolKVClient, RetryPolicy

    hog = _hogged(srv)
    slept: list[float] = []

    async def sleep(s: float) -> None:
        slept.append(s)
        srv.h.allocator.free(hog)

    async def run() -> str:
        app = build_app(LoopbackChannel(srv.tk))
        async with AsyncToolKVClient(
            "http://t",
            transport=httpx.ASGITransport(app=app),
            sleep=sleep,
            retry=RetryPolicy(**RETRY_DEVICE_FULL),
        ) as c:
            return (await c.tool_end("s1", 1)).state

    assert asyncio.run(run()) == "Restoring" and slept == [0.25]


def test_a_tool_start_checks_its_session_id_at_most_twice(
    srv: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The id is checked where the request is built (the route) and by the machine's own action
    (``_get``), nowhere else: the channel carries the built request, the scheduler side and the
    call policy do not check it again. Counted on an accepted tool_start over HTTP."""
    from toolkv.core import requests
    from toolkv.core.session.state import MachineState

    checks: list[str] = []
    arg_check, get = requests.Arg.check, MachineState._get

    def counted_check(self: requests.Arg, name: str, value: object) -> object:
        if name == "session_id":
            checks.append("request")
        return arg_check(self, name, value)

    def counted_get(self: MachineState, session_id: str) -> Any:
        checks.append("machine")
        return get(self, session_id)

    monkeypatch.setattr(requests.Arg, "check", counted_check)
    monkeypatch.setattr(MachineState, "_get", counted_get)
    r = srv.client.post("/session/tool_start", json={"session_id": "s1", "tool": "ls"})
    assert r.status_code == 200, r.text
    assert checks == ["request", "machine"]
