"""``toolkv trace-check --decisions LOG...``: a live server's decision log checked against the spec.

A live server has no abstract state to dump, but its plugin writes one line per control decision
and per protection ended (:mod:`toolkv.sglang.observe`)::

    toolkv decision op=tool_start session=agent-7 epoch=3 state=Offloading tokens=2048 outcome=ok reason=- rank=0

Each line names the session, its phase and epoch *after* the decision, and whether the decision
was taken. That is enough to replay every session's projection of the spec: the session's phase
machine, which is ``SESSION_TRANSITIONS`` in :mod:`toolkv.core.lifecycle` (the table
``model_tests/test_tables.py`` checks against TLC's state graph of ``spec/ToolKV.tla``). The rows
are read from that table here, never copied.

Per session, in log order (rank 0; with several ranks in the log, every rank must have logged the
same decisions in the same order):

* an accepted decision (``outcome=ok``) must be a table row of its action(s) from the phase the
  previous line left (``tool_start``: the policy's choice among ToolStart, Keep and LetGo);
* a decision not taken (refused, skipped, or a ``kv_hints`` report) changes nothing: the phase and
  the epoch stay what they were;
* epochs: ToolStart, Keep and LetGo raise it by one, nothing else changes it; an accepted
  ``tool_end`` carries the current one, a ``stale_epoch`` refusal one that is not current;
* between two lines, only the steps the plugin takes without a line may happen (*silent* steps,
  :data:`SILENT`): write and load acks, early restores, demotions, admissions, finished turns,
  the hand-over's TTL, a flush, and the idle expiry's close; each only where the table has the row;
* a session id that comes back after ``Closed`` is a new spec session (``New``, then its first
  turn), continuing the old epochs: it is ``Running`` until a new ToolStart.

What a log cannot show is said in docs/reliability.md ("Live decision logs checked against the
spec"): nodes, tiers, pools and locks (the spec's node-level facts) are invisible here; the fuzz
campaign's full-state traces (``toolkv trace-check FILE``) check those.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from toolkv.core import lifecycle
from toolkv.errors import InputError

# ---- the session projection, from the lifecycle table ---------------------------------------------
UNKNOWN = "-"  # no record: never seen, or forgotten (closed history full, or a restarted server)
REL: frozenset[tuple[str, str, str]] = frozenset(lifecycle.relation(lifecycle.SESSION_TRANSITIONS))
STATES: frozenset[str] = frozenset(lifecycle.SESSION_STATES)

# The spec actions that raise the session's epoch (ToolKV.tla: ToolStart, Keep, LetGo); every
# other action keeps it (EpochMonotone). tests/test_trace_decisions.py checks this against the spec.
EPOCH_RAISING: frozenset[str] = frozenset({"tool_start", "keep", "let_go"})

# The manager's "holds nothing" phases: the idle expiry closes a session only there
# (ToolKVManager.forget_idle, manager.IDLE).
IDLE: frozenset[str] = frozenset({"Running", "Runnable", "Expired", "Lost", "Released"})

# Table rows the plugin takes without writing a line at that moment, by trigger: a predicate on
# (source, dest). Each is a row of the table; only its logging is decided here.
SILENT_WHY: dict[str, str] = {
    "write_ack": "the tick processed the offload's write acks",
    "load_ack": "the tick processed the restore's load acks",
    "prefetch": "the tick started an early restore",
    "demote": "another session's tool_start demoted it to make host room (older logs have no line)",
    "admit": "its next request was admitted",
    "unpin": "the tick gave its hand-over's pin up to queued requests",
    "insert": "a turn finished",
    "ttl_sweep": "the hand-over's TTL ran out",
    "tree_reset": "the cache was flushed (its line comes at the next tick)",
    "close": "the idle expiry forgot it",
}


def _silent(trigger: str, src: str, dst: str) -> bool:
    if trigger == "ttl_sweep":
        return dst != "Expired"  # an expiry that ends a protection is logged (observe._log_ended)
    if trigger == "close":
        return src in IDLE  # forget_idle; a client's close is logged
    return trigger in SILENT_WHY


SILENT: frozenset[tuple[str, str, str]] = frozenset((s, d, t) for s, d, t in REL if _silent(t, s, d))
_SILENT_FROM: dict[str, frozenset[str]] = {
    src: frozenset(d for s, d, _t in SILENT if s == src) for src in {s for s, _d, _t in SILENT}
}

# What each logged op is, in spec actions (triggers of the table).
OP_TRIGGERS: dict[str, tuple[str, ...]] = {
    "tool_start": ("tool_start", "keep", "let_go"),  # the policy's choice (ToolKVManager.tool_start)
    "auto_offload": ("tool_start", "keep", "let_go"),  # zero-change: the same tool_start
    "retain": ("keep",),  # kv_hints' retain
    "tool_end": ("tool_end", "park"),  # restore, or park when its request would wait (load-adaptive)
    "restore_on_request": ("tool_end", "park"),  # the session's next request ends its tool call
    "close": ("close",),
    "admit": ("admit",),
    "demote": ("demote",),  # inside another session's tool_start, which needed the host room
    "ttl_sweep": ("ttl_sweep",),
    "tree_reset": ("tree_reset",),
}
# steps a call may take after its own before its line is written
IN_CALL: dict[str, tuple[str, ...]] = {"tool_end": ("admit",), "restore_on_request": ("admit",)}
# ops that only report (never change anything, whatever their outcome)
# (l3_store: a session stored to L3 or read back from it by the manager; it stays Offloaded, only
# its L3 sub-phase moves, which spec/storage/StorageTier.tla checks)
REPORTS: frozenset[str] = frozenset({"kv_hints", "l3_store"})
# a turn finished while toolkv held the session's KV: its tool call was ended if it could be, then
# the record closed and re-opened for the turn (SchedulerToolKV.on_finished), epoch kept
REOPEN = "turn_while_protected"

Config = tuple[str, int | None]  # (phase, epoch); phase UNKNOWN has no epoch


def _record_steps(c: Config) -> Iterator[Config]:
    """Steps of the record, not of the spec: a new record is a new spec session (``New``)."""
    state, epoch = c
    if state == UNKNOWN:
        yield ("New", 0)  # first turn of an unknown id
    elif state == "Closed":
        yield ("New", epoch)  # the id is reused: the new record continues the old epochs
        yield (UNKNOWN, None)  # dropped from the closed history


def closure(configs: Iterable[Config]) -> frozenset[Config]:
    """Every configuration reachable by silent steps (and record steps)."""
    seen = set(configs)
    todo = list(seen)
    while todo:
        c = todo.pop()
        nxt = [(d, c[1]) for d in _SILENT_FROM.get(c[0], ())]
        nxt += list(_record_steps(c))
        for n in nxt:
            if n not in seen:
                seen.add(n)
                todo.append(n)
    return frozenset(seen)


def apply(configs: Iterable[Config], triggers: Iterable[str]) -> frozenset[Config]:
    """One step of one of ``triggers`` from any of ``configs``, by the table."""
    trig = set(triggers)
    out = set()
    for state, epoch in configs:
        for s, d, t in REL:
            if s == state and t in trig and epoch is not None:
                out.add((d, epoch + 1 if t in EPOCH_RAISING else epoch))
    return frozenset(out)


# ---- parsing ------------------------------------------------------------------------------------------
MARK = "toolkv decision "
_FIELD = re.compile(r'([A-Za-z_]\w*)=("(?:[^"\\]|\\.)*"|\S*)')
_START = re.compile(r"toolkv enabled on scheduler tp_rank=(\d+)")
_RESET_CLOSE = re.compile(r"tree reset while session (.*) was (\w+): closing it\s*$")
_TP = re.compile(r"\bTP(\d+)\b")


@dataclass(frozen=True)
class Decision:
    """One line of the log: a decision line, or one of the two other events the checker reads
    (``op=<server start>``: the scheduler side started, every session is unknown again;
    ``op=<reset close>``: a flush closed a session mid-copy, an ERROR line)."""

    file: str
    line: int  # 1-based line number in its file
    op: str
    session: str | None
    epoch: int | None
    state: str  # UNKNOWN for "-"
    outcome: str
    reason: str
    rank: int
    asked: int | str | None = None  # tool_end: the epoch the call carried
    l3: str | None = None  # the session's copy in L3: storing, stored, fetching
    text: str = ""

    def key(self) -> tuple[Any, ...]:
        """What every rank must agree on."""
        return (self.op, self.session, self.epoch, self.state, self.outcome, self.reason)

    def where(self) -> str:
        return f"{self.file}:{self.line}"


SERVER_START = "<server start>"
RESET_CLOSE = "<reset close>"


def _value(raw: str) -> str | None:
    if raw.startswith('"'):
        try:
            v = json.loads(raw)
        except json.JSONDecodeError:
            return raw
        return str(v)
    return None if raw in ("", "-") else raw


def _int(v: str | None) -> int | None:
    if v is None:
        return None
    try:
        return int(v)
    except ValueError:
        return None


def parse_line(text: str, file: str = "", line: int = 0) -> Decision | None:
    """The event of one log line, or None. Whatever precedes toolkv's message (sglang's
    ``[time TP0]`` prefix, a logging format's level and logger name) is ignored."""
    i = text.find(MARK)
    if i < 0:
        m = _START.search(text)
        if m:
            r = int(m.group(1))
            return Decision(file, line, SERVER_START, None, None, UNKNOWN, "ok", "", r, text=text)
        m = _RESET_CLOSE.search(text)
        if m:
            tp = _TP.search(text[: m.start()])
            r = int(tp.group(1)) if tp else 0
            return Decision(
                file, line, RESET_CLOSE, m.group(1), None, m.group(2), "ok", "reset_mid_copy", r, text=text
            )
        return None
    f = {k: _value(v) for k, v in _FIELD.findall(text[i + len(MARK) :])}
    op = f.get("op")
    if op is None:
        raise InputError(f"{file}:{line}: a decision line without op=: {text.strip()[:200]}")
    asked: int | str | None = None
    if "asked" in f:
        a = f["asked"]
        asked = _int(a) if _int(a) is not None else a
    return Decision(
        file=file,
        line=line,
        op=op,
        session=f.get("session"),
        epoch=_int(f.get("epoch")),
        state=f.get("state") or UNKNOWN,
        outcome=f.get("outcome") or "",
        reason=f.get("reason") or "",
        rank=_int(f.get("rank")) or 0,
        asked=asked,
        l3=f.get("l3"),
        text=text.rstrip("\r\n"),
    )


