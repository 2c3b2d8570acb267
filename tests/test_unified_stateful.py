"""Hypothesis stateful run of ToolKVManager over the REAL sglang 0.5.23 UnifiedRadixCache.

Every rule is a spec action (``spec/ToolKV.tla``): turns with shared prefixes, tool_start,
tool_end with current and stale epochs, sglang's write and load acks in issue order, other
requests locking prefixes, sglang's own device and host eviction, memory pressure, splits, tree
resets, the clock with the TTL sweep, close. After every step the spec's invariants are checked
on the real objects, in the form 0.5.23's tier relation takes (``docs/sglang_versions.md``):

* ``LockAccounting``: each node's ``lock_ref`` is the number of path locks over it: in-flight
  writes, in-flight loads, other requests, restoring sessions' pins;
* ``HostRefAccounting``: ``host_lock_ref`` is the number of protection *segments* covering the
  node (a split copies the count to the new prefix) plus the host lock of a load anchored there;
* ``ProtectionOwned``, ``ProtectedHasHost``, ``NoFreeWhilePending``, ``RunnableOnlyWhenLoaded``,
  ``EpochMonotone``; slots conserved on both tiers; every readable device copy and every
  acknowledged host copy holds exactly its tokens' bytes (unreferenced slots scribbled first).

At teardown every session is closed and memory drained: every counter is back where it started.
"""

from __future__ import annotations

import contextlib
from typing import Any, ClassVar

import pytest

from toolkv.testing.unified_harness import has_unified_radix_cache, sglang_version

if not has_unified_radix_cache():
    pytest.skip(
        f"needs sglang >= 0.5.21 (UnifiedRadixCache), found {sglang_version()}", allow_module_level=True
    )

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from toolkv.core.backends.unified import full
from toolkv.core.lifecycle import PROTECTING
from toolkv.core.manager import ManagerConfig
from toolkv.core.treeops import attached, path_to
from toolkv.errors import ToolKVError
from toolkv.testing.unified_harness import UnifiedCacheHarness, UnifiedHarnessConfig
from toolkv.verify.toolkv.mutants import mutant_manager

SESSIONS = ("s1", "s2", "s3")
UNIT = 16  # tokens per turn: >= sglang's load_back_threshold (10), a whole page at page size 16


