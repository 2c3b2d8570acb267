"""Call policy ``offload``: every tool call offloads (spec ``ToolStart``), demoting offloaded
sessions predicted back later when the host is full; a 507 when none can yield."""

from __future__ import annotations

from toolkv.core.calls import Calls, demote_for_room
from toolkv.core.policy import Decision
from toolkv.core.result import SessionView
from toolkv.core.settings import PolicyName


class Offload(Calls):
    """Every tool call offloads (spec ``ToolStart``)."""

    name = PolicyName("offload")

    def tool_start(self, session_id: str, tool: str | None, expected_s: float | None) -> SessionView:
        m = self.m
        rec = self.record(session_id)
        hint = None if expected_s is None else float(expected_s)
        expected = hint if hint is not None else m.durations.median(tool)
        # a full host demotes offloaded sessions predicted back after this one, not a 507 -- but
        # only when the device needs the room this session holds (demote_for_room)
        m.tool_start(session_id, demote=lambda: demote_for_room(m, rec), returns_at=m.now + expected)
        # "_hint": the predicted return (demotion order, L3 by predicted return) uses the hint
        reason = "policy_offload" if hint is None else "policy_offload_hint"
        self.note(rec, tool, Decision("offload", reason, expected, 0.0, None))
        return m.view(rec)  # with the decision and its reason, as the per-call policy answers


POLICY = Offload
