"""The server configurations of the agent benchmark (``scripts/gpu_agent_suite.sh``), as the twin
builds them: which sglang cache, how large its host pool, which toolkv settings, and what the
agents do around each tool call (the ``toolkv bench agent`` mode)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

GB = 1e9
#: the L3 link of the L3 configurations: one local NVMe drive (3-7 GB/s sequential), each way
L3_GBPS = 5.0
REGIMES = {"constrained": 120_000, "plentiful": 800_000}  # device pool tokens (--max-total-tokens)
#: sglang's --hicache-write-policy values (server_args.py), the first the benchmarks' default:
#: write_through writes a node to host on its first hit, write_through_selective on its second,
#: write_back only when eviction would drop it (docs/twin.md, "HiCache write policy")
WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")


@dataclass(frozen=True)
class TwinConfig:
    name: str
    cache: str  # "hiradix" (--enable-hierarchical-cache) or "radix"
    mode: str  # the agents: stock | explicit | on-request
    host_gb: float = 16.0  # --hicache-size (HiCache only)
    policy: str = "offload"  # TOOLKV_POLICY
    send_tool: bool = False  # name each tool in tool_start (for the per-call policy)
    ttl_s: float = 600.0  # TOOLKV_TTL_S
    pin_budget_share: float | None = None  # TOOLKV_HOST_BUDGET_TOKENS as a share of the device pool
    adaptive: bool = True  # TOOLKV_ADAPTIVE
    # an L3 tier below the host pool (sglang's --hicache-storage-backend; the twin's is
    # toolkv.twin.storage): the storage link's GB/s each way (a local NVMe drive), None: no L3
    l3_gbps: float | None = None
    l3_write_gbps: float | None = None  # the write direction's, when it differs
    l3_capacity_gb: float | None = None  # the store's capacity (None: it never fills)
    l3_store: str = ""  # a store shared by several servers (a fleet's), by name; "": the server's own
    l3_mooncake: bool = False  # the store has Mooncake's semantics (master eviction, soft pins)
    # TOOLKV_* settings over the twin's own, as an operator's environment would set them (parsed
    # and checked by ToolKVConfig.from_env): e.g. (("TOOLKV_L3", "0"),) to try a knob on a load
    toolkv_env: tuple[tuple[str, str], ...] = ()
    # --hicache-write-policy (HiCache only): when sglang writes a node to the host pool, and what its
    # eviction does with a node that has no host copy
    write_policy: str = "write_through"

    def __post_init__(self) -> None:
        if self.write_policy not in WRITE_POLICIES:
            raise ValueError(
                f"write_policy must be one of {', '.join(WRITE_POLICIES)}; got {self.write_policy!r}"
            )

    def storage_link(self, kv_bytes_per_token: int) -> Any:
        """The L3 link of an L3 server (``toolkv.twin.storage.StorageLink``), None without L3."""
        if not self.l3_gbps:
            return None
        from toolkv.twin.storage import StorageLink

        return StorageLink.of_gbps(
            self.l3_gbps, self.l3_write_gbps or self.l3_gbps, kv_bytes_per_token, self.l3_capacity_gb,
            store=self.l3_store, mooncake=self.l3_mooncake,
        )  # fmt: skip

    def host_tokens(self, kv_bytes_per_token: int) -> int:
        """The host pool sglang allocates for ``--hicache-size host_gb`` (pool_host/base.py:
        ``int(host_size * 1e9 // size_per_token)``, plus one page)."""
        return int(self.host_gb * GB // kv_bytes_per_token) + 1 if self.cache == "hiradix" else 0

    def with_host_gb(self, host_gb: float) -> TwinConfig:
        return replace(self, host_gb=host_gb)

    def with_write_policy(self, write_policy: str) -> TwinConfig:
        """The same server under another ``--hicache-write-policy`` (no-op without HiCache)."""
        return replace(self, write_policy=write_policy) if self.cache == "hiradix" else self

    def describe(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


# The suite's labels; ``offload`` is the suite's ``explicit`` and ``auto`` its ``policy``.
CONFIGS: dict[str, TwinConfig] = {
    c.name: c
    for c in (
        TwinConfig("radix", "radix", "stock", ttl_s=30.0, pin_budget_share=0.5),
        TwinConfig("pin", "radix", "explicit", ttl_s=30.0, pin_budget_share=0.5),
        TwinConfig("stock", "hiradix", "stock"),
        TwinConfig("stock-large", "hiradix", "stock", host_gb=80.0),
        TwinConfig("offload", "hiradix", "explicit"),
        TwinConfig("zero-change", "hiradix", "on-request"),
        TwinConfig("auto", "hiradix", "explicit", policy="auto", send_tool=True),
        # the same without load-adaptive protection (TOOLKV_ADAPTIVE=0): every fitting tool_end pins
        TwinConfig("offload-pinned", "hiradix", "explicit", adaptive=False),
        TwinConfig("auto-pinned", "hiradix", "explicit", policy="auto", send_tool=True, adaptive=False),
        # with an L3 tier on a local NVMe drive (L3_GBPS): stock HiCache writes every host copy
        # through to it and reads a request's missing prefix on arrival; toolkv's manager adds its
        # own L3 path (store by predicted return, reads ahead, a full host's victims stored)
        TwinConfig("stock-l3", "hiradix", "stock", l3_gbps=L3_GBPS),
        TwinConfig("offload-l3", "hiradix", "explicit", send_tool=True, l3_gbps=L3_GBPS),
        TwinConfig("auto-l3", "hiradix", "explicit", policy="auto", send_tool=True, l3_gbps=L3_GBPS),
    )
}
GPU_LABEL = {"offload": "explicit", "auto": "policy"}  # the label the GPU suite's JSON carries


def get(name: str) -> TwinConfig:
    if name in CONFIGS:
        return CONFIGS[name]
    back = {v: k for k, v in GPU_LABEL.items()}
    if name in back:
        return CONFIGS[back[name]]
    raise ValueError(f"unknown configuration {name!r}; known: {', '.join(CONFIGS)}")
