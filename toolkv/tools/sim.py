"""An agent workload over a real cache stack: sessions alternate generation turns and tool calls.

This is what ``toolkv demo`` runs (CPU, sglang's real HiRadixCache, the controllable copy engine
standing in for the GPU's DMA). It is a driver over the same server stand-in as the twin and the
soak: toolkv's scheduler side attached as the plugin attaches it (its cache hooks applied through
sglang's ``HookRegistry``, the tick on an agreed clock), the scheduler model
(:class:`~toolkv.twin.scheduler.TwinScheduler`: real ``Req`` objects admitted by sglang's
``PrefillAdder``, prefill and decode) and the forward that writes and checks KV bytes
(:class:`~toolkv.twin.forward.KVForward`). One loop iteration is one scheduler iteration, in
sglang's order: copies that have had their time finish; the agents' messages (generate requests
through toolkv's BEFORE hook, ``tool_start``/``tool_end``/``close`` through its control handler);
toolkv's tick; ``get_next_batch_to_run`` (which processes HiCache's acks), the forward, the results.
A finished request's KV enters the tree through the real ``cache_finished_req``, whose toolkv hook
records the turn.

toolkv runs with ``TOOLKV_LAZY_FREE=0`` here: every offload frees its GPU copy once the write is
acknowledged and every ``tool_end`` loads it back, so each call shows the whole round trip and
each restore is compared byte for byte (the server default leaves the GPU copy to sglang's
eviction: docs/policy.md).
"""

from __future__ import annotations

import contextlib
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from types import SimpleNamespace
from typing import Any

import torch

from toolkv.core.lifecycle import HOLDING
from toolkv.core.phases import Phase
from toolkv.core.treeops import path_to, walk
from toolkv.errors import DeviceMemoryFull
from toolkv.sglang.cache_hooks import toolkv_cache_hooks
from toolkv.sglang.config import ToolKVConfig
from toolkv.testing.harness import CacheHarness, HarnessConfig
from toolkv.twin.clock import Clock, FixedIteration
from toolkv.twin.server import Server


