"""TLA+ values as TLC prints them, read into Python.

TLC prints states (in error traces, in ``-tool`` state messages, in ``-dump dot`` labels) as
``/\\ var = value`` conjuncts with values in TLA+ syntax. This module turns that text into plain
Python values, so that the spec's states can be compared with the implementation's abstract state.

A dumped state graph repeats the same conjunct text in thousands of states (most variables do not
change from one state to the next), so :func:`parse_state` memoises each conjunct's parse: reading a
24k-state graph is dominated by the distinct conjuncts, not by the states.

Only the standard library is imported.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, order=True)
class ModelValue:
    """A TLC model value (``n1``, ``NoNode``). Distinct from the string ``"n1"`` on purpose."""

    name: str

    def __repr__(self) -> str:
        return self.name


class FrozenDict(dict[Any, Any]):
    """A dict that can live inside a frozenset (a TLA+ set of records or functions).

    TLA+ values are immutable; this class only adds hashing, so treat instances as read-only.
    """

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(frozenset(self.items()))


_TOKEN_RE = re.compile(
    r"""
    \s*(?:
      (?P<str>"(?:[^"\\]|\\.)*")
    | (?P<num>-?\d+)
    | (?P<sym><<|>>|\|->|:>|@@|\.\.|[{}\[\](),])
    | (?P<ident>[A-Za-z_][A-Za-z0-9_]*)
    )""",
    re.VERBOSE,
)


def _tokens(text: str) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    pos = 0
    text = text.rstrip()
    while pos < len(text):
        m = _TOKEN_RE.match(text, pos)
        if m is None or m.end() == pos:
            raise ValueError(f"cannot tokenize TLA+ value at {pos}: {text[pos : pos + 40]!r}")
        kind = m.lastgroup
        assert kind is not None
        out.append((kind, m.group(kind)))
        pos = m.end()
        while pos < len(text) and text[pos].isspace():
            pos += 1
    return out


def _unquote(tok: str) -> str:
    body = tok[1:-1]
    return re.sub(r"\\(.)", lambda m: {"n": "\n", "t": "\t"}.get(m.group(1), m.group(1)), body)


class _ValueParser:
    def __init__(self, text: str) -> None:
        self.toks = _tokens(text)
        self.i = 0

    def peek(self) -> tuple[str, str] | None:
        return self.toks[self.i] if self.i < len(self.toks) else None

    def take(self, expected: str | None = None) -> tuple[str, str]:
        tok = self.peek()
        if tok is None:
            raise ValueError("unexpected end of TLA+ value")
        if expected is not None and tok[1] != expected:
            raise ValueError(f"expected {expected!r}, got {tok[1]!r}")
        self.i += 1
        return tok

    def at(self, sym: str) -> bool:
        tok = self.peek()
        return tok is not None and tok[0] == "sym" and tok[1] == sym

    def items(self, close: str) -> list[Any]:
        out: list[Any] = []
        if self.at(close):
            self.take(close)
            return out
        while True:
            out.append(self.value())
            if self.at(","):
                self.take(",")
                continue
            self.take(close)
            return out

    def value(self) -> Any:
        kind, text = self.take()
        if kind == "str":
            return _unquote(text)
        if kind == "num":
            first = int(text)
            if self.at(".."):  # an interval printed as a..b
                self.take("..")
                hi = int(self.take()[1])
                return frozenset(range(first, hi + 1))
            return first
        if kind == "ident":
            if text == "TRUE":
                return True
            if text == "FALSE":
                return False
            return ModelValue(text)
        if text == "{":
            return frozenset(self.items("}"))
        if text == "<<":
            return tuple(self.items(">>"))
        if text == "[":
            return self.record()
        if text == "(":
            return self.function()
        raise ValueError(f"unexpected token {text!r} in TLA+ value")

    def record(self) -> FrozenDict:
        rec = FrozenDict()
        if self.at("]"):
            self.take("]")
            return rec
        while True:
            kind, key = self.take()
            if kind != "ident":
                raise ValueError(f"record field name expected, got {key!r}")
            self.take("|->")
            rec[key] = self.value()
            if self.at(","):
                self.take(",")
                continue
            self.take("]")
            return rec

    def function(self) -> Any:
        # Either ``(k1 :> v1 @@ k2 :> v2)`` or a parenthesised value.
        first = self.value()
        if not self.at(":>"):
            self.take(")")
            return first
        fn = FrozenDict()
        key = first
        while True:
            self.take(":>")
            fn[key] = self.value()
            if self.at("@@"):
                self.take("@@")
                key = self.value()
                continue
            self.take(")")
            return fn


def parse_value(text: str) -> Any:
    """Parse TLC's printed form of a TLA+ value into Python.

    Integers -> int, strings -> str, TRUE/FALSE -> bool, model values -> :class:`ModelValue`,
    sets -> frozenset, sequences/tuples (and functions over 1..n, which TLC prints the same way)
    -> tuple, records and ``:>``/``@@`` functions -> :class:`FrozenDict` (a dict).
    """
    p = _ValueParser(text)
    v = p.value()
    if p.peek() is not None:
        raise ValueError(f"trailing text after TLA+ value: {p.toks[p.i :]!r}")
    return v


@functools.lru_cache(maxsize=1 << 16)
def _parse_conjunct(chunk: str) -> tuple[str, Any]:
    """One ``var = value`` conjunct. Cached: parsed values are immutable (frozenset, tuple,
    :class:`FrozenDict` treated as read-only), so states may share them."""
    m = _CONJ_RE.match(chunk)
    if m is None:
        raise ValueError(f"not a state conjunct: {chunk[:80]!r}")
    return m.group(1), parse_value(m.group(2))


@functools.lru_cache(maxsize=1 << 16)
def _plain_conjunct(chunk: str) -> tuple[str, Any]:
    name, value = _parse_conjunct(chunk)
    return name, to_plain(value)


def parse_conjunct(chunk: str, plain: bool = False) -> tuple[str, Any]:
    """``(name, value)`` of one ``/\\ var = value`` conjunct (memoised; values are read-only)."""
    return _plain_conjunct(chunk) if plain else _parse_conjunct(chunk)


def parse_state(text: str, plain: bool = False) -> dict[str, Any]:
    """Parse a state printed as ``/\\ var = value`` conjuncts (or one ``var = value``).

    ``plain=True`` returns :func:`to_plain` values. Values are shared between states that print
    the same conjunct: treat them as read-only."""
    parse = _plain_conjunct if plain else _parse_conjunct
    out: dict[str, Any] = {}
    for chunk in _state_conjuncts(text):
        name, value = parse(chunk)
        out[name] = value
    return out


_CONJ_RE = re.compile(r"^(?:/\\\s+)?([A-Za-z_][A-Za-z0-9_]*)\s+=\s+(.*)$", re.DOTALL)


def _state_conjuncts(text: str) -> Iterator[str]:
    # TLC wraps long values onto indented continuation lines; a conjunct starts at "/\ ".
    chunks: list[str] = []
    for line in text.splitlines():
        if not line.strip():
            continue
        if line.startswith("/\\") or not chunks:
            chunks.append(line.strip())
        else:
            chunks[-1] += " " + line.strip()
    yield from chunks


def to_plain(value: Any) -> Any:
    """Convert parsed TLA+ values to JSON-friendly Python (sets become sorted lists)."""
    if isinstance(value, ModelValue):
        return value.name
    if isinstance(value, Mapping):
        return {str(to_plain(k)): to_plain(v) for k, v in value.items()}
    if isinstance(value, frozenset):
        return sorted((to_plain(v) for v in value), key=repr)
    if isinstance(value, tuple):
        return [to_plain(v) for v in value]
    return value


__all__ = ["FrozenDict", "ModelValue", "parse_conjunct", "parse_state", "parse_value", "to_plain"]
