"""The call policies: what a tool call's ``tool_start`` does with the session's KV.

A call policy owns the decision among the spec's ``ToolStart``, ``Keep`` and ``LetGo`` and what is
done when the chosen action cannot be taken (its fallbacks); the session machine
(``toolkv.core.session.machine``) only takes the action it is told. One module of this package a
policy, named as the policy (its ``POLICY`` is the class; ``settings.POLICY_NAMES`` reads the names
off the folder): a new policy is one new file here. Two ship:

* ``offload.Offload`` — every tool call offloads (``ToolStart``), demoting offloaded sessions
  predicted back later when the host is full; a 507 when none can yield.
* ``auto.Auto`` — the per-call policy of ``toolkv.core.policy.decide`` (docs/policy.md): keep a
  short call's KV on the GPU when the device has spare room by the keep rule
  (``policy.keep_fits``), offload a long one with an early restore timed to its predicted return,
  let tiny or unaffordable KV go. Fallbacks: a keep whose path is not all resident offloads; an
  offload the host cannot take (nothing to demote) lets go.

Both remember the call (tool, start time, decision and reason) on the record, for the duration
model at tool_end and for kv_meta. Everything here is deterministic: it runs on every
tensor-parallel rank with the same inputs.
"""

from __future__ import annotations

import logging
from importlib import import_module
from typing import Protocol

from toolkv.core.phases import OFFLOADED
from toolkv.core.policy import Decision, keep_fits
from toolkv.core.record import SessionRecord
from toolkv.core.result import SessionView
from toolkv.core.session.machine import SessionMachine
from toolkv.core.settings import POLICY_NAMES, PolicyName
from toolkv.core.treeops import path_to

log = logging.getLogger("toolkv")


class CallPolicy(Protocol):
    """Decides and takes one tool call's ``tool_start`` on the session machine."""

    name: PolicyName

    def tool_start(self, session_id: str, tool: str | None, expected_s: float | None) -> SessionView:
        """``tool``/``expected_s`` are validated hints (the tool's name, the client's estimate)."""
        ...


class Calls:
    """What the policies share: noting the call on the record, and the keep rule's inputs."""

    name: PolicyName

    def __init__(self, machine: SessionMachine) -> None:
        self.m = machine

    def record(self, session_id: str) -> SessionRecord:
        """The open session's record, looked up and not checked: the id came in a
        ``toolkv.core.requests.ToolStart``, checked when it was built, and the machine's action
        checks its own argument. An id with no open record goes through the machine's ``_get``,
        which answers the refusal (unknown, or the closed session's record for its guard)."""
        rec = self.m.sessions.get(session_id)
        return rec if rec is not None else self.m._get(session_id)

    def note(self, rec: SessionRecord, tool: str | None, d: Decision) -> None:
        """Remember the tool call (for the duration model at tool_end) and the decision taken; arm
        the early restore an offload decision asked for (policy ``auto``, ``prefetch`` on)."""
        m = self.m
        rec.tool, rec.tool_started_at, rec.call_open = tool, m.now, True
        rec.decision, rec.reason, rec.expected_s = d.action, d.reason, d.expected_s
        m.counters[f"decision_{d.action}"] += 1
        m.counters[f"reason_{rec.reason}"] += 1
        m._touch(rec)
        if d.prefetch_after_s is not None and m.config.prefetch and rec.state in OFFLOADED:
            m.timers.arm_prefetch(rec, m.now + d.prefetch_after_s)
        log.debug(
            "tool_start %s tool=%s decision=%s reason=%s expected=%.2fs",
            rec.session_id,
            tool,
            rec.decision,
            rec.reason,
            rec.expected_s,
        )

    def returns_at(self, tool: str | None, hint: float | None) -> float:
        """When the call is expected back: the client's hint, else the tool's median."""
        return self.m.now + (hint if hint is not None else self.m.durations.median(tool))


def keep_fits_now(m: SessionMachine, kv_tokens: int) -> bool:
    """The keep rule (``policy.keep_fits``) on the device as it is now, queued requests counted:
    whether pinning ``kv_tokens`` more leaves the policy's reserve free."""
    return keep_fits(m.pressure(), kv_tokens, m.config.policy_config.device_reserve)


def demote_for_room(m: SessionMachine, rec: SessionRecord) -> bool:
    """Whether a ``tool_start`` that finds the host full may demote other offloaded sessions to
    make room for this one: only when the device needs the room this session's KV holds (the keep
    rule, queued requests counted, says a pin of it would not fit).

    A demotion drops a protected host copy whose GPU copy is gone already: that session's next
    turn recomputes everything. It pays only if freeing this session's GPU copy lets queued or
    running requests in. When the device has room to spare, offloading this session buys nothing,
    while sglang's own cache would have kept both; then the call is refused as host-full instead
    (``HostMemoryFull``, nothing changed) and this session's KV stays on the GPU as sglang's
    evictable cache, as without toolkv. (The regime map found this: with a small host and few
    sessions, demotions made ``offload`` reuse less than stock.)

    With an L3 tier on, a victim is stored there, not dropped, and demotion is always allowed."""
    node = m._live_node(rec)
    if node is None:
        return True  # tool_start raises SessionKVLost before it looks at the host
    if m._storage_on():
        return True  # with an L3 tier a victim is stored, not dropped: nothing is lost
    return not keep_fits_now(m, sum(len(n.key) for n in path_to(m.tree, node)))


def call_policies(machine: SessionMachine) -> dict[str, CallPolicy]:
    """Every call policy over ``machine``, by the name ``ManagerConfig.policy`` and a call's
    ``policy`` use: each module of this package (``POLICY_NAMES``) gives its ``POLICY``."""
    policies: dict[str, CallPolicy] = {}
    for name in POLICY_NAMES:
        cls = getattr(import_module(f"{__name__}.{name}"), "POLICY", None)
        if cls is None:
            raise TypeError(
                f"toolkv/core/calls/{name}.py defines no POLICY: the class of the call policy {name!r}"
            )
        policy: CallPolicy = cls(machine)
        assert policy.name == name, f"toolkv/core/calls/{name}.py's POLICY is named {policy.name!r}"
        policies[name] = policy
    return policies
