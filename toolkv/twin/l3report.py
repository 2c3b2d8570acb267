"""``toolkv twin l3`` and ``toolkv twin fleet``: the sweeps of issue 27 over the twin, their tables
and plots.

- ``l3``: one server, the long-tool shape, host pool size x {stock, stock-l3, toolkv, toolkv-l3}:
  resumed-turn reuse and TTFT against host GB, with the optimal-retention bound on the host alone
  (moves free and never late: :mod:`toolkv.twin.opt`). L3 is sglang's storage tier
  (:mod:`toolkv.twin.storage`) and toolkv's L3 decisions its manager's (``toolkv/core/session/l3.py``).
- ``fleet``: N servers behind a session-id router sharing one L3; a share of the servers is drained
  part-way, so their sessions' next turns land elsewhere: reuse and TTFT of all resumed turns and
  of the moved ones, against N.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from toolkv.twin.fleet import fleet_config, log, long_workload, progress_line, simulate_fleet
from toolkv.twin.l3 import L3Config
from toolkv.twin.run import Options

L3_CONFIGS = "stock,stock-l3,toolkv,toolkv-l3"
COLORS = {
    "stock": "tab:blue",
    "stock-l3": "tab:orange",
    "toolkv": "tab:green",
    "toolkv-l3": "tab:red",
    "stock-mc": "tab:brown",
    "toolkv-mc": "tab:purple",
}
FLEET_CONFIGS = "stock,stock-l3,toolkv-l3"
KV_BYTES = 131_072  # bytes of KV a token in the default profile (the JSONs count tokens)


def l3_config(a: argparse.Namespace) -> L3Config:
    return L3Config(
        read_gbps=a.l3_read_gbps,
        write_gbps=a.l3_write_gbps,
        capacity_gb=a.l3_capacity_gb or None,
        pin_share=getattr(a, "l3_pin_share", None),
    )


def options(a: argparse.Namespace) -> Options:
    from toolkv.twin.configs import REGIMES

    # 32 request slots are plenty for a handful of sessions a server; the harness sizes its
    # req_to_token table by them times the context (100K), and a fleet has 64 of them
    return Options(device_tokens=a.device_tokens or REGIMES[a.regime], context_len=100_000 + 128,
                   max_running_requests=32)  # fmt: skip


def _profile(a: argparse.Namespace) -> Any:
    from toolkv.twin.profile import TimeProfile, default_profile

    return TimeProfile.load(a.profile) if a.profile else default_profile()


def _names(a: argparse.Namespace, default: str) -> list[str]:
    raw = a.configs if a.configs not in (None, "", "default") else default
    return [n.strip() for n in raw.split(",") if n.strip()]


def l3_sweep(a: argparse.Namespace, hosts: list[float]) -> list[dict[str, Any]]:
    """Host GB x configuration on one server (every run: ``simulate_fleet`` with ``n=1``)."""
    w = long_workload(a.sessions, a.duration, a.seed)
    window = (w.ramp_s + a.warmup, w.duration_s)
    rows = []
    for gb in hosts:
        for name in _names(a, L3_CONFIGS):
            r = simulate_fleet(w, fleet_config(name, gb), _profile(a), options(a), n=1, l3=l3_config(a),
                               window=window, opt=True)  # fmt: skip
            rows.append(r)
            if not a.quiet:
                log(progress_line(r))
    return rows


def busiest(w: Any, n: int, k: int) -> list[int]:
    """The ``k`` servers the router gives the most of ``w``'s sessions (ties: the lower index): the
    servers drained, so that a drain moves sessions (a fixed index may host none of them)."""
    from toolkv.twin.fleet import route
    from toolkv.twin.sessions import Sessions

    s = Sessions.lazy(w)
    load = [0] * n
    for i in range(len(s.starts)):
        load[route(s.sid(i), list(range(n)))] += 1
    return sorted(range(n), key=lambda v: (-load[v], v))[:k]


def fleet_sweep(a: argparse.Namespace, ns: list[int]) -> list[dict[str, Any]]:
    """N servers x configuration, ``sessions`` per server, a share drained at ``drain_at``."""
    rows = []
    for n in ns:
        w = long_workload(a.sessions * n, a.duration, a.seed)
        window = (w.ramp_s + a.warmup, w.duration_s)
        k = max(1, round(a.drain_share * n)) if a.drain_share > 0 else 0
        drain = [(a.drain_at, i) for i in busiest(w, n, k)]
        host = a.host_gb[0] if a.host_gb else 32.0
        for name in _names(a, FLEET_CONFIGS):
            r = simulate_fleet(w, fleet_config(name, host), _profile(a), options(a), n=n, l3=l3_config(a),
                               drain=drain, window=window, tick_s=0.25)  # fmt: skip
            rows.append(r)
            if not a.quiet:
                log(progress_line(r) + f", moved turns {r['moved_turns']}")
    return rows


def _f(x: float | None, fmt: str = "{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f} %"


def _l3_cells(r: dict[str, Any]) -> list[str]:
    """toolkv's L3 path (stores made / acknowledged whole; reads started / whole / short) and the
    storage reads (GB, reads sglang's host allocation cut short)."""
    st, c = r["l3"], r.get("toolkv_l3") or {}
    if st is None:
        return ["-", "-", "-"]
    tk = r["config"].startswith("toolkv")
    gb = st["read_tokens"] * KV_BYTES / 1e9
    return [
        f"{c.get('l3_store', 0)} / {c.get('demoted_l3', 0)}" if tk else "-",
        f"{c.get('l3_prefetch', 0)} / {c.get('l3_restored', 0)} / {c.get('l3_prefetch_short', 0)}"
        if tk
        else "-",
        f"{gb:,.1f} / {st['reads_cut']}",
    ]


def l3_table(rows: list[dict[str, Any]]) -> str:
    head = ("host GB", "config", "reuse", "TTFT p50 s", "TTFT p90 s", "toolkv L3 stores / whole",
            "toolkv L3 reads / whole / short", "L3 read GB / reads cut", "L3 wait p50 s", "opt: host",
            "checks")  # fmt: skip
    out = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for r in rows:
        out.append("| " + " | ".join([
            f"{r['host_gb']:g}", r["config"], _pct(r["reuse"]), _f(r["ttft_p50_s"]), _f(r["ttft_p90_s"]),
            *_l3_cells(r), _f(r["l3_wait_p50_s"]), _pct(r.get("opt_reuse")),
            "pass" if r["passed"] else "FAIL" + (f" ({r['crashed']})" if r["crashed"] else ""),
        ]) + " |")  # fmt: skip
    return "\n".join(out)


def fleet_table(rows: list[dict[str, Any]]) -> str:
    head = ("servers", "drained", "config", "turns/s", "reuse", "TTFT p50 s", "TTFT p90 s", "moved turns",
            "moved reuse", "moved TTFT p50 s", "L3 read GB", "evicted pages", "tool_end 404 / adopted",
            "checks")  # fmt: skip
    out = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for r in rows:
        gb = r["l3"]["read_tokens"] * KV_BYTES / 1e9 if r["l3"] else None
        ev = r["l3"].get("evicted_pages", 0) if r["l3"] else None
        tk = r["config"].startswith("toolkv")
        ends = (
            f"{r['calls'].get('tool_end 404', 0)} / {r['toolkv_l3'].get('tool_end_adopted', 0)}"
            if tk
            else "-"
        )
        out.append("| " + " | ".join([
            str(r["servers"]), str(r["drained"]), r["config"], f"{r['turns_per_s']:.3f}", _pct(r["reuse"]),
            _f(r["ttft_p50_s"]), _f(r["ttft_p90_s"]), str(r["moved_turns"]), _pct(r["moved_reuse"]),
            _f(r["moved_ttft_p50_s"]), _f(gb, "{:,.0f}"), "-" if ev is None else f"{ev:,}", ends,
            "pass" if r["passed"] else "FAIL" + (f" ({r['crashed']})" if r["crashed"] else ""),
        ]) + " |")  # fmt: skip
    return "\n".join(out)


def plot(rows: list[dict[str, Any]], out: Path, x: str) -> None:
    """Reuse, TTFT p50 and TTFT p90 against ``x`` (``host_gb`` or ``servers``), a line per config."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfgs = list(dict.fromkeys(r["config"] for r in rows))
    panels: tuple[tuple[str, float, str], ...] = (
        ("reuse", 100.0, "resumed-turn reuse, %"), ("ttft_p50_s", 1.0, "resumed-turn TTFT p50, s"),
        ("ttft_p90_s", 1.0, "resumed-turn TTFT p90, s"),
    )  # fmt: skip
    if x == "servers":
        panels += (("moved_reuse", 100.0, "reuse of turns that moved server, %"),)
    fig, axes = plt.subplots(1, len(panels), figsize=(4.4 * len(panels), 3.6))
    for c in cfgs:
        pts = sorted((r[x], r) for r in rows if r["config"] == c)
        for ax, (key, scale, _) in zip(axes, panels, strict=True):
            ax.plot([p for p, _ in pts], [scale * (r[key] or 0.0) for _, r in pts], marker="o", label=c,
                    color=COLORS.get(c))  # fmt: skip
    if x == "host_gb":
        ref = [r for r in rows if r["config"] == cfgs[0]]
        opt: list[tuple[float, float]] = sorted(
            (float(r["host_gb"]), float(r["opt_reuse"])) for r in ref if r.get("opt_reuse") is not None
        )
        axes[0].plot(
            [p for p, _ in opt],
            [100 * y for _, y in opt],
            "k--",
            label=f"opt, host only ({cfgs[0]} timeline)",
        )
    if x == "servers":
        for ax in axes:
            ax.set_xscale("log", base=2)
    for ax, (_, _, title) in zip(axes, panels, strict=True):
        ax.set_title(title)
        ax.set_xlabel("host pool, GB" if x == "host_gb" else "servers")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def _median(xs: Sequence[float | None]) -> float | None:
    ys = [x for x in xs if x is not None]
    return statistics.median(ys) if ys else None


def _by_fleet(rows: list[dict[str, Any]]) -> dict[tuple[int, str], list[dict[str, Any]]]:
    """The runs grouped by (servers, configuration), the configurations in :data:`COLORS`' order."""
    groups: dict[tuple[int, str], list[dict[str, Any]]] = {}
    order = list(COLORS)
    for r in sorted(
        rows, key=lambda r: (r["servers"], order.index(r["config"]) if r["config"] in order else 99)
    ):
        groups.setdefault((r["servers"], r["config"]), []).append(r)
    return groups


def _span(xs: list[float | None], cell: Any) -> str:
    """``median (min-max)`` of the seeds' values, each written by ``cell``."""
    ys = [x for x in xs if x is not None]
    if not ys:
        return "-"
    return f"{cell(_median(ys))} ({cell(min(ys))}-{cell(max(ys))})" if len(ys) > 1 else cell(ys[0])


def _pooled(rows: list[dict[str, Any]], key: str) -> float | None:
    """Cached / reusable tokens summed over the runs (``reuse_tokens``, ``moved_reuse_tokens``):
    a seed with more moved tokens weighs more, as a turn of it does."""
    got = sum(r[key][0] for r in rows)
    want = sum(r[key][1] for r in rows)
    return got / want if want else None


def seeds_table(rows: list[dict[str, Any]], against: str = "stock-mc") -> str:
    """One line per (servers, configuration) over the seeds of ``rows`` (each row's ``seed``):
    reuse pooled over the seeds' tokens and its per-seed median and range, the moved turns' alike,
    TTFT p50 and p90 medians (range), and for a toolkv configuration the seeds on which its moved
    reuse was above / equal to / below ``against``'s on the same seed and fleet."""
    head = ("servers", "config", "seeds", "reuse (pooled)", "reuse per seed", "TTFT p50 s", "TTFT p90 s",
            "moved turns", "moved reuse (pooled)", "moved reuse per seed", f"moved reuse vs {against}: "
            "above / equal / below", "checks")  # fmt: skip
    out = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    ref = {(r["servers"], r["seed"]): r for r in rows if r["config"] == against}
    for (n, cfg), rs in _by_fleet(rows).items():
        vs = "-"
        if cfg != against and cfg.startswith("toolkv"):
            won = tie = lost = 0
            for r in rs:
                o = ref.get((n, r["seed"]))
                if o is None or r["moved_reuse"] is None or o["moved_reuse"] is None:
                    continue
                d = r["moved_reuse"] - o["moved_reuse"]
                won, tie, lost = won + (d > 1e-9), tie + (abs(d) <= 1e-9), lost + (d < -1e-9)
            vs = f"{won} / {tie} / {lost}"
        out.append("| " + " | ".join([
            str(n), cfg, ",".join(str(r["seed"]) for r in sorted(rs, key=lambda r: r["seed"])),
            _pct(_pooled(rs, "reuse_tokens")), _span([r["reuse"] for r in rs], _pct),
            _span([r["ttft_p50_s"] for r in rs], _f), _span([r["ttft_p90_s"] for r in rs], _f),
            str(sum(r["moved_turns"] for r in rs)), _pct(_pooled(rs, "moved_reuse_tokens")),
            _span([r["moved_reuse"] for r in rs], _pct), vs,
            "pass" if all(r["passed"] for r in rs) else "FAIL",
        ]) + " |")  # fmt: skip
    return "\n".join(out)


def pooled_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (servers, configuration) over the seeds, in :func:`plot`'s keys: reuse and
    moved reuse pooled over the seeds' tokens, TTFT p50 and p90 the seeds' medians."""
    return [
        {"servers": n, "config": cfg, "reuse": _pooled(rs, "reuse_tokens"),
         "ttft_p50_s": _median([r["ttft_p50_s"] for r in rs]), "ttft_p90_s": _median([r["ttft_p90_s"] for r in rs]),
         "moved_reuse": _pooled(rs, "moved_reuse_tokens")}
        for (n, cfg), rs in _by_fleet(rows).items()
    ]  # fmt: skip


def rows_of(paths: list[Path]) -> tuple[str, list[dict[str, Any]]]:
    """The kind and the rows of saved ``toolkv twin l3``/``fleet`` JSONs, each row with its run's
    ``seed``."""
    import json

    kinds, rows = set(), []
    for path in paths:
        data = json.loads(Path(path).read_text())
        kinds.add(data["kind"])
        rows += [{**r, "seed": data["args"].get("seed", 0)} for r in data["rows"]]
    if len(kinds) != 1:
        raise ValueError(f"the files hold runs of different kinds: {sorted(kinds)}")
    return kinds.pop(), rows


def table_of(path: Path) -> str:
    """The markdown table of a saved ``toolkv twin l3``/``fleet`` JSON (what docs/benchmarks.md shows)."""
    kind, rows = rows_of([path])
    return (l3_table if kind == "l3" else fleet_table)(rows)


def main(argv: list[str] | None = None) -> int:
    """``python -m toolkv.twin.l3report FILE.json``: print the table of a saved sweep.
    ``python -m toolkv.twin.l3report --seeds FILE.json ... [--plot PNG]``: fleet runs of several
    seeds (one file or more each), their summary over the seeds (:func:`seeds_table`), and with
    ``--plot`` its picture against the number of servers (:func:`pooled_rows`)."""
    import sys

    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["--seeds"] and len(args) > 1:
        files, png = args[1:], None
        if "--plot" in files:
            i = files.index("--plot")
            if i + 1 >= len(files):
                print("--plot needs a PNG path", file=sys.stderr)
                return 2
            png, files = Path(files[i + 1]), files[:i] + files[i + 2 :]
        kind, rows = rows_of([Path(a) for a in files])
        if kind != "fleet" or any("reuse_tokens" not in r for r in rows):
            print("--seeds takes fleet runs that record reuse_tokens (toolkv twin fleet)", file=sys.stderr)
            return 2
        print(seeds_table(rows))
        if png is not None:
            plot(pooled_rows(rows), png, "servers")
        return 0
    if len(args) != 1:
        print("usage: python -m toolkv.twin.l3report FILE.json | --seeds FILE.json [FILE.json ...] [--plot PNG]",
              file=sys.stderr)  # fmt: skip
        return 2
    print(table_of(Path(args[0])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
