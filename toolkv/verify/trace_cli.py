"""``toolkv trace-check``: full-state traces (``FILE...``, :mod:`toolkv.verify.toolkv.tracecheck`) or a
live server's decision logs (``--decisions LOG...``, :mod:`toolkv.verify.toolkv.decisions`)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from toolkv.verify.toolkv import tracecheck


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "files", nargs="*", type=Path, help="JSON-lines traces (toolkv fuzz --trace-dir writes them)"
    )
    p.add_argument(
        "--decisions",
        nargs="+",
        type=Path,
        metavar="LOGFILE",
        help="server logs with toolkv's decision lines: replay every session against the spec's session"
        " table (one file per server; sglang's line prefixes are ignored)",
    )
    p.add_argument("--json", action="store_true")


def run(args: argparse.Namespace) -> int:
    if args.decisions and args.files:
        args._parser.error("give trace files or --decisions LOGFILE..., not both")
    if args.decisions:
        from toolkv.verify.toolkv.decisions import check_logs, render

        r = check_logs(args.decisions)
        if args.json:
            print(json.dumps(r.to_json(), indent=2))
        else:
            print(render(r), file=sys.stdout)
        return 0 if r.ok else 1
    if not args.files:
        args._parser.error("give trace files, or --decisions LOGFILE...")
    return tracecheck.run(args)
