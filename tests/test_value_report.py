"""The value table in docs/benchmarks.md is the value report of the saved GPU runs (never typed by
hand), and the report's figures are what the per-turn records say."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _generated import ROOT, doc_block

from toolkv.tools.value_report import load, load_runs, main, stats, summarize_runs

RUNS = ROOT / "docs" / "results" / "value"


def test_the_docs_table_is_the_reports_output(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(RUNS)]) == 0
    printed = capsys.readouterr().out.strip()
    block = doc_block("benchmarks.md", "value")
    assert block is not None and block.strip() == printed, "regenerate the table in docs/benchmarks.md"


def test_the_repeated_runs_table_is_the_reports_output(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The repeated, interleaved GPU runs (docs/results/value_repeat/) as docs/benchmarks.md shows them
    (the command printed there runs from the repository root)."""
    monkeypatch.chdir(ROOT)
    assert main([f"docs/results/value_repeat/{c}/{r}" for c in ("A", "B") for r in ("r1", "r2")]) == 0
    printed = capsys.readouterr().out.strip()
    block = doc_block("benchmarks.md", "value-repeat")
    assert block is not None and block.strip() == printed, "regenerate the table in docs/benchmarks.md"


def test_ratios_are_against_the_stock_run_of_the_same_host_size() -> None:
    rows = {r["config"]: r for r in load([RUNS])}
    assert rows["stock16"]["tps_vs_stock"] == 1.0 and rows["stock64"]["tps_vs_stock"] == 1.0
    o = rows["offload16"]
    assert o["tps_vs_stock"] == pytest.approx(o["closed_turns_per_s"] / rows["stock16"]["closed_turns_per_s"])
    assert o["p90_vs_stock"] == pytest.approx(o["resumed_ttft_p90_s"] / rows["stock16"]["resumed_ttft_p90_s"])


def test_the_figures_follow_the_turn_records(tmp_path: Path) -> None:
    """A hand-made run of 10 turns: t90 is the 9th end, reuse the cached share of resumed prompts."""
    turns = [
        {"turn": i % 2, "start_s": float(i), "e2e_s": 1.0, "status": 200, "ttft_s": 0.1 * i,
         "prompt_tokens": 100, "cached_tokens": 50 if i % 2 else 0}
        for i in range(10)
    ]  # fmt: skip
    res = {"config": "stock16", "turns": turns, "summary": {"calls": {}}, "events": []}
    s = stats(res)
    assert s["t90_s"] == pytest.approx(9.0) and s["closed_turns_per_s"] == pytest.approx(1.0)
    assert s["reuse"] == pytest.approx(0.5) and s["resumed_turns"] == 5
    bad = tmp_path / "x.json"
    bad.write_text(json.dumps({"nothing": 1}))
    assert main([str(bad)]) == 2


# ---- repeated runs ---------------------------------------------------------------------------------
def _run(config: str, d: float, p50: float, p90: float, cached: int) -> dict[str, object]:
    """A hand-made closed run whose figures are known: 10 turns, turn i from i*d to (i+1)*d, so
    t90 = 9 d and closed turns/s = 1/d; the 5 resumed turns (odd i) have TTFTs p50, p50, p50, p90,
    p90 (so their p50 and p90 are exactly those) and ``cached`` of 100 prompt tokens (reuse)."""
    ttfts = iter([p50, p50, p50, p90, p90])
    turns = [
        {"turn": i % 2, "start_s": i * d, "e2e_s": d, "status": 200, "ttft_s": next(ttfts) if i % 2 else 0.1,
         "prompt_tokens": 100, "cached_tokens": cached if i % 2 else 0}
        for i in range(10)
    ]  # fmt: skip
    return {"config": config, "turns": turns, "summary": {"calls": {}}, "events": []}


