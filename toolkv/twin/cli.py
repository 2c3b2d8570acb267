"""``toolkv twin``: run the agent benchmark's workload against a twin of one sglang server.

    toolkv twin [--configs stock,stock-large,offload,auto] [--regime constrained] [--opt]
                [--compare docs/results/agent/constrained] [--out DIR] [--json]
    toolkv twin sweep --host-gb 8,16,32,64 --configs stock,offload,auto --tool-shapes traces,long
                [--plot FILE.png] [--out FILE.json]
    toolkv twin speed [--sessions 1000 --duration 3600]       (the twin's own speed)
    toolkv twin l3 --host-gb 16,32,64,128 [--configs stock,stock-l3,toolkv,toolkv-l3] [--l3-read-gbps 5]
                [--plot FILE.png] [--out FILE.json]          (one server with an L3 store, long tools)
    toolkv twin fleet --servers 8,16,32,64 [--drain-share 0.25 --drain-at 300] [--out FILE.json]
                                                             (N servers sharing one L3, some drained)
    toolkv twin map [--map-sessions 24,48,96,192 --host-gb 8,16,32,64 --map-shapes traces,long,named
                --seeds 0,1,2,3,4 --jobs N] [--out FILE.json] [--plot FILE.png]
                                                             (the regime map: toolkv against stock)

The workload options are ``toolkv bench agent``'s (same generator, same seeds).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from toolkv.argtypes import (
    choice_list,
    int_list,
    nonneg_float,
    positive_float,
    positive_float_list,
    positive_int,
    seed,
    share,
    writable_file,
)
from toolkv.twin.configs import CONFIGS, REGIMES, WRITE_POLICIES, TwinConfig, get
from toolkv.twin.profile import profile_file
from toolkv.workload.plan import SHAPES, Workload

ACTIONS = ("run", "sweep", "speed", "l3", "fleet", "map")
# l3 and fleet run the long-tool shape of issue 27 (toolkv.twin.fleet.long_workload); their defaults
L3_DEFAULTS = {"l3": {"sessions": 8, "duration": 900.0}, "fleet": {"sessions": 6, "duration": 900.0}}
VALIDATED = "stock,stock-large,offload,auto"
# the l3 and fleet actions' configurations (toolkv.twin.fleet.FLEET_CONFIGS, which builds the twin to
# import; tests/test_cli_bounds.py checks the two agree)
FLEET_NAMES = ("stock", "stock-l3", "toolkv", "toolkv-l3", "stock-mc", "toolkv-mc")
# the default run's load (what ``toolkv twin`` runs with no workload flag): its output says how it
# differs from the README's headline
DEFAULT_LOAD = {"sessions": Workload().initial_sessions, "duration": 45.0, "first_tokens": Workload().first_tokens,
                "turns": Workload().turns_median, "arrival_rate": None}  # fmt: skip
# host pools of the actions that take a list of them
HOST_LISTS = {"sweep": [8.0, 16.0, 32.0, 64.0], "l3": [16.0, 32.0, 64.0, 128.0]}


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = Workload()
    p.add_argument(
        "action",
        nargs="?",
        choices=ACTIONS,
        default="run",
        help="run (default), sweep, speed, l3, fleet or map",
    )
    p.add_argument(
        "--configs", default=None, type=choice_list((*CONFIGS, *FLEET_NAMES, "stock4x"), every="all"),
        help=f"comma list of {', '.join(CONFIGS)} (or all; default {VALIDATED}); l3/fleet: of stock, stock-l3, "
        "toolkv, toolkv-l3, stock-mc, toolkv-mc (-mc: the shared store as Mooncake); map: of stock, offload, auto, "
        "stock4x (stock with 4x the host pool)",
    )  # fmt: skip
    p.add_argument("--regime", choices=sorted(REGIMES), default="constrained", help="device pool size")
    p.add_argument(
        "--device-tokens", type=positive_int, default=None, help="device pool tokens (overrides --regime)"
    )
    p.add_argument(
        "--host-gb",
        default=None,
        type=positive_float_list,
        help="HiCache host pool GB for the 16 GB configurations (sweep, l3: a comma list)",
    )
    p.add_argument(
        "--write-policy",
        default=None,
        type=choice_list(WRITE_POLICIES),
        help="sglang's --hicache-write-policy of the HiCache configurations (default write_through, the "
        "benchmarks'); map: a comma list, an axis of the map",
    )
    p.add_argument(
        "--profile",
        default=None,
        type=profile_file,
        help="time profile JSON (default: the built-in H200 profile)",
    )
    p.add_argument(
        "--opt", action="store_true", help="also compute the optimal-retention bound per configuration"
    )
    p.add_argument(
        "--compare", default=None,
        help="folder of toolkv bench agent JSON to compare with (matched by label), or one such JSON (matched by "
        "the agents' mode)",
    )  # fmt: skip
    p.add_argument(
        "--sessions", type=positive_int, default=None,
        help=f"sessions at the start (default {d.initial_sessions}; l3: 8; fleet: 6 per server)",
    )  # fmt: skip
    p.add_argument("--arrival-rate", type=nonneg_float, default=None, help="sessions/s after the ramp")
    p.add_argument("--turns", type=positive_int, default=d.turns_median, help="median turns per session")
    p.add_argument("--first-tokens", type=positive_int, default=d.first_tokens)
    p.add_argument("--growth", type=positive_int, default=d.growth_per_turn)
    p.add_argument("--output", type=positive_int, default=d.output_tokens)
    p.add_argument(
        "--max-context", type=positive_int, default=d.max_context,
        help="a session ends before its prompt + answer would exceed this (toolkv bench agent's)",
    )  # fmt: skip
    p.add_argument(
        "--ttl",
        type=positive_float,
        default=None,
        help="TOOLKV_TTL_S of the toolkv configurations (default theirs)",
    )
    p.add_argument("--tool-shape", choices=sorted(SHAPES), default=d.tool_shape)
    p.add_argument(
        "--tool-shapes",
        default="traces,long",
        type=choice_list(sorted(SHAPES)),
        help="sweep: comma list of tool shapes",
    )
    p.add_argument(
        "--duration", type=positive_float, default=None,
        help="seconds of arrivals and turns (default the suite's 45; l3 and fleet: 900)",
    )  # fmt: skip
    p.add_argument(
        "--warmup", type=nonneg_float, default=10.0, help="seconds after the ramp left out of the window"
    )
    p.add_argument("--seed", type=seed, default=d.seed)
    p.add_argument(
        "--plot", default=None, type=writable_file(".png", ".svg", ".pdf"), help="sweep: write the PNG here"
    )
    p.add_argument(
        "--out",
        default=None,
        help="run: a folder for one JSON per configuration + report.md; sweep: a JSON file",
    )
    p.add_argument("--json", action="store_true", help="print the results as JSON on stdout")
    p.add_argument(
        "--servers", default="8,16,32,64", type=int_list, help="fleet: comma list of server counts"
    )
    p.add_argument("--drain-share", type=share, default=0.25, help="fleet: share of the servers drained")
    p.add_argument("--drain-at", type=nonneg_float, default=300.0, help="fleet: when they are drained (s)")
    p.add_argument(
        "--l3-read-gbps",
        type=positive_float,
        default=5.0,
        help="l3/fleet: a server's L3 read GB/s (a parameter)",
    )
    p.add_argument(
        "--l3-write-gbps", type=positive_float, default=5.0, help="l3/fleet: a server's L3 write GB/s"
    )
    p.add_argument(
        "--l3-capacity-gb", type=positive_float, default=4000.0, help="l3/fleet: the shared L3 store's GB"
    )
    p.add_argument(
        "--l3-pin-share", type=share, default=None,
        help="fleet on Mooncake: share of the store toolkv's servers may soft-pin, split evenly "
        "(TOOLKV_L3_PIN_TOKENS each); unset: no cap",
    )  # fmt: skip
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    from toolkv.twin.regime_map import add_map_arguments

    add_map_arguments(p)


def workload(a: argparse.Namespace, tool_shape: str | None = None, **over: Any) -> Workload:
    kw: dict[str, Any] = dict(
        initial_sessions=a.sessions, arrival_rate=a.arrival_rate, turns_median=a.turns, first_tokens=a.first_tokens,
        growth_per_turn=a.growth, output_tokens=a.output, max_context=getattr(a, "max_context", Workload().max_context),
        tool_shape=tool_shape or a.tool_shape,
        duration_s=a.duration, seed=a.seed,
    )  # fmt: skip
    kw.update(over)
    return Workload(**kw)


def configs(a: argparse.Namespace, host_gb: float | None) -> list[TwinConfig]:
    names = list(CONFIGS) if a.configs == "all" else [n.strip() for n in a.configs.split(",") if n.strip()]
    out = []
    for n in names:
        c = get(n)
        if host_gb is not None and c.cache == "hiradix" and c.host_gb == 16.0:
            c = c.with_host_gb(host_gb)
        if getattr(a, "ttl", None) is not None and c.mode != "stock":
            c = replace(c, ttl_s=a.ttl)
        if getattr(a, "write_policy", None):
            c = c.with_write_policy(a.write_policy.split(",")[0])
        out.append(c)
    return out


def _profile(a: argparse.Namespace) -> Any:
    from toolkv.twin.profile import TimeProfile, default_profile

    return TimeProfile.load(a.profile) if a.profile else default_profile()


def _opts(a: argparse.Namespace) -> Any:
    from toolkv.twin.run import Options

    return Options(device_tokens=a.device_tokens if a.device_tokens is not None else REGIMES[a.regime])


def run_configs(
    a: argparse.Namespace, w: Workload, cfgs: list[TwinConfig], *, opt: bool, progress: bool
) -> list[dict[str, Any]]:
    """Each configuration over the same sessions (drawn lazily, identical to ``make_plan(w)``)."""
    from toolkv.twin.report import result
    from toolkv.twin.run import simulate
    from toolkv.twin.sessions import Sessions

    prof, opts = _profile(a), _opts(a)
    window = (w.ramp_s + a.warmup, w.duration_s)
    out = []
    for c in cfgs:
        o = simulate(Sessions.lazy(w), c, prof, opts, progress=progress)
        out.append(result(o, prof, window=window, opt=opt))
        if progress:
            print(f"{c.name}: {o.end_s:.0f} simulated s in {o.wall_s:.1f} CPU s", file=sys.stderr)
    return out


def do_run(a: argparse.Namespace) -> int:
    from toolkv.twin.report import explain, load_line, markdown, write

    host = a.host_gb[0] if a.host_gb else None
    w = workload(a)
    results = run_configs(a, w, configs(a, host), opt=a.opt, progress=not (a.quiet or a.json))
    default_load = all(getattr(a, k) == v for k, v in DEFAULT_LOAD.items())
    device = a.device_tokens if a.device_tokens is not None else REGIMES[a.regime]
    text = "\n\n".join([
        load_line(w, window=(w.ramp_s + a.warmup, w.duration_s), device_tokens=device,
                  regime=None if a.device_tokens else a.regime,
                  profile=a.profile or "the built-in H200 profile (docs/twin.md)"),
        markdown(results),
        explain(results, headline=default_load),
    ])  # fmt: skip
    cmp_rows: list[dict[str, Any]] = []
    if a.compare:
        from toolkv.twin.validate import compare, load_gpu, table

        cmp_rows = compare(results, load_gpu(Path(a.compare)))
        text += "\n\n" + table(cmp_rows)
    if a.out:
        write(results, Path(a.out))
        (Path(a.out) / "report.md").write_text(text + "\n")
    if a.json:
        slim = [{k: v for k, v in r.items() if k not in ("samples", "turns", "plan")} for r in results]
        print(json.dumps({"results": slim, "compare": cmp_rows}, indent=1, default=str))
    else:
        print(text)
    return 0 if all(r["passed"] for r in results) else 1


def do_sweep(a: argparse.Namespace) -> int:
    from toolkv.twin.sweep import plot, sweep

    hosts = a.host_gb or HOST_LISTS["sweep"]
    shapes = [s.strip() for s in a.tool_shapes.split(",") if s.strip()]
    rows = sweep(a, hosts, shapes)
    data = {"hosts_gb": hosts, "tool_shapes": shapes, "regime": a.regime, "rows": rows}
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(data, indent=1))
    if a.plot:
        plot(rows, Path(a.plot))
    if a.json:
        print(json.dumps(data, indent=1))
    else:
        from toolkv.twin.sweep import table

        print(table(rows))
    return 0


def do_speed(a: argparse.Namespace) -> int:
    """The twin's own speed: simulated seconds per CPU second on a long run (no assert anywhere)."""
    from toolkv.twin.run import simulate
    from toolkv.twin.sessions import Sessions

    out = []
    for c in configs(a, a.host_gb[0] if a.host_gb else None):
        sessions = Sessions.lazy(workload(a))
        t0 = time.process_time()
        o = simulate(sessions, c, _profile(a), _opts(a), progress=not (a.quiet or a.json))
        cpu = time.process_time() - t0
        out.append({
            "config": c.name, "sessions": len(sessions.starts), "turns": len(o.agents.turns), "iterations": o.iterations,
            "simulated_s": o.end_s, "cpu_s": cpu, "simulated_s_per_cpu_s": o.end_s / cpu if cpu else None,
            "crashed": o.crashed, "leaked": o.leaks.get("leaked"),
        })  # fmt: skip
    if a.json:
        print(json.dumps(out, indent=1))
    else:
        print(
            "| config | sessions | turns | scheduler iterations | simulated s | CPU s | simulated s per CPU s | run |"
        )
        print("|---|---|---|---|---|---|---|---|")
        for r in out:
            print(
                f"| {r['config']} | {r['sessions']:,} | {r['turns']:,} | {r['iterations']:,} | {r['simulated_s']:,.0f} "
                f"| {r['cpu_s']:,.0f} | {r['simulated_s_per_cpu_s']:.1f} | {r['crashed'] or 'completed'} |"
            )
    return 0


