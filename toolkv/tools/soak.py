"""The CPU soak: toolkv's scheduler side and HTTP side in one process over sglang's REAL caches.

Many agent sessions (``toolkv.workload.plan``'s sessions, scaled to CPU-sized prompts) talk
to toolkv's real FastAPI routes (``http_api.build_app``) through httpx's ASGI transport; the
routes reach the scheduler side through a queue that the simulated scheduler loop drains once per
iteration, in the order sglang's ``event_loop_normal`` runs (scheduler.py:1520):

1. ``process_input_requests``: toolkv's control requests (``SchedulerToolKV.ipc_handler``) and
   ``flush_cache`` requests (sglang's real ``SchedulerFlushWrapper.handle``), then the wrapper's
   ``check_pending()`` (a deferred ``/flush_cache?timeout=T`` runs here, on the first idle
   iteration), then toolkv's AFTER hook: the tick;
2. ``get_next_batch_to_run``, the forward and the batch's results, by the scheduler model every
   driver runs (:class:`~toolkv.twin.scheduler.TwinScheduler`, or its 0.5.23 subclass): sglang's
   ack checks (``check_hicache_events``), the last prefill batch merged into the running batch,
   the waiting requests (real ``Req`` objects) admitted by sglang's ``PrefillAdder`` (prefix
   matched, HiCache ``init_load_back``, locked; toolkv's AFTER hook on ``get_new_batch_prefill``
   ends hand-overs), chunked prefill and decode steps, retractions; the forward
   (:class:`~toolkv.twin.forward.KVForward`) waits for the loads, checks every reused prefix byte
   for byte and writes the new positions' KV (deterministic per token); a finished request's KV
   is inserted by the real ``cache_finished_req`` / ``release_kv_cache``, whose toolkv hook
   records the turn;
3. the copy engine (test double, ``ControlledTransferEngine``) finishes some of the writes and
   loads in flight, so acks retire one or more iterations later, as on a GPU.

Mixed in: sessions abandoned mid-tool (never a ``tool_end``: the TTL releases them), requests
aborted before and after admission, tool_end racing the session's next request, client
disconnects (a ``tool_start`` whose reply is lost, re-sent with ``prior_epoch``), deferred flushes,
and on a plain ``RadixCache`` other requests re-inserting an offloaded session's branch. Pool
occupancy, toolkv's protected tokens and the process's RSS are sampled; at the end every
session is closed, the caches drained, and every counter must equal its initial value.

Test doubles, each for what cannot exist on CPU: the harnesses' three (unpinned host pool, torch
copy primitives, the controlled copy engine), :class:`~toolkv.twin.server.SchedulerStandIn` (sglang's ``Scheduler``
needs a model runner; the real ``Scheduler.is_fully_idle`` and ``Scheduler.flush_cache`` run
bound to it, over the scheduler model's queues; the server stand-in is
:mod:`toolkv.twin.server`, the one the demo and the fault bench run too), :class:`SoakChannel` (the tokenizer-manager <->
scheduler ZMQ channel: the wire objects are pickled both ways) and the forward (``KVForward``: the
model's KV as a function of the token ids, the planned output ids as its samples).
``python -m toolkv.tools.soak`` is the long run (``make soak-long``).
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import json
import logging
import os
import pickle
import random
import resource
import sys
import time
import zlib
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from toolkv.core import requests
from toolkv.core.phases import Phase
from toolkv.errors import ToolKVError
from toolkv.sglang.cache_hooks import toolkv_cache_hooks
from toolkv.sglang.config import ToolKVConfig
from toolkv.sglang.http_api import ChannelTransport, build_app
from toolkv.sglang.ipc import ToolKVReqInput
from toolkv.twin.clock import Clock, FixedIteration
from toolkv.twin.server import ServerKind, make_server
from toolkv.workload.plan import SessionPlan, Workload, plan_session

StackKind = ServerKind
STACKS: tuple[StackKind, ...] = ("hiradix", "pin", "shadow", "unified")
log = logging.getLogger("toolkv.soak")


# ---- the channel: the HTTP routes' requests queue up for the scheduler loop -------------------------
class SoakChannel(ChannelTransport):
    """TEST DOUBLE of sglang's tokenizer-manager <-> scheduler channel (ZMQ): a request is pickled
    onto the scheduler's inbox; the scheduler loop handles it in its next ``process_input_requests``
    and the pickled reply is delivered through toolkv's real rid-keyed ``ReplyRegistry``."""

    def __init__(self) -> None:
        super().__init__(timeout_s=1e9)  # virtual time: the loop, not a wall clock, bounds a reply
        self.inbox: deque[ToolKVReqInput] = deque()

    def _send(self, req: ToolKVReqInput) -> None:
        self.inbox.append(pickle.loads(pickle.dumps(req)))


