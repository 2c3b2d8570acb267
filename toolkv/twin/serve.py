"""``toolkv serve``: an sglang-compatible server on CPU, for trying toolkv's agents and tools
without a GPU.

What is real: sglang's own caches (``HiRadixCache`` with its host pool on sglang 0.5.16,
``UnifiedRadixCache`` on 0.5.21+), the scheduler model every twin driver runs
(:class:`~toolkv.twin.server.Server`: real ``Req`` objects, chunked prefill, the forward that writes
and checks KV bytes), toolkv's scheduler side attached as the plugin attaches it, the plugin's cache
hooks and request hooks, toolkv's HTTP routes (:mod:`toolkv.sglang.http_api`) and its Prometheus
collectors (:mod:`toolkv.sglang.metrics`). What is not: the model. Answers come from the
:mod:`~toolkv.twin.stand_in_model` (deterministic; a tool call while the conversation asks for one,
text otherwise), and there is no GPU time: a turn takes as long as the cache work on CPU.

Threads, as in sglang: the HTTP handlers (the tokenizer manager's side) run on uvicorn's event
loop and hand every request to the scheduler thread through a queue (sglang's ZMQ channel); the
scheduler thread alone touches the cache and toolkv, one iteration at a time, as sglang's
single-threaded scheduler does. toolkv's control calls travel as the plugin's own wire objects
(``ToolKVReqInput`` out, ``ToolKVReqOutput`` back, pickled as on the real channel) and their
replies through the real rid-keyed reply registry.

Routes: ``/generate``, ``/v1/chat/completions`` (tool calls; no streaming), ``/v1/models``,
``/health``, toolkv's ``/session/*`` and ``/metrics`` (toolkv's collectors, and the stand-in's
``sglang:prompt_tokens_total``/``sglang:cached_tokens_total``/``sglang:generation_tokens_total``
named like sglang's). A refusal is a 4xx with toolkv's ``{"error", "message"}`` body.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import pickle
import queue
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from toolkv.core.requests import MAX_SESSION_ID, AutoOffload
from toolkv.core.requests import Request as SessionRequest
from toolkv.errors import BadRequest, SchedulerTimeout, ToolKVError
from toolkv.sglang.config import ToolKVConfig
from toolkv.sglang.http_api import ChannelTransport, install_routes
from toolkv.sglang.ipc import ToolKVReqInput
from toolkv.twin import stand_in_model as model

log = logging.getLogger("toolkv.serve")

IDLE_WAIT_S = 0.02  # an idle scheduler waits this long for a request, then ticks (TTLs run on)


@dataclass(frozen=True)
class ServeConfig:
    """The server's shape. The default device pool is small on purpose: a few agents fill it, so
    toolkv's offloads matter; the host pool is ``host_ratio`` times larger (HiCache's
    ``--hicache-ratio``)."""

    port: int = 30000
    device_tokens: int = 16_384
    host_ratio: float = 4.0
    max_new_tokens: int = 256  # the most /generate may ask for
    request_timeout_s: float = 30.0

    @property
    def context_len(self) -> int:
        return self.device_tokens

    @property
    def max_prompt_tokens(self) -> int:
        """A prompt plus its answer must fit half the device pool, so one request never waits for
        memory that toolkv's held sessions could never give back."""
        return self.device_tokens // 2 - self.max_new_tokens


@dataclass(frozen=True)
class TurnResult:
    rid: str
    output_ids: list[int]
    prompt_tokens: int
    cached_tokens: int  # prompt tokens found in the cache (device or host), as sglang reports them


@dataclass
class _Turn:
    sid: str | None
    prompt: list[int]
    output: list[int]
    done: Callable[[TurnResult], object]


@dataclass
class _Control:
    req: ToolKVReqInput
    reply: Callable[[Any], None]


@dataclass
class _Call:
    fn: Callable[[], Any]
    done: Callable[[Any], object]


