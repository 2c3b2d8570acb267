"""How long a scheduler iteration takes, for the drivers that run a server's scheduler side on a
clock of their own (the twin, the CPU soak, the demo).

A driver runs sglang's scheduler loop one iteration at a time and moves its clock by what the
iteration took; toolkv's tick reads that clock (:class:`toolkv.sglang.tp.AgreedClock` over the
driver's ``now``). The drivers differ only in what an iteration costs, so that is the interface:

- :class:`ModelledGpuTime` (the twin): a forward's modelled GPU time from a
  :class:`~toolkv.twin.profile.TimeProfile`; a prefill into prefixes HiCache is loading also waits
  for those loads (the schedule stream waits on the load's finish event). An iteration that ran no
  forward takes no time: the driver jumps to its next event instead.
- :class:`FixedIteration` (the soak, the demo): every iteration takes the same time whatever ran,
  so time counts iterations (the soak's ``tick_s``, the demo's one iteration).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from toolkv.twin.copies import TimedCopies
    from toolkv.twin.profile import TimeProfile
    from toolkv.twin.scheduler import Batch


class Clock(Protocol):
    """The time one scheduler iteration takes on a driver's clock."""

    def iteration_s(self, batch: Batch | None, now: float) -> float:
        """Seconds from ``now`` until the iteration ends that ran ``batch`` (None: no forward, or a
        driver that does not model its forwards)."""
        ...


@dataclass(frozen=True)
class FixedIteration:
    """Every iteration takes ``step_s``, whatever ran: time counts scheduler iterations."""

    step_s: float

    def iteration_s(self, batch: Batch | None, now: float) -> float:
        return self.step_s


@dataclass(frozen=True)
class ModelledGpuTime:
    """The twin's GPU time: the profile's time for the forward; a prefill whose prefixes HiCache
    is loading ends no earlier than the last host-to-device copy queued (``copies``)."""

    profile: TimeProfile
    copies: TimedCopies

    def iteration_s(self, batch: Batch | None, now: float) -> float:
        if batch is None:
            return 0.0
        if batch.mode == "decode":
            return self.profile.decode_s(len(batch.reqs), batch.context)
        end = now + self.profile.prefill_s(batch.chunks)
        if batch.loads:  # the forward waits for the layers HiCache is loading into its prefixes
            end = max(end, self.copies.last_finish("h2d"))
        return end - now
