"""The storage-tier model (``spec/storage/StorageTier.tla``) in Python: its bounds, its actions and
its invariants over states in the plain form TLC dumps them (``tla.to_plain``: a function of the
sessions is a dict, a set a sorted list).

Why a copy of the spec: the fuzz campaign (:mod:`toolkv.verify.storage.fuzzing`) checks every
implementation step against the spec's successor and the spec's invariants on the refinement
mapping, thousands of times per second; TLC cannot be asked that often. The copy is kept honest
by TLC itself: ``model_tests/test_storage_conformance.py`` requires that it explains every edge of
TLC's state graph (and no other successor), that its invariants hold on every state TLC reaches,
and that on each spec mutant's TLC error trace it reports the invariant TLC reports.

The names are the spec's; each action is one function of (state, session[, page]) returning the
successor or None where the action is not enabled.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

State = dict[str, Any]
Act = tuple[Any, ...]  # ("StorePage", "s1"), ("L3Evict", "s1", 2)

BUGS = (
    "none",
    "RestoreBeforeStoreAck",
    "TrustShortAck",
    "LateL3Protect",
    "ReleaseDropsPin",
    "ArrivalKeepsPin",
)
WAITING = frozenset({"Offloading", "Offloaded", "Storing", "Stored", "Prefetching"})  # the TTL applies
SESSION_VARS = (
    "phase", "gpu", "hostN", "hprot", "gw", "ld", "wr", "wn", "wfail", "l3", "l3prot", "pin", "pf",
    "rn", "rfail", "viaL3",
)  # fmt: skip
HISTORY = frozenset({"viaL3"})  # read by the witnesses only; no implementation object holds it
INVARIANTS = (
    "HostAccounting", "HostProtectionOwned", "StoreSourcePresent", "StoredWhole", "RestoreSourceWhole",
    "ReadSourcePresent", "LoadSourceWhole", "RunnableOnGpu", "ReleasedHoldsNothing",
)  # fmt: skip


@dataclass(frozen=True)
class StorageBounds:
    """The model's constants (``Sessions``, ``P``, ``HostSlots``, ``StoreFails``, ``ReadAtArrival``,
    ``BUG``)."""

    sessions: tuple[str, ...]
    pages: int
    host_slots: int
    store_fails: bool = True
    bug: str = "none"
    read_at_arrival: bool = False

    @classmethod
    def from_cfg(cls, consts: Mapping[str, Any]) -> StorageBounds:
        """From ``tla.cfg_constants`` of a StorageTier config."""
        return cls(
            sessions=tuple(str(s) for s in consts["Sessions"]),
            pages=int(consts["P"]),
            host_slots=int(consts["HostSlots"]),
            store_fails=bool(consts["StoreFails"]),
            bug=str(consts.get("BUG", "none")),
            read_at_arrival=bool(consts.get("ReadAtArrival", False)),
        )

    def cfg_constants(self) -> dict[str, str]:
        """The constants as TLA+ text, for ``tla.with_constants``."""
        return {
            "Sessions": "{" + ", ".join(self.sessions) + "}",
            "P": str(self.pages),
            "HostSlots": str(self.host_slots),
            "StoreFails": "TRUE" if self.store_fails else "FALSE",
            "ReadAtArrival": "TRUE" if self.read_at_arrival else "FALSE",
            "BUG": f'"{self.bug}"',
        }


def init(b: StorageBounds) -> State:
    """The spec's ``Init``."""

    def each(v: Any) -> dict[str, Any]:
        return {s: copy.copy(v) for s in b.sessions}

    return {
        "phase": each("Running"), "gpu": each(True), "hostN": each(0), "hprot": each(False),
        "gw": each(False), "ld": each(False), "wr": each(False), "wn": each(0), "wfail": each(False),
        "l3": each([]), "l3prot": each(False), "pin": each(0), "pf": each(False), "rn": each(0),
        "rfail": each(False), "viaL3": each(False), "hostFree": b.host_slots,
    }  # fmt: skip


def _pages(xs: Iterable[int]) -> list[int]:
    return sorted(set(xs), key=repr)  # as tla.to_plain orders a set


