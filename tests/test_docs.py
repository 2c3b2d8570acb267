"""Generated parts of the docs are current."""

from __future__ import annotations

import re
from pathlib import Path

from toolkv.tools.diagram import session_diagram, tier_diagram

DOCS = Path(__file__).resolve().parents[1] / "docs"


def _block(text: str, name: str) -> str:
    m = re.search(rf"<!-- BEGIN {name} -->\n```mermaid\n(.*?)\n```\n<!-- END {name} -->", text, re.S)
    assert m, f"no generated {name} block in docs/architecture.md"
    return m.group(1)


def test_architecture_diagrams_match_the_lifecycle_tables() -> None:
    text = (DOCS / "architecture.md").read_text()
    assert _block(text, "sessions") == session_diagram(), "run: toolkv diagram sessions"
    assert _block(text, "tiers") == tier_diagram(), "run: toolkv diagram tiers"
