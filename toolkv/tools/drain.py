"""``toolkv drain URL``: stop accepting tool calls, and (``--wait``) wait until nothing is held.

Before toolkv is switched off (``TOOLKV_ENABLE=0``) or sglang is upgraded, a restart must not cut
a session off in the middle of a tool call. ``toolkv drain URL`` makes the server refuse new
``tool_start`` calls (503 ``draining``; agents using ``tool_call`` run their tools anyway), while
the calls in flight finish or expire by their TTL as usual; ``--wait S`` then polls
``GET /session/status`` until no session holds KV. ``--off`` ends the drain.

Exit status: 0 when the request was taken (with ``--wait``: and the server is drained), 1 when
toolkv did not answer or ``--wait`` ran out with sessions still held, 2 for a usage error.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from toolkv.tools.doctor import add_server_arguments, client, diagnosis, drain_line, timeout_s


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_server_arguments(p)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--off", action="store_true", help="end the drain: tool calls are accepted again")
    mode.add_argument(
        "--wait",
        type=timeout_s,
        default=None,
        metavar="S",
        help="wait up to S seconds until no session holds KV (exit 1 if some still do)",
    )
    p.add_argument(
        "--every",
        type=timeout_s,
        default=5.0,
        metavar="S",
        help="with --wait: seconds between two reads of the server's status (default 5)",
    )


def _report(url: str, d: Any, waited_s: float | None, as_json: bool) -> None:
    if as_json:
        out: dict[str, Any] = {"url": url, **d.raw}
        if waited_s is not None:
            out["waited_s"] = round(waited_s, 3)
        print(json.dumps(out, indent=2))
        return
    print(f"toolkv at {url}: drain {drain_line(d)}")
    if d.drained:
        print(
            "  next: switch toolkv off (TOOLKV_ENABLE=0) or upgrade sglang, restart, and check with toolkv doctor"
        )


def run(args: argparse.Namespace) -> int:
    from toolkv.errors import ToolKVError

    url = args.url.rstrip("/")
    t0 = time.monotonic()
    with client(args) as kv:
        try:
            d = kv.drain(not args.off)
            while args.wait is not None and not d.drained:
                left = args.wait - (time.monotonic() - t0)
                if left <= 0:
                    break
                if not args.json:
                    print(f"toolkv drain: {drain_line(d)}; waiting", file=sys.stderr)
                time.sleep(min(args.every, left))
                d = kv.server_status(limit=0).drain
        except ToolKVError as e:
            line = diagnosis(url, e)
            if args.json:
                print(json.dumps({"url": url, "on": False, "error": e.code, "message": line}, indent=2))
            else:
                print(line, file=sys.stderr)
            return 1
    waited = time.monotonic() - t0 if args.wait is not None else None
    _report(url, d, waited, args.json)
    if args.wait is not None and not d.drained:
        if not args.json:
            print(f"toolkv drain: still held after {args.wait:g} s", file=sys.stderr)
        return 1
    return 0