class SchedulerLoop:
    """The scheduler thread: the server stand-in over the real cache, toolkv attached to it, and
    the inbox the HTTP side writes to. Everything it owns is built and used on its own thread
    (sglang 0.5.23's cache reads a per-thread parallel context)."""

    def __init__(self, cfg: ServeConfig, tk_config: ToolKVConfig, *, registry: Any) -> None:
        self.cfg = cfg
        self.tk_config = tk_config
        self.registry = registry
        self.inbox: queue.SimpleQueue[_Turn | _Control | _Call | None] = queue.SimpleQueue()
        self.waiting: dict[str, _Turn] = {}  # rid -> the turn whose request runs
        self.turns = 0
        self.describe = ""  # the cache, in words, once built
        self.tk: Any = None
        self.server: Any = None
        self._t0 = time.monotonic()
        self._ready = threading.Event()
        self._failed: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._main, name="toolkv-scheduler", daemon=True)

    # ---- lifecycle ----------------------------------------------------------------------------------
    def start(self) -> None:
        """Build everything on the scheduler thread; re-raise here what building raised."""
        self._thread.start()
        self._ready.wait()
        if self._failed is not None:
            raise self._failed

    def stop(self) -> None:
        self._stop.set()
        self.inbox.put(None)
        self._thread.join(timeout=10)

    def submit(self, item: _Turn | _Control | _Call) -> None:
        self.inbox.put(item)

    def _main(self) -> None:
        with contextlib.ExitStack() as stack:
            try:
                self._build(stack)
            except BaseException as e:  # handed to start(), on the caller's thread
                self._failed = e
                self._ready.set()
                return
            self._ready.set()
            while not self._stop.is_set():
                self._iteration()

    def _build(self, stack: contextlib.ExitStack) -> None:
        from prometheus_client import Counter

        from toolkv.sglang.cache_hooks import toolkv_cache_hooks
        from toolkv.sglang.metrics import ToolKVMetrics
        from toolkv.twin.server import ServerKind, make_server
        from toolkv.twin.stack import unified

        kind: ServerKind = "unified" if unified() else "hiradix"
        server = make_server(
            kind, device_tokens=self.cfg.device_tokens, host_ratio=self.cfg.host_ratio,
            context_len=self.cfg.context_len + 8,
        )  # fmt: skip
        stack.callback(server.close)
        stack.enter_context(toolkv_cache_hooks(server.tree_api))  # the plugin's turn capture
        server.on_admitted = self._admitted
        server.on_finished = self._finished
        labels = {"model_name": model.NAME, "tp_rank": "0"}
        metrics = ToolKVMetrics(labels, registry=self.registry)
        self.tk = server.attach(self.tk_config, now=lambda: time.monotonic() - self._t0, metrics=metrics)
        self.metrics = metrics
        self.server = server

        def counter(name: str, doc: str) -> Any:
            return Counter(name, doc, ["model_name"], registry=self.registry).labels(model_name=model.NAME)

        self.prompt_tokens = counter("sglang:prompt_tokens", "Prompt tokens (stand-in server)")
        self.cached_tokens = counter("sglang:cached_tokens", "Prompt tokens found in the cache (stand-in)")
        self.generation_tokens = counter("sglang:generation_tokens", "Generated tokens (stand-in server)")
        cache = type(server.h.tree).__name__
        self.describe = (
            f"sglang's {cache}: {server.device_size:,} device tokens, {server.host_size:,} host tokens;"
            f" toolkv backend {self.tk.manager.backend.name}"
        )

    # ---- one scheduler iteration --------------------------------------------------------------------
    def _iteration(self) -> None:
        """The copy engine finishes what is in flight, the inbox is processed (sglang's
        ``process_input_requests``, then toolkv's tick, its AFTER hook), one batch runs."""
        s = self.server
        if s.h.is_hi:
            s.h.complete("write")
            s.h.complete("load")
        busy = bool(self.waiting) or s.busy()
        try:
            item = self.inbox.get_nowait() if busy else self.inbox.get(timeout=IDLE_WAIT_S)
        except queue.Empty:
            item = None
        while item is not None:
            self._handle(item)
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                item = None
        s.check_events()
        self.tk.tick()
        s.iterate()

    def _handle(self, item: _Turn | _Control | _Call) -> None:
        if isinstance(item, _Control):
            item.reply(self.tk.ipc_handler(item.req))
        elif isinstance(item, _Call):
            item.done(item.fn())
        else:
            from toolkv.sglang.plugin import before_handle_generate_request

            before_handle_generate_request(
                self.server.scheduler, SimpleNamespace(session_id=item.sid, session_params=None)
            )
            req = self.server.request(item.sid, item.prompt, item.output)
            self.waiting[req.rid] = item
            self.server.sched.add_request(req)

    def _admitted(self, req: Any) -> None:
        """The plugin's AFTER hook on ``get_new_batch_prefill``: the session's hand-over ends."""
        from toolkv.sglang.plugin import after_get_new_batch_prefill

        plan = SimpleNamespace(batch_to_run=SimpleNamespace(reqs=[req]))
        after_get_new_batch_prefill(plan, self.server.scheduler)

    def _finished(self, req: Any) -> None:
        turn = self.waiting.pop(req.rid, None)
        if turn is None:
            return
        prompt = len(req.origin_input_ids)
        cached = min(int(req.cached_tokens), prompt)
        self.turns += 1
        self.prompt_tokens.inc(prompt)
        self.cached_tokens.inc(cached)
        self.generation_tokens.inc(len(req.output_ids))
        turn.done(TurnResult(req.rid, list(req.output_ids), prompt, cached))

    def refresh_metrics(self) -> None:
        """On the scheduler thread: the gauges and counters from toolkv's kv_meta now, so a scrape
        shows the call that just returned (the plugin refreshes them at most once a second)."""
        self.metrics.refresh(self.tk.metrics())


