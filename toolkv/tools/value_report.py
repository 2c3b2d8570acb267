"""The value table of one GPU run: each toolkv configuration against stock sglang at the same host size.

Input: the ``toolkv bench agent`` JSON files of one run (``stock16.json``, ``offload16.json``,
``auto16.json``, ``stock64.json``, ...: the digits are the host pool in GB, a name starting with
``stock`` is the reference at its size). The load is closed (every session starts at once), so the
window throughput of ``bench agent`` only says the window was long enough; the table's throughput
is ``closed_turns_per_s``: 90 % of the turns over the time it took to complete them (the last tenth
waits mostly on the longest tool calls). Computed from the per-turn records, so older JSON works too.

``python -m toolkv.tools.value_report DIR [--json OUT]`` prints a Markdown table.
Standard library only.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path
from typing import Any


def _pct(xs: list[float], p: float) -> float:
    if not xs:
        return math.nan
    ys = sorted(xs)
    k = (len(ys) - 1) * p / 100
    lo, hi = math.floor(k), math.ceil(k)
    return ys[lo] + (ys[hi] - ys[lo]) * (k - lo)


def stats(res: dict[str, Any]) -> dict[str, Any]:
    """Closed-load figures of one run, from its per-turn records."""
    ok = [t for t in res["turns"] if t.get("status") == 200]
    ends = sorted(t["start_s"] + t["e2e_s"] for t in ok)
    first = min(t["start_s"] for t in ok)
    k = math.ceil(0.9 * len(ends))
    t90 = ends[k - 1] - first
    resumed = [t for t in ok if t["turn"] > 0]
    prompt = sum(t["prompt_tokens"] for t in resumed)
    cached = sum(min(t["cached_tokens"], t["prompt_tokens"]) for t in resumed)
    calls: dict[str, int] = res["summary"].get("calls", {})
    return {
        "config": res["config"],
        "turns": len(ok),
        "t90_s": t90,
        "makespan_s": ends[-1] - first,
        "closed_turns_per_s": k / t90,
        "resumed_turns": len(resumed),
        "resumed_ttft_p50_s": _pct([t["ttft_s"] for t in resumed], 50),
        "resumed_ttft_p90_s": _pct([t["ttft_s"] for t in resumed], 90),
        "reuse": cached / prompt if prompt else 0.0,
        "resumed_zero_cached": sum(1 for t in resumed if t["cached_tokens"] == 0),
        "prefill_computed_tokens": sum(t["prompt_tokens"] - t["cached_tokens"] for t in ok),
        "tool_start_refused": sum(
            v for c, v in calls.items() if c.startswith("tool_start ") and c != "tool_start 200"
        ),
        "tool_end_refused": sum(
            v for c, v in calls.items() if c.startswith("tool_end ") and c != "tool_end 200"
        ),
        "http_5xx": res["summary"].get("http_5xx", 0),
        "by_answer": by_answer(res),
    }


def by_answer(res: dict[str, Any]) -> dict[str, list[int]]:
    """Resumed turns split by what toolkv answered to the tool call before them (``tool_start``
    status / ``tool_end`` status, ``-`` for no call): ``[turns, turns with 0 cached tokens]``.
    Shows where the KV was lost: after an accepted restore, or after a refusal."""
    start: dict[str, str] = {}
    end: dict[str, str] = {}
    out: dict[str, list[int]] = {}
    for _t, sid, what in sorted(res.get("events", [])):
        w = str(what).split()
        if w[0] == "tool_start":
            start[sid] = w[1]
        elif w[0] == "tool_end":
            end[sid] = w[1]
        elif w[0] == "turn" and w[1] != "0":
            cached = int(next(x for x in w if x.startswith("cached=")).split("=")[1])
            key = f"{start.pop(sid, '-')} / {end.pop(sid, '-')}"
            row = out.setdefault(key, [0, 0])
            row[0] += 1
            row[1] += cached == 0
    return out


def host_gb(config: str) -> str:
    m = re.search(r"(\d+)$", config)
    return m.group(1) if m else ""


def compare(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each row with its ratios to the stock row of the same host size (none for a missing stock)."""
    ref = {host_gb(r["config"]): r for r in rows if r["config"].startswith("stock")}
    out = []
    for r in rows:
        s = ref.get(host_gb(r["config"]))
        r = dict(r)
        r["tps_vs_stock"] = r["closed_turns_per_s"] / s["closed_turns_per_s"] if s else None
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


def answers_markdown(rows: list[dict[str, Any]]) -> str:
    """Resumed turns by toolkv's answers (configurations that call toolkv)."""
    lines = ["| config | tool_start / tool_end | resumed turns | with 0 cached tokens |", "|---|---|---|---|"]
    for r in rows:
        for key, (n, zero) in sorted(r["by_answer"].items(), key=lambda kv: -kv[1][0]):
            if key != "- / -":
                lines.append(f"| {r['config']} | {key} | {n} | {zero} |")
    return "\n".join(lines)


def load(paths: list[Path]) -> list[dict[str, Any]]:
    files: list[Path] = []
    for p in paths:
        files += sorted(p.glob("*.json")) if p.is_dir() else [p]
    rows = []
    for f in files:
        try:
            res = json.loads(f.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"{f}: not a bench agent result ({e})") from e
        if not isinstance(res, dict) or "turns" not in res or "config" not in res:
            raise ValueError(f"{f}: not a bench agent result (no turns)")
        rows.append(stats(res))
    order = {"stock": 0, "offload": 1, "auto": 2}
    rows.sort(key=lambda r: (int(host_gb(r["config"]) or 0), order.get(r["config"].rstrip("0123456789"), 9)))
    return compare(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m toolkv.tools.value_report", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("paths", nargs="+", type=Path, help="result files or directories of them")
    ap.add_argument("--json", type=Path, default=None, help="write the rows as JSON here")
    a = ap.parse_args(argv)
    try:
        rows = load(a.paths)
    except ValueError as e:
        print(f"value_report: {e}", file=sys.stderr)
        return 2
    print(markdown(rows))
    print()
    print(answers_markdown(rows))
    if a.json is not None:
        a.json.write_text(json.dumps(rows, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
