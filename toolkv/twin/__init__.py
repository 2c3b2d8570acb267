"""A twin of one sglang server under the agent workload of ``toolkv bench agent``.

The cache is not modelled: sglang 0.5.16's own ``HiRadixCache``/``RadixCache`` (tiny tensors, exact
token accounting, the CPU harness of :mod:`toolkv.testing.harness`) and toolkv's real
``SchedulerToolKV``/``ToolKVManager`` make every cache decision. Admission uses sglang's real
``Req`` and ``PrefillAdder``. Only GPU compute time and copy time are modelled
(:mod:`toolkv.twin.profile`). See ``docs/twin.md``.
"""
