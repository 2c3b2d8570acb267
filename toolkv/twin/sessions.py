"""Where the twin's agents get their sessions: a drawn :class:`~toolkv.workload.plan.Plan`,
or the same sessions drawn lazily, one when it starts, and dropped when it ends.

``make_plan`` draws every token of every session up front: an hour of 1,000 sessions is about 75
million token ids, gigabytes of Python integers. :class:`LazySessions` reproduces ``make_plan``
exactly (the same start times from the same ``random.Random(seed)`` sequence, each session from
``plan_session`` with the same per-session seed) but draws a session only when it starts; the
twin drops its tokens when it ends. ``tests/test_twin.py`` checks both give the same sessions.
"""

from __future__ import annotations

import random
from typing import Any

from toolkv.workload.plan import Plan, SessionPlan, Workload, plan_session


def session_starts(w: Workload) -> list[float]:
    """``make_plan``'s start times: the initial sessions over the ramp, then Poisson arrivals."""
    rng = random.Random(w.seed)
    starts = [w.ramp_s * (i + rng.random()) / max(1, w.initial_sessions) for i in range(w.initial_sessions)]
    t = w.ramp_s
    while w.rate > 0:
        t += rng.expovariate(w.rate)
        if t >= w.duration_s:
            break
        starts.append(t)
    return starts


class Sessions:
    """The sessions of one run, in ``make_plan``'s order (session ``i`` is ``s{i}``)."""

    def __init__(self, workload: Workload, starts: list[float], plan: Plan | None = None) -> None:
        self.workload = workload
        self.starts = starts
        self._plan = plan
        self.summaries: dict[str, dict[str, Any]] = {}

    @classmethod
    def of(cls, plan: Plan) -> Sessions:
        return cls(plan.workload, [s.start_s for s in plan.sessions], plan)

    @classmethod
    def lazy(cls, w: Workload) -> Sessions:
        return cls(w, session_starts(w))

    def sid(self, i: int) -> str:
        return f"s{i}"

    def draw(self, i: int) -> SessionPlan:
        """Session ``i``, identical to ``make_plan(workload).sessions[i]``."""
        if self._plan is not None:
            sp = self._plan.sessions[i]
        else:
            w = self.workload
            sp = plan_session(w, i, self.starts[i], random.Random(w.seed * 1_000_003 + i))
        self.summaries[sp.sid] = sp.summary()
        return sp

    def describe(self) -> dict[str, Any]:
        """``Plan.describe()`` of the sessions that started (all of them, once the run is over)."""
        w = self.workload
        plans = [self.summaries[k] for k in sorted(self.summaries, key=lambda s: int(s[1:]))]
        tools = [t for s in plans for t in s["tools_s"]]
        return {
            "workload": w.__dict__ | {},
            "arrival_rate_per_s": w.rate,
            "tool_mixture": w.tools.__dict__ | {"long_weight": w.tools.long_weight},
            "sessions": len(self.starts),
            "tool_calls_planned": len(tools),
            "sessions_plan": plans,
        }

    def appended(self) -> dict[tuple[str, int], int]:
        """(session, turn) -> tool-result tokens appended before that turn."""
        return {
            (s["sid"], t + 1): n for s in self.summaries.values() for t, n in enumerate(s["result_tokens"])
        }
