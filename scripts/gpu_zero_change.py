"""Zero-change on a live server, for real: the OpenAI chat endpoint answers with ``tool_calls``, toolkv
offloads the session on that answer alone, and the next chat request (carrying the tool result)
restores it and reuses the prefix.

The server must run with a tokenizer and a chat template (dummy weights: scripts/stage/make_tokenizer.py),
the xgrammar grammar backend, a tool-call parser (sglang parses a chat answer into ``tool_calls`` only
when one is set; ``pythonic`` constrains a required call to sglang's JSON-array schema on both 0.5.16
and 0.5.23), ``--constrained-json-disable-any-whitespace``, ``--enable-cache-report``,
and toolkv with ``TOOLKV_ZERO_CHANGE=1`` and ``TOOLKV_RESTORE_ON_REQUEST=1``. Dummy weights cannot choose
to call a tool, so the request forces one with sglang's own constrained decoding: ``tool_choice
"required"`` with ``parallel_tool_calls`` false compiles a JSON schema of exactly one call; the tool takes
no argument, so the call is a few tokens whatever the weights. No toolkv call is made by the client
except ``kv_meta`` (to observe) and ``close`` (to clean up).

    python scripts/gpu_zero_change.py --url http://127.0.0.1:30000 --out zero_change.json
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from toolkv.client import ToolKVClient

SESSIONS = 4
SHARED_SLACK = 64  # device tokens a session may keep during its tool: what it shares with live sessions
TOOL = {
    "type": "function",
    "function": {
        "name": "run_code",
        "description": "Run the snippet of the conversation and return its output.",
        "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
    },
}
WORDS = [
    "agent",
    "tool",
    "cache",
    "offload",
    "restore",
    "session",
    "epoch",
    "tier",
    "host",
    "device",
    "pinned",
    "radix",
    "prefix",
    "token",
]


def post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        out: dict[str, Any] = json.loads(r.read())
        return out


def user_text(i: int, words: int = 400) -> str:
    rng = random.Random(i)
    return f"session {i}: " + " ".join(f"{rng.choice(WORDS)}{rng.randrange(1000)}" for _ in range(words))


def chat(url: str, model: str, sid: str, messages: list[dict[str, Any]], **kw: Any) -> dict[str, Any]:
    body = {"model": model, "messages": messages, "tools": [TOOL], "session_id": sid, "temperature": 0, **kw}
    return post(url + "/v1/chat/completions", body)


def wait_state(c: ToolKVClient, sid: str, want: set[str], limit_s: float = 60) -> tuple[str, float]:
    t0 = time.perf_counter()
    while True:
        state = c.kv_meta(sid).state
        if state in want or time.perf_counter() - t0 > limit_s:
            return state, time.perf_counter() - t0
        time.sleep(0.02)


def judge(sessions: list[dict[str, Any]], end: dict[str, Any]) -> dict[str, bool]:
    """The verdicts, from what was recorded (``--judge FILE`` re-reads a saved run).

    During the tool a session keeps on the device only what it shares with another session's live
    KV: here the system prompt, which the session before it holds once restored (49 tokens with the
    staged tokenizer). So "offloaded" means at most ``SHARED_SLACK`` device tokens, as the e2e check
    allows for the device pool's own accounting."""
    checks: dict[str, bool] = {}
    for rec in sessions:
        sid, calls = rec["session"], rec["tool_calls"]
        checks[f"{sid}: chat answered finish_reason tool_calls"] = rec["finish_reason"] == "tool_calls"
        checks[f"{sid}: the call names run_code"] = bool(calls) and calls[0]["function"]["name"] == "run_code"
        checks[f"{sid}: offloaded on the answer alone"] = (
            rec["state_during_tool"] == "Offloaded" and rec["device_tokens_during_tool"] <= SHARED_SLACK
        )
        checks[f"{sid}: next turn reused the prefix"] = (
            rec["cached_tokens_turn2"] >= rec["prompt_tokens_turn1"] - 8
        )
    checks["nothing protected by toolkv"] = end.get("protected_tokens", 0) == 0
    checks["no device tokens locked"] = end.get("device_locked_tokens", 0) == 0
    return checks


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url")
    ap.add_argument("--out", required=True)
    ap.add_argument("--judge", action="store_true", help="re-judge the run saved in --out (no server)")
    a = ap.parse_args()
    if a.judge:
        res = json.loads(Path(a.out).read_text())
        res["checks"] = judge(res["sessions"], res["server_meta_end"])
        res["passed"] = all(res["checks"].values())
        Path(a.out).write_text(json.dumps(res, indent=2, default=str))
        for k, v in res["checks"].items():
            print(("PASS " if v else "FAIL ") + k)
        return 0 if res["passed"] else 1
    if not a.url:
        ap.error("--url is required (or --judge)")
    c = ToolKVClient(a.url, timeout_s=120)
    with urllib.request.urlopen(a.url + "/v1/models", timeout=30) as r:
        model = json.loads(r.read())["data"][0]["id"]
    sessions = []
    for i in range(SESSIONS):
        sid = f"zc{i}"
        rec: dict[str, Any] = {"session": sid}
        msgs: list[dict[str, Any]] = [
            {"role": "system", "content": "You are an agent. Call run_code when you need to run code."},
            {"role": "user", "content": user_text(i)},
        ]
        r1 = chat(a.url, model, sid, msgs, tool_choice="required", parallel_tool_calls=False, max_tokens=64)
        ch = r1["choices"][0]
        calls = ch["message"].get("tool_calls") or []
        rec["finish_reason"] = ch["finish_reason"]
        rec["content"] = (ch["message"].get("content") or "")[:200]
        rec["tool_calls"] = calls
        rec["prompt_tokens_turn1"] = r1["usage"]["prompt_tokens"]
        state, rec["offload_seen_s"] = wait_state(c, sid, {"Offloaded"})
        meta = c.kv_meta(sid)
        rec["state_during_tool"], rec["device_tokens_during_tool"], rec["host_tokens_during_tool"] = (
            state,
            meta.device_tokens,
            meta.host_tokens,
        )
        tool_msgs = [
            {"role": "assistant", "content": None, "tool_calls": calls},
            {"role": "tool", "tool_call_id": calls[0]["id"] if calls else "none", "content": "exit 0: 42"},
        ]
        t = time.perf_counter()
        r2 = chat(a.url, model, sid, msgs + tool_msgs, tool_choice="none", max_tokens=8)
        rec["turn2_latency_s"] = time.perf_counter() - t
        details = r2["usage"].get("prompt_tokens_details") or {}
        rec["cached_tokens_turn2"] = int(details.get("cached_tokens") or 0)
        rec["state_after_turn2"] = c.kv_meta(sid).state
        sessions.append(rec)
        print(json.dumps(rec, default=str), flush=True)
    for i in range(SESSIONS):
        c.close_session(f"zc{i}")
    time.sleep(2)
    end = c.server_meta().raw
    checks = judge(sessions, end)
    res = {"checks": checks, "passed": all(checks.values()), "sessions": sessions, "server_meta_end": end}
    Path(a.out).write_text(json.dumps(res, indent=2, default=str))
    for k, v in checks.items():
        print(("PASS " if v else "FAIL ") + k)
    print("TOOLKV_ZERO_CHANGE", "PASS" if res["passed"] else "FAIL")
    return 0 if res["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
