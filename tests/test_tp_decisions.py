"""Every decision toolkv takes on time, load or an asynchronous event, under tensor parallelism, on
CPU: two gloo ranks, each with its own REAL HiRadixCache (CPU harness) and its own toolkv whose
agreement is ``toolkv.sglang.tp`` over the 2-rank group (sglang's ``writing_check``/``loading_check``
reduce over the same group).

Each scenario makes the ranks see something different: rank 1's clock runs 2.5 s behind and
jitters, one rank's copy is acknowledged an iteration later, one rank's waiting queue is longer,
one rank's host pool has fewer free slots. The ranks must still take the same decision in the same
iteration: every step's record (reply, every session's phase and epoch, the cache's accounting with
its lock and host references, the tree's device and host token counts, how many collectives ran)
is compared between the ranks, and at the end everything is returned (the accounting equals the
one before the scenario).

The scenarios of one run share one launch of the two processes (a launch costs seconds). Each
decision also has a mutant that takes it on the rank's own reading, skipping the agreement for that
decision only (``LocalAt``: the collective still runs, so the ranks stay in step as long as their
control flow does, but its result is thrown away); the same checks must then find the ranks
apart. ``tests/test_tp.py`` has the promised-room refusal and the first hand-over,
``tests/test_drain_tp.py`` the drain's refusals; the Rust tree core's are in
``tests/test_tp_rust_0523.py``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch.multiprocessing as mp
from test_tp import WORLD, ScriptedClock, _free_port

TTL = 8.0
HANDOVER_TTL = 3.0
FULL = 10**6  # a waiting queue no device holds
LOCAL_READINGS = (  # a reply's numbers of this rank alone (the decision in it is agreed)
    "message",
    "device_free_tokens",
    "device_evictable_tokens",
    "promised_tokens",
    "host_free_tokens",
    "host_evictable_tokens",
    "tp_rank",
)


SINK: list[str] = []  # where a rank appends each record as it is taken (its scenario's own file)


class LocalAt:
    """The mutant agreement: calls made from the named functions run their collective (the ranks
    stay in step) but answer this rank's own reading, as if that decision skipped the agreement."""

    def __init__(self, agree: Any, where: set[str]) -> None:
        self.agree, self.where = agree, where

    @property
    def collectives(self) -> int:
        return int(self.agree.collectives)

    def _local(self) -> bool:
        return sys._getframe(2).f_code.co_name in self.where

    def all_true(self, ok: bool) -> bool:
        agreed = self.agree.all_true(ok)
        return ok if self._local() else agreed

    def max_time(self, t: float) -> float:
        agreed = self.agree.max_time(t)
        return t if self._local() else agreed


