"""``python -m toolkv.tools.ttft_bins LABEL=RESULT.json ...``: where a resumed turn's time to first
token goes, by how much of its prompt had to be computed.

The twin and the GPU can agree on closed throughput and still disagree on the resumed-turn TTFT
tail. Binning the resumed turns (turn > 0, answered 200) of each bench agent result by their
uncached tokens (prompt - cached) separates the prefill cost model (turns that compute thousands of
tokens) from the wait of a turn whose KV was kept (a few hundred computed tokens: its TTFT is queue,
admission and any host->GPU load). The decode column (end to end - TTFT) shows where a run that
admits sooner pays instead. One row per result; medians, and TTFT p90.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

#: uncached-token bins of a resumed turn: [lo, hi)
BINS: tuple[tuple[int, int], ...] = ((0, 500), (500, 2000), (2000, 5000), (5000, 1 << 30))


def resumed(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The resumed turns of a bench agent result that were answered."""
    return [t for t in result["turns"] if t.get("turn", 0) > 0 and t.get("status") == 200]


def _p90(xs: list[float]) -> float:
    q = sorted(xs)
    return q[min(len(q) - 1, int(0.9 * len(q)))] if q else math.nan


def row(label: str, result: dict[str, Any]) -> dict[str, Any]:
    """One result's numbers: resumed turns, TTFT p50/p90, decode median, and per bin (count, TTFT
    median). A result without resumed turns has NaN medians and empty bins."""
    ts = resumed(result)
    ttft = [float(t["ttft_s"]) for t in ts]
    unc = [int(t["prompt_tokens"]) - int(t["cached_tokens"]) for t in ts]
    bins = []
    for lo, hi in BINS:
        b = [x for x, u in zip(ttft, unc, strict=True) if lo <= u < hi]
        bins.append(
            {"lo": lo, "hi": hi, "n": len(b), "ttft_median_s": statistics.median(b) if b else math.nan}
        )
    return {
        "label": label,
        "resumed": len(ts),
        "ttft_p50_s": statistics.median(ttft) if ttft else math.nan,
        "ttft_p90_s": _p90(ttft),
        "decode_median_s": statistics.median([float(t["e2e_s"]) - float(t["ttft_s"]) for t in ts])
        if ts
        else math.nan,
        "uncached_median": statistics.median(unc) if unc else math.nan,
        "bins": bins,
    }


def _bin_name(lo: int, hi: int) -> str:
    return f"{lo:,}+" if hi >= 1 << 30 else f"{lo:,}-{hi:,}"


def markdown(rows: list[dict[str, Any]]) -> str:
    head = ["run", "resumed", "TTFT p50 / p90 s", "decode median s", "uncached median"]
    head += [f"TTFT median s, {_bin_name(lo, hi)} uncached (n)" for lo, hi in BINS]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["label"], str(r["resumed"]), f"{r['ttft_p50_s']:.2f} / {r['ttft_p90_s']:.2f}",
                 f"{r['decode_median_s']:.2f}", f"{r['uncached_median']:,.0f}"]  # fmt: skip
        cells += [f"{b['ttft_median_s']:.2f} ({b['n']})" if b["n"] else "- (0)" for b in r["bins"]]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m toolkv.tools.ttft_bins", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument(
        "results", nargs="+", metavar="LABEL=RESULT.json", help="a label and a bench agent result"
    )
    a = ap.parse_args(argv)
    rows = []
    try:
        for spec in a.results:
            label, sep, path = spec.partition("=")
            if not sep or not label or not path:
                raise ValueError(f"{spec!r}: expected LABEL=RESULT.json")
            try:
                res = json.loads(Path(path).read_text())
            except (OSError, json.JSONDecodeError) as e:
                raise ValueError(f"{path}: not a bench agent result ({e})") from None
            if not isinstance(res, dict) or not isinstance(res.get("turns"), list):
                raise ValueError(f"{path}: not a bench agent result (no turns)")
            rows.append(row(label, res))
    except (ValueError, KeyError, TypeError) as e:
        print(f"ttft_bins: error: {e}", file=sys.stderr)
        return 2
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
