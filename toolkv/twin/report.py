"""The twin's JSON and report: the same JSON shape ``toolkv bench agent`` writes (so
``toolkv.workload.report``'s tables read it), plus what only a twin knows (leaks after evicting
everything, the optimal-retention bound, its own speed)."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from toolkv.twin.configs import GPU_LABEL
from toolkv.twin.host_mix import mean_shares
from toolkv.twin.opt import opt_reuse
from toolkv.twin.profile import TimeProfile
from toolkv.twin.run import Outcome
from toolkv.workload.metrics import Turn, occupancy, recomputed_between, summarize
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


def recomputed_after_evict(meta: dict[str, Any]) -> dict[str, int]:
    """``{session, other, total}`` of the server's eviction-harm count (``kv_meta``'s
    ``recomputed_after_evict_tokens``, the ``toolkv:kv_recomputed_after_evict_tokens_total``
    counter's source)."""
    return recomputed_between(None, meta) or {"session": 0, "other": 0, "total": 0}


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
        "host_mix": mean_shares(o.samples, o.host_tokens),
        "drain_s": o.drain_s,
        # eviction harm over the whole run (toolkv.sglang.ghost): prompt tokens recomputed whose KV
        # the cache held earlier, for requests with a session id and for the others (a stock
        # configuration's agents send none: all of its harm is "other")
        "recomputed_after_evict_tokens": recomputed_after_evict(o.meta_end),
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
            "recomputed after evict: session / other", "leaks", "sim s", "CPU s", "run")  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for r in results:
        t, s = r["twin"], r["summary"]
        opt = t.get("opt")
        frac = opt.get("fraction") if opt else None
        lines.append("| " + " | ".join([
            r["config"], f"{t['configuration']['host_gb']:g}" if r["twin"]["host_tokens"] else "-",
            f"{100 * s['reuse']['reuse']:.0f} %", f"{100 * opt['reuse']:.0f} %" if opt else "-",
            f"{100 * frac:.0f} %" if frac is not None else "-", str(t["retractions"]),
            f"{t['copied_tokens']['h2d']:,.0f} / {t['copied_tokens']['d2h']:,.0f}", harm_cell(t),
            str(t["leaks"]["leaked"]),
            f"{t['sim_end_s']:.0f}", f"{t['wall_s']:.0f}", t["crashed"] or "completed",
        ]) + " |")  # fmt: skip
    return "\n".join(lines)


def harm_cell(twin: dict[str, Any]) -> str:
    """The eviction-harm cell: session / other recomputed tokens (``-`` in a result recorded
    before the count existed)."""
    harm = twin.get("recomputed_after_evict_tokens")
    return f"{harm['session']:,} / {harm['other']:,}" if harm else "-"


def markdown(results: list[dict[str, Any]]) -> str:
    """The benchmark's own table (``toolkv.workload.report.suite_table``) and the twin's."""
    return suite_table(results) + "\n\n" + twin_table(results)