class Rank:
    """One rank's toolkv over one harness, and the records the ranks compare."""

    def __init__(self, rank: int, h: Any, agree: Any, clock_agree: Any, **cfg: Any) -> None:
        from toolkv.sglang.config import ToolKVConfig
        from toolkv.sglang.scheduler_side import SchedulerToolKV
        from toolkv.sglang.tp import AgreedClock

        self.rank, self.h, self.agree = rank, h, agree
        self.clock = ScriptedClock(rank)
        cfg.setdefault("ttl_s", TTL)
        self.tk = SchedulerToolKV(
            h.tree,
            config=ToolKVConfig(**cfg),
            agree=agree,
            tp_size=WORLD,
            tp_rank=rank,
            clock=AgreedClock(clock_agree, every=1, source=self.clock),
        )
        h.tree._toolkv = self.tk
        self.initial = h.accounting()
        self.trace: list[dict[str, Any]] = []

    def record(self, step: str, reply: Any = None) -> dict[str, Any]:
        if isinstance(reply, tuple) and isinstance(reply[1], dict):
            reply = [reply[0], {k: v for k, v in reply[1].items() if k not in LOCAL_READINGS}]
        m, acc = self.tk.manager, self.h.accounting()
        row = {
            "step": step,
            "reply": reply,
            "now": m.now,
            "sessions": {s: m.kv_meta(s) for s in sorted(m.sessions)},
            "acct": [acc.device_free, acc.host_free, acc.evictable, acc.protected, acc.pending_writes],
            "locks": [list(x) for x in acc.lock_refs],
            "host_refs": [list(x) for x in acc.host_refs],
            "loads": acc.pending_loads,
            "tree": self.tree_counts(),
            "collectives": self.agree.collectives,
        }
        self.trace.append(row)
        if SINK:  # as it happens: a mutant's rank may die out of step before it writes its results
            with Path(SINK[0]).open("a") as f:
                f.write(json.dumps(row) + "\n")
        return row

    def tree_counts(self) -> list[int] | None:
        """(tokens on device, tokens on host) over the tree's nodes."""
        return list(self.h.tree_token_counts())

    def call(self, step: str, op: str, **body: Any) -> dict[str, Any]:
        return self.record(step, self.tk.handle(op, body))

    def iteration(
        self, step: str, *, writes_on: tuple[int, ...] = (), loads_on: tuple[int, ...] = ()
    ) -> None:
        """One scheduler iteration: this rank's copy engine may finish, sglang's ack checks
        (all-reduce MIN inside), then toolkv's tick (the agreed clock inside)."""
        self.clock.t += 1.0
        if self.rank in writes_on:
            self.h.complete("write")
        if self.rank in loads_on:
            self.h.complete("load")
        self.h.check_events()
        self.tk.tick()
        self.record(step)

    def turn(self, sid: str, first: int, n: int, slot: int = 0) -> None:
        from _turns import finish_turn

        assert finish_turn(
            self.h, sid, list(range(first, first + n - 2)), [first + n - 2, first + n - 1], slot=slot
        )

    def admit(self, step: str, *sids: str) -> None:
        self.tk.on_batch([SimpleNamespace(session_id=s, session=None) for s in sids])
        self.record(step)

    def finish(self) -> dict[str, Any]:
        """Close every session, let sglang settle and evict everything: all is returned."""
        for sid in sorted(self.tk.manager.sessions):
            self.tk.handle("close", {"session_id": sid})
        h = self.h
        h.synchronize()
        h.check_events()
        h.evict_device(10**6)
        h.check_events()
        h.evict_host(10**6)
        self.record("drained")
        return {"trace": self.trace, "leak_free": h.accounting() == self.initial}


def _harness(**kw: Any) -> Any:
    from toolkv.testing.harness import CacheHarness, HarnessConfig

    return CacheHarness(HarnessConfig(**kw), seed=0)


# ---- the scenarios -------------------------------------------------------------------------------------
def sc_handover(rank: int, agree: Any, clock_agree: Any) -> dict[str, Any]:
    """The hand-over: a request admitted while the load runs, the loads acknowledged an iteration
    apart (rank 1 later), so ``Handover`` and the ``Admit`` it waited for come in the same
    iteration on both ranks; a second hand-over whose request never comes ends by its hand-over
    TTL on the agreed clock (the ranks' own clocks 2.5 s apart)."""
    with _harness() as h:
        r = Rank(rank, h, agree, clock_agree, handover_ttl_s=HANDOVER_TTL, lazy_free=False)
        r.turn("a", 1, 50)
        r.turn("b", 100, 40, slot=1)
        r.call("tool_start a", "tool_start", session_id="a")
        r.call("tool_start b", "tool_start", session_id="b")
        r.iteration("writes", writes_on=(0, 1))
        r.call("tool_end a", "tool_end", session_id="a", epoch=1)
        r.iteration("a loads start")
        r.admit("a admitted while restoring", "a")
        r.iteration("rank0 loads a", loads_on=(0,))
        r.iteration("rank1 loads a", loads_on=(1,))
        r.call("tool_end b", "tool_end", session_id="b", epoch=1)
        r.iteration("b loads start")
        r.iteration("b loads", loads_on=(0, 1))
        for i in range(int(HANDOVER_TTL) + 2):
            r.iteration(f"b waits {i}")
        return r.finish()


