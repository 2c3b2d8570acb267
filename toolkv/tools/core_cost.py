"""What sglang 0.5.23's radix tree core costs, stock and with toolkv, on each core (a benchmark,
not a test: it prints a table and writes JSON; nothing asserts a speed).

    python -m toolkv.tools.core_cost [--sessions 48,96] [--reps 3] [--out FILE.json]

Runs in the 0.5.23 environment (``.venv-0523``), whose torch the wheel's Rust core is built for.

1. **Tree operations per core**: a ``UnifiedRadixCache`` over CPU pools with the sessions' paths
   in it (a shared prompt, then each session's own turns), and the calls a scheduler and toolkv
   make per request or per tool call, each timed over every session, ``--reps`` times (the
   median): ``match`` (``match_prefix`` of a session's tokens), ``insert`` (one turn's 32 new
   tokens), ``evict`` (64 tokens), ``backup`` (``build_backup_kv_action`` of a session's leaf),
   ``path`` (``collect_path_info``, how toolkv reads a path on the Rust core), ``lock`` (a path lock
   and its release with the receipt). Reported as microseconds per call.
2. **The twin's 0.5.23 scheduler** (sglang's own admission over the real cache, GPU time modelled)
   on the value load at each session count: stock and toolkv's ``offload`` on each core, ``--reps``
   times in interleaved order, reporting the CPU time per scheduler iteration (the cost a core adds
   to a real scheduler's loop: the median over the repetitions), and the simulated throughput and
   resumed-turn TTFT p90 (which the core must not change: the twin is deterministic, so they are
   one number per cell).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from toolkv.argtypes import int_list, positive_int

CORES = ("python", "rust")
CONFIGS = ("stock", "offload")


# ---- 1. tree operations -----------------------------------------------------------------------------
def _tree_ops(core: Any, sessions: int, reps: int) -> dict[str, float]:
    import torch
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams

    from toolkv.testing.unified_harness import UnifiedCacheHarness, UnifiedHarnessConfig, rkey

    shared = list(range(1, 513))
    cfg = UnifiedHarnessConfig(
        tree_core=core, device_tokens=sessions * 400 + 2048, host_ratio=2.0, layers=1, heads=1, head_dim=1,
        dtype=torch.float16, write_policy="write_back", context_len=8192,
    )  # fmt: skip
    out: dict[str, list[float]] = {k: [] for k in ("match", "insert", "evict", "backup", "path", "lock")}
    for rep in range(reps):
        with UnifiedCacheHarness(cfg) as h:
            tree, tc = h.tree, h.tree.tree_core
            paths = [shared + list(range(10_000 * (i + 1), 10_000 * (i + 1) + 256)) for i in range(sessions)]
            t = time.perf_counter()
            for p in paths:
                idx = h.allocator.alloc(len(p))
                assert idx is not None
                tree.insert(InsertParams(key=rkey(p, None), value=idx))
            out["insert"].append((time.perf_counter() - t) / sessions)
            t = time.perf_counter()
            leaves = [h.match(p).last_device_node for p in paths]
            out["match"].append((time.perf_counter() - t) / sessions)
            ids = [leaf if isinstance(leaf, int) else leaf.id for leaf in leaves]
            t = time.perf_counter()
            for nid in ids:
                tc.collect_path_info([nid])
            out["path"].append((time.perf_counter() - t) / sessions)
            t = time.perf_counter()
            for nid in ids:
                tc.build_backup_kv_action(nid)
            out["backup"].append((time.perf_counter() - t) / sessions)
            t = time.perf_counter()
            for nid in ids:
                tree.dec_lock_ref(nid, tree.inc_lock_ref(nid).to_dec_params())
            out["lock"].append((time.perf_counter() - t) / sessions)
            t = time.perf_counter()
            for _ in range(sessions):
                tree.evict(EvictParams(num_tokens=64))
            out["evict"].append((time.perf_counter() - t) / sessions)
        del rep
    return {k: 1e6 * statistics.median(v) for k, v in out.items()}


# ---- 2. the twin's scheduler ------------------------------------------------------------------------
def _twin(core: str, config: str, sessions: int) -> dict[str, Any]:
    os.environ["SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND"] = core  # the twin's stack reads sglang's setting
    from toolkv.twin.configs import REGIMES, get
    from toolkv.twin.profile import default_profile
    from toolkv.twin.report import result
    from toolkv.twin.run import Options, simulate
    from toolkv.twin.sessions import Sessions
    from toolkv.workload.metrics import closed_stats
    from toolkv.workload.plan import Workload

    w = Workload(
        initial_sessions=sessions, arrival_rate=0.0, turns_median=6, first_tokens=3000, growth_per_turn=900,
        output_tokens=32, max_context=16384, duration_s=75.0,
    )  # fmt: skip
    prof = default_profile()
    t0 = time.process_time()
    o = simulate(Sessions.lazy(w), get(config), prof, Options(device_tokens=REGIMES["constrained"]))
    cpu = time.process_time() - t0
    r = result(o, prof, window=(w.ramp_s, w.duration_s))
    s = closed_stats(r)
    return {
        "core": core, "config": config, "sessions": sessions, "iterations": o.iterations,
        "cpu_s": cpu, "cpu_ms_per_iteration": 1e3 * cpu / max(1, o.iterations),
        "closed_turns_per_s": s["closed_turns_per_s"], "resumed_ttft_p90_s": s["resumed_ttft_p90_s"],
        "reuse": s["reuse"], "passed": bool(r["passed"]), "crashed": r["twin"]["crashed"],
    }  # fmt: skip


def _run_twin_cell(core: str, config: str, sessions: int) -> dict[str, Any]:
    """One twin run in a fresh interpreter (the tree core is chosen when sglang builds the cache,
    and a process keeps sglang's module state: one run per process, as the regime map does)."""
    import subprocess

    code = (
        "import json, sys; from toolkv.tools.core_cost import _twin; "
        f"print('CELL ' + json.dumps(_twin({core!r}, {config!r}, {sessions})))"
    )
    env = dict(
        os.environ,
        SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=core,
        MASTER_PORT=str(21_000 + os.getpid() % 20_000),
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=False)
    line = next((x for x in p.stdout.splitlines() if x.startswith("CELL ")), None)
    if line is None:
        raise RuntimeError(f"twin {core}/{config}/{sessions} failed: {p.stderr[-2000:]}")
    return dict(json.loads(line[5:]))


# ---- the report -------------------------------------------------------------------------------------
def table(res: dict[str, Any]) -> str:
    """The two Markdown tables of one run's JSON (what the docs quote, generated)."""
    ops = res["tree_ops"]
    names = list(next(iter(ops.values())))
    lines = [
        f"Tree operations, microseconds per call (median of {res['reps']}, {res['ops_sessions']} session paths):",
        "",
        "| core | " + " | ".join(names) + " |",
        "|---|" + "---|" * len(names),
    ]
    lines += [f"| {core} | " + " | ".join(f"{ops[core][n]:.1f}" for n in names) + " |" for core in CORES]
    lines += [
        "",
        f"The twin's 0.5.23 scheduler on the value load (CPU ms per scheduler iteration: median of {res['reps']}):",
        "",
        "| sessions | config | core | CPU ms / iteration | turns/s | resumed TTFT p90 s | reuse | checks |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for cell in res["twin"]:
        lines.append(
            f"| {cell['sessions']} | {cell['config']} | {cell['core']} | {cell['cpu_ms_per_iteration']:.2f} | "
            f"{cell['closed_turns_per_s']:.3f} | {cell['resumed_ttft_p90_s']:.2f} | {100 * cell['reuse']:.0f} % | "
            f"{'pass' if cell['passed'] else 'FAIL'} |"
        )
    return "\n".join(lines)


def run(sessions: list[int], reps: int, ops_sessions: int = 64, progress: bool = True) -> dict[str, Any]:
    res: dict[str, Any] = {"reps": reps, "ops_sessions": ops_sessions, "tree_ops": {}, "twin": []}
    for core in CORES:
        if progress:
            print(f"tree operations on the {core} core ...", file=sys.stderr, flush=True)
        res["tree_ops"][core] = _tree_ops(core, ops_sessions, reps)
    runs: dict[tuple[int, str, str], list[dict[str, Any]]] = {}
    for rep in range(reps):
        order = CORES if rep % 2 == 0 else tuple(reversed(CORES))  # interleaved: a drift hits both
        for n in sessions:
            for config in CONFIGS:
                for core in order:
                    if progress:
                        print(
                            f"twin rep {rep + 1}/{reps}: {n} sessions, {config}, {core} core",
                            file=sys.stderr,
                            flush=True,
                        )
                    runs.setdefault((n, config, core), []).append(_run_twin_cell(core, config, n))
    for cells in runs.values():
        cell = dict(cells[0])
        cell["cpu_ms_per_iteration"] = statistics.median(c["cpu_ms_per_iteration"] for c in cells)
        cell["cpu_ms_per_iteration_runs"] = [c["cpu_ms_per_iteration"] for c in cells]
        cell["same_simulation"] = all(
            (c["closed_turns_per_s"], c["resumed_ttft_p90_s"])
            == (cell["closed_turns_per_s"], cell["resumed_ttft_p90_s"])
            for c in cells
        )
        res["twin"].append(cell)
    res["twin"].sort(key=lambda c: (c["sessions"], c["config"], c["core"]))
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m toolkv.tools.core_cost", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--sessions", type=int_list, default=[48, 96], help="twin session counts")
    ap.add_argument("--reps", type=positive_int, default=3, help="repetitions of every measurement")
    ap.add_argument("--out", default=None, help="write the JSON here")
    a = ap.parse_args(argv)
    from toolkv.testing.unified_harness import has_unified_radix_cache

    if not has_unified_radix_cache():
        ap.error("needs sglang 0.5.23 (run it with .venv-0523/bin/python)")
    res = run(list(a.sessions), a.reps)
    print(table(res))
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
