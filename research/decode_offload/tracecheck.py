"""Validate a decode-offload fuzz trace against ``spec/decode/DecodeOffload.tla`` with TLC.

A trace (JSON lines written by :mod:`research.decode_offload.fuzzing`: a header with the spec's
constants, then one record per step: the action, the capacity decision ``fits`` and the state
record ``s`` the refinement mapping read off the real objects) becomes a TLA+ module that
EXTENDS ``DecodeOffload``. Its initial state is the first record; every later record must be
reached by the named spec action from the one before (TLC evaluates the spec's own
``Admit``/``Offload``/``Check``/... definitions), or, when the spec does not enable that action,
must equal it. The spec's invariants are checked on every recorded state too.

Capacity is decided by the implementation's token-granular pools; the trace's ``fits`` replaces
the spec's ``HostFits``/``DevFits`` (TLC definition override), so a refused write or admission
is legal exactly when the real pool refused it. TLC stops with a deadlock at the first step no
spec action explains; that step is reported.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

SPEC_DIR = Path(__file__).resolve().parents[2] / "spec" / "decode"
SAFETY = (
    "TypeOK", "LiveReadsOwned", "TreeSlotsOwned", "NoFreeUnderCopy", "ReleasedOnce", "SlotAccounting",
    "ProtectedMatchesLocks", "InflightAccounting", "ReleaseWaits", "HostFreedAfterBackup",
    "HostAccounting", "HashChain", "IncAccounting", "HostCopiesRight", "StorageRight", "RanksAgree",
)  # fmt: skip
ACTIONS = {
    "Admit": "Admit(a[2])",
    "Decode": "Decode(a[2])",
    "Offload": "Offload(a[2])",
    "Finish": "Finish(a[2])",
    "Check": "Check",
    "Copy": "Copy(a[2])",
    "Store": "Store(a[2])",
}
FIELDS = (
    "phase", "len", "dev", "devFree", "locks", "prot", "treeOk", "hasSt", "inc", "last", "inflight",
    "rel", "chain", "ops", "okeys", "acked", "odata", "stored", "freed", "hostFree", "store",
)  # fmt: skip
MODEL_FIELDS = {"r"}  # record fields whose values are model values (request names)


@dataclass
class DecodeTraceResult:
    ok: bool
    steps: int
    first_illegal: int | None  # 1-based index of the first step no spec action explains
    action: list[Any] | None
    message: str
    seconds: float


def tla_value(v: Any, model: bool = False) -> str:
    """JSON value -> TLA+ text: dicts keyed by names are functions (``a :> x @@ b :> y``), lists
    are sequences, lists of dicts with an ``r`` field are records (sets when ``as_set``)."""
    if isinstance(v, bool):
        return "TRUE" if v else "FALSE"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, str):
        return v if model else json.dumps(v)
    raise TypeError(f"cannot render {v!r}")


def _record(d: dict[str, Any]) -> str:
    return "[" + ", ".join(f"{k} |-> {tla_value(x, k in MODEL_FIELDS)}" for k, x in d.items()) + "]"


def _seq(xs: list[Any]) -> str:
    return (
        "<<"
        + ", ".join(
            _record(x) if isinstance(x, dict) else _seq(x) if isinstance(x, list) else tla_value(x)
            for x in xs
        )
        + ">>"
    )


def _func(d: dict[str, Any], render: Any) -> str:
    return "(" + " @@ ".join(f"{k} :> {render(v)}" for k, v in d.items()) + ")"


def render_state(s: dict[str, Any]) -> str:
    """The spec's state record ``s`` in TLA+."""
    out: dict[str, str] = {}
    for f in ("phase", "hasSt", "inc", "last", "inflight", "rel", "len"):
        out[f] = _func(s[f], tla_value)
    out["dev"] = _func(s["dev"], lambda xs: "{" + ", ".join(str(x) for x in xs) + "}")
    out["chain"] = _func(s["chain"], _seq)
    for f in ("devFree", "locks", "prot", "acked"):
        out[f] = str(s[f])
    out["treeOk"] = tla_value(s["treeOk"])
    out["ops"] = _seq(s["ops"])
    out["okeys"] = _seq(s["okeys"])
    out["odata"] = _func(s["odata"], _seq)
    for f in ("stored", "freed", "hostFree"):
        out[f] = _func(s[f], tla_value)
    out["store"] = _func(s["store"], lambda es: "{" + ", ".join(_record(e) for e in es) + "}")
    missing = set(FIELDS) - set(out)
    assert not missing, missing
    return "[" + ", ".join(f"{f} |-> {out[f]}" for f in FIELDS) + "]"


def _act(a: list[Any]) -> str:
    return "<<" + ", ".join([json.dumps(a[0]), *(str(x) for x in a[1:])]) + ">>"


