"""Copy time for the CPU copy engine: the harness's DMA test double, completed on simulated time.

On CPU, HiCache's writes and loads are queued on :class:`~toolkv.testing.transfer.
ControlledTransferEngine` streams and complete only when told to. The twin tells them at the
simulated instant a real copy engine would have finished: each side stream is a FIFO that moves
``kv_bytes_per_token`` bytes per token at its direction's rate (:class:`~toolkv.twin.profile.
TimeProfile`), starting when the copy was queued or when the previous copy finished. The bytes
themselves are the harness's tiny KV; only their token count matters for the time.
"""

from __future__ import annotations

from typing import Any

from toolkv.twin.profile import TimeProfile


class TimedCopies:
    """Stamps every copy queued on the write and load streams with its finish time and lets
    the ones that are due complete."""

    def __init__(self, harness: Any, profile: TimeProfile) -> None:
        self.profile = profile
        self.engine = harness.engine
        ctrl = harness.tree.cache_controller if harness.is_hi else None
        kv = harness.kv_pool
        # tiny bytes per token in the harness pools: K and V, every layer
        self.tiny = (
            2 * harness.cfg.layers * harness.cfg.heads * harness.cfg.head_dim * kv.store_dtype.itemsize
        )
        self.streams: list[tuple[Any, str]] = []
        if ctrl is not None and hasattr(ctrl, "l2_transfer_engine"):  # sglang 0.5.21+ (l2_transfer.py)
            eng = ctrl.l2_transfer_engine
            self.streams = [(eng.device_to_host_stream, "d2h"), (eng.host_to_device_stream, "h2d")]
        elif ctrl is not None:
            self.streams = [(ctrl.write_stream, "d2h"), (ctrl.load_stream, "h2d")]
        self.finish: dict[int, list[float]] = {id(s): [] for s, _ in self.streams}
        self.tokens_moved = {"d2h": 0.0, "h2d": 0.0}

    def stamp(self, now: float) -> None:
        """Give every copy queued since the last call its finish time (FIFO per direction)."""
        for s, direction in self.streams:
            fin = self.finish[id(s)]
            while len(fin) < len(s.ops):
                tokens = s.nbytes[len(fin)] / self.tiny
                start = max(now, fin[-1] if fin else now)
                fin.append(start + self.profile.copy_s(tokens, direction))
                self.tokens_moved[direction] += tokens

    def complete_due(self, now: float) -> None:
        """Run every copy whose finish time has come (sglang sees its event complete)."""
        for s, _ in self.streams:
            fin = self.finish[id(s)]
            upto = s.done
            while upto < len(fin) and fin[upto] <= now + 1e-12:
                upto += 1
            if upto > s.done:
                s.run_until(upto)

    def last_finish(self, direction: str) -> float:
        """When the last copy queued in ``direction`` finishes (0 with none queued)."""
        for s, d in self.streams:
            if d == direction and self.finish[id(s)]:
                return self.finish[id(s)][-1]
        return 0.0

    def next_finish(self, now: float) -> float | None:
        """The earliest finish time after ``now`` of a copy still queued, or None."""
        out = None
        for s, _ in self.streams:
            fin = self.finish[id(s)]
            if s.done < len(fin):
                t = fin[s.done]
                out = t if out is None else min(out, t)
        return out
