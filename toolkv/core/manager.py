"""ToolKVManager: the scheduler-side implementation of ``spec/ToolKV.tla``'s manager actions.

Single-threaded by design: every method runs on the scheduler thread (inside a request handler or
the per-iteration tick), so on every tensor-parallel rank the same calls happen at the same
iteration with the same inputs. Time comes in as an argument (``tick(now)``) and asynchronous
completion is read off the tree after sglang's own ``writing_check``/``loading_check`` (which agree
across ranks with an all-reduce MIN), so nothing here reads a local clock or a local event without
agreement.

Spec action → method: ``Insert`` → :meth:`record_turn`, ``ToolStart`` → :meth:`offload`,
``Keep`` → :meth:`keep`, ``LetGo`` → :meth:`let_go`, ``Demote`` → :meth:`demote`, ``Prefetch`` →
:meth:`prefetch`, ``WriteAck`` → :meth:`process_write_acks`, ``ToolEnd`` → :meth:`tool_end`,
``LoadAck`` → :meth:`process_load_acks`, ``Admit`` → :meth:`admitted`, ``HostRoom`` → the room
:meth:`offload` makes with sglang's ``evict_host``, ``TtlSweep`` → :meth:`ttl_sweep`, ``Close`` →
:meth:`close`, ``TreeReset`` → :meth:`on_tree_reset`, ``Tick`` → :meth:`set_clock`.
:meth:`tool_start` is what the HTTP route calls: with ``policy="offload"`` it is ``ToolStart``;
with ``policy="auto"`` the per-call policy (``toolkv.core.policy``) chooses among ``ToolStart``,
``Keep`` and ``LetGo``, demoting other sessions first when the host budget is reached, and the
tick runs ``Prefetch`` when an offloaded tool call is expected to return. :meth:`tick` is what the
scheduler calls once per iteration: the clock, then every enabled manager action.
"""

from __future__ import annotations

import heapq
import logging
from array import array
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from toolkv.core.backends.base import Agreement, Backend, LocalAgreement, device_full
from toolkv.core.lifecycle import EXPIRING, HOLDING, fire
from toolkv.core.policy import Decision, DurationModel, PolicyConfig, Pressure, decide, demotion_order
from toolkv.core.session import SessionRecord
from toolkv.core.treeops import Tree, attached, path_to, walk
from toolkv.errors import (
    BadRequest,
    DeviceMemoryFull,
    HostMemoryFull,
    SessionKVLost,
    StaleEpoch,
    UnknownSession,
    WrongState,
)

log = logging.getLogger("toolkv")

# the phases of a session that holds nothing: it may be forgotten when idle (spec Close)
IDLE = frozenset({"Running", "Runnable", "Expired", "Lost", "Released"})


@dataclass(frozen=True)
class ManagerConfig:
    ttl_s: float = 600.0  # how long a protection lives without a tool_end
    host_budget_tokens: int | None = None  # cap on tokens toolkv keeps protected on host
    closed_history: int = 10_000  # closed sessions remembered for kv_meta (then 404)
    # "offload": every tool_start offloads (spec ToolStart); "auto": the per-call policy decides
    policy: str = "offload"
    policy_config: PolicyConfig = field(default_factory=PolicyConfig)
    # the restore rate the policy assumes until it has measured one (tokens per second)
    restore_tokens_per_s: float = 200_000.0
    prefetch: bool = True  # with policy "auto": restore early, before the tool is expected back
    # how long a pin on the GPU that waits for its tool_end (a kept session, or an early restore
    # once loaded: spec Kept) may live before the sweep releases it (never longer than ttl_s;
    # spec KeepTTL)
    keep_ttl_s: float = 30.0
    # how long a restored (or kept) session stays pinned waiting for its next request to be
    # admitted (spec Handover); never longer than ttl_s. Under load the next request can queue
    # for seconds: without the pin sglang evicts the KV it was restored for.
    handover_ttl_s: float = 30.0
    # a session that holds nothing and has had no turn or call for this long is forgotten (spec
    # Close): agents that end without close (zero-change mode never calls it) must not grow the
    # table for ever. inf: never.
    idle_ttl_s: float = 3600.0
    # With an L3 storage tier (sglang's --hicache-storage-backend): a host that must make room
    # stores an offloaded session's copy to L3 instead of dropping it. False: drop, as without one.
    l3: bool = True
    # the rate the early restore assumes for reading a session back from L3 (tokens per second):
    # a session's early restore starts that much earlier once its copy lives in L3
    l3_read_tokens_per_s: float = 100_000.0
    # Load-adaptive protection (spec Park, Unpin): a tool_end whose next request would wait (the
    # device cannot take the restore's pin next to what running and queued requests need) parks
    # the session: its host copy stays protected, nothing is loaded or pinned, and sglang's own
    # load_back brings it in when the request is admitted. A hand-over's pin is given up (the host
    # copy protected again) when queued requests need the room. False (the base spec, without its
    # policy actions): restore at every tool_end that fits the running requests' promise, else 503,
    # and pin until admission whatever is queued. The plugin turns it on (TOOLKV_ADAPTIVE=1).
    adaptive: bool = False

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, not {self.policy!r}")
        if not self.keep_ttl_s >= 0:
            raise ValueError("keep_ttl_s must be a number of seconds >= 0")
        if not self.handover_ttl_s >= 0:
            raise ValueError("handover_ttl_s must be a number of seconds >= 0")
        if not self.idle_ttl_s > 0:
            raise ValueError("idle_ttl_s must be a number of seconds > 0 (inf: never)")
        if not (self.restore_tokens_per_s > 0 and self.restore_tokens_per_s < float("inf")):
            raise ValueError("restore_tokens_per_s must be a positive number")
        if not (self.l3_read_tokens_per_s > 0 and self.l3_read_tokens_per_s < float("inf")):
            raise ValueError("l3_read_tokens_per_s must be a positive number")


POLICIES = ("offload", "auto")


