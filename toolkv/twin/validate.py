"""The twin against the GPU: the same metrics, computed the same way, from the JSON each wrote.

``toolkv twin --compare DIR`` reads the ``toolkv bench agent`` results of one regime (e.g.
``docs/results/agent/constrained``), matches each twin configuration to the GPU configuration
of the same label, and prints both with the relative difference and whether it is inside the
target band (turns/s and reuse within 15 %, resumed-turn TTFT p90 within 25 %). Reuse is
recomputed from the GPU run's own turns and plan with :func:`toolkv.twin.report.reuse`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from toolkv.twin.report import reuse
from toolkv.workload.metrics import Turn

TARGETS = {"turns_per_s": 0.15, "reuse": 0.15, "resumed_ttft_p90_s": 0.25}


def gpu_reuse(res: dict[str, Any]) -> float:
    """The twin's reuse definition applied to a GPU run's recorded turns and plan."""
    turns = [Turn(**{k: v for k, v in t.items() if k != "output_ids"}) for t in res["turns"]]
    appended = {
        (sp["sid"], i + 1): n
        for sp in res["plan"]["sessions_plan"]
        for i, n in enumerate(sp["result_tokens"])
    }
    window = tuple(res["summary"]["window_s"])
    return float(reuse(turns, appended, (window[0], window[1]))["reuse"])


def metrics(res: dict[str, Any]) -> dict[str, float]:
    s = res["summary"]
    r = s["reuse"]["reuse"] if "reuse" in s else gpu_reuse(res)
    return {"turns_per_s": s["turns_per_s"], "reuse": r, "resumed_ttft_p90_s": s["resumed_ttft_p90_s"],
            "resumed_ttft_p50_s": s["resumed_ttft_p50_s"]}  # fmt: skip


def load_gpu(root: Path) -> dict[str, dict[str, Any]]:
    """The GPU results by label: every JSON of a folder, or one JSON file. A single file (a run
    whose label is no configuration's, e.g. ``load48`` of the acceptance run) is also offered to
    every twin configuration whose agents run its mode (see :func:`compare`)."""
    if root.is_file():
        r = json.loads(root.read_text())
        return {r["config"]: r | {"_by_mode": True}}
    return {r["config"]: r for r in (json.loads(p.read_text()) for p in sorted(root.glob("*.json")))}


def compare(twins: list[dict[str, Any]], gpu: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for t in twins:
        g = gpu.get(t.get("gpu_label", t["config"]))
        if g is None:  # a single GPU file: the configurations whose agents ran its mode
            g = next((r for r in gpu.values() if r.get("_by_mode") and r.get("mode") == t.get("mode")), None)
        if g is None:
            continue
        mt, mg = metrics(t), metrics(g)
        row: dict[str, Any] = {
            "config": t["config"],
            "gpu_config": g["config"],
            "twin": mt,
            "gpu": mg,
            "within": {},
        }
        for k, band in TARGETS.items():
            ref = mg[k]
            if ref == 0:
                row["within"][k] = abs(mt[k]) <= band  # 0 % reuse on both sides is a match
            else:
                row["within"][k] = abs(mt[k] - ref) / abs(ref) <= band
        rows.append(row)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    head = ("config", "turns/s twin / GPU", "reuse twin / GPU", "TTFT p50 s twin / GPU", "TTFT p90 s twin / GPU",
            "inside the band")  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for r in rows:
        t, g = r["twin"], r["gpu"]
        ok = [k for k, v in r["within"].items() if v]
        bad = [k for k, v in r["within"].items() if not v]
        names = {"turns_per_s": "turns/s", "reuse": "reuse", "resumed_ttft_p90_s": "p90"}
        verdict = "all" if not bad else ("none" if not ok else ", ".join(names[k] for k in ok))
        lines.append(
            f"| {r['config']} ({r['gpu_config']}) | {t['turns_per_s']:.3f} / {g['turns_per_s']:.3f} "
            f"| {100 * t['reuse']:.0f} % / {100 * g['reuse']:.0f} % "
            f"| {t['resumed_ttft_p50_s']:.2f} / {g['resumed_ttft_p50_s']:.2f} "
            f"| {t['resumed_ttft_p90_s']:.2f} / {g['resumed_ttft_p90_s']:.2f} | {verdict} |"
        )
    return "\n".join(lines)