def _set(st: State, **changes: Any) -> State:
    """A successor: ``changes`` maps a variable to a new value, or to a dict of per-session
    overrides (``phase={"s1": "Stored"}``)."""
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in st.items()}
    for k, v in changes.items():
        if isinstance(v, dict):
            out[k].update(v)
        else:
            out[k] = v
    return out


# ---- the manager ---------------------------------------------------------------------------------------
def tool_start(st: State, s: str, b: StorageBounds) -> State | None:
    if st["phase"][s] != "Running" or not st["gpu"][s] or st["hostFree"] < b.pages:
        return None
    return _set(
        st, phase={s: "Offloading"}, gw={s: True}, hostN={s: b.pages}, hprot={s: True},
        hostFree=st["hostFree"] - b.pages,
    )  # fmt: skip


def host_ack(st: State, s: str, b: StorageBounds) -> State | None:
    if not st["gw"][s]:
        return None
    if st["phase"][s] == "Offloading":
        return _set(st, gw={s: False}, phase={s: "Offloaded"}, gpu={s: False})
    return _set(st, gw={s: False})


def store(st: State, s: str, b: StorageBounds) -> State | None:
    if st["phase"][s] != "Offloaded" or st["wr"][s]:
        return None
    return _set(
        st, phase={s: "Storing"}, wr={s: True}, wn={s: 0}, wfail={s: False},
        l3prot={s: b.bug != "LateL3Protect"},
    )  # fmt: skip


def store_ack(st: State, s: str, b: StorageBounds) -> State | None:
    if not st["wr"][s] or not (st["wn"][s] == b.pages or st["wfail"][s]):
        return None
    if st["phase"][s] != "Storing":
        return _set(st, wr={s: False})
    whole = st["wn"][s] == b.pages or b.bug == "TrustShortAck"
    return _set(
        st, wr={s: False}, phase={s: "Stored" if whole else "Offloaded"}, hprot={s: not whole},
        l3prot={s: whole},
    )  # fmt: skip


def _load_from_host(s: str) -> dict[str, Any]:
    return {"phase": {s: "Loading"}, "ld": {s: True}, "hprot": {s: True}}


def tool_end_from_host(st: State, s: str, b: StorageBounds) -> State | None:
    ph = st["phase"][s]
    if not (
        ph == "Offloaded"
        or (ph == "Storing" and b.bug != "RestoreBeforeStoreAck")
        or (ph == "Stored" and st["hostN"][s] == b.pages and not b.read_at_arrival)
    ):
        return None
    return _set(st, **_load_from_host(s), l3prot={s: False})


def storage_prefetch(st: State, s: str, b: StorageBounds) -> State | None:
    ph = st["phase"][s]
    if not (
        (ph == "Stored" and st["hostN"][s] == 0 and not b.read_at_arrival)
        or (ph == "Storing" and b.bug == "RestoreBeforeStoreAck")
    ):
        return None
    if st["pf"][s] or st["hostFree"] < b.pages:
        return None
    return _set(
        st, phase={s: "Prefetching"}, pf={s: True}, pin={s: 1}, rn={s: 0}, rfail={s: False},
        hprot={s: False}, l3prot={s: True}, hostFree=st["hostFree"] - b.pages,
    )  # fmt: skip


def tool_end_at_arrival(st: State, s: str, b: StorageBounds) -> State | None:
    if not b.read_at_arrival or st["phase"][s] != "Stored":
        return None
    return _set(st, phase={s: "Running"}, hprot={s: False}, l3prot={s: b.bug == "ArrivalKeepsPin"})


def prefetch_ack(st: State, s: str, b: StorageBounds) -> State | None:
    if not st["pf"][s] or not (st["rn"][s] == b.pages or st["rfail"][s]):
        return None
    rn = st["rn"][s]
    base: dict[str, Any] = {
        "pf": {s: False}, "pin": {s: 0}, "hostN": {s: rn}, "hostFree": st["hostFree"] + (b.pages - rn),
    }  # fmt: skip
    if st["phase"][s] != "Prefetching":
        return _set(st, **base)
    if rn == b.pages:
        out = _set(st, **base, l3prot={s: False}, viaL3={s: True})
        return _set(out, **_load_from_host(s))
    return _set(st, **base, l3prot={s: False}, phase={s: "Lost"})


