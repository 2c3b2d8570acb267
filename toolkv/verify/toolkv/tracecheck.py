"""``toolkv trace-check FILE``: validate an action-level trace against the spec's next-state relation.

A trace (JSON lines, written by the fuzz campaign: a header, then one record per step with the
spec action ``act``, the abstract state after it and the capacity decision ``fits``) is turned into
a TLA+ module that EXTENDS ``ToolKV``: its initial state is the first record, and every step must
be the named spec action with its parameters, from the recorded state to the next one — TLC
evaluates the real ``ToolStart``/``WriteAck``/… definitions, so this is the spec's own next-state
relation at whatever size the trace has, not a Python re-implementation. A call the spec does not
enable in that state (e.g. ``tool_end`` on a running session) must leave the state unchanged.

Capacity is the one thing the implementation decides differently: its pools count tokens, the
spec's count nodes. The trace records each decision (``fits``) and the module replaces the spec's
``HostFits``/``DevFits`` with it (TLC definition override), so a refusal is legal exactly when the
implementation says its pool was full — and nothing else changes.

TLC stops with a deadlock at the first step that no spec action explains; that step is reported.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from toolkv.errors import InputError


def spec_files() -> Path:
    """The spec modules to check against: the same directory ``toolkv spec-check`` uses
    (``TOOLKV_SPEC_DIR``, the checkout's ``spec/``, else the copy installed in the package). An
    installed toolkv has no checkout: reading ``spec/`` next to the package found no module, and
    TLC then marked every trace illegal."""
    from toolkv.verify.spec_check import default_spec_dir

    d = default_spec_dir()
    if not (d / "ToolKV.tla").is_file():
        raise InputError(f"no ToolKV.tla in {d}: set TOOLKV_SPEC_DIR to toolkv's spec directory")
    return d


NODE_FIELDS = ("parent", "writeKey", "loadKey", "ref", "prot")
FUNC_FIELDS = (
    "status", "parent", "dev", "host", "lockRef", "hostRef", "writeKey", "loadKey", "loadAcks", "extLock",
    "phase", "ref", "epoch", "prot", "deadline",
)  # fmt: skip
SCALARS = ("devFree", "hostFree", "now", "resets")
ACTIONS = {
    "ToolStart": "ToolStart(a[2])",
    "WriteAck": "WriteAck(a[2])",
    "ToolEnd": "ToolEnd(a[2], a[3])",
    "LoadAck": "LoadAck(a[2])",
    "TtlSweep": "TtlSweep",
    "Close": "Close(a[2])",
    "Lock": "Lock(a[2])",
    "Unlock": "Unlock(a[2])",
    "GpuEvict": "GpuEvict(a[2])",
    "HostEvict": "HostEvict(a[2])",
    "WriteThrough": "WriteThrough(a[2])",
    "Split": "Split(a[2], a[3])",
    "Insert": "Insert(a[2], a[3], a[4])",
    "TreeReset": "TreeReset",
    "Tick": "Tick",
    "Keep": "Keep(a[2])",
    "LetGo": "LetGo(a[2])",
    "Demote": "Demote(a[2])",
    "Prefetch": "Prefetch(a[2])",
    "HostRoom": "HostRoom(a[2], a[3])",
    "HostUnmirror": "HostUnmirror(a[2], a[3])",
    "Admit": "Admit(a[2])",
    "Park": "Park(a[2], a[3])",
    "Unpin": "Unpin(a[2])",
}


@dataclass
class TraceCheckResult:
    ok: bool
    steps: int
    first_illegal: int | None  # 1-based index of the first step no spec action explains
    action: list[Any] | None
    message: str
    seconds: float


def _value(field: str, v: Any) -> str:
    if isinstance(v, bool):
        return "TRUE" if v else "FALSE"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, str):
        return v if field in NODE_FIELDS else json.dumps(v)
    raise TypeError(f"cannot render {v!r} for {field}")


def _func(field: str, d: dict[str, Any]) -> str:
    return "(" + " @@ ".join(f"{k} :> {_value(field, v)}" for k, v in d.items()) + ")"


def _act(a: list[Any]) -> str:
    """``["ToolEnd", "s1", 2]`` -> ``<<"ToolEnd", s1, 2>>``: parameters are model values or ints."""
    return "<<" + ", ".join([json.dumps(a[0]), *(str(x) for x in a[1:])]) + ">>"


UNBORN = {
    "status": "Unborn", "parent": "Root", "dev": False, "host": False, "lockRef": 0, "hostRef": 0,
    "writeKey": "NoNode", "loadKey": "NoNode", "loadAcks": 0, "extLock": False,
}  # fmt: skip


def _record(step: dict[str, Any], nodes: list[str]) -> str:
    st = step["state"]
    # nodes created later in the trace are Unborn here (the spec's functions range over all Nodes)
    full = {f: ({n: st[f].get(n, UNBORN[f]) for n in nodes} if f in UNBORN else st[f]) for f in FUNC_FIELDS}
    fields = [f"{f} |-> {_func(f, full[f])}" for f in FUNC_FIELDS]
    fields += [f"{f} |-> {st[f]}" for f in SCALARS]
    fields += [f"act |-> {_act(step['act'])}", f"fits |-> {'TRUE' if step.get('fits', True) else 'FALSE'}"]
    return "[" + ", ".join(fields) + "]"


def build_module(header: dict[str, Any], steps: list[dict[str, Any]]) -> tuple[str, str]:
    nodes, sessions = header["nodes"], header["sessions"]
    consts = ", ".join(nodes + sessions)
    trace = ",\n  ".join(_record(s, nodes) for s in steps)
    assigns = "\n".join(f"         /\\ {v}' = Trace[i + 1].{v}" for v in FUNC_FIELDS + SCALARS)
    init = "\n".join(f"         /\\ {v} = Trace[1].{v}" for v in FUNC_FIELDS + SCALARS)
    cases = "\n".join(
        f'       {"[]" if k else "  "} a[1] = "{name}" -> IF ENABLED {expr} THEN {expr}'
        + " ELSE UNCHANGED core /\\ tgt' = {}"
        for k, (name, expr) in enumerate(ACTIONS.items())
    )
    module = f"""---- MODULE TraceRun ----
EXTENDS ToolKV, Sequences
CONSTANTS {consts}
VARIABLE i

Trace == <<
  {trace}
>>

TInit == /\\ i = 1
{init}
         /\\ queued = {{}}
         /\\ ring = <<>>
         /\\ act = Trace[1].act
         /\\ tgt = {{}}

\\* The implementation's capacity decisions replace the spec's node-slot guards.
TFits == Trace[i + 1].fits
THostFits(W, n) == TFits
\\* room was made exactly where the trace says the manager made it (HostRoom and HostUnmirror steps before a ToolStart)
THostShort(W) == Trace[i + 1].act[1] \\in {{"HostRoom", "HostUnmirror"}}
TDevFits(C) == TFits
\\* sglang's promise of device room is checked on the real pools by the campaign; the trace records
\\* the implementation's decision (a pin or an offload refused for it is a step that did not fit)
TPromiseFits(df, d, lr) == TFits
TInsertFits == TRUE
TWriteFits == TRUE
TSplitFits(n) == TRUE

Step(a) == CASE
{cases}

TNext == /\\ i < Len(Trace)
         /\\ i' = i + 1
{assigns}
         /\\ act' = Trace[i + 1].act
         /\\ Step(Trace[i + 1].act)

Done == i = Len(Trace) /\\ UNCHANGED <<vars, i>>
TraceNext == TNext \\/ Done
====
"""
    big = 10**6
    cfg = f"""CONSTANTS
    Nodes = {{{", ".join(nodes)}}}
    Sessions = {{{", ".join(sessions)}}}
{chr(10).join(f"    {x} = {x}" for x in nodes + sessions)}
    Root = Root
    NoNode = NoNode
    DevSlots = {header.get("dev_slots", big)}
    HostSlots = {header.get("host_slots", big)}
    MaxEpoch = {header.get("max_epoch", big)}
    MaxTime = {header.get("max_time", big)}
    TTL = {header["ttl"]}
    KeepTTL = {header.get("keep_ttl", header["ttl"])}
    MaxResets = {big}
    EnvLocks = TRUE
    EnvWrites = TRUE
    Hist = TRUE
    Ring = 0
    SysLoads = FALSE
    Policy = {"TRUE" if header.get("policy") else "FALSE"}
    LazyFree = {"TRUE" if header.get("lazy_free") else "FALSE"}
    Promised = 0
    Unmirror = {"TRUE" if header.get("unmirror") else "FALSE"}
    BUG = "none"
    HostFits <- THostFits
    PromiseFits <- TPromiseFits
    HostShort <- THostShort
    DevFits <- TDevFits
    InsertFits <- TInsertFits
    WriteFits <- TWriteFits
    SplitFits <- TSplitFits
INIT TInit
NEXT TraceNext
"""
    return module, cfg


def read_trace(path: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The header and the steps of a JSON-lines trace; anything else is an :class:`InputError`
    naming the file and line (a file that is not a trace is the user's input, not a bug)."""
    lines: list[Any] = []
    for no, raw in enumerate(Path(path).read_text(errors="replace").splitlines(), 1):
        if not raw.strip():
            continue
        try:
            lines.append(json.loads(raw))
        except json.JSONDecodeError as e:
            raise InputError(f"{path}: line {no} is not JSON ({e.msg}): not a toolkv trace") from None
    if not lines or not isinstance(lines[0], dict) or "header" not in lines[0]:
        raise InputError(f"{path}: the first line must be the trace header")
    if not all(isinstance(x, dict) and "act" in x for x in lines[1:]):
        raise InputError(f"{path}: every line after the header must be a step with an 'act'")
    return lines[0]["header"], lines[1:]


def check_trace(path: Path, timeout: float = 600.0) -> TraceCheckResult:
    from toolkv.verify.tla.tlc import Toolchain, run_tlc

    header, steps = read_trace(path)
    if not steps or steps[0]["act"] != ["Init"]:
        raise InputError(f"{path}: the first step must be the initial state (act Init)")
    try:
        module, cfg = build_module(header, steps)
    except (KeyError, TypeError, ValueError) as e:
        raise InputError(f"{path}: not a toolkv trace ({type(e).__name__}: {e})") from None
    spec_dir = spec_files()
    tmp = Path(tempfile.mkdtemp(prefix="toolkv-trace-"))
    try:
        for f in spec_dir.glob("*.tla"):
            shutil.copy(f, tmp / f.name)
        (tmp / "TraceRun.tla").write_text(module)
        (tmp / "TraceRun.cfg").write_text(cfg)
        res = run_tlc(
            Toolchain.locate(), tmp / "TraceRun.tla", tmp / "TraceRun.cfg", timeout=timeout, deadlock=False
        )  # deadlock = a step no spec action explains: it must be reported, not ignored
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    n = len(steps) - 1
    if res.outcome == "pass":
        return TraceCheckResult(True, n, None, None, "every step is a spec step", res.seconds)
    if res.outcome == "deadlock" and res.trace is not None:
        last = res.trace.states[-1].values
        i = int(last["i"])  # the last legal record; step i (0-based record i) is illegal
        return TraceCheckResult(
            False, n, i, steps[i]["act"], f"step {i} ({steps[i]['act']}) is not a spec step", res.seconds
        )
    return TraceCheckResult(
        False,
        n,
        None,
        None,
        f"TLC: {res.outcome} {res.violated or ''} " + " ".join(res.error_lines[-3:]),
        res.seconds,
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "files", nargs="+", type=Path, help="JSON-lines traces (toolkv fuzz --trace-dir writes them)"
    )
    p.add_argument("--json", action="store_true")


def run(args: argparse.Namespace) -> int:
    bad = 0
    out = []
    for i, f in enumerate(args.files, 1):
        r = check_trace(f)
        out.append({"file": str(f), **asdict(r)})
        bad += not r.ok
        if not args.json:
            status = "ok" if r.ok else "ILLEGAL"
            print(
                f"[{i}/{len(args.files)}] {f}: {status}: {r.steps} steps, {r.message} ({r.seconds:.1f}s)",
                file=sys.stderr if r.ok else sys.stdout,
                flush=True,
            )
    if args.json:
        print(json.dumps(out, indent=2))
    elif not bad:
        print(f"{len(args.files)} trace(s): every step is a spec step")
    return 1 if bad else 0
