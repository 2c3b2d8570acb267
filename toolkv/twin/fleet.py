"""Twins of one or more sglang servers sharing an L3 store (``toolkv twin l3`` and ``toolkv twin fleet``).

Each server is a full twin (:class:`~toolkv.twin.run.Twin`: sglang's real cache, ``Req``,
``PrefillAdder``, toolkv's real scheduler side, modelled GPU time), with its own device and host
pools. The agents are one population; a router sends each request to a server chosen by the
session id (rendezvous hashing over the servers that are up, as a consistent-hash router does),
so a session stays on its server until that server is drained, and then its next turn lands on
the server the hash picks among the others.

L3 is sglang's own storage tier on every server (:mod:`toolkv.twin.storage`): HiCache writes
every host copy through to it and reads a request's missing prefix from it on arrival
(``wait_complete``); the servers' backends share one store (by name), each server with its own
link to it (:mod:`toolkv.twin.l3`). toolkv's L3 decisions are its manager's (``toolkv/core/session/l3.py``:
a session predicted away long is stored early and read back ahead of its predicted return, a full
host's victims are stored instead of dropped, a ``tool_end`` reads a stored session back), the
same code the plugin runs on a server; the fleet adds no policy of its own.

Configurations (:data:`FLEET_CONFIGS`): ``stock`` (HiCache, no L3: a moved session is recomputed),
``stock-l3`` (HiCache with the shared L3), ``toolkv`` (toolkv ``offload`` with tool names, no L3),
``toolkv-l3`` (the same with the shared L3 and toolkv's L3 path). A moved session's ``tool_end``
reaches a server that never saw it and gets a 404 (toolkv's state is per server); its turn is read
from the shared L3 by sglang's arrival read, or recomputed. ``stock-mc`` and ``toolkv-mc``: the same
as ``stock-l3`` and ``toolkv-l3`` on a store with Mooncake's semantics (the master evicts least
recently used pages once the capacity is reached; toolkv soft-pins what it stores whole, with its
manifest, and a moved session's ``tool_end`` on a server that never saw it is adopted from the
manifest instead of a 404).
"""

from __future__ import annotations

import heapq
import itertools
import math
import sys
import time
import zlib
from dataclasses import dataclass, replace
from typing import Any

from toolkv.core.lifecycle import HOLDING
from toolkv.core.phases import Phase
from toolkv.twin.agents import Agents
from toolkv.twin.configs import TwinConfig, get
from toolkv.twin.l3 import L3Config
from toolkv.twin.opt import opt_reuse
from toolkv.twin.profile import TimeProfile
from toolkv.twin.report import reuse
from toolkv.twin.run import Options, Stalled, Twin
from toolkv.twin.sessions import Sessions
from toolkv.workload.metrics import summarize
from toolkv.workload.plan import Workload


@dataclass(frozen=True)
class FleetConfig:
    """One configuration of the L3 / multi-server study: a server configuration, with L3 or not."""

    name: str
    server: TwinConfig
    l3: bool  # the servers have sglang's storage tier on the shared store
    mooncake: bool = False  # the shared store has Mooncake's semantics (toolkv.twin.storage)


_TOOLKV = replace(get("offload"), name="toolkv", send_tool=True)
FLEET_CONFIGS: dict[str, FleetConfig] = {
    c.name: c
    for c in (
        FleetConfig("stock", get("stock"), False),
        FleetConfig("stock-l3", get("stock-l3"), True),
        FleetConfig("toolkv", _TOOLKV, False),
        FleetConfig("toolkv-l3", replace(get("offload-l3"), name="toolkv-l3"), True),
        # the shared tier as Mooncake: the master evicts (LRU, past the capacity), toolkv soft-pins
        # what it stores and a moved session's tool_end is adopted (spec/storage/SharedTier.tla)
        FleetConfig("stock-mc", replace(get("stock-l3"), name="stock-mc"), True, mooncake=True),
        FleetConfig("toolkv-mc", replace(get("offload-l3"), name="toolkv-mc"), True, mooncake=True),
    )
}


