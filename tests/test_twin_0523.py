"""The twin over sglang 0.5.23: the real ``UnifiedRadixCache`` (HiCache, Python tree core) through
:mod:`toolkv.testing.unified_harness`, 0.5.23's admission (:mod:`toolkv.twin.scheduler_0523`) and
toolkv's unified backend, chosen from the installed sglang. The 0.5.23 half of
``tests/test_twin.py``'s conservation, determinism and hand-computed schedule.

Runs in the 0.5.23 environment (``make test-0523``); skips where an older sglang is installed.
"""

from __future__ import annotations

import random

import pytest

from toolkv.testing.unified_harness import has_unified_radix_cache, sglang_version

if not has_unified_radix_cache():
    pytest.skip(
        f"needs sglang >= 0.5.21 (UnifiedRadixCache), found {sglang_version()}", allow_module_level=True
    )

from toolkv.tools.agent_workload import Plan, SessionPlan, Workload, make_plan
from toolkv.twin.configs import get
from toolkv.twin.profile import TimeProfile, default_profile
from toolkv.twin.run import Options, Outcome, Twin, simulate

SMALL = Workload(initial_sessions=4, ramp_s=1.0, turns_median=3, first_tokens=1200, growth_per_turn=300,
                 output_tokens=20, duration_s=12.0, seed=3)  # fmt: skip
OPTS = Options(
    device_tokens=6000, chunked_prefill_size=1024, max_prefill_tokens=2048, max_running_requests=16
)


def run(name: str, w: Workload = SMALL, opts: Options = OPTS) -> Outcome:
    return simulate(make_plan(w), get(name), default_profile(), opts)


def test_the_twin_builds_sglangs_unified_stack() -> None:
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    from toolkv.core.backends.unified import UnifiedBackend
    from toolkv.twin.scheduler_0523 import TwinScheduler0523

    twin = Twin(make_plan(SMALL), get("offload"), default_profile(), OPTS)
    try:
        assert twin.stack.unified and twin.stack.sglang == sglang_version()
        assert isinstance(twin.h.tree, UnifiedRadixCache) and twin.h.tree.cache_controller is not None
        assert isinstance(twin.sched, TwinScheduler0523)
        assert isinstance(twin.tk.manager.backend, UnifiedBackend)
        assert twin.stack.host_tokens == get("offload").host_tokens(default_profile().kv_bytes_per_token)
    finally:
        twin.stack.close()


@pytest.mark.parametrize("name", ["stock", "offload", "auto"])
def test_conservation_and_idle_pools(name: str) -> None:
    o = run(name)
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
    assert o.cached_tokens > 0  # later turns reuse their session's prefix
    # nothing leaked: no lock, no protection, no slot, every device and host token free again
    assert o.leaks["leaked"] == 0, o.leaks
    if name in ("offload", "auto"):
        assert sum(v for k, v in a.calls.items() if k.startswith("tool_start")) > 0
        # every finished turn reached toolkv through the AFTER hook on UnifiedRadixCache.checkpoint
        assert o.meta_end["backend"] == "unified" and o.meta_end["counters"]["turns"] == len(a.turns)
    if name == "stock":
        assert not a.calls


def test_same_seed_same_run() -> None:
    one, two = run("offload"), run("offload")
    key = [(t.session, t.turn, t.start_s, t.ttft_s, t.e2e_s, t.cached_tokens) for t in one.agents.turns]
    assert key == [
        (t.session, t.turn, t.start_s, t.ttft_s, t.e2e_s, t.cached_tokens) for t in two.agents.turns
    ]
    assert one.agents.calls == two.agents.calls and one.end_s == two.end_s


def test_configurations_without_hicache_are_refused() -> None:
    """toolkv's unified backend needs a host tier: radix and pin have no 0.5.23 server to model.
    The refusal leaves no CPU harness behind (the next twin builds)."""
    for name in ("radix", "pin"):
        with pytest.raises(ValueError, match="without HiCache"):
            run(name)
    assert run("stock").crashed is None


ROUND = TimeProfile(prefill_a=0.1, prefill_b=0.001, prefill_c=0.0, decode_d=0.01, decode_e=0.0, decode_f=0.0,
                    h2d_gbps=50.0, d2h_gbps=50.0, kv_bytes_per_token=131_072)  # fmt: skip


def test_hand_computed_schedule() -> None:
    """The schedule of ``tests/test_twin.py::test_hand_computed_schedule`` on 0.5.23: the same
    decisions (chunk 1024 for s0, s1's first chunk in the 548 tokens s0's last chunk leaves,
    then s1's last 52 tokens, then 3 decode steps of both) and the same times."""
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
