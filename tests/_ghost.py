"""Shared by the eviction-harm tests of both releases: real requests (sglang's ``Req``) through
the twin's scheduler walk (sglang's ``PrefillAdder`` matches and locks each prefix on the REAL
tree: 0.5.16's HiRadixCache, 0.5.23's UnifiedRadixCache), the plugin's cache hooks applied by
sglang's ``HookRegistry`` (:func:`toolkv.twin.stack.build`), toolkv's ``on_batch`` where the
plugin's AFTER hook on ``get_new_batch_prefill`` calls it. Eviction is the tree's own
(``evict`` on the device, ``evict_host`` on the host pool)."""

from __future__ import annotations

import contextlib
from array import array
from collections.abc import Iterator
from typing import Any

from toolkv.twin.configs import TwinConfig
from toolkv.twin.stack import Stack, build

DEVICE_TOKENS = 512


class GhostRig:
    """One stack, its scheduler, and a way to run one request to its end."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.h, self.tk = stack.harness, stack.tk
        if stack.unified:
            from toolkv.twin.scheduler_0523 import TwinScheduler0523 as Sched
        else:
            from toolkv.twin.scheduler import TwinScheduler as Sched
        self.sched = Sched(self.h, on_admitted=lambda req: self.tk.on_batch([req]))
        self._rid = 0

    def run(self, prompt: list[int], sid: str | None, out: int = 2) -> Any:
        """Serve one request to its end; returns the finished ``Req``."""
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.sampling.sampling_params import SamplingParams

        sp = SamplingParams(max_new_tokens=out, ignore_eos=True, temperature=0)
        sp.normalize(None)
        self._rid += 1
        req = Req(f"r{self._rid}", "", array("q", prompt), sp, session_id=sid, vocab_size=1 << 20)
        self.sched.add_request(req)
        for _ in range(1000):
            self.h.complete("write")
            self.h.complete("load")
            self.h.check_events()
            batch = self.sched.next_batch()
            if batch is not None:
                self.h.complete("load")
                self.h.check_events()
                self.sched.finish_batch(batch)
            if req.finished() and not self.sched.busy:
                break
        assert req.finished(), "the request did not finish"
        self.h.complete("write")
        self.h.check_events()
        return req

    def evict_all(self) -> None:
        """Evict every unlocked token from the device, then from the host pool."""
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        self.h.complete("write")
        self.h.check_events()
        self.h.tree.evict(EvictParams(num_tokens=10 * DEVICE_TOKENS))
        if self.h.is_hi:
            self.h.evict_host(10 * DEVICE_TOKENS)

    @property
    def recomputed(self) -> dict[str, int]:
        return dict(self.tk.metrics()["recomputed_after_evict_tokens"])


@contextlib.contextmanager
def rig() -> Iterator[GhostRig]:
    cfg = TwinConfig("stock", "hiradix", "stock", host_gb=0.001)
    stack = build(cfg, device_tokens=DEVICE_TOKENS, kv_bytes_per_token=1024, now=lambda: 0.0)
    try:
        yield GhostRig(stack)
    finally:
        stack.close()


def prompt(seed: int, n: int = 96) -> list[int]:
    return [seed * 1000 + i for i in range(n)]


def check_counts_recomputed_after_eviction(r: GhostRig) -> None:
    """Evict a prefix, re-request it: the count rises by the recomputed tokens, for the
    session and for another request separately; a prefix never cached counts nothing; a prefix
    still cached counts nothing."""
    b = r.tk.ghost.block_tokens
    a, o = prompt(1), prompt(2)
    r.run(a, "s1")
    r.run(o, None)
    assert r.recomputed == {"session": 0, "other": 0}  # first sight: nothing was cached before
    r.run(a + prompt(3, 32), "s1")  # its prefix is cached: matched, not recomputed
    assert r.recomputed == {"session": 0, "other": 0}
    r.evict_all()
    r.run(a + prompt(4, 32), "s1")
    # the 96 prompt tokens (6 blocks) were cached and evicted; the new tail never was
    assert r.recomputed == {"session": 96 - 96 % b, "other": 0}
    r.run([*o, 7], None)
    assert r.recomputed == {"session": 96 - 96 % b, "other": 96 - 96 % b}
    r.run(prompt(5), None)  # never cached
    r.run(prompt(6), "s2")
    assert r.recomputed == {"session": 96 - 96 % b, "other": 96 - 96 % b}


def check_ghost_bounded(r: GhostRig) -> None:
    """The ghost holds at most its capacity, dropping the least recently cached first."""
    from toolkv.sglang.ghost import EvictionGhost

    r.tk.ghost = EvictionGhost(r.tk.ghost.block_tokens, capacity=8)
    for k in range(10, 16):
        r.run(prompt(k, 64), None)  # 4 blocks each
        assert len(r.tk.ghost) <= 8
    assert len(r.tk.ghost) == 8
    r.evict_all()
    r.run(prompt(10, 64), None)  # fell off the ghost: not counted (a lower bound)
    assert r.recomputed["other"] == 0
    r.run(prompt(15, 64), None)  # the most recent: still in the ghost
    assert r.recomputed["other"] == 64
