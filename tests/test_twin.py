"""The twin (``toolkv twin``): sglang 0.5.16's real cache, Req and PrefillAdder, toolkv's real
scheduler side, modelled GPU time. CPU, seconds long.

- conservation: every prompt token of every turn was either served from cache or computed,
  every turn the plan asked for was answered, and after the run every sglang and toolkv counter
  is back at its initial value with both pools idle; the same seed gives the same run;
- a hand-computed schedule: two requests, chunked prefill, a decode batch, on a profile with
  round numbers, equal to the twin's decisions and times to the microsecond;
- the optimal-retention bound on a hand-made timeline; the profile fit on synthetic points;
- L3 and more than one server: with long tools and the same L3, toolkv reuses at least what stock
  HiCache does and far more than toolkv without L3; a session whose server is drained is served
  from the shared L3 on its new server (recomputed without one); every token read from L3 was
  completely written, the links' bytes equal the store's, and nothing stays held; the store's
  timing, capacity and the router on hand-made cases.
"""

from __future__ import annotations

import math
import random

import pytest
from _twin_common import (
    OPTS,
    SMALL,
    check_conservation,
    check_hand_computed_schedule,
    check_same_seed_same_run,
    run,
)

from toolkv.twin.configs import get
from toolkv.twin.opt import belady, opt_reuse
from toolkv.twin.profile import TimeProfile, default_profile
from toolkv.workload.plan import Workload, make_plan


@pytest.mark.parametrize("name", ["stock", "offload", "auto", "pin", "radix"])
def test_conservation_and_idle_pools(name: str) -> None:
    check_conservation(run(name), name)


def test_same_seed_same_run() -> None:
    check_same_seed_same_run()


def test_hand_computed_schedule() -> None:
    """Two requests, chunk 1024, 4 output tokens, a = 0.1 s + 1 ms per prefill token, 10 ms a decode step.

    t=0      s0 (1500 tokens) arrives; PrefillAdder: first chunk of 1024     -> ends 0.1 + 1.024 = 1.124
    t=1.124  s1 (600, sent at 0.05) waits; s0's last 476 tokens leave 548 of the chunk budget, which
             s1's first chunk takes                                         -> ends 1.124 + 0.1 + 1.024 = 2.248
             s0's first token: TTFT 2.248
    t=2.248  s1's last 52 tokens                                            -> ends 2.248 + 0.152 = 2.400
             s1's first token: TTFT 2.400 - 0.05 = 2.350
    then one decode batch of both, 3 steps of 10 ms: both finish at 2.430.
    (The run and its assertions: ``_twin_common.check_hand_computed_schedule``, shared with 0.5.23.)"""
    check_hand_computed_schedule()


def test_belady_keeps_the_soonest_reuse() -> None:
    """Capacity 100: a (60 tokens, back at 5) and b (60, back at 3) cannot both stay; Belady keeps
    b whole and 40 tokens of a; c arrives at 4 (back at 9) after b left and takes what a leaves."""
    tl = [
        {"end_s": 0.0, "next_s": 5.0, "tokens": 60},
        {"end_s": 1.0, "next_s": 3.0, "tokens": 60},
        {"end_s": 4.0, "next_s": 9.0, "tokens": 80},
    ]
    found = belady(tl, 100)
    assert found == {1: 60.0, 0: 40.0, 2: 60.0}
    r = opt_reuse(tl, 100, (0.0, 10.0))
    assert r["reuse"] == pytest.approx(160 / 200)
    assert belady(tl, 10**6) == {0: 60.0, 1: 60.0, 2: 80.0}
    assert belady(tl, 0) == {0: 0.0, 1: 0.0, 2: 0.0}


def test_profile_round_trip_and_validation() -> None:
    p = default_profile()
    assert TimeProfile.from_json(p.to_json()) == p
    with pytest.raises(ValueError):
        TimeProfile.from_json(p.to_json() | {"decode_g": 1.0})
    with pytest.raises(ValueError):
        TimeProfile.from_json(p.to_json() | {"h2d_gbps": 0.0})
    assert math.isclose(p.copy_s(8192, "h2d"), p.copy_fixed_s + 8192 * 131072 / (p.h2d_gbps * 1e9))


