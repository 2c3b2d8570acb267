"""The manager bound to one scheduler rank: IPC handling, the tick, turn capture, zero-change.

Everything here runs on the scheduler thread, from sglang hooks that fire on every TP rank at the
same iteration with the same inputs (broadcast requests, finished requests of the same batch, the
iteration boundary). This class holds no sglang ``Scheduler`` reference: the plugin passes in the
tree, the agreement and the few scheduler facts it needs, so the whole class is unit-tested on
CPU over a real cache (``tests/test_plugin.py``, ``tests/test_tp.py``).
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from toolkv import __version__
from toolkv.core import requests
from toolkv.core.backends.base import Agreement, Backend, LocalAgreement
from toolkv.core.lifecycle import EXPIRING, HOLDING
from toolkv.core.manager import ToolKVManager, make_backend
from toolkv.core.phases import Phase
from toolkv.core.result import OPEN_CALL
from toolkv.core.treeops import Tree
from toolkv.errors import DeviceMemoryFull, Draining, ToolKVError, Unsupported
from toolkv.sglang.config import ToolKVConfig
from toolkv.sglang.ghost import EvictionGhost, block_size, computed_span, namespace
from toolkv.sglang.ipc import ToolKVReqInput, ToolKVReqOutput
from toolkv.sglang.kv_hints import kv_hints_supported
from toolkv.sglang.metrics import ToolKVMetrics
from toolkv.sglang.observe import DecisionLog
from toolkv.sglang.replay import replayed_tool_start
from toolkv.sglang.sizing import host_pool, kv_bytes_per_token
from toolkv.sglang.startup import (
    SUPPORTED,
    decode_offload_reasons,
    fallback_warnings,
    flag_reasons,
    installed_sglang_version,
)
from toolkv.sglang.tp import AgreedClock

log = logging.getLogger("toolkv")


# ---- configuration checks ---------------------------------------------------------------------------
def unsupported_reasons(server_args: Any, version: str | None = None) -> list[str]:
    """Server configurations toolkv refuses (readable in both the HTTP and scheduler processes).

    Each one breaks an assumption the design rests on: one tree per TP group fed by one broadcast
    request stream (pp, DP attention, attention CP), the session's KV living in the radix tree
    (streaming sessions), a single tokenizer-manager process that owns the routes and the reply
    registry (tokenizer workers), no foreign owner of session leaves (session radix cache on
    top of HiCache leaks host memory upstream), and a host tier that keeps KV (0.5.23's
    ``--hicache-host-memory-mode buffer_only`` makes host memory a staging buffer for a storage
    backend). Then the flags the sglang release (``version``, default: the installed one)
    needs, from :data:`toolkv.sglang.startup.SUPPORTED`.
    """

    def g(name: str, default: Any = None) -> Any:
        return getattr(server_args, name, default)

    out: list[str] = []
    if g("enable_streaming_session", False):
        out.append("streaming sessions (--enable-streaming-session) keep a turn's KV outside the radix tree")
    if (g("pp_size", 1) or 1) > 1:
        out.append("pipeline parallelism (--pp-size > 1)")
    if g("enable_dp_attention", False):
        out.append("DP attention (--enable-dp-attention)")
    if (g("attn_cp_size", 1) or 1) > 1:
        out.append("attention context parallelism (--attn-cp-size > 1)")
    if g("enable_session_radix_cache", False) and g("enable_hierarchical_cache", False):
        out.append("--enable-session-radix-cache together with --enable-hierarchical-cache")
    if (g("tokenizer_worker_num", 1) or 1) > 1:
        out.append("multiple tokenizer workers (--tokenizer-worker-num > 1)")
    if (g("dp_size", 1) or 1) > 1:
        out.append("data parallelism (--dp-size > 1): one scheduler reply per call is assumed")
    if g("disaggregation_mode", "null") not in (None, "null"):
        out.append("prefill/decode disaggregation")
    if g("use_ray", False):
        out.append("Ray launch mode (--use-ray): sglang's plugin hooks are not applied there")
    if g("hicache_host_memory_mode", "cache") == "buffer_only":
        out.append(
            "--hicache-host-memory-mode buffer_only: host memory only stages a storage backend's copies"
        )
    out += decode_offload_reasons(server_args)
    version = version or installed_sglang_version()
    if version in SUPPORTED:
        out += flag_reasons(version, server_args)
    return out


def check_server_args(server_args: Any) -> None:
    """Refuse what toolkv cannot serve; then, in the launching process only (the scheduler ranks
    run the same check and would repeat it), warn about what it serves in a degraded way."""
    reasons = unsupported_reasons(server_args)
    if reasons:
        raise Unsupported(
            "toolkv cannot run with this sglang configuration: "
            + "; ".join(reasons)
            + " (unset TOOLKV_ENABLE to serve without toolkv)",
            reasons=reasons,
        )
    import multiprocessing

    if multiprocessing.parent_process() is None:
        for line in fallback_warnings(installed_sglang_version(), server_args):
            log.warning(line)


def check_tree(tree: Any) -> None:
    """Only the tree classes whose internals toolkv was verified against are accepted — exactly,
    not subclasses: the C++ tree, LMCache/FlexKV and the streaming wrapper all store or evict KV
    differently. sglang 0.5.16: ``RadixCache`` and ``HiRadixCache``. sglang 0.5.23:
    ``UnifiedRadixCache`` with a host tier and the Python tree core (the unified backend's own
    check names the setting), not its LMCache/FlexKV subclasses."""
    from toolkv.core.backends.unified import check_tree as check_unified_tree
    from toolkv.core.backends.unified import is_unified_tree
    from toolkv.core.backends.unified_rust import check_rust_tree
    from toolkv.core.treeops import handle_tree

    if is_unified_tree(tree):  # 0.5.21+: hiradix_cache.py no longer exists there
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

        if type(tree) is not UnifiedRadixCache:
            raise Unsupported(
                f"toolkv supports UnifiedRadixCache, not {type(tree).__name__}"
                " (LMCache/FlexKV and other external caches keep KV outside the tree's host tier)",
                tree=type(tree).__name__,
            )
        if getattr(tree, "disable", False):
            raise Unsupported("the radix cache is disabled (--disable-radix-cache)")
        (check_rust_tree if handle_tree(tree) else check_unified_tree)(tree)
        if getattr(tree.tree_core, "is_eagle", False):
            raise Unsupported("EAGLE speculative decoding stores bigram keys; toolkv walks plain keys")
        return
    from sglang.srt.mem_cache.hiradix_cache import HiRadixCache
    from sglang.srt.mem_cache.radix_cache import RadixCache

    kind = type(tree)
    if kind not in (RadixCache, HiRadixCache):
        raise Unsupported(
            f"toolkv supports RadixCache and HiRadixCache, not {kind.__name__}"
            " (UnifiedRadixCache is used for hybrid/DSA models or with SGLANG_ENABLE_UNIFIED_RADIX_TREE)",
            tree=kind.__name__,
        )
    if getattr(tree, "disable", False):
        raise Unsupported("the radix cache is disabled (--disable-radix-cache)")
    if getattr(tree, "is_eagle", False):
        raise Unsupported("EAGLE speculative decoding stores bigram keys; toolkv walks plain keys")


def session_label(req: Any) -> str | None:
    """The session a finished request belongs to: the top-level ``session_id`` label (copied from
    ``GenerateReqInput.session_id``), else the id of its ``session_params`` session. Streaming
    sessions return None: their KV is not in the tree."""
    sid = getattr(req, "session_id", None)
    session = getattr(req, "session", None)
    if session is not None and getattr(session, "streaming", False):
        return None
    if sid is None and session is not None:
        sid = getattr(session, "session_id", None)
    return sid if isinstance(sid, str) and sid else None


# ---- zero-change decisions ------------------------------------------------------------------------------
def decide_on_tool_calls(state: str | None, *, zero_change: bool) -> str:
    """A chat turn of the session ended with finish_reason "tool_calls". Returns ``offload`` or
    the reason to skip. Skipping is never an error: the client did not ask for anything."""
    if not zero_change:
        return "skip:disabled"
    if state is None:
        return "skip:untracked"
    if state != Phase.RUNNING:
        return f"skip:{state}"
    return "offload"


def decide_on_request(state: str | None, *, restore_on_request: bool) -> str:
    """A new request of the session arrived. If its KV is away, the request itself is the tool's
    end: restore now instead of letting prefill reload it piecemeal (or recompute it)."""
    if not restore_on_request or state is None:
        return "none"
    if state in OPEN_CALL:
        return "restore"  # tool_end: load, unpin, take over the early restore, or just resume
    return "none"


# GET /session/status lists at most this many of the sessions that hold KV (declared with the
# request, toolkv.core.requests.StatusQuery)
STATUS_LIMIT_DEFAULT = requests.STATUS_LIMIT_DEFAULT
STATUS_LIMIT_MAX = requests.STATUS_LIMIT_MAX


CLIP_MAX_NEW_TOKENS = 4096  # sglang's schedule_policy clips a request's decode budget here


def promised_tokens(sched: Any) -> int:
    """Device tokens sglang counts on without having allocated them yet: the rest of the prompt
    of the request being prefilled in chunks (``add_chunked_req`` takes its next chunk even when
    the budget is exhausted) and the remaining decode tokens of the running batch (clipped as the
    prefill adder clips them). Deterministic across TP ranks: it reads only scheduler state."""
    total = 0
    ch = getattr(sched, "chunked_req", None)
    if ch is not None:
        fill = getattr(ch, "full_untruncated_fill_ids", None)
        if fill is None or len(fill) == 0:
            fill = getattr(ch, "fill_ids", None) or ()
        # 0.5.16 keeps the allocated prefix as ``prefix_indices``; 0.5.23 only its length,
        # ``prefix_len`` (schedule_batch.py:1220, advanced per chunk by checkpoint_kv_cache).
        prefix = getattr(ch, "prefix_indices", None)
        done = len(prefix) if prefix is not None else int(getattr(ch, "prefix_len", 0) or 0)
        total += max(0, len(fill) - done)
    batch = getattr(sched, "running_batch", None)
    for req in getattr(batch, "reqs", None) or ():
        params = getattr(req, "sampling_params", None)
        max_new = getattr(params, "max_new_tokens", None) or 0
        out = getattr(req, "output_ids", None)
        total += max(0, min(max_new - (0 if out is None else len(out)), CLIP_MAX_NEW_TOKENS))
    return total


def queued_tokens(sched: Any) -> int:
    """Device tokens the requests waiting for admission will need, at most: each one's prompt
    plus its (clipped) decode budget; their cached prefixes are not subtracted (an upper bound, so
    a keep errs on the side of leaving room). Deterministic across TP ranks."""
    total = 0
    for req in getattr(sched, "waiting_queue", None) or ():
        ids = getattr(req, "origin_input_ids", None) or ()
        params = getattr(req, "sampling_params", None)
        max_new = getattr(params, "max_new_tokens", None) or 0
        total += len(ids) + min(int(max_new), CLIP_MAX_NEW_TOKENS)
    return total


class SchedulerToolKV:
    """One rank's toolkv: the manager, its agreed clock, and the glue sglang's hooks call."""

    def __init__(
        self,
        tree: Tree,
        *,
        config: ToolKVConfig | None = None,
        agree: Agreement | None = None,
        backend: Backend | None = None,
        tp_size: int = 1,
        tp_rank: int = 0,
        clock: AgreedClock | None = None,
        metrics: ToolKVMetrics | None = None,
    ) -> None:
        self.config = config or ToolKVConfig()
        self.agree = agree or LocalAgreement()
        mcfg = self.config.manager_config()
        if backend is None:
            backend = make_backend(tree, config=mcfg, agree=self.agree, fallback=self.config.fallback)
        self.manager = ToolKVManager(tree, backend, config=mcfg, agree=self.agree)
        self.clock = clock or AgreedClock(self.agree, every=self.config.sweep_every)
        self.tp_size = tp_size
        self.tp_rank = tp_rank
        self.skipped: dict[str, int] = {}
        # the eviction-harm count (toolkv.sglang.ghost): fed by the turn-capture and admission hooks
        self.ghost = EvictionGhost(block_size(getattr(tree, "page_size", 1)))
        # The drain (POST /session/drain). Set and cleared only by a control request, which sglang
        # broadcasts to every TP rank like tool_start, so every rank holds the same flag at the
        # same iteration and refuses the same calls: no agreement (collective) is needed for it.
        self.draining = False
        self.drain_since: float | None = None  # agreed clock when the drain began
        self.drain_refused = 0  # tool calls refused since then
        self.decisions = DecisionLog(
            self.manager,
            tp_rank=tp_rank,
            metrics=metrics,
            bytes_per_token=kv_bytes_per_token(tree),
            snapshot=self.metrics,
        )
        # a session demoted inside another session's tool_start (host room) gets its own line
        self.manager.on_demote = lambda sid: self.decisions.decided("demote", sid, None, "ok", "host_room")
        # and a session stored to L3 (or read back from it ahead of its return) by the manager's
        # own choice: op=l3_store reason=l3_early|host_room|l3_readahead, the session's l3= after it
        self.manager.machine.on_store = lambda sid, why: self.decisions.decided(
            "l3_store", sid, None, "ok", why
        )
        # the handler of each request type: the one dispatch (every type of REQUESTS has one)
        self._handlers: dict[type[requests.Request], Callable[[Any], dict[str, Any]]] = {
            requests.ToolStart: self._tool_start,
            requests.ToolEnd: lambda r: _jsonable(self.manager.tool_end(r.session_id, r.epoch)),
            requests.KvMetaQuery: self._kv_meta,
            requests.Close: lambda r: _jsonable(self.manager.close(r.session_id)),
            requests.AutoOffload: lambda r: self.on_tool_calls(r.session_id, r.tool),
            requests.Handshake: lambda r: self.status(),
            requests.StatusQuery: lambda r: self.server_status(r.limit),
            requests.Drain: lambda r: self.set_drain(r.drain),
        }
        assert set(self._handlers) == set(requests.REQUESTS.values()), "a handler per request type"
        # Agree on the clock before the first handler can arm a deadline: the manager starts at
        # t=0, and a deadline armed then would expire on the first real reading. Every rank
        # builds its instance in Scheduler.__init__, so this first reduction is unconditional.
        self.tick()

    @property
    def tree(self) -> Tree:
        return self.manager.tree

    def bind_scheduler(self, sched: Any) -> None:
        """Restores must leave free the device tokens sglang has promised (see
        :func:`promised_tokens`); backends without that notion ignore it."""
        if hasattr(self.manager.backend, "headroom"):
            self.manager.backend.headroom = lambda: promised_tokens(sched)
        self.manager.queued_demand = lambda: queued_tokens(sched)

    def bind_schedule_stream(self, stream: Any) -> None:
        """sglang creates ``schedule_stream`` in ``run_event_loop``, after ``__init__``; the
        HiRadix backend orders forwards after its restores on it."""
        if stream is not None and getattr(self.manager.backend, "schedule_stream", stream) is None:
            self.manager.backend.schedule_stream = stream  # type: ignore[attr-defined]

    # ---- per iteration ------------------------------------------------------------------------------
    def tick(self) -> None:
        """Once per scheduler iteration on every rank. The clock reduction inside is
        unconditional (every ``sweep_every`` ticks on every rank), so ranks never disagree on
        whether a collective happens."""
        self.manager.tick(self.clock.tick())
        self.decisions.after_tick()

    # ---- IPC ----------------------------------------------------------------------------------------
    def handle(self, op: str, body: Mapping[str, Any]) -> tuple[int, dict[str, Any]]:
        """Run one control operation given as its name and JSON body (the in-process callers: the
        twin, ``kv_hints``, the tests): the request is built, so checked, here. Returns (http
        status, JSON body), as :meth:`answer`."""
        try:
            req = requests.parse(op, body)
        except ToolKVError as e:
            sid = body.get("session_id") if isinstance(body, Mapping) else None
            asked = body.get("epoch") if isinstance(body, Mapping) else None
            return self._refused(op, sid if isinstance(sid, str) else None, asked, e)
        return self.answer(req)

    def answer(self, req: requests.Request) -> tuple[int, dict[str, Any]]:
        """Run one request through its handler (``_handlers``, by type). Typed errors become
        their status; anything else is a 500 whose message names the exception (and is logged).
        Every call that can change something is one decision line (see
        :mod:`toolkv.sglang.observe`)."""
        sid = getattr(req, "session_id", None)
        asked = req.epoch if isinstance(req, requests.ToolEnd) else None
        try:
            out = self._handlers[type(req)](req)
        except ToolKVError as e:
            return self._refused(req.op, sid, asked, e)
        except Exception as e:  # never take the scheduler loop down for a control call
            log.exception("toolkv op %s failed", req.op)
            if req.decides:
                self.decisions.decided(req.op, sid, None, "refused", "internal", self._asked(req.op, asked))
            return 500, {"error": "internal", "message": f"{type(e).__name__}: {e}"}
        if req.decides:
            skipped = out.get("skipped")
            extra = self._asked(req.op, asked)
            if isinstance(skipped, str):
                self.decisions.decided(req.op, sid, None, "skipped", skipped, extra)
            else:
                self.decisions.decided(req.op, sid, out, "ok", "", extra)
        return 200, out

    @staticmethod
    def _asked(op: str, epoch: object) -> dict[str, Any] | None:
        """A tool_end's decision line carries the epoch the call asked for."""
        return {"asked": epoch} if op == requests.ToolEnd.op else None

    def _refused(self, op: str, sid: str | None, asked: object, e: ToolKVError) -> tuple[int, dict[str, Any]]:
        if op in requests.DECIDING:
            self.decisions.decided(op, sid, None, "refused", e.code, self._asked(op, asked))
        return e.http_status, _jsonable(e.to_dict())

    def _tool_start(self, req: requests.ToolStart) -> dict[str, Any]:
        # a re-sent tool_start already applied: its record, unchanged (logged as skipped)
        replay = replayed_tool_start(self.manager, req.session_id, req.prior_epoch)
        if replay is not None:
            return _jsonable(replay)
        self._refuse_while_draining(req.session_id)
        return _jsonable(self.manager.start(req))

    def _kv_meta(self, req: requests.KvMetaQuery) -> dict[str, Any]:
        if req.session_id is None:
            return self.metrics()
        return _jsonable(self.manager.kv_meta(req.session_id))

    def ipc_handler(self, req: ToolKVReqInput) -> ToolKVReqOutput:
        """What the scheduler's ``_request_dispatcher`` calls for a :class:`ToolKVReqInput`; the
        returned output is sent to the tokenizer manager by ``process_input_requests`` (rank 0).
        The request was built, so checked, by the HTTP side: it is rebuilt, not checked again."""
        body = req.body if isinstance(req.body, Mapping) else {}
        try:
            request = requests.from_wire(req.op, body)
        except ToolKVError as e:
            status, out = self._refused(req.op, None, None, e)
        else:
            status, out = self.answer(request)
        return ToolKVReqOutput(rid=req.rid, ok=status == 200, status=status, body=out)

    def status(self) -> dict[str, Any]:
        """What the HTTP side checks before its first call (handshake via get_internal_state)."""
        return {
            "version": __version__,
            "backend": self.manager.backend.name,
            "tp_size": self.tp_size,
            "tp_rank": self.tp_rank,
            "zero_change": self.config.zero_change,
            "kv_hints": kv_hints_supported(),  # sglang 0.5.21+ carries kv_hints (toolkv.sglang.kv_hints)
        }

    # ---- the drain and the operator's status read -------------------------------------------------
    def _refuse_while_draining(self, sid: str) -> None:
        """A new tool call while draining: refused before anything changes (validate, then act)."""
        if not self.draining:
            return
        self.drain_refused += 1
        held = self._held_sessions()
        raise Draining(
            f"toolkv is draining: no new tool call is accepted (session {sid!r} stays where sglang "
            f'keeps it; {held} session(s) still hold KV). POST /session/drain {{"drain": false}} '
            "ends the drain",
            held_sessions=held,
        )

    def _held_sessions(self, states: Mapping[str, int] | None = None) -> int:
        """Sessions in a phase that holds KV (a host protection or a pin: spec ``Holding``)."""
        if states is None:
            states = Counter(r.state for r in self.manager.sessions.values())
        return sum(n for state, n in states.items() if state in HOLDING)

    def _held_tokens(self) -> int:
        """Tokens toolkv holds now, whatever the backend calls them (the gauge's sum)."""
        b: Any = self.manager.backend
        return sum(
            int(getattr(b, a)) for a in ("protected_tokens", "pinned_tokens", "host_tokens") if hasattr(b, a)
        )

    def set_drain(self, on: bool) -> dict[str, Any]:
        """Start (``on``) or end the drain; idempotent. While draining, ``tool_start`` (and the
        zero-change and ``kv_hints`` offloads) is refused with 503 ``draining``; every call already
        in flight (offloading, offloaded, restoring, parked, handed over, kept) finishes or expires
        by its TTL as usual. Returns :meth:`drain_status`."""
        if on and not self.draining:
            self.draining, self.drain_since, self.drain_refused = True, self.manager.now, 0
            log.log(
                self.decisions.level, "toolkv drain started: new tool calls are refused rank=%d", self.tp_rank
            )
        elif not on and self.draining:
            self.draining, self.drain_since = False, None
            log.log(
                self.decisions.level,
                "toolkv drain ended: tool calls are accepted again rank=%d",
                self.tp_rank,
            )
        return self.drain_status()

    def drain_status(self) -> dict[str, Any]:
        """What an operator polls during a drain: ``drained`` once no session holds KV and toolkv
        holds no token, i.e. toolkv can be switched off (or sglang upgraded) without cutting a
        tool call off. Read from the agreed state (the TTL sweep runs on the agreed clock)."""
        states = Counter(r.state for r in self.manager.sessions.values())
        held, tokens = self._held_sessions(states), self._held_tokens()
        return _jsonable(
            {
                "draining": self.draining,
                "drained": self.draining and held == 0 and tokens == 0,
                "drain_since": self.drain_since,
                "drain_refused": self.drain_refused,
                "held_sessions": held,
                "held_tokens": tokens,
                "states": dict(states),
                "now": self.manager.now,
            }
        )

    def server_status(self, limit: int = STATUS_LIMIT_DEFAULT) -> dict[str, Any]:
        """``GET /session/status`` (``toolkv doctor``): the server-wide ``kv_meta`` plus what an
        operator needs at a terminal: the sglang release, every setting in force, the drain, and
        the sessions that hold KV with the time left on their TTL (soonest first, at most
        ``limit``). Every rank computes it (the request is broadcast); rank 0's answer is sent.
        The TTL left is read on the agreed clock, the one the sweep decides on."""
        m = self.manager
        out = self.metrics()
        out.update(self.drain_status())
        out["sglang"] = installed_sglang_version()
        out["settings"] = _jsonable(self.config.describe())
        held = [r for r in m.sessions.values() if r.state in HOLDING]
        held.sort(key=lambda r: (r.deadline if r.state in EXPIRING else math.inf, r.session_id))
        listed = []
        for rec in held[:limit]:
            meta = _jsonable(m.kv_meta(rec.session_id))
            deadline = meta.get("deadline")
            meta["ttl_left_s"] = None if deadline is None else round(max(0.0, deadline - m.now), 3)
            listed.append(meta)
        out["held"] = listed
        return out

    def metrics(self) -> dict[str, Any]:
        """Server-wide kv_meta: lifecycle counts, counters, and the memory toolkv holds."""
        m = self.manager
        out: dict[str, Any] = dict(m.kv_meta())
        out.update(
            version=__version__,
            tp_size=self.tp_size,
            tp_rank=self.tp_rank,
            ttl_s=self.config.ttl_s,
            host_budget_tokens=self.config.host_budget_tokens,
            zero_change=self.config.zero_change,
            kv_hints=kv_hints_supported(),
            skipped=dict(self.skipped),
            draining=self.draining,
            # whether a finished offload leaves its GPU copy to sglang's eviction (the plugin's
            # default where the backend can) or frees it at the ack
            lazy_free=bool(self.config.lazy_free and m.caps.lazy_free is not None),
            # tokens recomputed whose KV the cache held earlier, by requester (toolkv.sglang.ghost)
            recomputed_after_evict_tokens=dict(self.ghost.recomputed),
            ghost_blocks=len(self.ghost),
        )
        out["held_sessions"] = self._held_sessions(out.get("states"))
        b: Any = m.backend
        for attr in ("protected_tokens", "pinned_tokens", "host_tokens"):
            if hasattr(b, attr):
                out[attr] = int(getattr(b, attr))
        tree = m.tree
        if hasattr(tree, "tree_core"):  # sglang 0.5.21+: which radix tree core the server runs
            from toolkv.core.treeops import handle_tree

            out["tree_core"] = "rust" if handle_tree(tree) else "python"
        alloc = getattr(tree, "token_to_kv_pool_allocator", None)
        if alloc is not None:
            out["device_free_tokens"] = int(alloc.available_size())
            # sglang's own idle invariant: free + evictable + locked == pool size; "locked" must
            # fall back to zero once no request runs and toolkv holds nothing (pin backend).
            out["device_evictable_tokens"] = int(tree.evictable_size())
            out["device_locked_tokens"] = int(tree.protected_size())
        host = host_pool(tree)
        if host is not None:
            out["host_free_tokens"] = int(host.available_size())
            out["host_total_tokens"] = int(host.size)
        return _jsonable(out)

    # ---- request lifecycle hooks --------------------------------------------------------------------
    def _state(self, sid: str) -> str | None:
        rec = self.manager.sessions.get(sid)
        return None if rec is None else rec.state

    def _skip(self, reason: str) -> dict[str, Any]:
        self.count_skip(reason)
        return {"skipped": reason}

    def count_skip(self, reason: str) -> None:
        """Something toolkv deliberately left alone (``kv_meta``'s ``skipped`` counts them): an
        operator sees why a session is not tracked without reading debug logs."""
        self.skipped[reason] = self.skipped.get(reason, 0) + 1

    def on_tool_calls(self, sid: str, tool: str | None = None) -> dict[str, Any]:
        """Zero-change: the turn ended in tool calls, offload like an explicit tool_start would
        (with ``TOOLKV_POLICY=auto``: decide per call, by the model's tool name)."""
        decision = decide_on_tool_calls(self._state(sid), zero_change=self.config.zero_change)
        if decision == "offload" and self.draining:
            self.drain_refused += 1
            decision = "skip:draining"
        if decision != "offload":
            return self._skip(decision)
        try:
            return _jsonable(self.manager.tool_start(sid, tool=tool))
        except ToolKVError as e:  # e.g. host_memory_full, kv_lost: the turn just stays on GPU
            return self._skip(f"skip:{e.code}")

    def on_request(self, sid: str | None) -> None:
        """A new generate request of ``sid`` arrived (the same broadcast request on every rank)."""
        if sid is None:
            return
        rec = self.manager.sessions.get(sid)
        if (
            decide_on_request(
                None if rec is None else rec.state, restore_on_request=self.config.restore_on_request
            )
            != "restore"
        ):
            return
        assert rec is not None
        if rec.l3_then == "tool_end":  # its tool_end was accepted: being read back from L3 already
            return
        try:
            meta = self.manager.tool_end(sid, rec.epoch)
        except DeviceMemoryFull:
            # Stays offloaded and protected; sglang's prefill reloads the path itself
            # (init_load_back) if it can, and on_finished settles the record afterwards.
            self.skipped["restore_deferred"] = self.skipped.get("restore_deferred", 0) + 1
            self.decisions.decided("restore_on_request", sid, None, "refused", DeviceMemoryFull.code)
            return
        self.decisions.decided("restore_on_request", sid, _jsonable(meta), "ok")

    def on_admitted(self, sid: str | None) -> None:
        """A request of ``sid`` was admitted into a prefill batch: sglang matched its prefix and
        locked it (the same batch on every rank). A hand-over ends here: the request's lock now
        keeps the KV on the GPU (spec ``Admit``)."""
        if sid is not None and self.manager.admit(sid):
            self.decisions.decided("admit", sid, None, "ok", "handover_ended")

    def on_batch(self, reqs: Sequence[Any]) -> None:
        """Every request of a newly formed prefill batch (``get_new_batch_prefill``'s result):
        its hand-over ends, and what it recomputes of evicted KV is counted (:meth:`on_computed`)."""
        for req in reqs:
            sid = session_label(req)
            self.on_computed(req, sid)
            self.on_admitted(sid)

    def on_computed(self, req: Any, sid: str | None) -> int:
        """Count the tokens ``req`` recomputes in this extend whose KV the cache held earlier
        (the ghost's blocks past its matched prefix), as ``session`` if it carries a session id,
        else ``other``. Returns the tokens counted."""
        span = computed_span(req)
        if span is None:
            return 0
        tokens, start = span
        return self.ghost.admitted(tokens, start, "session" if sid is not None else "other", namespace(req))

    def on_cached(self, tokens: Sequence[int], extra_key: Any) -> None:
        """The tree just inserted ``tokens`` for a request (session or not): the ghost learns
        its blocks."""
        self.ghost.cached(tokens, extra_key)

    def on_finished(self, sid: str, tokens: Sequence[int], extra_key: str | None) -> None:
        """A turn of ``sid`` finished and its KV was inserted (``cache_finished_req``)."""
        m = self.manager
        rec = m.sessions.get(sid)
        if rec is not None and rec.state in (Phase.HANDOVER, Phase.PARKED):  # ran without being seen admitted
            m.admit(sid)
        if rec is not None and rec.state in HOLDING:
            # The session ran a turn while toolkv still held its KV (a request without tool_end,
            # or a restore that was deferred). Settle first so the new turn can be recorded:
            # process acks (state is agreed: sglang's ack checks reduce across ranks), then end
            # the tool call; if that cannot happen now, close and re-open the record, keeping the
            # epoch so an old tool_end stays stale.
            m.tick(m.now)
            if rec.state in (Phase.OFFLOADING, Phase.OFFLOADED, Phase.KEPT, Phase.PREFETCHING):
                try:
                    m.tool_end(sid, rec.epoch)
                    m.tick(m.now)
                except ToolKVError:
                    pass
            if rec.state in HOLDING:
                epoch = rec.epoch
                m.close(sid)
                m.insert(sid, tokens, extra_key)
                m.sessions[sid].epoch = epoch
                self.skipped["reopened"] = self.skipped.get("reopened", 0) + 1
                self.decisions.decided("turn_while_protected", sid, None, "ok", "reopened")
                return
        m.insert(sid, tokens, extra_key)

    def on_tree_reset(self) -> None:
        self.ghost.reset()
        self.manager.tree_reset()


def _jsonable(d: Mapping[str, Any]) -> dict[str, Any]:
    """Manager results hold floats like ``inf`` (no deadline) that JSON cannot carry."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, float) and (v != v or v in (float("inf"), float("-inf"))):
            out[k] = None
        elif isinstance(v, Mapping):
            out[k] = _jsonable(v)
        else:
            out[k] = v
    return out
