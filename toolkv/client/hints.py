"""sglang's own hint channel (``kv_hints``, sglang 0.5.23): the envelope that asks toolkv for an
action when a request finishes, and the outcome toolkv writes back into the response."""

from __future__ import annotations

from typing import Any

from toolkv import errors
from toolkv.core.requests import ToolStart

# ---- sglang's own hint channel (kv_hints, sglang 0.5.23) ------------------------------------------
KV_HINTS_ACTIONS = ("tool_start", "retain", "prefetch")


def kv_hints(
    action: str = "tool_start",
    *,
    tool: str | None = None,
    expected_s: float | None = None,
    prior_epoch: int | None = None,
    action_id: str | None = None,
    message_id: str | None = None,
) -> dict[str, Any]:
    """The ``kv_hints`` envelope that asks toolkv for ``action`` when this request finishes, for
    the request body (``extra_body={"session_id": sid, "kv_hints": kv_hints("tool_start",
    tool="search")}`` with the OpenAI client, or a ``/generate`` body): no extra round trip. The
    outcome comes back in the response's ``meta_info`` (:func:`kv_hints_outcome`).

    ``action``: ``tool_start`` (as ``ToolKVClient.tool_start``), ``retain`` (keep the KV on the GPU
    if there is spare room, else a tool_start) or ``prefetch`` (a tool_start whose ``expected_s``,
    required, times an early restore). Needs sglang 0.5.23 on the server: 0.5.16 has no
    ``kv_hints`` and drops the field, so no outcome comes back (use :meth:`ToolKVClient.tool_call`).
    Validated here as the server does, so a bad hint fails in the agent, not as a ``rejected``."""
    if action not in KV_HINTS_ACTIONS:
        raise ValueError(f"action must be one of {', '.join(KV_HINTS_ACTIONS)}, not {action!r}")
    if expected_s is None and action == "prefetch":
        raise ValueError("a prefetch needs expected_s: when the tool is expected back")
    if prior_epoch is not None and action != "tool_start":
        raise ValueError("prior_epoch only goes with a tool_start")
    given = {"tool": tool, "expected_s": expected_s, "prior_epoch": prior_epoch}
    payload: dict[str, Any] = {}
    for name, value in given.items():
        if value is not None:
            try:  # the bounds the server checks: the HTTP tool_start's own (toolkv.core.requests)
                payload[name] = ToolStart.check(name, value)
            except errors.BadRequest as e:
                raise ValueError(e.message) from None
    if expected_s is not None:
        payload["expected_s"] = float(expected_s)
    import uuid

    return {
        "protocol_version": "1",
        "message_id": message_id or uuid.uuid4().hex,
        "actions": [
            {
                "action_id": action_id or f"toolkv-{action}",
                "action_type": f"toolkv.{action}",
                "action_version": "1",
                "payload": payload,
            }
        ],
    }


def kv_hints_outcome(meta_info: Any) -> dict[str, Any] | None:
    """toolkv's answer to a request's ``kv_hints`` from its ``meta_info`` (a ``/generate``
    response's ``meta_info``; a chat completion's ``choices[0].meta_info`` with
    ``return_meta_info: true``; or the last chunk of a stream): ``{"outcome": "accepted" |
    "clipped" | "deferred" | "rejected", "epoch", "state", "reason", ...}``. A streamed response
    keeps sglang's per-token list (the outcome is its last entry). None when the server sent no
    outcome: sglang 0.5.16 (no ``kv_hints``), toolkv not running, or no toolkv action."""
    if not isinstance(meta_info, dict):
        return None
    value = meta_info.get("toolkv")
    if isinstance(value, list):
        value = next((v for v in reversed(value) if isinstance(v, dict)), None)
    return dict(value) if isinstance(value, dict) and "outcome" in value else None
