"""toolkv as a consumer of sglang's own KV-hint channel (``kv_hints``, sglang 0.5.23).

Since 0.5.21 a generate request may carry a versioned envelope of typed actions
(``sglang/srt/managers/kv_hints.py``: ``KvHintsEnvelope{protocol_version, message_id,
actions[KvHintAction{action_id, action_type, action_version, payload}]}``, 16-55; "consumers
ignore actions they do not implement, and the component that implements an action validates its
payload", 4). sglang carries it untouched from the request to the scheduler's ``Req`` and nothing
in 0.5.23 reads it (verified against the installed 0.5.23 source):

* ``GenerateReqInput.kv_hints`` (``managers/io_struct.py:378``), decoded by
  ``decode_kv_hints_envelope`` when the request is normalised (io_struct.py:583-587, one envelope
  per request of a batch 888-905);
* ``TokenizedGenerateReqInput.kv_hints`` (io_struct.py:1170), set by the tokenizer manager
  (``managers/tokenizer_manager.py:1617``);
* ``Req(kv_hints=recv_req.kv_hints)`` in ``Scheduler.handle_generate_request``
  (``managers/scheduler.py:3016``), kept as ``Req.kv_hints`` (``managers/schedule_batch.py:1416``).

The OpenAI chat route does not carry it: ``ChatCompletionRequest`` has no ``kv_hints`` field (a
pydantic model that ignores unknown fields, ``entrypoints/openai/protocol.py:909``) and
``OpenAIServingChat._convert_to_internal_request`` builds the ``GenerateReqInput`` without it
(``entrypoints/openai/serving_chat.py:1366-1410``). :func:`carry_chat_kv_hints` copies it from
the request's JSON body (the plugin's chat hooks).

toolkv implements three action types, all applied when the request that carries them finishes
(the turn that ends in a tool call), with no extra round trip:

========================  ==========================================================================
``toolkv.tool_start``     the HTTP ``tool_start``: the spec's ToolStart / Keep / LetGo as the policy
                          chooses, with ``tool``, ``expected_s`` and the replay fence ``prior_epoch``
``toolkv.retain``         spec ``Keep``: pin the resident KV until ``tool_end`` or the TTL, on spare
                          device room only (the policy's keep rule); otherwise a ``tool_start``
``toolkv.prefetch``       a ``tool_start`` whose ``expected_s`` (required) times the policy's early
                          restore (spec ``Prefetch`` before the tool is expected back)
========================  ==========================================================================

No new spec action: each one is the same manager call the HTTP route makes, with the same epoch
fence (the outcome carries the epoch that ``tool_end`` needs). The outcome is one of
``accepted`` (done as asked), ``clipped`` (done, but less than asked: ``reason`` says what),
``deferred`` (accepted, takes effect later: the early restore is scheduled) or ``rejected``
(nothing changed: a malformed action, an unknown session, a wrong state, an aborted request).
A bad hint is never an exception in the scheduler: it is a ``rejected`` outcome.

The outcome rides back on sglang's own per-request output channel: ``Req.customized_info``
(schedule_batch.py:1340) is copied into the scheduler's output by
``_GenerationStreamAccumulator.accept`` (``managers/scheduler_components/output_streamer.py:688-708``,
a value per output token, sliced per chunk) and into the response's ``meta_info`` by
``TokenizerManager.update_request_meta_info`` (tokenizer_manager.py:2577-2583, 2825-2838). The
plugin attaches it BEFORE ``SchedulerOutputStreamer.stream_output`` (output_streamer.py:135): every
finished request has been through ``release_kv_cache`` by then (its turn recorded by the
``checkpoint`` hook, its lock released: batch_result_processor.py:387-502 and 1374-1466 release
before the stream calls at 502 and 1099), and the output is not sent yet.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from toolkv.core.lifecycle import HOLDING
from toolkv.core.phases import Phase
from toolkv.core.requests import ToolStart
from toolkv.errors import BadRequest

if TYPE_CHECKING:
    from toolkv.sglang.scheduler_side import SchedulerToolKV

PROTOCOL_MAJOR = "1"  # the envelope protocol toolkv reads ("1" or "1.x")
ACTION_VERSION = "1"
NAMESPACE = "toolkv."
TOOL_START = "toolkv.tool_start"
RETAIN = "toolkv.retain"
PREFETCH = "toolkv.prefetch"
ACTION_TYPES = (TOOL_START, RETAIN, PREFETCH)
META_KEY = "toolkv"  # the key in Req.customized_info and in the response's meta_info
OUTCOMES = ("accepted", "clipped", "deferred", "rejected")

# payload fields per action type: (allowed, required). Strict like the HTTP bodies (extra="forbid").
_FIELDS: dict[str, tuple[frozenset[str], frozenset[str]]] = {
    TOOL_START: (frozenset({"tool", "expected_s", "prior_epoch"}), frozenset()),
    RETAIN: (frozenset({"tool", "expected_s"}), frozenset()),
    PREFETCH: (frozenset({"tool", "expected_s"}), frozenset({"expected_s"})),
}


@dataclass(frozen=True)
class HintAction:
    """A validated toolkv action of one request's envelope."""

    action_id: str
    action_type: str
    tool: str | None = None
    expected_s: float | None = None
    prior_epoch: int | None = None


