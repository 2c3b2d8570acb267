"""Plain RadixCache fallback: keep the session's KV on the GPU, pinned against eviction.

There is no host tier to move to, so ToolStart takes one path lock (``inc_lock_ref`` on the
recorded leaf) within a token budget, and ToolEnd / TTL / Close return it exactly once. The GPU
memory is not freed during the tool call — the win is that the prefix survives eviction pressure
and the next turn is a full cache hit.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from toolkv.core.backends.base import (
    Agreement,
    LocalAgreement,
    LockPins,
    SynchronousLoads,
    device_pressure,
    offload_lock_cost,
)
from toolkv.core.policy import Pressure
from toolkv.core.record import SessionRecord
from toolkv.core.treeops import Tier, Tree, TreeNode, attached, path_to
from toolkv.errors import HostMemoryFull


class PinBackend(SynchronousLoads, LockPins):
    name = "pin"

    def __init__(
        self, tree: Tree, *, agree: Agreement | None = None, budget_tokens: int | None = None
    ) -> None:
        self.tree = tree
        self.agree = agree or LocalAgreement()
        self.budget_tokens = budget_tokens
        self.pinned_tokens = 0
        self._handed: dict[str, int] = {}  # session -> budget tokens of its handed-over pin
        # Device tokens sglang has promised but not allocated yet (bound by the scheduler side):
        # the offload's pin must leave them free or evictable.
        self.headroom: Callable[[], int] = lambda: 0

    def offload_lock_cost(self, leaf: TreeNode) -> int:
        """Device tokens the offload's pin takes from what sglang may evict: the path's resident
        unlocked nodes (``inc_lock_ref`` on the leaf locks the whole path)."""
        path = path_to(self.tree, leaf)
        return offload_lock_cost(path, lambda m: m is leaf, lambda m: m.value is not None and m.lock_ref == 0)

    def offload(self, rec: SessionRecord, leaf: TreeNode) -> bool:
        tokens = sum(len(m.key) for m in path_to(self.tree, leaf))
        ok = self.budget_tokens is None or self.pinned_tokens + tokens <= self.budget_tokens
        if not self.agree.all_true(ok):
            raise HostMemoryFull(
                f"pin budget exhausted: {self.pinned_tokens} + {tokens} > {self.budget_tokens} tokens",
                need_tokens=tokens,
            )
        self.tree.inc_lock_ref(leaf)
        rec.protected = leaf
        rec.offload_tokens = tokens
        self.pinned_tokens += tokens
        return True

    def offload_pending(self, rec: SessionRecord) -> bool:
        return False

    def free_gpu(self, recs: Sequence[SessionRecord]) -> None:
        for r in recs:
            r.freed_tokens = 0

    def restore(self, rec: SessionRecord) -> bool:
        """The offload's pin becomes the hand-over's (spec ``Handover``): the same path lock, still
        counted against the budget until the next request is admitted (``unpin``)."""
        if rec.protected is not None and rec.pinned is None:
            rec.pinned, rec.protected = rec.protected, None
            self._handed[rec.session_id] = rec.offload_tokens
        return True

    def unpin(self, rec: SessionRecord) -> None:
        super().unpin(rec)
        self.pinned_tokens -= self._handed.pop(rec.session_id, 0)

    def release(self, rec: SessionRecord) -> None:
        self.unpin(rec)
        self.release_protection(rec)

    def release_protection(self, rec: SessionRecord) -> None:
        if rec.protected is not None:
            self.tree.dec_lock_ref(rec.protected)
            rec.protected = None
            self.pinned_tokens -= rec.offload_tokens

    def forget(self, rec: SessionRecord) -> None:
        if rec.protected is not None:
            self.pinned_tokens -= rec.offload_tokens
        self.pinned_tokens -= self._handed.pop(rec.session_id, 0)
        rec.protected = None
        rec.pinned = None

    def worth_prefetching(self, rec: SessionRecord) -> bool:
        return True

    def pressure(self) -> Pressure:
        """The "host" of a GPU pin is its budget: pinning is what an offload does here."""
        dev_total, dev_avail = device_pressure(self.tree)
        budget = self.budget_tokens if self.budget_tokens is not None else dev_total
        return Pressure(dev_total, dev_avail, budget, max(0, min(budget, budget - self.pinned_tokens)))

    def reset(self) -> None:
        return None

    def describe(self, rec: SessionRecord) -> dict[str, object]:
        node = rec.node
        if node is None or not attached(self.tree, node):
            return {"tier": Tier.EVICTED.value, "tokens": 0, "device_tokens": 0, "host_tokens": 0}
        tokens = sum(len(m.key) for m in path_to(self.tree, node))
        return {
            "tier": Tier.GPU.value,
            "pinned": rec.protected is not None or rec.pinned is not None,
            "tokens": tokens,
            "device_tokens": tokens,
            "host_tokens": 0,
        }