def load_ack(st: State, s: str, b: StorageBounds) -> State | None:
    if not st["ld"][s]:
        return None
    if st["phase"][s] == "Loading":
        return _set(st, ld={s: False}, gpu={s: True}, phase={s: "Runnable"}, hprot={s: False})
    return _set(st, ld={s: False}, gpu={s: True})


def _release(st: State, s: str, to: str, b: StorageBounds) -> State:
    out = _set(st, phase={s: to}, hprot={s: False}, l3prot={s: False})
    if b.bug == "ReleaseDropsPin":
        out["pin"][s] = 0
    return out


def expire(st: State, s: str, b: StorageBounds) -> State | None:
    return _release(st, s, "Expired", b) if st["phase"][s] in WAITING else None


def close(st: State, s: str, b: StorageBounds) -> State | None:
    return _release(st, s, "Closed", b) if st["phase"][s] != "Closed" else None


# ---- sglang's threads and the environment --------------------------------------------------------------
def store_page(st: State, s: str, b: StorageBounds) -> State | None:
    if not st["wr"][s] or st["wfail"][s] or st["wn"][s] >= b.pages:
        return None
    wn = st["wn"][s]
    return _set(st, wn={s: wn + 1}, l3={s: _pages([*st["l3"][s], wn + 1])})


def store_refused(st: State, s: str, b: StorageBounds) -> State | None:
    if not b.store_fails or not st["wr"][s] or st["wfail"][s] or st["wn"][s] >= b.pages:
        return None
    return _set(st, wfail={s: True})


def read_page(st: State, s: str, b: StorageBounds) -> State | None:
    if not st["pf"][s] or st["rfail"][s] or st["rn"][s] >= b.pages:
        return None
    if st["rn"][s] + 1 in st["l3"][s]:
        return _set(st, rn={s: st["rn"][s] + 1})
    return _set(st, rfail={s: True})


def l3_evict(st: State, s: str, p: int, b: StorageBounds) -> State | None:
    if p not in st["l3"][s] or st["l3prot"][s] or st["pin"][s] != 0:
        return None
    return _set(st, l3={s: [x for x in st["l3"][s] if x != p]})


def host_evict(st: State, s: str, b: StorageBounds) -> State | None:
    if not (st["hostN"][s] > 0 and not (st["hprot"][s] or st["wr"][s] or st["ld"][s] or st["gw"][s])):
        return None
    return _set(st, hostN={s: 0}, hostFree=st["hostFree"] + st["hostN"][s])


SessionAction = Callable[[State, str, StorageBounds], "State | None"]

#: every action of ``Next`` but ``L3Evict`` (which also takes a page), by the name TLC labels it with
ACTIONS: dict[str, SessionAction] = {
    "ToolStart": tool_start,
    "HostAck": host_ack,
    "Store": store,
    "StoreAck": store_ack,
    "ToolEndFromHost": tool_end_from_host,
    "StoragePrefetch": storage_prefetch,
    "ToolEndAtArrival": tool_end_at_arrival,
    "PrefetchAck": prefetch_ack,
    "LoadAck": load_ack,
    "Expire": expire,
    "Close": close,
    "StorePage": store_page,
    "StoreRefused": store_refused,
    "ReadPage": read_page,
    "HostEvict": host_evict,
}
ACTION_NAMES = (*ACTIONS, "L3Evict")


def step(st: State, act: Act, b: StorageBounds) -> State | None:
    """The successor of ``st`` by ``act`` (``(name, session)`` or ``("L3Evict", session, page)``),
    or None where the spec does not enable it."""
    if act[0] == "L3Evict":
        return l3_evict(st, str(act[1]), int(act[2]), b)
    return ACTIONS[str(act[0])](st, str(act[1]), b)


def successors(st: State, b: StorageBounds) -> list[tuple[Act, State]]:
    """Every (action, successor) pair of ``Next`` from ``st``."""
    out: list[tuple[Act, State]] = []
    for s in b.sessions:
        for name in ACTIONS:
            nxt = step(st, (name, s), b)
            if nxt is not None:
                out.append(((name, s), nxt))
        for p in range(1, b.pages + 1):
            nxt = l3_evict(st, s, p, b)
            if nxt is not None:
                out.append((("L3Evict", s, p), nxt))
    return out


