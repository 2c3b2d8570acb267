"""The decisions of ``tests/test_tp_decisions.py`` on sglang 0.5.23's Rust tree core: two gloo
ranks, each with its own REAL ``UnifiedRadixCache`` on the Rust ``TreeCore`` (node handles only,
``toolkv.core.backends.unified_rust``) and its own toolkv agreeing over the 2-rank group, the same
group sglang's ``check_hicache_events`` reduces its ack counts over.

The ranks see different things: the offload's writes and the restore's loads are acknowledged an
iteration apart, rank 1's clock runs behind, only rank 1's scheduler counts a promise the
offload's locks would take, only rank 1's host pool is short of free slots. They must take the
same decision in the same iteration (lazy free leaving the same GPU copies, the hand-over, the
promised-room refusal, the host room made by evicting the same unprotected copy), with the same
record at every step, and return everything. Mutants skip one agreement each; the records must
then part.

Runs in the 0.5.23 environment (``make test-0523``); skips where an older sglang is installed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from toolkv.testing.unified_harness import has_unified_radix_cache, sglang_version

if not has_unified_radix_cache():
    pytest.skip(
        f"needs sglang >= 0.5.21 (UnifiedRadixCache), found {sglang_version()}", allow_module_level=True
    )

from test_tp_decisions import Rank, _launch, divergence

MODULE = __name__


class RustRank(Rank):
    """A rank over the Rust tree core: turns inserted as sglang's ``cache_finished_req`` does on
    0.5.23; no node objects to sum over (the pools and the tree's sizes carry the comparison)."""

    def tree_counts(self) -> list[int] | None:
        return None

    def turn(self, sid: str, first: int, n: int, slot: int = 0) -> None:
        import torch
        from sglang.srt.mem_cache.base_prefix_cache import InsertParams

        from toolkv.testing.unified_harness import rkey

        h, tokens = self.h, list(range(first, first + n))
        m = h.match(tokens)
        have = int(m.device_prefix_len)
        prefix = h.tree.path_device_indices(m.last_device_node)[:have]
        lock = h.tree.lock(m.last_device_node)
        try:
            idx = h.allocator.alloc(n - have)
            assert idx is not None
            h.fill_kv(idx, tokens[have:])
            value = torch.cat([prefix.to(idx.dtype), idx])
            h.tree.insert(InsertParams(key=rkey(tokens, None), value=value, prev_prefix_len=have))
        finally:
            h.tree.unlock(lock)
        self.tk.manager.insert(sid, tokens, None)

    def iteration(
        self, step: str, *, writes_on: tuple[int, ...] = (), loads_on: tuple[int, ...] = ()
    ) -> None:
        """sglang's ``check_hicache_events`` submits the queued writes before the copy engine can
        finish them; then the base iteration (finish, the reduced ack check, toolkv's tick)."""
        self.h.check_events()
        super().iteration(step, writes_on=writes_on, loads_on=loads_on)


def _harness(**kw: Any) -> Any:
    from toolkv.testing.unified_harness import UnifiedCacheHarness, UnifiedHarnessConfig

    return UnifiedCacheHarness(UnifiedHarnessConfig(tree_core="rust", **kw), seed=0)


def sc_offload(rank: int, agree: Any, clock_agree: Any) -> dict[str, Any]:
    """Offload, lazy free, hand-over and admission: the writes acknowledged on rank 0 first, the
    loads too; each phase changes in the same iteration on both ranks."""
    with _harness(device_tokens=256) as h:
        r = RustRank(rank, h, agree, clock_agree, lazy_free=True)
        r.turn("a", 1, 48)
        r.call("tool_start a", "tool_start", session_id="a")
        r.iteration("rank0 writes", writes_on=(0,))
        r.iteration("rank1 writes", writes_on=(1,))
        h.evict_device(10**6)
        r.record("sglang evicts the GPU copy")
        r.call("tool_end a", "tool_end", session_id="a", epoch=1)
        r.iteration("loads start")
        r.iteration("rank0 loads", loads_on=(0,))
        r.iteration("rank1 loads", loads_on=(1,))
        r.admit("a admitted", "a")
        return r.finish()


def sc_promise(rank: int, agree: Any, clock_agree: Any) -> dict[str, Any]:
    """The promised-room refusal: only rank 1's scheduler promised the room the offload's write
    locks would take (write_back: the turn has no host copy); both refuse, then both accept."""
    with _harness(device_tokens=256, write_policy="write_back") as h:
        r = RustRank(rank, h, agree, clock_agree, lazy_free=False)
        r.turn("a", 1, 48)
        be: Any = r.tk.manager.backend
        be.headroom = (lambda: 10**6) if rank == 1 else (lambda: 0)
        r.call("tool_start a (rank 1 promised)", "tool_start", session_id="a")
        be.headroom = lambda: 0
        r.call("tool_start a", "tool_start", session_id="a")
        r.iteration("rank0 writes", writes_on=(0,))
        r.iteration("rank1 writes", writes_on=(1,))
        return r.finish()


def sc_host_room(rank: int, agree: Any, clock_agree: Any) -> dict[str, Any]:
    """Host room: only rank 1's host pool is short of free slots; a closed session's unprotected
    host copy covers it, and both ranks evict the same."""
    with _harness(device_tokens=256, write_policy="write_back") as h:
        r = RustRank(rank, h, agree, clock_agree, lazy_free=False)
        r.turn("c", 500, 100)
        r.call("tool_start c", "tool_start", session_id="c")
        r.iteration("c written", writes_on=(0, 1))
        r.call("close c", "close", session_id="c")
        r.turn("a", 1, 48)
        pool = h.host_pool
        hog = pool.alloc(pool.available_size() - 10) if rank == 1 else None
        reply = r.tk.handle("tool_start", {"session_id": "a"})
        if hog is not None:
            pool.free(hog)
        r.record("tool_start a (rank 1: 10 free slots)", reply)
        r.iteration("a written", writes_on=(0, 1))
        return r.finish()


SCENARIOS = {"offload": sc_offload, "promise": sc_promise, "host_room": sc_host_room}
MUTANTS = {
    "acks_local": ("offload", "ack"),  # sglang's reduced ack counts skipped
    "promise_local": ("promise", "check_offload_room"),
    "host_room_local": ("host_room", "offload"),
}


def _state(row: dict[str, Any], sid: str) -> str:
    return str(row["sessions"][sid]["state"])


def test_two_gloo_ranks_on_the_rust_core_agree(tmp_path: Path) -> None:
    r0, r1 = _launch(tmp_path, list(SCENARIOS), module=MODULE)
    for name in SCENARIOS:
        assert divergence(r0, r1, name) is None, (name, divergence(r0, r1, name))
    by = {s["step"]: s for s in r0["offload"]["trace"]}
    assert _state(by["rank0 writes"], "a") == "Offloading", "rank 0 must wait for rank 1's write"
    assert _state(by["rank1 writes"], "a") == "Offloaded"
    assert _state(by["rank0 loads"], "a") == "Restoring" and _state(by["rank1 loads"], "a") == "Handover"
    assert _state(by["a admitted"], "a") == "Runnable"
    by = {s["step"]: s for s in r0["promise"]["trace"]}
    refused = by["tool_start a (rank 1 promised)"]
    assert refused["reply"][0] == 503 and _state(refused, "a") == "Running"
    assert by["tool_start a"]["reply"][0] == 200 and _state(by["rank1 writes"], "a") == "Offloaded"
    by = {s["step"]: s for s in r0["host_room"]["trace"]}
    assert by["tool_start a (rank 1: 10 free slots)"]["reply"][0] == 200


@pytest.mark.parametrize(
    "mutant",
    [pytest.param(m, marks=[] if m == "host_room_local" else [pytest.mark.slow]) for m in MUTANTS],
)
def test_a_decision_taken_without_agreement_parts_the_rust_ranks(tmp_path: Path, mutant: str) -> None:
    """One mutant in the quick suite (the Rust backend's own host room), all in ``test-long``."""
    name = MUTANTS[mutant][0]
    r0, r1 = _launch(tmp_path, [name], mutant, module=MODULE)
    assert divergence(r0, r1, name) is not None, f"{mutant}: the ranks stayed together"
