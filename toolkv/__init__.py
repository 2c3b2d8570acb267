"""toolkv: tool-call-aware KV-cache tiering for SGLang.

While an agent's session waits on a tool call, toolkv moves the session's radix-tree KV from GPU
memory to (pinned) host memory, protects the host copy, and brings it back when the tool ends.
The behaviour is specified in ``spec/ToolKV.tla``; this package implements that specification.
"""

__version__ = "0.1.0"
