"""Tensor parallelism for the decode offload manager: two gloo ranks, each with its own REAL
``DecodeKVCacheOffloadManager`` (own pools, own host pool, own controller and backup thread, own
files in a shared storage directory), driven in lockstep by the same seeded scheduler, while each
rank's copy engine and backup thread finish at their own pace (rank 0 eagerly, rank 1 lazily).

The manager must keep the ranks identical anyway: ``check_offload_progress`` agrees the number of
write and backup acks with an ``all_reduce(MIN)`` over the TP group before acting. After every
scheduler step the ranks exchange (``all_gather_object``) the lockstep part of their abstract
state (everything except per-rank engine progress and storage) and stop at the first difference.

Rank 0 also writes the whole run as one trace for ``research.decode_offload.tracecheck`` (with
``Ranks = {k1, k2}``). Run by ``fuzz/test_decode_tp.py`` in two spawned processes; each writes
``rank{r}.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import traceback
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

RANK_FIELDS = ("odata", "stored", "store")  # per rank: engine progress and the rank's own files
RIDS = ("r1", "r2", "r3", "r4", "r5")
GLOBAL = ("admit", "decode", "decode", "decode", "offload", "offload", "finish", "check", "check")


def lockstep_view(s: dict[str, Any]) -> dict[str, Any]:
    """The part of a rank's abstract state every rank must agree on (per-rank fields are keyed by
    the rank's name; their values must still agree for ``freed`` and ``hostFree``)."""
    out = {k: v for k, v in s.items() if k not in RANK_FIELDS}
    out["freed"] = list(s["freed"].values())
    out["hostFree"] = list(s["hostFree"].values())
    return out


def run_rank(
    rank: int, world: int, port: int, out_dir: str, seed: int, steps: int, mutants: list[str | None]
) -> None:
    """One TP rank: one episode per entry of ``mutants`` (None: the class as shipped), each
    written to ``{out_dir}/{episode}/rank{rank}.json``."""
    import torch.distributed as dist

    os.environ["OMP_NUM_THREADS"] = "1"
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=60),
    )
    import logging

    logging.disable(logging.ERROR)  # sglang logs every refused host write
    for i, mutant in enumerate(mutants):
        out = Path(out_dir, f"{i}-{mutant or 'none'}")
        out.mkdir(parents=True, exist_ok=True)
        episode(rank, world, str(out), seed, steps, mutant)
        dist.barrier()
    dist.destroy_process_group()


def episode(rank: int, world: int, out_dir: str, seed: int, steps: int, mutant: str | None) -> None:
    """Build, drive ``steps`` scheduler steps, drain, write ``rank{rank}.json``."""
    import torch.distributed as dist

    from research.decode_offload import mutants as decode_mutants
    from research.decode_offload.harness import DecodeHarnessConfig, DecodeOffloadHarness
    from research.decode_offload.world import DecodeWorld

    result: dict[str, Any] = {"rank": rank, "ok": True, "failure": None, "diverged_at": None, "steps": 0}
    progress: list[list[list[int]]] = []  # per step: every rank's (copies done, backups written, acks queued)
    sched = random.Random(seed)  # identical on every rank: the scheduler's decisions
    local = random.Random(seed * 1000 + rank)  # this rank's engines
    eager = 0.8 if rank == 0 else 0.15
    cfg = DecodeHarnessConfig(device_tokens=24, host_ratio=0.25)
    group = dist.group.WORLD
    tracer: _Tracer | None = None
    host_size = 0
    with decode_mutants.apply(mutant):
        h = DecodeOffloadHarness(
            cfg, group=group, rank=rank, world=world, storage_dir=Path(out_dir) / "store"
        )
        try:
            w = DecodeWorld(h, RIDS, prompt_len=3, max_new=12, rank_name=f"k{rank + 1}")
            host_size = int(h.host_pool.size)
            tracer = _Tracer(rank, world, w)
            for i in range(steps):
                action = sched.choice(GLOBAL)
                rid = sched.choice(RIDS)
                if action in ("admit", "decode", "offload", "finish"):
                    tracer.step(getattr(w, action)(rid))
                else:
                    tracer.step(w.check())
                while local.random() < eager and tracer.step(w.copy()):
                    pass
                while local.random() < eager and tracer.step(w.store()):
                    pass
                tracer.gather()
                w.check_real()
                mine = lockstep_view(w.abstract())
                views: list[Any] = [None] * world
                dist.all_gather_object(views, mine)
                mine_p = [w.copies_done(), w.freed(), int(h.controller.ack_backup_queue.qsize())]
                prog: list[Any] = [None] * world
                dist.all_gather_object(prog, mine_p)
                progress.append(prog)
                result["steps"] = i + 1
                if any(v != views[0] for v in views):
                    result.update(
                        ok=False, diverged_at=i + 1, failure=f"ranks diverged at step {i + 1}: {views}"
                    )
                    break
            if result["ok"]:
                w.drain()  # the same number of checks on every rank (lockstep increments)
                w.check_quiescent()
                views = [None] * world
                dist.all_gather_object(views, lockstep_view(w.abstract()))
                if any(v != views[0] for v in views):
                    result.update(ok=False, failure="ranks differ after draining")
        except Exception as exc:
            result.update(
                ok=False, failure=f"{type(exc).__name__}: {exc}", trace=traceback.format_exc()[-2000:]
            )
        finally:
            h.close()
    result["progress"] = progress
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    if rank == 0 and tracer is not None:
        tracer.write(Path(out_dir, "trace.jsonl"), h.cfg.device_tokens, int(host_size))


