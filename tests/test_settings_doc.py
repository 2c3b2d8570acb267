"""Every ``TOOLKV_*`` setting is declared once (``toolkv.core.settings``); the rest is derived.

Checked here: docs/operations.md's settings table is the declaration rendered (regenerate with
``toolkv docs --settings``); the plugin's ``ToolKVConfig`` has one field per declared setting, in
its order and of its type; the parser's defaults are the declared ones; and the library's own
``ManagerConfig`` / ``PolicyConfig`` defaults are the plugin's, so that a test or an embedder that
builds a ``ToolKVManager`` without settings checks the machine a server runs.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from toolkv.core.config import ManagerConfig
from toolkv.core.policy import PolicyConfig
from toolkv.core.settings import BEGIN, END, SETTINGS, PolicyName, of_layer, table
from toolkv.sglang.config import ToolKVConfig

OPS = Path(__file__).resolve().parents[1] / "docs" / "operations.md"
TYPES = {bool: {"bool"}, int: {"int", "int | None"}, float: {"float"}, str: {"str", "Fallback"}}


def test_the_operations_table_is_the_declaration() -> None:
    text = OPS.read_text()
    assert text[text.index(BEGIN) : text.index(END) + len(END)] == table(), "run: toolkv docs --settings"


def test_the_plugin_config_has_one_field_per_declared_setting() -> None:
    """One field per setting, layer by layer in the declaration's order (ToolKVConfig is the three
    layers' dataclasses of toolkv.core.settings)."""
    got = [(f.name, f.type) for f in dataclasses.fields(ToolKVConfig)]
    layered = [*of_layer("plugin"), *of_layer("manager"), *of_layer("policy")]
    assert sorted(layered, key=lambda s: s.field) == sorted(SETTINGS, key=lambda s: s.field)
    assert [n for n, _ in got] == [s.field for s in layered]
    for (name, annotation), s in zip(got, layered, strict=True):
        assert annotation in TYPES[s.kind], (name, annotation, s.kind)
        assert (s.default is None) == annotation.endswith("| None"), name
        assert s.reason and "\n" not in s.reason and s.doc, name
        assert (s.bound is not None) == (s.kind in (int, float)), f"{name}: a number needs its bound"


def test_the_parser_and_every_config_default_to_the_declaration() -> None:
    """One declaration, one default: unset variables give the declared value, and so do the
    plugin's, the manager's and the policy's own defaults."""
    parsed = ToolKVConfig.from_env({})
    for s in SETTINGS:
        assert getattr(parsed, s.field) == s.default == getattr(ToolKVConfig(), s.field), s.name
    for cls, layer in ((ManagerConfig, "manager"), (PolicyConfig, "policy")):
        fields = {f.name: f for f in dataclasses.fields(cls)}
        for s in of_layer(layer):
            assert fields[s.field].default == s.default, f"{cls.__name__}.{s.field}"
        assert set(fields) - {"policy_config"} == {s.field for s in of_layer(layer)}, cls.__name__


def test_a_manager_built_without_settings_is_the_one_a_server_runs() -> None:
    assert ManagerConfig() == ToolKVConfig().manager_config()
    assert ManagerConfig().adaptive and ManagerConfig().lazy_free and ManagerConfig().l3_read_at_arrival
    eager = ManagerConfig.eager()
    assert not eager.adaptive and not eager.lazy_free
    assert dataclasses.replace(eager, adaptive=True, lazy_free=True) == ManagerConfig()


def test_the_policy_names_are_one_list() -> None:
    """``PolicyName`` is the list: the manager's call policies, ``TOOLKV_POLICY``'s choices and the
    published schema of a call's ``policy`` are its members, nothing more."""
    from toolkv.core.manager import ToolKVManager
    from toolkv.sglang.http_api import openapi_document
    from toolkv.testing.harness import CacheHarness, HarnessConfig

    names = [p.value for p in PolicyName]
    with CacheHarness(HarnessConfig(device_tokens=256)) as h:
        assert sorted(ToolKVManager(h.tree).calls) == sorted(names)
    assert {s.field: s for s in SETTINGS}["policy"].choices == tuple(names)
    body = openapi_document()["paths"]["/session/tool_start"]["post"]["requestBody"]
    schema = body["content"]["application/json"]["schema"]
    enum = next(x["enum"] for x in schema["properties"]["policy"]["anyOf"] if "enum" in x)
    assert enum == names


def test_the_status_schema_describes_every_setting() -> None:
    from toolkv.sglang.http_api import openapi_document

    settings = openapi_document()["components"]["schemas"]["Settings"]["properties"]
    assert list(settings) == [s.field for s in SETTINGS]
    for s in SETTINGS:
        assert settings[s.field]["description"] == f"{s.name}: {s.reason}"


@pytest.mark.parametrize("s", SETTINGS, ids=lambda s: s.name)
def test_a_refusal_names_the_variable_and_what_it_accepts(s: object) -> None:
    from toolkv.core.settings import Setting

    assert isinstance(s, Setting)
    if s.kind is str and not s.choices:
        return  # a header name: tests/test_session_header.py
    with pytest.raises(ValueError) as ei:
        ToolKVConfig.from_env(
            {"TOOLKV_ENABLE": "1", s.name: "nonsense"} if s.name != "TOOLKV_ENABLE" else {s.name: "nonsense"}
        )
    msg = str(ei.value)
    assert msg.startswith(f"{s.name}='nonsense': expected"), msg


def test_doctor_names_what_differs_from_the_declaration() -> None:
    from toolkv.tools.doctor import settings_lines

    in_force = {s.field: s.default for s in SETTINGS}
    n = len([s for s in SETTINGS if s.field != "enable"])  # every setting but the switch
    assert settings_lines(in_force) == [f"  settings:  0 changed, {n} at the default"]
    lines = settings_lines({**in_force, "ttl_s": 300.0, "lazy_free": False, "newer": 1})
    assert lines[0] == f"  settings:  2 changed, {n - 2} at the default:"
    assert lines[1] == "    TOOLKV_TTL_S=300 (default 600): protection lifetime without a tool_end"
    assert lines[2].startswith("    TOOLKV_LAZY_FREE=0 (default 1): ")
    assert lines[3] == "    not known here: newer=1"
