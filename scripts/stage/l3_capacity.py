"""Helpers of scripts/gpu_l3_capacity.sh (not a test, not part of the toolkv package).

    python scripts/stage/l3_capacity.py disk DIR --out disk.json     the disk's write / read rate under DIR
    python scripts/stage/l3_capacity.py quiet DIR [--limit S]        wait for HiCacheFile's writes, count L3
    python scripts/stage/l3_capacity.py report RUNS [--disk disk.json] the L3 evidence and the × stock64 table

``disk``: one file of ``--mb`` MiB written in 16-MiB blocks and fsync'd, then read back with
O_DIRECT (the page cache bypassed; where the filesystem refuses O_DIRECT, after
``posix_fadvise(DONTNEED)``, which needs no privilege; the JSON says which); then ``--files``
files of 128 KiB (one token of Llama-3.1-8B's KV, the page HiCacheFile writes at page size 1)
written through a temporary name and renamed, as HiCacheFile does, and read back. Also the
filesystem's type, size and free space. Every probe file is removed.

``quiet``: HiCache writes to L3 in a background thread after the host copy; this waits until no
temporary file is left and the page count has not moved for ``--stable`` seconds (at most
``--limit``), then prints one JSON line (the script keeps it as ``<config>.l3.txt``): pages (``*.bin``), bytes, files in flight, seconds waited.

``report RUNS``: RUNS holds ``r<k>/<config>.json`` (agent_bench), ``<config>.metrics.before`` /
``.after`` (the server's /metrics around the bench), ``<config>.l3.txt`` (``quiet`` after the
bench, L3 servers only) and ``<config>.decisions.txt`` (the server's toolkv decision lines during
the bench). Prints (1) per run and config: sglang's L3 counters (``backuped_tokens_total``: tokens
written to L3, ``prefetched_tokens_total``: tokens read from L3), toolkv's L3 counters
(``tokens_total{kind=l3_stored}``, ``events_total`` l3_store / l3_prefetch / l3_restored /
tool_end_l3 / demoted_l3), the L3 directory after the bench, and the decision lines (all, and those
naming ``l3=``); (2) each config against stock64 of the same run (closed turns/s, resumed TTFT
p90, reuse: the issue's target is toolkv16l3 at >= 0.8x stock64), from value_report's rows.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import mmap
import os
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Any

MiB = 1 << 20
PAGE = 128 << 10  # one token of Llama-3.1-8B's KV in bf16: 32 layers x 8 heads x 128 x 2 (K, V) x 2 bytes


def _fs_of(path: Path) -> dict[str, Any]:
    """The mount holding ``path`` (/proc/mounts: the longest mount point that is a prefix)."""
    best = ("", "?", "?")
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            dev, mnt, typ = line.split()[:3]
            if (str(path) + "/").startswith(mnt.rstrip("/") + "/") and len(mnt) >= len(best[0]):
                best = (mnt, typ, dev)
    except OSError:
        pass
    du = shutil.disk_usage(path)
    return {"mount": best[0], "fs_type": best[1], "device": best[2], "size_gb": round(du.total / 1e9, 1),
            "free_gb": round(du.free / 1e9, 1)}  # fmt: skip


def _aligned(n: int) -> mmap.mmap:
    buf = mmap.mmap(-1, n)  # page-aligned, as O_DIRECT needs
    buf.write(os.urandom(MiB) * (n // MiB))
    return buf


def disk(a: argparse.Namespace) -> int:
    d = Path(a.dir)
    d.mkdir(parents=True, exist_ok=True)
    res: dict[str, Any] = {"dir": str(d), **_fs_of(d)}
    block = 16 * MiB
    n = max(1, a.mb * MiB // block)
    buf = _aligned(block)
    f = d / "probe.bin"
    try:
        t0 = time.perf_counter()
        fd = os.open(f, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        for _ in range(n):
            os.write(fd, buf)
        os.fsync(fd)
        os.close(fd)
        dt = time.perf_counter() - t0
        res["seq_write"] = {"mib": n * 16, "s": round(dt, 3), "mb_per_s": round(n * block / 1e6 / dt)}
        try:
            fd = os.open(f, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
            how = "O_DIRECT"
            t0 = time.perf_counter()
            while os.readv(fd, [buf]) > 0:
                pass
        except OSError:
            fd = os.open(f, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            how = "fadvise DONTNEED (O_DIRECT refused)"
            t0 = time.perf_counter()
            while os.read(fd, block):
                pass
        dt = time.perf_counter() - t0
        os.close(fd)
        res["seq_read"] = {
            "mib": n * 16,
            "s": round(dt, 3),
            "mb_per_s": round(n * block / 1e6 / dt),
            "how": how,
        }
    finally:
        f.unlink(missing_ok=True)
    # the HiCacheFile pattern: one 128-KiB file per page, written to a temporary name and renamed
    sub = d / "probe_pages"
    sub.mkdir(exist_ok=True)
    page = os.urandom(PAGE)
    os.sync()  # what others left dirty (the bundle's install) is not timed here
    try:
        t0 = time.perf_counter()
        for i in range(a.files):
            tmp = sub / f"{i}.bin.tmp.x"
            with open(tmp, "wb") as fh:
                fh.write(page)
            os.replace(tmp, sub / f"{i}.bin")
        os.sync()
        dt = time.perf_counter() - t0
        res["page_write"] = {"files": a.files, "s": round(dt, 3), "files_per_s": round(a.files / dt),
                             "mb_per_s": round(a.files * PAGE / 1e6 / dt), "synced": True}  # fmt: skip
        for i in range(a.files):  # out of the page cache first (no privilege needed)
            fd = os.open(sub / f"{i}.bin", os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
        t0 = time.perf_counter()
        for i in range(a.files):
            with open(sub / f"{i}.bin", "rb") as fh:
                fh.read()
        dt = time.perf_counter() - t0
        res["page_read"] = {"files": a.files, "s": round(dt, 3), "files_per_s": round(a.files / dt),
                            "mb_per_s": round(a.files * PAGE / 1e6 / dt), "how": "fadvise DONTNEED"}  # fmt: skip
    finally:
        shutil.rmtree(sub, ignore_errors=True)
    Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    print(disk_line(res))
    return 0


def disk_line(r: dict[str, Any]) -> str:
    def g(k: str, f: str) -> Any:
        return (r.get(k) or {}).get(f, "?")

    return (
        f"L3 disk ({r['fs_type']} on {r['device']}, mount {r['mount']}, {r['free_gb']} of"
        f" {r['size_gb']} GB free): sequential write {g('seq_write', 'mb_per_s')} MB/s (fsync), read"
        f" {g('seq_read', 'mb_per_s')} MB/s ({g('seq_read', 'how')}); 128-KiB pages: write"
        f" {g('page_write', 'files_per_s')} files/s ({g('page_write', 'mb_per_s')} MB/s), read"
        f" {g('page_read', 'files_per_s')} files/s ({g('page_read', 'mb_per_s')} MB/s)"
    )


def l3_count(d: Path) -> tuple[int, int, int]:
    """(pages, bytes, writes in flight) in an L3 directory (HiCacheFile: ``KEY.bin`` via a temp name)."""
    pages = size = tmp = 0
    with os.scandir(d) as it:
        for e in it:
            if ".tmp" in e.name:
                tmp += 1
            elif e.name.endswith(".bin"):
                pages += 1
                with contextlib.suppress(OSError):
                    size += e.stat().st_size
    return pages, size, tmp


def quiet(a: argparse.Namespace) -> int:
    d = Path(a.dir)
    t0 = time.monotonic()
    last, since = -1, t0
    while True:
        pages, size, tmp = l3_count(d)
        if pages != last or tmp:
            last, since = pages, time.monotonic()
        elif time.monotonic() - since >= a.stable:
            break
        if time.monotonic() - t0 > a.limit:
            break
        time.sleep(0.5)
    print(json.dumps({"pages": pages, "bytes": size, "in_flight": tmp, "waited_s": round(time.monotonic() - t0, 1),
                      "quiet": tmp == 0 and time.monotonic() - since >= a.stable}))  # fmt: skip
    return 0


_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


def metric_sum(text: str, name: str, **labels: str) -> float | None:
    """The sum of a metric's samples whose labels include ``labels`` (None: no sample)."""
    total, seen = 0.0, False
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if not m or m.group(1) != name:
            continue
        lab = m.group(2) or ""
        if all(f'{k}="{v}"' in lab for k, v in labels.items()):
            total += float(m.group(3))
            seen = True
    return total if seen else None


