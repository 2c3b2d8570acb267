"""Tensor-parallel lockstep on CPU: two gloo ranks, each with its own REAL HiRadixCache (CPU
harness) and its own toolkv whose agreement is ``toolkv.sglang.tp`` over the 2-rank group — the same group
sglang's ``writing_check``/``loading_check`` reduce over. The ranks get deliberately different
timings (rank 1's copies finish later, its clock is skewed, its device memory runs out alone) and
must still take identical decisions at every step, with identical per-rank accounting, and no hang.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch.multiprocessing as mp

from toolkv.core.backends.base import LocalAgreement
from toolkv.sglang.tp import AgreedClock, ProcessGroupAgreement

WORLD = 2
TTL = 6.0  # long enough for the offload and restore round trip of session a (9 iterations)
BASE = 1_000_000.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ScriptedClock:
    """Per-rank wall clock: rank 1 runs 2.5 s behind rank 0 and jitters."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.t = BASE

    def __call__(self) -> float:
        return self.t - (2.5 if self.rank == 1 else 0.0) + (0.3 * (self.t % 2) if self.rank == 1 else 0.0)


def _threads() -> list[str]:
    """Names of this process's OS threads (gloo names its own: gloo_tcp_loop, pt_gloo_runloop)."""
    return sorted(p.read_text().strip() for p in Path("/proc/self/task").glob("*/comm"))


def _rank_main(rank: int, port: int, out: str, scenario: str = "main") -> None:
    """One rank, and its orderly end.

    Why a rank used to die with SIGABRT ("terminate called without an active exception") now and
    then: ``destroy_process_group`` does not stop gloo while anything still holds the group, and
    the cache controller and the agreement here hold it past the scenario (measured: after
    ``destroy_process_group`` each rank still runs gloo's ``gloo_tcp_loop`` and two
    ``pt_gloo_runloop`` threads). The rank then left through interpreter finalization with those
    threads running, and with its peer possibly already gone; C++ exit-time destructors met a
    still-joinable gloo thread and called ``std::terminate``. It depended on which rank finished
    first and on scheduling, so it showed only on a loaded machine, about 2 runs in 9.

    The end is now ordered: the results are written, both ranks pass a barrier (no collective of
    either is still in flight), the group is destroyed, and the process leaves with ``os._exit``
    — no exit-time destructors run against gloo's threads. Nothing is retried.
    """
    import gc

    import torch.distributed as dist

    os.environ["OMP_NUM_THREADS"] = "1"
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD,
        timeout=timedelta(seconds=30),
    )
    result = _scenario(rank) if scenario == "main" else _scenario_promise(rank)
    gc.collect()
    dist.barrier()  # both ranks are done with every collective before either tears down
    dist.destroy_process_group()
    result["threads_after_destroy"] = _threads()
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _scenario(rank: int) -> dict[str, Any]:
    from types import SimpleNamespace

    import torch.distributed as dist
    from _turns import finish_turn

    from toolkv.sglang.config import ToolKVConfig
    from toolkv.sglang.scheduler_side import SchedulerToolKV
    from toolkv.testing.harness import CacheHarness, HarnessConfig

    trace: list[dict[str, Any]] = []
    with CacheHarness(HarnessConfig(), seed=rank) as h:  # ensure_process_group returns the 2-rank WORLD
        assert h.tree.tp_world_size == WORLD
        initial = h.accounting()
        agree = ProcessGroupAgreement(dist.group.WORLD)
        clock = ScriptedClock(rank)
        tk = SchedulerToolKV(
            h.tree,
            config=ToolKVConfig(ttl_s=TTL, lazy_free=False),
            agree=agree,
            tp_size=WORLD,
            clock=AgreedClock(agree, every=1, source=clock),
        )
        h.tree._toolkv = tk

        def record(step: str, reply: Any = None) -> None:
            acc = h.accounting()
            trace.append(
                {
                    "step": step,
                    "reply": reply,
                    "now": tk.manager.now,
                    "sessions": {s: tk.manager.kv_meta(s) for s in sorted(tk.manager.sessions)},
                    "acct": [
                        acc.device_free,
                        acc.host_free,
                        acc.evictable,
                        acc.protected,
                        acc.pending_writes,
                    ],
                    "loads": acc.pending_loads,
                    "collectives": agree.collectives,
                }
            )

        def iteration(step: str, *, writes_on: tuple[int, ...] = (), loads_on: tuple[int, ...] = ()) -> None:
            """One scheduler iteration: this rank's copy engine may finish, sglang's ack checks
            (all-reduce MIN inside), then the tick (agreed clock inside)."""
            clock.t += 1.0
            if rank in writes_on:
                h.complete("write")
            if rank in loads_on:
                h.complete("load")
            h.check_events()
            tk.tick()
            record(step)

        assert finish_turn(h, "a", list(range(1, 49)), [49, 50])
        assert finish_turn(h, "b", list(range(100, 140)), [140], slot=1)
        record("turns")
        record("tool_start a", tk.handle("tool_start", {"session_id": "a"}))
        iteration("rank0 writes done", writes_on=(0,))  # rank 1 lags: nobody may free yet
        iteration("nothing")
        iteration("rank1 writes done", writes_on=(1,))  # now both free, same iteration
        record("tool_end a", tk.handle("tool_end", {"session_id": "a", "epoch": 1}))
        iteration("loads start")  # tool_end only queues the load: the next tick starts it (ring idle)
        iteration("rank0 loads done", loads_on=(0,))
        iteration("rank1 loads done", loads_on=(1,))
        # the next request of a is admitted on both ranks (the same prefill batch): the hand-over
        # ends in the same iteration everywhere
        tk.on_batch([SimpleNamespace(session_id="a", session=None)])
        record("a admitted")

        record("tool_start b", tk.handle("tool_start", {"session_id": "b"}))
        iteration("all writes done", writes_on=(0, 1))
        # Only rank 1 is full, and nothing there can be evicted: a request holds a's KV (the only
        # evictable cache; a restore would otherwise evict it to make room, on both ranks alike).
        held = h.match(list(range(1, 51))).last_device_node if rank == 1 else None
        if held is not None:
            h.tree.inc_lock_ref(held)
        hog = h.alloc(h.allocator.available_size()) if rank == 1 else None
        status, body = tk.handle("tool_end", {"session_id": "b", "epoch": 1})
        if hog is not None:
            h.allocator.free(hog)
        if held is not None:
            h.tree.dec_lock_ref(held)
        # local diagnostics (this rank's free memory, and so the reason in words); the decision is agreed
        body.pop("device_free_tokens", None)
        body.pop("device_evictable_tokens", None)
        body.pop("message", None)
        record("tool_end b (rank 1 full)", (status, body))
        for i in range(int(TTL) + 2):  # clocks are skewed: the agreed MAX decides expiry for both
            iteration(f"idle {i}")
        record("close a", tk.handle("close", {"session_id": "a"}))
        record("close b", tk.handle("close", {"session_id": "b"}))
        h.synchronize()
        h.check_events()
        h.evict_device(10**6)
        h.check_events()
        h.evict_host(10**6)
        record("drained")
        leak_free = h.accounting() == initial
    return {"trace": trace, "leak_free": leak_free}


