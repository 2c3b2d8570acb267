"""The regime map's sglang 0.5.23 slice, on the tree core a user gets by default (Rust): toolkv's
``offload`` and ``auto`` never slower than stock sglang 0.5.23 on the same core, by the map's own
bars (``toolkv.twin.regime_map.never_worse``: closed throughput and resumed-turn TTFT p90 against
the same seed's stock run). One seed per cell (the map's full seeds run on 0.5.16 in
``tests/test_regime_map.py``).

Runs in the 0.5.23 environment (``make test-0523``); skips where an older sglang is installed.
"""

from __future__ import annotations

import pytest

from toolkv.testing.unified_harness import has_unified_radix_cache, sglang_version

if not has_unified_radix_cache():
    pytest.skip(
        f"needs sglang >= 0.5.21 (UnifiedRadixCache), found {sglang_version()}", allow_module_level=True
    )

from toolkv.twin.regime_map import cells, never_worse, run_map, tasks


@pytest.fixture(scope="module")
def recs() -> list[dict[str, object]]:
    mp = pytest.MonkeyPatch()
    mp.setenv("SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND", "rust")  # the map's workers inherit it
    try:
        todo = tasks([48], [16.0], ["traces"], [0], ["stock", "offload", "auto"])
        todo += tasks([96], [16.0], ["named"], [0], ["stock", "offload", "auto"])
        rows = run_map(todo, jobs=2, quiet=True)
        toolkv_rows = [r for r in rows if r["config"] != "stock"]
        assert toolkv_rows and all(r["tree_core"] == "rust" for r in toolkv_rows), rows
        return cells(rows)
    finally:
        mp.undo()


def test_the_slice_ran_on_the_rust_core_and_passed_its_checks(recs: list[dict[str, object]]) -> None:
    assert {(r["sessions"], r["config"]) for r in recs} == {
        (n, c) for n in (48, 96) for c in ("stock", "offload", "auto")
    }
    assert all(r["all_passed"] for r in recs), [r for r in recs if not r["all_passed"]]


def test_offload_and_auto_are_never_slower_than_stock_on_the_default_core(
    recs: list[dict[str, object]],
) -> None:
    assert never_worse(recs) == []