def read_log(path: Path) -> list[Decision]:
    out = []
    with open(path, encoding="utf-8", errors="replace") as fh:
        for no, raw in enumerate(fh, 1):
            d = parse_line(raw, str(path), no)
            if d is not None:
                out.append(d)
    if not any(d.op not in (SERVER_START, RESET_CLOSE) for d in out):
        raise InputError(
            f"{path}: no 'toolkv decision' line (a server log with toolkv's logger at INFO is needed)"
        )
    return out


# ---- checking ------------------------------------------------------------------------------------------
class Violation(StrEnum):
    TRANSITION = "transition"  # an accepted decision the table does not allow from that phase
    REFUSED_CHANGED = "refused_changed"  # a decision not taken, yet the phase changed
    EPOCH = "epoch"  # an epoch the spec does not give there
    RESET_MID_COPY = "reset_mid_copy"  # a flush during a copy (spec TreeReset needs none in flight)
    UNKNOWN_OP = "unknown_op"  # an op or phase the checker does not know
    RANKS_DISAGREE = "ranks_disagree"  # TP ranks logged different decisions


@dataclass(frozen=True)
class TraceLine:
    line: int
    text: str


@dataclass
class IllegalDecision:
    kind: Violation
    file: str
    line: int
    session: str | None
    op: str
    message: str
    trace: list[TraceLine] = field(default_factory=list)  # the session's lines up to this one
    trace_omitted: int = 0  # earlier lines of the session not shown

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["kind"] = self.kind.value
        return d