# ---- configuration and results ----------------------------------------------------------------------
@dataclass(frozen=True)
class SoakConfig:
    stack: StackKind = "hiradix"
    tool_calls: int = 10_000  # stop starting tool calls after this many
    concurrent: int = 12  # sessions alive at once
    seed: int = 0
    device_tokens: int = 3072
    host_ratio: float = 3.0
    context_len: int = 1024
    ttl_s: float = 120.0
    handover_ttl_s: float = 5.0
    tick_s: float = 0.1  # virtual seconds per scheduler iteration
    abandon_p: float = 0.04  # per session: vanishes after a tool_start (the TTL releases it)
    abort_waiting_p: float = 0.03  # per request: aborted before admission (client gone)
    abort_running_p: float = 0.03  # per request: aborted after admission (ends early)
    race_p: float = 0.05  # per tool call: the next request sent without waiting for tool_end's reply
    disconnect_p: float = 0.02  # per tool call: tool_start's reply lost; re-sent with prior_epoch
    close_p: float = 0.85  # per finished session: the client closes it (else it just stops)
    repopulate_p: float = 0.1  # per tool call (pin/shadow): another request re-inserts the branch
    http_share: float = 0.25  # sessions whose calls go through the FastAPI routes (the rest: the channel)
    closed_history: int = 10_000  # closed sessions the manager remembers (TOOLKV_CLOSED_HISTORY)
    idle_ttl_s: float = (
        3600.0  # a session holding nothing and silent this long is forgotten (TOOLKV_IDLE_TTL_S)
    )
    # TOOLKV_LAZY_FREE: off here, so that every tool call takes the host->GPU restore path the soak
    # checks byte for byte (with lazy free most sessions come back resident: tests/test_lazy_free.py)
    lazy_free: bool = False
    flush_every: int = 2_500  # tool calls between deferred /flush_cache?timeout requests
    sample_every: int = 250  # iterations between samples
    progress: bool = False

    def workload(self) -> Workload:
        # the agent workload's shape at CPU scale: ~25 turns, a first prompt of ~48 tokens growing
        # by ~14 per turn, the trace-calibrated tool durations (virtual time)
        return Workload(
            initial_sessions=self.concurrent,
            turns_median=12,
            turns_sigma=0.4,
            first_tokens=48,
            growth_per_turn=14,
            output_tokens=4,
            result_sigma=0.5,
            max_context=self.context_len - 8,
            seed=self.seed,
        )


@dataclass
class Sample:
    iteration: int
    now: float
    tool_calls: int
    rss_bytes: int
    device_used: int
    host_used: int
    protected_tokens: int
    sessions: int


@dataclass
class SoakResult:
    config: dict[str, Any]
    tool_calls: int = 0
    sessions: int = 0
    iterations: int = 0
    seconds: float = 0.0
    http_requests: int = 0  # through the FastAPI routes
    channel_requests: int = 0  # straight into the routes' channel
    replies: Counter[str] = field(default_factory=Counter)  # "op status code"
    events: Counter[str] = field(default_factory=Counter)
    restores_verified: int = 0
    restored_bytes_checked: int = 0
    bytes_checked: int = 0
    byte_mismatches: int = 0
    flushes: Counter[str] = field(default_factory=Counter)
    counters: dict[str, int] = field(default_factory=dict)
    left_open: int = 0  # sessions whose client never closed them (abandoned, or just stopped)
    tracked_at_end: int = 0  # records the manager still held before the final close sweep
    leaks: list[str] = field(default_factory=list)
    # toolkv steps that took device room sglang had promised (spec PromiseKept): each a line
    promise_broken: list[str] = field(default_factory=list)
    flat_problems: list[str] = field(default_factory=list)
    error_logs: list[str] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["replies"] = dict(self.replies)
        d["events"] = dict(self.events)
        d["flushes"] = dict(self.flushes)
        return d


