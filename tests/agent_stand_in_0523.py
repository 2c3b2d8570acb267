"""TEST DOUBLE of an sglang 0.5.23 server for the ``kv_hints`` tests and the agent example.

Stands in for: the HTTP server's routes (``/generate``, ``/v1/chat/completions`` with its
parsing and response building), the scheduler loop, and the model (the STAND-IN MODEL of
:mod:`toolkv.twin.stand_in_model`, the one ``toolkv serve`` answers with: a tool call while the
conversation has fewer than two tool results and offers tools, then a final answer). The copy engine is the harness's controlled one; uvloop, absent on this CPU box, is
replaced by asyncio's own loop policy (:func:`uvloop_stand_in`).

What stays real (sglang 0.5.23's own code): ``GenerateReqInput`` and its normalisation, which
decodes the envelope with ``decode_kv_hints_envelope`` (io_struct.py:583-587); a ``Req`` built with
``kv_hints`` as ``handle_generate_request`` builds it (scheduler.py:3016); the ``UnifiedRadixCache``
and ``release_kv_cache`` -> the hooked ``checkpoint``; the ``SchedulerOutputStreamer`` (hooked
``stream_output``) and its output payload; ``TokenizerManager.update_request_meta_info`` (hooked)
building ``meta_info`` from the payload's ``customized_info``. toolkv's side is the plugin itself:
``after_scheduler_init`` builds the rank, the hooks are applied by sglang's ``HookRegistry``, the
chat route runs the plugin's ``around_chat_kv_hints`` and the session routes are toolkv's own
(``build_app`` over the loopback channel).
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
import types
import uuid
from array import array
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import torch
from _turns import LoopbackChannel
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from toolkv.sglang.cache_hooks import plugin_hooks
from toolkv.sglang.config import ToolKVConfig
from toolkv.sglang.http_api import install_routes
from toolkv.sglang.plugin import (
    STREAMER,
    TOKENIZER,
    UNIFIED,
    after_scheduler_init,
    around_chat_kv_hints,
    before_handle_generate_request,
    hooks,
)
from toolkv.sglang.scheduler_side import SchedulerToolKV
from toolkv.testing.unified_harness import UnifiedCacheHarness, UnifiedHarnessConfig, ensure_process_group
from toolkv.twin import stand_in_model as model


def uvloop_stand_in() -> None:
    """sglang's tokenizer manager installs uvloop's loop policy at import
    (tokenizer_manager.py:206). TEST DOUBLE where uvloop is not installed: asyncio's default."""
    try:
        import uvloop  # noqa: F401
    except ImportError:
        mod = types.ModuleType("uvloop")
        mod.EventLoopPolicy = asyncio.DefaultEventLoopPolicy  # type: ignore[attr-defined]
        sys.modules["uvloop"] = mod


@contextlib.contextmanager
def hooked() -> Iterator[None]:
    """The plugin's 0.5.23 scheduler-side hooks on the tree and the output streamer, and its
    ``update_request_meta_info`` hook, applied by sglang's real ``HookRegistry``; undone after."""
    uvloop_stand_in()
    rows = [
        (t, h, k)
        for t, h, k in hooks(main_process=True, config=ToolKVConfig(), tree="unified")
        if t.startswith((UNIFIED, STREAMER, TOKENIZER))
    ]
    with plugin_hooks(rows):
        yield