# (column, metric, labels): the L3 evidence, as increments over the bench
COUNTERS = (
    ("sglang L3 written (tokens)", "sglang:backuped_tokens_total", {}),
    ("sglang L3 read (tokens)", "sglang:prefetched_tokens_total", {}),
    ("toolkv l3_stored tokens", "toolkv:tokens_total", {"kind": "l3_stored"}),
    ("l3_store", "toolkv:events_total", {"event": "l3_store"}),
    ("l3_prefetch", "toolkv:events_total", {"event": "l3_prefetch"}),
    ("l3_restored", "toolkv:events_total", {"event": "l3_restored"}),
    ("tool_end_l3", "toolkv:events_total", {"event": "tool_end_l3"}),
    ("demoted_l3", "toolkv:events_total", {"event": "demoted_l3"}),
)


def _read(p: Path) -> str:
    try:
        return p.read_text(errors="replace")
    except OSError:
        return ""


def evidence(run: Path, cfg: str) -> dict[str, Any]:
    before, after = _read(run / f"{cfg}.metrics.before"), _read(run / f"{cfg}.metrics.after")
    row: dict[str, Any] = {"config": cfg}
    for col, name, labels in COUNTERS:
        b, x = metric_sum(before, name, **labels), metric_sum(after, name, **labels)
        row[col] = None if x is None else int(x - (b or 0))
    l3 = _read(run / f"{cfg}.l3.txt").strip()
    row["l3"] = json.loads(l3) if l3 else None
    dec = _read(run / f"{cfg}.decisions.txt").splitlines()
    row["decisions"] = len(dec)
    row["decisions_l3"] = sum(1 for x in dec if " l3=" in x)
    return row