def rss_bytes() -> int:
    """Resident set size of this process now (``/proc/self/statm``; ``ru_maxrss`` elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def flat_problems(samples: list[Sample], *, warmup: float = 0.25, sizes: dict[str, int]) -> list[str]:
    """After the warm-up, a quantity must not trend upwards. The samples after warm-up are cut
    in thirds; the median of the last third may exceed the maximum of the first third by at most
    a slack (RSS: 24 MiB; pool occupancy and protected tokens: 5 % of the pool). A leak of a
    few slots or protections per tool call, or a record kept per call, raises the whole last
    third above anything the first third reached; the ordinary ups and downs of a steady
    population of sessions do not (the median ignores a peak)."""
    body = samples[int(len(samples) * warmup) :]
    if len(body) < 6:
        return [f"too few samples after warm-up ({len(body)}) to judge a trend"]
    third = len(body) // 3
    early, late = body[:third], body[-third:]
    out: list[str] = []
    checks: list[tuple[str, Callable[[Sample], int], float]] = [
        ("rss_bytes", lambda s: s.rss_bytes, 24 * 2**20),
        ("device_used", lambda s: s.device_used, 0.05 * sizes["device"]),
        ("host_used", lambda s: s.host_used, 0.05 * max(1, sizes["host"])),
        ("protected_tokens", lambda s: s.protected_tokens, 0.05 * max(sizes["device"], sizes["host"])),
    ]
    for name, get, slack in checks:
        e = max(get(s) for s in early)
        lt = sorted(get(s) for s in late)[len(late) // 2]
        if lt > e + slack:
            out.append(
                f"{name} grew after warm-up: max {e} over samples {early[0].iteration}..{early[-1].iteration},"
                f" median {lt} over {late[0].iteration}..{late[-1].iteration} (slack {slack:.0f})"
            )
    return out


def problems(r: SoakResult, *, min_calls: int, min_sessions: int) -> list[str]:
    """Everything a soak run must show, as failure lines that carry the numbers: the call and
    session counts, no leak, no upward trend, no byte that differs, no ERROR line, no session
    closed by a reset, and that every fault it mixes in actually happened."""
    out = list(r.leaks) + list(r.flat_problems) + list(r.promise_broken)
    stack = r.config["stack"]
    if r.tool_calls < min_calls or r.sessions < min_sessions:
        out.append(
            f"ran {r.tool_calls} tool calls over {r.sessions} sessions (< {min_calls} / {min_sessions})"
        )
    if r.byte_mismatches:
        out.append(
            f"{r.byte_mismatches} reused prefixes held wrong bytes ({r.bytes_checked:,} bytes checked)"
        )
    if r.error_logs:
        out.append(f"ERROR lines: {r.error_logs}")
    if r.counters.get("reset_mid_copy"):
        out.append(f"{r.counters['reset_mid_copy']} sessions closed by a tree reset")
    need = ["abandoned", "aborted_waiting", "aborted_running", "raced", "disconnect_replayed"]
    if stack in ("pin", "shadow"):
        need.append("repopulated")
    out += [f"no {e} event happened ({dict(r.events)})" for e in need if not r.events.get(e)]
    if not r.flushes.get("ok"):
        out.append(f"no flush ran ({dict(r.flushes)})")
    if not r.counters.get("expired"):
        out.append("no session expired by the TTL")
    if stack in ("hiradix", "unified") and not (r.restores_verified and r.restored_bytes_checked):
        out.append("no restored session's bytes were checked")
    return out


# ---- the soak -----------------------------------------------------------------------------------------
class _ErrorLogs(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


class Soak:
    """One soak run (see the module docstring). ``run()`` returns a :class:`SoakResult`."""

    def __init__(self, cfg: SoakConfig) -> None:
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        self.now = 0.0
        self.clock: Clock = FixedIteration(cfg.tick_s)  # an iteration is tick_s, whatever it ran
        self.iteration = 0
        self.result = SoakResult(config=asdict(cfg))
        self.futures: dict[str, asyncio.Future[list[int]]] = {}  # rid -> the client waiting for it
        self.aborting: set[str] = set()  # rids the client aborts once they are admitted
        self.restored: set[str] = set()  # rids admitted while their session's restore was loading
        self.timers: list[tuple[float, int, asyncio.Future[None]]] = []
        self._seq = 0
        self.in_http = 0
        self.calls_started = 0
        self.next_flush = cfg.flush_every
        self.flush_waiters: list[asyncio.Future[Any]] = []
        self._flush_pending = False
        self._progress = 0  # the last iteration a request finished (a stall detector)
        # requests held in front of the scheduler while a flush waits for an idle moment (an
        # operator drains traffic before /flush_cache; sglang itself would keep admitting them)
        self.held: list[Any] = []

    # ---- clients' view -------------------------------------------------------------------------------
    async def sleep(self, seconds: float) -> None:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._seq += 1
        heapq.heappush(self.timers, (self.now + max(0.0, seconds), self._seq, fut))
        await fut

    async def http(
        self, method: str, path: str, *, json: dict[str, Any], routes: bool = True
    ) -> tuple[int, dict[str, Any]]:
        """One control call. ``routes``: through toolkv's FastAPI routes (httpx's ASGI transport:
        validation, the error mapping, JSON both ways); else straight into the same channel the
        routes use (``ChannelTransport.call``: rid, reply registry, pickled wire), which costs a
        fifth as much and lets the soak reach its call count within CI's budget."""
        op = path.rsplit("/", 1)[-1]
        self.in_http += 1
        try:
            if routes:
                r = await self.client.request(method, path, json=json)
                status, body = r.status_code, r.json()
                self.result.http_requests += 1
            else:
                try:  # the request the route would build (and check), sent on its channel
                    status, body = await self.channel.call(requests.parse(op, json))
                except ToolKVError as e:
                    status, body = e.http_status, e.to_dict()
                self.result.channel_requests += 1
        finally:
            self.in_http -= 1
        self.result.replies[f"{op} {status} {body.get('error', body.get('state', ''))}"] += 1
        return status, body

    def submit(
        self, sid: str | None, prompt: list[int], output: list[int]
    ) -> tuple[Any, asyncio.Future[list[int]]]:
        """A generate request reaches the scheduler (``handle_generate_request``: toolkv's BEFORE
        hook may restore the session first) and waits in its queue to be admitted; the future
        resolves to the output it produced."""
        from toolkv.sglang.plugin import before_handle_generate_request

        before_handle_generate_request(self.sched, SimpleNamespace(session_id=sid, session_params=None))
        req = self.stack.request(sid, prompt, output)
        fut: asyncio.Future[list[int]] = asyncio.get_running_loop().create_future()
        self.futures[req.rid] = fut
        if self.flush_waiters:
            self.held.append(req)
        else:
            self.stack.sched.add_request(req)
        return req, fut

    async def agent(self, plan: SessionPlan) -> None:
        """One agent session: turns and tool calls as planned, with the faults of the config."""
        cfg, res = self.cfg, self.result
        rng = random.Random(zlib.crc32(f"{cfg.seed}/{plan.sid}".encode()))
        sid = plan.sid
        res.sessions += 1
        ctx: list[int] = []
        prompt = list(plan.first)
        epoch = 0
        routes = rng.random() < cfg.http_share
        abandon_at = rng.randrange(max(1, len(plan.tools_s))) if rng.random() < cfg.abandon_p else -1
        racing: asyncio.Task[tuple[int, dict[str, Any]]] | None = None
        for turn in range(plan.turns):
            output = [rng.randrange(1000, 120_000) for _ in range(4)]
            output = await self._request(sid, ctx + prompt, output, rng)
            if racing is not None:  # tool_end raced this request: its answer comes when it comes
                await racing
                racing = None
            ctx = ctx + prompt + output
            if turn >= len(plan.tools_s) or self.calls_started >= cfg.tool_calls:
                break
            # ---- the tool call --------------------------------------------------------------------
            self.calls_started += 1
            if self.calls_started >= self.next_flush:
                self.next_flush += cfg.flush_every
                asyncio.get_running_loop().create_task(self._flush())
            if rng.random() < cfg.disconnect_p:
                # the reply is lost (connection dropped); the agent re-sends with the epoch it knew
                await self.channel.send_nowait(requests.ToolStart(sid))
                await self.sleep(cfg.tick_s * 2)
                st, body = await self.http(
                    "POST",
                    "/session/tool_start",
                    json={"session_id": sid, "prior_epoch": epoch},
                    routes=routes,
                )
                res.events["disconnect_resent"] += 1
                res.events["disconnect_replayed"] += int(bool(body.get("replayed")))
            else:
                st, body = await self.http(
                    "POST", "/session/tool_start", json={"session_id": sid}, routes=routes
                )
            started = st == 200
            if started:
                epoch = int(body["epoch"])
            if turn == abandon_at:
                res.events["abandoned"] += 1
                res.left_open += 1
                return  # never a tool_end, a next request or a close: the TTL must release it
            if self.stack.name in ("pin", "shadow") and rng.random() < cfg.repopulate_p:
                self._repopulate(sid)
            await self.sleep(plan.tools_s[turn])
            prompt = list(plan.results[turn])
            if not started:
                continue  # nothing to end: the next request recomputes what is missing
            end = self.http(
                "POST", "/session/tool_end", json={"session_id": sid, "epoch": epoch}, routes=routes
            )
            if rng.random() < cfg.race_p:  # the next request is sent without waiting for the reply
                res.events["raced"] += 1
                racing = asyncio.get_running_loop().create_task(end)
                await asyncio.sleep(0)
            else:
                await end
        if racing is not None:
            await racing
        if rng.random() < cfg.close_p:
            await self.http("POST", "/session/close", json={"session_id": sid}, routes=routes)
        else:
            res.left_open += 1

    async def _request(self, sid: str, prompt: list[int], output: list[int], rng: random.Random) -> list[int]:
        """Send the turn's request and return the output it produced. One aborted before
        admission is sent again later, as an agent retries; one aborted after admission ends
        early (the part computed is cached, the output is cut)."""
        while True:
            req, fut = self.submit(sid, prompt, output)
            if rng.random() < self.cfg.abort_running_p:
                # the client goes away once it runs: sglang's abort sets ``to_finish``, and the
                # request ends at its next result with the part computed cached
                self.aborting.add(req.rid)
            if rng.random() < self.cfg.abort_waiting_p:
                await asyncio.sleep(0)  # the client goes away before the scheduler admits it
                if self._abort_waiting(req):
                    self.result.events["aborted_waiting"] += 1
                    await self.sleep(rng.uniform(0.5, 2.0 * self.cfg.handover_ttl_s))
                    continue
            return await fut

    def _abort_waiting(self, req: Any) -> bool:
        """Abort a request still waiting (held or queued); False once it was admitted."""
        held = next((i for i, r in enumerate(self.held) if r is req), None)
        if held is not None:
            del self.held[held]
        elif not self.stack.drop(req):
            return False
        self.aborting.discard(req.rid)
        self.futures.pop(req.rid).set_result([])
        return True

    def _admitted(self, req: Any) -> None:
        """A request is in a new prefill batch: the plugin's AFTER hook on
        ``get_new_batch_prefill`` (its session's hand-over ends); a client gone since aborts it."""
        from sglang.srt.managers.schedule_batch import FINISH_ABORT

        from toolkv.sglang.plugin import after_get_new_batch_prefill

        sid = req.session_id
        rec = self.tk.manager.sessions.get(sid) if sid else None
        # toolkv's load of the session is in flight (Restoring) or done and not yet handed over:
        # the forward waits for it, then checks the restored prefix byte for byte
        if rec is not None and rec.state in (Phase.RESTORING, Phase.HANDOVER) and rec.restore == "loading":
            self.restored.add(req.rid)
        after_get_new_batch_prefill(SimpleNamespace(batch_to_run=SimpleNamespace(reqs=[req])), self.sched)
        if req.rid in self.aborting:
            self.aborting.discard(req.rid)
            req.to_finish = FINISH_ABORT()
            self.result.events["aborted_running"] += 1

    def _finished(self, req: Any) -> None:
        """A request's result is processed and its KV released into the tree: its client has it."""
        self.futures.pop(req.rid).set_result(list(req.output_ids))
        self._progress = self.iteration

    def _repopulate(self, sid: str) -> None:
        """Another request (no session label) runs the offloaded session's tokens, re-inserting
        its branch into a plain RadixCache while toolkv holds it (pin: a no-op for the tree;
        shadow: the snapshot's restore must then free its duplicate slots)."""
        rec = self.tk.manager.sessions.get(sid)
        if rec is None or rec.state not in (Phase.OFFLOADED, Phase.OFFLOADING) or not rec.tokens:
            return
        self.submit(None, list(rec.tokens), [1])  # nobody waits for its answer
        self.result.events["repopulated"] += 1

    async def _flush(self) -> None:
        """An operator's ``/flush_cache?timeout=T``: drains requests (no new ones are admitted
        while it waits, as sglang keeps them queued for it), runs on the first idle iteration."""
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.flush_waiters.append(fut)
        out = await fut
        self.result.flushes["ok" if out else "timed_out"] += 1

    # ---- the scheduler loop --------------------------------------------------------------------------------
    def step(self) -> None:
        cfg, res, sched, tk = self.cfg, self.result, self.sched, self.tk
        self.iteration += 1
        # 1. process_input_requests: control requests, then the deferred flush, then toolkv's tick
        loop = asyncio.get_running_loop()
        while self.channel.inbox:
            room = self._promise_room()
            req = self.channel.inbox.popleft()
            out = pickle.loads(pickle.dumps(tk.ipc_handler(req)))
            self._check_promise(room, getattr(req, "op", "ipc"))
            loop.call_soon(self.channel.replies.resolve, out)
        if self.flush_waiters and sched.flush_wrapper._pending is None and not self._flush_pending:
            answer = sched.request_flush(timeout_s=30.0)
            if answer is not None:  # idle already: answered at once
                self.flush_waiters.pop(0).set_result(bool(answer.success))
            else:
                self._flush_pending = True
        before = len(sched.flush_replies.sent)
        sched.flush_wrapper.check_pending()  # runs a pending flush on the first idle iteration
        if len(sched.flush_replies.sent) > before:
            self._flush_pending = False
            self.flush_waiters.pop(0).set_result(bool(sched.flush_replies.sent[-1].success))
        if not self.flush_waiters and self.held:
            for req in self.held:
                self.stack.sched.add_request(req)
            self.held = []
        room = self._promise_room()
        tk.tick()  # the AFTER hook of process_input_requests
        self._check_promise(room, "tick")
        # 2. get_next_batch_to_run (sglang's ack checks first; toolkv's AFTER hook on
        # get_new_batch_prefill for each admitted request), the forward, the batch's results
        mism = self.stack.byte_mismatches
        batch = self.stack.sched.next_batch()
        if batch is not None:
            seen = self.stack.bytes_checked
            self.stack.forward.run(batch)
            if self.stack.byte_mismatches > mism:
                log.error("reused prefix holds wrong bytes: requests %s", self.stack.forward.mismatched[-3:])
            restored = [r for r in batch.reqs if r.rid in self.restored]
            if restored:
                self.restored.difference_update(r.rid for r in restored)
                res.restores_verified += len(restored)
                res.restored_bytes_checked += self.stack.bytes_checked - seen
            self.stack.sched.finish_batch(batch)
        # 3. the copy engine
        self.stack.progress_copies(self.rng)
        # the clock: one iteration, or straight to the next wake-up when nothing at all happens
        idle = (
            not self.stack.sched.busy
            and not self.held
            and not self.channel.inbox
            and self.in_http == 0
            and not self.stack.busy()
        )
        step = self.clock.iteration_s(None, self.now)
        nxt = self.timers[0][0] if self.timers else self.now + step
        self.now = max(self.now + step, nxt) if idle else self.now + step
        while self.timers and self.timers[0][0] <= self.now:
            _, _, timer = heapq.heappop(self.timers)
            if not timer.done():
                timer.set_result(None)
        if self.iteration % cfg.sample_every == 0:
            self._sample()

    def _promise_room(self) -> int:
        """Free + evictable device tokens less what sglang has promised (the rest of a chunked
        prefill, the running decode): what a toolkv step must not drive below zero."""
        from toolkv.sglang.scheduler_side import promised_tokens

        tree = self.stack.h.tree
        free = int(tree.token_to_kv_pool_allocator.available_size())
        return free + int(tree.evictable_size()) - promised_tokens(self.sched)

    def _check_promise(self, before: int, what: str) -> None:
        """Spec ``PromiseKept`` on the soak's real pools: a toolkv step that found the promise kept
        must leave it kept (the 0.5.23 crash: a burst of tool_starts locked it away)."""
        after = self._promise_room()
        if before >= 0 > after and len(self.result.promise_broken) < 20:
            self.result.promise_broken.append(
                f"iteration {self.iteration}: {what} took device room sglang had promised ({before} -> {after})"
            )

    def _sample(self) -> None:
        dev, host = self.stack.occupancy()
        b: Any = self.tk.manager.backend
        prot = int(
            getattr(b, "protected_tokens", 0)
            or getattr(b, "pinned_tokens", 0)
            or getattr(b, "host_tokens", 0)
        )
        self.result.samples.append(
            Sample(
                self.iteration,
                self.now,
                self.calls_started,
                rss_bytes(),
                dev,
                host,
                prot,
                len(self.tk.manager.sessions),
            )
        )
        if self.cfg.progress:
            print(
                f"\r[{self.cfg.stack}] calls {self.calls_started:>7,}/{self.cfg.tool_calls:,}"
                f"  sessions {self.result.sessions:>5}  it {self.iteration:>8,}  rss {rss_bytes() / 2**20:6.0f} MiB"
                f"  dev {dev:>6} host {host:>6} prot {prot:>6}",
                end="",
                file=sys.stderr,
                flush=True,
            )

    async def _main(self) -> SoakResult:
        import httpx

        cfg, res = self.cfg, self.result
        self.stack = make_server(
            cfg.stack, device_tokens=cfg.device_tokens, host_ratio=cfg.host_ratio, context_len=cfg.context_len
        )
        errors = _ErrorLogs()
        logging.getLogger("toolkv").addHandler(errors)
        t0 = time.perf_counter()
        try:
            with toolkv_cache_hooks(self.stack.tree_api):
                initial = self.stack.accounting()
                self.sched = self.stack.scheduler
                self.stack.on_admitted = self._admitted
                self.stack.on_finished = self._finished
                tk_cfg = ToolKVConfig(
                    ttl_s=cfg.ttl_s,
                    handover_ttl_s=cfg.handover_ttl_s,
                    fallback="shadow" if cfg.stack == "shadow" else "pin",
                    sweep_every=1,
                    closed_history=cfg.closed_history,
                    idle_ttl_s=cfg.idle_ttl_s,
                    lazy_free=cfg.lazy_free,
                )
                self.tk = self.stack.attach(tk_cfg, now=lambda: self.now)
                self.channel = SoakChannel()
                transport = httpx.ASGITransport(app=build_app(self.channel))
                async with httpx.AsyncClient(transport=transport, base_url="http://toolkv") as client:
                    self.client = client
                    await self._drive()
                    # the end: every session still tracked is closed (abandoned ones included)
                    res.tracked_at_end = len(self.tk.manager.sessions)
                    for sid in list(self.tk.manager.sessions):
                        closing = asyncio.get_running_loop().create_task(
                            self.http("POST", "/session/close", json={"session_id": sid})
                        )
                        while not closing.done():
                            self.step()
                            await asyncio.sleep(0)
                for _ in range(4):
                    self.step()
                    await asyncio.sleep(0)
                self._sample()
                res.counters = {k: int(v) for k, v in self.tk.manager.counters.items()}
                self._leaks(initial)
                res.bytes_checked = self.stack.bytes_checked
                res.byte_mismatches = self.stack.byte_mismatches
        finally:
            logging.getLogger("toolkv").removeHandler(errors)
            self.stack.close()
        res.error_logs = errors.lines[:20]
        res.tool_calls = self.calls_started
        res.iterations = self.iteration
        res.seconds = time.perf_counter() - t0
        res.flat_problems = flat_problems(
            res.samples[:-1], sizes={"device": self.stack.device_size, "host": self.stack.host_size}
        )
        if cfg.progress:
            print(file=sys.stderr)
        return res

    async def _drive(self) -> None:
        """Run the agents: ``concurrent`` at a time, new ones as others end, until the tool-call
        budget is used; the scheduler loop runs in between."""
        cfg, w = self.cfg, self.cfg.workload()
        loop = asyncio.get_running_loop()
        live: set[asyncio.Task[None]] = set()
        index = 0

        def launch() -> None:
            nonlocal index
            plan = plan_session(w, index, self.now, random.Random(cfg.seed * 1_000_003 + index), prefix="a")
            index += 1
            live.add(loop.create_task(self.agent(plan)))

        for _ in range(cfg.concurrent):
            launch()
        # A run that stops making progress (e.g. leaked device slots: nothing can be admitted
        # any more) ends as a failure with the numbers, not as a hang.
        while live:
            if self.iteration - self._progress > 5_000:
                self.result.leaks.append(
                    f"stalled: {self.iteration} iterations for {self.calls_started} tool calls;"
                    f" {len(self.stack.sched.waiting_queue)} requests waiting,"
                    f" {len(self.stack.sched.running_batch.reqs)} running, device/host in use"
                    f" {self.stack.occupancy()}"
                )
                for t in live:
                    t.cancel()
                for r in list(self.stack.sched.waiting_queue):
                    self.stack.drop(r)
                self.held, self.futures = [], {}
                return
            self.step()
            for _ in range(3):  # let the woken clients and their HTTP round trips move on
                await asyncio.sleep(0)
            for t in [t for t in live if t.done()]:
                live.discard(t)
                t.result()  # an agent's exception is the soak's failure
                if self.calls_started < cfg.tool_calls:
                    launch()

    def _leaks(self, initial: Any) -> None:
        """Every counter back to its initial value: nothing tracked, held, queued or in flight."""
        res, m, stack = self.result, self.tk.manager, self.stack
        stack.drain()
        after = stack.accounting()
        if after != initial:
            res.leaks.append(f"cache accounting {after} != initial {initial}")
        b: Any = m.backend
        for attr in ("protected_tokens", "pinned_tokens", "host_tokens"):
            v = getattr(b, attr, 0)
            if v:
                res.leaks.append(f"backend {attr} = {v}")
        # a closed record keeps kv_meta's answer only: a node reference would keep the session's
        # evicted path alive for as long as the bounded closed history remembers it
        held = sum(1 for r in m._closed.values() if r.node is not None)
        if held:
            res.leaks.append(f"{held} closed records still reference a tree node")
        for name in ("sessions", "_offloading", "_restoring", "_prefetching"):
            if getattr(m, name):
                res.leaks.append(f"manager.{name} holds {len(getattr(m, name))}")
        if getattr(b, "_loads", None):
            res.leaks.append(f"backend loads in flight: {len(b._loads)}")
        if len(self.channel.replies):
            res.leaks.append(f"{len(self.channel.replies)} replies never delivered")
        if self.stack.sched.busy or self.held or self.futures or any(not f.done() for _, _, f in self.timers):
            res.leaks.append("requests or client timers left over")

    def run(self) -> SoakResult:
        return asyncio.run(self._main())


