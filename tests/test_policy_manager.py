"""The per-call policy in the manager, on the real HiRadixCache (CPU harness).

Spec actions ``Keep``, ``LetGo``, ``Demote`` and ``Prefetch`` (spec/ToolKV.tla) as the manager
runs them, and ``tool_start`` with ``policy="auto"`` choosing among them:

* keep: a short tool's KV stays on the GPU under one path lock; tool_end returns the lock;
* let go: a KV too small to be worth two transfers is not held at all; tool_end just resumes;
* offload + early restore: a long tool's KV goes to host, and the tick loads it back before the
  tool is expected to return, so tool_end finds it resident (bytes equal to the offloaded ones);
* demotion: when the host budget is reached, the least valuable offloaded session is demoted
  (its protection released) instead of a 507;
* the TTL bounds a kept or prefetched session's pin; a stale epoch changes nothing;
* the duration model learns per tool name from accepted tool_ends.

Every test ends with the tree's accounting back at its initial value: every lock, host
reference and slot taken is returned.
"""

from __future__ import annotations

from collections.abc import Iterator

import _cycle
import pytest
import torch
from _cycle import step

from toolkv.core.manager import ManagerConfig, ToolKVManager
from toolkv.core.policy import PolicyConfig
from toolkv.core.treeops import path_to
from toolkv.errors import BadRequest, HostMemoryFull, StaleEpoch, WrongState
from toolkv.testing.harness import CacheHarness, HarnessConfig


@pytest.fixture
def h() -> Iterator[CacheHarness]:
    with CacheHarness(HarnessConfig(device_tokens=2048)) as harness:
        yield harness


def auto(h: CacheHarness, **kw: object) -> ToolKVManager:
    policy = kw.pop("policy_config", PolicyConfig(min_offload_tokens=64))
    return ToolKVManager(h.tree, config=ManagerConfig(policy="auto", policy_config=policy, **kw))  # type: ignore[arg-type]


def turn(h: CacheHarness, m: ToolKVManager, sid: str, tokens: list[int]) -> torch.Tensor:
    """A turn of ``sid`` finishes; HiCache's own write-through of it is acknowledged."""
    return _cycle.turn(h, m, sid, tokens, ack_writes=True)


def locks_on(h: CacheHarness, tokens: list[int]) -> list[int]:
    node = h.match(tokens).last_device_node
    return [n.lock_ref for n in path_to(h.tree, node)]


def test_a_short_tool_is_kept_on_the_gpu_under_one_lock(h: CacheHarness) -> None:
    initial = h.accounting()
    m = auto(h)
    a = list(range(1, 201))
    kv = turn(h, m, "a", a)
    free = h.allocator.available_size()
    r = m.tool_start("a", tool="grep", expected_s=0.2)
    assert (r["state"], r["decision"], r["reason"], r["tool"]) == ("Kept", "keep", "short_tool_hint", "grep")
    assert r["epoch"] == 1 and r["protected"] is False and r["deadline"] == 30.0, "a GPU pin: the keep TTL"
    assert locks_on(h, a) == [1], "kept: one path lock, nothing copied"
    assert h.allocator.available_size() == free and h.tree.ongoing_write_through == {}
    assert h.evict_device(10_000) == 0 or h.match(a).device_indices.numel() == 200, (
        "a pinned path is not evicted"
    )
    with pytest.raises(StaleEpoch):
        m.tool_end("a", 0)
    assert m.kv_meta("a")["state"] == "Kept" and locks_on(h, a) == [1]
    m.set_clock(0.2)
    assert m.tool_end("a", 1)["state"] == "Handover"
    assert locks_on(h, a) == [1], "still pinned: the next request has not been admitted yet"
    assert m.admit("a") and m.kv_meta("a")["state"] == "Runnable"
    assert locks_on(h, a) == [0]
    assert torch.equal(h.device_kv(h.match(a).device_indices), kv)
    assert m.durations.count("grep") == 1 and m.counters["decision_keep"] == 1
    m.close("a")
    h.drain()
    assert h.accounting() == initial


def test_a_small_kv_is_let_go_and_tool_end_just_resumes(h: CacheHarness) -> None:
    initial = h.accounting()
    # the host budget cannot take it (a session the host can take is never let go)
    m = auto(h, policy_config=PolicyConfig(min_offload_tokens=256, keep_max_s=0.5), host_budget_tokens=50)
    a = list(range(1, 101))  # 100 tokens: below min_offload_tokens
    turn(h, m, "a", a)
    held = h.accounting()
    r = m.tool_start("a", expected_s=30.0)  # long: not kept either
    assert (r["state"], r["decision"], r["reason"]) == ("Released", "let_go", "small_kv_hint")
    assert h.accounting() == held, "let go: nothing taken"
    assert m.tool_end("a", 1)["state"] == "Running"
    turn(h, m, "a", [*a, 7, 8, 9])  # the next turn records as usual
    assert m.kv_meta("a")["state"] == "Running"
    m.close("a")
    h.drain()
    assert h.accounting() == initial


