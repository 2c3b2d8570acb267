"""Agent-trace load generator for a running sglang server (``toolkv bench agent``).

Sessions arrive open loop on the schedule of a :class:`~toolkv.workload.plan.Plan` (seeded,
identical for every configuration). Each session is a sequence of turns: send the prompt (its
context plus the new tool result) to ``/generate`` as token ids (dummy weights,
``--skip-tokenizer-init``, temperature 0), stream the answer, "run a tool" for the planned
duration, repeat. A slow server does not slow the arrivals: overload shows as latency.

Modes (what the agent does around each tool call):

- ``stock``      nothing, and its requests carry no session id: the server decides what stays.
- ``explicit``   ``tool_start`` after the turn, ``tool_end`` with its epoch when the tool returns.
- ``on-request`` ``tool_start`` after the turn, no ``tool_end``: the session's next request restores
  it (``TOOLKV_RESTORE_ON_REQUEST``). This is zero-change mode's server path with the trigger
  emulated: zero-change offloads when a chat answer ends in ``tool_calls``, which a dummy-weight
  model never produces, so the agent sends the ``tool_start`` the server would have made.

``--send-tool`` names each tool in ``tool_start``; ``--policy offload|auto`` asks for that per-call
policy in every ``tool_start`` body (``"policy": ...``, overriding the server's ``TOOLKV_POLICY`` for
the call), so that one server can serve offload and auto agents in turn. Without it no ``policy``
field is sent.

Measured: per turn TTFT (streaming), end-to-end time and sglang's ``cached_tokens``; every toolkv
answer by status; the device and host pools sampled once a second (``/session/kv_meta`` when toolkv
is loaded, sglang's ``/v1/loads``). At the end it checks that nothing is left protected or locked.
``--twins K`` then compares K offloaded sessions token for token with never-offloaded twins, and
``--probe`` measures resume against prefill of the same tokens and decode under a restore
(:mod:`toolkv.tools.agent_probe`).

Standard library only: it runs on a GPU machine next to the server with nothing installed.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from toolkv.argtypes import (
    OneLineParser,
    http_url,
    nonneg_float,
    nonneg_int,
    positive_float,
    positive_int,
    seed,
)
from toolkv.core.phases import Phase
from toolkv.core.settings import POLICY_NAMES
from toolkv.workload.metrics import REFUSALS, Turn, occupancy, recomputed_between, summarize, unexpected_5xx
from toolkv.workload.plan import SHAPES, Plan, SessionPlan, Workload, make_plan

MODES = ("stock", "explicit", "on-request")
POLICIES = POLICY_NAMES  # what --policy may ask for in tool_start (toolkv's TOOLKV_POLICY values)
__all__ = ["MODES", "POLICIES", "REFUSALS", "HttpServer", "main", "run_plan", "unexpected_5xx"]


@dataclass
class Generated:
    status: int
    output_ids: list[int]
    cached_tokens: int
    ttft_s: float
    e2e_s: float


class AgentServer(Protocol):
    """What the load generator needs from a server (HTTP in production, a CPU stand-in in tests)."""

    def generate(self, ids: list[int], sid: str | None, out_tokens: int) -> Generated: ...
    def call(self, op: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]: ...
    def kv_meta(self, sid: str | None = None) -> tuple[int, dict[str, Any]]: ...
    def loads(self) -> dict[str, Any] | None: ...


def _post(url: str, body: dict[str, Any], timeout: float = 600) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read() or b"{}"
            try:
                return r.status, json.loads(raw)
            except ValueError:
                return r.status, {}
    except urllib.error.HTTPError as e:
        try:
            return e.code, json.loads(e.read() or b"{}")
        except ValueError:
            return e.code, {}


def _get(url: str, timeout: float = 30) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, {}
    except (urllib.error.URLError, OSError, ValueError):
        return 0, {}


class HttpServer:
    """A running sglang server with (or without) the toolkv plugin."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")

    def generate(self, ids: list[int], sid: str | None, out_tokens: int) -> Generated:
        return self.generate_stream(ids, sid, out_tokens, None)

    def generate_stream(
        self, ids: list[int], sid: str | None, out_tokens: int, on_tokens: Callable[[int], None] | None
    ) -> Generated:
        """One streamed ``/generate``; ``on_tokens(n)`` is told the output length at every chunk
        (sglang streams the cumulative ``output_ids`` unless ``--incremental-streaming-output``)."""
        body: dict[str, Any] = {
            "input_ids": ids,
            "stream": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": out_tokens, "ignore_eos": True},
        }
        if sid is not None:
            body["session_id"] = sid
        req = urllib.request.Request(
            self.url + "/generate", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        t0 = time.perf_counter()
        ttft = math.nan
        last: dict[str, Any] = {}
        try:
            with urllib.request.urlopen(req, timeout=1800) as r:
                for raw in r:
                    line = raw.strip()
                    if not line.startswith(b"data:") or line == b"data: [DONE]":
                        continue
                    if math.isnan(ttft):
                        ttft = time.perf_counter() - t0
                    last = json.loads(line[5:])
                    if on_tokens is not None:
                        on_tokens(len(last.get("output_ids", [])))
                status = r.status
        except urllib.error.HTTPError as e:
            return Generated(e.code, [], 0, math.nan, time.perf_counter() - t0)
        meta = last.get("meta_info", {})
        return Generated(
            status, list(last.get("output_ids", [])), int(meta.get("cached_tokens") or 0), ttft,
            time.perf_counter() - t0,
        )  # fmt: skip

    def call(self, op: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        return _post(f"{self.url}/session/{op}", body)

    def kv_meta(self, sid: str | None = None) -> tuple[int, dict[str, Any]]:
        q = "" if sid is None else "?" + urllib.parse.urlencode({"session_id": sid})
        return _get(f"{self.url}/session/kv_meta{q}")

    def loads(self) -> dict[str, Any] | None:
        st, body = _get(self.url + "/v1/loads")
        if st != 200:
            return None
        rows = body.get("loads", body) if isinstance(body, dict) else body
        return rows[0] if isinstance(rows, list) and rows else (rows if isinstance(rows, dict) else None)

    def flush(self) -> int:
        return _post(self.url + "/flush_cache", {})[0]

    def health(self) -> int:
        return _get(self.url + "/health")[0]


@dataclass
class RunRecord:
    turns: list[Turn] = field(default_factory=list)
    calls: Counter[str] = field(default_factory=Counter)  # "tool_start 200", "tool_end 503", ...
    decisions: Counter[str] = field(default_factory=Counter)  # tool_start's answer: keep, offload, let_go
    errors: list[str] = field(default_factory=list)
    samples: list[dict[str, Any]] = field(default_factory=list)
    events: list[tuple[float, str, str]] = field(default_factory=list)  # (t, session, what)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add_turn(self, t: Turn) -> None:
        with self.lock:
            self.turns.append(t)

    def count(self, what: str) -> None:
        with self.lock:
            self.calls[what] += 1

    def event(self, t: float, sid: str, what: str) -> None:
        with self.lock:
            self.events.append((round(t, 4), sid, what))

    def error(self, msg: str) -> None:
        with self.lock:
            if len(self.errors) < 200:
                self.errors.append(msg)


def run_session(
    server: AgentServer, sp: SessionPlan, mode: str, w: Workload, rec: RunRecord, clock: Any,
    stop_at: float, scale: float, send_tool: bool = False, policy: str | None = None,
) -> None:  # fmt: skip
    """One agent session; no turn starts after ``stop_at`` (run clock). ``send_tool``: name the
    tool in ``tool_start`` (for the per-call policy; servers before it refuse the field).
    ``policy``: the per-call policy (``offload`` or ``auto``) asked for in every ``tool_start``,
    overriding the server's ``TOOLKV_POLICY`` for that call; None sends no ``policy`` field."""
    ctx = list(sp.first)
    sid = sp.sid if mode != "stock" else None
    epoch: int | None = None
    tracked = False
    for t in range(sp.turns):
        restore_s = math.nan
        if t > 0 and mode == "explicit" and epoch is not None:
            t0 = time.perf_counter()
            st, body = server.call("tool_end", {"session_id": sp.sid, "epoch": epoch})
            restore_s = time.perf_counter() - t0
            rec.count(f"tool_end {st}")
            rec.event(clock(), sp.sid, f"tool_end {st}")
            if st >= 500 and str(st) not in REFUSALS:
                rec.error(f"tool_end {sp.sid}: {st} {body}")
        start = clock()
        g = server.generate(ctx, sid, w.output_tokens)
        rec.add_turn(
            Turn(sp.sid, t, start, len(ctx), g.cached_tokens, len(g.output_ids), g.ttft_s, g.e2e_s, g.status,
                 sp.tools_s[t - 1] if t else 0.0, restore_s)
        )  # fmt: skip
        rec.event(start, sp.sid, f"turn {t} ttft={g.ttft_s:.3f} e2e={g.e2e_s:.3f} cached={g.cached_tokens}")
        if g.status != 200:
            rec.error(f"generate {sp.sid} turn {t}: {g.status}")
            break
        tracked = tracked or sid is not None
        ctx += g.output_ids
        if t == sp.turns - 1:
            break
        epoch = None
        if mode in ("explicit", "on-request"):
            start_body: dict[str, Any] = {"session_id": sp.sid}
            if send_tool:
                start_body["tool"] = w.tools.name_of(sp.tools_s[t])
            if policy is not None:
                start_body["policy"] = policy
            st, body = server.call("tool_start", start_body)
            rec.count(f"tool_start {st}")
            rec.event(
                clock(),
                sp.sid,
                f"tool_start {st}" + (f" {body.get('decision')}" if "decision" in body else ""),
            )
            if isinstance(body.get("decision"), str):
                with rec.lock:
                    rec.decisions[str(body["decision"])] += 1
            epoch = int(body["epoch"]) if st == 200 and "epoch" in body else None
            if st >= 500 and str(st) not in REFUSALS:
                rec.error(f"tool_start {sp.sid}: {st} {body}")
        # a tool still running when the run ends ends the session: nobody waits ten minutes for it
        time.sleep(max(0.0, min(sp.tools_s[t] * scale, stop_at - clock() + 0.01)))
        if clock() > stop_at:
            break
        ctx += sp.results[t]
    if tracked:
        st, _ = server.call("close", {"session_id": sp.sid})
        rec.count(f"close {st}")


def _sample(server: AgentServer, t: float, device_total: int | None) -> dict[str, Any]:
    st, m = server.kv_meta()
    ld = server.loads() or {}
    s: dict[str, Any] = {"t": round(t, 3)}
    if st == 200:
        free = m.get("device_free_tokens")
        total = device_total or ld.get("max_total_num_tokens")
        s["device_used"] = int(total) - int(free) if free is not None and total else None
        s["device_locked"] = m.get("device_locked_tokens")
        s["device_evictable"] = m.get("device_evictable_tokens")
        ht, hf = m.get("host_total_tokens"), m.get("host_free_tokens")
        s["host_used"] = int(ht) - int(hf) if ht is not None and hf is not None else None
        s["protected"] = m.get("protected_tokens", m.get("pinned_tokens"))
        s["states"] = m.get("states")
    if ld:
        s["loads_used"] = ld.get("num_used_tokens")
        s["running"] = ld.get("num_running_reqs")
        s["waiting"] = ld.get("num_waiting_reqs")
        if s.get("device_used") is None and ld.get("num_used_tokens") is not None:
            s["device_used"] = ld.get("num_used_tokens")
    return s


def run_plan(
    server: AgentServer, plan: Plan, mode: str, *, scale: float = 1.0, progress_s: float = 10.0,
    sample_s: float = 1.0, device_total: int | None = None, drain_s: float = 900.0, send_tool: bool = False,
    policy: str | None = None,
) -> tuple[RunRecord, float]:  # fmt: skip
    """Start each planned session at its time (times scaled by ``scale``), sample the pools while
    they run, and wait for the last turn. Returns the record and the wall time."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if policy is not None and policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    rec = RunRecord()
    w = plan.workload
    t0 = time.perf_counter()

    def clock() -> float:
        return time.perf_counter() - t0

    stop_at = w.duration_s * scale
    done = threading.Event()

    def sampler() -> None:
        while not done.is_set():
            try:
                s = _sample(server, clock(), device_total)
                with rec.lock:
                    rec.samples.append(s)
            except Exception as e:  # a sample is an observation: never stop the run for it
                rec.error(f"sample: {type(e).__name__}: {e}")
            done.wait(sample_s)

    def session(sp: SessionPlan) -> None:
        try:
            run_session(server, sp, mode, w, rec, clock, stop_at, scale, send_tool, policy)
        except Exception as e:  # a dead server surfaces here: record it, the others go on
            rec.error(f"session {sp.sid}: {type(e).__name__}: {e}")

    threads: list[threading.Thread] = []
    smp = threading.Thread(target=sampler, daemon=True)
    smp.start()
    next_progress = progress_s
    for sp in sorted(plan.sessions, key=lambda s: s.start_s):
        while clock() < sp.start_s * scale:
            time.sleep(min(0.05, sp.start_s * scale - clock()))
        th = threading.Thread(target=session, args=(sp,), daemon=True)
        th.start()
        threads.append(th)
    while any(th.is_alive() for th in threads):
        time.sleep(min(0.2, progress_s))
        if clock() >= next_progress:
            next_progress += progress_s
            with rec.lock:
                n, e, calls = len(rec.turns), len(rec.errors), dict(rec.calls)
            live = sum(th.is_alive() for th in threads)
            print(  # progress on stderr: stdout is the results' (--json)
                f"[{clock():6.0f}s] {mode}: {live} sessions live, {n} turns, {e} errors, calls {calls}",
                file=sys.stderr,
                flush=True,
            )
        if clock() > stop_at + drain_s:
            rec.error(f"sessions did not finish {drain_s} s after the end of the run")
            break
    done.set()
    smp.join(timeout=5)
    return rec, clock()


def twins(server: AgentServer, k: int, w: Workload, wait_s: float = 60.0) -> list[dict[str, Any]]:
    """K pairs, one request at a time: turn 1, offload, restore, turn 2 of the offloaded session,
    against a twin with the same tokens that is never offloaded. One record per pair."""
    import random

    out = []
    for i in range(k):
        rng = random.Random(10_000 + i)
        tokens = [2000 + rng.randrange(60_000) for _ in range(min(w.first_tokens, 4096))]
        extra = [3000 + rng.randrange(60_000) for _ in range(512)]
        res: dict[str, Any] = {"pair": i}
        for role in ("twin", "offloaded"):
            sid = f"twin{i}-{role}"
            first = [7 + (role == "offloaded"), *tokens]  # distinct first token: no shared prefix
            g1 = server.generate(first, sid, 32)
            if role == "offloaded":
                st_s, body = server.call("tool_start", {"session_id": sid})
                res["tool_start"] = st_s
                deadline = time.time() + wait_s
                m: dict[str, Any] = {}
                while time.time() < deadline:
                    _, m = server.kv_meta(sid)
                    if m.get("state") == Phase.OFFLOADED:
                        break
                    time.sleep(0.05)
                res["device_tokens_offloaded"] = m.get("device_tokens")
                st_e, _ = server.call("tool_end", {"session_id": sid, "epoch": body.get("epoch", 0)})
                res["tool_end"] = st_e
            g2 = server.generate(first + g1.output_ids + extra, sid, 32)
            res[role] = {"turn2": g2.output_ids, "cached": g2.cached_tokens, "status": [g1.status, g2.status]}
            server.call("close", {"session_id": sid})
        res["identical"] = res["twin"]["turn2"] == res["offloaded"]["turn2"] and bool(res["twin"]["turn2"])
        out.append(res)
    return out


def parser() -> argparse.ArgumentParser:
    d = Workload()
    ap = OneLineParser(prog="toolkv bench agent", description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--url", type=http_url, default="http://127.0.0.1:30000")
    ap.add_argument("--mode", choices=MODES, default="explicit")
    ap.add_argument("--config", default=None, help="label of the server configuration (default: the mode)")
    ap.add_argument("--sessions", type=positive_int, default=d.initial_sessions, help="sessions at the start")
    ap.add_argument("--arrival-rate", type=nonneg_float, default=None, help="sessions/s after the ramp")
    ap.add_argument("--turns", type=positive_int, default=d.turns_median, help="median turns per session")
    ap.add_argument("--first-tokens", type=positive_int, default=d.first_tokens)
    ap.add_argument("--growth", type=positive_int, default=d.growth_per_turn, help="tokens added per turn")
    ap.add_argument("--output", type=positive_int, default=d.output_tokens, help="answer tokens per turn")
    ap.add_argument("--max-context", type=positive_int, default=d.max_context)
    ap.add_argument("--tool-shape", choices=sorted(SHAPES), default=d.tool_shape)
    ap.add_argument(
        "--duration", type=positive_float, default=d.duration_s, help="seconds of arrivals and turns"
    )
    ap.add_argument(
        "--warmup", type=nonneg_float, default=10.0, help="seconds after the ramp left out of the window"
    )
    ap.add_argument("--twins", type=nonneg_int, default=0, help="token-identity pairs to run after the load")
    ap.add_argument("--probe", action="store_true", help="resume vs prefill and decode under restore")
    ap.add_argument("--flush", action="store_true", help="POST /flush_cache before the load")
    ap.add_argument(
        "--drain", type=nonneg_float, default=300.0, help="seconds to wait for turns still running at the end"
    )
    ap.add_argument("--seed", type=seed, default=d.seed)
    ap.add_argument(
        "--send-tool", action="store_true", help="name each tool in tool_start (for TOOLKV_POLICY=auto)"
    )
    ap.add_argument(
        "--policy", choices=POLICIES, default=None,
        help="send this per-call policy in every tool_start body, overriding the server's TOOLKV_POLICY "
        "for the call (default: send none, the server's policy decides)",
    )  # fmt: skip
    ap.add_argument("--out", default=None, help="JSON results file (this, --json, or both)")
    ap.add_argument(
        "--json", action="store_true", help="print the JSON results on stdout instead of the summary lines"
    )
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    a = ap.parse_args(argv)
    if a.out is None and not a.json:  # a run of minutes whose results went nowhere
        ap.error("give --out FILE for the JSON results, or --json to print them")
    if a.policy is not None and a.mode == "stock":
        ap.error("--policy needs a mode that calls tool_start (explicit or on-request)")
    try:
        w = Workload(
            initial_sessions=a.sessions, arrival_rate=a.arrival_rate, turns_median=a.turns,
            first_tokens=a.first_tokens, growth_per_turn=a.growth, output_tokens=a.output,
            max_context=a.max_context, tool_shape=a.tool_shape, duration_s=a.duration, seed=a.seed,
        )  # fmt: skip
    except ValueError as e:
        ap.error(str(e))
    server = HttpServer(a.url)
    health = server.health()
    if health != 200:
        said = "no answer" if health == 0 else f"HTTP {health}"
        print(f"{ap.prog}: error: no healthy server at {a.url} (GET /health: {said})", file=sys.stderr)
        return 2
    if a.flush:
        print(f"flush_cache: {server.flush()}", file=sys.stderr, flush=True)
        time.sleep(2)
    ld = server.loads() or {}
    device_total = ld.get("max_total_num_tokens")
    plan = make_plan(w)
    _st0, meta0 = server.kv_meta()
    rec, wall = run_plan(
        server, plan, a.mode, device_total=device_total, drain_s=a.drain, send_tool=a.send_tool,
        policy=a.policy,
    )  # fmt: skip
    window = (w.ramp_s + a.warmup, w.duration_s)
    summary = summarize(rec.turns, rec.calls, window_start_s=window[0], window_end_s=window[1], wall_s=wall)
    summary["errors"] = len(rec.errors)
    summary["decisions"] = dict(rec.decisions)
    deadline = time.time() + 120  # let abandoned requests finish before anything else runs
    while time.time() < deadline and (ld := server.loads() or {}).get("num_running_reqs", 0) + ld.get(
        "num_waiting_reqs", 0
    ):
        time.sleep(1)
    time.sleep(3)  # a few idle scheduler iterations: acks land, sglang's idle memory check runs
    _st1, meta1 = server.kv_meta()
    probe: dict[str, Any] = {}
    if a.probe:
        from toolkv.tools.agent_probe import run_probe

        probe = run_probe(server)
    pairs = twins(server, a.twins, w) if a.twins else []
    time.sleep(2)
    st2, meta2 = server.kv_meta()
    # eviction harm over this run: tokens recomputed whose KV the cache held earlier, by requester
    summary["recomputed_after_evict_tokens"] = recomputed_between(meta0, meta2) if st2 == 200 else None
    checks = {
        "server healthy": server.health() == 200,
        "no 5xx other than the documented refusals": summary["http_5xx"] == 0,
        "every generate answered": summary["turns"] == summary["turns_ok"],
        "nothing protected at the end": st2 != 200 or int(meta2.get("protected_tokens") or 0) == 0,
        "no device tokens locked at the end": st2 != 200 or int(meta2.get("device_locked_tokens") or 0) == 0,
        "twins token-identical": all(p["identical"] for p in pairs),
    }
    res = {
        "config": a.config or a.mode,
        "mode": a.mode,
        "policy": a.policy,
        "send_tool": a.send_tool,
        "workload": asdict(w),
        "plan": plan.describe(),
        "device_total_tokens": device_total,
        "summary": summary,
        "occupancy": occupancy(rec.samples, device_total),
        "checks": checks,
        "passed": all(checks.values()),
        "server_meta": {"before": meta0, "after_load": meta1, "end": meta2},
        "probe": probe,
        "twins": pairs,
        "errors": rec.errors,
        "samples": rec.samples,
        "events": rec.events,
        "turns": [asdict(t) | {"output_ids": None} for t in rec.turns],
    }
    if a.out is not None:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(res, indent=1, default=str))
    if a.json:
        print(json.dumps(res, indent=1, default=str))
        return 0 if res["passed"] else 1
    keys = ("turns_in_window", "turns_per_s", "gen_tokens_per_s", "resumed_cache_hit", "resumed_ttft_p50_s",
            "resumed_ttft_p90_s", "http_5xx", "errors")  # fmt: skip
    print(
        f"config={res['config']} mode={a.mode} "
        + (f"policy={a.policy} " if a.policy else "")
        + " ".join(
            f"{k}={summary[k]:.3g}" if isinstance(summary[k], float) else f"{k}={summary[k]}" for k in keys
        )
    )
    for k, v in checks.items():
        print(("PASS " if v else "FAIL ") + k)
    print("calls", summary["calls"])
    harm = summary["recomputed_after_evict_tokens"]
    if harm is not None:
        print(f"recomputed_after_evict_tokens session={harm['session']} other={harm['other']}")
    return 0 if res["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
