"""The fault table on a LIVE sglang server with toolkv (GPU): each row injects one fault over HTTP and
records what the client saw, the session's state after, the tokens checked and what leaked.

Run by ``scripts/gpu_faults.sh`` on the GPU machine; the same faults on the real caches on CPU are
``tests/test_faults.py`` (where a fault can be put between two scheduler iterations; here the timing
is the real server's, so a row says which interleaving it observed instead of forcing one).

How a row checks the KV on a live server: the server cannot hand out its KV bytes, so every
conversation first runs as a *twin* that is never offloaded (temperature 0, requests one at a time);
a row's turn must produce the twin's tokens exactly, and ``meta_info.cached_tokens`` says whether the
prefix was reused (restored) or recomputed. Leaks: at the end every session is closed and the server
must hold nothing protected or locked (toolkv's ``kv_meta``); sglang's own idle memory check would
crash the server on a leaked slot, so the server must still be healthy and its log free of
tracebacks. The last row restarts the server.

    python scripts/gpu_faults.py --launch launch.json --out faults.json      # run (GPU)
    python scripts/gpu_faults.py --table faults.json                         # the docs table
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

PROMPT_TOKENS = 3000  # per session (no shared prefix between sessions)
NEW_TOKENS = 24
TOOL_RESULT = 200
RESTORED = ("Handover", "Runnable")


@dataclass
class Row:
    """One line of the live fault table (the CPU table's columns, plus the row's own verdict)."""

    fault: str
    injected: str
    client_saw: str = ""
    state_after: str = ""
    checked: str = ""
    leaks: str = ""
    passed: bool = False
    notes: list[str] = field(default_factory=list)
    error: str = ""


class Live:
    """The server under test: launch, health, its toolkv routes and sglang's own routes."""

    def __init__(self, launch: dict[str, Any], log: Path) -> None:
        self.cmd: list[str] = launch["cmd"]
        self.env = {**os.environ, **launch.get("env", {})}
        self.url = launch["url"]
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None
        self.http = httpx.Client(base_url=self.url, timeout=180)
        self.starts: list[float] = []

    def start(self, limit_s: float = 300) -> float:
        with self.log.open("ab") as f:
            self.proc = subprocess.Popen(self.cmd, env=self.env, stdout=f, stderr=subprocess.STDOUT,
                                         start_new_session=True)  # fmt: skip
        t0 = time.time()
        while time.time() - t0 < limit_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode} at start")
            try:
                if self.http.get("/health", timeout=5).status_code == 200:
                    self.starts.append(time.time() - t0)
                    return self.starts[-1]
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise RuntimeError(f"server not healthy after {limit_s:.0f} s")

    def stop(self) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(20)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        self.proc = None

    def healthy(self) -> bool:
        try:
            return self.http.get("/health", timeout=10).status_code == 200
        except httpx.HTTPError:
            return False

    # ---- toolkv's routes: (status, body) exactly as a client sees them -------------------------
    def call(self, op: str, **body: Any) -> tuple[int, dict[str, Any]]:
        r = self.http.post(f"/session/{op}", json=body)
        return r.status_code, r.json()

    def meta(self, sid: str) -> dict[str, Any]:
        r = self.http.get("/session/kv_meta", params={"session_id": sid})
        return {"http": r.status_code, **r.json()}

    def server(self) -> dict[str, Any]:
        out: dict[str, Any] = self.http.get("/session/kv_meta").json()
        return out

    def wait_state(self, sid: str, want: tuple[str, ...], limit_s: float = 60) -> str:
        t0 = time.time()
        state = ""
        while time.time() - t0 < limit_s:
            state = str(self.meta(sid).get("state"))
            if state in want:
                return state
            time.sleep(0.01)
        raise TimeoutError(f"{sid} stuck in {state} (wanted {want})")

    # ---- sglang's routes -------------------------------------------------------------------------
    def generate(self, ids: list[int], sid: str | None, new: int = NEW_TOKENS, rid: str | None = None,
                 timeout: float = 180) -> tuple[list[int], int, str]:  # fmt: skip
        body: dict[str, Any] = {
            "input_ids": ids,
            "sampling_params": {"temperature": 0, "max_new_tokens": new, "ignore_eos": True},
        }
        if sid is not None:
            body["session_id"] = sid
        if rid is not None:
            body["rid"] = rid
        r = self.http.post("/generate", json=body, timeout=timeout)
        if r.status_code != 200:
            return [], 0, f"{r.status_code} {r.text[:200]}"
        out = r.json()
        meta = out.get("meta_info", {})
        reason = meta.get("finish_reason") or {}
        return list(out["output_ids"]), int(meta.get("cached_tokens") or 0), str(reason.get("type", ""))

    def abort(self, rid: str) -> int:
        return self.http.post("/abort_request", json={"rid": rid}).status_code

    def flush(self, timeout_s: float = 0) -> tuple[int, str]:
        r = self.http.post("/flush_cache", params={"timeout": timeout_s}, timeout=timeout_s + 120)
        return r.status_code, r.text.strip()[:120]


