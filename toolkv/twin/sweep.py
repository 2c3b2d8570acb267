"""``toolkv twin sweep``: host pool size x configuration x tool shape, one twin run each, drawn
as reuse, turns/s and resumed-turn TTFT p90 against host GB."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any


def sweep(a: argparse.Namespace, hosts: list[float], shapes: list[str]) -> list[dict[str, Any]]:
    from toolkv.twin.cli import configs, run_configs, workload

    rows = []
    for shape in shapes:
        w = workload(a, shape)
        for gb in hosts:
            cfgs = [c.with_host_gb(gb) if c.cache == "hiradix" else c for c in configs(a, gb)]
            for r in run_configs(a, w, cfgs, opt=True, progress=False):
                s, t = r["summary"], r["twin"]
                rows.append({
                    "tool_shape": shape, "host_gb": gb, "config": r["config"], "turns_per_s": s["turns_per_s"],
                    "reuse": s["reuse"]["reuse"], "opt_reuse": t["opt"]["reuse"], "ttft_p90_s": s["resumed_ttft_p90_s"],
                    "ttft_p50_s": s["resumed_ttft_p50_s"], "passed": r["passed"], "crashed": t["crashed"],
                })  # fmt: skip
                if not a.quiet:
                    print(
                        f"{shape} {gb:g} GB {r['config']}: reuse {s['reuse']['reuse']:.2f}", file=sys.stderr
                    )
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        "tool shape",
        "host GB",
        "config",
        "turns/s",
        "reuse",
        "opt reuse",
        "TTFT p50 s",
        "TTFT p90 s",
        "checks",
    )
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for r in rows:
        lines.append(
            f"| {r['tool_shape']} | {r['host_gb']:g} | {r['config']} | {r['turns_per_s']:.3f} | {100 * r['reuse']:.0f} % "
            f"| {100 * r['opt_reuse']:.0f} % | {r['ttft_p50_s']:.2f} | {r['ttft_p90_s']:.2f} "
            f"| {'pass' if r['passed'] else 'FAIL' + (' (crashed)' if r['crashed'] else '')} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = sorted({r["tool_shape"] for r in rows})
    cfgs = list(dict.fromkeys(r["config"] for r in rows))
    fig, axes = plt.subplots(len(shapes), 3, figsize=(13, 3.4 * len(shapes)), squeeze=False)
    for i, shape in enumerate(shapes):
        for c in cfgs:
            pts = sorted((r["host_gb"], r) for r in rows if r["config"] == c and r["tool_shape"] == shape)
            xs = [x for x, _ in pts]
            for ax, key, scale in ((axes[i][0], "reuse", 100.0), (axes[i][1], "turns_per_s", 1.0),
                                   (axes[i][2], "ttft_p90_s", 1.0)):  # fmt: skip
                ax.plot(xs, [scale * r[key] for _, r in pts], marker="o", label=c)
                bad = [(x, scale * r[key]) for x, r in pts if r["crashed"]]
                if bad:  # a run that ended early (the server died or stalled): its numbers are partial
                    ax.plot([x for x, _ in bad], [y for _, y in bad], "x", color="red", markersize=10,
                            label="run ended early (crashed or stalled)")  # fmt: skip
        opt = sorted(
            {
                (r["host_gb"], r["opt_reuse"])
                for r in rows
                if r["tool_shape"] == shape and r["config"] == cfgs[0]
            }
        )
        axes[i][0].plot(
            [x for x, _ in opt], [100 * y for _, y in opt], "k--", label=f"opt ({cfgs[0]} timeline)"
        )
        axes[i][0].set_ylabel(f"tools: {shape}")
        for ax, title in zip(
            axes[i], ("resumed-turn reuse, %", "turns/s", "resumed-turn TTFT p90, s"), strict=True
        ):
            ax.set_title(title)
            ax.set_xlabel("host pool, GB")
            ax.grid(alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    for ax in axes[:, 0]:
        for h, lab in zip(*ax.get_legend_handles_labels(), strict=True):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    axes[0][0].legend(handles, labels, fontsize=7)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
