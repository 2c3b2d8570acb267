"""The agent-load results table in docs, generated from the JSON that ``toolkv bench agent``
writes (``python -m toolkv.workload.report FILE...``). Docs embed its output verbatim and a test
checks they still agree, so a figure can never go stale."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from toolkv.workload.metrics import REFUSALS, unexpected_5xx

COLUMNS = (
    ("mode", "mode"),
    ("s", "wall s"),
    ("turns", "turns"),
    ("tps", "turns/s"),
    ("hit", "resumed prompt tokens from cache"),
    ("zero", "resumed turns with 0 cached"),
    ("p50", "resumed TTFT p50 s"),
    ("p90", "resumed TTFT p90 s"),
    ("refused", "refusals (409/503/507)"),
    ("bad", "other 5xx"),
    ("twins", "twins identical"),
    ("end", "protected/locked at end"),
)


def row(res: dict[str, Any]) -> dict[str, str]:
    s = res["summary"]
    calls = s["calls"]
    refused = {k: v for k, v in calls.items() if k.split()[1] in REFUSALS}
    end = res["server_meta"]["end"] or {}
    twins = res.get("twins") or []
    return {
        "mode": res["mode"],
        "s": f"{s['wall_s']:.0f}",
        "turns": str(s["turns_ok"]),
        "tps": f"{s['turns_per_s']:.2f}",
        "hit": f"{100 * s['resumed_cache_hit']:.1f} %",
        "zero": f"{s['resumed_zero_cached']} of {s['resumed_turns']}",
        "p50": f"{s['resumed_ttft_p50_s']:.2f}",
        "p90": f"{s['resumed_ttft_p90_s']:.2f}",
        "refused": ", ".join(f"{k}: {v}" for k, v in sorted(refused.items())) or "0",
        "bad": str(unexpected_5xx(calls)),
        "twins": f"{sum(p['identical'] for p in twins)} of {len(twins)}" if twins else "-",
        "end": f"{int(end.get('protected_tokens') or 0)}/{int(end.get('device_locked_tokens') or 0)}",
    }


def table(paths: list[Path]) -> str:
    rows = [row(json.loads(p.read_text())) for p in paths]
    head = "| " + " | ".join(t for _, t in COLUMNS) + " |"
    sep = "|" + "|".join("---" for _ in COLUMNS) + "|"
    body = ["| " + " | ".join(r[k] for k, _ in COLUMNS) + " |" for r in rows]
    return "\n".join([head, sep, *body])


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args and args[0] == "suite":
        return suite_main(args[1:])
    if not args:
        print("usage: python -m toolkv.workload.report RESULTS.json...", file=sys.stderr)
        return 2
    missing = [a for a in args if not Path(a).is_file()]
    if missing:
        print(f"no such results file: {', '.join(missing)}", file=sys.stderr)
        return 2
    print(table([Path(a) for a in args]))
    return 0


# ---- the configuration suite (scripts/gpu_agent_suite.sh) ----------------------------------------------
ORDER = ("radix", "pin", "stock", "stock-large", "explicit", "zero-change")
REGIMES = ("constrained", "plentiful")


def _ok(calls: dict[str, int], op: str) -> str:
    ok = calls.get(f"{op} 200", 0)
    bad = sum(v for k, v in calls.items() if k.startswith(op + " ") and not k.endswith(" 200"))
    return f"{ok}/{bad}" if ok or bad else "-"


def load_suite(root: Path) -> dict[str, list[dict[str, Any]]]:
    """regime -> results, in the order of ``ORDER`` (others after, by name)."""
    out: dict[str, list[dict[str, Any]]] = {}
    for regime in REGIMES:
        files = sorted((root / regime).glob("*.json"))
        res = [json.loads(p.read_text()) for p in files]
        res.sort(
            key=lambda r: (ORDER.index(r["config"]) if r["config"] in ORDER else len(ORDER), r["config"])
        )
        if res:
            out[regime] = res
    return out


def suite_table(results: list[dict[str, Any]]) -> str:
    ref = next((r for r in results if r["config"] == "stock"), None)
    head = ("config", "turns/s", "vs stock", "gen tok/s", "resumed turns", "resumed tokens from cache",
            "TTFT p50 s", "TTFT p90 s", "p90 vs stock", "TTFT p99 s", "tool_start ok/refused",
            "tool_end ok/refused", "device pool used", "checks")  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for r in results:
        s, occ = r["summary"], r.get("occupancy") or {}
        rt = (
            s["turns_per_s"] / ref["summary"]["turns_per_s"]
            if ref and ref["summary"]["turns_per_s"]
            else None
        )
        rp = s["resumed_ttft_p90_s"] / ref["summary"]["resumed_ttft_p90_s"] if ref else None
        share = occ.get("device_used_share_mean")
        lines.append("| " + " | ".join([
            r["config"], f"{s['turns_per_s']:.3f}", f"{rt:.2f}x" if rt else "-", f"{s['gen_tokens_per_s']:.0f}",
            f"{s['resumed_turns']}", f"{100 * s['resumed_cache_hit']:.0f} %", f"{s['resumed_ttft_p50_s']:.2f}",
            f"{s['resumed_ttft_p90_s']:.2f}", f"{rp:.2f}x" if rp else "-", f"{s['resumed_ttft_p99_s']:.2f}",
            _ok(s["calls"], "tool_start"), _ok(s["calls"], "tool_end"),
            f"{100 * share:.0f} %" if share is not None else "-", "pass" if r["passed"] else "FAIL",
        ]) + " |")  # fmt: skip
    return "\n".join(lines)


def probe_table(results: list[dict[str, Any]]) -> str:
    rows = [
        "| tokens | prefill s | resume s (tool_end → Runnable) | recompute / resume |",
        "|---|---|---|---|",
    ]
    for r in results:
        for n, v in (r.get("probe") or {}).get("median_by_size", {}).items():
            rows.append(
                f"| {int(n):,} | {v['prefill_s']:.4f} | {v['resume_s']:.4f} | {v['recompute_over_resume']:.1f}x |"
            )
        d = (r.get("probe") or {}).get("decode_under_restore")
        if d:
            rows.append("")
            rows.append(
                f"Decode of {d['streams']} streams: {d['decode_tokens_per_s_quiet']:.0f} tokens/s with no restore, "
                f"{d['decode_tokens_per_s_restoring']:.0f} tokens/s while {d['restores']} restores of "
                f"{d['restore_tokens']:,} tokens ran back to back (a restore in flight "
                f"{100 * d['restore_in_flight_share']:.0f} % of that window)."
            )
    return "\n".join(rows)


def suite_markdown(root: Path) -> str:
    parts = []
    suite = load_suite(root)
    for regime, results in suite.items():
        parts.append(f"#### {regime}\n\n{suite_table(results)}")
    probes = [r for rs in suite.values() for r in rs if r.get("probe")]
    if probes:
        parts.append(f"#### resume against recompute ({probes[0]['config']}, constrained, idle server)\n\n"
                     + probe_table(probes[:1]))  # fmt: skip
    return "\n\n".join(parts)


def plots(root: Path, out: Path) -> list[Path]:
    """Throughput/latency per configuration, pool occupancy over time, one session's timeline."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    suite = load_suite(root)
    made: list[Path] = []
    fig, axes = plt.subplots(len(suite), 2, figsize=(11, 3.2 * len(suite)), squeeze=False)
    for i, (regime, results) in enumerate(suite.items()):
        names = [r["config"] for r in results]
        axes[i][0].barh(names, [r["summary"]["turns_per_s"] for r in results], color="tab:blue")
        axes[i][0].set_xlabel("completed turns/s (steady-state window)")
        axes[i][0].set_title(regime)
        p50 = [r["summary"]["resumed_ttft_p50_s"] for r in results]
        p90 = [r["summary"]["resumed_ttft_p90_s"] for r in results]
        axes[i][1].barh(names, p90, color="tab:orange", label="p90")
        axes[i][1].barh(names, p50, color="tab:red", label="p50")
        axes[i][1].set_xlabel("resumed-turn TTFT, s")
        axes[i][1].legend(loc="lower right")
    fig.tight_layout()
    made.append(out / "agent_throughput_latency.png")
    fig.savefig(made[-1], dpi=110)
    plt.close(fig)
    for regime, results in suite.items():
        fig, axes = plt.subplots(
            len(results), 1, figsize=(10, 1.9 * len(results)), sharex=True, squeeze=False
        )
        for ax, r in zip(axes[:, 0], results, strict=True):
            sm = r.get("samples") or []
            t = [s["t"] for s in sm]
            for key, label, color in (("device_used", "device pool used", "tab:blue"),
                                      ("device_locked", "device locked by requests", "tab:red"),
                                      ("host_used", "host pool used", "tab:orange"),
                                      ("protected", "toolkv protected", "tab:green")):  # fmt: skip
                ys = [s.get(key) for s in sm]
                ax.plot(t, [y if y is not None else float("nan") for y in ys], label=label, color=color)
            ax.set_ylabel(r["config"], rotation=0, ha="right")
        axes[0][0].legend(fontsize=7, ncol=4, loc="upper left")
        axes[-1][0].set_xlabel(f"run time, s ({regime}; tokens)")
        fig.tight_layout()
        made.append(out / f"agent_occupancy_{regime}.png")
        fig.savefig(made[-1], dpi=110)
        plt.close(fig)
    constrained = {r["config"]: r for r in suite.get("constrained", [])}
    shown = [c for c in ("stock", "explicit", "zero-change", "stock-large") if c in constrained]
    if shown:
        fig, axes = plt.subplots(
            len(shown), 1, figsize=(10, 1.4 * len(shown) + 0.6), sharex=True, squeeze=False
        )
        for ax, c in zip(axes[:, 0], shown, strict=True):
            turns = sorted(
                (t for t in constrained[c]["turns"] if t["session"] == "s0"), key=lambda t: t["turn"]
            )
            for t in turns:
                ax.barh(0, t["ttft_s"], left=t["start_s"], color="tab:red")
                ax.barh(0, t["e2e_s"] - t["ttft_s"], left=t["start_s"] + t["ttft_s"], color="tab:blue")
            ax.set_yticks([])
            ax.set_ylabel(c, rotation=0, ha="right")
        axes[0][0].set_title(
            "session s0, constrained: red = waiting for the first token, blue = decoding, gaps = tool calls"
        )
        axes[-1][0].set_xlabel("run time, s")
        fig.tight_layout()
        made.append(out / "agent_session_timeline.png")
        fig.savefig(made[-1], dpi=110)
        plt.close(fig)
    return made


def suite_main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m toolkv.workload.report suite")
    ap.add_argument(
        "root", help="folder with constrained/ and plentiful/ results of scripts/gpu_agent_suite.sh"
    )
    ap.add_argument("--plots", default=None, help="write the PNG plots into this folder")
    a = ap.parse_args(argv)
    root = Path(a.root)
    if not root.is_dir():
        print(f"no such results folder: {root}", file=sys.stderr)
        return 2
    print(suite_markdown(root))
    if a.plots:
        for p in plots(root, Path(a.plots)):
            print(f"wrote {p}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