class UnifiedManagerMachine(RuleBasedStateMachine):
    page_size = 1
    caveats: frozenset[str] = frozenset()  # seeded defects (mutation testing): the run must fail

    def __init__(self) -> None:
        super().__init__()
        self.h = UnifiedCacheHarness(
            UnifiedHarnessConfig(page_size=self.page_size, device_tokens=12 * UNIT, host_ratio=1.5)
        )
        self.mgr = mutant_manager(self.h.tree, config=ManagerConfig.eager(ttl_s=8.0), caveats=self.caveats)
        self.initial = self.h.accounting()
        self.fresh = 1
        self.now = 0.0
        self.ext: list[Any] = []  # TreeLocks other requests hold
        self.ballast_dev: list[torch.Tensor] = []
        self.ballast_host: list[torch.Tensor] = []
        self.epochs = {s: 0 for s in SESSIONS}
        self.phases = {s: "New" for s in SESSIONS}

    # ---- helpers ---------------------------------------------------------------------------------------
    def nodes(self) -> list[Any]:
        return [n for n in self.h.iter_nodes() if n is not self.h.tree.root_node]

    def loading(self) -> set[int]:
        """Nodes a load is filling: the manager's chains, and every node on the path of a load a
        request started itself."""
        out = {id(m) for _, chain in self.mgr.backend.loading_chains() for m in chain}
        core = self.h.tree.tree_core
        for anchor in self.h.tree.ongoing_load_back:
            if anchor not in {leaf.id for leaf, _ in self.mgr.backend.loading_chains()}:
                out.update(id(m) for m in path_to(self.h.tree, core.node_by_id(anchor)))
        return out

    def readable(self, n: Any) -> bool:
        busy = self.loading()
        return all(full(m).value is not None and id(m) not in busy for m in path_to(self.h.tree, n))

    def tokens(self, n: Any) -> list[int]:
        return [t for m in path_to(self.h.tree, n) for t in m.key.token_ids]

    def act(self, fn: Any, *args: Any) -> None:
        # typed refusals are part of the contract; the invariants check what they left behind
        with contextlib.suppress(ToolKVError):
            fn(*args)

    # ---- sessions and the manager ----------------------------------------------------------------------
    def turn(self, d: st.DataObject) -> None:
        s, pick = d.draw(st.sampled_from(SESSIONS)), d.draw(st.integers(0, 50))
        if self.mgr.sessions.get(s) is not None and self.mgr.sessions[s].state in PROTECTING:
            return
        self.mgr.admit(s)  # the turn's request is admitted first: it ends a hand-over (spec Admit)
        parents = [self.h.tree.root_node] + [n for n in self.nodes() if self.readable(n)]
        parent = parents[pick % len(parents)]
        prefix = [] if parent is self.h.tree.root_node else self.tokens(parent)
        fresh = list(range(self.fresh, self.fresh + UNIT))
        self.fresh += UNIT
        new = self.h.allocator.alloc(UNIT)
        if new is None:
            self.h.evict_device(UNIT)
            if parent is not self.h.tree.root_node and not (
                attached(self.h.tree, parent) and self.readable(parent)
            ):
                return
            new = self.h.allocator.alloc(UNIT)
            if new is None:
                return
        self.h.fill_kv(new, fresh)
        prefix_idx = self.h.tree.path_device_indices(parent.id) if prefix else new[:0]
        from sglang.srt.mem_cache.base_prefix_cache import InsertParams

        from toolkv.testing.unified_harness import rkey

        self.h.tree.insert(
            InsertParams(
                key=rkey(prefix + fresh), value=torch.cat([prefix_idx, new]), prev_prefix_len=len(prefix)
            )
        )
        self.mgr.insert(s, prefix + fresh)

    def tool_start(self, d: st.DataObject) -> None:
        self.act(self.mgr.tool_start, d.draw(st.sampled_from(self.biased(("Running",)))))

    def tool_end(self, d: st.DataObject) -> None:
        s = d.draw(st.sampled_from(self.biased(("Offloading", "Offloaded", "Restoring"))))
        delta = d.draw(st.sampled_from((0, 0, 0, -1, 1)))
        rec = self.mgr.sessions.get(s)
        epoch = max(0, (rec.epoch if rec else 0) + delta)
        self.act(self.mgr.tool_end, s, epoch)

    def close(self, d: st.DataObject) -> None:
        self.act(self.mgr.close, d.draw(st.sampled_from(SESSIONS)))

    def tick(self, d: st.DataObject) -> None:
        dt = d.draw(st.sampled_from((0.0, 1.0, 1.0, 3.0)))
        """One scheduler iteration: sglang's check_hicache_events, then the manager's tick."""
        self.now += dt
        self.h.check_events()
        self.mgr.tick(self.now)

    # ---- the copy engine and the rest of sglang ----------------------------------------------------------
    def copy_finishes(self, d: st.DataObject) -> None:
        which = d.draw(st.sampled_from(("write", "load")))
        if self.h.engine is not None:
            self.h.complete(which, 1)  # type: ignore[arg-type]

    def other_request_locks(self, d: st.DataObject) -> None:
        pick = d.draw(st.integers(0, 50))
        c = [n for n in self.nodes() if self.readable(n)]
        if c:
            self.ext.append(self.h.tree.lock(c[pick % len(c)].id))

    def other_request_unlocks(self, d: st.DataObject) -> None:
        if self.ext:
            self.h.tree.unlock(self.ext.pop(d.draw(st.integers(0, 50)) % len(self.ext)))

    def gpu_evict(self, d: st.DataObject) -> None:
        self.h.evict_device(d.draw(st.sampled_from((UNIT, 3 * UNIT))))

    def host_evict(self, d: st.DataObject) -> None:
        self.h.evict_host(d.draw(st.sampled_from((UNIT, 3 * UNIT))))

    def split(self, d: st.DataObject) -> None:
        pick, cut = d.draw(st.integers(0, 50)), d.draw(st.integers(1, UNIT - 1))
        ps = self.page_size
        c = [n for n in self.nodes() if len(n.key) >= 2 * ps]
        if c:
            n = c[pick % len(c)]
            at = max(ps, min(len(n.key) - ps, cut // ps * ps))
            prefix = self.tokens(n.parent) if n.parent is not self.h.tree.root_node else []
            self.h.match(prefix + list(n.key.token_ids[:at]))

    def memory_pressure(self, d: st.DataObject) -> None:
        pool, take = d.draw(st.sampled_from(("device", "host"))), d.draw(st.booleans())
        alloc: Any = self.h.allocator if pool == "device" else self.h.host_pool
        held = self.ballast_dev if pool == "device" else self.ballast_host
        if take:
            n = int(alloc.available_size()) // 2 // self.page_size * self.page_size
            idx = alloc.alloc(n) if n else None
            if idx is not None:
                held.append(idx)
        elif held:
            alloc.free(held.pop())

    def tree_reset(self, d: st.DataObject) -> None:
        """flush_cache, which sglang runs only when idle: every copy finished and retired first."""
        if self.ext or self.ballast_dev or self.ballast_host:
            return
        h = self.h
        h.tree.flush_pending_backups()
        if h.controller.load_queue:
            h.tree.ready_to_load_host_cache()
        h.synchronize()
        h.check_events()
        self.mgr.tick(
            self.mgr.now
        )  # the scheduler's tick after the acks: finished offloads and restores settle
        h.tree.reset()
        h.allocator.clear()
        self.mgr.tree_reset()

    WEIGHTS: ClassVar[dict[str, int]] = {
        "turn": 6, "tool_start": 5, "tool_end": 5, "tick": 5, "copy_finishes": 6, "close": 1,
        "other_request_locks": 1, "other_request_unlocks": 1, "gpu_evict": 2, "host_evict": 2,
        "split": 2, "memory_pressure": 2, "tree_reset": 1,
    }  # fmt: skip
    CHOICES: ClassVar[list[str]] = [a for a, w in WEIGHTS.items() for _ in range(w)]

    def biased(self, phases: tuple[str, ...]) -> list[str]:
        """Sessions in ``phases`` three times over, then every session once."""
        hot = [s for s in SESSIONS if s in self.mgr.sessions and self.mgr.sessions[s].state in phases]
        return hot * 3 + list(SESSIONS)

    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        """One spec action, drawn by weight so that deep sequences (turn, offload, ack, restore,
        ack) stay likely while every action remains reachable."""
        getattr(self, data.draw(st.sampled_from(self.CHOICES), label="action"))(data)

    # ---- invariants ---------------------------------------------------------------------------------------
    @invariant()
    def spec_invariants(self) -> None:
        h, mgr = self.h, self.mgr
        tree, root = h.tree, h.tree.root_node
        nodes = self.nodes()
        # LockAccounting: every lock_ref is a sum of path locks
        anchors: list[Any] = [x.node for x in self.ext]
        anchors += [
            w.lock_params.node_id for w in tree.ongoing_write_through.values() if w.lock_params is not None
        ]
        anchors += list(tree.ongoing_load_back)
        anchors += [r.pinned.id for r in mgr.sessions.values() if r.pinned is not None]
        covered: dict[int, int] = {}
        for a in anchors:
            for m in path_to(tree, tree.tree_core.node_by_id(a)):
                covered[m.id] = covered.get(m.id, 0) + 1
        for n in nodes:
            assert full(n).lock_ref == covered.get(n.id, 0), f"LockAccounting at node {n.id}"
        # HostRefAccounting with segment locks: a host lock covers its anchor and every prefix a
        # split cut off it, up to the fragment carrying the receipt's boundary id
        hcount: dict[int, int] = {}

        def cover(anchor: Any, receipt: Any) -> None:
            uuid = receipt.component_host_lock_uuids.get(0) if receipt is not None else None
            m = anchor
            while m is not root and uuid is not None:
                hcount[m.id] = hcount.get(m.id, 0) + 1
                if full(m).metadata.get("host_uuid") == uuid:
                    break
                m = m.parent

        for rec in mgr.sessions.values():
            if rec.protected is not None:
                cover(rec.protected, rec.backend_state.host)
        for a, load in tree.ongoing_load_back.items():  # a load holds a host lock on its anchor
            cover(tree.tree_core.node_by_id(a), load.host_lock_params)
        for n in nodes:
            assert full(n).host_lock_ref == hcount.get(n.id, 0), f"HostRefAccounting at node {n.id}"
        # ProtectionOwned, ProtectedHasHost
        for rec in mgr.sessions.values():
            if rec.protected is not None:
                assert rec.state in PROTECTING and rec.protected is rec.node, "ProtectionOwned"
                assert attached(tree, rec.protected) and full(rec.protected).host_value is not None, (
                    "ProtectedHasHost"
                )
        # NoFreeWhilePending, TreeShape (copies closed towards the root)
        for n in nodes:
            d = full(n)
            if n.write_through_pending_id is not None:
                assert d.value is not None and d.host_value is not None, "NoFreeWhilePending"
            assert d.value is not None or d.host_value is not None, "TreeShape: a node with no copy"
            if n.parent is not root:
                p = full(n.parent)
                assert d.value is None or p.value is not None, (
                    "TreeShape: device copy under an evicted parent"
                )
                assert d.host_value is None or p.host_value is not None, (
                    "TreeShape: host copy under an unbacked parent"
                )

    @invariant()
    def steps_and_slots(self) -> None:
        h, mgr = self.h, self.mgr
        for s in SESSIONS:
            rec = mgr.sessions.get(s) or mgr._closed.get(s)
            phase, epoch = (rec.state, rec.epoch) if rec else ("New", 0)
            if self.phases[s] == "Closed" and phase != "Closed":
                self.epochs[s] = 0  # a turn re-opened a closed id: a new session, epochs from 0
            assert epoch >= self.epochs[s], "EpochMonotone"
            if phase == "Runnable" and self.phases[s] != "Runnable":
                assert rec is not None and rec.node is not None and self.readable(rec.node), (
                    "RunnableOnlyWhenLoaded"
                )
            self.epochs[s], self.phases[s] = epoch, phase
        dev, host = h.tree_token_counts()
        held_dev = sum(len(x) for x in self.ballast_dev)
        held_host = sum(len(x) for x in self.ballast_host)
        assert h.allocator.available_size() + dev + held_dev == h.cfg.device_tokens, (
            "device slots not conserved"
        )
        assert h.host_pool.available_size() + host + held_host == h.host_pool.size, "host slots not conserved"

    @invariant()
    def kv_integrity(self) -> None:
        h = self.h
        h.scribble_unreferenced()
        busy = self.loading()
        for n in self.nodes():
            d = full(n)
            toks = list(n.key.token_ids)
            if d.value is not None and id(n) not in busy:
                assert torch.equal(h.device_kv(d.value).float(), h.expected_kv(toks)), "device KV differs"
            if d.host_value is not None and n.write_through_pending_id is None:
                assert torch.equal(h.host_kv(d.host_value).float(), h.expected_kv(toks)), "host KV differs"

    def teardown(self) -> None:
        try:
            h, mgr = self.h, self.mgr
            for x in self.ext:
                h.tree.unlock(x)
            for x in self.ballast_dev:
                h.allocator.free(x)
            for x in self.ballast_host:
                h.host_pool.free(x)
            for s in list(mgr.sessions):
                mgr.close(s)
            h.drain()
            mgr.tick(self.now + 1)
            h.drain()
            assert h.accounting() == self.initial, "leak after closing every session and draining"
        finally:
            self.h.close()


class UnifiedManagerMachinePage16(UnifiedManagerMachine):
    page_size = 16


_SETTINGS = settings(
    max_examples=int(__import__("os").environ.get("TOOLKV_UNIFIED_EXAMPLES", "25")),
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    derandomize=True,
)
TestUnifiedManager = UnifiedManagerMachine.TestCase
TestUnifiedManager.settings = _SETTINGS
TestUnifiedManagerPage16 = UnifiedManagerMachinePage16.TestCase
TestUnifiedManagerPage16.settings = _SETTINGS


@pytest.mark.parametrize("caveat", ["FreeBeforeAck", "EvictProtected"])
def test_seeded_defects_are_caught(caveat: str) -> None:
    """Each seeded defect of the spec's BUG list makes this run fail: the checks above can fail."""
    from hypothesis.errors import Flaky
    from hypothesis.stateful import run_state_machine_as_test

    machine = type(f"Mutant_{caveat}", (UnifiedManagerMachine,), {"caveats": frozenset({caveat})})
    quick = settings(_SETTINGS, max_examples=60, phases=[p for p in _SETTINGS.phases if p.name != "shrink"])
    with pytest.raises((AssertionError, Flaky, ExceptionGroup)):
        run_state_machine_as_test(machine, settings=quick)
