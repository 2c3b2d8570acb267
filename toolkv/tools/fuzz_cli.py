"""``toolkv fuzz``: the stateful campaign against the real HiRadixCache, and the mutant kill table.

    toolkv fuzz --examples 500 --steps 80            # correct implementation: must find nothing
    toolkv fuzz --mutants --examples 300             # every caveat switch must be killed
    toolkv fuzz --trace-dir traces/ --examples 20    # also write JSONL traces for trace-check
    toolkv fuzz --device cuda --examples 400         # on the GPU machine: real CUDA pools

Prints a progress line every ``--every`` examples and a final summary; ``--out FILE`` saves it as
JSON and ``--json`` prints it as JSON on stdout (as every other command's ``--json`` does).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from toolkv.argtypes import device, positive_int, seed
from toolkv.verify.campaign import campaign

# implementation switch (or environment defect) -> the caveat it seeds
MUTANTS: dict[str, tuple[frozenset[str], frozenset[str], str]] = {
    "HostLockLeak": (frozenset({"HostLockLeak"}), frozenset(), "1 host-lock leak on failed restore"),
    "DoubleLoad": (frozenset({"DoubleLoad"}), frozenset(), "2 load_back races"),
    "OrphanHost": (frozenset(), frozenset({"OrphanHost"}), "3 host buffers orphaned by eviction"),
    "EvictProtected": (frozenset({"EvictProtected"}), frozenset(), "4 protected nodes host-evicted"),
    "StaleNode": (frozenset({"StaleNode"}), frozenset(), "5 stale session->node reference"),
    "NoTtl": (frozenset({"NoTtl"}), frozenset(), "6 TTL never run"),
    "FreeBeforeAck": (frozenset({"FreeBeforeAck"}), frozenset(), "7 GPU freed before the write ack"),
    "EarlyRunnable": (frozenset({"EarlyRunnable"}), frozenset(), "7 runnable before the load ack"),
    "NoEpochCheck": (frozenset({"NoEpochCheck"}), frozenset(), "stale epoch accepted"),
    "EpochReuse": (frozenset({"EpochReuse"}), frozenset(), "epoch restarted on expiry"),
    "KeepNoPin": (frozenset({"KeepNoPin"}), frozenset(), "policy: kept KV not pinned"),
    "DemoteKeepsRef": (frozenset({"DemoteKeepsRef"}), frozenset(), "policy: demoted session still protected"),
    "EarlyKept": (frozenset({"EarlyKept"}), frozenset(), "policy: early restore kept before its load ack"),
    "EarlyRelease": (
        frozenset({"EarlyRelease"}),
        frozenset(),
        "hand-over: pin released before the next request",
    ),
    "KeepFullTtl": (
        frozenset({"KeepFullTtl"}),
        frozenset(),
        "keep TTL: a kept session armed with the full TTL",
    ),
    "WarmFullTtl": (
        frozenset({"WarmFullTtl"}),
        frozenset(),
        "keep TTL: an early restore kept with its offload's full TTL",
    ),
    "ParkUnprotected": (
        frozenset({"ParkUnprotected"}),
        frozenset(),
        "load-adaptive: a parked session's host copy unprotected",
    ),
    "ResidentNoPin": (
        frozenset({"ResidentNoPin"}),
        frozenset(),
        "lazy free: a resident path handed over unpinned",
    ),
    "ClosedKeepsRef": (
        frozenset({"ClosedKeepsRef"}),
        frozenset(),
        "closed history: a closed record keeps its evicted path alive",
    ),
    "WriteLockFree": (
        frozenset({"WriteLockFree"}),
        frozenset(),
        "device room: tool_start's write locks take room sglang promised",
    ),
    "PinPricedByLoad": (
        frozenset({"PinPricedByLoad"}),
        frozenset(),
        "device room: a restore's pin priced by the tokens to load alone",
    ),
}
# Mutants whose defect lives on the lazy-free path (spec LazyFree): their campaign runs with it on
# (the production default on HiRadixCache), where a tool_end finds the offloaded path resident.
LAZY_MUTANTS = frozenset({"ResidentNoPin", "PinPricedByLoad"})


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--profile", default=None, help="Hypothesis settings profile: dev (default), ci, long, gpu"
    )
    p.add_argument("--examples", type=positive_int, default=None, help="override the profile's examples")
    p.add_argument(
        "--steps", type=positive_int, default=None, help="override the profile's steps per example"
    )
    p.add_argument("--mutants", action="store_true", help="run the kill table over every caveat switch")
    p.add_argument("--only", action="append", default=[], help="with --mutants: only these mutants")
    p.add_argument("--device", default="cpu", type=device, help="cpu (default) or cuda")
    p.add_argument("--page-size", type=positive_int, default=1, choices=(1, 16))
    p.add_argument("--trace-dir", type=Path, help="write one JSONL trace per example here")
    p.add_argument("--seed", type=seed, default=None)
    p.add_argument("--every", type=positive_int, default=25, help="progress line every N examples")
    p.add_argument("--out", type=Path, help="write the summary as JSON to this file")
    p.add_argument("--json", action="store_true", help="print the summary as JSON on stdout")
    p.add_argument("--no-shrink", action="store_true", help="stop at the first failure (kill detection only)")
    p.add_argument(
        "--storage",
        action="store_true",
        help="the L3 storage tier's campaign (spec/storage/StorageTier.tla) over sglang's HiCacheFile; "
        "with --mutants its defects' kill table (--only, --invariants-only)",
    )
    p.add_argument(
        "--invariants-only",
        action="store_true",
        help="with --storage: no step check and no leak check at teardown, the spec's invariants alone",
    )
    p.add_argument(
        "--reproduce",
        metavar="BLOB",
        help="replay one failing example from the @reproduce_failure blob a failure printed",
    )


def kill_table(results: list[dict[str, Any]]) -> str:
    """The kill table of ``docs/caveats.md``, as Markdown rows, from ``--mutants --out``'s JSON:
    the doc quotes this output, and a test keeps the two equal."""
    rows = []
    for r in results:
        failure = r.get("failure") or ""
        if len(failure) > 110:
            failure = failure[:110] + "…"
        killed = "yes" if r.get("killed", r.get("failure") is not None) else "NO"
        rows.append(
            f"| `{r['label']}` | {r['caveat']} | {killed} | {r.get('examples_to_kill') or '-'} | {failure} |"
        )
    return "\n".join(rows)


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import logging

    logging.getLogger("toolkv").setLevel(logging.ERROR)
    if getattr(args, "storage", False):
        return run_storage(args)
    results: list[dict[str, Any]] = []
    rc = 0
    if args.mutants:
        names = args.only or list(MUTANTS)
        for i, name in enumerate(names, 1):
            cav, env, caveat = MUTANTS[name]
            print(f"[{i}/{len(names)}] mutant {name} (caveat {caveat}) ...", file=sys.stderr, flush=True)
            r = campaign(
                examples=args.examples,
                steps=args.steps,
                profile=args.profile,
                caveats=cav,
                env_bugs=env,
                device=args.device,
                page_size=args.page_size,
                seed=args.seed,
                every=args.every,
                label=name,
                shrink=not args.no_shrink,
                lazy_free=name in LAZY_MUTANTS,
            )
            r["caveat"] = caveat
            r["killed"] = r["failure"] is not None
            rc |= not r["killed"]
            results.append(r)
            if args.out:  # written after every mutant, so a cut-off run still leaves its rows
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(json.dumps(results, indent=2))
            print(
                f"    -> {'killed' if r['killed'] else 'SURVIVED'} after {r['examples_to_kill'] or r['examples']} "
                f"examples: {(r['failure'] or '')[:100]}",
                file=sys.stderr,
                flush=True,
            )
        print(f"\n{'mutant':<16} {'caveat':<38} {'killed':<7} {'to kill':>8} {'steps':>6}  by")
        for r in results:
            print(
                f"{r['label']:<16} {r['caveat']:<38} {'yes' if r['killed'] else 'NO':<7} "
                f"{r['examples_to_kill'] or '-':>8} {r['shrunk_steps'] or '-':>6}  {(r['failure'] or '')[:70]}"
            )
    else:
        r = campaign(
            examples=args.examples,
            steps=args.steps,
            profile=args.profile,
            device=args.device,
            page_size=args.page_size,
            trace_dir=args.trace_dir,
            seed=args.seed,
            every=args.every,
            shrink=not args.no_shrink,
            reproduce=args.reproduce,
        )
        results.append(r)
        rc = 1 if r["failure"] else 0
        print(
            f"fuzz: {r['examples']} examples, {r['steps']} steps, {r['seconds']}s on {r['device']}, "
            f"{r['kv_bytes_checked']:,} KV bytes checked, failures: {r['failure'] or 0}"
        )
        print("actions: " + ", ".join(f"{k} {v}" for k, v in r["actions"].items()))
    _emit(args, results)
    return rc


def _emit(args: argparse.Namespace, results: list[dict[str, Any]]) -> None:
    """The campaigns' results as ``--out`` (a JSON file) and ``--json`` (standard output) ask."""
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2))
    if args.json:
        print(json.dumps(results, indent=2))


