"""The TLC configs ``make test`` leaves out of ``toolkv spec-check`` are covered by others it runs.

``make test`` runs ``toolkv spec-check --skip NAME ...`` with the names in the Makefile's
``SPEC_CHECK_COVERED`` (``make test-long`` and a plain ``toolkv spec-check`` run every config). Each
left-out config must be covered by a run of the same ``make test`` (docs/testing.md says why):

* ``safety`` by ``policy`` and ``live`` by ``live_policy``: the same constants but ``Policy``
  (FALSE -> TRUE) and ``KeepTTL``; the same INIT/NEXT or SPECIFICATION, VIEW and SYMMETRY; a
  superset of the invariants and properties. ``Policy`` only enables actions (every use in the spec
  is a guard conjunct ``/\\ Policy``) and ``KeepTTL`` is read only on paths those actions open, so
  every behaviour of the smaller model is one of the larger (fair under the same fairness: no
  fairness condition names a policy action), and what holds on the larger holds on it.
* ``dump`` by the conformance graph ``dump`` of the pytest stage: TLC runs the same config (with
  ``-dump``), and the graph's dump fails unless TLC passes.
* ``ring`` by ``ring_policy`` at fewer nodes: the same pair of differences as above, and ``Nodes``
  a subset. This cover is smaller than the config it stands for: ``make test`` checks ``ring``'s
  invariants and properties on every behaviour of ``ring``'s model over the nodes ``ring_policy``
  has (a behaviour that never inserts the others is one of ``ring``'s), and ``make test-long``
  the behaviours that need the third node.

The checks below are the premises of those arguments, so a change of the spec or of a config that
breaks one fails here instead of leaving a config unchecked by ``make test``.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from toolkv.verify import spec_check
from toolkv.verify.tla.tlc import cfg_constants, cfg_sections
from toolkv.verify.toolkv.conformance import load_conformance

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "spec"
COVERED_BY = {"safety": "policy", "live": "live_policy"}  # left out -> the larger config run instead
FEWER_NODES = {"ring": "ring_policy"}  # left out -> the same with the policy, over a subset of its nodes
DUMPED = {"dump"}  # left out -> the pytest stage dumps the same config and fails unless TLC passes
NEW_IN_LARGER = {"Policy": ("FALSE", "TRUE"), "KeepTTL": None}


def _skipped() -> set[str]:
    m = re.search(r"^SPEC_CHECK_COVERED\s*:?=\s*(.*)$", (ROOT / "Makefile").read_text(), re.M)
    assert m, "the Makefile names no SPEC_CHECK_COVERED"
    return set(m.group(1).split())


def _configs() -> dict[str, spec_check.ConfigSpec]:
    return {c.name: c for c in spec_check.load_manifest(SPEC)[1]}


def _definitions() -> dict[str, str]:
    """ToolKV.tla's top-level definitions (comments removed), by name."""
    text = re.sub(r"\(\*.*?\*\)", "", (SPEC / "ToolKV.tla").read_text(), flags=re.S)
    text = re.sub(r"\\\*.*", "", text)
    text = re.sub(r"^ASSUME\b", "ASSUME ==", text, flags=re.M)  # the assumptions: a part of their own
    parts = re.split(r"^([A-Za-z_]\w*)(?:\([^)]*\))?\s*==", text, flags=re.M)
    return {parts[i]: parts[i + 1] for i in range(1, len(parts) - 1, 2)}


def _guarded(body: str) -> bool:
    return re.search(r"/\\ Policy\b", body) is not None


def test_make_test_leaves_out_only_covered_configs() -> None:
    skipped, configs = _skipped(), _configs()
    argued = set(COVERED_BY) | DUMPED | set(FEWER_NODES)
    assert skipped <= argued, f"no cover argued for {skipped - argued}"
    assert skipped <= set(configs), f"not in spec/configs.toml: {skipped - set(configs)}"
    covers = {**COVERED_BY, **FEWER_NODES}
    assert all(covers[s] not in skipped for s in skipped if s in covers)