# run -> config -> (d, p50, p90, cached). Ratios against the same run's stock16:
#   offload16: turns/s × 2.0, 1.6, 1.0; p50 × 0.5, 0.5, 0.8; p90 × 0.5, 1.0, 0.8; reuse 60, 70, 65 %
#   auto16 (not in r3): turns/s × 1.25, 0.8; p50 × 0.75, 0.5; p90 × 0.75, 0.5; reuse 50, 40 %
# The stock runs differ (1, 0.5, 1 turns/s): the median of offload's own turns/s is 1.0, the
# median of stock's 1.0, yet the median ratio is 1.6; only pairing within a repetition gives that.
RUNS_SPEC = {
    "r1": {"stock16": (1.0, 2.0, 2.0, 20), "offload16": (0.5, 1.0, 1.0, 60), "auto16": (0.8, 1.5, 1.5, 50)},
    "r2": {"stock16": (2.0, 2.0, 4.0, 30), "offload16": (1.25, 1.0, 4.0, 70), "auto16": (2.5, 1.0, 2.0, 40)},
    "r3": {"stock16": (1.0, 1.0, 1.0, 10), "offload16": (1.0, 0.8, 0.8, 65)},
}


def _write_runs(root: Path, spec: dict[str, dict[str, tuple[float, float, float, int]]]) -> list[Path]:
    out = []
    for run, cfgs in spec.items():
        d = root / run
        d.mkdir(parents=True)
        for cfg, args in cfgs.items():
            (d / f"{cfg}.json").write_text(json.dumps(_run(cfg, *args)))
        out.append(d)
    return out


def test_medians_and_ranges_over_runs_pair_each_run_with_its_own_stock(tmp_path: Path) -> None:
    folders = _write_runs(tmp_path / "runs", RUNS_SPEC)
    runs = load_runs(folders)
    assert list(runs) == ["r1", "r2", "r3"]
    s = {r["config"]: r for r in summarize_runs(runs)}
    assert list(s) == ["stock16", "offload16", "auto16"]
    o, a, st = s["offload16"], s["auto16"], s["stock16"]
    assert (o["runs"], o["runs_vs_stock"], a["runs"], st["runs"]) == (3, 3, 2, 3)

    def spread(rec: dict[str, object], key: str) -> tuple[float, float, float]:
        x = rec[key]
        assert isinstance(x, dict)
        return x["median"], x["min"], x["max"]

    assert spread(o, "tps_vs_stock") == pytest.approx((1.6, 1.0, 2.0))
    assert spread(o, "p50_vs_stock") == pytest.approx((0.5, 0.5, 0.8))
    assert spread(o, "p90_vs_stock") == pytest.approx((0.8, 0.5, 1.0))
    assert spread(o, "reuse") == pytest.approx((0.65, 0.60, 0.70))
    assert spread(o, "closed_turns_per_s") == pytest.approx((1.0, 0.8, 2.0))
    assert spread(a, "tps_vs_stock") == pytest.approx((1.025, 0.8, 1.25))  # even count: mean of the two
    assert spread(a, "p50_vs_stock") == pytest.approx((0.625, 0.5, 0.75))
    assert spread(a, "p90_vs_stock") == pytest.approx((0.625, 0.5, 0.75))
    assert spread(a, "reuse") == pytest.approx((0.45, 0.40, 0.50))
    assert spread(st, "tps_vs_stock") == pytest.approx((1.0, 1.0, 1.0))
    assert spread(st, "reuse") == pytest.approx((0.2, 0.1, 0.3))
    assert spread(st, "resumed_ttft_p90_s") == pytest.approx((2.0, 1.0, 4.0))


