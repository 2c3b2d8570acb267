"""Wire types between sglang's HTTP process (tokenizer manager) and its scheduler ranks.

They subclass sglang's ``BaseReq`` so they travel over sglang's own ZMQ channel in either wire
format: pickle (the default, ``SGLANG_USE_PICKLE_IPC``) needs the classes importable under the same
module path in both processes — the plugin imports this module in both — and msgpack needs them in
the decoder's tagged union, which :func:`register_wire_types` adds via ``hook_custom_types``.

A request travels as its ``op`` and ``body``, a plain ``dict`` on purpose: msgspec encodes it in
both formats. The body is ``Request.to_body()`` of a request the HTTP side built, so checked
(``toolkv.core.requests``); the scheduler rebuilds it by ``op`` without checking it again.
"""

from typing import Any

import msgspec
from sglang.srt.managers.io_struct import BaseReq, hook_custom_types

from toolkv.core.requests import REQUESTS

# Operations the scheduler side understands: one per request type (toolkv.core.requests).
OPS = frozenset(REQUESTS)


class ToolKVReqInput(BaseReq, kw_only=True):  # type: ignore[misc,call-arg]
    """HTTP process -> every scheduler rank (rank 0 receives it and broadcasts it)."""

    op: str
    body: dict[str, Any] = msgspec.field(default_factory=dict)


class ToolKVReqOutput(BaseReq, kw_only=True):  # type: ignore[misc,call-arg]
    """Scheduler rank 0 -> HTTP process. ``status`` is the HTTP status the route answers with;
    on failure ``body`` is ``ToolKVError.to_dict()`` (``error``, ``message``, details)."""

    ok: bool
    status: int = 200
    body: dict[str, Any] = msgspec.field(default_factory=dict)


_registered = False


def register_wire_types() -> None:
    """Teach sglang's msgpack decoder the two types (idempotent; harmless in pickle mode)."""
    global _registered
    if not _registered:
        hook_custom_types(ToolKVReqInput, ToolKVReqOutput)
        _registered = True


def reply_ok(rid: str | None, body: dict[str, Any]) -> ToolKVReqOutput:
    return ToolKVReqOutput(rid=rid, ok=True, status=200, body=body)


def reply_error(rid: str | None, status: int, body: dict[str, Any]) -> ToolKVReqOutput:
    return ToolKVReqOutput(rid=rid, ok=False, status=status, body=body)
