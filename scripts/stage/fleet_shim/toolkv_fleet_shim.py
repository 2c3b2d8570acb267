"""Session label from sglang-router's routing key, for the multi-server run (scripts/gpu_fleet.sh).

Why this exists: toolkv keys a session by the ``session_id`` field of ``/generate`` (or of a chat
request). sglang-router 0.3.2 parses each request into its own typed struct and re-serialises it to
the worker, and that struct has no ``session_id``: the label never reaches the server, so toolkv
records no turn and every ``tool_start`` behind the router answers ``unknown_session``. The router
does forward the header it routes by (``X-SMG-Routing-Key``, its ``manual`` policy's sticky key), so
this sglang plugin copies that header into ``GenerateReqInput.session_id`` when the body carries
none, in the HTTP process, before the tokenizer manager builds the request. A body that has its own
``session_id`` (a client talking to the server directly) is left alone.

It is a separate plugin, not part of toolkv, because the run is what showed the gap: whether toolkv
should take the session from the routing key itself is open (see docs/architecture.md, "More than
one server"). Registered in the main process only: the tokenizer manager lives there.
"""

from __future__ import annotations

import logging
import multiprocessing
from typing import Any

log = logging.getLogger("toolkv_fleet_shim")

HEADER = "x-smg-routing-key"
TARGET = "sglang.srt.managers.tokenizer_manager.TokenizerManager.generate_request"


def register() -> None:
    """sglang's plugin entry point (group ``sglang.srt.plugins``)."""
    if multiprocessing.parent_process() is not None:  # a scheduler or detokenizer process
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, session_from_routing_key, HookType.BEFORE)
    log.info("toolkv_fleet_shim: %s header -> session_id on %s", HEADER, TARGET)


def session_from_routing_key(manager: Any, obj: Any, request: Any = None, *args: Any, **kwargs: Any) -> None:
    """BEFORE hook of ``TokenizerManager.generate_request(obj, request)``: label the request with the
    router's routing key. Returns None (the arguments go on unchanged; ``obj`` is changed in place)."""
    headers = getattr(request, "headers", None)
    if headers is None or not hasattr(obj, "session_id") or obj.session_id is not None:
        return None
    key = headers.get(HEADER)
    if isinstance(key, str) and key:
        obj.session_id = key
    return None