@dataclass(frozen=True)
class Rejected:
    """A toolkv action that cannot be applied as written (nothing is changed for it)."""

    action_id: str
    action_type: str
    reason: str


def _field(obj: Any, name: str) -> Any:
    """A field of sglang's msgspec structs or of the plain dict a test or an old sender passes."""
    return obj.get(name) if isinstance(obj, Mapping) else getattr(obj, name, None)


def _protocol_ok(version: Any) -> bool:
    return isinstance(version, str) and (
        version == PROTOCOL_MAJOR or version.startswith(PROTOCOL_MAJOR + ".")
    )


def _validate(action_id: str, action_type: str, version: Any, payload: Any) -> HintAction | Rejected:
    def bad(reason: str) -> Rejected:
        return Rejected(action_id, action_type, reason)

    if action_type not in _FIELDS:
        return bad(f"unknown toolkv action type {action_type!r} (known: {', '.join(ACTION_TYPES)})")
    if version != ACTION_VERSION:
        return bad(f"unsupported action_version {version!r} (toolkv reads {ACTION_VERSION!r})")
    if not isinstance(payload, Mapping):
        return bad("payload must be an object")
    allowed, required = _FIELDS[action_type]
    extra = sorted(str(k) for k in payload if k not in allowed)
    if extra:
        return bad(f"unknown payload field(s) {', '.join(extra)} (allowed: {', '.join(sorted(allowed))})")
    missing = sorted(required - set(payload))
    if missing:
        return bad(f"missing payload field(s) {', '.join(missing)}")
    try:  # the bounds of the HTTP tool_start's fields (toolkv.core.requests.ToolStart)
        checked: list[Any] = [
            ToolStart.check(k, payload.get(k)) for k in ("tool", "expected_s", "prior_epoch")
        ]
    except BadRequest as e:
        return bad(e.message)
    tool, expected, prior = checked
    return HintAction(
        action_id,
        action_type,
        tool=tool,
        expected_s=None if expected is None else float(expected),
        prior_epoch=prior,
    )


def toolkv_actions(envelope: Any) -> list[HintAction | Rejected]:
    """The toolkv actions of one request's envelope, validated, in order. Actions of other types
    are not toolkv's and are skipped (the envelope's contract, kv_hints.py:4); an envelope of a
    protocol toolkv does not read rejects only toolkv's own actions."""
    if envelope is None:
        return []
    actions = _field(envelope, "actions")
    if not isinstance(actions, Sequence) or isinstance(actions, (str, bytes)):
        return []
    protocol_ok = _protocol_ok(_field(envelope, "protocol_version"))
    out: list[HintAction | Rejected] = []
    for i, a in enumerate(actions):
        action_type = _field(a, "action_type")
        if not isinstance(action_type, str) or not action_type.startswith(NAMESPACE):
            continue
        aid = _field(a, "action_id")
        action_id = aid if isinstance(aid, str) and aid else f"#{i}"
        if not protocol_ok:
            version = _field(envelope, "protocol_version")
            out.append(Rejected(action_id, action_type, f"unsupported protocol_version {version!r}"))
            continue
        payload = _field(a, "payload")
        out.append(
            _validate(action_id, action_type, _field(a, "action_version"), {} if payload is None else payload)
        )
    return out


