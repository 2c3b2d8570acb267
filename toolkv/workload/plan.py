"""The agent workload of ``toolkv bench agent``: what each session will do, drawn up front from one seed.

Every configuration of a benchmark run replays the same :class:`Plan` (same sessions, same start
times, same prompts, same tool durations), so the configurations differ only in the server. The
defaults are calibrated to published agent traces; ``docs/benchmarks.md`` lists each figure with
its source and says which parameter it sets:

- tool-call duration: a heavy-tailed mixture (:class:`ToolMixture`): a log-normal body with the
  Codex per-call median (0.626 s) and a log-uniform tail of 1-10 minute calls that carries half of
  all tool time (TraceLab);
- turns per session: log-normal around the median of 33 (Codex, SWE-bench-Pro);
- context: a first prompt of ~12K tokens growing by ~2,240 tokens per turn, of which the model's
  answer is the input/output ratio of 131:1 applied to the mean prompt (~350 tokens) and the rest
  is the tool result;
- arrivals: open loop. ``initial_sessions`` start spread over ``ramp_s``, then a Poisson stream
  whose rate keeps the population level if a turn took ``assumed_turn_s``; a slower server sees
  the same offered load and shows it as latency, not as fewer sessions.

Standard library only: it also runs on the GPU machine with nothing installed.
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass, field
from typing import Any

VOCAB_LO, VOCAB_HI = 1000, 120_000  # token ids drawn from here (Llama-3 vocabulary: 128,256)


@dataclass(frozen=True)
class ToolMixture:
    """Tool-call duration: log-normal body, log-uniform tail. ``long_time_share`` is the share of
    expected tool time spent in tail calls; the tail's probability follows from it."""

    short_median_s: float = 0.626
    short_sigma: float = 1.0
    long_min_s: float = 60.0
    long_max_s: float = 600.0
    long_time_share: float = 0.5

    def __post_init__(self) -> None:
        if not (0.0 <= self.long_time_share <= 1.0):
            raise ValueError(f"long_time_share must be in [0, 1], got {self.long_time_share}")
        if not (0 < self.long_min_s < self.long_max_s) or self.short_median_s <= 0 or self.short_sigma < 0:
            raise ValueError("tool durations must be positive with long_min_s < long_max_s")

    @property
    def short_mean_s(self) -> float:
        return self.short_median_s * math.exp(self.short_sigma**2 / 2)

    @property
    def long_mean_s(self) -> float:
        lo, hi = self.long_min_s, self.long_max_s
        return (hi - lo) / math.log(hi / lo)

    @property
    def long_weight(self) -> float:
        """P(a call is a tail call) such that tail calls carry ``long_time_share`` of tool time:
        w * E_long = share * ((1 - w) * E_short + w * E_long)."""
        s, el, es = self.long_time_share, self.long_mean_s, self.short_mean_s
        if s >= 1.0:
            return 1.0
        return s * es / ((1 - s) * el + s * es)

    @property
    def mean_s(self) -> float:
        w = self.long_weight
        return (1 - w) * self.short_mean_s + w * self.long_mean_s

    def name_of(self, seconds: float) -> str:
        """The tool's name as an agent would send it with ``tool_start``: its duration class
        (``build`` for a tail-length call, ``read`` otherwise). It carries what a real tool name
        tells a server, the kind of call, and no more than that."""
        return "build" if seconds >= self.long_min_s else "read"

    def sample(self, rng: random.Random) -> float:
        if rng.random() < self.long_weight:
            return math.exp(rng.uniform(math.log(self.long_min_s), math.log(self.long_max_s)))
        return rng.lognormvariate(math.log(self.short_median_s), self.short_sigma)


@dataclass(frozen=True)
class NamedTools:
    """Tool calls drawn from a few named tools, each with its own log-normal duration: an agent
    whose tools differ in kind (a lookup takes a second, a build half a minute) and send their
    names. ``name_of`` gives back the tool whose median is nearest (in log time) to a duration,
    which is the tool that most likely drew it; the spread keeps names and durations apart from
    a fixed mapping, as real calls of one tool vary."""

    names: tuple[str, ...] = ("lookup", "search", "test", "build")
    medians_s: tuple[float, ...] = (1.0, 3.0, 8.0, 25.0)
    sigma: float = 0.5
    long_weight: float = 0.0  # no heavy tail: the shape's long calls are its slowest tool

    def __post_init__(self) -> None:
        if len(self.names) != len(self.medians_s) or not self.names:
            raise ValueError("one median per tool name, at least one tool")
        if any(m <= 0 for m in self.medians_s) or self.sigma < 0:
            raise ValueError("tool medians must be positive and sigma >= 0")

    @property
    def mean_s(self) -> float:
        return sum(self.medians_s) / len(self.medians_s) * math.exp(self.sigma**2 / 2)

    def name_of(self, seconds: float) -> str:
        t = math.log(max(seconds, 1e-9))
        return min(zip(self.names, self.medians_s, strict=True), key=lambda nm: abs(math.log(nm[1]) - t))[0]

    def sample(self, rng: random.Random) -> float:
        median = self.medians_s[rng.randrange(len(self.medians_s))]
        return rng.lognormvariate(math.log(median), self.sigma)


# Named tool-duration shapes: the trace-calibrated default, long calls only (a second shape next to
# it, never instead of it), and four named tools of 1-25 s medians (an agent whose tools differ).
SHAPES: dict[str, ToolMixture | NamedTools] = {
    "traces": ToolMixture(),
    "long": ToolMixture(long_time_share=1.0),
    "named": NamedTools(),
}


