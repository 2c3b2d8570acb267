"""``--json`` means the same in every command: the result as JSON on stdout. ``toolkv fuzz`` used to
take a file path there; a file is now ``--out FILE``. README says every command has it: ``diagram``,
``docs`` and ``bench agent`` did not (issue 36). ``toolkv --help`` is written for a user: what toolkv
is, that ``TOOLKV_ENABLE=1`` switches it on, and the commands by audience."""

from __future__ import annotations

import argparse
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


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    from toolkv.tools.cli import build_parser

    action = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_every_command_has_json() -> None:
    from toolkv.tools.agent_bench import parser as bench_agent_parser
    from toolkv.tools.cli import SUBCOMMANDS

    parsers = {**_subparsers(), "bench agent": bench_agent_parser()}
    assert set(SUBCOMMANDS) < set(parsers)
    # a server runs until Ctrl-C: its machine-readable answers are its HTTP API and /metrics
    servers = {"serve"}
    missing = [n for n, p in parsers.items() if "--json" not in p._option_string_actions and n not in servers]
    assert missing == []


def test_diagram_json_is_the_diagram(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["diagram", "sessions"]) == 0
    text = capsys.readouterr().out.strip()
    assert main(["diagram", "sessions", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["mermaid"] == text and doc["initial"] == "New" and "Handover" in doc["states"]
    assert {"from": "Restoring", "to": "Handover", "triggers": ["load_ack"]} in doc["edges"]
    lines = [f"    {e['from']} --> {e['to']}: {', '.join(e['triggers'])}" for e in doc["edges"]]
    assert text.splitlines()[2:] == lines


def test_docs_json_says_what_it_wrote(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from toolkv.tools import docgen

    spec_json, spec_md = tmp_path / "spec-check.json", tmp_path / "spec.md"
    spec_json.write_bytes(docgen.SPEC_JSON.read_bytes())
    spec_md.write_bytes(docgen.SPEC_MD.read_bytes())
    monkeypatch.setattr(docgen, "SPEC_JSON", spec_json)
    monkeypatch.setattr(docgen, "SPEC_MD", spec_md)
    assert main(["docs", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc == {"source": str(spec_json), "written": [str(spec_md)], "changed": False}
    spec_md.write_text(docgen.replace_block(spec_md.read_text(), f"{docgen.BEGIN}\nstale\n{docgen.END}"))
    assert main(["docs", "--json", "--spec-check", str(spec_json)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["written"] == [str(spec_json), str(spec_md)] and doc["changed"] is True


def test_help_is_for_a_user(capsys: pytest.CaptureFixture[str]) -> None:
    from toolkv.tools.cli import SUBCOMMANDS

    with pytest.raises(SystemExit) as ei:
        main(["--help"])
    out = capsys.readouterr().out
    assert ei.value.code == 0
    assert "toolkv is an sglang plugin" in out and "TOOLKV_ENABLE=1" in out and "sglang.launch_server" in out
    headings = [line for line in out.splitlines() if line.startswith("for ")]
    assert [h.split()[1] for h in headings] == ["operators,", "agents", "developers"]
    listed = {line.split()[0] for line in out.splitlines() if line.startswith("  ") and line.strip()}
    assert set(SUBCOMMANDS) <= listed, set(SUBCOMMANDS) - listed
    assert "``" not in out and "Each subcommand lives in its own module" not in out  # not the docstring
    assert max(len(line) for line in out.splitlines()) <= 100


def test_a_new_command_is_listed_even_without_an_audience(monkeypatch: pytest.MonkeyPatch) -> None:
    from toolkv.tools import cli

    monkeypatch.setitem(
        cli.SUBCOMMANDS, "inspect", ("toolkv.tools.diagram", "a command no audience row names yet")
    )
    assert "other commands:\n  inspect" in cli.commands_help()
