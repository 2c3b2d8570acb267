"""``toolkv twin map``: where toolkv helps, where it does not, and whether it is ever slower than
stock sglang, over a grid of loads.

Axes: sessions (a closed load: all start at once) × HiCache host pool GB × tool shape × sglang's
``--hicache-write-policy`` (``--write-policy``; write_through unless named), each cell
run with several seeds (different sessions, prompts and tool durations). In every cell and seed
the twin runs stock sglang, toolkv ``offload`` and ``auto`` at the cell's host size, and stock at
4× that host (what more memory buys instead). Each run gives the value report's closed-load
figures (``toolkv.workload.metrics.closed_stats``: 90 % of the turns over the time they took, resumed
turns' TTFT, reuse) and the offline bound on reuse (``--opt``); each configuration's ratios are
taken against the stock run of the same seed, then summarised per cell as the median and range
over seeds.

Never worse (``never_worse``): in every cell, ``offload`` and ``auto`` must reach at least 0.98×
stock's closed throughput and at most 1.05× its resumed TTFT p90 (medians over seeds); where the
live KV is at least twice the host pool (toolkv's regime), at least 1.5× throughput or at most
0.7× p90. The fast slice of ``tests/test_regime_map.py`` checks it in ``make test``; the whole map
is ``make test-long``'s and ``docs/results/twin/map.json``'s.

Every run is independent, so the map runs on a process pool (``--jobs``, default every core) and
prints a progress line per run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from toolkv.argtypes import choice_list, int_list, nonneg_int_list, positive_int

SESSIONS = (24, 48, 96, 192)
HOSTS_GB = (8.0, 16.0, 32.0, 64.0)
SHAPES = ("traces", "long", "named")
SEEDS = (0, 1, 2, 3, 4)
CONFIGS = ("stock", "offload", "auto", "stock4x")
#: the write policies (toolkv.twin.configs.WRITE_POLICIES); a run without one in its row (a map
#: made before the axis) ran the first
WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
TOOLKV = ("offload", "auto")
# The load of a cell, as the GPU value load (docs/benchmarks.md): closed, ~6 turns, a first prompt
# of ~3,000 tokens growing by ~900 a turn, 32 answer tokens. The window of turns per tool shape:
# long tools (1-10 minutes) need a longer one for a session to come back at all.
LOAD = dict(arrival_rate=0.0, turns_median=6, first_tokens=3000, growth_per_turn=900, output_tokens=32,
            max_context=16384)  # fmt: skip
DURATION_S = {"traces": 75.0, "named": 100.0, "long": 600.0}
# never worse: the bars of every cell, and of cells where the live KV is at least LIVE_SHARE× the host
MIN_TPS, MAX_P90 = 0.98, 1.05
LIVE_SHARE, WIN_TPS, WIN_P90 = 2.0, 1.5, 0.7


@dataclass(frozen=True)
class Task:
    sessions: int
    host_gb: float
    shape: str
    seed: int
    config: str
    write_policy: str = WRITE_POLICIES[0]


def tasks(
    sessions: Iterable[int], hosts: Iterable[float], shapes: Iterable[str], seeds: Iterable[int],
    configs: Iterable[str], write_policies: Iterable[str] = WRITE_POLICIES[:1],
) -> list[Task]:  # fmt: skip
    """Every run of the map, the heaviest first (the pool ends sooner when long runs start early)."""
    out = [
        Task(n, h, s, seed, c, wp)
        for wp in write_policies
        for s in shapes
        for n in sessions
        for h in hosts
        for seed in seeds
        for c in configs
    ]
    return sorted(out, key=lambda t: -t.sessions)


def _workload(t: Task) -> Any:
    from toolkv.workload.plan import Workload

    return Workload(initial_sessions=t.sessions, tool_shape=t.shape, duration_s=DURATION_S[t.shape], seed=t.seed,
                    **LOAD)  # type: ignore[arg-type]  # fmt: skip


def live_kv_bytes(t: Task, kv_bytes_per_token: int) -> float:
    """The KV the load holds live at its largest: every session's last context, in bytes."""
    from toolkv.workload.plan import make_plan

    plan = make_plan(_workload(t))
    w = plan.workload
    ctx = sum(
        len(s.first) + sum(len(r) for r in s.results) + s.turns * w.output_tokens for s in plan.sessions
    )
    return float(ctx * kv_bytes_per_token)


