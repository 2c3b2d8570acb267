"""Prometheus metrics of one scheduler rank, served by sglang's own ``/metrics``.

sglang runs prometheus_client in multiprocess mode under ``--enable-metrics``: the launcher sets
``PROMETHEUS_MULTIPROC_DIR`` before it spawns the scheduler processes (engine.py:1297), every
process writes its samples there, and the HTTP process serves them all through a
``MultiProcessCollector`` mounted at ``/metrics`` (utils/common.py:2303). Collectors created here,
in a scheduler process, land in the same directory, so toolkv needs no route and no port of its
own. Like sglang's scheduler collector (metrics_collector.py:1042-1092) the labels are
``model_name`` and ``tp_rank``, gauges use ``multiprocess_mode="mostrecent"``, and only the ranks
sglang itself reports from (attention-TP rank 0, or all with
``--enable-metrics-for-all-schedulers``) emit: every TP rank holds the same sessions.

prometheus_client is imported inside the constructor, never at module import: it picks its
value store when first imported, and must not do so before ``PROMETHEUS_MULTIPROC_DIR`` is set.

Names (documented in docs/operations.md, "Metrics"):

* ``toolkv:sessions{state}`` gauge: tracked sessions by lifecycle state, one sample per phase of
  ``toolkv.core.lifecycle.SESSION_STATES`` (0 when no session is in it)
* ``toolkv:protected_tokens`` gauge: tokens toolkv holds now (protected host copies; pinned or
  shadowed tokens on a plain RadixCache)
* ``toolkv:host_used_tokens``, ``toolkv:host_total_tokens`` gauges: HiCache's host pool
* ``toolkv:device_free_tokens``, ``toolkv:device_evictable_tokens``, ``toolkv:device_locked_tokens``
* ``toolkv:draining`` gauge: 1 while the server drains (``POST /session/drain``), else 0
* ``toolkv:decisions_total{op,outcome}`` counter: every control decision; ``outcome`` is ``ok``,
  a refusal code (``host_memory_full``, ``stale_epoch``, ...) or ``skip:<reason>``
* ``toolkv:events_total{event}`` counter: the manager's lifetime events (turns, expired, lost, ...)
* ``toolkv:tokens_total{kind}`` counter: offloaded / freed / restored tokens
* ``toolkv:kv_recomputed_after_evict_tokens_total{requester}`` counter: prompt tokens recomputed
  whose KV the cache held earlier (upstream sglang's ``kv_recomputed_after_evict_tokens_total``),
  ``requester`` ``session`` (requests with a session id) or ``other``; see :mod:`toolkv.sglang.ghost`
* ``toolkv:offload_seconds``, ``toolkv:restore_seconds`` histograms: tool_start until the GPU copy
  is freed, tool_end until the session is runnable
* ``toolkv:offload_bytes``, ``toolkv:restore_bytes`` histograms: KV bytes per offload / restore

Every series above exists from the moment the collectors are built, at 0 (for the labelled
families: the label values listed in :data:`EVENTS`, :data:`TOKEN_KINDS` and
:data:`DECISION_SERIES`). prometheus_client creates a labelled series only when its label values
are first used, so without this a counter appeared only at its first increment: a dashboard showed
"no data" instead of 0, an alert on ``rate()`` or ``increase()`` could not see the first event
(its series starts above zero), and an alert on a missing series could not tell "never happened"
from "not exported".
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from toolkv.core.lifecycle import SESSION_STATES
from toolkv.core.requests import REQUESTS
from toolkv.sglang.ghost import REQUESTERS

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
BYTES_BUCKETS = tuple(float(2**k) for k in range(16, 38, 2))  # 64 KiB .. 128 GiB
GAUGES = (
    "protected_tokens",
    "host_used_tokens",
    "host_total_tokens",
    "device_free_tokens",
    "device_evictable_tokens",
    "device_locked_tokens",
    "draining",
)
# The manager's lifetime counters (``ToolKVManager.counters``) exported as ``events_total{event}``,
# and the ``*_tokens`` ones as ``tokens_total{kind}``: created at 0 at start-up. A counter not listed
# here is still exported at its first increment (tests/test_metrics_states.py checks that every
# counter the code names is listed). The per-call policy's ``decision_*``/``reason_*`` counters are
# named at run time and appear when first counted.
EVENTS: tuple[str, ...] = (
    "turns", "tool_start", "tool_end", "expired", "lost", "closed", "stale_epoch", "kv_lost",
    "restore_deferred", "restore_below_threshold", "reset_mid_copy", "forgotten", "handover", "admitted",
    "admitted_parked", "parked", "unpinned_parked", "unpinned_runnable", "kept", "let_go", "demoted",
    "demoted_l3", "prefetched", "prefetch_deferred", "tool_end_l3", "l3_from_host", "l3_prefetch",
    "l3_prefetch_refused", "l3_prefetch_short", "l3_restored", "l3_store", "l3_store_refused",
    "l3_store_short", "l3_store_l3_early", "l3_store_host_room", "l3_readahead", "tool_end_l3_arrival",
    "offload_room_refused", "tool_end_adopted", "drain_let_go", "drain_closed", "l3_store_pin_cap",
)  # fmt: skip
TOKEN_KINDS: tuple[str, ...] = ("offloaded", "freed", "left", "restored", "l3_stored")
# decisions_total{op,outcome} created at 0: every decision's acceptance, and the refusals the shipped
# alert rules and the drain's dashboard panel read.
DECISION_OPS = (
    *(op for op, kind in REQUESTS.items() if kind.decides),  # the requests that decide, then the ticks'
    "restore_on_request",
    "ttl_sweep",
    "tree_reset",
)
DECISION_SERIES: tuple[tuple[str, str], ...] = (
    *((op, "ok") for op in DECISION_OPS),
    ("tool_start", "host_memory_full"),
    ("auto_offload", "skip:host_memory_full"),
    ("tool_start", "draining"),
    ("auto_offload", "skip:draining"),
)
# Every phase of the lifecycle table, read from it (a phase added there is exported at once).
STATES: tuple[str, ...] = SESSION_STATES


class ToolKVMetrics:
    """The collectors, and the calls :class:`~toolkv.sglang.scheduler_side.SchedulerToolKV` makes."""

    def __init__(self, labels: Mapping[str, str], *, registry: Any = None, refresh_s: float = 1.0) -> None:
        from prometheus_client import REGISTRY, Counter, Gauge, Histogram

        reg = REGISTRY if registry is None else registry
        self.labels = {k: str(v) for k, v in labels.items()}
        names = list(self.labels)
        self.refresh_s = refresh_s
        self._next_refresh = 0.0
        self._seen_counters: dict[str, int] = {}
        # every state label ever set: a count that falls to zero must be set to 0, not left behind
        self._seen_states: set[str] = set(STATES)

        def gauge(name: str, doc: str, extra: tuple[str, ...] = ()) -> Any:
            return Gauge(
                f"toolkv:{name}", doc, [*names, *extra], registry=reg, multiprocess_mode="mostrecent"
            )

        self.sessions = gauge("sessions", "Sessions toolkv tracks, by lifecycle state", ("state",))
        self.gauges = {
            "protected_tokens": gauge("protected_tokens", "Tokens toolkv holds now (host copies or pins)"),
            "host_used_tokens": gauge("host_used_tokens", "HiCache host pool tokens in use"),
            "host_total_tokens": gauge("host_total_tokens", "HiCache host pool size in tokens"),
            "device_free_tokens": gauge("device_free_tokens", "Free device KV tokens"),
            "device_evictable_tokens": gauge("device_evictable_tokens", "Evictable device KV tokens"),
            "device_locked_tokens": gauge("device_locked_tokens", "Locked (in use) device KV tokens"),
            "draining": gauge("draining", "1 while the server drains (new tool calls refused), else 0"),
        }
        self.decisions = Counter(
            "toolkv:decisions",
            "Control decisions by operation and outcome",
            [*names, "op", "outcome"],
            registry=reg,
        )
        self.events = Counter("toolkv:events", "Manager lifetime events", [*names, "event"], registry=reg)
        self.tokens = Counter("toolkv:tokens", "Tokens moved, by kind", [*names, "kind"], registry=reg)
        self.recomputed = Counter(
            "toolkv:kv_recomputed_after_evict_tokens",
            "Prompt tokens recomputed whose KV the cache held earlier (evicted), by requester",
            [*names, "requester"],
            registry=reg,
        )
        self._seen_recomputed: dict[str, int] = {}
        self.latency = {
            kind: Histogram(
                f"toolkv:{kind}_seconds",
                f"{kind}: from the call until the {'GPU copy is freed' if kind == 'offload' else 'session is runnable'}",
                names,
                registry=reg,
                buckets=LATENCY_BUCKETS,
            )
            for kind in ("offload", "restore")
        }
        self.nbytes = {
            kind: Histogram(
                f"toolkv:{kind}_bytes", f"KV bytes per {kind}", names, registry=reg, buckets=BYTES_BUCKETS
            )
            for kind in ("offload", "restore")
        }
        self._create_series()

    def _create_series(self) -> None:
        """Every series at 0 from the start (see the module docstring for why)."""
        for state in STATES:
            self.sessions.labels(**self.labels, state=state).set(0)
        for g in self.gauges.values():
            g.labels(**self.labels).set(0)
        for op, outcome in DECISION_SERIES:
            self.decisions.labels(**self.labels, op=op, outcome=outcome)
        for event in EVENTS:
            self.events.labels(**self.labels, event=event)
        for kind in TOKEN_KINDS:
            self.tokens.labels(**self.labels, kind=kind)
        for requester in REQUESTERS:
            self.recomputed.labels(**self.labels, requester=requester)
        for family in (*self.latency.values(), *self.nbytes.values()):
            family.labels(**self.labels)

    # ---- events ----------------------------------------------------------------------------------------
    def decision(self, op: str, outcome: str) -> None:
        self.decisions.labels(**self.labels, op=op, outcome=outcome).inc()

    def completed(self, kind: str, seconds: float, nbytes: int | None) -> None:
        self.latency[kind].labels(**self.labels).observe(seconds)
        if nbytes is not None:
            self.nbytes[kind].labels(**self.labels).observe(nbytes)

    # ---- periodic --------------------------------------------------------------------------------------
    def due(self) -> bool:
        """At most one refresh per ``refresh_s`` (local time: metrics are never agreed across ranks
        and never decide anything)."""
        return time.monotonic() >= self._next_refresh

    def refresh(self, meta: Mapping[str, Any]) -> None:
        """Set the gauges and advance the counters from a server-wide ``kv_meta``."""
        self._next_refresh = time.monotonic() + self.refresh_s
        states: Mapping[str, int] = meta.get("states", {})
        # kv_meta counts only the phases some session is in now: every other phase is 0
        self._seen_states.update(states)
        for state in sorted(self._seen_states):
            self.sessions.labels(**self.labels, state=state).set(int(states.get(state, 0)))
        held = sum(int(meta.get(k) or 0) for k in ("protected_tokens", "pinned_tokens", "host_tokens"))
        values = {"protected_tokens": held, "draining": int(bool(meta.get("draining")))}
        if meta.get("host_total_tokens") is not None:
            values["host_total_tokens"] = int(meta["host_total_tokens"])
            values["host_used_tokens"] = int(meta["host_total_tokens"]) - int(
                meta.get("host_free_tokens") or 0
            )
        for k in ("device_free_tokens", "device_evictable_tokens", "device_locked_tokens"):
            if meta.get(k) is not None:
                values[k] = int(meta[k])
        for k, v in values.items():
            self.gauges[k].labels(**self.labels).set(v)
        recomputed: Mapping[str, int] = meta.get("recomputed_after_evict_tokens", {})
        for requester, value in recomputed.items():
            delta = int(value) - self._seen_recomputed.get(requester, 0)
            if delta > 0:
                self._seen_recomputed[requester] = int(value)
                self.recomputed.labels(**self.labels, requester=requester).inc(delta)
        counters: Mapping[str, int] = meta.get("counters", {})
        for name, value in counters.items():
            delta = int(value) - self._seen_counters.get(name, 0)
            if delta <= 0:
                continue
            self._seen_counters[name] = int(value)
            if name.endswith("_tokens"):
                self.tokens.labels(**self.labels, kind=name[: -len("_tokens")]).inc(delta)
            else:
                self.events.labels(**self.labels, event=name).inc(delta)
