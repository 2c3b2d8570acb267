"""Every ``TOOLKV_*`` setting, declared once: its name, type, default, bound and a one-line reason.

Everything else is derived from :data:`SETTINGS`: the plugin's environment parser and its refusal
messages (``toolkv.sglang.config.ToolKVConfig.from_env``), the defaults of the library's own
``ManagerConfig`` and ``PolicyConfig`` (so a test or an embedder gets the machine a server runs),
the settings table of docs/operations.md (``toolkv docs --settings``, checked by
tests/test_settings_doc.py), the OpenAPI text of ``GET /session/status``'s ``settings`` and what
``toolkv doctor`` prints. A new setting is a change in this file alone: its entry in
:data:`SETTINGS` and its field in its layer's dataclass (:class:`PluginSettings`,
:class:`ManagerSettings`, :class:`PolicySettings`), which the plugin's and the library's configs
are built from (tests/test_extensions.py shows it on a copy of the package). The call policies'
names (:data:`POLICY_NAMES`, :class:`PolicyName`) are the file names of ``toolkv/core/calls/``,
read off the folder: a new policy is its own file there, nothing here.

Standard library only (and :mod:`toolkv.argtypes`): the plugin entry point reads the environment
before toolkv's own dependencies are known to be installed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from toolkv.argtypes import Numeric, floats, ints

Layer = Literal["plugin", "manager", "policy"]


#: the default ``TOOLKV_POLICY`` (first in :data:`POLICY_NAMES`)
DEFAULT_POLICY = "offload"


def _policy_names(folder: Path) -> tuple[str, ...]:
    """The call policies' names: one module of ``toolkv/core/calls/`` a policy, named as it
    (``offload.py`` is ``offload``), read off the folder without importing it (the policies need
    toolkv's dependencies; this module must load without them). The default first, then by name."""
    names = [p.stem for p in folder.glob("*.py") if not p.stem.startswith("_")]
    assert DEFAULT_POLICY in names, f"no call policy {DEFAULT_POLICY!r} in {folder}"
    return tuple(sorted(names, key=lambda n: (n != DEFAULT_POLICY, n)))


#: every call policy's name, the one list of them (``TOOLKV_POLICY``, a call's ``policy``)
POLICY_NAMES: tuple[str, ...] = _policy_names(Path(__file__).with_name("calls"))

if TYPE_CHECKING:  # the members are the policies' files: a type checker sees the enum, not them

    class PolicyName(StrEnum):
        """The call policies a ``tool_start`` can run under: one member per name of
        :data:`POLICY_NAMES` (``PolicyName("auto")``)."""

else:
    PolicyName = StrEnum("PolicyName", {n.upper(): n for n in POLICY_NAMES}, module=__name__)


MIN_DURATION_S = 1e-3
"""Observations below this (including 0) are clamped to it: the log of a duration must be finite,
and sub-millisecond tool calls are indistinguishable for every decision made here."""

MAX_DURATION_S = 1e6
"""Observations and quantiles above this (~11.6 days) are clamped to it, so that one absurd sample
cannot push ``exp`` of a quantile out of the float range; nothing here distinguishes durations
that long."""

# TOOLKV_REPLY_TIMEOUT_S's floor: the HTTP side waits this long for the scheduler, which reads toolkv's
# requests between forward passes; below a second a long prefill chunk alone outlasts the wait.
MIN_REPLY_TIMEOUT_S = 1.0
# a duration that must be > 0 (TTLs: 0 would release at the next sweep)
POSITIVE_S = floats(0, lo_open=True)

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"", "0", "false", "no", "off"})


def parse_bool(env: Mapping[str, str], name: str, default: bool) -> bool:
    """``name`` as a switch (unset: ``default``); anything but the listed words is refused."""
    raw = env.get(name)
    if raw is None:
        return default
    v = raw.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise ValueError(f"{name}={raw!r}: expected one of 1/0, true/false, yes/no, on/off")


