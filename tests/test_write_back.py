"""sglang 0.5.16 under ``--hicache-write-policy write_back``: a tool_start's copy must not keep a lock.

sglang's ``HiRadixCache`` locks a node it writes to host the write-through way (``write_backup(node)``
-> ``inc_lock_ref``) and releases the lock at the write's ack (``writing_check()`` ->
``_finish_write_through_ack(release_lock=True)``). Under write_back its eviction writes unbacked
leaves unlocked (``write_backup(x, write_back=True)``) and then drains every write in flight with
``writing_check(write_back=True)``, which finishes each ack with ``release_lock=False``. A locked
write still in flight at that moment is acked without its lock released, and its path stays on the
device for good. toolkv's tool_start used the locked form; on the twin's 96-session named-tool load
81 of 171 tool_start copies leaked their lock and the server stopped admitting. toolkv now releases
the locks of its writes that such a drain finished (the plugin's AROUND hook on
``HiRadixCache.writing_check`` -> ``HiRadixBackend.around_writing_check``); the copy stays
asynchronous, as under write_through.

The first test pins sglang's behaviour the fix rests on (if a later 0.5.16 build releases the lock
in its drain, it fails and says so); the second is the fix, and the third shows the second can fail.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from toolkv.testing.unified_harness import has_unified_radix_cache

pytestmark = pytest.mark.skipif(has_unified_radix_cache(), reason="sglang 0.5.16's HiRadixCache")

DEVICE = 512


@pytest.fixture
def server() -> Iterator[object]:
    from toolkv.sglang.cache_hooks import toolkv_cache_hooks
    from toolkv.twin.server import make_server

    with toolkv_cache_hooks("radix"):
        srv = make_server(
            "hiradix", device_tokens=DEVICE, host_ratio=2.0, context_len=2048, write_policy="write_back"
        )
        try:
            yield srv
        finally:
            srv.close()


def _turn(srv: object, sid: str, prompt: list[int], out: int) -> None:
    req = srv.request(sid, prompt, list(range(7000, 7000 + out)))  # type: ignore[attr-defined]
    srv.sched.add_request(req)  # type: ignore[attr-defined]
    while not req.finished():
        assert srv.iterate() is not None  # type: ignore[attr-defined]
    srv.iterate()  # type: ignore[attr-defined]


def test_sglang_write_back_drain_keeps_the_lock_of_a_locked_write() -> None:
    """The premise: a write-through-form write acked by write_back's drain keeps its lock."""
    import torch

    from toolkv.testing.harness import CacheHarness, HarnessConfig

    with CacheHarness(HarnessConfig(device_tokens=256, write_policy="write_back")) as h:
        assert h.run_request(list(range(1, 65)))
        node = h.match(list(range(1, 65))).last_device_node
        assert node.host_value is None and node.lock_ref == 0  # write_back: no copy until eviction
        assert h.tree.write_backup(node) == 64 and node.lock_ref == 1
        h.tree.writing_check(write_back=True)  # what _evict_write_back's flush_staged runs
        assert node.write_through_pending_id is None and isinstance(node.host_value, torch.Tensor)
        assert node.lock_ref == 1, "sglang's write_back drain now releases the lock: revisit _write_back"


def _tool_start_leaves_no_lock(srv: object) -> tuple[int, list[int]]:
    """Session a's turn, its tool_start, then write_back's drain (as an eviction would run it) and
    the scheduler's own ack check: the locks left on a's path."""
    from toolkv.core.treeops import path_to
    from toolkv.sglang.config import ToolKVConfig

    tk = srv.attach(ToolKVConfig(), now=lambda: 0.0)  # type: ignore[attr-defined]
    _turn(srv, "a", list(range(1, 233)), 8)
    rec = tk.manager.sessions["a"]
    path = list(path_to(srv.h.tree, rec.node))  # type: ignore[attr-defined]
    status, _ = tk.handle("tool_start", {"session_id": "a"})
    srv.h.tree.writing_check(write_back=True)  # type: ignore[attr-defined]
    srv.h.tree.writing_check()  # type: ignore[attr-defined]
    return status, [m.lock_ref for m in path]


def test_a_tool_start_under_write_back_leaves_no_lock(server: object) -> None:
    status, locks = _tool_start_leaves_no_lock(server)
    assert status == 200 and set(locks) == {0}, locks
    assert server.h.pending("write") == 0  # type: ignore[attr-defined]


def test_without_the_release_the_lock_leaks(server: object, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same steps without the release (the hook passes the call through): the lock stays."""
    from toolkv.core.backends.hiradix import HiRadixBackend

    monkeypatch.setattr(HiRadixBackend, "around_writing_check", lambda self, call, write_back: call())
    status, locks = _tool_start_leaves_no_lock(server)
    assert status == 200 and max(locks) > 0, locks
