"""``toolkv spec-check``: run SANY and TLC over every spec config and mutant in spec/configs.toml.

The manifest states, for every config, the outcome TLC must reach: "pass" for the correct
manager, or the exact invariant/property that must catch a seeded defect. A mutant that passes,
or that is caught by a different property, means the spec no longer says what docs/caveats.md
claims it says, so the command fails in both cases.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import sys
import time
import tomllib
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TextIO

from toolkv.argtypes import positive_float, positive_int
from toolkv.verify.tla import tlc as tla

KINDS = ("safe", "live", "mutant", "witness")
QUICK_JIT_KINDS = ("mutant", "witness")  # run with the JIT's first tier only (tla.tlc_command)


@dataclass(frozen=True)
class ConfigSpec:
    """One manifest entry."""

    name: str
    kind: str
    module: str
    cfg: str
    expect: str
    caveat: int | None = None


@dataclass
class ConfigResult:
    name: str
    kind: str
    cfg: str
    expected: str
    result: str
    ok: bool
    generated: int | None
    distinct: int | None
    depth: int | None
    seconds: float
    exit_code: int | None
    detail: str = ""


def default_spec_dir() -> Path:
    """The spec directory: ``TOOLKV_SPEC_DIR``, the checkout's ``spec/``, or packaged copies."""
    env = os.environ.get("TOOLKV_SPEC_DIR")
    if env:
        return Path(env)
    pkg = Path(__file__).resolve().parents[1]  # the toolkv package
    for cand in (pkg.parent / "spec", pkg / "spec_files"):
        if (cand / "configs.toml").is_file():
            return cand
    return pkg.parent / "spec"


def load_manifest(spec_dir: Path) -> tuple[list[str], list[ConfigSpec]]:
    """Read and validate configs.toml; a malformed manifest is an error, not a skipped run."""
    path = spec_dir / "configs.toml"
    with path.open("rb") as fh:
        data = tomllib.load(fh)
    sany = [str(m) for m in data.get("sany", [])]
    configs: list[ConfigSpec] = []
    seen: set[str] = set()
    for raw in data.get("config", []):
        entry = ConfigSpec(
            name=str(raw["name"]),
            kind=str(raw["kind"]),
            module=str(raw["module"]),
            cfg=str(raw["cfg"]),
            expect=str(raw["expect"]),
            caveat=int(raw["caveat"]) if "caveat" in raw else None,
        )
        if entry.kind not in KINDS:
            raise ValueError(f"{path}: config {entry.name}: unknown kind {entry.kind!r}")
        if entry.name in seen:
            raise ValueError(f"{path}: duplicate config name {entry.name}")
        if entry.kind in ("safe", "live") and entry.expect != "pass":
            raise ValueError(f"{path}: config {entry.name}: a {entry.kind} config must expect 'pass'")
        if entry.kind in ("mutant", "witness") and entry.expect == "pass":
            raise ValueError(f"{path}: config {entry.name}: a {entry.kind} config must name a property")
        for rel in (entry.module, entry.cfg):
            if not (spec_dir / rel).is_file():
                raise ValueError(f"{path}: config {entry.name}: missing file {rel}")
        seen.add(entry.name)
        configs.append(entry)
    return sany, configs


def result_name(res: tla.TlcResult, cfg_text: str) -> str:
    """The single word compared with the manifest's expectation."""
    if res.outcome == "pass":
        return "pass"
    if res.outcome in ("invariant", "action_property") and res.violated:
        return res.violated
    if res.outcome == "temporal":
        props = tla.cfg_sections(cfg_text).get("PROPERTIES", [])
        # TLC does not say which temporal property failed; attribute it only when unambiguous.
        return props[0] if len(props) == 1 else "temporal"
    return res.outcome


def check_config(
    tools: tla.Toolchain, spec_dir: Path, entry: ConfigSpec, workers: int, timeout: float
) -> ConfigResult:
    cfg_path = spec_dir / entry.cfg
    # a mutant or witness stops at its first violation, mostly within seconds: the JIT's first tier
    # alone costs less CPU there (tla.tlc_command); the correct models run for minutes on both tiers
    res = tla.run_tlc(
        tools,
        spec_dir / entry.module,
        cfg_path,
        workers=workers,
        timeout=timeout,
        quick_jit=entry.kind in QUICK_JIT_KINDS,
    )
    name = result_name(res, cfg_path.read_text())
    detail = "" if name == entry.expect else "; ".join(res.error_lines[-3:]) or res.output[-400:]
    return ConfigResult(
        name=entry.name,
        kind=entry.kind,
        cfg=entry.cfg,
        expected=entry.expect,
        result=name,
        ok=name == entry.expect,
        generated=res.generated,
        distinct=res.distinct,
        depth=res.depth,
        seconds=round(res.seconds, 1),
        exit_code=res.exit_code,
        detail=detail,
    )


def _fmt(v: int | None) -> str:
    return "-" if v is None else f"{v:,}"


