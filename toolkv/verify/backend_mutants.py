"""Seeded defects applied from outside the production code: subclasses of the real backends that
put a fixed bug back, for tests that must fail on it (mutation testing). Named as in the spec's
BUG constant. Nothing in ``toolkv.core`` or ``toolkv.sglang`` imports this module."""

from __future__ import annotations

from toolkv.core.backends.hiradix import HiRadixBackend
from toolkv.core.session import SessionRecord
from toolkv.errors import DeviceMemoryFull


class RingOverrunBackend(HiRadixBackend):
    """Mutant ``RingOverrun``: the restore that took the server down. Each ``tool_end`` starts its
    load at once, in the request handler, after checking only that the *next* producer slot of
    sglang's layer-done counter is free; bunched restores plus sglang's own prefill loads then
    come round to a slot whose load is still in flight."""

    def restore(self, rec: SessionRecord) -> bool:
        counter = self.tree.cache_controller.layer_done_counter
        nxt = (counter.producer_index + 1) % counter.num_counters
        if not self.agree.all_true(bool(counter.events[nxt].finish_event.query())):
            raise DeviceMemoryFull(f"load slot busy; session {rec.session_id!r} stays offloaded")
        runnable = super().restore(rec)
        if self.tree.cache_controller.load_queue:
            self.tree.ready_to_load_host_cache()
        return runnable

    def start_loads(self) -> bool:
        return False


class RingTwoFreeBackend(HiRadixBackend):
    """Mutant ``RingTwoFree``: the tick starts the queue when the next two producer slots are
    free (instead of the whole ring). Two such starts in a row leave sglang one slot, and its own
    next-but-one prefill load reuses a busy slot."""

    def start_loads(self) -> bool:
        ctrl = self.tree.cache_controller
        if not ctrl.load_queue:
            return False
        c = ctrl.layer_done_counter
        nxt = [(c.producer_index + i) % c.num_counters for i in (1, 2)]
        if not self.agree.all_true(all(c.events[i].finish_event.query() for i in nxt)):
            return False
        self.tree.ready_to_load_host_cache()
        return True
