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
