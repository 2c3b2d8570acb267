"""Assurance for sglang's decode-side KV offload (``spec/decode/DecodeOffload.tla``) over the REAL
``DecodeKVCacheOffloadManager``.

- ``world``       the decode scheduler around the real manager, one method per spec action, the
  refinement mapping and the checks after each step
- ``fuzzing``     the Hypothesis campaign (``python -m research.decode_offload.fuzzing``)
- ``tracecheck``  a fuzz trace validated against the spec with TLC
- ``mutants``     seeded defects applied as patches on the real class
- ``tp``          two gloo ranks driven in lockstep (tensor parallelism)
- ``fixes``       proposed fixes for the upstream bugs, as patches the tests apply
- ``diagram``     the lifecycle diagrams in docs/decode_offload.md, from TLC's state graph
"""
