"""The manager's three timers: protection deadlines (the TTLs), idle expiry, and due early restores.

Each is a min-heap of ``(when, seq, session_id)`` with lazy deletion: re-arming pushes a new entry
and the record says which one is current (``deadline_seq``, ``last_active``, ``prefetch_at``), so a
stale entry is skipped when it surfaces instead of being searched for. That keeps arming O(log n)
and the per-iteration check O(1) when nothing is due (the tick compares the heap's head with the
clock), as sglang's and vLLM's schedulers keep their own timed queues.

One sequence number is shared by the three heaps and by the L3 tier's request ids, so that ties
break in arming order and every rank, arming in the same order, makes the same ids.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterator

from toolkv.core.record import SessionRecord

Entry = tuple[float, int, str]  # (when, seq, session id)


class Timers:
    """Deadlines, idle expiries and due early restores of every session (agreed clock seconds)."""

    __slots__ = ("deadlines", "idle", "prefetch_due", "seq")

    def __init__(self) -> None:
        self.deadlines: list[Entry] = []  # spec deadline[s]: TtlSweep releases what is past it
        self.idle: list[Entry] = []  # idle expiry: Close of a session that holds nothing
        self.prefetch_due: list[Entry] = []  # policy auto: when an early restore should start
        self.seq = 0

    def next_seq(self) -> int:
        """The next sequence number (also the L3 tier's request ids: unique, the same on every rank)."""
        self.seq += 1
        return self.seq

    def arm_deadline(self, rec: SessionRecord, when: float) -> None:
        """The session's protection (or pin) ends at ``when`` unless its tool_end comes first;
        earlier entries of the session go stale (``deadline_seq``)."""
        rec.deadline = when
        rec.deadline_seq = self.next_seq()
        heapq.heappush(self.deadlines, (when, rec.deadline_seq, rec.session_id))

    def arm_idle(self, rec: SessionRecord, when: float) -> None:
        """Look at the session again at ``when`` (it is forgotten then if still idle)."""
        if when != math.inf:
            heapq.heappush(self.idle, (when, self.next_seq(), rec.session_id))

    def arm_prefetch(self, rec: SessionRecord, when: float) -> None:
        """Start the session's early restore at ``when`` (``prefetch_at`` says which entry counts)."""
        rec.prefetch_at = when
        heapq.heappush(self.prefetch_due, (when, self.next_seq(), rec.session_id))

    @staticmethod
    def due(heap: list[Entry], now: float) -> Iterator[Entry]:
        """Pop the entries of ``heap`` due at ``now``, earliest first. The consumer may push onto
        the heap while iterating (an entry pushed due now is popped too) or stop early."""
        while heap and heap[0][0] <= now:
            yield heapq.heappop(heap)

    @staticmethod
    def any_due(heap: list[Entry], now: float) -> bool:
        """O(1): whether an entry of ``heap`` is due (the tick's idle-cost check)."""
        return bool(heap) and heap[0][0] <= now