@dataclass(frozen=True)
class DemoConfig:
    sessions: int = 8
    turns: int = 4  # generation turns per session; a tool call follows every turn but the last
    shared_prefix: int = 128  # system prompt shared by every session
    turn_tokens: tuple[int, int] = (48, 160)  # tokens added per turn (tool result + model output)
    tool_ticks: tuple[int, int] = (4, 30)  # how long a tool runs
    abandon_prob: float = 0.1  # a client that never calls tool_end (the TTL must clean up)
    ttl_ticks: int = 60
    dma_ticks: int = 2  # iterations a GPU<->host copy takes
    page_size: int = 1
    device_tokens: int = 4096
    host_ratio: float = 3.0
    seed: int = 0
    max_ticks: int = 5000
    # False: the same sessions on the same cache with toolkv not attached (sglang's HiRadixCache
    # alone), what ``toolkv demo`` prints beside its own run
    toolkv: bool = True

    def min_device_tokens(self) -> int:
        """The smallest GPU pool the workload can finish in: a session's longest prompt (the shared
        prefix and every turn at its longest), whole pages. A smaller pool can never run that
        session's last turn, so the run would only end at ``max_ticks`` with sessions unfinished."""
        longest = self.shared_prefix + self.turns * self.turn_tokens[1]
        return -(-longest // self.page_size) * self.page_size


@dataclass
class Agent:
    sid: str
    tokens: list[int]
    turns_left: int
    phase: str = "generate"  # generate | running | tool | restoring | abandoned | done
    epoch: int = 0
    tool_until: int = 0
    snapshot: torch.Tensor | None = None
    # the agent's own draws (turn sizes, tool durations, abandoning): the same sessions whatever
    # the server does, so a run without toolkv runs the same load
    rng: random.Random = field(default_factory=random.Random)


@dataclass
class Sample:
    tick: int
    device_used: int
    host_used: int
    protected: int
    offloaded_sessions: int
    running_sessions: int


@dataclass
class DemoReport:
    config: dict[str, Any]
    sessions: int = 0
    turns: int = 0
    tool_calls: int = 0
    tokens_offloaded: int = 0
    tokens_restored: int = 0
    bytes_verified: int = 0
    restores_verified: int = 0
    restore_mismatches: int = 0
    device_tokens_freed: int = 0
    peak_device_freed_during_tools: int = 0
    expired: int = 0
    deferred_restores: int = 0
    parked_restores: int = 0  # tool_end answered Parked: the next request's admission loads it
    prefix_bytes_checked: int = 0  # KV bytes of every reused prefix, compared by the forward
    refused_offloads: int = 0
    resumed_prompt_tokens: int = 0  # prompt tokens of the turns after a tool call
    resumed_cached_tokens: int = 0  # of those, what sglang found in its cache (GPU or host)
    ticks: int = 0
    leaks: dict[str, Any] = field(default_factory=dict)
    timeline: list[str] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    counters: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["samples"] = [asdict(s) for s in self.samples]
        return d


OUTPUT_TOKENS = 8  # the model's answer in each turn's new tokens (the rest: the tool's result)


class Simulation:
    def __init__(self, cfg: DemoConfig, harness: CacheHarness | None = None) -> None:
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        self._hooks = contextlib.ExitStack()
        self._hooks.enter_context(toolkv_cache_hooks("radix"))  # the plugin's turn capture
        self.h = harness or CacheHarness(
            HarnessConfig(
                page_size=cfg.page_size,
                device_tokens=cfg.device_tokens,
                host_ratio=cfg.host_ratio,
                max_reqs=cfg.sessions + 2,
                context_len=cfg.min_device_tokens() + cfg.page_size + 8,
            ),
            seed=cfg.seed,
        )
        self.now = 0
        self.clock: Clock = FixedIteration(1.0)  # one scheduler iteration is one tick
        # the server stand-in every byte-checking driver shares: scheduler model, forward, toolkv
        # attached as the plugin attaches it
        self.server = Server(
            self.h,
            "hiradix",
            chunked_prefill_size=512,
            max_prefill_tokens=2048,
            max_running_requests=cfg.sessions + 1,
        )
        self.server.on_admitted = self._admitted
        self.server.on_finished = self._finished
        tk_cfg = ToolKVConfig(enable=True, ttl_s=float(cfg.ttl_ticks), lazy_free=False, sweep_every=1)
        self.tk: Any = self.server.attach(tk_cfg, now=lambda: self.now) if cfg.toolkv else None
        self.mgr: Any = self.tk.manager if self.tk is not None else None
        self.sched = self.server.sched
        self.forward = self.server.forward
        self.report = DemoReport(config=asdict(cfg))
        self._seen: dict[int, tuple[Any, int]] = {}  # id(ack) -> (ack, tick first seen)
        self._running: dict[str, Agent] = {}  # rid -> the agent whose request it is
        self._rid = 0
        prefix = [self.rng.randrange(1, 50_000) for _ in range(cfg.shared_prefix)]
        self.agents = [
            Agent(
                sid=f"s{i:02d}",
                tokens=list(prefix),
                turns_left=cfg.turns,
                rng=random.Random(f"{cfg.seed}/{i}"),
            )
            for i in range(cfg.sessions)
        ]
        self.report.sessions = cfg.sessions

    # ---- helpers --------------------------------------------------------------------------------------
    def _log(self, msg: str) -> None:
        self.report.timeline.append(f"t={self.now:5d}  {msg}")

    def _path_kv(self, sid: str) -> torch.Tensor:
        rec = self.mgr.sessions[sid]
        assert rec.node is not None
        idx = torch.cat([m.value for m in path_to(self.h.tree, rec.node)])
        return self.h.device_kv(idx)

    def _state(self, sid: str) -> str:
        if self.mgr is None:
            return Phase.CLOSED
        rec = self.mgr.sessions.get(sid)
        return Phase.CLOSED if rec is None else rec.state

    def _advance_copies(self) -> None:
        """The copy engine finishes transfers that have been in flight for ``dma_ticks``. (An ack
        is remembered with a reference to it, so its ``id`` cannot pass to a newer one.)"""
        ctrl = self.h.tree.cache_controller
        live = [ack for queue in (ctrl.ack_write_queue, ctrl.ack_load_queue) for ack in queue]
        self._seen = {id(ack): self._seen.get(id(ack), (ack, self.now)) for ack in live}
        for ack in live:
            if self.now - self._seen[id(ack)][1] >= self.cfg.dma_ticks and not ack.finish_event.query():
                ack.finish_event.synchronize()

    def _record_sample(self) -> None:
        h, m = self.h, self.mgr
        if m is None:
            self.report.samples.append(
                Sample(self.now, int(h.cfg.device_tokens - h.allocator.available_size()),
                       int(h.host_pool.size - h.host_pool.available_size()), 0, 0, 0)
            )  # fmt: skip
            return
        dev_used = h.cfg.device_tokens - h.allocator.available_size()
        host_used = h.host_pool.size - h.host_pool.available_size()
        protected = sum(r.offload_tokens for r in m.sessions.values() if r.protected is not None)
        states = Counter(r.state for r in m.sessions.values())
        self.report.samples.append(
            Sample(
                self.now,
                int(dev_used),
                int(host_used),
                int(protected),
                states[Phase.OFFLOADED] + states[Phase.OFFLOADING],
                states[Phase.RUNNING] + states[Phase.RUNNABLE],
            )
        )
        freed = sum(r.freed_tokens for r in m.sessions.values() if r.state == Phase.OFFLOADED)
        self.report.peak_device_freed_during_tools = max(self.report.peak_device_freed_during_tools, freed)

    def _call(self, op: str, **body: Any) -> tuple[int, dict[str, Any]]:
        """A control call as the scheduler side handles it (what ``POST /session/<op>`` reaches);
        without toolkv nothing answers (404, as a server without toolkv's routes)."""
        if self.tk is None:
            return 404, {"error": "not_found"}
        status, out = self.tk.handle(op, body)
        return int(status), dict(out)

    # ---- agents ---------------------------------------------------------------------------------------
    def _generate(self, a: Agent) -> None:
        """The agent sends its next turn: the tool's result (or the user's first message) as the
        prompt's new tokens; the model answers with ``OUTPUT_TOKENS`` planned tokens. The request
        passes toolkv's BEFORE hook on ``handle_generate_request`` and waits in the queue."""
        from toolkv.sglang.plugin import before_handle_generate_request

        lo, hi = self.cfg.turn_tokens
        new = [a.rng.randrange(1, 50_000) for _ in range(a.rng.randint(lo, hi))]
        req = self.server.request(a.sid, a.tokens + new[:-OUTPUT_TOKENS], new[-OUTPUT_TOKENS:])
        self._running[req.rid] = a
        before_handle_generate_request(
            self.server.scheduler, SimpleNamespace(session_id=a.sid, session_params=None)
        )
        self.sched.add_request(req)
        a.phase = "running"

    def _admitted(self, req: Any) -> None:
        """The plugin's AFTER hook on ``get_new_batch_prefill``: the session's hand-over ends."""
        from toolkv.sglang.plugin import after_get_new_batch_prefill

        after_get_new_batch_prefill(
            SimpleNamespace(batch_to_run=SimpleNamespace(reqs=[req])), self.server.scheduler
        )

    def _finished(self, req: Any) -> None:
        """The turn's request finished; its KV is in the tree and toolkv recorded the turn."""
        a = self._running.pop(req.rid)
        if a.turns_left < self.cfg.turns:  # a turn after a tool call
            self.report.resumed_prompt_tokens += len(req.origin_input_ids)
            self.report.resumed_cached_tokens += min(int(req.cached_tokens), len(req.origin_input_ids))
        a.tokens = [*req.origin_input_ids, *req.output_ids]
        a.turns_left -= 1
        self.report.turns += 1
        a.phase = "generate"
        if a.turns_left == 0:
            a.phase = "done"
            self._call("close", session_id=a.sid)
            self._log(f"{a.sid} finished its last turn ({len(a.tokens)} tokens) and closed")
            return
        self._start_tool(a)

    def _start_tool(self, a: Agent) -> None:
        snap = self._path_kv(a.sid) if self._state(a.sid) == Phase.RUNNING else None
        a.tool_until = self.now + a.rng.randint(*self.cfg.tool_ticks)
        abandon = a.rng.random() < self.cfg.abandon_prob
        if self.tk is None:  # no toolkv: the tool runs, the KV stays where sglang keeps it
            a.phase = "abandoned" if abandon else "tool"
            a.snapshot = None
            return
        status, r = self._call("tool_start", session_id=a.sid)
        if status != 200:
            self.report.refused_offloads += 1
            self._log(f"{a.sid} tool_start refused: {r.get('error')}")
            a.phase = "tool"  # the tool still runs; the KV just stays on the GPU
            a.snapshot = None
            return
        a.epoch = int(r["epoch"])
        a.snapshot = snap
        self.report.tool_calls += 1
        self.report.tokens_offloaded += int(r["tokens"])
        a.phase = "abandoned" if abandon else "tool"
        self._log(
            f"{a.sid} tool_start epoch={a.epoch} {r['tokens']} tokens -> {r['state']}"
            + ("  (client will vanish)" if abandon else "")
        )

    def _end_tool(self, a: Agent) -> None:
        if a.snapshot is None:  # the offload was refused: nothing to restore
            a.phase = "generate"
            return
        status, r = self._call("tool_end", session_id=a.sid, epoch=a.epoch)
        if status == DeviceMemoryFull.http_status and r.get("error") == DeviceMemoryFull.code:
            self.report.deferred_restores += 1
            return  # retry next iteration
        if status != 200:
            self._log(f"{a.sid} tool_end refused: {r.get('error')} ({self._state(a.sid)})")
            a.phase = "generate"
            return
        self.report.tokens_restored += self.mgr.sessions[a.sid].restored_tokens
        a.phase = "restoring"
        if r["state"] == Phase.PARKED:
            self.report.parked_restores += 1
            self._log(
                f"{a.sid} tool_end epoch={a.epoch} -> Parked (its request would wait: sglang loads it then)"
            )
            return
        self._log(f"{a.sid} tool_end epoch={a.epoch} -> {r['state']}")

    def _check_restored(self, a: Agent) -> None:
        """Compare the restored KV with the snapshot as soon as the load is acknowledged: in
        ``Handover``, while toolkv pins it for the next request (not later: once the hand-over's
        TTL unpins it, a small pool may evict part of the path). Then the agent sends its next
        turn, whose admission ends the hand-over. A session toolkv parked (nothing loaded yet: its
        request would queue) is loaded by sglang's ``load_back`` when that request is admitted;
        the forward checks those bytes as it checks every reused prefix."""
        state = self._state(a.sid)
        if state in HOLDING and state not in (Phase.HANDOVER, Phase.PARKED):
            return  # the load is still in flight
        if a.snapshot is not None and state in (Phase.HANDOVER, Phase.RUNNABLE):
            kv = self._path_kv(a.sid)
            if torch.equal(kv, a.snapshot):
                self.report.bytes_verified += kv.numel() * kv.element_size()
                self.report.restores_verified += 1
            else:
                self.report.restore_mismatches += 1
                self._log(f"{a.sid} RESTORED BYTES DIFFER")
        elif a.snapshot is not None and state != Phase.PARKED:
            # the call ended with nothing to restore (toolkv let the KV go): the next turn reuses
            # what sglang still has and recomputes the rest
            self._log(f"{a.sid} tool call over in {state}: nothing restored to compare")
        a.snapshot = None
        a.phase = "generate"

    def _act(self, a: Agent) -> None:
        if a.phase == "generate":
            self._generate(a)
        elif a.phase == "tool" and self.now >= a.tool_until:
            self._end_tool(a)
        elif a.phase == "restoring":
            self._check_restored(a)
        elif a.phase == "abandoned":
            # the client is gone: the session ends once toolkv holds nothing of it any more, by its
            # TTL (Expired) or earlier (Released: demoted for host room; Lost; forgotten as idle)
            state = self._state(a.sid)
            if state in HOLDING:
                return
            if state == Phase.EXPIRED:
                self.report.expired += 1
                self._log(f"{a.sid} expired by TTL: protection released; client gone, session closed")
            else:
                self._log(f"{a.sid} {state}: nothing held any more; client gone, session closed")
            if state != Phase.CLOSED:
                self._call("close", session_id=a.sid)
            a.phase = "done"

    # ---- main loop ------------------------------------------------------------------------------------
    def step(self) -> None:
        """One scheduler iteration (see the module docstring for the order)."""
        self._advance_copies()
        order = list(self.agents)
        self.rng.shuffle(order)
        for a in order:
            if a.phase not in ("done", "running"):
                self._act(a)
        if self.tk is not None:
            self.tk.tick()  # the AFTER hook on process_input_requests
        batch = self.server.iterate()  # get_next_batch_to_run, the forward, the results
        self._record_sample()
        self.now += int(self.clock.iteration_s(batch, float(self.now)))

    def run(self, progress: Callable[[int], None] | None = None) -> DemoReport:
        initial = self.h.accounting()
        while any(a.phase != "done" for a in self.agents) and self.now < self.cfg.max_ticks:
            self.step()
            if progress is not None:
                progress(sum(1 for a in self.agents if a.phase == "done"))
        self.report.ticks = self.now
        if self.mgr is not None:
            self.report.device_tokens_freed = int(self.mgr.counters["freed_tokens"])
            self.report.counters = dict(self.mgr.counters)
        self.report.restore_mismatches += self.forward.byte_mismatches
        self.report.prefix_bytes_checked = self.forward.bytes_checked
        self.report.leaks = self._leaks(initial)
        return self.report

    def _leaks(self, initial: Any) -> dict[str, Any]:
        """Close everything, let every copy finish, evict all: every counter must be back."""
        for sid in list(self.mgr.sessions if self.mgr is not None else ()):
            self._call("close", session_id=sid)
        unfinished = sum(1 for a in self.agents if a.phase != "done")
        for r in list(self.sched.waiting_queue):  # requests of sessions cut off by the limit
            self.server.drop(r)
        self.h.drain()
        final = self.h.accounting()
        diffs = {
            k: (getattr(initial, k), getattr(final, k))
            for k in asdict(initial)
            if getattr(initial, k) != getattr(final, k)
        }
        return {
            "count": len(diffs),
            "differences": {k: list(v) for k, v in diffs.items()},
            "sessions_unfinished": unfinished,
        }

    def close(self) -> None:
        """Release the harness and undo the plugin's cache hooks."""
        self.h.close()
        self._hooks.close()


def tokens_of(h: CacheHarness, tokens: list[int]) -> int:
    return walk(h.tree, tokens)[1]
