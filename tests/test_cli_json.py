"""``--json`` means the same in every command: the result as JSON on stdout. ``toolkv fuzz`` used to
take a file path there; a file is now ``--out FILE``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from toolkv.tools.cli import main


def test_fuzz_json_prints_and_out_writes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "fuzz.json"
    rc = main(["fuzz", "--examples", "1", "--steps", "5", "--seed", "3", "--json", "--out", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    doc = json.loads(printed[printed.index("[\n") :])  # after the progress lines
    assert doc == json.loads(out.read_text())
    assert doc[0]["examples"] == 1
