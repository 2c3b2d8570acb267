"""The reuse an offline optimal retention would reach on a run's own timeline (``--opt``).

Input: every tool call of the run as an interval: the session's KV (``tokens``) becomes idle when
its turn ends (``end_s``) and is wanted again when its next request is sent (``next_s``; never,
if the session ended). A retention policy may hold at most ``capacity`` tokens of idle KV.
Knowing every future request time, the best it can do is Belady's rule at token granularity:
whenever idle KV is added, keep the ``capacity`` tokens whose next use is soonest (partially
keeping the last session that fits) and drop the rest, possibly the newcomer (bypass). A
session's request then finds the tokens still held. Tokens are unit-size items of equal value
(a cached token saves one token of prefill), so this rule maximises the number of tokens found
(Belady's MIN is optimal for unit-size items with bypass).

What the bound assumes, and so what it does not cover: the timeline is fixed (the run's own
turn ends and request times; a policy that served turns faster would change them); the held KV
lives in ``capacity`` tokens of host memory and the device pool holds none of it across a tool
call (in the constrained regime running requests lock most of the device pool; on a plain
RadixCache the capacity is instead the device tokens toolkv's pin may hold); moving KV costs
nothing and is never too late; a session's KV is only reused by that session (sessions share
no prefix in this workload).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any


def belady(intervals: Iterable[Mapping[str, Any]], capacity: int) -> dict[int, float]:
    """Tokens found at each interval's next use, keyed by its position in ``intervals``."""
    items = list(intervals)
    events: list[tuple[float, int, int]] = []  # (time, 0 = use first / 1 = add, index)
    for i, it in enumerate(items):
        events.append((float(it["end_s"]), 1, i))
        nxt = it.get("next_s")
        if nxt is not None and math.isfinite(float(nxt)):
            events.append((float(nxt), 0, i))
    events.sort()
    held: dict[int, float] = {}
    found: dict[int, float] = {}
    for _t, kind, i in events:
        if kind == 0:
            found[i] = held.pop(i, 0.0)
            continue
        held[i] = float(items[i]["tokens"])
        total = sum(held.values())
        if total <= capacity:
            continue
        over = total - capacity
        for j in sorted(held, key=lambda k: -_next(items[k])):  # furthest next use first
            cut = min(over, held[j])
            held[j] -= cut
            over -= cut
            if held[j] <= 0:
                del held[j]
            if over <= 0:
                break
    return found


def _next(it: Mapping[str, Any]) -> float:
    n = it.get("next_s")
    return math.inf if n is None else float(n)


def opt_reuse(
    timeline: Sequence[Mapping[str, Any]], capacity: int, window: tuple[float, float]
) -> dict[str, Any]:
    """The bound's reuse over the resumed turns whose request falls in ``window`` (the same turns
    the summary's latency and reuse count): tokens found / reusable prefix."""
    found = belady(timeline, capacity)
    lo, hi = window
    got = want = 0.0
    for i, it in enumerate(timeline):
        nxt = it.get("next_s")
        if nxt is None or not lo <= float(nxt) <= hi:
            continue
        want += float(it["tokens"])
        got += found.get(i, 0.0)
    return {"capacity_tokens": capacity, "tokens_found": got, "reusable_tokens": want,
            "reuse": got / want if want else 0.0}  # fmt: skip
