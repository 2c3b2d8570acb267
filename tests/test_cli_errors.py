"""Inputs that used to end in a traceback are one line and exit status 2 (issue: CLI and
package): a file that is not a trace, ``bench transfer --device cuda`` without a GPU, ``fuzz-http``
against a server that is not there, ``docs --spec-check`` with a file that is not spec-check
output (which also overwrote docs/spec-check.json before it was read), and a command whose
dependency is not installed (it names the extra). The installed-wheel side of the same issue is
tests/test_wheel_install.py.

Issue 36's leftovers: ``bench transfer --device bogus``, ``--tokens abc`` and ``--shape 1,2``,
``twin --profile`` with a missing or malformed file (tracebacks), ``fuzz --device cuda`` without a
GPU (a minute of campaign, then a "failure"), ``demo --device-tokens 10`` (a normal-looking summary,
then exit 1; pools below 4096 also crashed), ``bench agent`` without a server; a usage error is one
line, not a usage block."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from toolkv.errors import InputError
from toolkv.tools import docgen
from toolkv.tools.cli import main


def _error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    rc = main(argv)
    captured = capsys.readouterr()
    assert rc == 2, captured
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in captured.err, captured.err
    assert lines[0].startswith(f"toolkv {argv[0]}: error: "), lines
    return lines[0]


def _usage_error(capsys: pytest.CaptureFixture[str], argv: list[str], prog: str) -> str:
    """A bad argument: exit status 2 at parse time and one line, ``<prog>: error: ...``."""
    with pytest.raises(SystemExit) as ei:
        main(argv)
    err = capsys.readouterr().err
    assert ei.value.code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"{prog}: error: ") and lines[0].endswith(f"(see {prog} --help)"), lines
    return lines[0]


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--device", "bogus"], "argument --device: 'bogus': expected cpu or cuda[:N]"),
        (["--device", "cuda:x"], "expected cpu or cuda[:N]"),
        (["--tokens", "abc"], "argument --tokens: 'abc': expected a comma list, each an integer >= 1"),
        (["--tokens", "512,0"], "expected a comma list, each an integer >= 1"),
        (["--shape", "1,2"], "argument --shape: '1,2': expected 3 comma-separated positive integers"),
        (["--shape", "32,8,x"], "(layers,kv_heads,head_dim)"),
        (["--shape", "32,0,128"], "expected 3 comma-separated positive integers"),
    ],
)
def test_bench_transfer_bad_arguments(
    capsys: pytest.CaptureFixture[str], args: list[str], words: str
) -> None:
    assert words in _usage_error(capsys, ["bench", "transfer", *args], "toolkv bench")


def test_bench_transfer_arguments_parse_to_numbers() -> None:
    from toolkv.tools.cli import build_parser

    a = build_parser().parse_args(["bench", "transfer", "--shape", "4, 2,64", "--tokens", "16,32"])
    assert (a.shape, a.tokens, a.device) == ((4, 2, 64), [16, 32], "cpu")
    assert build_parser().parse_args(["bench", "transfer"]).shape == (32, 8, 128)


def test_usage_errors_are_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert "invalid choice: 'nope'" in _usage_error(capsys, ["nope"], "toolkv")
    assert "required: COMMAND" in _usage_error(capsys, [], "toolkv")
    assert "argument --sessions" in _usage_error(capsys, ["demo", "--sessions", "0"], "toolkv demo")


PROFILE = {
    "prefill_a": 0.05, "prefill_b": 1e-5, "prefill_c": 4e-9, "decode_d": 0.03, "decode_e": 0.0,
    "decode_f": 0.0, "h2d_gbps": 50.0, "d2h_gbps": 48.0, "kv_bytes_per_token": 131072,
}  # fmt: skip


@pytest.mark.parametrize(
    ("content", "words"),
    [
        (None, "No such file or directory"),
        ('{"prefill_a": 1', "not JSON"),
        ("[1, 2]", "expected a JSON object of profile fields, got list"),
        (json.dumps({k: v for k, v in PROFILE.items() if k != "h2d_gbps"}), "missing field(s) ['h2d_gbps']"),
        (json.dumps({**PROFILE, "prefill_z": 1}), "unknown field(s) ['prefill_z']"),
        (json.dumps({**PROFILE, "decode_d": "fast"}), "decode_d must be a finite number, got 'fast'"),
        (json.dumps({**PROFILE, "decode_d": True}), "decode_d must be a finite number"),
        (json.dumps({**PROFILE, "prefill_a": -1}), "prefill_a must be >= 0"),
        (json.dumps({"profile": {**PROFILE, "h2d_gbps": 0}}), "copy rates and kv_bytes_per_token must be positive"),
    ],
)  # fmt: skip
def test_twin_profile_missing_or_malformed(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, content: str | None, words: str
) -> None:
    f = tmp_path / "bad.json"
    if content is not None:
        f.write_text(content)
    line = _usage_error(capsys, ["twin", "--profile", str(f)], "toolkv twin")
    assert f"argument --profile: profile {str(f)!r}: " in line and words in line, line


def test_twin_profile_accepts_a_profile_and_a_calibration(tmp_path: Path) -> None:
    from toolkv.tools.cli import build_parser
    from toolkv.twin.profile import TimeProfile, default_profile

    plain, calibration = tmp_path / "p.json", tmp_path / "c.json"
    plain.write_text(json.dumps(PROFILE))
    calibration.write_text(json.dumps({"profile": default_profile().to_json(), "points": []}))
    assert build_parser().parse_args(["twin", "--profile", str(plain)]).profile == str(plain)
    assert TimeProfile.load(plain).h2d_gbps == 50.0
    assert TimeProfile.load(calibration) == default_profile()


def test_fuzz_on_cuda_without_a_gpu_is_refused_at_once(capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    line = _usage_error(capsys, ["fuzz", "--device", "cuda", "--examples", "1"], "toolkv fuzz")
    assert "--device cuda: no CUDA device here" in line and "--device cpu" in line


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--device-tokens", "10"], "--device-tokens 10: the GPU pool must hold a session's longest prompt"),
        (["--device-tokens", "700"], "use at least 768"),
        (["--turns", "2", "--device-tokens", "400"], "= 448 (with --turns 2); use at least 448"),
        (["--page-size", "16", "--device-tokens", "900"], "expected a multiple of --page-size 16"),
    ],
)
def test_demo_refuses_a_pool_it_cannot_finish_in(
    capsys: pytest.CaptureFixture[str], args: list[str], words: str
) -> None:
    assert words in _error(capsys, ["demo", *args])


def test_demo_in_the_smallest_pool_finishes_and_verifies_its_restores(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """At the floor the demo used to crash (a restore compared after its hand-over pin had gone
    and the pool had evicted it) or report differing bytes (an evicted shared prefix recomputed
    with random KV). Now: every session finishes, every compared restore is byte-identical."""
    rc = main(
        ["demo", "--sessions", "6", "--turns", "3", "--device-tokens", "608", "--json", "--timeline", "0"]
    )
    captured = capsys.readouterr()
    assert rc == 0, captured.err[-2000:]
    report = json.loads(captured.out)
    assert report["restore_mismatches"] == 0 and report["restores_verified"] > 0
    assert report["leaks"]["sessions_unfinished"] == 0 and report["leaks"]["count"] == 0
    # the pool was tight: some restores had to wait (parked: the request's admission loads them)
    assert report["deferred_restores"] + report["parked_restores"] > 0, report["counters"]
    assert report["prefix_bytes_checked"] > 0
    assert "FAILED" not in captured.err


def test_demo_says_why_it_failed() -> None:
    from toolkv.tools.demo import failures
    from toolkv.tools.sim import DemoReport

    ok = DemoReport(config={}, leaks={"count": 0, "differences": {}, "sessions_unfinished": 0})
    assert failures(ok) == []
    bad = DemoReport(
        config={},
        restore_mismatches=2,
        ticks=5000,
        leaks={"count": 0, "differences": {}, "sessions_unfinished": 3},
    )
    assert failures(bad) == [
        "2 restore(s) with differing bytes",
        "3 session(s) unfinished after 5000 scheduler iterations (the iteration limit)",
    ]


def test_bench_agent_without_a_server_or_an_output(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "agent", "--url", "http://127.0.0.1:9", "--json"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == (
        "toolkv bench agent: error: no healthy server at http://127.0.0.1:9 (GET /health: no answer)\n"
    )
    line = _usage_error(capsys, ["bench", "agent", "--url", "http://127.0.0.1:9"], "toolkv bench agent")
    assert "give --out FILE for the JSON results, or --json to print them" in line


@pytest.mark.parametrize(
    ("content", "words"),
    [
        ("this is not json\n", "line 1 is not JSON"),
        ('{"header": {}}\n{"x": 1}\n', "every line after the header must be a step"),
        ('[1, 2]\n', "the first line must be the trace header"),
        ('{"header": {}}\n{"act": ["ToolStart"]}\n', "the first step must be the initial state"),
        ("", "the first line must be the trace header"),
    ],
)  # fmt: skip
def test_trace_check_on_a_file_that_is_not_a_trace(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, content: str, words: str
) -> None:
    f = tmp_path / "t.jsonl"
    f.write_text(content)
    assert words in _error(capsys, ["trace-check", str(f)])


def test_bench_transfer_on_cuda_without_a_gpu(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    line = _error(capsys, ["bench", "transfer", "--device", "cuda", "--out", str(tmp_path / "t.json")])
    assert "--device cuda: no CUDA device here" in line and not (tmp_path / "t.json").exists()


def test_fuzz_http_against_no_server(capsys: pytest.CaptureFixture[str]) -> None:
    line = _error(capsys, ["fuzz-http", "http://127.0.0.1:9", "--session", "s", "--examples", "1"])
    assert "cannot load http://127.0.0.1:9/openapi.json" in line and "is the server running" in line


@pytest.mark.parametrize(
    "content",
    [
        "{not json",
        "[]",
        "{}",
        json.dumps({"configs": [{"name": "x"}]}),
        json.dumps({"configs": [], "ok": True}),
    ],
)
def test_docs_refuses_bad_spec_check_json_and_writes_nothing(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, content: str
) -> None:
    """Run against a copy of docs/ (the command writes into docs/): nothing may change there."""
    spec_json, spec_md = tmp_path / "spec-check.json", tmp_path / "spec.md"
    spec_json.write_bytes(docgen.SPEC_JSON.read_bytes())
    spec_md.write_bytes(docgen.SPEC_MD.read_bytes())
    monkeypatch.setattr(docgen, "SPEC_JSON", spec_json)
    monkeypatch.setattr(docgen, "SPEC_MD", spec_md)
    before = (spec_json.read_bytes(), spec_md.read_bytes())
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    assert "not" in _error(capsys, ["docs", "--spec-check", str(bad)])
    assert (spec_json.read_bytes(), spec_md.read_bytes()) == before
    # the committed JSON still renders (the same path, unchanged)
    assert main(["docs"]) == 0 and spec_md.read_bytes() == before[1]


def test_docs_outside_a_checkout(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(docgen, "SPEC_MD", tmp_path / "docs" / "spec.md")
    assert "regenerates the docs/ of a toolkv checkout" in _error(capsys, ["docs"])


@pytest.mark.parametrize(
    ("module", "extra"), [("sglang", "sglang"), ("hypothesis", "test"), ("httpx", "client")]
)
def test_a_missing_dependency_names_the_extra(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, module: str, extra: str
) -> None:
    import toolkv.tools.demo as demo

    def run(_args: Any) -> int:
        raise ModuleNotFoundError(f"No module named '{module}'", name=module)

    monkeypatch.setattr(demo, "run", run)
    line = _error(capsys, ["demo"])
    # no package index has toolkv: the hint names the wheel the install docs build from a checkout
    assert line == (
        f"toolkv demo: error: needs {module}, which is not installed here: pip install "
        f"'dist/toolkv-0.1.0-py3-none-any.whl[{extra}]' (the wheel built in a toolkv checkout: "
        "python -m pip wheel --no-deps -w dist .)"
    )


def test_a_missing_toolkv_module_is_a_bug_not_a_message(monkeypatch: pytest.MonkeyPatch) -> None:
    import toolkv.tools.demo as demo

    def run(_args: Any) -> int:
        raise ModuleNotFoundError("No module named 'toolkv.nothing'", name="toolkv.nothing")

    monkeypatch.setattr(demo, "run", run)
    with pytest.raises(ModuleNotFoundError):
        main(["demo"])


def test_debug_shows_the_traceback(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    f = tmp_path / "t.jsonl"
    f.write_text("nope\n")
    monkeypatch.setenv("TOOLKV_DEBUG", "1")
    with pytest.raises(InputError):
        main(["trace-check", str(f)])
