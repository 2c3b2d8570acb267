"""Seeded defects for sglang's ``DecodeKVCacheOffloadManager``, applied as patches on the REAL
class by the test runner (never branches in production code). Each one is the Python side of a
``BUG`` value of ``spec/decode/DecodeOffload.tla``; the fuzz campaign must kill every one.

The two upstream bugs the class's own comments record as fixed are re-introduced as they were
described: prefill slots freed mid-decode (``EagerPrefillFree``), and a release without its
idempotence guard (``NoReleaseGuard``). In 0.5.16 a second release has no caller (TLC shows the
guard alone is redundant: ``decode_guard_redundant``), so that mutant also gives it one: a
finalize that does not wait for in-flight increments, after which the last write ack releases
the request again. Patches wrap the original methods; none copies upstream code.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

MutantFn = Callable[[], contextlib.AbstractContextManager[None]]


def _cls() -> Any:
    from sglang.srt.disaggregation.decode_kvcache_offload_manager import DecodeKVCacheOffloadManager

    return DecodeKVCacheOffloadManager


@contextlib.contextmanager
def _patched(**methods: Callable[..., Any]) -> Iterator[None]:
    cls = _cls()
    saved = {name: cls.__dict__[name] for name in methods}
    for name, fn in methods.items():
        setattr(cls, name, fn)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(cls, name, fn)


def _aligned(mgr: Any, req: Any) -> int:
    """What offload_kv_cache would write now (tokens), computed from its state as it does."""
    ps = mgr.page_size
    st = mgr.offloaded_state.get(req.rid)
    pre = st.prefill_len if st is not None else len(req.origin_input_ids) // ps * ps
    inc = st.inc_len if st is not None else 0
    new = len(req.origin_input_ids) + len(req.output_ids) - 1 - pre - inc
    return int(new // mgr.offload_stride * mgr.offload_stride)


def eager_prefill_free() -> contextlib.AbstractContextManager[None]:
    """Upstream bug (fixed): the prefill-aligned slots were freed in offload_kv_cache, mid-decode
    (the request still attends to them), and release freed only the part after the prompt."""
    cls = _cls()
    offload, release = cls.offload_kv_cache, cls._release_finished_req

    def offload_kv_cache(self: Any, req: Any) -> bool:
        fresh = req.rid not in self.offloaded_state
        out = bool(offload(self, req))
        st = self.offloaded_state.get(req.rid)
        if fresh and st is not None and st.prefill_len > 0 and req.req_pool_idx not in (None, -1):
            slots = self.req_to_token_pool.req_to_token[req.req_pool_idx, : st.prefill_len]
            self.token_to_kv_pool_allocator.free(slots)
        return out

    def _release_finished_req(self: Any, req: Any, start_offset: int) -> None:
        st = self.offloaded_state.get(req.rid)
        if st is not None:
            st.prefill_len = 0  # already freed; release frees [start_offset:] only
        release(self, req, start_offset)

    return _patched(offload_kv_cache=offload_kv_cache, _release_finished_req=_release_finished_req)


def _finalize_ignoring_inflight(finalize: Callable[..., Any]) -> Callable[..., Any]:
    def finalize_release_on_finish(self: Any, req: Any) -> None:
        hidden = self.offload_inflight.pop(req.rid, None)
        try:
            finalize(self, req)
        finally:
            if hidden is not None:
                self.offload_inflight[req.rid] = hidden

    return finalize_release_on_finish


def finalize_ignores_inflight() -> contextlib.AbstractContextManager[None]:
    """finalize_release_on_finish releases although an increment is still in flight."""
    cls = _cls()
    return _patched(finalize_release_on_finish=_finalize_ignoring_inflight(cls.finalize_release_on_finish))


def no_release_guard() -> contextlib.AbstractContextManager[None]:
    """Upstream bug (fixed): _release_finished_req without its guard. The guard tests
    ``req.req_pool_idx is None``; the patch hands a released request its old slot index back
    before calling the real method, so the body runs again. Its second caller is a finalize that
    does not wait for in-flight increments (the last write ack then releases again)."""
    cls = _cls()
    release = cls._release_finished_req

    def _release_finished_req(self: Any, req: Any, start_offset: int) -> None:
        stash: dict[str, tuple[Any, Any]] = self.__dict__.setdefault("_mutant_released", {})
        if req.req_pool_idx is None and req.rid in stash:
            req.req_pool_idx, req.kv = stash[req.rid]
        before = (req.req_pool_idx, req.kv)
        release(self, req, start_offset)
        if before[0] not in (None, -1) and req.req_pool_idx is None:
            stash[req.rid] = before

    return _patched(
        _release_finished_req=_release_finished_req,
        finalize_release_on_finish=_finalize_ignoring_inflight(cls.finalize_release_on_finish),
    )


def no_release_guard_only() -> contextlib.AbstractContextManager[None]:
    """The guard alone removed (finalize still waits): an equivalent mutant in 0.5.16, because
    nothing calls the release a second time. It must survive; if it is ever killed, a second
    releaser has appeared and the guard is load-bearing."""
    cls = _cls()
    release = cls._release_finished_req

    def _release_finished_req(self: Any, req: Any, start_offset: int) -> None:
        stash: dict[str, tuple[Any, Any]] = self.__dict__.setdefault("_mutant_released", {})
        if req.req_pool_idx is None and req.rid in stash:
            req.req_pool_idx, req.kv = stash[req.rid]
        before = (req.req_pool_idx, req.kv)
        release(self, req, start_offset)
        if before[0] not in (None, -1) and req.req_pool_idx is None:
            stash[req.rid] = before

    return _patched(_release_finished_req=_release_finished_req)


def host_free_at_write_ack() -> contextlib.AbstractContextManager[None]:
    """The host slots are freed when the write ack is retired, before the storage backup ran."""
    cls = _cls()
    trigger = cls._trigger_backup

    def _trigger_backup(self: Any, req: Any, host_indices: Any, tokens: Any, t0: Any, prior: Any) -> Any:
        out = trigger(self, req, host_indices, tokens, t0, prior)
        self.decode_host_mem_pool.free(host_indices)
        return out

    return _patched(_trigger_backup=_trigger_backup)


def hash_not_chained() -> contextlib.AbstractContextManager[None]:
    """Each increment's page hashes start from None instead of the request's last hash."""
    cls = _cls()
    trigger = cls._trigger_backup

    def _trigger_backup(self: Any, req: Any, host_indices: Any, tokens: Any, t0: Any, prior: Any) -> Any:
        return trigger(self, req, host_indices, tokens, t0, None)

    return _patched(_trigger_backup=_trigger_backup)


def gap_on_host_full() -> contextlib.AbstractContextManager[None]:
    """inc_len advances although the host pool refused the write (those pages never reach storage)."""
    cls = _cls()
    offload = cls.offload_kv_cache

    def offload_kv_cache(self: Any, req: Any) -> bool:
        k = _aligned(self, req) if req.req_pool_idx not in (None, -1) else 0
        out = bool(offload(self, req))
        st = self.offloaded_state.get(req.rid)
        if not out and k > 0 and st is not None:
            st.inc_len += k
        return out

    return _patched(offload_kv_cache=offload_kv_cache)


def no_release_at_ack() -> contextlib.AbstractContextManager[None]:
    """The write-ack path never releases a finished request (it waits forever)."""
    cls = _cls()
    progress = cls._check_offload_progress

    def _check_offload_progress(self: Any, finish_count: int) -> None:
        self._release_finished_req = lambda req, start_offset: None
        try:
            progress(self, finish_count)
        finally:
            del self._release_finished_req

    return _patched(_check_offload_progress=_check_offload_progress)


def local_ack_counts() -> contextlib.AbstractContextManager[None]:
    """Each TP rank retires its own counts (no all_reduce MIN): ranks free host memory apart."""
    cls = _cls()
    check = cls.check_offload_progress

    def check_offload_progress(self: Any) -> None:
        world = self.tp_world_size
        self.tp_world_size = 1
        try:
            check(self)
        finally:
            self.tp_world_size = world

    return _patched(check_offload_progress=check_offload_progress)


#: mutant name (the spec's BUG value) -> patch; ``tp`` ones only show with two ranks.
MUTANTS: dict[str, MutantFn] = {
    "EagerPrefillFree": eager_prefill_free,
    "NoReleaseGuard": no_release_guard,
    "FinalizeIgnoresInflight": finalize_ignores_inflight,
    "HostFreeAtWriteAck": host_free_at_write_ack,
    "HashNotChained": hash_not_chained,
    "GapOnHostFull": gap_on_host_full,
    "NoReleaseAtAck": no_release_at_ack,
}
TP_MUTANTS: dict[str, MutantFn] = {"LocalAckCounts": local_ack_counts}
#: mutants that must survive (the spec's ``decode_guard_redundant`` config says why).
EQUIVALENT: dict[str, MutantFn] = {"NoReleaseGuardOnly": no_release_guard_only}


def apply(name: str | None) -> contextlib.AbstractContextManager[None]:
    """The patch for ``name`` (None: the class as shipped). Unknown names are refused."""
    if name is None:
        return contextlib.nullcontext()
    table = {**MUTANTS, **TP_MUTANTS, **EQUIVALENT}
    if name not in table:
        raise ValueError(f"unknown decode mutant {name!r}; known: {sorted(table)}")
    return table[name]()


__all__ = ["EQUIVALENT", "MUTANTS", "TP_MUTANTS", "apply"]
