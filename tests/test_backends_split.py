"""A node split while its KV is in flight or protected, on every backend, over the real caches.

sglang splits a node whenever a request diverges inside it (``_split_node`` from ``match_prefix`` or
``insert``): the suffix keeps its identity, a fresh prefix takes its place, and the prefix copies
``lock_ref``, ``write_through_pending_id`` and the host/device indices but not
``host_ref_counter``. Each test drives the real stack through spec actions (the conformance
``Replayer``) and checks after every step that the implementation moved exactly as the spec says
(HiRadixCache: the spec's successor, every variable) and, at the end, that the KV bytes of the whole
path are the ones computed for its tokens and that every counter is back at its initial value.

The pin and shadow backends copy synchronously: nothing is in flight after ``tool_start`` or
``tool_end`` returns, so their "during a write / load" cases are a split right after those calls.
"""

from __future__ import annotations

import pytest
from _spec_steps import kv_intact, leak_free, spec_bounds, step

from toolkv.core.treeops import attached, path_to
from toolkv.verify.toolkv.world import Replayer

BOUNDS = spec_bounds("n1", "n2", "n3")


# ---- HiRadixCache ------------------------------------------------------------------------------------
def admitted(r: Replayer, s: str) -> dict[str, object]:
    """The session's next request is admitted (its lock replaces the hand-over's pin), runs and
    finishes (its lock goes): spec ``Admit`` then ``Unlock``."""
    step(r, ["Admit", s])
    return step(r, ["Unlock", r.abstract()["ref"][s]])


@pytest.mark.parametrize("replayer", ["hiradix"], indirect=True)
def test_hiradix_split_during_the_write(replayer: Replayer) -> None:
    r = replayer
    step(r, ["Insert", "a", "Root", "n1"])
    st = step(r, ["ToolStart", "a"])
    assert st["phase"]["a"] == "Offloading" and st["writeKey"]["n1"] == "n1"
    st = step(r, ["Split", "n1", "n2"])  # the prefix inherits the pending write
    assert st["writeKey"]["n2"] == "n1" and st["dev"]["n2"] and st["host"]["n2"]
    assert st["hostRef"] == {"n1": 1, "n2": 0, "n3": 0}
    st = step(r, ["WriteAck", "n1"])  # one ack covers both halves; both are freed
    assert st["phase"]["a"] == "Offloaded"
    assert not st["dev"]["n1"] and not st["dev"]["n2"] and st["host"]["n1"] and st["host"]["n2"]
    step(r, ["ToolEnd", "a", 1])
    st = step(r, ["LoadAck", "n1"])
    assert st["phase"]["a"] == "Handover"
    admitted(r, "a")
    kv_intact(r, "a")
    leak_free(r)


@pytest.mark.parametrize("replayer", ["hiradix"], indirect=True)
def test_hiradix_split_during_the_load(replayer: Replayer) -> None:
    r = replayer
    step(r, ["Insert", "a", "Root", "n1"])
    step(r, ["ToolStart", "a"])
    step(r, ["WriteAck", "n1"])
    st = step(r, ["ToolEnd", "a", 1])
    assert st["phase"]["a"] == "Restoring" and st["loadKey"]["n1"] == "n1"
    st = step(r, ["Split", "n1", "n2"])  # the prefix is part of the same load: loading too
    assert st["loadKey"]["n2"] == "n1" and st["phase"]["a"] == "Restoring"
    assert st["lockRef"]["n2"] == st["lockRef"]["n1"] == 2  # the load's path lock + the restore pin
    st = step(r, ["LoadAck", "n1"])
    assert st["phase"]["a"] == "Handover" and st["loadKey"]["n2"] == "NoNode"
    assert st["lockRef"] == {"n1": 1, "n2": 1, "n3": 0}, "the restore's pin is handed over"
    st = admitted(r, "a")
    assert st["lockRef"] == {"n1": 0, "n2": 0, "n3": 0}
    kv_intact(r, "a")
    leak_free(r)


