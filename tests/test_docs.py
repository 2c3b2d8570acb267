"""Generated parts of the docs are current."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from toolkv.tools.diagram import session_diagram, tier_diagram

DOCS = Path(__file__).resolve().parents[1] / "docs"


def _block(text: str, name: str) -> str:
    m = re.search(rf"<!-- BEGIN {name} -->\n```mermaid\n(.*?)\n```\n<!-- END {name} -->", text, re.S)
    assert m, f"no generated {name} block in docs/architecture.md"
    return m.group(1)


def test_architecture_diagrams_match_the_lifecycle_tables() -> None:
    text = (DOCS / "architecture.md").read_text()
    assert _block(text, "sessions") == session_diagram(), "run: toolkv diagram sessions"
    assert _block(text, "tiers") == tier_diagram(), "run: toolkv diagram tiers"


def test_architecture_map_is_the_layer_rules() -> None:
    """docs/architecture.md's package table says, for every package, exactly what
    ``toolkv.tools.layout.ALLOWED`` (the rules tests/test_layers.py enforces) lets it import."""
    from toolkv.tools.layout import ALLOWED

    text = (DOCS / "architecture.md").read_text()
    rows = dict(re.findall(r"^\| `toolkv/([a-z_]+)(?:\.py|/)` \|.*\| ([^|]+) \|$", text, re.M))
    assert set(rows) == {p.removeprefix("toolkv.") for p in ALLOWED if p != "toolkv"}, sorted(rows)
    for pkg, cell in rows.items():
        said = set(re.findall(r"`([a-z_]+)`", cell))
        want = {p.removeprefix("toolkv.") for p in ALLOWED[f"toolkv.{pkg}"] if p != "toolkv"}
        if cell.strip() == "anything":
            assert pkg == "tools"
            continue
        assert said == want, f"{pkg}: the map says {sorted(said)}, the rules {sorted(want)}"


def test_layout_measures_are_current() -> None:
    """The layout block of docs/architecture.md is what the package measures now."""
    from toolkv.tools.layout import BEGIN, END, block

    text = (DOCS / "architecture.md").read_text()
    assert text[text.index(BEGIN) : text.index(END) + len(END)] == block(), "run: toolkv docs --layout"


# ---- operator docs ------------------------------------------------------------------------------
ROOT = DOCS.parent
OWN = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]


def test_docs_have_no_machine_paths_or_workplace_words() -> None:
    """Docs are read on other machines: no absolute paths of this one, no words about how the
    work is organised."""
    bad = re.compile(r"(/work/|/tmp/|/home/|/root/|\.\./shared)|\b(wave|helper|CEO)\b", re.I)
    hits = [
        f"{p.name}:{i}: {line.strip()}"
        for p in OWN
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if bad.search(line)
    ]
    assert not hits, "\n".join(hits)


def test_sizing_warning_in_operations_is_what_the_plugin_prints() -> None:
    from toolkv.sglang.sizing import PoolSizes, host_pool_warning

    w = host_pool_warning(PoolSizes(device_tokens=122_880, host_tokens=122_070, bytes_per_token=131_072))
    assert w is not None and w in (DOCS / "operations.md").read_text()


def test_every_metric_is_documented() -> None:
    from prometheus_client import CollectorRegistry

    from toolkv.sglang.metrics import ToolKVMetrics

    reg = CollectorRegistry()
    ToolKVMetrics({"model_name": "m", "tp_rank": "0"}, registry=reg)
    names = {m.name + ("_total" if m.type == "counter" else "") for m in reg.collect()}
    assert len(names) == 16  # with toolkv:draining and toolkv:kv_recomputed_after_evict_tokens_total
    text = (DOCS / "operations.md").read_text()
    assert not [n for n in names if f"`{n}" not in text], sorted(n for n in names if f"`{n}" not in text)


def test_every_setting_is_in_the_operations_table() -> None:
    """A ``TOOLKV_*`` setting (one per config field) has its row in docs/operations.md's table,
    and the table has no row for a setting that is gone."""
    from toolkv.sglang.config import ToolKVConfig

    rows = set(re.findall(r"^\| `(TOOLKV_[A-Z0-9_]+)` \|", (DOCS / "operations.md").read_text(), re.M))
    assert rows == ToolKVConfig.variables(), rows ^ ToolKVConfig.variables()


def test_spec_results_table_is_generated_from_spec_check_json() -> None:
    """docs/spec.md's model-checking table is rendered from what `toolkv spec-check --json` wrote
    (regenerate: toolkv spec-check --json > f.json && toolkv docs --spec-check f.json)."""
    import json
    import tomllib

    from toolkv.tools.docgen import BEGIN, END, SPEC_JSON, spec_table

    summary = json.loads(SPEC_JSON.read_text())
    text = (DOCS / "spec.md").read_text()
    block = text[text.index(BEGIN) : text.index(END) + len(END)]
    assert block == spec_table(summary), "run: toolkv docs"
    assert "spec_dir" not in summary
    manifest = tomllib.loads((ROOT / "spec" / "configs.toml").read_text())
    names = {c["name"] for c in manifest["config"]}
    assert {c["name"] for c in summary["configs"]} <= names, "a config in the table no longer exists"


def test_a_later_spec_check_run_merges_into_the_stored_rows(tmp_path: Path, monkeypatch: Any) -> None:
    """`toolkv docs --spec-check-add`: a config of the later run replaces its row, a new one joins
    after the last of its kind, seconds add up, the runs are counted and the table says so; runs
    with different worker counts are refused and change nothing."""

    from toolkv.errors import InputError
    from toolkv.tools import docgen

    def row(name: str, kind: str, seconds: float) -> dict[str, Any]:
        return {
            "name": name,
            "kind": kind,
            "cfg": f"{name}.cfg",
            "expected": "pass",
            "result": "pass",
            "ok": True,
            "generated": 10,
            "distinct": 5,
            "depth": 3,
            "seconds": seconds,
            "exit_code": 0,
            "detail": "",
        }

    def summary(seconds: float, *configs: dict[str, Any]) -> dict[str, Any]:
        return {"ok": True, "seconds": seconds, "workers": 1, "sany": [], "configs": list(configs)}

    base = summary(30.0, row("a", "safe", 10.0), row("m", "mutant", 20.0))
    added = summary(7.0, row("m", "mutant", 3.0), row("b", "safe", 4.0))
    merged = docgen.merge_summaries(base, added)
    assert [r["name"] for r in merged["configs"]] == ["a", "b", "m"]
    assert merged["configs"][2]["seconds"] == 3.0 and merged["seconds"] == 37.0 and merged["runs"] == 2
    assert "3 configs in 37 s (over 2 runs, merged by `toolkv docs --spec-check-add`)" in docgen.spec_table(
        merged
    )
    with pytest.raises(InputError):
        docgen.merge_summaries(base, {**added, "workers": 2})