def test_lazy_sessions_are_make_plans() -> None:
    """The twin draws each session when it starts; they are exactly ``make_plan``'s."""
    from toolkv.twin.sessions import Sessions

    w = Workload(initial_sessions=3, turns_median=4, first_tokens=600, growth_per_turn=200, output_tokens=10,
                 duration_s=400.0, seed=5)  # fmt: skip
    plan = make_plan(w)
    lazy = Sessions.lazy(w)
    assert lazy.starts == [s.start_s for s in plan.sessions]
    for i, sp in enumerate(plan.sessions):
        got = lazy.draw(i)
        assert (got.sid, got.first, got.results, got.tools_s) == (sp.sid, sp.first, sp.results, sp.tools_s)
    assert lazy.describe()["sessions_plan"] == plan.describe()["sessions_plan"]


def test_profile_fit_recovers_synthetic_coefficients() -> None:
    """The calibration's fit on points made from known coefficients (with 1 % noise) gives them back."""
    from toolkv.twin.fit import decode_terms, fit, prefill_terms, residual

    rng = random.Random(1)
    true_p = [0.012, 30e-6, 1.3e-9]
    pts = [(p, n, sum(c * f for c, f in zip(true_p, prefill_terms((p, n)), strict=True)) * rng.uniform(0.99, 1.01))
           for p in (0, 8192, 32768) for n in (256, 2048, 8192)]  # fmt: skip
    got = fit(pts, prefill_terms)
    assert got[1] == pytest.approx(true_p[1], rel=0.1) and got[2] == pytest.approx(true_p[2], rel=0.1)
    assert residual(pts, prefill_terms, got) < 0.05
    true_d = [0.019, 0.0002, 1e-8]
    pts = [(b, lsum, sum(c * f for c, f in zip(true_d, decode_terms((b, lsum)), strict=True)))
           for b in (1, 4, 16) for lsum in (4096, 65536)]  # fmt: skip
    assert fit(pts, decode_terms) == pytest.approx(true_d, rel=1e-6)
    # a term the points cannot see (noise only) is fixed at zero, never negative
    flat = [(b, lsum, 0.02 + (0.0001 if b % 2 else -0.0001)) for b in (1, 2, 3, 4) for lsum in (1000, 2000)]
    assert all(c >= 0 for c in fit(flat, decode_terms))


def test_a_dying_scheduler_fails_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """sglang's allocator raising mid-run (the scheduler process dying on a GPU server) ends the
    run early and fails its checks instead of raising or passing."""
    from toolkv.twin import scheduler as sched_mod
    from toolkv.twin.report import result

    calls = {"n": 0}
    real = sched_mod.TwinScheduler._alloc_extend

    def dying(self: sched_mod.TwinScheduler, reqs: list[object]) -> list[tuple[int, int]]:
        calls["n"] += 1
        if calls["n"] == 4:
            raise RuntimeError("Out of memory. Try to lower your batch size.\nmore lines")
        return real(self, reqs)

    monkeypatch.setattr(sched_mod.TwinScheduler, "_alloc_extend", dying)
    o = run("stock")
    assert o.crashed is not None and "Out of memory" in o.crashed
    r = result(o, default_profile(), window=(2.0, SMALL.duration_s))
    assert not r["passed"] and not r["checks"]["the scheduler did not die"]


def test_hand_over_hook_sees_every_admitted_session_request() -> None:
    """Every request of a session reaches toolkv's admission hook once per prefill batch it is in
    (the plugin's AFTER hook on get_new_batch_prefill); stock requests carry no session."""
    from toolkv.twin.run import Twin

    seen: list[str | None] = []
    twin = Twin(make_plan(SMALL), get("offload"), default_profile(), OPTS)
    twin.tk.on_batch = lambda reqs: seen.extend(r.session_id for r in reqs)  # type: ignore[method-assign]
    twin.tk.on_admitted = lambda sid: seen.append(sid)  # type: ignore[method-assign]
    o = twin.run()
    assert o.crashed is None
    sessions = {t.session for t in o.agents.turns}
    assert set(seen) == sessions  # every session, and nothing else
    assert len(seen) >= len(o.agents.turns)  # at least one prefill batch per turn (chunks add more)