def fleet_config(name: str, host_gb: float | None = None) -> FleetConfig:
    if name not in FLEET_CONFIGS:
        raise ValueError(f"unknown L3/fleet configuration {name!r}; known: {', '.join(FLEET_CONFIGS)}")
    c = FLEET_CONFIGS[name]
    return c if host_gb is None else replace(c, server=c.server.with_host_gb(host_gb))


def long_workload(
    sessions: int,
    duration_s: float,
    seed: int = 0,
    *,
    turns: int = 8,
    first_tokens: int = 60_000,
    ramp_s: float = 60.0,
) -> Workload:
    """The long-tool shape of issue 27: every tool call 1-10 minutes (the twin's ``long`` shape),
    sessions of 50-100K tokens (a first prompt of 45-75K growing by 2,240 tokens a turn, ended
    before 100K). The sessions start over ``ramp_s`` (60 s: a first turn of 60K tokens is an 8-s
    prefill, and a burst of them would measure the queue, not the cache)."""
    return Workload(
        initial_sessions=sessions, ramp_s=ramp_s, turns_median=turns, first_tokens=first_tokens,
        max_context=100_000, tool_shape="long", duration_s=duration_s, seed=seed,
    )  # fmt: skip


def route(sid: str, servers: list[int]) -> int:
    """Rendezvous hashing on the session id: the server that scores highest among those up. A
    server that goes away moves only its own sessions, each to one fixed other server."""
    return max(servers, key=lambda k: zlib.crc32(f"{sid}/{k}".encode()))


