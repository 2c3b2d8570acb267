"""The per-call policy's actions of ``spec/ToolKV.tla``: ``Keep``, ``LetGo`` and ``Demote``.

Which of ``ToolStart``, ``Keep`` and ``LetGo`` a tool call gets is the call policy's choice
(``toolkv.core.calls``); these are the actions themselves, callable on their own as the spec's
steps (the conformance replay and kv_hints' ``retain`` do).
"""

from __future__ import annotations

from toolkv.core.lifecycle import fire
from toolkv.core.phases import Phase
from toolkv.core.policy import demotion_order
from toolkv.core.record import SessionRecord
from toolkv.core.result import SessionView
from toolkv.core.session.handover import Handover
from toolkv.core.session.state import MachineState, log
from toolkv.errors import WrongState


class PolicyActions:
    """Keep, LetGo, Demote, and the order demotions take. Calls only the state and the hand-over's
    room check (a keep's pin takes device room as a hand-over's does)."""

    def __init__(self, s: MachineState, handover: Handover) -> None:
        self.s = s
        self.handover = handover

    # ---- Keep -----------------------------------------------------------------------------------------
    def can_keep(self, rec: SessionRecord) -> bool:
        return rec.state == Phase.RUNNING

    def keep(self, session_id: str) -> SessionView:
        """Spec ``Keep``: pin the session's resident path on the GPU until tool_end or the TTL."""
        rec = self.s._get(session_id)
        if not self.can_keep(rec):
            raise WrongState(f"keep needs a Running session; {session_id!r} is {rec.state}", state=rec.state)
        node = self.s._live_node(rec)
        if node is not None:
            # the pin takes the path's unlocked resident tokens out of what sglang may evict
            # (spec Keep's PromiseFits): refused, nothing changed, where they are promised
            rec.node, rec.tree_gen = node, self.s.tree_gen
            self.handover.check_pin_room(rec)
        if node is None or not self.s.backend.keep(rec, node):
            raise WrongState(f"session {session_id!r} has no resident KV to keep", state=rec.state)
        self.keep_step(rec)
        return self.s.view(rec)

    def keep_step(self, rec: SessionRecord) -> None:
        """``Keep``'s step once the backend pinned the path."""
        rec.epoch += 1
        # A pin holds device memory nobody else can use: bounded by the shorter keep TTL (a client
        # that crashed mid-call must not pin the GPU for the full TTL). Spec Keep arms KeepTTL,
        # whether the policy chose it or a client asked for it (kv_hints' retain).
        self.s._arm_deadline(rec, self.s._keep_ttl())
        fire(rec, "keep", Phase.KEPT)
        self.s.counters["kept"] += 1

    # ---- LetGo ----------------------------------------------------------------------------------------
    def can_let_go(self, rec: SessionRecord) -> bool:
        return rec.state == Phase.RUNNING

    def let_go(self, session_id: str) -> SessionView:
        """Spec ``LetGo``: hold nothing for this tool call; it still gets an epoch for tool_end."""
        rec = self.s._get(session_id)
        if not self.can_let_go(rec):
            raise WrongState(
                f"let_go needs a Running session; {session_id!r} is {rec.state}", state=rec.state
            )
        self.let_go_step(rec)
        return self.s.view(rec)

    def let_go_step(self, rec: SessionRecord) -> None:
        rec.epoch += 1
        fire(rec, "let_go", Phase.RELEASED)
        self.s.counters["let_go"] += 1

    # ---- Demote ---------------------------------------------------------------------------------------
    def can_demote(self, rec: SessionRecord) -> bool:
        return rec.state == Phase.OFFLOADED

    def demote(self, session_id: str) -> SessionView:
        """Spec ``Demote``: release an offloaded session's host protection. HiCache may then evict
        its host copy; the next turn recomputes what is gone, never reads it as protected."""
        rec = self.s._get(session_id)
        if not self.can_demote(rec):
            raise WrongState(
                f"demote needs an Offloaded session; {session_id!r} is {rec.state}", state=rec.state
            )
        self.demote_release(rec)
        self.s._settle(rec, "demote")
        fire(rec, "demote", Phase.RELEASED)
        self.s.counters["demoted"] += 1
        log.debug("session %s demoted (host budget)", session_id)
        self.s.on_demote(session_id)
        return self.s.view(rec)

    def demote_release(self, rec: SessionRecord) -> None:
        """What a demotion gives back: the session's host protection (it holds no pin)."""
        self.s.backend.release(rec)

    def demotion_candidates(self, but: str, returns_at: float = float("inf")) -> list[str]:
        """Offloaded sessions predicted back after ``returns_at`` (when the session that needs the
        room is), the one predicted back last first (policy.demotion_order): an optimal cache
        drops the KV whose next use is furthest, and never the one about to be used. Only
        ``Offloaded`` sessions on their host copy: one with a copy in flight is never demoted.
        With an L3 tier on, every such session is a candidate, the latest first: a victim is
        stored to L3, not dropped (``yield_host``), so even one due before ``returns_at`` may
        yield its host copy rather than have the tool_start answer 507."""
        any_end = self.s._storage_on()
        cands = []
        for r in self.s.sessions.values():
            if r.state != Phase.OFFLOADED or r.l3 or r.session_id == but:
                continue
            end = self.s._predicted_end(r)
            if any_end or end > returns_at:
                cands.append((r.session_id, r.tool_started_at, end, r.offload_tokens))
        return demotion_order(cands, self.s.now)

    def demotable_tokens(self, but: str, returns_at: float) -> int:
        """Host tokens the demotions a tool_start may make would free: the protected copies of
        offloaded sessions predicted back after ``returns_at`` (any, with an L3 tier on: they are
        stored, not dropped), the call policy counts them as host room. Never a copy still
        protected for a store in flight (``l3`` set): it is room only at its whole StoreAck, and
        then sglang's ``evict_host`` counts it (``host_evictable_tokens``)."""
        any_end = self.s._storage_on()
        return sum(
            r.offload_tokens
            for r in self.s.sessions.values()
            if r.state == Phase.OFFLOADED
            and not r.l3  # a copy in L3 holds no host protection (or is already on its way there)
            and r.session_id != but
            and (any_end or self.s._predicted_end(r) > returns_at)
        )
