"""toolkv on sglang 0.5.23's default Rust tree core, with the Python core as the oracle.

The Rust ``TreeCore`` exposes node handles only (``toolkv.core.backends.unified_rust``). The same
seeded run of tool calls — turns, ``tool_start``, write and load acknowledgements, sglang's own
device and host eviction, ``tool_end``, ``close`` — goes to the plugin's default manager over a
real ``UnifiedRadixCache`` on each core, and must give the same observations on both: every
answer (state, epoch, tokens on device and on host, or the typed error), the same restored bytes
(checked against the KV each turn wrote), and at the end every lock, host reference and slot
returned (the device pool all free or evictable, nothing protected, the host pool all freeable).
The Rust backend's seeded defects — a host lock never returned, a recorded node id used without
checking it still names the node — must be caught by the same run.

Runs in the 0.5.23 environment (``make test-0523``); skips where an older sglang is installed.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field
from typing import Any

import pytest

from toolkv.testing.unified_harness import has_unified_radix_cache, sglang_version

if not has_unified_radix_cache():
    pytest.skip(
        f"needs sglang >= 0.5.21 (UnifiedRadixCache), found {sglang_version()}", allow_module_level=True
    )

import torch

from toolkv.core.backends.base import LocalAgreement
from toolkv.core.backends.unified_rust import RustUnifiedBackend
from toolkv.errors import ToolKVError
from toolkv.sglang.config import ToolKVConfig
from toolkv.testing.unified_harness import UnifiedCacheHarness, UnifiedHarnessConfig
from toolkv.verify.toolkv.mutants import mutant_manager

SESSIONS = ("s0", "s1", "s2")
SHARED = list(range(1, 17))  # a system prompt every session starts with (a shared prefix node)


@dataclass
class Run:
    """One core's stack and what the driver observed."""

    h: UnifiedCacheHarness
    mgr: Any
    seen: list[tuple[Any, ...]] = field(default_factory=list)
    bytes_checked: int = 0
    queued: int = 0  # device tokens the waiting requests need (load-adaptive protection reads it)


def _open(
    core: str,
    write_policy: str,
    caveats: frozenset[str] = frozenset(),
    policy: str = "offload",
    host_ratio: float = 1.5,
) -> Run:
    cfg = UnifiedHarnessConfig(
        tree_core=core, device_tokens=320, host_ratio=host_ratio, write_policy=write_policy
    )
    h = UnifiedCacheHarness(cfg)
    # the plugin's defaults (lazy free, load-adaptive protection), with the server's call policy;
    # without host room from mirrors, which the Rust core does not offer (tests/test_unmirror_0523.py):
    # the Python core's answers are the oracle for what the Rust core offers
    mcfg = dataclasses.replace(ToolKVConfig(policy=policy).manager_config(), unmirror=False)
    mgr = mutant_manager(h.tree, caveats=caveats, config=mcfg, agree=LocalAgreement())
    run = Run(h, mgr)
    mgr.queued_demand = lambda: run.queued  # the requests waiting for admission (the scheduler's count)
    return run


def _turn(r: Run, sid: str, tokens: list[int]) -> None:
    """A finished turn: its KV written into the device pool and inserted, as sglang does. A
    handed-over or parked session's request is admitted first (the plugin's hook after the
    prefill batch forms); a session toolkv still holds for its tool call has no turn now."""
    rec = r.mgr.sessions.get(sid)
    if rec is not None and rec.state in ("Handover", "Parked"):
        r.mgr.admit(sid)
    elif rec is not None and rec.state not in (
        "Running",
        "Runnable",
        "Released",
        "Expired",
        "Lost",
        "Closed",
    ):
        r.seen.append(("turn", sid, "held", rec.state))
        return
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams

    from toolkv.testing.unified_harness import rkey

    h = r.h
    m = h.match(tokens)
    have = int(m.device_prefix_len)
    prefix = h.tree.path_device_indices(m.last_device_node)[:have]
    lock = h.tree.lock(m.last_device_node)  # the request holds its prefix while it allocates
    try:
        fresh = tokens[have:]
        idx = h.allocator.alloc(len(fresh)) if fresh else prefix[:0]
        if idx is None:  # sglang evicts for the allocation
            h.tree.evict(EvictParams(num_tokens=len(fresh)))
            idx = h.allocator.alloc(len(fresh))
        if idx is None:
            r.seen.append(("turn", sid, "no_room"))
            return
        if fresh:
            h.fill_kv(idx, fresh)
        # the matched prefix is the tree's own (prev_prefix_len): the insert frees duplicates after it
        value = torch.cat([prefix.to(idx.dtype), idx])
        h.tree.insert(InsertParams(key=rkey(tokens, None), value=value, prev_prefix_len=have))
    finally:
        h.tree.unlock(lock)
    r.mgr.insert(sid, tokens, None)
    r.seen.append(("turn", sid, r.mgr.kv_meta(sid)["tokens"]))


