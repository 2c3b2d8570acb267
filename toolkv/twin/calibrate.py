"""Measure the twin's time profile on a live sglang server and fit it (``scripts/gpu_calibrate.sh``).

Three measurements, each one kind of forward at a time on an otherwise idle server:

1. **prefill vs new tokens and cached context**: warm a prefix of ``p`` tokens (one request,
   then ``cached_tokens`` confirms it is cached), then send ``p + n`` tokens with one output token;
   the time to the first streamed token is one prefill of ``n`` tokens over ``p`` cached ones;
2. **decode step vs batch and context**: ``B`` streams of context ``L`` (prefixes warmed first)
   decode together; the gaps between streamed tokens, once all ``B`` are decoding, are steps of
   a batch of ``B`` over ``B * L`` context tokens;
3. **copies**: toolkv's ``tool_start``/``tool_end`` on a session of ``t`` tokens, timed from the
   call to ``Offloaded`` / ``Runnable`` in ``kv_meta`` (device->host and host->device, HiCache's
   own kernels): a fixed cost per copy and a rate from two sizes.

Then least squares (:mod:`toolkv.twin.fit`) gives the profile; the raw points, the fit and its
worst relative error are written next to it. Standard library only: it runs next to the server.
``--dry-run`` replaces the server with the default profile plus noise, so the whole path (grid,
fit, files) is exercised on CPU.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from toolkv.core.phases import Phase
from toolkv.twin.fit import copy_terms, decode_terms, fit, prefill_terms, residual
from toolkv.twin.profile import TimeProfile, default_profile

PREFILL_GRID = [(p, n) for p in (0, 8192, 24576, 49152) for n in (256, 1024, 4096, 8192)]
DECODE_GRID = [(1, 1024), (1, 16384), (4, 1024), (4, 16384), (8, 1024), (8, 8192), (16, 1024), (16, 4096)]
COPY_SIZES = (1024, 8192, 32768)
KV_BYTES = 131_072  # Llama-3.1-8B: 32 layers x 8 KV heads x 128 x 2 (K, V) x 2 bytes


class LiveServer:
    """The few HTTP calls the calibration needs (``/generate`` streamed, toolkv's session API)."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")
        self._rng = random.Random(7)

    def tokens(self, n: int, first: int) -> list[int]:
        return [first, *(self._rng.randrange(1000, 120_000) for _ in range(n - 1))]

    def stream(self, ids: list[int], out: int, sid: str | None = None) -> tuple[list[float], int]:
        """Arrival times of every streamed chunk (from the send) and the reported cached tokens."""
        body: dict[str, Any] = {"input_ids": ids, "stream": True,
                                "sampling_params": {"temperature": 0, "max_new_tokens": out, "ignore_eos": True}}  # fmt: skip
        if sid:
            body["session_id"] = sid
        req = urllib.request.Request(
            self.url + "/generate", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        t0 = time.perf_counter()
        times: list[float] = []
        cached = 0
        with urllib.request.urlopen(req, timeout=600) as r:
            for raw in r:
                line = raw.strip()
                if not line.startswith(b"data:") or line == b"data: [DONE]":
                    continue
                times.append(time.perf_counter() - t0)
                cached = int(json.loads(line[5:]).get("meta_info", {}).get("cached_tokens") or 0)
        return times, cached

    def call(self, op: str, body: dict[str, Any]) -> dict[str, Any]:
        req = urllib.request.Request(
            f"{self.url}/session/{op}", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return dict(json.loads(r.read() or b"{}"))
        except urllib.error.HTTPError as e:
            return {"status": e.code}

    def state(self, sid: str) -> str | None:
        with urllib.request.urlopen(f"{self.url}/session/kv_meta?session_id={sid}", timeout=30) as r:
            st = json.loads(r.read() or b"{}").get("state")
            return st if isinstance(st, str) else None

    def flush(self) -> None:
        """Empty the cache between points. sglang refuses (400) while the scheduler is not fully
        idle, e.g. while HiCache's write-through of the last request is in flight: retry a while."""
        for attempt in range(100):
            try:
                urllib.request.urlopen(
                    urllib.request.Request(
                        self.url + "/flush_cache", b"{}", {"Content-Type": "application/json"}
                    ),
                    timeout=60,
                ).read()
                break
            except urllib.error.HTTPError as e:
                if e.code != 400 or attempt == 99:
                    raise
                time.sleep(0.2)
        time.sleep(1.0)


def measure_prefill(s: LiveServer, grid: list[tuple[int, int]], reps: int) -> list[list[float]]:
    pts = []
    for i, (p, n) in enumerate(grid):
        for rep in range(reps):
            s.flush()
            prefix = s.tokens(p, 10 + 2 * i + 1000 * rep) if p else []
            if p:
                s.stream(prefix, 1)
            times, cached = s.stream(prefix + s.tokens(n, 50_000 + i + 1000 * rep), 1)
            if p and cached < p * 0.99:
                print(f"prefill p={p} n={n}: only {cached} cached, point dropped", file=sys.stderr)
                continue
            pts.append([float(cached), float(n + p - cached), times[0]])
    return pts


def _together(s: LiveServer, prompts: list[list[int]], steps: int) -> list[list[float]]:
    """Stream every prompt at once; each stream's chunk arrival times."""
    results: list[list[float]] = [[] for _ in prompts]

    def run(k: int) -> None:
        results[k] = s.stream(prompts[k], steps)[0]

    ths = [threading.Thread(target=run, args=(k,)) for k in range(len(prompts))]
    for th in ths:
        th.start()
    for th in ths:
        th.join()
    return results


def measure_decode(s: LiveServer, grid: list[tuple[int, int]], steps: int) -> list[list[float]]:
    pts = []
    for j, (b, ctx) in enumerate(grid):
        s.flush()
        prompts = [s.tokens(ctx, 70_000 + 100 * j + k) for k in range(b)]
        for ids in prompts:  # warm: the decode streams below then start together, prefill-free
            s.stream(ids, 1)
        results = _together(s, prompts, steps)
        # every stream's gaps after the last stream's first token: all b decode then
        start = max(r[0] for r in results if r)
        gaps = [b2 - a2 for r in results for a2, b2 in itertools.pairwise(r) if a2 >= start]
        if gaps:
            pts.append([float(b), float(b * ctx + b * steps // 2), statistics.median(gaps)])
    return pts


def measure_copies(s: LiveServer, sizes: tuple[int, ...], reps: int) -> dict[str, list[list[float]]]:
    out: dict[str, list[list[float]]] = {"d2h": [], "h2d": []}
    for i, t in enumerate(sizes):
        for rep in range(reps):
            s.flush()
            sid = f"cal{i}-{rep}"
            s.stream(s.tokens(t, 90_000 + 10 * i + rep), 1, sid)
            t0 = time.perf_counter()
            r = s.call("tool_start", {"session_id": sid})
            while s.state(sid) not in (Phase.OFFLOADED, None) and time.perf_counter() - t0 < 30:
                time.sleep(0.002)
            out["d2h"].append([float(t), time.perf_counter() - t0])
            t0 = time.perf_counter()
            s.call("tool_end", {"session_id": sid, "epoch": r.get("epoch", 0)})
            while (
                s.state(sid) not in (Phase.RUNNABLE, Phase.HANDOVER, None) and time.perf_counter() - t0 < 30
            ):
                time.sleep(0.002)
            out["h2d"].append([float(t), time.perf_counter() - t0])
            s.call("close", {"session_id": sid})
    return out


def synthetic(p: TimeProfile, noise: float, seed: int = 0) -> dict[str, Any]:
    """What a server with profile ``p`` would measure, with relative noise (``--dry-run``)."""
    rng = random.Random(seed)

    def jitter(x: float) -> float:
        return x * rng.uniform(1 - noise, 1 + noise)

    return {
        "prefill": [[float(a), float(n), jitter(p.prefill_s([(a, n)]))] for a, n in PREFILL_GRID],
        "decode": [[float(b), float(b * c), jitter(p.decode_s(b, b * c))] for b, c in DECODE_GRID],
        "copies": {d: [[float(t), jitter(p.copy_s(t, d))] for t in COPY_SIZES] for d in ("d2h", "h2d")},
    }


def profile_from(points: dict[str, Any], kv_bytes: int, source: str) -> tuple[TimeProfile, dict[str, Any]]:
    pa = fit(points["prefill"], prefill_terms)
    dd = fit(points["decode"], decode_terms)
    rates, fixed, err = {}, [], {}
    for d in ("d2h", "h2d"):
        c0, c1 = fit(points["copies"][d], copy_terms) if len(points["copies"][d]) >= 3 else (0.0, 0.0)
        rates[d] = kv_bytes / c1 / 1e9 if c1 > 0 else 0.0
        fixed.append(c0)
        err[d] = residual(points["copies"][d], copy_terms, [c0, c1])
    prof = TimeProfile(
        prefill_a=pa[0], prefill_b=pa[1], prefill_c=pa[2], decode_d=dd[0], decode_e=dd[1], decode_f=dd[2],
        h2d_gbps=rates["h2d"] or default_profile().h2d_gbps, d2h_gbps=rates["d2h"] or default_profile().d2h_gbps,
        kv_bytes_per_token=kv_bytes, copy_fixed_s=statistics.mean(fixed), source=source,
    )  # fmt: skip
    quality = {
        "prefill_worst_relative_error": residual(points["prefill"], prefill_terms, pa),
        "decode_worst_relative_error": residual(points["decode"], decode_terms, dd),
        "copy_worst_relative_error": err,
    }
    return prof, quality


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m toolkv.twin.calibrate", description=(__doc__ or "").split("\n\n")[0]
    )
    ap.add_argument("--url", default="http://127.0.0.1:30000")
    ap.add_argument("--out", required=True, help="folder for profile.json and points.json")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--decode-steps", type=int, default=48)
    ap.add_argument(
        "--budget-s", type=float, default=330.0, help="stop measuring after this (the device call is short)"
    )
    ap.add_argument("--dry-run", action="store_true", help="no server: the default profile plus 3 %% noise")
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    if a.dry_run:
        points = synthetic(default_profile(), 0.03)
        source = "dry run: synthetic points from the default profile"
    else:
        s = LiveServer(a.url)
        steps: list[tuple[str, Callable[[], Any]]] = [
            ("prefill", lambda: measure_prefill(s, PREFILL_GRID, a.reps)),
            ("decode", lambda: measure_decode(s, DECODE_GRID, a.decode_steps)),
            ("copies", lambda: measure_copies(s, COPY_SIZES, a.reps)),
        ]
        points = {}
        for name, step in steps:
            if time.time() - t0 > a.budget_s:
                print(f"budget spent: {name} not measured", file=sys.stderr)
                points[name] = [] if name != "copies" else {"d2h": [], "h2d": []}
                continue
            points[name] = step()
            print(f"{name}: done after {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
        source = f"calibrated on {a.url} at {time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC"
    (out / "points.json").write_text(json.dumps(points, indent=1))
    prof, quality = profile_from(points, KV_BYTES, source)
    (out / "profile.json").write_text(json.dumps({"profile": prof.to_json(), "fit": quality}, indent=1))
    print(json.dumps({"profile": prof.to_json(), "fit": quality}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
