"""Shared by the plugin tests: finish a request the way sglang's scheduler does, through the
REAL ``RadixCache.cache_finished_req`` wrapped by toolkv's AROUND hook.

``FinishedReq`` is a stand-in for sglang's ``Req`` carrying exactly the fields
``cache_finished_req`` reads (radix_cache.py:437-488); the slots it points at live in the
harness's real ``ReqToTokenPool``, and the KV in its real device pool.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

from toolkv.sglang.plugin import after_get_new_batch_prefill, around_cache_finished_req
from toolkv.testing.harness import CacheHarness


@dataclass
class FinishedReq:
    origin_input_ids: array[int]
    output_ids: array[int]
    req_pool_idx: int
    cache_protected_len: int
    last_node: Any
    session_id: str | None = None
    session: Any = None
    extra_key: str | None = None
    priority: int = 0


def finish_turn(
    h: CacheHarness, sid: str | None, prompt: list[int], output: list[int], slot: int = 0
) -> bool:
    """Prefill ``prompt`` reusing the cached prefix, "decode" ``output``, then cache the finished
    request (the final sampled token has no KV, as in sglang). Returns False without memory."""
    tokens = prompt + output
    kv_len = len(tokens) - 1
    m = h.match(tokens[:kv_len])
    prefix = m.device_indices
    h.tree.inc_lock_ref(m.last_device_node)
    new = h.alloc(kv_len - len(prefix)) if kv_len > len(prefix) else prefix[:0]
    if new is None:
        h.tree.dec_lock_ref(m.last_device_node)
        return False
    h.req_pool.req_to_token[slot, :kv_len] = torch.cat([prefix, new.to(prefix.device)]).to(torch.int32)
    req = FinishedReq(
        origin_input_ids=array("q", prompt),
        output_ids=array("q", output),
        req_pool_idx=slot,
        cache_protected_len=len(prefix),
        last_node=m.last_device_node,
        session_id=sid,
    )
    # admitted: its prefix is matched and locked, as after get_new_batch_prefill (the AFTER hook)
    # (stand-ins for NextBatchPlan/ScheduleBatch and the Scheduler: the hook reads only these fields)
    plan = SimpleNamespace(batch_to_run=SimpleNamespace(reqs=[req]))
    after_get_new_batch_prefill(plan, SimpleNamespace(_toolkv=getattr(h.tree, "_toolkv", None)))
    from sglang.srt.mem_cache.radix_cache import RadixCache

    around_cache_finished_req(RadixCache.cache_finished_req, h.tree, req, kv_len_to_handle=kv_len)
    return True


def iteration(h: CacheHarness, tk: Any, *, writes: bool = False, loads: bool = False) -> None:
    """One scheduler iteration as far as toolkv sees it: copies may finish, sglang processes its
    acks (writing_check/loading_check), then the process_input_requests AFTER hook ticks. With
    ``loads`` the copies that the previous tick started (toolkv starts queued loads in its tick)
    finish within this iteration."""
    if loads:
        tk.tick()
    if writes:
        h.complete("write")
    if loads:
        h.complete("load")
    h.check_events()
    tk.tick()


class LoopbackChannel:
    """TEST DOUBLE of sglang's tokenizer-manager <-> scheduler ZMQ channel (one TP rank).

    What stays real: the wire objects (``ToolKVReqInput``/``ToolKVReqOutput``) are pickled both ways
    as with ``SGLANG_USE_PICKLE_IPC``; the scheduler side is the exact handler the plugin adds to
    ``_request_dispatcher``, followed by the tick the ``process_input_requests`` AFTER hook runs;
    replies go through toolkv's real rid-keyed ``ReplyRegistry``, delivered on a later event-loop
    turn like ``handle_loop`` would. What is replaced: the sockets and the process boundary.
    """

    def __new__(cls, tk: Any, timeout_s: float = 5.0) -> Any:
        import asyncio
        import pickle

        from toolkv.sglang.http_api import ChannelTransport

        class _Loopback(ChannelTransport):
            sent: list[Any]

            def _send(self, req: Any) -> None:
                wire = pickle.loads(pickle.dumps(req))
                self.sent.append(wire)
                out = pickle.loads(pickle.dumps(tk.ipc_handler(wire)))
                tk.tick()
                asyncio.get_running_loop().call_soon(self.replies.resolve, out)

        t = _Loopback(timeout_s=timeout_s)
        t.sent = []
        return t
