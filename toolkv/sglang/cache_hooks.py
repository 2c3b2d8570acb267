"""toolkv's cache hooks applied by sglang's own ``HookRegistry``, for a server stand-in in this process.

On a server, :func:`toolkv.sglang.plugin.register` hands the plugin's hook list to sglang's
``HookRegistry`` and sglang applies it before the ``Scheduler`` is built. The CPU drivers that run a
server's scheduler side over sglang's real caches (the soak, the server twin, the fault bench) need
the same turn capture (``RadixCache.cache_finished_req`` AROUND, or ``UnifiedRadixCache.checkpoint``
AFTER on 0.5.21+) and tree-reset hook, and nothing else: no ``Scheduler`` exists there. Wiring the
hook functions by hand would let a driver's hooks drift from the plugin's; so they take the rows
of the plugin's own list (:func:`~toolkv.sglang.plugin.hooks`) that target the cache class, and
let the registry apply them, as a server does.

The registry patches classes process-wide and has no undo, so :func:`toolkv_cache_hooks` is a
context that puts back the class's methods and the registry's state when the last user leaves
(:func:`plugin_hooks` does the same for any rows of the plugin's list: the 0.5.23 stand-in server
of the tests applies its streamer and tokenizer-manager rows with it).
It nests: several stacks in one process (a fleet's servers, or a twin run inside a test that
already applied them) share one application, applied by the first and undone by the last. A
hook reaches a tree only through ``tree._toolkv`` (absent: the hook does nothing), so trees
built without toolkv in the same process are unaffected while it is applied.
"""

from __future__ import annotations

import contextlib
import pkgutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from toolkv.sglang.config import ToolKVConfig
from toolkv.sglang.plugin import HIRADIX, RADIX, UNIFIED, hooks

TREE_APIS = ("radix", "unified")


def cache_class_path(tree_api: str) -> str:
    """The dotted path of the cache class whose methods the plugin hooks for a release's cache
    API (``radix``: 0.5.16's ``RadixCache``, which ``HiRadixCache`` inherits them from; ``unified``:
    0.5.21+'s ``UnifiedRadixCache``)."""
    if tree_api not in TREE_APIS:
        raise ValueError(f"unknown cache API {tree_api!r}; known: {', '.join(TREE_APIS)}")
    return UNIFIED if tree_api == "unified" else RADIX


def cache_classes(tree_api: str) -> tuple[str, ...]:
    """The dotted paths of every cache class the plugin hooks for ``tree_api``: the turn-capture
    class of :func:`cache_class_path`, and for 0.5.16 also ``HiRadixCache`` (its ``writing_check``,
    write_back's drain)."""
    return (cache_class_path(tree_api),) if tree_api == "unified" else (RADIX, HIRADIX)


def cache_hooks(tree_api: str) -> list[tuple[str, Callable[..., Any], str]]:
    """The rows of the plugin's hook list (scheduler process, default config) that target the
    cache classes of ``tree_api``: (target, hook, ``HookType`` name), in the plugin's order."""
    prefixes = tuple(c + "." for c in cache_classes(tree_api))
    rows = hooks(main_process=False, config=ToolKVConfig(), tree=tree_api)
    return [row for row in rows if row[0].startswith(prefixes)]


Row = tuple[str, Callable[..., Any], str]  # (target, hook, HookType name), as plugin.hooks gives them


@dataclass
class _Applied:
    """One application of a set of the plugin's hooks: what to put back when its last user leaves."""

    originals: list[tuple[Any, str, Any]]  # (owner, attribute, its own value before patching)
    registry_hooks: dict[str, list[Any]]
    registry_patched: set[str]
    users: int = field(default=1)


_applied: dict[tuple[str, ...], _Applied] = {}


def _owner(target: str) -> tuple[Any, str]:
    """(the class or module holding ``target``'s attribute, the attribute's name)."""
    path, name = target.rsplit(".", 1)
    return pkgutil.resolve_name(path), name


def _apply(rows: list[Row]) -> _Applied:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    owners = dict.fromkeys(_owner(target) for target, _, _ in rows)  # once each, in order
    applied = _Applied(
        originals=[(owner, name, owner.__dict__[name]) for owner, name in owners],
        registry_hooks={k: list(v) for k, v in HookRegistry._hooks.items()},
        registry_patched=set(HookRegistry._patched),
    )
    for target, hook, kind in rows:
        HookRegistry.register(target, hook, getattr(HookType, kind))
    HookRegistry.apply_hooks()
    return applied


def _undo(applied: _Applied) -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry

    for owner, name, value in applied.originals:
        setattr(owner, name, value)
    HookRegistry._hooks.clear()
    HookRegistry._hooks.update(applied.registry_hooks)
    HookRegistry._patched.clear()
    HookRegistry._patched.update(applied.registry_patched)


@contextlib.contextmanager
def plugin_hooks(rows: list[Row]) -> Iterator[None]:
    """Apply ``rows`` of the plugin's hook list with sglang's ``HookRegistry`` while the context is
    open, and put back the patched attributes and the registry's state when the last user of the
    same rows leaves (an entry with the same targets while they are applied shares the
    application). Different row sets nest in last-in, first-out order."""
    key = tuple(target for target, _, _ in rows)
    applied = _applied.get(key)
    if applied is None:
        applied = _applied[key] = _apply(rows)
    else:
        applied.users += 1
    try:
        yield
    finally:
        applied.users -= 1
        if applied.users == 0:
            del _applied[key]
            _undo(applied)


def toolkv_cache_hooks(tree_api: str) -> contextlib.AbstractContextManager[None]:
    """Apply toolkv's turn-capture and tree-reset hooks to the cache class of ``tree_api`` with
    sglang's ``HookRegistry`` (as ``register`` does in a scheduler process) while the context is
    open; nested entries share the first one's application, and the last exit undoes it."""
    return plugin_hooks(cache_hooks(tree_api))


def active(tree_api: str) -> int:
    """How many users hold the cache hooks of ``tree_api`` applied now (0: not applied)."""
    applied = _applied.get(tuple(target for target, _, _ in cache_hooks(tree_api)))
    return applied.users if applied is not None else 0