def _scenario_promise(rank: int) -> dict[str, Any]:
    """``tool_start``'s device-room check (sglang's promise of device room) under skewed views:
    only rank 1's scheduler counts a promise the offload's write locks would take, and both ranks
    must refuse the same call; with the promise gone both accept it, and the writes, acknowledged
    on different iterations per rank, finish it in the same iteration."""
    import torch.distributed as dist
    from _turns import finish_turn

    from toolkv.sglang.config import ToolKVConfig
    from toolkv.sglang.scheduler_side import SchedulerToolKV
    from toolkv.testing.harness import CacheHarness, HarnessConfig

    trace: list[dict[str, Any]] = []
    # write_back: a finished turn has no host copy, so a tool_start writes (and locks) its whole path
    with CacheHarness(HarnessConfig(write_policy="write_back"), seed=rank) as h:
        initial = h.accounting()
        agree = ProcessGroupAgreement(dist.group.WORLD)
        clock = ScriptedClock(rank)
        tk = SchedulerToolKV(
            h.tree, config=ToolKVConfig(ttl_s=TTL), agree=agree, tp_size=WORLD,
            clock=AgreedClock(agree, every=1, source=clock),
        )  # fmt: skip
        h.tree._toolkv = tk

        def record(step: str, reply: Any = None) -> None:
            acc = h.accounting()
            trace.append(
                {
                    "step": step,
                    "reply": reply,
                    "sessions": {x: tk.manager.kv_meta(x) for x in sorted(tk.manager.sessions)},
                    "acct": [
                        acc.device_free,
                        acc.host_free,
                        acc.evictable,
                        acc.protected,
                        acc.pending_writes,
                    ],
                }
            )

        assert finish_turn(h, "a", list(range(1, 49)), [49, 50])
        record("turn")
        be: Any = tk.manager.backend
        be.headroom = (lambda: 10**6) if rank == 1 else (lambda: 0)  # only rank 1 sees the promise
        status, body = tk.handle("tool_start", {"session_id": "a"})
        for k in ("message", "device_free_tokens", "device_evictable_tokens", "promised_tokens"):
            body.pop(k, None)  # this rank's own numbers; the decision is agreed
        record("tool_start, rank 1 promised", (status, body))
        be.headroom = lambda: 0
        record("tool_start", tk.handle("tool_start", {"session_id": "a"}))
        for step, writes_on in (("rank0 writes", (0,)), ("rank1 writes", (1,))):
            clock.t += 1.0
            if rank in writes_on:
                h.complete("write")
            h.check_events()
            tk.tick()
            record(step)
        record("close", tk.handle("close", {"session_id": "a"}))
        h.synchronize()
        h.check_events()
        h.evict_device(10**6)
        h.check_events()
        h.evict_host(10**6)
        record("drained")
        leak_free = h.accounting() == initial
    return {"trace": trace, "leak_free": leak_free}