def sc_host_room(rank: int, agree: Any, clock_agree: Any) -> dict[str, Any]:
    """Host room that counts evictable copies: only rank 1's host pool is short of free slots,
    the unprotected host copy of a closed session covers it; both ranks accept the offload and
    evict the same copy. With fewer slots still on rank 1, both refuse it (507)."""
    with _harness(write_policy="write_back") as h:
        r = Rank(rank, h, agree, clock_agree, lazy_free=False)
        r.turn("c", 500, 100)
        r.call("tool_start c", "tool_start", session_id="c")
        r.iteration("c written", writes_on=(0, 1))
        r.call("close c", "close", session_id="c")  # its host copy stays, unprotected: evictable
        r.turn("a", 1, 50, slot=1)
        r.turn("b", 200, 30, slot=2)
        pool = h.host_pool
        keep = 10 if rank == 1 else pool.available_size()
        hog = pool.alloc(pool.available_size() - keep) if rank == 1 else None
        reply = r.tk.handle("tool_start", {"session_id": "a"})
        if hog is not None:
            pool.free(hog)  # before the record: the host's free slots are compared
        r.record("tool_start a (rank 1: 10 free slots)", reply)
        r.iteration("a written", writes_on=(0, 1))
        hog = pool.alloc(pool.available_size()) if rank == 1 else None
        reply = r.tk.handle("tool_start", {"session_id": "b"})
        if hog is not None:
            pool.free(hog)
        r.record("tool_start b (rank 1: no slot, nothing evictable)", reply)
        return r.finish()


def sc_demote(rank: int, agree: Any, clock_agree: Any) -> dict[str, Any]:
    """Demotion by predicted return under skewed device views: the host budget is full, and only
    rank 1's waiting queue says the device needs the room; both ranks demote the session predicted
    back last (not the one back sooner than the caller), in the same call. Then the per-call
    policy ``auto`` keeps or offloads on the device's room: only rank 1's queue leaves none."""
    with _harness() as h:
        r = Rank(rank, h, agree, clock_agree, host_budget_tokens=100, lazy_free=False)
        r.turn("late", 1, 40)
        r.turn("soon", 100, 40, slot=1)
        r.turn("a", 200, 40, slot=2)
        r.call("tool_start late", "tool_start", session_id="late", tool="t_late", expected_s=100.0)
        r.call("tool_start soon", "tool_start", session_id="soon", tool="t_soon", expected_s=2.0)
        r.iteration("writes", writes_on=(0, 1))
        r.tk.manager.queued_demand = (lambda: FULL) if rank == 1 else (lambda: 0)
        r.call("tool_start a (rank 1 queued)", "tool_start", session_id="a", tool="t_a", expected_s=10.0)
        r.tk.manager.queued_demand = lambda: 0
        r.iteration("a writes", writes_on=(0, 1))
        r.call("tool_end a", "tool_end", session_id="a", epoch=1)
        r.iteration("a loads", loads_on=(0, 1))
        r.admit("a admitted", "a")
        r.turn("a", 200, 42, slot=2)
        r.tk.manager.queued_demand = (lambda: FULL) if rank == 1 else (lambda: 0)
        r.call("auto tool_start a (rank 1 queued)", "tool_start", session_id="a", tool="t_a", policy="auto")
        r.tk.manager.queued_demand = lambda: 0
        return r.finish()


