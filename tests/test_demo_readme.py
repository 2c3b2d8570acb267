"""README's ``make demo`` block is what ``toolkv demo`` prints at its default seed: the demo is
deterministic (a fixed seed, acks told apart by reference, not by a reusable ``id``), so a change
that moves any of its numbers must regenerate the block (``toolkv demo --timeline 0``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from toolkv.tools.cli import main

README = Path(__file__).resolve().parents[1] / "README.md"


def _readme_summary() -> str:
    text = README.read_text()
    start = text.index("`make demo` prints a timeline and a summary like this")
    body = text.index("```\n", start) + 4
    return text[body : text.index("```\n", body)]


def test_readme_shows_what_the_demo_prints(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--timeline", "0"]) == 0
    assert capsys.readouterr().out == _readme_summary()


def test_the_demo_is_deterministic(capsys: pytest.CaptureFixture[str]) -> None:
    outs = []
    for _ in range(2):
        assert main(["demo", "--timeline", "30", "--sessions", "6", "--device-tokens", "1024"]) == 0
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1]