class QueueTransport(ChannelTransport):
    """toolkv's reply channel (rid-keyed, :class:`~toolkv.sglang.http_api.ChannelTransport`) over
    the scheduler thread's inbox. The wire objects are pickled both ways, as on sglang's channel,
    so what crosses is exactly what would cross between processes."""

    def __init__(self, loop: SchedulerLoop, *, timeout_s: float) -> None:
        super().__init__(timeout_s=timeout_s)
        self.loop = loop

    def _send(self, req: ToolKVReqInput) -> None:
        events = asyncio.get_running_loop()

        def reply(out: Any) -> None:
            events.call_soon_threadsafe(self.replies.resolve, pickle.loads(pickle.dumps(out)))

        self.loop.submit(_Control(pickle.loads(pickle.dumps(req)), reply))

    async def call(self, req: SessionRequest) -> tuple[int, dict[str, Any]]:
        status, out = await super().call(req)
        _log_control(req.op, req.to_body(), status, out)
        return status, out


def _log_control(op: str, body: Mapping[str, Any], status: int, out: Mapping[str, Any]) -> None:
    """One line per session call, in words: what toolkv did with the session's KV."""
    sid = body.get("session_id")
    if op in ("kv_meta", "server_status") or not sid:
        return
    if status != 200:
        log.info("session %s: %s refused (%d %s): %s", sid, op, status, out.get("error"), out.get("message"))
        return
    state, tokens = out.get("state"), int(out.get("tokens") or 0)
    what = {
        "tool_start": f"tool call starts: {tokens:,} tokens of KV -> {state} (host memory while the tool runs)",
        "tool_end": f"tool call ended: {tokens:,} tokens of KV -> {state} (back on the device for the next turn)",
        "close": f"closed: toolkv holds nothing of it any more ({state})",
    }.get(op, f"{op} -> {state}")
    log.info("session %s: %s", sid, what)


# ---- the HTTP side ----------------------------------------------------------------------------------
def _session_id(body: Mapping[str, Any]) -> str | None:
    sid = body.get("session_id")
    if sid is None:
        return None
    if not isinstance(sid, str) or not 0 < len(sid) <= MAX_SESSION_ID:
        raise BadRequest(
            f"session_id must be a string of 1 to {MAX_SESSION_ID} characters", field="session_id"
        )
    return sid


