"""toolkv.core.policy: the duration model, the keep / offload / let_go rules, and demotion order."""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import replace
from statistics import NormalDist
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from toolkv.core.policy import (
    MAX_DURATION_S,
    MIN_DURATION_S,
    Decision,
    DurationModel,
    PolicyConfig,
    Pressure,
    decide,
    demotion_order,
)

Z = NormalDist().inv_cdf
CFG = PolicyConfig()
RATE = 1_000_000.0  # restore tokens per second
ROOMY = Pressure(
    device_total_tokens=100_000,
    device_available_tokens=100_000,
    host_total_tokens=1_000_000,
    host_available_tokens=1_000_000,
)


def prior_quantile(cfg: PolicyConfig, q: float) -> float:
    return cfg.prior_median_s * math.exp(cfg.prior_sigma * Z(q))


def trained(tool: str, seconds: float, n: int = 200, cfg: PolicyConfig = CFG) -> DurationModel:
    """A model that has seen ``n`` calls of ``tool`` spread log-normally around ``seconds``."""
    m = DurationModel(cfg)
    for i in range(n):
        m.observe(tool, seconds * math.exp(0.3 * Z((i + 0.5) / n)))
    return m


def run(
    *,
    kv: int = 10_000,
    tool: str | None = "t",
    hint: float | None = None,
    pressure: Pressure = ROOMY,
    model: DurationModel | None = None,
    cfg: PolicyConfig = CFG,
    rate: float = RATE,
) -> Decision:
    return decide(
        kv_tokens=kv,
        tool=tool,
        expected_s=hint,
        pressure=pressure,
        model=model if model is not None else DurationModel(cfg),
        config=cfg,
        restore_tokens_per_s=rate,
    )


# ---- PolicyConfig ------------------------------------------------------------------------------------


def test_defaults_are_valid_and_an_unseen_tool_is_kept_by_default() -> None:
    # calibration: the prior's p75 (~1.6 s) is under keep_max_s, so an unseen tool is short
    assert prior_quantile(CFG, CFG.keep_quantile) < CFG.keep_max_s
    assert run(tool="never_seen").action == "keep"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("prior_median_s", 0.0),
        ("prior_median_s", -1.0),
        ("prior_median_s", math.nan),
        ("prior_median_s", math.inf),
        ("prior_median_s", MAX_DURATION_S * 10),
        ("prior_median_s", True),
        ("prior_sigma", 0.0),
        ("prior_sigma", -0.5),
        ("prior_sigma", math.inf),
        ("prior_weight", 0.0),
        ("prior_weight", math.nan),
        ("keep_max_s", -0.1),
        ("keep_max_s", math.inf),
        ("keep_quantile", 0.0),
        ("keep_quantile", 1.0),
        ("keep_quantile", math.nan),
        ("device_reserve", -0.01),
        ("device_reserve", 1.01),
        ("min_offload_tokens", -1),
        ("min_offload_tokens", 1.5),
        ("prefetch_quantile", 0.0),
        ("prefetch_quantile", 1.5),
        ("prefetch_margin_s", -0.01),
        ("prefetch_margin_s", math.nan),
        ("max_tools", 0),
        ("max_tools", 2.0),
        ("max_tools", True),
        ("keep_max_s", "2"),
    ],
)
def test_config_rejects_invalid_field(field: str, value: Any) -> None:
    with pytest.raises(ValueError, match=f"PolicyConfig.{field}"):
        PolicyConfig(**{field: value})


def test_config_accepts_boundary_values() -> None:
    cfg = PolicyConfig(device_reserve=0.0, min_offload_tokens=0, keep_max_s=0.0, prefetch_margin_s=0.0)
    assert cfg.device_reserve == 0.0
    assert PolicyConfig(device_reserve=1.0, max_tools=1).max_tools == 1


# ---- DurationModel -----------------------------------------------------------------------------------


