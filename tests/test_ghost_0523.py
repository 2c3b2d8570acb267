"""The eviction-harm count on sglang 0.5.23's real UnifiedRadixCache (the checks of
tests/_ghost.py, which tests/test_ghost.py runs on 0.5.16)."""

from __future__ import annotations

import pytest

from toolkv.testing.unified_harness import has_unified_radix_cache, sglang_version

if not has_unified_radix_cache():
    pytest.skip(
        f"needs sglang >= 0.5.21 (UnifiedRadixCache); installed: {sglang_version()}", allow_module_level=True
    )

from _ghost import check_counts_recomputed_after_eviction, check_ghost_bounded, rig


def test_counts_recomputed_after_eviction_by_requester() -> None:
    with rig() as r:
        assert r.stack.unified
        check_counts_recomputed_after_eviction(r)


def test_ghost_stays_bounded() -> None:
    with rig() as r:
        check_ghost_bounded(r)
