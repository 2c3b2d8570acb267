"""sglang 0.5.23's two tree cores, and what toolkv needs from them (docs/sglang_versions.md, "The
tree core"):

* the crash of a stock server on the default (Rust) core, ``insert value must be an int64 tensor,
  got Int``, is not sglang's insert path: here, with the torch sglang pins, a real request finishes
  through ``release_kv_cache`` -> ``checkpoint_into_tree`` into the Rust core without error, the
  binding names ``torch.int32`` "Int", and ``scripts/stage/tree_core_probe.py`` passes;
* an offload and a restore run through node handles alone (sglang's tree-core interface) and give
  the same observations on both cores;
* what toolkv reads and the Rust core does not expose: node objects, children, per-node locks, a
  lookup that does not split; a refused device-leaf eviction poisons the Rust core, so toolkv cannot
  find these out by trying;
* on the Python core, sglang's own white-box sets (``UnifiedTreeCoreInspector``: the evictable
  device and host leaves the core maintains) agree with toolkv's FreeSet and HostEvictable rules.

Runs in the 0.5.23 environment (``make test-0523``); skips where an older sglang is installed.
"""

from __future__ import annotations

import functools
import subprocess
import sys
from array import array
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from toolkv.testing.unified_harness import has_unified_radix_cache, sglang_version

if not has_unified_radix_cache():
    pytest.skip(
        f"needs sglang >= 0.5.21 (UnifiedRadixCache), found {sglang_version()}", allow_module_level=True
    )

import torch

from toolkv.core.backends.unified import full
from toolkv.core.manager import ManagerConfig, ToolKVManager
from toolkv.core.treeops import path_to
from toolkv.testing.unified_harness import UnifiedCacheHarness, UnifiedHarnessConfig

ROOT = Path(__file__).resolve().parents[1]
SHARED = list(range(1, 33))
A = SHARED + list(range(1000, 1032))
B = SHARED + list(range(2000, 2016))


def fill(h: UnifiedCacheHarness, tokens: list[int]) -> None:
    idx = h.allocator.alloc(len(tokens))
    assert idx is not None
    h.fill_kv(idx, tokens)
    h.insert(tokens, idx)


def bare_rust_core() -> Any:
    """sglang's production Rust adapter with no pools: the core alone, on the CPU."""
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.rust_tree_core.adapter import RustUnifiedTreeCore
    from sglang.srt.mem_cache.unified_cache.components import ComponentType

    return RustUnifiedTreeCore(
        CacheInitParams(
            disable=False,
            req_to_token_pool=None,
            token_to_kv_pool_allocator=None,
            page_size=1,
            tree_components=(ComponentType.FULL,),
        )
    )


# ---- the crash: not sglang's insert path ---------------------------------------------------------
def test_a_stock_request_finishes_into_the_rust_core_with_an_int64_insert() -> None:
    """A real ``Req`` (its ``req_to_token`` row is int32, as sglang's ``ReqToTokenPool`` keeps it)
    finishes through sglang's own ``release_kv_cache`` -> ``checkpoint`` -> ``checkpoint_into_tree``,
    which copies the row to int64 before ``insert`` (unified_radix_cache.py:1234): on the Rust core
    with the torch sglang pins, the turn lands in the tree."""
    from sglang.srt.managers.schedule_batch import FINISH_LENGTH, Req
    from sglang.srt.mem_cache.common import release_kv_cache
    from sglang.srt.sampling.sampling_params import SamplingParams

    with UnifiedCacheHarness(UnifiedHarnessConfig(tree_core="rust", device_tokens=256)) as h:
        assert type(h.tree.tree_core).__name__ == "RustUnifiedTreeCore"
        prompt, output = list(range(1, 41)), [41, 42, 43]
        req = Req("r0", "", array("q", prompt), SamplingParams(max_new_tokens=len(output)))
        kv_len = len(prompt) + len(output) - 1
        root = h.match(prompt + output).last_device_node
        req.last_node, req.lock = root, h.tree.lock(root)
        assert h.req_pool.alloc([req]) is not None
        new = h.allocator.alloc(kv_len)
        assert new is not None
        assert h.req_pool.req_to_token.dtype == torch.int32
        h.req_pool.write((req.kv.req_pool_idx, slice(0, kv_len)), new.to(torch.int32))
        req.kv.kv_committed_len = req.kv.kv_allocated_len = kv_len
        req.output_ids.extend(output)
        req.finished_reason = FINISH_LENGTH(length=len(output))
        release_kv_cache(req, h.tree, checkpoint=True)
        m = h.match(prompt + output[:-1])
        assert m.device_prefix_len == kv_len
        assert torch.equal(h.tree.path_device_indices(m.last_device_node), new.to(torch.int64))


