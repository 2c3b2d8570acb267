"""The CPU harness: real sglang caches (HiRadixCache, RadixCache, pools, allocators, cache controller)
with named test doubles for what a CPU machine lacks (pinned memory, copy kernels, the DMA engine).

May import: nothing of toolkv except itself. Used by ``toolkv.verify``, ``toolkv.tools`` and tests.
"""