def test_the_report_takes_a_folder_of_runs_or_several_run_folders(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folders = _write_runs(tmp_path / "runs", RUNS_SPEC)
    assert main([str(tmp_path / "runs"), "--json", str(tmp_path / "s.json")]) == 0
    out = capsys.readouterr().out
    assert main([str(f) for f in folders]) == 0
    assert capsys.readouterr().out == out
    lines = out.splitlines()
    assert lines[0].startswith("Median (min–max) over runs: 3 runs (r1, r2, r3)")
    assert (
        "| offload16 | 3 | 1.00 (0.80–2.00) | 1.60× (1.00–2.00) | 0.50× (0.50–0.80) | 0.80× (0.50–1.00) |"
        in out
    )
    assert (
        "| auto16 | 2 | 0.82 (0.40–1.25) | 1.02× (0.80–1.25) | 0.62× (0.50–0.75) | 0.62× (0.50–0.75) |" in out
    )
    assert (
        "| stock16 | 3 | 1.00 (0.50–1.00) | 1.00× | 1.00× | 1.00× | 2.00 (1.00–4.00) | 20 % (10–30) |" in out
    )
    assert "| r2 | offload16 | 10 | 0.80 | 1.60× | 1.00 / 4.00 | 0.50× / 1.00× | 70 % |" in out
    saved = json.loads((tmp_path / "s.json").read_text())
    assert set(saved) == {"runs", "summary"} and list(saved["runs"]) == ["r1", "r2", "r3"]
    # one run folder alone is the single-run table, unless --runs asks for the summary
    assert main([str(folders[0])]) == 0
    assert capsys.readouterr().out.startswith("| config | turns | t90 s |")
    assert main(["--runs", str(folders[0])]) == 0
    assert "1 runs (r1)" in capsys.readouterr().out


def test_a_run_without_its_stock_counts_for_reuse_not_for_ratios(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A round cut short by the time budget (r2 has offload but no stock) and a dead server's file
    (no completed turn) are what a repeated GPU call can leave behind."""
    spec = {"r1": RUNS_SPEC["r1"], "r2": {"offload16": (1.0, 1.0, 1.0, 90)}}
    folders = _write_runs(tmp_path, spec)
    dead = _run("auto16", 1.0, 1.0, 1.0, 0)
    for t in dead["turns"]:  # type: ignore[union-attr]
        t["status"] = 503
    (folders[1] / "auto16.json").write_text(json.dumps(dead))
    s = {r["config"]: r for r in summarize_runs(load_runs(folders))}
    assert (s["offload16"]["runs"], s["offload16"]["runs_vs_stock"]) == (2, 1)
    assert s["offload16"]["tps_vs_stock"]["median"] == pytest.approx(2.0)
    assert s["offload16"]["reuse"]["median"] == pytest.approx(0.75)
    assert s["auto16"]["runs"] == 1  # the dead file is left out, with a warning
    assert "no completed turn" in capsys.readouterr().err
    assert main([str(tmp_path)]) == 0
    assert "| offload16 | 2 (1 vs stock) |" in capsys.readouterr().out
    assert main([str(folders[1] / "auto16.json")]) == 2  # alone, as a single run, it is an error
    assert main([str(folders[0]), str(folders[1] / "offload16.json")]) == 2  # folders and files mixed


@pytest.mark.parametrize(
    ("run", "marker"),
    [
        # the 96-session named-tools GPU run
        ("docs/results/value_repeat/named96/r1", "value-named96"),
        # the round at the lazy-free default (one H100)
        ("docs/results/value_repeat/C/r1", "value-repeat-lazy"),
    ],
)
def test_a_one_run_table_is_the_reports_output(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, run: str, marker: str
) -> None:
    """A one-run GPU table of docs/benchmarks.md is value_report's output over its run folder."""
    monkeypatch.chdir(ROOT)
    assert main([run]) == 0
    printed = capsys.readouterr().out.strip()
    block = doc_block("benchmarks.md", marker)
    assert block is not None and block.strip() == printed, "regenerate the table in docs/benchmarks.md"


@pytest.mark.parametrize(
    ("runs", "block_name"),
    [
        (["docs/results/l3_capacity/A/r1"], "l3-gpu"),
        (["docs/results/l3_capacity/C/r1", "docs/results/l3_capacity/C/r2"], "l3-gpu-c"),
    ],
    ids=["A", "C"],
)
def test_the_l3_gpu_tables_are_the_reports_output(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, runs: list[str], block_name: str
) -> None:
    """The L3 GPU runs as docs/benchmarks.md shows them (run A: one device call; run C:
    docs/results/l3_capacity/C/r1 and r2, one call each): each block begins with value_report's
    output over its runs."""
    monkeypatch.chdir(ROOT)
    assert main(runs) == 0
    printed = capsys.readouterr().out.strip()
    block = doc_block("benchmarks.md", block_name)
    assert block is not None and block.strip().startswith(printed), (
        "regenerate the table in docs/benchmarks.md"
    )


def test_the_ttft_bins_table_is_the_tools_output(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/benchmarks.md's resumed-turn TTFT bins (GPU rounds against the twin) are what
    ``python -m toolkv.tools.ttft_bins`` prints for the command beside them; a bad argument is an
    error, not a traceback."""
    import re
    import shlex

    from toolkv.tools.ttft_bins import main as bins_main

    monkeypatch.chdir(ROOT)
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    m = re.search(
        r"```bash\n(python -m toolkv\.tools\.ttft_bins .*?)\n```\n\n<!-- BEGIN ttft-bins -->", text, re.S
    )
    assert m is not None, "the command above the ttft-bins block"
    args = shlex.split(m.group(1).replace("\\\n", " "))[3:]
    assert bins_main(args) == 0
    printed = capsys.readouterr().out.strip()
    assert doc_block("benchmarks.md", "ttft-bins").strip() == printed, "regenerate the ttft-bins block"
    for bad in (["nolabel.json"], ["x=docs/results/value_repeat"], ["x=/nonexistent.json"]):
        assert bins_main(bad) == 2
        assert "ttft_bins: error" in capsys.readouterr().err


def test_ttft_bins_counts_resumed_answered_turns_by_uncached_tokens() -> None:
    """Only turns after the first that were answered count; each lands in the bin of its
    prompt - cached tokens; decode is end to end - TTFT."""
    from toolkv.tools.ttft_bins import row

    def t(turn: int, prompt: int, cached: int, ttft: float, status: int = 200) -> dict[str, object]:
        return {"turn": turn, "prompt_tokens": prompt, "cached_tokens": cached, "ttft_s": ttft,
                "e2e_s": ttft + 1.0, "status": status}  # fmt: skip

    res = {"turns": [t(0, 3000, 0, 9.0), t(1, 3000, 2900, 0.2), t(1, 3000, 2700, 0.4), t(2, 6000, 0, 3.0),
                     t(2, 4000, 1000, 2.0), t(3, 5000, 4900, 7.0, status=503)]}  # fmt: skip
    r = row("x", res)
    assert r["resumed"] == 4 and r["decode_median_s"] == 1.0
    assert r["bins"][0]["ttft_median_s"] == pytest.approx(0.3)
    assert [b["n"] for b in r["bins"]] == [2, 0, 1, 1]
    assert r["bins"][2]["ttft_median_s"] == 2.0 and r["bins"][3]["ttft_median_s"] == 3.0


def test_the_eviction_harm_is_each_runs_own_share_of_the_servers_counter(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Runs share a server: a run's eviction harm is the counter at its end less at its start
    (kv_meta's ``recomputed_after_evict_tokens``), printed as a table of its own; results recorded
    before the count print no such table (the docs' recorded tables stay as they are)."""
    d = tmp_path / "run"
    d.mkdir()
    metas = {
        "stock16": ({"session": 0, "other": 100}, {"session": 0, "other": 1100}),
        "offload16": ({"session": 0, "other": 1100}, {"session": 300, "other": 1150}),
    }
    for cfg, (before, end) in metas.items():
        res = _run(cfg, 1.0, 1.0, 1.0, 50)
        res["server_meta"] = {
            "before": {"recomputed_after_evict_tokens": before},
            "end": {"recomputed_after_evict_tokens": end},
        }
        (d / f"{cfg}.json").write_text(json.dumps(res))
    rows = {r["config"]: r for r in load([d])}
    assert rows["stock16"]["recomputed_after_evict"] == {"session": 0, "other": 1000, "total": 1000}
    assert rows["offload16"]["recomputed_after_evict"] == {"session": 300, "other": 50, "total": 350}
    assert main([str(d)]) == 0
    out = capsys.readouterr().out
    assert "| stock16 | 0 | 1,000 | 1,000 |" in out and "| offload16 | 300 | 50 | 350 |" in out
    assert main([str(RUNS)]) == 0
    assert "recomputed after evict" not in capsys.readouterr().out