def write(results: list[dict[str, Any]], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for r in results:
        (out / f"{r['config']}.json").write_text(json.dumps(r, indent=1, default=str))


# What the README's headline ran (scripts/gpu_value_repeat.sh, LOAD=value), as a twin command: the
# default run is a smaller, quicker load and says so.
HEADLINE = (
    "toolkv twin --configs stock,offload,auto --sessions 48 --arrival-rate 0 --turns 6 --first-tokens 3000 "
    "--growth 900 --output 32 --max-context 16384 --warmup 0 --duration 75"
)

COLUMNS = (
    ("turns/s", "turns finished per second inside the window (closed load: a session sends its next turn "
     "when its tool returns)"),
    ("vs stock", "that, over the stock row's"),
    ("resumed turns", "turns after a tool call that started inside the window: the latency columns count these"),
    ("resumed tokens from cache", "their prompt tokens sglang found in its cache (GPU or host) instead of computing"),
    ("TTFT p50/p90/p99 s", "their time to first token, queueing included; p90 vs stock over the stock row's"),
    ("tool_start / tool_end ok/refused", "toolkv's calls answered 200 / refused (507: the host pool or budget "
     "is full; the session's KV then stays where sglang keeps it)"),
    ("device pool used", "the GPU KV pool's mean occupancy"),
    ("checks", "every generate answered, no 5xx beyond the documented refusals, nothing protected or locked "
     "and every counter back at the end, the scheduler alive"),
    ("reuse / opt reuse / of opt", "the twin's reuse of all resumed prompts; the best any retention could do "
     "(--opt); the share of that bound reached"),
    ("copied h2d / d2h tokens", "KV copied host to GPU (restores, load-backs) and GPU to host (write-backs)"),
    ("recomputed after evict: session / other", "prompt tokens recomputed whose KV the cache held earlier "
     "(toolkv:kv_recomputed_after_evict_tokens_total), for requests with a session id / the others, whole run; "
     "stock's agents send no session id, so all of its harm is other"),
)  # fmt: skip


def load_line(
    w: Any, *, window: tuple[float, float], device_tokens: int, regime: str | None, profile: str
) -> str:
    """The load a run ran, in one paragraph: the workload ``w``, the measured window, the server."""
    rate = f"{w.rate:.3f} sessions/s after the ramp" if w.rate else "no later arrivals"
    pool = f"device pool {device_tokens:,} tokens" + (f" (--regime {regime})" if regime else "")
    return (
        f"load: {w.initial_sessions} sessions at the start (ramp {w.ramp_s:g} s), {rate}; median {w.turns_median} "
        f"turns per session; first prompt {w.first_tokens:,} tokens, +{w.growth_per_turn:,} per turn "
        f"({w.output_tokens} of them the answer); tools: {w.tool_shape}; {w.duration_s:g} s of arrivals and "
        f"turns, measured from {window[0]:g} s to {window[1]:g} s (the ramp and --warmup left out); {pool}; "
        f"GPU time: {profile}."
    )


def explain(results: list[dict[str, Any]], *, headline: bool) -> str:
    """What the tables' columns mean, how the run relates to the README's headline (``headline``:
    say so, for a run of the default load), and, for each toolkv row slower than stock at p99, the
    turn that p99 is: with under a hundred resumed turns, p99 is the slowest one of them."""
    width = max(len(k) for k, _ in COLUMNS)
    lines = ["columns:"] + [f"  {k:<{width}}  {v}" for k, v in COLUMNS]
    if headline:
        lines += [
            "",
            "This is the twin's quick default load, not the README's headline: that one is 48 sessions starting "
            "together with shorter prompts, measured on an H200 (docs/benchmarks.md). The same load on the twin "
            "(its numbers beside the H200's: docs/twin.md, 'The default run and the README's headline'):",
            f"  {HEADLINE}",
        ]
    stock = next((r for r in results if r["config"] == "stock"), None)
    if stock is None:
        return "\n".join(lines)
    for r in results:
        s = r["summary"]
        if r["mode"] == "stock" or s["resumed_ttft_p99_s"] <= stock["summary"]["resumed_ttft_p99_s"]:
            continue
        lo, hi = s["window_s"]
        resumed = [t for t in r["turns"] if t["turn"] > 0 and t["status"] == 200 and lo <= t["start_s"] <= hi]
        if not resumed:
            continue
        worst = max(resumed, key=lambda t: t["ttft_s"])
        why = (
            "its tool_start was refused, so nothing of it was kept and it recomputed its whole prompt, as under "
            "stock"
            if worst["cached_tokens"] == 0
            and worst["restore_call_s"] != worst["restore_call_s"]  # NaN: no tool_end
            else f"{worst['cached_tokens']:,} of its {worst['prompt_tokens']:,} prompt tokens came from the cache"
        )
        lines += [
            "",
            f"{r['config']}'s TTFT p99 ({s['resumed_ttft_p99_s']:.2f} s, stock {stock['summary']['resumed_ttft_p99_s']:.2f} s) "
            f"is over {len(resumed)} resumed turns"
            + (", so it is their slowest one" if len(resumed) < 100 else "")
            + f": session {worst['session']} turn {worst['turn']}, sent at {worst['start_s']:.1f} s into a queue "
            f"of the other sessions' turns, first token after {worst['ttft_s']:.2f} s; {why}.",
        ]
    return "\n".join(lines)
