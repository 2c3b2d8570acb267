"""The ``toolkv`` console script.

Each subcommand lives in its own module and is imported lazily, so ``toolkv --help`` stays fast and
does not import torch or sglang.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# name -> (module, help). Each module provides ``add_arguments(parser)`` and ``run(args) -> int``.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "spec-check": ("toolkv.verify.spec_check", "run SANY and TLC over every spec config and mutant"),
    "demo": ("toolkv.tools.demo", "agent sessions with tool calls over a real HiRadixCache on CPU"),
    "fuzz": (
        "toolkv.tools.fuzz_cli",
        "Hypothesis stateful campaign against the real HiRadixCache (and --mutants)",
    ),
    "trace-check": (
        "toolkv.verify.tracecheck",
        "validate JSON-lines traces against the spec's next-state relation",
    ),
    "diagram": ("toolkv.tools.diagram", "Mermaid state diagrams generated from the lifecycle tables"),
    "bench": ("toolkv.tools.bench", "benchmarks (overhead: control-path cost per call and per idle tick)"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="toolkv", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        sp = sub.add_parser(name, help=help_text, description=help_text)
        sp.set_defaults(_module=module_name)
        importlib.import_module(module_name).add_arguments(sp)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    module = importlib.import_module(args._module)
    rc: int = module.run(args)
    return rc


if __name__ == "__main__":
    sys.exit(main())