class FleetServer(Twin):
    """One server of the fleet: a :class:`Twin` whose messages come from the fleet's router."""

    def __init__(
        self, fleet: Fleet, index: int, cfg: TwinConfig, profile: TimeProfile, opts: Options
    ) -> None:
        from toolkv.testing.harness import CacheHarness

        # The CPU harness allows one live instance per process because its copy doubles are
        # sglang module globals (the device module and the transfer primitives). N trees can
        # share them: every cache controller selects its own stream object through the device
        # module (``with device_module.stream(self.write_stream)``) and the primitives queue on
        # whatever stream is selected, so each server's copies land on its own streams, timed by
        # its own TimedCopies. Each server installs the doubles over the previous server's;
        # ``Fleet.close`` closes them in reverse order, which restores sglang's globals.
        CacheHarness._live_cpu = None
        super().__init__(fleet.sessions, cfg, profile, opts)
        self.agents = fleet.agents  # one population for every server
        self.fleet = fleet
        self.index = index
        self.inbox: list[tuple[float, str, str]] = []
        self.ran = False
        self.up = True
        self.drained_at: float | None = None
        self.held_at: float | None = None  # drained: the last time it still held a session

    def ready_at(self) -> float:
        """When this server next has something to do: now if it has input or just ran a batch,
        else at its next copy or storage completion or its next idle tick."""
        if self.inbox or self.ran:
            return self.now
        t = self.now + self.fleet.tick_s
        for c in (self.copies.next_finish(self.now), self._next_storage()):
            if c is not None:
                t = min(t, c)
        return max(t, self.now)

    @property
    def busy(self) -> bool:
        st = self.stack.storage
        return bool(
            self.inbox or self.sched.busy or self.copies.next_finish(self.now) or (st is not None and st.busy)
        )

    def deliver(self, t: float, kind: str, sid: str) -> None:
        if not self.ran and not self.inbox:
            self.now = max(self.now, t)  # an idle server wakes when the message arrives
        self.inbox.append((t, kind, sid))

    def _input(self, t: float, kind: str, sid: str) -> None:
        super()._input(t, kind, sid)
        if kind == "generate":
            self.fleet.on_generate(self, sid)

    def _admitted(self, req: Any) -> None:
        info = self.fleet.turn_info.get((self._sid(req), self.agents.agents[self._sid(req)].turn))
        hit = int(getattr(req, "storage_hit_length", 0) or 0)
        if info is not None and hit and not info.get("l3_tokens"):
            info["l3_tokens"] = hit  # read from L3 by the request's own prefetch (sglang's arrival read)
            info["l3_wait_s"] = self.now - info["sent_s"]
        super()._admitted(req)

    def step(self) -> None:
        """One scheduler iteration (:meth:`Twin.iterate`, with the router's inbox for input)."""
        self.now = max(self.now, self.ready_at())
        self.copies.complete_due(self.now)
        self._storage_io()
        inbox, self.inbox = self.inbox, []
        for t, kind, sid in inbox:
            self._input(t, kind, sid)
        self.tk.tick()
        self.copies.stamp(self.now)
        self._storage_io()
        batch = self.sched.next_batch()
        self.copies.stamp(self.now)
        self._storage_io()
        self.iterations += 1
        self.ran = batch is not None
        if batch is not None:
            self.now += self._batch_time(batch)
            self.copies.complete_due(self.now)
            if batch.mode == "prefill":
                self.prefills += 1
            else:
                self.decodes += 1
            self.sched.finish_batch(batch)
        elif self.sched.stalled and not self.copies.next_finish(self.now) and not self._next_storage():
            raise Stalled(f"server {self.index}: batch_is_full with nothing running")
        if not self.samples or self.now - self.samples[-1]["t"] >= self.opts.sample_s:
            self._sample()
        if not self.up and self.holding():
            self.held_at = self.now

    def holding(self) -> int:
        """Sessions toolkv holds something for (the leak check's ``sessions_holding``)."""
        return sum(1 for r in self.tk.manager.sessions.values() if r.state not in _HOLDS_NOTHING)

    def settle(self) -> dict[str, Any]:
        """Idle iterations after the run (acks land, TTLs fire), then :meth:`Twin.leaks`."""
        until = self.now + self.opts.drain_s
        while self.now < until or (self.stack.storage is not None and self.stack.storage.busy):
            self.copies.complete_due(self.now)
            self._storage_io()
            self.tk.tick()
            self.h.tree.check_hicache_events()
            nxt = self._next_storage()
            self.now = min(until, self.now + self.opts.idle_s * 10) if nxt is None else max(self.now, nxt)
        leaks = self.leaks()
        st = self.stack.storage
        left = int(st.busy) if st is not None else 0
        leaks["l3_ops_in_flight"] = left
        leaks["leaked"] += left
        return leaks


