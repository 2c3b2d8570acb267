"""The agent benchmark's generator and metric code on CPU: the workload is a function of its seed
and matches its calibration, the metrics count what they claim, and the load generator driven
against toolkv's real scheduler side over the real HiRadixCache serves every resumed turn from
cache and leaves nothing protected. No timing is asserted: the GPU run is the measurement."""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from pathlib import Path

import pytest
from agent_stand_in import StandInServer

from toolkv.sglang.config import ToolKVConfig
from toolkv.testing.harness import HarnessConfig
from toolkv.tools.agent_bench import main as bench_main
from toolkv.tools.agent_bench import parser, run_plan
from toolkv.workload.metrics import Turn, occupancy, pct, summarize
from toolkv.workload.plan import ToolMixture, Workload, make_plan
from toolkv.workload.report import suite_markdown

DOCS = Path(__file__).resolve().parents[1] / "docs"
SMALL = Workload(
    initial_sessions=5, first_tokens=160, growth_per_turn=64, output_tokens=8, max_context=900,
    turns_median=4, duration_s=60, ramp_s=8, seed=3,
)  # fmt: skip


def test_the_plan_is_a_function_of_the_workload_and_its_seed() -> None:
    a, b = make_plan(SMALL), make_plan(SMALL)
    assert a.describe() == b.describe()
    assert [s.first for s in a.sessions] == [s.first for s in b.sessions]
    other = make_plan(Workload(**{**SMALL.__dict__, "seed": 4}))
    assert [s.first for s in other.sessions] != [s.first for s in a.sessions]
    for s in a.sessions:  # every session fits its context and has a tool call between turns
        assert len(s.tools_s) == len(s.results) == s.turns - 1
        assert len(s.first) + sum(map(len, s.results)) + s.turns * SMALL.output_tokens <= SMALL.max_context
    starts = [s.start_s for s in a.sessions]
    assert all(0 <= t < SMALL.ramp_s for t in starts[: SMALL.initial_sessions])
    assert all(SMALL.ramp_s <= t < SMALL.duration_s for t in starts[SMALL.initial_sessions :])


def test_the_tool_mixture_matches_its_calibration() -> None:
    m = ToolMixture()
    rng = random.Random(0)
    xs = [m.sample(rng) for _ in range(200_000)]
    assert pct(xs, 50) == pytest.approx(m.short_median_s, rel=0.05)  # the body sets the median
    long_time = sum(x for x in xs if x >= m.long_min_s) / sum(xs)
    assert long_time == pytest.approx(m.long_time_share, abs=0.06)  # half of tool time in 1-10 min calls
    assert ToolMixture(long_time_share=1.0).long_weight == 1.0
    assert ToolMixture(long_time_share=0.0).long_weight == 0.0
    with pytest.raises(ValueError):
        ToolMixture(long_time_share=1.5)
    with pytest.raises(ValueError):
        Workload(tool_shape="nope")


def _turn(sid: str, n: int, start: float, e2e: float, ttft: float, cached: int, status: int = 200) -> Turn:
    return Turn(sid, n, start, 100, cached, 10, ttft, e2e, status)


def test_the_summary_counts_the_window_as_documented() -> None:
    turns = [
        _turn("a", 0, 0.0, 4.0, 1.0, 0),  # ends before the window: not counted
        _turn("a", 1, 6.0, 5.0, 2.0, 90),  # starts in the window: latency; ends in it: throughput
        _turn("b", 1, 12.0, 20.0, 4.0, 0),  # starts in the window, ends after it
        _turn("c", 2, 25.0, 1.0, math.nan, 0, status=503),  # failed: neither
    ]
    calls = {"tool_start 200": 2, "tool_end 503": 1, "tool_end 500": 1}
    s = summarize(turns, calls, window_start_s=5.0, window_end_s=25.0, wall_s=30.0)
    assert s["turns_in_window"] == 1 and s["turns_per_s"] == pytest.approx(1 / 20)
    assert s["gen_tokens_per_s"] == pytest.approx(10 / 20)
    assert s["resumed_turns"] == 2 and s["resumed_cache_hit"] == pytest.approx(90 / 200)
    assert s["resumed_computed_tokens"] == 110 and s["resumed_zero_cached"] == 1
    assert s["resumed_ttft_p50_s"] == 2.0 and s["resumed_ttft_p90_s"] == 4.0
    assert s["http_5xx"] == 2  # the undocumented tool_end 500 and the failed generate
    with pytest.raises(ValueError):
        summarize(turns, calls, window_start_s=5.0, window_end_s=5.0, wall_s=1.0)
    occ = occupancy([{"device_used": 10, "host_used": None}, {"device_used": 30}], device_total=40)
    assert occ["device_used"] == {"mean": 20.0, "max": 30.0} and occ["host_used"] is None
    assert occ["device_used_share_mean"] == 0.5


@pytest.fixture
def server() -> Iterator[StandInServer]:
    s = StandInServer(HarnessConfig(device_tokens=8192, host_ratio=3.0, context_len=2048))
    yield s
    s.close()