def do_l3(a: argparse.Namespace) -> int:
    """One server with an L3 store, host pool sweep (:mod:`toolkv.twin.l3report`)."""
    from toolkv.twin.l3report import l3_sweep, l3_table

    hosts = a.host_gb or HOST_LISTS["l3"]
    rows = l3_sweep(a, hosts)
    return _l3_out(
        a, {"kind": "l3", "hosts_gb": hosts, "args": _args(a), "rows": rows}, l3_table(rows), "host_gb"
    )


def do_fleet(a: argparse.Namespace) -> int:
    """N servers sharing one L3, a share of them drained (:mod:`toolkv.twin.l3report`)."""
    from toolkv.twin.l3report import fleet_sweep, fleet_table

    ns = list(a.servers)
    rows = fleet_sweep(a, ns)
    return _l3_out(
        a, {"kind": "fleet", "servers": ns, "args": _args(a), "rows": rows}, fleet_table(rows), "servers"
    )


def _args(a: argparse.Namespace) -> dict[str, Any]:
    keep = ("sessions", "duration", "seed", "regime", "device_tokens", "host_gb", "configs", "servers", "drain_share",
            "drain_at", "l3_read_gbps", "l3_write_gbps", "l3_capacity_gb", "l3_pin_share", "warmup", "profile")  # fmt: skip
    return {k: getattr(a, k) for k in keep}


