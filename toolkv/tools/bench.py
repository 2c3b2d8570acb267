"""``toolkv bench overhead``: control-path CPU cost of the manager on the real HiRadixCache.

Measured per call with ``perf_counter_ns`` around exactly one manager call; the copies themselves are
excluded by construction (on CPU the copy engine is the controllable double, whose copies run only
when the benchmark completes them, outside the timed region). Reported: p50/p99 of ``tool_start``,
of the ``tick`` that finishes an offload (``WriteAck``), of ``tool_end`` (which queues the load), of
the ``tick`` that starts it (sglang's load ring idle), of the ``tick`` that finishes a restore (``LoadAck``), the mean idle ``tick``, and tracked-session memory, at 1k, 10k and
100k tracked sessions. Quoted against a reference measured in the same run: the cost of one empty
Python function call and of one ``dict`` lookup on this machine.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

from toolkv.argtypes import cuda_missing, device, int_list, int_tuple, positive_int, writable_file
from toolkv.core.phases import Phase
from toolkv.errors import InputError

RESULTS = "results/bench"  # git-ignored


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("what", choices=["overhead", "transfer"], help="which benchmark")
    p.add_argument(
        "--device", type=device, default="cpu", help="transfer: cpu, or cuda[:N] on the GPU machine"
    )
    p.add_argument(
        "--tokens", type=int_list, default="512,8192", help="transfer: tokens per offload (comma separated)"
    )
    p.add_argument(
        "--shape",
        type=int_tuple("layers", "kv_heads", "head_dim"),
        default="32,8,128",
        help="transfer: layers,kv_heads,head_dim (default: Llama-3-8B's)",
    )
    p.add_argument(
        "--sizes", default="1000,10000,100000", type=int_list, help="tracked sessions (comma separated)"
    )
    p.add_argument(
        "--samples", type=positive_int, default=1000, help="timed tool_start/tool_end cycles per size"
    )
    p.add_argument(
        "--out",
        type=writable_file(".json"),
        default=None,
        help=f"where to write the JSON results (default {RESULTS}/<what>.json, git-ignored; "
        "the committed figures in docs/bench/ are only ever replaced on purpose, with --out)",
    )
    p.add_argument(
        "--json", action="store_true", help="print the JSON results on stdout instead of the table"
    )


def output_path(args: argparse.Namespace) -> Path:
    """``--out``, else ``results/bench/<what>.json`` (git-ignored): a plain run never replaces the
    committed figures in docs/bench/."""
    return Path(args.out) if args.out is not None else Path(RESULTS) / f"{args.what}.json"


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _reference() -> dict[str, float]:
    def f() -> None:
        return None

    d = {i: i for i in range(1000)}
    n = 200_000
    t = time.perf_counter_ns()
    for _ in range(n):
        f()
    call = (time.perf_counter_ns() - t) / n / 1000
    t = time.perf_counter_ns()
    for i in range(n):
        d.get(i & 511)
    look = (time.perf_counter_ns() - t) / n / 1000
    return {"empty_call_us": call, "dict_get_us": look}


SGLANG_PRIMITIVES = (
    "write_backup",
    "load_back",
    "_evict_backuped",
    "ready_to_load_host_cache",
    "inc_lock_ref",
    "dec_lock_ref",
)


class PrimitiveClock:
    """Accumulates time spent inside sglang's own primitives during a timed manager call, so the
    report can separate toolkv's control path from the sglang work it asks for. It wraps the
    methods on the one tree instance being measured (instance attributes; the class is untouched)."""

    def __init__(self, tree: Any) -> None:
        self.ns = 0
        for name in SGLANG_PRIMITIVES:
            setattr(tree, name, self._wrap(getattr(tree, name)))

    def _wrap(self, fn: Any) -> Any:
        def timed(*a: Any, **k: Any) -> Any:
            t = time.perf_counter_ns()
            try:
                return fn(*a, **k)
            finally:
                self.ns += time.perf_counter_ns() - t

        return timed

    def take(self) -> float:
        ns, self.ns = self.ns, 0
        return ns / 1000


def measure(n_sessions: int, samples: int, log: Any) -> dict[str, Any]:
    from toolkv.core.manager import ManagerConfig, ToolKVManager
    from toolkv.testing.harness import CacheHarness, HarnessConfig

    tok = 16  # tokens per session; tiny KV shape: the bench measures control flow, not bytes
    cfg = HarnessConfig(
        device_tokens=(n_sessions + samples + 64) * tok,
        host_ratio=2.0,
        layers=1,
        heads=1,
        head_dim=1,
        write_policy="write_through_selective",
        max_reqs=2,
    )
    h = CacheHarness(cfg)
    try:
        m = ToolKVManager(h.tree, config=ManagerConfig(ttl_s=1e9, adaptive=False, lazy_free=False))
        import torch

        t0 = time.perf_counter()
        base = torch.arange(1, n_sessions * tok + 1)
        idx_all = h.allocator.alloc(n_sessions * tok)
        tracemalloc.start()
        mem0 = tracemalloc.get_traced_memory()[0]
        rec_bytes = 0
        for i in range(n_sessions):
            toks = [i + 1, *base[i * tok + 1 : (i + 1) * tok].tolist()]
            h.insert(toks, idx_all[i * tok : (i + 1) * tok])
            before = tracemalloc.get_traced_memory()[0]
            m.insert(f"s{i}", toks)
            rec_bytes += tracemalloc.get_traced_memory()[0] - before
            if (i + 1) % max(1, n_sessions // 4) == 0:
                log(f"  {n_sessions:>7} sessions: tracked {i + 1} ({time.perf_counter() - t0:.1f}s)")
        tracemalloc.stop()
        del mem0
        gc.collect()

        # idle tick: nothing pending, nothing due
        reps = 20_000
        t = time.perf_counter_ns()
        for k in range(reps):
            m.tick(1.0 + k * 1e-6)
        idle = (time.perf_counter_ns() - t) / reps / 1000

        starts, ack_ticks, ends, start_ticks, load_ticks = [], [], [], [], []
        prim: dict[str, list[float]] = {
            k: [] for k in ("tool_start", "tick_write_ack", "tool_end", "tick_load_start", "tick_load_ack")
        }
        clock = PrimitiveClock(h.tree)
        gc.disable()
        now = 2.0
        for j in range(samples):
            sid = f"s{(j * 7919) % n_sessions}"
            if m.sessions[sid].state != Phase.RUNNING:
                continue
            clock.take()
            t = time.perf_counter_ns()
            r = m.tool_start(sid)
            starts.append((time.perf_counter_ns() - t) / 1000)
            prim["tool_start"].append(clock.take())
            h.complete("write")
            h.check_events()
            now += 1
            clock.take()
            t = time.perf_counter_ns()
            m.tick(now)
            ack_ticks.append((time.perf_counter_ns() - t) / 1000)
            prim["tick_write_ack"].append(clock.take())
            t = time.perf_counter_ns()
            m.tool_end(sid, int(r["epoch"]))  # type: ignore[call-overload]
            ends.append((time.perf_counter_ns() - t) / 1000)
            prim["tool_end"].append(clock.take())
            # tool_end only queues the load; the next tick starts it once sglang's load ring is idle
            now += 1
            t = time.perf_counter_ns()
            m.tick(now)
            start_ticks.append((time.perf_counter_ns() - t) / 1000)
            prim["tick_load_start"].append(clock.take())
            h.complete("load")
            h.check_events()
            now += 1
            clock.take()
            t = time.perf_counter_ns()
            m.tick(now)
            load_ticks.append((time.perf_counter_ns() - t) / 1000)
            prim["tick_load_ack"].append(clock.take())
            m.admit(sid)  # the next request holds the restored KV (spec Admit: the hand-over's pin ends)
            m.insert(sid, m.sessions[sid].tokens.tolist())  # its turn ends: Running again
        gc.enable()
        assert all(r.state == Phase.RUNNING for r in m.sessions.values())

        def row(xs: list[float], key: str) -> dict[str, float]:
            own = [x - p for x, p in zip(xs, prim[key], strict=True)]
            return {
                "p50_us": statistics.median(xs),
                "p99_us": _pct(xs, 0.99),
                "max_us": max(xs),
                "n": len(xs),
                "sglang_p50_us": statistics.median(prim[key]),
                "toolkv_p50_us": statistics.median(own),
                "toolkv_p99_us": _pct(own, 0.99),
            }

        return {
            "sessions": n_sessions,
            "tool_start": row(starts, "tool_start"),
            "tick_write_ack": row(ack_ticks, "tick_write_ack"),
            "tool_end": row(ends, "tool_end"),
            "tick_load_start": row(start_ticks, "tick_load_start"),
            "tick_load_ack": row(load_ticks, "tick_load_ack"),
            "idle_tick_us": idle,
            "bytes_per_tracked_session": rec_bytes / n_sessions,
        }
    finally:
        h.close()


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


def transfer(args: argparse.Namespace) -> int:
    """GB/s of a whole offload (tool_start until the GPU copy is freed) and restore (tool_end until
    Runnable) through the real HiRadixCache, next to a raw pinned ``copy_`` of the same bytes
    measured in the same run. Meaningful on a GPU; on CPU the copy engine is the test double."""
    import torch

    from toolkv.core.manager import ManagerConfig, ToolKVManager
    from toolkv.testing.harness import CacheHarness, HarnessConfig

    dev = args.device
    problem = cuda_missing(dev)
    if problem is not None:
        raise InputError(problem)
    layers, heads, dim = args.shape
    sizes: list[int] = list(args.tokens)
    dtype = torch.bfloat16
    per_token = 2 * layers * heads * dim * dtype.itemsize
    page = 16
    cap = (max(sizes) * 2 // page + 4) * page
    cfg = HarnessConfig(
        device=dev,
        io_backend="kernel" if dev.startswith("cuda") else "direct",
        page_size=page,
        device_tokens=cap,
        host_ratio=2.0,
        layers=layers,
        heads=heads,
        head_dim=dim,
        dtype=dtype,
    )
    h = CacheHarness(cfg)
    rows = []

    def sync() -> None:
        if dev.startswith("cuda"):
            torch.cuda.synchronize()

    try:
        m = ToolKVManager(h.tree, config=ManagerConfig(ttl_s=1e9, adaptive=False, lazy_free=False))
        h.tree.write_through_threshold = 10**9  # the offload itself does the writes
        now = 0.0
        # Warm-up: the first transfer JIT-compiles sglang's copy kernels; time only warm calls.
        sizes = [min(sizes), *sizes]
        for k, n in enumerate(sizes):
            nbytes = n * per_token
            src = torch.randn(nbytes // 2, dtype=torch.bfloat16, device=dev)
            host = torch.empty(nbytes // 2, dtype=torch.bfloat16, pin_memory=dev.startswith("cuda"))
            raw_d2h, raw_h2d = [], []
            for _ in range(5):
                sync()
                t = time.perf_counter()
                host.copy_(src, non_blocking=True)
                sync()
                raw_d2h.append(time.perf_counter() - t)
                t = time.perf_counter()
                src.copy_(host, non_blocking=True)
                sync()
                raw_h2d.append(time.perf_counter() - t)
            del src, host
            tokens = list(range(1 + k * 10**7, 1 + k * 10**7 + n))
            idx = h.allocator.alloc(n)
            assert idx is not None, "device pool too small"
            h.fill_kv(idx, tokens)
            h.insert(tokens, idx)
            sid = f"bench{k}"
            m.insert(sid, tokens)
            before = h.device_kv(idx).float()
            sync()
            t = time.perf_counter()
            r = m.tool_start(sid)
            h.synchronize()
            h.check_events()
            now += 1
            m.tick(now)
            sync()
            t_off = time.perf_counter() - t
            assert m.kv_meta(sid)["state"] == Phase.OFFLOADED, m.kv_meta(sid)
            t = time.perf_counter()
            m.tool_end(sid, int(r["epoch"]))  # type: ignore[call-overload]
            now += 1
            m.tick(now)  # starts the queued load (sglang's load ring is idle)
            h.synchronize()
            h.check_events()
            now += 1
            m.tick(now)
            sync()
            t_on = time.perf_counter() - t
            assert m.kv_meta(sid)["state"] == Phase.RUNNABLE, m.kv_meta(sid)
            node_idx = torch.cat(
                [
                    x.value
                    for x in __import__("toolkv.core.treeops", fromlist=["path_to"]).path_to(
                        h.tree, m.sessions[sid].node
                    )
                ]
            )
            same = bool(torch.equal(h.device_kv(node_idx).float(), before))
            m.close(sid)
            if k == 0:
                continue  # the warm-up transfer (JIT compilation of the copy kernels) is not reported
            rows.append(
                {
                    "tokens": n,
                    "bytes": nbytes,
                    "raw_d2h_gbps": _gbps(nbytes, min(raw_d2h)),
                    "raw_h2d_gbps": _gbps(nbytes, min(raw_h2d)),
                    "offload_gbps": _gbps(nbytes, t_off),
                    "restore_gbps": _gbps(nbytes, t_on),
                    "offload_ms": t_off * 1e3,
                    "restore_ms": t_on * 1e3,
                    "bytes_identical": same,
                }
            )
    finally:
        h.close()
    out = {"device": dev, "shape": [layers, heads, dim], "dtype": "bfloat16", "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    if args.json:
        print(json.dumps(out, indent=2))
        return 0 if all(r["bytes_identical"] for r in rows) else 1
    print(
        f"{'tokens':>7} | {'MiB':>7} | {'raw d2h':>8} | {'offload':>8} | {'ratio':>6} | {'raw h2d':>8} | "
        f"{'restore':>8} | {'ratio':>6} | identical"
    )
    for row in rows:
        print(
            f"{row['tokens']:>7} | {row['bytes'] / 2**20:>7.1f} | {row['raw_d2h_gbps']:>8.1f} | "
            f"{row['offload_gbps']:>8.1f} | {row['offload_gbps'] / row['raw_d2h_gbps']:>6.2f} | "
            f"{row['raw_h2d_gbps']:>8.1f} | {row['restore_gbps']:>8.1f} | "
            f"{row['restore_gbps'] / row['raw_h2d_gbps']:>6.2f} | {row['bytes_identical']}"
        )
    print(
        "GB/s; ratio = toolkv / raw pinned copy of the same bytes in the same run. Whole calls timed: "
        "tool_start..GPU copy freed, tool_end..Runnable (control path + sglang + DMA)."
    )
    return 0 if all(r["bytes_identical"] for r in rows) else 1


OVERHEAD_CALLS = ("tool_start", "tick_write_ack", "tool_end", "tick_load_start", "tick_load_ack")


def overhead_tables(data: dict[str, Any]) -> str:
    """The two markdown tables of docs/benchmarks.md's control-path section, from the JSON that
    ``toolkv bench overhead --out`` writes (tests/test_bench_overhead.py checks the docs hold them)."""
    lines = [
        "| tracked sessions | call | all p50 µs | all p99 µs | sglang p50 µs | toolkv p50 µs | toolkv p99 µs |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in data["results"]:
        for call in OVERHEAD_CALLS:
            c = r[call]
            lines.append(
                f"| {r['sessions']:,} | `{call}` | {c['p50_us']:.0f} | {c['p99_us']:.0f} | {c['sglang_p50_us']:.0f} "
                f"| {c['toolkv_p50_us']:.0f} | {c['toolkv_p99_us']:.0f} |"
            )
    empty = data["reference"]["empty_call_us"]
    lines += [
        "",
        "| tracked sessions | idle tick (mean) | vs empty call | memory per tracked session |",
        "|---|---|---|---|",
    ]
    for r in data["results"]:
        lines.append(
            f"| {r['sessions']:,} | {r['idle_tick_us']:.2f} µs | {r['idle_tick_us'] / empty:.1f}× "
            f"| {r['bytes_per_tracked_session']:.0f} B |"
        )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    args.out = output_path(args)
    if args.what == "transfer":
        return transfer(args)
    import logging

    logging.getLogger("toolkv").setLevel(logging.WARNING)
    sizes: list[int] = args.sizes

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    ref = _reference()
    results = []
    for n in sizes:
        log(f"measuring with {n} tracked sessions ...")
        results.append(measure(n, args.samples, log))
    out = {
        "reference": ref,
        "results": results,
        "python": sys.version.split()[0],
        "targets": {"call_p99_us": 50, "idle_tick_us": 2},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"reference: empty Python call {ref['empty_call_us']:.3f} us, dict.get {ref['dict_get_us']:.3f} us")
    print("all = the whole manager call; sglang = time inside sglang's primitives it calls (write_backup,")
    print("load_back, _evict_backuped, ready_to_load_host_cache, lock refs); toolkv = all - sglang")
    hdr = (
        f"{'sessions':>9} | {'call':<15} | {'all p50':>8} | {'all p99':>8} | {'sglang p50':>10} | "
        f"{'toolkv p50':>10} | {'toolkv p99':>10} | {'toolkv p99/empty call':>21}"
    )
    print(hdr)
    print("-" * len(hdr))
    for r in results:
        for k in ("tool_start", "tick_write_ack", "tool_end", "tick_load_start", "tick_load_ack"):
            x = r[k]
            print(
                f"{r['sessions']:>9} | {k:<15} | {x['p50_us']:>8.1f} | {x['p99_us']:>8.1f} | "
                f"{x['sglang_p50_us']:>10.1f} | {x['toolkv_p50_us']:>10.1f} | {x['toolkv_p99_us']:>10.1f} | "
                f"{x['toolkv_p99_us'] / ref['empty_call_us']:>20.0f}x"
            )
        print(
            f"{r['sessions']:>9} | {'idle tick':<15} | {r['idle_tick_us']:>8.3f} | {'(mean)':>8} | "
            f"{r['idle_tick_us'] / ref['empty_call_us']:>13.1f}x"
        )
        print(f"{r['sessions']:>9} | {'memory/session':<15} | {r['bytes_per_tracked_session']:>8.0f} B")
    print(f"results written to {args.out}")
    return 0
