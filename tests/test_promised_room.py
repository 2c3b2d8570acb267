"""A tool_start must not take device room sglang has promised: the 0.5.23 crash, reproduced.

On one H100 (0.5.23, Granite-8B shape, 16 GB host next to a 120K-token pool) a toolkv server
exited in 2 of 4 loaded launches with sglang's "Out of memory ... Available full tokens: 129
(full_available_size=129 + full_evictable_size_=0)" from ``alloc_token_slots``, in the prefill
after a burst of ``tool_start``s whose paths had no host copy. Why: a write locks the node it copies
(and its path) until the copy is acknowledged (``write_backup`` / ``_execute_and_commit_kv_backup``
→ ``inc_lock_ref``), so a ``tool_start`` of a resident, unlocked path takes those tokens out of what
sglang may evict. sglang admits the next chunk of a chunked prefill without a budget check when
its budget is spent (``PrefillBudget.available_chunk_tokens``: "continuation must make progress"),
counting on the rest of the prompt fitting in free + evictable; with the write's lock on, it does
not, and the allocation raises.

Here the same thing happens on the real sglang cache and admission (the server stand-in's
scheduler model: sglang's ``PrefillAdder``, ``add_chunked_req``, ``alloc_token_slots``) with the
copy engine holding the writes in flight: a session's path sits resident and unbacked
(``write_back``: no host copy until eviction), a long prompt is being prefilled in chunks, and the
session's ``tool_start`` comes between two chunks. toolkv must refuse it (503
``device_memory_full``, nothing changed), and the chunked prefill must finish. Runs on both
releases (0.5.16's ``HiRadixCache``, 0.5.23's ``UnifiedRadixCache``).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from toolkv.sglang.cache_hooks import toolkv_cache_hooks
from toolkv.sglang.config import ToolKVConfig
from toolkv.testing.unified_harness import has_unified_radix_cache
from toolkv.twin.server import Server, make_server

UNIFIED = has_unified_radix_cache()
DEVICE = 512
CHUNK = 64


@pytest.fixture
def server() -> Iterator[Server]:
    kind = "unified" if UNIFIED else "hiradix"
    with toolkv_cache_hooks("unified" if UNIFIED else "radix"):
        srv = make_server(
            kind,
            device_tokens=DEVICE,
            host_ratio=2.0,
            context_len=2048,
            write_policy="write_back",
            chunked_prefill_size=CHUNK,
            max_prefill_tokens=CHUNK,
        )
        try:
            yield srv
        finally:
            srv.close()


def _room(srv: Server) -> int:
    tree = srv.h.tree
    return int(tree.token_to_kv_pool_allocator.available_size()) + int(tree.evictable_size())


def _run_turn(srv: Server, sid: str, prompt: list[int], out: int) -> None:
    req = srv.request(sid, prompt, list(range(7000, 7000 + out)))
    srv.sched.add_request(req)
    while not req.finished():
        assert srv.iterate() is not None
    srv.iterate()  # the next iteration merges the finished batch, as the scheduler does


def test_tool_start_between_chunks_keeps_the_chunked_prefill_alive(server: Server) -> None:
    srv = server
    now = [0.0]
    tk = srv.attach(ToolKVConfig(), now=lambda: now[0])  # the plugin's defaults
    # session a's turn: 240 tokens resident, unlocked and (write_back) without a host copy
    _run_turn(srv, "a", list(range(1, 233)), 8)
    assert tk.manager.sessions["a"].state == "Running"
    # a long prompt of another session: its prefill runs in chunks of CHUNK tokens
    long_req = srv.request("b", list(range(10_000, 10_000 + 400)), [9000])
    srv.sched.add_request(long_req)
    assert srv.iterate() is not None and srv.sched.chunked_req is long_req
    before = _room(srv)
    status, body = tk.handle("tool_start", {"session_id": "a"})
    # the write would lock a's 240 resident tokens while the rest of b's prompt needs them
    assert status == 503 and body["error"] == "device_memory_full", (status, body)
    assert "promised" in body["message"]
    assert _room(srv) == before and tk.manager.sessions["a"].state == "Running"  # nothing changed
    assert srv.h.pending("write") == 0
    while not long_req.finished():  # sglang's own prefill runs to its end (it raised before the fix)
        assert srv.iterate() is not None
    srv.iterate()
    # once the promise is kept, the same call goes through
    status, body = tk.handle("tool_start", {"session_id": "a"})
    assert status == 200 and body["state"] in ("Offloading", "Offloaded"), body
