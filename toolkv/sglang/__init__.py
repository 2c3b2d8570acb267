"""The glue into a running sglang server: the plugin entry point and its hooks, the scheduler-side
handler, HTTP routes, IPC wire types, tensor-parallel agreement and the ``TOOLKV_*`` config.

May import: ``toolkv.core``, ``toolkv.errors`` (every error the HTTP routes answer, the wire
errors ``ToolKVUnavailable`` and ``SchedulerTimeout`` included). Never ``toolkv.client``,
``toolkv.verify`` or ``toolkv.tools``. Modules here import sglang lazily where the plugin loader needs
to stay importable without it.
"""
