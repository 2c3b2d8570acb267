"""Assurance: the TLC driver, spec-check over every config and mutant, trace-check, the refinement
mappings from implementation to spec, the conformance replays of TLC's state graphs and the
Hypothesis state machines that fuzz the real caches. One subpackage per spec toolkv runs, with the same role
files in each (``spec``/``world``, ``conformance``, ``fuzzing``, ``tracecheck``, ``mutants``):

- ``toolkv/``   toolkv's own spec (``spec/ToolKV.tla``): the manager over the real caches
- ``storage/``  the L3 storage tier (``spec/storage/StorageTier.tla``) over sglang's ``HiCacheFile``
- ``tla/``      TLC and TLA+ plumbing every spec's checks share (run TLC, read its output and values,
  plan walks over a state graph)

Shared at the top: ``spec_check`` (``toolkv spec-check``), ``trace_cli`` (``toolkv trace-check``),
``campaign`` (one fuzz campaign under a profile), ``profiles`` (Hypothesis settings profiles).

May import: ``toolkv.core``, ``toolkv.errors``, ``toolkv.testing``. Never ``toolkv.sglang`` or
``toolkv.tools``. Not needed by a server: nothing in ``core`` or ``sglang`` imports it. The model of
sglang's decode-side offload (``spec/decode/``), a feature toolkv refuses, is checked by the same
tools from the checkout's ``research/decode_offload/`` and is not in the package.
"""
