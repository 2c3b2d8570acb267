"""The twin's L3 tier (toolkv/twin/storage.py, l3.py, l3map.py): sglang's own HiCache storage path on
an in-memory backend, its I/O timed on the twin's clock (TimedStorageIO, a timing double for the
controller's storage threads), and toolkv's real L3 path (core/session/l3.py) driving it."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from toolkv.twin.profile import default_profile
from toolkv.twin.run import Options
from toolkv.workload.plan import Workload

ROOT = Path(__file__).resolve().parent.parent
# long tools (1-10 minutes), a host that cannot hold the idle sessions (1 GB: 7,630 tokens)
L3W = Workload(initial_sessions=6, ramp_s=2.0, turns_median=4, first_tokens=2400, growth_per_turn=400,
               output_tokens=20, max_context=8000, tool_shape="long", duration_s=700.0, seed=1)  # fmt: skip
L3OPTS = Options(
    device_tokens=6000, chunked_prefill_size=1024, max_prefill_tokens=2048, max_running_requests=16
)


def _harness(rate: float = 1000.0) -> tuple[Any, Any, Any]:
    from toolkv.testing.harness import HarnessConfig
    from toolkv.twin.storage import StorageLink, TimedStorageIO, build_storage_harness

    link = StorageLink(read_tokens_per_s=rate, write_tokens_per_s=rate, prefetch_threshold=1)
    cfg = HarnessConfig(page_size=1, device_tokens=256, host_ratio=2.0, layers=1, heads=1, head_dim=2,
                        dtype=torch.float16)  # fmt: skip
    h = build_storage_harness(cfg, link)
    return h, TimedStorageIO(h, link), link


def _hits(h: Any, tokens: list[int]) -> int:
    """Leading tokens of ``tokens`` the store holds (sglang's own hit query from the root)."""
    from array import array

    return int(h.tree.query_storage_hit_length(h.tree.root_node, array("q", tokens)))


def _settle(h: Any, io: Any, now: float) -> None:
    """The scheduler's per-iteration storage step at ``now``: copies done, storage I/O, events."""
    h.synchronize()
    h.tree.check_hicache_events()
    io.pump(now)
    h.tree.check_hicache_events()
    io.pump(now)


def test_storage_writes_and_reads_at_the_link_rate_and_bytes_come_back_equal() -> None:
    """A turn's KV goes device -> host (write-through) -> L3 through sglang's own path; the write
    is in the store only once the link has moved it (100 tokens at 1,000 a second: 0.1 s); evicted
    from device and host, it is read back by sglang's prefetch at the same rate, and the host bytes
    equal what the 'forward' wrote."""
    h, io, _ = _harness()
    try:
        tokens = list(range(1000, 1100))
        assert h.run_request(tokens, deterministic=True)
        h.synchronize()
        h.tree.check_hicache_events()  # write-through acked: sglang queues write_backup_storage
        io.pump(0.0)
        assert io.next_finish() == pytest.approx(0.1)
        assert _hits(h, tokens) == 0  # not written yet
        io.pump(0.099)
        assert _hits(h, tokens) == 0
        _settle(h, io, 0.1)
        assert _hits(h, tokens) == 100 and not h.tree.ongoing_backup
        # gone from device and host: only L3 has it
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        h.tree.evict(EvictParams(num_tokens=256))
        h.evict_host(10_000)
        m = h.match(tokens)
        assert len(m.device_indices) == 0 and int(m.host_hit_length) == 0
        rid = "r1"
        from array import array

        h.tree.prefetch_from_storage(
            rid, m.last_host_node, array("q", tokens), m.last_host_node.get_last_hash_value()
        )
        _settle(h, io, 1.0)  # the hit query, then the scheduler allocates host slots, the read starts
        assert io.next_finish() == pytest.approx(1.1)
        assert not h.tree.check_prefetch_progress(rid)  # wait_complete: not before the read ends
        _settle(h, io, 1.1)
        assert h.tree.check_prefetch_progress(rid)
        assert h.tree.pop_prefetch_loaded_tokens(rid) == 100
        m = h.match(tokens)
        assert int(m.host_hit_length) == 100
        nodes = []
        n = m.last_host_node
        while n is not h.tree.root_node:
            nodes.append(n)
            n = n.parent
        idx = torch.cat([x.host_value for x in reversed(nodes)])
        got = h.host_pool.kv_buffer[:, :, idx.long()].float()
        exp = h.expected_kv(tokens)
        assert torch.equal(got, exp.to(got.dtype))
        assert io.stats["write_tokens"] == 100 and io.stats["read_tokens"] == 100
    finally:
        h.close()


def _run(name: str, env: tuple[tuple[str, str], ...] = ()) -> tuple[Any, Any]:
    from dataclasses import replace

    from toolkv.twin.configs import get
    from toolkv.twin.run import Twin
    from toolkv.twin.sessions import Sessions

    cfg = replace(get(name).with_host_gb(1.0), toolkv_env=env)
    twin = Twin(Sessions.lazy(L3W), cfg, default_profile(), L3OPTS)
    return twin, twin.run()


def test_toolkv_l3_runs_through_the_manager_and_stock_l3_through_sglang() -> None:
    """offload-l3: toolkv's manager stores sessions to L3 (l3_store, demoted_l3: acknowledged
    whole); by default (TOOLKV_L3_READ_AT_ARRIVAL=1) their tool_ends read nothing
    (tool_end_l3_arrival) and sglang's arrival reads bring them, with it off toolkv reads them back
    (l3_prefetch or l3_readahead) and the storage double moved those tokens; stock-l3: sglang's own
    write-through and arrival reads, no toolkv L3 action. Every run conserves tokens and leaves
    nothing held."""
    from toolkv.twin.report import result

    runs = {c: _run(c) for c in ("stock-l3", "offload-l3", "offload")}
    runs["offload-l3-toolkv-read"] = _run("offload-l3", (("TOOLKV_L3_READ_AT_ARRIVAL", "0"),))
    for c, (_twin, o) in runs.items():
        r = result(o, default_profile(), window=(3.0, L3W.duration_s))
        assert o.crashed is None and r["passed"], (c, o.crashed, o.leaks)
    tk_twin, tk = runs["offload-l3"]
    c = tk.meta_end["counters"]
    assert c["l3_store"] > 0 and c["demoted_l3"] > 0 and c["tool_end_l3_arrival"] > 0, c
    assert c.get("l3_prefetch", 0) + c.get("l3_readahead", 0) == 0, c
    st = tk_twin.stack.storage.stats
    assert st["toolkv_read_tokens"] == 0 and st["read_tokens"] > 0 and st["write_tokens"] > 0
    rd_twin, rd = runs["offload-l3-toolkv-read"]
    c = rd.meta_end["counters"]
    assert c["l3_store"] > 0 and c["demoted_l3"] > 0 and not c.get("tool_end_l3_arrival"), c
    assert c.get("l3_prefetch", 0) + c.get("l3_readahead", 0) > 0, c
    st = rd_twin.stack.storage.stats
    assert st["toolkv_read_tokens"] > 0 and st["write_tokens"] > 0
    s_twin, s = runs["stock-l3"]
    assert not any(k.startswith("l3_") and v for k, v in s.meta_end["counters"].items())
    assert s_twin.stack.storage.stats["write_tokens"] > 0  # sglang writes every host copy through
    assert runs["offload"][0].stack.storage is None


def test_l3_configs_refuse_a_cache_without_hicache() -> None:
    from dataclasses import replace

    from toolkv.twin.configs import get
    from toolkv.twin.stack import build

    with pytest.raises(ValueError, match="HiRadixCache"):
        build(replace(get("offload-l3"), cache="radix"), device_tokens=1000, kv_bytes_per_token=131_072,
              now=lambda: 0.0)  # fmt: skip


def test_link_is_a_fifo_at_its_rate() -> None:
    from toolkv.twin.l3 import L3Config, Link

    link = Link.of_gbps(1.0, 1_000_000)  # 1,000 tokens a second
    assert link.schedule(0.0, 100) == pytest.approx(0.1) and link.schedule(0.05, 100) == pytest.approx(0.2)
    assert link.tokens == 200
    with pytest.raises(ValueError):
        L3Config(read_gbps=0)


@pytest.mark.parametrize(
    ("name", "marker"),
    [
        ("l3map.json", "twin-l3map"),
        ("l3map_toolkv_read.json", "twin-l3map-toolkv-read"),
        ("l3map_toolkv_l3_off.json", "twin-l3map-toolkv-l3-off"),
    ],
)
def test_the_committed_l3map_is_the_block_in_the_docs(name: str, marker: str) -> None:
    """docs/benchmarks.md shows docs/results/twin/l3map*.json as ``doc_table`` renders it; the JSON's
    cells are its rows' ratios (a test that fails on an edited table or a stale block)."""
    from toolkv.twin.l3map import cells, doc_table

    data = json.loads((ROOT / "docs" / "results" / "twin" / name).read_text())
    assert data["cells"] == json.loads(json.dumps(cells(data["rows"])))
    assert all(r["passed"] and not r["crashed"] for r in data["rows"])
    doc = (ROOT / "docs" / "benchmarks.md").read_text()
    block = re.search(rf"<!-- BEGIN {marker} -->\n(.*?)\n<!-- END {marker} -->", doc, re.S)
    assert block is not None and block.group(1).strip() == doc_table(data).strip(), (
        f"regenerate the block: python -m toolkv.twin.l3map --doc-table docs/results/twin/{name}"
    )


def test_a_toolkv_setting_reaches_the_twins_toolkv_and_a_bad_one_stops_the_sweep(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``--toolkv-env VAR=VALUE`` (l3map) and ``TwinConfig.toolkv_env``: parsed as the plugin parses
    an operator's environment; only the named fields change; a bad name or value is an error
    before any run."""
    from toolkv.sglang.config import ToolKVConfig
    from toolkv.twin import l3map
    from toolkv.twin.stack import with_env

    base = ToolKVConfig(enable=True, ttl_s=600.0, l3_read_tokens_per_s=5.0)
    got = with_env(base, (("TOOLKV_L3", "0"), ("TOOLKV_L3_STORE_MARGIN_S", "1e9")))
    assert (got.l3, got.l3_store_margin_s) == (False, 1e9)
    assert (got.ttl_s, got.l3_read_tokens_per_s, got.policy) == (600.0, 5.0, base.policy)
    with pytest.raises(ValueError, match="TOOLKV_L3"):
        with_env(base, (("TOOLKV_L3", "maybe"),))
    for bad in ("TOOLKV_L3=maybe", "TOOLKV_NOPE=1", "NOEQUALS"):
        assert l3map.main(["--sessions", "24", "--shapes", "long", "--toolkv-env", bad]) == 2
        assert "error" in capsys.readouterr().err
