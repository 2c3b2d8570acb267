"""An agent workload over a real cache stack: sessions alternate generation turns and tool calls.

This is what ``toolkv demo`` runs on the embedded default (CPU, real HiRadixCache, the controllable
copy engine standing in for the GPU's DMA) and what the benchmarks reuse. One loop iteration is one
scheduler iteration: copies that have had their time finish, sglang's ``check_hicache_events``
processes acks, the manager ticks, then every agent acts.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from toolkv.core.lifecycle import HOLDING
from toolkv.core.manager import ManagerConfig, ToolKVManager
from toolkv.core.treeops import path_to, walk
from toolkv.errors import DeviceMemoryFull, HostMemoryFull, SessionKVLost, ToolKVError
from toolkv.testing.harness import CacheHarness, HarnessConfig


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
    phase: str = "generate"  # generate | tool | restoring | abandoned | done
    epoch: int = 0
    tool_until: int = 0
    snapshot: torch.Tensor | None = None


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
    refused_offloads: int = 0
    ticks: int = 0
    leaks: dict[str, Any] = field(default_factory=dict)
    timeline: list[str] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    counters: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["samples"] = [asdict(s) for s in self.samples]
        return d


class Simulation:
    def __init__(self, cfg: DemoConfig, harness: CacheHarness | None = None) -> None:
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        self.h = harness or CacheHarness(
            HarnessConfig(
                page_size=cfg.page_size, device_tokens=cfg.device_tokens, host_ratio=cfg.host_ratio
            ),
            seed=cfg.seed,
        )
        self.mgr = ToolKVManager(self.h.tree, config=ManagerConfig(ttl_s=float(cfg.ttl_ticks)))
        self.report = DemoReport(config=asdict(cfg))
        self._seen: dict[int, int] = {}  # id(ack) -> tick first seen
        self.now = 0
        prefix = [self.rng.randrange(1, 50_000) for _ in range(cfg.shared_prefix)]
        self.agents = [
            Agent(sid=f"s{i:02d}", tokens=list(prefix), turns_left=cfg.turns) for i in range(cfg.sessions)
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

    def _advance_copies(self) -> None:
        """The copy engine finishes transfers that have been in flight for ``dma_ticks``."""
        ctrl = self.h.tree.cache_controller
        for queue in (ctrl.ack_write_queue, ctrl.ack_load_queue):
            for ack in queue:
                first = self._seen.setdefault(id(ack), self.now)
                if self.now - first >= self.cfg.dma_ticks and not ack.finish_event.query():
                    ack.finish_event.synchronize()

    def _sample(self) -> None:
        h, m = self.h, self.mgr
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
                states["Offloaded"] + states["Offloading"],
                states["Running"] + states["Runnable"],
            )
        )
        freed = sum(r.freed_tokens for r in m.sessions.values() if r.state == "Offloaded")
        self.report.peak_device_freed_during_tools = max(self.report.peak_device_freed_during_tools, freed)

    # ---- agents ---------------------------------------------------------------------------------------
    def _generate(self, a: Agent) -> None:
        lo, hi = self.cfg.turn_tokens
        new = [self.rng.randrange(1, 50_000) for _ in range(self.rng.randint(lo, hi))]
        tokens = a.tokens + new
        if not self.h.run_request(tokens, deterministic=True):  # a recomputed prefix has its old bytes
            return  # no device memory this iteration; retry next one
        a.tokens = tokens[: len(tokens) // self.cfg.page_size * self.cfg.page_size]
        self.mgr.record_turn(a.sid, a.tokens)
        a.turns_left -= 1
        self.report.turns += 1
        if a.turns_left == 0:
            a.phase = "done"
            self.mgr.close(a.sid)
            self._log(f"{a.sid} finished its last turn ({len(a.tokens)} tokens) and closed")
            return
        try:
            snap = self._path_kv(a.sid)
            r = self.mgr.tool_start(a.sid)
        except (HostMemoryFull, SessionKVLost) as e:
            self.report.refused_offloads += 1
            self._log(f"{a.sid} tool_start refused: {e.code}")
            a.phase = "tool"  # the tool still runs; the KV just stays on the GPU
            a.snapshot = None
            a.tool_until = self.now + self.rng.randint(*self.cfg.tool_ticks)
            return
        a.epoch = int(r["epoch"])  # type: ignore[call-overload]
        a.snapshot = snap
        self.report.tool_calls += 1
        self.report.tokens_offloaded += int(r["tokens"])  # type: ignore[call-overload]
        abandon = self.rng.random() < self.cfg.abandon_prob
        a.phase = "abandoned" if abandon else "tool"
        a.tool_until = self.now + self.rng.randint(*self.cfg.tool_ticks)
        self._log(
            f"{a.sid} tool_start epoch={a.epoch} {r['tokens']} tokens -> {r['state']}"
            + ("  (client will vanish)" if abandon else "")
        )

    def _end_tool(self, a: Agent) -> None:
        if a.snapshot is None:  # the offload was refused: nothing to restore
            a.phase = "generate"
            return
        try:
            r = self.mgr.tool_end(a.sid, a.epoch)
        except DeviceMemoryFull:
            self.report.deferred_restores += 1
            return  # retry next iteration
        except ToolKVError as e:
            self._log(f"{a.sid} tool_end refused: {e.code} ({self.mgr.kv_meta(a.sid)['state']})")
            a.phase = "generate"
            return
        self.report.tokens_restored += self.mgr.sessions[a.sid].restored_tokens
        a.phase = "restoring"
        self._log(f"{a.sid} tool_end epoch={a.epoch} -> {r['state']}")

    def _check_restored(self, a: Agent) -> None:
        """Compare the restored KV with the snapshot as soon as the load is acknowledged: in
        ``Handover``, while toolkv pins it for the next request. Not later: once the hand-over's
        TTL unpins it (``Runnable``), a small pool may already have evicted part of the path. The
        agent's next turn waits for ``Runnable`` (a turn cannot be recorded during the hand-over)."""
        rec = self.mgr.sessions.get(a.sid)
        state = "Closed" if rec is None else rec.state
        if a.snapshot is not None and state not in HOLDING and state != "Runnable":
            # the call ended with nothing to restore (the KV never left the GPU, or toolkv let it
            # go): there is no restore to compare, and the next turn recomputes what is missing
            self._log(f"{a.sid} tool call over in {state}: nothing restored to compare")
            a.snapshot = None
        if a.snapshot is not None and state in ("Handover", "Runnable"):
            kv = self._path_kv(a.sid)
            if torch.equal(kv, a.snapshot):
                self.report.bytes_verified += kv.numel() * kv.element_size()
                self.report.restores_verified += 1
            else:
                self.report.restore_mismatches += 1
                self._log(f"{a.sid} RESTORED BYTES DIFFER")
            a.snapshot = None
        if a.snapshot is None and state != "Handover":
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
            rec = self.mgr.sessions.get(a.sid)
            state = "Closed" if rec is None else rec.state
            if state in HOLDING:
                return
            if state == "Expired":
                self.report.expired += 1
                self._log(f"{a.sid} expired by TTL: protection released; client gone, session closed")
            else:
                self._log(f"{a.sid} {state}: nothing held any more; client gone, session closed")
            if rec is not None:
                self.mgr.close(a.sid)
            a.phase = "done"

    # ---- main loop ------------------------------------------------------------------------------------
    def step(self) -> None:
        self._advance_copies()
        self.h.tree.check_hicache_events()
        self.mgr.tick(float(self.now))
        order = list(self.agents)
        self.rng.shuffle(order)
        for a in order:
            if a.phase != "done":
                self._act(a)
        self._sample()
        self.now += 1

    def run(self, progress: Callable[[int], None] | None = None) -> DemoReport:
        initial = self.h.accounting()
        while any(a.phase != "done" for a in self.agents) and self.now < self.cfg.max_ticks:
            self.step()
            if progress is not None:
                progress(sum(1 for a in self.agents if a.phase == "done"))
        self.report.ticks = self.now
        self.report.device_tokens_freed = int(self.mgr.counters["freed_tokens"])
        self.report.counters = dict(self.mgr.counters)
        self.report.leaks = self._leaks(initial)
        return self.report

    def _leaks(self, initial: Any) -> dict[str, Any]:
        """Close everything, let every copy finish, evict all: every counter must be back."""
        for sid in list(self.mgr.sessions):
            self.mgr.close(sid)
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
            "sessions_unfinished": sum(1 for a in self.agents if a.phase != "done"),
        }


def tokens_of(h: CacheHarness, tokens: list[int]) -> int:
    return walk(h.tree, tokens)[1]
