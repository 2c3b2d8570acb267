"""Shared by the twin tests (``test_twin.py`` on 0.5.16, ``test_twin_0523.py`` on 0.5.23): the
small workload both run, and the checks that must hold on either release, so the two files can
only differ where the releases do.

Each check runs the twin under whichever sglang is installed (the twin picks its scheduler and
cache from it); the release-specific assertions stay in the test files.
"""

from __future__ import annotations

import random

from toolkv.twin.configs import get
from toolkv.twin.profile import TimeProfile, default_profile
from toolkv.twin.report import recomputed_after_evict
from toolkv.twin.run import Options, Outcome, simulate
from toolkv.workload.plan import Plan, SessionPlan, Workload, make_plan

SMALL = Workload(initial_sessions=4, ramp_s=1.0, turns_median=3, first_tokens=1200, growth_per_turn=300,
                 output_tokens=20, duration_s=12.0, seed=3)  # fmt: skip
OPTS = Options(
    device_tokens=6000, chunked_prefill_size=1024, max_prefill_tokens=2048, max_running_requests=16
)
# round numbers, so a schedule's times can be computed by hand (check_hand_computed_schedule)
ROUND = TimeProfile(prefill_a=0.1, prefill_b=0.001, prefill_c=0.0, decode_d=0.01, decode_e=0.0, decode_f=0.0,
                    h2d_gbps=50.0, d2h_gbps=50.0, kv_bytes_per_token=131_072)  # fmt: skip


def run(name: str, w: Workload = SMALL, opts: Options = OPTS, profile: TimeProfile | None = None) -> Outcome:
    """One twin run of configuration ``name`` on ``w`` (the built-in profile unless given)."""
    return simulate(make_plan(w), get(name), profile or default_profile(), opts)


def check_conservation(o: Outcome, name: str) -> None:
    """A run of ``SMALL`` under configuration ``name`` lost nothing: every turn answered, every
    prompt token served from cache or computed exactly once, nothing leaked, and toolkv's calls
    only where the configuration makes them."""
    assert o.crashed is None, o.crashed
    plan = make_plan(SMALL)
    a = o.agents
    # every turn a session started was answered (the run ends with no turn in flight)
    assert a.finished and all(t.status == 200 for t in a.turns)
    assert {t.session for t in a.turns} == {s.sid for s in plan.sessions}
    # every prompt token was served from cache or computed, exactly once (no retraction here)
    assert o.retractions == 0
    assert o.prefill_tokens + o.cached_tokens == sum(t.prompt_tokens for t in a.turns)
    assert all(0 <= t.cached_tokens <= t.prompt_tokens for t in a.turns)
    assert all(t.output_tokens == SMALL.output_tokens for t in a.turns)
    # nothing leaked: no lock, no protection, no slot, every device and host token free again
    assert o.leaks["leaked"] == 0, o.leaks
    if name in ("offload", "auto"):
        assert sum(v for k, v in a.calls.items() if k.startswith("tool_start")) > 0
    if name == "stock":
        assert not a.calls  # stock agents make no toolkv call
    # the eviction-harm count: recomputed tokens are computed prompt tokens, paid by whoever sent
    # them (stock agents send no session id: all of it is "other"; toolkv's agents all send one)
    harm = recomputed_after_evict(o.meta_end)
    assert 0 <= harm["total"] <= o.prefill_tokens
    assert harm["session" if o.config.mode == "stock" else "other"] == 0, harm


def check_same_seed_same_run() -> None:
    """Two runs of one plan make the same turns, at the same times, with the same calls."""
    one, two = run("offload"), run("offload")
    key = [(t.session, t.turn, t.start_s, t.ttft_s, t.e2e_s, t.cached_tokens) for t in one.agents.turns]
    assert key == [
        (t.session, t.turn, t.start_s, t.ttft_s, t.e2e_s, t.cached_tokens) for t in two.agents.turns
    ]
    assert one.agents.calls == two.agents.calls and one.end_s == two.end_s


def check_hand_computed_schedule() -> None:
    """The schedule ``tests/test_twin.py::test_hand_computed_schedule`` computes by hand: two
    requests (1500 and 600 tokens), chunk 1024, 4 output tokens, on ``ROUND``."""
    w = Workload(initial_sessions=0, turns_median=1, first_tokens=1500, growth_per_turn=10, output_tokens=4,
                 duration_s=10.0)  # fmt: skip
    rng = random.Random(0)
    plan = Plan(w, [SessionPlan("s0", 0.0, [7, *(rng.randrange(1000, 9000) for _ in range(1499))]),
                    SessionPlan("s1", 0.05, [8, *(rng.randrange(1000, 9000) for _ in range(599))])])  # fmt: skip
    o = simulate(plan, get("stock"), ROUND, Options(device_tokens=4096, chunked_prefill_size=1024))
    got = {t.session: (round(t.ttft_s, 6), round(t.e2e_s, 6), t.cached_tokens) for t in o.agents.turns}
    assert got == {"s0": (2.248, 2.43, 0), "s1": (2.35, 2.38, 0)}
    assert (o.prefill_batches, o.decode_steps) == (3, 3)
    assert o.leaks["leaked"] == 0
