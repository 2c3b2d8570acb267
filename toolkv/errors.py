"""Typed errors. Every error is raised before any state changes (validate, then act), and carries
the HTTP status the plugin maps it to, so the Python API and the HTTP contract cannot drift apart."""

from __future__ import annotations


class ToolKVError(Exception):
    """Base class. ``http_status`` is what the HTTP layer answers; ``code`` is a stable machine name."""

    http_status = 400
    code = "bad_request"

    def __init__(self, message: str, **details: object) -> None:
        super().__init__(message)
        self.message = message
        self.details = details

    def to_dict(self) -> dict[str, object]:
        return {"error": self.code, "message": self.message, **self.details}


class BadRequest(ToolKVError):
    http_status = 400
    code = "bad_request"


class UnsupportedMediaType(BadRequest):
    """The body is not declared ``application/json``. Refused before it is read: a ``text/plain``
    form post is the one body a browser sends cross-site without asking first, so accepting it
    would let any web page drive tool_start/close on a server without ``--api-key``."""

    http_status = 415
    code = "unsupported_media_type"


class PayloadTooLarge(BadRequest):
    """The body is over the route's size limit. Refused while it is read: a declared
    ``Content-Length`` over the limit before any byte, a chunked body at the first chunk past it,
    so a hostile body costs the server no more memory than the limit."""

    http_status = 413
    code = "payload_too_large"


class UnknownSession(ToolKVError):
    http_status = 404
    code = "unknown_session"


class StaleEpoch(ToolKVError):
    """``tool_end`` carried an epoch other than the one its ``tool_start`` returned."""

    http_status = 409
    code = "stale_epoch"


class WrongState(ToolKVError):
    """The session's lifecycle state does not allow this call (e.g. ``tool_end`` while running)."""

    http_status = 409
    code = "wrong_state"


class SessionKVLost(ToolKVError):
    """Nothing of the session's KV is left in the cache (evicted, or the tree was reset)."""

    http_status = 409
    code = "kv_lost"


class HostMemoryFull(ToolKVError):
    """The host pool, or toolkv's host budget, cannot hold the session's KV."""

    http_status = 507
    code = "host_memory_full"


class Unsupported(ToolKVError):
    """The server configuration cannot run toolkv (refused at start-up)."""

    http_status = 501
    code = "unsupported"


class DeviceMemoryFull(ToolKVError):
    """The restore cannot start now (no device memory or no free load slot). The session stays
    offloaded and protected: retry ``tool_end``, or the next turn reloads it lazily."""

    http_status = 503
    code = "device_memory_full"


class Draining(ToolKVError):
    """The operator drains the server (``POST /session/drain``): no new tool call is accepted, so
    that the calls in flight can finish or expire and toolkv can be switched off or sglang upgraded
    without cutting a session off mid-call. Nothing changed: the session's KV stays where sglang
    keeps it, and the agent's turn goes on without toolkv."""

    http_status = 503
    code = "draining"


class ToolKVUnavailable(ToolKVError):
    """The scheduler does not run toolkv (the HTTP side's handshake failed) or the server is
    still starting."""

    http_status = 503
    code = "toolkv_unavailable"


class SchedulerTimeout(ToolKVError):
    """No scheduler reply within the timeout. The operation may still take effect: check kv_meta."""

    http_status = 504
    code = "scheduler_timeout"


class StartupRefused(SystemExit):
    """toolkv is enabled but cannot run: a bad ``TOOLKV_*`` value, a missing dependency, or an
    sglang release toolkv was not verified against. Stops the launch with ``message``.

    A ``SystemExit`` on purpose: sglang's plugin loader catches every ``Exception`` from a plugin,
    logs it and serves on without the plugin (plugins/__init__.py:83-84, 135-136). An operator who
    set ``TOOLKV_ENABLE=1`` must get toolkv or no server, never a server that silently lacks it.
    """

    def __init__(self, message: str) -> None:
        super().__init__(f"toolkv: refusing to start: {message}")
        self.message = message


class InputError(ValueError):
    """A command-line input or environment toolkv cannot use (a file that is not a trace, a device
    that is not there, a server that does not answer). Not a bug: the ``toolkv`` command prints
    it as one line, ``toolkv <command>: error: ...``, and exits 2 (``TOOLKV_DEBUG=1`` re-raises).
    A ``ValueError`` so that library callers that caught ``ValueError`` still do."""