class StandIn0523:
    """One scheduler rank and its HTTP routes. Use as a context manager inside :func:`hooked`."""

    def __init__(self, *, device_tokens: int = 4096, tree_core: str = "python") -> None:
        from sglang.srt.disaggregation.utils import DisaggregationMode
        from sglang.srt.managers.scheduler_components.output_streamer import SchedulerOutputStreamer
        from sglang.srt.runtime_context import get_parallel
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
        from sglang.utils import TypeBasedDispatcher

        self._stack = contextlib.ExitStack()
        self.h = self._stack.enter_context(
            UnifiedCacheHarness(UnifiedHarnessConfig(device_tokens=device_tokens, tree_core=tree_core))  # type: ignore[arg-type]
        )
        self._stack.enter_context(get_parallel().override(tp_rank=0, attn_tp_rank=0, dp_rank=None))
        self.sched = SimpleNamespace(  # the Scheduler attributes the init hook reads (as test_plugin_0523)
            server_args=self.h.server_args,
            tree_cache=self.h.tree,
            tp_cpu_group=ensure_process_group(),
            _request_dispatcher=TypeBasedDispatcher([(int, lambda x: x)]),
        )
        after_scheduler_init(None, self.sched)  # reads TOOLKV_* from the environment
        self.tk: SchedulerToolKV = self.sched._toolkv
        self.sent: list[Any] = []  # TEST DOUBLE of the detokenizer socket: what the streamer sends
        self.streamer = SchedulerOutputStreamer(
            send_to_detokenizer=SimpleNamespace(send_output=self.sent.append),
            tree_cache=self.h.tree,
            server_args=self.h.server_args,
            is_generation=True,
            spec_algorithm=SpeculativeAlgorithm.NONE,
            disaggregation_mode=DisaggregationMode.NULL,
            enable_hicache_storage=lambda: False,
        )
        self.app = self._build_app()

    def __enter__(self) -> StandIn0523:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._stack.close()

    # ---- the scheduler loop ---------------------------------------------------------------------------
    def iterate(self, n: int = 1) -> None:
        """Scheduler iterations: the copy engine finishes what is in flight, sglang retires the
        acks (``check_hicache_events``), toolkv ticks (the process_input_requests AFTER hook)."""
        for _ in range(n):
            self.tk.tick()
            self.h.check_events()
            self.h.complete("write")
            self.h.complete("load")
            self.h.check_events()
            self.tk.tick()

    # ---- one request through sglang's request path ----------------------------------------------------
    def generate_obj(self, obj: Any, output: list[int], *, abort: bool = False) -> dict[str, Any]:
        """Serve a ``GenerateReqInput``: normalise it (sglang decodes ``kv_hints``; a malformed
        envelope raises ValueError), the BEFORE hook of ``handle_generate_request`` (a session
        whose KV is away is restored), prefill + decode into the real cache, finish through
        ``release_kv_cache``, stream through the real streamer, build ``meta_info`` as the
        tokenizer manager does. Returns ``{"output_ids", "meta_info"}``."""
        from sglang.srt.managers.io_struct import unwrap_from_pickle
        from sglang.srt.managers.schedule_batch import FINISH_ABORT, FINISH_LENGTH, Req
        from sglang.srt.managers.tokenizer_manager import ReqState, TokenizerManager
        from sglang.srt.mem_cache.common import release_kv_cache
        from sglang.srt.sampling.sampling_params import SamplingParams

        obj.normalize_batch_and_arguments()
        before_handle_generate_request(
            self.sched, SimpleNamespace(session_id=obj.session_id, session_params=None)
        )
        self.iterate(4)  # a restore the request triggered lands before its prefill
        prompt = list(obj.input_ids)
        req = Req(
            obj.rid,
            "",
            array("q", prompt),
            SamplingParams(max_new_tokens=len(output)),
            stream=bool(obj.stream),
            session_id=obj.session_id,
            cache_salt=obj.cache_salt,
            kv_hints=obj.kv_hints,  # as Scheduler.handle_generate_request (scheduler.py:3016)
        )
        self._prefill_and_decode(req, prompt, output)
        req.finished_reason = (
            FINISH_ABORT("client aborted") if abort else FINISH_LENGTH(length=len(req.output_ids))
        )
        release_kv_cache(req, self.h.tree, checkpoint=True)
        self.streamer.stream_output([req], False)
        payload = self.sent.pop()
        i = payload.rids.index(req.rid)
        meta_info: dict[str, Any] = {
            "id": req.rid,
            "finish_reason": payload.finished_reasons[i],
            "prompt_tokens": payload.prompt_tokens[i],
            "completion_tokens": payload.completion_tokens[i],
            "cached_tokens": payload.cached_tokens[i],
        }
        customized = unwrap_from_pickle(payload.customized_info)
        if customized is not None:
            state = ReqState([], True, asyncio.Event(), obj, None)  # type: ignore[arg-type]
            # the method reads only its own static helper: called on the class, as the hook sees it
            TokenizerManager.update_request_meta_info(
                TokenizerManager,  # type: ignore[arg-type]
                meta_info,
                state,
                customized,
                i,
                payload.finished_reasons[i],
            )
        return {"output_ids": list(output), "meta_info": meta_info}

    def _prefill_and_decode(self, req: Any, prompt: list[int], output: list[int]) -> None:
        """The forward passes: the cached prefix matched and locked, a ``req_to_token`` row, device
        KV for every token but the last sampled one (written with the harness's deterministic KV)."""
        h = self.h
        tokens = prompt + output
        kv_len = len(tokens) - 1
        m = h.match(tokens[:kv_len], None)
        prefix = h.tree.path_device_indices(m.last_device_node)[: m.device_prefix_len]
        req.last_node = m.last_device_node
        req.lock = h.tree.lock(m.last_device_node)
        assert h.req_pool.alloc([req]) is not None
        new = h.alloc(kv_len - len(prefix))
        if new is None:
            h.evict_device(kv_len)
            new = h.alloc(kv_len - len(prefix))
        assert new is not None, "the stand-in's device pool is too small"
        h.fill_kv(new, tokens[len(prefix) : kv_len])
        row = torch.cat([prefix, new.to(prefix.device)]).to(torch.int32)
        h.req_pool.write((req.kv.req_pool_idx, slice(0, kv_len)), row)
        req.kv.cache_protected_len = len(prefix)
        req.kv.kv_committed_len = req.kv.kv_allocated_len = kv_len
        req.cached_tokens = len(prefix)
        req.output_ids.extend(output)

    def generate(self, body: dict[str, Any], output: list[int] | None = None) -> dict[str, Any]:
        """``/generate`` with a JSON body (``input_ids``, ``session_id``, ``kv_hints``, ``stream``)."""
        from sglang.srt.managers.io_struct import GenerateReqInput

        ids = list(body["input_ids"])
        obj = GenerateReqInput(
            input_ids=ids,
            session_id=body.get("session_id"),
            kv_hints=body.get("kv_hints"),
            stream=bool(body.get("stream", False)),
            rid=uuid.uuid4().hex,
        )
        n = int((body.get("sampling_params") or {}).get("max_new_tokens", 8))
        out = output if output is not None else [1000 + (ids[-1] * 31 + 7 * k) % 9000 for k in range(n)]
        return self.generate_obj(obj, out)

    # ---- the HTTP routes ------------------------------------------------------------------------------
    def _build_app(self) -> FastAPI:
        app = FastAPI()
        install_routes(app, LoopbackChannel(self.tk))

        @app.post("/generate")
        async def generate(request: Request) -> JSONResponse:
            try:
                return JSONResponse(self.generate(await request.json()))
            except ValueError as e:  # sglang answers a malformed request with a 400
                return JSONResponse({"error": {"message": str(e)}}, status_code=400)

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> JSONResponse:
            body = await request.json()
            try:
                return JSONResponse(await self._chat(body, request))
            except ValueError as e:  # OpenAIServingBase.handle_request: ValueError -> 400
                return JSONResponse(
                    {"object": "error", "message": str(e), "type": "BadRequest", "code": 400}, status_code=400
                )

        return app

    async def _chat(self, body: dict[str, Any], raw_request: Request) -> dict[str, Any]:
        from sglang.srt.managers.io_struct import GenerateReqInput

        messages = list(body["messages"])
        # the STAND-IN MODEL's rule (toolkv.twin.stand_in_model, shared with `toolkv serve`): a tool
        # call while the conversation offers tools and holds fewer than two results, then text
        name = model.tool_to_call(messages, body.get("tools") or [], body.get("tool_choice"))
        prompt = model.tokenize(messages)
        output = model.output_ids(prompt)
        # what OpenAIServingChat._convert_to_internal_request builds (serving_chat.py:1366-1410):
        # session_id and extra_key are carried, kv_hints is not
        adapted = GenerateReqInput(
            input_ids=prompt, session_id=body.get("session_id"), stream=False, rid=uuid.uuid4().hex
        )

        async def original(_serving: Any, adapted_request: Any, _request: Any, _raw: Any) -> dict[str, Any]:
            return self.generate_obj(adapted_request, output)

        # the plugin's AROUND hook of _handle_non_streaming_request: copies kv_hints from the body
        ret = await around_chat_kv_hints(original, None, adapted, body, raw_request)
        sid = body.get("session_id")
        if name is not None and self.tk.config.zero_change and isinstance(sid, str):
            # the plugin's zero-change hook sends this op when finish_reason is "tool_calls"
            self.tk.handle("auto_offload", {"session_id": sid, "tool": name})
        message: dict[str, Any] = {"role": "assistant", "content": None}
        if name is not None:
            call = {"id": f"call_{uuid.uuid4().hex[:8]}", "type": "function"}
            call["function"] = {"name": name, "arguments": model.tool_arguments(messages)}  # type: ignore[assignment]
            message["tool_calls"] = [call]
        else:
            message["content"] = model.answer_text(messages)
        out_choice: dict[str, Any] = {
            "index": 0,
            "message": message,
            "finish_reason": "tool_calls" if name is not None else "stop",
            "logprobs": None,
        }
        if body.get("return_meta_info"):
            out_choice["meta_info"] = ret["meta_info"]
        meta = ret["meta_info"]
        return {
            "id": meta["id"],
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.get("model", "stand-in"),
            "choices": [out_choice],
            "usage": {
                "prompt_tokens": meta["prompt_tokens"],
                "completion_tokens": meta["completion_tokens"],
                "total_tokens": meta["prompt_tokens"] + meta["completion_tokens"],
            },
        }
