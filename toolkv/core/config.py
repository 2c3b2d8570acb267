"""The manager's settings (``ManagerConfig``): TTLs, budgets, the call policy and its knobs.

Every default is the one ``toolkv.core.settings`` declares, the plugin's: a test or an embedder
that builds a ``ToolKVManager`` without settings gets the machine a server runs (load-adaptive
protection, lazy free and L3 read at arrival on). A test of the base spec's eager path says so
(``adaptive=False, lazy_free=False``).

Its own module so that the session machine, the call policies and the plugin's environment parser
(``toolkv.sglang.config``) can all import it without importing the manager.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from toolkv.core.policy import PolicyConfig
from toolkv.core.settings import POLICY_NAMES, default

#: the call policies a tool_start can run under (``toolkv.core.calls``; ``settings.PolicyName``)
POLICIES = POLICY_NAMES


@dataclass(frozen=True)
class ManagerConfig:
    ttl_s: float = default("ttl_s")  # how long a protection lives without a tool_end
    host_budget_tokens: int | None = default(
        "host_budget_tokens"
    )  # cap on tokens toolkv keeps protected on host
    closed_history: int = default("closed_history")  # closed sessions remembered for kv_meta (then 404)
    # "offload": every tool_start offloads (spec ToolStart); "auto": the per-call policy decides
    policy: str = default("policy")
    policy_config: PolicyConfig = field(default_factory=PolicyConfig)
    # the restore rate the policy assumes until it has measured one (tokens per second)
    restore_tokens_per_s: float = default("restore_tokens_per_s")
    prefetch: bool = default(
        "prefetch"
    )  # with policy "auto": restore early, before the tool is expected back
    # how long a pin on the GPU that waits for its tool_end (a kept session, or an early restore
    # once loaded: spec Kept) may live before the sweep releases it (never longer than ttl_s;
    # spec KeepTTL)
    keep_ttl_s: float = default("keep_ttl_s")
    # how long a restored (or kept) session stays pinned waiting for its next request to be
    # admitted (spec Handover); never longer than ttl_s. Under load the next request can queue
    # for seconds: without the pin sglang evicts the KV it was restored for.
    handover_ttl_s: float = default("handover_ttl_s")
    # a session that holds nothing and has had no turn or call for this long is forgotten (spec
    # Close): agents that end without close (zero-change mode never calls it) must not grow the
    # table for ever. inf: never.
    idle_ttl_s: float = default("idle_ttl_s")
    # With an L3 storage tier (sglang's --hicache-storage-backend): a host that must make room
    # stores an offloaded session's copy to L3 instead of dropping it. False: drop, as without one.
    l3: bool = default("l3")
    # With an L3 tier: a tool_end of a session whose copy lives in L3 (StoreAck whole) reads
    # nothing itself: spec Demote, then ToolEnd of the Released session, and sglang's own read at the
    # next request's arrival brings the copy (as under stock sglang with L3). toolkv's reads ahead
    # into a host with no room came back short; in the twin this kept more with long and named tools
    # (docs/benchmarks.md). False (what spec/storage/StorageTier.tla models): StoragePrefetch at
    # tool_end, and a read ahead of the predicted return for a session stored early.
    l3_read_at_arrival: bool = default("l3_read_at_arrival")
    # the rate the early restore assumes for reading a session back from L3 (tokens per second):
    # a session's early restore starts that much earlier once its copy lives in L3
    l3_read_tokens_per_s: float = default("l3_read_tokens_per_s")
    # Load-adaptive protection (spec Park, Unpin): a tool_end whose next request would wait (the
    # device cannot take the restore's pin next to what running and queued requests need) parks
    # the session: its host copy stays protected, nothing is loaded or pinned, and sglang's own
    # load_back brings it in when the request is admitted. A hand-over's pin is given up (the host
    # copy protected again) when queued requests need the room. False (the base spec, without its
    # policy actions): restore at every tool_end that fits the running requests' promise, else 503,
    # and pin until admission whatever is queued.
    adaptive: bool = default("adaptive")
    # Spec LazyFree: a finished offload leaves its GPU copies to sglang's eviction (unlocked, backed
    # up, in sglang's own LRU order) instead of freeing them; they are taken only when sglang needs
    # the room, and a session whose copy survives comes back with nothing to load.
    # False (the base spec): freed once the write is acknowledged. Only backends that can honour it
    # (HiRadixCache under its LRU strategy) do; the others free at once.
    lazy_free: bool = default("lazy_free")
    # Spec Unmirror: a tool_start the host cannot take, even after sglang's evict_host, drops host
    # mirrors of device copies running requests lock (the device copy stays; sglang writes the
    # mirror again when the request finishes), leaf first in LRU order, instead of answering 507.
    # HiRadixCache under write_through*, docs/policy.md "Host room from mirrors".
    unmirror: bool = default("unmirror")

    @classmethod
    def eager(cls, **overrides: Any) -> ManagerConfig:
        """The base spec's machine, without its load-adaptive and lazy-free actions: an offload
        frees the device copy once its write is acknowledged, a ``tool_end`` restores it (or answers
        503) and pins until admission whatever is queued. What a test of the restore path asks
        for by name; no server runs it unless told ``TOOLKV_ADAPTIVE=0 TOOLKV_LAZY_FREE=0``."""
        return cls(**{"adaptive": False, "lazy_free": False, **overrides})

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, not {self.policy!r}")
        if not self.keep_ttl_s >= 0:
            raise ValueError("keep_ttl_s must be a number of seconds >= 0")
        if not self.handover_ttl_s >= 0:
            raise ValueError("handover_ttl_s must be a number of seconds >= 0")
        if not self.idle_ttl_s > 0:
            raise ValueError("idle_ttl_s must be a number of seconds > 0 (inf: never)")
        if not (self.restore_tokens_per_s > 0 and self.restore_tokens_per_s < float("inf")):
            raise ValueError("restore_tokens_per_s must be a positive number")
        if not (self.l3_read_tokens_per_s > 0 and self.l3_read_tokens_per_s < float("inf")):
            raise ValueError("l3_read_tokens_per_s must be a positive number")
