"""``python -m toolkv.twin ...`` = ``toolkv twin ...`` (also runs the twin next to an older toolkv
tree whose command line has no ``twin``: see docs/twin.md, validation)."""

from __future__ import annotations

import sys

from toolkv.argtypes import OneLineParser
from toolkv.twin.cli import add_arguments, run


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(prog="python -m toolkv.twin", description=(sys.modules[__name__].__doc__ or ""))
    add_arguments(ap)
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
