"""``toolkv demo``: agent sessions with multi-turn tool calls over a real HiRadixCache on CPU.

The embedded default needs no GPU and no server: the real sglang cache stack runs on CPU with the
controllable copy engine standing in for the GPU's DMA (see docs/testing.md).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from dataclasses import fields
from pathlib import Path

from toolkv.argtypes import nonneg_int, positive_int, probability, seed, writable_file
from toolkv.errors import InputError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sessions", type=positive_int, default=8, help="concurrent agent sessions (default 8)")
    p.add_argument("--turns", type=positive_int, default=4, help="generation turns per session (default 4)")
    p.add_argument("--page-size", type=positive_int, default=1, choices=(1, 16))
    p.add_argument("--device-tokens", type=positive_int, default=4096, help="GPU KV pool size in tokens")
    p.add_argument(
        "--abandon", type=probability, default=0.1, help="probability a client never calls tool_end"
    )
    p.add_argument(
        "--ttl", type=positive_int, default=60, help="TTL of a protection, in scheduler iterations"
    )
    p.add_argument("--seed", type=seed, default=0)
    p.add_argument(
        "--json", action="store_true", help="print the full report as JSON on stdout instead of text"
    )
    p.add_argument(
        "--out", type=writable_file(".json"), metavar="FILE.json", help="also write the JSON report here"
    )
    p.add_argument(
        "--plot",
        type=writable_file(".png", ".svg", ".pdf"),
        metavar="FILE.png",
        help="draw pool occupancy over time",
    )
    p.add_argument(
        "--timeline", type=nonneg_int, default=40, help="timeline lines to print (default 40, 0: none)"
    )
    p.add_argument(
        "--no-compare", action="store_true",
        help="do not also run the same sessions without toolkv (the comparison printed after the summary)",
    )  # fmt: skip


def _bar(total: int, enabled: bool) -> object:
    from tqdm import tqdm

    return tqdm(
        total=total, desc="sessions done", unit="session", file=sys.stderr, disable=not enabled, leave=False
    )


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("toolkv").setLevel(logging.ERROR)  # the timeline already says it
    from toolkv.tools.sim import DemoConfig, Simulation

    cfg = DemoConfig(
        sessions=args.sessions,
        turns=args.turns,
        page_size=args.page_size,
        device_tokens=args.device_tokens,
        abandon_prob=args.abandon,
        ttl_ticks=args.ttl,
        seed=args.seed,
    )
    # refused before the cache is built, not reported as a failed run or a traceback
    if cfg.device_tokens % cfg.page_size:
        raise InputError(
            f"--device-tokens {cfg.device_tokens}: the pool is allocated in whole pages, "
            f"expected a multiple of --page-size {cfg.page_size}"
        )
    least = cfg.min_device_tokens()
    if cfg.device_tokens < least:
        raise InputError(
            f"--device-tokens {cfg.device_tokens}: the GPU pool must hold a session's longest prompt, "
            f"{cfg.shared_prefix} shared + {cfg.turns} turns x up to {cfg.turn_tokens[1]} tokens = {least} "
            f"(with --turns {cfg.turns}); use at least {least}"
        )
    print("toolkv demo: building a real sglang HiRadixCache on CPU ...", file=sys.stderr)
    sim = Simulation(cfg)
    bar = _bar(cfg.sessions, enabled=not args.json and sys.stderr.isatty())
    last = [0]

    def progress(done: int) -> None:
        if done > last[0]:
            bar.update(done - last[0])  # type: ignore[attr-defined]
            last[0] = done

    report = sim.run(progress)
    bar.close()  # type: ignore[attr-defined]
    sim.close()
    without = None
    if not args.no_compare:  # the same sessions, sglang's cache alone
        from dataclasses import replace

        print("toolkv demo: the same sessions without toolkv ...", file=sys.stderr)
        stock = Simulation(replace(cfg, toolkv=False))
        without = stock.run()
        stock.close()
        report.counters["without_toolkv"] = {  # type: ignore[assignment]
            "resumed_prompt_tokens": without.resumed_prompt_tokens,
            "resumed_cached_tokens": without.resumed_cached_tokens,
            "scheduler_iterations": without.ticks,
        }
    if args.plot:
        plot(report, str(args.plot))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report.to_json(), indent=2) + "\n")
    if args.json:
        print(json.dumps(report.to_json(), indent=2))
    else:
        print_report(report, args.timeline)
        if without is not None:
            print_comparison(report, without)
    problems = failures(report)
    if problems:  # the exit status is 1: say why, after the summary, in one line
        print(f"toolkv demo: FAILED: {'; '.join(problems)}", file=sys.stderr)
    return 1 if problems else 0


def failures(r: object) -> list[str]:
    """What makes a run fail (exit status 1): leaked counters, restored bytes that differ, sessions
    that did not finish within the iteration limit. Empty when the run passed."""
    from toolkv.tools.sim import DemoReport

    assert isinstance(r, DemoReport)
    out = []
    if r.leaks["count"]:
        out.append(f"{r.leaks['count']} counter(s) not back to initial: {r.leaks['differences']}")
    if r.restore_mismatches:
        out.append(f"{r.restore_mismatches} restore(s) with differing bytes")
    if r.leaks["sessions_unfinished"]:
        out.append(
            f"{r.leaks['sessions_unfinished']} session(s) unfinished after {r.ticks} scheduler iterations "
            "(the iteration limit)"
        )
    return out


def print_report(r: object, timeline: int) -> None:
    from toolkv.tools.sim import DemoReport

    assert isinstance(r, DemoReport)
    if timeline:
        print(
            f"timeline (first {min(timeline, len(r.timeline))} of {len(r.timeline)} events; t= counts scheduler "
            f"iterations: a tool runs {r.config['tool_ticks'][0]}-{r.config['tool_ticks'][1]} of them, a GPU<->host "
            f"copy {r.config['dma_ticks']})"
        )
        for line in r.timeline[:timeline]:
            print("  " + line)
        print()
    rows = [
        ("sessions", r.sessions),
        ("generation turns", r.turns),
        ("tool calls offloaded", r.tool_calls),
        ("tokens offloaded (tool_start)", r.tokens_offloaded),
        ("tokens restored (host->GPU)", r.tokens_restored),
        ("restores verified byte-identical", f"{r.restores_verified} ({r.bytes_verified:,} bytes)"),
        ("restores or prefixes with differing bytes", r.restore_mismatches),
        ("GPU tokens freed during tool calls", r.device_tokens_freed),
        ("peak GPU tokens freed at once", r.peak_device_freed_during_tools),
        ("sessions expired by TTL", r.expired),
        ("restores deferred (no GPU memory)", r.deferred_restores),
        ("restores parked (loaded at admission)", r.parked_restores),
        ("reused prefixes checked (bytes)", f"{r.prefix_bytes_checked:,}"),
        ("offloads refused (host full / KV lost)", r.refused_offloads),
        ("scheduler iterations", r.ticks),
        ("leaks (counters not back to initial)", r.leaks["count"]),
    ]
    if r.leaks["sessions_unfinished"]:
        rows.append(("sessions unfinished (iteration limit)", r.leaks["sessions_unfinished"]))
    width = max(len(k) for k, _ in rows)
    print("summary")
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")
    if r.leaks["count"]:
        print("  LEAKED:", r.leaks["differences"])


def print_comparison(r: object, without: object) -> None:
    """The same sessions (same prompts, tools and clients, one seed) on the same cache without toolkv,
    beside the run with it: what the resumed turns found in the cache, what they computed."""
    from toolkv.tools.sim import DemoReport

    assert isinstance(r, DemoReport) and isinstance(without, DemoReport)

    def share(x: DemoReport) -> str:
        return f"{x.resumed_cached_tokens:,} ({100 * x.resumed_cached_tokens / max(1, x.resumed_prompt_tokens):.0f} %)"

    rows = [
        ("resumed-turn prompt tokens", f"{r.resumed_prompt_tokens:,}", f"{without.resumed_prompt_tokens:,}"),
        ("  of them from the cache", share(r), share(without)),
        ("  of them computed (tool results too)", f"{r.resumed_prompt_tokens - r.resumed_cached_tokens:,}",
         f"{without.resumed_prompt_tokens - without.resumed_cached_tokens:,}"),
        ("scheduler iterations", f"{r.ticks:,}", f"{without.ticks:,}"),
    ]  # fmt: skip
    width = max(len(k) for k, _, _ in rows)
    print()
    print("the same sessions without toolkv (sglang's HiRadixCache alone)")
    print(f"  {'':<{width}}  {'with toolkv':>14}  {'without':>14}")
    for k, a, b in rows:
        print(f"  {k:<{width}}  {a:>14}  {b:>14}")
    if r.resumed_cached_tokens <= without.resumed_cached_tokens:
        print(
            "  Here sglang's host pool (3x the GPU pool) keeps every session without toolkv too,\n"
            "  so sglang alone reuses as much, in fewer iterations (toolkv's restores wait for their copies):\n"
            "  this run shows toolkv's mechanism (offload, protection, TTL, byte-identical restores), not its\n"
            "  gain, which needs a host pool that cannot hold every paused session (README, docs/benchmarks.md)."
        )


def plot(r: object, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from toolkv.tools.sim import DemoReport, Sample

    assert isinstance(r, DemoReport)
    names = [f.name for f in fields(Sample)]
    cols = {n: [getattr(s, n) for s in r.samples] for n in names}
    fig, ax = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    ax[0].plot(cols["tick"], cols["device_used"], label="GPU pool used (tokens)")
    ax[0].plot(cols["tick"], cols["host_used"], label="host pool used (tokens)")
    ax[0].plot(cols["tick"], cols["protected"], label="protected by toolkv (tokens)")
    ax[0].set_ylabel("tokens")
    ax[0].legend(loc="upper left", fontsize=8)
    ax[0].set_title("toolkv demo: KV pool occupancy over scheduler iterations")
    ax[1].step(cols["tick"], cols["offloaded_sessions"], label="sessions in a tool call (offloaded)")
    ax[1].step(cols["tick"], cols["running_sessions"], label="sessions generating / runnable")
    ax[1].set_xlabel("scheduler iteration")
    ax[1].set_ylabel("sessions")
    ax[1].legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot written to {path}", file=sys.stderr)
