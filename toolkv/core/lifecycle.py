"""The two lifecycle tables — session phases and node tiers — declared once, run on ``transitions``.

Each row is ``(trigger, source, dest)``; the trigger is the snake_case name of the spec action
that causes the move (``ToolStart`` → ``tool_start``). ``model_tests/test_tables.py`` extracts the
same relations from TLC's state graph of ``spec/ToolKV.tla`` and asserts equality, so a change on
either side without the other breaks the build.

Why one shared ``Machine`` with models that are not registered: ``transitions`` normally decorates
every model with bound trigger methods (~20 objects each). With 100k tracked sessions that is
memory for nothing; ``machine.events[trigger].trigger(model)`` runs the same transition logic
(source check, conditions, state write) against any object that has a ``state`` attribute.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from transitions import Machine, MachineError

# transitions logs every state entry/exit at INFO; sglang runs with INFO on, so that would be one log
# line per session transition on every rank. toolkv logs its own decisions.
logging.getLogger("transitions").setLevel(logging.WARNING)

Row = tuple[str, str | tuple[str, ...], str | tuple[str, ...]]  # (trigger, source(s), dest(s))

# ---- sessions --------------------------------------------------------------------------------------
SESSION_STATES: tuple[str, ...] = (
    "New",  # created, no turn recorded yet (the spec's initial phase; close is refused)
    "Running",  # tracked; its KV is in the tree on the GPU, or it never had one
    "Offloading",  # tool_start accepted; GPU→host writes in flight, GPU copy not yet freed
    "Offloaded",  # GPU copy freed; host copy protected
    "Restoring",  # tool_end accepted; host→GPU load in flight
    "Runnable",  # the tool call is over and the next request holds the KV (or the hand-over ended)
    "Expired",  # the TTL released the protection before a tool_end came
    "Lost",  # the tree was reset while the session was offloaded: the KV is gone
    "Closed",  # the client closed the session
    # the per-call policy (docs/policy.md)
    "Kept",  # tool_start kept the KV on the GPU: the session pins its path until tool_end or the keep TTL
    "Prefetching",  # an early restore is loading the offloaded KV before tool_end
    "Released",  # nothing is held: the policy let the KV go, or demoted it from the host
    # the hand-over
    "Handover",  # tool call over, KV on the GPU and pinned until the next request holds it (or a TTL)
    # load-adaptive protection
    "Parked",  # tool call over, host copy protected, nothing pinned: sglang's load_back at admission loads it
)
# The phases that hold a host protection (spec ``Protecting``).
PROTECTING: frozenset[str] = frozenset({"Offloading", "Offloaded", "Restoring", "Prefetching", "Parked"})
# The phases that hold a session pin, a path lock (spec ``Pinning``).
PINNING: frozenset[str] = frozenset({"Restoring", "Prefetching", "Kept", "Handover"})
# The TTL applies until tool_end is accepted (spec ``Expiring``); a Restoring session ends with its
# load. A hand-over waits for a request that may never come, so the TTL bounds it too.
EXPIRING: frozenset[str] = frozenset({"Offloading", "Offloaded", "Prefetching", "Kept", "Handover", "Parked"})
# The phases whose KV a tree reset loses (spec ``Holding``).
HOLDING: frozenset[str] = PROTECTING | {"Kept", "Handover"}

SESSION_TRANSITIONS: tuple[Row, ...] = (
    ("insert", ("New", "Runnable", "Expired", "Lost", "Released"), "Running"),
    ("tool_start", "Running", "Offloading"),
    ("tool_start", "Running", "Offloaded"),  # nothing was in flight: finished at once
    ("write_ack", "Offloading", "Offloaded"),
    ("tool_end", "Offloading", "Handover"),  # cancel before anything was freed
    ("tool_end", "Offloaded", "Restoring"),
    ("tool_end", "Offloaded", "Handover"),  # nothing to load (someone else restored it)
    ("tool_end", "Offloading", "Restoring"),
    ("load_ack", "Restoring", "Handover"),  # readable: pinned until the next request holds it
    (
        "ttl_sweep",
        ("Offloading", "Offloaded", "Prefetching", "Kept"),
        "Expired",
    ),  # not Restoring: tool_end was accepted
    ("ttl_sweep", "Handover", "Runnable"),  # the request never came: the KV stays, unpinned
    ("admit", "Handover", "Runnable"),  # the next request matched and locked its prefix
    # load-adaptive protection: a tool_end whose request would wait loads and pins nothing
    ("park", ("Offloading", "Offloaded"), "Parked"),
    ("admit", "Parked", "Runnable"),  # the request was admitted: sglang's load_back took the host copy
    ("ttl_sweep", "Parked", "Runnable"),  # the request never came: the protection goes
    (
        "unpin",
        "Handover",
        ("Parked", "Runnable"),
    ),  # the room is needed: the pin goes, the host copy stays protected
    # flush_cache needs an idle scheduler: no write or load pending, so only these are lost
    ("tree_reset", ("Offloaded", "Kept", "Handover", "Parked"), "Lost"),
    # the per-call policy
    ("keep", "Running", "Kept"),
    ("let_go", "Running", "Released"),
    ("demote", "Offloaded", "Released"),  # host budget reached: the protection is released
    ("prefetch", "Offloaded", "Prefetching"),  # early restore: the load is in flight
    ("prefetch", "Offloaded", "Kept"),  # early restore: nothing to load, the path is resident
    ("load_ack", "Prefetching", "Kept"),  # the early restore is readable; waits for its tool_end
    ("tool_end", "Kept", "Handover"),
    ("tool_end", "Prefetching", "Restoring"),  # the early restore becomes the restore
    ("tool_end", "Released", "Running"),  # nothing was held: the next turn recomputes what is missing
    ("close", tuple(s for s in SESSION_STATES if s not in ("New", "Closed")), "Closed"),
)

# ---- node tiers --------------------------------------------------------------------------------------
TIER_STATES: tuple[str, ...] = (
    "Unborn",  # not created yet (spec only; the implementation has no such object)
    "GPU",
    "BackingUp",
    "CpuProtected",
    "CpuUnprotected",
    "Loading",
    "Evicted",  # deleted from the tree (status Gone in the spec)
)

# Every tier change a node can make, by the spec action that makes it. Rows are the spec's own
# relation (model_tests/test_tables.py extracts it from TLC's state graph and checks equality).
TIER_TRANSITIONS: tuple[Row, ...] = (
    ("insert", "Unborn", "GPU"),  # a turn's new leaf lands on the GPU
    # a diverging request splits a node: the new prefix node copies the copies and in-flight marks of
    # the node it splits, but not its host_ref_counter (so never CpuProtected)
    ("split", "Unborn", ("GPU", "BackingUp", "Loading", "CpuUnprotected")),
    ("write_through", "GPU", "BackingUp"),  # HiCache's own write-through starts
    ("tool_start", "GPU", "BackingUp"),  # toolkv backs up the path
    ("tool_start", "GPU", "CpuProtected"),  # nothing in flight: freed at once
    ("tool_start", "GPU", "CpuUnprotected"),  # ... and so is an exclusive ancestor (not protected itself)
    ("tool_start", "CpuUnprotected", "CpuProtected"),  # already host-only: just protected
    ("write_ack", "BackingUp", "GPU"),  # ack of a write nobody offloads
    ("write_ack", "BackingUp", ("CpuProtected", "CpuUnprotected")),  # ack, then toolkv frees the GPU copy
    ("write_ack", "GPU", ("CpuProtected", "CpuUnprotected")),  # the path's last ack frees acked nodes too
    ("gpu_evict", "GPU", ("CpuProtected", "CpuUnprotected", "Evicted")),  # sglang's device eviction
    ("host_evict", "CpuUnprotected", "Evicted"),  # sglang's host eviction (never a protected node)
    ("host_room", "CpuUnprotected", "Evicted"),  # ... asked for by a tool_start short of host room
    ("tool_end", ("CpuProtected", "CpuUnprotected"), "Loading"),  # load_back starts (leaf and ancestors)
    ("load_ack", "Loading", "GPU"),  # the load is acknowledged: readable
    ("ttl_sweep", "CpuProtected", "CpuUnprotected"),  # TTL released the protection
    ("demote", "CpuProtected", "CpuUnprotected"),  # the policy released the protection
    ("prefetch", ("CpuProtected", "CpuUnprotected"), "Loading"),  # an early restore's load_back
    # a parked session's request is admitted: sglang's init_load_back loads the evicted path, or (no
    # room) the request recomputes it and the protection simply goes
    ("admit", ("CpuProtected", "CpuUnprotected"), "Loading"),
    ("admit", "CpuProtected", "CpuUnprotected"),
    ("close", "CpuProtected", "CpuUnprotected"),  # close released the protection
    ("tree_reset", ("GPU", "CpuProtected", "CpuUnprotected"), "Evicted"),  # nothing in flight (is_fully_idle)
)


class _DestIs:
    """Row condition: the caller asked for this destination (or did not say)."""

    __slots__ = ("dest",)

    def __init__(self, dest: str) -> None:
        self.dest = dest

    def __call__(self, event: Any) -> bool:
        target = getattr(event.model, "target", None)
        return target is None or target == self.dest


def _expand(table: Iterable[Row]) -> list[tuple[str, str, str]]:
    """(trigger, source, dest) rows with tuples of sources/destinations expanded."""
    out = []
    for trigger, source, dest in table:
        for src in [source] if isinstance(source, str) else source:
            for dst in [dest] if isinstance(dest, str) else dest:
                out.append((trigger, src, dst))
    return out


def relation(table: Iterable[Row]) -> set[tuple[str, str, str]]:
    """The table as a set of (source, dest, trigger) triples — the form the spec comparison uses."""
    return {(src, dst, trigger) for trigger, src, dst in _expand(table)}


def _rows(table: Iterable[Row]) -> list[dict[str, Any]]:
    return [
        {"trigger": trigger, "source": src, "dest": dst, "conditions": [_DestIs(dst)]}
        for trigger, src, dst in _expand(table)
    ]


def _machine(states: tuple[str, ...], table: Iterable[Row]) -> Machine:
    return Machine(
        model=None,
        states=list(states),
        transitions=_rows(table),
        initial=states[0],
        auto_transitions=False,
        ignore_invalid_triggers=False,
        send_event=True,
    )


SESSION_MACHINE = _machine(SESSION_STATES, SESSION_TRANSITIONS)
_SESSION_REL = relation(SESSION_TRANSITIONS)


class IllegalTransition(AssertionError):
    """A move that the lifecycle table (and therefore the spec) does not allow: always a bug."""


def fire(model: Any, trigger: str, dest: str) -> None:
    """Move ``model.state`` to ``dest`` through ``trigger``, run by the session machine.

    The destination is chosen by the caller (the manager knows which branch of the spec action it
    is in); the table decides whether the move exists. Several rows share a trigger and source
    (``tool_start`` ends in Offloading or Offloaded), so every row carries the condition "the
    caller asked for my destination" and ``transitions`` runs the one that matches.
    """
    src = model.state
    model.target = dest
    try:
        ok = SESSION_MACHINE.events[trigger].trigger(model)
    except (MachineError, KeyError) as exc:
        raise IllegalTransition(f"{trigger}: {src} -> {dest} is not in the session lifecycle table") from exc
    finally:
        model.target = None
    if not ok or model.state != dest:
        raise IllegalTransition(f"{trigger}: {src} -> {dest} is not in the session lifecycle table")


@dataclass
class _TierModel:
    state: str


class TierMonitor:
    """Checks observed tier changes of nodes against ``TIER_TRANSITIONS`` (run on ``transitions``).

    Used by the fuzz campaign and the conformance replay, which know which action ran. An empty
    table (before the extraction ran) accepts everything.
    """

    def __init__(self, table: Iterable[Row] = TIER_TRANSITIONS) -> None:
        rows = list(table)
        self.enabled = bool(rows)
        self.rel = relation(rows)
        self.machine = _machine(TIER_STATES, rows) if rows else None

    def observe(self, action: str, before: Mapping[Any, str], after: Mapping[Any, str]) -> None:
        if self.machine is None:
            return
        for node, old in before.items():
            new = after.get(node, "Evicted")
            if old == new:
                continue
            model = _TierModel(old)
            try:
                self.machine.events[action].trigger(model)
            except (MachineError, KeyError) as exc:
                raise IllegalTransition(f"{action}: tier {old} -> {new} not in the tier table") from exc
            if (old, new, action) not in self.rel:
                raise IllegalTransition(f"{action}: tier {old} -> {new} not in the tier table")