def sc_protect(rank: int, agree: Any, clock_agree: Any) -> dict[str, Any]:
    """Load-adaptive protection: a tool_end whose restore only rank 1's waiting queue cannot take
    parks on both ranks, and the parked session's admission ends it on both; a hand-over that
    waits while only rank 1's queue grows is unpinned on both ranks in the same tick."""
    with _harness() as h:
        r = Rank(rank, h, agree, clock_agree, lazy_free=False)
        r.turn("a", 1, 50)
        r.turn("b", 100, 40, slot=1)
        r.call("tool_start a", "tool_start", session_id="a")
        r.call("tool_start b", "tool_start", session_id="b")
        r.iteration("writes", writes_on=(0, 1))
        r.tk.manager.queued_demand = (lambda: FULL) if rank == 1 else (lambda: 0)
        r.call("tool_end a (rank 1 queued)", "tool_end", session_id="a", epoch=1)
        r.tk.manager.queued_demand = lambda: 0
        r.admit("a admitted (parked)", "a")
        r.call("tool_end b", "tool_end", session_id="b", epoch=1)
        r.iteration("b loads start")
        r.iteration("b loads", loads_on=(0, 1))
        r.tk.manager.queued_demand = (lambda: FULL) if rank == 1 else (lambda: 0)
        r.iteration("rank 1 queue grows")
        r.tk.manager.queued_demand = lambda: 0
        r.admit("b admitted (unpinned)", "b")
        return r.finish()


def sc_lazy_free(rank: int, agree: Any, clock_agree: Any) -> dict[str, Any]:
    """Lazy free: the offload's writes are acknowledged an iteration apart; both ranks finish it in
    the same iteration and leave the same GPU copies to sglang's eviction; sglang evicts them
    (the host copy stays) and the tool_end loads them back, the loads again an iteration apart."""
    with _harness() as h:
        r = Rank(rank, h, agree, clock_agree, lazy_free=True)
        r.turn("a", 1, 50)
        r.call("tool_start a", "tool_start", session_id="a")
        r.iteration("rank0 writes", writes_on=(0,))
        r.iteration("rank1 writes", writes_on=(1,))
        h.evict_device(10**6)
        r.record("sglang evicts")
        r.call("tool_end a", "tool_end", session_id="a", epoch=1)
        r.iteration("loads start")
        r.iteration("rank0 loads", loads_on=(0,))
        r.iteration("rank1 loads", loads_on=(1,))
        r.admit("a admitted", "a")
        return r.finish()


def sc_ttl(rank: int, agree: Any, clock_agree: Any) -> dict[str, Any]:
    """The TTL on skewed clocks: a tool call that never ends expires in the same iteration on
    both ranks (rank 1's own clock would expire it 2.5 s later)."""
    with _harness() as h:
        r = Rank(rank, h, agree, clock_agree, lazy_free=False)
        r.turn("a", 1, 50)
        r.call("tool_start a", "tool_start", session_id="a")
        for i in range(int(TTL) + 4):
            r.iteration(f"idle {i}", writes_on=(0, 1) if i == 0 else ())
        return r.finish()


def sc_l3(rank: int, agree: Any, clock_agree: Any) -> dict[str, Any]:
    """L3 with read at arrival, over sglang's real file backend and its storage threads: a session
    away long is stored to L3 by predicted return; rank 1's backup thread is held back an
    iteration (its write to storage acknowledged later), and both ranks take ``StoreAck`` in the
    same iteration (sglang reduces its backup acks). The tool_end then reads nothing itself
    (``l3_read_at_arrival``): both ranks let sglang's prefetch at the next request read it."""
    import tempfile
    import threading

    from toolkv.testing.harness import HarnessConfig
    from toolkv.testing.storage_harness import StorageCacheHarness

    with (
        tempfile.TemporaryDirectory() as d,
        StorageCacheHarness(HarnessConfig(device_tokens=256, host_ratio=2.0, page_size=4), Path(d)) as h,
    ):
        r = Rank(rank, h, agree, clock_agree, lazy_free=False, l3=True, l3_read_at_arrival=True)
        hold = threading.Event()
        if rank == 0:
            hold.set()
        put = h.backend.batch_set

        def held_back(*args: Any, **kw: Any) -> Any:  # rank 1's storage writes wait for the event
            assert hold.wait(30)
            return put(*args, **kw)

        h.backend.batch_set = held_back
        r.turn("a", 1, 97)  # 96 tokens of KV: 24 pages
        r.call("tool_start a", "tool_start", session_id="a", tool="slow_ci", expected_s=600.0)
        r.iteration("writes", writes_on=(0, 1))
        r.iteration("storing (rank 1's backup held)")
        if rank == 0:
            h._wait(lambda: h.controller.ack_backup_queue.qsize() >= len(h.tree.ongoing_backup), "acked")
        r.iteration("rank 0's backup acked")
        hold.set()
        h._wait(lambda: h.controller.ack_backup_queue.qsize() >= len(h.tree.ongoing_backup), "acked")
        r.iteration("rank 1's backup acked")
        r.iteration("after the acks")
        r.call("tool_end a (read at arrival)", "tool_end", session_id="a", epoch=1)
        r.iteration("after tool_end")
        return r.finish()