def prompt(i: int) -> list[int]:
    return [1000 + ((i + 7) * 100_003 + j * 7_919) % 60_000 for j in range(PROMPT_TOKENS)]


def tool_result(i: int) -> list[int]:
    return [500 + (i * 31 + j * 17) % 20_000 for j in range(TOOL_RESULT)]


@dataclass
class Conv:
    """A two-turn conversation and its never-offloaded twin's tokens."""

    i: int
    out1: list[int] = field(default_factory=list)
    out2: list[int] = field(default_factory=list)

    @property
    def p1(self) -> list[int]:
        return prompt(self.i)

    @property
    def p2(self) -> list[int]:
        return self.p1 + self.out1 + tool_result(self.i)


def in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    box: list[Any] = []

    def run() -> None:
        try:
            box.append(fn())
        except Exception as e:  # recorded by the row
            box.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, box


class Watcher:
    """Polls a session's ``kv_meta`` from a thread and keeps each state it saw, in order: on a live
    server this is how a row knows which interleaving it met."""

    def __init__(self, live: Live, sid: str) -> None:
        self.states: list[str] = []
        self._stop = threading.Event()
        self._live, self._sid = live, sid
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        http = httpx.Client(base_url=self._live.url, timeout=30)
        while not self._stop.is_set():
            try:
                state = str(
                    http.get("/session/kv_meta", params={"session_id": self._sid}).json().get("state")
                )
            except (httpx.HTTPError, ValueError):
                continue
            if not self.states or self.states[-1] != state:
                self.states.append(state)

    def stop(self) -> None:
        time.sleep(0.05)
        self._stop.set()
        self._t.join(10)