def _spawn(tmp_path: Path, scenario: str) -> tuple[dict[str, Any], dict[str, Any]]:
    t0 = time.monotonic()
    ctx = mp.spawn(_rank_main, args=(_free_port(), str(tmp_path), scenario), nprocs=WORLD, join=False)
    while not ctx.join(timeout=1):
        if time.monotonic() > t0 + 120:
            for p in ctx.processes:
                p.kill()
            pytest.fail("TP ranks hung (no lockstep)")
    r0, r1 = (json.loads(Path(tmp_path, f"rank{r}.json").read_text()) for r in range(WORLD))
    for a, b in zip(r0["trace"], r1["trace"], strict=True):
        assert a == b, f"ranks diverged at {a['step']!r}:\n{a}\n{b}"
    return r0, r1


def test_two_gloo_ranks_refuse_an_offload_one_ranks_promise_needs_together(tmp_path: Path) -> None:
    r0, r1 = _spawn(tmp_path, "promise")
    by = {s["step"]: s for s in r0["trace"]}
    refused = by["tool_start, rank 1 promised"]
    assert refused["reply"][0] == 503 and refused["reply"][1]["error"] == "device_memory_full"
    assert refused["sessions"]["a"]["state"] == "Running" and refused["acct"] == by["turn"]["acct"]
    assert by["tool_start"]["reply"][1]["state"] == "Offloading"
    assert by["rank0 writes"]["sessions"]["a"]["state"] == "Offloading", "rank 0 must wait for rank 1"
    assert by["rank1 writes"]["sessions"]["a"]["state"] == "Offloaded"
    assert r0["leak_free"] and r1["leak_free"]


def test_two_gloo_ranks_take_identical_decisions(tmp_path: Path) -> None:
    t0 = time.monotonic()
    ctx = mp.spawn(_rank_main, args=(_free_port(), str(tmp_path)), nprocs=WORLD, join=False)
    deadline = t0 + 120
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail("TP ranks hung (no lockstep)")
    r0, r1 = (json.loads(Path(tmp_path, f"rank{r}.json").read_text()) for r in range(WORLD))
    t0s, t1s = r0["trace"], r1["trace"]
    assert [s["step"] for s in t0s] == [s["step"] for s in t1s]
    for a, b in zip(t0s, t1s, strict=True):
        assert a == b, f"ranks diverged at {a['step']!r}:\n{a}\n{b}"
    by = {s["step"]: s for s in t0s}
    assert by["tool_start a"]["sessions"]["a"]["state"] == "Offloading"
    assert by["rank0 writes done"]["sessions"]["a"]["state"] == "Offloading", "rank 0 must wait for rank 1"
    assert by["rank1 writes done"]["sessions"]["a"]["state"] == "Offloaded"
    assert by["tool_end a"]["reply"][1]["state"] == "Restoring"
    assert by["loads start"]["loads"] == 1 and by["loads start"]["sessions"]["a"]["state"] == "Restoring"
    assert by["rank0 loads done"]["sessions"]["a"]["state"] == "Restoring"
    assert by["rank1 loads done"]["sessions"]["a"]["state"] == "Handover"  # pinned until admitted
    assert by["a admitted"]["sessions"]["a"]["state"] == "Runnable"
    # rank 1 cannot take b's restore: both ranks park it (spec Park), none loads or pins it
    parked = by["tool_end b (rank 1 full)"]
    assert parked["reply"][0] == 200 and parked["sessions"]["b"]["state"] == "Parked"
    states = [s["sessions"]["b"]["state"] for s in t0s if s["step"].startswith("idle")]
    assert "Runnable" in states and states[0] == "Parked", states  # its request never came: the TTL
    assert r0["leak_free"] and r1["leak_free"]
    # (mp.spawn's join raised above had a rank died by a signal; "threads_after_destroy" records
    # what each rank still ran when it left)


def test_single_rank_agreement_issues_no_collective() -> None:
    a = ProcessGroupAgreement(None)
    assert a.all_true(True) and not a.all_true(False) and a.max_time(3.0) == 3.0
    assert a.collectives == 0


def test_agreed_clock_cadence_and_monotonicity() -> None:
    readings = iter([10.0, 5.0, 12.0])
    clock = AgreedClock(LocalAgreement(), every=2, source=lambda: next(readings))
    got = [clock.tick() for _ in range(6)]
    # read on ticks 0, 2 and 4 only; a reading that went backwards does not move it back
    assert got == [10.0, 10.0, 10.0, 10.0, 12.0, 12.0]
    with pytest.raises(ValueError):
        AgreedClock(LocalAgreement(), every=0)
