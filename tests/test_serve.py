"""``toolkv serve`` end to end, as a new user runs it: the server in a process of its own on a free
port, then ``examples/agent_openai.py``, ``toolkv doctor`` and a ``/metrics`` scrape against it,
then Ctrl-C. Nothing is mocked on the path: the server is sglang's real HiRadixCache under the twin's
scheduler model with toolkv attached as the plugin attaches it (the model is the named stand-in).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, subprocess.Popen[str]]]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "toolkv.tools.cli", "serve", "--port", "0"],
        cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert proc.stdout is not None
    url = None
    deadline = time.monotonic() + 60
    while url is None and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        m = re.search(r"listening on (http://127\.0\.0\.1:\d+)", line)
        url = m.group(1) if m else None
    if url is None:
        proc.kill()
        pytest.fail(f"toolkv serve did not start: {proc.communicate()[1][-2000:]}")
    # the port is bound before uvicorn listens on it: wait until it accepts a connection
    import socket

    host, port = url.removeprefix("http://").split(":")
    while time.monotonic() < deadline:
        try:
            socket.create_connection((host, int(port)), timeout=1).close()
            break
        except OSError:
            time.sleep(0.1)
    yield url, proc
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def post(url: str, body: object) -> tuple[int, dict[str, object]]:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def metric(text: str, name: str, **labels: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name}{labels} not in /metrics")


def test_the_agent_example_runs_against_it_and_shows_what_toolkv_did(
    server: tuple[str, subprocess.Popen[str]],
) -> None:
    url, _ = server
    out = subprocess.run(
        [sys.executable, "examples/agent_openai.py", "--base-url", url],
        cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    run = json.loads(out.stdout)
    assert run["answer"].startswith("[toolkv-stand-in]")
    assert run["tool_calls"] == 2
    # kv_hints falls back to explicit (the server answers as 0.5.16): tool_start/tool_end per call
    did = run["toolkv"]
    assert did["tool_start"] == did["tool_end"] == 2
    assert did["offloaded_tokens"] > 0 and did["restored_tokens"] > 0
    reused = run["tokens_reused"]
    assert len(reused) == 3 and reused[1] > 0 and reused[2] > reused[1]

    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    assert metric(text, "toolkv:tokens_total", kind="offloaded") >= did["offloaded_tokens"]
    assert metric(text, "toolkv:tokens_total", kind="restored") >= did["restored_tokens"]
    assert metric(text, "toolkv:events_total", event="tool_start") >= 2
    assert metric(text, "sglang:cached_tokens_total") >= sum(reused)


def test_doctor_and_the_typed_client_work_against_it(
    server: tuple[str, subprocess.Popen[str]], capsys: pytest.CaptureFixture[str]
) -> None:
    from toolkv.client import ToolKVClient
    from toolkv.errors import UnknownSession
    from toolkv.tools.cli import main

    url, _ = server
    assert main(["doctor", url]) == 0
    said = capsys.readouterr().out
    assert said.startswith(f"toolkv is on at {url}") and "backend hiradix" in said

    with ToolKVClient(url) as kv:
        status, body = post(f"{url}/generate", {"text": "hello from a test", "session_id": "t1"})
        assert status == 200 and body["meta_info"]["prompt_tokens"] == 17  # type: ignore[index]
        with kv.tool_call("t1", tool="search") as tc:
            assert tc.start is not None and kv.kv_meta("t1").state in ("Offloading", "Offloaded")
        kv.close_session("t1")
        with pytest.raises(UnknownSession):
            kv.tool_start("never-seen")


def test_nonsense_is_a_typed_4xx(server: tuple[str, subprocess.Popen[str]]) -> None:
    url, _ = server
    for route, body in [
        ("/generate", {"text": 5}),
        ("/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 0}}),
        ("/generate", {"input_ids": list(range(1, 9000))}),
        ("/v1/chat/completions", {"messages": "hi"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stream": True}),
        ("/v1/chat/completions", {"messages": [{"role": "user"}], "session_id": ""}),
        ("/session/tool_end", {"session_id": "x", "epoch": -1}),
    ]:
        status, out = post(url + route, body)
        assert status == 400 and out["error"] == "bad_request" and out["message"], (route, body, out)


def _vm(pid: int, field: str) -> int:
    """``VmRSS`` / ``VmHWM`` (peak RSS) of a process, in bytes, from /proc (Linux)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"{field} not in /proc/{pid}/status")


HOSTILE = 256 << 20  # a 256 MiB body


def _hostile_post(url: str, *, chunked: bool) -> bytes:
    """POST 256 MiB of JSON-typed bytes to ``/session/tool_start`` over a raw socket, with its
    ``Content-Length`` declared or chunked, sending from a thread while the answer is read, so the
    answer is seen however early the server gives it. The sender reuses one 1 MiB buffer."""
    import socket
    import threading

    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=30)
    length = "Transfer-Encoding: chunked" if chunked else f"Content-Length: {HOSTILE}"
    head = f"POST /session/tool_start HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n{length}\r\n\r\n"
    piece = b" " * (1 << 20)
    frame = b"%x\r\n" % len(piece) + piece + b"\r\n" if chunked else piece

    def send() -> None:
        try:
            sock.sendall(head.encode())
            for _ in range(HOSTILE // len(piece)):
                sock.sendall(frame)
            if chunked:
                sock.sendall(b"0\r\n\r\n")
        except OSError:  # the server answered and closed the connection: what a refusal does
            pass

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    answer = b""
    try:
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            got = sock.recv(65536)
            if not got:
                break
            answer += got
    finally:
        sock.close()
        sender.join(timeout=60)
    return answer


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_a_256_mib_post_is_refused_without_the_memory_to_hold_it(
    server: tuple[str, subprocess.Popen[str]], chunked: bool
) -> None:
    """The session routes' 4,096-byte limit holds while the body is read: the server's peak RSS
    (``VmHWM``, reset to its current RSS first) grows by a few MB, not by the body."""
    url, proc = server
    _hostile_post(url, chunked=chunked)  # a first one warms what the refusal path imports
    Path(f"/proc/{proc.pid}/clear_refs").write_text("5")  # peak RSS := current RSS
    before = _vm(proc.pid, "VmHWM")
    answer = _hostile_post(url, chunked=chunked)
    grew = _vm(proc.pid, "VmHWM") - before
    print(
        f"peak RSS growth under a 256 MiB POST ({'chunked' if chunked else 'content-length'}): {grew / 2**20:.2f} MiB"
    )
    assert grew < 8 << 20, f"peak RSS grew by {grew / 2**20:.1f} MiB under a 256 MiB POST"
    assert answer.startswith(b"HTTP/1.1 413"), answer[:300]
    assert b'"error":"payload_too_large"' in answer
    status, out = post(f"{url}/session/tool_start", {"session_id": "never-seen"})
    assert status == 404 and out["error"] == "unknown_session"  # the server still answers


def test_ctrl_c_stops_it_cleanly(server: tuple[str, subprocess.Popen[str]]) -> None:
    _, proc = server
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=20)
    assert proc.returncode == 0, stderr
    assert "Traceback" not in stderr and "stopped after" in stdout
