"""The twin's event loop: one sglang scheduler iteration at a time, on simulated time.

Per iteration, in sglang's order (managers/scheduler.py ``event_loop_normal``):

1. ``process_input_requests``: every agent message due by now. A generate request calls toolkv's
   ``SchedulerToolKV.on_request`` (the BEFORE hook on ``handle_generate_request``) and enters the
   waiting queue as a real ``Req``; a toolkv call runs ``SchedulerToolKV.handle`` and is answered.
2. toolkv's tick (the AFTER hook on ``process_input_requests``).
3. ``get_next_batch_to_run`` (:class:`~toolkv.twin.scheduler.TwinScheduler`), which runs
   ``check_hicache_events`` first; every admitted request of a session then gets
   ``SchedulerToolKV.on_admitted`` when toolkv has it.
4. The forward: the clock advances by the profile's time for it (a prefill that HiCache loads
   into also waits for those loads: :class:`~toolkv.twin.clock.ModelledGpuTime`, the twin's
   :class:`~toolkv.twin.clock.Clock`), copies that finish by then complete, results are processed
   (``cache_finished_req`` -> toolkv's ``on_finished``).

With nothing to run the clock jumps to the next agent message or copy completion (at most
``idle_s`` ahead, so toolkv's tick still sees time pass).
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from toolkv.core.lifecycle import HOLDING
from toolkv.twin.agents import Agents
from toolkv.twin.clock import Clock, ModelledGpuTime
from toolkv.twin.configs import TwinConfig
from toolkv.twin.copies import TimedCopies
from toolkv.twin.host_mix import host_mix
from toolkv.twin.profile import TimeProfile
from toolkv.twin.scheduler import Batch, TwinScheduler
from toolkv.twin.server import Server
from toolkv.twin.sessions import Sessions
from toolkv.twin.stack import Stack, build
from toolkv.workload.plan import Plan


class Stalled(Exception):
    """The simulated server stopped serving for good (what a GPU run would see as a hang)."""


@dataclass
class Options:
    device_tokens: int = 120_000
    chunked_prefill_size: int = 8192
    max_prefill_tokens: int = 16384
    max_running_requests: int = 256
    idle_s: float = 0.01  # longest idle jump
    sample_s: float = 1.0  # occupancy samples, like the benchmark's sampler
    drain_s: float = 5.0  # idle time after the last session (acks land, TTLs fire)
    give_up_s: float = 600.0  # stop this long after the run's end if sessions are still unfinished
    context_len: int = 65_536 + 64  # the harness's longest request (sessions of 100K tokens need more)


@dataclass
class Outcome:
    """Everything one simulated run recorded (summarised by :mod:`toolkv.twin.report`)."""

    config: TwinConfig
    agents: Agents
    samples: list[dict[str, Any]]
    end_s: float
    iterations: int
    prefill_batches: int
    decode_steps: int
    retractions: int
    prefill_tokens: int
    cached_tokens: int
    copied_tokens: dict[str, float]
    meta_end: dict[str, Any]
    leaks: dict[str, Any]
    crashed: str | None
    host_tokens: int
    device_tokens: int
    wall_s: float
    drain_s: float = 0.0  # scheduler time in blocking write drains (write_back: Twin._charge_drains)


class Twin:
    """One configuration over one plan."""

    def __init__(
        self, plan: Plan | Sessions, cfg: TwinConfig, profile: TimeProfile, opts: Options | None = None
    ) -> None:
        self.sessions = plan if isinstance(plan, Sessions) else Sessions.of(plan)
        self.cfg, self.profile = cfg, profile
        self.opts = opts or Options()
        self.now = 0.0
        self.stack: Stack = build(
            cfg, device_tokens=self.opts.device_tokens, kv_bytes_per_token=profile.kv_bytes_per_token,
            now=lambda: self.now, max_reqs=self.opts.max_running_requests, context_len=self.opts.context_len,
        )  # fmt: skip
        self.h = self.stack.harness
        self.tk = self.stack.tk
        self.agents = Agents(self.sessions, cfg.mode, cfg.send_tool)
        self.copies = TimedCopies(self.h, profile)
        self._drains = 0  # blocking write drains not yet charged to the clock (_watch_drains)
        self.drain_s = 0.0  # scheduler time spent waiting in them, over the run
        self._watch_drains()
        self.clock: Clock = ModelledGpuTime(profile, self.copies)
        # the one server stand-in, without the byte-writing forward (the twin counts tokens)
        self.server = Server(
            self.h, cfg.name, chunked_prefill_size=self.opts.chunked_prefill_size,
            max_prefill_tokens=self.opts.max_prefill_tokens, max_running_requests=self.opts.max_running_requests,
            scheduler_class=self.stack.scheduler_class, kv_forward=False,
        )  # fmt: skip
        self.server.on_admitted, self.server.on_first_token = self._admitted, self._first_token
        self.server.on_finished = self._finished
        self.server.bind(self.tk)
        self.sched: TwinScheduler = self.server.sched
        self.samples: list[dict[str, Any]] = []
        self.crashed: str | None = None
        self.iterations = self.prefills = self.decodes = 0

    def _watch_drains(self) -> None:
        """Count sglang's blocking write drains (``writing_check(write_back=True)``: write_back's
        eviction, and toolkv's copies under write_back). On a GPU the scheduler thread waits in
        them until every queued device-to-host copy has landed; the CPU harness runs the copies at
        once, so :meth:`_charge_drains` moves the clock to where the copy engine would finish."""
        tree = self.h.tree
        if getattr(tree, "cache_controller", None) is None:
            return
        real = tree.writing_check

        def writing_check(*args: Any, **kw: Any) -> Any:
            if kw.get("write_back", args[0] if args else False):
                self._drains += 1
            return real(*args, **kw)

        tree.writing_check = writing_check

    def _charge_drains(self) -> None:
        """The scheduler waits for the copies a blocking drain waited for (after ``copies.stamp``,
        which gave them their finish times on the copy engine's FIFO)."""
        if self._drains:
            self._drains = 0
            until = self.copies.last_finish("d2h")
            if until > self.now:
                self.drain_s += until - self.now
                self.now = until

    # ---- scheduler callbacks ---------------------------------------------------------------------
    def _sid(self, req: Any) -> str:
        return str(req.rid).split("#")[0]

    def _admitted(self, req: Any) -> None:
        """The request is in a newly formed prefill batch: toolkv's hand-over ends (the plugin
        calls ``on_batch`` after ``get_new_batch_prefill``; ``on_admitted`` per request before)."""
        on_batch = getattr(self.tk, "on_batch", None)
        if on_batch is not None:
            on_batch([req])
            return
        hook = getattr(self.tk, "on_admitted", None)
        if hook is not None and req.session_id is not None:
            hook(req.session_id)

    def _first_token(self, req: Any) -> None:
        self.agents.first_token(self._sid(req), self.now)

    def _finished(self, req: Any) -> None:
        self.agents.turn_done(self._sid(req), req, self.now)

    # ---- input -----------------------------------------------------------------------------------
    def _new_req(self, sid: str) -> Any:
        """The turn's request, built by the server stand-in: the agent's context, the workload's
        output length, the session id only when the agent sends one."""
        return self.server.request(
            sid, self.agents.agents[sid].ctx, max_new_tokens=self.sessions.workload.output_tokens,
            sends_session=self.agents.sid_sent(sid) is not None,
        )  # fmt: skip

    def _inputs(self) -> None:
        while due := self.agents.due(self.now):  # an agent's reaction at the same instant is due too
            for t, kind, sid in due:
                self._input(t, kind, sid)

    def _input(self, t: float, kind: str, sid: str) -> None:
        """One agent message reaching the scheduler (``process_input_requests``)."""
        if kind == "start":
            self.agents.start(sid, t)
        elif kind == "tool_done":
            self.agents.tool_done(sid, t)
        elif kind == "generate":
            self.agents.generate_sent(sid, t)
            self.tk.on_request(self.agents.sid_sent(sid))
            self.sched.add_request(self._new_req(sid))
        elif kind.startswith("op:"):
            op = kind[3:]
            body: dict[str, Any] = (
                self.agents.tool_start_body(sid) if op == "tool_start" else {"session_id": sid}
            )
            if op == "tool_end":
                body["epoch"] = self.agents.agents[sid].epoch
            status, out = self.tk.handle(op, body)
            self.agents.answered(op, sid, status, out, self.now)

    # ---- the loop --------------------------------------------------------------------------------
    def _batch_time(self, b: Batch) -> float:
        """The forward's time on the twin's clock (a method, so a driver can count or time it)."""
        return self.clock.iteration_s(b, self.now)

    def _sample(self) -> None:
        m = self.tk.metrics()
        tree = self.h.tree
        s: dict[str, Any] = {
            "t": round(self.now, 3),
            "device_used": self.opts.device_tokens - int(self.h.allocator.available_size()),
            "device_locked": int(tree.protected_size()),
            "device_evictable": int(tree.evictable_size()),
            "protected": m.get("protected_tokens", m.get("pinned_tokens")),
            "states": m.get("states"),
            "running": len(self.sched.running_batch.reqs),
            "waiting": len(self.sched.waiting_queue),
        }
        if self.h.host_pool is not None:
            s["host_used"] = int(self.h.host_pool.size) - int(self.h.host_pool.available_size())
            s["host_mix"] = host_mix(tree)
        self.samples.append(s)

    def _storage_io(self) -> None:
        """An L3 server's storage operations: start what was queued, finish what is due."""
        if self.stack.storage is not None:
            self.stack.storage.pump(self.now)

    def _next_storage(self) -> float | None:
        return self.stack.storage.next_finish() if self.stack.storage is not None else None

    def iterate(self) -> bool:
        """One scheduler iteration. Returns False once every session is over and drained."""
        self.copies.complete_due(self.now)
        self._storage_io()
        self._inputs()
        self.tk.tick()
        self.copies.stamp(self.now)
        self._charge_drains()
        self._storage_io()
        batch = self.sched.next_batch()
        self.copies.stamp(self.now)
        self._charge_drains()
        self._storage_io()
        self.iterations += 1
        if batch is not None:
            self.now += self._batch_time(batch)
            self.copies.complete_due(self.now)
            if batch.mode == "prefill":
                self.prefills += 1
            else:
                self.decodes += 1
            self.sched.finish_batch(batch)
        else:
            if self.sched.stalled and not self.copies.next_finish(self.now):
                m = self.tk.metrics()
                raise Stalled(
                    f"stalled: batch_is_full with nothing running and {len(self.sched.waiting_queue)} waiting"
                    f" (device free {self.h.allocator.available_size()}, evictable {self.h.tree.evictable_size()},"
                    f" locked {self.h.tree.protected_size()}; toolkv {m.get('states')},"
                    f" pinned {m.get('pinned_tokens', m.get('protected_tokens'))})"
                )
            if self.now > self.sessions.workload.duration_s + self.opts.give_up_s:
                raise Stalled(f"sessions did not finish {self.opts.give_up_s:.0f} s after the end of the run")
            nxt = [
                t
                for t in (self.agents.next_time(), self.copies.next_finish(self.now), self._next_storage())
                if t is not None
            ]
            if not nxt and not self.sched.busy and self.agents.finished:
                return False
            self.now = max(self.now, min([*nxt, self.now + self.opts.idle_s]))
        if not self.samples or self.now - self.samples[-1]["t"] >= self.opts.sample_s:
            self._sample()
        return True

    def run(self, progress: Callable[[float], None] | None = None) -> Outcome:
        wall = time.perf_counter()
        try:
            while self.iterate():
                if progress is not None:
                    progress(self.now)
        except (RuntimeError, Stalled) as e:
            # sglang's allocator raising here is the scheduler process dying on a GPU server
            # ("Out of memory" in alloc_for_extend / alloc_req_slots): the run ends, and says so
            self.crashed = f"t={self.now:.3f}s: {str(e).splitlines()[0]}"
            out = self._outcome(self.now, time.perf_counter() - wall, {"leaked": -1}, self.tk.metrics())
            self.stack.close()
            return out
        end = self.now
        drain_until = self.now + self.opts.drain_s
        while self.now < drain_until:  # idle iterations: acks land, the TTL sweep runs
            self.copies.complete_due(self.now)
            self._storage_io()
            self.tk.tick()
            if self.h.is_hi:
                self.h.tree.check_hicache_events()
            self.now = min(drain_until, self.now + self.opts.idle_s * 10)
        meta_end = self.tk.metrics()
        leaks = self.leaks()
        out = self._outcome(end, time.perf_counter() - wall, leaks, meta_end)
        self.stack.close()
        return out

    def _outcome(self, end: float, wall: float, leaks: dict[str, Any], meta_end: dict[str, Any]) -> Outcome:
        return Outcome(
            self.cfg, self.agents, self.samples, end, self.iterations, self.prefills, self.decodes,
            self.sched.retractions, self.sched.prefill_tokens, self.sched.cached_tokens,
            dict(self.copies.tokens_moved), meta_end, leaks, self.crashed, self.stack.host_tokens,
            self.opts.device_tokens, wall, self.drain_s,
        )  # fmt: skip

    def leaks(self) -> dict[str, Any]:
        """What must be back at its initial value once no request runs and no session is held:
        sglang's request slots and locks, toolkv's protections; then, evicting everything the
        tree still caches, every device and host slot free."""
        tree = self.h.tree
        out: dict[str, Any] = {
            "device_locked_tokens": int(tree.protected_size()),
            "protected_tokens": int(self.tk.metrics().get("protected_tokens") or 0),
            "request_slots_in_use": self.h.req_pool.size - self.h.req_pool.available_size(),
            "waiting_or_running": int(self.sched.busy),
            "sessions_holding": sum(1 for r in self.tk.manager.sessions.values() if r.state in HOLDING),
        }
        self.h.drain()
        acc = self.h.accounting()
        out["device_free_after_evict"] = acc.device_free - self.opts.device_tokens
        out["host_free_after_evict"] = (acc.host_free - int(self.h.host_pool.size)) if self.h.is_hi else 0
        out["lock_refs"] = len(acc.lock_refs)
        out["host_refs"] = len(acc.host_refs)
        out["pending_copies"] = acc.pending_writes + acc.pending_loads
        out["leaked"] = sum(1 for v in out.values() if v)
        return out


def simulate(
    plan: Plan | Sessions,
    cfg: TwinConfig,
    profile: TimeProfile,
    opts: Options | None = None,
    *,
    progress: bool = False,
) -> Outcome:
    """Run ``plan`` against ``cfg``; ``progress`` draws a bar of simulated time on stderr."""
    twin = Twin(plan, cfg, profile, opts)
    if not progress:
        return twin.run()
    total = twin.sessions.workload.duration_s
    try:
        from tqdm import tqdm

        bar: Any = tqdm(total=round(total), unit="sim s", desc=cfg.name, file=sys.stderr, leave=False)
    except ImportError:  # pragma: no cover - tqdm is in the pinned environment
        bar = None
    shown = [0]

    def tick(now: float) -> None:
        cur = min(round(now), round(total))
        if cur > shown[0]:
            if bar is not None:
                bar.update(cur - shown[0])
            else:
                print(f"\r{cfg.name}: {cur}/{total:.0f} sim s", end="", file=sys.stderr)
            shown[0] = cur

    out = twin.run(tick)
    if bar is not None:
        bar.close()
    return out


def nan_to_none(x: float) -> float | None:
    return None if isinstance(x, float) and math.isnan(x) else x
