"""The value table of one GPU run: each toolkv configuration against stock sglang at the same host size.

Input: the ``toolkv bench agent`` JSON files of one run (``stock16.json``, ``offload16.json``,
``auto16.json``, ``stock64.json``, ...: the digits are the host pool in GB, ``stock<GB>`` is the
reference at its size; a variant after the digits, as in ``stock16l3`` and ``toolkv16l3`` (with an
L3 tier: scripts/gpu_l3_capacity.sh), is compared to the reference of its size). The load is closed
(every session starts at once), so the window throughput of ``bench agent`` only says the window was long enough; the table's throughput
is ``closed_turns_per_s``: 90 % of the turns over the time it took to complete them (the last tenth
waits mostly on the longest tool calls). Computed from the per-turn records, so older JSON works too.

``python -m toolkv.tools.value_report DIR [--json OUT]`` prints a Markdown table.

Repeated runs. One run is one folder of those files, all measured on one server in one call (a
*repetition*: stock16, offload16, auto16 ... interleaved); several runs are several such folders.
The report switches to the repeated-runs summary when it is given

- two or more folders: ``value_report runs/r1 runs/r2 runs/r3`` (each folder one run), or
- one folder that holds no result file itself but run folders: ``value_report runs`` (its
  subfolders with result files, in natural order: ``r1, r2, ..., r10``), or ``--runs`` with one
  run folder (a summary of one run).

``scripts/gpu_value_repeat.sh`` writes that layout (``r<k>/<config>.json``). Each run's ratios are
taken against the stock run of the same repetition and the same host size (never against another
run's stock: the run-to-run spread of this load is larger than the effect), then summarised per
config as the median and the range (min-max) over runs of: closed turns/s × stock, resumed TTFT p50
and p90 × stock, reuse, and the closed turns/s itself; ``runs`` is how many runs have the config
(``3 (2 vs stock)`` where a run lacks its stock reference: such a run counts for reuse and turns/s
but not for the ratios). A file with no completed turn (a server that died) is left out with a
warning. A compact per-run table follows. ``--json`` then writes ``{"runs": {run: rows},
"summary": rows}``.

Eviction harm. Where the server reported it (a toolkv with the count), each run's
``toolkv:kv_recomputed_after_evict_tokens_total`` over the run (``server_meta`` end less before:
prompt tokens recomputed whose KV the cache held earlier, ``session`` / ``other``) follows as a table
of its own: what toolkv saves its sessions (offload/auto against stock, whose agents send no
session id, so all of its harm is ``other``) and what it costs other requests.

Standard library only (with :mod:`toolkv.workload.metrics`, which computes each run's row).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
from pathlib import Path
from typing import Any

# one run's closed-load figures (a row of the table) are the workload's metrics, shared with the twin
from toolkv.workload.metrics import EmptyRun, recomputed_between
from toolkv.workload.metrics import closed_stats as stats

# a config's name: kind, host pool in GB, then a variant (``stock16``, ``offload64``, ``stock16l3``: stock
# sglang at 16 GB with an L3 tier, ``toolkv16l3``)
_NAME = re.compile(r"([A-Za-z_-]*?)(\d+)(.*)")


def host_gb(config: str) -> str:
    m = _NAME.fullmatch(config)
    return m.group(2) if m else ""


def is_reference(config: str) -> bool:
    """The stock row of its host size: ``stock<GB>`` with no variant (``stock16l3`` is compared to it)."""
    return re.fullmatch(r"stock\d*", config) is not None


def config_order(config: str) -> tuple[int, int, str]:
    """Rows by host size, then stock, offload, auto, toolkv, each plain before its variants (a stable
    sort keeps the rest in file order)."""
    order = {"stock": 0, "offload": 1, "auto": 2, "toolkv": 3}
    m = _NAME.fullmatch(config)
    if m is None:
        return 0, order.get(config, 9), ""
    return int(m.group(2)), order.get(m.group(1), 9), m.group(3)


def compare(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each row with its ratios to the stock row of the same host size (none for a missing stock)."""
    ref = {host_gb(r["config"]): r for r in rows if is_reference(r["config"])}
    out = []
    for r in rows:
        s = ref.get(host_gb(r["config"]))
        r = dict(r)
        r["tps_vs_stock"] = r["closed_turns_per_s"] / s["closed_turns_per_s"] if s else None
        r["p50_vs_stock"] = r["resumed_ttft_p50_s"] / s["resumed_ttft_p50_s"] if s else None
        r["p90_vs_stock"] = r["resumed_ttft_p90_s"] / s["resumed_ttft_p90_s"] if s else None
        out.append(r)
    return out


