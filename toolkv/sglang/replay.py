"""Recognising a re-sent ``tool_start`` (its first reply was lost) on the scheduler side.

An agent whose ``tool_start`` timed out cannot tell whether it was applied. Sending it again
used to answer ``wrong_state`` when it had been (the session is no longer Running), and the agent
lost the epoch it needs for ``tool_end``. The client therefore sends the epoch it last saw as
``prior_epoch``; the session's epoch grows by exactly one per accepted ``tool_start`` (and by
nothing else), so a session at ``prior_epoch + 1`` that is in, or past, a tool call has already
applied this call: the answer is its record, unchanged, marked ``replayed``.

This is a reading of the manager's record and nothing more: no state changes, the manager and
its spec are untouched, and every other case goes to ``ToolKVManager.tool_start`` as before
(``prior_epoch == epoch``: a new call; anything else: the manager decides, e.g. ``wrong_state``).
"""

from __future__ import annotations

from typing import Any

from toolkv.core.phases import Phase

# Phases where a tool_start at the session's current epoch cannot be the call being re-sent:
# Running/New have not started it (the manager's tool_start runs), Closed is final.
_NOT_STARTED = frozenset({Phase.NEW, Phase.RUNNING, Phase.CLOSED})


def replayed_tool_start(manager: Any, session_id: str, prior: int | None) -> dict[str, object] | None:
    """The session's record when this tool_start was already applied, else None (run it)."""
    if prior is None:
        return None
    rec = manager.sessions.get(session_id)
    if rec is None or rec.epoch != prior + 1 or rec.state in _NOT_STARTED:
        return None
    meta: dict[str, object] = dict(manager.kv_meta(session_id))
    meta.update(replayed=True, skipped="replayed")
    return meta