@dataclass(frozen=True)
class Setting:
    """One ``TOOLKV_*`` setting. ``field`` is its attribute on ``ToolKVConfig`` (and, by ``layer``,
    on ``ManagerConfig`` or ``PolicyConfig``); ``bound`` (numbers) or ``choices`` (names) is what
    the parser accepts and the refusal states; ``why`` is added to a refusal: what the refused
    value would do. ``reason`` is the one line the OpenAPI text and ``toolkv doctor`` show,
    ``doc`` the docs table's cell; ``shown`` the default as the table writes it (None: the value)."""

    field: str
    kind: type[bool] | type[int] | type[float] | type[str]
    default: bool | int | float | str | None
    reason: str
    layer: Layer
    doc: str
    bound: Numeric[Any] | None = None
    choices: tuple[str, ...] = ()
    header: bool = False  # an HTTP header name (toolkv.sglang.config checks it: credentials)
    why: str = ""
    shown: str | None = None

    @property
    def name(self) -> str:
        return f"TOOLKV_{self.field.upper()}"

    def accepts(self) -> str:
        """What the parser accepts, in words (the docs table's column)."""
        if self.kind is bool:
            return "1/0 (true/false, yes/no, on/off)"
        if self.choices:
            return " or ".join(f"`{c}`" for c in self.choices)
        if self.header:
            return "an HTTP header name"
        if self.bound is not None:
            unset = " (unset: none)" if self.default is None else ""
            return self.bound.describe() + unset
        return "text"

    def default_text(self) -> str:
        if self.shown is not None:
            return self.shown
        d = self.default
        if isinstance(d, bool):
            return "`1`" if d else "`0`"
        if isinstance(d, float):
            return f"`{d:g}`"
        return f"`{d}`"

    def parse(self, env: Mapping[str, str]) -> Any:
        """The value ``env`` gives (unset or empty: the default); a refusal is one line naming the
        variable, the value and what is accepted. A header name is ``toolkv.sglang.config``'s."""
        if self.kind is bool:
            assert isinstance(self.default, bool)
            return parse_bool(env, self.name, self.default)
        raw = env.get(self.name)
        if raw is None or not raw.strip():
            return self.default
        if self.choices:
            v = raw.strip().lower()
            if v not in self.choices:
                raise ValueError(f"{self.name}={v!r}: expected {' or '.join(repr(c) for c in self.choices)}")
            return v
        if self.bound is None:
            return raw
        try:
            return self.bound.parse(raw)
        except ValueError as e:
            raise ValueError(f"{self.name}={raw!r}: {e}{self.why}") from None


