"""The CPU harness is real: KV round-trips byte-exact through the real HiRadixCache, every counter
returns to its initial value, and in-flight transfers are observable states (not instant)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from toolkv.testing.harness import WRITE_POLICIES, CacheHarness, HarnessConfig

PAGE_SIZES = (1, 16)


@pytest.fixture
def make() -> Iterator[type[CacheHarness]]:
    made: list[CacheHarness] = []

    class _Make(CacheHarness):
        def __init__(self, cfg: HarnessConfig | None = None, seed: int = 0) -> None:
            super().__init__(cfg, seed=seed)
            made.append(self)

    yield _Make
    for h in made:
        h.close()


def _leaf(h: CacheHarness, tokens: list[int]) -> object:
    node = h.match(tokens).last_device_node
    assert node is not h.tree.root_node
    return node


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("policy", WRITE_POLICIES)
def test_round_trip_is_byte_exact_and_leak_free(
    make: type[CacheHarness], page_size: int, policy: str
) -> None:
    h = make(HarnessConfig(page_size=page_size, write_policy=policy), seed=page_size)
    initial = h.accounting()
    tokens = list(range(1, 65))
    idx = h.alloc(64)
    assert idx is not None
    original = h.device_kv(idx).clone()
    assert h.insert(tokens, idx) == 0
    node = _leaf(h, tokens)

    if policy != "write_back" and not node.backuped:  # write_through_selective backs up on the 2nd hit
        assert h.tree.write_backup(node) == 64
    if policy != "write_back":
        h.complete("write")
        h.tree.writing_check()
        assert node.write_through_pending_id is None
        assert torch.equal(h.host_kv(node.host_value), original), "host copy differs after the write ack"

    # The real eviction path: write-through drops the GPU copy of a backed-up leaf, write-back
    # writes it to host first (synchronously) and then drops it.
    assert h.evict_device(64) == 64
    assert node.evicted and node.backuped
    h.scribble_unreferenced()  # other requests reuse the freed slots

    dev = h.tree.load_back(node)
    assert dev is not None and len(dev) == 64
    assert h.tree.ready_to_load_host_cache() >= 0
    h.complete("load")
    h.tree.loading_check()
    assert torch.equal(h.device_kv(node.value), original), "restored KV differs from what was offloaded"

    h.drain()
    assert h.accounting() == initial


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_backing_up_is_an_observable_state(make: type[CacheHarness], page_size: int) -> None:
    h = make(HarnessConfig(page_size=page_size))
    tokens = list(range(100, 132))
    idx = h.alloc(32)
    assert idx is not None
    original = h.device_kv(idx).clone()
    h.insert(tokens, idx)  # write_through: the insert starts the GPU→host write
    node = _leaf(h, tokens)

    assert node.backuped and node.write_through_pending_id is not None
    assert h.pending("write") == 1
    for _ in range(3):  # the scheduler polls; nothing completes until the copy engine does
        h.check_events()
    assert node.write_through_pending_id is not None and node.lock_ref > 0
    assert not torch.equal(h.host_kv(node.host_value), original), "host bytes arrived before the ack"

    h.complete("write")
    h.check_events()
    assert node.write_through_pending_id is None and node.lock_ref == 0
    assert torch.equal(h.host_kv(node.host_value), original)


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_reading_before_the_load_ack_sees_stale_bytes(make: type[CacheHarness], page_size: int) -> None:
    h = make(HarnessConfig(page_size=page_size))
    tokens = list(range(7, 7 + 48))
    idx = h.alloc(48)
    assert idx is not None
    original = h.device_kv(idx).clone()
    h.insert(tokens, idx)
    node = _leaf(h, tokens)
    h.complete("write")
    h.check_events()
    h.evict_device(48)
    h.scribble_unreferenced()

    assert h.tree.load_back(node) is not None
    h.tree.ready_to_load_host_cache()
    assert not node.evicted, "load_back marks the node on-device before any byte moved"
    assert h.pending("load") == 1
    h.check_events()
    assert node in h.tree.ongoing_load_back.values(), "the load is still in flight"
    assert not torch.equal(h.device_kv(node.value), original), "a premature read must see stale bytes"

    h.complete("load")
    h.check_events()
    assert node not in h.tree.ongoing_load_back.values()
    assert torch.equal(h.device_kv(node.value), original)


def test_freeing_gpu_before_the_write_ack_corrupts_the_host_copy(make: type[CacheHarness]) -> None:
    """Caveat 7 is reachable on CPU: the harness would catch an implementation that frees early."""
    h = make(HarnessConfig())
    tokens = list(range(1, 41))
    idx = h.alloc(40)
    assert idx is not None
    original = h.device_kv(idx).clone()
    h.insert(tokens, idx)
    node = _leaf(h, tokens)
    h.tree.dec_lock_ref(node)  # pretend the write lock was not there (what a buggy manager ignores)
    h.tree._evict_backuped(node)  # free the GPU copy while the write is still in flight
    h.scribble_unreferenced()
    h.complete("write")
    assert not torch.equal(h.host_kv(node.host_value), original)
    h.tree.inc_lock_ref(node)  # rebalance so the real ack processing can run
    h.check_events()


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_plain_radix_cache_lock_and_evict(make: type[CacheHarness], page_size: int) -> None:
    h = make(HarnessConfig(kind="radix", page_size=page_size))
    initial = h.accounting()
    tokens = list(range(1, 33))
    idx = h.alloc(32)
    assert idx is not None
    h.insert(tokens, idx)
    node = _leaf(h, tokens)
    h.tree.inc_lock_ref(node)
    assert h.evict_device(32) == 0, "a locked node is not evictable"
    h.tree.dec_lock_ref(node)
    assert h.evict_device(32) == 32
    assert h.accounting() == initial


def test_shared_prefix_split_keeps_suffix_identity(make: type[CacheHarness]) -> None:
    h = make(HarnessConfig())
    a = list(range(1, 41))
    b = a[:20] + list(range(500, 520))
    ia = h.alloc(40)
    assert ia is not None
    h.insert(a, ia)
    leaf_a = _leaf(h, a)
    ib = h.alloc(40)
    assert ib is not None
    assert h.insert(b, ib) == 20  # the diverging insert splits leaf_a
    assert _leaf(h, a) is leaf_a, "sglang keeps the suffix object when it splits a node"
    assert len(leaf_a.key) == 20 and leaf_a.parent is not h.tree.root_node


def test_engine_is_fifo_per_stream_and_default_stream_is_synchronous() -> None:
    from toolkv.testing.transfer import ControlledDeviceModule, ControlledTransferEngine

    eng = ControlledTransferEngine()
    dm = ControlledDeviceModule(eng)
    log: list[str] = []
    s = dm.Stream()
    with dm.stream(s):
        eng.submit(lambda: log.append("a"), 1)
        e1 = dm.Event()
        e1.record()
        eng.submit(lambda: log.append("b"), 1)
        e2 = dm.Event()
        e2.record()
    eng.submit(lambda: log.append("now"), 1)
    assert log == ["now"] and not e1.query() and not e2.query()
    e2.synchronize()
    assert log == ["now", "a", "b"] and e1.query()
    assert eng.bytes_moved == {"default": 1, "stream0": 2}
