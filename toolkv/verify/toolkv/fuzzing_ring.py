"""The stateful campaign with sglang's load-slot ring in the model (``Ring = 3``, ``SysLoads``).

:class:`ToolKVMachine` runs the spec at ``Ring = 0``: a queued load is in flight and its start is an
internal step of ``LoadAck``, so the step-level refinement check compares ``queued`` and ``ring``
only as two empty values. This machine models the ring the way ``spec/ToolKV.tla`` does and the
conformance replay executes it (:mod:`toolkv.verify.toolkv.world`): a ``ToolEnd`` only queues its load,
``StartLoads`` is the tick's ``start_loads``, ``SysStart`` a prefill batch of another request that
loads a host-only prefix and starts the whole queue (toolkv's loads included), a parked session's
``Admit`` whose request loads its path back the same kind of start (the request's own batch),
``RingDone`` the copy
engine finishing the oldest started load, and ``LoadAck`` sglang's ``loading_check`` retiring every
finished load at the front of the queue (one implementation step standing for the spec's
``LoadAck`` of each key it completes, which the base machine composes). So every step checks the
ring variables against the spec's successor, with bunched restores of several sessions and
sglang's own loads interleaved at sizes no TLC graph reaches.

It is a subclass rather than a switch in the base machine because adding actions changes what
Hypothesis draws: the base campaign, its kill table (examples-to-kill per seed) and its TLC-checked
traces (``tracecheck`` models ``Ring = 0``) stay exactly as they are. This machine writes no traces.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from hypothesis import strategies as st

from toolkv.verify.toolkv.fuzzing import SESSIONS, ToolKVMachine

RING = 3  # producer slots of sglang 0.5.16's LayerDoneCounter


class RingToolKVMachine(ToolKVMachine):
    """The base campaign plus the ring's actions; each step is checked against the spec at
    ``Ring = 3`` (``queued`` and ``ring`` included)."""

    #: the ring's actions join the base draw: starts and slot completions often, so loads progress.
    #: Load-adaptive protection included: a parked session's admission starts its load with the
    #: request's own batch (sglang's ``ready_to_load_host_cache``, the whole queue in one slot).
    _CHOICES: ClassVar[list[str]] = [
        *ToolKVMachine._CHOICES,
        *["start_loads"] * 3,
        *["sys_start"] * 2,
        *["ring_done"] * 4,
        *["load_ack"] * 4,  # a load now needs a start and a slot completion before its ack
        *["tool_start_all"] * 2,
        *["tool_end_all"] * 2,
    ]
    totals: ClassVar[dict[str, int]] = {}  # action counts over every example of this class

    def __init__(self) -> None:
        assert self.trace_dir is None, "trace-check models Ring = 0: the ring campaign writes no traces"
        super().__init__()
        self.bounds = dataclasses.replace(self.bounds, ring=RING, sys_loads=True)
        self.r.b = self.bounds
        self.r.merge_acks = True  # one loading_check may retire several keys: _spec_steps composes them
        self.state = self.r.abstract()

    def admit(self, data: st.DataObject) -> None:
        """The base campaign's admission (handed-over and parked sessions). A parked session's
        request that loads its path back starts the load in its own batch, with toolkv's queue:
        counted, so the campaign shows it happened."""
        pre = self.state
        super().admit(data)
        if len(self.state["ring"]) > len(pre["ring"]):  # only a parked admission starts a load
            self._note("parked Admit started its load")
            if pre["queued"]:
                self._note("parked Admit took toolkv's queue")

    # ---- the ring's actions ------------------------------------------------------------------------
    def start_loads(self, data: st.DataObject) -> None:
        """The tick's ``start_loads``, also where the spec's ``StartLoads`` is not enabled (a load in
        flight, or nothing queued): there it must be a stuttering step."""
        self._do(["StartLoads"])

    def sys_start(self, data: st.DataObject) -> None:
        """A prefill batch of another request loads from host, at sglang's own cadence: at most one
        of its loads is still in flight (the spec's guard; sglang never checks the ring itself)."""
        if sum(1 for slot in self.state["ring"] if slot["who"] == "sys") <= 1:
            took = bool(self.state["queued"])
            if self._do(["SysStart"]) is not None and took:
                self._note("SysStart took toolkv's queue")

    def tool_start_all(self, data: st.DataObject) -> None:
        """Every running session calls a tool in the same iteration."""
        for s in SESSIONS:
            if self.state["phase"][s] == "Running":
                self._do(["ToolStart", s])

    def tool_end_all(self, data: st.DataObject) -> None:
        """Agents' tool calls often end together: every offloaded session's ``tool_end`` in a row,
        so their loads queue up and start together (the bunched restores of the crash)."""
        for s in SESSIONS:
            if self.state["phase"][s] in ("Offloading", "Offloaded"):
                self._do(["ToolEnd", s, self.state["epoch"][s]])

    def ring_done(self, data: st.DataObject) -> None:
        if self.state["ring"]:
            self._do(["RingDone"])

    # ---- base actions the ring changes --------------------------------------------------------------
    def _ack(self, which: str) -> None:
        """A load is acknowledged only once its copy finished (``RingDone``): retire the oldest
        finished load that carries a spec node."""
        if which == "write":
            super()._ack(which)
            return
        by_real = {self.r.nodes.obj[n].id: n for n in self._in_tree()}
        finished = []
        for ack in self.r.h.tree.cache_controller.ack_load_queue:
            if not ack.finish_event.query():
                break
            finished += [by_real[i] for i in ack.node_ids if i in by_real]
        if finished and self._do(["LoadAck", finished[0]]) is not None and len(finished) > 1:
            self._note("LoadAck of bunched restores")

    def _finish_one(self) -> None:
        """Towards idle with the ring: start the queue, finish the oldest copy, retire its ack."""
        s = self.state
        if any(v != "NoNode" for v in s["writeKey"].values()):
            self._ack("write")
        elif s["queued"] and not s["ring"]:
            self._do(["StartLoads"])
        elif s["ring"]:
            self._do(["RingDone"])
        else:
            self._ack("load")

    def _note(self, what: str) -> None:
        self.counts[what] = self.counts.get(what, 0) + 1

    def teardown(self) -> None:
        for key, n in self.counts.items():
            type(self).totals[key] = type(self).totals.get(key, 0) + n
        if not self.failed:  # queued loads start once the ring is idle, then drain as usual
            h, backend = self.r.h, self.r.mgr.backend
            while h.tree.cache_controller.load_queue:
                h.synchronize()
                backend.start_loads()
        super().teardown()


def ring_machine_class(*, seed_class: str = "RingToolKVMachine") -> type[RingToolKVMachine]:
    """A fresh subclass (its own example counter and totals), as Hypothesis instantiates it."""
    attrs: dict[str, Any] = {"examples": 0, "totals": {}}
    return type(seed_class, (RingToolKVMachine,), attrs)


__all__ = ["RING", "RingToolKVMachine", "ring_machine_class"]
