"""The manager's settings (``ManagerConfig``): TTLs, budgets, the call policy and its knobs.

Its own module so that the session machine, the call policies and the plugin's environment parser
(``toolkv.sglang.config``) can all import it without importing the manager.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from toolkv.core.policy import PolicyConfig

#: the call policies a tool_start can run under (``toolkv.core.calls``)
POLICIES = ("offload", "auto")


@dataclass(frozen=True)
class ManagerConfig:
    ttl_s: float = 600.0  # how long a protection lives without a tool_end
    host_budget_tokens: int | None = None  # cap on tokens toolkv keeps protected on host
    closed_history: int = 10_000  # closed sessions remembered for kv_meta (then 404)
    # "offload": every tool_start offloads (spec ToolStart); "auto": the per-call policy decides
    policy: str = "offload"
    policy_config: PolicyConfig = field(default_factory=PolicyConfig)
    # the restore rate the policy assumes until it has measured one (tokens per second)
    restore_tokens_per_s: float = 200_000.0
    prefetch: bool = True  # with policy "auto": restore early, before the tool is expected back
    # how long a pin on the GPU that waits for its tool_end (a kept session, or an early restore
    # once loaded: spec Kept) may live before the sweep releases it (never longer than ttl_s;
    # spec KeepTTL)
    keep_ttl_s: float = 30.0
    # how long a restored (or kept) session stays pinned waiting for its next request to be
    # admitted (spec Handover); never longer than ttl_s. Under load the next request can queue
    # for seconds: without the pin sglang evicts the KV it was restored for.
    handover_ttl_s: float = 30.0
    # a session that holds nothing and has had no turn or call for this long is forgotten (spec
    # Close): agents that end without close (zero-change mode never calls it) must not grow the
    # table for ever. inf: never.
    idle_ttl_s: float = 3600.0
    # With an L3 storage tier (sglang's --hicache-storage-backend): a host that must make room
    # stores an offloaded session's copy to L3 instead of dropping it. False: drop, as without one.
    l3: bool = True
    # With an L3 tier: a tool_end of a session whose copy lives in L3 (StoreAck whole) reads
    # nothing itself: spec Demote, then ToolEnd of the Released session, and sglang's own read at the
    # next request's arrival brings the copy (as under stock sglang with L3). toolkv's reads ahead
    # into a host with no room came back short; in the twin this kept more with long and named tools
    # (docs/benchmarks.md). False (what spec/storage/StorageTier.tla models): StoragePrefetch at
    # tool_end, and a read ahead of the predicted return for a session stored early.
    l3_read_at_arrival: bool = False
    # the rate the early restore assumes for reading a session back from L3 (tokens per second):
    # a session's early restore starts that much earlier once its copy lives in L3
    l3_read_tokens_per_s: float = 100_000.0
    # Load-adaptive protection (spec Park, Unpin): a tool_end whose next request would wait (the
    # device cannot take the restore's pin next to what running and queued requests need) parks
    # the session: its host copy stays protected, nothing is loaded or pinned, and sglang's own
    # load_back brings it in when the request is admitted. A hand-over's pin is given up (the host
    # copy protected again) when queued requests need the room. False (the base spec, without its
    # policy actions): restore at every tool_end that fits the running requests' promise, else 503,
    # and pin until admission whatever is queued. The plugin turns it on (TOOLKV_ADAPTIVE=1).
    adaptive: bool = False
    # Spec LazyFree: a finished offload leaves its GPU copies to sglang's eviction (unlocked, backed
    # up, in sglang's own LRU order) instead of freeing them; they are taken only when sglang needs
    # the room, and a session whose copy survives comes back with nothing to load.
    # False (the base spec): freed once the write is acknowledged. The plugin turns it on
    # (TOOLKV_LAZY_FREE=1) on backends that can (HiRadixCache under its LRU strategy).
    lazy_free: bool = False
    # Spec Unmirror: a tool_start the host cannot take, even after sglang's evict_host, drops host
    # mirrors of device copies running requests lock (the device copy stays; sglang writes the
    # mirror again when the request finishes), leaf first in LRU order, instead of answering 507.
    # HiRadixCache only. False: 507 (docs/twin.md, "Where the host pool goes").
    unmirror: bool = False

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
