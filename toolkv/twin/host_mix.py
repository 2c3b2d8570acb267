"""Where the host pool's tokens go: mirrors of device KV against copies only the host holds.

Under ``--hicache-write-policy write_through`` sglang writes every node it inserts to the host
(hiradix_cache.py ``insert`` -> ``_inc_hit_count`` -> ``write_backup``), so the host holds a mirror
of most of the device, and ``evict_host`` may free only host copies whose device copy is gone
(hiradix_cache.py ``evict_host``: ``if not x.evicted: continue``). The host's room for KV that is
*not* on the device is then what is left after the mirror. This module sorts the host pool's
tokens, at one moment, into four kinds, so a run says how much of the host paid for itself:

- ``mirror_locked``: host copies of device nodes a running request (or a pin) locks: the same KV
  twice, neither copy evictable;
- ``mirror_unlocked``: host copies of idle device nodes (a protected session whose GPU copy lazy
  free left to sglang's LRU is one): the host copy survives the device's eviction;
- ``host_only_protected``: toolkv's protected copies whose device copy is gone;
- ``host_only_unprotected``: HiCache's own copies of evicted nodes, which ``evict_host`` may free.

``python -m toolkv.twin.host_mix`` runs the value load under each write policy and prints the
table of docs/twin.md ("Where the host pool goes"), saving its JSON. The sort walks the tree, so
the twin takes it at its samples only (one per simulated second), on 0.5.16's ``HiRadixCache`` and on
0.5.23's ``UnifiedRadixCache`` (Python tree core).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

KINDS = ("mirror_locked", "mirror_unlocked", "host_only_protected", "host_only_unprotected")


def host_mix(tree: Any) -> dict[str, int] | None:
    """The host tokens of ``tree`` (a ``HiRadixCache``, or 0.5.23's ``UnifiedRadixCache`` on its
    Python tree core) by kind; None for a cache without node objects with a host copy (a plain
    ``RadixCache``, 0.5.23's Rust tree core)."""
    try:
        root = getattr(tree, "root_node", None)
    except NotImplementedError:  # 0.5.23's Rust core: "root_node: not yet ported"
        return None
    if root is None:
        return None
    if hasattr(root, "component_data"):  # a UnifiedTreeNode: its FULL component's copies
        facts = _unified_facts
    elif all(hasattr(root, a) for a in ("host_value", "host_ref_counter", "lock_ref", "value")):
        facts = _hiradix_facts
    else:
        return None
    out = dict.fromkeys(KINDS, 0)
    stack = list(root.children.values())
    while stack:
        n = stack.pop()
        stack.extend(n.children.values())
        host, dev, locked, protected = facts(n)
        if host is None:
            continue
        k = len(host)
        if dev is not None:
            out["mirror_locked" if locked else "mirror_unlocked"] += k
        else:
            out["host_only_protected" if protected else "host_only_unprotected"] += k
    return out


def _hiradix_facts(n: Any) -> tuple[Any, Any, bool, bool]:
    return n.host_value, n.value, n.lock_ref > 0, n.host_ref_counter > 0


def _unified_facts(n: Any) -> tuple[Any, Any, bool, bool]:
    d = n.component_data[0]  # FULL
    return d.host_value, d.value, d.lock_ref > 0, any(cd.host_lock_ref > 0 for cd in n.component_data)


def mean_shares(samples: Iterable[Mapping[str, Any]], host_tokens: int) -> dict[str, float] | None:
    """Each kind's mean share of the host pool over the samples that carry ``host_mix``."""
    rows = [s["host_mix"] for s in samples if s.get("host_mix")]
    if not rows or host_tokens <= 0:
        return None
    return {k: sum(r[k] for r in rows) / len(rows) / host_tokens for k in KINDS}


# ---- the docs table ----------------------------------------------------------------------------
#: the value load (scripts/gpu_lib.sh ``value_load value``), as ``toolkv twin`` takes it
VALUE_LOAD = ["--sessions", "48", "--arrival-rate", "0", "--turns", "6", "--first-tokens", "3000",
              "--growth", "900", "--output", "32", "--max-context", "16384", "--warmup", "0",
              "--duration", "75"]  # fmt: skip
COMMAND = "python -m toolkv.twin.host_mix --out docs/results/twin/host_mix.json"


#: the configurations beside the named ones: toolkv without host room from mirrors (TOOLKV_UNMIRROR=0)
VARIANTS = {
    "offload-507": ("offload", (("TOOLKV_UNMIRROR", "0"),)),
    "auto-507": ("auto", (("TOOLKV_UNMIRROR", "0"),)),
}


def _configs(names: Sequence[str], write_policy: str) -> list[Any]:
    from dataclasses import replace

    from toolkv.twin.configs import get

    out = []
    for n in names:
        base, env = VARIANTS.get(n, (n, ()))
        out.append(replace(get(base), name=n, toolkv_env=env).with_write_policy(write_policy))
    return out


def run(
    policies: Sequence[str], configs: Sequence[str], extra: Sequence[str] = (), command: str = COMMAND
) -> dict[str, Any]:
    """Each configuration under each write policy on the value load, with the bound (``--opt``)."""
    from toolkv.twin.cli import add_arguments, run_configs, workload

    p = argparse.ArgumentParser()
    add_arguments(p)
    rows: list[dict[str, Any]] = []
    for wp in policies:
        a = p.parse_args(["--quiet", "--opt", "--write-policy", wp, *VALUE_LOAD, *extra])
        w = workload(a)
        for r in run_configs(a, w, _configs(configs, wp), opt=True, progress=False):
            t = r["twin"]
            print(f"{wp} {r['config']}: reuse {r['summary']['reuse']['reuse']:.2f}", file=sys.stderr)
            rows.append({
                "write_policy": wp,
                "config": r["config"],
                "host_tokens": t["host_tokens"],
                "shares": t["host_mix"],
                "reuse": r["summary"]["reuse"]["reuse"],
                "opt_reuse": t["opt"]["reuse"],
                "closed_turns_per_s": r["summary"]["closed_turns_per_s"],
                "ttft_p90_s": r["summary"]["resumed_ttft_p90_s"],
                "tool_start_refused": sum(v for c, v in r["summary"].get("calls", {}).items()
                                          if c.startswith("tool_start ") and c != "tool_start 200"),
            })  # fmt: skip
    return {"command": command, "load": VALUE_LOAD, "rows": rows}


def table(data: Mapping[str, Any]) -> str:
    """The markdown table of ``run``'s JSON (docs/twin.md, tests/test_host_mix.py): each kind's
    share of the host pool, then the run's closed throughput and resumed-turn TTFT p90 against the
    stock run of the same write policy, its reuse, the share of the bound, its 507s."""
    head = ("write policy", "config", "mirror of locked KV", "mirror of idle KV", "host only, protected",
            "host only, unprotected", "free", "turns/s × stock", "p90 × stock", "reuse (of the bound)",
            "tool_start 507")  # fmt: skip
    out = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    stock = {r["write_policy"]: r for r in data["rows"] if r["config"] == "stock"}
    for r in data["rows"]:
        s, ref = r["shares"], stock[r["write_policy"]]
        free = 1.0 - sum(s.values())
        frac = r["reuse"] / r["opt_reuse"] if r["opt_reuse"] else None
        out.append("| " + " | ".join([
            r["write_policy"], r["config"], *(f"{100 * s[k]:.0f} %" for k in KINDS), f"{100 * free:.0f} %",
            f"{r['closed_turns_per_s'] / ref['closed_turns_per_s']:.2f}×", f"{r['ttft_p90_s'] / ref['ttft_p90_s']:.2f}×",
            f"{100 * r['reuse']:.0f} % ({100 * frac:.0f} %)" if frac is not None else f"{100 * r['reuse']:.0f} %",
            "-" if r["config"] == "stock" else str(r["tool_start_refused"]),
        ]) + " |")  # fmt: skip
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    from toolkv.twin.configs import WRITE_POLICIES

    p = argparse.ArgumentParser(prog="python -m toolkv.twin.host_mix", description=__doc__.split("\n\n")[0])
    p.add_argument("--write-policies", default=",".join(WRITE_POLICIES))
    p.add_argument("--configs", default="stock,offload,auto,offload-507,auto-507",
                   help="twin configurations; offload-507, auto-507: with TOOLKV_UNMIRROR=0")  # fmt: skip
    p.add_argument("--out", type=Path, help="write the JSON here")
    a, extra = p.parse_known_args(argv)
    args = list(sys.argv[1:] if argv is None else argv)
    data = run(
        a.write_policies.split(","),
        a.configs.split(","),
        extra,
        " ".join(["python -m toolkv.twin.host_mix", *args]),
    )
    print(table(data))
    if a.out:
        a.out.write_text(json.dumps(data, indent=1) + "\n")
        print(f"wrote {a.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
