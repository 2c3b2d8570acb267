"""Shared by the fault tests (``test_faults.py`` on 0.5.16, ``test_soak_0523.py`` on 0.5.23): one
real cache stack, toolkv's scheduler side, its HTTP routes, and the scheduler loop of
``toolkv.tools.soak`` driven one iteration at a time, so a test can put a fault exactly where it
wants it (between sglang's ack check and toolkv's tick, between tool_end and the next request).

Every row of the fault table (``docs/reliability.md``) is one :class:`Row`, filled from what the
test observed: the HTTP status and error code the client saw, the session's state after, the
bytes and tokens checked, and whether any counter failed to return to its initial value.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import pickle
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from fastapi.testclient import TestClient

from toolkv.sglang.config import ToolKVConfig
from toolkv.sglang.http_api import ChannelTransport, build_app
from toolkv.sglang.ipc import ToolKVReqInput
from toolkv.sglang.plugin import after_get_new_batch_prefill, before_handle_generate_request
from toolkv.sglang.scheduler_side import SchedulerToolKV
from toolkv.twin.server import Server

ROWS_DIR = Path(os.environ.get("TOOLKV_FAULT_ROWS", "")) if os.environ.get("TOOLKV_FAULT_ROWS") else None


@dataclass
class Row:
    """One line of the fault table."""

    release: str
    backend: str
    fault: str
    injected: str
    client_saw: str
    state_after: str
    checked: str
    leaks: str = "none"
    test: str = ""


class ImmediateChannel(ChannelTransport):
    """TEST DOUBLE of the tokenizer-manager <-> scheduler channel: the pickled request is handled
    by the scheduler side's IPC handler at once (its ``process_input_requests``), the pickled
    reply delivered through toolkv's real reply registry; unlike ``tests/_turns.LoopbackChannel``
    it does not tick, so a test decides where the tick falls."""

    def __init__(self, tk: SchedulerToolKV) -> None:
        super().__init__(timeout_s=5.0)
        self.tk = tk

    def _send(self, req: ToolKVReqInput) -> None:
        out = pickle.loads(pickle.dumps(self.tk.ipc_handler(pickle.loads(pickle.dumps(req)))))
        asyncio.get_running_loop().call_soon(self.replies.resolve, out)


class Bench:
    """A server stand-in, toolkv attached to it, the HTTP routes, and a scheduler loop stepped by
    hand."""

    def __init__(
        self, stack: Server, *, ttl_s: float = 60.0, handover_ttl_s: float = 5.0, lazy_free: bool = False
    ) -> None:
        # The faults here are of the host->GPU restore path, which needs the GPU copy freed at the write
        # ack (TOOLKV_LAZY_FREE=0); with lazy free a copy sglang did not evict is handed over as it is
        # (tests/test_lazy_free.py).
        self.stack = stack
        h = stack.h
        self.h = h
        self.initial = stack.accounting()
        self.sched = stack.scheduler
        stack.on_admitted = self._admitted
        self.now = 0.0
        cfg = ToolKVConfig(
            ttl_s=ttl_s,
            handover_ttl_s=handover_ttl_s,
            fallback="shadow" if stack.name == "shadow" else "pin",
            sweep_every=1,
            lazy_free=lazy_free,
        )
        self.tk = stack.attach(cfg, now=lambda: self.now)
        self.channel = ImmediateChannel(self.tk)
        self.client = TestClient(build_app(self.channel))
        self.errors: list[str] = []
        self._handler = _Collect(self.errors)
        logging.getLogger("toolkv").addHandler(self._handler)
        self.running: list[Any] = []

    def close(self) -> None:
        logging.getLogger("toolkv").removeHandler(self._handler)

    # ---- the client -----------------------------------------------------------------------------------
    def call(self, op: str, **body: Any) -> tuple[int, dict[str, Any]]:
        """One HTTP call through toolkv's routes, handled at once by the scheduler side (its
        ``process_input_requests``); the tick is left to :meth:`iteration`."""
        if op == "kv_meta":
            r = self.client.get("/session/kv_meta", params=body)
        else:
            r = self.client.post(f"/session/{op}", json=body)
        return r.status_code, r.json()

    def meta(self, sid: str) -> dict[str, Any]:
        return self.tk.handle("kv_meta", {"session_id": sid})[1]

    # ---- requests ---------------------------------------------------------------------------------------
    def turn(self, sid: str | None, prompt: list[int], output: list[int]) -> Any:
        """A request arrives (toolkv's BEFORE hook), is admitted (AFTER hook of
        get_new_batch_prefill) and finishes (the cache's hooked insert records the turn)."""
        run = self.admit(sid, prompt, output)
        assert run is not None, "no device memory for the request"
        self.stack.finish(run)
        return run

    def admit(self, sid: str | None, prompt: list[int], output: list[int]) -> Any:
        """The request reaches the scheduler (toolkv's BEFORE hook may restore its session) and
        the scheduler model admits it into a prefill batch, whose forward runs; the request holds
        its prefix until ``stack.finish``. None when it cannot be admitted now."""
        before_handle_generate_request(self.sched, SimpleNamespace(session_id=sid, session_params=None))
        return self.stack.admit(sid, prompt, output)

    def _admitted(self, req: Any) -> None:
        """The plugin's AFTER hook on ``get_new_batch_prefill``, per admitted request."""
        after_get_new_batch_prefill(SimpleNamespace(batch_to_run=SimpleNamespace(reqs=[req])), self.sched)

    # ---- the scheduler loop --------------------------------------------------------------------------------
    def iteration(self, *, writes: bool = False, loads: bool = False, dt: float = 0.1) -> None:
        """One iteration in sglang's order: control requests and the deferred flush
        (``check_pending``), toolkv's tick, sglang's ack checks; then the copy engine finishes
        what the test says (so the acks retire in the NEXT iteration's check)."""
        self.now += dt
        self.sched.flush_wrapper.check_pending()
        self.tk.tick()
        self.stack.check_events()
        if writes and self.h.is_hi:
            self.h.complete("write")
        if loads and self.h.is_hi:
            self.h.complete("load")

    def settle(self, n: int = 4) -> None:
        for _ in range(n):
            self.iteration(writes=True, loads=True)

    # ---- the end ----------------------------------------------------------------------------------------
    def leaks(self) -> list[str]:
        """Close every session, drain, and list every counter not back at its initial value."""
        for sid in list(self.tk.manager.sessions):
            self.tk.handle("close", {"session_id": sid})
        self.settle()
        self.stack.drain()
        out: list[str] = []
        after = self.stack.accounting()
        if after != self.initial:
            out.append(f"accounting {after} != {self.initial}")
        b: Any = self.tk.manager.backend
        for attr in ("protected_tokens", "pinned_tokens", "host_tokens"):
            if getattr(b, attr, 0):
                out.append(f"{attr}={getattr(b, attr)}")
        if len(self.channel.replies):
            out.append("undelivered replies")
        return out


class _Collect(logging.Handler):
    def __init__(self, sink: list[str]) -> None:
        super().__init__(logging.ERROR)
        self.sink = sink

    def emit(self, record: logging.LogRecord) -> None:
        self.sink.append(record.getMessage())


DOC = Path(__file__).resolve().parents[1] / "docs" / "reliability.md"
BEGIN, END = "<!-- BEGIN faults -->", "<!-- END faults -->"
HEADER = (
    "| release | backend | fault | how injected | what the client saw | state after | bytes / tokens checked "
    "| leaks | test |\n|---|---|---|---|---|---|---|---|---|"
)
REGENERATE = (
    "TOOLKV_FAULT_ROWS=out/fault-rows .venv/bin/pytest tests/test_faults.py tests/test_soak.py -k 'not test_soak[' "
    "&& TOOLKV_FAULT_ROWS=out/fault-rows .venv-0523/bin/pytest tests/test_soak_0523.py -k deferred "
    "&& .venv/bin/python tests/_faultbench.py out/fault-rows"
)


def render(row: Row) -> str:
    """The row's line in the generated table."""
    cells = [row.release, row.backend, row.fault, row.injected, row.client_saw, row.state_after, row.checked]
    cells += [row.leaks, f"`{row.test.split('::')[-1]}`"]
    return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"


def record(row: Row) -> None:
    """With ``TOOLKV_FAULT_ROWS=DIR`` write the row for the generator; otherwise check that the
    generated table in ``docs/reliability.md`` carries exactly this row (what the test observed)."""
    if ROWS_DIR is not None:
        ROWS_DIR.mkdir(parents=True, exist_ok=True)
        name = row.test.split("::")[-1] + "-" + row.release
        (ROWS_DIR / f"{name}.json").write_text(json.dumps(asdict(row), indent=1))
        return
    line = render(row)
    assert line in DOC.read_text(), (
        f"docs/reliability.md lacks this observed row; regenerate with\n  {REGENERATE}\n{line}"
    )


def write_table(rows_dir: Path, doc: Path = DOC) -> int:
    """Replace the table between the markers of ``doc`` with the rows in ``rows_dir``."""
    rows = [Row(**json.loads(p.read_text())) for p in sorted(rows_dir.glob("*.json"))]
    rows.sort(key=lambda r: (r.release, r.backend != "hiradix", r.test))
    text = doc.read_text()
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    body = "\n".join([HEADER, *(render(r) for r in rows)])
    doc.write_text(f"{head}{BEGIN}\n{body}\n{END}{tail}")
    return len(rows)


if __name__ == "__main__":
    import sys

    print(f"{write_table(Path(sys.argv[1]))} rows written to {DOC}")