class ToolKVManager:
    """Tracks sessions and moves their KV between tiers through a :class:`Backend`."""

    def __init__(
        self,
        tree: Tree,
        backend: Backend | None = None,
        *,
        config: ManagerConfig | None = None,
        agree: Agreement | None = None,
    ) -> None:
        self.config = config or ManagerConfig()
        self.agree = agree or LocalAgreement()
        self.tree = tree
        if backend is None:
            backend = make_backend(tree, config=self.config, agree=self.agree)
        self.backend = backend
        self.sessions: dict[str, SessionRecord] = {}
        self._closed: OrderedDict[str, SessionRecord] = OrderedDict()
        self._offloading: dict[str, SessionRecord] = {}
        self._restoring: dict[str, SessionRecord] = {}
        self._prefetching: dict[str, SessionRecord] = {}
        self._handover: dict[str, SessionRecord] = {}  # spec Handover: pinned, waiting for admission
        # the L3 storage tier (spec/storage/StorageTier.tla): stores and prefetches in flight
        self._storing: dict[str, SessionRecord] = {}
        self._fetching: dict[str, SessionRecord] = {}
        self._poll_storage: Callable[[], int] | None = getattr(self.backend, "poll_storage", None)
        self._prefetch_due: list[tuple[float, int, str]] = []  # (when, seq, session id), lazy deletion
        self.durations = DurationModel(self.config.policy_config)
        self.restore_rate = self.config.restore_tokens_per_s  # EWMA of measured restores
        self._deadlines: list[tuple[float, int, str]] = []  # (deadline, seq, session id), lazy deletion
        self._idle: list[tuple[float, int, str]] = []  # (idle expiry, seq, session id), lazy deletion
        self._seq = 0
        self.now = 0.0
        self.tree_gen = 0
        self.counters: Counter[str] = Counter()
        # Device tokens queued requests will need (the scheduler binds sglang's waiting queue):
        # a pin must leave them free, or a kept session is paid for by somebody's recompute.
        self.queued_demand: Callable[[], int] = lambda: 0

    # ---- helpers --------------------------------------------------------------------------------------
    def _get(self, session_id: str) -> SessionRecord:
        if not isinstance(session_id, str) or not session_id:
            raise BadRequest("session_id must be a non-empty string")
        rec = self.sessions.get(session_id)
        if rec is None:
            rec = self._closed.get(session_id)
        if rec is None:
            raise UnknownSession(f"unknown session {session_id!r}", session_id=session_id)
        return rec

    def _node_current(self, rec: SessionRecord, node: Any) -> bool:
        """True when the session's recorded node is still a node of the current tree: recorded
        under this tree generation and still attached (caveat 5: a node split off, evicted or
        left behind by a tree reset must not be acted on)."""
        return rec.tree_gen == self.tree_gen and attached(self.tree, node)

    def _live_node(self, rec: SessionRecord) -> Any:
        """The session's node if it is still in the current tree, else a re-walk by its tokens
        (caveat 5: never act on a stale node). Returns None when nothing is left."""
        node = rec.node
        if node is not None and self._node_current(rec, node):
            return node
        if not rec.tokens:
            return None
        found, matched = walk(self.tree, rec.tokens, rec.extra_key)
        if matched == len(rec.tokens) and found is not self.tree.root_node:
            return found
        return None

    def _arm_deadline(self, rec: SessionRecord, ttl_s: float | None = None) -> None:
        self._seq += 1
        rec.deadline = self.now + (self.config.ttl_s if ttl_s is None else ttl_s)
        rec.deadline_seq = self._seq
        heapq.heappush(self._deadlines, (rec.deadline, self._seq, rec.session_id))

    def _touch(self, rec: SessionRecord) -> None:
        """The session did something: its idle expiry moves to ``now + idle_ttl_s``."""
        rec.last_active = self.now
        if self.config.idle_ttl_s != float("inf"):
            self._seq += 1
            heapq.heappush(self._idle, (self.now + self.config.idle_ttl_s, self._seq, rec.session_id))

    def forget_idle(self) -> int:
        """Spec ``Close`` of every session that holds nothing and was idle for ``idle_ttl_s``:
        its record goes to the bounded closed history (tokens and node dropped). O(1) when none
        is due."""
        heap, n = self._idle, 0
        while heap and heap[0][0] <= self.now:
            _due, _seq, sid = heapq.heappop(heap)
            rec = self.sessions.get(sid)
            if rec is None or rec.last_active + self.config.idle_ttl_s > self.now:
                continue  # closed already, or active since (a newer entry is queued)
            if rec.state not in IDLE:
                self._touch(rec)  # holds something: the TTL ends that first; look again later
                continue
            self.close(sid)
            self.counters["forgotten"] += 1
            n += 1
        return n

    def _settle(self, rec: SessionRecord) -> None:
        """The session left the protecting states: stop watching it (its old deadline stays on
        record, as in the spec; the sweep ignores sessions that protect nothing)."""
        self._offloading.pop(rec.session_id, None)
        self._restoring.pop(rec.session_id, None)
        self._prefetching.pop(rec.session_id, None)
        self._handover.pop(rec.session_id, None)
        self._storing.pop(rec.session_id, None)
        self._fetching.pop(rec.session_id, None)
        rec.l3 = rec.l3_then = ""
        rec.prefetch_at = float("inf")

    # ---- Insert ---------------------------------------------------------------------------------------
    def record_turn(self, session_id: str, tokens: Sequence[int], extra_key: str | None = None) -> None:
        """A turn of the session finished and its KV landed in the tree (``cache_finished_req``)."""
        if not isinstance(session_id, str) or not session_id:
            raise BadRequest("session_id must be a non-empty string")
        rec = self.sessions.get(session_id)
        if rec is None:
            old = self._closed.pop(session_id, None)
            rec = SessionRecord(session_id=session_id)
            if old is not None:
                # A reused id continues the old epochs: a tool_end from before the close stays
                # stale (spec EpochMonotone; Closed never goes back to Running under one record).
                rec.epoch = old.epoch
        elif rec.state not in ("Running", "Runnable", "Expired", "Lost", "Released"):
            raise WrongState(
                f"session {session_id!r} is {rec.state}; a turn cannot end while its KV is offloaded"
                " (call tool_end first)",
                state=rec.state,
            )
        node, matched = walk(self.tree, tokens, extra_key)
        self.sessions[session_id] = rec
        rec.tokens = array("q", tokens[:matched])
        rec.extra_key = extra_key
        rec.node = node if matched else None
        rec.tree_gen = self.tree_gen
        if rec.state != "Running":
            fire(rec, "insert", "Running")
        self._touch(rec)
        self.counters["turns"] += 1

    # ---- tool_start: the policy's choice among ToolStart, Keep and LetGo --------------------------------
    def tool_start(
        self,
        session_id: str,
        *,
        tool: str | None = None,
        expected_s: float | None = None,
        policy: str | None = None,
    ) -> dict[str, object]:
        """The HTTP tool_start. ``tool`` (the tool's name) and ``expected_s`` (the client's own
        estimate) are optional hints the policy learns from and uses; with ``policy="offload"``
        every call offloads. ``policy`` overrides the configured policy for this call (one server
        can serve agents of both policies, e.g. to compare them interleaved on one load)."""
        if policy is not None and policy not in POLICIES:
            raise BadRequest(f"policy must be one of {', '.join(POLICIES)}, not {policy!r}")
        policy = policy or self.config.policy
        if tool is not None and (not isinstance(tool, str) or not tool or len(tool) > 256):
            raise BadRequest("tool must be a non-empty string of at most 256 characters")
        if expected_s is not None and (
            isinstance(expected_s, bool)
            or not isinstance(expected_s, (int, float))
            or not 0 <= expected_s < float("inf")
        ):
            raise BadRequest("expected_s must be a finite number of seconds >= 0")
        if policy == "offload":
            rec = self._get(session_id)
            hint = None if expected_s is None else float(expected_s)
            expected = hint if hint is not None else self.durations.median(tool)
            # a full host demotes offloaded sessions predicted back after this one, not a 507
            self.offload(session_id, demote=True, returns_at=self.now + expected)
            self._note_call(rec, tool, Decision("offload", "policy_offload", expected, 0.0, None))
            return self._meta(rec)  # with the decision and its reason, as the per-call policy answers
        rec = self._get(session_id)
        if rec.state != "Running":
            raise WrongState(
                f"tool_start needs a Running session; {session_id!r} is {rec.state}", state=rec.state
            )
        node = self._live_node(rec)
        if node is None:
            return self._meta(self._let_go(rec, tool, self._decision("let_go", "no_kv", expected_s)))
        rec.node, rec.tree_gen = node, self.tree_gen
        hint = None if expected_s is None else float(expected_s)
        kv_tokens = sum(len(m.key) for m in path_to(self.tree, node))
        need_fn = getattr(self.backend, "host_need", None)
        host_need = int(need_fn(node)) if need_fn is not None else kv_tokens
        d = decide(
            kv_tokens=kv_tokens,
            tool=tool,
            expected_s=hint,
            pressure=self._pressure(session_id, tool, hint, host_need),
            model=self.durations,
            config=self.config.policy_config,
            restore_tokens_per_s=self.restore_rate,
            host_need_tokens=host_need,
        )
        back = self.now + (hint if hint is not None else self.durations.median(tool))
        if d.action == "keep" and self.backend.keep(rec, node):
            self._kept(rec, tool, d)
            return self._meta(rec)
        if d.action in ("keep", "offload"):  # keep: the path is not all resident; offload it instead
            try:
                self.offload(session_id, demote=True, returns_at=back)
            except HostMemoryFull:
                return self._meta(self._let_go(rec, tool, self._decision("let_go", "host_full", expected_s)))
            reason = d.reason if d.action == "offload" else "not_resident"
            self._note_call(
                rec, tool, Decision("offload", reason, d.expected_s, d.restore_s, d.prefetch_after_s)
            )
            return self._meta(rec)
        return self._meta(self._let_go(rec, tool, d))

    def _pressure(self, session_id: str, tool: str | None, hint: float | None, kv_tokens: int) -> Pressure:
        """The backend's pressure, with the host room that demotions could make counted as room:
        the protected tokens of offloaded sessions predicted back later than this call would be
        (they are worth less on the host than this one). ``decide`` only asks whether the host can
        take ``kv_tokens`` (what the offload would add), so the scan over sessions runs only when
        it cannot already."""
        p = self.backend.pressure()
        if p.device_spare_tokens is not None:
            p = replace(p, device_spare_tokens=max(0, p.device_spare_tokens - int(self.queued_demand())))
        if p.host_available_tokens >= kv_tokens:
            return p
        back = self.now + (hint if hint is not None else self.durations.median(tool))
        demotable = sum(
            r.offload_tokens
            for r in self.sessions.values()
            if r.state == "Offloaded"
            and not r.l3  # a copy in L3 holds no host protection (or is already on its way there)
            and r.session_id != session_id
            and self._predicted_end(r) > back
        )
        if not demotable:
            return p
        return replace(p, host_available_tokens=min(p.host_total_tokens, p.host_available_tokens + demotable))

    def _decision(self, action: str, reason: str, expected_s: float | None) -> Decision:
        return Decision(action, reason, float(expected_s or 0.0), 0.0, None)  # type: ignore[arg-type]

    def _note_call(self, rec: SessionRecord, tool: str | None, d: Decision | None) -> None:
        """Remember the tool call (for the duration model at tool_end) and the decision taken."""
        rec.tool, rec.tool_started_at, rec.call_open = tool, self.now, True
        action = d.action if d is not None else "offload"
        rec.decision, rec.reason = action, (d.reason if d is not None else "policy_offload")
        rec.expected_s = d.expected_s if d is not None else 0.0
        self.counters[f"decision_{action}"] += 1
        self.counters[f"reason_{rec.reason}"] += 1
        self._touch(rec)
        if (
            d is not None
            and d.prefetch_after_s is not None
            and self.config.prefetch
            and rec.state in ("Offloading", "Offloaded")
        ):
            rec.prefetch_at = self.now + d.prefetch_after_s
            self._seq += 1
            heapq.heappush(self._prefetch_due, (rec.prefetch_at, self._seq, rec.session_id))
        log.debug(
            "tool_start %s tool=%s decision=%s reason=%s expected=%.2fs",
            rec.session_id,
            tool,
            rec.decision,
            rec.reason,
            rec.expected_s,
        )

    # ---- Keep -----------------------------------------------------------------------------------------
    def keep(self, session_id: str) -> dict[str, object]:
        """Spec ``Keep``: pin the session's resident path on the GPU until tool_end or the TTL."""
        rec = self._get(session_id)
        if rec.state != "Running":
            raise WrongState(f"keep needs a Running session; {session_id!r} is {rec.state}", state=rec.state)
        node = self._live_node(rec)
        if node is None or not self.backend.keep(rec, node):
            raise WrongState(f"session {session_id!r} has no resident KV to keep", state=rec.state)
        rec.node, rec.tree_gen = node, self.tree_gen
        self._kept(rec, None, None)
        return self._meta(rec)

    def _kept(self, rec: SessionRecord, tool: str | None, d: Decision | None) -> None:
        rec.epoch += 1
        # A pin holds device memory nobody else can use: bounded by the shorter keep TTL (a client
        # that crashed mid-call must not pin the GPU for the full TTL). Spec Keep arms KeepTTL,
        # whether the policy chose it or a client asked for it (kv_hints' retain).
        self._arm_deadline(rec, self._keep_ttl())
        fire(rec, "keep", "Kept")
        self.counters["kept"] += 1
        if d is not None:
            self._note_call(rec, tool, d)

    # ---- LetGo ----------------------------------------------------------------------------------------
    def let_go(self, session_id: str) -> dict[str, object]:
        """Spec ``LetGo``: hold nothing for this tool call; it still gets an epoch for tool_end."""
        rec = self._get(session_id)
        if rec.state != "Running":
            raise WrongState(
                f"let_go needs a Running session; {session_id!r} is {rec.state}", state=rec.state
            )
        return self._meta(self._let_go(rec, None, None))

    def _let_go(self, rec: SessionRecord, tool: str | None, d: Decision | None) -> SessionRecord:
        rec.epoch += 1
        fire(rec, "let_go", "Released")
        self.counters["let_go"] += 1
        if d is not None:
            self._note_call(rec, tool, d)
        return rec

    # ---- Demote ---------------------------------------------------------------------------------------
    def demote(self, session_id: str) -> dict[str, object]:
        """Spec ``Demote``: release an offloaded session's host protection. HiCache may then evict
        its host copy; the next turn recomputes what is gone, never reads it as protected."""
        rec = self._get(session_id)
        if rec.state != "Offloaded":
            raise WrongState(
                f"demote needs an Offloaded session; {session_id!r} is {rec.state}", state=rec.state
            )
        self._demote_release(rec)
        self._settle(rec)
        fire(rec, "demote", "Released")
        self.counters["demoted"] += 1
        log.debug("session %s demoted (host budget)", session_id)
        return self._meta(rec)

    def _demote_release(self, rec: SessionRecord) -> None:
        """What a demotion gives back: the session's host protection (it holds no pin)."""
        self.backend.release(rec)

    # ---- Store (spec/storage/StorageTier.tla) -----------------------------------------------------------
    def store(self, session_id: str) -> dict[str, object]:
        """Spec ``Store`` of the storage tier on its own: write an ``Offloaded`` session's protected
        host copy to L3; the host copy stays protected until a whole ``StoreAck``, which the tick
        takes. It is what the host-room rule does to a victim (``_yield_host``), callable as
        ``demote`` is, so that the storage-tier conformance replay and fuzz campaign can take the
        spec's ``Store`` step through the manager. Refused (``WrongState``) unless the session is
        ``Offloaded`` on its host copy and a storage tier is on; a backend that cannot store it now
        (a host write in flight, no page hashes, a backend that evicts on its own) changes nothing
        (``l3_store_refused``)."""
        rec = self._get(session_id)
        if rec.state != "Offloaded" or rec.l3 or not self._storage_on():
            raise WrongState(
                f"store needs an Offloaded session on its host copy and a storage tier; {session_id!r} is "
                f"{rec.state}" + (f" ({rec.l3})" if rec.l3 else ""),
                state=rec.state,
            )
        self._store(rec)
        return self._meta(rec)

    def _demotion_candidates(self, but: str, returns_at: float = float("inf")) -> list[str]:
        """Offloaded sessions predicted back after ``returns_at`` (when the session that needs the
        room is), the one predicted back last first (policy.demotion_order): an optimal cache
        drops the KV whose next use is furthest, and never the one about to be used. Only
        ``Offloaded`` sessions: one with a copy in flight is never demoted."""
        cands = []
        for r in self.sessions.values():
            if r.state != "Offloaded" or r.l3 or r.session_id == but:
                continue
            end = self._predicted_end(r)
            if end > returns_at:
                cands.append((r.session_id, r.tool_started_at, end, r.offload_tokens))
        return demotion_order(cands, self.now)

    def _predicted_end(self, rec: SessionRecord) -> float:
        """When the session's tool call is predicted to return, given how long it has run: its
        tool's median conditioned on having lasted this long (a heavy-tailed call far past its
        median is likely a long one), from the client's hint when it gave one."""
        hinted = rec.reason.endswith("_hint")
        return rec.tool_started_at + self.durations.residual_median(
            rec.tool, self.now - rec.tool_started_at, rec.expected_s if hinted else None
        )

    # ---- Prefetch ---------------------------------------------------------------------------------------
    def prefetch(self, session_id: str) -> dict[str, object]:
        """Spec ``Prefetch``: start the restore of an offloaded session before its tool_end, so
        that the KV is on the GPU when the tool returns. The session keeps its protection until
        the load is acknowledged, then it is Kept (pinned) until tool_end or the TTL. Raises
        ``DeviceMemoryFull`` (nothing changed) when the device cannot take it now."""
        rec = self._get(session_id)
        if rec.state != "Offloaded":
            raise WrongState(
                f"prefetch needs an Offloaded session; {session_id!r} is {rec.state}", state=rec.state
            )
        if rec.l3 and self._l3_prefetch(rec):
            return self._meta(rec)
        runnable = self.backend.restore(rec)  # raises DeviceMemoryFull before changing anything
        rec.prefetch_at = float("inf")
        if runnable:  # nothing to load: the path is resident; pin it (the pin backend's offload pin is it)
            kept = rec.pinned is not None or (rec.node is not None and self.backend.keep(rec, rec.node))
            assert kept, "a restored path must be resident"
            fire(rec, "prefetch", "Kept")
            self._arm_warm(rec)
        elif self._prefetch_readable(rec):  # never, with a load in flight (restore pinned the path)
            self.backend.release_protection(rec)
            fire(rec, "prefetch", "Kept")
            self._arm_warm(rec)
        else:
            fire(rec, "prefetch", "Prefetching")
            self._prefetching[session_id] = rec
            rec.restore_started_at = self.now
        self.counters["prefetched"] += 1
        return self._meta(rec)

    def run_prefetches(self) -> int:
        """Start the early restores that are due (policy ``auto``). A device that cannot take one
        now defers it to a later tick; a suffix sglang would not load is left to tool_end."""
        heap, n = self._prefetch_due, 0
        while heap and heap[0][0] <= self.now:
            when, _seq, sid = heapq.heappop(heap)
            rec = self.sessions.get(sid)
            if rec is None or rec.prefetch_at != when or rec.state not in ("Offloading", "Offloaded"):
                continue
            if rec.l3 == "fetching" or rec.l3_then:  # being read back from L3 already
                continue
            if rec.state == "Offloading":  # its writes are still in flight: look again shortly
                rec.prefetch_at = self.now + 0.05
                self._seq += 1
                heapq.heappush(heap, (rec.prefetch_at, self._seq, sid))
                break
            if not rec.l3 and not self.backend.worth_prefetching(rec):
                continue
            try:
                if not self._spare_for(rec):
                    # An early restore makes room by evicting other sessions' cache for a session
                    # that is not back yet: only into spare room (under load it cost more than it
                    # saved); otherwise its tool_end restores it.
                    raise DeviceMemoryFull("no spare device room for an early restore")
                self.prefetch(sid)
                n += 1
            except DeviceMemoryFull:
                self.counters["prefetch_deferred"] += 1
                rec.prefetch_at = self.now + 0.25
                self._seq += 1
                heapq.heappush(heap, (rec.prefetch_at, self._seq, sid))
                break  # the device is full for the others too; try again later
        return n

    def _spare_for(self, rec: SessionRecord) -> bool:
        """Whether the device has spare room (free after promised and queued tokens, as the keep
        rule counts it) for the session's KV. Backends without the notion always have room."""
        p = self.backend.pressure()
        if p.device_spare_tokens is None:
            return True
        spare = p.device_spare_tokens - int(self.queued_demand())
        return spare - rec.offload_tokens >= self.config.policy_config.device_reserve * p.device_total_tokens

    # ---- ToolStart ------------------------------------------------------------------------------------
    def offload(
        self, session_id: str, *, demote: bool = False, returns_at: float = float("inf")
    ) -> dict[str, object]:
        """Spec ``ToolStart``: offload the session's KV to the host. With ``demote``, a host that
        is full (pool or budget) demotes offloaded sessions predicted back after ``returns_at``,
        the latest first, until it fits (their copies become evictable: spec ``Demote`` then
        ``HostRoom``); a 507 only when none can yield."""
        rec = self._get(session_id)
        if rec.state != "Running":
            raise WrongState(
                f"tool_start needs a Running session; {session_id!r} is {rec.state}", state=rec.state
            )
        node = self._live_node(rec)
        if node is None:
            had = rec.node is not None
            rec.node = None
            self.counters["kv_lost"] += 1
            raise SessionKVLost(
                f"session {session_id!r} has no KV in the cache" + (" any more" if had else " yet"),
                session_id=session_id,
            )
        rec.node, rec.tree_gen = node, self.tree_gen
        while True:
            try:
                clean = self.backend.offload(rec, node)  # raises HostMemoryFull before changing anything
                break
            except HostMemoryFull:
                victims = self._demotion_candidates(session_id, returns_at) if demote else []
                if not victims:
                    raise
                self._yield_host(victims[0])
        rec.epoch += 1
        self._arm_deadline(rec)
        if self._free_at_tool_start(clean):
            self.backend.free_gpu([rec])
            fire(rec, "tool_start", "Offloaded")
        else:
            fire(rec, "tool_start", "Offloading")
            self._offloading[session_id] = rec
        self.counters["tool_start"] += 1
        self.counters["offloaded_tokens"] += rec.offload_tokens
        log.debug(
            "tool_start %s epoch=%d state=%s tokens=%d", session_id, rec.epoch, rec.state, rec.offload_tokens
        )
        return self._meta(rec)

    def _free_at_tool_start(self, clean: bool) -> bool:
        """Whether ``tool_start`` frees the GPU copies itself: only when no write on the path is
        in flight (caveat 7: a GPU copy is freed only after its write is acknowledged; otherwise
        ``process_write_acks`` frees it once sglang has retired the ack)."""
        return clean

    # ---- the L3 storage tier (spec/storage/StorageTier.tla) ---------------------------------------------
    # An Offloaded session's copy can go down to sglang's storage backend (--hicache-storage-backend)
    # instead of being dropped when the host must make room. The session stays ``Offloaded`` (the
    # main model's phase: a protected copy below the GPU, left by tool_end, the TTL, close or a
    # tree reset) and ``rec.l3`` says where that copy is: "storing" (spec Store: the host copy is
    # still protected), "stored" (StoreAck whole: host protection released, the copy protected in
    # L3), "fetching" (StoragePrefetch: the copy pinned by sglang's prefetch). Every answer read
    # off an asynchronous event is agreed across TP ranks inside the backend (``store_ack`` and
    # ``prefetch_ack`` read sglang's lockstep queues, drained with an all-reduce MIN, and agree on
    # what they find), and the calls run in the same order on every rank.
    def _storage_on(self) -> bool:
        enabled = getattr(self.backend, "storage_enabled", None)
        return bool(self.config.l3 and enabled is not None and enabled())

    def _yield_host(self, session_id: str) -> None:
        """Make host room with one victim: with a storage tier, Store its host copy to L3 (the host
        copy goes only after the StoreAck; if sglang holds every page already the ack comes at
        once); else, or if the backend refuses or cuts the write short, ``demote`` (drop) it."""
        rec = self.sessions[session_id]
        if self._storage_on() and self._store(rec) and rec.l3:
            return
        self.demote(session_id)

    def _store(self, rec: SessionRecord) -> bool:
        """Spec ``Store`` (then ``StoreAck`` at once if nothing is in flight). False: refused,
        nothing changed."""
        if not self.backend.store(rec):  # type: ignore[attr-defined]
            self.counters["l3_store_refused"] += 1
            return False
        rec.l3 = "storing"
        self._storing[rec.session_id] = rec
        self.counters["l3_store"] += 1
        self._store_ack(rec)
        return True

    def _store_ack(self, rec: SessionRecord) -> bool | None:
        """Spec ``StoreAck``: whole → the copy lives in L3 (``stored``); short → the session stays
        on its protected host copy (never restored from an incomplete write). None: in flight."""
        got: bool | None = self.backend.store_ack(rec)  # type: ignore[attr-defined]
        if got is None:
            return None
        del self._storing[rec.session_id]
        if got:
            rec.l3 = "stored"
            self.counters["demoted_l3"] += 1
            self.counters["l3_stored_tokens"] += rec.offload_tokens
            if rec.prefetch_at != float("inf"):  # the early restore now reads L3 first: start sooner
                lead = rec.offload_tokens / self.config.l3_read_tokens_per_s
                rec.prefetch_at = max(self.now, rec.prefetch_at - lead)
                self._seq += 1
                heapq.heappush(self._prefetch_due, (rec.prefetch_at, self._seq, rec.session_id))
            log.debug("session %s demoted to L3", rec.session_id)
        else:
            rec.l3 = ""
            self.counters["l3_store_short"] += 1
        return got

    def _fetch(self, rec: SessionRecord, then: str) -> str:
        """Spec ``ToolEnd`` of a stored session (``then`` = "tool_end") or an early restore of one
        ("prefetch"): ``storage_prefetch``. "host": the host copy was still there and is protected
        again (the caller restores from it); "prefetching": sglang reads it into the host pool,
        :meth:`process_storage_acks` goes on at its ack; "refused": retried at the next tick."""
        self._seq += 1
        rid = f"toolkv-l3:{rec.session_id}:{rec.epoch}:{self._seq}"  # the same on every rank
        got: str = self.backend.storage_prefetch(rec, rid)  # type: ignore[attr-defined]
        rec.l3_then = then
        rec.prefetch_at = float("inf")  # the read is the early restore, or tool_end came first
        if got == "host":
            rec.l3 = rec.l3_then = ""
            self._fetching.pop(rec.session_id, None)
            self.counters["l3_from_host"] += 1
            return got
        self._fetching[rec.session_id] = rec  # "refused" stays "stored": retried by the tick
        if got == "prefetching":
            rec.l3 = "fetching"
            rec.restore_started_at = self.now
            self.counters["l3_prefetch"] += 1
        else:
            self.counters["l3_prefetch_refused"] += 1
        return got

    def _tool_end_l3(self, rec: SessionRecord) -> bool:
        """tool_end of a session with an L3 copy. True: handled here (the restore goes on at the
        prefetch's ack); False: the host copy is protected, restore from it as usual."""
        if rec.l3 == "storing" and self._store_left_for_host(rec):  # ToolEndFromHost
            return False
        if rec.l3_then == "tool_end":  # this call's tool_end was accepted already
            raise WrongState(
                f"tool_end already accepted; {rec.session_id!r} is being restored from L3", state=rec.state
            )
        if rec.l3 == "fetching":  # an early restore from L3 is reading: it becomes the restore
            rec.l3_then = "tool_end"
        elif self._fetch(rec, "tool_end") == "host":
            return False
        self._observe_call(rec)
        self.counters["tool_end"] += 1
        self.counters["tool_end_l3"] += 1
        return True

    def _l3_prefetch(self, rec: SessionRecord) -> bool:
        """The early restore (spec ``Prefetch``) of a session with an L3 copy. True: handled here
        (a storage prefetch, then the host→GPU prefetch at its ack)."""
        if rec.l3 == "storing" and self._store_left_for_host(rec):  # prefetch from the host copy
            return False
        if rec.l3 == "fetching" or rec.l3_then:
            raise WrongState(f"session {rec.session_id!r} is being read from L3 already", state=rec.state)
        return self._fetch(rec, "prefetch") != "host"

    def _store_left_for_host(self, rec: SessionRecord) -> bool:
        """A session whose store is still in flight is read back from its host copy, which is whole
        and still protected, and the store is let go (spec ``ToolEndFromHost`` from ``Storing``):
        never from a storage copy whose write is not acknowledged whole (``RestoreSourceWhole``;
        mutant ``RestoreBeforeStoreAck`` reads it). True: restore from the host copy."""
        self.backend.drop_storage(rec)  # type: ignore[attr-defined]
        self._storing.pop(rec.session_id, None)
        rec.l3 = ""
        return True

    def process_storage_acks(self) -> int:
        """Once per tick on every rank: ``StoreAck`` of the stores in flight, ``PrefetchAck`` of the
        prefetches (then the host→GPU restore, or the early restore), and the prefetches of
        released sessions (``poll_storage``: their pins end at their own acks). Returns how many
        acks were taken."""
        n = 0
        for rec in list(self._storing.values()):
            if self._store_ack(rec) is not None:
                n += 1
        for rec in list(self._fetching.values()):
            if rec.l3 == "stored":  # sglang refused the prefetch last time: ask again
                then = rec.l3_then
                if self._fetch(rec, then) == "host":
                    self._after_fetch(rec, then)
                continue
            got = self.backend.prefetch_ack(rec)  # type: ignore[attr-defined]
            if got is None:
                continue
            n += 1
            then = rec.l3_then
            del self._fetching[rec.session_id]
            rec.l3 = rec.l3_then = ""
            if got:
                self.counters["l3_restored"] += 1
            else:  # a page was missing: restore what came back, the next turn recomputes the rest
                self.counters["l3_prefetch_short"] += 1
                if not self.backend.protect_host_prefix(rec):  # type: ignore[attr-defined]
                    self._nothing_came_back(rec, then)
                    continue
            self._after_fetch(rec, then)
        assert self._poll_storage is not None
        n += self._poll_storage()
        return n

    def _after_fetch(self, rec: SessionRecord, then: str) -> None:
        """The session's copy is on host again, protected: restore it to the GPU (tool_end), or
        start the early restore (prefetch). A device that cannot take it leaves the session
        Offloaded on its protected host copy: the early restore is tried again later; the
        tool_end's restore is left to sglang's own load-back of the next request or the TTL."""
        whole = rec.offload_tokens
        try:
            if then == "tool_end":
                self._restore_from_host(rec)
                if rec.restore:
                    rec.recompute_tokens = max(rec.recompute_tokens, whole - self._path_tokens(rec))
            else:
                self.prefetch(rec.session_id)
        except DeviceMemoryFull:
            rec.admit_pending = False  # nothing to hand over: the request runs on what sglang has
            if then != "tool_end":
                self.counters["prefetch_deferred"] += 1
                rec.prefetch_at = self.now + 0.25
                self._seq += 1
                heapq.heappush(self._prefetch_due, (rec.prefetch_at, self._seq, rec.session_id))

    def _path_tokens(self, rec: SessionRecord) -> int:
        return sum(len(m.key) for m in path_to(self.tree, rec.node)) if rec.node is not None else 0

    def _nothing_came_back(self, rec: SessionRecord, then: str) -> None:
        """A prefetch that read no page: nothing is held; the next turn recomputes it all."""
        self.backend.release(rec)
        self._settle(rec)
        rec.admit_pending = False
        fire(rec, "demote", "Released")
        if then == "tool_end":
            fire(rec, "tool_end", "Running")
        rec.recompute_tokens, rec.restored_tokens, rec.restore = rec.offload_tokens, 0, "recompute"

    # ---- WriteAck -------------------------------------------------------------------------------------
    def process_write_acks(self) -> int:
        """Finish every offload whose path writes are all acknowledged; returns how many."""
        if not self._offloading:
            return 0
        done = [r for r in self._offloading.values() if not self.backend.offload_pending(r)]
        if not done:
            return 0
        self.backend.free_gpu(done)
        for rec in done:
            del self._offloading[rec.session_id]
            fire(rec, "write_ack", "Offloaded")
            self.counters["freed_tokens"] += rec.freed_tokens
        return len(done)

    # ---- ToolEnd --------------------------------------------------------------------------------------
    def tool_end(self, session_id: str, epoch: int) -> dict[str, object]:
        rec = self._get(session_id)
        if isinstance(epoch, bool) or not isinstance(epoch, int):
            raise BadRequest("epoch must be an integer")
        if not self._epoch_matches(rec, epoch):
            self.counters["stale_epoch"] += 1
            raise StaleEpoch(
                f"epoch {epoch} is stale for session {session_id!r} (current {rec.epoch})",
                current_epoch=rec.epoch,
            )
        if rec.state == "Kept":  # the pin stays until the next request holds the path
            self._settle(rec)
            self._hand_over(rec, "tool_end")
            self._observe_call(rec)
            self.counters["tool_end"] += 1
            return self._meta(rec)
        if rec.state == "Prefetching":  # the early restore becomes the restore
            del self._prefetching[session_id]
            self._restoring[session_id] = rec
            fire(rec, "tool_end", "Restoring")
            self._observe_call(rec)
            self.counters["tool_end"] += 1
            return self._meta(rec)
        if rec.state == "Released":  # nothing was held: the next turn recomputes what is missing
            fire(rec, "tool_end", "Running")
            self._observe_call(rec)
            self.counters["tool_end"] += 1
            return self._meta(rec)
        if rec.state not in ("Offloading", "Offloaded"):
            return self._tool_end_not_offloaded(rec)
        if rec.l3 and self._tool_end_l3(rec):
            return self._meta(rec)
        self._restore_from_host(rec)
        self._observe_call(rec)
        self.counters["tool_end"] += 1
        return self._meta(rec)

    def _restore_from_host(self, rec: SessionRecord) -> None:
        """Spec ``ToolEnd`` from a protected host copy: the host→GPU load, or the hand-over at once
        when nothing is to load. When the device cannot take it now, spec ``Park`` (with
        ``adaptive``): the host copy stays protected and the next request's admission loads it;
        without ``adaptive``, ``DeviceMemoryFull`` (nothing changed)."""
        session_id = rec.session_id
        try:
            self._check_pin_room(rec, queued=self.config.adaptive)
            runnable = self.backend.restore(rec)  # raises DeviceMemoryFull before changing anything
        except DeviceMemoryFull:
            if self.config.adaptive and self._parks():
                self._park(rec)
                return
            self._restore_refused(rec)
            raise
        self._offloading.pop(session_id, None)
        if runnable:  # nothing to load: pin what is resident until the next request holds it
            self._settle(rec)
            self._pin_for_handover(rec)
            self._hand_over(rec, "tool_end")
        else:
            fire(rec, "tool_end", "Restoring")
            self._restoring[session_id] = rec
            rec.restore_started_at = self.now
        self.counters["restored_tokens"] += rec.restored_tokens
        if rec.recompute_tokens:  # nothing worth loading: the next request recomputes the suffix
            self.counters["restore_below_threshold"] += 1
        log.debug("tool_end %s epoch=%d state=%s", session_id, rec.epoch, rec.state)

    # ---- Park (load-adaptive protection) ----------------------------------------------------------------
    def park(self, session_id: str, epoch: int) -> dict[str, object]:
        """Spec ``Park`` as an explicit call: the tool call of ``epoch`` is over and the session's
        KV stays protected on host until its next request is admitted. :meth:`tool_end` parks on
        its own when the device cannot take the restore next to the queued requests; the
        conformance replay takes the spec's step with this call. Refused (nothing changed) for a
        stale epoch or a session that is not ``Offloading``/``Offloaded`` on its host copy."""
        rec = self._get(session_id)
        if isinstance(epoch, bool) or not isinstance(epoch, int):
            raise BadRequest("epoch must be an integer")
        if not self._epoch_matches(rec, epoch):
            raise StaleEpoch(
                f"epoch {epoch} is stale for session {session_id!r} (current {rec.epoch})",
                current_epoch=rec.epoch,
            )
        if rec.state not in ("Offloading", "Offloaded") or rec.l3 or not self._parks():
            raise WrongState(
                f"park needs an offloaded session on a backend with a host tier; {session_id!r} is {rec.state}",
                state=rec.state,
            )
        self._park(rec)
        self._observe_call(rec)
        self.counters["tool_end"] += 1
        return self._meta(rec)

    def _parks(self) -> bool:
        """Whether the backend can leave a restore to sglang's own load-back: only on HiCache, whose
        host copy lives in the tree (a plain RadixCache's pin or shadow copy has none to load)."""
        return bool(getattr(self.backend, "parks", False))

    def _park(self, rec: SessionRecord) -> None:
        """Spec ``Park``: the tool call is over but its next request would wait behind others (the
        device cannot take the restore's pin next to what running and queued requests need).
        Loading now would hold device room for a request that is not running; so nothing is
        loaded or pinned: the host copy stays protected (a write still in flight finishes, and
        frees nothing), and sglang's own ``load_back`` brings the KV in when the request is
        admitted (spec ``Admit`` of a parked session), which ends the protection. The TTL bounds
        a request that never comes."""
        self._offloading.pop(rec.session_id, None)  # its write ack frees nothing: the request is coming
        fire(rec, "park", "Parked")
        self._arm_deadline(rec)
        rec.restore, rec.restored_tokens, rec.recompute_tokens = "parked", 0, 0
        self.counters["parked"] += 1
        log.debug(
            "tool_end %s epoch=%d parked (device room is needed by queued requests)",
            rec.session_id,
            rec.epoch,
        )

    def _observe_call(self, rec: SessionRecord) -> None:
        """The tool call is over (tool_end accepted): feed its duration (agreed clock) to the
        duration model."""
        self._touch(rec)
        if rec.call_open:
            self.durations.observe(rec.tool, self.now - rec.tool_started_at)
            rec.call_open = False

    def _epoch_matches(self, rec: SessionRecord, epoch: int) -> bool:
        """Spec ``ToolEnd``'s guard ``e = epoch[s]``: a tool_end of an older tool call is refused
        and changes nothing (``StaleEpochNoop``)."""
        return epoch == rec.epoch

    def _tool_end_not_offloaded(self, rec: SessionRecord) -> dict[str, object]:
        """A current-epoch tool_end for a session that is not offloaded (already restoring, or
        never offloaded): refused, so no node is ever loaded twice (caveat 2). Always raises."""
        raise WrongState(
            f"tool_end needs an offloaded session; {rec.session_id!r} is {rec.state}", state=rec.state
        )

    def _restore_refused(self, rec: SessionRecord) -> None:
        """The backend refused the restore before changing anything: the session stays offloaded
        and protected (caveat 1: its host protection is kept, for a retry or the TTL to release)."""
        self.counters["restore_deferred"] += 1

    # ---- LoadAck --------------------------------------------------------------------------------------
    def process_load_acks(self) -> int:
        """Forget acknowledged loads; every restoring session whose path is now readable becomes
        Runnable (its pin and protection are released)."""
        if not self._restoring and not self._prefetching and not self.backend.loads_in_flight():
            return 0
        self.backend.poll_loads()
        done = [r for r in self._restoring.values() if not self.backend.restore_pending(r)]
        warm = [r for r in self._prefetching.values() if self._prefetch_readable(r)]
        for rec in done:  # readable: the load's pin stays as the hand-over's, the protection goes
            self.backend.release_protection(rec)
            self._settle(rec)
            self._hand_over(rec, "load_ack")
            self._measured_restore(rec)
        for rec in warm:  # an early restore is readable: Kept (pinned) until its tool_end
            self.backend.release_protection(rec)
            del self._prefetching[rec.session_id]
            fire(rec, "load_ack", "Kept")
            self._measured_restore(rec)
            self._arm_warm(rec)
        return len(done) + len(warm)

    def _keep_ttl(self) -> float:
        return min(self.config.ttl_s, self.config.keep_ttl_s)

    def _arm_warm(self, rec: SessionRecord) -> None:
        """An early restore became ``Kept``: its pin waits for tool_end at most the keep TTL, as a
        kept session's does, and never past the offload's own deadline (spec ``WarmDeadline``)."""
        self._arm_deadline(rec, min(self._keep_ttl(), max(0.0, rec.deadline - self.now)))

    def _prefetch_readable(self, rec: SessionRecord) -> bool:
        """An early restore is done when no load into the session's path is in flight (caveat 7's
        read side: never Kept, i.e. served, before the load is acknowledged)."""
        return not self.backend.restore_pending(rec)

    def _measured_restore(self, rec: SessionRecord) -> None:
        """Fold a finished load into the restore rate the policy assumes (EWMA, agreed clock)."""
        took = self.now - rec.restore_started_at
        if rec.restored_tokens > 0 and took > 0:
            self.restore_rate = 0.8 * self.restore_rate + 0.2 * (rec.restored_tokens / took)

    # ---- the hand-over (spec Handover, Admit) ----------------------------------------------------------
    def _check_pin_room(self, rec: SessionRecord, *, queued: bool = False) -> None:
        """The hand-over pins the session's whole path, which takes its resident part out of
        what sglang may evict. sglang has promised running requests device tokens it counts on
        finding free or evictable (the rest of a chunked prefill over-commits otherwise, and the
        allocation fails with "Out of memory"): refuse the restore (``DeviceMemoryFull``, nothing
        changed; sglang's own load-back serves the next request) unless free + evictable, less
        what was promised, still covers what the pin takes: the path's unlocked resident tokens
        and the ones still to load (``pin_cost``). With ``queued``, the tokens the waiting
        requests need count as promised too: a pin taken while they queue takes their room.
        Agreed across ranks."""
        cost = getattr(self.backend, "pin_cost", None)
        if cost is None or rec.node is None:
            return
        tree: Any = self.backend.tree
        need = int(cost(rec.node))
        free = int(tree.token_to_kv_pool_allocator.available_size())
        evictable = int(tree.evictable_size())
        reserved = int(getattr(self.backend, "headroom", lambda: 0)())
        if queued:
            reserved += int(self.queued_demand())
        if not self.agree.all_true(need + reserved <= free + evictable):
            raise device_full(rec, need, free, evictable, reserved)

    def _room_short(self) -> bool:
        """Whether the device is short for what running and queued requests need: free and
        evictable tokens less than the promised and queued ones. Agreed across ranks."""
        tree: Any = self.backend.tree
        free = int(tree.token_to_kv_pool_allocator.available_size())
        evictable = int(tree.evictable_size())
        reserved = int(getattr(self.backend, "headroom", lambda: 0)()) + int(self.queued_demand())
        return self.agree.all_true(reserved > free + evictable)

    def unpin_for_room(self) -> int:
        """Spec ``Unpin``, once per tick while hand-overs wait: when queued requests need the room
        that hand-over pins hold, give the pins up, the latest hand-over first, until the room is
        there or none is left. A session whose path is backed up on host is protected there
        again (``Parked``: its admission loads whatever sglang evicted meanwhile); one that is
        not (a kept path never written) is ``Runnable``. Returns how many pins went."""
        if not self._handover or not self.config.adaptive or not self._parks():
            return 0
        n = 0
        for rec in reversed(list(self._handover.values())):
            if not self._room_short():
                break
            self._unpin(rec)
            n += 1
        return n

    def unpin(self, session_id: str) -> dict[str, object]:
        """Spec ``Unpin`` of one hand-over, as an explicit call (the conformance replay takes the
        spec's step with it; the tick's :meth:`unpin_for_room` decides when on a server)."""
        rec = self._get(session_id)
        if rec.state != "Handover":
            raise WrongState(
                f"unpin needs a Handover session; {session_id!r} is {rec.state}", state=rec.state
            )
        self._unpin(rec)
        return self._meta(rec)

    def _unpin(self, rec: SessionRecord) -> None:
        assert rec.state == "Handover", rec.state
        self.backend.unpin(rec)
        self._handover.pop(rec.session_id, None)
        reprotect = getattr(self.backend, "reprotect", None)
        if reprotect is not None and reprotect(rec):
            fire(rec, "unpin", "Parked")
            self._arm_deadline(rec)
            self.counters["unpinned_parked"] += 1
        else:
            fire(rec, "unpin", "Runnable")
            self.counters["unpinned_runnable"] += 1

    def _pin_for_handover(self, rec: SessionRecord) -> None:
        """A restore that needed no load returned the protection and holds no pin yet: pin the
        resident path (the recorded node, possibly the device prefix left below sglang's
        ``load_back_threshold``) so that it survives until the next request holds it."""
        if rec.node is not None and rec.pinned is None and not self.backend.keep(rec, rec.node):
            # never with a correct backend (the restore found the path resident); a backend that
            # says so with a load in flight (mutant EarlyRunnable) is caught by HandoverResident
            log.error("session %s: the restored path is not resident; handed over unpinned", rec.session_id)

    def _hand_over(self, rec: SessionRecord, trigger: str) -> None:
        """The tool call is over and the KV is on the GPU, pinned (spec ``Handover``): armed with
        the hand-over TTL. A request already admitted while the load ran ends it at once."""
        fire(rec, trigger, "Handover")
        self._handover[rec.session_id] = rec
        self._arm_deadline(rec, min(self.config.ttl_s, self.config.handover_ttl_s))
        self.counters["handover"] += 1
        if rec.admit_pending:
            self._admit(rec)

    def admitted(self, session_id: str) -> bool:
        """Spec ``Admit``: the session's next request was admitted: sglang matched its prefix and
        locked it (the scheduler calls this after the prefill batch is formed). Its own lock now
        keeps the path on the GPU, so the hand-over's pin goes. A request admitted while the load
        is still in flight (Restoring) ends the hand-over as soon as the load is acknowledged.
        Returns True when a hand-over ended; anything else is a no-op (the request is served
        whatever toolkv holds)."""
        rec = self.sessions.get(session_id)
        if rec is None:
            return False
        if rec.state == "Restoring" or (rec.l3 == "fetching" and rec.l3_then == "tool_end"):
            rec.admit_pending = True
            return False
        if rec.state == "Parked":  # sglang's load_back took the host copy; the request's lock holds it
            self.backend.release_protection(rec)
            self._settle(rec)
            fire(rec, "admit", "Runnable")
            self.counters["admitted_parked"] += 1
            return True
        if rec.state != "Handover":
            return False
        self._admit(rec)
        return True

    def _admit(self, rec: SessionRecord) -> None:
        self.backend.unpin(rec)
        self._handover.pop(rec.session_id, None)
        rec.admit_pending = False
        fire(rec, "admit", "Runnable")
        self.counters["admitted"] += 1

    # ---- TtlSweep -------------------------------------------------------------------------------------
    def ttl_sweep(self) -> int:
        """Release every protection past its deadline. O(1) when none is due, O(k log n) for k."""
        heap, n = self._deadlines, 0
        while heap and heap[0][0] <= self.now:
            _deadline, seq, sid = heapq.heappop(heap)
            rec = self.sessions.get(sid)
            if rec is None or rec.deadline_seq != seq or rec.state not in EXPIRING:
                continue  # lazily deleted entry, or tool_end accepted (Restoring: its load ends it)
            self._expire(rec)
            n += 1
        return n

    def _expire(self, rec: SessionRecord) -> None:
        """Spec ``TtlSweep`` for one session: release what it holds, ``Expired``. The epoch is
        kept (``EpochMonotone``): a tool_end of the expired call must stay stale. A hand-over
        whose request never came is ``Runnable``: its KV stays in the tree, unpinned."""
        self.backend.release(rec)
        self._settle(rec)
        self._touch(rec)  # the idle clock restarts at the expiry: forgotten idle_ttl_s after it
        if rec.state in ("Handover", "Parked"):
            self.counters["handover_expired" if rec.state == "Handover" else "parked_expired"] += 1
            rec.admit_pending = False
            fire(rec, "ttl_sweep", "Runnable")
            return
        fire(rec, "ttl_sweep", "Expired")
        self.counters["expired"] += 1
        log.debug("session %s expired after %.1fs without tool_end", rec.session_id, self.config.ttl_s)

    # ---- Close ----------------------------------------------------------------------------------------
    def close(self, session_id: str) -> dict[str, object]:
        rec = self._get(session_id)
        if rec.state == "Closed":
            raise WrongState(f"session {session_id!r} is already closed", state=rec.state)
        self.backend.release(rec)
        self._settle(rec)
        fire(rec, "close", "Closed")
        # a closed record answers kv_meta and fences old epochs: its token copy goes (the bulk of
        # a record); the node reference stays as the spec's ref does (one object per record)
        rec.tokens, rec.backend_state = array("q"), None
        del self.sessions[session_id]
        self._closed[session_id] = rec
        while len(self._closed) > self.config.closed_history:
            self._closed.popitem(last=False)
        self.counters["closed"] += 1
        return self._meta(rec)

    # ---- TreeReset ------------------------------------------------------------------------------------
    def on_tree_reset(self) -> None:
        """The tree was replaced (flush_cache): every node object is gone, so drop references
        without releasing; offloaded and kept sessions lose their KV.

        sglang flushes only a fully idle scheduler (no write or load pending), but "pending" is
        what its own ack checks left: ``writing_check``/``loading_check`` retire a copy in one
        iteration, and toolkv's tick (the AFTER hook of ``process_input_requests``) sees it in the
        next, after ``check_pending()`` at the end of ``process_input_requests`` may already have
        run a deferred ``/flush_cache?timeout=T``. Such a session has, in the spec, already taken
        its ``WriteAck``/``LoadAck`` step, and ``TreeReset`` (enabled only with ``WriteKeys = {}``
        and no load ack pending) comes after it. So this step is, in spec actions:

        1. ``WriteAck`` for every ``Offloading`` session whose writes sglang retired (→
           ``Offloaded``), ``LoadAck`` for every ``Restoring`` one whose load it retired (→
           ``Handover``, then ``Admit`` → ``Runnable`` when its request was admitted during the
           load) and every ``Prefetching`` one (→ ``Kept``): :meth:`_take_retired_acks`, on the
           records only (the nodes are gone: the GPU copies ``WriteAck`` frees and the pins
           ``LoadAck``/``Admit`` hand over went with the reset, as the spec's ``TreeReset`` clears
           ``dev`` and ``lockRef``);
        2. ``TreeReset``: every session in ``Holding`` becomes ``Lost`` (the KV is gone), the
           others keep their phase (a stale node reference, re-resolved by the next walk).

        A session whose copy sglang had NOT retired would be a reset the spec does not allow
        (only a future sglang could do it): it is closed with an error line instead of taking
        the scheduler down."""
        self._take_retired_acks()
        self.tree_gen += 1
        self.backend.reset()
        mid_copy: list[str] = []
        for rec in self.sessions.values():
            self.backend.forget(rec)
            if rec.state in ("Offloaded", "Kept", "Handover", "Parked"):
                self._settle(rec)
                rec.admit_pending = False
                fire(rec, "tree_reset", "Lost")
                self.counters["lost"] += 1
            elif rec.state in HOLDING:
                mid_copy.append(rec.session_id)
        for sid in mid_copy:
            log.error("tree reset while session %s was %s: closing it", sid, self.sessions[sid].state)
            self.counters["reset_mid_copy"] += 1
            self.close(sid)
        self._offloading.clear()
        self._restoring.clear()
        self._prefetching.clear()
        self._storing.clear()
        self._fetching.clear()

    def _take_retired_acks(self) -> None:
        """Spec ``WriteAck``/``LoadAck`` (and ``Admit``) for the copies sglang retired before a
        reset that no tick has processed yet, read off the old tree's nodes before the backend
        forgets its loads (see :meth:`on_tree_reset`). Nothing here touches a cache: the nodes
        belong to the replaced tree, whose memory the reset already returned. A write counts as
        retired when no path node carries a ``write_through_pending_id`` (both releases clear it
        at the ack and leave it on the old nodes); a load when the backend's own ack processing
        finds none in flight: 0.5.16's reset keeps ``ongoing_load_back``, so an unretired load
        shows; 0.5.23's empties it, so there sglang's own idle check is the only witness."""
        for rec in list(self._offloading.values()):
            if rec.node is not None and not self.backend.offload_pending(rec):
                del self._offloading[rec.session_id]
                fire(rec, "write_ack", "Offloaded")
        if not (self._restoring or self._prefetching):
            return
        self.backend.poll_loads()
        for rec in list(self._restoring.values()):
            if rec.node is not None and not self.backend.restore_pending(rec):
                self._settle(rec)
                fire(rec, "load_ack", "Handover")
                self.counters["handover"] += 1
                if rec.admit_pending:
                    rec.admit_pending = False
                    fire(rec, "admit", "Runnable")
                    self.counters["admitted"] += 1
        for rec in list(self._prefetching.values()):
            if rec.node is None or not self._prefetch_readable(rec):
                continue
            del self._prefetching[rec.session_id]
            fire(rec, "load_ack", "Kept")
            self._arm_warm(rec)

    # ---- Tick -----------------------------------------------------------------------------------------
    def set_clock(self, now: float) -> None:
        if now < self.now:
            raise ValueError(f"the agreed clock went backwards ({now} < {self.now})")
        self.now = now

    def tick(self, now: float) -> None:
        """Once per scheduler iteration, after sglang processed its acks. ``now`` must already be
        agreed across ranks. Idle cost: three emptiness checks."""
        self.set_clock(now)
        if self._offloading:
            self.process_write_acks()
        if self._poll_storage is not None:  # the L3 tier: store and prefetch acks, released prefetches
            self.process_storage_acks()
        if self._prefetch_due and self._prefetch_due[0][0] <= now:
            self.run_prefetches()
        if self._restoring or self._prefetching or self.backend.loads_in_flight():
            # spec StartLoads (only when sglang's load ring is idle), then LoadAck. A load whose
            # session was closed meanwhile still has to run: it holds sglang's locks and slots.
            self.backend.start_loads()
            self.process_load_acks()
        if self._handover:
            self.unpin_for_room()
        if self._deadlines and self._deadlines[0][0] <= now:
            self.ttl_sweep()
        if self._idle and self._idle[0][0] <= now:
            self.forget_idle()

    # ---- kv_meta --------------------------------------------------------------------------------------
    def _meta(self, rec: SessionRecord) -> dict[str, object]:
        out: dict[str, object] = {
            "session_id": rec.session_id,
            "state": rec.state,
            "epoch": rec.epoch,
            "backend": self.backend.name,
            "protected": rec.protected is not None,
            "deadline": rec.deadline if rec.state in EXPIRING else None,
        }
        if rec.state == "Closed":
            out.update(tier="Evicted", tokens=0, device_tokens=0, host_tokens=0)
        else:
            out.update(self.backend.describe(rec))
        if rec.l3:  # an Offloaded session's L3 sub-phase; its tier is l3 once the copy lives there
            out["l3"] = rec.l3
            if rec.l3 != "storing":
                out["tier"] = "l3"
        if rec.reason:  # the per-call policy's last decision
            out.update(
                decision=rec.decision or None, reason=rec.reason, tool=rec.tool, expected_s=rec.expected_s
            )
        if rec.restore:  # what the last accepted tool_end did: loaded, found resident, or left to recompute
            out.update(
                restore=rec.restore,
                restored_tokens=rec.restored_tokens,
                recompute_tokens=rec.recompute_tokens,
            )
        return out

    def kv_meta(self, session_id: str | None = None) -> dict[str, object]:
        if session_id is not None:
            return self._meta(self._get(session_id))
        states = Counter(r.state for r in self.sessions.values())
        return {
            "backend": self.backend.name,
            "sessions": len(self.sessions),
            "states": dict(states),
            "now": self.now,
            "counters": dict(self.counters),
            "policy": self.config.policy,
            "restore_tokens_per_s": self.restore_rate,
            "tools": self.durations.snapshot(),
        }


def make_backend(
    tree: Tree,
    *,
    config: ManagerConfig,
    agree: Agreement,
    fallback: str = "pin",
) -> Backend:
    """Chosen from the tree type: UnifiedRadixCache (sglang 0.5.21+) → host offload with its own
    primitives; HiRadixCache → host offload; plain RadixCache → GPU pin (default) or shadow copy."""
    from toolkv.core.backends.unified import UnifiedBackend, is_unified_tree

    if is_unified_tree(tree):  # checked first: it also has cache_controller and load_back
        # raises Unsupported (with the fix) for a tree it cannot drive
        return UnifiedBackend(tree, agree=agree, host_budget_tokens=config.host_budget_tokens)
    if hasattr(tree, "cache_controller") and hasattr(tree, "load_back"):
        from toolkv.core.backends.hiradix import HiRadixBackend

        return HiRadixBackend(tree, agree=agree, host_budget_tokens=config.host_budget_tokens)
    if fallback == "shadow":
        from toolkv.core.backends.shadow import ShadowBackend

        return ShadowBackend(tree, agree=agree, budget_tokens=config.host_budget_tokens)
    from toolkv.core.backends.pin import PinBackend

    return PinBackend(tree, agree=agree, budget_tokens=config.host_budget_tokens)
