"""The twin's JSON and report: the same JSON shape ``toolkv bench agent`` writes (so
``toolkv.workload.report``'s tables read it), plus what only a twin knows (leaks after evicting
everything, the optimal-retention bound, its own speed)."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from toolkv.twin.configs import GPU_LABEL
from toolkv.twin.opt import opt_reuse
from toolkv.twin.profile import TimeProfile
from toolkv.twin.run import Outcome
from toolkv.workload.metrics import Turn, occupancy, summarize
from toolkv.workload.report import suite_table


def reuse(
    turns: list[Turn], results: dict[tuple[str, int], int], window: tuple[float, float]
) -> dict[str, Any]:
    """Resumed-turn prompt tokens served from cache / their reusable prefix (the prompt less the
    tool result appended before the turn), over resumed turns that start in ``window``."""
    got = want = 0
    for t in turns:
        if t.resumed and t.status == 200 and window[0] <= t.start_s <= window[1]:
            want += t.prompt_tokens - results[(t.session, t.turn)]
            got += min(t.cached_tokens, t.prompt_tokens)
    return {"cached_tokens": got, "reusable_tokens": want, "reuse": got / want if want else 0.0}


def capacity(o: Outcome) -> int:
    """The idle-KV capacity the bound gets: the host pool, or on a plain RadixCache (no host
    pool) the device tokens toolkv's GPU pin may hold (``TOOLKV_HOST_BUDGET_TOKENS``)."""
    if o.host_tokens:
        return o.host_tokens
    share = o.config.pin_budget_share
    return int(share * o.device_tokens) if share is not None else 0


def result(
    o: Outcome, profile: TimeProfile, *, window: tuple[float, float], opt: bool = False,
    opt_capacity: int | None = None,
) -> dict[str, Any]:  # fmt: skip
    """One configuration's result, shaped like ``toolkv bench agent --out``'s JSON."""
    a = o.agents
    summary = summarize(a.turns, a.calls, window_start_s=window[0], window_end_s=window[1], wall_s=o.end_s)
    summary["errors"] = 0
    summary["decisions"] = dict(a.decisions)
    summary["reuse"] = reuse(a.turns, a.sessions.appended(), window)
    checks = {
        "every generate answered": summary["turns"] == summary["turns_ok"],
        "no 5xx other than the documented refusals": summary["http_5xx"] == 0,
        "nothing protected at the end": o.leaks.get("protected_tokens", -1) == 0,
        "no device tokens locked at the end": o.leaks.get("device_locked_tokens", -1) == 0,
        "every counter back to initial, pools idle": o.leaks["leaked"] == 0,
        "the scheduler did not die": o.crashed is None,
    }
    twin: dict[str, Any] = {
        "profile": profile.to_json(),
        "configuration": o.config.describe(),
        "host_tokens": o.host_tokens,
        "sim_end_s": o.end_s,
        "wall_s": o.wall_s,
        "iterations": o.iterations,
        "prefill_batches": o.prefill_batches,
        "decode_steps": o.decode_steps,
        "retractions": o.retractions,
        "prefill_tokens": o.prefill_tokens,
        "cached_tokens": o.cached_tokens,
        "copied_tokens": o.copied_tokens,
        "leaks": o.leaks,
        "crashed": o.crashed,
        "timeline": a.timeline,
    }
    if opt:
        cap = opt_capacity if opt_capacity is not None else capacity(o)
        twin["opt"] = opt_reuse(a.timeline, cap, window)
        r = summary["reuse"]["reuse"]
        twin["opt"]["fraction"] = r / twin["opt"]["reuse"] if twin["opt"]["reuse"] else None
    return {
        "config": o.config.name,
        "gpu_label": GPU_LABEL.get(o.config.name, o.config.name),
        "mode": o.config.mode,
        "source": "twin",
        "workload": asdict(a.sessions.workload),
        "plan": a.sessions.describe(),
        "device_total_tokens": o.device_tokens,
        "summary": summary,
        "occupancy": occupancy(o.samples, o.device_tokens),
        "checks": checks,
        "passed": all(checks.values()),
        "server_meta": {"before": None, "after_load": None, "end": o.meta_end},
        "probe": {},
        "twins": [],
        "errors": [],
        "samples": o.samples,
        "events": [],
        "turns": [asdict(t) | {"output_ids": None} for t in a.turns],
        "twin": twin,
    }


def twin_table(results: list[dict[str, Any]]) -> str:
    """What the benchmark table lacks: reuse as defined for the twin, the bound, leaks, speed."""
    head = ("config", "host GB", "reuse", "opt reuse", "of opt", "retractions", "copied h2d / d2h tokens",
            "leaks", "sim s", "CPU s", "run")  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for r in results:
        t, s = r["twin"], r["summary"]
        opt = t.get("opt")
        frac = opt.get("fraction") if opt else None
        lines.append("| " + " | ".join([
            r["config"], f"{t['configuration']['host_gb']:g}" if r["twin"]["host_tokens"] else "-",
            f"{100 * s['reuse']['reuse']:.0f} %", f"{100 * opt['reuse']:.0f} %" if opt else "-",
            f"{100 * frac:.0f} %" if frac is not None else "-", str(t["retractions"]),
            f"{t['copied_tokens']['h2d']:,.0f} / {t['copied_tokens']['d2h']:,.0f}", str(t["leaks"]["leaked"]),
            f"{t['sim_end_s']:.0f}", f"{t['wall_s']:.0f}", t["crashed"] or "completed",
        ]) + " |")  # fmt: skip
    return "\n".join(lines)


def markdown(results: list[dict[str, Any]]) -> str:
    """The benchmark's own table (``toolkv.workload.report.suite_table``) and the twin's."""
    return suite_table(results) + "\n\n" + twin_table(results)


def write(results: list[dict[str, Any]], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for r in results:
        (out / f"{r['config']}.json").write_text(json.dumps(r, indent=1, default=str))