SETTINGS: tuple[Setting, ...] = (
    Setting(
        "enable",
        bool,
        False,
        "master switch: nothing is hooked unless set",
        layer="plugin",
        doc="master switch",
    ),
    Setting(
        "ttl_s",
        float,
        600.0,
        "protection lifetime without a tool_end",
        layer="manager",
        bound=POSITIVE_S,
        why=" (0 would release every protection at the next sweep, before any tool_end)",
        doc="how long a session stays protected after `tool_start` without a `tool_end`; when it runs out, the protection is released (state `Expired`). Once a `tool_end` is accepted the TTL no longer applies: the session is `Restoring` until its load is acknowledged. Must be > 0 (0 would release every protection at the next sweep)",
    ),
    Setting(
        "host_budget_tokens",
        int,
        None,
        "cap on the tokens toolkv keeps protected on host",
        layer="manager",
        bound=ints(1),
        why=" (0 would refuse every tool_start with 507; unset it for no budget)",
        shown="unlimited",
        doc="the most tokens toolkv may keep protected on host at once (a prefix shared by several sessions counts once); above it `tool_start` answers 507, or with `TOOLKV_POLICY=auto` demotes other offloaded sessions first. At least 1 (unset it for no budget); a budget above the host pool warns at start-up (§3)",
    ),
    Setting(
        "fallback",
        str,
        "pin",
        "the backend on a plain RadixCache",
        layer="plugin",
        choices=("pin", "shadow"),
        doc="backend used on a plain `RadixCache` (no `--enable-hierarchical-cache`): `pin` keeps the KV on the GPU and locks it; `shadow` copies it to host memory and removes it from the tree. Setting it explicitly also silences the start-up warning about running without HiCache",
    ),
    Setting(
        "zero_change",
        bool,
        False,
        'offload on finish_reason "tool_calls"',
        layer="plugin",
        doc='offload automatically when a chat turn ends with `finish_reason == "tool_calls"` (§6)',
    ),
    Setting(
        "restore_on_request",
        bool,
        True,
        "a session's next request restores it",
        layer="plugin",
        doc="when a new request arrives for an offloaded session, restore it at once (no `tool_end` needed)",
    ),
    Setting(
        "sweep_every",
        int,
        64,
        "scheduler iterations between clock agreements",
        layer="plugin",
        bound=ints(1),
        doc="scheduler iterations between agreements on the clock; TTL decisions can lag by this many iterations",
    ),
    Setting(
        "reply_timeout_s",
        float,
        30.0,
        "how long the HTTP side waits for the scheduler",
        layer="plugin",
        bound=floats(MIN_REPLY_TIMEOUT_S),
        why=" (seconds; the scheduler answers between forward passes, and one iteration with a long prefill chunk takes longer than a shorter wait, so every toolkv call would answer 504)",
        doc="how long the HTTP side waits for the scheduler before answering 504. At least 1: the scheduler reads toolkv's requests between forward passes, and one iteration with a long prefill chunk outlasts a shorter wait, so every call would answer 504",
    ),
    Setting(
        "closed_history",
        int,
        10000,
        "closed sessions kept for kv_meta",
        layer="manager",
        bound=ints(0),
        doc="how many closed sessions `kv_meta` still answers for (older ones get 404)",
    ),
    Setting(
        "policy",
        str,
        DEFAULT_POLICY,
        "offload (every tool_start) or auto (per call)",
        layer="manager",
        choices=POLICY_NAMES,
        doc="`offload`: every `tool_start` offloads; `auto`: per call keep on the GPU, offload (with an early restore) or let go, and demote instead of 507 when the host budget is reached ([policy](policy.md))",
    ),
    Setting(
        "prefetch",
        bool,
        True,
        "with policy auto, restore before the tool is expected back",
        layer="manager",
        doc="with `TOOLKV_POLICY=auto`: start restores before the tool is expected to return",
    ),
    Setting(
        "adaptive",
        bool,
        True,
        "a tool_end whose request would queue parks the session; hand-over pins yield to queued requests",
        layer="manager",
        doc="load-adaptive protection: a `tool_end` whose next request would wait (the device cannot take the restore's pin next to what running and queued requests need) answers 200 with state `Parked`: the host copy stays protected, nothing is loaded or pinned, and sglang's own load-back brings the KV in when the request is admitted; a restored session's pin (`Handover`) is given up when queued requests need the room. `0`: restore at every `tool_end` that fits the running requests, else 503, and pin until admission ([policy](policy.md#load-adaptive-protection))",
    ),
    Setting(
        "lazy_free",
        bool,
        True,
        "a finished offload leaves its GPU copy to sglang's eviction",
        layer="manager",
        doc="a finished offload leaves its GPU copy where it is, unlocked and backed up, for sglang's own eviction to take when it needs the room (the protected host copy stays); a session whose copy survives its tool call comes back with nothing to load. `0`: free the GPU copy as soon as the write is acknowledged. On a plain `RadixCache` (pin, shadow) the copy is always freed; on 0.5.23's Rust tree core it is always left to sglang ([policy](policy.md#leaving-the-gpu-copy-to-sglang))",
    ),
    Setting(
        "unmirror",
        bool,
        True,
        "a tool_start short of host room drops mirrors of KV running requests lock, not a 507",
        layer="manager",
        doc="a `tool_start` the host pool cannot take, even after sglang's `evict_host` freed what it may, drops the host *mirrors* of KV that running requests lock on the GPU (under `write_through` sglang writes every node it inserts to the host, so most of a full host is such mirrors) instead of answering 507: the GPU copy stays, and sglang writes the mirror again when the request finishes. Never a protected copy, a copy being written or read, or the session's own path. `HiRadixCache` under `write_through` and `write_through_selective`; not under `write_back` (there only eviction would write it again, in a blocking drain). `0`: 507 ([policy](policy.md#host-room-from-mirrors))",
    ),
    Setting(
        "restore_tokens_per_s",
        float,
        200000.0,
        "the restore rate assumed until one is measured",
        layer="manager",
        bound=floats(1),
        doc="the restore rate the policy assumes until it has measured one",
    ),
    Setting(
        "keep_ttl_s",
        float,
        30.0,
        "the longest a GPU pin (kept, or restored early) waits for tool_end",
        layer="manager",
        bound=POSITIVE_S,
        why=" (0 would drop every GPU pin, kept or restored early, at the next sweep, before its tool_end: TOOLKV_POLICY=auto and kv_hints retain would keep nothing)",
        doc="the longest a GPU pin waiting for its `tool_end` lasts (a session kept by `TOOLKV_POLICY=auto` or a kv_hints `retain`, or restored early); never longer than `TOOLKV_TTL_S`; then the pin goes and the KV stays in the cache, unpinned (state `Expired`). Must be > 0 (0 would drop every such pin at the next sweep: `auto` and `retain` would keep nothing)",
    ),
    Setting(
        "handover_ttl_s",
        float,
        30.0,
        "the longest a restored session stays pinned waiting for its next request",
        layer="manager",
        bound=POSITIVE_S,
        why=" (0 would unpin a restored session at the next sweep, before sglang admits its next request, so the KV just brought back could be evicted unused)",
        doc="the longest a restored (or kept) session stays pinned after its `tool_end`, waiting for sglang to admit its next request (state `Handover`); then the pin goes and the KV stays in the cache, unpinned (never longer than `TOOLKV_TTL_S`). Must be > 0 (0 would unpin it at the next sweep, before the request is admitted, so the restored KV could be evicted unused)",
    ),
    Setting(
        "idle_ttl_s",
        float,
        3600.0,
        "a session holding nothing, with no turn or call for this long, is forgotten",
        layer="manager",
        bound=floats(1),
        doc="a session that holds nothing (no protection, no pin) and has had no turn or call for this long is forgotten, so that sessions that simply stop calling do not keep a record forever; at least 1",
    ),
    Setting(
        "l3",
        bool,
        True,
        "with an L3 tier, a full host stores an offloaded session to L3 instead of dropping it",
        layer="manager",
        doc="with sglang's L3 storage tier on (`--hicache-storage-backend file`, see \"An L3 tier\" below): a host that must make room stores an offloaded session to L3 instead of dropping it. `0`: drop, as without a storage backend (sglang's own write-through to L3 and its read at a request's arrival stay; in the twin, with long or named tools at 48 sessions, `0` kept more than `1`: [benchmarks](benchmarks.md#16-gb-host--l3-against-stock-sglang-with-a-64-gb-host-the-regime-maps-loads)). Without a storage backend it changes nothing",
    ),
    Setting(
        "l3_read_tokens_per_s",
        float,
        100000.0,
        "the L3 read rate the early restore of a session in L3 assumes",
        layer="manager",
        bound=floats(1),
        doc="the L3 read rate the early restore assumes for a session in L3: its restore starts that much sooner (tokens / rate seconds). A finite number >= 1",
    ),
    Setting(
        "l3_read_at_arrival",
        bool,
        True,
        "a session stored in L3 is read back by sglang at its next request's arrival, not by toolkv",
        layer="manager",
        doc="with an L3 tier: `1` makes a `tool_end` of a session stored whole in L3 read nothing itself: the session is demoted (`Released`, its copy stays in sglang's storage) and its next request's arrival read, sglang's own, brings it into whatever host room sglang's LRU makes; toolkv's reads ahead of a predicted return are off too. `0`: toolkv reads it back to the host at `tool_end` (and ahead of the predicted return for a session stored early), the behaviour `spec/storage/StorageTier.tla` models. In the twin `1` kept more with long and named tools ([benchmarks](benchmarks.md#16-gb-host--l3-against-stock-sglang-with-a-64-gb-host-the-regime-maps-loads))",
    ),
    Setting(
        "l3_pin_tokens",
        int,
        None,
        "cap on the tokens this server's puts keep soft-pinned in a shared Mooncake tier",
        layer="manager",
        bound=ints(1),
        why=" (0 would refuse every store to the tier; unset it for no cap)",
        shown="unlimited",
        doc="with a shared Mooncake tier: the most tokens this server's stores may keep soft-pinned in it at once (`spec/storage/SharedTier.tla`'s `PinBudget`; a page shared by several sessions counts once). Mooncake's master evicts no soft-pinned page, so pinned copies that fill the store make it refuse every later put; a store that would pass the cap is refused (counter `l3_store_pin_cap`) and the session keeps its host copy. The server cannot ask Mooncake's client for the tier's capacity, so there is no default: set it to the share of the tier you leave to toolkv divided by the servers sharing it, in tokens (bytes / KV bytes per token). At least 1; unset: no cap. Without Mooncake it changes nothing",
    ),
    Setting(
        "session_header",
        str,
        "",
        "an HTTP header whose value labels a request without a session_id",
        layer="plugin",
        header=True,
        shown="off",
        doc="an HTTP header (name, any letter case) whose value is the session of a request whose body has no `session_id`: `X-SMG-Routing-Key` behind sglang's router (see \"Behind sglang's router\" below). Off by default: a routing key is not necessarily a session id. A value that is not a header name, or a credential header, stops the launch: its value would be logged on every decision line and answered by `kv_meta` (`Authorization`, `Proxy-Authorization`, `Cookie`, `Set-Cookie`, `X-Api-Key`, `Api-Key`, and any name with `auth`, `token`, `secret`, `password`, `credential`, `api-key`, `cookie` or `signature` in it)",
    ),
    Setting(
        "prior_median_s",
        float,
        0.6,
        "an unseen tool's median duration",
        layer="policy",
        bound=floats(MIN_DURATION_S, MAX_DURATION_S),
        doc="with `TOOLKV_POLICY=auto`: the median duration the policy assumes for a tool it has not seen yet (seconds, log-normal prior; [policy](policy.md)). Between 0.001 and 1e6",
    ),
    Setting(
        "prior_sigma",
        float,
        1.5,
        "the prior's log-space spread (the heavy tail)",
        layer="policy",
        bound=floats(0, lo_open=True),
        doc="the log-space spread of that prior: the heavier the tail, the less an unseen tool is kept. > 0",
    ),
    Setting(
        "prior_weight",
        float,
        2.0,
        "observations the prior counts for",
        layer="policy",
        bound=floats(0, lo_open=True),
        doc="how many observations the prior counts for before a tool's own history outweighs it. > 0",
    ),
    Setting(
        "keep_max_s",
        float,
        2.0,
        "keep a call on the GPU only if expected shorter",
        layer="policy",
        bound=floats(0),
        doc="a call is kept on the GPU only if its expected duration (at `TOOLKV_KEEP_QUANTILE`) is at most this many seconds. >= 0",
    ),
    Setting(
        "keep_quantile",
        float,
        0.75,
        "the duration quantile the keep test uses",
        layer="policy",
        bound=floats(0, 1, lo_open=True, hi_open=True),
        doc="the duration quantile the keep test uses (a call that runs long wastes device token-seconds). Strictly between 0 and 1",
    ),
    Setting(
        "device_reserve",
        float,
        0.1,
        "the device pool share a keep must leave free",
        layer="policy",
        bound=floats(0, 1),
        doc="the keep rule: after pinning a session's KV, this share of the device pool must stay free once running requests got what they were promised and queued requests what they need; also the room an early restore may take. Between 0 and 1",
    ),
    Setting(
        "min_offload_tokens",
        int,
        256,
        "below it, let go rather than offload",
        layer="policy",
        bound=ints(0),
        doc="a session with less KV than this, which the host cannot take, is let go (recomputing it is cheaper than two copies). An integer >= 0",
    ),
    Setting(
        "prefetch_quantile",
        float,
        0.5,
        "when the early restore aims to finish",
        layer="policy",
        bound=floats(0, 1, lo_open=True, hi_open=True),
        doc="the duration quantile an early restore aims to finish by (with `TOOLKV_PREFETCH=1`). Strictly between 0 and 1",
    ),
    Setting(
        "prefetch_margin_s",
        float,
        0.05,
        "how much before that the early restore starts",
        layer="policy",
        bound=floats(0),
        doc="how many seconds before that the early restore starts. >= 0",
    ),
    Setting(
        "max_tools",
        int,
        4096,
        "tools whose duration statistics are kept (LRU)",
        layer="policy",
        bound=ints(1),
        doc="how many tool names' duration statistics are kept (the least recently seen go first). An integer >= 1",
    ),
    Setting(
        "l3_store_margin_s",
        float,
        10.0,
        "with L3, a session predicted away longer than its L3 round trip plus this is stored at once",
        layer="policy",
        bound=floats(0),
        doc="with an L3 tier (`TOOLKV_L3`, sglang's `--hicache-storage-backend`): an offloaded session predicted away longer than writing it to L3 and reading it back plus this margin is stored to L3 at the next tick (decision line `op=l3_store reason=l3_early`), its host copy then counts as host room, and it is read back to the host this margin plus its read time before its predicted return (`reason=l3_readahead`). A large value (`1e9`) stores only a full host's victims (`reason=host_room`). Seconds >= 0",
    ),
    Setting(
        "l3_write_tokens_per_s",
        float,
        100000.0,
        "the L3 write rate that horizon assumes",
        layer="policy",
        bound=floats(1),
        doc="the L3 write rate that horizon assumes (tokens per second). A finite number >= 1",
    ),
)

