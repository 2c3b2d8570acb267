"""The 96-session named-tool load under each HiCache write policy: stock, ``offload`` and ``auto``
on the twin, with what toolkv decided and what sglang's write_back drains cost.

    python -m toolkv.twin.write_policy [--policies write_through,write_through_selective,write_back]
                                       [--seed 0] [--sessions 96] [--turns 5] [--unfixed] [--out FILE.json]
    python -m toolkv.twin.write_policy --doc-table FILE.json      (the docs table, from the JSON)

The load is the GPU one of docs/benchmarks.md ("96 sessions, four named tools"), as ``toolkv twin
--sessions 96 --arrival-rate 0 --turns 5 --first-tokens 3000 --growth 900 --output 32
--max-context 16384 --warmup 0 --tool-shape named --duration 100 --device-tokens 120000
--host-gb 16 --write-policy P`` runs it. ``--unfixed`` adds toolkv before the fix under
write_back (its locked tool_start writes, without releasing the locks that write_back's drain keeps:
``HiRadixBackend.around_writing_check`` passing the call through) as rows ``offload-unfixed`` and
``auto-unfixed``, so the table shows what the fix changed. The rows
are the regime map's closed-load figures (``toolkv.workload.metrics.closed_stats``) plus the
device tokens still locked at the end of the run, the tool_start refusals by answer, toolkv's
demotions, and the scheduler time spent in blocking write drains.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from toolkv.argtypes import choice_list, positive_int, seed
from toolkv.twin.configs import WRITE_POLICIES

LOAD = dict(initial_sessions=96, arrival_rate=0.0, turns_median=5, first_tokens=3000, growth_per_turn=900,
            output_tokens=32, max_context=16384, tool_shape="named", duration_s=100.0)  # fmt: skip
DEVICE_TOKENS, HOST_GB = 120_000, 16.0
CONFIGS = ("stock", "offload", "auto")
COMMAND = (
    "toolkv twin --configs stock,offload,auto --sessions 96 --arrival-rate 0 --turns 5 --first-tokens 3000 "
    "--growth 900 --output 32 --max-context 16384 --warmup 0 --tool-shape named --duration 100 "
    "--device-tokens 120000 --host-gb 16 --write-policy P"
)


@contextlib.contextmanager
def unfixed() -> Iterator[None]:
    """toolkv before the fix: a write_back drain's kept locks are not released."""
    from toolkv.core.backends.hiradix import HiRadixBackend

    real = HiRadixBackend.around_writing_check
    HiRadixBackend.around_writing_check = lambda self, call, write_back: call()  # type: ignore[method-assign]
    try:
        yield
    finally:
        HiRadixBackend.around_writing_check = real  # type: ignore[method-assign]


def run_one(
    config: str, policy: str, seed_: int, *, old: bool = False, load: dict[str, Any] | None = None
) -> dict[str, Any]:
    """One twin run of the load (``LOAD``, or ``load``): its closed-load row."""
    from toolkv.twin.configs import get
    from toolkv.twin.profile import default_profile
    from toolkv.twin.report import result
    from toolkv.twin.run import Options, simulate
    from toolkv.twin.sessions import Sessions
    from toolkv.workload.metrics import closed_stats
    from toolkv.workload.plan import Workload

    w = Workload(seed=seed_, **(load or LOAD))  # type: ignore[arg-type]
    cfg = get(config).with_host_gb(HOST_GB).with_write_policy(policy)
    prof = default_profile()
    with unfixed() if old else contextlib.nullcontext():
        o = simulate(Sessions.lazy(w), cfg, prof, Options(device_tokens=DEVICE_TOKENS), progress=False)
    r = result(o, prof, window=(w.ramp_s, w.duration_s))
    s = closed_stats(r)
    counters = o.meta_end.get("counters", {}) or {}
    calls = r["summary"].get("calls", {})
    return {
        "config": f"{config}-unfixed" if old else config, "write_policy": policy, "seed": seed_,
        **{k: s[k] for k in ("turns", "closed_turns_per_s", "resumed_ttft_p50_s", "resumed_ttft_p90_s", "reuse",
                             "resumed_zero_cached")},
        "tool_start": {c.split(" ", 1)[1]: v for c, v in sorted(calls.items()) if c.startswith("tool_start ")},
        "demoted": int(counters.get("demoted", 0)),
        "device_locked_tokens_end": o.meta_end.get("device_locked_tokens"),
        "drain_s": round(float(r["twin"].get("drain_s", 0.0)), 3),
        "passed": bool(r["passed"]), "crashed": o.crashed,
    }  # fmt: skip