class Faults:
    """The rows, in order; each one is independent (its own session ids and conversations)."""

    def __init__(self, live: Live, ttl_s: float, handover_ttl_s: float) -> None:
        self.s = live
        self.ttl_s = ttl_s
        self.handover_ttl_s = handover_ttl_s
        self.convs: dict[str, Conv] = {}
        self.rows: list[Row] = []
        self.open: set[str] = set()  # sessions a row left open on purpose (the TTL row's)

    # ---- shared steps ------------------------------------------------------------------------
    def twins(self, names: list[str]) -> None:
        for n, name in enumerate(names):
            c = Conv(n)
            c.out1, _, _ = self.s.generate(c.p1, f"twin-{name}")
            c.out2, _, _ = self.s.generate(c.p2, f"twin-{name}")
            self.s.call("close", session_id=f"twin-{name}")
            self.convs[name] = c
        status, _ = self.s.flush(60)
        assert status == 200, "flush between the twins and the rows"

    def turn1(self, sid: str) -> Conv:
        c = self.convs[sid]
        out, _, _ = self.s.generate(c.p1, sid)
        assert out == c.out1, f"{sid}: turn 1 differs from its twin"
        return c

    def offloaded(self, sid: str, **hints: Any) -> int:
        """Turn 1, then tool_start and wait until the write is acknowledged; returns the epoch."""
        self.turn1(sid)
        st, body = self.s.call("tool_start", session_id=sid, **hints)
        assert st == 200, (st, body)
        self.s.wait_state(sid, ("Offloaded",))
        return int(body["epoch"])

    def turn2(self, sid: str) -> tuple[bool, int]:
        """The next turn: (its tokens equal the twin's, cached tokens)."""
        c = self.convs[sid]
        out, cached, _ = self.s.generate(c.p2, sid)
        return out == c.out2, cached

    def prefix(self, sid: str) -> int:
        c = self.convs[sid]
        return len(c.p1) + len(c.out1) - 1  # the last output token has no KV yet

    def leaks(self, *sids: str) -> str:
        """Close the row's sessions, wait for the server to go idle, and say what is still held
        beyond what the sessions left open hold: device tokens locked with no request running, and
        host tokens protected for no open session."""
        for sid in sids:
            self.s.call("close", session_id=sid)
            self.open.discard(sid)
        waited = self.quiesce()
        srv = self.s.server()
        locked = int(srv.get("device_locked_tokens") or 0)
        expect = 0
        for sid in self.open:
            m = self.s.meta(sid)
            if m.get("protected") and m.get("tier") != "device":
                expect += int(m.get("tokens") or 0)
        extra = int(srv.get("protected_tokens") or 0) - expect
        out = [f"{locked} device tokens locked"] if locked else []
        out += [f"{extra} host tokens protected for no open session"] if extra else []
        return "; ".join(out) if out else f"none (idle after {waited:.1f} s)"

    def quiesce(self, limit_s: float = 30) -> float:
        """Wait until no device token is locked (no request runs, nothing pinned)."""
        t0 = time.time()
        while time.time() - t0 < limit_s:
            if int(self.s.server().get("device_locked_tokens") or 0) == 0:
                break
            time.sleep(0.1)
        return time.time() - t0

    def run(self, fn: Callable[[Row], None], fault: str, injected: str) -> None:
        row = Row(fault, injected)
        t0 = time.time()
        print(f"== {fault}", flush=True)
        try:
            fn(row)
        except Exception as e:  # a failed row is a result: the others still run
            row.passed = False
            row.error = f"{type(e).__name__}: {e}"
            row.notes.append(traceback.format_exc(limit=3))
        row.notes.append(f"{time.time() - t0:.1f} s")
        print(
            ("PASS " if row.passed else "FAIL ") + fault + (f"  ({row.error})" if row.error else ""),
            flush=True,
        )
        self.rows.append(row)

    # ---- the rows ----------------------------------------------------------------------------
    def disconnect_restored(self, row: Row) -> None:
        sid = "disconnect"
        epoch = self.offloaded(sid)
        st, body = self.s.call("tool_end", session_id=sid, epoch=epoch)
        assert st == 200, body
        self.s.wait_state(sid, RESTORED)
        c = self.convs[sid]
        body2 = {"input_ids": c.p2, "session_id": sid, "stream": True,
                 "sampling_params": {"temperature": 0, "max_new_tokens": 2000, "ignore_eos": True}}  # fmt: skip
        chunks = 0
        with self.s.http.stream("POST", "/generate", json=body2) as r:
            for line in r.iter_lines():
                if line.startswith("data:") and "[DONE]" not in line:
                    chunks += 1
                if chunks >= 3:
                    break  # the client goes away mid-generate: the connection is closed here
        gone_s = self.quiesce()  # sglang aborts a request whose client went away
        state = self.s.meta(sid)["state"]
        equal, cached = self.turn2(sid)
        row.client_saw = f"{chunks} streamed chunks, then the connection closed; the retry answered"
        row.injected += f" (the server released the request {gone_s:.1f} s later, of 2,000 tokens asked)"
        row.state_after = f"{state} after the disconnect; the retry -> {self.s.meta(sid)['state']}"
        row.checked = (
            f"retry tokens equal the twin's: {equal}; cached {cached:,} of {len(c.p2):,} prompt tokens"
        )
        row.leaks = self.leaks(sid)
        row.passed = equal and cached >= self.prefix(sid) and row.leaks.startswith("none")

    def start_racing(self, sid: str, then: Callable[[], Any]) -> tuple[int, dict[str, Any], Any, list[str]]:
        """``tool_start`` and, 3 ms after it was sent, ``then()`` (the session's next request, a
        flush): on a GPU the write of a few thousand tokens is acknowledged within milliseconds, so
        only a call already on its way meets the session Offloading. Returns tool_start's answer,
        ``then()``'s result and the states a watcher saw."""
        watch = Watcher(self.s, sid)
        ts, sbox = in_thread(lambda: self.s.call("tool_start", session_id=sid))
        time.sleep(0.003)
        result = then()
        ts.join(60)
        watch.stop()
        st, body = sbox[0]
        return int(st), dict(body), result, watch.states

    def abort_offloading(self, row: Row) -> None:
        for attempt in range(3):  # until the request met the session Offloading
            sid = f"abort-offloading-{attempt}"
            self.turn1(sid)
            c = self.convs[sid]
            rid = f"{sid}-r"

            def request_then_abort() -> tuple[Any, int]:
                t, box = in_thread(lambda: self.s.generate(c.p2, sid, rid=rid))  # noqa: B023
                time.sleep(0.005)
                ab = self.s.abort(rid)  # noqa: B023
                t.join(60)
                return (box[0] if box else None), ab

            st, body, (got, ab), seen = self.start_racing(sid, request_then_abort)
            assert st == 200, body
            st2, body2 = self.s.call("tool_end", session_id=sid, epoch=int(body["epoch"]))
            end = self.s.wait_state(sid, ("Runnable", "Running"), self.handover_ttl_s + 20)
            seen = [*seen, *([end] if not seen or end != seen[-1] else [])]
            equal, cached = self.turn2(sid)
            leaks = self.leaks(sid)
            if body["state"] == "Offloading" and "Offloaded" not in seen:
                break
        reason = got[2] if isinstance(got, tuple) else repr(got)
        row.injected += f" (attempt {attempt + 1}: the first whose `tool_start` answered before its write was acknowledged)"
        row.client_saw = (f"`tool_start` 200 `{body['state']}`; the request: abort {ab}, finish `{reason or 'error'}`; "
                          f"late `tool_end` {st2} `{body2.get('error') or body2.get('state')}`")  # fmt: skip
        row.state_after = (
            " -> ".join(seen) + f" (hand-over TTL {self.handover_ttl_s:g} s); the retry -> Running"
        )
        row.checked = f"retry tokens equal the twin's: {equal}; cached {cached:,} tokens"
        row.leaks = leaks
        row.passed = (
            body["state"] == "Offloading" and "Offloaded" not in seen
            and equal and cached >= self.prefix(sid) and leaks.startswith("none") and st2 == 409
        )  # fmt: skip

    def abort_restoring(self, row: Row) -> None:
        sid = "abort-restoring"
        epoch = self.offloaded(sid)
        c = self.convs[sid]
        st, body = self.s.call("tool_end", session_id=sid, epoch=epoch)
        assert st == 200, body
        t, box = in_thread(lambda: self.s.generate(c.p2, sid, rid="abort-restoring-r"))
        time.sleep(0.005)
        ab = self.s.abort("abort-restoring-r")
        t.join(60)
        got = box[0] if box else None
        state_now = self.s.meta(sid)["state"]
        end = self.s.wait_state(sid, ("Runnable", "Running"), self.handover_ttl_s + 20)
        equal, cached = self.turn2(sid)
        reason = got[2] if isinstance(got, tuple) else repr(got)
        row.client_saw = f"`tool_end` 200 `{body['state']}`; the request: abort {ab}, finish `{reason or 'error'}`; the retry answered"
        row.state_after = f"{state_now} -> {end}; the retry -> Running"
        row.checked = f"retry tokens equal the twin's: {equal}; cached {cached:,} tokens"
        row.leaks = self.leaks(sid)
        row.passed = equal and cached >= self.prefix(sid) and row.leaks.startswith("none")

    def tool_end_races(self, row: Row) -> None:
        sid = "race"
        epoch = self.offloaded(sid)
        c = self.convs[sid]
        t, box = in_thread(lambda: self.s.generate(c.p2, sid))
        st, body = self.s.call("tool_end", session_id=sid, epoch=epoch)
        t.join(120)
        out, cached, _ = box[0] if box and isinstance(box[0], tuple) else ([], 0, "")
        equal = out == c.out2
        row.client_saw = f"the request served; `tool_end` {st} `{body.get('state') or body.get('error')}`"
        row.state_after = f"{self.s.meta(sid)['state']}"
        row.checked = f"tokens equal the twin's: {equal}; cached {cached:,} tokens"
        row.leaks = self.leaks(sid)
        row.passed = (
            equal and cached >= self.prefix(sid) and st in (200, 409) and row.leaks.startswith("none")
        )

    def host_full(self, row: Row) -> None:
        sids = [f"host-{i}" for i in range(12)]
        refused: tuple[str, int, dict[str, Any]] | None = None
        offloaded: list[str] = []
        before: dict[str, Any] = {}
        self.open.update(sids)
        for k, sid in enumerate(sids):
            self.turn1(sid)
            before = {**self.s.meta(sid), "protected_tokens": self.s.server().get("protected_tokens")}
            st, body = self.s.call("tool_start", session_id=sid, expected_s=30.0 + k)
            if st != 200:
                refused = (sid, st, body)
                break
            self.s.wait_state(sid, ("Offloaded",))
            offloaded.append(sid)
        assert refused is not None, f"the host pool never filled ({len(offloaded)} sessions offloaded)"
        sid, st, body = refused
        meta = self.s.meta(sid)
        after = {**meta, "protected_tokens": self.s.server().get("protected_tokens")}
        same = all(
            before.get(k) == after.get(k) for k in ("protected_tokens", "state", "epoch", "device_tokens")
        )
        # every offloaded session still comes back whole
        equal_all = True
        for o in offloaded:
            st2, _ = self.s.call("tool_end", session_id=o, epoch=int(self.s.meta(o)["epoch"]))
            self.s.wait_state(o, RESTORED)
            eq, cached = self.turn2(o)
            equal_all = equal_all and eq and cached >= self.prefix(o) and st2 == 200
        eq_r, _ = self.turn2(sid)
        row.client_saw = (f"{len(offloaded)} `tool_start` 200, then {st} `{body.get('error')}` "
                          f"(need {body.get('need_tokens')}, free {body.get('host_free_tokens')})")  # fmt: skip
        row.state_after = (
            f"the refused session {meta['state']} with its KV on the device; the others Offloaded"
        )
        row.checked = (f"protected tokens and the session's state, epoch and device tokens unchanged by the refusal: {same}; {len(offloaded)} restored turns equal "
                       f"their twins with the prefix cached: {equal_all}; the refused session's turn equal: {eq_r}")  # fmt: skip
        row.leaks = self.leaks(*sids)
        row.passed = st == 507 and body.get("error") == "host_memory_full" and same and equal_all and eq_r

    def restore_into_locked_pool(self, row: Row) -> None:
        sid = "locked"
        epoch = self.offloaded(sid)
        srv = self.s.server()
        total = sum(
            int(srv.get(k) or 0)
            for k in ("device_free_tokens", "device_evictable_tokens", "device_locked_tokens")
        )
        # the request holds all but 2,500 slots at once, growing by 1,500 while it decodes: less
        # than the session's 3,200 tokens stays free or evictable
        hog_len = max(total - 2500, 1000)
        hog = [40_000 + (j * 13) % 20_000 for j in range(hog_len)]
        t, box = in_thread(lambda: self.s.generate(hog, None, new=1500, rid="hog"))
        time.sleep(1.0)  # the hog is admitted and holds its slots
        st, body = self.s.call("tool_end", session_id=sid, epoch=epoch)
        during = self.s.meta(sid)
        t.join(180)
        hog_end = box[0][2] if box and isinstance(box[0], tuple) else repr(box[0] if box else None)
        st2, body2 = (st, body)
        if st != 200:
            st2, body2 = self.s.call("tool_end", session_id=sid, epoch=epoch)
        self.s.wait_state(sid, RESTORED)
        equal, cached = self.turn2(sid)
        row.injected += f" (a request of {hog_len:,} tokens in a {total:,}-token pool)"
        row.client_saw = (f"`tool_end` {st} `{body.get('error') or body.get('state')}`; after the request ended "
                          f"{st2} `{body2.get('state') or body2.get('error')}`")  # fmt: skip
        row.state_after = (
            f"{during['state']} (protected {during.get('protected')}) until the retry; then restored"
        )
        row.checked = (
            f"tokens equal the twin's: {equal}; cached {cached:,} tokens; the request ended `{hog_end}`"
        )
        row.leaks = self.leaks(sid)
        row.passed = (st == 503 and body.get("error") == "device_memory_full" and during["state"] == "Offloaded"
                      and st2 == 200 and equal and cached >= self.prefix(sid) and row.leaks.startswith("none"))  # fmt: skip

    def flush_under_load(self, row: Row) -> None:
        sid, run = "flush-offloaded", "flush-running"
        epoch = self.offloaded(sid)
        self.turn1(run)
        c = self.convs[sid]
        busy = [60_000 + (j * 11) % 20_000 for j in range(2000)]
        t, _ = in_thread(lambda: self.s.generate(busy, None, new=400))
        time.sleep(0.5)
        tf, fbox = in_thread(lambda: self.s.flush(30))
        tf.join(120)
        t.join(120)
        flushed = fbox[0] if fbox else None
        time.sleep(0.5)
        s1, s2 = self.s.meta(sid)["state"], self.s.meta(run)["state"]
        st, body = self.s.call("tool_end", session_id=sid, epoch=epoch)
        st3, body3 = self.s.call("tool_start", session_id=run)
        out, cached, _ = self.s.generate(c.p2, sid)
        row.client_saw = (f"flush {flushed}; `tool_end` {st} `{body.get('error')}`; `tool_start` of the "
                          f"running session {st3} `{body3.get('error') or body3.get('state')}`")  # fmt: skip
        row.state_after = f"Offloaded -> {s1}; Running -> {s2}"
        row.checked = f"the next turn recomputes ({cached} cached) to the twin's tokens: {out == c.out2}"
        row.leaks = self.leaks(sid, run)
        row.passed = s1 == "Lost" and out == c.out2 and st == 409 and row.leaks.startswith("none")

    def deferred_flush_offloading(self, row: Row) -> None:
        for attempt in range(3):  # until the flush was asked while the write was pending
            sid = f"deferred-flush-{attempt}"
            self.turn1(sid)
            c = self.convs[sid]
            before = self.s.server().get("counters", {})
            st, body, fl, seen = self.start_racing(sid, lambda: self.s.flush(30))
            state = self.s.meta(sid)["state"]
            after = self.s.server().get("counters", {})
            st2, body2 = (0, {"error": "-"})
            if st == 200:
                st2, body2 = self.s.call("tool_end", session_id=sid, epoch=int(body["epoch"]))
            out, cached, _ = self.s.generate(c.p2, sid)
            next_state = self.s.meta(sid).get("state")
            leaks = self.leaks(sid)
            if st == 200 and body["state"] == "Offloading":
                break
        mid = int(after.get("reset_mid_copy", 0)) - int(before.get("reset_mid_copy", 0))
        row.injected += f" (attempt {attempt + 1}: the first whose `tool_start` answered before its write was acknowledged)"
        row.client_saw = (f"`tool_start` {st} `{body.get('state') or body.get('error')}`; flush {fl[0]}; "
                          f"`tool_end` {st2} `{body2.get('error') or body2.get('state')}`")  # fmt: skip
        row.state_after = " -> ".join(seen) + f"; the next turn -> {next_state}"
        row.checked = f"reset_mid_copy +{mid}; the next turn recomputes ({cached} cached) to the twin's tokens: {out == c.out2}"
        row.leaks = leaks
        row.passed = (st == 200 and body["state"] == "Offloading" and state == "Lost" and mid == 0
                      and out == c.out2 and leaks.startswith("none"))  # fmt: skip

    def ttl_under_load(self, row: Row, sid: str, epoch: int, since: float) -> None:
        """The abandoned session offloaded at the start; the other rows were its load."""
        left = self.ttl_s + 2 - (time.time() - since)
        n = 0
        while left > 0:  # keep the server busy until the TTL is due
            self.s.generate([80_000 + (n * 100 + j) % 9000 for j in range(500)], None, new=16)
            n += 1
            left = self.ttl_s + 2 - (time.time() - since)
        state = self.s.wait_state(sid, ("Expired",), 30)
        m = self.s.meta(sid)
        st, body = self.s.call("tool_end", session_id=sid, epoch=epoch)
        row.injected += (
            f" ({time.time() - since:.0f} s of the other rows and {n} extra requests; TTL {self.ttl_s:g} s)"
        )
        row.client_saw = f"a late `tool_end` {st} `{body.get('error')}` (`{body.get('state')}`)"
        row.state_after = f"Offloaded -> {state}; protected {m.get('protected')}"
        row.checked = f"the session's host copy still protected: {m.get('protected')}"
        row.leaks = self.leaks(sid)
        row.passed = state == "Expired" and not m.get("protected") and st == 409

    def restart(self, row: Row) -> None:
        sid = "restart"
        epoch = self.offloaded(sid)
        self.s.stop()
        took = self.s.start()
        st, body = self.s.call("tool_end", session_id=sid, epoch=epoch)
        m = self.s.meta(sid)
        equal, cached = self.turn2(sid)
        row.injected += f" (SIGTERM, then a new server: healthy after {took:.0f} s)"
        row.client_saw = f"`tool_end` {st} `{body.get('error')}`; `kv_meta` {m['http']} `{m.get('error')}`"
        row.state_after = f"unknown; the next turn -> {self.s.meta(sid).get('state')}"
        row.checked = f"the next turn recomputes ({cached} cached) to the twin's tokens: {equal}"
        row.leaks = self.leaks(sid)
        row.passed = st == 404 and body.get("error") == "unknown_session" and m["http"] == 404 and equal


