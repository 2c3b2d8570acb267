"""What a manager call answers about one session: :class:`SessionView`, a typed record.

The HTTP routes answer it as JSON, byte for byte what they answered when the manager built a dict
by hand, so :meth:`SessionView.as_dict` is the one place that turns it into that dict (same keys,
same order, same values). The view is also a read-only ``Mapping`` over that dict, so a caller that
reads ``view["epoch"]`` or ``view.get("device_tokens")`` works unchanged; code that wants types
reads the fields.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import MISSING, dataclass, fields
from functools import cached_property

from toolkv.core.lifecycle import EXPIRING, TIER_STATES
from toolkv.core.phases import Phase
from toolkv.core.record import SessionRecord

#: the tier a session's record reports once its copy lives in the storage tier (L3)
L3_TIER = "l3"
#: the tiers a session's record can report: a node's tiers (``lifecycle.TIER_STATES``, but the
#: spec-only ``Unborn``), and ``l3``
TIERS: tuple[str, ...] = (*(t for t in TIER_STATES if t != "Unborn"), L3_TIER)


#: the phases of a tool call waiting for its tool_end (what an accepted tool_start leads to): a
#: tool_end restores from them, and so does a request of the session that arrives first
OPEN_CALL: frozenset[str] = frozenset(
    {Phase.OFFLOADING, Phase.OFFLOADED, Phase.KEPT, Phase.PREFETCHING, Phase.RELEASED}
)
#: what a session's placement says (``Backend.describe``): its tier and its token counts
PLACEMENT_KEYS: tuple[str, ...] = ("tier", "tokens", "device_tokens", "host_tokens")


@dataclass(frozen=True)
class CallDecision:
    """The per-call policy's last decision for the session (present once a tool call was decided)."""

    decision: str | None  # keep, offload or let_go
    reason: str  # why, a short snake_case word
    tool: str | None
    expected_s: float


@dataclass(frozen=True)
class RestoreOutcome:
    """What the last accepted tool_end did: loaded, found resident, parked, or left to recompute."""

    restore: str
    restored_tokens: int
    recompute_tokens: int


@dataclass(frozen=True, eq=False)
class SessionView(Mapping[str, object]):
    """One session as ``kv_meta`` and every session call answer it (see ``docs/operations.md``)."""

    session_id: str
    state: str
    epoch: int
    backend: str
    protected: bool
    deadline: float | None  # None outside the phases a TTL applies to
    placement: Mapping[str, object]  # the backend's ``describe``: tier and token counts
    l3: str = ""  # an Offloaded session's L3 sub-phase ("" without one)
    call: CallDecision | None = None
    restore: RestoreOutcome | None = None

    @classmethod
    def of(cls, rec: SessionRecord, backend_name: str, placement: Mapping[str, object]) -> SessionView:
        """The view of ``rec`` now (``placement`` is what the backend describes of it)."""
        return cls(
            session_id=rec.session_id,
            state=rec.state,
            epoch=rec.epoch,
            backend=backend_name,
            protected=rec.protected is not None,
            deadline=rec.deadline if rec.state in EXPIRING else None,
            placement=placement,
            l3=rec.l3,
            call=(
                CallDecision(rec.decision or None, rec.reason, rec.tool, rec.expected_s)
                if rec.reason
                else None
            ),
            restore=(
                RestoreOutcome(rec.restore, rec.restored_tokens, rec.recompute_tokens)
                if rec.restore
                else None
            ),
        )

    @staticmethod
    def closed_placement() -> dict[str, object]:
        """A closed session holds nothing anywhere."""
        return dict(zip(PLACEMENT_KEYS, ("Evicted", 0, 0, 0), strict=True))

    @property
    def tier(self) -> object:
        """Where the KV is: the backend's tier, or ``l3`` once the copy lives in the storage tier."""
        return self.as_dict().get("tier")

    @property
    def closed(self) -> bool:
        return self.state == Phase.CLOSED

    def as_dict(self) -> dict[str, object]:
        """The JSON object the HTTP routes answer (a fresh dict: the caller may change it)."""
        return dict(self._dict)

    @cached_property
    def _dict(self) -> dict[str, object]:
        out: dict[str, object] = {
            "session_id": self.session_id,
            "state": self.state,
            "epoch": self.epoch,
            "backend": self.backend,
            "protected": self.protected,
            "deadline": self.deadline,
        }
        out.update(self.placement)
        if self.l3:  # an Offloaded session's L3 sub-phase; its tier is l3 once the copy lives there
            out["l3"] = self.l3
            if self.l3 != "storing":
                out["tier"] = L3_TIER
        if self.call is not None:
            out.update(
                decision=self.call.decision,
                reason=self.call.reason,
                tool=self.call.tool,
                expected_s=self.call.expected_s,
            )
        if self.restore is not None:
            out.update(
                restore=self.restore.restore,
                restored_tokens=self.restore.restored_tokens,
                recompute_tokens=self.restore.recompute_tokens,
            )
        return out

    # ---- the read-only Mapping over as_dict() ------------------------------------------------------
    def __getitem__(self, key: str) -> object:
        return self._dict[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._dict)

    def __len__(self) -> int:
        return len(self._dict)

    def __repr__(self) -> str:
        return f"SessionView({self._dict!r})"


#: the keys every session record carries (the client's ``KVMeta`` has a field for each): the view's
#: own fields that have no default, then its placement's
RECORD_KEYS: tuple[str, ...] = (
    *(f.name for f in fields(SessionView) if f.default is MISSING and f.name != "placement"),
    *PLACEMENT_KEYS,
)
