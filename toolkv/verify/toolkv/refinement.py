"""The refinement mapping: the implementation's abstract state in the spec's variables, and the
spec's invariants evaluated on it in Python.

The mapping needs to know which real ``TreeNode`` object stands for which spec node name; whoever
drives the implementation (the conformance replayer, the fuzz state machine) keeps that
correspondence in a :class:`NodeMap`. Everything else is read off the real objects:

| spec variable | implementation |
|---|---|
| ``status[n]`` | ``Unborn`` if never created; ``InTree`` if attached to the current tree (``treeops.attached``) and created in the current tree generation; else ``Gone`` |
| ``parent[n]`` | name of ``node.parent`` (``Root`` for any tree root) |
| ``dev[n]`` | in the tree and ``node.value is not None`` |
| ``host[n]`` | in the tree and ``node.host_value is not None``; for a detached node of the current generation: its host slots are still allocated (an orphaned host buffer, caveat 3) |
| ``lockRef[n]``, ``hostRef[n]`` | ``node.lock_ref``, ``node.host_ref_counter`` (0 once the node's tree was reset) |
| ``writeKey[n]`` | name of the node whose id is ``node.write_through_pending_id`` |
| ``loadKey[n]`` | the manager's own loads: ``backend.loading_chains()``, and the loads a parked session's admitted request started (``request_loads``: sglang keeps no record of which nodes a load fills, so the driver that admitted it passes them) |
| ``loadAcks[k]`` | loads carrying ``k``'s id that are started (``ack_load_queue``) or queued (``load_queue``) |
| ``queued`` | ``Ring > 0``: the spec nodes named by the ops on the controller's ``load_queue`` (``load_back`` enqueued them, nothing started them yet); ``Ring = 0``: empty (the spec does not model the ring: a queued load is in flight, its start an internal step) |
| ``ring`` | ``Ring > 0``: one entry per started load whose copy has not finished, oldest first: the acks on ``ack_load_queue`` whose ``finish_event`` has not fired, each with the spec nodes among its ``node_ids`` (``keys``; sglang's own loads name prefixes outside the spec's nodes, which drop out) and who started it (``who``: ``sys`` for sglang's own starts of a prefill batch, ``tkv`` for toolkv's, as the driver's ``load_starter`` says: both start through the same sglang call, ``ready_to_load_host_cache``); checked against ``layer_done_counter``: its busy producer slots are exactly these loads. ``Ring = 0``: empty |

The ring's granularity. sglang records a load's per-layer producer events and its ack's
``finish_event`` on the load stream at the same position, so a producer slot is free exactly when
that load's ack has finished: a finished ack still on ``ack_load_queue`` is out of ``ring`` but
still counted in ``loadAcks`` until ``loading_check`` retires it (the spec's ``LoadAck``).
| ``phase[s]``, ``ref[s]``, ``epoch[s]``, ``prot[s]``, ``deadline[s]`` | the ``SessionRecord`` (``state``, ``node``, ``epoch``, ``protected``, ``min(deadline, MaxTime)``) |
| ``devFree``, ``hostFree`` | ``DevSlots``/``HostSlots`` minus the nodes holding a copy (slots are node-granular in the spec; token capacity is an environment choice, see ``conformance.py``) |
| ``now``, ``resets`` | ``manager.now``, resets seen |
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from toolkv.core.treeops import TreeNode, attached, path_to
from toolkv.verify.toolkv.spec import Rules, successor

NO_NODE = "NoNode"
ROOT = "Root"


@dataclass(frozen=True)
class Bounds:
    """The spec constants a mapping (and the Python copy of the spec's actions) needs."""

    nodes: tuple[str, ...]
    sessions: tuple[str, ...]
    dev_slots: int
    host_slots: int
    max_time: int
    ttl: int
    max_epoch: int = 1
    max_resets: int = 1
    env_locks: bool = True
    env_writes: bool = True
    ring: int = 0
    sys_loads: bool = False
    policy: bool = False
    lazy_free: bool = False  # spec LazyFree
    keep_ttl: int | None = None  # spec KeepTTL (None: the TTL)
    promised: int = 0  # spec Promised
    # spec Unmirror: a ToolStart short of host room may drop mirrors (HostUnmirror). Not modelled
    # by the executable spec and the replayer yet (configs.toml [conformance_pending]): the worlds
    # run the manager with it off, as every config but MC_unmirror does; TLC and
    # tests/test_unmirror.py check the mechanism
    unmirror: bool = False

    @property
    def keep_for(self) -> int:
        """Spec ``KeepFor``: the keep TTL, never more than the TTL."""
        return self.ttl if self.keep_ttl is None else min(self.keep_ttl, self.ttl)

    @classmethod
    def from_cfg(cls, consts: Mapping[str, Any]) -> Bounds:
        def names(v: Any) -> tuple[str, ...]:
            return tuple(sorted(str(x) for x in v))

        return cls(
            nodes=names(consts["Nodes"]),
            sessions=names(consts["Sessions"]),
            dev_slots=int(consts["DevSlots"]),
            host_slots=int(consts["HostSlots"]),
            max_time=int(consts["MaxTime"]),
            ttl=int(consts["TTL"]),
            max_epoch=int(consts.get("MaxEpoch", 1)),
            max_resets=int(consts.get("MaxResets", 1)),
            env_locks=bool(consts.get("EnvLocks", True)),
            env_writes=bool(consts.get("EnvWrites", True)),
            ring=int(consts.get("Ring", 0)),
            sys_loads=bool(consts.get("SysLoads", False)),
            policy=bool(consts.get("Policy", False)),
            lazy_free=bool(consts.get("LazyFree", False)),
            keep_ttl=int(consts["KeepTTL"]) if "KeepTTL" in consts else None,
            promised=int(consts.get("Promised", 0)),
            unmirror=bool(consts.get("Unmirror", False)),
        )

    def rules(self, *, bug: str = "none", fits: bool | None = None, slots: bool = True) -> Rules:
        """These constants as :class:`toolkv.verify.toolkv.spec.Rules` (for ``successor``)."""
        return Rules(
            nodes=self.nodes,
            sessions=self.sessions,
            dev_slots=self.dev_slots,
            host_slots=self.host_slots,
            max_epoch=self.max_epoch,
            max_time=self.max_time,
            ttl=self.ttl,
            max_resets=self.max_resets,
            env_locks=self.env_locks,
            env_writes=self.env_writes,
            ring=self.ring,
            sys_loads=self.sys_loads,
            policy=self.policy,
            lazy_free=self.lazy_free,
            keep_ttl=self.keep_ttl,
            promised=self.promised,
            unmirror=self.unmirror,
            bug=bug,
            fits=fits,
            slots=slots,
        )


@dataclass
class NodeMap:
    """Spec node name ↔ real TreeNode object, with the tree generation each was created in."""

    obj: dict[str, TreeNode] = field(default_factory=dict)
    gen: dict[str, int] = field(default_factory=dict)

    def add(self, name: str, node: TreeNode, generation: int) -> None:
        assert name not in self.obj, f"spec node {name} created twice"
        self.obj[name] = node
        self.gen[name] = generation

    def name_of(self, node: TreeNode | None) -> str:
        if node is None:
            return NO_NODE
        for name, o in self.obj.items():
            if o is node:
                return name
        return NO_NODE


class NotMapped(NotImplementedError):
    """The spec model has a variable this mapping cannot yet read off the implementation."""


def abstract_state(
    mgr: Any,
    nodes: NodeMap,
    bounds: Bounds,
    *,
    ext_locks: set[str],
    resets: int,
    env_host_slots: set[int] | None = None,
    load_starter: Callable[[Any], str | None] | None = None,
    request_loads: Sequence[tuple[TreeNode, list[TreeNode]]] = (),
) -> dict[str, Any]:
    """The implementation's state in the spec's variables (``core`` of ``ToolKV.tla``).

    ``env_host_slots``: host slots other requests hold (so a detached node's stale ``host_value``
    pointing at reallocated slots is not mistaken for an orphan). ``load_starter``: who started a
    load (``"tkv"`` or ``"sys"``) given its ack; needed only when the spec models the ring.
    ``request_loads``: (key node, nodes it fills) of the in-flight loads an admitted request of a
    parked session started (spec ``Admit``), which sglang does not record by node."""
    tree = mgr.tree
    by_id = {id(o): n for n, o in nodes.obj.items()}
    gen = mgr.tree_gen
    root_id = id(tree.root_node)
    names = bounds.nodes

    status: dict[str, str] = {}
    for n in names:
        o = nodes.obj.get(n)
        if o is None:
            status[n] = "Unborn"
        elif nodes.gen[n] == gen and attached(tree, o):
            status[n] = "InTree"
        else:
            status[n] = "Gone"
    in_tree = [n for n in names if status[n] == "InTree"]

    def parent(n: str) -> str:
        o = nodes.obj.get(n)
        if o is None or o.parent is None or id(o.parent) == root_id:
            return ROOT
        return by_id.get(id(o.parent), ROOT)

    host_pool = getattr(tree, "token_to_kv_pool_host", None)
    orphan_candidates = [
        n
        for n in names
        if status[n] == "Gone"
        and nodes.gen[n] == gen
        and getattr(nodes.obj[n], "host_value", None) is not None
    ]
    owned_host: set[int] = set()
    if orphan_candidates:  # only then is it worth collecting every slot the live tree owns
        owned_host = set(env_host_slots or ())
        for n in in_tree:
            hv = nodes.obj[n].host_value
            if hv is not None:
                owned_host.update(hv.tolist())

    def host(n: str) -> bool:
        o = nodes.obj.get(n)
        if o is None or getattr(o, "host_value", None) is None:
            return False
        if status[n] == "InTree":
            return True
        if n in orphan_candidates and host_pool is not None:
            idx = o.host_value.tolist()
            return bool(host_pool.slot_used[idx].all()) and owned_host.isdisjoint(idx)
        return False

    real_id_to_name = {nodes.obj[n].id: n for n in in_tree}
    chains = mgr.backend.loading_chains() if hasattr(mgr.backend, "loading_chains") else []
    chains = [*chains, *request_loads]
    load_key: dict[str, str] = {}
    for leaf, filled in chains:
        for m in filled:
            if id(m) in by_id:
                load_key[by_id[id(m)]] = by_id.get(id(leaf), NO_NODE)
    # In-flight loads: started (an ack in ack_load_queue) or queued by load_back and not started yet
    # (load_queue). With Ring = 0 the spec does not model the start: a queued load is in flight.
    ctrl = getattr(tree, "cache_controller", None)
    pending_ids: dict[int, int] = {}
    for op in [*getattr(ctrl, "ack_load_queue", ()), *getattr(ctrl, "load_queue", ())]:
        for i in op.node_ids:
            pending_ids[i] = pending_ids.get(i, 0) + 1

    dev = {n: status[n] == "InTree" and nodes.obj[n].value is not None for n in names}
    hst = {n: host(n) for n in names}

    sessions = {**getattr(mgr, "_closed", {}), **mgr.sessions}
    phase, ref, epoch, prot, deadline = {}, {}, {}, {}, {}
    for s in bounds.sessions:
        rec = sessions.get(s)
        if rec is None:
            phase[s], ref[s], epoch[s], prot[s], deadline[s] = "New", NO_NODE, 0, NO_NODE, 0
            continue
        phase[s] = rec.state
        ref[s] = by_id.get(id(rec.node), NO_NODE) if rec.node is not None else NO_NODE
        epoch[s] = rec.epoch
        prot[s] = by_id.get(id(rec.protected), NO_NODE) if rec.protected is not None else NO_NODE
        deadline[s] = 0 if rec.deadline_seq == 0 else int(min(rec.deadline, bounds.max_time))

    queued: list[str] = []
    ring: list[dict[str, Any]] = []
    if bounds.ring > 0:
        if ctrl is None or load_starter is None:
            raise NotMapped("the load-slot ring (Ring > 0) needs the cache controller and a load_starter")
        queued, ring = ring_state(ctrl, real_id_to_name, load_starter)
    out: dict[str, Any] = {
        "status": status,
        "parent": {n: parent(n) for n in names},
        "dev": dev,
        "host": hst,
        "lockRef": {n: nodes.obj[n].lock_ref if status[n] == "InTree" else 0 for n in names},
        "hostRef": {
            n: nodes.obj[n].host_ref_counter if (n in nodes.obj and nodes.gen[n] == gen) else 0 for n in names
        },
        "writeKey": {
            n: real_id_to_name.get(nodes.obj[n].write_through_pending_id, NO_NODE)
            if status[n] == "InTree" and nodes.obj[n].write_through_pending_id is not None
            else NO_NODE
            for n in names
        },
        "loadKey": {n: load_key.get(n, NO_NODE) if status[n] == "InTree" else NO_NODE for n in names},
        "loadAcks": {n: pending_ids.get(nodes.obj[n].id, 0) if status[n] == "InTree" else 0 for n in names},
        "devFree": bounds.dev_slots - sum(dev.values()),
        "hostFree": bounds.host_slots - sum(hst.values()),
        "phase": phase,
        "ref": ref,
        "epoch": epoch,
        "prot": prot,
        "deadline": deadline,
        "now": int(min(mgr.now, bounds.max_time)),  # the spec's clock saturates: MaxTime means "or later"
        "resets": resets,
        "queued": queued,  # both stay empty while the spec does not model the ring (Ring = 0)
        "ring": ring,
    }
    return out


def ring_state(
    ctrl: Any, id_to_name: Mapping[int, str], load_starter: Callable[[Any], str | None]
) -> tuple[list[str], list[dict[str, Any]]]:
    """``queued`` and ``ring`` read off sglang's ``HiCacheController``: the spec nodes on the load
    queue, and the started loads whose copy has not finished (oldest first). Raises
    :class:`NotMapped` when the counter's busy producer slots disagree with those loads, or a
    load in flight has no recorded starter: the mapping would be guessing."""
    queued = sorted({id_to_name[i] for op in ctrl.load_queue for i in op.node_ids if i in id_to_name})
    ring: list[dict[str, Any]] = []
    for ack in ctrl.ack_load_queue:
        if ack.finish_event.query():  # its slot is free; only loading_check's retirement is pending
            continue
        who = load_starter(ack)
        if who is None:
            raise NotMapped("a load in flight has no known starter")
        ring.append({"keys": sorted({id_to_name[i] for i in ack.node_ids if i in id_to_name}), "who": who})
    busy = sum(1 for ev in ctrl.layer_done_counter.events if not ev.finish_event.query())
    if busy != len(ring):
        raise NotMapped(f"{busy} producer slots busy but {len(ring)} started loads unfinished")
    return queued, ring


# ---- the spec's invariants, in Python, over an abstract state ---------------------------------------
PROTECTING = {"Offloading", "Offloaded", "Restoring", "Prefetching", "Parked"}
PINNING = {"Restoring", "Prefetching", "Kept", "Handover"}  # spec Pinning: the phases that hold a path lock
# spec Expiring: until tool_end is accepted, and a hand-over until its request is admitted
EXPIRING = {"Offloading", "Offloaded", "Prefetching", "Kept", "Handover", "Parked"}


def _path(st: Mapping[str, Any], n: str, limit: int) -> list[str]:
    out = []
    while n not in (ROOT, NO_NODE) and limit > 0:
        out.append(n)
        n = st["parent"][n]
        limit -= 1
    return out


def check_invariants(st: Mapping[str, Any], b: Bounds) -> list[str]:
    """Names of the spec invariants (``ToolKV.tla``) that ``st`` violates."""
    bad: list[str] = []
    nodes, sess = b.nodes, b.sessions
    in_tree = [n for n in nodes if st["status"][n] == "InTree"]
    if st["devFree"] < 0 or st["hostFree"] < 0:
        bad.append("SlotAccounting")
    for n in in_tree:
        p = st["parent"][n]
        if not (st["dev"][n] or st["host"][n]) or (p != ROOT and st["status"].get(p) != "InTree"):
            bad.append("TreeShape")
            break
        if p != ROOT and ((st["dev"][n] and not st["dev"][p]) or (st["host"][n] and not st["host"][p])):
            bad.append("TreeShape")
            break
    lim = len(nodes)
    paths = {k: set(_path(st, k, lim)) for k in nodes}
    write_keys = {st["writeKey"][m] for m in nodes} - {NO_NODE}
    for n in nodes:
        if st["status"][n] != "InTree":
            continue
        expect = sum(1 for k in write_keys if n in paths[k])
        expect += sum(1 for k in nodes if st["loadAcks"][k] >= 1 and n in paths[k])
        expect += sum(1 for k in nodes if st["loadAcks"][k] >= 2 and n in paths[k])
        expect += sum(1 for k in nodes if st["extLock"].get(k) and n in paths[k])
        expect += sum(
            1
            for s in sess
            if st["phase"][s] in PINNING and st["ref"][s] != NO_NODE and n in paths.get(st["ref"][s], set())
        )
        if st["lockRef"][n] != expect:
            bad.append("LockAccounting")
            break
    for n in nodes:
        held = sum(1 for s in sess if st["prot"][s] == n)
        if st["hostRef"][n] != held:
            bad.append("HostRefAccounting")
            break
    for s in sess:
        if st["prot"][s] != NO_NODE and not (st["phase"][s] in PROTECTING and st["prot"][s] == st["ref"][s]):
            bad.append("ProtectionOwned")
            break
    for n in nodes:
        if st["loadAcks"][n] > 1 or (st["loadAcks"][n] > 0 and st["status"][n] != "InTree"):
            bad.append("LoadAckSane")
            break
        lk = st["loadKey"][n]
        if lk != NO_NODE and not (
            st["status"][n] == "InTree" and st["dev"][n] and st["loadAcks"].get(lk, 0) == 1
        ):
            bad.append("LoadAckSane")
            break
    for n in nodes:
        if (st["host"][n] or st["dev"][n]) and st["status"][n] != "InTree":
            bad.append("NoOrphanHost")
            break
    for s in sess:
        p = st["prot"][s]
        if p != NO_NODE and not (st["status"][p] == "InTree" and st["host"][p]):
            bad.append("ProtectedHasHost")
            break
    for n in nodes:
        if st["writeKey"][n] != NO_NODE and not (
            st["dev"][n] and st["host"][n] and st["status"][n] == "InTree"
        ):
            bad.append("NoFreeWhilePending")
            break
    if b.ring > 0 and not ring_bounded(st, b.ring):
        bad.append("RingBounded")
    for s in sess:  # the keep TTL: a pin waiting for its tool_end is due within KeepTTL
        if st["phase"][s] == "Kept" and st["deadline"][s] > st["now"] + b.keep_for:
            bad.append("KeptWithinKeepTTL")
            break
    for s in sess:  # the hand-over
        r = st["ref"][s]
        if st["phase"][s] == "Handover" and not (
            r != NO_NODE
            and st["status"][r] == "InTree"
            and all(st["dev"][m] and st["loadKey"][m] == NO_NODE for m in _path(st, r, lim))
        ):
            bad.append("HandoverResident")
            break
    for s in sess:  # the per-call policy
        r = st["ref"][s]
        if st["phase"][s] == "Kept" and not (
            r != NO_NODE
            and st["status"][r] == "InTree"
            and all(st["dev"][m] and st["loadKey"][m] == NO_NODE for m in _path(st, r, lim))
        ):
            bad.append("KeptIsResident")
            break
    if any(st["phase"][s] == "Released" and st["prot"][s] != NO_NODE for s in sess):
        bad.append("ReleasedHoldsNothing")
    if any(st["phase"][s] == "Closed" and st["ref"][s] != NO_NODE for s in sess):
        bad.append("ClosedHoldsNoNode")
    return bad


def ring_bounded(st: Mapping[str, Any], ring: int) -> bool:
    """``RingBounded``: no more loads in flight than producer slots, and every key queued or in
    flight has exactly one pending load ack."""
    keys = [*st.get("queued", ()), *(k for slot in st.get("ring", ()) for k in slot["keys"])]
    return len(st.get("ring", ())) <= ring and all(st["loadAcks"].get(k, 0) == 1 for k in keys)


CORE = (
    "status", "parent", "dev", "host", "lockRef", "hostRef", "writeKey", "loadKey", "loadAcks", "extLock",
    "devFree", "hostFree", "phase", "ref", "epoch", "prot", "deadline", "now", "resets",
)  # fmt: skip
HISTORY = ("act", "tgt")  # the spec's history variables: not part of the implementation's state


def check_step(
    pre: Mapping[str, Any], post: Mapping[str, Any], b: Bounds, act: tuple[Any, ...] | None = None
) -> list[str]:
    """The spec's action properties over one step: ``RunnableOnlyWhenLoaded``, ``EpochMonotone``,
    and (given the action) ``StaleEpochNoop``; and the TTL both ways: after a sweep no protection is
    past its deadline (``ProtectionReleased``, made checkable on a finite run), and no session ever
    expires before its deadline (``NoEarlyExpiry``)."""
    bad: list[str] = []
    stale_end = act is not None and act[0] == "ToolEnd" and int(act[2]) != pre["epoch"][str(act[1])]
    if stale_end and any(pre[k] != post[k] for k in CORE if k in pre and k in post):
        bad.append("StaleEpochNoop")
    for s in b.sessions:
        ready = ("Runnable", "Handover")
        # a parked session's admitted request reads through sglang's own load_back (spec exception)
        if post["phase"][s] in ready and pre["phase"][s] not in (*ready, "Parked"):
            r = post["ref"][s]
            path = _path(post, r, len(b.nodes)) if r != NO_NODE else []
            if r == NO_NODE or not all(
                post["status"][m] == "InTree" and post["dev"][m] and post["loadKey"][m] == NO_NODE
                for m in path
            ):
                bad.append("RunnableOnlyWhenLoaded")
                break
    if any(post["epoch"][s] < pre["epoch"][s] for s in b.sessions):
        bad.append("EpochMonotone")
    if (
        act is not None
        and act[0] == "TtlSweep"
        and any(post["phase"][s] in EXPIRING and post["deadline"][s] <= post["now"] for s in b.sessions)
    ):
        bad.append("ProtectionReleased")
    if any(
        pre["phase"][s] in PROTECTING and post["phase"][s] == "Expired" and pre["deadline"][s] > pre["now"]
        for s in b.sessions
    ):
        bad.append("NoEarlyExpiry")
    return bad


def spec_successor(
    pre: Mapping[str, Any], act: Sequence[Any], b: Bounds, *, fits: bool | None = None, slots: bool = True
) -> dict[str, Any]:
    """The spec's successor of ``pre`` under ``act``; a call the spec does not enable changes nothing."""
    nxt = successor(pre, act, b.rules(fits=fits, slots=slots))
    return dict(pre) if nxt is None else nxt


def step_mismatch(expected: Mapping[str, Any], got: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    """Variables (history excluded) where the implementation's state differs from the spec's:
    ``{var: (spec, implementation)}``, restricted to the differing entries of functions."""
    out: dict[str, tuple[Any, Any]] = {}
    for k, want in expected.items():
        if k in HISTORY:
            continue
        have = got[k]
        if want != have:
            if isinstance(want, dict) and isinstance(have, dict):
                out[k] = (
                    {x: v for x, v in want.items() if have.get(x) != v},
                    {x: v for x, v in have.items() if want.get(x) != v},
                )
            else:
                out[k] = (want, have)
    return out


def check_refinement_step(
    pre: Mapping[str, Any],
    post: Mapping[str, Any],
    act: Sequence[Any],
    b: Bounds,
    *,
    fits: bool | None = None,
    slots: bool = True,
) -> dict[str, tuple[Any, Any]]:
    """Step-level refinement: the implementation's state after ``act`` equals the spec's successor
    of its state before (``specstep.successor``). Empty when it does. ``fits`` is the capacity
    decision the implementation took (its pools count tokens, the spec's count nodes)."""
    return step_mismatch(spec_successor(pre, act, b, fits=fits, slots=slots), post)


def path_names(nodes: NodeMap, tree: Any, node: TreeNode) -> list[str]:
    by_id = {id(o): n for n, o in nodes.obj.items()}
    return [by_id.get(id(m), "?") for m in path_to(tree, node)]
