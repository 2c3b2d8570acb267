"""The twin over sglang 0.5.23: the real ``UnifiedRadixCache`` (HiCache, Python tree core) through
:mod:`toolkv.testing.unified_harness`, 0.5.23's admission (:mod:`toolkv.twin.scheduler_0523`) and
toolkv's unified backend, chosen from the installed sglang. The 0.5.23 half of
``tests/test_twin.py``'s conservation, determinism and hand-computed schedule.

Runs in the 0.5.23 environment (``make test-0523``); skips where an older sglang is installed.
"""

from __future__ import annotations

import pytest

from toolkv.testing.unified_harness import has_unified_radix_cache, sglang_version

if not has_unified_radix_cache():
    pytest.skip(
        f"needs sglang >= 0.5.21 (UnifiedRadixCache), found {sglang_version()}", allow_module_level=True
    )

import _twin_common as common

from toolkv.twin.configs import get
from toolkv.twin.profile import default_profile
from toolkv.twin.run import Twin
from toolkv.workload.plan import make_plan


def test_the_twin_builds_sglangs_unified_stack() -> None:
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    from toolkv.core.backends.unified import UnifiedBackend
    from toolkv.twin.scheduler_0523 import TwinScheduler0523

    twin = Twin(make_plan(common.SMALL), get("offload"), default_profile(), common.OPTS)
    try:
        assert twin.stack.unified and twin.stack.sglang == sglang_version()
        assert isinstance(twin.h.tree, UnifiedRadixCache) and twin.h.tree.cache_controller is not None
        assert isinstance(twin.sched, TwinScheduler0523)
        assert isinstance(twin.tk.manager.backend, UnifiedBackend)
        assert twin.stack.host_tokens == get("offload").host_tokens(default_profile().kv_bytes_per_token)
    finally:
        twin.stack.close()


@pytest.mark.parametrize("name", ["stock", "offload", "auto"])
def test_conservation_and_idle_pools(name: str) -> None:
    o = common.run(name)
    common.check_conservation(o, name)
    assert o.cached_tokens > 0  # later turns reuse their session's prefix
    if name in ("offload", "auto"):
        # every finished turn reached toolkv through the AFTER hook on UnifiedRadixCache.checkpoint
        assert o.meta_end["backend"] == "unified" and o.meta_end["counters"]["turns"] == len(o.agents.turns)


def test_same_seed_same_run() -> None:
    common.check_same_seed_same_run()


def test_configurations_without_hicache_are_refused() -> None:
    """toolkv's unified backend needs a host tier: radix and pin have no 0.5.23 server to model.
    The refusal leaves no CPU harness behind (the next twin builds)."""
    for name in ("radix", "pin"):
        with pytest.raises(ValueError, match="without HiCache"):
            common.run(name)
    assert common.run("stock").crashed is None


def test_hand_computed_schedule() -> None:
    """The schedule of ``tests/test_twin.py::test_hand_computed_schedule`` on 0.5.23: the same
    decisions (chunk 1024 for s0, s1's first chunk in the 548 tokens s0's last chunk leaves,
    then s1's last 52 tokens, then 3 decode steps of both) and the same times."""
    common.check_hand_computed_schedule()


def test_the_host_pool_sort_covers_every_host_token_on_0523() -> None:
    """``toolkv.twin.host_mix`` on 0.5.23's Python tree core: the kinds partition what the host
    pool has allocated at every sample (a node missed, or counted twice, breaks the sum)."""
    from toolkv.twin.host_mix import KINDS

    o = common.run("offload")
    mixes = [(s["host_used"], s["host_mix"]) for s in o.samples if "host_used" in s]
    assert mixes and any(used > 0 for used, _ in mixes)
    for used, mix in mixes:
        assert mix is not None and set(mix) == set(KINDS)
        assert sum(mix.values()) == used, (used, mix)