@pytest.mark.parametrize("cfg", [CFG, PolicyConfig(prior_median_s=0.125, prior_sigma=0.7)])
def test_prior_is_used_for_unseen_tools(cfg: PolicyConfig) -> None:
    m = DurationModel(cfg)
    m.observe("other", 300.0)  # observations of another tool do not leak into an unseen one
    for q in (0.1, 0.5, 0.75, 0.9):
        assert m.quantile("unseen", q) == pytest.approx(prior_quantile(cfg, q), rel=1e-12)
    assert m.median("unseen") == pytest.approx(cfg.prior_median_s, rel=1e-12)
    assert m.count("unseen") == 0
    assert "unseen" not in m.snapshot()


def test_one_observation_moves_the_estimate_only_part_of_the_way() -> None:
    m = DurationModel(CFG)
    m.observe("grep", 0.01)
    assert 0.01 < m.median("grep") < CFG.prior_median_s
    # k = 2 pseudo-observations: log-median is 2/3 prior, 1/3 observation
    expected = math.exp((2 * math.log(CFG.prior_median_s) + math.log(0.01)) / 3)
    assert m.median("grep") == pytest.approx(expected, rel=1e-12)


def test_median_and_sigma_converge_to_the_sample_after_many_observations() -> None:
    rng = random.Random(1234)
    m = DurationModel(CFG)
    samples = [rng.lognormvariate(math.log(90.0), 0.8) for _ in range(5000)]
    for s in samples:
        m.observe("build", s)
    logs = [math.log(s) for s in samples]
    geo_mean = math.exp(statistics.fmean(logs))
    assert m.median("build") == pytest.approx(geo_mean, rel=0.01)
    assert m.snapshot()["build"]["sigma"] == pytest.approx(statistics.pstdev(logs), rel=0.02)
    assert m.count("build") == 5000


@given(
    st.lists(st.floats(min_value=MIN_DURATION_S, max_value=1e4), min_size=1, max_size=300),
)
def test_posterior_median_lies_between_prior_and_geometric_mean(durations: list[float]) -> None:
    m = DurationModel(CFG)
    for d in durations:
        m.observe("t", d)
    xbar = statistics.fmean(math.log(d) for d in durations)
    mu0 = math.log(CFG.prior_median_s)
    k, n = CFG.prior_weight, len(durations)
    # the conjugate mean: the distance to the sample's log-mean shrinks as k / (k + n)
    assert abs(math.log(m.median("t")) - xbar) <= k / (k + n) * abs(xbar - mu0) + 1e-9


@given(
    st.lists(st.floats(min_value=0.0, max_value=1e7), max_size=50),
    st.floats(min_value=1e-6, max_value=1 - 1e-6),
    st.floats(min_value=1e-6, max_value=1 - 1e-6),
    st.sampled_from(["t", None, "unseen"]),
)
def test_quantiles_are_monotone_in_q_and_clamped(
    durations: list[float], q1: float, q2: float, tool: str | None
) -> None:
    m = DurationModel(CFG)
    for d in durations:
        m.observe("t", d)
    lo, hi = sorted((q1, q2))
    assert m.quantile(tool, lo) <= m.quantile(tool, hi)
    for q in (lo, hi):
        assert MIN_DURATION_S <= m.quantile(tool, q) <= MAX_DURATION_S


def test_quantiles_are_strictly_increasing_away_from_the_clamps() -> None:
    m = trained("t", 5.0)
    values = [m.quantile("t", q) for q in (0.1, 0.25, 0.5, 0.75, 0.9)]
    assert values == sorted(values)
    assert len(set(values)) == len(values)
    assert m.quantile("t", 0.5) == pytest.approx(m.median("t"), rel=1e-12)


@pytest.mark.parametrize("q", [0.0, 1.0, -0.1, 1.5, math.nan])
def test_quantile_rejects_q_outside_the_open_unit_interval(q: float) -> None:
    with pytest.raises(ValueError, match="q must be"):
        DurationModel(CFG).quantile("t", q)


