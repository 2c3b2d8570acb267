"""The manager's layers hold their contracts: phases are the lifecycle table's, every spec action is
a machine method named as the spec's with its guard, the L3 sub-machine refuses a move its table
does not have, the typed answer is the JSON it replaced, capabilities are checked once, and the
policy's knobs come from the environment."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from toolkv.core import lifecycle
from toolkv.core.calls.auto import Auto
from toolkv.core.calls.offload import Offload
from toolkv.core.capabilities import PinPriced, StorageTier, capabilities_of
from toolkv.core.lifecycle import IllegalTransition
from toolkv.core.manager import ToolKVManager
from toolkv.core.phases import L3, L3_TRANSITIONS, Phase, fire_l3
from toolkv.core.policy import PolicyConfig, Pressure, keep_fits
from toolkv.core.record import SessionRecord
from toolkv.core.result import SessionView
from toolkv.core.session.machine import SessionMachine
from toolkv.sglang.config import ToolKVConfig

SPEC = Path(__file__).resolve().parents[1] / "spec" / "ToolKV.tla"
CORE = Path(__file__).resolve().parents[1] / "toolkv" / "core"


def test_phases_are_the_lifecycle_tables() -> None:
    assert tuple(Phase) == lifecycle.SESSION_STATES
    for _trigger, src, dst in lifecycle.SESSION_TRANSITIONS:
        for p in (src,) if isinstance(src, str) else src:
            Phase(p)
        for p in (dst,) if isinstance(dst, str) else dst:
            Phase(p)


def test_every_manager_action_of_the_spec_is_a_machine_method() -> None:
    """``ManagerNext`` and the environment steps the manager takes are methods named as the spec's
    actions; the ones a caller may ask about have a ``can_`` guard."""
    text = SPEC.read_text()
    manager_next = text[text.index("ManagerNext ==") : text.index("EnvNext ==")]
    actions = set(re.findall(r"\b([A-Z][A-Za-z]+)\(", manager_next)) | {"TtlSweep", "StartLoads"}
    actions |= {"Insert", "Admit", "TreeReset", "Tick"}  # env steps the manager takes a step on
    # the room ToolStart makes (through sglang's evict_host; by dropping mirrors)
    actions -= {"HostRoom", "HostUnmirror"}
    snake = {a: re.sub(r"(?<!^)(?=[A-Z])", "_", a).lower() for a in actions}
    missing = sorted(a for a, m in snake.items() if not callable(getattr(SessionMachine, m, None)))
    assert not missing, missing
    for a in (
        "ToolStart",
        "ToolEnd",
        "Keep",
        "LetGo",
        "Demote",
        "Prefetch",
        "Park",
        "Unpin",
        "Close",
        "Insert",
    ):
        owners = [getattr(SessionMachine, f"{part}_class") for part in SessionMachine.PARTS]
        assert any(callable(getattr(p, "can_" + snake[a], None)) for p in [SessionMachine, *owners]), a


def test_the_machine_is_made_of_parts_not_stubs() -> None:
    """No method exists only so that one part can call another's: every cross-part call names
    the part it goes to, and no machine module raises ``NotImplementedError``."""
    for p in (CORE / "session").glob("*.py"):
        assert "NotImplementedError" not in p.read_text(), p
    assert SessionMachine.__bases__[0].__name__ == "MachineState"
    for part in SessionMachine.PARTS:
        assert getattr(SessionMachine, f"{part}_class").__bases__ == (object,), part


def test_the_l3_sub_machine_refuses_a_move_its_table_has_not() -> None:
    rec = SessionRecord(session_id="s", state="Offloaded")
    fire_l3(rec, "store", L3.STORING)
    assert rec.l3 == "storing" and type(rec.l3) is str
    with pytest.raises(IllegalTransition):
        fire_l3(rec, "storage_prefetch", L3.FETCHING)  # never from a write not acknowledged whole
    fire_l3(rec, "store_ack", L3.STORED)
    fire_l3(rec, "storage_prefetch", L3.FETCHING)
    fire_l3(rec, "prefetch_ack", L3.NONE)
    assert rec.l3 == ""
    assert {t for t, _, _ in L3_TRANSITIONS} <= {
        "store",
        "store_ack",
        "tool_end_from_host",
        "storage_prefetch",
        "tool_end_at_arrival",
        "prefetch_ack",
        "expire",
        "close",
    }


def test_the_session_view_is_the_json_it_replaced() -> None:
    rec = SessionRecord(session_id="s", state="Offloaded", epoch=3, deadline=12.5)
    rec.l3, rec.reason, rec.decision, rec.tool, rec.expected_s = "stored", "long_tool", "offload", "bash", 4.0
    rec.restore, rec.restored_tokens = "loaded", 64
    placement = {"tier": "CpuProtected", "tokens": 64, "device_tokens": 0, "host_tokens": 64}
    view = SessionView.of(rec, "hiradix", placement)
    want = {
        "session_id": "s",
        "state": "Offloaded",
        "epoch": 3,
        "backend": "hiradix",
        "protected": False,
        "deadline": 12.5,
        "tier": "l3",  # in the backend's place, as the hand-built dict had it
        "tokens": 64,
        "device_tokens": 0,
        "host_tokens": 64,
        "l3": "stored",
        "decision": "offload",
        "reason": "long_tool",
        "tool": "bash",
        "expected_s": 4.0,
        "restore": "loaded",
        "restored_tokens": 64,
        "recompute_tokens": 0,
    }
    assert json.dumps(view.as_dict()) == json.dumps(want)
    assert view == want and view["epoch"] == 3 and view.get("nope") is None and dict(view) == want
    assert view.call is not None and view.call.reason == "long_tool" and view.tier == "l3"


def test_capabilities_are_protocols() -> None:
    class Bare:
        pass

    caps = capabilities_of(Bare())
    assert caps.storage is None and caps.pin_priced is None and not caps.parks
    from toolkv.core.backends.hiradix import HiRadixBackend

    for name in ("store", "store_ack", "storage_prefetch", "prefetch_ack", "poll_storage", "drop_storage"):
        assert callable(getattr(HiRadixBackend, name)), name
    assert not isinstance(Bare(), StorageTier) and not isinstance(Bare(), PinPriced)


def test_no_core_file_is_large_and_the_manager_has_no_type_ignore() -> None:
    sizes = {p.relative_to(CORE).as_posix(): len(p.read_text().splitlines()) for p in CORE.rglob("*.py")}
    assert not {f: n for f, n in sizes.items() if n > 600}, sizes
    for p in [CORE / "manager.py", *(CORE / "calls").glob("*.py"), *(CORE / "session").glob("*.py")]:
        assert "type: ignore" not in p.read_text(), p
        assert "getattr(self.backend" not in p.read_text(), p


def test_the_keep_rule_is_one_function() -> None:
    p = Pressure(1000, 800, 1000, 1000, device_spare_tokens=300)
    assert keep_fits(p, 200, 0.1) and not keep_fits(p, 201, 0.1)
    for path in (*CORE.rglob("*.py"), CORE.parent / "sglang" / "kv_hints.py"):
        if path.name != "policy.py":
            assert "device_reserve *" not in path.read_text(), path


def test_the_call_policies_are_the_configs() -> None:
    assert {c.name for c in (Offload, Auto)} == {"offload", "auto"}
    assert set(ToolKVManager.__init__.__code__.co_varnames) >= {"config", "backend"}


def test_policy_knobs_come_from_the_environment() -> None:
    cfg = ToolKVConfig.from_env(
        {"TOOLKV_KEEP_MAX_S": "5", "TOOLKV_DEVICE_RESERVE": "0.2", "TOOLKV_MAX_TOOLS": "9"}
    )
    pc = cfg.manager_config().policy_config
    assert (pc.keep_max_s, pc.device_reserve, pc.max_tools) == (5.0, 0.2, 9)
    assert ToolKVConfig.from_env({}).manager_config().policy_config == PolicyConfig()
    with pytest.raises(ValueError, match="TOOLKV_KEEP_QUANTILE"):
        ToolKVConfig.from_env({"TOOLKV_KEEP_QUANTILE": "1"})
    with pytest.raises(ValueError, match="TOOLKV_DEVICE_RESERVE"):
        ToolKVConfig.from_env({"TOOLKV_DEVICE_RESERVE": "2"})