@pytest.mark.parametrize("replayer", ["hiradix"], indirect=True)
def test_hiradix_split_of_a_protected_host_copy(replayer: Replayer) -> None:
    r = replayer
    step(r, ["Insert", "a", "Root", "n1"])
    step(r, ["ToolStart", "a"])
    step(r, ["WriteAck", "n1"])
    st = step(r, ["Split", "n1", "n2"])  # host-only, protected: the protection stays on the suffix
    assert st["hostRef"] == {"n1": 1, "n2": 0, "n3": 0} and st["prot"]["a"] == "n1"
    assert not st["dev"]["n2"] and st["host"]["n2"]
    r.h.evict_host(10**6)  # sglang's own host eviction cannot take either half now
    st = r.abstract()
    assert st["status"]["n1"] == st["status"]["n2"] == "InTree"
    step(r, ["ToolEnd", "a", 1])
    st = step(r, ["LoadAck", "n1"])
    assert st["phase"]["a"] == "Handover" and st["hostRef"]["n1"] == 0
    admitted(r, "a")
    kv_intact(r, "a")
    leak_free(r)


# ---- pin (plain RadixCache) --------------------------------------------------------------------------
@pytest.mark.parametrize("replayer", ["pin"], indirect=True)
@pytest.mark.parametrize("split", ["n1", "n2"], ids=["the pinned leaf", "a pinned ancestor"])
def test_pin_split_keeps_the_path_pinned_and_returns_every_lock(replayer: Replayer, split: str) -> None:
    r = replayer
    step(r, ["Insert", "a", "Root", "n2"])
    step(r, ["Insert", "a", "n2", "n1"])  # a's path: n2 -> n1
    step(r, ["ToolStart", "a"])  # pinned: one path lock from n1 up
    step(r, ["Split", split, "n3"])
    path = path_to(r.h.tree, r.obj("n1"))
    assert len(path) == 3 and all(m.lock_ref == 1 for m in path)  # the prefix inherits the lock
    r.h.evict_device(10**6)  # the pinned path survives eviction pressure
    assert all(attached(r.h.tree, m) for m in path)
    step(r, ["ToolEnd", "a", 1])
    assert all(m.lock_ref == 1 for m in path), "handed over: pinned until the next request"
    admitted(r, "a")
    assert all(m.lock_ref == 0 for m in path)
    kv_intact(r, "a")
    leak_free(r)


# ---- shadow (plain RadixCache) -----------------------------------------------------------------------
@pytest.mark.parametrize("replayer", ["shadow"], indirect=True)
def test_shadow_split_of_the_shared_prefix_while_the_branch_is_on_host(replayer: Replayer) -> None:
    r = replayer
    step(r, ["Insert", "a", "Root", "n1"])  # n1: the prefix a and b share
    step(r, ["Insert", "a", "n1", "n2"])  # a's own branch
    step(r, ["Insert", "b", "n1", "n3"])
    step(r, ["ToolStart", "a"])  # only a's exclusive branch (n2) goes to host and leaves the tree
    assert not attached(r.h.tree, r.obj("n2")) and attached(r.h.tree, r.obj("n1"))
    half = len(r.tokens["n1"]) // 2
    r.h.match(r.tokens["n1"][:half])  # a request diverges inside the shared prefix: sglang splits it
    assert len(r.obj("n1").key) == len(r.tokens["n1"]) - half  # n1 is the suffix now
    step(r, ["ToolEnd", "a", 1])  # re-inserted under the (now split) prefix
    assert r.mgr.sessions["a"].state == "Handover"
    kv_intact(r, "a")
    kv_intact(r, "b")
    leak_free(r)


@pytest.mark.parametrize("replayer", ["shadow"], indirect=True)
def test_shadow_split_of_the_restored_branch(replayer: Replayer) -> None:
    r = replayer
    step(r, ["Insert", "a", "Root", "n1"])
    step(r, ["ToolStart", "a"])
    step(r, ["ToolEnd", "a", 1])  # a fresh node object holds the restored tokens
    step(r, ["Split", "n1", "n2"])  # the name follows its tokens to the re-inserted node
    admitted(r, "a")
    step(r, ["Insert", "a", "n1", "n3"])  # the next turn, then the next tool call
    step(r, ["ToolStart", "a"])
    step(r, ["ToolEnd", "a", 2])
    kv_intact(r, "a")
    leak_free(r)
