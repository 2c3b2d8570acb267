"""A stand-in sglang server for a CPU dry run of scripts/gpu_fleet.py (not a test, not a model).

    python scripts/gpu_fleet.py --dry-run-stub scripts/stage/fleet_stub.py --model x --out O --work W --l3-dir D
    DRY_RUN_STUB=scripts/stage/fleet_stub.py bash scripts/gpu_value_repeat.sh    (tests/test_gpu_value_repeat.py)

Why: the multi-server run costs GPU time and can only be tried whole; this lets the client, the
real sglang router in front of it, the drain and the result files run on a laptop first. It answers
what the router asks a worker (``/health``, ``/model_info``, ``/server_info``) and what the client
asks sglang and toolkv, with just enough state for the scenario to go through:

* ``/generate``: greedy output is a hash of the input ids (so a conversation and its twin agree);
  ``cached_tokens`` is the longest prefix of the input this server holds, from its own cache or,
  with ``--storage``, from the L3 directory, one file per token keyed by a chained hash as
  HiCacheFile keys pages; a finished turn is written there. The session is the body's
  ``session_id``, else the ``X-SMG-Routing-Key`` header (what toolkv does with
  ``TOOLKV_SESSION_HEADER=X-SMG-Routing-Key``). A body with ``"stream": true`` is answered as
  sglang streams: one server-sent event with the whole answer, then ``data: [DONE]``.
* ``/session/*``: toolkv's answers, 404 ``unknown_session`` for a session this server never saw;
  ``tool_start`` beyond ``--budget`` protected tokens moves the oldest offloaded session to L3.
  ``tool_start`` takes the per-call ``policy`` (``offload`` or ``auto``, 400 for anything else) and
  the ``tool`` name, and writes one ``toolkv decision op=tool_start ...`` line naming both on stderr
  (the server log), as toolkv's decision log does.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

NEW_TOKENS_DEFAULT = 24


class State:
    """One stub server's caches and sessions."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.a = args
        self.storage: bool = args.storage
        self.cache: set[str] = set()  # chained hashes of every cached prefix (a radix tree, flattened)
        self.sessions: dict[str, dict[str, Any]] = {}
        self.lock = threading.Lock()

    @staticmethod
    def chain(ids: list[int]) -> list[str]:
        out, h = [], b""
        for t in ids:
            h = hashlib.sha1(h + t.to_bytes(8, "little", signed=True)).digest()[:12]
            out.append(h.hex())
        return out

    def cached(self, keys: list[str]) -> tuple[int, int]:
        """(tokens found in this server's cache, tokens then found in L3)."""
        n = 0
        while n < len(keys) and keys[n] in self.cache:
            n += 1
        m = n
        if self.storage:
            while m < len(keys) and os.path.exists(os.path.join(self.a.l3_dir, keys[m] + "_stub_0_1.bin")):
                m += 1
        return n, m - n

    def insert(self, keys: list[str]) -> None:
        self.cache.update(keys)
        if self.storage:
            for k in keys:
                p = os.path.join(self.a.l3_dir, k + "_stub_0_1.bin")
                if not os.path.exists(p):
                    with open(p, "wb") as fh:
                        fh.write(b"kv")


