"""Twins of one or more sglang servers sharing an L3 store (``toolkv twin l3`` and ``toolkv twin fleet``).

Each server is a full twin (:class:`~toolkv.twin.run.Twin`: sglang's real cache, ``Req``,
``PrefillAdder``, toolkv's real scheduler side, modelled GPU time), with its own device and host
pools. The agents are one population; a router sends each request to a server chosen by the
session id (rendezvous hashing over the servers that are up, as a consistent-hash router does),
so a session stays on its server until that server is drained, and then its next turn lands on
the server the hash picks among the others. All servers share one L3 store (:mod:`toolkv.twin.l3`)
with a link of their own to it.

Configurations (:data:`FLEET_CONFIGS`):

- ``stock``: HiCache, no L3: a moved session is recomputed on its new server;
- ``stock-l3``: HiCache with the L3 store; the prompt's part found in L3 is read when the request
  arrives, and the request waits for it (sglang's ``prefetch_from_storage`` on arrival with
  ``wait_complete``);
- ``toolkv``: toolkv's ``offload`` policy (tool names sent so its duration model learns per tool),
  no L3: what it cannot keep on the host is lost;
- ``toolkv-l3``: the same, with the L3 store, and toolkv's knowledge of the tool call used on it:

  * a session whose tool's learned median (toolkv's ``DurationModel``) is at least ``long_s`` is
    demoted (toolkv's own ``demote``: its host protection goes) once its L3 copy is complete;
  * its read is scheduled from the predicted return (``residual_median`` of the tool given how
    long it has run, less the read's own time), to whichever server the router will send the next
    turn to (the new one, for a session whose server was drained), and re-predicted while the
    tool runs on; what it read ahead is held on the host (up to half the pool) until the request
    is admitted, as toolkv's hand-over holds a restore;
  * a request that arrives with its KV missing is read on arrival as stock does; if the host is
    full, what toolkv read ahead for others yields first, then the sessions toolkv holds that are
    predicted back later (their L3 copies complete) are demoted to make room.

The twin parts only: the policy here is the twin's, built on toolkv's real duration model and
real offload/demotion decisions; toolkv's manager has no L3 state yet (issue 27, item 1). The last
hop (host to GPU) is sglang's ``load_back`` when the request is admitted, on its critical path
(75K tokens at the calibrated 53 GB/s: 0.19 s).
"""

from __future__ import annotations

import heapq
import itertools
import math
import sys
import time
import zlib
from dataclasses import dataclass, field, replace
from typing import Any

from toolkv.twin.agents import Agents
from toolkv.twin.configs import TwinConfig, get
from toolkv.twin.l3 import L3Config, L3Store, Link
from toolkv.twin.opt import opt_reuse
from toolkv.twin.profile import TimeProfile
from toolkv.twin.report import reuse
from toolkv.twin.run import Options, Stalled, Twin
from toolkv.twin.sessions import Sessions
from toolkv.workload.metrics import summarize
from toolkv.workload.plan import Workload


@dataclass(frozen=True)
class FleetConfig:
    """One configuration of the L3 / multi-server study: a server configuration and its L3."""

    name: str
    server: TwinConfig
    l3: str | None  # None, or the L3 prefetch: "arrival" (stock) | "predicted" (toolkv)