def test_a_long_tool_is_offloaded_and_restored_early(h: CacheHarness) -> None:
    initial = h.accounting()
    m = auto(h, adaptive=False, lazy_free=False, restore_tokens_per_s=1000.0)  # 300 tokens restore in 0.3 s
    a = list(range(1, 301))
    kv = turn(h, m, "a", a)
    r = m.tool_start("a", tool="build", expected_s=10.0)
    assert (r["decision"], r["reason"]) == ("offload", "long_tool_hint")
    step(h, m, 0.0, writes=True)
    assert m.kv_meta("a")["state"] == "Offloaded" and m.kv_meta("a")["device_tokens"] == 0
    due = m.sessions["a"].prefetch_at
    assert due == pytest.approx(10.0 - 0.3 - 0.05), "start the load so that it ends as the tool returns"
    step(h, m, due - 0.01)
    assert m.kv_meta("a")["state"] == "Offloaded", "not before it is due"
    h.scribble_unreferenced()
    m.tick(due)
    meta = m.kv_meta("a")
    assert meta["state"] == "Prefetching" and meta["protected"] is True
    step(h, m, due, loads=True)
    meta = m.kv_meta("a")
    assert meta["state"] == "Kept" and meta["protected"] is False and meta["device_tokens"] == 300
    assert locks_on(h, a)[-1] == 1, "kept after the early restore: pinned until tool_end"
    m.set_clock(10.0)
    assert m.tool_end("a", 1)["state"] == "Handover"
    assert torch.equal(h.device_kv(h.match(a).device_indices), kv), "restored bytes equal the offloaded ones"
    assert m.counters["prefetched"] == 1
    m.close("a")
    h.drain()
    assert h.accounting() == initial


def test_tool_end_during_an_early_restore_takes_it_over(h: CacheHarness) -> None:
    initial = h.accounting()
    m = auto(h, adaptive=False, lazy_free=False, restore_tokens_per_s=1000.0)
    a = list(range(1, 301))
    kv = turn(h, m, "a", a)
    m.tool_start("a", expected_s=10.0)
    step(h, m, 0.0, writes=True)
    m.tick(9.7)
    assert m.kv_meta("a")["state"] == "Prefetching"
    assert m.tool_end("a", 1)["state"] == "Restoring", "the load in flight becomes the restore"
    step(h, m, 9.8)
    assert m.kv_meta("a")["state"] == "Restoring", "never runnable before the load ack"
    step(h, m, 9.9, loads=True)
    assert m.kv_meta("a")["state"] == "Handover"
    assert torch.equal(h.device_kv(h.match(a).device_indices), kv)
    m.close("a")
    h.drain()
    assert h.accounting() == initial


def test_a_gpu_pin_waits_at_most_the_keep_ttl(h: CacheHarness) -> None:
    """A client that crashed mid-call must not pin the GPU for the whole TTL: the policy's pins
    (kept, or restored early) expire after keep_ttl_s; the KV stays in the cache, unpinned."""
    initial = h.accounting()
    m = auto(h, adaptive=False, lazy_free=False, ttl_s=600.0, keep_ttl_s=20.0, restore_tokens_per_s=1000.0)
    a, b = list(range(1, 301)), list(range(1000, 1300))
    turn(h, m, "a", a)
    turn(h, m, "b", b)
    assert m.tool_start("a", expected_s=0.1)["deadline"] == 20.0
    m.tool_start("b", expected_s=10.0)
    step(h, m, 0.0, writes=True)
    m.tick(9.7)
    step(h, m, 9.8, loads=True)
    meta = m.kv_meta("b")
    assert meta["state"] == "Kept" and meta["deadline"] == pytest.approx(29.8), "re-armed at the load ack"
    m.tick(20.0)
    assert m.kv_meta("a")["state"] == "Expired" and locks_on(h, a) == [0]
    assert m.kv_meta("b")["state"] == "Kept"
    m.tick(29.8)
    assert m.kv_meta("b")["state"] == "Expired" and locks_on(h, b) == [0]
    assert h.match(b).device_indices.numel() == 300, "the KV stays in the cache, unpinned"
    m.close("a")
    m.close("b")
    h.drain()
    assert h.accounting() == initial