# ---- applying an action on the turn's finish ----------------------------------------------------------
def _outcome(
    action: HintAction | Rejected, outcome: str, meta: Mapping[str, Any] | None, reason: str = ""
) -> dict[str, Any]:
    out: dict[str, Any] = {
        "outcome": outcome,
        "action_id": action.action_id,
        "action_type": action.action_type,
    }
    if meta is not None:
        for k in ("epoch", "state", "decision"):
            if meta.get(k) is not None:
                out[k] = meta[k]
        if meta.get("replayed"):
            out["replayed"] = True
    if reason:
        out["reason"] = reason
    return out


def _refused(action: HintAction, body: Mapping[str, Any]) -> dict[str, Any]:
    """A manager refusal (the HTTP route's 4xx/5xx body) as a rejected outcome."""
    code = body.get("error")
    message = body.get("message")
    reason = str(code) if code else "refused"
    if isinstance(message, str) and message:
        reason = f"{reason}: {message}"
    return _outcome(action, "rejected", None, reason)


def _tool_start(tk: SchedulerToolKV, sid: str, action: HintAction) -> tuple[int, dict[str, Any]]:
    """The HTTP tool_start, through the same handler (decision line, replay fence, typed errors)."""
    body: dict[str, Any] = {"session_id": sid}
    if action.tool is not None:
        body["tool"] = action.tool
    if action.expected_s is not None:
        body["expected_s"] = action.expected_s
    if action.prior_epoch is not None:
        body["prior_epoch"] = action.prior_epoch
    return tk.handle("tool_start", body)


def _ttl_clip(tk: SchedulerToolKV, action: HintAction, meta: Mapping[str, Any]) -> str:
    """Why the hold is shorter than asked, or "": a protection lasts at most the TTL, so a tool
    expected back later will find its KV released (the TTL, not the hint, bounds what a client
    can hold). A GPU pin waiting for tool_end (``Kept``) lasts at most the keep TTL."""
    if action.expected_s is None or meta.get("state") not in HOLDING:
        return ""
    kept = meta.get("state") == Phase.KEPT
    bound = min(tk.config.ttl_s, tk.config.keep_ttl_s) if kept else tk.config.ttl_s
    if action.expected_s > bound:
        which = " (keep TTL)" if kept else ""
        return f"ttl: held at most {bound:g}s{which}, expected_s is {action.expected_s:g}s"
    return ""


def _apply_tool_start(tk: SchedulerToolKV, sid: str, action: HintAction) -> dict[str, Any]:
    status, meta = _tool_start(tk, sid, action)
    if status != 200:
        return _refused(action, meta)
    clip = _ttl_clip(tk, action, meta)
    return _outcome(action, "clipped" if clip else "accepted", meta, clip)


def _device_room_for(tk: SchedulerToolKV, kv_tokens: int) -> bool:
    """The policy's keep rule (``policy.keep_fits``, the one the per-call policy keeps by): after
    pinning, the pool's ``device_reserve`` must stay free after what running requests were
    promised and queued requests will need."""
    return tk.manager.keep_fits(kv_tokens)


