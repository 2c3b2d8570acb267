"""The live GPU runs quoted in the docs are the recorded ones: the fault table in
``docs/reliability.md`` is ``scripts/gpu_faults.py --table`` of its JSON, and every recorded server
log replays against the spec with the session and line counts the docs quote. A stale figure is a
bug; a log with an illegal decision is one too."""

from __future__ import annotations

import json
from types import ModuleType

import pytest
from _generated import ROOT, doc_block, load_script

from toolkv.verify.toolkv.decisions import check_logs

RESULTS = ROOT / "docs" / "results"


def _gpu_faults() -> ModuleType:
    return load_script(ROOT / "scripts" / "gpu_faults.py")


def test_the_live_fault_table_in_the_docs_is_the_recorded_run() -> None:
    run = json.loads((RESULTS / "faults" / "faults_0516_write_back.json").read_text())
    block = doc_block("reliability.md", "live-faults")
    assert block is not None and block == _gpu_faults().table(run)
    assert run["passed"] and run["leak_free"], "the docs call every row of this run a pass"
    assert len(run["rows"]) == 10 and all(r["passed"] for r in run["rows"])


def test_a_failed_row_shows_as_a_failure_in_the_table() -> None:
    run = json.loads((RESULTS / "faults" / "faults_0516_write_through.json").read_text())
    lines = _gpu_faults().table(run).splitlines()[2:]
    failed = [r for r in run["rows"] if not r["passed"]]
    assert failed, "the write-through run has failed rows (see docs/reliability.md)"
    assert sum("| FAIL" in ln for ln in lines) == len(failed)


@pytest.mark.parametrize(
    ("logs", "sessions", "lines"),
    [
        (["faults/server_toolkv_0516_write_back.log"], 52, 118),
        (["faults/server_toolkv_0516_write_through.log"], 52, 132),
    ],
)
def test_recorded_live_logs_replay_against_the_spec(logs: list[str], sessions: int, lines: int) -> None:
    r = check_logs([RESULTS / p for p in logs])
    assert r.ok, [e.to_json() for e in r.errors]
    assert (r.sessions, r.lines) == (sessions, lines)
    doc = (ROOT / "docs" / "reliability.md").read_text()
    assert f"{sessions} sessions" in doc and f"{lines}" in doc
