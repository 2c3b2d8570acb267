"""Writes that finish together, as on a GPU: the model-based test must still take one spec step.

On a GPU the copy engine finishes queued writes on its own, and sglang's ``writing_check`` retires
every finished ack at the front of its queue in one call. The CUDA fuzz campaign stopped at such a
step: ``WriteAck n2`` retired three writes, the spec's ``WriteAck`` retires one. The conformance
executor now hands sglang the one ack the step names and holds the later ones back. Here the CPU
copy engine double finishes both writes before the first ack (``synchronize``: what a fast GPU
does), and every step must still be the spec's successor; the old executor retired both.
"""

from __future__ import annotations

from _spec_steps import leak_free, spec_bounds, step

from toolkv.verify.toolkv.world import Replayer

BOUNDS = spec_bounds("n1", "n2")


def test_writes_finished_together_are_retired_one_spec_step_at_a_time(replayer: Replayer) -> None:
    r = replayer
    step(r, ["Insert", "a", "Root", "n1"])
    step(r, ["Insert", "b", "Root", "n2"])
    step(r, ["ToolStart", "a"])
    st = step(r, ["ToolStart", "b"])
    assert st["writeKey"] == {"n1": "n1", "n2": "n2"}
    queue = r.h.tree.cache_controller.ack_write_queue
    assert len(queue) == 2
    r.h.synchronize()  # both copies finish before anyone looks: a fast GPU
    assert all(ack.finish_event.query() for ack in queue)
    first = r.obj("n1").id if queue[0].node_ids[0] == r.obj("n1").id else r.obj("n2").id
    name = "n1" if first == r.obj("n1").id else "n2"
    other = "n2" if name == "n1" else "n1"
    st = step(r, ["WriteAck", name])
    assert st["writeKey"][name] == "NoNode" and st["writeKey"][other] == other
    assert len(queue) == 1, "the later write stays for its own step"
    st = step(r, ["WriteAck", other])
    assert st["writeKey"] == {"n1": "NoNode", "n2": "NoNode"}
    assert st["phase"] == {"a": "Offloaded", "b": "Offloaded"}
    leak_free(r)
