"""Tensor-parallel agreement over a ``torch.distributed`` process group.

Every TP rank runs its own scheduler with its own copy of the radix tree; they stay identical only
if every rank takes every decision identically at the same iteration. Decisions that depend on a
local reading (free memory, a CUDA event, the wall clock) are therefore reduced first: ``all_true``
is an all-reduce MIN over 0/1, ``max_time`` an all-reduce MAX over float64 seconds. Both are
*unconditional*: the caller must invoke them on every rank the same number of times, which holds
because they are only reached from code paths that depend on already-agreed state.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from toolkv.core.backends.base import Agreement


class ProcessGroupAgreement:
    """:class:`toolkv.core.backends.base.Agreement` over a gloo (CPU) process group.

    Use the scheduler's ``tp_cpu_group``: a CPU group keeps these tiny reductions off the GPU
    streams, exactly like sglang's own ``writing_check``/``loading_check``.
    """

    def __init__(self, group: Any) -> None:
        self.group = group
        self.world_size = int(dist.get_world_size(group=group)) if group is not None else 1
        self.collectives = 0  # how many reductions were issued (tests check lockstep with it)

    def all_true(self, ok: bool) -> bool:
        if self.world_size <= 1:
            return ok
        t = torch.tensor([1 if ok else 0], dtype=torch.int32)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        self.collectives += 1
        return bool(t.item())

    def max_time(self, t: float) -> float:
        if self.world_size <= 1:
            return t
        x = torch.tensor([t], dtype=torch.float64)
        dist.all_reduce(x, op=dist.ReduceOp.MAX, group=self.group)
        self.collectives += 1
        return float(x.item())


class AgreedClock:
    """The clock every rank's manager sees: agreed once every ``every`` ticks, never backwards.

    Between agreements it holds the last agreed value, so TTL deadlines and sweeps are evaluated
    on identical numbers on every rank. Reducing only every ``every`` iterations keeps the idle
    cost at one integer increment per scheduler iteration; a TTL of minutes does not care about
    a lag of a few dozen iterations.
    """

    def __init__(self, agree: Agreement, every: int = 64, source: Callable[[], float] = time.time) -> None:
        if every < 1:
            raise ValueError("every must be >= 1")
        self.agree = agree
        self.every = every
        self.source = source
        self.ticks = 0
        self.now = 0.0

    def tick(self) -> float:
        if self.ticks % self.every == 0:
            self.now = max(self.now, self.agree.max_time(self.source()))
        self.ticks += 1
        return self.now
