"""toolkv end-to-end checks against a live sglang server (run by scripts/gpu_e2e.sh on the GPU box).

Per session: turn 1 -> tool_start -> wait Offloaded (the GPU copy freed; with lazy free, the server's
default where the backend can, left on the GPU unlocked and evictable for sglang's own eviction) -> tool_end -> wait until
the load is done (Handover: the restored KV stays pinned until the next request holds it) -> turn 2. The same two turns were first run as a "twin" that is never offloaded; the
offloaded session's turn 2 must produce the same tokens (temperature 0) and report its prefix as
cached. One session skips tool_end: its next request must restore it (restore on request). At the
end every session is closed and nothing may stay locked or protected. Writes JSON to --out.

Requests run one at a time so that batch composition, hence numerics, is the same for a session
and its twin. The twin runs before a cache flush, so the two never share radix nodes.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from toolkv.client import KVMeta, ToolKVClient

PROMPT_TOKENS = 3000
NEW_TOKENS = 24
TOOL_RESULT = 200
SESSIONS = 4


def post(url: str, body: dict[str, Any], timeout: float = 600) -> dict[str, Any]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        out: dict[str, Any] = json.loads(r.read())
        return out


def wait_healthy(url: str, pid: int, limit_s: float = 600) -> float:
    t0 = time.time()
    while True:
        try:
            if urllib.request.urlopen(url + "/health", timeout=5).status == 200:
                return time.time() - t0
        except OSError:
            pass
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            state = "Z"
        if state == "Z":
            sys.exit(f"server exited after {time.time() - t0:.0f} s (see server.log)")
        if time.time() - t0 > limit_s:
            sys.exit(f"server not healthy after {limit_s:.0f} s")
        time.sleep(1)


def prompt(i: int) -> list[int]:
    """A distinct 3000-token prompt per session (no shared prefix: each session's KV is its own)."""
    return [1000 + ((i + 1) * 100_003 + j * 7_919) % 60_000 for j in range(PROMPT_TOKENS)]


def tool_result(i: int) -> list[int]:
    return [500 + (i * 31 + j * 17) % 20_000 for j in range(TOOL_RESULT)]


def generate(url: str, ids: list[int], sid: str) -> tuple[list[int], int]:
    out = post(
        url + "/generate",
        {
            "input_ids": ids,
            "session_id": sid,
            "sampling_params": {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True},
        },
    )
    return list(out["output_ids"]), int(out.get("meta_info", {}).get("cached_tokens") or 0)


# After tool_end the load runs (Restoring); once it is acknowledged the session is handed over
# (Handover) until its next request is admitted, or Runnable when the hand-over has ended.
RESTORED = ("Handover", "Runnable")


def wait_state(
    c: ToolKVClient, sid: str, want: str | tuple[str, ...], limit_s: float = 60
) -> tuple[KVMeta, float]:
    wanted = (want,) if isinstance(want, str) else want
    t0 = time.perf_counter()
    while True:
        m = c.kv_meta(sid)
        if m.state in wanted:
            return m, time.perf_counter() - t0
        if time.perf_counter() - t0 > limit_s:
            raise TimeoutError(f"{sid} stuck in {m.state} (wanted {want})")
        time.sleep(0.01)


def flush(url: str) -> bool:
    try:
        urllib.request.urlopen(
            urllib.request.Request(url + "/flush_cache?timeout=60", method="POST"), timeout=120
        )
        return True
    except urllib.error.HTTPError:
        return False


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--pid", type=int, required=True)
    ap.add_argument("--out", required=True)
    # the backend make_backend picks for the server's tree: hiradix on sglang 0.5.16, unified on 0.5.23
    ap.add_argument("--backend", default="hiradix", choices=["hiradix", "unified"])
    # the server's TOOLKV_LAZY_FREE, when the run sets it (checked against what the server reports)
    ap.add_argument("--lazy-free", dest="lazy_free", choices=["0", "1"], default=None)
    a = ap.parse_args()
    url = a.url
    res: dict[str, Any] = {"healthy_after_s": wait_healthy(url, a.pid), "checks": {}, "sessions": []}
    checks: dict[str, bool] = res["checks"]
    c = ToolKVClient(url, timeout_s=120)
    server = c.server_meta()
    res["server_meta_start"] = server.raw
    checks[f"backend is {a.backend}"] = server.backend == a.backend
    lazy = bool(server.raw.get("lazy_free", False))
    res["lazy_free"] = lazy
    if a.lazy_free is not None:  # the run asked for one: the server must run it
        checks[f"lazy free is {'on' if a.lazy_free == '1' else 'off'}"] = lazy == (a.lazy_free == "1")
    copy_check = "gpu copy left evictable" if lazy else "freed ok"

    # 1. twins: never offloaded
    twins = []
    for i in range(SESSIONS):
        p = prompt(i)
        out1, _ = generate(url, p, f"twin{i}")
        out2, cached2 = generate(url, p + out1 + tool_result(i), f"twin{i}")
        twins.append((out1, out2, cached2))
    for i in range(SESSIONS):
        c.close_session(f"twin{i}")
    checks["flush between twins and sessions"] = flush(url)
    base = c.server_meta().raw

    # 2. the same conversations with a tool call in between
    for i in range(SESSIONS):
        sid, p = f"s{i}", prompt(i)
        rec: dict[str, Any] = {"session": sid}
        out1, _ = generate(url, p, sid)
        rec["turn1 equals twin"] = out1 == twins[i][0]
        before = c.server_meta().raw
        started = c.tool_start(sid)
        rec["tool_start"] = started.__dict__
        off, rec["offload_s"] = wait_state(c, sid, "Offloaded")
        during = c.server_meta().raw
        rec["device_tokens_during_tool"] = off.device_tokens
        rec["device_freed"] = during["device_free_tokens"] - before["device_free_tokens"]
        rec["device_evictable_gained"] = during["device_evictable_tokens"] - before["device_evictable_tokens"]
        if lazy:
            # the copy stays on the GPU, unlocked: sglang's eviction may take it whenever it needs the
            # room (the session's tokens moved from locked, while turn 1 ran, to evictable)
            rec[copy_check] = (
                off.device_tokens >= started.tokens - 64
                and during["device_locked_tokens"] <= before["device_locked_tokens"]
                and during["device_evictable_tokens"] >= started.tokens - 64
            )
        else:
            rec[copy_check] = off.device_tokens == 0 and rec["device_freed"] >= started.tokens - 64
        implicit = i == SESSIONS - 1  # last session: no tool_end, the next request restores it
        if not implicit:
            ended = c.tool_end(sid, started.epoch)
            rec["tool_end_state"] = ended.state
            restored, rec["restore_s"] = wait_state(c, sid, RESTORED)
            rec["state_after_load"] = restored.state
        t = time.perf_counter()
        out2, cached2 = generate(url, p + out1 + tool_result(i), sid)
        rec["turn2_latency_s"] = time.perf_counter() - t
        rec["implicit_restore"] = implicit
        rec["cached_tokens_turn2"] = cached2
        rec["twin_cached_tokens_turn2"] = twins[i][2]
        rec["turn2 equals twin"] = out2 == twins[i][1]
        rec["prefix reused"] = cached2 >= len(p) + len(out1) - 64
        rec["state_after_turn2"] = c.kv_meta(sid).state
        res["sessions"].append(rec)
        for k in ("turn1 equals twin", copy_check, "turn2 equals twin", "prefix reused"):
            checks[f"{sid}: {k}"] = bool(rec[k])

    # 3. errors on the live server
    m = c.tool_start("s0")
    try:
        c.tool_end("s0", m.epoch + 5)
        checks["stale epoch refused"] = False
    except Exception as e:
        checks["stale epoch refused"] = getattr(e, "http_status", 0) == 409
    c.tool_end("s0", m.epoch)
    wait_state(c, "s0", RESTORED)

    # 4. no leak once everything is closed
    for i in range(SESSIONS):
        c.close_session(f"s{i}")
    time.sleep(2)  # a few idle iterations: sglang's strict idle memory check runs then
    end = c.server_meta().raw
    res["server_meta_base"], res["server_meta_end"] = base, end
    checks["nothing protected by toolkv"] = end.get("protected_tokens", 0) == 0
    checks["no device tokens locked"] = end.get("device_locked_tokens", 0) == 0
    checks["every session closed"] = end.get("sessions") == 0
    checks["server still healthy"] = urllib.request.urlopen(url + "/health", timeout=10).status == 200
    res["passed"] = all(checks.values())
    Path(a.out).write_text(json.dumps(res, indent=2, default=str))
    for k, v in checks.items():
        print(("PASS " if v else "FAIL ") + k)
    print("TOOLKV_E2E", "PASS" if res["passed"] else "FAIL")
    return 0 if res["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
