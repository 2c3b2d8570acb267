"""``toolkv.sglang.cache_hooks``: the plugin's own cache rows, applied by sglang's ``HookRegistry``
for the in-process server stand-ins (twin, soak), once however many stacks use them, and undone
by the last: other tests of the same process must find the cache classes as sglang defines them.

Runs on whichever release is installed (``radix`` rows on 0.5.16, ``unified`` rows on 0.5.23)."""

from __future__ import annotations

import pkgutil

from toolkv.sglang.cache_hooks import active, cache_classes, cache_hooks, toolkv_cache_hooks
from toolkv.sglang.config import ToolKVConfig
from toolkv.sglang.plugin import hooks
from toolkv.testing.unified_harness import has_unified_radix_cache

TREE = "unified" if has_unified_radix_cache() else "radix"


def _methods() -> dict[str, object]:
    """Every hooked attribute, by target, as its class holds it now (0.5.16: ``RadixCache``'s turn
    capture and reset, ``HiRadixCache``'s ``writing_check``)."""
    out = {}
    for target, _, _ in cache_hooks(TREE):
        path, name = target.rsplit(".", 1)
        out[target] = pkgutil.resolve_name(path).__dict__[name]
    return out


def _registry() -> tuple[dict[str, list[object]], set[str]]:
    from sglang.srt.plugins.hook_registry import HookRegistry

    return {k: list(v) for k, v in HookRegistry._hooks.items()}, set(HookRegistry._patched)


def test_the_rows_are_the_plugins_own_cache_rows() -> None:
    """Every row of the plugin's scheduler-side list on the cache class, and nothing else."""
    prefixes = tuple(c + "." for c in cache_classes(TREE))
    plugin_rows = hooks(main_process=False, config=ToolKVConfig(), tree=TREE)
    rows = cache_hooks(TREE)
    assert rows and rows == [r for r in plugin_rows if r[0].startswith(prefixes)]


def test_nested_entries_share_one_application_and_the_last_exit_undoes_it() -> None:
    before = _methods()
    registry = _registry()
    with toolkv_cache_hooks(TREE):
        applied = _methods()
        assert all(applied[n] is not before[n] for n in before)
        assert all(applied[n].__wrapped__ is before[n] for n in before), "wrapped once, over sglang's own"
        with toolkv_cache_hooks(TREE):  # a second stack (a fleet's next server): nothing applied again
            assert active(TREE) == 2
            assert _methods() == applied
        assert active(TREE) == 1
        assert _methods() == applied, "still applied for the first user"
    assert active(TREE) == 0
    assert _methods() == before
    assert _registry() == registry


def test_an_error_inside_still_undoes_the_hooks() -> None:
    before = _methods()
    try:
        with toolkv_cache_hooks(TREE):
            raise RuntimeError("boom")
    except RuntimeError:
        pass
    assert active(TREE) == 0 and _methods() == before


def test_the_twins_stacks_hold_the_hooks_from_build_to_close() -> None:
    """Two servers' stacks (as a fleet builds them) share one application; the last close undoes it."""
    from toolkv.twin.configs import get
    from toolkv.twin.stack import build

    cfg = get("offload").with_host_gb(0.01)
    one = build(cfg, device_tokens=2048, kv_bytes_per_token=131_072, now=lambda: 0.0)
    try:
        type(one.harness)._live_owner._live_cpu = None  # as a fleet's servers do (twin/fleet.py)
        two = build(cfg, device_tokens=2048, kv_bytes_per_token=131_072, now=lambda: 0.0)
        assert active(TREE) == 2
        two.close()
    finally:
        assert active(TREE) == 1
        one.close()
    assert active(TREE) == 0
