"""Hypothesis stateful testing of the L3 storage tier over sglang's REAL ``HiCacheFile`` (CPU).

Every step is one action of ``spec/storage/StorageTier.tla`` run by
:class:`toolkv.verify.storage.world.StorageWorld`: the manager's ``tool_start``, ``store``,
``tool_end``, TTL sweep and ``close``; the copy engine's host write and load acknowledgements;
sglang's backup thread writing a page, or the storage refusing one (a short write), and the
acknowledgement of the write; its prefetch I/O thread reading a page, and the acknowledgement of
the prefetch; the backend deleting an unprotected page; HiCache evicting an unheld host copy. Two
sessions share a host pool sized in pages, so host room runs out. A step draws a session, then one
of the actions the spec enables for it, by weight, swarm style (each example leaves out a random
subset of the diversions), with a generator Hypothesis seeds; manager calls the spec does not
enable are drawn too (they must be refused and change nothing).

After every step:

* the spec's invariants on the refinement mapping (``storage_spec.violations``): among them
  ``RestoreSourceWhole`` (never restored from a copy that was not completely written) and
  ``ReadSourcePresent`` (no storage page is deleted while a prefetch still has to read it);
* the real objects (``StorageWorld.check_real``): every readable GPU copy, acknowledged host copy
  and stored page holds exactly the KV computed for its tokens — a session read back from L3 and
  loaded to the GPU holds the bytes it was offloaded with — and sglang's host references are what
  toolkv, its writes to storage and its prefetches hold;
* the step is a spec step: the mapped state equals the spec's successor for the action drawn
  (``storage_spec.explain``; a ``tool_start`` that had ``evict_host`` make room, a sweep that
  expired several sessions, a load acknowledgement that finished two loads started together
  stand for those steps in a row), and a call the manager refuses changes nothing.

At teardown every session is closed and every thread finishes: every lock, host reference, slot
and storage record must be back (``StorageWorld.settle``), unless a check already failed. With
``checks="invariants"`` the step check and the teardown's leak check are off: the invariants alone
must then catch a defect. The stack is built once per campaign (sglang's storage threads take a
second to start) and reset in place between examples. Per-example action counts and KV bytes
checked are Hypothesis ``event``s, so :func:`toolkv.verify.campaign.campaign` sums them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
import tempfile
from pathlib import Path
from typing import Any, ClassVar

from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, rule

from toolkv.verify.storage import spec as storage_spec
from toolkv.verify.storage.spec import Act, State, StorageBounds
from toolkv.verify.storage.world import StorageWorld, Unrealizable, WorldFailure

#: two sessions of two pages; the host holds two copies and a page, so a prefetch waits for the
#: other session's copy to go (and a broken restore that reads a copy still being written fits)
BOUNDS = StorageBounds(sessions=("s1", "s2"), pages=2, host_slots=5, store_fails=True)
#: storage defects that act on the tool_end at arrival only: their campaigns run with ``ReadAtArrival``
ARRIVAL_MUTANTS = frozenset({"ArrivalKeepsPin"})


#: steps served in order: acks in issue order, each of sglang's storage threads one page at a time
IN_ORDER = frozenset(
    {"HostAck", "LoadAck", "StorePage", "StoreRefused", "StoreAck", "ReadPage", "PrefetchAck"}
)


class StorageFuzzFailure(AssertionError):
    """A check failed after a step (the message names the invariant or check)."""


class _Holder:
    """The one world of a campaign (built once: sglang's storage threads take a second)."""

    world: StorageWorld | None = None
    key: tuple[Any, ...] | None = None

    @classmethod
    def get(cls, bounds: StorageBounds, mutant: str | None) -> StorageWorld:
        key = (bounds, mutant)
        if cls.world is None or cls.key != key:
            cls.close()
            cls.world = StorageWorld(
                bounds, Path(tempfile.mkdtemp(prefix="toolkv-l3-fuzz-")) / "l3", mutant=mutant
            )
            cls.key = key
        return cls.world

    @classmethod
    def close(cls) -> None:
        if cls.world is not None:
            w, cls.world, cls.key = cls.world, None, None
            w.close()


class StorageMachine(RuleBasedStateMachine):
    """Configured by :func:`machine_class`."""

    mutant: ClassVar[str | None] = None
    checks: ClassVar[str] = "all"  # or "invariants": no step check, no leak check at teardown
    bounds: ClassVar[StorageBounds] = BOUNDS

    def __init__(self) -> None:
        super().__init__()
        self.world = _Holder.get(self.bounds, self.mutant)
        if self.world.live and self.world.used:  # the last example's teardown did not finish
            try:
                self.world.settle(force=True)
            except Exception:
                _Holder.close()
                self.world = _Holder.get(self.bounds, self.mutant)
        if not self.world.live:
            self.world.start()
        self.failed = False
        self.counts: dict[str, int] = {}
        self.state: State = self.world.abstract()
        self._rng: random.Random | None = None
        self._swarm: dict[str, int] = {}
        self._next: dict[str, str] = {}
        self.history: list[list[Any]] = []  # the actions taken, for the failure message

    # ---- one step ---------------------------------------------------------------------------------
    def _fail(self, msg: str) -> None:
        self.failed = True
        raise StorageFuzzFailure(f"{msg} (after {self.history[-40:]})")

    def _do(self, act: Act, *, others: tuple[str, ...] = ()) -> None:
        pre = self.state
        self.history.append(list(act))
        try:
            res = self.world.apply(act)
        except Unrealizable:
            self.state = self.world.abstract()
            if self.state != pre:
                self._fail(f"{list(act)}: a step sglang could not take changed the state")
            self._count(f"{act[0]}!unrealizable")
            return
        except WorldFailure as exc:
            self._fail(f"{list(act)}: {exc}")
        post = self.world.abstract()
        self.state = post
        self._count(str(act[0]) + (f"!{res.error}" if res.error else ""))
        bad = storage_spec.violations(post, self.bounds)
        if bad:
            self._fail(f"{list(act)}: spec invariants violated on the refinement mapping: {bad}")
        real = self.world.check_real()
        if real:
            self._fail(f"{list(act)}: checks on the real objects failed: {real}")
        if self.checks == "invariants":
            return
        enabled = storage_spec.step(pre, act, self.bounds) is not None
        if res.error is not None or not enabled:
            # refused, or a call the spec does not enable here (a sweep with nothing due): nothing
            # may change, bar the host room a refused tool_start made
            if storage_spec.explain(pre, post, None, self.bounds, others) is None:
                why = f"refused ({res.error})" if res.error else "not enabled in the spec"
                self._fail(f"{list(act)} {why} but changed the state: {_delta(pre, post)}")
            if res.error is None:
                self._count(f"{act[0]}!stutter")
            return
        steps = storage_spec.explain(pre, post, act, self.bounds, others)
        if steps is None:
            self._fail(f"{list(act)} is not a spec step: {_delta(pre, post)}")
        if steps is not None and len(steps) > 1:
            self._count("composite")

    def _count(self, key: str) -> None:
        self.counts[key] = self.counts.get(key, 0) + 1

    def _on(self, name: str, *args: Any) -> bool:
        """The spec enables ``name`` for these arguments in the current (mapped) state."""
        return storage_spec.step(self.state, (name, *args), self.bounds) is not None

    # ---- the step: one action, drawn by weight among those the spec enables ---------------------------
    #: (action, weight): a deep sequence (offload, store page by page, ack, evict the host copy, read
    #: page by page, ack, load) stays likely while every action stays reachable
    WEIGHTS: ClassVar[dict[str, int]] = {
        "ToolStart": 6, "HostAck": 6, "Store": 6, "StorePage": 6, "StoreAck": 6, "HostEvict": 6,
        "StoragePrefetch": 6, "ReadPage": 4, "PrefetchAck": 6, "LoadAck": 6,
        "ToolEndFromHost": 1, "StoreRefused": 1, "L3Evict": 3, "Expire": 1, "Close": 1, "Refused": 1,
        "MidRead": 5, "ToolEndAtArrival": 6,
    }  # fmt: skip
    #: swarm testing: each example leaves out a random subset of these diversions, so that some
    #: examples are dense in closes mid-read, others in refused pages or page deletions
    OPTIONAL: ClassVar[tuple[str, ...]] = (
        "ToolEndFromHost", "StoreRefused", "L3Evict", "Expire", "Close", "Refused", "MidRead",
    )  # fmt: skip

    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        if self._rng is None:
            # The choices are made with a seeded generator (its seed is Hypothesis's draw, so an
            # example replays exactly): Hypothesis's own draws favour the first entries of a list
            # in its simplest examples, which would make the weights meaningless.
            self._rng = data.draw(st.randoms(use_true_random=True), label="rng")
            self._swarm = {
                a: w for a, w in self.WEIGHTS.items() if a not in self.OPTIONAL or self._rng.random() < 0.5
            }
        self._next = self.world.next_acks()
        choices = {a: self._candidates(a) for a in self._swarm}
        # the session first, then one of its actions by weight: a session in a short window (a
        # prefetch between its reads) gets its close or TTL as often as its next read
        busy = sorted({act[1] for a, acts in choices.items() if a != "Refused" for act in acts})
        if not busy:
            return  # every session's story is over: the rest of the example would only be refusals
        s = self._rng.choice(busy)
        mine = {
            a: [x for x in acts if x[1] == s] for a, acts in choices.items() if any(x[1] == s for x in acts)
        }
        names = sorted(mine)
        name = self._rng.choices(names, weights=[self._swarm[a] for a in names])[0]
        act: Act = self._rng.choice(mine[name])
        others = {"ToolStart": ("HostEvict",), "Expire": ("Expire",), "LoadAck": ("LoadAck",)}
        try:
            self._do(act, others=others.get(str(act[0]), ()))
        except Exception:  # whatever broke, the teardown must not report a leak in its place
            self.failed = True
            raise

    def _candidates(self, name: str) -> list[Act]:
        """The instances of ``name`` to draw from: those the spec enables (so every draw acts),
        but for steps the storage model leaves to others or sglang cannot take (see below)."""
        ss = self.bounds.sessions
        if name == "L3Evict":
            return [(name, s, p) for s in ss for p in range(1, self.bounds.pages + 1) if self._on(name, s, p)]
        if name == "MidRead":  # close or the TTL while a read from storage runs (its pin's hazard)
            busy = [s for s in ss if self.state["pf"][s]]
            return [(a, s) for s in busy for a in ("Close", "Expire") if self._on(a, s)]
        if name == "Store":  # not while sglang's own write of the host copy is still queued
            return [(name, s) for s in ss if self._on(name, s) and not self.world.sglang_writing(s)]
        if name == "HostEvict":  # sglang's evict_host frees only a copy whose device copy is gone
            return [(name, s) for s in ss if self._on(name, s) and not self.state["gpu"][s]]
        if name == "Refused":  # a manager call the spec does not enable here: it must change nothing
            calls = ("ToolStart", "Store", "ToolEndFromHost", "Expire", "Close")
            # (tool_end during the GPU->host write is spec/ToolKV.tla's, handed over at once; a
            # stored session's tool_end with no host room for its prefetch waits in the model,
            # while sglang evicts, reads a shorter prefix or revokes: a degradation left out; a
            # session back through ToolEndAtArrival has no GPU copy until its next request, which
            # the model does not run: its tool_start is ToolKV.tla's, not refused)
            return [
                (a, s) for s in ss for a in calls
                if not self._on(a, s)
                and not (a == "ToolEndFromHost" and self.state["phase"][s] in ("Offloading", "Stored"))
                and not (a == "ToolStart" and self.state["phase"][s] == "Running" and not self.state["gpu"][s])
            ]  # fmt: skip
        if name in IN_ORDER:  # the copy engine and each thread serve one session at a time
            return [(name, s) for s in ss if self._on(name, s) and self._next.get(name) == s]
        return [(name, s) for s in ss if self._on(name, s)]

    # ---- the end of an example ----------------------------------------------------------------------
    def teardown(self) -> None:
        """Close every session, let every thread finish, require everything returned — only when
        no check failed (a leak after a violation is its consequence; Hypothesis reports the
        first). A stack that cannot be cleaned up is closed and the next example builds one. The
        statistics are recorded whatever happened."""
        try:
            self._settle()
        finally:
            with contextlib.suppress(Exception):  # e.g. an example Hypothesis cut short
                for key, n in sorted(self.counts.items()):
                    event(f"action {key}", payload=n)
                via = sum(1 for s in self.bounds.sessions if self.state["viaL3"][s])
                event("restored from L3", payload=via)
                event("kv bytes checked", payload=self.world.kv_checked)

    def _settle(self) -> None:
        leak: WorldFailure | None = None
        if not self.failed:
            try:
                self.world.settle()
                return
            except WorldFailure as exc:
                leak = exc
        try:  # reuse the stack if what the example left behind can be cleaned up
            self.world.settle(force=True)
        except Exception:
            _Holder.close()  # rebuilt by the next example
        if leak is not None and self.checks == "all":  # with the invariants alone, not reported
            raise StorageFuzzFailure(f"teardown: {leak}") from leak


def _delta(pre: State, post: State) -> dict[str, Any]:
    """The variables a step changed, as (before, after) per session."""
    out: dict[str, Any] = {}
    for k in post:
        if pre[k] != post[k]:
            out[k] = (
                (pre[k], post[k])
                if not isinstance(post[k], dict)
                else {s: (pre[k][s], post[k][s]) for s in post[k] if pre[k][s] != post[k][s]}
            )
    return out


def machine_class(
    *, mutant: str | None = None, checks: str = "all", read_at_arrival: bool = False
) -> type[StorageMachine]:
    """A configured subclass (Hypothesis instantiates the class itself, once per example).
    ``read_at_arrival``: the model's ``ReadAtArrival`` and the manager's ``l3_read_at_arrival``
    (a Stored session's tool_end is ``ToolEndAtArrival``, never ``StoragePrefetch``)."""
    if checks not in ("all", "invariants"):
        raise ValueError(f"checks must be 'all' or 'invariants', not {checks!r}")
    return type(
        "StorageMachine_"
        + (mutant or "correct")
        + ("_arrival" if read_at_arrival else "")
        + ("" if checks == "all" else "_invariants"),
        (StorageMachine,),
        {
            "mutant": mutant,
            "checks": checks,
            "bounds": dataclasses.replace(BOUNDS, read_at_arrival=read_at_arrival),
        },
    )


def campaign(
    *,
    examples: int = 30,
    steps: int = 50,
    seed: int | None = 1,
    mutant: str | None = None,
    checks: str = "all",
    read_at_arrival: bool | None = None,
    profile: str = "ci",
    shrink: bool = False,
    every: int = 0,
) -> dict[str, Any]:
    """One campaign (``toolkv.verify.campaign.campaign`` with this machine); the stack is closed at
    the end. ``failure`` is None when nothing was found. ``read_at_arrival`` (``ReadAtArrival``, the
    manager's ``l3_read_at_arrival``): None is on for the defects of :data:`ARRIVAL_MUTANTS` only."""
    from hypothesis.internal import observability

    from toolkv.verify.campaign import campaign as run

    if read_at_arrival is None:
        read_at_arrival = mutant in ARRIVAL_MUTANTS
    cls = machine_class(mutant=mutant, checks=checks, read_at_arrival=read_at_arrival)
    # The statistics come through Hypothesis's observability callbacks, which by default also
    # trace every line run for coverage (Hypothesis supports switching that off here): with real
    # sglang threads in every step that costs several times the step. The stack is built before,
    # outside the test, for the same reason.
    cover = observability.OBSERVABILITY_COLLECT_COVERAGE
    observability.OBSERVABILITY_COLLECT_COVERAGE = False
    try:
        _Holder.get(cls.bounds, mutant)
        return run(
            examples=examples,
            steps=steps,
            profile=profile,
            seed=seed,
            label=(mutant or "correct") + ("+arrival" if read_at_arrival else ""),
            shrink=shrink,
            every=every,
            machine=cls,
        )
    finally:
        observability.OBSERVABILITY_COLLECT_COVERAGE = cover
        _Holder.close()


__all__ = ["ARRIVAL_MUTANTS", "BOUNDS", "StorageFuzzFailure", "StorageMachine", "campaign", "machine_class"]