def final_check(live: Live, sids: list[str]) -> dict[str, Any]:
    """Close every session the run used, let the server idle, and read what it still holds."""
    for sid in sids:
        live.call("close", session_id=sid)
    time.sleep(3)  # idle iterations: sglang's strict idle memory check runs then
    srv = live.server()
    return {
        "protected_tokens": srv.get("protected_tokens"),
        "device_locked_tokens": srv.get("device_locked_tokens"),
        "sessions": srv.get("sessions"),
        "states": srv.get("states"),
        "healthy": live.healthy(),
        "counters": srv.get("counters"),
    }


ORDER: list[tuple[str, str, str]] = [
    (
        "disconnect_restored",
        "client disconnect during a generate of a restored session",
        "the session restored (Handover); its next turn streamed, the connection closed after 3 chunks",
    ),
    (
        "abort_offloading",
        "request abort while Offloading",
        "`tool_start`, then at once the session's next request (restore on request) and `/abort_request` for it",
    ),
    (
        "abort_restoring",
        "request abort while Restoring",
        "`tool_end`, then at once the session's next request and `/abort_request` for it",
    ),
    (
        "tool_end_races",
        "tool_end racing the next request",
        "the next request and `tool_end` sent together from two threads",
    ),
    (
        "host_full",
        "host pool filling during an offload",
        "sessions offloaded one after another, each expected back later than the one before, until refused",
    ),
    (
        "restore_into_locked_pool",
        "restore while locked requests hold the device pool",
        "a request holding most of the device pool runs; then `tool_end`; the retry after it ends",
    ),
    (
        "ttl_under_load",
        "TTL under load",
        "a session Offloaded and abandoned at the start while the rows above ran",
    ),
    (
        "flush_under_load",
        "flush under load",
        "`/flush_cache?timeout=30` while a request runs, one session Offloaded and one Running",
    ),
    (
        "deferred_flush_offloading",
        "flush asked during an offload",
        "`tool_start`, then at once `/flush_cache?timeout=30` (deferred while the write is pending)",
    ),
    ("restart", "server restart", "a session Offloaded; the server stopped and started again"),
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--launch", help="JSON: {cmd: [...], env: {...}, url: ...}")
    ap.add_argument("--log", default="server.log")
    ap.add_argument("--out", default="faults.json")
    ap.add_argument("--table", help="print the docs table of this JSON and exit")
    ap.add_argument("--release", default="0.5.16")
    ap.add_argument("--rows", default="", help="comma-separated row names (default: all, in order)")
    a = ap.parse_args()
    if a.table:
        print(table(json.loads(Path(a.table).read_text())))
        return 0
    launch = json.loads(Path(a.launch).read_text())
    env = launch.get("env", {})
    live = Live(launch, Path(a.log))
    res: dict[str, Any] = {"release": a.release, "launch": launch, "rows": []}
    try:
        res["healthy_after_s"] = live.start()
        f = Faults(live, float(env.get("TOOLKV_TTL_S", 40)), float(env.get("TOOLKV_HANDOVER_TTL_S", 5)))
        rowsids = ["ttl", "disconnect", "abort-restoring", "race", "locked", "flush-offloaded", "flush-running",
                   "restart", *(f"abort-offloading-{i}" for i in range(3)), *(f"deferred-flush-{i}" for i in range(3)),
                   *(f"host-{i}" for i in range(12))]  # fmt: skip
        f.twins(rowsids)
        ttl_epoch = f.offloaded("ttl", expected_s=1.0)  # predicted back first: never demoted for another
        f.open.add("ttl")
        ttl_since = time.time()
        rows = [r for r in ORDER if not a.rows or r[0] in a.rows.split(",")]
        for name, fault, how in rows:
            if name == "restart":  # the last row: what the first server holds once everything is closed
                res["before_restart"] = final_check(live, rowsids)
                f.run(f.restart, fault, how)
                res["end"] = final_check(live, ["restart"])
            elif name == "ttl_under_load":  # before any flush: a flush would take its copy (Lost)
                f.run(lambda r: f.ttl_under_load(r, "ttl", ttl_epoch, ttl_since), fault, how)
            else:
                f.run(getattr(f, name), fault, how)
        if "end" not in res:
            res["end"] = final_check(live, rowsids)
        res["rows"] = [asdict(r) for r in f.rows]
    except Exception as e:  # what ran is still written
        res["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
        if "f" in locals():
            res["rows"] = [asdict(r) for r in f.rows]
    finally:
        res["server_starts_s"] = live.starts
        live.stop()
    ends = [e for e in (res.get("before_restart"), res.get("end")) if e is not None] or [{}]
    res["leak_free"] = all(
        e.get("protected_tokens") == 0 and e.get("device_locked_tokens") == 0 and e.get("healthy")
        for e in ends
    )
    res["passed"] = (
        bool(res["rows"])
        and all(r["passed"] for r in res["rows"])
        and res["leak_free"]
        and "error" not in res
    )
    Path(a.out).write_text(json.dumps(res, indent=1, default=str))
    print(table(res))
    print("TOOLKV_FAULTS", "PASS" if res["passed"] else "FAIL")
    return 0 if res["passed"] else 1


def table(res: dict[str, Any]) -> str:
    """The docs table: one line per row, from the run's JSON."""
    head = ("| fault | how injected | what the client saw | state after | tokens checked | leaks | verdict |\n"
            "|---|---|---|---|---|---|---|")  # fmt: skip
    lines = [head]
    for r in res.get("rows", []):
        cells = [r["fault"], r["injected"], r["client_saw"] or "-", r["state_after"] or "-",
                 r["checked"] or "-", r["leaks"] or "-", "pass" if r["passed"] else f"FAIL {r['error']}".strip()]  # fmt: skip
        lines.append("| " + " | ".join(str(c).replace("|", "\\|").replace("\n", " ") for c in cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