def _apply_retain(tk: SchedulerToolKV, sid: str, action: HintAction) -> dict[str, Any]:
    """Spec ``Keep`` through ``ToolKVManager.keep``; where the KV cannot be pinned (no spare device
    room, or the path is not all resident) the call is a ``tool_start`` instead (the policy
    offloads or lets go), reported as clipped."""
    from toolkv.errors import ToolKVError, WrongState

    m = tk.manager
    rec = m.sessions.get(sid)
    if rec is None or rec.state != Phase.RUNNING or tk.draining:
        # the HTTP tool_start's answer for this case (unknown session, wrong state, a replay, the
        # drain's refusal)
        return _apply_tool_start(tk, sid, action)
    meta = m.kv_meta(sid)
    device_tokens = meta.get("device_tokens")
    kv_tokens = device_tokens if isinstance(device_tokens, int) else 0
    why = "" if _device_room_for(tk, kv_tokens) else "no_device_room"
    if not why:
        try:
            kept = m.keep(sid)
        except WrongState:
            why = "not_resident"
        except ToolKVError as e:
            tk.decisions.decided("retain", sid, None, "refused", e.code)
            return _refused(action, e.to_dict())
        else:
            tk.decisions.decided("retain", sid, kept, "ok", "kv_hints")
            clip = _ttl_clip(tk, action, kept)
            return _outcome(action, "clipped" if clip else "accepted", kept, clip)
    out = _apply_tool_start(tk, sid, action)
    if out["outcome"] != "rejected":
        out.update(outcome="clipped", reason=f"{why}: not pinned, tool_start instead")
    return out


def _apply_prefetch(tk: SchedulerToolKV, sid: str, action: HintAction) -> dict[str, Any]:
    """A tool_start timed by ``expected_s``. Deferred when the policy scheduled the early restore
    (it runs from the tick before the tool is expected back); clipped when the KV was offloaded
    without one (``TOOLKV_POLICY=offload``, early restore off, or a restore too short to be worth
    starting early) or let go; accepted when the KV stayed on the GPU (nothing to restore)."""
    status, meta = _tool_start(tk, sid, action)
    if status != 200:
        return _refused(action, meta)
    rec = tk.manager.sessions.get(sid)
    state = meta.get("state")
    if state in (Phase.OFFLOADING, Phase.OFFLOADED):
        due = None if rec is None else rec.prefetch_at
        if due is not None and math.isfinite(due):
            out = _outcome(action, "deferred", meta, _ttl_clip(tk, action, meta))
            out["restore_in_s"] = round(max(0.0, due - tk.manager.now), 3)
            return out
        return _outcome(action, "clipped", meta, "no_early_restore: restored at tool_end or the next request")
    if state == Phase.RELEASED:
        return _outcome(action, "clipped", meta, f"let_go: {meta.get('reason') or 'nothing held'}")
    clip = _ttl_clip(tk, action, meta)
    return _outcome(action, "clipped" if clip else "accepted", meta, clip)


_APPLY = {TOOL_START: _apply_tool_start, RETAIN: _apply_retain, PREFETCH: _apply_prefetch}


def _aborted(req: Any) -> bool:
    """sglang's abort finish reason (``FINISH_ABORT``, schedule_batch.py:332): a turn that did not
    complete must not start a tool call (vLLM's envelope consumers discard hints on abort too)."""
    return type(getattr(req, "finished_reason", None)).__name__ == "FINISH_ABORT"


def outcome_for(tk: SchedulerToolKV, req: Any) -> dict[str, Any] | None:
    """Apply the toolkv action of a finished request's ``kv_hints``; the outcome for its response's
    meta, or None when the envelope holds no toolkv action. One toolkv action per request (a
    turn ends in one tool call): the first valid one applies, later ones are rejected. Never
    raises for a bad hint; an unexpected error becomes ``rejected: internal`` (and is logged)."""
    from toolkv.sglang.scheduler_side import session_label

    actions = toolkv_actions(getattr(req, "kv_hints", None))
    if not actions:
        return None
    first = next((a for a in actions if isinstance(a, HintAction)), None)
    others = [
        _outcome(
            a, "rejected", None, a.reason if isinstance(a, Rejected) else "one toolkv action per request"
        )
        for a in actions
        if a is not first
    ]
    if first is None:
        result = others[0]
        others = others[1:]
    else:
        sid = session_label(req)
        if sid is None:
            result = _outcome(first, "rejected", None, "no_session: the request has no session_id")
        elif _aborted(req):
            result = _outcome(first, "rejected", None, "aborted: the turn did not complete")
        else:
            try:
                result = _APPLY[first.action_type](tk, sid, first)
            except Exception as e:  # never take the scheduler loop down for a hint
                import logging

                logging.getLogger("toolkv").exception("toolkv: kv_hints action of session %s failed", sid)
                result = _outcome(first, "rejected", None, f"internal: {type(e).__name__}")
    # one decision line per hint (outcome as the metrics label: four values, never free text)
    tk.decisions.decided("kv_hints", session_label(req), None, str(result["outcome"]))
    if others:
        result["others"] = others
    return result