def format_table(results: list[ConfigResult]) -> str:
    header = ("config", "kind", "expected", "result", "distinct", "depth", "seconds", "")
    rows = [
        (
            r.name,
            r.kind,
            r.expected,
            r.result,
            _fmt(r.distinct),
            _fmt(r.depth),
            f"{r.seconds:.1f}",
            "ok" if r.ok else "FAIL",
        )
        for r in results
    ]
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=True)]
    right = {4, 5, 6}

    def line(cells: tuple[str, ...]) -> str:
        return "  ".join(
            c.rjust(w) if i in right else c.ljust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ).rstrip()

    out = [line(header), line(tuple("-" * w for w in widths))]
    out += [line(r) for r in rows]
    return "\n".join(out)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print a machine-readable summary on stdout")
    parser.add_argument(
        "--only",
        action="append",
        metavar="NAME",
        help="run only configs whose name matches (fnmatch pattern; repeatable; e.g. 'mut_*')",
    )
    parser.add_argument(
        "--skip",
        action="append",
        metavar="NAME",
        help="leave out configs whose name matches (fnmatch pattern; repeatable; `make test` leaves out "
        "the configs another run of the same make test covers, docs/testing.md)",
    )
    parser.add_argument("--workers", type=positive_int, default=1, help="TLC worker threads (default 1)")
    parser.add_argument(
        "--jobs",
        type=positive_int,
        default=1,
        help="TLC runs at a time, one JVM each (default 1; CI uses its cores)",
    )
    parser.add_argument(
        "--timeout", type=positive_float, default=600.0, help="seconds per TLC run (default 600)"
    )
    parser.add_argument("--spec-dir", type=Path, default=None, help="directory holding configs.toml")
    parser.add_argument("--list", action="store_true", help="list the configs and exit")


def run(args: argparse.Namespace) -> int:
    json_mode: bool = bool(args.json)
    progress: TextIO = sys.stderr if json_mode else sys.stdout
    spec_dir: Path = args.spec_dir or default_spec_dir()
    try:
        sany_modules, configs = load_manifest(spec_dir)
    except (OSError, ValueError, KeyError, tomllib.TOMLDecodeError) as exc:
        print(f"spec-check: bad manifest: {exc}", file=sys.stderr)
        return 2
    if args.only:
        configs = [c for c in configs if any(fnmatch.fnmatchcase(c.name, pat) for pat in args.only)]
        if not configs:
            print(f"spec-check: no config matches {args.only}", file=sys.stderr)
            return 2
    skip = getattr(args, "skip", None) or []
    if skip:
        unknown = [pat for pat in skip if not any(fnmatch.fnmatchcase(c.name, pat) for c in configs)]
        if unknown:  # a config renamed or removed: the skip list no longer says what it meant
            print(f"spec-check: --skip matches no config: {unknown}", file=sys.stderr)
            return 2
        configs = [c for c in configs if not any(fnmatch.fnmatchcase(c.name, pat) for pat in skip)]
    if args.list:
        for c in configs:
            print(f"{c.name:28} {c.kind:8} {c.cfg:40} expect {c.expect}")
        return 0
    if args.workers < 1:
        print("spec-check: --workers must be >= 1", file=sys.stderr)
        return 2
    try:
        tools = tla.Toolchain.locate()
    except tla.TlaToolError as exc:
        print(f"spec-check: {exc}", file=sys.stderr)
        return 2

    t0 = time.monotonic()
    sany_report: list[dict[str, Any]] = []
    sany_ok = True
    for mod in sany_modules:
        s = tla.run_sany(tools, spec_dir / mod)
        sany_report.append({"module": mod, "ok": s.ok, "seconds": round(s.seconds, 1)})
        print(f"[sany] {mod}: {'ok' if s.ok else 'FAILED'} ({s.seconds:.1f}s)", file=progress, flush=True)
        if not s.ok:
            sany_ok = False
            print(s.output, file=sys.stderr)
    results: list[ConfigResult] = []
    if sany_ok:
        jobs = max(1, int(getattr(args, "jobs", 1) or 1))

        def report(i: int, r: ConfigResult) -> None:
            print(
                f"[{i}/{len(configs)}] {r.name}: {r.result} (expected {r.expected}) "
                f"{_fmt(r.distinct)} states, depth {_fmt(r.depth)}, {r.seconds:.1f}s {'ok' if r.ok else 'FAIL'}",
                file=progress,
                flush=True,
            )
            if not r.ok and r.detail:
                print(f"    {r.detail}", file=progress, flush=True)

        # Longest first when running several at once: the big safety and liveness runs start early.
        order = sorted(configs, key=lambda c: c.kind not in ("safe", "live")) if jobs > 1 else configs
        with ThreadPoolExecutor(max_workers=jobs) as pool:  # each job waits on its own JVM
            futures = {
                pool.submit(check_config, tools, spec_dir, entry, args.workers, args.timeout): entry
                for entry in order
            }
            done: dict[str, ConfigResult] = {}
            for n, fut in enumerate(as_completed(futures), 1):
                r = fut.result()
                done[r.name] = r
                report(n, r)
        results = [done[c.name] for c in configs]
    total = time.monotonic() - t0
    ok = sany_ok and all(r.ok for r in results) and len(results) == len(configs)
    if json_mode:
        summary = {
            "ok": ok,
            "seconds": round(total, 1),
            "workers": args.workers,
            "spec_dir": str(spec_dir),
            "sany": sany_report,
            "configs": [asdict(r) for r in results],
        }
        json.dump(summary, sys.stdout, indent=2)
        print()
    else:
        print()
        print(format_table(results))
        failed = [r.name for r in results if not r.ok]
        print(
            f"\n{len(results)} configs in {total:.0f}s: "
            + ("all as expected" if ok else f"FAILED: {', '.join(failed) or 'SANY'}")
        )
    return 0 if ok else 1