class _Tracer:
    """Builds one trace of the whole TP system for ``research.decode_offload.tracecheck``: per
    scheduler step, the lockstep action (recorded once, with every rank's per-rank fields), then
    rank 0's engine steps, then rank 1's (they touch only their own rank's fields, so this order
    is a valid interleaving of what ran in parallel)."""

    PER_RANK = ("odata", "stored", "freed", "hostFree", "store")

    def __init__(self, rank: int, world: int, w: Any) -> None:
        self.rank, self.world, self.w = rank, world, w
        self.mine: list[dict[str, Any]] = [{"act": ["Init"], "fits": True, "s": w.abstract()}]
        self.records: list[dict[str, Any]] = []
        self.gather()

    def step(self, res: Any) -> bool:
        """Record a step that changed something or was refused (as the fuzz machine does)."""
        if res.changed or not res.fits:
            self.mine.append({"act": res.act, "fits": res.fits, "s": self.w.abstract()})
        return bool(res.changed)

    def gather(self) -> None:
        import torch.distributed as dist

        every: list[Any] = [None] * self.world
        dist.all_gather_object(every, self.mine)
        self.mine = []
        if self.rank != 0:
            return
        lockstep = [r for r in every[0] if r["act"][0] not in ("Copy", "Store")]
        for g in lockstep:  # the same lockstep records on every rank
            s = dict(g["s"])
            prev = self.records[-1]["s"] if self.records else g["s"]
            for f in self.PER_RANK:
                s[f] = {}
                for k, recs in enumerate(every):
                    # a rank whose step changed nothing it records (only when ranks already
                    # disagree) keeps its fields from the previous record
                    name = f"k{k + 1}"
                    mine = next((r["s"] for r in recs if r["act"] == g["act"]), None)
                    s[f][name] = mine[f][name] if mine is not None else prev[f][name]
            self.records.append({**g, "s": s})
        for recs in every:
            for r in recs:
                if r["act"][0] in ("Copy", "Store"):
                    s = dict(self.records[-1]["s"])
                    for f in self.PER_RANK:
                        s[f] = {**s[f], **r["s"][f]}
                    self.records.append({**r, "s": s})

    def write(self, path: Path, dev_slots: int, host_slots: int) -> None:
        header = {
            "reqs": list(RIDS),
            "ranks": [f"k{r + 1}" for r in range(self.world)],
            "pre": 3,
            "max_len": 15,
            "stride": 1,
            "dev_slots": dev_slots,
            "host_slots": host_slots,
        }
        path.write_text("\n".join(json.dumps(x) for x in [{"header": header}, *self.records]) + "\n")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spawn(
    out_dir: Path,
    *,
    seed: int = 3,
    steps: int = 120,
    mutants: Sequence[str | None] = (None,),
    timeout: float = 300,
) -> dict[str, list[dict[str, Any]]]:
    """Run the episodes on two spawned gloo ranks; episode name -> [rank 0 result, rank 1 result]."""
    import time

    from torch.multiprocessing.spawn import spawn as mp_spawn

    world = 2
    ctx = mp_spawn(  # type: ignore[no-untyped-call]
        run_rank,
        args=(world, _free_port(), str(out_dir), seed, steps, list(mutants)),
        nprocs=world,
        join=False,
    )
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            raise TimeoutError("TP ranks hung")
    return {
        m or "none": [
            json.loads(Path(out_dir, f"{i}-{m or 'none'}", f"rank{r}.json").read_text()) for r in range(world)
        ]
        for i, m in enumerate(mutants)
    }


def summary(results: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per episode: ok, steps, steps where the ranks' copy engines / queued backup acks differed."""
    out: dict[str, Any] = {}
    for name, (r0, r1) in results.items():
        prog = r0["progress"]
        out[name] = {
            "ok": r0["ok"] and r1["ok"],
            "steps": r0["steps"],
            "diverged_at": r0["diverged_at"],
            "steps_copies_skewed": sum(1 for p in prog if p[0][0] != p[1][0]),
            "steps_backup_acks_skewed": sum(1 for p in prog if p[0][2] != p[1][2]),
            "failure": (r0["failure"] or r1["failure"] or "")[:160] or None,
        }
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--seed", type=int, default=3)


def run(args: argparse.Namespace) -> int:
    """The shipped class and the LocalAckCounts mutant on two ranks; the summary as JSON."""
    import tempfile

    if args.steps < 1:
        print("decode tp: --steps must be >= 1", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="toolkv-decode-tp-") as d:
        s = summary(spawn(Path(d), seed=args.seed, steps=args.steps, mutants=(None, "LocalAckCounts")))
    print(json.dumps(s, indent=2))
    return 0 if s["none"]["ok"] and not s["LocalAckCounts"]["ok"] else 1


def main(argv: list[str] | None = None) -> int:
    """``python -m research.decode_offload.tp [--steps N] [--seed S]``."""
    p = argparse.ArgumentParser(prog="python -m research.decode_offload.tp")
    add_arguments(p)
    return run(p.parse_args(argv))


__all__ = [
    "RANK_FIELDS",
    "add_arguments",
    "episode",
    "lockstep_view",
    "main",
    "run",
    "run_rank",
    "spawn",
    "summary",
]


if __name__ == "__main__":
    raise SystemExit(main())
