"""sglang's real DecodeKVCacheOffloadManager under the Hypothesis state machine (CPU harness):
the class as shipped survives, every seeded defect (patched into the real class) is killed, the
equivalent mutant survives, and the campaign's traces are behaviours of spec/decode/DecodeOffload.tla.

Budgets come from the environment: TOOLKV_DECODE_EXAMPLES (default 60), TOOLKV_DECODE_STEPS (60),
TOOLKV_DECODE_KILL_EXAMPLES (200). The long campaign is marked ``slow``.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from research.decode_offload import mutants as decode_mutants
from research.decode_offload.fuzzing import RIDS, campaign
from research.decode_offload.harness import DecodeHarnessConfig, DecodeOffloadHarness
from research.decode_offload.tracecheck import check_trace
from research.decode_offload.world import DecodeWorld

EXAMPLES = int(os.environ.get("TOOLKV_DECODE_EXAMPLES", "60"))
STEPS = int(os.environ.get("TOOLKV_DECODE_STEPS", "60"))
KILL_EXAMPLES = int(os.environ.get("TOOLKV_DECODE_KILL_EXAMPLES", "200"))

pytestmark = pytest.mark.filterwarnings("ignore")


@pytest.fixture(autouse=True)
def _quiet() -> Iterator[None]:
    logging.disable(logging.ERROR)  # sglang logs every write the host pool refuses
    yield
    logging.disable(logging.NOTSET)


EVERY_ACTION = (
    "Admit", "Decode", "Decode!refused", "Offload!issued", "Offload!refused!full", "Finish!issued",
    "Finish!none", "Check", "Copy", "Store",
)  # fmt: skip


def test_the_shipped_class_survives_the_campaign() -> None:
    r = campaign(examples=EXAMPLES, steps=STEPS, seed=1234)
    print("decode fuzz:", json.dumps({k: r[k] for k in ("examples", "steps", "seconds", "actions")}))
    assert r["failure"] is None, r["failure"]
    missing = [a for a in EVERY_ACTION if not r["actions"].get(a)]
    assert not missing, f"the campaign never performed {missing}: {r['actions']}"


def test_paged_with_a_two_page_stride_and_a_partial_prompt_page() -> None:
    cfg = DecodeHarnessConfig(page_size=2, device_tokens=48, host_ratio=0.125, stride_tokens=4)
    r = campaign(examples=max(EXAMPLES // 2, 10), steps=STEPS, seed=99, cfg=cfg, prompt_len=3, max_new=16)
    assert r["failure"] is None, r["failure"]
    assert r["actions"].get("Offload!issued") and r["actions"].get("Stutter")


@pytest.mark.parametrize("mutant", sorted(decode_mutants.MUTANTS))
def test_every_mutant_is_killed(mutant: str) -> None:
    r = campaign(examples=KILL_EXAMPLES, steps=STEPS, seed=7, mutant=mutant)
    print(f"decode kill {mutant}: {json.dumps({k: r[k] for k in ('examples_to_kill', 'failure')})}")
    assert r["failure"] is not None, f"mutant {mutant} survived {r['examples']} examples"


@pytest.mark.parametrize("mutant", sorted(decode_mutants.EQUIVALENT))
def test_the_equivalent_mutant_survives(mutant: str) -> None:
    """The release guard alone is redundant in 0.5.16 (TLC: decode_guard_redundant)."""
    r = campaign(examples=EXAMPLES, steps=STEPS, seed=11, mutant=mutant)
    assert r["failure"] is None, f"{mutant} was killed: the guard now matters ({r['failure']})"


def test_campaign_traces_are_spec_behaviours(tmp_path: Path) -> None:
    r = campaign(examples=5, steps=60, seed=5, trace_dir=tmp_path, swarm=False)
    assert r["failure"] is None, r["failure"]
    traces = sorted(tmp_path.glob("*.jsonl"))
    seen: set[str] = set()
    for t in traces:
        res = check_trace(t)
        assert res.ok, f"{t.name}: {res.message}"
        seen |= {json.loads(x)["act"][0] for x in t.read_text().splitlines()[2:]}
    assert {"Admit", "Decode", "Offload", "Finish", "Check", "Copy", "Store"} <= seen, seen


@pytest.mark.parametrize("mutant", [None, "FinalizeIgnoresInflight"])
def test_trace_check_finds_the_first_illegal_step(tmp_path: Path, mutant: str | None) -> None:
    """One scenario traced on the shipped class and on a broken one: only the broken trace is
    refused, at the finish that released the request with an increment in flight."""
    script = [
        ("admit", "r1"),
        ("decode", "r1"),
        ("offload", "r1"),
        ("finish", "r1"),
        ("copy", None),
        ("check", None),
    ]
    with decode_mutants.apply(mutant), DecodeOffloadHarness(DecodeHarnessConfig()) as h:
        w = DecodeWorld(h, RIDS[:1])
        steps = [{"act": ["Init"], "fits": True, "s": w.abstract()}]
        for name, arg in script:
            res = getattr(w, name)(arg) if arg else getattr(w, name)()
            steps.append({"act": res.act, "fits": res.fits, "s": w.abstract()})
        header = {
            "reqs": list(RIDS[:1]), "ranks": [w.rank], "pre": 3, "max_len": 15, "stride": 1,
            "dev_slots": h.cfg.device_tokens, "host_slots": int(h.host_pool.size),
        }  # fmt: skip
    f = tmp_path / "t.jsonl"
    f.write_text("\n".join(json.dumps(x) for x in [{"header": header}, *steps]) + "\n")
    res = check_trace(f)
    if mutant is None:
        assert res.ok, res.message
    else:
        assert not res.ok and res.first_illegal == 4 and res.action == ["Finish", "r1"], res


@pytest.mark.slow
def test_long_campaign() -> None:
    for ps, stride in ((1, None), (2, 4)):
        cfg = DecodeHarnessConfig(page_size=ps, device_tokens=24 * ps, host_ratio=0.125, stride_tokens=stride)
        r = campaign(examples=2000, steps=80, cfg=cfg)
        print("decode long:", json.dumps({k: r[k] for k in ("examples", "steps", "seconds")}))
        assert r["failure"] is None, r["failure"]
