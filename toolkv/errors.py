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