def make_handler(st: State) -> type[BaseHTTPRequestHandler]:
    class H(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def send(self, code: int, obj: Any) -> None:
            b = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(b)))
            self.end_headers()
            self.wfile.write(b)

        def send_sse(self, obj: Any) -> None:
            b = f"data: {json.dumps(obj)}\n\ndata: [DONE]\n\n".encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Content-Length", str(len(b)))
            self.end_headers()
            self.wfile.write(b)

        def body(self) -> Any:
            n = int(self.headers.get("Content-Length") or 0)
            return json.loads(self.rfile.read(n)) if n else {}

        def unknown(self, sid: Any) -> None:
            self.send(404, {"error": "unknown_session", "message": f"session {sid!r} is unknown"})

        def meta(self, sid: str) -> dict[str, Any]:
            r = st.sessions[sid]
            return {"session_id": sid, "backend": "hiradix", "protected": r["state"] == "Offloaded", **r}

        def do_GET(self) -> None:
            u = urlparse(self.path)
            if u.path in ("/health", "/health_generate"):
                return self.send(200, {})
            if u.path in ("/model_info", "/get_model_info"):
                return self.send(
                    200, {"model_path": st.a.model, "tokenizer_path": None, "is_generation": True}
                )
            if u.path in ("/server_info", "/get_server_info"):
                return self.send(
                    200, {"model_path": st.a.model, "tp_size": 1, "dp_size": 1, "version": "0.5.16"}
                )
            if u.path == "/session/kv_meta":
                sid = parse_qs(u.query).get("session_id", [None])[0]
                with st.lock:
                    if sid is None:
                        return self.send(200, {"backend": "hiradix", "sessions": len(st.sessions), "states": {},
                                               "counters": {}, "protected_tokens": 0, "device_locked_tokens": 0,
                                               "held_sessions": len(st.sessions)})  # fmt: skip
                    if sid not in st.sessions:
                        return self.unknown(sid)
                    return self.send(200, self.meta(sid))
            return self.send(404, {"detail": "Not Found"})

        def do_DELETE(self) -> None:
            if urlparse(self.path).path == "/hicache/storage-backend":
                st.storage = False
                return self.send(200, {})
            return self.send(404, {"detail": "Not Found"})

        def do_POST(self) -> None:
            path = urlparse(self.path).path
            b = self.body()
            with st.lock:
                if path == "/generate":
                    ids = list(b["input_ids"])
                    sid = b.get("session_id") or self.headers.get("x-smg-routing-key")
                    keys = st.chain(ids)
                    dev, l3 = st.cached(keys)
                    n_new = int((b.get("sampling_params") or {}).get("max_new_tokens", NEW_TOKENS_DEFAULT))
                    seed = hashlib.sha1(json.dumps(ids).encode()).digest()
                    out = [1000 + (seed[i % 20] * 131 + i * 7) % 30000 for i in range(n_new)]
                    st.insert(st.chain(ids + out[:-1]))
                    if sid:
                        r = st.sessions.setdefault(sid, {"epoch": 0})
                        r.update(state="Running", tier="GPU", tokens=len(ids) + n_new - 1, device_tokens=len(ids),
                                 host_tokens=0)  # fmt: skip
                    details = {"device": dev, "host": 0, "storage": l3} if dev + l3 else None
                    ans = {
                        "output_ids": out,
                        "meta_info": {"cached_tokens": dev + l3, "cached_tokens_details": details},
                    }
                    if b.get("stream"):
                        return self.send_sse(ans)
                    return self.send(200, ans)
                if path.startswith("/session/"):
                    sid = b.get("session_id")
                    if sid not in st.sessions:
                        return self.unknown(sid)
                    r = st.sessions[sid]
                    if path == "/session/tool_start":
                        policy = b.get("policy")
                        if policy not in (None, "offload", "auto"):
                            return self.send(400, {"error": "bad_request", "message": f"policy {policy!r}"})
                        print(f"toolkv decision op=tool_start session={sid} epoch={r['epoch'] + 1} outcome=ok"
                              f" policy={policy or '-'} tool={b.get('tool') or '-'}", file=sys.stderr, flush=True)  # fmt: skip
                        r.update(
                            state="Offloaded", tier="CpuProtected", epoch=r["epoch"] + 1, device_tokens=0
                        )
                        held = [
                            x for x in st.sessions.values() if x["state"] == "Offloaded" and x["tier"] != "l3"
                        ]
                        while st.storage and sum(x["tokens"] for x in held) > st.a.budget and len(held) > 1:
                            held.pop(0).update(tier="l3", l3="stored")
                        return self.send(200, self.meta(sid))
                    if path == "/session/tool_end":
                        if b.get("epoch") != r["epoch"]:
                            return self.send(409, {"error": "stale_epoch", "message": "stale"})
                        r.update(state="Handover", tier="GPU", l3=None)
                        return self.send(200, self.meta(sid))
                    if path == "/session/close":
                        r.update(state="Closed")
                        return self.send(200, self.meta(sid))
                if path == "/flush_cache":
                    st.cache.clear()
                    return self.send(200, {})
                if path in ("/hicache/storage-backend/clear", "/clear_hicache_storage_backend"):
                    for e in os.scandir(st.a.l3_dir):
                        os.remove(e.path)
                    return self.send(200, {})
            return self.send(404, {"detail": "Not Found"})

        def log_message(self, *args: Any) -> None:
            pass

    return H


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--model", default="stub")
    ap.add_argument("--l3-dir", required=True)
    ap.add_argument("--storage", action="store_true")
    ap.add_argument("--budget", type=int, default=7560)
    a = ap.parse_args()
    ThreadingHTTPServer(("127.0.0.1", a.port), make_handler(State(a))).serve_forever()


if __name__ == "__main__":
    main()
