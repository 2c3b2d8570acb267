"""TEST DOUBLE: a controllable copy engine standing in for the GPU's DMA engine on a CPU-only machine.

Why it exists. On a GPU, ``HiCacheController.start_writing`` / ``start_loading`` enqueue copies on a
side stream and return at once; the copies finish later and ``finish_event.query()`` turns True then.
On CPU, torch has no asynchronous copy engine: ``torch.cpu.Event.query()`` is always True and
every copy happens inside ``start_writing()``. That makes the two states toolkv cares most about —
*backing up* (a GPU→host write in flight) and *loading* (a host→GPU load in flight) — unreachable,
and code that reads KV before a load's acknowledgement would never be caught.

What it replaces, and nothing more:

* ``sglang.srt.managers.cache_controller.device_module`` (the only place HiCache takes events and
  streams from) with :class:`ControlledDeviceModule`: events recorded on a side stream complete only
  when the test says so.
* The three direct copy primitives sgl-kernel provides on CUDA (``transfer_kv_direct``,
  ``transfer_kv_all_layer_direct_lf_pf``, ``transfer_kv_per_layer_direct_pf_lf``) with torch
  indexing that reproduces ``sgl-kernel/csrc/kvcacheio/transfer.cu``. On a side stream they are
  *deferred*: their bytes move at completion time, so a reader that runs before the ack sees stale
  data, and a source slot freed and reused before the ack corrupts the copy — exactly as on a GPU.

Everything else — pools, allocators, the controller, HiRadixCache, its ack processing — is the real
sglang code. Semantics kept from CUDA: each stream executes in FIFO order; an event completes when
every operation submitted to its stream before ``record()`` has completed; ``synchronize()`` blocks
until completion (here: forces it); ``stream.wait_event(e)`` orders the stream after ``e`` (for the
default stream, which runs synchronously with the host here, that means completing ``e`` now).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

Op = Callable[[], None]


def _executed() -> None:
    """What an executed copy leaves in its stream's queue (it must never run again)."""
    raise AssertionError("a copy ran twice")


@dataclass
class ControlledStream:
    """A FIFO queue of deferred copies; ``done`` counts how many have executed."""

    name: str
    engine: ControlledTransferEngine
    ops: list[Op] = field(default_factory=list)
    nbytes: list[int] = field(default_factory=list)
    done: int = 0
    # (position, event): before executing op ``position`` the stream waits for ``event``.
    waits: list[tuple[int, ControlledEvent]] = field(default_factory=list)

    @property
    def pending(self) -> int:
        return len(self.ops) - self.done

    def run_until(self, upto: int) -> int:
        """Execute queued copies in order until ``done == upto``; returns bytes moved."""
        moved = 0
        while self.done < upto:
            if self.waits:
                for pos, ev in self.waits:
                    if pos <= self.done:
                        ev.force()
                self.waits = [(pos, ev) for pos, ev in self.waits if pos > self.done]
            self.ops[self.done]()
            # Positions are what events record, so the list keeps its length; the executed copy's
            # closure (and the index tensors it cloned) is dropped: a soak of 100,000 tool calls
            # would otherwise keep every copy it ever made alive.
            self.ops[self.done] = _executed
            moved += self.nbytes[self.done]
            self.done += 1
        self.engine.bytes_moved[self.name] = self.engine.bytes_moved.get(self.name, 0) + moved
        return moved

    # torch.Stream-like surface used by sglang ------------------------------------------------
    def wait_event(self, event: ControlledEvent) -> None:
        self.engine.wait_event(self, event)

    def wait_stream(self, other: ControlledStream | None) -> None:
        if other is not None:
            ev = ControlledEvent(self.engine)
            ev.record(other)
            self.wait_event(ev)

    def synchronize(self) -> None:
        self.run_until(len(self.ops))

    def query(self) -> bool:
        return self.pending == 0


class ControlledEvent:
    """An event that completes when its stream has executed everything submitted before ``record``."""

    def __init__(self, engine: ControlledTransferEngine, enable_timing: bool = False, **_: Any) -> None:
        self.engine = engine
        self.stream: ControlledStream | None = None
        self.upto = 0
        self.enable_timing = enable_timing

    def record(self, stream: ControlledStream | None = None) -> None:
        stream = stream if stream is not None else self.engine.current
        self.stream = stream
        self.upto = len(stream.ops) if stream is not None else 0

    def query(self) -> bool:
        return self.stream is None or self.stream.done >= self.upto

    def force(self) -> None:
        if self.stream is not None:
            self.stream.run_until(self.upto)

    def synchronize(self) -> None:
        self.force()

    def wait(self, stream: ControlledStream | None = None) -> None:
        self.engine.wait_event(stream if stream is not None else self.engine.current, self)

    def elapsed_time(self, other: ControlledEvent) -> float:
        return 0.0


class ControlledTransferEngine:
    """Holds the side streams and lets a test decide when queued copies complete.

    ``current`` is the stream selected by ``device_module.stream(...)``; ``None`` is the default
    (compute) stream, whose work runs immediately and synchronously with the host.
    """

    def __init__(self) -> None:
        self.streams: list[ControlledStream] = []
        self.current: ControlledStream | None = None
        self.bytes_moved: dict[str, int] = {}

    def new_stream(self) -> ControlledStream:
        s = ControlledStream(name=f"stream{len(self.streams)}", engine=self)
        self.streams.append(s)
        return s

    def submit(self, op: Op, nbytes: int) -> None:
        """Run ``op`` now on the default stream, or queue it on the current side stream."""
        if self.current is None:
            op()
            self.bytes_moved["default"] = self.bytes_moved.get("default", 0) + nbytes
        else:
            self.current.ops.append(op)
            self.current.nbytes.append(nbytes)

    def wait_event(self, stream: ControlledStream | None, event: ControlledEvent) -> None:
        if event.query():
            return
        if stream is None:
            event.force()  # the default stream is synchronous with the host here
        else:
            stream.waits.append((len(stream.ops), event))

    def complete_all(self) -> int:
        """Finish every queued copy on every stream (what a GPU does given time)."""
        moved = 0
        for s in self.streams:
            moved += s.run_until(len(s.ops))
        return moved

    @property
    def pending(self) -> int:
        return sum(s.pending for s in self.streams)