def run(
    policies: Sequence[str], seed_: int, with_unfixed: bool, load: dict[str, Any] | None = None
) -> dict[str, Any]:
    rows = []
    for p in policies:
        for c in CONFIGS:
            rows.append(run_one(c, p, seed_, load=load))
        if with_unfixed and p == "write_back":
            rows += [run_one(c, p, seed_, old=True, load=load) for c in ("offload", "auto")]
    return {"command": COMMAND, "seed": seed_, "load": load or LOAD, "rows": rows}


def doc_table(data: dict[str, Any]) -> str:
    """One row per write policy and configuration, ratios against stock of the same policy."""
    head = ("write policy", "config", "turns/s (closed)", "× stock", "resumed TTFT p90 s", "p90 × stock", "reuse",
            "tool_start answers", "demoted", "device locked at end", "blocking drains s", "run")  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    stock = {r["write_policy"]: r for r in data["rows"] if r["config"] == "stock"}
    for r in data["rows"]:
        st = stock.get(r["write_policy"])
        tps = r["closed_turns_per_s"] / st["closed_turns_per_s"] if st else float("nan")
        p90 = r["resumed_ttft_p90_s"] / st["resumed_ttft_p90_s"] if st else float("nan")
        answers = ", ".join(f"{k}: {v}" for k, v in r["tool_start"].items()) or "-"
        # a stopped run's closed figures cover only the turns before it stopped: not comparable
        rate = (
            f"{r['closed_turns_per_s']:.2f} | {tps:.2f}×"
            if not r["crashed"]
            else f"- ({r['turns']} turns) | -"
        )
        lines.append(
            f"| {r['write_policy']} | {r['config']} | {rate} "
            f"| {r['resumed_ttft_p90_s']:.2f} | {p90:.2f}× | {100 * r['reuse']:.0f} % | {answers} | {r['demoted']} "
            f"| {r['device_locked_tokens_end'] or 0:,} | {r['drain_s']:.1f} "
            f"| {'completed' if not r['crashed'] else 'stopped: ' + r['crashed'].split(': ', 1)[-1]} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m toolkv.twin.write_policy", description=__doc__.splitlines()[0]
    )
    p.add_argument("--policies", default=",".join(WRITE_POLICIES), type=choice_list(WRITE_POLICIES))
    p.add_argument("--seed", type=seed, default=0)
    p.add_argument(
        "--sessions", type=positive_int, default=LOAD["initial_sessions"], help="sessions at the start"
    )
    p.add_argument(
        "--turns", type=positive_int, default=LOAD["turns_median"], help="median turns per session"
    )
    p.add_argument("--unfixed", action="store_true", help="also toolkv before the fix, under write_back")
    p.add_argument("--out", default=None, help="write the rows here (JSON)")
    p.add_argument("--doc-table", default=None, metavar="JSON", help="print the docs table of a saved run")
    a = p.parse_args(argv)
    if a.doc_table:
        print(doc_table(json.loads(Path(a.doc_table).read_text())))
        return 0
    from toolkv.twin.stack import quiet

    quiet()
    load = dict(LOAD, initial_sessions=a.sessions, turns_median=a.turns)
    data = run(a.policies.split(","), a.seed, a.unfixed, None if load == LOAD else load)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(data, indent=1, default=str) + "\n")
    print(doc_table(data))
    return 0 if all(r["passed"] for r in data["rows"] if not r["config"].endswith("-unfixed")) else 1


if __name__ == "__main__":
    sys.exit(main())