@dataclass
class DecisionCheckResult:
    files: list[str]
    ranks: list[int]
    sessions: int
    lines: int  # decision lines checked (the checked rank's)
    errors: list[IllegalDecision]

    @property
    def ok(self) -> bool:
        return not self.errors

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "files": self.files,
            "ranks": self.ranks,
            "sessions": self.sessions,
            "lines": self.lines,
            "illegal": len(self.errors),
            "errors": [e.to_json() for e in self.errors],
        }


TRACE_SHOWN = 40


def _fmt_states(cs: Iterable[Config]) -> str:
    return "{" + ", ".join(sorted({s for s, _ in cs})) + "}"


class _Session:
    def __init__(self, sid: str) -> None:
        self.sid = sid
        self.configs: frozenset[Config] = frozenset({(UNKNOWN, None)})
        self.trace: list[TraceLine] = []
        self.failed = False

    def last(self) -> str:
        (state, epoch), *rest = sorted(self.configs, key=str)
        if rest:
            return _fmt_states(self.configs)
        return "unknown (no record)" if state == UNKNOWN else f"{state} at epoch {epoch}"


def _epoch_of(cs: Iterable[Config]) -> str:
    es = sorted({e for _, e in cs if e is not None})
    return " or ".join(map(str, es)) if es else "none"


