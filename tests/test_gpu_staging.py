"""The GPU staging pieces that can be checked without a GPU: the chat tokenizer built for dummy
weights, the model configs of both releases, and the acceptance summary's verdicts.

The GPU run itself (scripts/gpu_acceptance.sh) needs the H200; these tests make sure what it
carries is sound before a scarce GPU run finds out.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from _generated import ROOT, doc_block, load_script

STAGE = ROOT / "scripts" / "stage"


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tok")
    subprocess.run(
        [sys.executable, str(STAGE / "make_tokenizer.py"), str(out)], check=True, capture_output=True
    )
    return out


def test_tokenizer_covers_the_model_vocabulary_and_its_special_ids(tokenizer_dir: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    for name in ("llama-3.2-1b", "llama-3.1-8b", "granite-8b"):
        cfg = AutoConfig.from_pretrained(str(STAGE / "model_configs" / name))
        assert len(tok) == cfg.vocab_size, name  # every id the model can emit decodes
        assert (tok.bos_token_id, tok.eos_token_id) == (cfg.bos_token_id, cfg.eos_token_id), name
    # ids anywhere in the vocabulary decode without error, specials included
    text = tok.decode([0, 255, 4095, 64_000, 127_999, 128_000, 128_001, 128_255])
    assert "<|end_of_text|>" in text


def test_a_tool_call_is_a_few_tokens_and_round_trips(tokenizer_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    call = '[{"name": "run_code", "parameters": {}}]'
    ids = tok.encode(call, add_special_tokens=False)
    assert tok.decode(ids) == call
    assert len(ids) <= 20  # learnt merges: the forced call fits the zero-change check's max_tokens


def test_the_next_turn_renders_as_an_extension_of_the_previous_prompt(tokenizer_dir: Path) -> None:
    """toolkv's restore pays off only if turn 2's prompt starts with turn 1's prompt tokens."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    msgs = [{"role": "system", "content": "agent"}, {"role": "user", "content": "run it " * 200}]
    call = {"id": "c1", "type": "function", "function": {"name": "run_code", "arguments": "{}"}}
    nxt = [
        *msgs,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "exit 0"},
    ]
    one = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    two = tok.apply_chat_template(nxt, tokenize=False, add_generation_prompt=True)
    assert two.startswith(one)
    a, b = tok.encode(one, add_special_tokens=False), tok.encode(two, add_special_tokens=False)
    common = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), len(a))
    assert common >= len(a) - 2  # at most the trailing newline pair tokenizes differently


def _summary_module():  # type: ignore[no-untyped-def]
    return load_script(ROOT / "scripts" / "acceptance_summary.py")


def _run_summary(out: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> dict:  # type: ignore[type-arg]
    mod = _summary_module()
    monkeypatch.setattr(sys, "argv", ["acceptance_summary.py", str(out)])
    monkeypatch.setenv("COMMIT", "c0ffee")
    mod.main()
    capsys.readouterr()
    return json.loads((out / "acceptance.json").read_text())  # type: ignore[no-any-return]


def test_acceptance_fails_on_a_check_that_never_ran_or_whose_json_says_fail(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    rel = tmp_path / "0516"
    rel.mkdir()
    (rel / "steps.tsv").write_text("e2e\t0\t30\nzero_change\t0\t20\nload\t0\t100\nserver_log\t0\t0\n")
    (rel / "e2e.json").write_text(json.dumps({"passed": True, "checks": {"a": True}}))
    (rel / "zero_change.json").write_text(json.dumps({"passed": True, "sessions": []}))
    (rel / "load.json").write_text(json.dumps({"passed": True, "summary": {"http_5xx": 0}}))
    assert _run_summary(tmp_path, monkeypatch, capsys)["passed"] is True

    (rel / "load.json").write_text(json.dumps({"passed": False, "summary": {"http_5xx": 3}}))
    res = _run_summary(tmp_path, monkeypatch, capsys)
    assert res["passed"] is False and res["releases"]["0516"]["load"]["http_5xx"] == 3

    (rel / "load.json").write_text(json.dumps({"passed": True}))
    (rel / "steps.tsv").write_text("e2e\t0\t30\nload\t0\t100\nserver_log\t0\t0\n")  # zero_change never ran
    res = _run_summary(tmp_path, monkeypatch, capsys)
    assert res["passed"] is False and res["releases"]["0516"]["zero_change"]["note"] == "did not run"
    assert res["commit"] == "c0ffee"


@pytest.mark.parametrize(
    ("folder", "marker"), [("acceptance", "acceptance"), ("acceptance_rerun", "fuzz-rerun")]
)
def test_the_acceptance_table_in_the_docs_is_the_recorded_runs(
    folder: str,
    marker: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """docs/testing.md quotes ``acceptance_summary.py docs/results/<folder>`` verbatim: a stale
    figure is a bug."""
    import shutil

    rec = ROOT / "docs" / "results" / folder
    work = tmp_path / folder
    shutil.copytree(rec, work)
    commit = json.loads((rec / "acceptance.json").read_text())["commit"]
    mod = _summary_module()
    monkeypatch.setattr(sys, "argv", ["acceptance_summary.py", str(work)])
    monkeypatch.setenv("COMMIT", commit)
    mod.main()
    printed = capsys.readouterr().out.rstrip("\n")
    block = doc_block("testing.md", marker, fence="")
    assert block is not None and block == printed
