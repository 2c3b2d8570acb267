"""``python -m toolkv.twin.l3map``: a 16 GB host plus an L3 tier against stock sglang with a 64 GB
host, on the regime map's loads (:mod:`toolkv.twin.regime_map`: closed, ~6 turns, 3,000-token
first prompts growing by ~900 a turn, tool shapes traces/long/named).

Configurations (each run is one twin server, the constrained device pool):

- ``stock64``: stock sglang, HiCache host pool 64 GB, no L3;
- ``stock-l3``: stock sglang, 16 GB host, L3 (:mod:`toolkv.twin.storage`: sglang's own storage
  path, write-through to L3 and a read on arrival with ``wait_complete``);
- ``offload-l3``: the same server with toolkv ``offload`` (tool names sent), toolkv's manager
  driving its L3 path (``toolkv/core/session/l3.py``) on the same storage backend.

Each row gives closed throughput, resumed-turn TTFT p90 and reuse, the ratios of the 16 GB rows to
the same cell and seed's ``stock64``, toolkv's L3 counters (``l3_store``, ``demoted_l3``,
``l3_prefetch``, ``l3_restored``, ``l3_prefetch_short``) and the storage I/O (reads cut short by
sglang's host allocation). The target: where ``stock64`` holds the whole live KV (live KV <= its
host pool), ``offload-l3`` at >= 0.8x ``stock64``'s closed throughput and reuse.

``python -m toolkv.twin.l3map --out docs/results/twin/l3map.json`` runs it (a progress line per run
on stderr, ``--jobs``) and prints the table; ``--doc-table FILE`` prints the docs block of a saved
one (``docs/benchmarks.md``, between ``<!-- BEGIN twin-l3map -->`` and its end marker).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

SESSIONS = (24, 48, 96)
SHAPES = ("traces", "named", "long")
SEEDS = (0, 1)
CONFIGS = ("stock64", "stock-l3", "offload-l3")
HOST_GB = {"stock64": 64.0, "stock-l3": 16.0, "offload-l3": 16.0}
BASE = {"stock64": "stock", "stock-l3": "stock-l3", "offload-l3": "offload-l3"}
TARGET = 0.8
COUNTERS = ("l3_store", "l3_store_l3_early", "l3_store_host_room", "demoted_l3", "l3_prefetch", "l3_restored",
            "l3_prefetch_short", "l3_prefetch_refused", "l3_readahead", "l3_from_host", "tool_start", "demoted")  # fmt: skip
STORAGE = ("write_tokens", "read_tokens", "toolkv_read_tokens", "queries", "reads_cut", "read_tokens_cut")


def plan(sessions: Sequence[int], shapes: Sequence[str], seeds: Sequence[int], configs: Sequence[str],
         seeds_96: Sequence[int] | None = None) -> list[tuple[int, str, int, str]]:  # fmt: skip
    """Every run, the heaviest first; ``seeds_96``: the seeds of the 96-session cells (fewer: they are
    the slowest and stock64 does not hold their live KV)."""
    out = [
        (n, s, seed, c)
        for s in shapes
        for n in sessions
        for seed in (seeds_96 if n >= 96 and seeds_96 is not None else seeds)
        for c in configs
    ]
    return sorted(out, key=lambda t: -t[0])


def run_one(task: tuple[Any, ...]) -> dict[str, Any]:
    """One twin run (in a worker process); a gloo port another process holds is tried again on
    another port (the machine is shared)."""
    for attempt in range(5):
        os.environ["MASTER_PORT"] = str(20_000 + (os.getpid() + 7919 * attempt) % 30_000)
        try:
            return _run_one(task)
        except Exception as e:  # torch.distributed.DistNetworkError (EADDRINUSE)
            if "EADDRINUSE" not in str(e) or attempt == 4:
                raise
    raise AssertionError("unreachable")


def _run_one(task: tuple[Any, ...]) -> dict[str, Any]:
    from toolkv.twin.configs import REGIMES, get
    from toolkv.twin.profile import default_profile
    from toolkv.twin.regime_map import Task, _workload, live_kv_bytes
    from toolkv.twin.report import result
    from toolkv.twin.run import Options, Twin
    from toolkv.twin.sessions import Sessions
    from toolkv.workload.metrics import closed_stats

    n, shape, seed, config, *rest = task
    env: tuple[tuple[str, str], ...] = rest[0] if rest else ()
    host = HOST_GB[config]
    t = Task(n, host, shape, seed, BASE[config])
    w = _workload(t)
    prof = default_profile()
    cfg = get(BASE[config]).with_host_gb(host)
    if env and not config.startswith("stock"):  # toolkv's knobs, on toolkv's configurations only
        cfg = replace(cfg, toolkv_env=env)
    t0 = time.process_time()
    twin = Twin(Sessions.lazy(w), cfg, prof, Options(device_tokens=REGIMES["constrained"]))
    o = twin.run()
    r = result(o, prof, window=(w.ramp_s, w.duration_s), opt=False)
    s = closed_stats(r)
    counters = (o.meta_end or {}).get("counters", {}) or {}
    storage = twin.stack.storage.describe() if twin.stack.storage is not None else None
    return {
        "sessions": n, "tool_shape": shape, "seed": seed, "config": config, "host_gb": host,
        "l3_gbps": cfg.l3_gbps, "closed_turns_per_s": s["closed_turns_per_s"], "turns": s["turns"],
        "resumed_ttft_p90_s": s["resumed_ttft_p90_s"], "reuse": s["reuse"],
        "counters": {k: int(counters.get(k, 0)) for k in COUNTERS},
        "storage": storage, "passed": bool(r["passed"]), "crashed": o.crashed, "leaked": o.leaks.get("leaked"),
        "live_kv_gb": live_kv_bytes(t, prof.kv_bytes_per_token) / 1e9, "cpu_s": time.process_time() - t0,
    }  # fmt: skip


def run_all(todo: Sequence[tuple[Any, ...]], jobs: int, quiet: bool = False) -> list[dict[str, Any]]:
    """Every run on ``jobs`` processes (spawned), a progress line per finished run on stderr."""
    import multiprocessing as mp

    rows = []
    t0 = time.monotonic()
    with mp.get_context("spawn").Pool(processes=max(1, jobs), maxtasksperchild=10) as pool:
        for i, row in enumerate(pool.imap_unordered(run_one, todo), 1):
            rows.append(row)
            if not quiet:
                el = time.monotonic() - t0
                print(
                    f"[{i}/{len(todo)}] {row['tool_shape']} {row['sessions']} seed {row['seed']} {row['config']}: "
                    f"{row['closed_turns_per_s']:.2f} turns/s, reuse {100 * row['reuse']:.0f} % "
                    f"({el:.0f} s elapsed, ~{el / i * (len(todo) - i):.0f} s left)",
                    file=sys.stderr,
                    flush=True,
                )
    return rows


def _ratio(a: float, b: float) -> float:
    return a / b if b and math.isfinite(a) and math.isfinite(b) else math.nan


def cells(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per cell (sessions, shape) and 16 GB configuration: the medians over seeds of the ratios to
    the same seed's ``stock64``, and whether the target holds (where stock64 holds the live KV)."""
    base = {(r["sessions"], r["tool_shape"], r["seed"]): r for r in rows if r["config"] == "stock64"}
    out = []
    keys = sorted({(r["sessions"], r["tool_shape"]) for r in rows}, key=lambda k: (k[0], SHAPES.index(k[1])))
    for n, shape in keys:
        for c in CONFIGS[1:]:
            runs = [r for r in rows if (r["sessions"], r["tool_shape"], r["config"]) == (n, shape, c)]
            pairs = [(r, base[(n, shape, r["seed"])]) for r in runs if (n, shape, r["seed"]) in base]
            if not pairs:
                continue
            tps = statistics.median(
                _ratio(r["closed_turns_per_s"], b["closed_turns_per_s"]) for r, b in pairs
            )
            reuse = statistics.median(_ratio(r["reuse"], b["reuse"]) for r, b in pairs)
            holds = all(b["live_kv_gb"] <= HOST_GB["stock64"] for _, b in pairs)
            out.append({
                "sessions": n, "tool_shape": shape, "config": c, "seeds": sorted(r["seed"] for r, _ in pairs),
                "tps_ratio": tps, "reuse_ratio": reuse, "stock64_holds_live_kv": holds,
                "target_met": (tps >= TARGET and reuse >= TARGET) if holds else None,
            })  # fmt: skip
    return out