def attach_outcome(req: Any, outcome: Mapping[str, Any]) -> None:
    """Put the outcome into ``req.customized_info`` where sglang's output streamer picks it up: a
    value per output token through the stop (the streamer slices ``values[send_token_offset :
    len(output_ids_through_stop)]``, output_streamer.py:505-506 and 705), None but for the last
    one, so the chunk that finishes the request carries it whether it streams or not."""
    n = max(1, len(getattr(req, "output_ids_through_stop", ()) or ()))
    info = getattr(req, "customized_info", None)
    if info is None:
        info = {}
        req.customized_info = info
    info[META_KEY] = [None] * (n - 1) + [dict(outcome)]


def apply_finished_hints(tk: SchedulerToolKV, reqs: Sequence[Any]) -> int:
    """For each request of an output step that finished and has not been streamed as finished
    (``finished_output``, set by the streamer, output_streamer.py:447-449) and carries a toolkv
    action: apply it and attach the outcome. Runs on every TP rank with the same requests (the
    same batch result), so the manager calls agree. Returns how many were applied."""
    n = 0
    for req in reqs:
        if not req.finished() or getattr(req, "finished_output", False):
            continue
        info = getattr(req, "customized_info", None)
        if info is not None and META_KEY in info:  # already applied (a second stream of the request)
            continue
        outcome = outcome_for(tk, req)
        if outcome is not None:
            attach_outcome(req, outcome)
            n += 1
    return n


# ---- the HTTP process ------------------------------------------------------------------------------------
def flatten_meta(meta_info: dict[str, Any]) -> None:
    """The response's ``meta_info["toolkv"]`` as one object: sglang accumulates customized info as
    a list with a value per output token (tokenizer_manager.py:2812-2821); the outcome is its last
    non-null entry. Only for a response that is not streamed: streamed chunks are sliced per token
    afterwards (``_slice_streaming_output_meta_info``, tokenizer_manager.py:364-374), so they keep
    sglang's list (``toolkv.client.kv_hints_outcome`` reads both shapes)."""
    value = meta_info.get(META_KEY)
    if not isinstance(value, list):
        return
    found = next((v for v in reversed(value) if isinstance(v, Mapping)), None)
    if found is None:
        meta_info.pop(META_KEY, None)
    else:
        meta_info[META_KEY] = dict(found)


def carry_chat_kv_hints(adapted_request: Any, body: Any) -> bool:
    """Copy ``kv_hints`` from a chat request's JSON body onto the ``GenerateReqInput`` the chat
    route built without it, decoded by sglang's own ``decode_kv_hints_envelope`` (a malformed
    envelope raises ``ValueError``, which the OpenAI route answers with a 400, as /generate does).
    Returns whether an envelope was carried."""
    if not isinstance(body, Mapping):
        return False
    value = body.get("kv_hints")
    if not value or getattr(adapted_request, "kv_hints", None) is not None:
        return False
    from sglang.srt.managers.kv_hints import decode_kv_hints_envelope

    adapted_request.kv_hints = decode_kv_hints_envelope(value)
    return True


@functools.cache
def kv_hints_supported() -> bool:
    """Whether the installed sglang carries ``kv_hints`` to the scheduler (0.5.21+: the module
    exists). On 0.5.16 the field does not exist, sglang drops it from a request, and no response
    carries a toolkv outcome. Cached: ``kv_meta`` reports it on every call."""
    try:
        import sglang.srt.managers.kv_hints  # noqa: F401
    except ImportError:
        return False
    return True
