"""Two measurements the agent load cannot isolate, run on an idle server after it (``--probe``).

1. **Resume against recompute.** For each size, one cold prefill of fresh tokens (the time to the
   first token of a one-token answer: the prefill), then ``tool_start``, wait until the session is
   Offloaded, and time ``tool_end`` until ``kv_meta`` reports it Runnable (the KV is on the GPU):
   the resume. Same tokens, same server, same minute; the ratio is what a restore saves.
2. **Decode while a restore is in flight.** A few streams decode; their token rate is counted in a
   window with no restore and in a window during which 1 GiB-class restores run back to back.

Standard library only (it runs on the GPU machine next to the server).
"""

from __future__ import annotations

import math
import random
import statistics
import threading
import time
from typing import Any

from toolkv.core.phases import Phase

POLL_S = 0.002


def _wait_state(server: Any, sid: str, want: str, timeout_s: float = 60.0) -> float:
    """Seconds until ``kv_meta`` reports ``want`` (NaN on timeout)."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout_s:
        st, m = server.kv_meta(sid)
        if st == 200 and m.get("state") == want:
            return time.perf_counter() - t0
        time.sleep(POLL_S)
    return float("nan")


def resume_vs_prefill(server: Any, n: int, rep: int, rng: random.Random) -> dict[str, Any]:
    sid = f"probe-{n}-{rep}"
    ids = [5, *(rng.randrange(1000, 120_000) for _ in range(n - 1))]
    g = server.generate(ids, sid, 1)
    st, body = server.call("tool_start", {"session_id": sid})
    off_s = _wait_state(server, sid, Phase.OFFLOADED) if st == 200 else float("nan")
    _, m = server.kv_meta(sid)
    t0 = time.perf_counter()
    st_e, _ = server.call("tool_end", {"session_id": sid, "epoch": body.get("epoch", 0)})
    call_s = time.perf_counter() - t0
    ready = _wait_state(server, sid, Phase.RUNNABLE) if st_e == 200 else float("nan")
    resume_s = call_s + ready  # NaN when it never became Runnable
    g2 = server.generate([*ids, *g.output_ids], sid, 1)
    server.call("close", {"session_id": sid})
    return {
        "tokens": n,
        "prefill_s": g.ttft_s,
        "offload_s": off_s,
        "device_tokens_when_offloaded": m.get("device_tokens"),
        "tool_end_status": st_e,
        "resume_s": resume_s,
        "ttft_after_resume_s": g2.ttft_s,
        "cached_after_resume": g2.cached_tokens,
    }


def decode_under_restore(
    server: Any, rng: random.Random, streams: int = 4, n_restore: int = 8192
) -> dict[str, Any]:
    """Token arrivals of ``streams`` decoding requests, counted with and without restores in flight."""
    arrivals: list[float] = []
    lock = threading.Lock()
    t0 = time.perf_counter()

    def stream(i: int) -> None:
        ids = [9, i, *(rng.randrange(1000, 120_000) for _ in range(510))]
        seen = 0

        def on_tokens(k: int) -> None:
            nonlocal seen
            now = time.perf_counter() - t0
            with lock:
                arrivals.extend([now] * (k - seen))
            seen = k

        server.generate_stream(ids, None, 1200, on_tokens)

    big = f"probe-restore-{n_restore}"
    big_ids = [11, *(rng.randrange(1000, 120_000) for _ in range(n_restore - 1))]
    server.generate(big_ids, big, 1)
    ths = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(streams)]
    for th in ths:
        th.start()
    time.sleep(1.0)  # all streams decoding
    quiet = (time.perf_counter() - t0, time.perf_counter() - t0 + 2.0)
    time.sleep(2.0)
    busy_start = time.perf_counter() - t0
    restores, in_flight = 0, 0.0
    while time.perf_counter() - t0 < busy_start + 3.0:
        st, body = server.call("tool_start", {"session_id": big})
        if st != 200 or math.isnan(_wait_state(server, big, Phase.OFFLOADED)):
            break
        a = time.perf_counter()
        st_e, _ = server.call("tool_end", {"session_id": big, "epoch": body.get("epoch", 0)})
        if st_e != 200 or math.isnan(_wait_state(server, big, Phase.RUNNABLE)):
            break
        in_flight += time.perf_counter() - a
        restores += 1
        server.generate(big_ids, big, 1)  # a turn (all cached): Runnable -> Running, offloadable again
    busy = (busy_start, time.perf_counter() - t0)
    for th in ths:
        th.join(timeout=120)
    server.call("close", {"session_id": big})

    def rate(win: tuple[float, float]) -> float:
        return sum(1 for x in arrivals if win[0] <= x < win[1]) / (win[1] - win[0])

    return {
        "streams": streams,
        "restore_tokens": n_restore,
        "restores": restores,
        "restore_in_flight_share": in_flight / (busy[1] - busy[0]),
        "decode_tokens_per_s_quiet": rate(quiet),
        "decode_tokens_per_s_restoring": rate(busy),
    }


def run_probe(server: Any, sizes: tuple[int, ...] = (1024, 8192), reps: int = 3) -> dict[str, Any]:
    rng = random.Random(4242)
    rows = [resume_vs_prefill(server, n, r, rng) for n in sizes for r in range(reps)]
    by: dict[str, Any] = {}
    for n in sizes:
        rs = [r for r in rows if r["tokens"] == n and r["resume_s"] == r["resume_s"]]
        if rs:
            p = statistics.median(r["prefill_s"] for r in rs)
            q = statistics.median(r["resume_s"] for r in rs)
            by[str(n)] = {"prefill_s": p, "resume_s": q, "recompute_over_resume": p / q if q else None}
    out: dict[str, Any] = {"resume_vs_prefill": rows, "median_by_size": by}
    if hasattr(server, "generate_stream"):
        out["decode_under_restore"] = decode_under_restore(server, rng)
    return out