def markdown(rows: list[dict[str, Any]]) -> str:
    head = (
        "| config | turns | t90 s | turns/s (closed) | × stock | resumed TTFT p50 / p90 s | p90 × stock |"
        " reuse | resumed with 0 cached | prefill computed | tool_start / tool_end refused |"
    )
    lines = [head, "|" + "---|" * 11]
    for r in rows:
        x = r["tps_vs_stock"]
        p = r["p90_vs_stock"]
        lines.append(
            f"| {r['config']} | {r['turns']} | {r['t90_s']:.1f} | {r['closed_turns_per_s']:.2f} |"
            f" {'-' if x is None else f'{x:.2f}×'} | {r['resumed_ttft_p50_s']:.2f} / {r['resumed_ttft_p90_s']:.2f} |"
            f" {'-' if p is None else f'{p:.2f}×'} | {100 * r['reuse']:.0f} % |"
            f" {r['resumed_zero_cached']} of {r['resumed_turns']} | {r['prefill_computed_tokens']:,} |"
            f" {r['tool_start_refused']} / {r['tool_end_refused']} |"
        )
    return "\n".join(lines)


def harm_markdown(rows: list[dict[str, Any]], run: str | None = None) -> str:
    """The eviction-harm table (``toolkv:kv_recomputed_after_evict_tokens_total`` over each run:
    prompt tokens recomputed whose KV the cache held earlier, for requests with a session id and
    for the others), or "" when no run reported it (results recorded before the count)."""
    have = [r for r in rows if r.get("recomputed_after_evict") is not None]
    if not have:
        return ""
    lines = [
        ("| run " if run is not None else "")
        + "| config | recomputed after evict: session | other | total |",
        "|" + "---|" * (5 if run is not None else 4),
    ]
    for r in have:
        h = r["recomputed_after_evict"]
        lines.append(
            (f"| {run} " if run is not None else "")
            + f"| {r['config']} | {h['session']:,} | {h['other']:,} | {h['total']:,} |"
        )
    return "\n".join(lines)


def answers_markdown(rows: list[dict[str, Any]]) -> str:
    """Resumed turns by toolkv's answers (configurations that call toolkv)."""
    lines = ["| config | tool_start / tool_end | resumed turns | with 0 cached tokens |", "|---|---|---|---|"]
    for r in rows:
        for key, (n, zero) in sorted(r["by_answer"].items(), key=lambda kv: -kv[1][0]):
            if key != "- / -":
                lines.append(f"| {r['config']} | {key} | {n} | {zero} |")
    return "\n".join(lines)


def load(paths: list[Path], skip_empty: bool = False) -> list[dict[str, Any]]:
    """The rows of one run (files, or folders of them), each with its ratios to the run's stock.
    ``skip_empty``: leave out a file with no completed turn (with a warning) instead of failing."""
    files: list[Path] = []
    for p in paths:
        files += sorted(p.glob("*.json")) if p.is_dir() else [p]
    if not files:
        raise ValueError("no result file in " + ", ".join(map(str, paths)))
    rows = []
    for f in files:
        try:
            res = json.loads(f.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"{f}: not a bench agent result ({e})") from e
        if not isinstance(res, dict) or "turns" not in res or "config" not in res:
            raise ValueError(f"{f}: not a bench agent result (no turns)")
        try:
            row = stats(res)
        except EmptyRun as e:
            if not skip_empty:
                raise ValueError(f"{f}: {e}") from e
            print(f"value_report: {f}: left out ({e})", file=sys.stderr)
            continue
        meta = res.get("server_meta") or {}
        row["recomputed_after_evict"] = recomputed_between(meta.get("before"), meta.get("end"))
        rows.append(row)
    rows.sort(key=lambda r: config_order(r["config"]))
    return compare(rows)


def _natural(name: str) -> list[Any]:
    return [int(x) if x.isdigit() else x for x in re.split(r"(\d+)", name)]


def run_folders(paths: list[Path], force: bool = False) -> list[Path] | None:
    """The run folders when ``paths`` name repeated runs (see the module docstring), else None."""
    dirs = [p for p in paths if p.is_dir()]
    if len(paths) >= 2 and len(dirs) == len(paths):
        return paths
    if len(paths) == 1 and dirs and not any(dirs[0].glob("*.json")):
        subs = [d for d in dirs[0].iterdir() if d.is_dir() and any(d.glob("*.json"))]
        if subs:
            return sorted(subs, key=lambda d: _natural(d.name))
    if force:
        if len(dirs) != len(paths):
            raise ValueError("--runs takes run folders, not files")
        return paths
    if len(paths) >= 2 and dirs:
        raise ValueError("several paths are either result files (one run) or run folders (repeated runs)")
    return None


def load_runs(folders: list[Path]) -> dict[str, list[dict[str, Any]]]:
    """Each run folder's rows (ratios within the run), keyed by a unique run label (the folder's
    name, or its path where two names are equal)."""
    names = [f.name for f in folders]
    out: dict[str, list[dict[str, Any]]] = {}
    for f, name in zip(folders, names, strict=True):
        label = name if names.count(name) == 1 else str(f)
        rows = load([f], skip_empty=True) if any(f.glob("*.json")) else []
        if rows:
            out[label] = rows
        else:
            print(f"value_report: {f}: no result with a completed turn, left out", file=sys.stderr)
    return out


def _spread(xs: list[float]) -> dict[str, float] | None:
    if not xs:
        return None
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


