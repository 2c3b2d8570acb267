"""The operator's routes on CPU: ``GET /session/status`` (``toolkv doctor``) and ``POST /session/drain``
(``toolkv drain``), driven through FastAPI's TestClient (and, for the command line, uvicorn on a
real port) -> toolkv's routes -> the loopback test double of sglang's channel -> the plugin's
scheduler-side handler -> the real ToolKVManager over the real HiRadixCache.

What must hold: while draining, a new tool call is refused with 503 ``draining`` and changes
nothing, calls in flight finish (or expire) as usual, and the drain reports when nothing is held;
the status read changes nothing; a malformed drain or status request is a 4xx that changes
nothing; the client and the CLI answer in types and one-line diagnoses, never tracebacks."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from _turns import LoopbackChannel, finish_turn, iteration
from fastapi import FastAPI
from fastapi.testclient import TestClient

from toolkv.client import (
    AsyncToolKVClient,
    DrainStatus,
    ServerStatus,
    ToolKVClient,
    ToolKVNotRunning,
)
from toolkv.errors import Draining
from toolkv.sglang.config import ToolKVConfig
from toolkv.sglang.http_api import build_app
from toolkv.sglang.scheduler_side import SchedulerToolKV
from toolkv.sglang.startup import installed_sglang_version
from toolkv.testing.harness import CacheHarness, HarnessConfig
from toolkv.tools.cli import main

A = list(range(1, 65))
B = list(range(100, 140))


class Server:
    def __init__(self, h: CacheHarness, tk: SchedulerToolKV) -> None:
        self.h, self.tk = h, tk
        self.app = build_app(LoopbackChannel(tk))
        self.client = TestClient(self.app)

    def snapshot(self) -> Any:
        """Everything a refusal must leave alone: the pools, every session record, the flag."""
        m = self.tk.manager
        return (
            self.h.accounting(),
            {sid: m.kv_meta(sid) for sid in m.sessions},
            dict(m.counters),
            (self.tk.draining, self.tk.drain_since),
        )


def make_server(h: CacheHarness, config: ToolKVConfig | None = None) -> Server:
    # the restores drained here need the GPU copy freed at the write ack (TOOLKV_LAZY_FREE=0)
    tk = SchedulerToolKV(h.tree, config=config if config is not None else ToolKVConfig(lazy_free=False))
    h.tree._toolkv = tk
    assert finish_turn(h, "a", A, [65, 66])
    assert finish_turn(h, "b", B, [140], slot=1)
    return Server(h, tk)


@pytest.fixture
def srv() -> Iterator[Server]:
    with CacheHarness(HarnessConfig()) as h:
        yield make_server(h)


# ---- the drain over HTTP ---------------------------------------------------------------------------
def test_drain_refuses_new_calls_lets_calls_in_flight_finish_and_reports_drained(srv: Server) -> None:
    c, h, tk = srv.client, srv.h, srv.tk
    r = c.post("/session/tool_start", json={"session_id": "a"})
    assert r.status_code == 200 and r.json()["state"] == "Offloading"
    r = c.post("/session/drain", json={})
    d = r.json()
    assert r.status_code == 200 and d["draining"] and not d["drained"]
    assert (d["held_sessions"], d["held_tokens"], d["drain_refused"]) == (1, 65, 0)

    # a new tool call: 503 draining, with a message, and nothing changed
    before = srv.snapshot()
    r = c.post("/session/tool_start", json={"session_id": "b"})
    body = r.json()
    assert r.status_code == 503 and body["error"] == "draining" and "POST /session/drain" in body["message"]
    assert body["held_sessions"] == 1
    after = srv.snapshot()
    assert after[:3] == before[:3] and after[3] == before[3]
    assert tk.drain_refused == 1

    # a re-sent tool_start that was already applied is still recognised (the call is in flight)
    r = c.post("/session/tool_start", json={"session_id": "a", "prior_epoch": 0})
    assert r.status_code == 200 and r.json()["replayed"] is True

    # the call in flight finishes as usual: offload completes, tool_end restores, admission ends it
    iteration(h, tk, writes=True)
    assert c.get("/session/status").json()["held"][0]["state"] == "Offloaded"
    r = c.post("/session/tool_end", json={"session_id": "a", "epoch": 1})
    assert r.status_code == 200 and r.json()["state"] == "Restoring"
    iteration(h, tk, loads=True)
    d = c.post("/session/drain", json={"drain": True}).json()  # idempotent: the drain goes on
    assert d["draining"] and d["held_sessions"] == 1 and d["drain_refused"] == 1  # Handover: pinned
    assert finish_turn(h, "a", [*A, 65, 66], [67])  # its next request is admitted and runs
    d = c.post("/session/drain", json={}).json()
    assert d["drained"] and d["held_sessions"] == 0 and d["held_tokens"] == 0
    assert c.get("/session/kv_meta").json()["draining"] is True

    # the drain ends: tool calls are accepted again
    d = c.post("/session/drain", json={"drain": False}).json()
    assert not d["draining"] and not d["drained"] and d["drain_since"] is None
    assert c.post("/session/tool_start", json={"session_id": "b"}).json()["state"] in (
        "Offloading",
        "Offloaded",
    )


def test_a_drained_server_counts_expired_calls_as_done() -> None:
    """A call whose tool_end never comes holds KV until its TTL: the drain waits for it, and is
    drained once the sweep (on the agreed clock) released it."""
    with CacheHarness(HarnessConfig()) as h:
        srv = make_server(h, ToolKVConfig(ttl_s=1.0, sweep_every=1, lazy_free=False))
        c = srv.client
        assert c.post("/session/tool_start", json={"session_id": "a"}).status_code == 200
        iteration(h, srv.tk, writes=True)
        assert not c.post("/session/drain", json={}).json()["drained"]
        time.sleep(1.2)
        srv.tk.tick()
        d = c.post("/session/drain", json={}).json()
        assert d["drained"] and d["states"]["Expired"] == 1


BAD_DRAIN = [
    (b'{"drain": "yes"}', "application/json", 400, "drain"),
    (b'{"drain": 1}', "application/json", 400, "drain"),
    (b'{"drain": null}', "application/json", 400, "drain"),
    (b'{"drain": true, "now": 1}', "application/json", 400, "now"),
    (b"[true]", "application/json", 400, "JSON object"),
    (b"", "application/json", 400, "JSON object"),
    (b"{not json", "application/json", 400, "not valid JSON"),
    (b'{"drain": true}', "text/plain", 415, "application/json"),
]


@pytest.mark.parametrize(("raw", "ctype", "status", "words"), BAD_DRAIN)
def test_a_malformed_drain_is_refused_and_changes_nothing(
    srv: Server, raw: bytes, ctype: str, status: int, words: str
) -> None:
    for draining in (False, True):
        srv.tk.set_drain(draining)
        before = srv.snapshot()
        r = srv.client.post("/session/drain", content=raw, headers={"content-type": ctype})
        assert r.status_code == status and words in r.json()["message"], r.text
        assert srv.snapshot() == before


def test_zero_change_and_kv_hints_retain_are_refused_while_draining() -> None:

    with CacheHarness(HarnessConfig()) as h:
        _zero_change_and_retain(make_server(h, ToolKVConfig(zero_change=True, lazy_free=False)))


def _zero_change_and_retain(srv: Server) -> None:
    from toolkv.sglang.kv_hints import RETAIN, HintAction, _apply_retain

    tk = srv.tk
    tk.set_drain(True)
    before = srv.snapshot()
    assert tk.handle("auto_offload", {"session_id": "a"}) == (200, {"skipped": "skip:draining"})
    out = _apply_retain(tk, "b", HintAction(action_id="x", action_type=RETAIN))
    assert out["outcome"] == "rejected" and out["reason"].startswith("draining")
    assert srv.snapshot()[:3] == before[:3] and tk.drain_refused == 2


# ---- the status read -------------------------------------------------------------------------------
def test_status_names_releases_settings_and_what_is_held_soonest_expiry_first(srv: Server) -> None:
    c, tk = srv.client, srv.tk
    assert c.post("/session/tool_start", json={"session_id": "a"}).status_code == 200
    for _ in range(3):  # the agreed clock moves (sweep_every ticks per reading)
        for _ in range(tk.config.sweep_every):
            tk.tick()
    assert c.post("/session/tool_start", json={"session_id": "b"}).status_code == 200
    before = srv.snapshot()
    st = c.get("/session/status").json()
    assert srv.snapshot() == before, "the status read changes nothing"
    assert st["sglang"] == installed_sglang_version() and st["backend"] == "hiradix"
    assert set(st["settings"]) == set(tk.config.describe()) and st["settings"]["ttl_s"] == tk.config.ttl_s
    assert st["draining"] is False and st["held_sessions"] == 2 and st["states"] == {"Offloading": 2}
    held = st["held"]
    assert [h["session_id"] for h in held] == sorted(
        ["a", "b"], key=lambda s: tk.manager.sessions[s].deadline
    )
    for h in held:
        rec = tk.manager.sessions[h["session_id"]]
        assert h["ttl_left_s"] == round(rec.deadline - tk.manager.now, 3) and 0 < h["ttl_left_s"] <= 600
    assert [h["session_id"] for h in c.get("/session/status", params={"limit": 1}).json()["held"]] == [
        held[0]["session_id"]
    ]
    assert c.get("/session/status", params={"limit": 0}).json()["held"] == []


@pytest.mark.parametrize("query", ["limit=-1", "limit=1001", "limit=x", "limit=1&limit=2", "session_id=a",
                                   "limit=", "limit=%C2%B2"])  # fmt: skip
def test_a_malformed_status_query_is_400_and_changes_nothing(srv: Server, query: str) -> None:
    before = srv.snapshot()
    r = srv.client.get(f"/session/status?{query}")
    assert r.status_code == 400 and r.json()["error"] == "bad_request" and r.json()["message"], r.text
    assert srv.snapshot() == before


# ---- metrics ---------------------------------------------------------------------------------------
def test_the_draining_gauge_follows_the_drain() -> None:
    from prometheus_client import CollectorRegistry

    from toolkv.sglang.metrics import ToolKVMetrics

    reg = CollectorRegistry()
    labels = {"model_name": "m", "tp_rank": "0"}
    with CacheHarness(HarnessConfig()) as h:
        tk = SchedulerToolKV(h.tree, metrics=ToolKVMetrics(labels, registry=reg, refresh_s=0.0))
        assert reg.get_sample_value("toolkv:draining", labels) == 0
        tk.handle("drain", {"drain": True})
        tk.tick()
        assert reg.get_sample_value("toolkv:draining", labels) == 1
        tk.handle("drain", {"drain": False})
        tk.tick()
        assert reg.get_sample_value("toolkv:draining", labels) == 0


# ---- the client --------------------------------------------------------------------------------------
def test_client_reads_status_drains_and_tool_call_goes_on_while_draining(srv: Server) -> None:
    with ToolKVClient("http://testserver", transport=srv.client._transport) as kv:
        kv.tool_start("a")
        d = kv.drain()
        assert isinstance(d, DrainStatus) and d.draining and d.held_sessions == 1 and not d.drained
        with pytest.raises(Draining) as ei:
            kv.tool_start("b")
        assert ei.value.http_status == 503 and ei.value.details["held_sessions"] == 1
        ran = False
        with kv.tool_call("b", tool="search") as call:
            ran = True
        assert ran and call.start_outcome == "refused" and call.end_outcome == "not_sent"
        assert isinstance(call.failures[0], Draining)
        st = kv.server_status(limit=5)
        assert isinstance(st, ServerStatus) and st.sglang == installed_sglang_version()
        assert st.drain.draining and st.drain.drain_refused == 2 and st.drain.held_sessions == 1
        (held,) = st.held
        assert held.meta.session_id == "a" and held.meta.state == "Offloading" and held.ttl_left_s is not None
        assert not kv.drain(False).draining


def test_async_client_status_and_drain(srv: Server) -> None:
    async def run() -> tuple[DrainStatus, ServerStatus]:
        transport = httpx.ASGITransport(app=srv.app)
        async with AsyncToolKVClient("http://t", transport=transport) as kv:
            d = await kv.drain()
            return d, await kv.server_status()

    d, st = asyncio.run(run())
    assert d.draining and d.drained and st.drain.draining and st.sessions == 2 and st.held == []


def test_tool_call_says_once_that_toolkv_is_off(caplog: pytest.LogCaptureFixture) -> None:
    """After toolkv is switched off every tool call meets a server without its routes: the agent's
    log says so once at WARNING, then at DEBUG (the tool runs every time)."""
    bare = TestClient(FastAPI())
    with ToolKVClient("http://testserver", transport=bare._transport) as kv:
        caplog.set_level(logging.DEBUG, logger="toolkv.client")
        for _ in range(3):
            with kv.tool_call("s") as call:
                pass
            assert call.start_outcome == "failed" and isinstance(call.failures[0], ToolKVNotRunning)
    levels = [r.levelno for r in caplog.records if r.name == "toolkv.client"]
    assert levels == [logging.WARNING, logging.DEBUG, logging.DEBUG]


# ---- the command line against a real port ----------------------------------------------------------
class LiveApp:
    """An ASGI app served by uvicorn on a real port, in a thread (the CLI speaks HTTP to it)."""

    def __init__(self, app: FastAPI) -> None:
        config = uvicorn.Config(
            app,
            host="127.0.0.1",
            port=0,
            log_level="warning",
            timeout_graceful_shutdown=1,
            loop="asyncio",  # not "auto": a test double may stand in for uvloop (test_session_header.py)
        )
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self.server.run, daemon=True)
        self._thread.start()
        t0 = time.monotonic()
        while not self.server.started:
            assert time.monotonic() - t0 < 30, "uvicorn did not start"
            time.sleep(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"

    def close(self) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=10)


@pytest.fixture
def live(request: pytest.FixtureRequest) -> Iterator[tuple[LiveApp, Server]]:
    """A live server; its TTL (default 1 s, swept at every tick) by ``@pytest.mark.parametrize("live", ...)``."""
    ttl_s = float(getattr(request, "param", 1.0))
    with CacheHarness(HarnessConfig()) as h:
        srv = make_server(h, ToolKVConfig(ttl_s=ttl_s, sweep_every=1, lazy_free=False))
        app = LiveApp(srv.app)
        yield app, srv
        app.close()


@pytest.mark.parametrize("live", [600.0], indirect=True)
def test_doctor_reports_toolkv_on(live: tuple[LiveApp, Server], capsys: pytest.CaptureFixture[str]) -> None:
    app, srv = live
    assert srv.client.post("/session/tool_start", json={"session_id": "a"}).status_code == 200
    assert main(["doctor", app.url]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"toolkv is on at {app.url}\n")
    assert f"on sglang {installed_sglang_version()}, backend hiradix, tp_size 1" in out
    assert "drain:     off" in out and "holding:   1 session, 65 tokens" in out
    assert re.search(r"\n +a +Offloading +BackingUp +65 +10\.0 min\n", out), out
    # the settings that differ from their declared defaults, by variable name (ttl_s=600 is the default)
    assert "TOOLKV_SWEEP_EVERY=1 (default 64)" in out and "TOOLKV_LAZY_FREE=0 (default 1)" in out
    assert "TOOLKV_TTL_S" not in out and "Traceback" not in out
    assert main(["doctor", app.url, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["on"] is True and doc["status"]["held"][0]["session_id"] == "a"


def test_doctor_says_why_toolkv_does_not_answer(capsys: pytest.CaptureFixture[str]) -> None:
    app = LiveApp(FastAPI())  # a server without toolkv's routes
    try:
        assert main(["doctor", app.url]) == 1
        err = capsys.readouterr().err
        assert err.startswith(f"toolkv is off at {app.url}") and "TOOLKV_ENABLE=1" in err
        assert main(["doctor", app.url, "--json"]) == 1
        doc = json.loads(capsys.readouterr().out)
        assert doc["on"] is False and doc["error"] == "toolkv_not_running"
    finally:
        app.close()
    assert main(["doctor", app.url, "--timeout", "2"]) == 1  # nothing listens there now
    assert capsys.readouterr().err.startswith(f"no server at {app.url}")


def test_drain_waits_until_nothing_is_held_then_ends(
    live: tuple[LiveApp, Server], capsys: pytest.CaptureFixture[str]
) -> None:
    app, srv = live
    assert srv.client.post("/session/tool_start", json={"session_id": "a"}).status_code == 200
    iteration(srv.h, srv.tk, writes=True)
    # its tool_end never comes: the 1 s TTL releases it while the drain waits
    assert main(["drain", app.url, "--wait", "30", "--every", "0.2", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["draining"] and d["drained"] and d["held_sessions"] == 0 and 0 < d["waited_s"] < 30
    assert srv.client.post("/session/tool_start", json={"session_id": "b"}).status_code == 503
    assert main(["drain", app.url, "--off"]) == 0
    assert "drain off" in capsys.readouterr().out
    assert srv.client.post("/session/tool_start", json={"session_id": "b"}).status_code == 200


@pytest.mark.parametrize("live", [600.0], indirect=True)
def test_drain_wait_that_runs_out_exits_1(
    live: tuple[LiveApp, Server], capsys: pytest.CaptureFixture[str]
) -> None:
    app, srv = live
    assert srv.client.post("/session/tool_start", json={"session_id": "a"}).status_code == 200
    assert main(["drain", app.url, "--wait", "0.5", "--every", "0.1"]) == 1
    out, err = capsys.readouterr()
    assert "1 session holding KV (65 tokens)" in out and "still held after 0.5 s" in err


@pytest.mark.parametrize("argv", [["drain", "http://x", "--wait", "0"], ["drain", "http://x", "--off", "--wait", "1"],
                                  ["doctor", "http://x", "--limit", "-1"], ["doctor", "http://x", "--timeout", "nan"]])  # fmt: skip
def test_operator_commands_refuse_bad_arguments_in_one_line(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as ei:
        main(argv)
    err = capsys.readouterr().err
    assert ei.value.code == 2 and err.count("\n") == 1 and "error:" in err


# ---- the example in docs/operations.md -------------------------------------------------------------
DOCS = Path(__file__).resolve().parents[1] / "docs" / "operations.md"
EXAMPLE = re.compile(
    r"(<!-- doctor-example: generated by tests/test_drain.py -->\n)(.*?)(   <!-- /doctor-example -->)", re.S
)


def test_docs_example_is_what_doctor_prints(srv: Server) -> None:
    """operations.md's ``toolkv doctor`` example is this server's report (one session offloaded);
    ``TOOLKV_WRITE_DOCS=1`` rewrites it."""
    from toolkv.tools.doctor import render

    assert srv.client.post("/session/tool_start", json={"session_id": "a"}).status_code == 200
    iteration(srv.h, srv.tk, writes=True)
    url = "http://127.0.0.1:30000"
    report = render(url, ServerStatus.from_json(srv.client.get("/session/status").json()))
    block = "\n".join(
        f"   {line}".rstrip() for line in ["```", f"toolkv doctor {url}", *report.splitlines(), "```"]
    )
    text = DOCS.read_text()
    m = EXAMPLE.search(text)
    assert m, "docs/operations.md lost its doctor-example markers"
    if os.environ.get("TOOLKV_WRITE_DOCS") == "1":
        DOCS.write_text(text[: m.start(2)] + block + "\n" + text[m.end(2) :])
        text = DOCS.read_text()
        m = EXAMPLE.search(text)
        assert m
    assert m.group(2) == block + "\n", "run TOOLKV_WRITE_DOCS=1 pytest tests/test_drain.py -k docs_example"
