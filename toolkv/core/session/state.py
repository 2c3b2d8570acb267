"""The session machine's state and the helpers every part of it shares (:class:`MachineState`).

``spec/ToolKV.tla``'s actions are split by concern over parts that the machine
(:class:`~toolkv.core.session.machine.SessionMachine`, which *is* this state) owns: ``copies``
(ToolStart, WriteAck, ToolEnd, LoadAck, Prefetch), ``loads`` (the host→GPU loads of ToolEnd and
Prefetch), ``handover`` (Handover, Admit, Park, Unpin), ``policy`` (Keep, LetGo, Demote) and
``l3`` (the storage tier). Each part holds this state and the parts it calls, given to it by the
machine, and nothing else: a call that crosses parts names the part it goes to. Everything here is
state, or a helper that reads and writes only state (and the backend), so no part needs another
to use it.

Single-threaded by design: every method runs on the scheduler thread (inside a request handler or
the per-iteration tick), so on every tensor-parallel rank the same calls happen at the same
iteration with the same inputs. Time comes in as an argument and asynchronous completion is read
off the tree after sglang's own ``writing_check``/``loading_check`` (agreed across ranks), so
nothing here reads a local clock or a local event without agreement.
"""

from __future__ import annotations

import logging
from array import array
from collections import Counter, OrderedDict
from collections.abc import Callable
from typing import Any

from toolkv.core.backends.base import Agreement, Backend, agreed_pressure
from toolkv.core.capabilities import Capabilities, capabilities_of
from toolkv.core.config import ManagerConfig
from toolkv.core.phases import L3, fire_l3
from toolkv.core.policy import DurationModel, Pressure, with_queued
from toolkv.core.record import SessionRecord
from toolkv.core.result import SessionView
from toolkv.core.timers import Timers
from toolkv.core.treeops import Tree, attached, path_to, walk
from toolkv.errors import BadRequest, StaleEpoch, UnknownSession

log = logging.getLogger("toolkv")


