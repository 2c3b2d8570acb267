"""scripts/gpu_l3_capacity.sh on CPU (issue 37, item 2): its syntax, and dry runs against three
stand-in servers (scripts/stage/fleet_stub.py, ``DRY_RUN_STUB``; the L3 one with ``--storage``) in
place of sglang. What a dry run shows: the servers start together, the four configs take turns on
them (stock16l3 and toolkv16l3 on the L3 server, its L3 emptied before each), the disk probe and
the L3 evidence land in the report, the budget stops new benches and still leaves the results, and
what comes back is a few files, the runs in one archive that value_report reads. Also: value_report
compares ``stock16l3`` and ``toolkv16l3`` to ``stock16``. No GPU timing is asserted."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from toolkv.tools.value_report import config_order, host_gb, is_reference, load

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_l3_capacity.sh"
TINY = (
    "--sessions 3 --arrival-rate 0 --turns 3 --first-tokens 200 --growth 100 --output 8 "
    "--max-context 2048 --warmup 0"
)


def _free_port() -> int:
    """A port with the two above it free too (the script's three servers)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            p = int(s.getsockname()[1])
        try:
            for q in (p + 1, p + 2):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", q))
            return p
        except OSError:
            continue
    raise RuntimeError("no three free ports")


def _dry_run(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    e = {
        **os.environ,
        "OUT": str(tmp_path / "out"),
        "WORK": str(tmp_path / "work"),
        "L3_ROOT": str(tmp_path / "disk"),
        "PY": sys.executable,
        "DRY_RUN_STUB": str(ROOT / "scripts" / "stage" / "fleet_stub.py"),
        "PORT": str(_free_port()),
        "DURATION": "9",  # past the plan's 8-s ramp: the bench's window must not be empty
        "DRAIN": "5",
        "L3_QUIET_S": "5",
        "DISK_PROBE_MB": "16",
        "DISK_PROBE_FILES": "50",
        "BENCH_ARGS": TINY,
        **env,
    }
    return subprocess.run(["bash", str(SCRIPT)], env=e, capture_output=True, text=True, timeout=400)


def test_the_script_parses() -> None:
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_l3_names_are_compared_to_stock_of_their_host_size(tmp_path: Path) -> None:
    assert [host_gb(c) for c in ("stock16", "stock16l3", "toolkv16l3", "stock64", "stock")] == [
        "16", "16", "16", "64", "",
    ]  # fmt: skip
    assert is_reference("stock16") and is_reference("stock64") and not is_reference("stock16l3")
    names = ["stock64", "toolkv16l3", "stock16l3", "offload16", "stock16"]
    assert sorted(names, key=config_order) == ["stock16", "stock16l3", "offload16", "toolkv16l3", "stock64"]
    # hand-made runs: 10 turns each, turn i from i*d to (i+1)*d (closed turns/s = 1/d)
    for cfg, d in (("stock16", 2.0), ("stock16l3", 1.0), ("toolkv16l3", 0.5), ("stock64", 0.25)):
        turns = [
            {"turn": i % 2, "start_s": i * d, "e2e_s": d, "status": 200, "ttft_s": 0.1,
             "prompt_tokens": 100, "cached_tokens": 50 if i % 2 else 0}
            for i in range(10)
        ]  # fmt: skip
        res = {"config": cfg, "turns": turns, "summary": {"calls": {}}, "events": []}
        (tmp_path / f"{cfg}.json").write_text(json.dumps(res))
    rows = {r["config"]: r for r in load([tmp_path])}
    assert rows["stock16l3"]["tps_vs_stock"] == pytest.approx(2.0)
    assert rows["toolkv16l3"]["tps_vs_stock"] == pytest.approx(4.0)
    assert rows["stock64"]["tps_vs_stock"] == pytest.approx(1.0)


def test_a_bad_config_or_bench_argument_is_refused_before_any_server(tmp_path: Path) -> None:
    r = _dry_run(tmp_path, CONFIGS="stock16 offload16")
    assert r.returncode == 2 and "unknown config offload16" in r.stderr
    r = _dry_run(tmp_path, BENCH_ARGS=TINY + " --tool-shape nope")
    assert r.returncode == 2 and "BENCH_ARGS refused" in r.stdout
    assert not list((tmp_path / "work").glob("server_*.log"))


def test_with_no_time_left_no_bench_starts_and_the_servers_still_stop(tmp_path: Path) -> None:
    r = _dry_run(tmp_path, BUDGET_S="50", MIN_LEFT_S="100")
    assert r.stdout.count("healthy after") == 3, r.stdout + r.stderr
    assert "budget: 8 benches not started" in r.stdout and "no bench left a result" in r.stdout
    assert "servers stopped" in r.stdout and r.returncode == 1
    assert "L3 disk " in r.stdout and "MB/s" in r.stdout  # the disk probe ran first
    assert not (tmp_path / "disk" / "toolkv_l3_srv16l3").exists()  # removed at the end


@pytest.mark.slow
def test_the_configs_take_turns_on_three_servers_and_the_report_reads_the_archive(tmp_path: Path) -> None:
    r = _dry_run(tmp_path, REPEATS="2", MIN_LEFT_S="30", BUDGET_S="120")  # round 2 cut short
    assert r.returncode == 0, r.stdout + r.stderr
    started = re.findall(r"\] (r\d) (\w+): start on (\w+)", r.stdout)
    round1 = [("stock16", "srv16"), ("stock16l3", "srv16l3"), ("toolkv16l3", "srv16l3"), ("stock64", "srv64")]
    assert started[:4] == [("r1", c, s) for c, s in round1]
    assert started[4:] == [("r2", c, s) for c, s in reversed(round1)][: len(started) - 4]  # round 2 reversed
    assert r.stdout.count("L3 emptied (clear: 200)") == sum(1 for x in started if x[2] == "srv16l3")
    assert "WARNING" not in r.stdout  # every flush answered 200
    res = tmp_path / "out" / "l3"
    assert sorted(p.name for p in res.iterdir()) == [
        "report.md", "results.tar.gz", "server_errors.txt", "server_logs.tar.gz",
    ]  # fmt: skip
    x = tmp_path / "x"
    with tarfile.open(res / "results.tar.gz") as t:
        t.extractall(x, filter="data")
    assert sorted(p.name for p in (x / "r1").glob("*.json")) == [
        "stock16.json", "stock16l3.json", "stock64.json", "toolkv16l3.json",
    ]  # fmt: skip
    assert (x / "disk.json").exists() and (x / "machine.txt").exists()
    # the stand-in L3 server writes every token it computes to L3: the directory held pages after the bench
    l3 = json.loads((x / "r1" / "stock16l3.l3.txt").read_text())
    assert l3["pages"] > 0 and l3["quiet"]
    assert (x / "r1" / "toolkv16l3.decisions.txt").read_text().count("op=tool_start") > 0
    report = (res / "report.md").read_text()
    assert "| stock16l3 | " in report and "| toolkv16l3 | " in report and "× stock64" in report
    assert "L3 evidence per bench" in report and "L3 disk " in report
    assert not (tmp_path / "disk" / "toolkv_l3_srv16l3").exists()
