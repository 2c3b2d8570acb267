"""An admission that arrives while the session's restore is still loading, as the fuzz campaign
draws it (``AdmitLoading``, toolkv/verify/toolkv/world.py), on the real HiRadixCache through the
conformance ``Replayer``: the admission itself changes nothing the spec sees (a stutter), and the
load ack is the spec's ``LoadAck`` then ``Admit`` in a row (the hand-over ends at once, the
request's lock replaces the pin). With the admission forgotten (a plausible bug: the early
admission dropped), the load ack leaves the session in Handover, pinned, and the refinement check
of ``LoadAck`` + ``Admit`` fails: the check is known to fail on it."""

from __future__ import annotations

from typing import Any

import pytest
from _spec_steps import kv_intact, leak_free, spec_bounds, step

from toolkv.verify.toolkv.refinement import check_refinement_step, spec_successor
from toolkv.verify.toolkv.world import Replayer

BOUNDS = spec_bounds("n1", "n2")


def load_ack_then_admit(r: Replayer, s: str) -> list[str]:
    """The load ack of ``s``'s restore; the spec steps it must stand for, LoadAck then Admit:
    returns the variables where the implementation differs from them (none: it refines them)."""
    pre = r.abstract()
    res = r.apply(["LoadAck", pre["ref"][s]], pre)
    assert res.error is None and res.post is not None
    mid = spec_successor(pre, ["LoadAck", pre["ref"][s]], r.b, fits=res.fits, slots=False)
    return check_refinement_step(mid, res.post, ["Admit", s], r.b, fits=res.fits, slots=False) or []


@pytest.mark.parametrize("bug", [None, "bug"])
@pytest.mark.parametrize("replayer", ["hiradix"], indirect=True)
def test_an_admission_while_loading_is_the_spec_admit_at_the_load_ack(
    replayer: Replayer, bug: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    if bug:
        from toolkv.core.session.handover import Handover

        real = Handover.admit

        def forgetful(self: Any, session_id: str) -> bool:
            rec = self.s.sessions.get(session_id)
            return False if rec is not None and rec.state == "Restoring" else real(self, session_id)

        monkeypatch.setattr(Handover, "admit", forgetful)
    r = replayer
    step(r, ["Insert", "a", "Root", "n1"])
    step(r, ["ToolStart", "a"])
    step(r, ["WriteAck", "n1"])
    st = step(r, ["ToolEnd", "a", 1])
    assert st["phase"]["a"] == "Restoring" and st["loadKey"]["n1"] == "n1"
    before = r.abstract()
    r.apply(["AdmitLoading", "a"], before)
    assert r.abstract() == before, "the admission alone changes nothing the spec sees"
    mismatch = load_ack_then_admit(r, "a")
    st = r.abstract()
    assert (not mismatch) is (bug is None), mismatch
    if bug is None:
        assert st["phase"]["a"] == "Runnable" and st["extLock"]["n1"] and st["lockRef"]["n1"] == 1
        step(r, ["Unlock", "n1"])  # the request finishes
        kv_intact(r, "a")
        leak_free(r)
    else:
        assert st["phase"]["a"] == "Handover", "pinned until a later request or the TTL"
