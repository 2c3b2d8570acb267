"""The manager's settings (``ManagerConfig``): TTLs, budgets, the call policy and its knobs.

Every default is the one ``toolkv.core.settings`` declares, the plugin's: a test or an embedder
that builds a ``ToolKVManager`` without settings gets the machine a server runs (load-adaptive
protection, lazy free and L3 read at arrival on). A test of the base spec's eager path says so
(``adaptive=False, lazy_free=False``).

Its own module so that the session machine, the call policies and the plugin's environment parser
(``toolkv.sglang.config``) can all import it without importing the manager.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from toolkv.core.policy import PolicyConfig
from toolkv.core.settings import POLICY_NAMES, ManagerSettings

#: the call policies a tool_start can run under (one module of ``toolkv.core.calls`` each; ``settings.PolicyName``)
POLICIES = POLICY_NAMES


@dataclass(frozen=True)
class ManagerConfig(ManagerSettings):
    """The manager's settings (``toolkv.core.settings.ManagerSettings``: TTLs, budgets, the call
    policy, the mechanisms it may use; what each one does is its declaration's ``doc``) and the
    call policy's knobs."""

    policy_config: PolicyConfig = field(default_factory=PolicyConfig)

    @classmethod
    def eager(cls, **overrides: Any) -> ManagerConfig:
        """The base spec's machine, without its load-adaptive and lazy-free actions: an offload
        frees the device copy once its write is acknowledged, a ``tool_end`` restores it (or answers
        503) and pins until admission whatever is queued. What a test of the restore path asks
        for by name; no server runs it unless told ``TOOLKV_ADAPTIVE=0 TOOLKV_LAZY_FREE=0``."""
        return cls(**{"adaptive": False, "lazy_free": False, **overrides})

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, not {self.policy!r}")
        if not self.keep_ttl_s >= 0:
            raise ValueError("keep_ttl_s must be a number of seconds >= 0")
        if not self.handover_ttl_s >= 0:
            raise ValueError("handover_ttl_s must be a number of seconds >= 0")
        if not self.idle_ttl_s > 0:
            raise ValueError("idle_ttl_s must be a number of seconds > 0 (inf: never)")
        if not (self.restore_tokens_per_s > 0 and self.restore_tokens_per_s < float("inf")):
            raise ValueError("restore_tokens_per_s must be a positive number")
        if not (self.l3_read_tokens_per_s > 0 and self.l3_read_tokens_per_s < float("inf")):
            raise ValueError("l3_read_tokens_per_s must be a positive number")