def run_task(t: Task) -> dict[str, Any]:
    """One twin run (in a worker process): its closed-load figures and the reuse bound."""
    # each worker is a fresh interpreter with its own single-process gloo group: its own port (the
    # parent's MASTER_PORT, inherited, may be taken by the parent's group)
    os.environ["MASTER_PORT"] = str(20_000 + os.getpid() % 30_000)
    from toolkv.twin.configs import REGIMES, get
    from toolkv.twin.profile import default_profile
    from toolkv.twin.report import result
    from toolkv.twin.run import Options, simulate
    from toolkv.twin.sessions import Sessions
    from toolkv.workload.metrics import closed_stats

    name = "stock" if t.config == "stock4x" else t.config
    cfg = (
        get(name)
        .with_host_gb(t.host_gb * (4 if t.config == "stock4x" else 1))
        .with_write_policy(t.write_policy)
    )
    w = _workload(t)
    prof = default_profile()
    t0 = time.process_time()
    o = simulate(Sessions.lazy(w), cfg, prof, Options(device_tokens=REGIMES["constrained"]), progress=False)
    r = result(o, prof, window=(w.ramp_s, w.duration_s), opt=True)
    s = closed_stats(r)
    opt = (r["twin"].get("opt") or {}).get("reuse")
    return {
        "sessions": t.sessions, "host_gb": t.host_gb, "tool_shape": t.shape, "seed": t.seed, "config": t.config,
        "write_policy": t.write_policy, "closed_turns_per_s": s["closed_turns_per_s"], "turns": s["turns"],
        "resumed_ttft_p50_s": s["resumed_ttft_p50_s"], "resumed_ttft_p90_s": s["resumed_ttft_p90_s"],
        "reuse": s["reuse"], "opt_reuse": opt, "passed": bool(r["passed"]), "crashed": r["twin"]["crashed"],
        "live_kv_gb": live_kv_bytes(t, prof.kv_bytes_per_token) / 1e9, "cpu_s": time.process_time() - t0,
        "tree_core": o.meta_end.get("tree_core"),
    }  # fmt: skip


#: sglang's host pool refuses to start when the machine's free memory, less its own reserve, is below
#: the pool (``HostKVCache.__init__``); on a small machine another process's peak can make that so for a
#: moment. Such a run is tried again after a pause rather than ending a map of hours.
_LOW_MEMORY = "Not enough host memory available"
_RETRIES, _RETRY_PAUSE_S = 6, 20.0


def run_task_retrying(t: Task) -> dict[str, Any]:
    """:func:`run_task`, run again (up to ``_RETRIES`` times, ``_RETRY_PAUSE_S`` apart) when sglang's
    host pool refused to start for want of free memory at that moment; any other error ends the map."""
    for attempt in range(_RETRIES + 1):
        try:
            return run_task(t)
        except ValueError as e:
            if _LOW_MEMORY not in str(e) or attempt == _RETRIES:
                raise
            print(
                f"toolkv twin map: {t}: {e}; trying again in {_RETRY_PAUSE_S:g} s",
                file=sys.stderr,
                flush=True,
            )
            time.sleep(_RETRY_PAUSE_S)
    raise AssertionError("unreachable")


def task_of(row: dict[str, Any]) -> Task:
    """The task a finished run's row answers."""
    return Task(int(row["sessions"]), float(row["host_gb"]), str(row["tool_shape"]), int(row["seed"]),
                str(row["config"]), policy_of(row))  # fmt: skip


