"""``toolkv docs``: the generated parts of docs/, rebuilt from what the tools wrote.

Numbers in docs are never typed in: a tool writes JSON, this command renders it into the marked
block of the document, and ``tests/test_docs.py`` fails when the two disagree. Today that is the
model-checking table of docs/spec.md::

    toolkv spec-check --json > spec-check.json      # minutes: every config and mutant
    toolkv docs --spec-check spec-check.json         # docs/spec-check.json + the table in docs/spec.md

The JSON is stored without machine-specific fields (the spec directory's absolute path).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

DOCS = Path(__file__).resolve().parents[2] / "docs"
SPEC_JSON = DOCS / "spec-check.json"
SPEC_MD = DOCS / "spec.md"
BEGIN, END = "<!-- BEGIN spec-check (generated: toolkv docs) -->", "<!-- END spec-check -->"
MACHINE_FIELDS = ("spec_dir",)


def clean(summary: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in summary.items() if k not in MACHINE_FIELDS}


def spec_table(summary: dict[str, Any]) -> str:
    """The block docs/spec.md shows: the command, the totals, and spec-check's own table."""
    from toolkv.verify.spec_check import ConfigResult, format_table

    results = [ConfigResult(**r) for r in summary["configs"]]
    ok = "all as expected" if summary["ok"] else "NOT all as expected"
    return "\n".join(
        [
            BEGIN,
            f"`toolkv spec-check --json` ({summary['workers']} TLC worker): {len(results)} configs in "
            f"{summary['seconds']:.0f} s, {ok}.",
            "",
            "```",
            format_table(results),
            "```",
            END,
        ]
    )


def replace_block(text: str, block: str) -> str:
    pattern = re.compile(re.escape(BEGIN) + r".*?" + re.escape(END), re.S)
    if not pattern.search(text):
        raise ValueError(f"no generated block ({BEGIN}) in the document")
    return pattern.sub(lambda _: block, text)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--spec-check", type=Path, metavar="FILE", help="JSON written by `toolkv spec-check --json`"
    )


def run(args: argparse.Namespace) -> int:
    if args.spec_check is not None:
        summary = clean(json.loads(args.spec_check.read_text()))
        SPEC_JSON.write_text(json.dumps(summary, indent=2) + "\n")
    summary = json.loads(SPEC_JSON.read_text())
    SPEC_MD.write_text(replace_block(SPEC_MD.read_text(), spec_table(summary)))
    print(f"{SPEC_MD.name}: table regenerated from {SPEC_JSON.name}")
    return 0
