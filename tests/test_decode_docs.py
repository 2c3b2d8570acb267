"""docs/decode_offload.md and spec/decode/ stay current: the committed lifecycle diagrams are the
ones generated from TLC's state graph, every model config is in the manifest, and every seeded
defect exists on both sides (a BUG value of the spec and a patch of the real class)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from research.decode_offload import diagram as decode_diagram
from research.decode_offload import mutants as decode_mutants
from toolkv.verify import spec_check

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "decode_offload.md"
SPEC = ROOT / "spec" / "decode"


def _bugs() -> set[str]:
    text = (SPEC / "DecodeOffload.tla").read_text()
    line = text[text.index("Bugs ==") : text.index("ASSUME")]
    return set(re.findall(r'"(\w+)"', line))


@pytest.mark.tlc
def test_committed_diagrams_are_the_generated_ones() -> None:
    text = DOC.read_text()
    assert decode_diagram.render(text, decode_diagram.generate()) == text, (
        "run: python -m research.decode_offload.diagram --write docs/decode_offload.md"
    )


def test_render_refuses_a_document_without_the_block() -> None:
    with pytest.raises(ValueError, match="decode-requests"):
        decode_diagram.render("no markers here", {"decode-requests": "x"})


def test_every_config_is_in_the_manifest() -> None:
    sany, configs = spec_check.load_manifest(SPEC)
    assert sany == ["DecodeOffload.tla"]
    listed = {c.cfg for c in configs}
    on_disk = {p.name for p in SPEC.glob("*.cfg")} - {decode_diagram.CFG}
    assert on_disk == listed, sorted(on_disk ^ listed)
    assert {c.kind for c in configs} == set(spec_check.KINDS)


def test_every_seeded_defect_exists_in_the_spec_and_as_a_patch() -> None:
    _, configs = spec_check.load_manifest(SPEC)
    in_cfgs = {re.search(r'BUG = "(\w+)"', (SPEC / c.cfg).read_text()).group(1) for c in configs}  # type: ignore[union-attr]
    bugs = _bugs() - {"none"}
    assert bugs <= in_cfgs, sorted(bugs - in_cfgs)
    patches = set(decode_mutants.MUTANTS) | set(decode_mutants.TP_MUTANTS) | set(decode_mutants.EQUIVALENT)
    assert patches == bugs, sorted(patches ^ bugs)
    text = DOC.read_text()
    assert all(f"`{b}`" in text for b in bugs), sorted(b for b in bugs if f"`{b}`" not in text)


def test_an_unknown_mutant_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown decode mutant 'Nope'"):
        decode_mutants.apply("Nope")