def policy_of(row: dict[str, Any]) -> str:
    """A run's or cell's write policy (a row written before the axis ran write_through)."""
    return str(row.get("write_policy") or WRITE_POLICIES[0])


def read_journal(path: Path) -> list[dict[str, Any]]:
    """The rows of a run journal (one JSON object a line); a torn last line (a run killed while
    writing) is skipped, so a map stopped at any moment resumes."""
    rows: list[dict[str, Any]] = []
    if not path.exists():
        return rows
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and {"sessions", "host_gb", "tool_shape", "seed", "config"} <= row.keys():
            rows.append(row)
    return rows


def run_map(
    todo: Sequence[Task], jobs: int, quiet: bool = False, journal: Path | None = None
) -> list[dict[str, Any]]:
    """Run every task on ``jobs`` processes, a progress line per finished run on stderr.

    With a ``journal``, every finished run is appended to it as it ends and the runs already in it
    are not run again: the full map takes hours on a small machine, and a stopped one resumes."""
    import multiprocessing as mp

    done: dict[Task, dict[str, Any]] = {}
    if journal is not None:
        want = set(todo)
        done = {task_of(r): r for r in read_journal(journal) if task_of(r) in want}
        if done and not quiet:
            print(f"toolkv twin map: {len(done)} runs already in {journal}, {len(todo) - len(done)} to run",
                  file=sys.stderr)  # fmt: skip
    rows: list[dict[str, Any]] = list(done.values())
    todo = [t for t in todo if t not in done]
    commit = _commit()
    t0 = time.monotonic()
    ctx = mp.get_context("spawn")  # a fresh interpreter per worker: no inherited torch threads
    with ctx.Pool(processes=max(1, jobs), maxtasksperchild=40) as pool:
        for i, row in enumerate(pool.imap_unordered(run_task_retrying, todo), 1):
            row["commit"] = commit
            rows.append(row)
            if journal is not None:
                journal.parent.mkdir(parents=True, exist_ok=True)
                with journal.open("a") as fh:
                    fh.write(json.dumps(row, default=str) + "\n")
            if not quiet:
                el = time.monotonic() - t0
                eta = el / i * (len(todo) - i)
                print(
                    f"[{i}/{len(todo)}] {row['tool_shape']} {row['sessions']} sessions {row['host_gb']:g} GB"
                    f"{_policy_words(row)} seed "
                    f"{row['seed']} {row['config']}: {row['closed_turns_per_s']:.2f} turns/s, p90 "
                    f"{row['resumed_ttft_p90_s']:.2f} s, reuse {100 * row['reuse']:.0f} % "
                    f"({el:.0f} s elapsed, ~{eta:.0f} s left)",
                    file=sys.stderr,
                    flush=True,
                )
    return rows


def _commit() -> str | None:
    """The git commit the runs were made at (provenance in the journal), or None outside a checkout."""
    import subprocess

    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                             cwd=Path(__file__).resolve().parent)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def _policy_words(rec: dict[str, Any]) -> str:
    """`` write_back`` for a cell of another write policy than write_through, else nothing: the
    words of a write_through cell stay what they were before the axis (known misses match them)."""
    wp = policy_of(rec)
    return "" if wp == WRITE_POLICIES[0] else f" {wp}"


def _ratio(a: float, b: float) -> float:
    return a / b if b and math.isfinite(a) and math.isfinite(b) else math.nan


def _summary(xs: list[float]) -> dict[str, float]:
    ys = [x for x in xs if math.isfinite(x)]
    if not ys:
        return {"median": math.nan, "min": math.nan, "max": math.nan}
    return {"median": statistics.median(ys), "min": min(ys), "max": max(ys)}


