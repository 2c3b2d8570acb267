"""Plain RadixCache fallback: a shadow copy in host memory.

ToolStart copies the session's *exclusive* branch (the nodes from its leaf up to the first node
shared with another branch or locked by a running request) to host memory, then removes that
branch from the tree, freeing its GPU slots. ToolEnd allocates slots, copies the bytes back and
re-inserts the branch under its prefix. If the prefix itself was evicted meanwhile, nothing is
re-inserted (the next turn recomputes) and the snapshot is dropped.

The copy is synchronous (the GPU is asked to finish it before the branch is removed), so this
backend has no in-flight states: it is the simple, always-available fallback.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from toolkv.core.backends.base import Agreement, LocalAgreement, LockPins, SynchronousLoads, device_pressure
from toolkv.core.policy import Pressure
from toolkv.core.record import SessionRecord
from toolkv.core.treeops import Tier, Tree, TreeNode, attached, path_to, walk
from toolkv.errors import DeviceMemoryFull, HostMemoryFull


@dataclass
class Snapshot:
    prefix_len: int  # tokens of the path that stayed in the tree
    k: list[torch.Tensor]  # per layer [n, heads, dim] on host
    v: list[torch.Tensor]

    @property
    def tokens(self) -> int:
        return int(self.k[0].shape[0]) if self.k else 0


class ShadowBackend(SynchronousLoads, LockPins):
    name = "shadow"

    def __init__(
        self, tree: Tree, *, agree: Agreement | None = None, budget_tokens: int | None = None
    ) -> None:
        self.tree = tree
        self.agree = agree or LocalAgreement()
        self.budget_tokens = budget_tokens
        self.host_tokens = 0
        self.kv_pool = tree.token_to_kv_pool_allocator.get_kvcache()
        self.allocator = tree.token_to_kv_pool_allocator

    def _exclusive(self, leaf: TreeNode) -> list[TreeNode]:
        """Bottom-up: the leaf and its ancestors while each is unlocked and has no other child."""
        out: list[TreeNode] = []
        node, came_from = leaf, None
        while node is not self.tree.root_node and node.lock_ref == 0:
            others = [c for c in node.children.values() if c is not came_from]
            if others:
                break
            out.append(node)
            node, came_from = node.parent, node
        return out

    def offload(self, rec: SessionRecord, leaf: TreeNode) -> bool:
        branch = self._exclusive(leaf)
        path = path_to(self.tree, leaf)
        n = sum(len(m.key) for m in branch)
        ok = self.budget_tokens is None or self.host_tokens + n <= self.budget_tokens
        if not self.agree.all_true(ok):
            raise HostMemoryFull(f"shadow budget exhausted: {self.host_tokens} + {n} > {self.budget_tokens}")
        top_down = list(reversed(branch))
        snap = Snapshot(prefix_len=sum(len(m.key) for m in path) - n, k=[], v=[])
        if branch:
            idx = torch.cat([m.value for m in top_down])
            pin = self.kv_pool.k_buffer[0].is_cuda
            for layer in range(self.kv_pool.layer_num):
                snap.k.append(self.kv_pool.k_buffer[layer][idx].to("cpu", non_blocking=False))
                snap.v.append(self.kv_pool.v_buffer[layer][idx].to("cpu", non_blocking=False))
                if pin:
                    snap.k[-1], snap.v[-1] = snap.k[-1].pin_memory(), snap.v[-1].pin_memory()
            for m in branch:  # bottom-up: each is a leaf when removed
                self.allocator.free(m.value)
                self.tree._delete_leaf(m)
            rec.node = path[len(path) - len(branch) - 1] if len(path) > len(branch) else None
        rec.backend_state = snap
        rec.offload_tokens = n
        rec.freed_tokens = n
        self.host_tokens += n
        return True

    def offload_pending(self, rec: SessionRecord) -> bool:
        return False

    def free_gpu(self, recs: Sequence[SessionRecord]) -> None:
        return None  # the branch was removed synchronously in offload()

    def restore(self, rec: SessionRecord) -> bool:
        snap: Snapshot | None = rec.backend_state
        assert snap is not None, "restore without a snapshot"
        n = snap.tokens
        ok = n == 0 or self.allocator.available_size() >= n
        if not self.agree.all_true(ok):
            raise DeviceMemoryFull(
                f"cannot re-insert {n} tokens now; session {rec.session_id!r} stays offloaded"
            )
        if n:
            tokens = rec.tokens
            _node, matched = walk(self.tree, tokens[: snap.prefix_len], rec.extra_key)
            if matched == snap.prefix_len:
                from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams
                from sglang.srt.mem_cache.radix_cache import RadixKey

                key = RadixKey(tokens[: snap.prefix_len + n], rec.extra_key)
                prefix = self.tree.match_prefix(MatchPrefixParams(key=key)).device_indices[: snap.prefix_len]
                idx = self.allocator.alloc(n)
                assert idx is not None
                for layer in range(self.kv_pool.layer_num):
                    self.kv_pool.k_buffer[layer][idx] = snap.k[layer].to(idx.device)
                    self.kv_pool.v_buffer[layer][idx] = snap.v[layer].to(idx.device)
                res = self.tree.insert(InsertParams(key=key, value=torch.cat([prefix, idx])))
                dup = int(res.prefix_len) - snap.prefix_len
                if dup > 0:
                    self.allocator.free(idx[:dup])
                rec.node = walk(self.tree, key.token_ids, rec.extra_key)[0]
                rec.restored_tokens = n
        self.release(rec)
        return True

    def release(self, rec: SessionRecord) -> None:
        self.unpin(rec)
        self.release_protection(rec)

    def release_protection(self, rec: SessionRecord) -> None:
        snap = rec.backend_state
        if snap is not None:
            self.host_tokens -= snap.tokens
            rec.backend_state = None

    def forget(self, rec: SessionRecord) -> None:
        rec.pinned = None  # the pinned node went with the tree
        self.release_protection(rec)  # snapshots live outside the tree: a reset does not invalidate them

    def worth_prefetching(self, rec: SessionRecord) -> bool:
        return True

    def pressure(self) -> Pressure:
        dev_total, dev_avail = device_pressure(self.tree)
        budget = self.budget_tokens if self.budget_tokens is not None else dev_total
        return Pressure(dev_total, dev_avail, budget, max(0, min(budget, budget - self.host_tokens)))

    def reset(self) -> None:
        return None

    def describe(self, rec: SessionRecord) -> dict[str, object]:
        snap = rec.backend_state
        node = rec.node
        dev = (
            sum(len(m.key) for m in path_to(self.tree, node))
            if node is not None and attached(self.tree, node)
            else 0
        )
        host = snap.tokens if snap is not None else 0
        t = Tier.CPU_PROTECTED if host else (Tier.GPU if dev else Tier.EVICTED)
        return {"tier": t.value, "tokens": dev + host, "device_tokens": dev, "host_tokens": host}
