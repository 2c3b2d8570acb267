"""Where the KV goes: ``hiradix`` (sglang's own host tier), ``pin`` and ``shadow`` (plain
RadixCache fallbacks). Part of ``toolkv.core``; may import ``toolkv.core`` and ``toolkv.errors``."""
