"""The runtime a server needs and nothing else: the session lifecycle tables (on ``transitions``),
the manager, session records, read-only tree operations and the backends that move the KV.

May import: ``toolkv.errors``. Never ``toolkv.sglang``, ``toolkv.verify``, ``toolkv.tools``: the
core must stay testable on a bare cache object and installable without the model checker.
"""
