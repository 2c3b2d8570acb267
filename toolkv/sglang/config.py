"""Plugin configuration from ``TOOLKV_*`` environment variables.

Environment variables, not sglang flags: sglang's argument parser is closed to plugins, and the
environment is the one thing every process sglang spawns inherits (the HTTP process, each
scheduler rank), so all of them see the same configuration without any plumbing.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any, Literal

from toolkv.argtypes import N, Numeric, floats, ints
from toolkv.errors import StartupRefused

if TYPE_CHECKING:  # imported lazily: the plugin entry point must load without toolkv's dependencies,
    # so that it can name the missing one instead of sglang's loader swallowing an ImportError
    from toolkv.core.manager import ManagerConfig
    from toolkv.core.policy import PolicyConfig

Fallback = Literal["pin", "shadow"]

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"", "0", "false", "no", "off"})


def _bool(env: Mapping[str, str], name: str, default: bool) -> bool:
    raw = env.get(name)
    if raw is None:
        return default
    v = raw.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise ValueError(f"{name}={raw!r}: expected one of 1/0, true/false, yes/no, on/off")


def _number(env: Mapping[str, str], name: str, default: N, bound: Numeric[N], *, why: str = "") -> N:
    """``name`` within ``bound`` (unset or empty: ``default``). The refusal states the bound the
    check applies, both made from ``bound``; ``why`` says what a refused value would do, so that the
    operator reading the refusal learns why the bound is there, not only where it is."""
    raw = env.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        return bound.parse(raw)
    except ValueError as e:
        raise ValueError(f"{name}={raw!r}: {e}{why}") from None


def _float(env: Mapping[str, str], name: str, default: float, bound: Numeric[float], why: str = "") -> float:
    return _number(env, name, default, bound, why=why)


def _int(
    env: Mapping[str, str], name: str, default: int | None, bound: Numeric[int], why: str = ""
) -> int | None:
    raw = env.get(name)
    if raw is None or not raw.strip():
        return default
    return _number(env, name, 0, bound, why=why)


# RFC 9110's ``token``: the characters an HTTP header name may have
_HEADER_CHARS = frozenset("!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
# Headers that carry credentials: a session id is logged and answered by kv_meta, a credential must not
# be. The names in use (RFC 9110's, cookies, API gateways' and clouds' key headers) ...
_SECRET_HEADERS = frozenset(
    {
        "authorization",
        "proxy-authorization",
        "cookie",
        "set-cookie",
        "x-api-key",
        "api-key",
        "x-goog-api-key",
        "ocp-apim-subscription-key",
    }
)
# ... and, since every gateway invents its own (X-Auth-Token, X-OpenAI-Api-Key, X-Amz-Security-Token),
# any name with one of these words in it. A routing key that happens to match can be renamed; a
# credential that becomes a session id is written to the log on every decision line.
_SECRET_WORDS = (
    "auth",
    "cookie",
    "token",
    "secret",
    "password",
    "passwd",
    "credential",
    "api-key",
    "api_key",
    "apikey",
    "access-key",
    "private-key",
    "signature",
)


def credential_header(name: str) -> bool:
    """Whether the header ``name`` (any letter case) carries a credential (see ``_SECRET_WORDS``)."""
    v = name.strip().lower()
    return v in _SECRET_HEADERS or any(w in v for w in _SECRET_WORDS)


def _header(env: Mapping[str, str], name: str) -> str:
    """An HTTP header name, lower-cased (header names are case-insensitive, and sglang's ASGI
    server hands them over lower-cased); ``""`` when unset or empty.

    Refused: anything that is not a header name (``X-SMG-Routing-Key: abc``, a name with a space),
    which would never match a header and silently label nothing, and the credential headers
    (:func:`credential_header`: ``Authorization``, ``Cookie``, ``X-Api-Key``, ...), whose value would
    become a session id that is logged and that ``kv_meta`` answers for."""
    raw = env.get(name)
    if raw is None or not raw.strip():
        return ""
    v = raw.strip()
    if not set(v) <= _HEADER_CHARS:
        raise ValueError(
            f"{name}={raw!r}: expected an HTTP header name (letters, digits and !#$%&'*+-.^_`|~), "
            "e.g. X-SMG-Routing-Key"
        )
    if credential_header(v):
        raise ValueError(
            f"{name}={raw!r}: a credential header cannot be a session id (its value would be written to the "
            "log on every decision line and answered by kv_meta); name the header that carries the session, "
            "e.g. X-SMG-Routing-Key"
        )
    return v.lower()


# TOOLKV_REPLY_TIMEOUT_S's floor: the HTTP side waits this long for the scheduler, which reads toolkv's
# requests between forward passes; below a second a long prefill chunk alone outlasts the wait.
MIN_REPLY_TIMEOUT_S = 1.0
# a duration that must be > 0 (TTLs: 0 would release at the next sweep)
POSITIVE_S = floats(0, lo_open=True)

# ``TOOLKV_*`` names that are not server settings: the test suite's and the tools' own knobs. A
# server launched from a developer's shell may carry them; they are neither read here nor refused.
TOOLING_VARIABLES = frozenset(
    {
        "TOOLKV_DEBUG",
        "TOOLKV_SPEC_DIR",
        "TOOLKV_TLA_JAR",
        "TOOLKV_JAVA",
        "TOOLKV_WRITE_OPENAPI",
        "TOOLKV_CONFORMANCE_REPORT",
        "TOOLKV_GPU_EXAMPLES",
        "TOOLKV_UNIFIED_EXAMPLES",
        "TOOLKV_DECODE_EXAMPLES",
        "TOOLKV_DECODE_STEPS",
        "TOOLKV_DECODE_KILL_EXAMPLES",
        "TOOLKV_SRC",
        "TOOLKV_EP",
    }
)


def _unknown(env: Mapping[str, str], known: frozenset[str]) -> list[tuple[str, str | None]]:
    """``(name, closest known name or None)`` for every variable that looks like toolkv's
    (``TOOLKV_`` in any case) and is neither a setting nor a tooling knob."""
    out = []
    for name in sorted(env):
        if not name.upper().startswith("TOOLKV_") or name in known or name in TOOLING_VARIABLES:
            continue
        # compared without the shared prefix, which would make every name look alike
        close = difflib.get_close_matches(name.upper()[7:], sorted(k[7:] for k in known), n=1, cutoff=0.6)
        out.append((name, f"TOOLKV_{close[0]}" if close else None))
    return out


def _unknown_message(found: list[tuple[str, str | None]]) -> str:
    parts = [f"{n} is not a toolkv variable" + (f" (did you mean {c}?)" if c else "") for n, c in found]
    return "; ".join(parts) + ". Known: see docs/operations.md, 'Enable'"


# ToolKVConfig's fields that are ``PolicyConfig``'s, with the bound each is read within: exactly
# PolicyConfig's own checks (tests/test_cli_bounds.py walks each end), so that a refusal is the
# parser's, stated with the variable's name and the bound, never PolicyConfig's field names.
# prior_median_s: toolkv.core.policy.MIN_DURATION_S .. MAX_DURATION_S (that module is not imported
# here: the plugin entry point loads this one before toolkv's dependencies are known to be there)
POLICY_KNOBS: dict[str, Numeric[Any]] = {
    "prior_median_s": floats(1e-3, 1e6),
    "prior_sigma": floats(0, lo_open=True),
    "prior_weight": floats(0, lo_open=True),
    "keep_max_s": floats(0),
    "keep_quantile": floats(0, 1, lo_open=True, hi_open=True),
    "device_reserve": floats(0, 1),
    "min_offload_tokens": ints(0),
    "prefetch_quantile": floats(0, 1, lo_open=True, hi_open=True),
    "prefetch_margin_s": floats(0),
    "max_tools": ints(1),
    "l3_store_margin_s": floats(0),
    "l3_write_tokens_per_s": floats(1),
}


def _policy_knobs(env: Mapping[str, str]) -> dict[str, Any]:
    """The per-call policy's ``TOOLKV_*`` knobs, parsed and validated as ``PolicyConfig`` would
    take them; a refusal names the variable and the value."""
    from toolkv.core.policy import PolicyConfig

    out: dict[str, Any] = {}
    for name, bound in POLICY_KNOBS.items():
        out[name] = _number(env, f"TOOLKV_{name.upper()}", getattr(ToolKVConfig, name), bound)
    try:
        PolicyConfig(**out)
    except ValueError as exc:
        field = str(exc).split(" ", 1)[0].removeprefix("PolicyConfig.")
        var = f"TOOLKV_{field.upper()}"
        raise ValueError(f"{var}={env.get(var)!r}: {str(exc).split(' ', 1)[1]}") from None
    return out


@dataclass(frozen=True)
class ToolKVConfig:
    """Everything the plugin reads from the environment (see ``docs/operations.md``).

    ``session_header`` (``TOOLKV_SESSION_HEADER``) is off unless named. A request's session is the
    ``session_id`` of its body; behind sglang's router that field is dropped (the router re-serialises
    the body from its own types), and the header it routes by is what reaches the server. Reading
    that header as the session is opt-in because a routing key is not necessarily a session id: an
    operator may route by user, tenant or prefix, and then every conversation of that key would be
    one toolkv session, each finished turn replacing the last one's record, so a ``tool_start``
    would protect whichever conversation happened to finish last. Only the operator knows what the
    key means, so only the operator can say it is a session."""

    enable: bool = False  # TOOLKV_ENABLE: nothing is hooked unless set
    ttl_s: float = 600.0  # TOOLKV_TTL_S: protection lifetime without a tool_end
    host_budget_tokens: int | None = None  # TOOLKV_HOST_BUDGET_TOKENS: cap on tokens toolkv protects
    fallback: Fallback = "pin"  # TOOLKV_FALLBACK: backend on a plain RadixCache
    zero_change: bool = False  # TOOLKV_ZERO_CHANGE: offload on finish_reason "tool_calls"
    restore_on_request: bool = True  # TOOLKV_RESTORE_ON_REQUEST: a session's next request restores it
    sweep_every: int = 64  # TOOLKV_SWEEP_EVERY: scheduler iterations between clock agreements
    reply_timeout_s: float = 30.0  # TOOLKV_REPLY_TIMEOUT_S: HTTP side wait for the scheduler
    closed_history: int = 10_000  # TOOLKV_CLOSED_HISTORY: closed sessions kept for kv_meta
    policy: str = "offload"  # TOOLKV_POLICY: offload (every tool_start) or auto (per call)
    prefetch: bool = True  # TOOLKV_PREFETCH: with policy auto, restore before the tool is expected back
    # TOOLKV_ADAPTIVE: a tool_end whose request would queue parks the session (host copy protected,
    # nothing pinned; sglang's load_back at admission loads it) and hand-over pins yield to queued
    # requests; 0: restore and pin at every tool_end that fits the running requests
    adaptive: bool = True
    # TOOLKV_LAZY_FREE: a finished offload leaves its GPU copies to sglang's eviction (its first
    # victims) instead of freeing them at once; 0: free them once the write is acknowledged
    lazy_free: bool = True
    # TOOLKV_UNMIRROR: a tool_start the host cannot take drops host mirrors of device copies
    # running requests lock (sglang writes them again at the request's finish) instead of a 507;
    # HiRadixCache under write_through / write_through_selective
    unmirror: bool = True
    restore_tokens_per_s: float = 200_000.0  # TOOLKV_RESTORE_TOKENS_PER_S: assumed until measured
    # TOOLKV_KEEP_TTL_S: the longest a GPU pin (kept, or restored early) waits for tool_end
    keep_ttl_s: float = 30.0
    # TOOLKV_HANDOVER_TTL_S: the longest a restored session stays pinned waiting for its next request
    handover_ttl_s: float = 30.0
    # TOOLKV_IDLE_TTL_S: a session holding nothing, with no turn or call for this long, is forgotten
    idle_ttl_s: float = 3600.0
    # TOOLKV_L3: with sglang's --hicache-storage-backend, a full host stores an offloaded session
    # to L3 instead of dropping it (0: drop, as without a storage backend)
    l3: bool = True
    # TOOLKV_L3_READ_TOKENS_PER_S: the L3 read rate the early restore of a session in L3 assumes
    l3_read_tokens_per_s: float = 100_000.0
    # TOOLKV_L3_READ_AT_ARRIVAL: a tool_end of a session stored in L3 lets sglang's own read at the
    # next request's arrival bring it, instead of toolkv reading it back to the host (ManagerConfig;
    # on by default: in the twin it kept more with long and named tools, docs/benchmarks.md)
    l3_read_at_arrival: bool = True
    # TOOLKV_SESSION_HEADER: an HTTP header whose value labels a request that has no session_id in
    # its body (lower-cased; "" = off): X-SMG-Routing-Key behind sglang's router
    session_header: str = ""
    # The per-call policy's knobs (TOOLKV_POLICY=auto; toolkv.core.policy.PolicyConfig, whose
    # defaults these are, docs/policy.md): the duration prior of an unseen tool, the keep rule, the
    # early restore's timing, the bound on per-tool statistics
    prior_median_s: float = 0.6  # TOOLKV_PRIOR_MEDIAN_S: an unseen tool's median duration
    prior_sigma: float = 1.5  # TOOLKV_PRIOR_SIGMA: its log-space spread (the heavy tail)
    prior_weight: float = 2.0  # TOOLKV_PRIOR_WEIGHT: observations the prior counts for
    keep_max_s: float = 2.0  # TOOLKV_KEEP_MAX_S: keep a call on the GPU only if expected shorter
    keep_quantile: float = 0.75  # TOOLKV_KEEP_QUANTILE: the duration quantile the keep test uses
    device_reserve: float = 0.10  # TOOLKV_DEVICE_RESERVE: pool share a keep must leave free
    min_offload_tokens: int = 256  # TOOLKV_MIN_OFFLOAD_TOKENS: below, let go rather than offload
    prefetch_quantile: float = 0.5  # TOOLKV_PREFETCH_QUANTILE: when the early restore aims to finish
    prefetch_margin_s: float = 0.05  # TOOLKV_PREFETCH_MARGIN_S: how much before that it starts
    max_tools: int = 4096  # TOOLKV_MAX_TOOLS: tools whose duration statistics are kept (LRU)
    # TOOLKV_L3_STORE_MARGIN_S: with an L3 tier, an offloaded session predicted away longer than its
    # L3 write and read back plus this is stored to L3 at once (1e9: only when the host is full)
    l3_store_margin_s: float = 10.0
    # TOOLKV_L3_WRITE_TOKENS_PER_S: the L3 write rate that horizon assumes
    l3_write_tokens_per_s: float = 100_000.0

    @classmethod
    def variables(cls) -> frozenset[str]:
        """Every ``TOOLKV_*`` setting: one per field, so a new field is a known variable at once."""
        return frozenset(f"TOOLKV_{f.name.upper()}" for f in fields(cls))

    @classmethod
    def enabled_in(cls, env: Mapping[str, str] | None = None) -> bool:
        """TOOLKV_ENABLE alone: the other variables are only read (and can only fail the launch)
        once toolkv is enabled, so an installed but disabled plugin stays inert.

        One exception: a misspelt switch that is on (``TOOLKV_ENABLED=1``, ``toolkv_enable=1``)
        while ``TOOLKV_ENABLE`` is unset. Its operator wants toolkv; serving without it would be
        the silent degradation the fail-closed start-up exists to prevent, so it is refused."""
        e = os.environ if env is None else env
        if "TOOLKV_ENABLE" not in e:
            wanted = [
                (n, c)
                for n, c in _unknown(e, cls.variables())
                if c == "TOOLKV_ENABLE" and e[n].strip().lower() in _TRUE
            ]
            if wanted:
                names = ", ".join(f"{n}={e[n]}" for n, _ in wanted)
                raise StartupRefused(
                    f"{names} looks like the switch TOOLKV_ENABLE, which is not set: toolkv would not run. "
                    f"Set TOOLKV_ENABLE=1, or unset {', '.join(n for n, _ in wanted)} to serve without toolkv"
                )
        return _bool(e, "TOOLKV_ENABLE", False)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> ToolKVConfig:
        """Parse and validate; a bad value raises ``ValueError`` naming the variable, so a typo
        stops the server at start-up instead of silently running with a default."""
        e = os.environ if env is None else env
        unknown = _unknown(e, cls.variables())
        if unknown:  # a misspelt name would otherwise run silently with the default
            raise ValueError(_unknown_message(unknown))
        fallback = (e.get("TOOLKV_FALLBACK") or "pin").strip().lower()
        if fallback not in ("pin", "shadow"):
            raise ValueError(f"TOOLKV_FALLBACK={fallback!r}: expected 'pin' or 'shadow'")
        sweep = _int(e, "TOOLKV_SWEEP_EVERY", cls.sweep_every, ints(1))
        closed = _int(e, "TOOLKV_CLOSED_HISTORY", cls.closed_history, ints(0))
        assert sweep is not None and closed is not None
        policy = (e.get("TOOLKV_POLICY") or "offload").strip().lower()
        if policy not in ("offload", "auto"):
            raise ValueError(f"TOOLKV_POLICY={policy!r}: expected 'offload' or 'auto'")
        return cls(
            enable=_bool(e, "TOOLKV_ENABLE", False),
            ttl_s=_float(
                e,
                "TOOLKV_TTL_S",
                cls.ttl_s,
                POSITIVE_S,
                why=" (0 would release every protection at the next sweep, before any tool_end)",
            ),
            host_budget_tokens=_int(
                e,
                "TOOLKV_HOST_BUDGET_TOKENS",
                None,
                ints(1),
                why=" (0 would refuse every tool_start with 507; unset it for no budget)",
            ),
            fallback="shadow" if fallback == "shadow" else "pin",
            zero_change=_bool(e, "TOOLKV_ZERO_CHANGE", False),
            restore_on_request=_bool(e, "TOOLKV_RESTORE_ON_REQUEST", True),
            sweep_every=sweep,
            reply_timeout_s=_float(
                e,
                "TOOLKV_REPLY_TIMEOUT_S",
                cls.reply_timeout_s,
                floats(MIN_REPLY_TIMEOUT_S),
                why=" (seconds; the scheduler answers between forward passes, and one iteration with a long "
                "prefill chunk takes longer than a shorter wait, so every toolkv call would answer 504)",
            ),
            closed_history=closed,
            policy=policy,
            prefetch=_bool(e, "TOOLKV_PREFETCH", True),
            adaptive=_bool(e, "TOOLKV_ADAPTIVE", True),
            lazy_free=_bool(e, "TOOLKV_LAZY_FREE", True),
            unmirror=_bool(e, "TOOLKV_UNMIRROR", cls.unmirror),
            restore_tokens_per_s=_float(
                e, "TOOLKV_RESTORE_TOKENS_PER_S", cls.restore_tokens_per_s, floats(1)
            ),
            keep_ttl_s=_float(
                e,
                "TOOLKV_KEEP_TTL_S",
                cls.keep_ttl_s,
                POSITIVE_S,
                why=" (0 would drop every GPU pin, kept or restored early, at the next sweep, before its "
                "tool_end: TOOLKV_POLICY=auto and kv_hints retain would keep nothing)",
            ),
            handover_ttl_s=_float(
                e,
                "TOOLKV_HANDOVER_TTL_S",
                cls.handover_ttl_s,
                POSITIVE_S,
                why=" (0 would unpin a restored session at the next sweep, before sglang admits its next "
                "request, so the KV just brought back could be evicted unused)",
            ),
            idle_ttl_s=_float(e, "TOOLKV_IDLE_TTL_S", cls.idle_ttl_s, floats(1)),
            l3=_bool(e, "TOOLKV_L3", True),
            l3_read_tokens_per_s=_float(
                e, "TOOLKV_L3_READ_TOKENS_PER_S", cls.l3_read_tokens_per_s, floats(1)
            ),
            l3_read_at_arrival=_bool(e, "TOOLKV_L3_READ_AT_ARRIVAL", True),
            session_header=_header(e, "TOOLKV_SESSION_HEADER"),
            **_policy_knobs(e),
        )

    def policy_config(self) -> PolicyConfig:
        """The per-call policy's knobs as ``toolkv.core.policy.PolicyConfig`` (which validates them)."""
        from toolkv.core.policy import PolicyConfig

        return PolicyConfig(**{name: getattr(self, name) for name in POLICY_KNOBS})

    def describe(self) -> dict[str, Any]:
        """The effective configuration, for the start-up log line and ``kv_meta``."""
        return asdict(self)

    def manager_config(self) -> ManagerConfig:
        from toolkv.core.manager import ManagerConfig

        return ManagerConfig(
            ttl_s=self.ttl_s,
            host_budget_tokens=self.host_budget_tokens,
            closed_history=self.closed_history,
            policy=self.policy,
            prefetch=self.prefetch,
            adaptive=self.adaptive,
            lazy_free=self.lazy_free,
            unmirror=self.unmirror,
            restore_tokens_per_s=self.restore_tokens_per_s,
            keep_ttl_s=self.keep_ttl_s,
            handover_ttl_s=self.handover_ttl_s,
            idle_ttl_s=self.idle_ttl_s,
            l3=self.l3,
            l3_read_tokens_per_s=self.l3_read_tokens_per_s,
            l3_read_at_arrival=self.l3_read_at_arrival,
            policy_config=self.policy_config(),
        )