@pytest.mark.parametrize("mode", ["stock", "explicit", "on-request"])
def test_the_load_generator_against_the_real_cache(server: StandInServer, mode: str) -> None:
    plan = make_plan(SMALL)
    rec, wall = run_plan(server, plan, mode, scale=0.02, progress_s=1e9, sample_s=0.01, device_total=8192)
    assert not rec.errors
    assert rec.turns and all(t.status == 200 for t in rec.turns)
    by_session = {s.sid: s for s in plan.sessions}
    for t in rec.turns:
        if t.turn > 0:  # the previous context is served from cache, except the tool result and the
            # previous answer's last token (sampled, never run through the model: it has no KV)
            assert t.cached_tokens == t.prompt_tokens - len(by_session[t.session].results[t.turn - 1]) - 1
    tool_calls = sum(1 for t in rec.turns if t.turn > 0)
    if mode == "stock":
        assert not rec.calls  # no toolkv call, no session id: toolkv tracks nothing
        assert server.tk.manager.sessions == {}
    else:
        assert rec.calls["tool_start 200"] >= tool_calls
        if mode == "explicit":
            assert rec.calls["tool_end 200"] == tool_calls
        assert max(s.get("protected") or 0 for s in rec.samples) > 0
        assert rec.calls["close 200"] == len({t.session for t in rec.turns})
    _, meta = server.kv_meta()
    assert meta["protected_tokens"] == 0 and meta["device_locked_tokens"] == 0
    s = summarize(rec.turns, rec.calls, window_start_s=0.0, window_end_s=SMALL.duration_s * 0.02, wall_s=wall)
    assert s["turns_ok"] == len(rec.turns) and s["http_5xx"] == 0


def test_the_per_call_policy_under_agent_load() -> None:
    """TOOLKV_POLICY=auto behind the stand-in: tool names sent, every decision taken, nothing left held."""
    s = StandInServer(
        HarnessConfig(device_tokens=8192, host_ratio=3.0, context_len=2048),
        ToolKVConfig(enable=True, policy="auto"),
    )
    try:
        plan = make_plan(SMALL)
        rec, _ = run_plan(
            s, plan, "explicit", scale=0.02, progress_s=1e9, sample_s=0.01, device_total=8192, send_tool=True
        )
        assert not rec.errors and rec.turns and all(t.status == 200 for t in rec.turns)
        decided = dict(rec.decisions)
        tool_calls = sum(1 for t in rec.turns if t.turn > 0)
        assert sum(decided.values()) >= tool_calls and set(decided) <= {"keep", "offload", "let_go"}
        _, meta = s.kv_meta()
        assert meta["protected_tokens"] == 0 and meta["device_locked_tokens"] == 0
        assert set(meta["tools"]) <= {"read", "build"} and meta["tools"], "the model learned per tool name"
    finally:
        s.close()


@pytest.mark.parametrize("policy", [None, "offload", "auto"])
def test_policy_goes_in_every_tool_start_body_and_nowhere_else(
    server: StandInServer, policy: str | None
) -> None:
    """--policy: every tool_start body asks for the per-call policy (one server serves offload and
    auto agents); without it no body has the field. --send-tool still names the tool beside it."""
    plan = make_plan(SMALL)
    rec, _ = run_plan(
        server, plan, "explicit", scale=0.02, progress_s=1e9, sample_s=0.01, device_total=8192,
        send_tool=policy == "auto", policy=policy,
    )  # fmt: skip
    assert not rec.errors and rec.turns and all(t.status == 200 for t in rec.turns)
    starts = [b for op, b in server.bodies if op == "tool_start"]
    assert len(starts) == rec.calls["tool_start 200"] >= sum(1 for t in rec.turns if t.turn > 0) > 0
    if policy is None:
        assert all("policy" not in b for b in starts)
    else:
        assert all(b["policy"] == policy for b in starts)
    assert all(("tool" in b) == (policy == "auto") for b in starts)
    others = [b for op, b in server.bodies if op != "tool_start"]
    assert others and all("policy" not in b for b in others)  # tool_end, close: no policy field


def test_the_policy_option_takes_offload_or_auto_and_needs_tool_start(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert parser().parse_args(["--out", "x.json"]).policy is None
    assert parser().parse_args(["--out", "x.json", "--policy", "auto", "--send-tool"]).policy == "auto"
    for bad in (["--policy", "keep"], ["--mode", "stock", "--policy", "offload"]):
        with pytest.raises(SystemExit) as e:  # refused before any server is asked
            bench_main(["--out", "x.json", "--url", "http://127.0.0.1:9", *bad])
        assert e.value.code == 2
    assert "--policy" in capsys.readouterr().err
    with pytest.raises(ValueError):
        run_plan(StandInServer.__new__(StandInServer), make_plan(SMALL), "explicit", policy="keep")


@pytest.mark.parametrize("folder", ["agent", "agent_replicate"])
def test_the_benchmark_tables_in_docs_are_generated_from_the_results(folder: str) -> None:
    assert suite_markdown(DOCS / "results" / folder) in (DOCS / "benchmarks.md").read_text()
