"""The twin's sort of the host pool (``toolkv.twin.host_mix``): every host token is in exactly one
kind, at every sample, and docs/twin.md's table is the recorded run."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

pytest.importorskip("sglang.srt.mem_cache.hiradix_cache")

from _twin_common import SMALL, run

from toolkv.twin.host_mix import KINDS, mean_shares, table

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", ["stock", "offload"])
def test_every_host_token_is_in_one_kind_at_every_sample(name: str) -> None:
    """The kinds partition what the host pool has allocated (a node missed, or counted twice,
    breaks the sum), and the run used the host at all (a run with an empty host proves nothing)."""
    o = run(name, SMALL)
    mixes = [(s["host_used"], s["host_mix"]) for s in o.samples if "host_used" in s]
    assert mixes and any(used > 0 for used, _ in mixes)
    for used, mix in mixes:
        assert set(mix) == set(KINDS)
        assert sum(mix.values()) == used, (used, mix)
    shares = mean_shares(o.samples, o.host_tokens)
    assert shares is not None and 0 < sum(shares.values()) <= 1


def test_toolkv_protects_a_copy_stock_never_does() -> None:
    """Only toolkv takes host protection: stock's runs have no protected host-only token."""
    stock = run("stock", SMALL)
    assert all(s["host_mix"]["host_only_protected"] == 0 for s in stock.samples if s.get("host_mix"))


def test_the_docs_table_is_the_recorded_run() -> None:
    data = json.loads((ROOT / "docs" / "results" / "twin" / "host_mix.json").read_text())
    text = (ROOT / "docs" / "twin.md").read_text()
    m = re.search(r"<!-- BEGIN twin-host-mix -->\n(.*?)\n<!-- END twin-host-mix -->", text, re.S)
    assert m is not None, "docs/twin.md has no twin-host-mix block"
    assert m.group(1) == table(data)
    assert data["command"] in text


def test_the_0523_docs_table_is_the_recorded_run() -> None:
    """docs/twin.md's 0.5.23 table (host room from mirrors on the Python tree core) is its JSON."""
    data = json.loads((ROOT / "docs" / "results" / "twin" / "host_mix_0523.json").read_text())
    text = (ROOT / "docs" / "twin.md").read_text()
    m = re.search(r"<!-- BEGIN twin-host-mix-0523 -->\n(.*?)\n<!-- END twin-host-mix-0523 -->", text, re.S)
    assert m is not None, "docs/twin.md has no twin-host-mix-0523 block"
    assert m.group(1) == table(data)
    assert data["command"] in text