BY_FIELD: dict[str, Setting] = {s.field: s for s in SETTINGS}
assert len(BY_FIELD) == len(SETTINGS), "one declaration per setting"


def default(field_name: str) -> Any:
    """The declared default of ``field_name`` (what ToolKVConfig, ManagerConfig and PolicyConfig use)."""
    return BY_FIELD[field_name].default


def of_layer(layer: Layer) -> tuple[Setting, ...]:
    return tuple(s for s in SETTINGS if s.layer == layer)


def variables() -> frozenset[str]:
    """Every ``TOOLKV_*`` setting's name."""
    return frozenset(s.name for s in SETTINGS)


# ---- the fields that carry them, one dataclass per layer ------------------------------------------
# One field per setting of the layer, in SETTINGS' order, each defaulting to its declaration: the
# plugin's ToolKVConfig is all three layers, the library's ManagerConfig and PolicyConfig are their
# own layer's (plus what only the library has), so a new setting is its entry above and its field
# here, in this one file (_check_layers asserts the two agree when the module loads).
Fallback = Literal["pin", "shadow"]


@dataclass(frozen=True)
class PluginSettings:
    """The plugin's own settings: what attaches toolkv to a server and how it talks to it."""

    enable: bool = default("enable")
    fallback: Fallback = default("fallback")  # noqa: RUF009 (a str: immutable)
    zero_change: bool = default("zero_change")
    restore_on_request: bool = default("restore_on_request")
    sweep_every: int = default("sweep_every")
    reply_timeout_s: float = default("reply_timeout_s")
    session_header: str = default("session_header")


