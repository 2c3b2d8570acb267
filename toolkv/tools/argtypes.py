"""argparse types shared by the subcommands: a bad value is a usage error at parse time (exit 2,
one line naming the argument), not a traceback or a silently empty run later."""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

DEVICE = re.compile(r"cpu|cuda(:\d+)?")


class OneLineParser(argparse.ArgumentParser):
    """argparse with a one-line usage error: ``toolkv <command>: error: ...`` and exit status 2, as
    every other error of the command line (a usage block of many lines would bury the one line
    that says what is wrong). Subparsers made from it are OneLineParsers too."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


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


def int_tuple(*names: str) -> Callable[[str], tuple[int, ...]]:
    """Exactly ``len(names)`` comma-separated positive integers (``32,8,128`` for
    layers,kv_heads,head_dim): a wrong count would otherwise fail deep inside the command."""

    def check(text: str) -> tuple[int, ...]:
        parts = [x.strip() for x in text.split(",")]
        try:
            out = tuple(int(x) for x in parts)
        except ValueError:
            out = ()
        if len(out) != len(names) or min(out) < 1:
            raise argparse.ArgumentTypeError(
                f"{text!r}: expected {len(names)} comma-separated positive integers ({','.join(names)})"
            )
        return out

    return check


def device(text: str) -> str:
    """``cpu`` or ``cuda[:N]``: what the cache harness can build its pools on."""
    if not DEVICE.fullmatch(text):
        raise argparse.ArgumentTypeError(f"{text!r}: expected cpu or cuda[:N]")
    return text


def cuda_missing(name: str) -> str | None:
    """Why the CUDA device ``name`` cannot be used here (None: it can, it is not CUDA, or torch is
    not installed, which the command reports itself by naming the extra to install). Checked
    before a command starts, so that a machine without a GPU is one line, not a campaign that runs
    for a minute and then reports every example as a failure."""
    if not name.startswith("cuda"):
        return None
    try:
        import torch
    except ModuleNotFoundError:
        return None
    if not torch.cuda.is_available():
        return (
            f"--device {name}: no CUDA device here (torch.cuda.is_available() is False); "
            "run it on a GPU machine or with --device cpu"
        )
    index = int(name.partition(":")[2] or 0)
    if index >= torch.cuda.device_count():
        return f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s)"
    return None


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
