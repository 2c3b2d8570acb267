"""The decode-offload lifecycle diagrams in ``docs/decode_offload.md``, generated from TLC's state
graph of ``spec/decode/DecodeOffload.tla`` (config ``MC_diagram.cfg``: one request, one rank).

Each diagram is a projection of the graph: a request's phase, and the life of its first
increment (written device->host, acknowledged and staged for storage, written to storage, host
slots freed). An arrow is drawn for every spec action that moves the projection, labelled with
the actions that do. ``tests/test_decode_docs.py`` fails if the committed diagrams differ.

``python -m research.decode_offload.diagram`` prints them; ``--write FILE`` updates the blocks
between ``<!-- BEGIN decode-NAME -->`` and ``<!-- END decode-NAME -->`` in ``FILE``.
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from toolkv.verify.tla import tlc as tla

SPEC_DIR = Path(__file__).resolve().parents[2] / "spec" / "decode"
CFG = "MC_diagram.cfg"
START = "[*]"


def state_graph() -> tla.StateGraph:
    """TLC's full state graph of the diagram config."""
    tmp = Path(tempfile.mkdtemp(prefix="toolkv-decode-diagram-"))
    try:
        res = tla.run_tlc(
            tla.Toolchain.locate(), SPEC_DIR / "DecodeOffload.tla", SPEC_DIR / CFG, dump_dot=tmp / "graph"
        )
        if res.outcome != "pass":
            raise tla.TlaToolError(f"TLC on {CFG}: {res.outcome} {' '.join(res.error_lines[-3:])}")
        return tla.read_dot(tmp / "graph")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _only(d: Mapping[Any, Any]) -> Any:
    (v,) = d.values()
    return v


def request_phase(state: Mapping[str, Any]) -> str:
    return str(_only(state["s"]["phase"]))


def first_increment(state: Mapping[str, Any]) -> str:
    """Where the request's first increment is: not issued, copying, on host, staged for
    storage, stored (backup acked by the thread), or its host slots freed."""
    s = state["s"]
    if len(s["ops"]) < 1:
        return START
    if len(_only(s["odata"])) < 1:
        return "Copying"
    if s["acked"] < 1:
        return "OnHost"
    if _only(s["stored"]) < 1:
        return "Staged"
    if _only(s["freed"]) < 1:
        return "Stored"
    return "Freed"


def project(g: tla.StateGraph, f: Callable[[Mapping[str, Any]], str]) -> dict[tuple[str, str], set[str]]:
    """(from, to) -> the actions that move ``f`` from one value to another."""
    out: dict[tuple[str, str], set[str]] = {}
    for src, dst, label in g.edges:
        a, b = f(g.states[src]), f(g.states[dst])
        if a != b:
            out.setdefault((a, b), set()).add(label)
    return out


def mermaid(edges: Mapping[tuple[str, str], set[str]], initial: str) -> str:
    lines = ["```mermaid", "stateDiagram-v2", f"    [*] --> {initial}" if initial != START else ""]
    for (a, b), labels in sorted(edges.items()):
        lines.append(f"    {a} --> {b}: {', '.join(sorted(labels))}")
    lines.append("```")
    return "\n".join(x for x in lines if x)


def generate() -> dict[str, str]:
    """Block name -> Mermaid text."""
    g = state_graph()
    init = g.states[next(iter(g.initial))]
    return {
        "decode-requests": mermaid(project(g, request_phase), request_phase(init)),
        "decode-increments": mermaid(project(g, first_increment), first_increment(init)),
    }


def _splice(body: str) -> Callable[[re.Match[str]], str]:
    return lambda m: m.group(1) + body + "\n" + m.group(2)


def render(doc: str, blocks: Mapping[str, str]) -> str:
    """``doc`` with every generated block replaced; a missing marker is an error."""
    for name, body in blocks.items():
        pat = re.compile(
            rf"(<!-- BEGIN {re.escape(name)} -->\n)(?:.*?\n)?(<!-- END {re.escape(name)} -->)", re.S
        )
        if not pat.search(doc):
            raise ValueError(f"no <!-- BEGIN {name} --> ... <!-- END {name} --> block")
        doc = pat.sub(_splice(body), doc)
    return doc


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--write", type=Path, default=None, help="update the generated blocks of this file")


def run(args: argparse.Namespace) -> int:
    blocks = generate()
    if args.write is None:
        for name, body in blocks.items():
            print(f"<!-- {name} -->\n{body}\n")
        return 0
    text = args.write.read_text()
    new = render(text, blocks)
    if new != text:
        args.write.write_text(new)
        print(f"updated {args.write}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m research.decode_offload.diagram")
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
