"""TLC's ``-tool`` output: numbered messages in, a verdict out.

With ``-tool`` TLC wraps every message in ``@!@!@STARTMSG code:severity @!@!@`` …
``@!@!@ENDMSG code @!@!@``. The codes are TLC's own message identifiers (``tlc2.output.EC``), stable
across releases, and TLC also ends with an exit code per kind of result. A verdict is read from
both and the two must agree; the English text is read only for what no code carries (the name of
the violated invariant, a state's values, statistics).

Messages nest (TLC prints an Assert's message inside the "evaluating invariant failed" message), so
the reader keeps a stack. Lines outside every message (SANY's progress lines) are ignored.

Only the standard library is imported.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

from toolkv.verify.tla.values import parse_state


class Code(IntEnum):
    """The TLC message codes (``tlc2.output.EC``) this reader acts on."""

    ASSUMPTION_FALSE = 2104
    ASSUMPTION_EVALUATION_ERROR = 2105
    INVARIANT_VIOLATED_INITIAL = 2107
    PROPERTY_VIOLATED_INITIAL = 2108
    INVARIANT_VIOLATED_BEHAVIOR = 2110
    INVARIANT_EVALUATION_FAILED = 2111
    ACTION_PROPERTY_VIOLATED_BEHAVIOR = 2112
    ACTION_PROPERTY_EVALUATION_FAILED = 2113
    DEADLOCK_REACHED = 2114
    TEMPORAL_PROPERTY_VIOLATED = 2116
    BEHAVIOR_UP_TO_THIS_POINT = 2121
    BACK_TO_STATE = 2122
    VALUE_ASSERT_FAILED = 2132
    SUCCESS = 2193
    SEARCH_DEPTH = 2194
    STATS = 2199
    STATE_PRINT2 = 2217
    STATE_PRINT3 = 2218  # "k: Stuttering"
    VERSION = 2262
    COUNTER_EXAMPLE = 2264
    COVERAGE_NEXT = 2772
    COVERAGE_INIT = 2773
    PARSING_FAILED = 3002


class Severity(IntEnum):
    """``tlc2.output.MP`` message classes."""

    NONE = 0
    ERROR = 1
    TLCBUG = 2
    WARNING = 3
    STATE = 4


#: What a run established. "pass" and the violations are results about the model; the rest say that
#: no result could be had (the model or its config is broken, or TLC failed).
OUTCOMES = (
    "pass",
    "invariant",
    "action_property",
    "temporal",
    "deadlock",
    "assumption",
    "evaluation",
    "parse",
    "config",
    "error",
)

#: Exit codes of TLC 2.15 (``tlc2.output.EC.ExitStatus``) per outcome. TLC 2.15 exits 13 (the
#: liveness code) for a violated action property. An outcome whose exit code disagrees is an error.
EXIT_CODES: dict[str, frozenset[int]] = {
    "pass": frozenset({0}),
    "assumption": frozenset({10}),
    "deadlock": frozenset({11}),
    "invariant": frozenset({12}),
    "action_property": frozenset({12, 13}),
    "temporal": frozenset({13}),
    "evaluation": frozenset({75, 76, 77}),
    "parse": frozenset({150}),
    "config": frozenset({151}),
}

_VIOLATIONS: dict[int, str] = {
    Code.INVARIANT_VIOLATED_BEHAVIOR: "invariant",
    Code.INVARIANT_VIOLATED_INITIAL: "invariant",
    Code.ACTION_PROPERTY_VIOLATED_BEHAVIOR: "action_property",
    Code.PROPERTY_VIOLATED_INITIAL: "action_property",
    Code.TEMPORAL_PROPERTY_VIOLATED: "temporal",
    Code.DEADLOCK_REACHED: "deadlock",
    Code.ASSUMPTION_FALSE: "assumption",
    Code.ASSUMPTION_EVALUATION_ERROR: "evaluation",
    Code.INVARIANT_EVALUATION_FAILED: "evaluation",
    Code.ACTION_PROPERTY_EVALUATION_FAILED: "evaluation",
    Code.VALUE_ASSERT_FAILED: "evaluation",
    Code.PARSING_FAILED: "parse",
}

_START_RE = re.compile(r"^@!@!@STARTMSG (\d+):(\d+) @!@!@$")
_END_RE = re.compile(r"^@!@!@ENDMSG (\d+) @!@!@$")


@dataclass(frozen=True)
class Message:
    code: int
    severity: int
    body: str


def parse_messages(text: str) -> list[Message]:
    """Every ``-tool`` message in order of appearance (nested ones included, in start order)."""
    out: list[Message | None] = []
    stack: list[tuple[int, int, int, list[str]]] = []  # (slot in out, code, severity, lines)
    for line in text.splitlines():
        if m := _START_RE.match(line):
            out.append(None)
            stack.append((len(out) - 1, int(m.group(1)), int(m.group(2)), []))
        elif (m := _END_RE.match(line)) and stack and stack[-1][1] == int(m.group(1)):
            slot, code, sev, lines = stack.pop()
            out[slot] = Message(code, sev, "\n".join(lines).strip("\n"))
        elif stack:
            stack[-1][3].append(line)
    for slot, code, sev, lines in stack:  # cut off (timeout): keep what was printed
        out[slot] = Message(code, sev, "\n".join(lines))
    return [m for m in out if m is not None]


@dataclass
class TraceState:
    """One state of an error trace: its 1-based number, the action that led to it, its values."""

    index: int
    action: str | None  # None for the initial state
    location: str  # TLC's "<...>" text, e.g. "ToolStart line 168, col 5 to ... of module ToolKV"
    values: dict[str, Any]


@dataclass
class Trace:
    states: list[TraceState]
    #: liveness traces end in a lasso: the 1-based state the last state loops back to, if any
    loop_to: int | None = None
    #: liveness traces may instead end by stuttering forever in the last state
    stuttering: bool = False


@dataclass
class TlcResult:
    """What one TLC run established.

    ``outcome`` is one of :data:`OUTCOMES`; ``violated`` names the invariant or action property
    when TLC names it (it does not name a violated temporal property); ``coverage`` maps each
    action of the next-state relation to ``(distinct, generated)`` states when ``-coverage`` ran.
    """

    outcome: str
    violated: str | None = None
    generated: int | None = None
    distinct: int | None = None
    left: int | None = None
    depth: int | None = None
    seconds: float = 0.0
    exit_code: int | None = None
    version: str | None = None
    revision: str | None = None
    trace: Trace | None = None
    coverage: dict[str, tuple[int, int]] | None = None
    output: str = ""
    error_lines: list[str] = field(default_factory=list)
    #: read back from ``SPEC_CHECK_TLC_CACHE`` (an earlier run with the same inputs), not run again
    cached: bool = False


_STATS_RE = re.compile(
    r"([\d,]+) states generated, ([\d,]+) distinct states found, ([\d,]+) states left on queue"
)
_DEPTH_RE = re.compile(r"depth of the complete state graph search is ([\d,]+)")
_VERSION_RE = re.compile(r"TLC2 Version (\S+).*\(rev: (\w+)\)")
_NAMED_RE = re.compile(r"(?:Invariant|Action property|property) (\S+) is violated")
_STATE_RE = re.compile(r"^(\d+): (.*)$", re.DOTALL)
_BACK_RE = re.compile(r"^(?:(\d+): Back to state|Back to state (\d+))")  # -tool form, then text form
_COVERAGE_RE = re.compile(r"^<(\w+) line .*>: (\d+):(\d+)$")


def _int(s: str) -> int:
    return int(s.replace(",", ""))


def _trace(msgs: list[Message]) -> Trace | None:
    starts = [
        i for i, m in enumerate(msgs) if m.code in (Code.BEHAVIOR_UP_TO_THIS_POINT, Code.COUNTER_EXAMPLE)
    ]
    if not starts:
        return None
    trace = Trace(states=[])
    for m in msgs[starts[-1] + 1 :]:
        if m.code == Code.STATE_PRINT2:
            head, _, body = m.body.partition("\n")
            hm = _STATE_RE.match(head)
            if hm is None:
                raise ValueError(f"unexpected state header {head!r}")
            loc = hm.group(2).strip()
            loc = loc[1:-1] if loc.startswith("<") and loc.endswith(">") else loc
            action = None if loc.startswith("Initial predicate") else loc.split(" ", 1)[0]
            trace.states.append(TraceState(int(hm.group(1)), action, loc, parse_state(body)))
        elif m.code == Code.STATE_PRINT3:
            trace.stuttering = True
        elif m.code == Code.BACK_TO_STATE:
            bm = _BACK_RE.match(m.body.strip())
            if bm:
                trace.loop_to = int(bm.group(1) or bm.group(2))
        elif m.severity != Severity.STATE and trace.states:
            break
    return trace


def verdict(msgs: list[Message], exit_code: int | None) -> tuple[str, str | None, list[str]]:
    """(outcome, violated name, notes) from the messages, checked against the exit code."""
    notes: list[str] = []
    outcome: str | None = None
    violated: str | None = None
    for m in msgs:
        if m.code == Code.SUCCESS and outcome is None:
            outcome = "pass"
        elif m.code in _VIOLATIONS and outcome in (None, "pass"):
            outcome = _VIOLATIONS[m.code]
            if named := _NAMED_RE.search(m.body):
                violated = named.group(1)
        if m.severity in (Severity.ERROR, Severity.TLCBUG):
            notes.append(f"{m.code}: {m.body.strip().splitlines()[0] if m.body.strip() else ''}")
    if outcome is None:
        by_exit = {c: o for o, cs in EXIT_CODES.items() for c in cs if o in ("parse", "config")}
        outcome = by_exit.get(exit_code, "error") if exit_code is not None else "error"
        return outcome, None, notes
    allowed = EXIT_CODES.get(outcome)
    if exit_code is not None and allowed is not None and exit_code not in allowed:
        notes.append(f"TLC said {outcome} but exited {exit_code}")
        return "error", violated, notes
    return outcome, violated, notes


def parse_tool_output(text: str, exit_code: int | None = None) -> TlcResult:
    """Read a ``-tool`` mode run: verdict, statistics, version, trace, coverage."""
    msgs = parse_messages(text)
    outcome, violated, notes = verdict(msgs, exit_code)
    res = TlcResult(outcome=outcome, violated=violated, exit_code=exit_code, output=text, error_lines=notes)
    coverage: dict[str, tuple[int, int]] = {}
    for m in msgs:
        if m.code == Code.VERSION and (vm := _VERSION_RE.search(m.body)):
            res.version, res.revision = vm.group(1), vm.group(2)
        elif m.code == Code.STATS and (sm := _STATS_RE.search(m.body)):
            res.generated, res.distinct, res.left = (_int(x) for x in sm.groups())
        elif m.code == Code.SEARCH_DEPTH and (dm := _DEPTH_RE.search(m.body)):
            res.depth = _int(dm.group(1))
        elif m.code == Code.COVERAGE_NEXT and (cm := _COVERAGE_RE.match(m.body.strip())):
            d, g = coverage.get(cm.group(1), (0, 0))
            coverage[cm.group(1)] = (d + int(cm.group(2)), g + int(cm.group(3)))
    res.coverage = coverage or None
    if outcome in ("invariant", "action_property", "temporal", "deadlock", "evaluation"):
        try:
            res.trace = _trace(msgs)
        except ValueError as exc:  # keep the verdict even if a value is in a form we do not know
            res.error_lines.append(f"trace not parsed: {exc}")
    return res


__all__ = [
    "EXIT_CODES",
    "OUTCOMES",
    "Code",
    "Message",
    "Severity",
    "TlcResult",
    "Trace",
    "TraceState",
    "parse_messages",
    "parse_tool_output",
    "verdict",
]