def cells(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One record per cell and configuration: medians and ranges over seeds of the ratios to the
    same seed's stock run, with the seeds and the live KV against the host pool."""
    by: dict[tuple[Any, ...], dict[int, dict[str, dict[str, Any]]]] = {}
    for r in rows:
        cell = (r["tool_shape"], r["sessions"], r["host_gb"], WRITE_POLICIES.index(policy_of(r)))
        by.setdefault(cell, {}).setdefault(r["seed"], {})[r["config"]] = r
    out = []
    for (shape, n, host, wpi), seeds in sorted(by.items()):
        configs = sorted(
            {c for runs in seeds.values() for c in runs},
            key=lambda c: CONFIGS.index(c) if c in CONFIGS else 9,
        )
        for c in configs:
            pairs = [(runs[c], runs.get("stock")) for runs in seeds.values() if c in runs]
            live = statistics.median(r["live_kv_gb"] for r, _ in pairs)
            rec: dict[str, Any] = {
                "tool_shape": shape, "sessions": n, "host_gb": host, "config": c,
                "seeds": sorted(r["seed"] for r, _ in pairs), "live_kv_gb": live, "live_over_host": live / host,
            }  # fmt: skip
            if wpi:  # a write_through cell keeps the record it had before the axis
                rec["write_policy"] = WRITE_POLICIES[wpi]
            for key, field in (
                ("tps", "closed_turns_per_s"),
                ("p50", "resumed_ttft_p50_s"),
                ("p90", "resumed_ttft_p90_s"),
            ):
                rec[f"{key}_vs_stock"] = _summary(
                    [_ratio(r[field], s[field]) if s else math.nan for r, s in pairs]
                )
                rec[field] = _summary([r[field] for r, _ in pairs])
            rec["reuse"] = _summary([r["reuse"] for r, _ in pairs])
            rec["reuse_of_opt"] = _summary(
                [_ratio(r["reuse"], r["opt_reuse"]) if r.get("opt_reuse") else math.nan for r, _ in pairs]
            )
            rec["all_passed"] = all(r["passed"] and not r["crashed"] for r, _ in pairs)
            out.append(rec)  # fmt: skip
    return out


def never_worse(recs: list[dict[str, Any]], configs: Sequence[str] = TOOLKV) -> list[str]:
    """The cells where ``offload`` or ``auto`` is slower than stock: below ``MIN_TPS`` of its closed
    throughput or above ``MAX_P90`` of its resumed TTFT p90 (medians over seeds), or a run that
    failed its checks. This is the bar an operator needs to leave toolkv on; it must hold in every
    cell."""
    return [m for m in misses(recs, configs) if "live KV" not in m]


def short_of_target(recs: list[dict[str, Any]]) -> list[str]:
    """The cells whose live KV is at least ``LIVE_SHARE``× the host pool where toolkv reaches
    neither ``WIN_TPS``× stock's throughput nor ``WIN_P90``× its p90: where it does not yet pay off
    as much as the target says."""
    return [m for m in misses(recs) if "live KV" in m]


def misses(recs: list[dict[str, Any]], configs: Sequence[str] = TOOLKV) -> list[str]:
    """Every bar of the module doc that a toolkv cell misses, one line each."""
    bad = []
    for r in recs:
        if r["config"] not in configs:
            continue
        tps, p90 = r["tps_vs_stock"]["median"], r["p90_vs_stock"]["median"]
        where = (
            f"{r['tool_shape']} {r['sessions']} sessions {r['host_gb']:g} GB{_policy_words(r)} {r['config']}"
        )
        if not r["all_passed"]:
            bad.append(f"{where}: a run failed its checks (crash, leak or 5xx)")
        if not tps >= MIN_TPS:
            bad.append(f"{where}: closed throughput {tps:.2f}x stock < {MIN_TPS}")
        if not p90 <= MAX_P90:
            bad.append(f"{where}: resumed TTFT p90 {p90:.2f}x stock > {MAX_P90}")
        if r["live_over_host"] >= LIVE_SHARE and not (tps >= WIN_TPS or p90 <= WIN_P90):
            bad.append(
                f"{where}: live KV {r['live_over_host']:.1f}x the host pool, but {tps:.2f}x throughput and "
                f"{p90:.2f}x p90 (needs >= {WIN_TPS}x or <= {WIN_P90}x)"
            )
    return bad


def table(recs: list[dict[str, Any]]) -> str:
    head = ("tool shape", "sessions", "host GB", "write policy", "live KV ÷ host", "config", "turns/s × stock",
            "p50 × stock", "p90 × stock", "reuse", "reuse ÷ opt", "seeds")  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def f(s: dict[str, float], pct: bool = False) -> str:
        k = 100.0 if pct else 1.0
        unit = " %" if pct else "×"
        return f"{k * s['median']:.{0 if pct else 2}f}{unit} ({k * s['min']:.{0 if pct else 2}f}–{k * s['max']:.{0 if pct else 2}f})"

    for r in recs:
        lines.append(
            f"| {r['tool_shape']} | {r['sessions']} | {r['host_gb']:g} | {policy_of(r)} | {r['live_over_host']:.1f} "
            f"| {r['config']} "
            f"| {f(r['tps_vs_stock'])} | {f(r['p50_vs_stock'])} | {f(r['p90_vs_stock'])} | {f(r['reuse'], True)} "
            f"| {f(r['reuse_of_opt'], True)} | {len(r['seeds'])} |"
        )
    return "\n".join(lines)


def doc_table(data: dict[str, Any]) -> str:
    """The map as docs/benchmarks.md shows it (generated from ``map.json``, checked by a test): one
    row per cell, each toolkv configuration's and stock at 4× the host's medians over seeds."""
    recs = data["cells"]
    # a map of several write policies gets a column for it; one of write_through alone (every map
    # before the axis) keeps the table it had
    wide = any("write_policy" in r for r in recs)
    by: dict[tuple[Any, ...], dict[str, dict[str, Any]]] = {}
    for r in recs:
        by.setdefault((r["tool_shape"], r["sessions"], r["host_gb"], policy_of(r)), {})[r["config"]] = r
    head = ("tools", "sessions", "host GB", *(("write policy",) if wide else ()), "live KV ÷ host", "stock reuse", "offload turns/s / p90 × stock",
            "offload reuse (÷ opt)", "auto turns/s / p90 × stock", "stock 4× host turns/s / p90 × stock")  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def pair(r: dict[str, Any] | None) -> str:
        if r is None:
            return "-"
        return f"{r['tps_vs_stock']['median']:.2f}× / {r['p90_vs_stock']['median']:.2f}×"

    for (shape, n, host, wp), cs in sorted(by.items(), key=lambda kv: (
            SHAPES.index(kv[0][0]) if kv[0][0] in SHAPES else 9, kv[0][1], kv[0][2], WRITE_POLICIES.index(kv[0][3]))):  # fmt: skip
        st, off = cs.get("stock"), cs.get("offload")
        any_rec = next(iter(cs.values()))
        opt = (
            f"{100 * off['reuse']['median']:.0f} % ({100 * off['reuse_of_opt']['median']:.0f} %)"
            if off
            else "-"
        )
        stock_reuse = "-" if st is None else f"{100 * st['reuse']['median']:.0f} %"
        lines.append(
            f"| {shape} | {n} | {host:g} | {f'{wp} | ' if wide else ''}{any_rec['live_over_host']:.1f} "
            f"| {stock_reuse} | {pair(off)} | {opt} "
            f"| {pair(cs.get('auto'))} | {pair(cs.get('stock4x'))} |"
        )
    return "\n".join(lines)


def plot(recs: list[dict[str, Any]], out: Path) -> None:
    """Heat maps: per tool shape (rows) and toolkv configuration (columns), the median closed
    throughput × stock over sessions × host GB, each square annotated with it and the p90 × stock."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = sorted({r["tool_shape"] for r in recs})
    cfgs = [c for c in (*TOOLKV, "stock4x") if any(r["config"] == c for r in recs)]
    fig, axes = plt.subplots(
        len(shapes), len(cfgs), figsize=(4.2 * len(cfgs), 3.6 * len(shapes)), squeeze=False
    )
    for i, shape in enumerate(shapes):
        for j, c in enumerate(cfgs):
            ax = axes[i][j]
            sub = [r for r in recs if r["tool_shape"] == shape and r["config"] == c]
            ns = sorted({r["sessions"] for r in sub})
            hs = sorted({r["host_gb"] for r in sub})
            grid = [[math.nan] * len(hs) for _ in ns]
            for r in sub:
                y, x = ns.index(r["sessions"]), hs.index(r["host_gb"])
                grid[y][x] = r["tps_vs_stock"]["median"]
                ax.text(x, y, f"{r['tps_vs_stock']['median']:.2f}×\np90 {r['p90_vs_stock']['median']:.2f}×",
                        ha="center", va="center", fontsize=7)  # fmt: skip
            im = ax.imshow(grid, cmap="RdYlGn", vmin=0.5, vmax=2.0, origin="lower", aspect="auto")
            ax.set_xticks(range(len(hs)), [f"{h:g}" for h in hs])
            ax.set_yticks(range(len(ns)), [str(n) for n in ns])
            ax.set_xlabel("host pool, GB")
            ax.set_ylabel("sessions")
            ax.set_title(f"{c} / stock, tools: {shape}", fontsize=9)
    fig.colorbar(im, ax=axes, shrink=0.6, label="closed turns/s × stock (median over seeds)")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)


def _ints(s: str | list[int]) -> list[int]:
    """An axis: parsed by its flag's type already (a list), or a comma list given in code."""
    return list(s) if isinstance(s, list) else [int(x) for x in s.split(",") if x.strip()]


def _floats(s: str | list[float]) -> list[float]:
    return list(s) if isinstance(s, list) else [float(x) for x in s.split(",") if x.strip()]


def main(a: argparse.Namespace) -> int:
    """``toolkv twin map`` (arguments: see :func:`add_map_arguments`)."""
    try:
        sessions = _ints(a.map_sessions)
        hosts = _floats(a.host_gb) if a.host_gb else list(HOSTS_GB)
        shapes = [s.strip() for s in a.map_shapes.split(",") if s.strip()]
        seeds = _ints(a.seeds)
        configs = [c.strip() for c in (a.configs or ",".join(CONFIGS)).split(",") if c.strip()]
        policies = [w.strip() for w in (getattr(a, "write_policy", None) or WRITE_POLICIES[0]).split(",")]
        bad = [s for s in shapes if s not in DURATION_S] + [c for c in configs if c not in CONFIGS]
        if (
            bad
            or not (sessions and hosts and shapes and seeds and configs)
            or min(sessions) < 1
            or min(hosts) <= 0
        ):
            raise ValueError(f"bad axis values {bad}" if bad else "every axis needs positive values")
        if "stock" not in configs:
            raise ValueError("the map needs stock: every ratio is against the stock run of the same seed")
    except ValueError as e:
        print(f"toolkv twin map: error: {e}", file=sys.stderr)
        return 2
    todo = tasks(sessions, hosts, shapes, seeds, configs, policies)
    jobs = a.jobs or os.cpu_count() or 1
    if not a.quiet:
        print(f"toolkv twin map: {len(todo)} runs on {jobs} processes", file=sys.stderr)
    t0 = time.monotonic()
    journal = Path(a.journal) if a.journal else (Path(a.out).with_suffix(".runs.jsonl") if a.out else None)
    rows = run_map(todo, jobs, quiet=a.quiet, journal=journal)
    recs = cells(rows)
    bad = never_worse(recs)
    short = short_of_target(recs)
    axes = {
        "sessions": sessions,
        "hosts_gb": hosts,
        "tool_shapes": shapes,
        "seeds": seeds,
        "configs": configs,
        **({"write_policies": policies} if policies != [WRITE_POLICIES[0]] else {}),
    }
    data = {
        "axes": axes, "load": LOAD | {"duration_s": DURATION_S}, "regime": "constrained",
        "bars": {"min_tps": MIN_TPS, "max_p90": MAX_P90, "live_share": LIVE_SHARE, "win_tps": WIN_TPS,
                 "win_p90": WIN_P90},
        "cells": recs, "runs": sorted(rows, key=lambda r: (r["tool_shape"], r["sessions"], r["host_gb"], r["seed"],
                                                          r["config"])),
        "commits": sorted({str(r.get("commit")) for r in rows}),
        "never_worse_violations": bad, "short_of_target": short, "wall_s": time.monotonic() - t0,
    }  # fmt: skip
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(data, indent=1, default=str) + "\n")
    if a.plot:
        plot(recs, Path(a.plot))
    if a.json:
        print(json.dumps(data, indent=1, default=str))
    else:
        print(table(recs))
        print()
        print("never worse: " + ("every cell" if not bad else f"{len(bad)} misses\n- " + "\n- ".join(bad)))
        print(
            f"target where the live KV is >= {LIVE_SHARE:g}x the host: "
            + ("met in every cell" if not short else f"missed in {len(short)}\n- " + "\n- ".join(short))
        )
    if bad and getattr(a, "known", None):
        known = _cells_of(json.loads(Path(a.known).read_text()).get("never_worse_violations", []))
        new = [m for m in bad if _cells_of([m]) - known]
        print(
            f"known misses (in {a.known}): {len(bad) - len(new)}; new: {len(new)}"
            + "".join(f"\n- {m}" for m in new)
        )
        return 0 if not new else 1
    return 0 if not bad else 1