def step(sess: _Session, d: Decision) -> tuple[Violation, str] | None:
    """Check one line of a session; on success the session's configuration becomes the line's."""
    here = closure(sess.configs)
    seen: Config = (d.state, d.epoch if d.state != UNKNOWN else None)
    if d.state != UNKNOWN and d.state not in STATES:
        return Violation.UNKNOWN_OP, f"phase {d.state!r} is not a phase of the session table"
    if d.op == RESET_CLOSE:
        # the flush happened with this session's copy in flight (Offloading/Restoring/Prefetching):
        # spec TreeReset is not enabled then; the implementation closes the session.
        return Violation.RESET_MID_COPY, (
            f"a flush reset the tree while the session was {d.state} (a copy in flight): spec TreeReset "
            f"needs no write or load pending, and no row leads from {d.state} to Closed by tree_reset"
        )
    taken = d.outcome == "ok" and d.op not in REPORTS
    if d.op == REOPEN and taken:
        ended = closure(here | apply(here, ["tool_end"]))
        held = {c for c in ended if c[0] in lifecycle.HOLDING and (c[0], "Closed", "close") in REL}
        reopened = {("Running", e) for _, e in held}
        if seen in reopened:
            sess.configs = frozenset({seen})
            return None
        if d.state == "Running" and any(s == "Running" for s, _ in reopened):
            return (
                Violation.EPOCH,
                f"a re-opened record keeps its epoch ({_epoch_of(reopened)}), not {d.epoch}",
            )
        return Violation.TRANSITION, (
            f"{REOPEN}: closes and re-opens a session whose KV toolkv holds; it was {sess.last()}"
            f" (reachable without a line: {_fmt_states(here)}), none of them held"
        )
    if not taken:
        if d.op not in OP_TRIGGERS and d.op not in REPORTS and d.op != REOPEN:
            return Violation.UNKNOWN_OP, f"op {d.op!r} is not a decision the checker knows"
        if seen in here:
            if (
                d.op == "tool_end"
                and d.reason == "stale_epoch"
                and d.epoch is not None
                and d.asked == d.epoch
            ):
                return Violation.EPOCH, f"tool_end refused as stale an epoch that is current ({d.asked})"
            sess.configs = frozenset({seen})
            return None
        if any(s == d.state for s, _ in here):
            return Violation.EPOCH, (
                f"{d.op} {d.outcome} ({d.reason or '-'}) changed the epoch: it was {_epoch_of(here)}, the line"
                f" says {d.epoch}"
            )
        return Violation.REFUSED_CHANGED, (
            f"{d.op} {d.outcome} ({d.reason or '-'}) leaves the session {d.state}; it was {sess.last()}, and"
            f" without a decision it can only be in {_fmt_states(here)}"
        )
    triggers = OP_TRIGGERS.get(d.op)
    if triggers is None:
        return Violation.UNKNOWN_OP, f"op {d.op!r} is not a decision the checker knows"
    if d.op in ("tool_end", "restore_on_request") and d.state == "Offloaded" and d.l3 == "fetching":
        # A copy in L3 is read back to the host first: the call is accepted and the session stays
        # Offloaded until the read's ack, when the manager starts the host->GPU restore at a tick
        # (no line). So the session is either still reading, or already where the call leads.
        if seen not in here:
            return Violation.TRANSITION, (
                f"accepted {d.op} of a session read back from L3 leaves it {d.state} epoch {d.epoch}; it"
                f" was {sess.last()} (reachable without a line: {_fmt_states(here)})"
            )
        if d.op == "tool_end" and isinstance(d.asked, int) and d.asked != d.epoch:
            return Violation.EPOCH, f"tool_end accepted epoch {d.asked}; the session's epoch is {d.epoch}"
        sess.configs = frozenset({seen}) | apply({seen}, triggers)
        return None
    after = apply(here, triggers)
    # the line is written right after the call: the one step a call takes after its own is the
    # admission of a request that was admitted while the load ran (ToolKVManager.hand_over)
    after |= apply(after, IN_CALL.get(d.op, ()))
    if d.op == "tree_reset":
        # the flush reset the tree when it ran; its line comes at the next tick, after lines of
        # the same iteration that may already show the session Lost
        after |= here
    if seen in after:
        if d.op == "tool_end" and isinstance(d.asked, int) and d.asked != d.epoch:
            return Violation.EPOCH, f"tool_end accepted epoch {d.asked}; the session's epoch is {d.epoch}"
        sess.configs = frozenset({seen})
        return None
    if any(s == d.state for s, _ in after):
        want = _epoch_of(c for c in after if c[0] == d.state)
        if d.op in ("tool_end", "restore_on_request"):
            return Violation.EPOCH, (
                f"accepted {d.op} carries epoch {d.epoch}; the session's current epoch is {want}"
            )
        return Violation.EPOCH, f"accepted {d.op} leaves epoch {d.epoch}; the spec gives {want}"
    rows = sorted({(s, dd, t) for s, dd, t in REL if t in triggers and dd == d.state})
    via = ", ".join(f"{s} -{t}-> {dd}" for s, dd, t in rows) or "none"
    return Violation.TRANSITION, (
        f"accepted {d.op} ({'/'.join(triggers)}) cannot lead to {d.state}: the session was {sess.last()}"
        f" (reachable without a line: {_fmt_states(here)}); table rows into {d.state} by it: {via}"
    )