def test_every_gpu_pin_waiting_for_its_tool_end_is_due_within_the_keep_ttl(h: CacheHarness) -> None:
    """Spec ``KeepTTL`` (invariant ``KeptWithinKeepTTL``), whoever took the pin and under either
    policy: a client's explicit keep (kv_hints' retain), an early restore that needed no load, and
    one whose load was acknowledged. Before, the first two kept the full TTL of a host protection
    and the third was re-armed only under ``policy="auto"``."""
    initial = h.accounting()
    m = ToolKVManager(h.tree, config=ManagerConfig.eager(ttl_s=600.0, keep_ttl_s=20.0))
    a, b, c = list(range(1, 201)), list(range(1000, 1200)), list(range(3000, 3200))
    for sid, toks in (("a", a), ("b", b), ("c", c)):
        turn(h, m, sid, toks)
    m.tick(1.0)
    assert m.keep("a")["deadline"] == 21.0, "an explicit keep: the keep TTL"
    held = h.match(b).last_device_node  # another request holds b's prefix: its GPU copy stays
    h.tree.inc_lock_ref(held)
    m.tool_start("b")
    step(h, m, 1.0, writes=True)
    assert m.kv_meta("b")["state"] == "Offloaded" and m.kv_meta("b")["deadline"] == 601.0
    m.tick(2.0)
    meta = m.prefetch("b")
    assert meta["state"] == "Kept" and meta["deadline"] == 22.0, "an early restore with nothing to load"
    h.tree.dec_lock_ref(held)
    m.tool_start("c")
    step(h, m, 2.0, writes=True)
    assert m.prefetch("c")["state"] == "Prefetching"
    step(h, m, 3.0, loads=True)
    meta = m.kv_meta("c")
    assert meta["state"] == "Kept" and meta["deadline"] == 23.0, "re-armed at the load ack (policy offload)"
    m.tick(23.0)
    assert [m.kv_meta(x)["state"] for x in "abc"] == ["Expired"] * 3
    assert locks_on(h, a) == [0] and locks_on(h, b) == [0] and locks_on(h, c) == [0]
    for x in "abc":
        m.close(x)
    h.drain()
    assert h.accounting() == initial


def test_the_ttl_bounds_a_kept_and_a_prefetching_session(h: CacheHarness) -> None:
    initial = h.accounting()
    m = auto(h, adaptive=False, lazy_free=False, ttl_s=5.0, restore_tokens_per_s=1000.0)
    a, b = list(range(1, 301)), list(range(1000, 1300))
    turn(h, m, "a", a)
    turn(h, m, "b", b)
    assert m.tool_start("a", expected_s=0.1)["state"] == "Kept"
    m.tool_start("b", expected_s=4.0)
    step(h, m, 0.0, writes=True)
    m.tick(3.7)  # b's early restore starts
    assert m.kv_meta("b")["state"] == "Prefetching"
    m.tick(5.0)  # neither tool_end came
    assert m.kv_meta("a")["state"] == "Expired" and m.kv_meta("b")["state"] == "Expired"
    assert locks_on(h, a) == [0], "the kept session's pin is returned"
    with pytest.raises(StaleEpoch):
        m.tool_end("a", 0)
    step(h, m, 5.1, loads=True)  # b's load still finishes: sglang holds its own lock until then
    assert m.kv_meta("b")["state"] == "Expired"
    m.close("a")
    m.close("b")
    h.drain()
    assert h.accounting() == initial


def test_the_host_budget_demotes_the_least_valuable_instead_of_507(h: CacheHarness) -> None:
    initial = h.accounting()
    m = auto(h, host_budget_tokens=450, prefetch=False)
    a, b = list(range(1, 301)), list(range(1000, 1300))
    turn(h, m, "a", a)
    turn(h, m, "b", b)
    m.tool_start("a", expected_s=600.0)  # a: expected back in 10 minutes
    step(h, m, 0.0, writes=True)
    m.set_clock(1.0)
    m.queued_demand = lambda: 10**6  # queued requests need the device room b holds
    r = m.tool_start("b", expected_s=30.0)  # 300 + 300 > 450: a must go
    m.queued_demand = lambda: 0
    assert r["decision"] == "offload" and r["state"] in ("Offloading", "Offloaded")
    assert m.kv_meta("a")["state"] == "Released" and m.kv_meta("a")["protected"] is False
    assert m.counters["demoted"] == 1
    assert m.backend.protected_tokens == 300  # type: ignore[attr-defined]
    assert m.tool_end("a", 1)["state"] == "Running", "a demoted session resumes; missing KV is recomputed"
    step(h, m, 1.0, writes=True)
    m.close("a")
    m.close("b")
    h.drain()
    assert h.accounting() == initial


