"""TEST DOUBLE of an sglang server for the agent load generator (no GPU, no sglang process here).

Stands in for: the HTTP server, the scheduler loop and the model. What stays real: the cache stack
(sglang 0.5.16's HiRadixCache or RadixCache from the harness), toolkv's scheduler side
(:class:`~toolkv.sglang.scheduler_side.SchedulerToolKV`: the same ``handle``/``on_request``/``tick``
the plugin calls), and finished requests cached through the real ``cache_finished_req`` with the
plugin's AROUND hook (``tests/_turns.py``). A background thread is the scheduler loop: each
iteration the copy engine finishes what is in flight, sglang processes its acks, toolkv ticks.
The "model" answers with ids derived from the prompt, so answers are deterministic like
temperature 0. ``cached_tokens`` is the device prefix the request found, as sglang reports it.
Every control call's body is recorded (``bodies``: ``(op, body)`` in arrival order) before it is
handed to toolkv, so a test can check what the load generator sent.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from _turns import finish_turn, iteration
from sglang.srt.mem_cache.base_prefix_cache import EvictParams

from toolkv.sglang.config import ToolKVConfig
from toolkv.sglang.scheduler_side import SchedulerToolKV
from toolkv.testing.harness import CacheHarness, HarnessConfig
from toolkv.tools.agent_bench import Generated


class StandInServer:
    def __init__(self, cfg: HarnessConfig, config: ToolKVConfig | None = None) -> None:
        self.h = CacheHarness(cfg)
        self.tk = SchedulerToolKV(self.h.tree, config=config or ToolKVConfig(enable=True))
        self.h.tree._toolkv = self.tk  # type: ignore[attr-defined]
        self.lock = threading.Lock()
        self.requests = 0
        self.bodies: list[tuple[str, dict[str, Any]]] = []  # every control call, as sent
        self._stop = threading.Event()
        self._loop = threading.Thread(target=self._run, daemon=True)
        self._loop.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            with self.lock:
                self._iterate()
            time.sleep(0.001)

    def _iterate(self) -> None:
        hiradix = self.h.cfg.kind == "hiradix"
        iteration(self.h, self.tk, writes=hiradix, loads=hiradix)

    def close(self) -> None:
        self._stop.set()
        self._loop.join(timeout=5)
        self.h.close()

    # ---- the AgentServer protocol -------------------------------------------------------------------
    def generate(self, ids: list[int], sid: str | None, out_tokens: int) -> Generated:
        t0 = time.perf_counter()
        out = [1000 + (ids[-1] * 31 + 7 * k) % 100_000 for k in range(out_tokens)]
        with self.lock:
            self.tk.on_request(sid)
            for _ in range(4):  # a restore the request triggered lands before its prefill
                self._iterate()
            self.requests += 1
            cached = len(self.h.match(ids).device_indices)
            ok = finish_turn(self.h, sid, ids, out)
            if not ok:
                self.h.tree.evict(EvictParams(num_tokens=len(ids) + out_tokens))
                ok = finish_turn(self.h, sid, ids, out)
        dt = time.perf_counter() - t0
        if not ok:
            return Generated(503, [], 0, float("nan"), dt)
        return Generated(200, out, cached, dt, dt)

    def call(self, op: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        with self.lock:
            self.bodies.append((op, dict(body)))
            return self.tk.handle(op, body)

    def kv_meta(self, sid: str | None = None) -> tuple[int, dict[str, Any]]:
        with self.lock:
            return self.tk.handle("kv_meta", {"session_id": sid})

    def loads(self) -> dict[str, Any] | None:
        return {
            "max_total_num_tokens": self.h.cfg.device_tokens,
            "num_running_reqs": 0,
            "num_waiting_reqs": 0,
        }