def _observe(r: Run, op: str, sid: str, fn: Any) -> None:
    try:
        out = fn()
        meta = r.mgr.kv_meta(sid)
        r.seen.append((op, sid, out.get("state") if isinstance(out, dict) else out, meta["state"], meta["epoch"],
                       meta["device_tokens"], meta["host_tokens"]))  # fmt: skip
    except ToolKVError as e:
        r.seen.append((op, sid, "error", e.code))


def _check_restored_bytes(r: Run, sid: str, tokens: list[int]) -> None:
    """A session whose KV is back on the GPU holds exactly the bytes its turns wrote."""
    rec = r.mgr.sessions.get(sid)
    if rec is None or rec.state not in ("Handover", "Runnable") or not tokens:
        return
    m = r.h.match(tokens)
    n = int(m.device_prefix_len)
    if n == 0:
        return
    got = r.h.device_kv(r.h.tree.path_device_indices(m.last_device_node)[:n]).float()
    assert torch.equal(got, r.h.expected_kv(tokens[:n])), f"{sid}: restored bytes differ"
    r.bytes_checked += n


def _drive(r: Run, seed: int, steps: int = 45) -> None:
    rng = random.Random(seed)
    ctx: dict[str, list[int]] = {s: list(SHARED) for s in SESSIONS}
    epoch: dict[str, int] = {s: 0 for s in SESSIONS}
    fresh = 100 + seed * 10_000
    now = 0.0
    for _ in range(steps):
        sid = rng.choice(SESSIONS)
        rec = r.mgr.sessions.get(sid)
        state = rec.state if rec is not None else None
        # an agent's next step by its session's state, or one of the environment's
        if rng.random() < 0.4:
            op = rng.choice(["ack", "ack", "ack", "evict", "host_evict", "queue", "admit", "close", "stale"])
        elif state in (None, "Closed", "Expired", "Lost", "Runnable", "Handover", "Parked"):
            op = "turn"
        elif state == "Running":
            op = rng.choice(["tool_start", "tool_start", "turn"])
        else:  # the tool call is away: its end (a late duplicate now and then)
            op = rng.choice(["tool_end", "tool_end", "tool_end", "stale"])
        if op == "turn":
            n = rng.choice([8, 16, 24])
            ctx[sid] = ctx[sid] + list(range(fresh, fresh + n))
            fresh += n
            _turn(r, sid, ctx[sid])
        elif op == "tool_start":
            tool = rng.choice(["run_code", "web_search", "wait_for_ci"])  # the auto policy decides by name
            _observe(r, op, sid, lambda s=sid, t=tool: r.mgr.tool_start(s, tool=t))
            rec = r.mgr.sessions.get(sid)
            epoch[sid] = rec.epoch if rec is not None else 0
        elif op == "tool_end":
            _observe(r, op, sid, lambda s=sid: r.mgr.tool_end(s, epoch[s]))
        elif op == "stale":
            _observe(r, op, sid, lambda s=sid: r.mgr.tool_end(s, epoch[s] + 3))
        elif op == "ack":  # the copy engine finishes; the scheduler's checks and toolkv's tick
            r.h.check_events()
            r.h.complete("write")
            r.h.tree.ready_to_load_host_cache() if r.h.tree.cache_controller.load_queue else None
            r.h.complete("load")
            r.h.check_events()
            now += 1.0
            r.mgr.tick(now)
            r.seen.append(("ack", tuple(sorted((s, x.state) for s, x in r.mgr.sessions.items()))))
        elif op == "evict":
            from sglang.srt.mem_cache.base_prefix_cache import EvictParams

            r.h.tree.evict(EvictParams(num_tokens=rng.choice([16, 64, 320])))
            r.seen.append(("evict", int(r.h.allocator.available_size())))
        elif op == "host_evict":
            r.h.tree.evict_host(rng.choice([16, 64, 480]))
            r.seen.append(("host_evict",))
        elif op == "admit":  # the session's next request was admitted (the plugin's prefill hook)
            r.seen.append(("admit", sid, r.mgr.admit(sid)))
        elif op == "queue":  # requests queue up (or leave): hand-overs give up their pins for them
            r.queued = rng.choice([0, 0, 400])
            r.seen.append(("queue", r.queued))
        elif op == "close":
            if sid in r.mgr.sessions:
                r.mgr.close(sid)
                ctx[sid] = list(SHARED)
            r.seen.append(("close", sid))
        _check_restored_bytes(r, sid, ctx[sid])