def test_the_rust_binding_calls_torch_int32_Int() -> None:
    """The crash's words name ``torch.int32``: the binding refuses an int32 insert value with exactly
    that message and takes an int64 one (with this torch)."""
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    core = bare_rust_core()
    key = RadixKey(array("q", [11, 12, 13]))
    with pytest.raises(ValueError, match=r"^insert value must be an int64 tensor, got Int$"):
        core.begin_insert(InsertParams(key=key, value=torch.tensor([7, 8, 9], dtype=torch.int32)))
    core.end_insert()
    step = core.begin_insert(InsertParams(key=key, value=torch.tensor([7, 8, 9], dtype=torch.int64)))
    while step.result is None:
        step = core.resume_insert()
    core.end_insert()
    assert core.match_prefix(MatchPrefixParams(key=key)).device_prefix_len == 3


def test_the_tree_core_probe_passes_with_the_torch_sglang_pins() -> None:
    """The staging's check (scripts/stage/tree_core_probe.py) answers 0 here; with torch 2.11 it
    answers 1 with the crash's message (docs/sglang_versions.md)."""
    from importlib.metadata import requires

    pins = [r.split("==")[1].strip() for r in requires("sglang") or [] if r.startswith("torch==")]
    assert pins and torch.__version__.split("+")[0] == pins[0], (pins, torch.__version__)
    probe = subprocess.run(
        [sys.executable, str(ROOT / "scripts/stage/tree_core_probe.py")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert probe.returncode == 0, probe.stdout + probe.stderr
    assert f"the bundled Rust tree core works with torch {torch.__version__}" in probe.stdout


# ---- what runs through node handles alone ---------------------------------------------------------
@pytest.mark.parametrize("core", ["python", "rust"])
def test_an_offload_and_a_restore_through_node_handles_alone(core: str) -> None:
    """Everything toolkv *does* to the tree is a handle-based call that both cores implement: the
    backup of the path's unbacked nodes (``build_backup_kv_action``), the host lock, the pending
    writes (``ongoing_write_through``, kept by the cache, not the core), freeing a backed-up device
    leaf, ``load_back`` and its ack, and reading a path (``collect_path_info``)."""
    from sglang.srt.mem_cache.unified_cache.components import ComponentType

    cfg = UnifiedHarnessConfig(tree_core=core, device_tokens=512, write_policy="write_back")
    with UnifiedCacheHarness(cfg) as h:
        tree, tc = h.tree, h.tree.tree_core
        fill(h, A)
        fill(h, B)
        leaf = h.match(A).last_device_node
        assert isinstance(leaf, int)
        path = tc.collect_path_info([leaf])[0]
        assert [(p.path_start, p.path_end, p.full_value_len, p.num_children) for p in path] == [
            (0, 32, 32, 2),
            (32, 64, 32, 0),
        ]
        ids = [p.node_id for p in path]
        assert not any(tc.is_backuped(n) for n in ids)
        backup = tc.build_backup_kv_action(leaf)
        assert list(backup.node_ids) == ids  # root-down, the nodes without a host copy
        tree._execute_and_commit_kv_backup(backup)
        receipt = tree.inc_host_lock_ref(leaf).to_dec_params()
        pending = {n for w in tree.ongoing_write_through.values() for n in w.publish_node_ids}
        assert set(ids) <= pending
        h.check_events()
        h.complete("write")
        h.check_events()
        assert not tree.ongoing_write_through and all(tc.is_backuped(n) for n in ids)
        free0 = h.allocator.available_size()
        tree._evict_device_leaf(leaf, {ct: 0 for ct in tree.tree_components})
        assert h.allocator.available_size() == free0 + 32
        assert tc.is_full_device_evicted(leaf) and tc.component_has_host_value_only(leaf, ComponentType.FULL)
        assert [p.full_value_len for p in tc.collect_path_info([leaf])[0]] == [32, None]
        assert tree.load_back(leaf) and leaf in tree.ongoing_load_back
        tree.ready_to_load_host_cache()
        h.complete("load")
        h.check_events()
        assert leaf not in tree.ongoing_load_back and not tc.is_full_device_evicted(leaf)
        assert [p.full_value_len for p in tc.collect_path_info([leaf])[0]] == [32, 32]
        assert torch.equal(h.device_kv(tree.path_device_indices(leaf)).float(), h.expected_kv(A))
        tree.dec_host_lock_ref(leaf, receipt)
        assert (tree.evictable_size(), tree.protected_size()) == (80, 0)


# ---- what toolkv reads and the Rust core does not expose -----------------------------------------
def test_the_rust_core_has_no_nodes_children_or_per_node_locks() -> None:
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.mem_cache.rust_tree_core.adapter import RustUnifiedTreeCore
    from sglang.srt.mem_cache.unified_cache.unified_tree_core_interface import TreePathNodeInfo
    from sglang.test.kits.unified_radix_cache.unified_tree_core_inspection_interface import (
        UnifiedTreeCoreInspectionInterface,
    )

    # a path entry carries lengths, the device value's length and a child count: no child ids,
    # no lock counts, no host value, no pending write
    assert TreePathNodeInfo.__struct_fields__ == (
        "node_id",
        "parent_id",
        "path_start",
        "path_end",
        "full_value_len",
        "num_children",
    )
    # the reads toolkv makes off node objects exist only in sglang's test-only inspection
    # interface, which the production Rust adapter does not implement ...
    needed = [
        "get_child_node_ids",
        "get_parent_node_id",
        "get_component_device_lock_ref",
        "get_component_host_lock_ref",
        "get_write_through_pending_id",
        "is_device_evictable_leaf",
        "is_host_evictable_leaf",
    ]
    for name in needed:
        assert hasattr(UnifiedTreeCoreInspectionInterface, name)
        assert not hasattr(RustUnifiedTreeCore, name), name
    # ... and whose Rust variant is a separately compiled extension the wheel does not ship
    sglang_dir = Path(str(__import__("sglang").__file__)).parent
    assert not list((sglang_dir / "srt/mem_cache/rust_tree_core").glob("mem_cache_inspection*"))
    assert list((sglang_dir / "srt/mem_cache/rust_tree_core").glob("mem_cache.cpython-*.so"))

    with UnifiedCacheHarness(UnifiedHarnessConfig(tree_core="rust", device_tokens=256)) as h:
        fill(h, list(range(1, 65)))
        leaf = h.match(list(range(1, 65))).last_device_node
        for read in (lambda: h.tree.root_node, lambda: h.tree.tree_core.node_by_id(leaf)):
            with pytest.raises(NotImplementedError, match="not yet ported to the Rust tree core"):
                read()
        # the only lookups: match_full_device_prefix (device part only) leaves the tree alone,
        # match_prefix splits the node it stops inside
        tc = h.tree.tree_core
        n, _node, _pinned = tc.match_full_device_prefix(RadixKey(array("q", range(1, 41))))
        assert n == 40 and len(tc.collect_path_info([leaf])[0]) == 1
        assert h.match(list(range(1, 41))).device_prefix_len == 40
        assert [(p.path_start, p.path_end) for p in tc.collect_path_info([leaf])[0]] == [(0, 40), (40, 64)]


def test_a_refused_device_leaf_eviction_poisons_only_the_rust_core() -> None:
    """toolkv frees a device copy only after reading that the node is unlocked and has no child on
    device. On the Python core a wrong call is an AssertionError and the core stays usable; on the
    Rust core it is a panic, and every later call on that core fails: trying is not an option."""
    for core in ("python", "rust"):
        with UnifiedCacheHarness(UnifiedHarnessConfig(tree_core=core, device_tokens=256)) as h:
            fill(h, A)
            fill(h, B)
            parent = h.tree.tree_core.collect_path_info([h.match(A).last_device_node])[0][0].node_id
            tracker = {ct: 0 for ct in h.tree.tree_components}
            if core == "python":
                with pytest.raises(AssertionError, match="is not a D-leaf"):
                    h.tree._evict_device_leaf(parent, tracker)
                assert h.match(A).device_prefix_len == len(A)
            else:
                with pytest.raises(RuntimeError, match=r"Rust TreeCore panicked: node \d+ is not a D-leaf"):
                    h.tree._evict_device_leaf(parent, tracker)
                with pytest.raises(RuntimeError, match="mutex poisoned"):
                    h.tree.evictable_size()
                h.tree = None  # the harness cannot drain a poisoned core


# ---- sglang's white-box sets as the oracle for toolkv's rules (Python core) -----------------------
class Inspector:
    """sglang's ``UnifiedTreeCoreInspector`` read-outs applied to the live Python core (toolkv drives
    a ``UnifiedTreeCore``; the inspector subclass adds methods, no state)."""

    def __init__(self, core: Any) -> None:
        self.core = core

    def __getattr__(self, name: str) -> Any:
        from sglang.test.kits.unified_radix_cache.unified_tree_core_inspector import (
            UnifiedTreeCoreInspector,
        )

        return functools.partial(getattr(UnifiedTreeCoreInspector, name), self.core)


@pytest.fixture
def h() -> Iterator[UnifiedCacheHarness]:
    with UnifiedCacheHarness(UnifiedHarnessConfig(device_tokens=512)) as harness:
        yield harness


def settle(h: UnifiedCacheHarness, m: ToolKVManager, now: float, which: str) -> None:
    h.check_events()
    if which == "load":
        m.tick(now)
    h.complete(which)  # type: ignore[arg-type]
    h.check_events()
    m.tick(now)


def test_toolkv_free_set_and_host_evictable_agree_with_sglangs_own_leaf_sets(
    h: UnifiedCacheHarness,
) -> None:
    from sglang.srt.mem_cache.unified_cache.components import ComponentType

    ins = Inspector(h.tree.tree_core)
    m = ToolKVManager(h.tree, config=ManagerConfig.eager(ttl_s=60.0))
    for sid, toks in (("a", A), ("b", B), ("c", SHARED + list(range(3000, 3024)))):
        fill(h, toks)
        m.insert(sid, toks)
    be: Any = m.backend
    freed: list[int] = []
    real_free = be._free_device_copy

    def checked_free(node: Any, tracker: dict[Any, int]) -> None:
        # every node toolkv's FreeSet frees is, at that moment, in the core's own evictable
        # device-leaf set (unlocked, no child with a device value)
        assert ins.is_device_evictable_leaf(node.id), node.id
        freed.append(node.id)
        real_free(node, tracker)

    be._free_device_copy = checked_free

    def host_rule_agrees() -> int:
        """toolkv's HostEvictable rule, node by node, against the core's host-leaf set, and its
        total against what sglang's evict_host frees when asked for everything (checked on a
        copy of the counts only: the caller decides whether to evict)."""
        for nid in ins.get_all_node_ids():
            node = h.tree.tree_core.node_by_id(nid)
            if node is h.tree.root_node or ins.get_child_node_ids(nid):
                continue
            rule = bool(node.evicted and node.backuped) and all(
                cd.host_lock_ref == 0 and cd.lock_ref == 0 for cd in node.component_data
            )
            assert rule == ins.is_host_evictable_leaf(nid), nid
            assert full(node).host_lock_ref == ins.get_component_host_lock_ref(nid, ComponentType.FULL)
        return int(be.host_evictable_tokens())

    settle(h, m, 0.5, "write")  # write-through on insert
    assert host_rule_agrees() == 0
    m.tool_start("a")
    m.tool_start("c")
    settle(h, m, 1.0, "write")
    assert m.kv_meta("a")["state"] == m.kv_meta("c")["state"] == "Offloaded"
    a_leaf, c_leaf = m.sessions["a"].node, m.sessions["c"].node
    assert sorted(freed) == sorted([a_leaf.id, c_leaf.id])
    assert path_to(h.tree, a_leaf)[0].id not in freed  # b still uses the shared prefix
    assert host_rule_agrees() == 0  # both suffixes are protected
    m.close("c")  # c's protection goes: its host copy is sglang's to evict
    room = host_rule_agrees()
    assert room == 24
    assert h.evict_host(10**9) == room  # and sglang's evict_host frees exactly that
    assert m.tool_end("a", 1)["state"] == "Restoring"
    settle(h, m, 2.0, "load")
    assert m.kv_meta("a")["state"] in ("Handover", "Runnable")
    assert host_rule_agrees() == 0
