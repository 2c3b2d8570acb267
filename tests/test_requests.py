"""The session API's requests, declared once (``toolkv.core.requests``): the published body schemas
accept exactly what the requests accept, the control channel carries a request unchanged, the
scheduler side has one handler per type, and the client's record is the server's."""

from __future__ import annotations

import json
import pickle
from dataclasses import fields
from typing import Any

import pytest

from toolkv.client import KVMeta
from toolkv.core import requests
from toolkv.core.phases import Phase
from toolkv.core.result import RECORD_KEYS, TIERS
from toolkv.errors import BadRequest
from toolkv.sglang.http_api import SessionMeta, body_model

VALID: dict[type[requests.Request], dict[str, Any]] = {
    requests.ToolStart: {"session_id": "s1"},
    requests.ToolEnd: {"session_id": "s1", "epoch": 1},
    requests.Close: {"session_id": "s1"},
    requests.Drain: {},
}
# every JSON kind, at and past the bounds the requests declare
VALUES: list[Any] = [None, "", "s", "x" * 256, "x" * 257, "x" * 512, "x" * 513, 0, -1, 1, 2**40, 1.5, -0.5,
                     0.0, True, False, float("inf"), float("nan"), "offload", "auto", "bogus", [], {}]  # fmt: skip


def _accepts_model(kind: type[requests.Request], body: dict[str, Any]) -> bool:
    try:
        body_model(kind).model_validate(body)
    except ValueError:  # pydantic's ValidationError
        return False
    return True


def _accepts_request(kind: type[requests.Request], body: dict[str, Any]) -> bool:
    try:
        kind.from_body(body)
    except BadRequest:
        return False
    return True


@pytest.mark.parametrize("kind", list(VALID), ids=lambda k: k.__name__)
def test_the_published_schema_accepts_what_the_request_accepts(kind: type[requests.Request]) -> None:
    """The pydantic model of docs/openapi.json is generated from the request's fields; each field,
    given each value on a valid body (and left out), is accepted by both or refused by both."""
    names = [f.name for f in fields(kind)]
    assert list(body_model(kind).model_fields) == names
    bodies = [VALID[kind], {**VALID[kind], "extra": 1}]
    for name in names:
        bodies.append({k: v for k, v in VALID[kind].items() if k != name})
        bodies += [{**VALID[kind], name: v} for v in VALUES]
    for body in bodies:
        assert _accepts_model(kind, body) == _accepts_request(kind, body), body


def test_a_refusal_names_the_field() -> None:
    with pytest.raises(BadRequest) as e:
        requests.ToolEnd.from_body({"session_id": "s1", "epoch": True})
    assert e.value.details["field"] == "epoch" and "epoch must be an integer" in e.value.message
    with pytest.raises(BadRequest, match="unknown toolkv operation"):
        requests.parse("tool_stop", {})


@pytest.mark.parametrize(
    "req",
    [
        requests.ToolStart("s1", tool="ls", expected_s=2, prior_epoch=3, policy=requests.PolicyName("auto")),
        requests.ToolStart("s1"),
        requests.ToolEnd("s1", 4),
        requests.Close("s1"),
        requests.AutoOffload("s1", tool="search"),
        requests.KvMetaQuery(),
        requests.KvMetaQuery("s1"),
        requests.StatusQuery(5),
        requests.Drain(False),
        requests.Handshake(),
    ],
    ids=repr,
)
def test_the_channel_carries_a_request_unchanged(req: requests.Request) -> None:
    """What crosses sglang's channel is rebuilt as it was: pickled (its default), or as a plain map
    of JSON kinds (what its msgpack format decodes)."""
    for wire in (
        pickle.loads(pickle.dumps(req.to_body())),
        json.loads(json.dumps(req.to_body())),
    ):
        again = requests.from_wire(req.op, wire)
        assert again == req and type(again) is type(req)
        assert requests.parse(req.op, wire) == req


def test_one_list_of_operations() -> None:
    from toolkv.sglang.ipc import OPS

    assert set(OPS) == set(requests.REQUESTS)
    assert {"tool_start", "tool_end", "close", "auto_offload"} == requests.DECIDING


def test_the_clients_record_is_the_servers() -> None:
    """``KVMeta`` has a field per key of the record (``SessionView``'s own and its placement's), the
    published ``SessionMeta`` describes each, and its phases and tiers are the core's."""
    assert tuple(f.name for f in fields(KVMeta) if f.name != "extra") == RECORD_KEYS
    assert set(RECORD_KEYS) <= set(SessionMeta.model_fields)
    assert SessionMeta.model_fields["state"].description == "|".join(Phase)
    assert SessionMeta.model_fields["tier"].description == "|".join(TIERS)
    assert {"Handover", "Parked"} <= set(SessionMeta.model_fields["state"].description.split("|"))
