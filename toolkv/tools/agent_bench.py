"""Agent-trace load generator for a running sglang server (``toolkv bench agent``).

Many concurrent agent sessions, each a sequence of turns: send the prompt (the previous context plus
the new tool result), generate a short answer, "run a tool" for a sampled duration, repeat. Token ids
go straight to ``/generate`` (dummy weights, ``--skip-tokenizer-init``), so no tokenizer is needed.

Modes (what the agent does around each tool call):

- ``stock``    nothing: plain HiCache decides what stays (the baseline).
- ``explicit`` ``tool_start`` after the turn, ``tool_end`` with its epoch when the tool returns.
- ``on-request`` ``tool_start`` after the turn, no ``tool_end``: the server restores the session when
  its next request arrives (``TOOLKV_RESTORE_ON_REQUEST``, the restore half of zero-change mode).

It measures per resumed turn the time to first token (streaming) and the prompt tokens served from
cache, counts every toolkv answer by status, and at the end checks that nothing is left protected or
locked. ``--twins K`` then runs K sessions one request at a time against never-offloaded twins
(temperature 0) and compares the resumed turn token for token.

Standard library only: it runs on a GPU machine next to the server with nothing installed.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

MODES = ("stock", "explicit", "on-request")
# Documented refusals that change nothing: 503 device memory (retry later), 507 host pool full,
# 409 kv lost / wrong state. Anything else >= 500 is a server fault.
REFUSALS = ("409", "503", "507")


def unexpected_5xx(calls: Counter[str] | dict[str, int]) -> int:
    """toolkv answers with a status of 500 or more that is not a documented refusal."""
    return sum(v for k, v in calls.items() if k.split()[1] >= "500" and k.split()[1] not in REFUSALS)


@dataclass(frozen=True)
class Workload:
    sessions: int = 48  # concurrent sessions
    turns: int = 6  # turns per session; a finished session is replaced by a new one
    first_min: int = 2000
    first_max: int = 4000
    append_min: int = 300
    append_max: int = 1500
    output: int = 32
    tool_median_s: float = 1.5  # log-normal tool duration
    tool_sigma: float = 1.0
    duration_s: float = 300.0  # keep starting sessions until this much time has passed
    seed: int = 0


@dataclass
class Turn:
    session: str
    turn: int
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float
    e2e_s: float
    status: int
    output_ids: list[int] = field(default_factory=list)


@dataclass
class Stats:
    turns: list[Turn] = field(default_factory=list)
    calls: Counter[str] = field(default_factory=Counter)  # "tool_start 200", "tool_end 503", ...
    errors: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add_turn(self, t: Turn) -> None:
        with self.lock:
            self.turns.append(t)

    def count(self, what: str) -> None:
        with self.lock:
            self.calls[what] += 1

    def error(self, msg: str) -> None:
        with self.lock:
            if len(self.errors) < 200:
                self.errors.append(msg)


def _post(url: str, body: dict[str, Any], timeout: float = 600) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        try:
            return e.code, json.loads(e.read() or b"{}")
        except ValueError:
            return e.code, {}


def _get(url: str, timeout: float = 30) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, {}


def generate(url: str, ids: list[int], sid: str, out_tokens: int) -> tuple[int, list[int], int, float, float]:
    """One streamed ``/generate``: (status, output ids, cached tokens, TTFT s, end-to-end s)."""
    body = {
        "input_ids": ids,
        "session_id": sid,
        "stream": True,
        "sampling_params": {"temperature": 0, "max_new_tokens": out_tokens, "ignore_eos": True},
    }
    req = urllib.request.Request(
        url + "/generate", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    t0 = time.perf_counter()
    ttft = math.nan
    last: dict[str, Any] = {}
    try:
        with urllib.request.urlopen(req, timeout=900) as r:
            for raw in r:
                line = raw.strip()
                if not line.startswith(b"data:") or line == b"data: [DONE]":
                    continue
                if math.isnan(ttft):
                    ttft = time.perf_counter() - t0
                last = json.loads(line[5:])
            status = r.status
    except urllib.error.HTTPError as e:
        return e.code, [], 0, math.nan, time.perf_counter() - t0
    meta = last.get("meta_info", {})
    return (
        status,
        list(last.get("output_ids", [])),
        int(meta.get("cached_tokens") or 0),
        ttft,
        time.perf_counter() - t0,
    )


class Session:
    """One agent: a private token range (no prefix shared with other sessions), its turns."""

    def __init__(self, sid: str, index: int, w: Workload, rng: random.Random) -> None:
        self.sid, self.w, self.rng = sid, w, rng
        self.base = 1000 + (index * 7919) % 50_000
        self.ctx: list[int] = self._tokens(rng.randint(w.first_min, w.first_max))
        self.epoch: int | None = None

    def _tokens(self, n: int) -> list[int]:
        r = self.rng
        return [self.base + r.randrange(60_000) for _ in range(n)]

    def tool_seconds(self) -> float:
        return float(self.rng.lognormvariate(math.log(self.w.tool_median_s), self.w.tool_sigma))

    def append_tool_result(self) -> None:
        self.ctx += self._tokens(self.rng.randint(self.w.append_min, self.w.append_max))


def run_session(url: str, s: Session, mode: str, stats: Stats, stop_at: float) -> None:
    w = s.w
    for t in range(w.turns):
        if t > 0 and mode == "explicit" and s.epoch is not None:
            st, body = _post(url + "/session/tool_end", {"session_id": s.sid, "epoch": s.epoch})
            stats.count(f"tool_end {st}")
            if st >= 500 and st != 503:
                stats.error(f"tool_end {s.sid}: {st} {body}")
        status, out, cached, ttft, e2e = generate(url, s.ctx, s.sid, w.output)
        stats.add_turn(Turn(s.sid, t, len(s.ctx), cached, ttft, e2e, status))
        if status != 200:
            stats.error(f"generate {s.sid} turn {t}: {status}")
            return
        s.ctx += out
        if t == w.turns - 1 or time.time() > stop_at:
            break
        if mode in ("explicit", "on-request"):
            st, body = _post(url + "/session/tool_start", {"session_id": s.sid})
            stats.count(f"tool_start {st}")
            s.epoch = int(body["epoch"]) if st == 200 and "epoch" in body else None
            if st >= 500 and st not in (503, 507):
                stats.error(f"tool_start {s.sid}: {st} {body}")
        time.sleep(s.tool_seconds())
        s.append_tool_result()
    if mode != "stock":
        st, _ = _post(url + "/session/close", {"session_id": s.sid})
        stats.count(f"close {st}")


def run_load(url: str, mode: str, w: Workload, progress_s: float = 10.0) -> tuple[Stats, float]:
    """``w.sessions`` worker threads, each running sessions back to back until the duration ends."""
    stats = Stats()
    t0 = time.time()
    stop_at = t0 + w.duration_s
    counter = iter(range(10**9))
    lock = threading.Lock()

    def worker(k: int) -> None:
        rng = random.Random(w.seed * 1_000_003 + k)
        while time.time() < stop_at:
            with lock:
                i = next(counter)
            try:
                run_session(url, Session(f"{mode}-{i}", i, w, rng), mode, stats, stop_at)
            except Exception as e:  # a dead server surfaces here: record and stop this worker
                stats.error(f"session {mode}-{i}: {type(e).__name__}: {e}")
                return

    threads = [threading.Thread(target=worker, args=(k,), daemon=True) for k in range(w.sessions)]
    for th in threads:
        th.start()
    while any(th.is_alive() for th in threads):
        time.sleep(progress_s)
        with stats.lock:
            n, e = len(stats.turns), len(stats.errors)
            calls = dict(stats.calls)
        print(f"[{time.time() - t0:6.0f}s] {mode}: {n} turns, {e} errors, calls {calls}", flush=True)
        if time.time() > stop_at + 900:
            stats.error("workers did not finish 900 s after the end of the run")
            break
    return stats, time.time() - t0


def pct(xs: list[float], p: float) -> float:
    xs = sorted(x for x in xs if not math.isnan(x))
    if not xs:
        return math.nan
    return xs[min(len(xs) - 1, round(p / 100 * (len(xs) - 1)))]


def summarize(stats: Stats, wall_s: float) -> dict[str, Any]:
    resumed = [t for t in stats.turns if t.turn > 0 and t.status == 200]
    ok = [t for t in stats.turns if t.status == 200]
    prompt = sum(t.prompt_tokens for t in resumed)
    cached = sum(min(t.cached_tokens, t.prompt_tokens) for t in resumed)
    ttft = [t.ttft_s for t in resumed]
    return {
        "turns": len(stats.turns),
        "turns_ok": len(ok),
        "turns_per_s": len(ok) / wall_s if wall_s else 0.0,
        "resumed_turns": len(resumed),
        "resumed_cache_hit": cached / prompt if prompt else 0.0,
        "resumed_zero_cached": sum(1 for t in resumed if t.cached_tokens == 0),
        "resumed_ttft_p50_s": pct(ttft, 50),
        "resumed_ttft_p90_s": pct(ttft, 90),
        "resumed_ttft_p99_s": pct(ttft, 99),
        "first_ttft_p50_s": pct([t.ttft_s for t in ok if t.turn == 0], 50),
        "calls": dict(stats.calls),
        "http_5xx": unexpected_5xx(stats.calls) + sum(1 for t in stats.turns if t.status >= 500),
        "refusals": {k: v for k, v in stats.calls.items() if k.split()[1] in REFUSALS},
        "errors": len(stats.errors),
        "wall_s": wall_s,
    }


def twins(url: str, k: int, w: Workload) -> list[dict[str, Any]]:
    """K sessions, one request at a time: turn 1, offload, restore, turn 2, against a twin with the
    same tokens that is never offloaded. Returns one record per pair."""
    out = []
    for i in range(k):
        rng = random.Random(10_000 + i)
        tokens = [2000 + rng.randrange(60_000) for _ in range(w.first_max)]
        extra = [3000 + rng.randrange(60_000) for _ in range(w.append_max)]
        res: dict[str, Any] = {"pair": i}
        for role in ("twin", "offloaded"):
            sid = f"twin{i}-{role}"
            # distinct first token: the two never share a radix prefix
            first = [7 + (role == "offloaded"), *tokens]
            st, o1, _, _, _ = generate(url, first, sid, w.output)
            if role == "offloaded":
                st_s, body = _post(url + "/session/tool_start", {"session_id": sid})
                res["tool_start"] = st_s
                deadline = time.time() + 60
                while time.time() < deadline:
                    _, m = _get(url + f"/session/kv_meta?session_id={sid}")
                    if m.get("state") == "Offloaded":
                        break
                    time.sleep(0.05)
                res["device_tokens_offloaded"] = m.get("device_tokens")
                st_e, _ = _post(url + "/session/tool_end", {"session_id": sid, "epoch": body.get("epoch", 0)})
                res["tool_end"] = st_e
            st2, o2, cached, _, _ = generate(url, first + o1 + extra, sid, w.output)
            res[role] = {"turn2": o2, "cached": cached, "status": [st, st2]}
            _post(url + "/session/close", {"session_id": sid})
        res["identical"] = res["twin"]["turn2"] == res["offloaded"]["turn2"] and bool(res["twin"]["turn2"])
        out.append(res)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="toolkv bench agent", description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:30000")
    ap.add_argument("--mode", choices=MODES, default="explicit")
    ap.add_argument("--sessions", type=int, default=Workload.sessions)
    ap.add_argument("--turns", type=int, default=Workload.turns)
    ap.add_argument("--duration", type=float, default=Workload.duration_s, help="seconds of load")
    ap.add_argument("--tool-median", type=float, default=Workload.tool_median_s)
    ap.add_argument("--tool-sigma", type=float, default=Workload.tool_sigma)
    ap.add_argument("--twins", type=int, default=0, help="token-identity pairs to run after the load")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True, help="JSON results file")
    a = ap.parse_args(argv)
    if a.sessions < 1 or a.turns < 1 or a.duration <= 0:
        ap.error("--sessions, --turns and --duration must be positive")
    w = Workload(
        sessions=a.sessions, turns=a.turns, duration_s=a.duration, tool_median_s=a.tool_median,
        tool_sigma=a.tool_sigma, seed=a.seed,
    )  # fmt: skip
    _st0, meta0 = _get(a.url + "/session/kv_meta")
    stats, wall = run_load(a.url, a.mode, w)
    summary = summarize(stats, wall)
    time.sleep(3)  # a few idle scheduler iterations: acks land, sglang's idle memory check runs
    _st1, meta1 = _get(a.url + "/session/kv_meta")
    pairs = twins(a.url, a.twins, w) if a.twins else []
    time.sleep(2)
    st2, meta2 = _get(a.url + "/session/kv_meta")
    health, _ = _get(a.url + "/health")
    checks = {
        "server healthy": health == 200,
        "no 5xx other than the documented refusals (503, 507)": summary["http_5xx"] == 0,
        "every generate answered": summary["turns"] == summary["turns_ok"],
        "nothing protected at the end": st2 != 200 or int(meta2.get("protected_tokens") or 0) == 0,
        "no device tokens locked at the end": st2 != 200 or int(meta2.get("device_locked_tokens") or 0) == 0,
        "twins token-identical": all(p["identical"] for p in pairs),
    }
    res = {
        "workload": asdict(w),
        "mode": a.mode,
        "summary": summary,
        "checks": checks,
        "passed": all(checks.values()),
        "server_meta": {"before": meta0, "after_load": meta1, "end": meta2},
        "twins": pairs,
        "errors": stats.errors,
        "turns": [asdict(t) | {"output_ids": None} for t in stats.turns],
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1, default=str))
    keys = ("turns_ok", "turns_per_s", "resumed_cache_hit", "resumed_ttft_p50_s", "resumed_ttft_p90_s",
            "resumed_zero_cached", "http_5xx", "errors")  # fmt: skip
    print(
        f"mode={a.mode} "
        + " ".join(
            f"{k}={summary[k]:.3g}" if isinstance(summary[k], float) else f"{k}={summary[k]}" for k in keys
        )
    )
    for k, v in checks.items():
        print(("PASS " if v else "FAIL ") + k)
    print("calls", summary["calls"])
    return 0 if res["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