@dataclass(frozen=True)
class ManagerSettings:
    """The manager's settings: TTLs, budgets, the call policy and the mechanisms it may use."""

    ttl_s: float = default("ttl_s")
    host_budget_tokens: int | None = default("host_budget_tokens")
    closed_history: int = default("closed_history")
    policy: str = default("policy")
    prefetch: bool = default("prefetch")
    adaptive: bool = default("adaptive")
    lazy_free: bool = default("lazy_free")
    unmirror: bool = default("unmirror")
    restore_tokens_per_s: float = default("restore_tokens_per_s")
    keep_ttl_s: float = default("keep_ttl_s")
    handover_ttl_s: float = default("handover_ttl_s")
    idle_ttl_s: float = default("idle_ttl_s")
    l3: bool = default("l3")
    l3_read_tokens_per_s: float = default("l3_read_tokens_per_s")
    l3_read_at_arrival: bool = default("l3_read_at_arrival")
    l3_pin_tokens: int | None = default("l3_pin_tokens")


@dataclass(frozen=True)
class PolicySettings:
    """The per-call policy's knobs (``TOOLKV_POLICY=auto``)."""

    prior_median_s: float = default("prior_median_s")
    prior_sigma: float = default("prior_sigma")
    prior_weight: float = default("prior_weight")
    keep_max_s: float = default("keep_max_s")
    keep_quantile: float = default("keep_quantile")
    device_reserve: float = default("device_reserve")
    min_offload_tokens: int = default("min_offload_tokens")
    prefetch_quantile: float = default("prefetch_quantile")
    prefetch_margin_s: float = default("prefetch_margin_s")
    max_tools: int = default("max_tools")
    l3_store_margin_s: float = default("l3_store_margin_s")
    l3_write_tokens_per_s: float = default("l3_write_tokens_per_s")


def _check_layers() -> None:
    """Each layer's dataclass has exactly its declared settings, in their order: a setting
    declared without its field (or a field without its declaration) fails at import."""
    from dataclasses import fields

    layers: tuple[tuple[type, Layer], ...] = (
        (PluginSettings, "plugin"),
        (ManagerSettings, "manager"),
        (PolicySettings, "policy"),
    )
    for cls, layer in layers:
        got = [f.name for f in fields(cls)]
        want = [x.field for x in of_layer(layer)]
        if got != want:  # not an assert: ``python -O`` must not load a half-declared setting
            raise TypeError(f"{cls.__name__} fields {got} != the {layer} settings {want}")


_check_layers()


def table() -> str:
    """docs/operations.md's settings table, between its markers (``toolkv docs --settings``)."""
    lines = [BEGIN, "| variable | default | accepts | meaning |", "|---|---|---|---|"]
    lines += [f"| `{s.name}` | {s.default_text()} | {s.accepts()} | {s.doc} |" for s in SETTINGS]
    return "\n".join([*lines, END])


BEGIN = "<!-- BEGIN settings (generated: toolkv docs --settings, from toolkv/core/settings.py) -->"
END = "<!-- END settings -->"