_TOOLKV = replace(get("offload"), name="toolkv", send_tool=True)
FLEET_CONFIGS: dict[str, FleetConfig] = {
    c.name: c
    for c in (
        FleetConfig("stock", get("stock"), None),
        FleetConfig("stock-l3", replace(get("stock"), name="stock-l3"), "arrival"),
        FleetConfig("toolkv", _TOOLKV, None),
        FleetConfig("toolkv-l3", replace(_TOOLKV, name="toolkv-l3"), "predicted"),
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


@dataclass(order=True)
class Read:
    """An L3 read into one server's host pool (``prefetch_from_storage``'s operation)."""

    finish: float
    seq: int
    server: int = field(compare=False)
    sid: str = field(compare=False)
    node: Any = field(compare=False)  # the last host node, protected while the read runs
    key: list[int] = field(compare=False)  # the tokens read (after what the tree already had)
    idx: Any = field(compare=False)  # their host slots
    upto: int = field(compare=False)  # the session's L3 tokens this read ends at
    ahead: bool = field(compare=False)  # scheduled by toolkv before the request (else on arrival)
    held: bool = field(compare=False, default=False)  # a request waits for it


class Server(Twin):
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
        self.reads: list[Read] = []
        self.ran = False
        self.up = True
        # session -> (host node, tokens read ahead or 0 for a request's own read): held until admitted
        self.awaiting: dict[str, tuple[Any, int]] = {}
        self.rlink = Link(fleet.l3cfg.read_gbps, profile.kv_bytes_per_token)
        self.wlink = Link(fleet.l3cfg.write_gbps, profile.kv_bytes_per_token)

    def ready_at(self) -> float:
        """When this server next has something to do: now if it has input or just ran a batch,
        else at its next copy or read completion or its next idle tick."""
        if self.inbox or self.ran:
            return self.now
        t = self.now + self.fleet.tick_s
        c = self.copies.next_finish(self.now)
        if c is not None:
            t = min(t, c)
        if self.reads:
            t = min(t, self.reads[0].finish)
        return max(t, self.now)

    @property
    def busy(self) -> bool:
        return bool(self.inbox or self.sched.busy or self.reads or self.copies.next_finish(self.now))

    def deliver(self, t: float, kind: str, sid: str) -> None:
        if not self.ran and not self.inbox:
            self.now = max(self.now, t)  # an idle server wakes when the message arrives
        self.inbox.append((t, kind, sid))

    def _input(self, t: float, kind: str, sid: str) -> None:
        if kind == "generate":
            self.agents.generate_sent(sid, t)
            self.fleet.on_generate(self, sid)
            return
        super()._input(t, kind, sid)
        if kind == "op:tool_start":
            self.fleet.on_tool_start(self, sid)
        elif kind == "op:close":
            self.fleet.on_close(sid)

    def admit(self, sid: str) -> None:
        """The request enters sglang's waiting queue (after its L3 read, if it waited for one)."""
        self.tk.on_request(self.agents.sid_sent(sid))
        self.sched.add_request(self._new_req(sid))

    def _admitted(self, req: Any) -> None:
        held = self.awaiting.pop(self._sid(req), None)
        if held is not None:
            held[0].release_host()
        super()._admitted(req)

    def _finished(self, req: Any) -> None:
        # the KV the tree keeps (prompt and answer but the last token) goes to L3 as HiCache writes
        # every node it backs up to the host (write_backup_storage)
        upto = len(req.origin_input_ids) + len(req.output_ids) - 1
        self.fleet.on_turn_end(self, self._sid(req), upto)
        super()._finished(req)

    def step(self) -> None:
        """One scheduler iteration (:meth:`Twin.iterate`, with the router's inbox for input)."""
        self.now = max(self.now, self.ready_at())
        self.copies.complete_due(self.now)
        self.fleet.complete_reads(self)
        inbox, self.inbox = self.inbox, []
        for t, kind, sid in inbox:
            self._input(t, kind, sid)
        self.tk.tick()
        self.copies.stamp(self.now)
        batch = self.sched.next_batch()
        self.copies.stamp(self.now)
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
        elif self.sched.stalled and not self.copies.next_finish(self.now) and not self.reads:
            raise Stalled(f"server {self.index}: batch_is_full with nothing running")
        if not self.samples or self.now - self.samples[-1]["t"] >= self.opts.sample_s:
            self._sample()

    def settle(self) -> dict[str, Any]:
        """Idle iterations after the run (acks land, TTLs fire), then :meth:`Twin.leaks`."""
        until = self.now + self.opts.drain_s
        while self.now < until:
            self.copies.complete_due(self.now)
            self.tk.tick()
            self.h.tree.check_hicache_events()
            self.now = min(until, self.now + self.opts.idle_s * 10)
        leaks = self.leaks()
        leaks["l3_reads_in_flight"] = len(self.reads) + len(self.awaiting)
        leaks["leaked"] += len(self.reads) + len(self.awaiting)
        return leaks


class Fleet:
    """``n`` servers of one configuration behind a session-id router, sharing one L3 store;
    ``drain`` lists (time, server) pairs: from that time the router sends that server nothing new."""

    def __init__(
        self, sessions: Sessions, cfg: FleetConfig, profile: TimeProfile, opts: Options, *, n: int = 1,
        l3: L3Config | None = None, drain: list[tuple[float, int]] | None = None, tick_s: float = 0.1,
    ) -> None:  # fmt: skip
        self.sessions, self.cfg, self.profile, self.opts = sessions, cfg, profile, opts
        self.l3cfg = replace(l3 or L3Config(), prefetch=cfg.l3 or "arrival")
        self.store: L3Store | None = L3Store(self.l3cfg, profile.kv_bytes_per_token) if cfg.l3 else None
        self.tick_s = tick_s
        self.agents = Agents(sessions, cfg.server.mode, cfg.server.send_tool)
        self.servers = [Server(self, i, cfg.server, profile, opts) for i in range(n)]
        self.up = list(range(n))
        self.drains = sorted(drain or [])
        self.wakes: list[tuple[float, int, str, int, str]] = []  # toolkv's timers: (t, seq, sid, turn, kind)
        self.reading: dict[str, Read] = {}
        self.tool_started: dict[str, tuple[float, str | None, int]] = {}
        self.last_server: dict[str, int] = {}
        self.turn_info: dict[tuple[str, int], dict[str, Any]] = {}
        self.counts: dict[str, int] = {
            "moved_turns": 0, "reads_on_arrival": 0, "reads_ahead": 0, "ahead_too_late": 0, "ahead_not_needed": 0,
            "read_no_host_room": 0, "read_node_gone": 0, "demoted_to_l3": 0,
        }  # fmt: skip
        self._seq = itertools.count()
        self.last_refusal = ""  # why the last start_read read nothing (diagnostics)
        self.now = 0.0
        self.crashed: str | None = None

    def close(self) -> None:
        """Close the servers' harnesses, the last built first (see :class:`Server`)."""
        for s in reversed(self.servers):
            s.stack.close()

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

    def on_generate(self, server: Server, sid: str) -> None:
        """A turn reaches ``server``: read what L3 has beyond the server's tree, or admit it."""
        a = self.agents.agents[sid]
        prev = self.last_server.get(sid)
        moved = prev is not None and prev != server.index
        self.counts["moved_turns"] += moved
        self.last_server[sid] = server.index
        self.release_held(sid, but=server.index)
        if sid in server.awaiting:  # what toolkv read ahead is now this waiting request's own
            server.awaiting[sid] = (server.awaiting[sid][0], 0)
        info = self.turn_info[(sid, a.turn)] = {
            "server": server.index,
            "moved": moved,
            "l3_tokens": 0,
            "l3_wait_s": 0.0,
        }
        info["sent_s"] = server.now
        if self.store is None:
            server.admit(sid)
            return
        rd = self.reading.get(sid)
        if rd is not None and rd.server == server.index:  # toolkv's read is still running: wait for it
            self.counts["ahead_too_late"] += 1
            rd.held = True
            return
        if rd is None and self.start_read(server, sid, server.now, ahead=False):
            self.counts["reads_on_arrival"] += 1
            self.reading[sid].held = True
            return
        info["no_read"] = self.last_refusal
        server.admit(sid)

    def on_tool_start(self, server: Server, sid: str) -> None:
        """toolkv with L3: schedule the session's read from its tool's predicted return."""
        if self.store is None or self.cfg.l3 != "predicted":
            return
        a = self.agents.agents[sid]
        tool = self._tool_name(a)
        self.tool_started[sid] = (server.now, tool, server.index)
        if server.tk.manager.durations.median(tool) >= self.l3cfg.long_s:
            # predicted long: to L3 once its copy there is complete (the writes queued at the
            # turn's end are done when the server's write link is free)
            heapq.heappush(
                self.wakes, (max(server.now, server.wlink.free_at), next(self._seq), sid, a.turn, "demote")
            )
        self._arm(server, sid, a.turn, server.now)

    def _tool_name(self, a: Any) -> str | None:
        return (
            self.sessions.workload.tools.name_of(a.plan.tools_s[a.turn])
            if self.cfg.server.send_tool
            else None
        )

    def _arm(self, server: Server, sid: str, turn: int, now: float) -> None:
        """Wake when the read has to start for the session to be on the host at its predicted
        return: toolkv's ``residual_median`` of the tool's learned duration given how long it has
        run (it grows as a heavy-tailed call runs on), less the read's time and a margin."""
        start, tool, _ = self.tool_started[sid]
        d = server.tk.manager.durations
        back = start + d.residual_median(tool, now - start)
        lead = len(self.agents.agents[sid].ctx) * server.rlink.s_per_token + self.l3cfg.margin_s
        heapq.heappush(
            self.wakes, (max(now + self.l3cfg.margin_s, back - lead), next(self._seq), sid, turn, "read")
        )

    def on_close(self, sid: str) -> None:
        """toolkv knows a session ended: its L3 copy goes (stock leaves it to the LRU)."""
        self.release_held(sid)
        if self.store is not None and self.cfg.l3 == "predicted" and sid not in self.reading:
            self.store.drop(sid)

    def on_turn_end(self, server: Server, sid: str, upto: int) -> None:
        if self.store is not None:
            self.store.write(server.wlink, server.index, sid, upto, server.now)

    def _wake(self, t: float, sid: str, turn: int, kind: str) -> None:
        a = self.agents.agents.get(sid)
        if a is None or a.done or a.turn != turn:
            return  # the tool returned (its request reads on arrival if it must)
        if kind == "demote":
            self._demote_long(t, sid, turn)
            return
        if sid in self.reading:
            return
        target = self.servers[self.home(sid)]
        if self.start_read(target, sid, t, ahead=True):
            self.counts["reads_ahead"] += 1
        else:
            self.counts["ahead_not_needed"] += 1
        # the tool runs on past its prediction: predict again from how long it has run (HiCache
        # may also evict the unprotected host copy meanwhile, or a drain move the session)
        self._arm(target, sid, turn, t)

    def _demote_long(self, t: float, sid: str, turn: int) -> None:
        """A session whose tool is predicted long leaves the host for L3 (toolkv's ``demote``:
        its host protection goes, HiCache may evict the copy): only once its L3 copy is
        completely written and toolkv holds it offloaded."""
        assert self.store is not None
        server = self.servers[self.tool_started[sid][2]]
        mgr = server.tk.manager
        rec = mgr.sessions.get(sid)
        if rec is None or rec.state not in ("Offloading", "Offloaded"):
            return  # toolkv holds nothing for it (refused, let go, expired)
        if rec.state == "Offloading" or self.store.readable(sid) < len(rec.tokens):
            heapq.heappush(self.wakes, (t + 0.5, next(self._seq), sid, turn, "demote"))
            return
        mgr.demote(sid)
        self.counts["demoted_to_l3"] += 1

    # ---- L3 reads ---------------------------------------------------------------------------------
    def start_read(self, server: Server, sid: str, now: float, *, ahead: bool) -> bool:
        """``prefetch_from_storage``: read what L3 holds of the session beyond the server's device
        and host tree into new host slots (evicting unprotected host copies when short)."""
        from toolkv.testing.harness import rkey

        assert self.store is not None
        upto = self.store.readable(sid)
        self.last_refusal = "not in L3"
        if upto < self.l3cfg.threshold_tokens:
            return False
        tokens = list(self.agents.agents[sid].ctx[:upto])
        tree = server.h.tree
        m = tree.match_prefix(_match_params(rkey(tokens)))
        have = len(m.device_indices) + int(m.host_hit_length)
        n = upto - have
        self.last_refusal = "in the tree"
        if n < self.l3cfg.threshold_tokens:
            return False
        self.last_refusal = "no host room"
        pool = tree.cache_controller.mem_pool_host
        idx = pool.alloc(n)
        if idx is None:
            tree.evict_host(n)
            idx = pool.alloc(n)
        if idx is None and self.cfg.l3 == "predicted" and not ahead:
            # a request is waiting: what toolkv read ahead for others (their requests are not
            # here yet) yields first, then sessions toolkv holds that are predicted back later
            for other in [o for o, (_, ahead) in server.awaiting.items() if o != sid and ahead]:
                server.awaiting.pop(other)[0].release_host()
                tree.evict_host(n)
                idx = pool.alloc(n)
                if idx is not None:
                    break
            if idx is None:
                idx = self._demote_for(server, sid, n, now)
        if idx is None:
            self.counts["read_no_host_room"] += 1
            return False
        m.last_host_node.protect_host()
        self.store.begin_read(sid, upto)
        rd = Read(server.rlink.schedule(now, n), next(self._seq), server.index, sid, m.last_host_node,
                  tokens[have:], idx, upto, ahead)  # fmt: skip
        heapq.heappush(server.reads, rd)
        self.reading[sid] = rd
        return True

    def _may_hold(self, server: Server, tokens: int) -> bool:
        """Whether toolkv may hold another read-ahead copy on ``server``'s host (half the pool)."""
        held = sum(n for _, n in server.awaiting.values())
        return held + tokens <= server.stack.host_tokens // 2

    def release_held(self, sid: str, but: int | None = None) -> None:
        """A session's held read-ahead copy on any server other than ``but`` is let go (its turn
        landed elsewhere, or it ended)."""
        for sv in self.servers:
            if sv.index != but and sid in sv.awaiting:
                sv.awaiting.pop(sid)[0].release_host()

    def _demote_for(self, server: Server, sid: str, n: int, now: float) -> Any:
        """toolkv with L3: a read that finds the host full of protected copies demotes, through
        toolkv's own ``demote``, the offloaded sessions predicted back after this one (the latest
        first, ``_demotion_candidates``) whose L3 copy is completely written: they go to L3
        instead of being dropped, and their host slots take this read."""
        assert self.store is not None
        tree = server.h.tree
        pool = tree.cache_controller.mem_pool_host
        mgr = server.tk.manager
        for victim in mgr._demotion_candidates(sid, now):  # predicted back after now, latest first
            rec = mgr.sessions[victim]
            if self.store.readable(victim) < len(rec.tokens):
                continue  # its L3 copy is not complete: demoting it would drop KV
            mgr.demote(victim)
            self.counts["demoted_to_l3"] += 1
            tree.evict_host(n)
            idx = pool.alloc(n)
            if idx is not None:
                return idx
        return None

    def complete_reads(self, server: Server) -> None:
        """``check_prefetch_progress`` once the read is complete: insert the tokens into the host
        tree (``_insert_helper_host``), free the slots of what was there already, release the
        protection; a request that waited for it enters the waiting queue."""
        from toolkv.core.treeops import attached
        from toolkv.testing.harness import rkey

        assert self.store is not None or not server.reads
        tree = server.h.tree
        pool = tree.cache_controller.mem_pool_host if server.reads else None
        while server.reads and server.reads[0].finish <= server.now + 1e-12:
            rd = heapq.heappop(server.reads)
            assert pool is not None and self.store is not None
            if attached(tree, rd.node):
                n = len(rd.key)
                matched = tree._insert_helper_host(rd.node, rkey(rd.key), rd.idx, [""] * n)
                if matched:
                    pool.free(rd.idx[:matched])
                if rd.held or (
                    rd.ahead and not self.agents.agents[rd.sid].done and self._may_hold(server, rd.upto)
                ):
                    # sglang inserts a finished prefetch and admits its request in the same pass
                    # (check_prefetch_progress inside get_new_batch_prefill): the copy cannot be
                    # evicted in between. Here the request joins the queue now, so the new host
                    # path stays protected until the request is admitted (Server._admitted).
                    # toolkv holds what it read ahead the same way (the hand-over), up to half
                    # the host pool, so that a read ahead is not evicted before its request.
                    m = tree.match_prefix(
                        _match_params(rkey(list(self.agents.agents[rd.sid].ctx[: rd.upto])))
                    )
                    m.last_host_node.protect_host()
                    server.awaiting[rd.sid] = (m.last_host_node, rd.upto if not rd.held else 0)
            else:  # the anchor left the tree meanwhile: what was read has nowhere to go
                self.counts["read_node_gone"] += 1
                pool.free(rd.idx)
            rd.node.release_host()
            self.store.end_read(rd.sid, len(rd.key))
            del self.reading[rd.sid]
            if rd.held:
                a = self.agents.agents[rd.sid]
                info = self.turn_info.get((rd.sid, a.turn))
                if info is not None:
                    info["l3_tokens"] = len(rd.key)
                    info["l3_wait_s"] = server.now - info["sent_s"]
                    info["ahead"] = rd.ahead
                if rd.server == self.last_server.get(rd.sid):
                    server.admit(rd.sid)
                else:  # pragma: no cover - a request waits only on a read to its own server
                    self.servers[self.last_server[rd.sid]].admit(rd.sid)

    # ---- the loop ---------------------------------------------------------------------------------
    def run(self) -> None:
        heap: list[tuple[float, int, int]] = []
        ver = [0] * len(self.servers)

        def touch(s: Server) -> None:
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
                tw = self.wakes[0][0] if self.wakes else inf
                tl = self.store.next_write() if self.store is not None else None
                td = self.drains[0][0] if self.drains else inf
                tg = min(te if te is not None else inf, tw, tl if tl is not None else inf, td)
                if tg <= ts:
                    self.now = tg
                    if self.store is not None:
                        self.store.complete_writes(tg)
                    while self.drains and self.drains[0][0] <= tg:
                        _, k = self.drains.pop(0)
                        if k in self.up and len(self.up) > 1:
                            self.up.remove(k)
                            self.servers[k].up = False
                    while self.wakes and self.wakes[0][0] <= tg:
                        t, _, sid, turn, kind = heapq.heappop(self.wakes)
                        self._wake(t, sid, turn, kind)
                    for t, kind, sid in self.agents.due(tg):
                        self._dispatch(t, kind, sid)
                    for s in self.servers:  # deliveries and reads may have moved a server's time
                        if s.inbox or s.reads:
                            touch(s)
                    continue
                if self.agents.finished and not any(s.busy for s in self.servers):  # wakes left are no-ops
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


def _match_params(key: Any) -> Any:
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams

    return MatchPrefixParams(key=key)


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
    if f.crashed is None:
        per = [s.settle() for s in f.servers]
        leaks = {k: sum(int(p[k]) for p in per) for k in per[0]}
    f.close()
    return summary(f, leaks, window=window, opt=opt, wall_s=time.perf_counter() - wall)


def summary(
    f: Fleet, leaks: dict[str, Any], *, window: tuple[float, float], opt: bool, wall_s: float
) -> dict[str, Any]:
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
    st = f.store.describe() if f.store is not None else None
    checks = {
        "every generate answered": s["turns"] == s["turns_ok"] and a.finished,
        "the scheduler did not die": f.crashed is None,
        "every counter back to initial, pools idle, no L3 read left": leaks.get("leaked") == 0,
        "every prompt token cached or computed once": retractions > 0
        or prefill + cached == sum(t.prompt_tokens for t in a.turns),
        "L3: nothing read that was not completely written": st is None or st["reads_unwritten"] == 0,
        "L3: no copy dropped while read": st is None or st["dropped_while_read"] == 0,
    }
    out: dict[str, Any] = {
        "config": f.cfg.name, "servers": len(f.servers), "host_gb": f.cfg.server.host_gb, "host_tokens": host_tokens,
        "device_tokens": f.opts.device_tokens, "drained": len(f.servers) - len(f.up),
        "turns": s["turns"], "turns_per_s": s["turns_per_s"], "resumed_turns": s["resumed_turns"],
        "reuse": reuse(a.turns, appended, window)["reuse"],
        "ttft_p50_s": s["resumed_ttft_p50_s"], "ttft_p90_s": s["resumed_ttft_p90_s"],
        "moved_turns": ms["resumed_turns"] if ms else 0,
        "moved_reuse": reuse(moved, appended, window)["reuse"] if moved else None,
        "moved_ttft_p50_s": ms["resumed_ttft_p50_s"] if ms else None,
        "l3_wait_p50_s": _pct(waits, 50), "l3_waits": len(waits),
        "prefill_tokens": prefill, "cached_tokens": cached, "retractions": retractions,
        "counts": dict(f.counts), "calls": dict(a.calls), "l3": st, "leaks": leaks, "crashed": f.crashed,
        "checks": checks, "passed": all(checks.values()), "sim_end_s": f.now, "wall_s": wall_s,
    }  # fmt: skip
    if opt:
        cap = host_tokens * len(f.servers)
        out["opt_reuse"] = opt_reuse(a.timeline, cap, window)["reuse"]
        if st is not None:
            out["opt_reuse_l3"] = opt_reuse(a.timeline, cap + st["capacity_tokens"], window)["reuse"]
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
