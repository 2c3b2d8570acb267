"""Never slower than stock: a fast slice of the regime map (``toolkv twin map``) in ``make test``.

Two cells of the map, each over two seeds, on the twin of one sglang 0.5.16 server (sglang's real
HiRadixCache and scheduler parts, modelled GPU time): the GPU value load (48 sessions, 16 GB host)
and the same load with twice the sessions, where toolkv was slower than stock before load-adaptive
protection. ``offload`` and ``auto`` must stay within the never-worse bars of
:mod:`toolkv.twin.regime_map` (>= 0.98x stock's closed throughput, <= 1.05x its resumed TTFT p90,
medians over seeds) in both, and reach the target (>= 1.5x throughput or <= 0.7x p90) on the
value load, where the live KV is 3x the host. The same toolkv without load-adaptive protection
(``offload-pinned``, TOOLKV_ADAPTIVE=0) runs in the larger cell too: the bars must catch it, or the
slice could not see the regression it is here for. The write-policy axis: the 96-session
named-tool cell (16 GB host) under ``write_back`` and ``write_through_selective``, over two seeds,
where ``auto`` under write_back once filled the device with locked paths (a tool_start copy in
flight when write_back's eviction drained the acks kept its lock for good). The whole map:
``make test-long``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from toolkv.twin.regime_map import cells, never_worse, read_journal, run_map, short_of_target, task_of, tasks

pytest.importorskip("sglang.srt.mem_cache.hiradix_cache")


@pytest.fixture(scope="module")
def recs() -> list[dict[str, object]]:
    todo = tasks([48], [16.0], ["traces"], [0, 1], ["stock", "offload", "auto"])
    todo += tasks([96], [16.0], ["traces"], [0, 1], ["stock", "offload", "auto", "offload-pinned"])
    todo += tasks([96], [16.0], ["named"], [0, 1], ["stock", "offload", "auto"], POLICIES)
    return cells(run_map(todo, jobs=2, quiet=True))


POLICIES = ("write_back", "write_through_selective")


def test_every_write_policy_has_its_cells(recs: list[dict[str, object]]) -> None:
    """The slice ran the named-tool cell under each other write policy (not write_through again)."""
    got = {(r.get("write_policy"), r["config"]) for r in recs if r["tool_shape"] == "named"}
    assert got == {(wp, c) for wp in POLICIES for c in ("stock", "offload", "auto")}


def test_offload_and_auto_are_never_slower_than_stock(recs: list[dict[str, object]]) -> None:
    assert never_worse(recs) == []


def test_on_the_value_load_they_reach_the_target(recs: list[dict[str, object]]) -> None:
    value = [r for r in recs if r["sessions"] == 48]
    assert value and short_of_target(value) == []


def test_the_bars_catch_pinning_through_the_queue(recs: list[dict[str, object]]) -> None:
    caught = never_worse(recs, configs=("offload-pinned",))
    assert any("96 sessions" in m for m in caught), caught


def test_a_stopped_map_resumes_from_its_journal(tmp_path: Path) -> None:
    """Runs already in the journal are not run again (a pool would start for the rest); a torn last
    line, as a map killed mid-write leaves, is skipped."""
    todo = tasks([24], [8.0], ["traces"], [0], ["stock", "offload"])
    journal = tmp_path / "map.runs.jsonl"
    rows = [{"sessions": t.sessions, "host_gb": t.host_gb, "tool_shape": t.shape, "seed": t.seed,
             "config": t.config, "closed_turns_per_s": 1.0} for t in todo]  # fmt: skip
    journal.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"sessions": 24, "host')
    assert len(read_journal(journal)) == 2
    got = run_map(todo, jobs=1, quiet=True, journal=journal)
    assert sorted(r["config"] for r in got) == ["offload", "stock"]
    assert len(journal.read_text().splitlines()) == 3  # nothing appended: nothing ran


ROOT = Path(__file__).resolve().parents[1]
MAP = ROOT / "docs" / "results" / "twin" / "map.json"


def test_the_committed_map_is_the_table_in_the_docs() -> None:
    """docs/benchmarks.md shows the committed map as ``doc_table`` renders it: a re-run map whose
    table was not regenerated (or a hand-edited figure) fails here."""
    import re

    from toolkv.twin.regime_map import doc_table

    data = json.loads(MAP.read_text())
    doc = (ROOT / "docs" / "benchmarks.md").read_text()
    block = re.search(r"<!-- BEGIN twin-map -->\n(.*?)\n<!-- END twin-map -->", doc, re.S)
    assert block is not None and block.group(1).strip() == doc_table(data).strip(), (
        "regenerate the map table in docs/benchmarks.md: python -m toolkv.twin.regime_map --doc-table "
        "docs/results/twin/map.json"
    )


def test_the_docs_facts_of_the_map_are_computed_from_it() -> None:
    """The prose numbers about the map (its margins, misses, auto against offload) are the
    ``facts`` block, rendered from the same JSON: a re-run map with stale prose fails here."""
    import re

    from toolkv.twin.map_facts import facts

    data = json.loads(MAP.read_text())
    doc = (ROOT / "docs" / "benchmarks.md").read_text()
    block = re.search(r"<!-- BEGIN twin-map-facts -->\n(.*?)\n<!-- END twin-map-facts -->", doc, re.S)
    assert block is not None and block.group(1).strip() == facts(data).strip(), (
        "regenerate: python -m toolkv.twin.regime_map --doc-table docs/results/twin/map.json --facts"
    )


def test_the_committed_map_is_whole_and_its_cells_match_its_runs() -> None:
    """map.json holds every run of its axes (one per cell, seed and config) and its cells are what
    ``cells`` makes of those runs now, so the summary cannot drift from the runs it came from."""
    data = json.loads(MAP.read_text())
    ax = data["axes"]
    want = set(
        tasks(ax["sessions"], ax["hosts_gb"], ax["tool_shapes"], ax["seeds"], ax["configs"],
              ax.get("write_policies", ["write_through"]))
    )  # fmt: skip
    have = {task_of(r) for r in data["runs"]}
    assert have == want
    assert json.loads(json.dumps(cells(data["runs"]), default=str)) == data["cells"]
    assert data["never_worse_violations"] == never_worse(cells(data["runs"]))


def test_a_known_miss_does_not_fail_the_long_map_but_a_new_one_does(tmp_path: Path) -> None:
    """``make test-long``'s map run: a cell already listed as slower than stock in the committed map
    is reported, a cell that newly misses fails it."""
    import argparse

    from toolkv.twin.regime_map import add_map_arguments, main

    def row(config: str, p90: float) -> dict[str, object]:
        return {"sessions": 24, "host_gb": 8.0, "tool_shape": "traces", "seed": 0, "config": config,
                "closed_turns_per_s": 1.0, "turns": 10, "resumed_ttft_p50_s": 0.1, "resumed_ttft_p90_s": p90,
                "reuse": 0.5, "opt_reuse": 1.0, "passed": True, "crashed": None, "live_kv_gb": 30.0}  # fmt: skip

    journal = tmp_path / "map.runs.jsonl"
    journal.write_text("".join(json.dumps(r) + "\n" for r in (row("stock", 1.0), row("offload", 2.0))))
    p = argparse.ArgumentParser()
    p.add_argument("--out")
    p.add_argument("--plot")
    p.add_argument("--json", action="store_true")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--configs")
    p.add_argument("--host-gb")
    add_map_arguments(p)
    argv = ["--map-sessions", "24", "--host-gb", "8", "--map-shapes", "traces", "--seeds", "0",
            "--configs", "stock,offload", "--journal", str(journal), "--quiet"]  # fmt: skip
    assert main(p.parse_args(argv)) == 1  # offload's p90 is 2x stock's: a miss
    known = tmp_path / "known.json"
    known.write_text(json.dumps({"never_worse_violations": ["traces 24 sessions 8 GB offload: p90 ..."]}))
    assert main(p.parse_args([*argv, "--known", str(known)])) == 0
    known.write_text(json.dumps({"never_worse_violations": ["traces 48 sessions 8 GB offload: p90 ..."]}))
    assert main(p.parse_args([*argv, "--known", str(known)])) == 1


WP_MAP = ROOT / "docs" / "results" / "twin" / "write_policy_map.json"
WP_RUN = ROOT / "docs" / "results" / "twin" / "write_back_named96.json"


def _block(doc: str, name: str) -> str:
    import re

    m = re.search(rf"<!-- BEGIN {name} -->\n(.*?)\n<!-- END {name} -->", doc, re.S)
    assert m is not None, name
    return m.group(1).strip()


def test_the_write_policy_map_is_the_table_in_the_docs() -> None:
    """docs/benchmarks.md's write-policy slice of the map is ``doc_table`` of its committed JSON, and
    that JSON's cells and misses are what its runs give now."""
    from toolkv.twin.regime_map import doc_table

    data = json.loads(WP_MAP.read_text())
    doc = (ROOT / "docs" / "benchmarks.md").read_text()
    assert _block(doc, "twin-map-write-policy") == doc_table(data).strip(), (
        "regenerate: python -m toolkv.twin.regime_map --doc-table docs/results/twin/write_policy_map.json"
    )
    assert json.loads(json.dumps(cells(data["runs"]), default=str)) == data["cells"]
    assert data["never_worse_violations"] == never_worse(cells(data["runs"]))
    assert {task_of(r).write_policy for r in data["runs"]} == set(data["axes"]["write_policies"])


def test_the_write_back_run_is_the_table_in_the_docs() -> None:
    """docs/twin.md's 96-session named-tool table under each write policy is its committed JSON."""
    from toolkv.twin.write_policy import doc_table

    doc = (ROOT / "docs" / "twin.md").read_text()
    assert _block(doc, "twin-write-back-named96") == doc_table(json.loads(WP_RUN.read_text())).strip(), (
        "regenerate: python -m toolkv.twin.write_policy --doc-table docs/results/twin/write_back_named96.json"
    )


def test_the_0523_write_back_run_is_the_table_in_the_docs() -> None:
    """docs/twin.md's 0.5.23 table of the same load is its committed JSON."""
    from toolkv.twin.write_policy import doc_table

    data = json.loads((ROOT / "docs" / "results" / "twin" / "write_back_named96_0523.json").read_text())
    doc = (ROOT / "docs" / "twin.md").read_text()
    assert _block(doc, "twin-write-back-named96-0523") == doc_table(data).strip()