async def _json_object(request: Any) -> dict[str, Any]:
    try:
        body = await request.json()
    except ValueError:
        raise BadRequest("request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    return body


def build_app(loop: SchedulerLoop, cfg: ServeConfig) -> FastAPI:
    """The FastAPI app: toolkv's session routes over :class:`QueueTransport`, and the stand-in's
    sglang routes, every one answered through the scheduler thread."""
    from toolkv import __version__

    app = FastAPI(title="toolkv serve: sglang stand-in on CPU (stand-in model)", version=__version__)
    transport = QueueTransport(loop, timeout_s=loop.tk_config.reply_timeout_s)
    install_routes(app, transport)

    async def on_scheduler(fn: Callable[[], Any]) -> Any:
        events = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = events.create_future()
        loop.submit(_Call(fn, lambda r: events.call_soon_threadsafe(fut.set_result, r)))
        return await asyncio.wait_for(fut, cfg.request_timeout_s)

    async def turn(sid: str | None, prompt: list[int], output: list[int]) -> TurnResult:
        if len(prompt) > cfg.max_prompt_tokens:
            raise BadRequest(
                f"prompt of {len(prompt):,} tokens: this server takes at most {cfg.max_prompt_tokens:,}"
                " (raise --device-tokens)",
                field="prompt",
            )
        events = asyncio.get_running_loop()
        fut: asyncio.Future[TurnResult] = events.create_future()
        loop.submit(_Turn(sid, prompt, output, lambda r: events.call_soon_threadsafe(fut.set_result, r)))
        try:
            return await asyncio.wait_for(fut, cfg.request_timeout_s)
        except TimeoutError:
            raise SchedulerTimeout(f"the request did not finish within {cfg.request_timeout_s:g}s") from None

    def error(e: ToolKVError) -> JSONResponse:
        return JSONResponse(status_code=e.http_status, content=e.to_dict())

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model.NAME, "object": "model", "owned_by": "toolkv"}]}

    @app.get("/get_model_info")
    async def model_info() -> dict[str, Any]:
        return {"model_path": model.NAME, "is_generation": True, "stand_in": True}

    @app.get("/metrics")
    async def metrics() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        await on_scheduler(loop.refresh_metrics)
        return Response(generate_latest(loop.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/generate")
    async def generate(request: Request) -> JSONResponse:
        """sglang's native route: ``input_ids`` or ``text``, ``sampling_params.max_new_tokens``,
        ``session_id``. Answers ``text``, ``output_ids`` and ``meta_info`` (``cached_tokens``)."""
        try:
            body = await _json_object(request)
            sid = _session_id(body)
            prompt = _prompt(body)
            n = _max_new_tokens(body, cfg.max_new_tokens)
            r = await turn(sid, prompt, model.output_ids(prompt, n))
        except ToolKVError as e:
            return error(e)
        log.info("session %s: /generate, %s", sid or "-", _reuse(r))
        return JSONResponse(
            {
                "text": " ".join(str(t) for t in r.output_ids),
                "output_ids": r.output_ids,
                "meta_info": _meta_info(r),
            }
        )

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> JSONResponse:
        """OpenAI's chat route, answered by the stand-in model: a tool call while the conversation
        asks for one, then text. ``session_id`` (``extra_body``) labels the session for toolkv."""
        try:
            body = await _json_object(request)
            sid = _session_id(body)
            messages, tools = _chat_input(body)
            name = model.tool_to_call(messages, tools, body.get("tool_choice"))
            prompt = model.tokenize(messages)
            r = await turn(sid, prompt, model.output_ids(prompt))
        except ToolKVError as e:
            return error(e)
        if name is not None and sid is not None and loop.tk_config.zero_change:
            # the plugin's zero-change hook: finish_reason "tool_calls" offloads the session
            await transport.send_nowait(AutoOffload(sid, tool=name))
        said = f"a tool call to {name}" if name else "text"
        log.info(
            "session %s: chat turn, %s; the stand-in model answered with %s", sid or "-", _reuse(r), said
        )
        return JSONResponse(_chat_response(body, messages, name, r))

    return app


def _reuse(r: TurnResult) -> str:
    return f"{r.prompt_tokens:,} prompt tokens, {r.cached_tokens:,} of them reused from the cache"


def _prompt(body: Mapping[str, Any]) -> list[int]:
    ids, text = body.get("input_ids"), body.get("text")
    if ids is not None:
        if (
            not isinstance(ids, list)
            or not ids
            or not all(isinstance(i, int) and 0 < i < 100_000 for i in ids)
        ):
            raise BadRequest(
                "input_ids must be a non-empty list of token ids from 1 to 99999", field="input_ids"
            )
        return list(ids)
    if isinstance(text, str) and text:
        return model.tokenize_text(text)
    raise BadRequest("give input_ids (a list of token ids) or text (a non-empty string)", field="input_ids")


def _max_new_tokens(body: Mapping[str, Any], cap: int) -> int:
    sp = body.get("sampling_params") or {}
    if not isinstance(sp, dict):
        raise BadRequest("sampling_params must be an object", field="sampling_params")
    n = sp.get("max_new_tokens", model.OUTPUT_TOKENS)
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= cap:
        raise BadRequest(
            f"sampling_params.max_new_tokens must be an integer from 1 to {cap}", field="max_new_tokens"
        )
    return n


def _chat_input(body: Mapping[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    if body.get("stream"):
        raise BadRequest("stream: the stand-in model does not stream; send stream false", field="stream")
    messages, tools = body.get("messages"), body.get("tools") or []
    if (
        not isinstance(messages, list)
        or not messages
        or not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages)
    ):
        raise BadRequest("messages must be a non-empty list of objects with a role", field="messages")
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise BadRequest("tools must be a list of objects", field="tools")
    return messages, tools


def _meta_info(r: TurnResult) -> dict[str, Any]:
    return {
        "id": r.rid,
        "finish_reason": {"type": "length", "length": len(r.output_ids)},
        "prompt_tokens": r.prompt_tokens,
        "completion_tokens": len(r.output_ids),
        "cached_tokens": r.cached_tokens,
    }


def _chat_response(
    body: Mapping[str, Any], messages: list[dict[str, Any]], name: str | None, r: TurnResult
) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": None}
    if name is not None:
        message["tool_calls"] = [
            {
                "id": f"call_{uuid.uuid4().hex[:8]}",
                "type": "function",
                "function": {"name": name, "arguments": model.tool_arguments(messages)},
            }
        ]
    else:
        message["content"] = model.answer_text(messages)
    choice: dict[str, Any] = {
        "index": 0,
        "message": message,
        "finish_reason": "tool_calls" if name is not None else "stop",
        "logprobs": None,
    }
    if body.get("return_meta_info"):
        choice["meta_info"] = _meta_info(r)
    n_out = len(r.output_ids)
    return {
        "id": r.rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": str(body.get("model") or model.NAME),
        "choices": [choice],
        "usage": {
            "prompt_tokens": r.prompt_tokens,
            "completion_tokens": n_out,
            "total_tokens": r.prompt_tokens + n_out,
            "prompt_tokens_details": {"cached_tokens": r.cached_tokens},
        },
    }


# ---- running it -------------------------------------------------------------------------------------
def serve(
    cfg: ServeConfig,
    tk_config: ToolKVConfig,
    *,
    out: Callable[[str], None] = print,
    notes: Sequence[str] = (),
) -> int:
    """Bind 127.0.0.1:``cfg.port`` (0: a free port), build the scheduler, serve until Ctrl-C, then
    stop the scheduler thread and release the caches. The bind comes first, so a port in use is
    an ``OSError`` before anything is built."""
    import socket

    import uvicorn
    from prometheus_client import CollectorRegistry

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(("127.0.0.1", cfg.port))
    except OSError:
        sock.close()
        raise
    port = sock.getsockname()[1]
    loop = SchedulerLoop(cfg, dataclasses.replace(tk_config, enable=True), registry=CollectorRegistry())
    try:
        loop.start()
        url = f"http://127.0.0.1:{port}"
        out(
            f"toolkv serve: an sglang stand-in on CPU (no GPU; answers come from a deterministic stand-in model, {model.NAME})"
        )
        out(f"  cache: {loop.describe}")
        for line in notes:
            out(line)
        out(f"  listening on {url}  (Ctrl-C stops it)")
        out(f"  try: python examples/agent_openai.py --base-url {url}")
        out(f"       toolkv doctor {url}")
        out(f"       curl -s {url}/metrics | grep -E 'toolkv:tokens_total|sglang:cached_tokens_total'")
        config = uvicorn.Config(
            app=build_app(loop, cfg), log_level="warning", access_log=False, lifespan="off"
        )
        with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C is how it stops: uvicorn re-raises it
            uvicorn.Server(config).run(sockets=[sock])
    finally:
        sock.close()
        turns = loop.turns
        loop.stop()
    out(f"toolkv serve: stopped after {turns} turn{'s' if turns != 1 else ''}")
    return 0