def test_observe_ignores_non_finite_and_negative_durations() -> None:
    m = DurationModel(CFG)
    m.observe("t", 2.0)
    before = m.snapshot()
    for bad in (math.nan, math.inf, -math.inf, -1.0, -1e-9):
        m.observe("t", bad)
        m.observe("fresh", bad)
    assert m.snapshot() == before
    assert m.count("t") == 1
    assert m.count(None) == 1
    assert m.count("fresh") == 0


def test_observe_clamps_tiny_and_huge_durations() -> None:
    cfg = PolicyConfig(prior_weight=1e-9)  # the prior all but vanishes: the estimate is the clamped sample
    m = DurationModel(cfg)
    m.observe("zero", 0.0)
    m.observe("tiny", 1e-9)
    m.observe("huge", 1e300)
    assert m.median("zero") == pytest.approx(MIN_DURATION_S, rel=1e-6)
    assert m.median("tiny") == pytest.approx(MIN_DURATION_S, rel=1e-6)
    assert m.median("huge") == pytest.approx(MAX_DURATION_S, rel=1e-6)
    assert m.count("zero") == 1


def test_a_huge_sample_counts_as_max_duration_in_the_fit() -> None:
    m = DurationModel(CFG)
    m.observe("t", 1e300)
    for _ in range(1000):
        m.observe("t", 1.0)
    k, mu0 = CFG.prior_weight, math.log(CFG.prior_median_s)
    assert m.median("t") == pytest.approx(
        math.exp((k * mu0 + math.log(MAX_DURATION_S)) / (k + 1001)), rel=1e-9
    )


def test_sigma_follows_the_conjugate_update() -> None:
    m = DurationModel(CFG)
    xs = [0.2, 5.0, 40.0]
    for x in xs:
        m.observe("t", x)
    k, mu0, s0 = CFG.prior_weight, math.log(CFG.prior_median_s), CFG.prior_sigma
    logs = [math.log(x) for x in xs]
    n, mean = len(logs), statistics.fmean(logs)
    m2 = sum((v - mean) ** 2 for v in logs)
    var = (k * s0**2 + m2 + k * n / (k + n) * (mean - mu0) ** 2) / (k + n)
    assert m.snapshot()["t"]["sigma"] == pytest.approx(math.sqrt(var), rel=1e-12)
    # one sample far from the prior widens the spread instead of narrowing it
    far = DurationModel(CFG)
    far.observe("t", 500.0)
    assert far.snapshot()["t"]["sigma"] > CFG.prior_sigma


def test_none_tool_reads_and_feeds_the_pooled_model() -> None:
    m = DurationModel(CFG)
    for _ in range(100):
        m.observe("fast", 0.1)
        m.observe("slow", 100.0)
    m.observe(None, 1.0)
    assert m.count(None) == 201
    assert m.count("fast") == 100
    assert m.median("fast") < m.median(None) < m.median("slow")
    assert m.median(None) == pytest.approx(math.sqrt(0.1 * 100.0), rel=0.05)  # geometric mean of both
    assert set(m.snapshot()) == {"fast", "slow"}  # a None observation creates no per-tool entry


def test_lru_bound_drops_the_least_recently_observed_tool() -> None:
    m = DurationModel(PolicyConfig(max_tools=3))
    for tool in ("a", "b", "c"):
        m.observe(tool, 50.0)
    m.observe("a", 50.0)  # refreshes "a": "b" is now the least recently observed
    m.observe("d", 50.0)
    assert list(m.snapshot()) == ["c", "a", "d"]
    assert m.count("b") == 0
    assert m.quantile("b", 0.5) == pytest.approx(CFG.prior_median_s)  # back to the prior
    assert m.count(None) == 5  # a dropped tool's observations stay pooled


def test_reads_do_not_refresh_lru_order() -> None:
    m = DurationModel(PolicyConfig(max_tools=2))
    m.observe("a", 1.0)
    m.observe("b", 1.0)
    m.quantile("a", 0.5)
    m.median("a")
    m.count("a")
    m.observe("c", 1.0)
    assert list(m.snapshot()) == ["b", "c"]


