"""TP=2 on CPU: two gloo ranks, each with its own real DecodeKVCacheOffloadManager, driven by the
same seeded scheduler while rank 0's copy engine and backup thread run eagerly and rank 1's
lazily. With sglang's all_reduce(MIN) the ranks stay identical and the two-rank trace is a
behaviour of the spec; with each rank using its own counts (mutant ``LocalAckCounts``, patched
into the real class) they drift apart and the trace is refused.
(``research.decode_offload.tp`` is the rank program.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from research.decode_offload.tp import spawn
from research.decode_offload.tracecheck import check_trace

STEPS = 120


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("decode-tp")


@pytest.fixture(scope="module")
def episodes(out: Path) -> dict[str, list[dict[str, Any]]]:
    """Both episodes in one pair of processes (each process imports sglang once)."""
    return spawn(out, seed=3, steps=STEPS, mutants=(None, "LocalAckCounts"))


def test_skewed_ranks_stay_identical(episodes: dict[str, list[dict[str, Any]]]) -> None:
    r0, r1 = episodes["none"]
    assert r0["ok"] and r1["ok"], (r0.get("failure"), r1.get("failure"), r0.get("trace"), r1.get("trace"))
    assert r0["steps"] == r1["steps"] == STEPS
    prog = r0["progress"]  # per step: each rank's (copies done, increments freed, backup acks queued)
    assert any(p[0][0] != p[1][0] for p in prog), "the copy engines were never skewed"
    assert any(p[0][2] != p[1][2] for p in prog), "the backup threads were never skewed at a check"
    assert all(p[0][1] == p[1][1] for p in prog), "host memory was not freed in lockstep"


def test_local_ack_counts_make_the_ranks_diverge(episodes: dict[str, list[dict[str, Any]]]) -> None:
    r0, r1 = episodes["LocalAckCounts"]
    assert not r0["ok"] and r0["diverged_at"] is not None and r0["diverged_at"] == r1["diverged_at"], (r0, r1)


def test_the_two_rank_traces_against_the_spec(episodes: dict[str, list[dict[str, Any]]], out: Path) -> None:
    """The whole TP system as one trace (lockstep steps, then each rank's engine steps) is a
    behaviour of the spec with Ranks = {k1, k2}; the mutant's is refused at the diverging check."""
    ok = check_trace(out / "0-none" / "trace.jsonl")
    assert ok.ok, ok.message
    bad = check_trace(out / "1-LocalAckCounts" / "trace.jsonl")
    assert not bad.ok and bad.action == ["Check"], bad