def _n(v: Any) -> str:
    return "-" if v is None else f"{v:,}"


def report(a: argparse.Namespace) -> int:
    root = Path(a.runs)
    runs = sorted((d for d in root.iterdir() if d.is_dir() and re.fullmatch(r"r\d+", d.name)),
                  key=lambda d: int(d.name[1:]))  # fmt: skip
    out: list[str] = []
    if a.disk and Path(a.disk).exists():
        out += [disk_line(json.loads(Path(a.disk).read_text())), ""]
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from toolkv.tools.value_report import config_order, load

    cols = [c for c, _, _ in COUNTERS]
    out += ["L3 evidence per bench (counter increments over the bench; the L3 directory once HiCache's writes"
            " were done; decision lines of the bench, and those naming l3=):", "",
            "| run | config | " + " | ".join(cols) + " | L3 pages after | L3 GB after | decisions (l3=) |",
            "|" + "---|" * (len(cols) + 5)]  # fmt: skip
    for r in runs:
        for f in sorted(r.glob("*.json"), key=lambda f: config_order(f.stem)):
            e = evidence(r, f.stem)
            l3 = e["l3"] or {}
            pages = (
                "-"
                if not l3
                else f"{l3['pages']:,}" + ("" if l3.get("quiet") else f" ({l3['in_flight']} in flight)")
            )
            gb = "-" if not l3 else f"{l3['bytes'] / 1e9:.1f}"
            out.append(f"| {r.name} | {e['config']} | " + " | ".join(_n(e[c]) for c in cols)
                       + f" | {pages} | {gb} | {e['decisions']} ({e['decisions_l3']}) |")  # fmt: skip
    # each config against stock64 of the same run: the target
    out += ["", "Against stock64 of the same run (closed turns/s, resumed TTFT p90, reuse):", "",
            "| run | config | turns/s (closed) | × stock64 | p90 s | p90 × stock64 | reuse |", "|" + "---|" * 7]  # fmt: skip
    for r in runs:
        files = sorted(r.glob("*.json"))
        if not files:
            continue
        try:
            rows = load(files, skip_empty=True)
        except ValueError as e:
            out.append(f"| {r.name} | ({e}) | | | | | |")
            continue
        ref = next((x for x in rows if x["config"] == "stock64"), None)
        for x in rows:
            t = "-" if ref is None else f"{x['closed_turns_per_s'] / ref['closed_turns_per_s']:.2f}×"
            p = "-" if ref is None else f"{x['resumed_ttft_p90_s'] / ref['resumed_ttft_p90_s']:.2f}×"
            out.append(f"| {r.name} | {x['config']} | {x['closed_turns_per_s']:.2f} | {t} |"
                       f" {x['resumed_ttft_p90_s']:.2f} | {p} | {100 * x['reuse']:.0f} % |")  # fmt: skip
    print("\n".join(out))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("disk")
    p.add_argument("dir")
    p.add_argument("--out", required=True)
    p.add_argument("--mb", type=int, default=1024)
    p.add_argument("--files", type=int, default=2048)
    p = sub.add_parser("quiet")
    p.add_argument("dir")
    p.add_argument("--limit", type=float, default=30)
    p.add_argument("--stable", type=float, default=3)
    p = sub.add_parser("report")
    p.add_argument("runs")
    p.add_argument("--disk", default=None)
    a = ap.parse_args(argv)
    return {"disk": disk, "quiet": quiet, "report": report}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
