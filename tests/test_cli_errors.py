"""Inputs that used to end in a traceback are one line and exit status 2 (issue: CLI and
package): a file that is not a trace, ``bench transfer --device cuda`` without a GPU, ``fuzz-http``
against a server that is not there, ``docs --spec-check`` with a file that is not spec-check
output (which also overwrote docs/spec-check.json before it was read), and a command whose
dependency is not installed (it names the extra). The installed-wheel side of the same issue is
tests/test_wheel_install.py."""

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


@pytest.mark.parametrize(("module", "extra"), [("sglang", "toolkv[sglang]"), ("hypothesis", "toolkv[test]"),
                                               ("httpx", "toolkv[client]")])  # fmt: skip
def test_a_missing_dependency_names_the_extra(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, module: str, extra: str
) -> None:
    import toolkv.tools.demo as demo

    def run(_args: Any) -> int:
        raise ModuleNotFoundError(f"No module named '{module}'", name=module)

    monkeypatch.setattr(demo, "run", run)
    line = _error(capsys, ["demo"])
    assert line == f"toolkv demo: error: needs {module}, which is not installed here: pip install '{extra}'"


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
