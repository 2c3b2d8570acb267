"""``toolkv:sessions{state}`` by scraping: one sample for every phase of the lifecycle table, and
a count that falls to zero is exported as 0 (it used to stay at its last value for the phases a
hand-kept list missed: Kept, Prefetching, Released)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from _turns import finish_turn
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from toolkv.core.lifecycle import SESSION_STATES
from toolkv.sglang.config import ToolKVConfig
from toolkv.sglang.metrics import ToolKVMetrics
from toolkv.sglang.scheduler_side import SchedulerToolKV
from toolkv.testing.harness import CacheHarness, HarnessConfig

LABELS = {"model_name": "m", "tp_rank": "0"}


def scrape(registry: CollectorRegistry) -> dict[str, float]:
    """``toolkv:sessions`` by state, parsed from the exposition text a Prometheus server reads."""
    text = generate_latest(registry).decode()
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "toolkv:sessions":
                assert {k: v for k, v in s.labels.items() if k != "state"} == LABELS
                out[s.labels["state"]] = s.value
    return out


def test_every_state_is_exported_and_falls_back_to_zero() -> None:
    reg = CollectorRegistry()
    m = ToolKVMetrics(LABELS, registry=reg, refresh_s=0.0)
    m.refresh({"states": dict.fromkeys(SESSION_STATES, 3)})
    assert scrape(reg) == dict.fromkeys(SESSION_STATES, 3.0)
    m.refresh({"states": {}})  # kv_meta lists only the phases some session is in
    assert scrape(reg) == dict.fromkeys(SESSION_STATES, 0.0)
    m.refresh({"states": {"Kept": 1, "SomeFuturePhase": 2}})  # a phase the table does not know yet
    m.refresh({"states": {}})
    got = scrape(reg)
    assert got["Kept"] == 0 and got["SomeFuturePhase"] == 0 and set(SESSION_STATES) <= set(got)


@pytest.fixture
def tk() -> Iterator[tuple[SchedulerToolKV, CollectorRegistry, CacheHarness]]:
    with CacheHarness(HarnessConfig()) as h:
        reg = CollectorRegistry()
        metrics = ToolKVMetrics(LABELS, registry=reg, refresh_s=0.0)
        t = SchedulerToolKV(h.tree, config=ToolKVConfig(policy="auto"), metrics=metrics)
        h.tree._toolkv = t
        assert finish_turn(h, "a", list(range(1, 41)), [41, 42])
        yield t, reg, h


def test_a_kept_session_scrapes_as_kept_then_zero(tk: Any) -> None:
    """Through the scheduler side (the tick refreshes the gauges): a short tool call is Kept on
    the GPU; after its tool_end the Kept count scrapes as 0 again."""
    t, reg, _h = tk
    status, meta = t.handle("tool_start", {"session_id": "a", "tool": "calc", "expected_s": 0.0})
    assert status == 200 and meta["state"] == "Kept"
    t.tick()
    got = scrape(reg)
    assert got["Kept"] == 1 and set(got) >= set(SESSION_STATES)
    status, meta = t.handle("tool_end", {"session_id": "a", "epoch": meta["epoch"]})
    assert status == 200
    t.tick()
    got = scrape(reg)
    assert got["Kept"] == 0 and got[meta["state"]] == 1
    assert sum(got.values()) == 1 == t.manager.kv_meta()["sessions"]
