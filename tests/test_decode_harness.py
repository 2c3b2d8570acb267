"""The CPU harness for sglang's real DecodeKVCacheOffloadManager: what it builds is real, and the
two engines the tests control (copy engine, storage backup thread) behave as on a server —
bytes move only when a copy completes, a page reaches storage only when its backup runs."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
import torch

from research.decode_offload.harness import DecodeHarnessConfig, DecodeOffloadHarness

pytestmark = pytest.mark.filterwarnings("ignore")


@pytest.fixture
def h() -> Iterator[DecodeOffloadHarness]:
    logging.disable(logging.ERROR)
    with DecodeOffloadHarness(DecodeHarnessConfig(device_tokens=32, host_ratio=0.25)) as harness:
        yield harness
    logging.disable(logging.NOTSET)


def _decode(h: DecodeOffloadHarness, req: object, toks: list[int]) -> None:
    for t in toks:
        assert h.decode_step(req, t)


def test_the_stack_is_sglangs_own(h: DecodeOffloadHarness) -> None:
    from sglang.srt.disaggregation.decode_kvcache_offload_manager import DecodeKVCacheOffloadManager
    from sglang.srt.mem_cache.chunk_cache import ChunkCache
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    assert type(h.manager) is DecodeKVCacheOffloadManager
    assert type(h.tree) is ChunkCache
    assert type(h.backend) is HiCacheFile
    assert type(h.host_pool) is MHATokenToKVPoolHost and not h.host_pool.pin_memory
    assert h.controller.backup_thread.is_alive()
    assert h.stride == 1 and h.host_pool.size == 9


def test_an_increment_reaches_storage_only_when_copied_acked_and_backed_up(h: DecodeOffloadHarness) -> None:
    m = h.manager
    req = h.new_request("a", [11, 12, 13], 8)
    assert h.admit(req, 14)
    _decode(h, req, [15, 16])  # KV of 14, 15 now on device
    assert m.offload_kv_cache(req)
    (ack_id,) = m.ongoing_offload
    host = m.ongoing_offload[ack_id][1]
    h.scribble()
    assert len(h.pending_copies()) == 1
    assert not torch.equal(h.host_kv(host), h.kv([14, 15])), "bytes moved before the copy completed"
    assert h.complete_copy()
    assert torch.equal(h.host_kv(host), h.kv([14, 15]))
    m.check_offload_progress()  # write ack retired: hashed and staged for storage
    assert not m.ongoing_offload and len(m.ongoing_backup) == 1
    assert h.stored_pages() == {}, "a page reached storage before its backup ran"
    assert h.storage is not None and h.storage.complete(5) == 1
    pages = h.stored_pages()
    chain = h.hash_chain(h.all_tokens(req))
    assert sorted(pages) == sorted(chain[3:5])
    for i in (3, 4):
        assert torch.equal(pages[chain[i]], h.kv([h.all_tokens(req)[i]]))
    free_before = h.host_pool.available_size()
    m.check_offload_progress()  # backup ack retired: host slots freed
    assert h.host_pool.available_size() == free_before + 2 and not m.ongoing_backup


def test_a_full_host_pool_refuses_the_write_and_changes_nothing(h: DecodeOffloadHarness) -> None:
    m = h.manager
    req = h.new_request("a", [21, 22, 23], 20)
    assert h.admit(req, 24)
    _decode(h, req, list(range(25, 36)))  # 11 new tokens > 9 host slots
    assert not m.offload_kv_cache(req)
    assert m.offloaded_state["a"].inc_len == 0 and not m.ongoing_offload
    assert h.host_pool.available_size() == h.host_pool.size


def test_finishing_releases_every_slot(h: DecodeOffloadHarness) -> None:
    from sglang.srt.managers.schedule_batch import FINISH_LENGTH

    m = h.manager
    dev0, req0 = h.allocator.available_size(), h.req_pool.available_size()
    req = h.new_request("a", [31, 32, 33], 8)
    assert h.admit(req, 34)
    _decode(h, req, [35])
    req.finished_reason = FINISH_LENGTH(length=2)
    assert m.offload_kv_cache(req)  # the finish-time increment is in flight: release waits
    assert req.req_pool_idx is not None
    h.complete_copy()
    m.check_offload_progress()
    assert req.req_pool_idx is None
    assert (h.allocator.available_size(), h.req_pool.available_size()) == (dev0, req0)


def test_bad_configurations_are_refused() -> None:
    with pytest.raises(ValueError, match="multiple of page_size"):
        DecodeHarnessConfig(page_size=4, device_tokens=30)
    with pytest.raises(ValueError, match="stride_tokens"):
        DecodeHarnessConfig(stride_tokens=0)
    with pytest.raises(ValueError, match="host_ratio"):
        DecodeHarnessConfig(host_ratio=0)


def test_one_harness_at_a_time(h: DecodeOffloadHarness) -> None:
    with pytest.raises(RuntimeError, match="one DecodeOffloadHarness at a time"):
        DecodeOffloadHarness()