class ControlledDeviceModule:
    """The slice of ``torch.cuda``'s module surface that ``cache_controller`` uses."""

    __name__ = "toolkv.testing.transfer.ControlledDeviceModule"

    def __init__(self, engine: ControlledTransferEngine) -> None:
        self.engine = engine

    def Event(self, enable_timing: bool = False, **kw: Any) -> ControlledEvent:
        return ControlledEvent(self.engine, enable_timing=enable_timing, **kw)

    def Stream(self, *args: Any, **kw: Any) -> ControlledStream:
        return self.engine.new_stream()

    @contextlib.contextmanager
    def stream(self, s: ControlledStream | None) -> Iterator[None]:
        prev = self.engine.current
        self.engine.current = s
        try:
            yield
        finally:
            self.engine.current = prev

    def current_stream(self) -> _DefaultStream:
        return _DefaultStream(self.engine)

    def synchronize(self) -> None:
        self.engine.complete_all()


@dataclass
class _DefaultStream:
    engine: ControlledTransferEngine

    def wait_event(self, event: ControlledEvent) -> None:
        self.engine.wait_event(self.engine.current, event)

    def wait_stream(self, other: ControlledStream) -> None:
        other.synchronize()

    def synchronize(self) -> None:
        self.engine.complete_all()


# ---- CPU versions of sgl-kernel's three direct copy primitives ----------------------------------
# Each takes the exact keyword arguments sglang passes (pool_host/mha.py) and defers the copy to the
# engine. Index tensors are cloned because sglang may reuse or mutate them after the call returns;
# on CUDA, record_stream keeps them alive for the same reason.


def _nbytes(t: torch.Tensor, n_rows: int) -> int:
    return int(n_rows * (t.numel() // max(t.shape[0], 1)) * t.element_size())


def make_transfer_kv_direct(engine: ControlledTransferEngine) -> Callable[..., None]:
    def transfer_kv_direct(
        src_layers: list[torch.Tensor],
        dst_layers: list[torch.Tensor],
        src_indices: torch.Tensor,
        dst_indices: torch.Tensor,
        page_size: int,
    ) -> None:
        assert len(src_layers) == len(dst_layers), "layer lists must pair up"
        assert src_indices.numel() == dst_indices.numel(), "index lists must have the same length"
        src_idx, dst_idx = src_indices.clone(), dst_indices.clone()
        pairs = list(zip(src_layers, dst_layers, strict=True))

        def op() -> None:
            for src, dst in pairs:
                dst[dst_idx] = src[src_idx].to(dst.dtype)

        engine.submit(op, sum(_nbytes(s, src_idx.numel()) for s, _ in pairs))

    return transfer_kv_direct


def make_transfer_kv_all_layer_direct_lf_pf(engine: ControlledTransferEngine) -> Callable[..., None]:
    """Device layer-first → host page-first-direct: host buffer ``[page, layer, page_size, head, dim]``."""

    def transfer_kv_all_layer_direct_lf_pf(
        src_ptrs: list[torch.Tensor],
        dst_ptrs: list[torch.Tensor],
        src_indices: torch.Tensor,
        dst_indices: torch.Tensor,
        page_size: int,
    ) -> None:
        n_layers = len(src_ptrs) // len(dst_ptrs)
        src_idx, dst_idx = src_indices.clone(), dst_indices.clone()
        assert src_idx.numel() % page_size == 0, "page-first copies move whole pages"

        def op() -> None:
            for kv, dst in enumerate(dst_ptrs):
                for layer in range(n_layers):
                    src = src_ptrs[kv * n_layers + layer]
                    for p in range(0, src_idx.numel(), page_size):
                        page = int(dst_idx[p]) // page_size
                        dst[page, layer] = src[src_idx[p : p + page_size]]

        engine.submit(op, sum(_nbytes(s, src_idx.numel()) for s in src_ptrs))

    return transfer_kv_all_layer_direct_lf_pf


def make_transfer_kv_per_layer_direct_pf_lf(engine: ControlledTransferEngine) -> Callable[..., None]:
    """Host page-first-direct → device layer-first, one layer."""

    def transfer_kv_per_layer_direct_pf_lf(
        src_ptrs: list[torch.Tensor],
        dst_ptrs: list[torch.Tensor],
        src_indices: torch.Tensor,
        dst_indices: torch.Tensor,
        layer_id: int,
        page_size: int,
    ) -> None:
        src_idx, dst_idx = src_indices.clone(), dst_indices.clone()
        assert src_idx.numel() % page_size == 0, "page-first copies move whole pages"

        def op() -> None:
            for src, dst in zip(src_ptrs, dst_ptrs, strict=True):
                for p in range(0, src_idx.numel(), page_size):
                    page = int(src_idx[p]) // page_size
                    dst[dst_idx[p : p + page_size]] = src[page, layer_id]

        engine.submit(op, sum(_nbytes(d, src_idx.numel()) for d in dst_ptrs))

    return transfer_kv_per_layer_direct_pf_lf