def sc_drain(rank: int, agree: Any, clock_agree: Any) -> dict[str, Any]:
    """The drain with the acks skewed: a session's offload and then its restore acknowledged an
    iteration apart; every poll answers the same on both ranks (held until the hand-over ends)."""
    with _harness() as h:
        r = Rank(rank, h, agree, clock_agree, lazy_free=False)
        r.turn("a", 1, 50)
        r.turn("b", 100, 40, slot=1)
        r.call("tool_start a", "tool_start", session_id="a")
        r.call("drain", "drain", drain=True)
        r.call("tool_start b refused", "tool_start", session_id="b")
        r.iteration("rank0 writes", writes_on=(0,))
        r.call("poll 1", "drain", drain=True)
        r.iteration("rank1 writes", writes_on=(1,))
        r.call("tool_end a", "tool_end", session_id="a", epoch=1)
        r.iteration("loads start")
        r.iteration("rank0 loads", loads_on=(0,))
        r.call("poll 2", "drain", drain=True)
        r.iteration("rank1 loads", loads_on=(1,))
        r.call("poll 3", "drain", drain=True)
        r.admit("a admitted", "a")
        r.call("poll 4", "drain", drain=True)
        r.call("undrain", "drain", drain=False)
        return r.finish()


SCENARIOS: dict[str, Callable[[int, Any, Any], dict[str, Any]]] = {
    "handover": sc_handover,
    "host_room": sc_host_room,
    "demote": sc_demote,
    "protect": sc_protect,
    "lazy_free": sc_lazy_free,
    "ttl": sc_ttl,
    "l3": sc_l3,
    "drain": sc_drain,
}

# mutant -> (scenario, where its agreement is skipped)
MUTANTS: dict[str, tuple[str, str]] = {
    "host_room_local": ("host_room", "offload"),  # each rank evicts its own shortfall
    "pressure_local": ("demote", "low"),  # the policy's pressure unagreed (demote for room, keep)
    "park_local": ("protect", "check_pin_room"),  # the restore's room on this rank's queue
    "unpin_local": ("protect", "_room_short"),  # the hand-over's pin given up on this rank's queue
    "acks_local": ("lazy_free", "ack"),  # sglang's ack counts unreduced (write and load acks)
    "clock_local": ("ttl", "clock"),  # the clock unagreed: each rank's TTL on its own clock
    "storage_acks_local": ("l3", "storage_ack"),  # sglang's backup acks unreduced
}