def _ranks_agree(by_rank: dict[int, list[Decision]]) -> list[IllegalDecision]:
    ranks = sorted(by_rank)
    base = by_rank[ranks[0]]
    out = []
    for r in ranks[1:]:
        other = by_rank[r]
        for i in range(max(len(base), len(other))):
            a = base[i] if i < len(base) else None
            b = other[i] if i < len(other) else None
            if a is not None and b is not None and a.key() == b.key():
                continue
            at = b or a
            assert at is not None
            out.append(
                IllegalDecision(
                    Violation.RANKS_DISAGREE,
                    at.file,
                    at.line,
                    at.session,
                    at.op,
                    f"decision {i + 1}: rank {ranks[0]} logged "
                    + (f"{a.where()} `{a.text.strip()[a.text.find(MARK) :]}`" if a else "nothing")
                    + f", rank {r} logged "
                    + (f"{b.where()} `{b.text.strip()[b.text.find(MARK) :]}`" if b else "nothing"),
                )
            )
            break
    return out


def check_events(events: Sequence[Decision], files: Sequence[str] = ()) -> DecisionCheckResult:
    """Check one server's events (in log order; one or more files of the same server)."""
    by_rank: dict[int, list[Decision]] = defaultdict(list)
    for d in events:
        # decision lines only: the reset's ERROR line names no rank (sglang's prefix may)
        if d.op not in (SERVER_START, RESET_CLOSE):
            by_rank[d.rank].append(d)
    ranks = sorted(by_rank)
    errors = _ranks_agree(by_rank) if len(ranks) > 1 else []
    checked = ranks[0] if ranks else 0  # rank 0 when it logged (INFO), else the lowest present
    sessions: dict[str, _Session] = {}
    lines = 0
    for d in events:
        if d.rank != checked:
            continue
        if d.op == SERVER_START:  # a restarted scheduler knows no session
            for s in sessions.values():
                s.configs = frozenset({(UNKNOWN, None)})
            continue
        lines += d.op != RESET_CLOSE
        if d.session is None:
            continue  # a call without a session id (refused): nothing to replay
        sess = sessions.get(d.session)
        if sess is None:
            sess = sessions[d.session] = _Session(d.session)
        if sess.failed:
            continue
        sess.trace.append(TraceLine(d.line, d.text))
        bad = step(sess, d)
        if bad is not None:
            sess.failed = True
            kind, msg = bad
            shown = sess.trace[-TRACE_SHOWN:]
            errors.append(
                IllegalDecision(
                    kind, d.file, d.line, d.session, d.op, msg, shown, len(sess.trace) - len(shown)
                )
            )
    return DecisionCheckResult(list(files), ranks, len(sessions), lines, errors)


def check_logs(paths: Sequence[Path]) -> DecisionCheckResult:
    """Each file is one server's log (a restarted server's log may continue in the same file: the
    scheduler's startup line resets every session). The results are summed."""
    total = DecisionCheckResult([str(p) for p in paths], [], 0, 0, [])
    for p in paths:
        r = check_events(read_log(p), [str(p)])
        total.ranks = sorted(set(total.ranks) | set(r.ranks))
        total.sessions += r.sessions
        total.lines += r.lines
        total.errors += r.errors
    return total


def render(r: DecisionCheckResult) -> str:
    out = []
    for e in r.errors:
        out.append(f"ILLEGAL {e.file}:{e.line} session {e.session!r} op {e.op} [{e.kind.value}]: {e.message}")
        if e.trace_omitted:
            out.append(f"    ... {e.trace_omitted} earlier line(s) of the session")
        for t in e.trace:
            i = t.text.find(MARK)
            out.append(f"  {t.line:>8}  {t.text[i:] if i >= 0 else t.text.strip()}")
    out.append(
        f"{len(r.files)} log(s), rank(s) {','.join(map(str, r.ranks)) or '-'}: {r.sessions} sessions,"
        f" {r.lines} decision lines, {len(r.errors)} illegal"
    )
    return "\n".join(out)
