"""Lazy free (spec ``LazyFree``) on the real HiRadixCache: a finished offload leaves its GPU copy
to sglang's own eviction instead of freeing it.

What must hold: nothing is freed at the write ack; a session whose copy survives its tool call is
handed over at ``tool_end`` with nothing to load, pinned until its next request holds the path, and
its bytes are the offloaded ones; a copy sglang's eviction takes is demoted to the protected host
copy and restored from it byte for byte; the eager path (``lazy_free=False``) still frees; every
lock, host reference and slot is returned. The production default (``TOOLKV_LAZY_FREE``) is on."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from toolkv.core.manager import ManagerConfig, ToolKVManager
from toolkv.core.treeops import path_to
from toolkv.testing.harness import CacheHarness, HarnessConfig

SHARED = list(range(1, 33))
A = SHARED + list(range(100, 132))
B = SHARED + list(range(200, 232))


def turn(h: CacheHarness, m: ToolKVManager, sid: str, tokens: list[int]) -> torch.Tensor:
    idx = h.alloc(len(tokens))
    assert idx is not None
    h.insert(tokens, idx)
    m.insert(sid, tokens)
    return h.device_kv(h.match(tokens).device_indices).clone()


def step(h: CacheHarness, m: ToolKVManager, now: float, *, writes: bool = False, loads: bool = False) -> None:
    if loads:
        m.tick(now)
    if writes:
        h.complete("write")
    if loads:
        h.complete("load")
    h.check_events()
    m.tick(now)


@pytest.fixture(params=[1, 16], ids=["page1", "page16"])
def hh(request: pytest.FixtureRequest) -> Iterator[CacheHarness]:
    h = CacheHarness(HarnessConfig(page_size=request.param))
    yield h
    h.close()


def offloaded(h: CacheHarness, lazy: bool) -> tuple[ToolKVManager, torch.Tensor, int]:
    """Session ``a`` offloaded (write acknowledged) next to ``b``; the free device slots before."""
    m = ToolKVManager(h.tree, config=ManagerConfig(lazy_free=lazy))
    kv_a = turn(h, m, "a", A)
    turn(h, m, "b", B)
    free_before = h.allocator.available_size()
    m.tool_start("a")
    step(h, m, 1, writes=True)
    assert m.kv_meta("a")["state"] == "Offloaded"
    return m, kv_a, free_before


def test_a_surviving_copy_is_handed_over_with_nothing_to_load(hh: CacheHarness) -> None:
    h = hh
    initial = h.accounting()
    m, kv_a, free_before = offloaded(h, lazy=True)
    assert h.allocator.available_size() == free_before, "nothing is freed at the write ack"
    leaf = h.match(A).last_device_node
    assert all(n.lock_ref == 0 for n in path_to(h.tree, leaf)), "the copy left is sglang's to evict"
    assert leaf.host_ref_counter > 0, "the host copy is protected all the same"
    assert m.counters["left_tokens"] > 0 and m.counters["freed_tokens"] == 0
    h.scribble_unreferenced()
    r = m.tool_end("a", 1)
    assert r["state"] == "Handover" and r["restored_tokens"] == 0, r
    assert leaf.lock_ref > 0, "a resident path is pinned until its next request holds it (ResidentNoPin)"
    assert m.admit("a") and m.kv_meta("a")["state"] == "Runnable"
    assert torch.equal(h.device_kv(h.match(A).device_indices), kv_a)
    m.close("a")
    m.close("b")
    h.drain()
    assert h.accounting() == initial


def test_a_copy_sglang_evicts_is_restored_from_the_protected_host_copy(hh: CacheHarness) -> None:
    h = hh
    initial = h.accounting()
    m, kv_a, _free_before = offloaded(h, lazy=True)
    h.evict_device(10**6)  # another request needs the whole device: sglang's own eviction runs
    assert h.match(A).device_indices.numel() < len(A), "sglang's eviction took the copy left"
    h.evict_host(10**6)  # and the host pool too: the protected copy stays
    h.scribble_unreferenced()
    r = m.tool_end("a", 1)
    assert r["state"] == "Restoring" and r["restored_tokens"] > 0, r
    step(h, m, 2, loads=True)
    assert m.kv_meta("a")["state"] == "Handover"
    assert m.admit("a")
    assert torch.equal(h.device_kv(h.match(A).device_indices), kv_a)
    m.close("a")
    m.close("b")
    h.drain()
    assert h.accounting() == initial


def test_without_lazy_free_the_write_ack_frees_the_copy(hh: CacheHarness) -> None:
    h = hh
    m, _, free_before = offloaded(h, lazy=False)
    assert h.allocator.available_size() - free_before == 32, "a's exclusive suffix is freed"
    assert m.counters["left_tokens"] == 0
    m.close("a")
    m.close("b")


def test_a_plain_radix_cache_frees_whatever_the_setting() -> None:
    """The pin fallback has no eviction that keeps a host copy: lazy free does not apply."""
    with CacheHarness(HarnessConfig(kind="radix")) as h:
        m = ToolKVManager(h.tree, config=ManagerConfig(lazy_free=True))
        assert m.machine.caps.lazy_free is None


def test_the_plugin_turns_it_on_by_default() -> None:
    from toolkv.sglang.config import ToolKVConfig

    assert ToolKVConfig().manager_config().lazy_free is True
    assert ToolKVConfig.from_env({"TOOLKV_LAZY_FREE": "0"}).manager_config().lazy_free is False
    with pytest.raises(ValueError):
        ToolKVConfig.from_env({"TOOLKV_LAZY_FREE": "maybe"})