def _rank_main(rank: int, port: int, out: str, names: list[str], mutant: str, module: str = __name__) -> None:
    """One rank: the scenarios in order, each on its own harness; the orderly end of
    tests/test_tp.py's ranks (barrier, destroy, ``os._exit``). A mutant's rank writes what it has
    as soon as a scenario fails (a rank out of step raises on a collective that times out)."""
    import gc

    import torch.distributed as dist

    from toolkv.core.backends.base import LocalAgreement
    from toolkv.sglang.tp import ProcessGroupAgreement

    os.environ["OMP_NUM_THREADS"] = "1"
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD,
        timeout=timedelta(seconds=10 if mutant else 60),
    )
    import importlib

    mod = importlib.import_module(module)  # this module's scenarios, or the 0.5.23 file's
    scenarios, mutants = mod.SCENARIOS, mod.MUTANTS
    results: dict[str, Any] = {}
    where = mutants[mutant][1] if mutant else ""
    for name in names:
        agree: Any = ProcessGroupAgreement(dist.group.WORLD)
        clock_agree: Any = agree
        if where == "clock":
            clock_agree = LocalAgreement()
        elif where == "ack":  # sglang's writing_check/loading_check reduce (its _all_reduce) skipped
            if module == __name__:
                from sglang.srt.mem_cache.hiradix_cache import HiRadixCache as Cache
            else:
                from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache as Cache
            Cache._all_reduce = lambda self, data, op: None  # type: ignore[method-assign]
        elif where == "storage_ack":  # every reduction of sglang's cache (the storage queues' too) skipped
            from sglang.srt.mem_cache.hiradix_cache import HiRadixCache

            HiRadixCache._all_reduce_attn_groups = lambda self, t, op: None  # type: ignore[method-assign]
        elif where:
            agree = LocalAt(agree, {where})
        SINK[:] = [str(Path(out, f"rank{rank}.{name}.jsonl"))]
        try:
            results[name] = scenarios[name](rank, agree, clock_agree)
        except Exception as e:  # a mutant's ranks out of step: what they did so far is the evidence
            if not mutant:
                raise
            print(f"rank {rank}, {name}: {e!r}", file=sys.stderr)  # its records are in its .jsonl
            Path(out, f"rank{rank}.json").write_text(json.dumps(results))
            os._exit(0)
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _launch(
    tmp_path: Path, names: list[str], mutant: str = "", module: str = __name__
) -> tuple[dict[str, Any], dict[str, Any]]:
    t0 = time.monotonic()
    args = (_free_port(), str(tmp_path), names, mutant, module)
    ctx = mp.spawn(_rank_main, args=args, nprocs=WORLD, join=False)
    while True:
        try:
            if ctx.join(timeout=1):
                break
        except (mp.ProcessExitedException, mp.ProcessRaisedException):
            if not mutant:
                raise
            break  # a mutant's rank died out of step (gloo aborts it): that is a finding too
        if time.monotonic() > t0 + 240:
            for p in ctx.processes:
                p.kill()
            if mutant:
                break
            pytest.fail("TP ranks hung (no lockstep)")
    for p in ctx.processes:
        if p.is_alive():
            p.kill()
    ranks: list[dict[str, Any]] = []
    for r in range(WORLD):
        p = Path(tmp_path, f"rank{r}.json")
        got: dict[str, Any] = json.loads(p.read_text()) if p.exists() else {}
        for name in names:  # what a rank that died had recorded, up to where it died
            rows = Path(tmp_path, f"rank{r}.{name}.jsonl")
            if name not in got and rows.exists():
                got[name] = {"error": "died", "trace": [json.loads(x) for x in rows.read_text().splitlines()]}
        ranks.append(got)
    return ranks[0], ranks[1]


def divergence(r0: dict[str, Any], r1: dict[str, Any], name: str) -> str | None:
    """Where the ranks' records of scenario ``name`` part (None: the same at every step, and
    both ranks got to the end leak-free)."""
    a, b = r0.get(name) or {}, r1.get(name) or {}
    for x, y in zip(a.get("trace", []), b.get("trace", []), strict=False):
        if x != y:
            diff = {k: (x.get(k), y.get(k)) for k in x if x.get(k) != y.get(k)}
            return f"ranks diverged at {x['step']!r}: {diff}"
    if not a or not b or "error" in a or "error" in b:
        return f"a rank did not finish: {a.get('error')} / {b.get('error')}"
    if len(a["trace"]) != len(b["trace"]):
        return "ranks took different numbers of steps"
    if not (a["leak_free"] and b["leak_free"]):
        return "something was not returned"
    return None


def _by(r: dict[str, Any], name: str) -> dict[str, dict[str, Any]]:
    return {s["step"]: s for s in r[name]["trace"]}


def _state(row: dict[str, Any], sid: str) -> str:
    return str(row["sessions"][sid]["state"])