@dataclass(frozen=True)
class Workload:
    initial_sessions: int = 12
    ramp_s: float = 8.0  # the initial sessions start spread over this
    assumed_turn_s: float = 8.0  # sets the default arrival rate only (see module docstring)
    arrival_rate: float | None = None  # sessions/s after the ramp; None: keep the population level
    turns_median: int = 33
    turns_sigma: float = 0.5
    first_tokens: int = 12_000  # first prompt, uniform within +-25 %
    growth_per_turn: int = 2_240  # tool result + answer
    output_tokens: int = 350  # the answer: mean prompt / 131
    result_sigma: float = 0.8  # log-normal spread of the tool result's length
    max_context: int = 65_536  # a session ends before its prompt + answer would exceed this
    tool_shape: str = "traces"
    duration_s: float = 60.0  # no session starts and no turn begins after this
    seed: int = 0

    def __post_init__(self) -> None:
        if self.tool_shape not in SHAPES:
            raise ValueError(f"tool_shape must be one of {sorted(SHAPES)}, got {self.tool_shape!r}")
        # each field is named with the flag that sets it in ``toolkv twin`` and ``toolkv bench agent``
        if self.initial_sessions < 0:
            raise ValueError(f"--sessions {self.initial_sessions}: expected an integer >= 0")
        if not self.duration_s > 0:
            raise ValueError(f"--duration {self.duration_s:g}: expected a number > 0")
        if self.turns_median < 1:
            raise ValueError(f"--turns {self.turns_median}: expected an integer >= 1")
        if self.output_tokens >= self.growth_per_turn:
            raise ValueError(
                f"--output {self.output_tokens} must be smaller than --growth {self.growth_per_turn} "
                "(a turn's new tokens are the answer and the tool's result)"
            )
        if self.first_tokens + self.output_tokens > self.max_context:
            raise ValueError(
                f"--first-tokens {self.first_tokens} + --output {self.output_tokens} exceeds "
                f"--max-context {self.max_context}"
            )

    @property
    def tools(self) -> ToolMixture | NamedTools:
        return SHAPES[self.tool_shape]

    @property
    def rate(self) -> float:
        """Arrivals per second after the ramp."""
        if self.arrival_rate is not None:
            return self.arrival_rate
        life = self.turns_median * (self.assumed_turn_s + self.tools.mean_s)
        return self.initial_sessions / life


@dataclass
class SessionPlan:
    """One session, fully determined: its tokens, and the tool durations between its turns."""

    sid: str
    start_s: float
    first: list[int]
    results: list[list[int]] = field(default_factory=list)  # tool result appended before turn t+1
    tools_s: list[float] = field(default_factory=list)  # tool call after turn t

    @property
    def turns(self) -> int:
        return len(self.results) + 1

    def summary(self) -> dict[str, Any]:
        return {
            "sid": self.sid,
            "start_s": self.start_s,
            "turns": self.turns,
            "first_tokens": len(self.first),
            "result_tokens": [len(r) for r in self.results],
            "tools_s": self.tools_s,
        }


@dataclass
class Plan:
    workload: Workload
    sessions: list[SessionPlan]

    def describe(self) -> dict[str, Any]:
        tools = [t for s in self.sessions for t in s.tools_s]
        return {
            "workload": asdict(self.workload),
            "arrival_rate_per_s": self.workload.rate,
            "tool_mixture": asdict(self.workload.tools) | {"long_weight": self.workload.tools.long_weight},
            "sessions": len(self.sessions),
            "tool_calls_planned": len(tools),
            "sessions_plan": [s.summary() for s in self.sessions],
        }


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB_LO, VOCAB_HI) for _ in range(n)]


def plan_session(
    w: Workload, index: int, start_s: float, rng: random.Random, prefix: str = "s"
) -> SessionPlan:
    """Draw one session. Its tokens are random ids, so sessions share no radix prefix: what a
    configuration serves from cache is the session's own history, nothing else."""
    first_n = rng.randint(int(w.first_tokens * 0.75), int(w.first_tokens * 1.25))
    first_n = min(first_n, w.max_context - w.output_tokens)
    turns = max(1, round(rng.lognormvariate(math.log(w.turns_median), w.turns_sigma)))
    s = SessionPlan(sid=f"{prefix}{index}", start_s=start_s, first=_tokens(rng, first_n))
    ctx = first_n + w.output_tokens
    mean_result = w.growth_per_turn - w.output_tokens
    median = mean_result / math.exp(w.result_sigma**2 / 2)
    for _ in range(turns - 1):
        n = max(1, round(rng.lognormvariate(math.log(median), w.result_sigma)))
        if ctx + n + w.output_tokens > w.max_context:
            break
        s.tools_s.append(w.tools.sample(rng))
        s.results.append(_tokens(rng, n))
        ctx += n + w.output_tokens
    return s


def make_plan(w: Workload, prefix: str = "s") -> Plan:
    """All sessions of a run: the initial ones spread over the ramp, then Poisson arrivals until
    ``duration_s``. Depends on nothing but ``w`` (seed included)."""
    rng = random.Random(w.seed)
    starts = [w.ramp_s * (i + rng.random()) / max(1, w.initial_sessions) for i in range(w.initial_sessions)]
    t = w.ramp_s
    while w.rate > 0:
        t += rng.expovariate(w.rate)
        if t >= w.duration_s:
            break
        starts.append(t)
    sessions = [
        plan_session(w, i, st, random.Random(w.seed * 1_000_003 + i), prefix) for i, st in enumerate(starts)
    ]
    return Plan(w, sessions)