@pytest.mark.parametrize("policy", ["auto", "offload"])
def test_a_full_host_demotes_nobody_while_the_device_has_room(h: CacheHarness, policy: str) -> None:
    """A demotion drops a host copy whose GPU copy is gone; it pays only when the device needs the
    room the new call's KV holds. With room to spare (nothing queued), b is not offloaded (auto
    lets it go, offload answers host-full and changes nothing): its KV stays in sglang's cache as
    without toolkv, and a keeps its protected copy."""
    initial = h.accounting()
    m = ToolKVManager(h.tree, config=ManagerConfig(policy=policy, policy_config=PolicyConfig(min_offload_tokens=64),
                                                  host_budget_tokens=450, prefetch=False))  # fmt: skip
    a, b = list(range(1, 301)), list(range(1000, 1300))
    turn(h, m, "a", a)
    turn(h, m, "b", b)
    m.tool_start("a", expected_s=600.0)
    step(h, m, 0.0, writes=True)
    m.set_clock(1.0)
    if policy == "offload":
        with pytest.raises(HostMemoryFull):
            m.tool_start("b", expected_s=30.0)
        assert m.kv_meta("b")["state"] == "Running"
    else:
        assert m.tool_start("b", expected_s=30.0)["decision"] == "let_go"
    assert m.kv_meta("a")["state"] == "Offloaded" and m.kv_meta("a")["protected"] is True
    assert m.counters["demoted"] == 0
    assert h.match(b).last_device_node is not h.tree.root_node, "b's KV is still on the GPU"
    m.close("a")
    m.close("b")
    h.drain()
    assert h.accounting() == initial


def test_the_duration_model_learns_per_tool_and_changes_the_decision(h: CacheHarness) -> None:
    m = auto(h, prefetch=False)
    a = list(range(1, 301))
    turn(h, m, "a", a)
    now = 0.0
    for _ in range(6):  # "build" takes two minutes every time
        r = m.tool_start("a", tool="build")
        step(h, m, now, writes=True)
        now += 120.0
        m.set_clock(now)
        m.tool_end("a", int(r["epoch"]))  # type: ignore[call-overload]
        step(h, m, now, loads=True)
        turn(h, m, "a", a)
    assert m.durations.median("build") > 30.0
    assert m.tool_start("a", tool="build")["decision"] == "offload"
    step(h, m, now, writes=True)
    m.set_clock(now + 120.0)
    m.tool_end("a", m.sessions["a"].epoch)
    step(h, m, now + 120.0, loads=True)
    turn(h, m, "a", a)
    assert m.tool_start("a", tool="ls")["decision"] == "keep", "an unseen tool gets the prior: short"
    assert m.kv_meta()["tools"]["build"]["n"] == 7


@pytest.mark.parametrize(
    "kw",
    [
        {"tool": ""},
        {"tool": "x" * 300},
        {"tool": 5},
        {"expected_s": -1.0},
        {"expected_s": float("nan")},
        {"expected_s": True},
    ],
)
def test_bad_hints_are_refused_and_change_nothing(h: CacheHarness, kw: dict[str, object]) -> None:
    m = auto(h)
    turn(h, m, "a", list(range(1, 301)))
    before = (h.accounting(), m.kv_meta("a"))
    with pytest.raises(BadRequest):
        m.tool_start("a", **kw)  # type: ignore[arg-type]
    assert (h.accounting(), m.kv_meta("a")) == before


def test_policy_actions_refuse_the_wrong_state(h: CacheHarness) -> None:
    m = auto(h)
    turn(h, m, "a", list(range(1, 301)))
    for op in (m.demote, m.prefetch):
        with pytest.raises(WrongState):
            op("a")
    m.keep("a")
    for op2 in (m.keep, m.let_go, m.demote, m.prefetch):
        with pytest.raises(WrongState):
            op2("a")
    assert m.kv_meta("a")["state"] == "Kept"
    m.close("a")


def test_a_reset_with_copies_in_flight_closes_the_session_instead_of_crashing(
    h: CacheHarness, caplog: pytest.LogCaptureFixture
) -> None:
    """sglang flushes only an idle scheduler, so the spec has no such reset; should one happen
    anyway, the manager must not take the scheduler down."""
    m = auto(h)
    turn(h, m, "b", list(range(1000, 1300)))
    a = list(range(1, 301))
    assert h.run_request(a)  # its write-through is still in flight
    m.insert("a", a)
    m.tool_start("a", expected_s=60.0)
    m.tool_start("b", expected_s=0.1)
    assert m.kv_meta("a")["state"] == "Offloading" and m.kv_meta("b")["state"] == "Kept"
    h.tree.reset()
    h.allocator.clear()
    with caplog.at_level("ERROR", logger="toolkv"):
        m.tree_reset()
    assert m.kv_meta("a")["state"] == "Closed" and "tree reset while session a was Offloading" in caplog.text
    assert m.kv_meta("b")["state"] == "Lost" and m.counters["reset_mid_copy"] == 1