def run_storage(args: argparse.Namespace) -> int:
    """``toolkv fuzz --storage``: the storage tier's campaign, or with ``--mutants`` its kill table
    (``toolkv.verify.storage.fuzzing``; defaults: 200 examples of 60 steps, a kill within 300)."""
    import logging

    from toolkv.verify.storage.fuzzing import campaign as storage_campaign
    from toolkv.verify.toolkv.mutants import STORAGE_MUTANTS

    logging.getLogger("sglang").setLevel(logging.ERROR)  # every refused page is a warning
    checks = "invariants" if args.invariants_only else "all"
    seed = 1 if args.seed is None else args.seed
    steps = args.steps or 60
    results: list[dict[str, Any]] = []
    rc = 0
    names: list[str | None] = list(args.only or STORAGE_MUTANTS) if args.mutants else [None]
    for name in names:
        r = storage_campaign(
            examples=args.examples or (300 if name else 200), steps=steps, seed=seed, mutant=name,
            checks=checks, profile=args.profile or "ci", shrink=not args.no_shrink, every=args.every,
        )  # fmt: skip
        results.append(r)
        bad = (r["failure"] is None) if name else (r["failure"] is not None)
        rc |= bad
        if name:
            print(
                f"{name:<22} {'killed' if r['failure'] else 'SURVIVED'} after {r['examples_to_kill'] or r['examples']} "
                f"examples: {(r['first_failure'] or r['failure'] or '')[:110]}"
            )
        else:
            print(
                f"storage fuzz: {r['examples']} examples, {r['steps']} steps, {r['seconds']}s, "
                f"{r['kv_bytes_checked']:,} KV bytes checked, {r['counters'].get('restored from L3', 0)} sessions "
                f"restored from L3, failures: {r['failure'] or 0}"
            )
            print("actions: " + ", ".join(f"{k} {v}" for k, v in r["actions"].items()))
    _emit(args, results)
    return rc
