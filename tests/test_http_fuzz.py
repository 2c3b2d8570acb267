"""schemathesis over toolkv's whole OpenAPI surface, against the app over the real HiRadixCache.

The app is the one the plugin serves (toolkv's routes; the TM<->scheduler channel is the loopback
test double of tests/_turns.py), the scheduler side and the manager are real, and so is the cache.
Between requests the harness re-creates sessions that were closed or expired and completes the
copies, so that later requests meet sessions in every lifecycle state. Bounded: ``EXAMPLES``
positive and as many negative cases per route (the whole file takes well under a minute).
"""

from __future__ import annotations

from typing import Any

import pytest
from _turns import LoopbackChannel, finish_turn, iteration

from toolkv.sglang.http_api import build_app
from toolkv.sglang.scheduler_side import SchedulerToolKV
from toolkv.testing.harness import CacheHarness, HarnessConfig
from toolkv.tools.http_fuzz import fuzz

schemathesis = pytest.importorskip("schemathesis")

EXAMPLES = 40
KNOWN = ["s1", "s2", "s3"]
PROMPTS = {sid: list(range(1 + 100 * i, 33 + 100 * i)) for i, sid in enumerate(KNOWN)}


def test_schemathesis_finds_no_server_error_and_refusals_change_nothing() -> None:
    with CacheHarness(HarnessConfig(device_tokens=512)) as h:
        tk = SchedulerToolKV(h.tree)
        h.tree._toolkv = tk
        app = build_app(LoopbackChannel(tk))
        schema = schemathesis.openapi.from_asgi("/openapi.json", app)

        def prepare() -> None:
            iteration(h, tk, writes=True, loads=True)  # finish whatever copies are in flight
            for slot, sid in enumerate(KNOWN):
                rec = tk.manager.sessions.get(sid)
                if rec is None or rec.state in ("Expired", "Lost"):
                    assert finish_turn(h, sid, PROMPTS[sid], [7], slot=slot)

        def snapshot() -> Any:
            metas = {sid: tk.manager.kv_meta(sid) for sid in KNOWN if sid in tk.manager.sessions}
            return h.accounting(), metas, tk.manager.kv_meta()["states"]

        report = fuzz(
            schema, call=lambda case: case.call(), snapshot=snapshot, known=KNOWN, prepare=prepare,
            examples=EXAMPLES,
        )  # fmt: skip
    print(report.to_json())
    assert report.failures == [], "\n".join(report.failures[:10])
    ops = {k.rsplit(" ", 1)[0] for k in report.by_operation}
    assert ops == {
        "POST /session/tool_start",
        "POST /session/tool_end",
        "POST /session/close",
        "GET /session/kv_meta",
        "GET /session/status",
    }  # POST /session/drain is left out on purpose (http_fuzz.NOT_FUZZED)
    # the run reached the manager's decisions, not only the validators
    assert report.by_status[200] > 0 and report.by_status[400] > 0 and report.by_status[404] > 0
    assert report.by_status[409] > 0, dict(report.by_status)
    assert not [s for s in report.by_status if s >= 500 and s not in (503, 504)]
