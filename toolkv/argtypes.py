"""Bounded values shared by every command line and by the ``TOOLKV_*`` settings: one statement of
each bound, from which both the check and its refusal are made, so that a refusal can never name a
bound other than the one applied (a ``TOOLKV_TTL_S=-1`` answered ">= 0" while 0 is refused too).

As argparse ``type=`` functions, a bad value is a usage error at parse time (exit 2, one line naming
the flag and what it accepts), not a traceback or a silently empty run later. Standard library
only: the twin, the verifier and the command line all parse their flags with these, and the
plugin's configuration reads its variables with :class:`Numeric`.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, NoReturn, TypeVar

DEVICE = re.compile(r"cpu|cuda(:\d+)?")

N = TypeVar("N", int, float)


class OneLineParser(argparse.ArgumentParser):
    """argparse with a one-line usage error: ``toolkv <command>: error: ...`` and exit status 2, as
    every other error of the command line (a usage block of many lines would bury the one line
    that says what is wrong). Subparsers made from it are OneLineParsers too."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _num(x: float) -> str:
    return f"{x:g}"


@dataclass(frozen=True)
class Numeric(Generic[N]):
    """A finite integer or number within a bound; callable as an argparse ``type=``.

    ``lo``/``hi`` are the bounds (None: none), ``lo_open``/``hi_open`` exclude them. The bound is
    data, not code, so that tests can walk every flag and setting and check each refusal against
    the bound it states (``tests/test_cli_bounds.py``)."""

    kind: type[N]
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False

    @property
    def __name__(self) -> str:  # argparse names a type by it in some messages
        return self.kind.__name__

    def describe(self) -> str:
        """What is accepted, in words: ``an integer >= 1``, ``a number > 0``, ``a number from 0 to 1``."""
        what = "an integer" if self.kind is int else "a finite number"
        lo, hi = self.lo, self.hi
        if lo is not None and hi is not None:
            if self.lo_open and self.hi_open:
                return f"{what} strictly between {_num(lo)} and {_num(hi)}"
            if not self.lo_open and not self.hi_open:
                return f"{what} from {_num(lo)} to {_num(hi)}"
            return f"{what} {'>' if self.lo_open else '>='} {_num(lo)} and {'<' if self.hi_open else '<='} {_num(hi)}"
        if lo is not None:
            return f"{what} {'>' if self.lo_open else '>='} {_num(lo)}"
        if hi is not None:
            return f"{what} {'<' if self.hi_open else '<='} {_num(hi)}"
        return what

    def admits(self, v: float) -> bool:
        """Whether ``v`` is within the bound (finite, and an integer for an integer kind)."""
        if not math.isfinite(v):
            return False
        if self.lo is not None and (v < self.lo or (self.lo_open and v == self.lo)):
            return False
        return not (self.hi is not None and (v > self.hi or (self.hi_open and v == self.hi)))

    def parse(self, text: str) -> N:
        """``text`` as a value of the bound; ``ValueError("expected ...")`` otherwise."""
        try:
            v = self.kind(text.strip())
        except ValueError:
            raise ValueError(f"expected {self.describe()}") from None
        if not self.admits(v):
            raise ValueError(f"expected {self.describe()}")
        return v

    def __call__(self, text: str) -> N:
        try:
            return self.parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"{text!r}: {e}") from None


def ints(lo: int | None = None, hi: int | None = None) -> Numeric[int]:
    """An integer from ``lo`` to ``hi`` (both included)."""
    return Numeric(int, lo, hi)


def floats(
    lo: float | None = None, hi: float | None = None, *, lo_open: bool = False, hi_open: bool = False
) -> Numeric[float]:
    """A finite number within ``lo`` .. ``hi`` (``*_open``: that end excluded)."""
    return Numeric(float, lo, hi, lo_open, hi_open)


positive_int = ints(1)
nonneg_int = ints(0)
seed = ints(0)  # a random seed: numpy's generators refuse negative ones
positive_float = floats(0, lo_open=True)
nonneg_float = floats(0)
probability = floats(0, 1)
share = floats(0, 1, hi_open=True)  # a share of a whole that must leave some of it: [0, 1)


@dataclass(frozen=True)
class NumberList(Generic[N]):
    """A comma list of values of ``item`` (``8,16,32``), at least one."""

    item: Numeric[N]

    @property
    def __name__(self) -> str:
        return f"{self.item.kind.__name__} list"

    def __call__(self, text: str) -> list[N]:
        parts = [x.strip() for x in text.split(",")]
        try:
            if not text.strip() or any(not x for x in parts):
                raise ValueError
            return [self.item.parse(x) for x in parts]
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r}: expected a comma list, each {self.item.describe()}"
            ) from None


int_list = NumberList(positive_int)  # ``1000,10000``
positive_float_list = NumberList(positive_float)
nonneg_int_list = NumberList(nonneg_int)


@dataclass(frozen=True)
class ChoiceList:
    """A comma list of names out of ``choices`` (``stock,offload``); ``every`` (if given) stands
    for all of them."""

    choices: tuple[str, ...]
    every: str | None = None

    @property
    def __name__(self) -> str:
        return "name list"

    def __call__(self, text: str) -> str:
        """The text itself (the commands split it), once every name in it is known."""
        names = [x.strip() for x in text.split(",")]
        if self.every is not None and text.strip() == self.every:
            return text.strip()
        bad = [n for n in names if n not in self.choices]
        if not text.strip() or bad:
            also = f" (or {self.every})" if self.every else ""
            raise argparse.ArgumentTypeError(
                f"{text!r}: expected a comma list of {', '.join(self.choices)}{also}"
            )
        return ",".join(names)


def choice_list(choices: Iterable[str], every: str | None = None) -> ChoiceList:
    return ChoiceList(tuple(choices), every)


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


def http_url(text: str) -> str:
    """A server's base URL, ``http(s)://host[:port]``: anything else would only fail as "no server
    there" (exit 1, the answer of a server that is down) instead of as the usage error it is."""
    from urllib.parse import urlsplit

    try:
        u = urlsplit(text)
        port = u.port  # a malformed port raises ValueError
    except ValueError:
        u, port = None, None
    if u is None or u.scheme not in ("http", "https") or not u.hostname or (port is not None and port < 1):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a server URL, http(s)://HOST[:PORT]")
    return text


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
        if not _can_write_in(parent) or (p.exists() and not os.access(p, os.W_OK)):
            raise argparse.ArgumentTypeError(f"{text!r} is not writable")
        return p

    return check


def _can_write_in(folder: Path) -> bool:
    """Whether a file can be made in ``folder``, by making one (``os.access`` says yes for root on
    ``/proc``, where no file can be made: the command would run for minutes, then fail to write)."""
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".toolkv-probe-"):
            return True
    except OSError:
        return False


def writable_dir(text: str) -> Path:
    """A folder the command will write into (made if missing): its nearest existing ancestor must
    be a writable folder, checked before the command runs."""
    p = Path(text)
    if p.exists() and not p.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is not a folder")
    q = p
    while not q.exists():
        q = q.parent
    if not q.is_dir() or not _can_write_in(q):
        raise argparse.ArgumentTypeError(f"{text!r} is not writable")
    return p