def run_soak(cfg: SoakConfig) -> SoakResult:
    return Soak(cfg).run()


# ---- the long run (make soak-long) ------------------------------------------------------------------------
def plot(results: list[SoakResult], path: Path) -> None:
    """One column per stack: RSS, pool occupancy and protected tokens against tool calls."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(results), figsize=(5 * len(results), 7), squeeze=False)
    for col, r in enumerate(results):
        xs = [s.tool_calls for s in r.samples]
        ax = axes[0][col]
        ax.plot(xs, [s.rss_bytes / 2**20 for s in r.samples], color="tab:red")
        ax.set_title(f"{r.config['stack']}: {r.tool_calls:,} calls, {r.sessions} sessions")
        ax.set_ylabel("RSS (MiB)")
        ax.set_ylim(bottom=0)
        ax = axes[1][col]
        for name, color in (
            ("device_used", "tab:blue"),
            ("host_used", "tab:green"),
            ("protected_tokens", "tab:orange"),
        ):
            ax.plot(xs, [getattr(s, name) for s in r.samples], label=name, color=color, linewidth=0.8)
        ax.set_xlabel("tool calls")
        ax.set_ylabel("tokens")
        ax.legend(loc="upper right", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m toolkv.tools.soak", description=__doc__.split("\n")[0])
    p.add_argument("--calls", type=int, default=100_000)
    p.add_argument("--stacks", default="hiradix,pin,shadow", help=f"comma-separated, of {','.join(STACKS)}")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("results/soak"))
    p.add_argument(
        "--closed-history",
        type=int,
        default=10_000,
        help="closed sessions the manager remembers (TOOLKV_CLOSED_HISTORY; each keeps its tokens)",
    )
    a = p.parse_args(argv)
    stacks = [s for s in a.stacks.split(",") if s]
    bad = [s for s in stacks if s not in STACKS]
    if bad or a.calls < 1:
        p.error(f"unknown stack {bad}" if bad else "--calls must be >= 1")
    a.out.mkdir(parents=True, exist_ok=True)
    results: list[SoakResult] = []
    failed = False
    for s in stacks:
        cfg = SoakConfig(
            stack=s, tool_calls=a.calls, seed=a.seed, closed_history=a.closed_history, progress=True
        )  # type: ignore[arg-type]
        r = run_soak(cfg)
        bad = problems(r, min_calls=a.calls, min_sessions=min(200, a.calls // 50))
        failed |= bool(bad)
        print(
            f"{s}: {r.tool_calls:,} tool calls, {r.sessions} sessions, {r.iterations:,} iterations in {r.seconds:.1f}s;"
            f" restores verified {r.restores_verified:,} ({r.restored_bytes_checked:,} bytes),"
            f" mismatches {r.byte_mismatches}, flushes {dict(r.flushes)}, leaks {len(r.leaks)},"
            f" trend problems {len(r.flat_problems)}" + "".join(f"\n  ! {x}" for x in bad)
        )
        (a.out / f"soak_{s}.json").write_text(json.dumps(r.to_json(), indent=1, default=str))
        results.append(r)
    plot(results, a.out / "soak.png")
    print(f"wrote {a.out / 'soak.png'} and {', '.join(str(a.out / f'soak_{s}.json') for s in stacks)}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
