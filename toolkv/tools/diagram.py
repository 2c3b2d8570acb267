"""``toolkv diagram``: Mermaid state diagrams generated from the lifecycle tables.

docs/architecture.md embeds the output between markers; ``tests/test_docs.py`` regenerates it and
fails if the document drifted from the tables.
"""

from __future__ import annotations

import argparse
from collections import defaultdict

from toolkv.core import lifecycle


def mermaid(table: tuple[lifecycle.Row, ...], initial: str) -> str:
    edges: dict[tuple[str, str], list[str]] = defaultdict(list)
    for trigger, src, dst in lifecycle._expand(table):
        if trigger not in edges[(src, dst)]:
            edges[(src, dst)].append(trigger)
    lines = ["stateDiagram-v2", f"    [*] --> {initial}"]
    for (src, dst), triggers in sorted(edges.items()):
        lines.append(f"    {src} --> {dst}: {', '.join(triggers)}")
    return "\n".join(lines)


def session_diagram() -> str:
    return mermaid(lifecycle.SESSION_TRANSITIONS, "New")


def tier_diagram() -> str:
    return mermaid(lifecycle.TIER_TRANSITIONS, "Unborn")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("which", choices=["sessions", "tiers"], help="which lifecycle table")


def run(args: argparse.Namespace) -> int:
    print(session_diagram() if args.which == "sessions" else tier_diagram())
    return 0
