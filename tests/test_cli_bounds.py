"""Every flag of every ``toolkv`` subcommand refuses nonsense at parse time, in one line, exit 2,
naming the flag and what it accepts; and every ``TOOLKV_*`` setting's refusal states the bound the
check applies.

The flags are discovered from the argparse parsers (``toolkv --help``'s subcommands and ``toolkv
bench agent``'s own), not listed here: a flag added with a plain ``type=int`` fails the first test,
and a bounded one is walked with values below, at and above its bounds, ``x``, ``nan`` and ``inf``.
The settings are discovered from ``ToolKVConfig``'s fields the same way.
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Iterator

import pytest

from toolkv.argtypes import ChoiceList, NumberList, Numeric
from toolkv.sglang.config import ToolKVConfig
from toolkv.tools import agent_bench
from toolkv.tools.cli import build_parser, main

# a valid value for each required positional, so that the flag after it is what is refused
POSITIONAL = {"url": "http://127.0.0.1:9", "what": "overhead", "which": "sessions"}


def parsers() -> dict[str, argparse.ArgumentParser]:
    """``command words -> parser`` for every subcommand."""
    p = build_parser()
    sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
    out: dict[str, argparse.ArgumentParser] = dict(sub.choices)
    out["bench agent"] = agent_bench.parser()
    return out


def flags() -> Iterator[tuple[str, argparse.Action]]:
    for name, sp in parsers().items():
        for a in sp._actions:
            if a.nargs != 0 and not isinstance(a, argparse._HelpAction):
                yield name, a


def argv(command: str, action: argparse.Action, value: str) -> list[str]:
    """``command`` with its required positionals, then ``action`` given ``value``."""
    sp = parsers()[command]
    words = command.split()
    if not action.option_strings:  # a positional: it is the value
        return [*words, value]
    for a in sp._actions:
        if not a.option_strings and a.nargs in (None, 1) and a.dest in POSITIONAL:
            words.append(POSITIONAL[a.dest])
    return [*words, f"{action.option_strings[0]}={value}"]  # "=": a value "-inf" is not a flag


def bad_values(t: object) -> list[str]:
    """Values the type ``t`` must refuse, made from the bound it states."""
    if isinstance(t, Numeric):
        out = ["x", "", "nan", "inf", "-inf"]
        if t.kind is int:
            out.append("1.5")
        assert t.lo is not None and t.lo >= 0, f"{t}: a flag that takes negative values"
        out.append(str(t.lo - 1 if t.kind is int else t.lo - 0.5))
        out.append("-1")
        if t.lo_open:
            out.append(str(t.lo if t.kind is float else int(t.lo)))
        if t.hi is not None:
            out.append(str(t.hi + 1 if t.kind is int else t.hi * 2 + 1))
            if t.hi_open:
                out.append(str(t.hi))
        return out
    if isinstance(t, NumberList):
        lo = t.item.lo if t.item.lo is not None else 0
        below = str(int(lo) - 1)
        return ["x", "", ",", "1,x", "-1", f"1,{below}", "1,,2", "nan"]
    if isinstance(t, ChoiceList):
        return ["nonsense", "", f"{t.choices[0]},nonsense"]
    raise AssertionError(t)


NUMERIC = [
    (name, a) for name, a in flags() if isinstance(a.type, Numeric | NumberList | ChoiceList) or a.choices
]


def test_no_flag_has_an_unbounded_number() -> None:
    """A number flag must say its bound (a type of toolkv.argtypes), or nonsense would pass the
    parser and surface later as a traceback or a silently empty run."""
    plain = [
        f"{name} {a.option_strings or a.dest}"
        for name, a in flags()
        if a.type in (int, float) or (isinstance(a.default, int | float) and not isinstance(a.default, bool)
        and not isinstance(a.type, Numeric))
    ]  # fmt: skip
    assert plain == []
    assert len(NUMERIC) > 60  # the walk below covers every bounded flag


def test_fleet_names_are_the_fleets_configurations() -> None:
    from toolkv.twin.cli import FLEET_NAMES
    from toolkv.twin.fleet import FLEET_CONFIGS

    assert tuple(FLEET_CONFIGS) == FLEET_NAMES


@pytest.mark.parametrize(
    ("command", "action"),
    NUMERIC,
    ids=[f"{n}:{a.option_strings[0] if a.option_strings else a.dest}" for n, a in NUMERIC],
)
def test_every_flag_refuses_nonsense_in_one_line(
    capsys: pytest.CaptureFixture[str], command: str, action: argparse.Action
) -> None:
    values = bad_values(action.type) if action.type is not None else []
    if action.choices:
        values += ["nonsense", "-1"]
    flag = action.option_strings[0] if action.option_strings else None
    for value in values:
        words = argv(command, action, value)
        with pytest.raises(SystemExit) as ei:
            main(words)
        err = capsys.readouterr().err
        lines = err.strip().splitlines()
        assert ei.value.code == 2, (words, err)
        assert len(lines) == 1 and "Traceback" not in err, (words, err)
        assert lines[0].startswith(f"toolkv {command}: error: argument "), (words, lines)
        if flag is not None:
            assert f"argument {flag}" in lines[0], (words, lines)
        # what is accepted: the bound in words, or argparse's list of choices
        said = lines[0]
        if isinstance(action.type, Numeric) and "invalid choice" not in said:
            assert action.type.describe() in said, (words, said)
        elif isinstance(action.type, ChoiceList) and "invalid choice" not in said:
            assert all(c in said for c in action.type.choices), (words, said)
        elif action.choices and "invalid choice" in said:
            assert all(repr(c) in said or str(c) in said for c in action.choices), (words, said)


@pytest.mark.parametrize(
    ("command", "action"),
    NUMERIC,
    ids=[f"{n}:{a.option_strings[0] if a.option_strings else a.dest}" for n, a in NUMERIC],
)
def test_every_default_is_within_its_bound(command: str, action: argparse.Action) -> None:
    """The bounds are not tighter than the defaults (a default is parsed by its type too)."""
    if action.default is None or action.type is None or action.default == []:
        return
    if isinstance(action.default, str) and callable(action.type):
        action.type(action.default)
    elif isinstance(action.type, Numeric):
        assert action.type.admits(action.default)


# ---- the TOOLKV_* settings --------------------------------------------------------------------------
BOUND = re.compile(
    r"expected (?:a finite number|an integer|a number) "
    r"(?:(?P<op>>=|>) (?P<lo>[-\d.e+]+)(?: and (?P<hop><=|<) (?P<hi>[-\d.e+]+))?"
    r"|from (?P<flo>[-\d.e+]+) to (?P<fhi>[-\d.e+]+)"
    r"|strictly between (?P<slo>[-\d.e+]+) and (?P<shi>[-\d.e+]+))"
)
NUMERIC_FIELDS = [
    f.name for f in ToolKVConfig.__dataclass_fields__.values() if f.type in ("float", "int", "int | None")
]


def _accepts(var: str, value: str) -> bool:
    try:
        ToolKVConfig.from_env({"TOOLKV_ENABLE": "1", var: value})
    except ValueError:
        return False
    return True


def _refusal(var: str, value: str) -> str:
    with pytest.raises(ValueError) as ei:
        ToolKVConfig.from_env({"TOOLKV_ENABLE": "1", var: value})
    msg = str(ei.value)
    assert "\n" not in msg and msg.startswith(f"{var}={value!r}: "), msg
    return msg


def test_every_numeric_setting_is_walked() -> None:
    assert len(NUMERIC_FIELDS) >= 20 and "ttl_s" in NUMERIC_FIELDS


@pytest.mark.parametrize("field", NUMERIC_FIELDS)
def test_a_settings_refusal_states_its_real_bound(field: str) -> None:
    """Each refused value's message states a bound; that bound is the one applied: a value at an
    included end is accepted, at an excluded end refused, and just inside accepted."""
    var = f"TOOLKV_{field.upper()}"
    integer = ToolKVConfig.__dataclass_fields__[field].type != "float"
    for value in ("-1", "0", "x", "nan", "inf", "1e300"):
        if _accepts(var, value):
            continue
        msg = _refusal(var, value)
        if value == "x" or (integer and not re.fullmatch(r"-?\d+", value)):  # not of the kind at all
            assert "expected" in msg, msg
            continue
        m = BOUND.search(msg)
        assert m is not None, msg
        if m["op"]:
            lo, lo_open = float(m["lo"]), m["op"] == ">"
            hi, hi_open = (float(m["hi"]), m["hop"] == "<") if m["hi"] else (None, False)
        elif m["flo"]:
            lo, lo_open, hi, hi_open = float(m["flo"]), False, float(m["fhi"]), False
        else:
            lo, lo_open, hi, hi_open = float(m["slo"]), True, float(m["shi"]), True
        v = float(value)
        # the refused value is outside what the message says is accepted
        inside = (
            math.isfinite(v)
            and (v > lo or (v == lo and not lo_open))
            and (hi is None or v < hi or (v == hi and not hi_open))
        )
        assert not inside, (msg, value)

        def text(x: float) -> str:
            return str(int(x)) if integer else repr(x)

        assert _accepts(var, text(lo)) is (not lo_open), (msg, "at the low end")
        step = 1 if integer else max(abs(lo) * 1e-3, 1e-3)
        assert _accepts(var, text(lo + step)), (msg, "just above the low end")
        if hi is not None:
            assert _accepts(var, text(hi)) is (not hi_open), (msg, "at the high end")


def test_ttl_minus_one_says_above_zero() -> None:
    msg = _refusal("TOOLKV_TTL_S", "-1")
    assert "> 0" in msg and ">= 0" not in msg, msg