@given(st.lists(st.sampled_from("abcdefgh"), max_size=80), st.integers(min_value=1, max_value=5))
def test_lru_bound_holds_for_any_sequence(tools: list[str], max_tools: int) -> None:
    m = DurationModel(PolicyConfig(max_tools=max_tools))
    for t in tools:
        m.observe(t, 1.0)
    held = list(m.snapshot())
    most_recent_first: list[str] = []
    for t in reversed(tools):
        if t not in most_recent_first:
            most_recent_first.append(t)
    assert held == list(reversed(most_recent_first[:max_tools]))
    assert len(held) <= max_tools
    assert m.count(None) == len(tools)


def test_snapshot_reports_n_median_sigma_p90() -> None:
    m = trained("ls", 0.2, n=50)
    snap = m.snapshot()["ls"]
    assert set(snap) == {"n", "median_s", "sigma", "p90_s"}
    assert snap["n"] == 50.0
    assert snap["median_s"] == m.median("ls")
    assert snap["p90_s"] == m.quantile("ls", 0.9)
    assert snap["p90_s"] == pytest.approx(snap["median_s"] * math.exp(snap["sigma"] * Z(0.9)), rel=1e-9)
    assert 0 < snap["sigma"] < CFG.prior_sigma


# ---- Pressure ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"device_total_tokens": -1, "device_available_tokens": 0},
        {"device_available_tokens": -1},
        {"host_total_tokens": -5, "host_available_tokens": 0},
        {"host_available_tokens": -1},
        {"device_available_tokens": 100_001},
        {"host_available_tokens": 1_000_001},
        {"device_total_tokens": 1.5},
    ],
)
def test_pressure_rejects_invalid_counts(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="Pressure"):
        replace(ROOMY, **kwargs)


# ---- decide: the rules -------------------------------------------------------------------------------


def test_no_hint_uses_the_model_quantile_at_keep_quantile() -> None:
    m = trained("t", 0.5)
    d = run(model=m)
    assert d.expected_s == m.quantile("t", CFG.keep_quantile)
    assert (d.action, d.reason) == ("keep", "short_tool")
    assert d.restore_s == 10_000 / RATE
    assert d.prefetch_after_s is None


def test_hint_overrides_the_model_both_ways() -> None:
    long_model = trained("build", 120.0)
    short_model = trained("ls", 0.05)
    d = run(tool="ls", model=short_model, hint=30.0)
    assert (d.action, d.reason, d.expected_s) == ("offload", "long_tool_hint", 30.0)
    assert d.prefetch_after_s == pytest.approx(30.0 - 10_000 / RATE - CFG.prefetch_margin_s)
    d = run(tool="build", model=long_model, hint=0.1)
    assert (d.action, d.reason, d.expected_s) == ("keep", "short_tool_hint", 0.1)


def test_small_kv_is_offloaded_when_the_host_can_take_it() -> None:
    d = run(kv=CFG.min_offload_tokens - 1, model=trained("t", 120.0))
    assert (d.action, d.reason) == ("offload", "long_tool"), "never let go what the host can take"


def test_small_kv_is_let_go_only_when_the_host_cannot_take_it() -> None:
    full = replace(ROOMY, host_available_tokens=0)
    d = run(kv=CFG.min_offload_tokens - 1, model=trained("t", 120.0), pressure=full)
    assert (d.action, d.reason, d.prefetch_after_s) == ("let_go", "small_kv", None)


def test_small_kv_is_kept_when_short_and_affordable() -> None:
    d = run(kv=100, model=trained("t", 0.1))
    assert (d.action, d.reason) == ("keep", "short_tool")


def test_small_kv_under_device_pressure_is_offloaded_when_the_host_has_room() -> None:
    tight = replace(ROOMY, device_available_tokens=10_000)  # 10_000 - 100 < 0.1 * 100_000
    d = run(kv=100, model=trained("t", 0.1), pressure=tight)
    assert (d.action, d.reason) == ("offload", "device_pressure")


