"""toolkv: tool-call-aware KV-cache tiering for SGLang.

While an agent's session waits on a tool call, toolkv moves the session's radix-tree KV from GPU
memory to (pinned) host memory, protects the host copy, and brings it back when the tool ends.
The behaviour is specified in ``spec/ToolKV.tla``; this package implements that specification.

Layers, bottom up (imports point only down; the rules are ``toolkv.tools.layout.ALLOWED`` and
``tests/test_layers.py`` enforces them, lazy imports included, with no import cycle anywhere):

- ``toolkv.errors``    the typed errors and their HTTP codes, shared by server and client (nothing of toolkv)
- ``toolkv.workload``  the agent workload (sessions drawn from one seed), its metrics and report tables
  (nothing of toolkv; standard library only)
- ``toolkv.core``      the runtime: session lifecycle, manager, call policy, tree reads, backends (errors)
- ``toolkv.client``    the typed HTTP client agents use (errors; no torch, no sglang)
- ``toolkv.testing``   the CPU harness: real sglang caches plus named test doubles (nothing of toolkv)
- ``toolkv.sglang``    the glue into a running sglang server: plugin, start-up guards, scheduler side,
  HTTP, IPC, TP (core, errors)
- ``toolkv.verify``    spec-check, trace-check, refinement, conformance, fuzzing: one subpackage per
  spec (``toolkv/``, ``storage/``, ``decode/``) over the TLC plumbing in ``tla/`` (core, errors, testing)
- ``toolkv.twin``      a twin of one sglang server: the real caches and toolkv's scheduler side under
  the agent workload, GPU time modelled (core, errors, sglang, testing, workload; never tools)
- ``toolkv.tools``     the ``toolkv`` command line: demo, sim, soak, bench, value report, diagrams, fuzz
  campaigns, docs (anything; nothing imports it)
"""

__version__ = "0.1.0"