def build_module(header: dict[str, Any], steps: list[dict[str, Any]]) -> tuple[str, str]:
    reqs, ranks = list(header["reqs"]), list(header["ranks"])
    records = ",\n  ".join(
        f"[s |-> {render_state(x['s'])}, a |-> {_act(x['act'])}, fits |-> {tla_value(bool(x.get('fits', True)))}]"
        for x in steps
    )
    cases = "\n".join(
        f'       {"[]" if k else "  "} a[1] = "{name}" -> IF ENABLED {expr} THEN {expr} ELSE Idle(a)'
        for k, (name, expr) in enumerate(ACTIONS.items())
    )
    module = f"""---- MODULE DecodeTraceRun ----
EXTENDS DecodeOffload
CONSTANTS {", ".join(reqs + ranks)}
VARIABLE i

Trace == <<
  {records}
>>

TInit == /\\ i = 1
         /\\ s = Trace[1].s
         /\\ act = <<"Init">>
         /\\ note = <<>>

\\* The implementation's capacity decisions replace the spec's page-count guards.
THostFits(k) == Trace[i + 1].fits
TDevFits(k) == Trace[i + 1].fits

\\* A call the spec does not enable here (or a step that changes nothing it models) leaves s as is.
Idle(a) == UNCHANGED s /\\ act' = a /\\ note' = <<>>

Step(a) == CASE
{cases}
       [] OTHER -> Idle(a)

TNext == /\\ i < Len(Trace)
         /\\ i' = i + 1
         /\\ s' = Trace[i + 1].s
         /\\ Step(Trace[i + 1].a)

Done == i = Len(Trace) /\\ UNCHANGED <<vars, i>>
TraceNext == TNext \\/ Done
====
"""
    consts = "\n".join(f"    {x} = {x}" for x in reqs + ranks)
    invariants = "\n".join(f"    {x}" for x in SAFETY)
    cfg = f"""CONSTANTS
    Reqs = {{{", ".join(reqs)}}}
    Ranks = {{{", ".join(ranks)}}}
{consts}
    Pre = {header["pre"]}
    MaxLen = {header["max_len"]}
    Stride = {header["stride"]}
    DevSlots = {header["dev_slots"]}
    HostSlots = {header["host_slots"]}
    TreePre = 0
    RadixFix = FALSE
    BUG = "none"
    HostFits <- THostFits
    DevFits <- TDevFits
INIT TInit
NEXT TraceNext
INVARIANTS
{invariants}
"""
    return module, cfg


def read_trace(path: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    lines = [json.loads(x) for x in Path(path).read_text().splitlines() if x.strip()]
    if not lines or "header" not in lines[0]:
        raise ValueError(f"{path}: the first line must be the trace header")
    steps = lines[1:]
    if not steps or steps[0]["act"] != ["Init"]:
        raise ValueError(f"{path}: the first step must be the initial state (act Init)")
    return lines[0]["header"], steps


def check_trace(path: Path, timeout: float = 600.0) -> DecodeTraceResult:
    """Run TLC over one trace; ``ok`` iff every step is a step of the spec."""
    from toolkv.verify.tla.tlc import Toolchain, run_tlc

    header, steps = read_trace(path)
    module, cfg = build_module(header, steps)
    tmp = Path(tempfile.mkdtemp(prefix="toolkv-decode-trace-"))
    try:
        shutil.copy(SPEC_DIR / "DecodeOffload.tla", tmp / "DecodeOffload.tla")
        (tmp / "DecodeTraceRun.tla").write_text(module)
        (tmp / "DecodeTraceRun.cfg").write_text(cfg)
        res = run_tlc(
            Toolchain.locate(),
            tmp / "DecodeTraceRun.tla",
            tmp / "DecodeTraceRun.cfg",
            timeout=timeout,
            deadlock=False,
        )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    n = len(steps) - 1
    if res.outcome == "pass":
        return DecodeTraceResult(True, n, None, None, "every step is a spec step", res.seconds)
    if res.outcome == "deadlock" and res.trace is not None:
        i = int(res.trace.states[-1].values["i"])
        return DecodeTraceResult(
            False, n, i, steps[i]["act"], f"step {i} ({steps[i]['act']}) is not a spec step", res.seconds
        )
    detail = f"TLC: {res.outcome} {res.violated or ''} " + " ".join(res.error_lines[-3:])
    return DecodeTraceResult(False, n, None, None, detail, res.seconds)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "files", nargs="+", type=Path, help="JSON-lines traces written by the decode fuzz campaign"
    )
    p.add_argument("--json", action="store_true", help="print the results as JSON on stdout")


def run(args: argparse.Namespace) -> int:
    """Check every file; exit status 1 if any trace has an illegal step."""
    results = [{"file": str(f), **asdict(check_trace(f))} for f in args.files]
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        for r in results:
            print(f"{r['file']}: {'ok' if r['ok'] else 'ILLEGAL'}: {r['steps']} steps, {r['message']}")
    return 0 if all(r["ok"] for r in results) else 1


def main(argv: list[str] | None = None) -> int:
    """``python -m research.decode_offload.tracecheck FILE...``"""
    p = argparse.ArgumentParser(prog="python -m research.decode_offload.tracecheck")
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