class MachineState:
    """Every session's record and what is in flight for it, over one backend."""

    def __init__(self, tree: Tree, backend: Backend, *, config: ManagerConfig, agree: Agreement) -> None:
        self.config = config
        self.agree = agree
        self.tree = tree
        self.backend = backend
        self.caps: Capabilities = capabilities_of(backend)  # checked once, here
        self.sessions: dict[str, SessionRecord] = {}
        self._closed: OrderedDict[str, SessionRecord] = OrderedDict()
        self._offloading: dict[str, SessionRecord] = {}
        self._restoring: dict[str, SessionRecord] = {}
        self._prefetching: dict[str, SessionRecord] = {}
        self._handover: dict[str, SessionRecord] = {}  # spec Handover: pinned, waiting for admission
        # the L3 storage tier (spec/storage/StorageTier.tla): stores and prefetches in flight
        self._storing: dict[str, SessionRecord] = {}
        self._fetching: dict[str, SessionRecord] = {}
        # stores in flight that the policy made early (by predicted return), not for a full host:
        # only these are read back ahead (a victim read back at once would take the room again)
        self._early: set[str] = set()
        self.timers = Timers()
        self.durations = DurationModel(self.config.policy_config)
        self.restore_rate = self.config.restore_tokens_per_s  # EWMA of measured restores
        self.now = 0.0
        self.tree_gen = 0
        self.counters: Counter[str] = Counter()
        # Device tokens queued requests will need (the scheduler binds sglang's waiting queue):
        # a pin must leave them free, or a kept session is paid for by somebody's recompute.
        self.queued_demand: Callable[[], int] = lambda: 0
        # Told of every demotion, which happens inside another session's call (its tool_start
        # needed the host room): the scheduler writes it as a decision line of its own, so an
        # operator sees why a session toolkv had accepted came back with nothing.
        self.on_demote: Callable[[str], None] = lambda session_id: None
        # told of every store the manager makes of its own accord, with why ("l3_early": a long
        # tool; "host_room": a full host's victim) and of every read-ahead ("l3_readahead"): the
        # scheduler writes a decision line for each, as for on_demote
        self.on_store: Callable[[str, str], None] = lambda session_id, why: None

    def pressure(self) -> Pressure:
        """The backend's pressure with the queued requests' tokens taken off the spare room,
        agreed across TP ranks (``agreed_pressure``: the tightest rank's counts). Every policy
        choice reads it here, never ``backend.pressure()`` alone."""
        return agreed_pressure(self.agree, with_queued(self.backend.pressure(), int(self.queued_demand())))

    # ---- records --------------------------------------------------------------------------------------
    def _get(self, session_id: str) -> SessionRecord:
        """The session's record, open or closed (a closed one answers kv_meta and fences epochs)."""
        if not isinstance(session_id, str) or not session_id:
            raise BadRequest("session_id must be a non-empty string")
        rec = self.sessions.get(session_id)
        if rec is None:
            rec = self._closed.get(session_id)
        if rec is None:
            raise UnknownSession(f"unknown session {session_id!r}", session_id=session_id)
        return rec

    def view(self, rec: SessionRecord) -> SessionView:
        """What a call answers about the session (``kv_meta``'s per-session object)."""
        placement = SessionView.closed_placement() if rec.state == "Closed" else self.backend.describe(rec)
        return SessionView.of(rec, self.backend.name, placement)

    def _meta(self, rec: SessionRecord) -> SessionView:
        """The view of ``rec`` (the name the seeded defects of ``verify.toolkv.mutants`` use)."""
        return self.view(rec)

    # ---- the session's node (caveat 5: never act on a stale node) -------------------------------------
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
        if matched == len(rec.tokens) and matched > 0:
            return found
        return None

    def _path_tokens(self, rec: SessionRecord) -> int:
        return sum(len(m.key) for m in path_to(self.tree, rec.node)) if rec.node is not None else 0

    # ---- timers -----------------------------------------------------------------------------------------
    def _arm_deadline(self, rec: SessionRecord, ttl_s: float | None = None) -> None:
        self.timers.arm_deadline(rec, self.now + (self.config.ttl_s if ttl_s is None else ttl_s))

    def _touch(self, rec: SessionRecord) -> None:
        """The session did something: its idle expiry moves to ``now + idle_ttl_s``."""
        rec.last_active = self.now
        self.timers.arm_idle(rec, self.now + self.config.idle_ttl_s)

    def _keep_ttl(self) -> float:
        return min(self.config.ttl_s, self.config.keep_ttl_s)

    def _arm_warm(self, rec: SessionRecord) -> None:
        """An early restore became ``Kept``: its pin waits for tool_end at most the keep TTL, as a
        kept session's does, and never past the offload's own deadline (spec ``WarmDeadline``)."""
        self._arm_deadline(rec, min(self._keep_ttl(), max(0.0, rec.deadline - self.now)))

    def _defer_prefetch(self, rec: SessionRecord, after_s: float) -> None:
        """Try the session's early restore again ``after_s`` from now."""
        self.timers.arm_prefetch(rec, self.now + after_s)

    # ---- leaving the protecting phases ------------------------------------------------------------------
    def _settle(self, rec: SessionRecord, why: str = "") -> None:
        """The session left the protecting states: stop watching it (its old deadline stays on
        record, as in the spec; the sweep ignores sessions that protect nothing). ``why`` is the
        action, for the L3 sub-machine's table when the session had a copy in L3."""
        self._offloading.pop(rec.session_id, None)
        self._restoring.pop(rec.session_id, None)
        self._prefetching.pop(rec.session_id, None)
        self._handover.pop(rec.session_id, None)
        self._storing.pop(rec.session_id, None)
        self._fetching.pop(rec.session_id, None)
        if rec.l3:
            self._l3_release(rec, why)
        rec.l3_then = ""
        rec.prefetch_at = float("inf")

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

    def _check_epoch(self, rec: SessionRecord, epoch: int, *, count: bool) -> None:
        """Spec ``ToolEnd``'s (and ``Park``'s) ``e = epoch[s]``: raises, changing nothing, else."""
        if isinstance(epoch, bool) or not isinstance(epoch, int):
            raise BadRequest("epoch must be an integer")
        if not self._epoch_matches(rec, epoch):
            if count:
                self.counters["stale_epoch"] += 1
            raise StaleEpoch(
                f"epoch {epoch} is stale for session {rec.session_id!r} (current {rec.epoch})",
                current_epoch=rec.epoch,
            )

    def _prefetch_readable(self, rec: SessionRecord) -> bool:
        """An early restore is done when no load into the session's path is in flight (caveat 7's
        read side: never Kept, i.e. served, before the load is acknowledged)."""
        return not self.backend.restore_pending(rec)

    def _measured_restore(self, rec: SessionRecord) -> None:
        """Fold a finished load into the restore rate the policy assumes (EWMA, agreed clock)."""
        took = self.now - rec.restore_started_at
        if rec.restored_tokens > 0 and took > 0:
            self.restore_rate = 0.8 * self.restore_rate + 0.2 * (rec.restored_tokens / took)

    def _predicted_end(self, rec: SessionRecord) -> float:
        """When the session's tool call is predicted to return, given how long it has run: its
        tool's median conditioned on having lasted this long (a heavy-tailed call far past its
        median is likely a long one), from the client's hint when it gave one."""
        hinted = rec.reason.endswith("_hint")
        return rec.tool_started_at + self.durations.residual_median(
            rec.tool, self.now - rec.tool_started_at, rec.expected_s if hinted else None
        )

    def _forget_tokens(self, rec: SessionRecord) -> None:
        """A closed record keeps what kv_meta and the epoch fence need; its token copy and its node
        reference go (spec ``Close``: ``ref`` becomes ``NoNode``, invariant ``ClosedHoldsNoNode``).
        A kept reference holds the node object and, through its parent link, every evicted
        ancestor with its token key: the bounded closed history would hold the whole path of
        each of its (by default 10,000) sessions."""
        rec.tokens, rec.backend_state, rec.node = array("q"), None, None

    # ---- the L3 tier's switch and its sub-phase's end (every protection's end goes through it) ------
    def _storage_on(self) -> bool:
        storage = self.caps.storage
        return bool(self.config.l3 and storage is not None and storage.storage_enabled())

    def _l3_release(self, rec: SessionRecord, why: str) -> None:
        """The session's protection ends (``why``: the action) and with it its L3 sub-phase."""
        self._early.discard(rec.session_id)
        fire_l3(rec, why, L3.NONE)
