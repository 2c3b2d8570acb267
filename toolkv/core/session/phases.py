"""The session phases as an enum, checked against the lifecycle table at import.

``lifecycle.SESSION_STATES`` is the one list of phases (``model_tests/test_tables.py`` checks its
transitions against TLC's state graph of ``spec/ToolKV.tla``). The enum below names the same
phases so that the session machine writes ``Phase.OFFLOADED`` instead of a string a typo could
break; it is a ``StrEnum``, so a member *is* its name (``Phase.RUNNING == "Running"``) and records,
``kv_meta`` and the HTTP JSON keep plain strings. The import-time check makes the enum and the
table one list: a phase added to one and not the other fails at import, not in production.
"""

from __future__ import annotations

from enum import StrEnum

from toolkv.core.lifecycle import EXPIRING, HOLDING, PINNING, PROTECTING, SESSION_STATES


class Phase(StrEnum):
    """A session's phase (spec ``phase[s]``); the values are ``lifecycle.SESSION_STATES``."""

    NEW = "New"
    RUNNING = "Running"
    OFFLOADING = "Offloading"
    OFFLOADED = "Offloaded"
    RESTORING = "Restoring"
    RUNNABLE = "Runnable"
    EXPIRED = "Expired"
    LOST = "Lost"
    CLOSED = "Closed"
    KEPT = "Kept"
    PREFETCHING = "Prefetching"
    RELEASED = "Released"
    HANDOVER = "Handover"
    PARKED = "Parked"


assert tuple(p.value for p in Phase) == SESSION_STATES, "Phase and lifecycle.SESSION_STATES differ"
assert set(SESSION_STATES) >= PROTECTING | PINNING | EXPIRING | HOLDING

#: phases of a session that holds nothing: it may be forgotten when idle (spec ``Close``), and a
#: turn may end in it (spec ``Insert``)
IDLE: frozenset[str] = frozenset({Phase.RUNNING, Phase.RUNNABLE, Phase.EXPIRED, Phase.LOST, Phase.RELEASED})
#: phases a tool_start's KV is on its way down or protected below the GPU in
OFFLOADED: frozenset[str] = frozenset({Phase.OFFLOADING, Phase.OFFLOADED})
#: phases a tree reset turns into ``Lost`` (the rest of ``HOLDING`` has a copy in flight)
RESET_LOSES: frozenset[str] = frozenset({Phase.OFFLOADED, Phase.KEPT, Phase.HANDOVER, Phase.PARKED})

__all__ = ["EXPIRING", "HOLDING", "IDLE", "OFFLOADED", "PINNING", "PROTECTING", "RESET_LOSES", "Phase"]
