"""Server features toolkv cannot share a server with, decided from the server arguments alone.

Pure functions: they read attributes of an sglang ``ServerArgs`` (or anything with the same
attribute names; a missing attribute counts as the feature being off) and return reasons. The
plugin refuses to start when any reason is returned, before any process is spawned.

Decode-side KV offload (``--disaggregation-decode-enable-offload-kvcache``, sglang's
``DecodeKVCacheOffloadManager``) is refused on a server with toolkv, for three reasons each
checked against sglang 0.5.16 (``docs/decode_offload.md``):

1. With it enabled, a finished request is released by the offload manager instead of
   ``release_kv_cache`` (batch_result_processor.py:889-892), so ``cache_finished_req`` never
   runs: no turn's KV ever enters the radix tree, and toolkv, which manages a session's KV
   in that tree, has nothing to offload or restore.
2. The manager keeps its own host pool and ``HiCacheController`` (a second pinned pool next
   to HiCache's) whose acks toolkv's agreement does not see.
3. Together with ``--disaggregation-decode-enable-radix-cache``, its release frees device slots
   the radix cache still owns and never unlocks the matched prefix (an upstream bug, reproduced
   in ``tests/test_decode_upstream.py``), which would corrupt the tree toolkv walks.
"""

from __future__ import annotations

from typing import Any

DECODE_OFFLOAD_FLAG = "--disaggregation-decode-enable-offload-kvcache"
DECODE_RADIX_FLAG = "--disaggregation-decode-enable-radix-cache"


def _on(server_args: Any, name: str) -> bool:
    value = getattr(server_args, name, False)
    if not isinstance(value, bool | None):
        raise TypeError(f"server_args.{name} must be a bool, got {type(value).__name__}: {value!r}")
    return bool(value)


def decode_offload_reasons(server_args: Any) -> list[str]:
    """Why toolkv cannot run next to decode-side KV offload with these arguments ([] if it can).

    Raises ``TypeError`` when a flag holds something other than a bool (a mis-parsed argument
    must not silently read as "off")."""
    if not _on(server_args, "disaggregation_decode_enable_offload_kvcache"):
        return []
    out = [
        f"decode-side KV offload ({DECODE_OFFLOAD_FLAG}) releases finished requests without "
        "cache_finished_req, so no turn's KV reaches the radix tree toolkv manages, and it keeps "
        "its own host pool and cache controller"
    ]
    if _on(server_args, "disaggregation_decode_enable_radix_cache"):
        out.append(
            f"with {DECODE_RADIX_FLAG} as well, sglang 0.5.16's offload release frees slots the "
            "radix cache still owns and never unlocks the matched prefix"
        )
    return out


__all__ = ["DECODE_OFFLOAD_FLAG", "DECODE_RADIX_FLAG", "decode_offload_reasons"]
