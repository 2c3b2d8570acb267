"""Collate one GPU acceptance run (scripts/gpu_acceptance.sh) into OUT/acceptance.json and a table.

    COMMIT=<sha> python scripts/acceptance_summary.py OUT

Reads OUT/<release>/steps.tsv (step, exit code, seconds: written by the run), asked.txt (the checks
the run was asked for; default: all) and each step's JSON. A check passes when its step exited 0 and
its JSON says so; an asked check that never ran is a failure (a missing file is not a pass). Prints "ACCEPTANCE PASS" or "ACCEPTANCE FAIL" last.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

STEP_JSON = {
    "e2e": "e2e.json",
    "e2e_eager": "e2e_eager.json",
    "zero_change": "zero_change.json",
    "load": "load.json",
    "fuzz": "fuzz_gpu.json",
}
EXPECTED = {
    "0516": ("e2e", "zero_change", "load", "server_log"),  # runs before asked.txt; later runs list e2e_eager there
    "0523": ("e2e", "zero_change", "load", "server_log"),
}


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def facts(step: str, data: Any) -> dict[str, Any]:
    """The numbers worth quoting from one step's JSON."""
    if data is None:
        return {}
    if step in ("e2e", "e2e_eager"):
        checks = data.get("checks", {})
        return {"checks_passed": sum(map(bool, checks.values())), "checks": len(checks),
                "healthy_after_s": round(float(data.get("healthy_after_s", 0)), 1)}  # fmt: skip
    if step == "zero_change":
        ss = data.get("sessions", [])
        return {"sessions": len(ss), "finish_reasons": sorted({s.get("finish_reason") for s in ss}),
                "cached_tokens_turn2": [s.get("cached_tokens_turn2") for s in ss],
                "prompt_tokens_turn1": [s.get("prompt_tokens_turn1") for s in ss]}  # fmt: skip
    if step == "load":
        s = data.get("summary", {})
        keys = ("turns", "turns_ok", "resumed_turns", "resumed_cache_hit", "resumed_ttft_p90_s", "http_5xx",
                "errors", "calls")  # fmt: skip
        return {k: s.get(k) for k in keys if k in s} | {"twins": len(data.get("twins", []))}
    if step == "fuzz":
        runs = data if isinstance(data, list) else [data]
        return {"examples": sum(r.get("examples", 0) for r in runs), "steps": sum(r.get("steps", 0) for r in runs),
                "violations": sum(r.get("failure") is not None for r in runs),
                "kv_bytes_checked": sum(r.get("kv_bytes_checked", 0) for r in runs)}  # fmt: skip
    return {}


def passed(step: str, rc: int, data: Any) -> bool:
    if rc != 0:
        return False
    if step in ("e2e", "e2e_eager", "zero_change", "load"):
        return bool(data and data.get("passed"))
    if step == "fuzz":
        return bool(data) and facts(step, data)["violations"] == 0 and facts(step, data)["steps"] > 0
    return True


def main() -> int:
    out = Path(sys.argv[1])
    res: dict[str, Any] = {"commit": os.environ.get("COMMIT", "unknown"), "releases": {}}
    gpu = out / "gpu.txt"
    res["gpu"] = gpu.read_text().strip() if gpu.exists() else None
    rows = []
    for rdir in sorted(p for p in out.iterdir() if (p / "steps.tsv").exists()):
        steps: dict[str, Any] = {}
        # rejudged.tsv: step, command, why: a verdict recomputed from the recorded data after the run
        # (the step's exit code stays as recorded; its JSON, rewritten by the command, decides)
        rejudged = {}
        if (rdir / "rejudged.tsv").exists():
            for line in (rdir / "rejudged.tsv").read_text().splitlines():
                name, cmd, why = line.split("\t")
                rejudged[name] = {"command": cmd, "why": why}
        for line in (rdir / "steps.tsv").read_text().splitlines():
            name, rc, secs = line.split("\t")
            data = read_json(rdir / STEP_JSON[name]) if name in STEP_JSON else None
            ok = passed(name, 0 if name in rejudged else int(rc), data)
            steps[name] = {"passed": ok, "rc": int(rc), "seconds": int(secs)} | facts(name, data)
            if name in rejudged:
                steps[name]["rejudged"] = rejudged[name]
        asked = rdir / "asked.txt"
        expected = (
            tuple(asked.read_text().strip().split(","))
            if asked.exists()
            else EXPECTED.get(rdir.name, ("fuzz",) if rdir.name == "fuzz" else ())
        )
        for name in expected:
            steps.setdefault(name, {"passed": False, "rc": None, "seconds": 0, "note": "did not run"})
        res["releases"][rdir.name] = steps
        core = rdir / "tree_core.txt"  # the radix tree core the release's server ran (0.5.23)
        if core.exists():
            res.setdefault("tree_core", {})[rdir.name] = core.read_text().strip()
        rows += [(rdir.name, n, s) for n, s in steps.items()]
    # a failed xgrammar launch is recorded, and shows as zero_change "did not run"
    res["passed"] = bool(rows) and all(s["passed"] for _, name, s in rows if name != "server_xgrammar")
    (out / "acceptance.json").write_text(json.dumps(res, indent=2, default=str))
    cores = "".join(f"  tree core {rel} {c}" for rel, c in sorted(res.get("tree_core", {}).items()))
    print(f"commit {res['commit']}  gpu {res['gpu']}{cores}")
    print(f"{'release':8} {'check':14} {'result':6} {'s':>5}  facts")
    for rel, name, s in rows:
        extra = {k: v for k, v in s.items() if k not in ("passed", "rc", "seconds", "rejudged")}
        verdict = ("PASS" if s["passed"] else "FAIL") + ("*" if "rejudged" in s else "")
        print(f"{rel:8} {name:14} {verdict:6} {s['seconds']:>5}  {json.dumps(extra, default=str)[:160]}")
    for rel, name, s in rows:
        if "rejudged" in s:
            print(
                f"* {rel} {name}: re-judged from the recorded data ({s['rejudged']['command']}): {s['rejudged']['why']}"
            )
    print("ACCEPTANCE", "PASS" if res["passed"] else "FAIL")
    return 0


if __name__ == "__main__":
    sys.exit(main())