# ---- invariants ----------------------------------------------------------------------------------------
def violations(st: State, b: StorageBounds) -> list[str]:
    """The spec's safety invariants (``MC_safety.cfg``, TypeOK aside) that ``st`` violates."""
    ss, pg = b.sessions, list(range(1, b.pages + 1))
    held = sum(st["hostN"][s] + (b.pages if st["pf"][s] else 0) for s in ss)
    checks: dict[str, bool] = {
        "HostAccounting": st["hostFree"] + held == b.host_slots,
        "HostProtectionOwned": all(
            not st["hprot"][s]
            or (
                st["hostN"][s] == b.pages
                and st["phase"][s] in ("Offloading", "Offloaded", "Storing", "Stored", "Loading")
            )
            for s in ss
        ),
        "StoreSourcePresent": all(not st["wr"][s] or st["hostN"][s] == b.pages for s in ss),
        "StoredWhole": all(
            st["phase"][s] != "Stored" or (sorted(st["l3"][s]) == pg and st["l3prot"][s]) for s in ss
        ),
        "RestoreSourceWhole": all(
            st["phase"][s] != "Prefetching"
            or (not st["wr"][s] and sorted(st["l3"][s]) == pg and st["l3prot"][s])
            for s in ss
        ),
        "ReadSourcePresent": all(
            not st["pf"][s] or all(p in st["l3"][s] for p in pg if p > st["rn"][s]) for s in ss
        ),
        "LoadSourceWhole": all(
            st["phase"][s] != "Loading" or (st["hostN"][s] == b.pages and st["hprot"][s] and st["ld"][s])
            for s in ss
        ),
        "RunnableOnGpu": all(st["phase"][s] != "Runnable" or st["gpu"][s] for s in ss),
        "ReleasedHoldsNothing": all(
            st["phase"][s] not in ("Expired", "Lost", "Closed", "Runnable", "Running")
            or not (st["hprot"][s] or st["l3prot"][s])
            for s in ss
        ),
    }
    return [name for name in INVARIANTS if not checks[name]]


def explain(
    pre: State, post: State, act: Act | None, b: StorageBounds, others: Iterable[str] = (), depth: int = 4
) -> list[Act] | None:
    """The spec steps one implementation step stands for: ``act`` once (None: not at all), and
    before or after it up to ``depth`` steps of the actions named in ``others``, of any session,
    that together lead from ``pre`` to ``post``. Why more than one: one call of the
    implementation may take several spec steps at once — a ``tool_start`` whose host lacks room
    has sglang's ``evict_host`` free unprotected host copies first (``HostEvict`` of each), a TTL
    sweep expires every session that is due (``Expire`` of each). None: no such sequence. An
    action of another session is tried only while that session's variables differ from ``post``."""
    extra = [(name, s) for s in b.sessions for name in others]

    def moves(cur: State, a: Act) -> bool:
        s = a[1]
        return any(cur[v][s] != post[v][s] for v in SESSION_VARS)

    def dfs(cur: State, path: list[Act], used: bool, left: int) -> list[Act] | None:
        if (used or act is None) and cur == post:
            return path
        if left == 0:
            return None
        for a in ([act] if act is not None and not used else []) + extra:
            if a != act and not moves(cur, a):
                continue
            nxt = step(cur, a, b)
            if nxt is None or nxt == cur:
                continue
            got = dfs(nxt, [*path, a], used or a == act, left - 1)
            if got is not None:
                return got
        return None

    if act is not None:
        first = step(pre, act, b)
        if first == post:
            return [act]
    return dfs(pre, [], False, depth + (1 if act is not None else 0))


__all__ = [
    "ACTIONS",
    "ACTION_NAMES",
    "BUGS",
    "HISTORY",
    "INVARIANTS",
    "SESSION_VARS",
    "StorageBounds",
    "explain",
    "init",
    "step",
    "successors",
    "violations",
]