def _l3_out(a: argparse.Namespace, data: dict[str, Any], text: str, x: str) -> int:
    from toolkv.twin.l3report import plot

    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(data, indent=1, default=str))
    if a.plot:
        plot(data["rows"], Path(a.plot), x)
    print(json.dumps(data, indent=1, default=str) if a.json else text)
    return 0 if all(r["passed"] for r in data["rows"]) else 1


def run(a: argparse.Namespace) -> int:
    d = Workload()
    if a.action == "map":
        from toolkv.twin.regime_map import main

        return main(a)
    extra = L3_DEFAULTS.get(a.action, {})
    if a.sessions is None:
        a.sessions = extra.get("sessions", d.initial_sessions)
    if a.duration is None:
        a.duration = extra.get("duration", 45.0)
    try:
        if a.host_gb and len(a.host_gb) > 1 and a.action not in HOST_LISTS:
            raise ValueError(f"--host-gb: one value for twin {a.action} (a comma list is for sweep and l3)")
        if a.write_policy and "," in a.write_policy:
            raise ValueError(f"--write-policy: one value for twin {a.action} (a comma list is for map)")
        if a.action in L3_DEFAULTS:
            bad = [n for n in (a.configs or "").split(",") if n.strip() and n.strip() not in FLEET_NAMES]
            if bad or a.configs == "all":
                raise ValueError(
                    f"--configs: twin {a.action} runs {', '.join(FLEET_NAMES)}; not {bad or 'all'}"
                )
        else:
            if a.configs is None:
                a.configs = VALIDATED
            bad = [n for n in a.configs.split(",") if n.strip() not in CONFIGS and n.strip() != "all"]
            if bad:
                raise ValueError(
                    f"--configs: {bad} are twin l3/fleet/map configurations; twin {a.action} runs "
                    f"{', '.join(CONFIGS)}"
                )
        if a.compare and not Path(a.compare).exists():
            raise ValueError(f"--compare: no such results folder or file: {a.compare}")
        workload(a)
    except ValueError as e:
        print(f"toolkv twin: error: {e}", file=sys.stderr)
        return 2
    return {"run": do_run, "sweep": do_sweep, "speed": do_speed, "l3": do_l3, "fleet": do_fleet}[a.action](a)
