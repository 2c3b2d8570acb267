"""The L3 storage tier under the Hypothesis state machine, over sglang's REAL ``HiCacheFile`` and
storage threads (CPU): the correct implementation survives the campaign, and each storage defect
of ``toolkv.verify.toolkv.mutants`` is killed — with every check on, and with the spec's
invariants alone for the two the storage model is about (restored from a copy never completely
written: ``RestoreSourceWhole``; a storage copy released while a prefetch reads it:
``ReadSourcePresent``).

Budgets (derandomised, so the numbers repeat): ``TOOLKV_STORAGE_EXAMPLES`` (default 200) examples
of ``TOOLKV_STORAGE_STEPS`` (60) steps for the correct implementation; a defect must be killed
within ``TOOLKV_STORAGE_KILL_EXAMPLES`` (300). ``toolkv fuzz --storage`` runs the same campaigns
with progress lines.
"""

from __future__ import annotations

import json
import os

import pytest

from toolkv.verify.storage.fuzzing import campaign

EXAMPLES = int(os.environ.get("TOOLKV_STORAGE_EXAMPLES", "200"))
STEPS = int(os.environ.get("TOOLKV_STORAGE_STEPS", "60"))
KILL_EXAMPLES = int(os.environ.get("TOOLKV_STORAGE_KILL_EXAMPLES", "300"))

pytestmark = pytest.mark.filterwarnings("ignore")

#: every action of StorageTier's Next the campaign must have performed
EVERY_ACTION = (
    "ToolStart", "HostAck", "Store", "StorePage", "StoreRefused", "StoreAck", "HostEvict",
    "ToolEndFromHost", "StoragePrefetch", "ReadPage", "PrefetchAck", "LoadAck", "L3Evict", "Expire", "Close",
)  # fmt: skip


def test_the_storage_tier_survives_the_campaign() -> None:
    r = campaign(examples=EXAMPLES, steps=STEPS)
    keys = ("examples", "steps", "seconds", "kv_bytes_checked", "counters")
    print("storage fuzz:", json.dumps({k: r[k] for k in keys}), json.dumps(r["actions"]))
    assert r["failure"] is None, (r["failure"], r["first_failure"])
    missing = [a for a in EVERY_ACTION if not r["actions"].get(a)]
    assert not missing, f"the campaign never performed {missing}: {r['actions']}"
    assert r["counters"].get("restored from L3", 0) > 0, "no session came back storage -> host -> GPU"
    assert r["actions"].get("composite", 0) > 0, "no implementation step stood for several spec steps"


def test_the_read_at_arrival_survives_the_campaign() -> None:
    """``ReadAtArrival`` / ``l3_read_at_arrival``: a Stored session's tool_end is
    ``ToolEndAtArrival`` (toolkv reads nothing, the session holds nothing)."""
    r = campaign(examples=EXAMPLES // 2, steps=STEPS, read_at_arrival=True)
    keys = ("examples", "steps", "seconds", "kv_bytes_checked")
    print("storage fuzz arrival:", json.dumps({k: r[k] for k in keys}), json.dumps(r["actions"]))
    assert r["failure"] is None, (r["failure"], r["first_failure"])
    every = [a for a in EVERY_ACTION if a not in ("StoragePrefetch", "ReadPage", "PrefetchAck")]
    missing = [a for a in (*every, "ToolEndAtArrival") if not r["actions"].get(a)]
    assert not missing, f"the campaign never performed {missing}: {r['actions']}"


@pytest.mark.parametrize(
    "mutant", ["RestoreBeforeStoreAck", "ReleaseDropsPin", "TrustShortAck", "ArrivalKeepsPin"]
)
def test_every_storage_defect_is_killed(mutant: str) -> None:
    arrival = mutant == "ArrivalKeepsPin"  # it acts on the tool_end at arrival only
    r = campaign(examples=KILL_EXAMPLES, steps=STEPS, mutant=mutant, read_at_arrival=arrival)
    print(f"storage kill {mutant}: {json.dumps({k: r[k] for k in ('examples_to_kill', 'failure')})}")
    assert r["failure"] is not None, f"{mutant} survived {r['examples']} examples"


@pytest.mark.parametrize(
    ("mutant", "invariant"),
    [("RestoreBeforeStoreAck", "RestoreSourceWhole"), ("ReleaseDropsPin", "ReadSourcePresent"),
     ("TrustShortAck", "StoredWhole"), ("ArrivalKeepsPin", "ReleasedHoldsNothing")],
)  # fmt: skip
def test_the_invariant_alone_kills_the_defect(mutant: str, invariant: str) -> None:
    """Without the step check and the teardown's leak check, the spec's invariant on the
    refinement mapping is what reports the defect: restored from a copy whose write was not
    acknowledged whole; a page deleted under a prefetch whose pin close let go; a short copy
    taken for a whole one."""
    arrival = mutant == "ArrivalKeepsPin"
    r = campaign(
        examples=KILL_EXAMPLES, steps=STEPS, mutant=mutant, checks="invariants", read_at_arrival=arrival
    )
    print(
        f"storage kill {mutant} by {invariant}: {json.dumps({k: r[k] for k in ('examples_to_kill', 'failure')})}"
    )
    reason = r["first_failure"] or ""  # what the first failing example raised
    assert "spec invariants violated" in reason and invariant in reason, (r["failure"], reason)


@pytest.mark.slow
def test_long_storage_campaign() -> None:
    """``make test-long``: ten times the CI campaign, with longer examples."""
    r = campaign(examples=2000, steps=80)
    print("storage fuzz long:", json.dumps({k: r[k] for k in ("examples", "steps", "seconds", "counters")}))
    assert r["failure"] is None, (r["failure"], r["first_failure"])
