"""docs/operations.md's examples of what toolkv prints and answers, checked against the code that
prints them: the start-up line, the decision log lines, and the session states ``kv_meta`` names.

A setting or a phase added to the code fails here until the example shows it.
"""

from __future__ import annotations

import re
from pathlib import Path

from toolkv.core.lifecycle import SESSION_STATES
from toolkv.sglang.config import ToolKVConfig
from toolkv.sglang.plugin import _config_line

ROOT = Path(__file__).resolve().parents[1]
OPERATIONS = (ROOT / "docs" / "operations.md").read_text()


def _pairs(text: str) -> list[tuple[str, str]]:
    return re.findall(r"(\w+)=(\S*)", text)


def test_the_start_up_line_is_what_the_plugin_prints() -> None:
    (line,) = re.findall(r"^\s*(toolkv enabled on scheduler .*)$", OPERATIONS, re.M)
    src = (ROOT / "toolkv" / "sglang" / "plugin.py").read_text()
    (fmt,) = re.findall(r'"(toolkv enabled on scheduler [^"]*)"', src)
    head = re.escape(fmt.split("%s %s%s")[0]).replace("%d", r"\d+").replace("%s", r"\S+")
    assert re.match(head, line), (fmt, line)
    doc = _pairs(line.split(": ", 1)[1])
    # the example's settings: TOOLKV_TTL_S=300 TOOLKV_HOST_BUDGET_TOKENS=400000, the rest default
    cfg = ToolKVConfig.from_env(
        {"TOOLKV_ENABLE": "1", "TOOLKV_TTL_S": "300", "TOOLKV_HOST_BUDGET_TOKENS": "400000"}
    )
    code = _pairs(_config_line(cfg))
    # the 8B shape of "Size host memory" with --tp 2 --hicache-size 16 (sglang: int(size * 1e9 // bytes))
    per_token = 2 * 32 * 8 * 128 * 2 // 2
    sizes = {"device_pool_tokens": "122880", "host_pool_tokens": str(int(16 * 1e9 // per_token))}
    sizes["kv_bytes_per_token"] = str(per_token)
    expected = dict(code) | sizes | {"backend": "hiradix", "metrics": "on"}
    order = ["backend", "metrics", *(k for k, _ in code), *sizes]
    assert [k for k, _ in doc] == order, "docs/operations.md, 'Is toolkv on?': print the line anew"
    wrong = {k: (v, expected[k]) for k, v in doc if v != expected[k]}
    assert not wrong, f"(example, code): {wrong}"


def test_the_decision_lines_have_the_logged_fields_in_order() -> None:
    src = (ROOT / "toolkv" / "sglang" / "observe.py").read_text()
    (fmt,) = re.findall(r'"(toolkv decision op=[^"]*)"', src)
    fields = [k for k, _ in _pairs(fmt)]
    lines = re.findall(r"^(toolkv decision op=.*)$", OPERATIONS, re.M)
    assert lines
    for line in lines:
        keys = [k for k, _ in _pairs(line)]
        assert keys[: len(fields)] == fields, line
        op = dict(_pairs(line))["op"]
        assert keys[len(fields) :] == (["asked"] if op == "tool_end" else []), (
            line
        )  # tool_end names its epoch
        assert dict(_pairs(line))["state"] in SESSION_STATES


def test_the_states_kv_meta_names_are_the_lifecycle_phases() -> None:
    (bullet,) = re.findall(r"^- `state`: (.*?)(?=^- )", OPERATIONS, re.M | re.S)
    named = re.findall(r"`([A-Z][a-z]+)`", bullet)
    assert len(named) == len(set(named)) and set(named) == set(SESSION_STATES), set(named) ^ set(
        SESSION_STATES
    )