def test_the_larger_configs_differ_only_by_the_policy() -> None:
    configs = _configs()
    for small, large in {**COVERED_BY, **FEWER_NODES}.items():
        a, b = (SPEC / configs[small].cfg).read_text(), (SPEC / configs[large].cfg).read_text()
        ca, cb = cfg_constants(a), cfg_constants(b)
        assert set(ca) == set(cb), (small, large)
        differ = {k for k in ca if ca[k] != cb[k]}
        if small in FEWER_NODES:  # the cover runs over a subset of the nodes (a smaller instance)
            assert set(cb["Nodes"]) < set(ca["Nodes"]), (small, large, ca["Nodes"], cb["Nodes"])
            differ.discard("Nodes")
        assert differ <= set(NEW_IN_LARGER), f"{small} vs {large}: {differ}"
        assert (ca["Policy"], cb["Policy"]) in {(False, True), ("FALSE", "TRUE")}, (
            ca["Policy"],
            cb["Policy"],
        )
        sa, sb = cfg_sections(a), cfg_sections(b)
        for key in ("INIT", "NEXT", "SPECIFICATION", "VIEW", "SYMMETRY", "CONSTRAINTS", "ACTION_CONSTRAINTS"):
            assert sa.get(key) == sb.get(key), (small, large, key)
        for key in ("INVARIANTS", "PROPERTIES"):
            assert set(sa.get(key, [])) <= set(sb.get(key, [])), (small, large, key)
        assert configs[small].kind == configs[large].kind and configs[large].expect == "pass"


def test_policy_only_enables_actions_and_keep_ttl_is_read_only_behind_them() -> None:
    defs = _definitions()
    for name, body in defs.items():
        for m in re.finditer(r"\bPolicy\b", body):
            before = body[: m.start()].rstrip()
            assert before.endswith("/\\") or name == "ASSUME", f"{name}: Policy used other than as a guard"
    uses = {name for name, body in defs.items() if re.search(r"\bKeepTTL\b", body)}
    assert uses <= {"KeepFor", "ASSUME"}, f"KeepTTL read outside KeepFor: {uses - {'KeepFor', 'ASSUME'}}"
    uses = {name for name, body in defs.items() if re.search(r"\bKeepFor\b", body)}
    assert uses <= {"KeepDeadline", "WarmDeadline", "KeptWithinKeepTTL"}, uses
    # KeepDeadline and WarmDeadline: in policy actions, or in LoadAck for a Prefetching session
    uses = {name for name, body in defs.items() if re.search(r"\b(KeepDeadline|WarmDeadline)\b", body)}
    uses -= {"KeepDeadline", "WarmDeadline"}
    assert {u for u in uses if not _guarded(defs[u])} <= {"LoadAck"}, uses
    assert re.search(r'Warm == \{s \\in Sessions : phase\[s\] = "Prefetching"', defs["LoadAck"])
    # and only a policy action makes a session Prefetching (a value given, not one compared with)
    enters = {n for n, b in defs.items() if re.search(r'(?:THEN|ELSE|->|!\[s\] =)\s*"Prefetching"', b)}
    assert enters and all(_guarded(defs[n]) for n in enters), enters
    fairness = defs["Fairness"]
    policy_actions = {n for n, b in defs.items() if _guarded(b) and n != "ASSUME"}
    assert not {a for a in policy_actions if re.search(rf"\b{a}\b", fairness)}, (
        "fairness names a policy action"
    )


def test_the_dump_config_is_the_conformance_graph_checked_by_pytest() -> None:
    configs, (graphs, _) = _configs(), load_conformance(SPEC)
    for name in DUMPED:
        same = [g for g in graphs if g.cfg == configs[name].cfg and not g.constants]
        assert same, f"no [[conformance]] graph dumps {configs[name].cfg} as it is"
        assert configs[name].expect == "pass"


def test_skip_leaves_out_exactly_the_named_configs(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    spec_check.add_arguments(parser)
    skip = sorted(_skipped())
    assert spec_check.run(parser.parse_args(["--list", *(a for s in skip for a in ("--skip", s))])) == 0
    listed = {line.split()[0] for line in capsys.readouterr().out.splitlines()}
    assert listed == set(_configs()) - set(skip)
    # a name that matches nothing (a config renamed) is an error, not a silent no-op
    assert spec_check.run(parser.parse_args(["--list", "--skip", "no_such_config"])) == 2
