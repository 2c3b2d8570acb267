"""Call policy ``auto``: the per-call policy of ``toolkv.core.policy.decide`` (docs/policy.md).
Keep a short call's KV on the GPU when the device has spare room by the keep rule
(``policy.keep_fits``), offload a long one with an early restore timed to its predicted return, let
tiny or unaffordable KV go. Fallbacks: a keep whose path is not all resident offloads; an offload
the host cannot take (nothing to demote) lets go."""

from __future__ import annotations

from dataclasses import replace

from toolkv.core.calls import Calls, demote_for_room
from toolkv.core.phases import Phase
from toolkv.core.policy import Decision, Pressure, decide
from toolkv.core.record import SessionRecord
from toolkv.core.result import SessionView
from toolkv.core.settings import PolicyName
from toolkv.core.treeops import path_to
from toolkv.errors import HostMemoryFull, WrongState


class Auto(Calls):
    """The per-call policy: keep, offload or let go, by ``policy.decide``."""

    name = PolicyName("auto")

    def tool_start(self, session_id: str, tool: str | None, expected_s: float | None) -> SessionView:
        m = self.m
        rec = self.record(session_id)
        if rec.state != Phase.RUNNING:
            raise WrongState(
                f"tool_start needs a Running session; {session_id!r} is {rec.state}", state=rec.state
            )
        node = m._live_node(rec)
        if node is None:
            return self._let_go(rec, tool, Decision("let_go", "no_kv", float(expected_s or 0.0), 0.0, None))
        rec.node, rec.tree_gen = node, m.tree_gen
        hint = None if expected_s is None else float(expected_s)
        kv_tokens = sum(len(n.key) for n in path_to(m.tree, node))
        sized = m.caps.host_sized
        host_need = int(sized.host_need(node)) if sized is not None else kv_tokens
        d = decide(
            kv_tokens=kv_tokens,
            tool=tool,
            expected_s=hint,
            pressure=self.pressure(session_id, tool, hint, host_need),
            model=m.durations,
            config=m.config.policy_config,
            restore_tokens_per_s=m.restore_rate,
            host_need_tokens=host_need,
        )
        back = self.returns_at(tool, hint)
        if d.action == "keep" and m.backend.keep(rec, node):
            m.policy.keep_step(rec)
            self.note(rec, tool, d)
            return m.view(rec)
        if d.action in ("keep", "offload"):  # keep: the path is not all resident; offload it instead
            try:
                m.tool_start(session_id, demote=lambda: demote_for_room(m, rec), returns_at=back)
            except HostMemoryFull:
                return self._let_go(
                    rec, tool, Decision("let_go", "host_full", float(expected_s or 0.0), 0.0, None)
                )
            reason = d.reason if d.action == "offload" else "not_resident"
            self.note(rec, tool, Decision("offload", reason, d.expected_s, d.restore_s, d.prefetch_after_s))
            return m.view(rec)
        return self._let_go(rec, tool, d)

    def _let_go(self, rec: SessionRecord, tool: str | None, d: Decision) -> SessionView:
        self.m.policy.let_go_step(rec)
        self.note(rec, tool, d)
        return self.m.view(rec)

    def pressure(self, session_id: str, tool: str | None, hint: float | None, kv_tokens: int) -> Pressure:
        """The backend's pressure, queued requests counted, with the host room that demotions
        could make counted as room: the protected tokens of offloaded sessions predicted back
        later than this call would be (they are worth less on the host than this one). ``decide``
        only asks whether the host can take ``kv_tokens`` (what the offload would add), so the
        scan over sessions runs only when it cannot already."""
        m = self.m
        p = m.pressure()  # agreed across TP ranks: decide() keeps, offloads or lets go alike on all
        if p.host_available_tokens >= kv_tokens:
            return p
        demotable = m.policy.demotable_tokens(session_id, self.returns_at(tool, hint))
        if not demotable:
            return p
        return replace(p, host_available_tokens=min(p.host_total_tokens, p.host_available_tokens + demotable))


POLICY = Auto