class Fleet:
    """``n`` servers of one configuration behind a session-id router, sharing one L3 store;
    ``drain`` lists (time, server) pairs: from that time the router sends that server nothing new."""

    def __init__(
        self, sessions: Sessions, cfg: FleetConfig, profile: TimeProfile, opts: Options, *, n: int = 1,
        l3: L3Config | None = None, drain: list[tuple[float, int]] | None = None, tick_s: float = 0.1,
    ) -> None:  # fmt: skip
        from toolkv.twin.storage import STORES

        self.sessions, self.cfg, self.profile, self.opts = sessions, cfg, profile, opts
        self.l3cfg = l3 or L3Config()
        self.store_name = f"fleet-{next(_FLEETS)}" if cfg.l3 else ""
        server = cfg.server
        if cfg.l3:  # every server's backend finds the one store by name
            server = replace(server, l3_gbps=self.l3cfg.read_gbps, l3_write_gbps=self.l3cfg.write_gbps,
                             l3_capacity_gb=self.l3cfg.capacity_gb, l3_store=self.store_name,
                             l3_mooncake=cfg.mooncake)  # fmt: skip
            pin = self.l3cfg.pin_tokens(n, profile.kv_bytes_per_token) if cfg.mooncake else None
            if pin is not None and server.mode != "stock":  # toolkv's servers: the pin budget
                server = replace(server, toolkv_env=(*server.toolkv_env, ("TOOLKV_L3_PIN_TOKENS", str(pin))))
        self.tick_s = tick_s
        self.agents = Agents(sessions, server.mode, server.send_tool)
        try:
            self.servers = [FleetServer(self, i, server, profile, opts) for i in range(n)]
        except BaseException:
            STORES.pop(self.store_name, None)
            raise
        self.up = list(range(n))
        self.drains = sorted(drain or [])
        self.last_server: dict[str, int] = {}
        self.turn_info: dict[tuple[str, int], dict[str, Any]] = {}
        self.counts: dict[str, int] = {"moved_turns": 0}
        self.now = 0.0
        self.crashed: str | None = None

    @property
    def store(self) -> Any:
        """The shared store (:class:`toolkv.twin.storage.L3Pages`), None without L3."""
        from toolkv.twin.storage import STORES

        return STORES.get(self.store_name) if self.store_name else None

    def close(self) -> None:
        """Close the servers' harnesses, the last built first (see :class:`FleetServer`), and forget the store."""
        from toolkv.twin.storage import STORES

        for s in reversed(self.servers):
            s.stack.close()
        STORES.pop(self.store_name, None)

    # ---- routing and the agents' side ------------------------------------------------------------
    def home(self, sid: str) -> int:
        return route(sid, self.up)

    def _dispatch(self, t: float, kind: str, sid: str) -> None:
        """An agent event: the agent's own (start, tool returned) runs here; a request or a
        toolkv call goes to a server: a turn and ``tool_end`` where the router sends them now,
        ``tool_start`` and ``close`` to the server that served the session's last turn."""
        if kind == "start":
            self.agents.start(sid, t)
        elif kind == "tool_done":
            self.agents.tool_done(sid, t)
        elif kind in ("generate", "op:tool_end"):
            self.servers[self.home(sid)].deliver(t, kind, sid)
        else:
            self.servers[self.last_server.get(sid, self.home(sid))].deliver(t, kind, sid)

    def on_generate(self, server: FleetServer, sid: str) -> None:
        """A turn reaches ``server`` (before it is queued there): whether it moved."""
        a = self.agents.agents[sid]
        prev = self.last_server.get(sid)
        moved = prev is not None and prev != server.index
        self.counts["moved_turns"] += moved
        self.last_server[sid] = server.index
        self.turn_info[(sid, a.turn)] = {"server": server.index, "moved": moved, "l3_tokens": 0,
                                             "sent_s": server.now}  # fmt: skip

    # ---- the loop ---------------------------------------------------------------------------------
    def run(self) -> None:
        heap: list[tuple[float, int, int]] = []
        ver = [0] * len(self.servers)

        def touch(s: FleetServer) -> None:
            ver[s.index] += 1
            heapq.heappush(heap, (s.ready_at(), ver[s.index], s.index))

        for s in self.servers:
            touch(s)
        give_up = self.sessions.workload.duration_s + self.opts.give_up_s
        inf = math.inf
        try:
            while True:
                while heap and heap[0][1] != ver[heap[0][2]]:
                    heapq.heappop(heap)
                ts = heap[0][0] if heap else inf
                te = self.agents.next_time()
                td = self.drains[0][0] if self.drains else inf
                tg = min(te if te is not None else inf, td)
                if tg <= ts:
                    self.now = tg
                    while self.drains and self.drains[0][0] <= tg:
                        _, k = self.drains.pop(0)
                        if k in self.up and len(self.up) > 1:
                            self.up.remove(k)
                            self.servers[k].up = False
                            self.servers[k].drained_at = tg
                            self.servers[k].tk.manager.routed_away()  # it lets go of what it holds
                    for t, kind, sid in self.agents.due(tg):
                        self._dispatch(t, kind, sid)
                    for s in self.servers:  # deliveries may have moved a server's time
                        if s.inbox:
                            touch(s)
                    continue
                if self.agents.finished and not any(s.busy for s in self.servers):
                    break
                if ts > give_up:
                    raise Stalled(
                        f"sessions did not finish {self.opts.give_up_s:.0f} s after the end of the run"
                    )
                _, _, k = heapq.heappop(heap)
                s = self.servers[k]
                s.step()
                self.now = max(self.now, s.now)
                touch(s)
        except (RuntimeError, Stalled) as e:
            self.crashed = f"t={self.now:.3f}s: {str(e).splitlines()[0]}"

    def l3_stats(self) -> dict[str, Any] | None:
        """The storage I/O of every server summed (:class:`toolkv.twin.storage.TimedStorageIO`), the
        shared store's pages, and toolkv's L3 counters summed over the servers' managers."""
        ios = [s.stack.storage for s in self.servers if s.stack.storage is not None]
        if not ios:
            return None
        out: dict[str, Any] = {k: 0 for k in ios[0].stats}
        for io in ios:
            for k, v in io.stats.items():
                out[k] += v
        store = self.store
        out["stored_pages"] = len(store) if store is not None else 0
        out["refused_pages"] = store.refused if store is not None else 0
        out["evicted_pages"] = store.evicted if store is not None else 0
        out["pinned_writes"] = store.pinned_writes if store is not None else 0
        out["unpinned"] = store.unpinned if store is not None else 0
        out["link_read_tokens"] = sum(io.rlink.tokens for io in ios)
        out["link_write_tokens"] = sum(io.wlink.tokens for io in ios)
        return out

    def toolkv_counters(self) -> dict[str, int]:
        """toolkv's L3 counters (and its demotions), summed over the servers' managers."""
        out: dict[str, int] = {}
        for s in self.servers:
            for k, v in s.tk.manager.counters.items():
                if k.startswith(("l3_", "drain_")) or k in (
                    "demoted_l3",
                    "demoted",
                    "tool_end_l3",
                    "tool_end_adopted",
                ):
                    out[k] = out.get(k, 0) + int(v)
        return out


