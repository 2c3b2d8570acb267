"""argparse types shared by the subcommands: a bad value is a usage error at parse time (exit 2,
one line naming the argument), not a traceback or a silently empty run later."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from pathlib import Path


def positive_int(text: str) -> int:
    return _int(text, 1)


def nonneg_int(text: str) -> int:
    return _int(text, 0)


def _int(text: str, lo: int) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if v < lo:
        raise argparse.ArgumentTypeError(f"{v} is less than {lo}")
    return v


def probability(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0.0 <= v <= 1.0:
        raise argparse.ArgumentTypeError(f"{v} is not within [0, 1]")
    return v


def int_list(text: str) -> list[int]:
    """Comma-separated positive integers (``1000,10000``)."""
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers") from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected positive integers")
    return out


def writable_file(*suffixes: str) -> Callable[[str], Path]:
    """A file the command will write: its directory must exist and be writable, checked before
    the command runs for minutes."""

    def check(text: str) -> Path:
        p = Path(text)
        if suffixes and p.suffix.lower() not in suffixes:
            raise argparse.ArgumentTypeError(f"{text!r}: expected a file ending in {' or '.join(suffixes)}")
        if p.is_dir():
            raise argparse.ArgumentTypeError(f"{text!r} is a directory")
        parent = p.parent
        if not parent.is_dir():
            raise argparse.ArgumentTypeError(f"{text!r}: no directory {str(parent)!r}")
        if not os.access(parent, os.W_OK) or (p.exists() and not os.access(p, os.W_OK)):
            raise argparse.ArgumentTypeError(f"{text!r} is not writable")
        return p

    return check
