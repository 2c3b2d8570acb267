"""The ring campaign: the stateful machine with sglang's load-slot ring in the model (``Ring = 3``).

Every step of ``RingToolKVMachine`` (``toolkv/verify/toolkv/fuzzing_ring.py``) is checked against the
spec's successor with ``queued`` and ``ring`` compared: bunched restores of three sessions, the
tick's ``start_loads`` (also where the spec's ``StartLoads`` is disabled: it must stutter),
sglang's own loads merging toolkv's queue into their start, slots finishing, acks retired several
at once. Derandomized, so the run is the same every time.
"""

from __future__ import annotations

import json

from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test

from toolkv.verify.toolkv.fuzzing_ring import ring_machine_class

RING_ACTIONS = ("StartLoads", "SysStart", "RingDone", "LoadAck", "ToolEnd", "TreeReset")


def test_ring_campaign_steps_are_spec_steps() -> None:
    machine = ring_machine_class()
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=40,
            stateful_step_count=120,  # a restore needs a deep sequence: offload, ack, restore, start, finish
            derandomize=True,
            database=None,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],  # each step drives a real cache stack
        ),
    )
    totals = machine.totals
    print("ring campaign actions:", json.dumps(dict(sorted(totals.items()))))
    for action in RING_ACTIONS:
        assert totals.get(action, 0) > 0, f"the ring campaign never performed {action}: {totals}"
    # reported, not required: how often a draw bunches restores depends on the base machine's weights
    print(
        "bunched:",
        {k: totals.get(k, 0) for k in ("SysStart took toolkv's queue", "LoadAck of bunched restores")},
    )
