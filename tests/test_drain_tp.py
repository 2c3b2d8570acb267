"""The drain under tensor parallelism, on CPU: two gloo ranks, each with its own REAL HiRadixCache
and toolkv, and deliberately different clocks (rank 1 runs 2.5 s behind and jitters).

The drain flag travels like tool_start, as a control request sglang broadcasts to every rank; so
every rank must refuse the same tool calls at the same step, issue the same collectives (none for
the drain itself), let the call in flight expire on the agreed clock at the same iteration, and
report drained at the same step. The status read must be identical on both ranks apart from
their local memory readings (only rank 0's answer is sent)."""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch.multiprocessing as mp
from test_tp import WORLD, ScriptedClock, _free_port

TTL = 4.0
LOCAL = (
    "device_free_tokens",
    "device_evictable_tokens",
    "device_locked_tokens",
    "host_free_tokens",
    "tp_rank",
)


def _rank_main(rank: int, port: int, out: str) -> None:
    """One rank; the orderly end of tests/test_tp.py's ranks (barrier, destroy, ``os._exit``)."""
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
    result = _scenario(rank)
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _scenario(rank: int) -> dict[str, Any]:
    import torch.distributed as dist
    from _turns import finish_turn

    from toolkv.sglang.config import ToolKVConfig
    from toolkv.sglang.scheduler_side import SchedulerToolKV
    from toolkv.sglang.tp import AgreedClock, ProcessGroupAgreement
    from toolkv.testing.harness import CacheHarness, HarnessConfig

    trace: list[dict[str, Any]] = []
    with CacheHarness(HarnessConfig(), seed=rank) as h:
        agree = ProcessGroupAgreement(dist.group.WORLD)
        clock = ScriptedClock(rank)
        tk = SchedulerToolKV(
            h.tree,
            config=ToolKVConfig(ttl_s=TTL, zero_change=True),
            agree=agree,
            tp_size=WORLD,
            tp_rank=rank,
            clock=AgreedClock(agree, every=1, source=clock),
        )
        h.tree._toolkv = tk

        def record(step: str, reply: Any = None) -> None:
            if isinstance(reply, tuple) and isinstance(reply[1], dict):
                reply = (reply[0], {k: v for k, v in reply[1].items() if k not in LOCAL and k != "message"})
            trace.append({"step": step, "reply": reply, "now": tk.manager.now, "collectives": agree.collectives,
                          "states": {s: r.state for s, r in sorted(tk.manager.sessions.items())}})  # fmt: skip

        def iteration(step: str, writes: bool = False) -> None:
            clock.t += 1.0
            if writes:
                h.complete("write")
            h.check_events()
            tk.tick()
            record(step)

        assert finish_turn(h, "a", list(range(1, 49)), [49, 50])
        assert finish_turn(h, "b", list(range(100, 140)), [140], slot=1)
        record("tool_start a", tk.handle("tool_start", {"session_id": "a"}))
        iteration("writes done", writes=True)
        record("drain", tk.handle("drain", {"drain": True}))
        record("tool_start b refused", tk.handle("tool_start", {"session_id": "b"}))
        record("auto_offload b skipped", tk.handle("auto_offload", {"session_id": "b"}))
        record("status", tk.handle("server_status", {}))
        for i in range(int(TTL) + 2):  # a's tool_end never comes: its TTL ends the call
            iteration(f"idle {i}")
            record(f"drain poll {i}", tk.handle("drain", {"drain": True}))
        record("undrain", tk.handle("drain", {"drain": False}))
        record("tool_start b", tk.handle("tool_start", {"session_id": "b"}))
    return {"trace": trace}


def test_two_gloo_ranks_drain_in_lockstep(tmp_path: Path) -> None:
    t0 = time.monotonic()
    ctx = mp.spawn(_rank_main, args=(_free_port(), str(tmp_path)), nprocs=WORLD, join=False)
    while not ctx.join(timeout=1):
        if time.monotonic() > t0 + 120:
            for p in ctx.processes:
                p.kill()
            pytest.fail("TP ranks hung (no lockstep)")
    t0s, t1s = (json.loads(Path(tmp_path, f"rank{r}.json").read_text())["trace"] for r in range(WORLD))
    assert [s["step"] for s in t0s] == [s["step"] for s in t1s]
    for a, b in zip(t0s, t1s, strict=True):
        assert a == b, f"ranks diverged at {a['step']!r}:\n{a}\n{b}"
    by = {s["step"]: s for s in t0s}
    assert by["drain"]["collectives"] == by["writes done"]["collectives"], "the drain issues no collective"
    status, body = by["tool_start b refused"]["reply"]
    assert (
        status == 503
        and body["error"] == "draining"
        and by["tool_start b refused"]["states"]["b"] == "Running"
    )
    assert by["auto_offload b skipped"]["reply"] == [200, {"skipped": "skip:draining"}]
    st = by["status"]["reply"][1]
    assert st["draining"] and st["held_sessions"] == 1 and [h["session_id"] for h in st["held"]] == ["a"]
    polls = [s["reply"][1] for s in t0s if s["step"].startswith("drain poll")]
    assert not polls[0]["drained"] and polls[-1]["drained"], polls
    assert by["undrain"]["reply"][1]["draining"] is False
    assert by["tool_start b"]["reply"][0] == 200
