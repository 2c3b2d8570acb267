"""The spec's next-state relation, action by action, in Python: ``successor(state, act)``.

Why a second copy of ``spec/ToolKV.tla``'s actions: the fuzz campaign checks, after *every* step,
that the implementation moved exactly as the spec would have — the same successor for the same
action and parameters, e.g. the same set of nodes freed by a write acknowledgement — at sizes no
TLC graph reaches, thousands of steps a second. TLC cannot be asked per step. This copy is kept
honest by ``model_tests/test_specstep.py``: on every edge of TLC's dumped state graphs,
``successor(u, act) == v``.

States are the plain form of :func:`toolkv.verify.tla.values.to_plain` (functions as dicts keyed by
names, sets as sorted lists). ``Rules`` carries the spec constants and the capacity decisions:
``fits`` replaces ``HostFits``/``DevFits`` with the decision the implementation took (token pools
decide capacity, not node slots), and ``slots=False`` makes the other node-slot guards true, as
trace validation does. Adding a spec action is one function in :data:`ACTIONS`.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

NO = "NoNode"
ROOT = "Root"
PROTECTING = ("Offloading", "Offloaded", "Restoring", "Prefetching", "Parked")
PINNING = ("Restoring", "Prefetching", "Kept", "Handover")  # spec Pinning: the phases that hold a path lock
# spec Expiring: the TTL stops once tool_end is accepted; it bounds a kept or prefetched pin and a hand-over
EXPIRING = ("Offloading", "Offloaded", "Prefetching", "Kept", "Handover", "Parked")
HOLDING = (*PROTECTING, "Kept", "Handover")  # spec Holding: what a tree reset loses


def pinning(r: Rules) -> tuple[str, ...]:
    """Spec ``Pinning`` (the EarlyRelease mutant's hand-over holds no pin)."""
    return PINNING[:-1] if r.bug == "EarlyRelease" else PINNING


State = dict[str, Any]


@dataclass(frozen=True)
class Rules:
    """The constants of one model plus the capacity oracle."""

    nodes: tuple[str, ...]
    sessions: tuple[str, ...]
    dev_slots: int
    host_slots: int
    max_epoch: int
    max_time: int
    ttl: int
    max_resets: int
    env_locks: bool = True
    env_writes: bool = True
    ring: int = 0
    sys_loads: bool = False
    policy: bool = False  # the per-call policy's actions (Keep, LetGo, Demote, Prefetch)
    lazy_free: bool = False  # spec LazyFree: offloads leave acknowledged GPU copies to GpuEvict
    bug: str = "none"
    fits: bool | None = None  # HostFits/DevFits decided by the implementation (None: the spec's)
    slots: bool = True  # False: InsertFits, WriteFits, SplitFits are TRUE (token pools decide)
    keep_ttl: int | None = None  # spec KeepTTL (None: the TTL)
    promised: int = 0  # spec Promised: device slots sglang promised and will allocate unchecked
    unmirror: bool = False  # spec Unmirror: a ToolStart short of host room may drop mirrors (HostUnmirror)

    @property
    def keep_for(self) -> int:
        """Spec ``KeepFor``: the keep TTL, never more than the TTL."""
        return self.ttl if self.keep_ttl is None else min(self.keep_ttl, self.ttl)

    def keep_deadline(self, now: int) -> int:
        """Spec ``KeepDeadline``: what Keep arms."""
        return min(now + (self.ttl if self.bug == "KeepFullTtl" else self.keep_for), self.max_time)

    def warm_deadline(self, now: int, d: int) -> int:
        """Spec ``WarmDeadline``: an early restore that becomes Kept."""
        if self.bug == "WarmFullTtl":
            return d
        return now if d < now else min(d, now + self.keep_for)

    @classmethod
    def from_cfg(cls, c: Mapping[str, Any]) -> Rules:
        return cls(
            nodes=tuple(sorted(str(x) for x in c["Nodes"])),
            sessions=tuple(sorted(str(x) for x in c["Sessions"])),
            dev_slots=int(c["DevSlots"]),
            host_slots=int(c["HostSlots"]),
            max_epoch=int(c["MaxEpoch"]),
            max_time=int(c["MaxTime"]),
            ttl=int(c["TTL"]),
            max_resets=int(c["MaxResets"]),
            env_locks=bool(c.get("EnvLocks", True)),
            env_writes=bool(c.get("EnvWrites", True)),
            ring=int(c.get("Ring", 0)),
            sys_loads=bool(c.get("SysLoads", False)),
            policy=bool(c.get("Policy", False)),
            lazy_free=bool(c.get("LazyFree", False)),
            bug=str(c.get("BUG", "none")),
            keep_ttl=int(c["KeepTTL"]) if "KeepTTL" in c else None,
            promised=int(c.get("Promised", 0)),
        )


# ---- definitions of the spec ---------------------------------------------------------------------
def path(st: Mapping[str, Any], n: str, limit: int) -> list[str]:
    """``Path(n)``: n and its ancestors, excluding the root (bounded, as in the spec)."""
    out: list[str] = []
    while n not in (ROOT, NO) and limit > 0:
        out.append(n)
        n = st["parent"][n]
        limit -= 1
    return out


def in_tree(st: Mapping[str, Any]) -> list[str]:
    return [n for n, s in st["status"].items() if s == "InTree"]


def kids(st: Mapping[str, Any], n: str) -> list[str]:
    return [c for c in in_tree(st) if st["parent"][c] == n]


def through(paths: Mapping[str, set[str]], m: str, keys: Iterable[str]) -> int:
    return sum(1 for k in keys if m in paths.get(k, ()))


def path_valid(st: Mapping[str, Any], n: str, limit: int) -> bool:
    if n == ROOT:
        return True
    return st["status"][n] == "InTree" and all(
        st["dev"][m] and st["loadKey"][m] == NO for m in path(st, n, limit)
    )


def free_set(
    st: Mapping[str, Any],
    leaves: Iterable[str],
    d: Mapping[str, bool],
    wk: Mapping[str, str],
    lk: Mapping[str, str],
    lr: Mapping[str, int],
    limit: int,
    no_ack: bool = False,
) -> set[str]:
    """``FreeSet`` (or ``FreeSetNoAck`` for the FreeBeforeAck mutant): bottom-up fixpoint."""
    ls = set(leaves)
    cand = {m for leaf in ls for m in path(st, leaf, limit)}
    kid = {m: kids(st, m) for m in cand}
    free: set[str] = set()
    for _ in range(limit):
        step = set(free)
        for m in cand:
            ok = d[m] and st["host"][m] and all((not d[c]) or c in free for c in kid[m])
            if not no_ack:
                ok = ok and wk[m] == NO and lk[m] == NO and lr[m] == 0
            if ok and (m in ls or any(st["parent"][c] == m for c in free)):
                step.add(m)
        free = step
    return free


def _paths(st: Mapping[str, Any], r: Rules) -> dict[str, set[str]]:
    return {k: set(path(st, k, len(r.nodes))) for k in st["status"]}


def _locked(
    st: Mapping[str, Any], r: Rules, lr: Mapping[str, int], keys: Iterable[str], d: int
) -> dict[str, int]:
    ps = _paths(st, r)
    ks = list(keys)
    return {m: lr[m] + d * through(ps, m, ks) for m in lr}


def room_of(st: Mapping[str, Any], df: int, d: Mapping[str, bool], lr: Mapping[str, int]) -> int:
    """Spec ``RoomOf``: free slots plus unlocked device copies (what sglang may still take)."""
    return df + sum(1 for m in in_tree(st) if d[m] and lr[m] == 0)


def promise_fits(
    st: Mapping[str, Any], r: Rules, df: int, d: Mapping[str, bool], lr: Mapping[str, int]
) -> bool:
    """Spec ``PromiseFits``. Where token pools decide (``slots=False``: the fuzz campaign, trace
    validation) it is TRUE here: the campaign checks sglang's promise on the real pools itself."""
    return not r.slots or r.promised <= room_of(st, df, d, lr)


def _restore_fits(st: Mapping[str, Any], r: Rules, n: str, c: Sequence[str]) -> bool:
    """Spec ``RestoreFits``: the restore's loads and pin keep the promise (``PinPricedByLoad``:
    only the slots to load count)."""
    if not r.slots:
        return True
    if r.bug == "PinPricedByLoad":
        return r.promised <= room_of(st, st["devFree"], st["dev"], st["lockRef"]) - len(c)
    d2 = {m: (v or m in c) for m, v in st["dev"].items()}
    return promise_fits(st, r, st["devFree"] - len(c), d2, _locked(st, r, st["lockRef"], [n], 1))


def _in_flight(st: Mapping[str, Any], k: str) -> bool:
    if k in st.get("queued", ()):
        return True
    return any(k in slot["keys"] for slot in st.get("ring", ()))


def _start_load(s: State, who: str) -> None:
    s["ring"] = [*s["ring"], {"keys": sorted(s["queued"]), "who": who}]
    s["queued"] = []


def host_evictable(st: Mapping[str, Any], r: Rules) -> list[str]:
    """Spec ``HostEvictable``: host-only, unlocked, no protected node in the subtree."""
    lim = len(r.nodes)
    live = in_tree(st)
    out = []
    for m in live:
        if not st["host"][m] or st["dev"][m] or st["lockRef"][m] != 0:
            continue
        if r.bug == "RoomEvictsProtected" or all(
            st["hostRef"][c] == 0 for c in live if m in path(st, c, lim)
        ):
            out.append(m)
    return out


def _mirror_ok(st: Mapping[str, Any], r: Rules, m: str, n: str) -> bool:
    """Spec ``MirrorOk(m, n)``: the host copy of a device copy a request locks, off the path to
    ``n``, not being loaded, written (unless ``UnmirrorInFlight``) or protected (unless
    ``UnmirrorProtected``)."""
    return (
        st["host"][m] and st["dev"][m] and st["lockRef"][m] > 0 and m not in path(st, n, len(r.nodes))
        and st["loadKey"][m] == NO
        and (r.bug == "UnmirrorInFlight" or st["writeKey"][m] == NO)
        and (r.bug == "UnmirrorProtected" or st["hostRef"][m] == 0)
    )  # fmt: skip


def mirror_room(st: Mapping[str, Any], r: Rules, n: str) -> list[str]:
    """Spec ``MirrorRoom(n)``: the mirrors a ToolStart of the path to ``n`` may drop, each with
    every host copy below it droppable too (a closed subtree)."""
    if not r.unmirror:
        return []
    lim = len(r.nodes)
    live = in_tree(st)
    return [
        m for m in live
        if _mirror_ok(st, r, m, n)
        and all(_mirror_ok(st, r, c, n) for c in live if st["host"][c] and m in path(st, c, lim))
    ]  # fmt: skip


def _host_fits(st: Mapping[str, Any], r: Rules, w: Sequence[str], n: str | None = None) -> tuple[bool, bool]:
    """(spec ``HostFits``, spec ``HostShort``). With the implementation's decision (``r.fits``)
    the room it made shows as ``HostRoom`` (and ``HostUnmirror``) steps before the ``ToolStart``:
    never short then."""
    if r.fits is not None:
        return r.fits, False
    room = 0 if r.bug == "RoomIgnored" else len(host_evictable(st, r))
    if r.bug != "RoomIgnored" and n is not None:
        room += len(mirror_room(st, r, n))
    return len(w) <= st["hostFree"] + room, len(w) > st["hostFree"]


# ---- actions: each returns the successor, or None when the action is not enabled ------------------
def tool_start(st: State, r: Rules, sid: str) -> State | None:
    n = st["ref"][sid]
    if not (st["phase"][sid] == "Running" and n != NO and st["epoch"][sid] < r.max_epoch):
        return None
    s = copy.deepcopy(st)
    s["tgt"] = []
    if st["status"][n] != "InTree" and r.bug != "StaleNode":
        s["ref"][sid] = NO
        return s
    lim = len(r.nodes)
    pn = path(st, n, lim)
    w = [m for m in pn if not st["host"][m]]
    fits, short = _host_fits(st, r, w, n)
    if not fits:
        return s
    if short:
        return None  # HostRoom first
    wk2 = {m: (m if m in w else st["writeKey"][m]) for m in st["writeKey"]}
    lr2 = _locked(st, r, st["lockRef"], w, 1)
    if not promise_fits(st, r, st["devFree"], st["dev"], lr2) and r.bug != "WriteLockFree":
        return s  # the writes' locks would take device room sglang promised: refused
    clean = all(wk2[m] == NO for m in pn)
    if r.bug == "FreeBeforeAck":
        f = free_set(st, [n], st["dev"], wk2, st["loadKey"], lr2, lim, no_ack=True)
    else:
        f = free_set(st, [n], st["dev"], wk2, st["loadKey"], lr2, lim) if clean and not r.lazy_free else set()
    for m in w:
        s["host"][m] = True
    s["hostFree"] -= len(w)
    s["writeKey"] = wk2
    s["lockRef"] = lr2
    s["hostRef"][n] += 1
    for m in f:
        s["dev"][m] = False
    s["devFree"] += len(f)
    s["prot"][sid] = n
    s["epoch"][sid] += 1
    s["deadline"][sid] = min(st["now"] + r.ttl, r.max_time)
    s["phase"][sid] = "Offloaded" if clean or r.bug == "FreeBeforeAck" else "Offloading"
    s["tgt"] = [n]
    return s


def write_ack(st: State, r: Rules, k: str) -> State | None:
    if not any(v == k for v in st["writeKey"].values()):
        return None
    lim = len(r.nodes)
    s = copy.deepcopy(st)
    wk2 = {m: (NO if v == k else v) for m, v in st["writeKey"].items()}
    lr2 = _locked(st, r, st["lockRef"], [k], -1)
    done = [
        x
        for x in r.sessions
        if st["phase"][x] == "Offloading" and all(wk2[m] == NO for m in path(st, st["ref"][x], lim))
    ]
    f = (
        set()
        if r.lazy_free
        else free_set(st, [st["ref"][x] for x in done], st["dev"], wk2, st["loadKey"], lr2, lim)
    )
    s["writeKey"], s["lockRef"] = wk2, lr2
    for m in f:
        s["dev"][m] = False
    s["devFree"] += len(f)
    for x in done:
        s["phase"][x] = "Offloaded"
    s["tgt"] = sorted({st["ref"][x] for x in done})
    return s


def tool_end(st: State, r: Rules, sid: str, e: Any) -> State | None:
    e = int(e)
    ph = st["phase"][sid]
    phases = ("Offloading", "Offloaded", "Restoring", "Expired", "Lost", "Kept", "Prefetching", "Released")
    if ph not in phases or not 0 <= e <= r.max_epoch:
        return None
    lim = len(r.nodes)
    n = st["ref"][sid]
    s = copy.deepcopy(st)
    s["tgt"] = []
    if ph in ("Kept", "Prefetching", "Released") and e == st["epoch"][sid]:
        s["phase"][sid] = {"Kept": "Handover", "Prefetching": "Restoring"}.get(ph, "Running")
        if ph == "Kept":
            if r.bug == "EarlyRelease":
                s["lockRef"] = _locked(st, r, st["lockRef"], [n], -1)
            s["deadline"][sid] = min(st["now"] + r.ttl, r.max_time)
        s["tgt"] = [] if ph == "Released" else [n]
        return s
    pn = path(st, n, lim)
    c = [m for m in pn if not st["dev"][m]]
    if ph in ("Offloading", "Offloaded") and (e == st["epoch"][sid] or r.bug == "NoEpochCheck"):
        s["tgt"] = [n]
        fits = r.fits if r.fits is not None else len(c) <= st["devFree"]
        overrun = r.bug == "RingOverrun" and bool(c) and len(st.get("ring", ())) >= r.ring
        if not fits or overrun or not _restore_fits(st, r, n, c):
            if r.bug == "HostLockLeak":
                s["phase"][sid] = "Expired"
            return s
        lk2 = {m: (n if m in c else v) for m, v in st["loadKey"].items()}
        loads = 1 if c else 0
        runnable = all(lk2[m] == NO for m in pn) or r.bug == "EarlyRunnable"
        pin = 0 if runnable and (r.bug == "EarlyRelease" or (r.bug == "ResidentNoPin" and not c)) else 1
        for m in c:
            s["dev"][m] = True
        s["devFree"] -= len(c)
        s["loadKey"] = lk2
        s["loadAcks"][n] += loads
        s["lockRef"] = _locked(st, r, st["lockRef"], [n], loads + pin)
        s["phase"][sid] = "Handover" if runnable else "Restoring"
        s["prot"][sid] = NO if runnable else n
        if runnable:
            s["hostRef"][n] -= 1
            s["deadline"][sid] = min(st["now"] + r.ttl, r.max_time)
        if r.ring > 0 and c:
            if r.bug == "RingOverrun":
                s["queued"] = sorted({*st["queued"], n})
                _start_load(s, "tkv")
            else:
                s["queued"] = sorted({*st["queued"], n})
        return s
    if r.bug == "DoubleLoad" and ph == "Restoring" and e == st["epoch"][sid] and st["loadKey"][n] != NO:
        s["tgt"] = [n]
        s["loadAcks"][n] += 1
        s["lockRef"] = _locked(st, r, st["lockRef"], [n], 1)
    return s


def load_ack(st: State, r: Rules, k: str) -> State | None:
    if not (st["loadAcks"][k] > 0 and not _in_flight(st, k)):
        return None
    lim = len(r.nodes)
    s = copy.deepcopy(st)
    la2 = dict(st["loadAcks"])
    la2[k] -= 1
    lk2 = {m: (NO if v == k else v) for m, v in st["loadKey"].items()} if la2[k] == 0 else st["loadKey"]

    def loaded(x: str) -> bool:
        return all(st["dev"][m] and lk2[m] == NO for m in path(st, st["ref"][x], lim))

    done = [x for x in r.sessions if st["phase"][x] == "Restoring" and loaded(x)]
    warm = [x for x in r.sessions if st["phase"][x] == "Prefetching" and (loaded(x) or r.bug == "EarlyKept")]
    ps = _paths(st, r)
    s["loadAcks"] = la2
    s["loadKey"] = dict(lk2)
    early = r.bug == "EarlyRelease"  # the old manager dropped the pin here
    s["lockRef"] = {
        m: st["lockRef"][m]
        - through(ps, m, [k])
        - (sum(1 for x in done if m in ps[st["ref"][x]]) if early else 0)
        for m in st["lockRef"]
    }
    for x in done:
        s["phase"][x] = "Handover"
        s["prot"][x] = NO
        s["deadline"][x] = min(st["now"] + r.ttl, r.max_time)
    for x in warm:
        s["phase"][x] = "Kept"
        s["prot"][x] = NO
        s["deadline"][x] = r.warm_deadline(st["now"], st["deadline"][x])
    both = done + warm
    s["hostRef"] = {m: st["hostRef"][m] - sum(1 for x in both if st["prot"][x] == m) for m in st["hostRef"]}
    s["tgt"] = sorted({st["ref"][x] for x in both})
    return s


def start_loads(st: State, r: Rules) -> State | None:
    ring = st.get("ring", [])
    guard = len(ring) <= r.ring - 2 if r.bug == "RingTwoFree" else not ring
    if not (r.ring > 0 and st.get("queued") and guard):
        return None
    s = copy.deepcopy(st)
    _start_load(s, "tkv")
    s["tgt"] = []
    return s


def sys_start(st: State, r: Rules) -> State | None:
    if not (r.sys_loads and sum(1 for x in st.get("ring", ()) if x["who"] == "sys") <= 1):
        return None
    s = copy.deepcopy(st)
    _start_load(s, "sys")
    s["tgt"] = []
    return s


def ring_done(st: State, r: Rules) -> State | None:
    if not st.get("ring"):
        return None
    s = copy.deepcopy(st)
    s["ring"] = s["ring"][1:]
    s["tgt"] = []
    return s


def _released(st: State, s: State, r: Rules, who: Sequence[str]) -> None:
    ps = _paths(st, r)
    for x in who:
        s["prot"][x] = NO
    s["hostRef"] = {m: st["hostRef"][m] - sum(1 for x in who if st["prot"][x] == m) for m in st["hostRef"]}
    s["lockRef"] = {
        m: st["lockRef"][m]
        - sum(1 for x in who if st["phase"][x] in pinning(r) and m in ps.get(st["ref"][x], ()))
        for m in st["lockRef"]
    }


def ttl_sweep(st: State, r: Rules) -> State | None:
    due = [x for x in r.sessions if st["phase"][x] in EXPIRING and st["deadline"][x] <= st["now"]]
    if r.bug == "NoTtl" or not due:
        return None
    s = copy.deepcopy(st)
    _released(st, s, r, due)
    for x in due:
        s["phase"][x] = "Runnable" if st["phase"][x] in ("Handover", "Parked") else "Expired"
        if r.bug == "EpochReuse":
            s["epoch"][x] = 0
    s["tgt"] = sorted({st["prot"][x] if st["prot"][x] != NO else st["ref"][x] for x in due})
    return s


def close(st: State, r: Rules, sid: str) -> State | None:
    if st["phase"][sid] in ("New", "Closed"):
        return None
    s = copy.deepcopy(st)
    _released(st, s, r, [sid])
    s["phase"][sid] = "Closed"
    if r.bug != "ClosedKeepsRef":
        s["ref"][sid] = NO  # the record lets go of its node
    held = {st["prot"][sid]} | ({st["ref"][sid]} if st["phase"][sid] in pinning(r) else set())
    s["tgt"] = sorted(held - {NO})
    return s


def host_room(st: State, r: Rules, sid: str, m: str) -> State | None:
    n = st["ref"][sid]
    ok = st["phase"][sid] == "Running" and n != NO and st["epoch"][sid] < r.max_epoch
    if not (ok and st["status"][n] == "InTree"):
        return None
    w = [x for x in path(st, n, len(r.nodes)) if not st["host"][x]]
    fits, short = _host_fits(st, r, w, n)
    if r.fits is not None:  # the implementation made room: each evicted copy is one step
        fits, short = True, True
    if not (fits and short and m in host_evictable(st, r) and not kids(st, m)):
        return None
    s = copy.deepcopy(st)
    s["status"][m] = "Gone"
    s["host"][m] = False
    s["hostFree"] += 1
    s["tgt"] = []
    return s


def host_unmirror(st: State, r: Rules, sid: str, m: str) -> State | None:
    """Spec ``HostUnmirror``: once no evictable host copy is left, a ToolStart short of host room
    drops one mirror ``m`` (a leaf of the host copies): the device copy stays, the node stays."""
    n = st["ref"][sid]
    ok = r.unmirror and st["phase"][sid] == "Running" and n != NO and st["epoch"][sid] < r.max_epoch
    if not (ok and st["status"][n] == "InTree"):
        return None
    w = [x for x in path(st, n, len(r.nodes)) if not st["host"][x]]
    fits, short = _host_fits(st, r, w, n)
    if r.fits is not None:  # the implementation made room: each dropped mirror is one step
        fits, short = True, True
    if not (fits and short and not host_evictable(st, r) and m in mirror_room(st, r, n)):
        return None
    if any(st["host"][c] for c in kids(st, m)):
        return None
    s = copy.deepcopy(st)
    s["host"][m] = False
    s["hostFree"] += 1
    s["tgt"] = []
    return s


def _admit_parked(st: State, r: Rules, sid: str) -> State | None:
    """Spec ``Admit`` of a parked session: sglang's init_load_back loads the evicted path if it
    fits (the load and the request's lock hold it), else the request recomputes it; the
    protection goes. With the ring the request's batch starts the load with the whole queue
    (``ready_to_load_host_cache`` in the same scheduler step), as ``SysStart`` does."""
    n = st["ref"][sid]
    lim = len(r.nodes)
    # another session's load may be in flight on the path: sglang's match sees those nodes on the
    # device and the request's forward waits for the load (they are not in ``c`` below)
    if n == NO or st["status"][n] != "InTree" or st["extLock"][n]:
        return None
    pn = path(st, n, lim)
    s = copy.deepcopy(st)
    if st["prot"][sid] != NO:
        s["hostRef"][st["prot"][sid]] -= 1
    s["prot"][sid] = NO
    s["phase"][sid] = "Runnable"
    c = [m for m in pn if not st["dev"][m]]
    fits = r.fits if r.fits is not None else len(c) <= st["devFree"]
    fits = fits and _restore_fits(st, r, n, c)  # sglang's admission counts the room live
    # with the ring the load is started by the request's own batch (a "sys" start, with the
    # queue), at sglang's cadence: enabled only while at most one of its own loads is in flight
    starts = fits and r.ring > 0 and bool(c)
    if starts and sum(1 for x in st.get("ring", ()) if x["who"] == "sys") > 1:
        return None
    if fits:
        loads = 1 if c else 0
        for m in c:
            s["dev"][m] = True
            s["loadKey"][m] = n
        s["devFree"] -= len(c)
        s["loadAcks"][n] += loads
        s["lockRef"] = _locked(st, r, st["lockRef"], [n], 1 + loads)
        s["extLock"][n] = True
        if starts:
            s["queued"] = sorted({*st["queued"], n})
            _start_load(s, "sys")
    s["tgt"] = [n]
    return s


def park(st: State, r: Rules, sid: str, e: Any) -> State | None:
    """Spec ``Park``: the tool call is over; nothing is loaded or pinned, the protection stays."""
    e = int(e)
    if not (r.policy and st["phase"][sid] in ("Offloading", "Offloaded") and e == st["epoch"][sid]):
        return None
    s = copy.deepcopy(st)
    s["phase"][sid] = "Parked"
    s["deadline"][sid] = min(st["now"] + r.ttl, r.max_time)
    if r.bug == "ParkUnprotected":
        s["hostRef"][st["prot"][sid]] -= 1
        s["prot"][sid] = NO
    s["tgt"] = [st["ref"][sid]]
    return s


def unpin(st: State, r: Rules, sid: str) -> State | None:
    """Spec ``Unpin``: the hand-over's pin goes; a path backed up whole is protected again."""
    if not (r.policy and r.bug != "EarlyRelease" and st["phase"][sid] == "Handover"):
        return None
    n = st["ref"][sid]
    backed = all(st["host"][m] for m in path(st, n, len(r.nodes)))
    s = copy.deepcopy(st)
    s["lockRef"] = _locked(st, r, st["lockRef"], [n], -1)
    s["phase"][sid] = "Parked" if backed else "Runnable"
    if backed:
        s["prot"][sid] = n
        s["hostRef"][n] += 1
        s["deadline"][sid] = min(st["now"] + r.ttl, r.max_time)
    s["tgt"] = [n]
    return s


def admit(st: State, r: Rules, sid: str) -> State | None:
    if st["phase"][sid] == "Parked":
        return _admit_parked(st, r, sid)
    n = st["ref"][sid]
    ok = st["phase"][sid] == "Handover" and n != NO and path_valid(st, n, len(r.nodes))
    if not (ok and not st["extLock"][n]):
        return None
    s = copy.deepcopy(st)
    s["extLock"][n] = True
    if r.bug == "EarlyRelease":
        s["lockRef"] = _locked(st, r, st["lockRef"], [n], 1)
    s["phase"][sid] = "Runnable"
    s["tgt"] = [n]
    return s


# ---- the per-call policy ----------------------------------------------------------------------------
def keep(st: State, r: Rules, sid: str) -> State | None:
    n = st["ref"][sid]
    ok = r.policy and st["phase"][sid] == "Running" and n != NO and st["epoch"][sid] < r.max_epoch
    if not (ok and path_valid(st, n, len(r.nodes))):
        return None
    if r.fits is False or not promise_fits(
        st, r, st["devFree"], st["dev"], _locked(st, r, st["lockRef"], [n], 1)
    ):
        return None  # (r.fits False: the implementation found the pin's room promised)
    s = copy.deepcopy(st)
    if r.bug != "KeepNoPin":
        s["lockRef"] = _locked(st, r, st["lockRef"], [n], 1)
    s["epoch"][sid] += 1
    s["deadline"][sid] = r.keep_deadline(st["now"])
    s["phase"][sid] = "Kept"
    s["tgt"] = [n]
    return s


def let_go(st: State, r: Rules, sid: str) -> State | None:
    if not (r.policy and st["phase"][sid] == "Running" and st["epoch"][sid] < r.max_epoch):
        return None
    s = copy.deepcopy(st)
    s["epoch"][sid] += 1
    s["phase"][sid] = "Released"
    s["tgt"] = []
    return s


def demote(st: State, r: Rules, sid: str) -> State | None:
    if not (r.policy and st["phase"][sid] == "Offloaded"):
        return None
    s = copy.deepcopy(st)
    if r.bug != "DemoteKeepsRef":
        _released(st, s, r, [sid])
    s["phase"][sid] = "Released"
    s["tgt"] = [st["prot"][sid]]
    return s


def prefetch(st: State, r: Rules, sid: str) -> State | None:
    if not (r.policy and st["phase"][sid] == "Offloaded"):
        return None
    lim = len(r.nodes)
    n = st["ref"][sid]
    pn = path(st, n, lim)
    c = [m for m in pn if not st["dev"][m]]
    fits = r.fits if r.fits is not None else len(c) <= st["devFree"]
    if not fits or not _restore_fits(st, r, n, c):
        return None
    s = copy.deepcopy(st)
    lk2 = {m: (n if m in c else v) for m, v in st["loadKey"].items()}
    loads = 1 if c else 0
    ready = all(lk2[m] == NO for m in pn) or r.bug == "EarlyKept"
    for m in c:
        s["dev"][m] = True
    s["devFree"] -= len(c)
    s["loadKey"] = lk2
    s["loadAcks"][n] += loads
    s["lockRef"] = _locked(st, r, st["lockRef"], [n], loads + 1)
    s["phase"][sid] = "Kept" if ready else "Prefetching"
    s["prot"][sid] = NO if ready else n
    if ready:
        s["hostRef"][n] -= 1
        s["deadline"][sid] = r.warm_deadline(st["now"], st["deadline"][sid])
    if r.ring > 0 and c:
        s["queued"] = sorted({*st["queued"], n})
    s["tgt"] = [n]
    return s


def lock(st: State, r: Rules, n: str) -> State | None:
    if not (r.env_locks and st["status"][n] == "InTree" and not st["extLock"][n]):
        return None
    if not path_valid(st, n, len(r.nodes)):
        return None
    if not promise_fits(st, r, st["devFree"], st["dev"], _locked(st, r, st["lockRef"], [n], 1)):
        return None
    s = copy.deepcopy(st)
    s["extLock"][n] = True
    s["lockRef"] = _locked(st, r, st["lockRef"], [n], 1)
    s["tgt"] = []
    return s


def unlock(st: State, r: Rules, n: str) -> State | None:
    if not st["extLock"][n]:
        return None
    s = copy.deepcopy(st)
    s["extLock"][n] = False
    s["lockRef"] = _locked(st, r, st["lockRef"], [n], -1)
    s["tgt"] = []
    return s


def gpu_evict(st: State, r: Rules, n: str) -> State | None:
    ok = st["status"][n] == "InTree" and st["dev"][n] and st["lockRef"][n] == 0
    ok = ok and st["writeKey"][n] == NO and st["loadKey"][n] == NO
    ks = kids(st, n)
    if not (ok and not any(st["dev"][c] for c in ks)):
        return None
    s = copy.deepcopy(st)
    s["dev"][n] = False
    s["devFree"] += 1
    if not st["host"][n] or (r.bug == "OrphanHost" and not ks):
        s["status"][n] = "Gone"
    s["tgt"] = []
    return s


def host_evict(st: State, r: Rules, n: str) -> State | None:
    ok = st["status"][n] == "InTree" and st["host"][n] and not st["dev"][n] and not kids(st, n)
    ok = ok and st["lockRef"][n] == 0 and (r.bug == "EvictProtected" or st["hostRef"][n] == 0)
    if not ok:
        return None
    s = copy.deepcopy(st)
    s["status"][n] = "Gone"
    s["host"][n] = False
    s["hostFree"] += 1
    s["tgt"] = []
    return s


def write_through(st: State, r: Rules, n: str) -> State | None:
    ok = r.env_writes and st["status"][n] == "InTree" and st["dev"][n] and not st["host"][n]
    ok = ok and st["loadKey"][n] == NO
    p = st["parent"][n]
    ok = ok and (p == ROOT or st["host"][p]) and (not r.slots or st["hostFree"] >= 1)
    if not ok or not promise_fits(st, r, st["devFree"], st["dev"], _locked(st, r, st["lockRef"], [n], 1)):
        return None
    s = copy.deepcopy(st)
    s["host"][n] = True
    s["hostFree"] -= 1
    s["writeKey"][n] = n
    s["lockRef"] = _locked(st, r, st["lockRef"], [n], 1)
    s["tgt"] = []
    return s


def split(st: State, r: Rules, n: str, m: str) -> State | None:
    if not (st["status"][n] == "InTree" and st["status"][m] == "Unborn"):
        return None
    fits = (not st["dev"][n] or st["devFree"] >= 1) and (not st["host"][n] or st["hostFree"] >= 1)
    if r.slots and not fits:
        return None
    locked_split = r.slots and r.promised > 0 and st["dev"][n] and st["lockRef"][n] > 0  # the extra slot
    if locked_split and r.promised > room_of(st, st["devFree"], st["dev"], st["lockRef"]) - 1:
        return None
    s = copy.deepcopy(st)
    s["status"][m] = "InTree"
    s["parent"][m] = st["parent"][n]
    s["parent"][n] = m
    for var in ("dev", "host", "lockRef", "writeKey", "loadKey"):
        s[var][m] = st[var][n]
    s["hostRef"][m] = st["hostRef"][n] if r.bug == "SplitCopiesHostRef" else 0
    s["devFree"] -= 1 if st["dev"][n] else 0
    s["hostFree"] -= 1 if st["host"][n] else 0
    s["tgt"] = []
    return s


def insert(st: State, r: Rules, sid: str, p: str, n: str) -> State | None:
    ok = st["phase"][sid] in ("New", "Running", "Runnable", "Expired", "Lost", "Released")
    ok = ok and st["status"][n] == "Unborn" and path_valid(st, p, len(r.nodes))
    if not (ok and (not r.slots or st["devFree"] >= 1)):
        return None
    s = copy.deepcopy(st)
    s["status"][n] = "InTree"
    s["parent"][n] = p
    s["dev"][n] = True
    s["devFree"] -= 1
    s["ref"][sid] = n
    s["phase"][sid] = "Running"
    s["tgt"] = []
    return s


def tree_reset(st: State, r: Rules) -> State | None:
    idle = not st.get("ring") and all(v == NO for v in st["writeKey"].values())
    idle = idle and not any(st["loadAcks"].values())  # is_fully_idle: nothing pending
    if not (st["resets"] < r.max_resets and not any(st["extLock"].values()) and idle):
        return None
    s = copy.deepcopy(st)
    if "queued" in s:
        s["queued"] = []
    s["status"] = {n: ("Gone" if v == "InTree" else v) for n, v in st["status"].items()}
    for var, v0 in (("dev", False), ("host", False), ("lockRef", 0), ("hostRef", 0)):
        s[var] = dict.fromkeys(st[var], v0)
    for var in ("writeKey", "loadKey"):
        s[var] = dict.fromkeys(st[var], NO)
    s["loadAcks"] = dict.fromkeys(st["loadAcks"], 0)
    s["devFree"], s["hostFree"] = r.dev_slots, r.host_slots
    s["phase"] = {x: ("Lost" if v in HOLDING else v) for x, v in st["phase"].items()}
    s["prot"] = dict.fromkeys(st["prot"], NO)
    s["resets"] += 1
    s["tgt"] = []
    return s


def tick(st: State, r: Rules) -> State | None:
    if st["now"] >= r.max_time:
        return None
    s = copy.deepcopy(st)
    s["now"] += 1
    s["tgt"] = []
    return s


Action = Callable[..., State | None]

#: spec action name -> its successor function (parameters follow the state and the rules).
ACTIONS: dict[str, Action] = {
    "ToolStart": tool_start,
    "WriteAck": write_ack,
    "ToolEnd": tool_end,
    "LoadAck": load_ack,
    "StartLoads": start_loads,
    "TtlSweep": ttl_sweep,
    "Close": close,
    "Keep": keep,
    "LetGo": let_go,
    "Demote": demote,
    "Prefetch": prefetch,
    "HostRoom": host_room,
    "HostUnmirror": host_unmirror,
    "Admit": admit,
    "Park": park,
    "Unpin": unpin,
    "Lock": lock,
    "Unlock": unlock,
    "GpuEvict": gpu_evict,
    "HostEvict": host_evict,
    "WriteThrough": write_through,
    "Split": split,
    "Insert": insert,
    "TreeReset": tree_reset,
    "SysStart": sys_start,
    "RingDone": ring_done,
    "Tick": tick,
}


class UnknownAction(KeyError):
    """The spec has an action this port does not know (add it to :data:`ACTIONS`)."""


def successor(st: Mapping[str, Any], act: Sequence[Any], r: Rules) -> State | None:
    """The spec state after ``act`` (e.g. ``["ToolEnd", "s1", 1]``) from ``st``; None if not enabled.

    ``st`` needs every spec variable but ``act``/``tgt``; the result carries ``act`` and ``tgt``."""
    name = str(act[0])
    fn = ACTIONS.get(name)
    if fn is None:
        raise UnknownAction(f"no Python successor for spec action {name!r}: add it to specstep.ACTIONS")
    base = {k: v for k, v in st.items() if k not in ("act", "tgt")}
    out = fn(base, r, *[a if isinstance(a, int) else str(a) for a in act[1:]])
    if out is not None:
        out["act"] = [name, *act[1:]]
    return out


__all__ = ["ACTIONS", "Rules", "UnknownAction", "free_set", "path", "path_valid", "successor"]
