"""Hypothesis stateful testing of ToolKVManager on the REAL sglang HiRadixCache.

Every rule is one spec action (``spec/ToolKV.tla``) executed through
:class:`toolkv.verify.toolkv.conformance.Replayer` in *real-capacity* mode: the pools are sized small and filled
by other requests, so "host full at write" and "no device memory at restore" happen when sglang's
real pools say so. Rules cover sessions and turns with shared prefixes, other requests locking and
unlocking prefixes, tool_start, tool_end with current and stale epochs, write and load acks (in the
order sglang retires them), GPU and host eviction, memory pressure, the clock and the TTL sweep,
node splits, tree resets and close.

After every step:

* step-level refinement: the implementation's state equals the spec's successor of its previous
  state for that action and parameters (``specstep.successor``; e.g. exactly the nodes a write
  acknowledgement frees), with the capacity decision the implementation took as the oracle — a
  step that breaks no invariant but is not a spec step fails here;
* the spec's invariants and step properties on the refinement mapping (``refinement.py``);
* sglang's own accounting: allocator + evictable == capacity when nothing is locked, host pool
  slots == host copies in the tree (no orphan), ``host_ref_counter`` == protections held;
* KV integrity: every device copy that is not loading and every host copy whose write is
  acknowledged holds exactly the bytes computed for its tokens (``harness.expected_kv``), with
  every unreferenced device slot scribbled over first, so a premature read or an early free shows.

At teardown every session is closed and all memory drained: every counter returns to its initial
value — unless a check already failed in this example: then teardown only frees the stack, so the
report names the first violation, not the leak that follows from it. Per-example action counts
and KV bytes checked are Hypothesis ``event``s (``--hypothesis-show-statistics``; ``toolkv fuzz``
sums them through Hypothesis's observability callbacks). Each step can be written to an
action-level JSONL trace for ``toolkv trace-check``.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, ClassVar

import torch
from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from toolkv.core.treeops import attached
from toolkv.verify.toolkv.refinement import NO_NODE, ROOT, Bounds, check_refinement_step, spec_successor
from toolkv.verify.toolkv.world import Replayer, StepResult, Unrealizable, _drain

SESSIONS = ("s1", "s2", "s3")
OPTIONAL = frozenset(
    {
        "lock",
        "unlock",
        "gpu_evict",
        "host_evict",
        "write_through",
        "split",
        "memory_pressure",
        "tree_reset",
        "close",
        "keep",
        "let_go",
        "demote",
        "prefetch",
        "tool_end_promised",
        "park",
        "unpin",
        "promise",
    }
)

# the optional actions that do something only on an offloaded session
_NEED_OFFLOADED = frozenset({"demote", "prefetch", "tool_end_promised", "park"})


def _depth(st: dict[str, Any], n: str) -> int:
    """How far ``n`` is below the root in ``st`` (leaves first = deepest first)."""
    k = 0
    while n != ROOT:
        n, k = st["parent"][n], k + 1
    return k


# the spec's manager actions (and the manager's tick): each must keep sglang's promise of device room
MANAGER_STEPS = frozenset(
    {"ToolStart", "ToolEnd", "Keep", "LetGo", "Demote", "Prefetch", "Park", "Unpin", "Close", "TtlSweep",
     "StartLoads", "HostRoom", "HostUnmirror", "WriteAck", "LoadAck", "Tick"}
)  # fmt: skip


class FuzzFailure(AssertionError):
    """An invariant, accounting or integrity check failed (the message says which)."""


UNBORN: dict[str, Any] = {
    "status": "Unborn", "parent": ROOT, "dev": False, "host": False, "lockRef": 0, "hostRef": 0,
    "writeKey": NO_NODE, "loadKey": NO_NODE, "loadAcks": 0, "extLock": False,
}  # fmt: skip
BIG = 10**6  # "unbounded" spec constants: the real pools bound the campaign, not node slots


class ToolKVMachine(RuleBasedStateMachine):
    """Configured by subclassing (``machine_class``): caveats, environment defects, device, trace."""

    caveats: ClassVar[frozenset[str]] = frozenset()
    env_bugs: ClassVar[frozenset[str]] = frozenset()
    device: ClassVar[str] = "cpu"
    io_backend: ClassVar[str] = "direct"
    page_size: ClassVar[int] = 1
    trace_dir: ClassVar[Path | None] = None
    ttl: ClassVar[int] = 4
    keep_ttl: ClassVar[int] = 2  # spec KeepTTL: a kept pin is due before a host protection
    policy: ClassVar[str] = "offload"  # "auto": tool_start is the per-call policy's choice
    lazy_free: ClassVar[bool] = False  # spec LazyFree: finished offloads leave their GPU copies
    # spec Unmirror: a tool_start short of host room drops mirrors of locked device copies (the
    # plugin's default, TOOLKV_UNMIRROR=1; HiRadixCache under write_through)
    unmirror: ClassVar[bool] = True
    examples: ClassVar[int] = 0  # examples built by this class (names the trace files)

    def __init__(self) -> None:
        super().__init__()
        type(self).examples += 1
        self.example = type(self).examples
        self.steps = 0
        self.counts: dict[str, int] = {}
        self.bytes_checked = 0
        self.failed = False
        self.bounds = Bounds(
            nodes=(),
            sessions=SESSIONS,
            dev_slots=BIG,
            host_slots=BIG,
            max_time=BIG,
            ttl=self.ttl,
            max_epoch=BIG,
            max_resets=BIG,
            policy=True,
            lazy_free=self.lazy_free,
            keep_ttl=self.keep_ttl,
            unmirror=self.unmirror,
        )
        unit = 4 * max(16, self.page_size)
        self._pending_before: dict[str, str] = {}  # AdmitLoading admissions before the step (_do)
        self.r = Replayer(
            self.bounds,
            caveats=self.caveats,
            env_bugs=self.env_bugs,
            page_size=self.page_size,
            capacity="real",
            device_tokens=14 * unit,
            host_ratio=1.0,
            device=self.device,
            io_backend=self.io_backend,
            ttl=self.ttl,
            seed=self.example,
            # on a GPU: a shape sgl-kernel's transfer kernels accept, in bf16 as served models are
            kv_shape=(2, 2, 4) if self.device == "cpu" else (2, 2, 64),
            dtype=torch.float32 if self.device == "cpu" else torch.bfloat16,
            policy=self.policy,
        )
        self.initial = self.r.h.accounting()
        self.names = 0
        self.ballast_dev: list[torch.Tensor] = []
        self.ballast_host: list[torch.Tensor] = []
        self.state = self.r.abstract()
        self.trace: list[dict[str, Any]] = []
        self._swarm: list[str] | None = None
        # sglang's promise of device room (spec Promised, in tokens here): what it will allocate
        # without asking again, which every manager step must leave free or evictable (PromiseKept)
        self.promised = 0
        if hasattr(self.r.mgr.backend, "headroom"):
            self.r.mgr.backend.headroom = lambda: self.promised
        if self.trace_dir is not None:
            self.trace.append({"act": ["Init"], "fits": True, "state": self.state})

    # ---- executing one spec action --------------------------------------------------------------
    def _room(self) -> int:
        """Free + evictable device tokens, as sglang's prefill budget reads them."""
        h = self.r.h
        return int(h.allocator.available_size()) + int(h.tree.evictable_size())

    def _do(self, act: list[Any]) -> StepResult | None:
        pre = self.state
        room = self._room()
        self._pending_before = dict(getattr(self.r, "pending_admits", {}))
        try:
            res = self.r.apply(act, pre)
        except Unrealizable:  # sglang's world refused the step (e.g. no memory for the turn)
            self.state = self.r.abstract()
            return None
        assert res.post is not None
        if str(act[0]) in MANAGER_STEPS and room >= self.promised > self._room():
            self._fail(
                f"{act}: PromiseKept violated: sglang promised {self.promised} device tokens, the step left "
                f"{self._room()} free + evictable (before it: {room})"
            )
        self.state = res.post
        self.steps += 1
        key = str(act[0]) + (f"!{res.error}" if res.error else "")
        self.counts[key] = self.counts.get(key, 0) + 1
        if res.violations:
            self._fail(f"{act}: spec properties violated on the refinement mapping: {res.violations}")
        for x in self._pending_before:
            if pre["phase"][x] == "Restoring" and self.state["phase"][x] == "Handover":
                self._fail(
                    f"{act}: {x}'s request was admitted while its load was in flight, yet the load ack "
                    "left the hand-over's pin in place (it ends only at a later request or the TTL)"
                )
        steps = self._spec_steps(pre, act)
        if not steps and self.state != pre:
            self._fail(f"{act} is no spec step, yet it changed {self._changed(pre)}")
        mid = pre
        for i, a in enumerate(steps):
            last = i == len(steps) - 1
            want = self.state if last else spec_successor(mid, a, self.bounds, fits=res.fits, slots=False)
            mismatch = check_refinement_step(mid, want, a, self.bounds, fits=res.fits, slots=False)
            if mismatch:
                self._fail(f"{act} is not a spec step: (spec successor, implementation) differ in {mismatch}")
            if self.trace_dir is not None:
                self.trace.append({"act": a, "fits": res.fits, "state": want, "error": res.error})
            mid = want
        return res

    def _changed(self, pre: dict[str, Any]) -> list[str]:
        return sorted(k for k, v in self.state.items() if pre.get(k) != v)

    def _spec_steps(self, pre: dict[str, Any], act: list[Any]) -> list[list[Any]]:
        """:meth:`_spec_steps_of`, then the spec's ``Admit`` of each session whose request was
        admitted while its load was in flight (``AdmitLoading``, a stutter itself) and whose
        load ack in this step ended the hand-over at once: ``LoadAck``, then ``Admit``."""
        if act[0] == "AdmitLoading":
            return []
        admits = [
            ["Admit", x] for x in sorted(self._pending_before)
            if pre["phase"][x] == "Restoring" and self.state["phase"][x] == "Runnable"
        ]  # fmt: skip
        return [*self._spec_steps_of(pre, act), *admits]

    def _spec_steps_of(self, pre: dict[str, Any], act: list[Any]) -> list[list[Any]]:
        """The spec steps one implementation step stands for. sglang starts every queued load in
        one transfer (``start_loading`` merges the queue), so one load ack can complete the loads
        of several keys at once: that is the spec's ``LoadAck`` of each of them, in a row (they
        commute). A ``ToolEnd`` that found the device full of unlocked cache made room with sglang's
        own ``evict`` first: that is the environment's ``GpuEvict`` of each evicted node, children
        first, then the ``ToolEnd`` (an early restore, ``Prefetch``, makes room the same way).
        A ``ToolStart`` that found the host short of free room had sglang's ``evict_host`` free
        unprotected host copies first: that is the manager's ``HostRoom`` of each freed node,
        leaves first; still short, it dropped mirrors of locked device copies: ``HostUnmirror``
        of each, leaves first. Every other action is one spec step."""
        if act[0] == "ToolStart":
            s = str(act[1])
            post_phase = self.state["phase"]
            # the policy's choice (auto): a kept session is spec Keep, a let-go one LetGo; the
            # sessions it demoted for room are Demote steps first (predicted back last, first)
            main: list[Any] = list(act)
            if pre["phase"][s] == "Running" and post_phase[s] == "Kept":
                main = ["Keep", s]
            elif pre["phase"][s] == "Running" and post_phase[s] == "Released":
                main = ["LetGo", s]
            demoted = [
                x for x in SESSIONS
                if x != s and pre["phase"][x] == "Offloaded" and post_phase[x] == "Released"
            ]  # fmt: skip
            rooms = [["HostRoom", s, n] for n in self._host_evicted(pre)]
            mirrors = [["HostUnmirror", s, n] for n in self._host_unmirrored(pre)]
            # each Demote releases one session's protection: they commute
            return [*(["Demote", x] for x in sorted(demoted)), *rooms, *mirrors, main]
        if act[0] == "WriteThrough":
            # sglang's write_backup frees host room itself when the pool is full (evict_host of
            # unprotected host leaves, hiradix_cache.py write_backup): the environment's HostEvict
            # of each freed node, leaves first, then the write
            return [*(["HostEvict", n] for n in self._host_evicted(pre)), act]
        if act[0] in ("ToolEnd", "Prefetch"):
            post = self.state
            gone = [n for n, d in pre["dev"].items() if d and not post["dev"].get(n, False)]

            return [*(["GpuEvict", n] for n in sorted(gone, key=lambda n: _depth(pre, n), reverse=True)), act]
        if act[0] != "LoadAck":
            return [act]
        done = [
            k for k, n in pre["loadAcks"].items()
            if k != act[1] and n > 0 and self.state["loadAcks"].get(k, 0) < n
        ]  # fmt: skip
        return [act, *(["LoadAck", k] for k in sorted(done))]

    def _host_evicted(self, pre: dict[str, Any]) -> list[str]:
        """Nodes whose host copy left the tree in the last step, leaves first."""
        post = self.state
        gone = [
            n
            for n, h in pre["host"].items()
            if h and not post["host"].get(n, False) and post["status"].get(n) == "Gone"
        ]
        return sorted(gone, key=lambda n: _depth(pre, n), reverse=True)

    def _host_unmirrored(self, pre: dict[str, Any]) -> list[str]:
        """Nodes that lost their host copy in the last step but stay in the tree on the device
        (a dropped mirror), leaves first."""
        post = self.state
        dropped = [
            n
            for n, h in pre["host"].items()
            if h
            and not post["host"].get(n, False)
            and post["status"].get(n) == "InTree"
            and post["dev"].get(n)
        ]
        return sorted(dropped, key=lambda n: _depth(pre, n), reverse=True)

    def _fresh_node(self) -> str:
        """A new spec node name, Unborn in the current state (the spec's functions range over it)."""
        self.names += 1
        name = f"n{self.names}"
        self.bounds = dataclasses.replace(self.bounds, nodes=(*self.bounds.nodes, name))
        self.r.b = self.bounds
        for var, v in UNBORN.items():
            self.state[var] = {**self.state[var], name: v}
        return name

    def _fail(self, message: str) -> None:
        self.failed = True
        raise FuzzFailure(message)

    def _in_tree(self) -> list[str]:
        return [n for n in self.bounds.nodes if self.state["status"][n] == "InTree"]

    def _path_valid(self, n: str) -> bool:
        s = self.state
        while n != ROOT:
            if s["status"][n] != "InTree" or not s["dev"][n] or s["loadKey"][n] != NO_NODE:
                return False
            n = s["parent"][n]
        return True

    def _biased(self, phases: tuple[str, ...]) -> list[str]:
        """Sessions in ``phases`` three times over, then every session once: calls that can make
        progress are likely, calls that must be refused still happen."""
        hot = [x for x in SESSIONS if self.state["phase"][x] in phases]
        return hot * 3 + list(SESSIONS)

    def _kids(self, n: str) -> list[str]:
        return [c for c in self._in_tree() if self.state["parent"][c] == n]

    # ---- the one rule: draw a spec action by weight, then its parameters ----------------------------
    WEIGHTS: ClassVar[dict[str, int]] = {
        "insert": 6, "tool_start": 5, "tool_end": 5, "write_ack": 4, "load_ack": 4, "tick": 4, "close": 1,
        "lock": 2, "unlock": 2, "gpu_evict": 2, "host_evict": 2, "write_through": 2, "split": 2,
        "memory_pressure": 4, "tree_reset": 1, "keep": 2, "let_go": 1, "demote": 2, "prefetch": 2,
        "tool_end_promised": 2, "admit": 3, "park": 2, "unpin": 1, "promise": 2,
    }  # fmt: skip
    _CHOICES: ClassVar[list[str]] = [a for a, w in WEIGHTS.items() for _ in range(w)]

    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        """One environment or manager step, drawn by weight (swarm-style: weights keep deep
        sequences likely — offload, ack, restore, ack — while every action stays reachable)."""
        if self._swarm is None:
            # Swarm testing: each example leaves out a random subset of the optional actions, so
            # some examples are dense in, say, memory pressure and restores while others churn the
            # tree. Hypothesis shrinks the subset towards the core actions.
            # Each optional action is in with probability 1/2 (a frozenset of them would hold only a
            # few: Hypothesis keeps collections small), and shrinks to out.
            names = sorted(OPTIONAL)
            on = data.draw(st.tuples(*(st.booleans() for _ in names)), label="swarm")
            keep = {a for a, b in zip(names, on, strict=True) if b}
            self._swarm = [a for a in self._CHOICES if a not in OPTIONAL or a in keep]
        boost = self._boosted()
        # (a boosted action comes in even where the example's swarm left it out: the state that
        # makes it interesting is rare enough)
        choices = self._swarm + [a for a in self._CHOICES if a in boost] * 3
        action = data.draw(st.sampled_from(choices), label="action")
        try:
            getattr(self, action)(data)
        except Exception:
            self.failed = True
            raise

    def _boosted(self) -> frozenset[str]:
        """Actions four times as likely in this state: the ones whose interesting case needs a
        short-lived state that exists now. An offloaded session (the next tool_end restores it) is
        what every policy call and a refused restore need; a restoring one (until its load ack) is
        what a retried tool_end needs (caveat 2) and an admission while loading; a backed-up, unlocked device leaf is what a GPU
        eviction needs to leave a host copy behind (caveat 3)."""
        out: set[str] = set()
        phases = set(self.state["phase"].values())
        if "Offloaded" in phases:
            out |= _NEED_OFFLOADED
        if "Restoring" in phases:
            out.add("tool_end")
            if self._admits_while_loading():
                out.add("admit")  # a request admitted while it loads
        if any(self.state["host"][n] for n in self._gpu_evictable()):
            out.add("gpu_evict")
        return frozenset(out)

    def _gpu_evictable(self) -> list[str]:
        """Device leaves sglang may evict: unlocked, no transfer in flight, no device child."""
        s = self.state
        return [
            n for n in self._in_tree()
            if s["dev"][n] and s["lockRef"][n] == 0 and s["writeKey"][n] == NO_NODE and s["loadKey"][n] == NO_NODE
            and not any(s["dev"][k] for k in self._kids(n))
        ]  # fmt: skip

    # ---- actions: sessions and the manager ----------------------------------------------------------
    def insert(self, data: st.DataObject) -> None:
        """A turn of session s finishes; its new leaf lands under a readable node (shared prefix)."""
        s = data.draw(st.sampled_from(SESSIONS), label="session")
        if self.state["phase"][s] not in ("New", "Running", "Runnable", "Expired", "Lost", "Released"):
            return
        parents = [ROOT] + [n for n in self._in_tree() if self._path_valid(n)]
        p = data.draw(st.sampled_from(parents), label="parent")
        n = self._fresh_node()
        self._do(["Insert", s, p, n])

    def tool_start(self, data: st.DataObject) -> None:
        """tool_start, mostly on a Running session (on others it must be refused)."""
        s = data.draw(st.sampled_from(self._biased(("Running",))), label="session")
        self._do(["ToolStart", s])

    def tool_end(self, data: st.DataObject) -> None:
        """tool_end with the current epoch, or a stale one; mostly on offloaded sessions."""
        s = data.draw(
            st.sampled_from(
                self._biased(
                    ("Offloaded", "Offloading", "Restoring", "Kept", "Prefetching", "Released", "Handover")
                )
                + [x for x in SESSIONS if self.state["phase"][x] == "Restoring"] * 3
            ),
            label="session",
        )
        delta = data.draw(st.sampled_from((0, 0, 0, -1, 1)), label="epoch delta")
        promisable = hasattr(self.r.mgr.backend, "headroom")
        # a third of the restores that could go ahead meet a device sglang has promised to
        # running requests: the refused restore (caveat 1) then comes up in most examples, not only
        # where the rarer tool_end_promised draw happens to find an offloaded session
        if (
            delta == 0
            and promisable
            and self.state["phase"][s] == "Offloaded"
            and data.draw(st.sampled_from((False, False, True)), label="device promised")
        ):
            self._promised(s)
            return
        self._do(["ToolEnd", s, max(0, self.state["epoch"][s] + delta)])
        # with TOOLKV_RESTORE_ON_REQUEST the request itself sent the restore: it may be admitted in
        # the next prefill batch while the load is still in flight
        if (
            self._admits_while_loading()
            and self.state["phase"][s] == "Restoring"
            and data.draw(st.booleans(), label="admitted while loading")
        ):
            self._admit_loading(s)

    def promise(self, data: st.DataObject) -> None:
        """sglang admits a request and promises it device tokens it will allocate without asking
        again (the rest of a chunked prefill): up to what is free or evictable now, as its
        admission counts the room live; 0 is the promise kept (the chunk allocated)."""
        self.promised = data.draw(st.integers(0, max(0, self._room())), label="promised")

    def tool_end_promised(self, data: st.DataObject) -> None:
        """tool_end while sglang has promised running requests every device token a restore could
        use (the rest of a chunked prefill, the decode budget: the backend's ``headroom``): the
        restore is refused (503, spec ``DevFits`` false) and must change nothing but the answer."""
        self._promised(data.draw(st.sampled_from(self._biased(("Offloaded",))), label="session"))

    def _promised(self, s: str) -> None:
        """``ToolEnd`` of ``s`` (current epoch) with every free or evictable device token promised."""
        be: Any = self.r.mgr.backend
        if not hasattr(be, "headroom"):
            return
        h = self.r.h
        promised = int(h.allocator.available_size()) + int(h.tree.evictable_size())
        be.headroom = lambda: promised
        try:
            self._do(["ToolEnd", s, self.state["epoch"][s]])
        finally:
            be.headroom = lambda: self.promised

    def close(self, data: st.DataObject) -> None:
        self._do(["Close", data.draw(st.sampled_from(SESSIONS), label="session")])

    # the per-call policy: each of tool_start's other choices, a demotion, an early restore
    # Drawn in any phase: where the spec does not enable the action, the call must be refused and
    # change nothing (the step check compares the state with the unchanged spec state).
    def keep(self, data: st.DataObject) -> None:
        """tool_start kept the KV on the GPU (spec Keep: only where the path is resident)."""
        self._do(["Keep", data.draw(st.sampled_from(self._biased(("Running",))), label="session")])

    def let_go(self, data: st.DataObject) -> None:
        self._do(["LetGo", data.draw(st.sampled_from(self._biased(("Running",))), label="session")])

    def demote(self, data: st.DataObject) -> None:
        self._do(["Demote", data.draw(st.sampled_from(self._biased(("Offloaded",))), label="session")])

    def prefetch(self, data: st.DataObject) -> None:
        """An early restore of an offloaded session, before its tool_end."""
        self._do(["Prefetch", data.draw(st.sampled_from(self._biased(("Offloaded",))), label="session")])

    def admit(self, data: st.DataObject) -> None:
        """The next request of a handed-over or parked session is admitted (it locks the prefix; a
        parked one's request loads it back through sglang's own load_back). Or of a session whose
        restore is still loading (Restoring): sglang matched the path being loaded and the batch
        waits for it; the spec has no step for that (``AdmitLoading``, a stutter), and the load ack
        must end the hand-over at once (spec ``LoadAck`` then ``Admit``; checked in :meth:`_do`)."""
        phases = (
            ("Handover", "Parked", "Restoring") if self._admits_while_loading() else ("Handover", "Parked")
        )
        s = data.draw(st.sampled_from(self._biased(phases)), label="session")
        n = self.state["ref"][s]
        if n == NO_NODE or self.state["extLock"][n]:
            return
        phase = self.state["phase"][s]
        if phase in ("Handover", "Parked"):
            self._do(["Admit", s])
        elif phase == "Restoring" and self._admits_while_loading():
            self._admit_loading(s)

    def _admits_while_loading(self) -> bool:
        """Whether this campaign draws admissions while loading: on a HiRadixCache without the
        copy ring (the ring's machine keeps its own draws: its coverage of LoadAck rests on them)."""
        return "AdmitLoading" in self.r.executors and self.r.b.ring == 0

    def _admit_loading(self, s: str) -> None:
        """``AdmitLoading`` of Restoring ``s`` (once; where the cache has the executor and the
        path is not held by another request)."""
        n = self.state["ref"][s]
        if self._admits_while_loading() and s not in self.r.pending_admits and not self.state["extLock"][n]:
            self._do(["AdmitLoading", s])

    def park(self, data: st.DataObject) -> None:
        """tool_end of an offloaded session whose request would wait (spec Park): nothing loaded."""
        s = data.draw(st.sampled_from(self._biased(("Offloaded", "Offloading"))), label="session")
        self._do(["Park", s, self.state["epoch"][s]])

    def unpin(self, data: st.DataObject) -> None:
        """Queued requests need the room a hand-over pins (spec Unpin)."""
        self._do(["Unpin", data.draw(st.sampled_from(self._biased(("Handover",))), label="session")])

    def write_ack(self, data: st.DataObject) -> None:
        """The copy engine finishes the oldest write; sglang retires it; the manager reacts."""
        self._ack("write")

    def load_ack(self, data: st.DataObject) -> None:
        self._ack("load")

    def _ack(self, which: str) -> None:
        ctrl = self.r.h.tree.cache_controller
        # the oldest started transfer, else (loads) the oldest queued one: its LoadAck starts it first
        q = ctrl.ack_write_queue if which == "write" else [*ctrl.ack_load_queue, *ctrl.load_queue]
        if not q:
            return
        by_real = {self.r.nodes.obj[n].id: n for n in self._in_tree()}
        name = by_real.get(q[0].node_ids[0])
        if name is None:
            return
        self._do(["WriteAck" if which == "write" else "LoadAck", name])

    def tick(self, data: st.DataObject) -> None:
        """One scheduler iteration's clock advance, then the sweep (as ``tick(now)`` does)."""
        self._do(["Tick"])
        self._do(["TtlSweep"])

    # ---- rules: the rest of sglang ------------------------------------------------------------------
    def lock(self, data: st.DataObject) -> None:
        """Another request matches a prefix and holds it while it runs."""
        held = set(self.r.pending_admits.values())  # an admitted request's path is its own
        c = [
            n
            for n in self._in_tree()
            if not self.state["extLock"][n] and self._path_valid(n) and n not in held
        ]
        if c:
            self._do(["Lock", data.draw(st.sampled_from(c), label="node")])

    def unlock(self, data: st.DataObject) -> None:
        c = [n for n in self.bounds.nodes if self.state["extLock"][n]]
        if c:
            self._do(["Unlock", data.draw(st.sampled_from(c), label="node")])

    def gpu_evict(self, data: st.DataObject) -> None:
        """sglang evicts a device leaf; mostly one with a host copy (sglang then keeps the node)."""
        c = self._gpu_evictable()
        c += [n for n in c if self.state["host"][n]] * 2
        if c:
            self._do(["GpuEvict", data.draw(st.sampled_from(c), label="node")])

    def host_evict(self, data: st.DataObject) -> None:
        s = self.state
        c = [
            n for n in self._in_tree()
            if s["host"][n] and not s["dev"][n] and not self._kids(n) and s["lockRef"][n] == 0
            and (s["hostRef"][n] == 0 or "EvictProtected" in self.caveats)
        ]  # fmt: skip
        if c:
            self._do(["HostEvict", data.draw(st.sampled_from(c), label="node")])

    def write_through(self, data: st.DataObject) -> None:
        s = self.state
        c = [
            n for n in self._in_tree()
            if s["dev"][n] and not s["host"][n] and s["loadKey"][n] == NO_NODE
            and (s["parent"][n] == ROOT or s["host"][s["parent"][n]])
        ]  # fmt: skip
        # mostly a device leaf: backed up and unlocked, it is what a GPU eviction keeps (caveat 3)
        c += [n for n in c if not any(s["dev"][k] for k in self._kids(n))] * 2
        if c:
            self._do(["WriteThrough", data.draw(st.sampled_from(c), label="node")])

    def split(self, data: st.DataObject) -> None:
        """A request diverges inside a node: sglang splits it (the suffix keeps its identity)."""
        ps = self.page_size
        c = [n for n in self._in_tree() if len(self.r.nodes.obj[n].key) >= 2 * ps]
        if c:
            n = data.draw(st.sampled_from(c), label="node")
            self._do(["Split", n, self._fresh_node()])

    def tree_reset(self, data: st.DataObject) -> None:
        """flush_cache: only on a fully idle scheduler (sglang's ``is_fully_idle``): no request runs
        (no locks, no memory held by others) and no write-through or load-back is pending. A flush
        asked for while copies are in flight succeeds once they are done, so the copies finish
        first, each as its own spec step."""
        s = self.state
        if any(s["extLock"].values()) or self.ballast_dev or self.ballast_host:
            return
        for _ in range(64):
            if not self._pending():
                self._do(["TreeReset"])
                return
            before = self.state
            self._finish_one()
            if self.state == before:
                return  # nothing could finish now: the flush is refused, as sglang's would be

    def _pending(self) -> bool:
        s = self.state
        return (
            any(v != NO_NODE for v in s["writeKey"].values())
            or any(s["loadAcks"].values())
            or bool(s.get("ring"))
            or bool(s.get("queued"))
        )

    def _finish_one(self) -> None:
        """One step towards an idle scheduler: the oldest write, else the oldest load, finishes."""
        if any(v != NO_NODE for v in self.state["writeKey"].values()):
            self._ack("write")
        else:
            self._ack("load")

    def memory_pressure(self, data: st.DataObject) -> None:
        """Other requests take (or give back) device or host memory: not a spec variable, but it
        decides whether a ToolStart finds the host full or a ToolEnd finds no device memory."""
        which = data.draw(st.sampled_from(("device", "device", "host")), label="pool")
        take = data.draw(st.booleans(), label="take")
        frac = data.draw(st.sampled_from((0.5, 1.0)), label="fraction")
        pool: Any = self.r.h.allocator if which == "device" else self.r.h.host_pool
        held = self.ballast_dev if which == "device" else self.ballast_host
        if take:
            ps = self.page_size
            n = int(pool.available_size() * frac) // ps * ps
            if n:
                idx = pool.alloc(n)
                if idx is not None:
                    held.append(idx)
                    if which == "host":
                        self.r.env_host_slots.update(int(x) for x in idx.tolist())
        elif held:
            idx = held.pop()
            pool.free(idx)
            if which == "host":
                self.r.env_host_slots.difference_update(int(x) for x in idx.tolist())
        self.state = self.r.abstract()

    # ---- checks after every step -------------------------------------------------------------------
    @invariant()
    def sglang_accounting(self) -> None:
        try:
            self._sglang_accounting()
        except Exception:
            self.failed = True
            raise

    def _sglang_accounting(self) -> None:
        h = self.r.h
        tree = h.tree
        dev_tokens = host_tokens = 0
        for node in h.iter_nodes():
            if node is tree.root_node:
                continue
            dev_tokens += len(node.value) if node.value is not None else 0
            host_tokens += len(node.host_value) if node.host_value is not None else 0
        held_dev = sum(len(x) for x in self.ballast_dev)
        held_host = sum(len(x) for x in self.ballast_host)
        if self.r._ballast_dev is not None or self.r._ballast_host is not None:
            raise FuzzFailure("replayer ballast left behind")
        cap = h.cfg.device_tokens
        if h.allocator.available_size() + dev_tokens + held_dev != cap:
            raise FuzzFailure(
                f"device slots not conserved: free {h.allocator.available_size()} + tree {dev_tokens} + other "
                f"{held_dev} != {cap}"
            )
        if h.host_pool.available_size() + host_tokens + held_host != h.host_pool.size:
            raise FuzzFailure(
                f"host slots not conserved (orphaned host buffer?): free {h.host_pool.available_size()} + tree "
                f"{host_tokens} + other {held_host} != {h.host_pool.size}"
            )
        idle = all(n.lock_ref == 0 for n in h.iter_nodes() if n is not tree.root_node)
        if idle and tree.protected_size() != 0:
            raise FuzzFailure(f"protected_size {tree.protected_size()} with nothing locked")

    @invariant()
    def kv_integrity(self) -> None:
        try:
            self._kv_integrity()
        except Exception:
            self.failed = True
            raise

    def _kv_integrity(self) -> None:
        h = self.r.h
        tree = h.tree
        h.scribble_unreferenced()
        backend = self.r.mgr.backend
        chains = backend.loading_chains() if hasattr(backend, "loading_chains") else []
        # and the loads sglang started for admitted parked sessions' requests (their bytes arrive
        # at the load's ack; the request itself waits for it before reading)
        chains = [*chains, *self.r.request_load_chains()]
        loading = {id(m) for _, nodes in chains for m in nodes}
        for node in h.iter_nodes():
            if node is tree.root_node:
                continue
            tokens = list(node.key.token_ids)
            exp = None
            if node.value is not None and id(node) not in loading and node.id not in tree.ongoing_load_back:
                exp = h.expected_kv(tokens)
                got = h.device_kv(node.value).float()
                if not torch.equal(got, exp):
                    raise FuzzFailure(
                        f"device KV of a readable node differs from its computed bytes ({tokens[:3]}…)"
                    )
                self.bytes_checked += got.numel() * 4
            if node.host_value is not None and node.write_through_pending_id is None:
                exp = exp if exp is not None else h.expected_kv(tokens)
                if not torch.equal(h.host_kv(node.host_value).float(), exp):
                    raise FuzzFailure(f"host KV differs from the offloaded bytes ({tokens[:3]}…)")

    def teardown(self) -> None:
        """Close every session, drain, and require every counter back at its initial value — only
        when no check failed in this example (a leak after a violation is its consequence, and
        raising it here would replace the first violation in Hypothesis's report)."""
        for key, n in sorted(self.counts.items()):
            event(f"action {key}", payload=n)
        event("kv bytes checked", payload=self.bytes_checked)
        try:
            if not self.failed:
                self._drain_and_check_leaks()
        finally:
            self.r.close()
            if self.trace_dir is not None and self.trace:
                self.write_trace(self.trace_dir / f"trace-{self.example:05d}.jsonl")

    def _drain_and_check_leaks(self) -> None:
        h, mgr = self.r.h, self.r.mgr
        for x in self.ballast_dev:
            h.allocator.free(x)
        for x in self.ballast_host:
            h.host_pool.free(x)
        self.ballast_dev, self.ballast_host = [], []
        for n in list(self.bounds.nodes):
            if self.state["extLock"].get(n):
                h.tree.dec_lock_ref(self.r.nodes.obj[n])
                self.r.ext.discard(n)
        for sid in list(mgr.sessions):
            mgr.close(sid)
        mgr.tick(mgr.now + 1)
        # an admitted request's load may still be queued (the harness draws no prefill batch to
        # start it, as sglang's would): start and retire every queued load, as an idle scheduler has
        _drain(self.r)
        h.drain()
        final = h.accounting()
        if final != self.initial:
            raise FuzzFailure(f"leak after closing every session and draining: {self.initial} -> {final}")

    def write_trace(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        header = {
            "nodes": list(self.bounds.nodes),
            "sessions": list(SESSIONS),
            "ttl": self.ttl,
            "keep_ttl": self.keep_ttl,
            "caveats": sorted(self.caveats),
            "policy": True,
            "lazy_free": self.lazy_free,
            "unmirror": self.unmirror,
        }
        with path.open("w") as f:
            f.write(json.dumps({"header": header}) + "\n")
            for step in self.trace:
                f.write(json.dumps(step) + "\n")


def machine_class(
    *,
    caveats: frozenset[str] = frozenset(),
    env_bugs: frozenset[str] = frozenset(),
    device: str = "cpu",
    page_size: int = 1,
    trace_dir: Path | None = None,
    policy: str = "offload",
    lazy_free: bool = False,
) -> type[ToolKVMachine]:
    """A configured subclass (Hypothesis instantiates the class itself, once per example)."""
    return type(
        "ToolKVMachine_"
        + ("_".join(sorted(caveats | env_bugs)) or "correct")
        + ("_auto" if policy == "auto" else "")
        + ("_lazy" if lazy_free else ""),
        (ToolKVMachine,),
        {
            "caveats": caveats,
            "env_bugs": env_bugs,
            "device": device,
            "io_backend": "kernel" if device.startswith("cuda") else "direct",
            "page_size": page_size,
            "trace_dir": trace_dir,
            "policy": policy,
            "lazy_free": lazy_free,
            "examples": 0,
        },
    )


__all__ = ["SESSIONS", "FuzzFailure", "ToolKVMachine", "attached", "machine_class"]
