"""The shipped monitoring files, loaded and checked against what toolkv actually exports.

``deploy/prometheus/toolkv-rules.yml`` (alert rules) and ``deploy/grafana/toolkv.json`` (the
dashboard) name metrics, labels and label values in PromQL strings that nothing else checks: a
renamed counter or a new lifecycle phase would leave an alert that never fires. So every
expression is taken apart here and each metric, label and value is looked up in the collectors a
scheduler rank registers (:class:`toolkv.sglang.metrics.ToolKVMetrics`) and in the lifecycle
table. The rules' unit tests (``deploy/prometheus/toolkv-rules.test.yml``: for every rule a
healthy server on which it stays silent and the fault on which it fires) are checked for that
shape here, and run by ``promtool test rules``. ``promtool`` and a real PromQL parser
(``promql_parser``) run where they are installed; neither is a Python dependency, so those checks
skip without them (``.ci/run`` installs promtool from Debian's ``prometheus`` package).
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry

from toolkv import errors
from toolkv.core.lifecycle import HOLDING, SESSION_STATES
from toolkv.sglang.metrics import ToolKVMetrics

ROOT = Path(__file__).resolve().parents[1]
RULES = ROOT / "deploy" / "prometheus" / "toolkv-rules.yml"
RULE_TESTS = ROOT / "deploy" / "prometheus" / "toolkv-rules.test.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "toolkv.json"
SGLANG_LABELS = {"model_name", "tp_rank"}
# sglang's own scheduler gauges the rules read (to tell an idle server), with the labels its
# SchedulerMetricsCollector gives them; test_sglang_gauges_exist checks them in the installed sglang
SGLANG_GAUGES: dict[str, set[str]] = {
    name: {"model_name", "engine_type", "tp_rank", "pp_rank", "moe_ep_rank"}
    for name in ("sglang:num_running_reqs", "sglang:num_queue_reqs")
}

# PromQL words that are not metric names (functions, aggregations, operators, modifiers)
PROMQL_WORDS = {
    "sum", "min", "max", "avg", "count", "by", "without", "on", "ignoring", "group_left",
    "group_right", "and", "or", "unless", "rate", "irate", "increase", "delta", "histogram_quantile",
    "min_over_time", "max_over_time", "avg_over_time", "absent", "clamp_min", "clamp_max", "offset",
    "bool", "topk", "bottomk", "le",
}  # fmt: skip
# decisions_total{op}: what observe.DecisionLog and the scheduler side log
OPS = {"tool_start", "tool_end", "close", "auto_offload", "restore_on_request", "ttl_sweep", "tree_reset",
       "turn_while_protected", "admit"}  # fmt: skip


def exported() -> dict[str, set[str]]:
    """Sample name -> its label names, from the collectors one scheduler rank registers, every
    child populated once (a family without samples would not show its labels)."""
    reg = CollectorRegistry()
    m = ToolKVMetrics({"model_name": "m", "tp_rank": "0"}, registry=reg, refresh_s=0.0)
    m.refresh(
        {
            "states": {"Running": 1},
            "counters": {"turns": 1, "offloaded_tokens": 1},
            "protected_tokens": 1,
            "host_total_tokens": 2,
            "host_free_tokens": 1,
            "device_free_tokens": 1,
            "device_evictable_tokens": 1,
            "device_locked_tokens": 0,
        }
    )
    m.decision("tool_start", "ok")
    for kind in ("offload", "restore"):
        m.completed(kind, 0.01, 1024)
    out: dict[str, set[str]] = {k: set(v) for k, v in SGLANG_GAUGES.items()}
    for fam in reg.collect():
        for s in fam.samples:
            out.setdefault(s.name, set()).update(s.labels)
    return out


def manager_events() -> set[str]:
    """events_total{event}: the manager's counter names (its source is the one list there is)."""
    src = "\n".join(
        f.read_text() for f in sorted((ROOT / "toolkv" / "core").rglob("*.py"))
    )  # any module of it
    names = {n for n in re.findall(r'counters\["([a-z0-9_]+)"\]', src) if not n.endswith("_tokens")}
    return names | set(re.findall(r'counters\[f"([a-z_]+)\{', src))  # prefixes: decision_, reason_


