"""``toolkv diagram``: Mermaid state diagrams generated from the lifecycle tables.

docs/architecture.md embeds the output between markers; ``tests/test_docs.py`` regenerates it and
fails if the document drifted from the tables.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from typing import Any

from toolkv.core import lifecycle
from toolkv.core.phases import Phase


def mermaid(table: tuple[lifecycle.Row, ...], initial: str) -> str:
    lines = ["stateDiagram-v2", f"    [*] --> {initial}"]
    for e in edges(table):
        lines.append(f"    {e['from']} --> {e['to']}: {', '.join(e['triggers'])}")
    return "\n".join(lines)


def session_diagram() -> str:
    return mermaid(lifecycle.SESSION_TRANSITIONS, Phase.NEW)


def tier_diagram() -> str:
    return mermaid(lifecycle.TIER_TRANSITIONS, "Unborn")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("which", choices=["sessions", "tiers"], help="which lifecycle table")
    p.add_argument(
        "--json",
        action="store_true",
        help='print {"which", "initial", "states", "edges", "mermaid"} as JSON instead of the Mermaid text',
    )


def edges(table: tuple[lifecycle.Row, ...]) -> list[dict[str, Any]]:
    """The diagram's edges, one per (from, to) pair with every trigger that takes it, sorted."""
    by_pair: dict[tuple[str, str], list[str]] = defaultdict(list)
    for trigger, src, dst in lifecycle._expand(table):
        if trigger not in by_pair[(src, dst)]:
            by_pair[(src, dst)].append(trigger)
    return [{"from": s, "to": d, "triggers": t} for (s, d), t in sorted(by_pair.items())]


def run(args: argparse.Namespace) -> int:
    text = session_diagram() if args.which == "sessions" else tier_diagram()
    if not args.json:
        print(text)
        return 0
    table, initial = (
        (lifecycle.SESSION_TRANSITIONS, Phase.NEW)
        if args.which == "sessions"
        else (lifecycle.TIER_TRANSITIONS, "Unborn")
    )
    rows = edges(table)
    states = sorted({initial} | {e["from"] for e in rows} | {e["to"] for e in rows})
    out = {"which": args.which, "initial": initial, "states": states, "edges": rows, "mermaid": text}
    print(json.dumps(out, indent=2))
    return 0