def _teardown_returns_everything(r: Run) -> None:
    """Every lock, host reference and slot taken is returned once the sessions are closed."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    h, tree = r.h, r.h.tree
    for sid in list(r.mgr.sessions):
        r.mgr.close(sid)
    for _ in range(3):
        h.check_events()
        h.complete("write")
        if tree.cache_controller.load_queue:
            tree.ready_to_load_host_cache()
        h.complete("load")
        h.check_events()
    r.mgr.tick(10_000.0)
    assert tree.protected_size() == 0, "device locks left behind"
    assert int(getattr(r.mgr.backend, "protected_tokens", 0)) == 0, "host protections left in the ledger"
    tree.evict(EvictParams(num_tokens=h.cfg.device_tokens))
    assert int(h.allocator.available_size()) == h.cfg.device_tokens, "device slots not returned"
    tree.evict_host(10**6)
    pool = tree.cache_controller.mem_pool_host
    assert int(pool.available_size()) == int(pool.size), "host slots held (a host lock not returned)"


SEEDS = range(8)


@pytest.mark.parametrize(
    ("write_policy", "host_ratio"),
    [("write_through", 1.5), ("write_back", 1.5), ("write_through", 0.6)],
    ids=["write_through", "write_back", "small_host"],
)
def test_the_rust_core_gives_the_python_cores_observations(write_policy: str, host_ratio: float) -> None:
    """(A host pool smaller than the device pool makes the auto policy demote for host room.)"""
    checked = 0
    totals: dict[str, int] = {}
    for seed in SEEDS:
        runs = {}
        policy = "auto" if seed % 2 else "offload"
        for core in ("python", "rust"):
            r = _open(core, write_policy, policy=policy, host_ratio=host_ratio)
            try:
                if core == "rust":
                    assert isinstance(r.mgr.backend, RustUnifiedBackend)
                _drive(r, seed)
                r.seen.append(("counters", tuple(sorted(r.mgr.counters.items()))))
                _teardown_returns_everything(r)
            finally:
                r.h.close()
            runs[core] = r
        py, rs = runs["python"].seen, runs["rust"].seen
        first = next((i for i, (a, b) in enumerate(zip(py, rs, strict=False)) if a != b), None)
        assert first is None and len(py) == len(rs), (
            f"seed {seed}: step {first}: python {py[first] if first is not None else None} "
            f"!= rust {rs[first] if first is not None else None}"
        )
        checked += runs["rust"].bytes_checked
        for k, v in runs["rust"].mgr.counters.items():
            totals[k] = totals.get(k, 0) + v
    assert checked > 0, "no restore reached a session's next turn: the run checks nothing"
    # the mechanisms the runs went through on the Rust core, each at least once
    mechanisms = ["tool_start", "restored_tokens", "left_tokens", "handover", "admitted", "parked", "kept"]
    if host_ratio < 1:
        mechanisms.append("demoted")
    for mechanism in mechanisms:
        assert totals.get(mechanism, 0) > 0, (mechanism, totals)


@pytest.mark.parametrize(
    "defect",
    [
        pytest.param("HostRefLeak", id="host_lock_never_returned"),
        pytest.param("StaleNode", id="recorded_id_used_unchecked"),
    ],
)
def test_the_rust_backends_seeded_defects_are_caught(defect: str) -> None:
    """A host lock never returned (``HostRefLeak``) leaves host slots no eviction can free; a
    recorded node id used without checking that it still names the session's node (``StaleNode``:
    no re-find after a split or an eviction) acts on a node that is gone. Each is caught by the
    same run on some seed, as a difference from the Python core or at teardown."""
    caught = []
    for seed in SEEDS:
        oracle = _open("python", "write_through")
        try:
            _drive(oracle, seed)
        finally:
            oracle.h.close()
        r = _open("rust", "write_through", frozenset({defect}))
        try:
            _drive(r, seed)
            _teardown_returns_everything(r)
            if r.seen != oracle.seen:
                caught.append(seed)
        except (AssertionError, KeyError, RuntimeError) as e:
            caught.append((seed, type(e).__name__))
        finally:
            r.h.close()
        if caught:
            break
    print(f"{defect} caught: {caught}")
    assert caught, f"{defect} survived seeds {list(SEEDS)}"
