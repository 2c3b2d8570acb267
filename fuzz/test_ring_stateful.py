"""The ring campaign: the stateful machine with sglang's load-slot ring in the model (``Ring = 3``).

Every step of ``RingToolKVMachine`` (``toolkv/verify/toolkv/fuzzing_ring.py``) is checked against the
spec's successor with ``queued`` and ``ring`` compared: bunched restores of three sessions, the
tick's ``start_loads`` (also where the spec's ``StartLoads`` is disabled: it must stutter),
sglang's own loads merging toolkv's queue into their start, slots finishing, acks retired several
at once. Derandomized, so the run is the same every time.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test

from toolkv.verify.toolkv.fuzzing_ring import ring_machine_class

RING_ACTIONS = (
    "StartLoads",
    "SysStart",
    "RingDone",
    "LoadAck",
    "ToolEnd",
    "TreeReset",
    "Park",
    "Unpin",
    "Admit",
)


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
        {
            k: totals.get(k, 0)
            for k in (
                "SysStart took toolkv's queue",
                "LoadAck of bunched restores",
                "parked Admit started its load",
                "parked Admit took toolkv's queue",
            )
        },
    )


def test_a_parked_admission_starts_its_load_with_the_queue_in_its_own_batch() -> None:
    """The step the ring campaign found, directed: a parked session's request is admitted while
    toolkv's restore of another session waits queued behind one of sglang's loads. sglang's
    ``get_new_batch_prefill`` runs ``init_load_back`` and ``ready_to_load_host_cache`` in one step,
    so the request's batch starts its load and toolkv's queued one together, as a start of its own
    (spec ``who = "sys"``); nothing is left queued for the tick. Every step is compared with the
    spec's successor; then, with two of sglang's loads in flight, a second parked admission that
    would load is not a step sglang takes (its cadence) and the spec does not enable it."""
    from toolkv.verify.toolkv import spec as specstep
    from toolkv.verify.toolkv.refinement import Bounds, spec_successor, step_mismatch
    from toolkv.verify.toolkv.world import Replayer, Unrealizable

    b = Bounds(
        nodes=("n1", "n2", "n3"),
        sessions=("s1", "s2", "s3"),
        dev_slots=3,
        host_slots=3,
        max_time=1,
        ttl=1,
        ring=3,
        sys_loads=True,
        policy=True,
        env_writes=False,
        env_locks=False,
    )
    # one loading_check retires the merged load of both keys: the spec's LoadAck of each, in a row
    r = Replayer(b, capacity="spec", fill=False, merge_acks=True)
    try:

        def step(*act: object, then: tuple[list[object], ...] = ()) -> dict[str, Any]:
            pre = r.abstract()
            res = r.apply(list(act), pre)
            assert res.error is None, (act, res.error)
            assert not res.violations, (act, res.violations)
            assert res.post is not None
            want = spec_successor(pre, list(act), b)
            assert want != pre, f"{act} is not enabled in the spec"
            for more in then:
                want = spec_successor(want, more, b)
            mismatch = step_mismatch(want, res.post)
            assert not mismatch, f"{act} is not the spec's step: (spec, implementation) differ in {mismatch}"
            return res.post

        for s, n in (("s1", "n1"), ("s2", "n2"), ("s3", "n3")):
            step("Insert", s, "Root", n)
            step("ToolStart", s)
            step("WriteAck", n)
        step("SysStart")  # one of sglang's own loads in flight: the tick's StartLoads waits
        post = step("ToolEnd", "s2", 1)
        assert post["queued"] == ["n2"], post["queued"]
        step("Park", "s1", 1)
        step("Park", "s3", 1)
        post = step("Admit", "s1")
        assert post["queued"] == [], post["queued"]
        assert post["ring"][-1] == {"keys": ["n1", "n2"], "who": "sys"}, post["ring"]
        assert post["phase"]["s1"] == "Runnable"
        # two of sglang's loads in flight: no batch is built, so s3's request is not admitted now
        pre = r.abstract()
        assert specstep.successor(pre, ["Admit", "s3"], b.rules()) is None
        with pytest.raises(Unrealizable):
            r.apply(["Admit", "s3"], pre)
        assert r.abstract() == pre
        # the loads finish in order and are retired; then s3's admission goes through
        step("RingDone")
        step("RingDone")
        post = step("LoadAck", "n1", then=(["LoadAck", "n2"],))
        assert post["phase"]["s2"] == "Handover"
        post = step("Admit", "s3")
        assert post["ring"] == [{"keys": ["n3"], "who": "sys"}], post["ring"]
        step("RingDone")
        post = step("LoadAck", "n3")
        assert post["loadAcks"] == {"n1": 0, "n2": 0, "n3": 0}
    finally:
        r.close()