_FLEETS = itertools.count()
_HOLDS_NOTHING = frozenset(set(Phase) - HOLDING)


def simulate_fleet(
    w: Workload, cfg: FleetConfig, profile: TimeProfile, opts: Options, *, n: int = 1,
    l3: L3Config | None = None, drain: list[tuple[float, int]] | None = None, window: tuple[float, float],
    opt: bool = False, tick_s: float = 0.1,
) -> dict[str, Any]:  # fmt: skip
    """Run one configuration of the fleet over ``w``'s sessions and summarise it."""
    wall = time.perf_counter()
    f = Fleet(Sessions.lazy(w), cfg, profile, opts, n=n, l3=l3, drain=drain, tick_s=tick_s)
    f.run()
    leaks: dict[str, Any] = {"leaked": -1}
    drained: dict[str, Any] = {"leaked": -1}
    if f.crashed is None:
        per = [s.settle() for s in f.servers]
        leaks = {k: sum(int(p[k]) for p in per) for k in per[0]}
        gone = [p for s, p in zip(f.servers, per, strict=True) if not s.up]
        drained = {k: sum(int(p[k]) for p in gone) for k in per[0]}
    st = f.l3_stats()
    f.close()
    out = summary(f, leaks, st, window=window, opt=opt, wall_s=time.perf_counter() - wall)
    out["drained_leaks"] = drained  # the drained servers' share of ``leaks`` (they stay up)
    # how long after its drain a drained server still held a session (0: none after the drain)
    out["drained_held_s"] = max(
        (s.held_at - s.drained_at for s in f.servers if s.drained_at is not None and s.held_at is not None),
        default=0.0,
    )
    return out


