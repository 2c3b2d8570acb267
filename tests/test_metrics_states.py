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


def _families(registry: CollectorRegistry) -> dict[str, list[Any]]:
    text = generate_latest(registry).decode()
    return {fam.name: fam.samples for fam in text_string_to_metric_families(text)}


def test_every_series_exists_at_zero_from_the_start() -> None:
    """Before any refresh or decision: every family has its series, all at 0, so a dashboard shows
    0 instead of "no data" and ``increase()`` sees the first event of a server's life."""
    from toolkv.sglang.metrics import DECISION_SERIES, EVENTS, GAUGES, TOKEN_KINDS

    reg = CollectorRegistry()
    ToolKVMetrics(LABELS, registry=reg)
    fams = _families(reg)
    for name in ("toolkv:sessions", *(f"toolkv:{g}" for g in GAUGES), "toolkv:decisions", "toolkv:events",
                 "toolkv:tokens", "toolkv:offload_seconds", "toolkv:restore_seconds", "toolkv:offload_bytes",
                 "toolkv:restore_bytes"):  # fmt: skip
        assert fams.get(name), f"{name} has no series at start-up"
        values = [s.value for s in fams[name] if not s.name.endswith("_created")]
        assert values and all(v == 0 for v in values), (name, values)
    label = {s.labels.get("event") for s in fams["toolkv:events"]}
    assert set(EVENTS) <= label and {"lost", "expired", "l3_prefetch_short"} <= label
    assert {s.labels.get("kind") for s in fams["toolkv:tokens"]} >= set(TOKEN_KINDS)
    got = {(s.labels.get("op"), s.labels.get("outcome")) for s in fams["toolkv:decisions"]}
    assert set(DECISION_SERIES) <= got and ("tool_start", "host_memory_full") in got


def test_every_counter_the_code_names_is_created_at_start() -> None:
    """Each ``counters["name"]`` the manager and its backends count is exported from the start
    (``EVENTS`` or, for ``*_tokens``, ``TOKEN_KINDS``): a counter added later without a line there
    fails here rather than appearing only at its first increment."""
    import re
    from pathlib import Path

    import toolkv
    from toolkv.sglang.metrics import EVENTS, TOKEN_KINDS

    root = Path(toolkv.__file__).parent
    named = set()
    for path in [*root.glob("core/**/*.py"), *root.glob("sglang/*.py")]:
        named |= set(re.findall(r'counters\["([a-z0-9_]+)"\]', path.read_text()))
    assert named, "no counter found: the pattern no longer matches the code"
    missing = {
        n
        for n in named
        if (n[: -len("_tokens")] not in TOKEN_KINDS if n.endswith("_tokens") else n not in EVENTS)
    }
    assert not missing, f"add to toolkv.sglang.metrics.EVENTS / TOKEN_KINDS: {sorted(missing)}"