def _f(x: Any, fmt: str) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def table(data: dict[str, Any]) -> str:
    """The runs, one line each, then the cells' ratios (markdown)."""
    rows = sorted(data["rows"], key=lambda r: (r["sessions"], SHAPES.index(r["tool_shape"]), r["seed"],
                                               CONFIGS.index(r["config"])))  # fmt: skip
    lines = [
        "| sessions | tools | seed | config | host GB | live KV GB | turns/s | reuse | TTFT p90 s | L3 store / "
        "stored whole | L3 reads: toolkv / restored whole / short | storage read GB / cut | checks |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        c, st = r["counters"], r["storage"] or {}
        kv = 131_072  # bytes a token (default profile); the JSON keeps tokens
        tk = r["config"] == "offload-l3"
        lines.append(
            f"| {r['sessions']} | {r['tool_shape']} | {r['seed']} | {r['config']} | {r['host_gb']:g} | "
            f"{r['live_kv_gb']:.0f} | {r['closed_turns_per_s']:.2f} | {100 * r['reuse']:.0f} % | "
            f"{_f(r['resumed_ttft_p90_s'], '.2f')} | "
            + (f"{c['l3_store']} / {c['demoted_l3']} | {c['l3_prefetch']} / {c['l3_restored']} / "
               f"{c['l3_prefetch_short']} | " if tk else "- | - | ")
            + (f"{st.get('read_tokens', 0) * kv / 1e9:.1f} / {st.get('reads_cut', 0)} | " if st else "- | ")
            + ("pass" if r["passed"] and not r["crashed"] else f"FAIL {r['crashed'] or ''}") + " |"
        )  # fmt: skip
    lines += ["", "| sessions | tools | config | seeds | turns/s vs stock64 | reuse vs stock64 | stock64 holds "
              "the live KV | target (>= 0.8x both) |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for x in data["cells"]:
        met = {None: "-", True: "met", False: "**missed**"}[x["target_met"]]
        lines.append(
            f"| {x['sessions']} | {x['tool_shape']} | {x['config']} | {','.join(map(str, x['seeds']))} | "
            f"{_f(x['tps_ratio'], '.2f')}x | {_f(x['reuse_ratio'], '.2f')}x | "
            f"{'yes' if x['stock64_holds_live_kv'] else 'no'} | {met} |"
        )
    return "\n".join(lines)


def doc_table(data: dict[str, Any]) -> str:
    """What docs/benchmarks.md shows between its twin-l3map markers: the command, then the table."""
    return f"`{data['command']}` (toolkv at `{data.get('commit') or '?'}`):\n\n{table(data)}"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m toolkv.twin.l3map", description=__doc__.split("\n\n")[0])
    p.add_argument("--sessions", default=",".join(map(str, SESSIONS)))
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--seeds", default=",".join(map(str, SEEDS)))
    p.add_argument("--seeds-96", default="0", help="seeds of the 96-session cells (default 0)")
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--jobs", type=int, default=1)
    p.add_argument("--out", default=None, help="write the JSON here (e.g. docs/results/twin/l3map.json)")
    p.add_argument("--doc-table", default=None, metavar="JSON", help="print the docs block of a saved run")
    p.add_argument(
        "--toolkv-env",
        action="append",
        default=[],
        metavar="VAR=VALUE",
        help="a TOOLKV_* setting for toolkv's configurations (repeatable), e.g. TOOLKV_L3=0",
    )
    p.add_argument("--quiet", action="store_true")
    a = p.parse_args(argv)
    if a.doc_table:
        try:
            print(doc_table(json.loads(Path(a.doc_table).read_text())))
        except (OSError, ValueError, KeyError) as e:
            print(f"python -m toolkv.twin.l3map: error: {e}", file=sys.stderr)
            return 2
        return 0
    try:
        sessions = [int(x) for x in a.sessions.split(",")]
        shapes = [x.strip() for x in a.shapes.split(",")]
        seeds = [int(x) for x in a.seeds.split(",")]
        seeds96 = [int(x) for x in a.seeds_96.split(",")] if a.seeds_96 else None
        configs = [x.strip() for x in a.configs.split(",")]
        if set(shapes) - set(SHAPES) or set(configs) - set(CONFIGS):
            raise ValueError(f"shapes among {SHAPES}, configs among {CONFIGS}")
        env = tuple(tuple(x.split("=", 1)) for x in a.toolkv_env)
        if any(len(kv) != 2 for kv in env):
            raise ValueError(f"--toolkv-env takes VAR=VALUE, got {a.toolkv_env}")
        if env:  # a bad name or value stops here, parsed as each run will parse it
            from toolkv.sglang.config import ToolKVConfig
            from toolkv.twin.stack import with_env

            with_env(ToolKVConfig(), env)
    except ValueError as e:
        print(f"python -m toolkv.twin.l3map: error: {e}", file=sys.stderr)
        return 2
    from toolkv.twin.regime_map import _commit

    todo = [(*t, env) for t in plan(sessions, shapes, seeds, configs, seeds96)]
    t0 = time.monotonic()
    rows = run_all(todo, a.jobs, a.quiet)
    cmd = "python -m toolkv.twin.l3map" + "".join(
        f" --{k.replace('_', '-')} {v}"
        for k, v in (
            ("sessions", a.sessions),
            ("shapes", a.shapes),
            ("seeds", a.seeds),
            ("seeds_96", a.seeds_96),
            *(("toolkv_env", x) for x in a.toolkv_env),
        )
    )
    # a run from an exported tree (git archive) names its commit in TOOLKV_COMMIT
    commit = os.environ.get("TOOLKV_COMMIT") or _commit()
    data = {"command": cmd + f" --out {a.out}" if a.out else cmd, "commit": commit, "target": TARGET,
            "rows": rows, "cells": cells(rows), "wall_s": time.monotonic() - t0}  # fmt: skip
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(data, indent=1, default=str) + "\n")
    print(table(data))
    return 0 if all(r["passed"] and not r["crashed"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