CODES = {c.code for c in vars(errors).values() if isinstance(c, type) and issubclass(c, errors.ToolKVError)}
# a zero-change offload that did nothing is counted as skip:<reason>: the session's state, untracked,
# disabled, or the code of the refusal it met (scheduler_side.decide_on_tool_calls, on_tool_calls)
SKIPS = {f"skip:{r}" for r in {*SESSION_STATES, "untracked", "disabled", *CODES}}
OUTCOMES = {"ok", "replayed", "internal"} | CODES | SKIPS
VALUES: dict[str, set[str]] = {"state": set(SESSION_STATES), "op": OPS, "outcome": OUTCOMES,
                               "kind": {"offloaded", "freed", "restored"}}  # fmt: skip

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_MATCHERS = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\s*\{([^}]*)\}")
_MATCHER = re.compile(r'([a-zA-Z_]+)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"')
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring)\s*\(([^)]*)\)")


def check_expr(expr: str, metrics: dict[str, set[str]]) -> list[str]:
    """Problems in one PromQL expression: unknown metrics, labels, or label values."""
    problems: list[str] = []
    used: set[str] = set()
    for name, body in _MATCHERS.findall(expr):
        if name in PROMQL_WORDS:
            continue
        used.add(name)
        for label, op, value in _MATCHER.findall(body):
            if name in metrics and label not in metrics[name]:
                problems.append(f"{name} has no label {label!r}")
            allowed = VALUES.get(label) or (manager_events() if label == "event" else None)
            if allowed is None or op in ("!=", "!~"):
                continue
            alternatives = value.split("|") if op == "=~" else [value]
            for alt in alternatives:
                if alt.endswith(".*"):
                    if not any(a.startswith(alt[:-2]) for a in allowed):
                        problems.append(f"{name}{{{label}}} pattern {alt!r} matches nothing toolkv exports")
                elif alt not in allowed and not alt.startswith("$"):
                    problems.append(f"{name}{{{label}=...}}: {alt!r} is not a value toolkv exports")
    bare = _STRING.sub('""', _MATCHERS.sub(lambda m: m.group(1), expr))
    bare = re.sub(r"\[[^\]]*\]", "", _GROUPING.sub("", bare))  # grouping labels, range selectors
    for word in re.findall(r"\b[a-zA-Z_:][a-zA-Z0-9_:]*\b", bare):
        if word not in PROMQL_WORDS and not word.startswith("__"):
            used.add(word)
    for name in sorted(used):
        if name not in metrics:
            problems.append(f"{name!r} is not a metric toolkv exports")
    labels = set().union(*(metrics.get(n, set()) for n in used)) | {"le"}
    for group in _GROUPING.findall(expr):
        for label in filter(None, (x.strip() for x in group.split(","))):
            if label not in labels:
                problems.append(f"grouping by {label!r}, which none of {sorted(used)} has")
    return problems


def rules() -> dict[str, Any]:
    data = yaml.safe_load(RULES.read_text())
    assert isinstance(data, dict)
    return data


def all_rules() -> list[dict[str, Any]]:
    return [r for g in rules()["groups"] for r in g["rules"]]


# ---- the alert rules ----------------------------------------------------------------------------
def test_rules_file_has_prometheus_rule_structure() -> None:
    data = rules()
    assert set(data) == {"groups"} and data["groups"]
    names = [g["name"] for g in data["groups"]]
    assert len(names) == len(set(names))
    for g in data["groups"]:
        assert set(g) <= {"name", "interval", "rules", "limit"} and g["rules"]
        for r in g["rules"]:
            assert ("alert" in r) != ("record" in r), r
            allowed = {"alert", "expr", "for", "keep_firing_for", "labels", "annotations"} if "alert" in r else {
                "record", "expr", "labels"}  # fmt: skip
            assert set(r) <= allowed and isinstance(r["expr"], str) and r["expr"].strip(), r
            if "for" in r:
                assert re.fullmatch(r"(\d+(ms|s|m|h|d|w|y))+", r["for"]), r["for"]
            for key in ("labels", "annotations"):
                assert all(isinstance(k, str) and isinstance(v, str) for k, v in r.get(key, {}).items())
            if "alert" in r:
                assert re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", r["alert"])
                assert r["labels"]["severity"] in ("warning", "critical")
                assert {"summary", "description"} <= set(r["annotations"])
    alerts = {r["alert"] for r in all_rules()}
    # harm, not occupancy: leaks (protections, locks at idle), accepted calls whose KV was lost,
    # protections that ran out, the refusal that costs prefill (507), restore latency
    assert alerts == {"ToolKVProtectionLeak", "ToolKVDeviceLocksAtIdle", "ToolKVOffloadedKVLost",
                      "ToolKVL3ReadBackShort", "ToolKVSessionsExpiring", "ToolKVHostMemoryFull",
                      "ToolKVRestoreSlow"}  # fmt: skip