# the fields summarised over runs: the ratios against the same repetition's stock, reuse, and two
# absolute figures (turns/s and p90 vary from run to run with the machine; the ratios less)
SUMMARY_FIELDS = (
    "tps_vs_stock", "p50_vs_stock", "p90_vs_stock", "reuse", "closed_turns_per_s", "resumed_ttft_p90_s",
)  # fmt: skip


def summarize_runs(runs: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per config, over the runs that have it: the median and range of each summary field (ratios
    only over runs with a stock reference), the number of runs and of runs with a reference."""
    by_cfg: dict[str, list[dict[str, Any]]] = {}
    for rows in runs.values():
        for r in rows:
            by_cfg.setdefault(r["config"], []).append(r)
    out = []
    for cfg, rows in by_cfg.items():
        rec: dict[str, Any] = {
            "config": cfg,
            "runs": len(rows),
            "runs_vs_stock": sum(1 for r in rows if r["tps_vs_stock"] is not None),
        }
        for key in SUMMARY_FIELDS:
            rec[key] = _spread([r[key] for r in rows if r.get(key) is not None and not math.isnan(r[key])])
        out.append(rec)
    out.sort(key=lambda r: config_order(r["config"]))
    return out


def _cell(s: dict[str, float] | None, digits: int, unit: str = "", scale: float = 1.0) -> str:
    """``median unit (min–max)``, or the one value when every run agrees."""
    if s is None:
        return "-"
    med, lo, hi = (f"{scale * s[k]:.{digits}f}" for k in ("median", "min", "max"))
    return f"{med}{unit}" if lo == hi else f"{med}{unit} ({lo}–{hi})"


def runs_markdown(summary: list[dict[str, Any]], runs: dict[str, list[dict[str, Any]]]) -> str:
    """The summary table (median (min–max) over runs), then one line per run and config."""
    lines = [
        f"Median (min–max) over runs: {len(runs)} runs ({', '.join(runs)}); ratios against the stock run of the"
        " same repetition.",
        "",
        "| config | runs | turns/s (closed) | × stock | resumed TTFT p50 × stock | p90 × stock | p90 s | reuse |",
        "|" + "---|" * 8,
    ]
    for r in summary:
        n = str(r["runs"])
        if r["runs_vs_stock"] != r["runs"]:
            n += f" ({r['runs_vs_stock']} vs stock)"
        lines.append(
            f"| {r['config']} | {n} | {_cell(r['closed_turns_per_s'], 2)} | {_cell(r['tps_vs_stock'], 2, '×')} |"
            f" {_cell(r['p50_vs_stock'], 2, '×')} | {_cell(r['p90_vs_stock'], 2, '×')} |"
            f" {_cell(r['resumed_ttft_p90_s'], 2)} | {_cell(r['reuse'], 0, ' %', 100)} |"
        )
    lines += [
        "",
        "| run | config | turns | turns/s (closed) | × stock | resumed TTFT p50 / p90 s | p50 / p90 × stock | reuse |",
        "|" + "---|" * 8,
    ]
    for run, rows in runs.items():
        for r in rows:
            x, p50, p90 = r["tps_vs_stock"], r["p50_vs_stock"], r["p90_vs_stock"]
            lines.append(
                f"| {run} | {r['config']} | {r['turns']} | {r['closed_turns_per_s']:.2f} |"
                f" {'-' if x is None else f'{x:.2f}×'} | {r['resumed_ttft_p50_s']:.2f} / {r['resumed_ttft_p90_s']:.2f} |"
                f" {'-' if p50 is None else f'{p50:.2f}×'} / {'-' if p90 is None else f'{p90:.2f}×'} |"
                f" {100 * r['reuse']:.0f} % |"
            )
    harm = [t for run, rows in runs.items() if (t := harm_markdown(rows, run))]
    if harm:  # one table: the first run's header, every run's rows
        lines += ["", harm[0], *(row for t in harm[1:] for row in t.splitlines()[2:])]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m toolkv.tools.value_report", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument(
        "paths", nargs="+", type=Path,
        help="result files or a folder of them (one run); several run folders, or one folder of run folders",
    )  # fmt: skip
    ap.add_argument("--runs", action="store_true", help="summarise as repeated runs even with one run folder")
    ap.add_argument("--json", type=Path, default=None, help="write the rows as JSON here")
    a = ap.parse_args(argv)
    try:
        folders = run_folders(a.paths, a.runs)
        if folders is not None:
            runs = load_runs(folders)
            if not runs:
                raise ValueError("no result with a completed turn in " + ", ".join(map(str, folders)))
            summary = summarize_runs(runs)
        else:
            rows = load(a.paths)
    except ValueError as e:
        print(f"value_report: {e}", file=sys.stderr)
        return 2
    if folders is not None:
        print(runs_markdown(summary, runs))
        if a.json is not None:
            a.json.write_text(json.dumps({"runs": runs, "summary": summary}, indent=1, sort_keys=True) + "\n")
        return 0
    print(markdown(rows))
    print()
    print(answers_markdown(rows))
    if harm := harm_markdown(rows):
        print()
        print(harm)
    if a.json is not None:
        a.json.write_text(json.dumps(rows, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
