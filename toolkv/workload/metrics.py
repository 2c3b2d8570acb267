"""Metrics of one agent-benchmark run, computed from what the run recorded (turns and pool samples).

Pure functions over plain records, so the same code summarises a live run and a recorded one, and
is tested on CPU. The steady-state window is ``[window_start_s, window_end_s]`` of the run's clock:

- throughput counts turns (and their generated tokens) that *completed* inside the window;
- latency counts resumed turns (turn > 0: they follow a tool call) that *started* inside it;
- cache use is sglang's ``cached_tokens`` against the prompt length of those resumed turns;
- a closed load (every session starts at once and none arrives later) finishes inside the window,
  so its window throughput only says the window was long enough: ``closed_turns_per_s`` is 90 % of
  the turns over the time it took to complete them (``t90_s``, from the first turn's start; the
  last tenth waits mostly on the longest tool calls, not on the server).

:func:`closed_stats` computes the closed-load figures from a recorded result's JSON (a row of the
value table, ``toolkv.tools.value_report``, and a run of the twin's regime map).

Standard library only (it runs on the GPU machine next to the server).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

# Documented refusals that change nothing: 503 device memory (retry later), 507 host pool full,
# 409 kv lost / wrong state. Anything else >= 500 is a server fault.
REFUSALS = ("409", "503", "507")


def unexpected_5xx(calls: Mapping[str, int]) -> int:
    """toolkv answers with a status of 500 or more that is not a documented refusal."""
    return sum(v for k, v in calls.items() if k.split()[1] >= "500" and k.split()[1] not in REFUSALS)


@dataclass
class Turn:
    session: str
    turn: int
    start_s: float  # run clock when the request was sent
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    ttft_s: float
    e2e_s: float
    status: int
    tool_s: float = 0.0  # the tool call before this turn (0 for the first turn)
    restore_call_s: float = math.nan  # the tool_end call before this turn, explicit mode
    output_ids: list[int] = field(default_factory=list)

    @property
    def end_s(self) -> float:
        return self.start_s + self.e2e_s

    @property
    def resumed(self) -> bool:
        return self.turn > 0


HARM_KEY = "recomputed_after_evict_tokens"  # kv_meta's eviction-harm count (toolkv.sglang.ghost)


def recomputed_between(
    before: Mapping[str, Any] | None, end: Mapping[str, Any] | None
) -> dict[str, int] | None:
    """The eviction-harm count of one run, ``{session, other, total}``: the server's
    ``recomputed_after_evict_tokens`` (``toolkv:kv_recomputed_after_evict_tokens_total``) at the
    end less at the start (runs share a server: the counter is the server's since it started).
    None when the server did not report it (no toolkv, or a toolkv before the count)."""
    got = (end or {}).get(HARM_KEY)
    if not isinstance(got, Mapping):
        return None
    was = (before or {}).get(HARM_KEY) or {}
    out = {k: int(got.get(k, 0)) - int(was.get(k, 0)) for k in ("session", "other")}
    return out | {"total": out["session"] + out["other"]}


def pct(xs: Iterable[float], p: float) -> float:
    """Nearest-rank percentile of the finite values; NaN when there are none."""
    v = sorted(x for x in xs if not math.isnan(x))
    if not v:
        return math.nan
    return v[min(len(v) - 1, max(0, math.ceil(p / 100 * len(v)) - 1))]


def summarize(
    turns: Sequence[Turn],
    calls: Mapping[str, int],
    *,
    window_start_s: float,
    window_end_s: float,
    wall_s: float,
) -> dict[str, Any]:
    if window_end_s <= window_start_s:
        raise ValueError(f"empty steady-state window [{window_start_s}, {window_end_s}]")
    span = window_end_s - window_start_s
    ok = [t for t in turns if t.status == 200]
    done = [t for t in ok if window_start_s <= t.end_s <= window_end_s]
    resumed = [t for t in ok if t.resumed and window_start_s <= t.start_s <= window_end_s]
    prompt = sum(t.prompt_tokens for t in resumed)
    cached = sum(min(t.cached_tokens, t.prompt_tokens) for t in resumed)
    ttft = [t.ttft_s for t in resumed]
    ends = sorted(t.end_s for t in ok)
    first = min((t.start_s for t in ok), default=0.0)
    t90 = ends[max(0, math.ceil(0.9 * len(ends)) - 1)] - first if ends else math.nan
    return {
        "window_s": [window_start_s, window_end_s],
        "turns": len(turns),
        "turns_ok": len(ok),
        "turns_in_window": len(done),
        "turns_per_s": len(done) / span,
        "gen_tokens_per_s": sum(t.output_tokens for t in done) / span,
        "t90_s": t90,
        "makespan_s": (ends[-1] - first) if ends else math.nan,
        "closed_turns_per_s": (math.ceil(0.9 * len(ends)) / t90) if ends and t90 > 0 else math.nan,
        "resumed_turns": len(resumed),
        "resumed_prompt_tokens": prompt,
        "resumed_cached_tokens": cached,
        "resumed_computed_tokens": prompt - cached,
        "resumed_cache_hit": cached / prompt if prompt else 0.0,
        "resumed_zero_cached": sum(1 for t in resumed if t.cached_tokens == 0),
        "resumed_ttft_p50_s": pct(ttft, 50),
        "resumed_ttft_p90_s": pct(ttft, 90),
        "resumed_ttft_p99_s": pct(ttft, 99),
        "first_ttft_p50_s": pct([t.ttft_s for t in ok if t.turn == 0], 50),
        "restore_call_p50_s": pct([t.restore_call_s for t in resumed], 50),
        "calls": dict(calls),
        "http_5xx": unexpected_5xx(calls) + sum(1 for t in turns if t.status >= 500),
        "refusals": {k: v for k, v in calls.items() if k.split()[1] in REFUSALS},
        "wall_s": wall_s,
    }


def occupancy(samples: Sequence[Mapping[str, Any]], device_total: int | None) -> dict[str, Any]:
    """Mean and peak of each sampled pool quantity over the run (tokens), and the device pool's
    mean occupied share when its size is known."""
    keys = ("device_used", "device_locked", "host_used", "protected", "running", "waiting")
    out: dict[str, Any] = {}
    for k in keys:
        xs = [float(s[k]) for s in samples if s.get(k) is not None]
        out[k] = {"mean": sum(xs) / len(xs), "max": max(xs)} if xs else None
    if device_total and out["device_used"]:
        out["device_used_share_mean"] = out["device_used"]["mean"] / device_total
    return out


# ---- closed-load figures of a recorded result (the value table and the regime map) -----------------
class EmptyRun(ValueError):
    """A result file without a single completed turn (the server died or never answered)."""


def _interpolated_pct(xs: list[float], p: float) -> float:
    """Percentile by linear interpolation between the nearest ranks (the value table's)."""
    if not xs:
        return math.nan
    ys = sorted(xs)
    k = (len(ys) - 1) * p / 100
    lo, hi = math.floor(k), math.ceil(k)
    return ys[lo] + (ys[hi] - ys[lo]) * (k - lo)


def closed_stats(res: dict[str, Any]) -> dict[str, Any]:
    """Closed-load figures of one recorded run (the JSON ``toolkv bench agent`` writes, or the
    twin's result in the same shape), from its per-turn records: the value table's row
    (``toolkv.tools.value_report``) and the regime map's figures."""
    ok = [t for t in res["turns"] if t.get("status") == 200]
    if not ok:
        raise EmptyRun(f"{res['config']}: no completed turn")
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
        "resumed_ttft_p50_s": _interpolated_pct([t["ttft_s"] for t in resumed], 50),
        "resumed_ttft_p90_s": _interpolated_pct([t["ttft_s"] for t in resumed], 90),
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
