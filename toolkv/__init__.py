"""toolkv: tool-call-aware KV-cache tiering for SGLang.

While an agent's session waits on a tool call, toolkv moves the session's radix-tree KV from GPU
memory to (pinned) host memory, protects the host copy, and brings it back when the tool ends.
The behaviour is specified in ``spec/ToolKV.tla``; this package implements that specification.

Layers (imports point only down; ``tests/test_layers.py`` enforces it):

- ``toolkv.errors``  the typed errors and their HTTP codes, shared by server and client
- ``toolkv.core``    the runtime: session lifecycle, manager, tree reads, backends (errors only)
- ``toolkv.client``  the typed HTTP client agents use (errors only; no torch, no sglang)
- ``toolkv.testing`` the CPU harness: real sglang caches plus named test doubles (nothing of toolkv)
- ``toolkv.sglang``  the glue into a running sglang server: plugin, scheduler side, HTTP, IPC, TP
- ``toolkv.verify``  TLC driver, spec-check, trace-check, refinement, conformance, fuzzing
- ``toolkv.tools``   the command line: demo, sim, bench, diagrams, fuzz campaigns
"""

__version__ = "0.1.0"