def test_every_rule_expression_names_what_toolkv_exports() -> None:
    metrics = exported()
    problems = {r.get("alert", r.get("record")): check_expr(r["expr"], metrics) for r in all_rules()}
    assert not {k: v for k, v in problems.items() if v}, problems


def test_the_leak_rules_count_every_holding_phase() -> None:
    """The leak alerts are silenced by any session in a phase that holds KV. They list the idle
    phases (state!~), so a phase added to the lifecycle's HOLDING set (Handover was) counts at
    once; the list must be exactly the phases outside HOLDING, or they would fire for sessions
    that legitimately hold KV (a holding phase listed) or miss leaks (an idle phase left out)."""
    for name in ("ToolKVProtectionLeak", "ToolKVDeviceLocksAtIdle"):
        (leak,) = [r for r in all_rules() if r.get("alert") == name]
        (states,) = re.findall(r'toolkv:sessions\{state!~"([^"]+)"\}', leak["expr"])
        assert set(states.split("|")) == set(SESSION_STATES) - HOLDING, name


def test_sglang_gauges_exist() -> None:
    """The idle test reads sglang's own scheduler gauges: they must exist in the installed sglang,
    labelled with the served model name and the TP rank as toolkv's own series are."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("sglang is not installed")
    srt = Path(next(iter(spec.submodule_search_locations))) / "srt"
    sources = [f.read_text() for f in srt.glob("*/*collector*.py")]
    (src,) = [t for t in sources if "class SchedulerMetricsCollector" in t]
    for name, labels in SGLANG_GAUGES.items():
        assert f'name="{name}"' in src, name
        for label in labels:
            assert re.search(rf'"{label}":', src), (name, label)
    assert '"model_name": server_args.served_model_name' in src and '"tp_rank": tp_rank' in src


# ---- the rules' unit tests (promtool's format) ------------------------------------------------------
def rule_tests() -> dict[str, Any]:
    data = yaml.safe_load(RULE_TESTS.read_text())
    assert isinstance(data, dict)
    return data


def test_every_rule_has_a_healthy_and_a_fault_test() -> None:
    """The shape that makes the unit tests mean something, checked with or without promtool: the
    first two groups are the healthy servers (busy, idle), where every rule is evaluated and
    expected silent; and every rule has a group in which it is expected to fire."""
    data = rule_tests()
    assert data["rule_files"] == [RULES.name]
    groups = data["tests"]
    alerts = {r["alert"] for r in all_rules()}
    for healthy in groups[:2]:
        checked = healthy["alert_rule_test"]
        assert {t["alertname"] for t in checked} == alerts
        assert not [t for t in checked if t.get("exp_alerts")], "a healthy server fires nothing"
    fired = {t["alertname"] for g in groups[2:] for t in g["alert_rule_test"] if t.get("exp_alerts")}
    assert fired == alerts, f"no fault test fires {sorted(alerts - fired)}"
    for g in groups[2:]:  # and each fault group also checks a moment before its alert fires
        for name in {t["alertname"] for t in g["alert_rule_test"] if t.get("exp_alerts")}:
            assert any(t["alertname"] == name and not t.get("exp_alerts") for t in g["alert_rule_test"])


def test_rule_tests_feed_what_toolkv_exports() -> None:
    """Each input series is a metric, labels and label values toolkv (or sglang) exports."""
    metrics = exported()
    problems: dict[str, list[str]] = {}
    for g in rule_tests()["tests"]:
        for series in g["input_series"]:
            sel = series["series"]
            name, _, body = sel.partition("{")
            labels = set(re.findall(r"([a-zA-Z_]+)=", body))
            found = check_expr(sel, metrics)
            if name in metrics:
                found += [f"unknown label {x}" for x in labels - metrics[name]]
                found += [f"missing label {x}" for x in metrics[name] - labels - {"le"}]
            if found:
                problems[sel] = found
    assert not problems, problems


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed")
def test_promtool_rule_unit_tests_pass() -> None:
    p = subprocess.run(
        ["promtool", "test", "rules", RULE_TESTS.name], capture_output=True, text=True, check=False,
        cwd=RULE_TESTS.parent, timeout=120,
    )  # fmt: skip
    assert p.returncode == 0, p.stdout + p.stderr


def test_the_checker_catches_what_it_should() -> None:
    metrics = exported()
    assert check_expr('rate(toolkv:decisions_total{op="tool_start"}[5m])', metrics) == []
    assert check_expr("toolkv:decision_total", metrics)  # misspelled metric
    assert check_expr('toolkv:sessions{phase="Kept"}', metrics)  # no such label
    assert check_expr('toolkv:sessions{state=~"Kept|Dormant"}', metrics)  # no such phase
    assert check_expr("sum by (op) (toolkv:sessions)", metrics)  # grouping by a label it lacks


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed")
def test_promtool_accepts_the_rules() -> None:
    p = subprocess.run(
        ["promtool", "check", "rules", str(RULES)], capture_output=True, text=True, check=False
    )
    assert p.returncode == 0, p.stdout + p.stderr


def _dashboard_exprs() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in dash["panels"] for t in p["targets"]]


def test_promql_parser_accepts_every_expression() -> None:
    promql_parser = pytest.importorskip("promql_parser")
    for expr in [r["expr"] for r in all_rules()] + _dashboard_exprs():
        promql_parser.parse(expr.replace("$__rate_interval", "5m").replace("$model", ".*"))


# ---- the dashboard --------------------------------------------------------------------------------
def test_dashboard_is_a_grafana_dashboard_model() -> None:
    dash = json.loads(DASHBOARD.read_text())
    for key, kind in [("title", str), ("uid", str), ("schemaVersion", int), ("panels", list),
                      ("templating", dict), ("time", dict), ("tags", list)]:  # fmt: skip
        assert isinstance(dash.get(key), kind), key
    assert re.fullmatch(r"[A-Za-z0-9_-]{1,40}", dash["uid"])
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert (
        variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    )
    ids, cells = set(), set()
    for p in dash["panels"]:
        assert (
            isinstance(p["id"], int) and p["id"] not in ids and p["type"] in ("timeseries", "stat", "gauge")
        )
        ids.add(p["id"])
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        g = p["gridPos"]
        assert all(isinstance(g[k], int) for k in "hwxy") and g["x"] + g["w"] <= 24 and g["h"] > 0
        cell = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cell & cells, f"panel {p['title']!r} overlaps another"
        cells |= cell
        refs = [t["refId"] for t in p["targets"]]
        assert refs and len(refs) == len(set(refs)) and all(t["expr"].strip() for t in p["targets"])


def test_every_dashboard_expression_names_what_toolkv_exports() -> None:
    metrics = exported()
    problems = {e: check_expr(e, metrics) for e in _dashboard_exprs()}
    assert not {k: v for k, v in problems.items() if v}, problems
    used = {n for e in _dashboard_exprs() for n in re.findall(r"toolkv:[a-z_]+", e)}
    families = {
        re.sub(r"_(total|bucket|sum|count|created)$", "", n) for n in metrics if n.startswith("toolkv:")
    }
    assert {re.sub(r"_(total|bucket)$", "", n) for n in used} >= families - {
        "toolkv:offload_bytes", "toolkv:restore_bytes"}, "every family but the byte histograms is plotted"  # fmt: skip
