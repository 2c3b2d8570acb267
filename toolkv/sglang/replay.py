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

from collections.abc import Mapping
from typing import Any

from toolkv.errors import BadRequest

# Phases where a tool_start at the session's current epoch cannot be the call being re-sent:
# Running/New have not started it (the manager's tool_start runs), Closed is final.
_NOT_STARTED = frozenset({"New", "Running", "Closed"})


def prior_epoch(body: Mapping[str, Any]) -> int | None:
    """The optional ``prior_epoch`` of a tool_start body (validated: the HTTP side does too, but
    the scheduler is reached by other callers, e.g. tests and the IPC channel)."""
    v = body.get("prior_epoch")
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise BadRequest("prior_epoch must be an integer >= 0", field="prior_epoch")
    return v


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
