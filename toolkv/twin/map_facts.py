"""What docs/benchmarks.md says of a saved regime map, computed from its JSON (the block between its
``twin-map-facts`` markers; ``python -m toolkv.twin.regime_map --doc-table MAP.json --facts``), so
the prose around the map's table cannot drift from the map."""

from __future__ import annotations

import statistics
from typing import Any

from toolkv.twin.regime_map import LIVE_SHARE, MAX_P90, MIN_TPS, TOOLKV, WIN_P90, WIN_TPS


def facts(data: dict[str, Any]) -> str:
    """What docs/benchmarks.md says of a saved map, computed from it (its twin-map-facts block):
    the never-worse bar's margins, the target's misses, ``auto`` against ``offload``, and the share
    of the offline bound toolkv reaches where the host binds."""
    recs = [r for r in data["cells"] if r["config"] in TOOLKV]

    def where(r: dict[str, Any]) -> str:
        return f"`{r['tool_shape']}`, {r['sessions']} sessions, {r['host_gb']:g} GB, `{r['config']}`"

    lo = min(recs, key=lambda r: r["tps_vs_stock"]["median"])
    hi = max(recs, key=lambda r: r["p90_vs_stock"]["median"])
    seed_hi = max(recs, key=lambda r: r["p90_vs_stock"]["max"])
    best = max(recs, key=lambda r: r["tps_vs_stock"]["median"])
    bad = data["never_worse_violations"]
    short = data["short_of_target"]
    by_cfg = {c: sum(1 for m in short if m.endswith(f" {c}: ") or f" {c}:" in m) for c in TOOLKV}
    cells_n = len({(r["tool_shape"], r["sessions"], r["host_gb"]) for r in recs})

    def key(r: dict[str, Any]) -> tuple[Any, ...]:
        return (r["tool_shape"], r["sessions"], r["host_gb"])

    off = {key(r): r for r in recs if r["config"] == "offload"}
    aut = {key(r): r for r in recs if r["config"] == "auto"}
    both = [k for k in off if k in aut]
    auto_lower = sum(1 for k in both if aut[k]["p90_vs_stock"]["median"] < off[k]["p90_vs_stock"]["median"])
    off_lower = sum(1 for k in both if off[k]["p90_vs_stock"]["median"] < aut[k]["p90_vs_stock"]["median"])
    close = sum(
        1 for k in both
        if abs(aut[k]["tps_vs_stock"]["median"] / off[k]["tps_vs_stock"]["median"] - 1) <= 0.01
    )  # fmt: skip
    binding = [
        r
        for r in recs
        if r["live_over_host"] >= LIVE_SHARE and r["reuse_of_opt"]["median"] == r["reuse_of_opt"]["median"]
    ]
    reach = sum(1 for r in binding if r["reuse_of_opt"]["median"] >= 0.9)
    lines = [
        f"- **Never worse**: {'no cell' if not bad else f'{len(bad)} cells'} below {MIN_TPS:g}× stock's closed "
        f"throughput or above {MAX_P90:g}× its resumed TTFT p90 (medians over seeds), over {cells_n} cells × "
        f"{len(TOOLKV)} configurations. The lowest throughput: {where(lo)}, "
        f"{lo['tps_vs_stock']['median']:.2f}×; the highest: {where(best)}, {best['tps_vs_stock']['median']:.2f}× "
        f"(p90 {best['p90_vs_stock']['median']:.2f}×). The highest p90 median: {where(hi)}, "
        f"{hi['p90_vs_stock']['median']:.3f}×; the highest single seed: {where(seed_hi)}, "
        f"{seed_hi['p90_vs_stock']['max']:.2f}×.",
        f"- **The target where the live KV is ≥ {LIVE_SHARE:g}× the host** (≥ {WIN_TPS:g}× throughput or ≤ "
        f"{WIN_P90:g}× p90) **is missed in {len(short)} cells and configurations** "
        f"({', '.join(f'{n} `{c}`' for c, n in by_cfg.items())}).",
        f"- **The offline bound where the host binds**: of the {len(binding)} cells and configurations whose live "
        f"KV is ≥ {LIVE_SHARE:g}× the host, toolkv reaches ≥ 90 % of the bound's reuse in {reach} (median "
        f"{100 * statistics.median(r['reuse_of_opt']['median'] for r in binding):.0f} %, lowest "
        f"{100 * min(r['reuse_of_opt']['median'] for r in binding):.0f} %).",
        f"- **`auto` against `offload`**: `auto` has the lower p90 median in {auto_lower} cells, `offload` in "
        f"{off_lower}; their throughputs are within 1 % of each other in {close} of {len(both)} cells.",
    ]
    return "\n".join(lines)