def _cells_of(misses: Iterable[str]) -> set[str]:
    """The cell and configuration a never-worse line names (its text before the colon)."""
    return {m.split(":", 1)[0] for m in misses}


def add_map_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--map-sessions", default=",".join(map(str, SESSIONS)), type=int_list,
        help="map: comma list of session counts",
    )  # fmt: skip
    p.add_argument(
        "--map-shapes",
        default=",".join(SHAPES),
        type=choice_list(SHAPES),
        help="map: comma list of tool shapes",
    )
    p.add_argument(
        "--seeds", default=",".join(map(str, SEEDS)), type=nonneg_int_list, help="map: comma list of seeds"
    )
    p.add_argument(
        "--jobs", type=positive_int, default=None, help="map: worker processes (default: every core)"
    )
    p.add_argument(
        "--known",
        default=None,
        metavar="MAP_JSON",
        help="map: a committed map whose never-worse misses are known; exit 1 only for a cell and "
        "configuration that misses now and did not there (a regression)",
    )
    p.add_argument(
        "--journal",
        default=None,
        help="map: append each finished run to this JSONL file and skip the runs already in it "
        "(default: next to --out, as <out>.runs.jsonl), so a stopped map resumes",
    )


def _print_doc_table(argv: Sequence[str] | None = None) -> int:
    """``python -m toolkv.twin.regime_map --doc-table MAP.json``: print the docs table of a saved map
    (what docs/benchmarks.md shows between its twin-map markers), without running anything."""
    p = argparse.ArgumentParser(prog="python -m toolkv.twin.regime_map", description=_print_doc_table.__doc__)
    p.add_argument(
        "--doc-table", required=True, metavar="MAP_JSON", help="a map.json written by toolkv twin map"
    )
    p.add_argument("--facts", action="store_true", help="print the facts block of docs/benchmarks.md instead")
    a = p.parse_args(argv)
    try:
        data = json.loads(Path(a.doc_table).read_text())
        from toolkv.twin.map_facts import facts

        print(facts(data) if a.facts else doc_table(data))
    except (OSError, ValueError, KeyError) as e:
        print(
            f"python -m toolkv.twin.regime_map: error: cannot read a map from {a.doc_table}: {e}",
            file=sys.stderr,
        )
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(_print_doc_table())
