"""Helpers for tests that drive the real cache stack through spec actions (the conformance
``Replayer``) and check each step against the spec; the ``replayer`` fixture is in conftest.py.

A module sets ``BOUNDS = spec_bounds("n1", "n2", ...)`` (the node names it uses; every other bound
is out of reach), takes the ``replayer`` fixture (``hiradix`` unless parametrized indirectly with a
backend name) and calls :func:`step` for each action.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any
from weakref import WeakKeyDictionary

import torch

from toolkv.core.treeops import attached, path_to, walk
from toolkv.verify.toolkv.refinement import Bounds, check_refinement_step
from toolkv.verify.toolkv.world import Replayer

BIG = 10**6

# each replayer's accounting (locks, host references, slots) when it was made
INITIAL: WeakKeyDictionary[Replayer, Any] = WeakKeyDictionary()


def spec_bounds(*nodes: str, sessions: tuple[str, ...] = ("a", "b"), ttl: int = 100) -> Bounds:
    """Bounds whose only limits are the named nodes and sessions."""
    return Bounds(
        nodes=nodes,
        sessions=sessions,
        dev_slots=BIG,
        host_slots=BIG,
        max_time=BIG,
        ttl=ttl,
        max_epoch=BIG,
        max_resets=BIG,
    )


def make_replayer(bounds: Bounds, backend: str = "hiradix", device_tokens: int = 1024) -> Replayer:
    r = Replayer(bounds, backend=backend, capacity="real", device_tokens=device_tokens)
    INITIAL[r] = r.h.accounting()
    return r


def step(r: Replayer, act: Sequence[Any]) -> dict[str, Any]:
    """One spec action, which must apply without error; on a HiRadixCache the implementation must
    also move to the spec's successor (every variable) with every property holding. Returns the
    abstract state after it."""
    pre = r.abstract()
    res = r.apply(list(act), pre)
    assert res.error is None, (act, res.error)
    if r.backend_name == "hiradix":
        assert not res.violations, (act, res.violations)
        assert res.post is not None
        mismatch = check_refinement_step(pre, res.post, list(act), r.b, fits=res.fits, slots=False)
        assert not mismatch, f"{act} is not a spec step: {mismatch}"
    return r.abstract()


def kv_intact(r: Replayer, session: str) -> None:
    """The session's whole path is on the device with exactly the bytes computed for its tokens."""
    rec = r.mgr.sessions[session]
    node, matched = walk(r.h.tree, rec.tokens)
    assert matched == len(rec.tokens) and attached(r.h.tree, node)
    r.h.scribble_unreferenced()
    idx = torch.cat([m.value for m in path_to(r.h.tree, node)])
    assert torch.equal(r.h.device_kv(idx).float(), r.h.expected_kv(list(rec.tokens)))


def leak_free(r: Replayer) -> None:
    """Close every session, let every copy finish: every lock, host reference and slot is back."""
    for sid in list(r.mgr.sessions):
        r.mgr.close(sid)
    r.h.drain()
    assert r.h.accounting() == INITIAL[r], "a lock, host reference or slot was not returned"
