"""scripts/gpu_value_repeat.sh on CPU: its syntax, and dry runs against the stand-in server
(scripts/stage/fleet_stub.py, ``DRY_RUN_STUB``) in place of sglang. What a dry run shows: the configs
take turns on one server (stock, offload, auto, stock, ...), each agent asks for its policy in every
``tool_start``, the time budget stops new benches and still leaves the report, and what comes back
from a device call (at most 8 files) is a few files, the runs in one archive that value_report reads.
No GPU timing is asserted."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from toolkv.tools.value_report import main as report_main

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_value_repeat.sh"
TINY = (
    "--sessions 3 --arrival-rate 0 --turns 3 --first-tokens 200 --growth 100 --output 8 "
    "--max-context 2048 --warmup 0"
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _dry_run(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    e = {
        **os.environ,
        "OUT": str(tmp_path / "out"),
        "WORK": str(tmp_path / "work"),
        "PY": sys.executable,
        "DRY_RUN_STUB": str(ROOT / "scripts" / "stage" / "fleet_stub.py"),
        "PORT": str(_free_port()),
        "DURATION": "9",  # past the plan's 8-s ramp: the bench's window must not be empty
        "DRAIN": "5",
        "BENCH_ARGS": TINY,
        **env,
    }
    return subprocess.run(["bash", str(SCRIPT)], env=e, capture_output=True, text=True, timeout=400)


def test_the_script_parses() -> None:
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_a_bad_config_or_bench_argument_is_refused_before_any_server(tmp_path: Path) -> None:
    r = _dry_run(tmp_path, CONFIGS="stock16 keep16")
    assert r.returncode == 2 and "unknown config keep16" in r.stderr
    r = _dry_run(tmp_path, BENCH_ARGS=TINY + " --tool-shape nope")
    assert r.returncode == 2 and "BENCH_ARGS refused" in r.stdout
    assert not (tmp_path / "work" / "value" / "server.log").exists()


def test_with_no_time_left_no_bench_starts_and_the_server_still_stops(tmp_path: Path) -> None:
    r = _dry_run(tmp_path, BUDGET_S="50", MIN_LEFT_S="100")
    assert "per-call policy accepted" in r.stdout, r.stdout + r.stderr
    assert "budget: 6 benches not started" in r.stdout and "no bench left a result" in r.stdout
    assert "server stopped" in r.stdout and r.returncode == 1
    res = tmp_path / "out" / "value"
    assert (res / "report.md").read_text().startswith("no report")
    assert not (res / "results.tar.gz").exists()


def test_the_named96_load_is_96_sessions_of_named_tools_for_100_s(tmp_path: Path) -> None:
    """LOAD=named96's bench arguments, checked by agent_bench before any server starts: refused
    while this tree's workload has no ``named`` tool shape, a server started once it has."""
    from toolkv.workload.plan import SHAPES

    r = _dry_run(tmp_path, LOAD="named96", BENCH_ARGS="", DURATION="", BUDGET_S="50", MIN_LEFT_S="")
    assert "REPEATS=1 " in r.stdout and "DURATION=100 " in r.stdout and "MIN_LEFT_S=125" in r.stdout
    args = "--sessions 96 --arrival-rate 0 --turns 5 --first-tokens 3000 --growth 900 --output 32"
    assert f"BENCH_ARGS={args} --max-context 16384 --warmup 0 --tool-shape named" in r.stdout
    if "named" in SHAPES:
        assert "server stopped" in r.stdout and "budget: 3 benches not started" in r.stdout
    else:
        assert r.returncode == 2 and "BENCH_ARGS refused" in r.stdout


@pytest.mark.slow
def test_the_configs_take_turns_on_one_server_and_the_report_reads_the_archive(tmp_path: Path) -> None:
    r = _dry_run(tmp_path, REPEATS="2")
    assert r.returncode == 0, r.stdout + r.stderr
    started = re.findall(r"\] (r\d) (\w+): start", r.stdout)
    assert started == [(k, c) for k in ("r1", "r2") for c in ("stock16", "offload16", "auto16")]
    assert r.stdout.count("server healthy") == 1 and "WARNING" not in r.stdout  # one server, every flush done
    res = tmp_path / "out" / "value"
    back = sorted(p.name for p in res.iterdir())
    assert back == [
        "report.md",
        "results.tar.gz",
        "server.log.gz",
        "server_errors.txt",
        "toolkv_decisions.txt.gz",
    ]
    # the stand-in logs each tool_start: offload agents ask for offload, auto agents for auto and name the tool
    log = (tmp_path / "work" / "value" / "server.log").read_text()
    asked = re.findall(r"op=tool_start .* policy=(\S+) tool=(\S+)", log)
    assert asked and set(asked) == {("offload", "-"), ("auto", "read")}
    # the archive is a folder of runs: value_report's summary over it is the report printed last
    x = tmp_path / "x"
    with tarfile.open(res / "results.tar.gz") as t:
        t.extractall(x, filter="data")
    assert sorted(p.name for p in (x / "r1").glob("*.json")) == [
        "auto16.json",
        "offload16.json",
        "stock16.json",
    ]
    assert (x / "r2" / "auto16.log").exists() and (x / "toolkv_decisions.txt").exists()
    report = (res / "report.md").read_text()
    assert report.startswith("Median (min–max) over runs: 2 runs (r1, r2)") and report.strip() in r.stdout
    assert "| offload16 | 2 |" in report and "| auto16 | 2 |" in report


@pytest.mark.slow
def test_the_budget_cuts_a_round_short_and_kills_a_bench_that_overruns(tmp_path: Path) -> None:
    # one bench (~16 s) fits before fewer than MIN_LEFT_S seconds are left; the rest are not started
    r = _dry_run(tmp_path, BUDGET_S="110", MIN_LEFT_S="100")
    assert r.returncode == 0, r.stdout + r.stderr
    assert re.findall(r"\] (r\d) (\w+): start", r.stdout) == [("r1", "stock16")]
    assert "budget: 5 benches not started" in r.stdout
    assert "1 runs (r1)" in (tmp_path / "out" / "value" / "report.md").read_text()
    # a bench still running at BUDGET_S + 5 is killed; the server is stopped and the report written
    r = _dry_run(tmp_path, BUDGET_S="10", MIN_LEFT_S="1")
    assert "r1 stock16: killed at the budget" in r.stdout, r.stdout
    assert "server stopped" in r.stdout and r.returncode == 1
    assert report_main([str(tmp_path / "work" / "value" / "runs")]) == 2  # nothing to report
