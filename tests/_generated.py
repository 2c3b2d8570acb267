"""What the tests of generated doc blocks share: loading a script that is not part of the package
(``scripts/``, ``examples/``) as a module, and reading the text a doc keeps between its
``<!-- BEGIN name -->`` / ``<!-- END name -->`` markers.

Such a test regenerates a table or summary from committed results and compares it with the doc;
kept once here so that every one of them reads the markers and loads the scripts the same way.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def load_script(path: Path, name: str | None = None) -> ModuleType:
    """Import the file at ``path`` as module ``name`` (default: its stem), registered in
    ``sys.modules`` first: a script's dataclasses look their module up there."""
    name = name or path.stem
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def doc_block(doc: str, marker: str, *, fence: str | None = None) -> str | None:
    """The text between ``<!-- BEGIN marker -->`` and ``<!-- END marker -->`` in ``docs/<doc>``
    (without the newlines next to the markers), or None when the markers are missing. ``fence``:
    the block is a fenced code block (``"text"`` for a text fence, ``""`` for a bare one) and its
    inside is returned."""
    text = (ROOT / "docs" / doc).read_text()
    inner = "(.*?)" if fence is None else f"```{fence}\n(.*?)\n```"
    m = re.search(
        rf"<!-- BEGIN {re.escape(marker)} -->\n{inner}\n<!-- END {re.escape(marker)} -->", text, re.S
    )
    return None if m is None else m.group(1)
