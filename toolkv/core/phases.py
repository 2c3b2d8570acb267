"""The session phases as an enum, checked against the lifecycle table at import, and the L3
sub-phases with their table (``spec/storage/StorageTier.tla``): ground-floor data that the
records, the backends and the session machine all read.

``lifecycle.SESSION_STATES`` is the one list of phases (``model_tests/test_tables.py`` checks its
transitions against TLC's state graph of ``spec/ToolKV.tla``). The enum below names the same
phases so that the session machine writes ``Phase.OFFLOADED`` instead of a string a typo could
break; it is a ``StrEnum``, so a member *is* its name (``Phase.RUNNING == "Running"``) and records,
``kv_meta`` and the HTTP JSON keep plain strings. The import-time check makes the enum and the
table one list: a phase added to one and not the other fails at import, not in production.
"""

from __future__ import annotations

from enum import StrEnum
from typing import TYPE_CHECKING

from toolkv.core.lifecycle import (
    EXPIRING,
    HOLDING,
    PINNING,
    PROTECTING,
    SESSION_STATES,
    IllegalTransition,
    Row,
    relation,
)

if TYPE_CHECKING:
    from toolkv.core.record import SessionRecord


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


# ---- the L3 sub-phases (``rec.l3``; the table and its moves: toolkv.core.session.l3's docstring) ----
class L3(StrEnum):
    """Where an offloaded session's copy is, relative to the storage tier (``rec.l3``)."""

    NONE = ""
    STORING = "storing"
    STORED = "stored"
    FETCHING = "fetching"


#: StorageTier.tla's phase of each sub-phase; every other spec phase is :attr:`L3.NONE`
SPEC_PHASE: dict[L3, str] = {L3.STORING: "Storing", L3.STORED: "Stored", L3.FETCHING: "Prefetching"}


def of_spec_phase(phase: str) -> L3:
    """The sub-phase of a StorageTier.tla phase (``Offloaded``, ``Running``, ... are NONE)."""
    return next((k for k, v in SPEC_PHASE.items() if v == phase), L3.NONE)


_IN_L3 = (L3.STORING, L3.STORED, L3.FETCHING)

#: The sub-machine's moves, by the StorageTier.tla action that makes them (snake_case). Equal to
#: the relation TLC's state graph of the storage spec projects onto the sub-phases.
L3_TRANSITIONS: tuple[Row, ...] = (
    ("store", L3.NONE, L3.STORING),  # a long tool, or the host must make room: write it to L3
    ("store_ack", L3.STORING, L3.STORED),  # whole: the host protection goes, the L3 copy is kept
    ("store_ack", L3.STORING, L3.NONE),  # short: never restored from; back on the host copy
    ("tool_end_from_host", (L3.STORING, L3.STORED), L3.NONE),  # the host copy is whole: read it
    ("storage_prefetch", L3.STORED, L3.FETCHING),  # tool_end (or an early restore) reads L3
    ("tool_end_at_arrival", L3.STORED, L3.NONE),  # l3_read_at_arrival: sglang reads it, not toolkv
    ("prefetch_ack", L3.FETCHING, L3.NONE),  # read back to host (or nothing came back)
    ("expire", _IN_L3, L3.NONE),  # the TTL releases the copy
    ("close", _IN_L3, L3.NONE),
)

#: Moves made by ToolKV.tla actions that StorageTier.tla does not model (its sessions are never
#: demoted and its tree is never reset): the copy's protection goes with the session's.
L3_OUTSIDE: tuple[Row, ...] = (
    ("demote", _IN_L3, L3.NONE),
    ("tree_reset", _IN_L3, L3.NONE),
)

_REL = relation(L3_TRANSITIONS) | relation(L3_OUTSIDE)


def fire_l3(rec: SessionRecord, trigger: str, dest: L3) -> None:
    """Move ``rec.l3`` to ``dest`` through the StorageTier.tla action ``trigger``; a move the
    tables do not have is a bug (``IllegalTransition``)."""
    src = L3(rec.l3)
    if (src, dest, trigger) not in _REL:
        raise IllegalTransition(f"{trigger}: l3 {src.value!r} -> {dest.value!r} is not in the L3 table")
    rec.l3 = dest.value


__all__ = [
    "EXPIRING",
    "HOLDING",
    "IDLE",
    "L3",
    "L3_OUTSIDE",
    "L3_TRANSITIONS",
    "OFFLOADED",
    "PINNING",
    "PROTECTING",
    "RESET_LOSES",
    "SPEC_PHASE",
    "Phase",
    "fire_l3",
    "of_spec_phase",
]