def test_a_short_tool_is_not_kept_on_evictable_room_only() -> None:
    """Evictable cache is other sessions' KV: a pin taken from it under load is paid for by their
    recompute. Only spare room (free after promised and queued tokens) admits a keep."""
    busy = replace(ROOMY, device_spare_tokens=5_000)  # plenty evictable, little free
    d = run(kv=1_000, model=trained("t", 0.1), pressure=busy)
    assert (d.action, d.reason) == ("offload", "device_pressure")
    idle = replace(ROOMY, device_spare_tokens=90_000)
    assert run(kv=1_000, model=trained("t", 0.1), pressure=idle).action == "keep"


def test_empty_kv_is_let_go() -> None:
    d = run(kv=0, model=trained("t", 120.0))
    assert (d.action, d.reason, d.restore_s, d.prefetch_after_s) == ("let_go", "no_kv", 0.0, None)


def test_short_tool_keep_boundary_is_the_device_reserve() -> None:
    m = trained("t", 0.1)
    kv = 5_000
    reserve = int(CFG.device_reserve * ROOMY.device_total_tokens)  # 10_000
    exactly = replace(ROOMY, device_available_tokens=reserve + kv)
    assert run(kv=kv, model=m, pressure=exactly).action == "keep"
    one_short = replace(ROOMY, device_available_tokens=reserve + kv - 1)
    d = run(kv=kv, model=m, pressure=one_short)
    assert (d.action, d.reason) == ("offload", "device_pressure")
    assert d.prefetch_after_s is not None
    assert d.prefetch_after_s == pytest.approx(
        max(0.0, m.quantile("t", CFG.prefetch_quantile) - kv / RATE - CFG.prefetch_margin_s)
    )


def test_keep_max_boundary() -> None:
    assert run(hint=CFG.keep_max_s).action == "keep"
    assert run(hint=math.nextafter(CFG.keep_max_s, math.inf)).action == "offload"


def test_long_tool_is_offloaded_with_a_prefetch_at_the_prefetch_quantile() -> None:
    m = trained("build", 120.0)
    kv, rate = 200_000, 50_000.0
    d = run(kv=kv, tool="build", model=m, rate=rate)
    assert (d.action, d.reason) == ("offload", "long_tool")
    assert d.restore_s == pytest.approx(4.0)
    t_q = m.quantile("build", CFG.prefetch_quantile)
    assert t_q != m.quantile("build", CFG.keep_quantile)  # the two quantiles differ here
    assert d.prefetch_after_s == pytest.approx(t_q - 4.0 - CFG.prefetch_margin_s)
    assert d.expected_s == m.quantile("build", CFG.keep_quantile)


def test_prefetch_is_clamped_at_zero_when_the_restore_is_longer_than_the_tool() -> None:
    d = run(kv=500_000, hint=3.0, rate=10_000.0)  # restore takes 50 s, the tool 3 s
    assert d.action == "offload"
    assert d.prefetch_after_s == 0.0


def test_host_room_boundary() -> None:
    m = trained("t", 120.0)
    kv = 20_000
    exact = replace(ROOMY, host_available_tokens=kv)
    assert run(kv=kv, model=m, pressure=exact).action == "offload"
    lacking = replace(ROOMY, host_available_tokens=kv - 1)
    d = run(kv=kv, model=m, pressure=lacking)
    assert (d.action, d.reason, d.prefetch_after_s) == ("keep", "host_full_keep", None)


def test_host_full_and_device_tight_lets_go() -> None:
    pressure = Pressure(
        device_total_tokens=100_000,
        device_available_tokens=15_000,
        host_total_tokens=1_000_000,
        host_available_tokens=0,
    )
    assert run(kv=10_000, model=trained("t", 120.0), pressure=pressure).reason == "host_full"
    d = run(kv=10_000, model=trained("t", 0.1), pressure=pressure)  # short, but no room either side
    assert (d.action, d.reason, d.prefetch_after_s) == ("let_go", "host_full", None)
    assert run(kv=10_000, hint=60.0, pressure=pressure).reason == "host_full_hint"


