"""ToolKVManager: the front door to toolkv's session machine, as the scheduler and the HTTP routes
see it.

The layers under it, each in its own module:

* ``toolkv.core.session.machine`` — :class:`SessionMachine`, ``spec/ToolKV.tla``'s manager actions,
  one method per action named as the spec's (``ToolStart`` → ``tool_start``), each with its
  ``can_<action>`` guard on the part that holds it (copies, loads, hand-over, policy, and
  ``toolkv.core.session.l3``, the L3 sub-machine of ``spec/storage/StorageTier.tla``);
* ``toolkv.core.calls`` — the call policies (one module each: ``offload``, ``auto``) that decide what a tool call's
  ``tool_start`` does (spec ``ToolStart``, ``Keep`` or ``LetGo``) and own its fallbacks;
* ``toolkv.core.timers`` — the TTL, idle and early-restore heaps;
* ``toolkv.core.capabilities`` — what the backend can do beyond ``Backend``, checked once;
* ``toolkv.core.result`` — :class:`SessionView`, the typed answer about one session.

The manager routes: :meth:`tool_start` (the HTTP tool_start, with its hints) to the call policy of
the call, and the spec's other actions to the machine's method of the same name (:meth:`tick`,
once per scheduler iteration, is the machine's ``tick``; :meth:`set_clock`, the bare ``Tick``
step, its ``set_clock``). It is also the edge where a session's typed answer
(:class:`SessionView`, what the machine and the call policies return) becomes the JSON object the
HTTP routes, the drivers and their reports have always read (``SessionView.as_dict``, byte for
byte the object the manager used to build by hand); :meth:`view` answers the typed one. One
vocabulary from here down: the manager's names are the machine's, which are the spec's
(``insert`` is ``Insert``, ``admit`` is ``Admit``, ``tree_reset`` is ``TreeReset``), but for
``tool_start``, which is the call policy's choice among ``ToolStart``, ``Keep`` and ``LetGo``
(``offload`` is the machine's ``tool_start`` alone).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from typing import ClassVar

from toolkv.core.backends.base import Agreement, Backend, LocalAgreement
from toolkv.core.calls import CallPolicy, call_policies, keep_fits_now
from toolkv.core.capabilities import Capabilities
from toolkv.core.config import POLICIES, ManagerConfig
from toolkv.core.phases import IDLE
from toolkv.core.policy import DurationModel
from toolkv.core.record import SessionRecord
from toolkv.core.requests import ToolStart
from toolkv.core.result import SessionView
from toolkv.core.session.copies import Demote
from toolkv.core.session.machine import SessionMachine
from toolkv.core.treeops import Tree

__all__ = ["IDLE", "POLICIES", "ManagerConfig", "SessionView", "ToolKVManager", "make_backend"]


class ToolKVManager:
    """Tracks sessions and moves their KV between tiers through a :class:`Backend`."""

    #: the session machine this manager drives (the seeded defects of ``verify.toolkv.mutants``
    #: are machines with one method put back wrong)
    machine_class: ClassVar[type[SessionMachine]] = SessionMachine

    def __init__(
        self,
        tree: Tree,
        backend: Backend | None = None,
        *,
        config: ManagerConfig | None = None,
        agree: Agreement | None = None,
    ) -> None:
        config = config or ManagerConfig()
        agree = agree or LocalAgreement()
        if backend is None:
            backend = make_backend(tree, config=config, agree=agree)
        self.machine = self.machine_class(tree, backend, config=config, agree=agree)
        self.calls: dict[str, CallPolicy] = call_policies(self.machine)
        assert set(self.calls) == set(POLICIES), "a call policy per name ManagerConfig accepts"

    # ---- state, read through to the machine ------------------------------------------------------------
    @property
    def config(self) -> ManagerConfig:
        return self.machine.config

    @config.setter
    def config(self, value: ManagerConfig) -> None:
        self.machine.config = value

    @property
    def on_demote(self) -> Callable[[str], None]:
        """Called with each session demoted inside another call (see ``MachineState.on_demote``)."""
        return self.machine.on_demote

    @on_demote.setter
    def on_demote(self, value: Callable[[str], None]) -> None:
        self.machine.on_demote = value

    @property
    def queued_demand(self) -> Callable[[], int]:
        """Device tokens queued requests will need (the scheduler binds sglang's waiting queue)."""
        return self.machine.queued_demand

    @queued_demand.setter
    def queued_demand(self, value: Callable[[], int]) -> None:
        self.machine.queued_demand = value

    @property
    def agree(self) -> Agreement:
        return self.machine.agree

    @property
    def tree(self) -> Tree:
        return self.machine.tree

    @property
    def backend(self) -> Backend:
        return self.machine.backend

    @property
    def caps(self) -> Capabilities:
        return self.machine.caps

    @property
    def sessions(self) -> dict[str, SessionRecord]:
        return self.machine.sessions

    @property
    def counters(self) -> Counter[str]:
        return self.machine.counters

    @property
    def now(self) -> float:
        return self.machine.now

    @property
    def tree_gen(self) -> int:
        return self.machine.tree_gen

    @property
    def durations(self) -> DurationModel:
        return self.machine.durations

    @property
    def restore_rate(self) -> float:
        return self.machine.restore_rate

    @property
    def _closed(self) -> OrderedDict[str, SessionRecord]:
        """Closed sessions still answered (for the verification tools and tests)."""
        return self.machine._closed

    # what is in flight, by step (the drivers' leak checks and the tests read them)
    @property
    def _offloading(self) -> dict[str, SessionRecord]:
        return self.machine._offloading

    @property
    def _restoring(self) -> dict[str, SessionRecord]:
        return self.machine._restoring

    @property
    def _prefetching(self) -> dict[str, SessionRecord]:
        return self.machine._prefetching

    @property
    def _handover(self) -> dict[str, SessionRecord]:
        return self.machine._handover

    @property
    def _storing(self) -> dict[str, SessionRecord]:
        return self.machine._storing

    @property
    def _fetching(self) -> dict[str, SessionRecord]:
        return self.machine._fetching

    # ---- tool_start: the call policy's choice among ToolStart, Keep and LetGo --------------------------
    def tool_start(
        self,
        session_id: str,
        *,
        tool: str | None = None,
        expected_s: float | None = None,
        policy: str | None = None,
    ) -> dict[str, object]:
        """The HTTP tool_start. ``tool`` (the tool's name) and ``expected_s`` (the client's own
        estimate) are optional hints the policy learns from and uses; with ``policy="offload"``
        every call offloads. ``policy`` overrides the configured policy for this call (one server
        can serve agents of both policies, e.g. to compare them interleaved on one load). The
        arguments are checked once, as the :class:`~toolkv.core.requests.ToolStart` they make."""
        asked = {"session_id": session_id, "tool": tool, "expected_s": expected_s, "policy": policy}
        return self.start(ToolStart.from_body({k: v for k, v in asked.items() if v is not None}))

    def start(self, req: ToolStart) -> dict[str, object]:
        """Run the tool_start ``req`` under its call policy (the server's when it names none).
        Checks nothing: the request checked itself when it was built."""
        policy = req.policy or self.config.policy
        return self.calls[policy].tool_start(req.session_id, req.tool, req.expected_s).as_dict()

    def keep_fits(self, kv_tokens: int) -> bool:
        """The keep rule on the device as it is now: whether pinning ``kv_tokens`` more leaves the
        policy's reserve free after promised and queued tokens (kv_hints' ``retain`` asks)."""
        return keep_fits_now(self.machine, kv_tokens)

    # ---- the spec's actions ------------------------------------------------------------------------------
    def insert(self, session_id: str, tokens: Sequence[int], extra_key: str | None = None) -> None:
        """Spec ``Insert``: a turn of the session finished and its KV landed in the tree."""
        self.machine.insert(session_id, tokens, extra_key)

    def offload(
        self, session_id: str, *, demote: Demote = False, returns_at: float = float("inf")
    ) -> dict[str, object]:
        """Spec ``ToolStart`` without a call policy (the conformance replay's step): the machine's
        ``tool_start`` (the manager's :meth:`tool_start` is the call policy's)."""
        return self.machine.tool_start(session_id, demote=demote, returns_at=returns_at).as_dict()

    def keep(self, session_id: str) -> dict[str, object]:
        """Spec ``Keep``: pin the session's resident path on the GPU until tool_end or the TTL."""
        return self.machine.keep(session_id).as_dict()

    def let_go(self, session_id: str) -> dict[str, object]:
        """Spec ``LetGo``: hold nothing for this tool call; it still gets an epoch for tool_end."""
        return self.machine.let_go(session_id).as_dict()

    def demote(self, session_id: str) -> dict[str, object]:
        """Spec ``Demote``: release an offloaded session's host protection."""
        return self.machine.demote(session_id).as_dict()

    def store(self, session_id: str) -> dict[str, object]:
        """StorageTier.tla's ``Store`` of an offloaded session's host copy to L3."""
        return self.machine.store(session_id).as_dict()

    def prefetch(self, session_id: str) -> dict[str, object]:
        """Spec ``Prefetch``: the early restore of an offloaded session."""
        return self.machine.prefetch(session_id).as_dict()

    def tool_end(self, session_id: str, epoch: int) -> dict[str, object]:
        """Spec ``ToolEnd`` of the tool call ``epoch``."""
        return self.machine.tool_end(session_id, epoch).as_dict()

    def park(self, session_id: str, epoch: int) -> dict[str, object]:
        """Spec ``Park`` as an explicit call."""
        return self.machine.park(session_id, epoch).as_dict()

    def unpin(self, session_id: str) -> dict[str, object]:
        """Spec ``Unpin`` of one hand-over, as an explicit call."""
        return self.machine.unpin(session_id).as_dict()

    def admit(self, session_id: str) -> bool:
        """Spec ``Admit``: the session's next request was admitted (True: a hand-over ended)."""
        return self.machine.admit(session_id)

    def close(self, session_id: str) -> dict[str, object]:
        """Spec ``Close``."""
        return self.machine.close(session_id).as_dict()

    def routed_away(self) -> None:
        """The router sends this server nothing new (a fleet's drain: its sessions' next calls
        reach other servers; not the operator's ``/session/drain``, where they still come here):
        from the next tick it lets go of its sessions, handing over what the shared tier holds
        whole (SharedTier.tla's ``LetGo``)."""
        self.machine.routed_away()

    def tree_reset(self) -> None:
        """Spec ``TreeReset``: the tree was replaced (flush_cache)."""
        self.machine.tree_reset()

    def set_clock(self, now: float) -> None:
        """Spec ``Tick`` as the bare step: the agreed clock moves to ``now``."""
        self.machine.set_clock(now)

    def write_ack(self) -> int:
        """Spec ``WriteAck`` of every offload whose writes are acknowledged."""
        return self.machine.write_ack()

    def load_ack(self) -> int:
        """Spec ``LoadAck`` of every load that is acknowledged."""
        return self.machine.load_ack()

    def process_storage_acks(self) -> int:
        """StorageTier.tla's ``StoreAck`` and ``PrefetchAck`` of what is in flight."""
        return self.machine.process_storage_acks()

    def run_prefetches(self) -> int:
        """The early restores that are due (policy ``auto``)."""
        return self.machine.run_prefetches()

    def unpin_for_room(self) -> int:
        """Spec ``Unpin`` of hand-overs whose pins queued requests need."""
        return self.machine.unpin_for_room()

    def ttl_sweep(self) -> int:
        """Spec ``TtlSweep``."""
        return self.machine.ttl_sweep()

    def forget_idle(self) -> int:
        """Spec ``Close`` of sessions idle for ``idle_ttl_s`` that hold nothing."""
        return self.machine.forget_idle()

    def tick(self, now: float) -> None:
        """Once per scheduler iteration, after sglang processed its acks: spec ``Tick``, then every
        enabled manager action. ``now`` must already be agreed across ranks."""
        self.machine.tick(now)

    # ---- kv_meta --------------------------------------------------------------------------------------
    def view(self, session_id: str) -> SessionView:
        """The session as a typed :class:`SessionView` (open or closed)."""
        return self.machine.view(self.machine._get(session_id))

    def kv_meta(self, session_id: str | None = None) -> dict[str, object]:
        """The HTTP kv_meta: one session's :class:`SessionView` as its JSON object, or (no
        ``session_id``) the server's summary."""
        m = self.machine
        if session_id is not None:
            return self.view(session_id).as_dict()
        states = Counter(r.state for r in m.sessions.values())
        return {
            "backend": m.backend.name,
            "sessions": len(m.sessions),
            "states": dict(states),
            "now": m.now,
            "counters": dict(m.counters),
            "policy": m.config.policy,
            "restore_tokens_per_s": m.restore_rate,
            "tools": m.durations.snapshot(),
        }


def make_backend(
    tree: Tree,
    *,
    config: ManagerConfig,
    agree: Agreement,
    fallback: str = "pin",
) -> Backend:
    """Chosen from the tree type: UnifiedRadixCache (sglang 0.5.21+) → host offload with its own
    primitives; HiRadixCache → host offload; plain RadixCache → GPU pin (default) or shadow copy."""
    from toolkv.core.backends.unified import UnifiedBackend, is_unified_tree

    if is_unified_tree(tree):  # checked first: it also has cache_controller and load_back
        from toolkv.core.treeops import handle_tree

        if handle_tree(tree):  # sglang 0.5.23's default Rust tree core: node handles only
            from toolkv.core.backends.unified_rust import RustUnifiedBackend

            return RustUnifiedBackend(
                tree, agree=agree, host_budget_tokens=config.host_budget_tokens, unmirror=config.unmirror
            )
        # raises Unsupported (with the fix) for a tree it cannot drive
        return UnifiedBackend(
            tree, agree=agree, host_budget_tokens=config.host_budget_tokens, unmirror=config.unmirror
        )
    if hasattr(tree, "cache_controller") and hasattr(tree, "load_back"):
        from toolkv.core.backends.hiradix import HiRadixBackend

        return HiRadixBackend(
            tree, agree=agree, host_budget_tokens=config.host_budget_tokens, unmirror=config.unmirror
        )
    if fallback == "shadow":
        from toolkv.core.backends.shadow import ShadowBackend

        return ShadowBackend(tree, agree=agree, budget_tokens=config.host_budget_tokens)
    from toolkv.core.backends.pin import PinBackend

    return PinBackend(tree, agree=agree, budget_tokens=config.host_budget_tokens)
