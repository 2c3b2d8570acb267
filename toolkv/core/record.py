"""The manager's record of one agent session (the spec's per-session variables)."""

from __future__ import annotations

import math
from array import array
from dataclasses import dataclass, field
from typing import Any

from toolkv.core.treeops import TreeNode


@dataclass(slots=True, eq=False)
class SessionRecord:
    """Spec variables ``phase``, ``ref``, ``epoch``, ``prot``, ``deadline`` of one session, plus
    what the implementation needs to re-find and describe its KV.

    ``node`` is the session's last node (``ref``); it can go stale, so it is only ever used after
    ``treeops.attached`` and the tree generation check. ``protected`` and ``pinned`` are the exact
    objects this session took a ``host_ref_counter`` / ``lock_ref`` on — released exactly once.
    """

    session_id: str
    state: str = "New"
    epoch: int = 0
    tokens: array[int] = field(default_factory=lambda: array("q"))
    extra_key: str | None = None
    node: TreeNode | None = None
    tree_gen: int = 0
    protected: TreeNode | None = None
    pinned: TreeNode | None = None
    deadline: float = math.inf
    deadline_seq: int = 0
    # per-offload bookkeeping for kv_meta / metrics
    offload_tokens: int = 0
    freed_tokens: int = 0
    restored_tokens: int = 0
    recompute_tokens: int = 0  # below load_back_threshold: left to the next request to recompute
    restore: str = ""  # the last tool_end's outcome: resident, loading, below_load_back_threshold
    backend_state: Any = None  # backend-private (e.g. the shadow snapshot)
    last_error: str = ""
    # the per-call policy: the current tool call and what was decided for it
    tool: str | None = None  # the tool's name, when the client said it
    tool_started_at: float = 0.0  # agreed clock at tool_start
    decision: str = ""  # keep, offload or let_go
    call_open: bool = False  # a tool call whose duration the model has not seen yet
    reason: str = ""  # why (a short snake_case word, also a metrics label)
    expected_s: float = 0.0  # the duration estimate the decision used
    prefetch_at: float = math.inf  # agreed clock time of the early restore (offloaded sessions)
    restore_started_at: float = 0.0  # agreed clock when the last load was queued (restore rate)
    admit_pending: bool = False  # the next request was admitted while the load was in flight
    last_active: float = 0.0  # agreed clock of the session's last turn or call (idle expiry)
    # the L3 storage tier (an ``Offloaded`` session's sub-phase, spec/storage/StorageTier.tla):
    # "" (none), "storing" (Store, host copy still protected), "stored" (StoreAck whole: the copy
    # lives in L3, host protection released), "fetching" (StoragePrefetch, the copy pinned)
    l3: str = ""
    l3_then: str = ""  # what a fetch leads to at its ack: "tool_end" (restore) or "prefetch" (early)
    target: str | None = None  # used by lifecycle.fire while a transition runs