def test_decide_is_deterministic_and_does_not_touch_the_model() -> None:
    def build() -> DurationModel:
        m = DurationModel(CFG)
        for i in range(30):
            m.observe("t", 1.0 + i)
            m.observe(None, 0.5)
        return m

    m1, m2 = build(), build()
    before = m1.snapshot()
    first = run(model=m1, kv=3_000)
    assert run(model=m1, kv=3_000) == first
    assert run(model=m2, kv=3_000) == first
    assert m1.snapshot() == before
    assert m1.count(None) == 60


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"kv": -1}, "kv_tokens"),
        ({"kv": 1.5}, "kv_tokens"),
        ({"hint": math.nan}, "expected_s"),
        ({"hint": math.inf}, "expected_s"),
        ({"hint": -0.1}, "expected_s"),
        ({"rate": 0.0}, "restore_tokens_per_s"),
        ({"rate": -5.0}, "restore_tokens_per_s"),
        ({"rate": math.nan}, "restore_tokens_per_s"),
        ({"rate": math.inf}, "restore_tokens_per_s"),
    ],
)
def test_decide_rejects_invalid_inputs(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        run(**kwargs)


@st.composite
def pressures(draw: st.DrawFn) -> Pressure:
    dt = draw(st.integers(min_value=0, max_value=200_000))
    ht = draw(st.integers(min_value=0, max_value=200_000))
    return Pressure(
        device_total_tokens=dt,
        device_available_tokens=draw(st.integers(min_value=0, max_value=dt)),
        device_spare_tokens=draw(st.none() | st.integers(min_value=0, max_value=dt)),
        host_total_tokens=ht,
        host_available_tokens=draw(st.integers(min_value=0, max_value=ht)),
    )


@given(
    kv=st.integers(min_value=0, max_value=200_000),
    pressure=pressures(),
    hint=st.none() | st.floats(min_value=0.0, max_value=1e5),
    durations=st.lists(st.floats(min_value=0.0, max_value=1e5), max_size=20),
    tool=st.sampled_from(["t", "unseen", None]),
    reserve=st.floats(min_value=0.0, max_value=1.0),
    min_offload=st.integers(min_value=0, max_value=2_000),
    keep_max=st.floats(min_value=0.0, max_value=100.0),
    rate=st.floats(min_value=1.0, max_value=1e8),
)
def test_decide_never_breaks_the_reserve_or_the_host_budget(
    kv: int,
    pressure: Pressure,
    hint: float | None,
    durations: list[float],
    tool: str | None,
    reserve: float,
    min_offload: int,
    keep_max: float,
    rate: float,
) -> None:
    cfg = PolicyConfig(device_reserve=reserve, min_offload_tokens=min_offload, keep_max_s=keep_max)
    m = DurationModel(cfg)
    for s in durations:
        m.observe("t", s)
    d = run(kv=kv, tool=tool, hint=hint, pressure=pressure, model=m, cfg=cfg, rate=rate)
    assert d == run(kv=kv, tool=tool, hint=hint, pressure=pressure, model=m, cfg=cfg, rate=rate)
    spare = pressure.device_available_tokens
    if pressure.device_spare_tokens is not None:
        spare = min(spare, pressure.device_spare_tokens)
    device_fits = spare - kv >= reserve * pressure.device_total_tokens
    host_fits = pressure.host_available_tokens >= kv
    if d.action == "keep":
        assert device_fits
    if d.action == "offload":
        assert host_fits
        assert d.prefetch_after_s is not None
        assert d.prefetch_after_s >= 0.0
    else:
        assert d.prefetch_after_s is None
    if kv > 0 and host_fits:
        assert d.action != "let_go"  # the host can take it: never a recompute
    assert d.restore_s == kv / rate
    assert d.reason.endswith("_hint") == (hint is not None)
    assert d.expected_s == (hint if hint is not None else m.quantile(tool, cfg.keep_quantile))


# ---- demotion_order ----------------------------------------------------------------------------------


def test_demotion_puts_the_largest_expected_remaining_time_first() -> None:
    now = 100.0
    cands = [("a", 0.0, 200.0, 10), ("b", 0.0, 150.0, 10), ("c", 0.0, 300.0, 10)]
    assert demotion_order(cands, now) == ["c", "a", "b"]


def test_demotion_puts_overdue_sessions_last_most_overdue_first() -> None:
    now = 100.0
    cands = [
        ("due_now", 0.0, 100.0, 10),
        ("slightly_over", 0.0, 90.0, 10),
        ("far_over", 0.0, 50.0, 10),
        ("running", 50.0, 101.0, 10),
        ("unknown_end", 90.0, math.inf, 10),
    ]
    assert demotion_order(cands, now) == ["unknown_end", "running", "far_over", "slightly_over", "due_now"]


def test_demotion_ties_break_on_oldest_start_then_id() -> None:
    now = 10.0
    cands = [
        ("z", 5.0, 20.0, 1),
        ("b", 3.0, 20.0, 1),
        ("a", 3.0, 20.0, 1),
        ("o", 1.0, 5.0, 1),
        ("n", 1.0, 5.0, 1),
    ]
    assert demotion_order(cands, now) == ["a", "b", "z", "n", "o"]
    assert demotion_order([], now) == []


@pytest.mark.parametrize(
    ("cands", "now", "match"),
    [
        ([("a", 0.0, 1.0, 1), ("a", 0.0, 2.0, 1)], 0.0, "duplicate"),
        ([("a", 0.0, 1.0, 1)], math.nan, "now"),
        ([("a", 0.0, 1.0, 1)], math.inf, "now"),
        ([("a", math.nan, 1.0, 1)], 0.0, "started_at"),
        ([("a", math.inf, 1.0, 1)], 0.0, "started_at"),
        ([("a", 0.0, math.nan, 1)], 0.0, "expected_end_at"),
        ([("a", 0.0, 1.0, -1)], 0.0, "tokens"),
    ],
)
def test_demotion_rejects_invalid_candidates(
    cands: list[tuple[str, float, float, int]], now: float, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        demotion_order(cands, now)


@given(
    st.lists(
        st.tuples(
            st.floats(min_value=0.0, max_value=1e4),
            st.floats(min_value=0.0, max_value=2e4),
            st.integers(min_value=0, max_value=10_000),
        ),
        max_size=30,
    ),
    st.floats(min_value=0.0, max_value=2e4),
    st.randoms(use_true_random=False),
)
def test_demotion_order_is_a_deterministic_partition_by_expected_remaining(
    rows: list[tuple[float, float, int]], now: float, rnd: random.Random
) -> None:
    cands = [(f"s{i}", start, end, tokens) for i, (start, end, tokens) in enumerate(rows)]
    order = demotion_order(cands, now)
    assert sorted(order) == sorted(c[0] for c in cands)
    shuffled = list(cands)
    rnd.shuffle(shuffled)
    assert demotion_order(shuffled, now) == order  # input order does not matter
    by_id = {c[0]: c for c in cands}
    remaining = [by_id[s][2] - now for s in order]
    running = [r for r in remaining if r > 0]
    assert remaining[: len(running)] == running  # every still-running session precedes every overdue one
    assert running == sorted(running, reverse=True)
    assert remaining[len(running) :] == sorted(remaining[len(running) :])


def test_the_residual_median_grows_past_the_median_for_a_heavy_tail() -> None:
    m = DurationModel(CFG)
    med = m.median("t")
    assert m.residual_median("t", 0.0) == pytest.approx(med)
    prev = med
    for e in (0.5 * med, med, 3 * med, 30 * med):
        r = m.residual_median("t", e)
        assert r >= e and r >= prev, "never back before now; later the longer it has run"
        prev = r
    assert m.residual_median("t", 30 * med) - 30 * med > med, "far past its median: long to go"
    assert m.residual_median("t", 0.0, median=10.0) == pytest.approx(10.0), "the hint sets the median"