def test_two_gloo_ranks_agree_on_every_decision(tmp_path: Path) -> None:
    r0, r1 = _launch(tmp_path, list(SCENARIOS))
    for name in SCENARIOS:
        assert divergence(r0, r1, name) is None, (name, divergence(r0, r1, name))

    by = _by(r0, "handover")
    assert by["a admitted while restoring"]["sessions"]["a"]["state"] == "Restoring"
    assert _state(by["rank0 loads a"], "a") == "Restoring", "rank 0 must wait for rank 1's load"
    assert _state(by["rank1 loads a"], "a") == "Runnable"  # Handover, then the Admit it waited for
    assert _state(by["b loads"], "b") == "Handover"
    waits = [_state(s, "b") for s in r0["handover"]["trace"] if s["step"].startswith("b waits")]
    assert waits[0] == "Handover" and waits[-1] == "Runnable", waits  # the hand-over TTL

    by = _by(r0, "host_room")
    a = by["tool_start a (rank 1: 10 free slots)"]
    assert a["reply"][0] == 200 and _state(a, "a") == "Offloading"
    assert a["tree"][1] < by["close c"]["tree"][1] + 50, "the evictable copy made the room on both"
    b = by["tool_start b (rank 1: no slot, nothing evictable)"]
    assert b["reply"][0] == 507 and _state(b, "b") == "Running"

    by = _by(r0, "demote")
    a = by["tool_start a (rank 1 queued)"]
    assert a["reply"][0] == 200 and _state(a, "a") == "Offloaded"  # written through already
    assert _state(a, "late") == "Released" and _state(a, "soon") == "Offloaded"
    auto = by["auto tool_start a (rank 1 queued)"]
    assert auto["reply"][0] == 200 and auto["sessions"]["a"]["decision"] != "keep", auto["reply"]

    by = _by(r0, "protect")
    assert _state(by["tool_end a (rank 1 queued)"], "a") == "Parked"
    assert _state(by["a admitted (parked)"], "a") == "Runnable"
    assert _state(by["b loads"], "b") == "Handover"
    assert _state(by["rank 1 queue grows"], "b") == "Parked"

    by = _by(r0, "lazy_free")
    assert _state(by["rank0 writes"], "a") == "Offloading" and _state(by["rank1 writes"], "a") == "Offloaded"
    assert by["rank1 writes"]["tree"][0] == 49, "lazy free leaves the GPU copies"
    assert _state(by["rank0 loads"], "a") == "Restoring" and _state(by["rank1 loads"], "a") == "Handover"

    idle = [_state(s, "a") for s in r0["ttl"]["trace"] if s["step"].startswith("idle")]
    assert idle[1] == "Offloaded" and idle[-1] == "Expired", idle

    by = _by(r0, "drain")
    assert by["tool_start b refused"]["reply"][0] == 503
    polls = [by[f"poll {i}"]["reply"][1]["drained"] for i in (1, 2, 3, 4)]
    assert polls == [False, False, False, True], polls  # held until the hand-over ends at admission

    by = _by(r0, "l3")
    assert by["writes"]["sessions"]["a"].get("l3") == "storing", "stored early: away for long"
    assert by["rank 0's backup acked"]["sessions"]["a"]["l3"] == "storing", "rank 0 must wait for rank 1"
    assert by["rank 1's backup acked"]["sessions"]["a"]["l3"] == "stored"
    end = by["tool_end a (read at arrival)"]
    assert end["reply"][0] == 200 and _state(end, "a") == "Running", "read at arrival: nothing read now"


@pytest.mark.parametrize(
    "mutant",
    [pytest.param(m, marks=[] if m == "park_local" else [pytest.mark.slow]) for m in MUTANTS],
)
def test_a_decision_taken_without_agreement_parts_the_ranks(tmp_path: Path, mutant: str) -> None:
    """Each mutant skips the agreement of one decision; its scenario must find the ranks apart
    (or out of step on a collective). One runs in the quick suite, all of them in ``test-long``."""
    name = MUTANTS[mutant][0]
    r0, r1 = _launch(tmp_path, [name], mutant)
    assert divergence(r0, r1, name) is not None, f"{mutant}: the ranks stayed together"
