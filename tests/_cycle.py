"""Shared by the manager-level tests on the HiRadixCache harness (``test_restore``,
``test_policy_manager``): a turn of a session lands in the real tree, and one scheduler iteration
as the manager sees it."""

from __future__ import annotations

import torch

from toolkv.core.manager import ToolKVManager
from toolkv.testing.harness import CacheHarness


def turn(
    h: CacheHarness, m: ToolKVManager, sid: str, tokens: list[int], *, ack_writes: bool = False
) -> torch.Tensor:
    """A turn of ``sid`` finishes (its KV lands in the tree, reusing a cached prefix); returns its
    KV. ``ack_writes``: HiCache's own write-through of it is acknowledged too. The request is
    admitted first, as sglang's scheduler does (it ends a hand-over: spec ``Admit``)."""
    m.admit(sid)
    assert h.run_request(tokens)
    m.insert(sid, tokens)
    if ack_writes:
        h.complete("write")
        h.check_events()
    return h.device_kv(h.match(tokens).device_indices).clone()


def step(h: CacheHarness, m: ToolKVManager, now: float, *, writes: bool = False, loads: bool = False) -> None:
    """One scheduler iteration: the tick starts queued loads, copies finish, sglang's ack checks, tick."""
    m.tick(now)
    if writes:
        h.complete("write")
    if loads:
        h.complete("load")
    h.check_events()
    m.tick(now)
