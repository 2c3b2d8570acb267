"""The agents' side of ``toolkv bench agent`` (``run_session``), as simulated events.

Each session follows the benchmark's protocol exactly: turn (generate) -> ``tool_start`` (modes
explicit and on-request) -> the tool sleeps for its planned duration -> ``tool_end`` (explicit)
-> the next turn's request, which carries the tool result. Stock agents send no session id and
call nothing. No turn starts after the run's end; a tool still running then ends the session
(``close`` if it was ever tracked). Every request and call reaches the server at the scheduler
iteration that follows it (``process_input_requests``), and its answer is back at once.
"""

from __future__ import annotations

import heapq
import itertools
import math
from array import array
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from toolkv.twin.sessions import Sessions
from toolkv.workload.metrics import Turn
from toolkv.workload.plan import SessionPlan


@dataclass
class Agent:
    plan: SessionPlan  # its token lists are emptied once copied into ``ctx``/``results``
    ctx: array[int]
    results: list[array[int]] = field(default_factory=list)
    turn: int = 0
    epoch: int | None = None
    tracked: bool = False
    sent_at: float = 0.0
    call_sent_at: float = 0.0
    restore_s: float = math.nan
    first_token_at: float = math.nan
    done: bool = False


@dataclass
class Agents:
    """The client population: a timed event queue of what agents send, and what they recorded."""

    sessions: Sessions
    mode: str
    send_tool: bool = False
    events: list[tuple[float, int, str, str]] = field(default_factory=list)
    agents: dict[str, Agent] = field(default_factory=dict)
    turns: list[Turn] = field(default_factory=list)
    calls: Counter[str] = field(default_factory=Counter)
    decisions: Counter[str] = field(default_factory=Counter)
    timeline: list[dict[str, Any]] = field(default_factory=list)  # tool calls: end of turn -> next request
    _seq: itertools.count[int] = field(default_factory=itertools.count)

    def __post_init__(self) -> None:
        self.stop_at = self.sessions.workload.duration_s
        self.live = 0
        for i, start in enumerate(self.sessions.starts):
            self.push(start, "start", self.sessions.sid(i))

    def push(self, t: float, kind: str, sid: str) -> None:
        heapq.heappush(self.events, (t, next(self._seq), kind, sid))

    def next_time(self) -> float | None:
        return self.events[0][0] if self.events else None

    @property
    def finished(self) -> bool:
        return not self.events and self.live == 0

    def start(self, sid: str, now: float) -> None:
        """A session starts: draw it (lazily) and send its first turn."""
        sp = self.sessions.draw(int(sid[1:]))
        # typed arrays: 8 bytes a token instead of a Python int's 36 (an hour holds ~75M tokens)
        results = [array("q", r) for r in sp.results]
        ctx = array("q", sp.first)
        self.agents[sid] = Agent(
            SessionPlan(sp.sid, sp.start_s, [], [[]] * len(results), sp.tools_s), ctx, results
        )
        self.live += 1
        self.begin(sid, now)

    def due(self, now: float) -> list[tuple[float, str, str]]:
        out = []
        while self.events and self.events[0][0] <= now + 1e-12:
            t, _, kind, sid = heapq.heappop(self.events)
            out.append((t, kind, sid))
        return out

    def sid_sent(self, sid: str) -> str | None:
        return sid if self.mode != "stock" else None

    # ---- what the server answered ----------------------------------------------------------------
    def answered(self, op: str, sid: str, status: int, body: dict[str, Any], now: float) -> None:
        """An HTTP call's answer; drives the agent's next step."""
        self.calls[f"{op} {status}"] += 1
        a = self.agents[sid]
        if op == "tool_start":
            if isinstance(body.get("decision"), str):
                self.decisions[str(body["decision"])] += 1
            a.epoch = int(body["epoch"]) if status == 200 and "epoch" in body else None
            self._sleep(a, now)
        elif op == "tool_end":
            a.restore_s = now - a.call_sent_at
            self.push(now, "generate", sid)

    def first_token(self, sid: str, now: float) -> None:
        self.agents[sid].first_token_at = now

    def call(self, op: str, sid: str, now: float) -> None:
        """The agent sends a toolkv call; the server sees it at its next iteration."""
        self.agents[sid].call_sent_at = now
        self.push(now, "op:" + op, sid)

    def generate_sent(self, sid: str, t: float) -> None:
        """The turn's request leaves the agent at ``t`` (its TTFT and end-to-end clock start)."""
        self.agents[sid].sent_at = t

    def turn_done(self, sid: str, req: Any, now: float) -> None:
        """A turn's answer is complete: the agent records it and goes on."""
        a = self.agents[sid]
        sp = a.plan
        t = a.turn
        self.turns.append(
            Turn(sid, t, a.sent_at, len(req.origin_input_ids), int(req.cached_tokens), len(req.output_ids),
                 a.first_token_at - a.sent_at, now - a.sent_at, 200, sp.tools_s[t - 1] if t else 0.0,
                 a.restore_s)
        )  # fmt: skip
        a.tracked = a.tracked or self.sid_sent(sid) is not None
        a.ctx.extend(req.output_ids)
        if t == sp.turns - 1:
            self._end(a, now)
            return
        self.timeline.append({"sid": sid, "turn": t, "end_s": now, "tokens": len(a.ctx) - 1})
        if self.mode in ("explicit", "on-request"):
            self.call("tool_start", sid, now)
        else:
            self._sleep(a, now)

    def tool_start_body(self, sid: str) -> dict[str, Any]:
        a = self.agents[sid]
        body: dict[str, Any] = {"session_id": sid}
        if self.send_tool:
            body["tool"] = self.sessions.workload.tools.name_of(a.plan.tools_s[a.turn])
        return body

    def _sleep(self, a: Agent, now: float) -> None:
        tool = a.plan.tools_s[a.turn]
        self.push(now + max(0.0, min(tool, self.stop_at - now + 0.01)), "tool_done", a.plan.sid)

    def tool_done(self, sid: str, now: float) -> None:
        """The tool returned (or the run ended: the session ends)."""
        a = self.agents[sid]
        if now > self.stop_at:
            self._end(a, now)
            return
        a.ctx.extend(a.results[a.turn])
        a.turn += 1
        self.next_use(sid, now)
        self.begin(sid, now)

    def next_use(self, sid: str, now: float) -> None:
        """The tool call that just ended is followed by a request: the timeline's next use."""
        for rec in reversed(self.timeline):
            if rec["sid"] == sid:
                rec["next_s"] = now
                rec["result_tokens"] = len(self.agents[sid].results[rec["turn"]])
                break

    def begin(self, sid: str, now: float) -> None:
        a = self.agents[sid]
        a.restore_s = math.nan
        a.first_token_at = math.nan
        if a.turn > 0 and self.mode == "explicit" and a.epoch is not None:
            self.call("tool_end", sid, now)
        else:
            self.push(now, "generate", sid)

    def _end(self, a: Agent, now: float) -> None:
        a.done = True
        self.live -= 1
        a.ctx = array("q")  # an hour of sessions: keep only what the report needs
        a.results = []
        if a.tracked:
            self.call("close", a.plan.sid, now)