def summary(
    f: Fleet, leaks: dict[str, Any], st: dict[str, Any] | None, *, window: tuple[float, float], opt: bool,
    wall_s: float,
) -> dict[str, Any]:  # fmt: skip
    """Reuse and TTFT of resumed turns (all, and those that moved server), L3 traffic, checks."""
    a = f.agents
    appended = a.sessions.appended()
    s = summarize(a.turns, a.calls, window_start_s=window[0], window_end_s=window[1], wall_s=f.now)
    moved = [t for t in a.turns if f.turn_info.get((t.session, t.turn), {}).get("moved")]
    ms = (
        summarize(moved, a.calls, window_start_s=window[0], window_end_s=window[1], wall_s=f.now)
        if moved
        else None
    )
    waits = [
        f.turn_info[(t.session, t.turn)]["l3_wait_s"] for t in a.turns
        if t.resumed and window[0] <= t.start_s <= window[1] and (t.session, t.turn) in f.turn_info
        and f.turn_info[(t.session, t.turn)].get("l3_tokens")
    ]  # fmt: skip
    prefill = sum(sv.sched.prefill_tokens for sv in f.servers)
    cached = sum(sv.sched.cached_tokens for sv in f.servers)
    retractions = sum(sv.sched.retractions for sv in f.servers)
    host_tokens = f.servers[0].stack.host_tokens
    checks = {
        "every generate answered": s["turns"] == s["turns_ok"] and a.finished,
        "the scheduler did not die": f.crashed is None,
        "every counter back to initial, pools idle, no storage operation left": leaks.get("leaked") == 0,
        "every prompt token cached or computed once": retractions > 0
        or prefill + cached == sum(t.prompt_tokens for t in a.turns),
        # every page in the store came through a server's write link, every token read through a read link
        "L3: the store's pages were written through the links": st is None
        or st["stored_pages"] <= st["link_write_tokens"],
        "L3: what was read went through the links": st is None or st["read_tokens"] <= st["link_read_tokens"],
    }
    all_reuse = reuse(a.turns, appended, window)
    moved_reuse = reuse(moved, appended, window) if moved else None
    out: dict[str, Any] = {
        "config": f.cfg.name, "servers": len(f.servers), "host_gb": f.cfg.server.host_gb, "host_tokens": host_tokens,
        "device_tokens": f.opts.device_tokens, "drained": len(f.servers) - len(f.up),
        "turns": s["turns"], "turns_per_s": s["turns_per_s"], "resumed_turns": s["resumed_turns"],
        "reuse": all_reuse["reuse"], "reuse_tokens": [all_reuse["cached_tokens"], all_reuse["reusable_tokens"]],
        "ttft_p50_s": s["resumed_ttft_p50_s"], "ttft_p90_s": s["resumed_ttft_p90_s"],
        "moved_turns": ms["resumed_turns"] if ms else 0,
        "moved_reuse": moved_reuse["reuse"] if moved_reuse else None,
        "moved_reuse_tokens": [moved_reuse["cached_tokens"], moved_reuse["reusable_tokens"]] if moved_reuse else [0, 0],
        "moved_ttft_p50_s": ms["resumed_ttft_p50_s"] if ms else None,
        "l3_wait_p50_s": _pct(waits, 50), "l3_waits": len(waits),
        "prefill_tokens": prefill, "cached_tokens": cached, "retractions": retractions,
        "counts": dict(f.counts), "toolkv_l3": f.toolkv_counters(), "calls": dict(a.calls), "l3": st,
        "leaks": leaks, "crashed": f.crashed,
        "checks": checks, "passed": all(checks.values()), "sim_end_s": f.now, "wall_s": wall_s,
    }  # fmt: skip
    if opt:
        cap = host_tokens * len(f.servers)
        out["opt_reuse"] = opt_reuse(a.timeline, cap, window)["reuse"]
    return out


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    ys = sorted(xs)
    return ys[min(len(ys) - 1, max(0, math.ceil(q / 100 * len(ys)) - 1))]


def progress_line(r: dict[str, Any]) -> str:
    return (
        f"{r['config']} n={r['servers']} host {r['host_gb']:g} GB: reuse {r['reuse']:.2f}, TTFT p50 "
        f"{r['ttft_p50_s']:.2f} s, {r['wall_s']:.0f} CPU s{' ' + r['crashed'] if r['crashed'] else ''}"
    )


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
