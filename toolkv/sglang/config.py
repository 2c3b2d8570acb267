"""Plugin configuration from ``TOOLKV_*`` environment variables.

Environment variables, not sglang flags: sglang's argument parser is closed to plugins, and the
environment is the one thing every process sglang spawns inherits (the HTTP process, each
scheduler rank), so all of them see the same configuration without any plumbing.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from toolkv.core.settings import (
    BY_FIELD,
    SETTINGS,
    ManagerSettings,
    PluginSettings,
    PolicySettings,
    of_layer,
    parse_bool,
    variables,
)
from toolkv.errors import StartupRefused

if TYPE_CHECKING:  # imported lazily: the plugin entry point must load without toolkv's dependencies,
    # so that it can name the missing one instead of sglang's loader swallowing an ImportError
    from toolkv.core.manager import ManagerConfig
    from toolkv.core.policy import PolicyConfig

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


# ToolKVConfig's fields that are ``PolicyConfig``'s (toolkv.core.settings declares which)
POLICY_KNOBS: tuple[str, ...] = tuple(x.field for x in of_layer("policy"))


def _check_policy(values: Mapping[str, Any], env: Mapping[str, str]) -> None:
    """``PolicyConfig``'s own checks over the parsed knobs: they agree with the declared bounds
    (tests/test_cli_bounds.py walks each end), so this only fires if the two drift apart; the
    refusal still names the variable, never PolicyConfig's field names."""
    from toolkv.core.policy import PolicyConfig

    try:
        PolicyConfig(**{name: values[name] for name in POLICY_KNOBS})
    except ValueError as exc:
        field = str(exc).split(" ", 1)[0].removeprefix("PolicyConfig.")
        var = f"TOOLKV_{field.upper()}"
        raise ValueError(f"{var}={env.get(var)!r}: {str(exc).split(' ', 1)[1]}") from None


@dataclass(frozen=True)
class ToolKVConfig(PolicySettings, ManagerSettings, PluginSettings):
    """Everything the plugin reads from the environment (see ``docs/operations.md``).

    ``session_header`` (``TOOLKV_SESSION_HEADER``) is off unless named. A request's session is the
    ``session_id`` of its body; behind sglang's router that field is dropped (the router re-serialises
    the body from its own types), and the header it routes by is what reaches the server. Reading
    that header as the session is opt-in because a routing key is not necessarily a session id: an
    operator may route by user, tenant or prefix, and then every conversation of that key would be
    one toolkv session, each finished turn replacing the last one's record, so a ``tool_start``
    would protect whichever conversation happened to finish last. Only the operator knows what the
    key means, so only the operator can say it is a session."""

    # its fields are the three layers' of toolkv.core.settings (plugin, manager, policy): one per
    # declared setting, its name, type, default, bound and reason declared there

    @classmethod
    def variables(cls) -> frozenset[str]:
        """Every ``TOOLKV_*`` setting (toolkv.core.settings declares them; one field each)."""
        return variables()

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
                if c == "TOOLKV_ENABLE" and parse_bool({n: e[n]}, n, False)
            ]
            if wanted:
                names = ", ".join(f"{n}={e[n]}" for n, _ in wanted)
                raise StartupRefused(
                    f"{names} looks like the switch TOOLKV_ENABLE, which is not set: toolkv would not run. "
                    f"Set TOOLKV_ENABLE=1, or unset {', '.join(n for n, _ in wanted)} to serve without toolkv"
                )
        return bool(BY_FIELD["enable"].parse(e))

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> ToolKVConfig:
        """Parse and validate; a bad value raises ``ValueError`` naming the variable, so a typo
        stops the server at start-up instead of silently running with a default."""
        e = os.environ if env is None else env
        unknown = _unknown(e, cls.variables())
        if unknown:  # a misspelt name would otherwise run silently with the default
            raise ValueError(_unknown_message(unknown))
        values: dict[str, Any] = {x.field: _header(e, x.name) if x.header else x.parse(e) for x in SETTINGS}
        _check_policy(values, e)
        return cls(**values)

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
            **{x.field: getattr(self, x.field) for x in of_layer("manager")},
            policy_config=self.policy_config(),
        )
