"""The decode scheduler around sglang's REAL ``DecodeKVCacheOffloadManager``, one spec action per
method (``spec/decode/DecodeOffload.tla``), the refinement mapping from the real objects to the
spec's state record, and the checks made on the real objects after every step.

How the scheduler drives the manager (sglang 0.5.16, verified against the installed source):

| spec action | what runs here | sglang |
|---|---|---|
| ``Admit(r)`` | pre-allocate the request's slots, receive its prompt KV | disaggregation/decode.py ``_pre_alloc`` |
| ``Decode(r)`` | one forward pass: KV of the last sampled token into the next slot | the decode batch |
| ``Offload(r)`` | ``manager.offload_kv_cache(req)`` | batch_result_processor.py:868-872 |
| ``Finish(r)`` | finish reason set; ``offload_kv_cache``, and if it issued nothing ``finalize_release_on_finish`` | batch_result_processor.py:889-892 |
| ``Check`` | ``manager.check_offload_progress()`` | disaggregation/decode.py:2194-2195, once per iteration |
| ``Copy(k)`` | the copy engine finishes the oldest pending device->host copy | the GPU's write stream |
| ``Store(k)`` | the backup thread writes the oldest staged increment to storage | ``HiCacheController.backup_thread_func`` |

The mapping (units: pages of ``page_size`` tokens):

| spec field | implementation |
|---|---|
| ``phase[r]`` | ``Waiting`` before admission; ``Released`` once ``req.req_pool_idx`` is None; ``Finished`` if ``req.finished()``; else ``Decoding`` |
| ``len[r]`` | ``req.kv_committed_len // page_size`` |
| ``dev[r]`` | pages of ``req_to_token[idx, :committed]`` none of whose slots is free in the allocator (live requests) |
| ``devFree`` | free allocator pages plus the live requests' allocated but not yet full pages |
| ``prot`` | ``tree_cache.protected_size_`` |
| ``hasSt``, ``inc``, ``last`` | ``offloaded_state[rid]``: exists, ``inc_len``, ``last_hash`` as its index on the request's true hash chain (None: 0; a hash on no chain of this request: -1) |
| ``inflight[r]`` | ``offload_inflight.get(rid, 0)`` |
| ``chain[r]``, ``okeys`` | the page hashes handed to ``cache_controller.write_storage`` (observed by a pass-through probe), as chain indices |
| ``ops`` | increments in ack-id order, from ``ongoing_offload`` entries as they appear |
| ``acked`` | increments no longer in ``ongoing_offload`` |
| ``odata[k]`` | finished copies (acked, or their ack's finish event done), each TRUE iff the host pages held the right KV when the copy was first seen finished |
| ``stored[k]`` | storage writes the backup thread completed |
| ``freed[k]`` | staged increments no longer in ``ongoing_backup`` |
| ``hostFree[k]`` | ``decode_host_mem_pool.available_size() // page_size`` |
| ``store[k]`` | the file backend's pages, read back through ``HiCacheFile.get``: the chain index of the file's hash, bytes right iff equal to the computed KV |
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from research.decode_offload.harness import DecodeOffloadHarness


class DecodeFailure(AssertionError):
    """A check on the real objects failed (the message says which)."""


@dataclasses.dataclass
class Increment:
    """One ``cache_controller.write`` the manager issued (an ack id)."""

    ack_id: int
    rid: str
    start: int  # token positions
    end: int
    host_indices: torch.Tensor
    tokens: list[int]


@dataclasses.dataclass
class Step:
    """What one action did, for statistics and the trace."""

    act: list[Any]
    fits: bool = True
    outcome: str = ""
    changed: bool = True


def token_id(req_index: int, pos: int) -> int:
    """Token ids unique per request and position: every request has its own hash chain."""
    return 100_000 * (req_index + 1) + pos + 1


class DecodeWorld:
    """A decode server's scheduler, driving the real manager through the spec's actions."""

    def __init__(
        self,
        h: DecodeOffloadHarness,
        rids: Sequence[str],
        *,
        prompt_len: int = 3,
        max_new: int = 12,
        rank_name: str = "k1",
    ) -> None:
        self.h = h
        self.m = h.manager
        self.ps = h.page_size
        self.rank = rank_name
        self.rids = tuple(rids)
        self.prompt_len = prompt_len
        self.max_new = max_new
        self.reqs: dict[str, Any] = {}
        self.chains: dict[str, list[str]] = {}
        self.where: dict[str, tuple[str, int]] = {}  # page hash -> (rid, chain length)
        for i, rid in enumerate(self.rids):
            toks = [token_id(i, p) for p in range(prompt_len + max_new)]
            self.reqs[rid] = h.new_request(rid, toks[:prompt_len], max_new)
            self.chains[rid] = h.hash_chain(toks)
            for k, hv in enumerate(self.chains[rid], 1):
                self.where[hv] = (rid, k)
        self.tokens = {
            rid: [token_id(i, p) for p in range(prompt_len + max_new)] for i, rid in enumerate(self.rids)
        }
        self.admitted: set[str] = set()
        self.increments: list[Increment] = []
        self.copy_ok: list[bool] = []  # per increment, once its copy was seen finished
        self.staged: list[tuple[str, list[str]]] = []  # write_storage calls: (rid, page hashes)
        self.initial = self.counters()
        self._probe_write_storage()

    # ---- observation -----------------------------------------------------------------------------
    def _probe_write_storage(self) -> None:
        """Record every ``write_storage`` call (a pass-through: the real method runs unchanged).
        Write acks are retired in ack-id order, so the n-th call stages the n-th increment."""
        ctrl = self.m.cache_controller
        real = ctrl.write_storage

        def write_storage(
            host_indices: Any, token_ids: Any, hash_value: Any = None, prefix_keys: Any = None
        ) -> Any:
            n = len(self.staged)
            rid = self.increments[n].rid if n < len(self.increments) else "?"
            self.staged.append((rid, list(hash_value or [])))
            return real(host_indices, token_ids, hash_value=hash_value, prefix_keys=prefix_keys)

        ctrl.write_storage = write_storage

    def _observe_new_increments(self) -> None:
        known = {i.ack_id for i in self.increments}
        for ack_id in sorted(self.m.ongoing_offload):
            if ack_id in known:
                continue
            req, host_indices, tokens, _t, start, end = self.m.ongoing_offload[ack_id]
            self.increments.append(
                Increment(ack_id, req.rid, int(start), int(end), host_indices.clone(), list(tokens))
            )

    def acked(self) -> int:
        return sum(1 for i in self.increments if i.ack_id not in self.m.ongoing_offload)

    def copies_done(self) -> int:
        """Finished copies: the acked ones, then the leading queued acks whose event completed."""
        n = self.acked()
        for ack in self.m.cache_controller.ack_write_queue:
            if not ack.finish_event.query():
                break
            n += 1
        return n

    def _observe_copies(self) -> None:
        for j in range(len(self.copy_ok), self.copies_done()):
            inc = self.increments[j]
            exp = self.h.kv(inc.tokens)
            self.copy_ok.append(bool(torch.equal(self.h.host_kv(inc.host_indices), exp)))

    def freed(self) -> int:
        return len(self.staged) - len(self.m.ongoing_backup)

    # ---- actions (each one spec action) ----------------------------------------------------------
    def phase(self, rid: str) -> str:
        req = self.reqs[rid]
        if rid not in self.admitted:
            return "Waiting"
        if req.req_pool_idx is None:
            return "Released"
        return "Finished" if req.finished() else "Decoding"

    def admit(self, rid: str) -> Step:
        if self.phase(rid) != "Waiting":
            return Step(["Admit", rid], changed=False)
        req = self.reqs[rid]
        ok = self.h.admit(req, self.tokens[rid][self.prompt_len])
        if ok:
            self.admitted.add(rid)
        return self._after(Step(["Admit", rid], fits=ok, changed=ok))

    def decode(self, rid: str) -> Step:
        req = self.reqs[rid]
        if self.phase(rid) != "Decoding" or len(req.output_ids) >= self.max_new:
            return Step(["Decode", rid], changed=False)
        pos = int(req.kv_committed_len)
        nxt = self.tokens[rid][pos + 1]
        ok = self.h.decode_step(req, nxt)
        full_page = ok and (pos + 1) % self.ps == 0
        act = ["Decode", rid] if full_page or not ok else ["Stutter"]
        return self._after(Step(act, fits=ok, changed=ok))

    def _aligned(self, req: Any) -> int:
        """The increment offload_kv_cache would write now (tokens), computed as it does."""
        st = self.m.offloaded_state.get(req.rid)
        prefill = len(req.origin_input_ids) // self.ps * self.ps
        inc = st.inc_len if st is not None else 0
        pre = st.prefill_len if st is not None else prefill
        new = len(req.origin_input_ids) + len(req.output_ids) - 1 - pre - inc
        return new // self.h.stride * self.h.stride

    def offload(self, rid: str) -> Step:
        if self.phase(rid) != "Decoding":
            return Step(["Offload", rid], changed=False)
        req = self.reqs[rid]
        k = self._aligned(req)
        fresh = rid not in self.m.offloaded_state
        issued = bool(self.m.offload_kv_cache(req))
        out = "issued" if issued else ("full" if k > 0 else "none")
        changed = out != "none" or fresh  # the first call creates offloaded_state[rid]
        return self._after(Step(["Offload", rid], fits=out != "full", outcome=out, changed=changed))

    def finish(self, rid: str) -> Step:
        """The request stops (its finish reason is set), then sglang's finish hook runs."""
        from sglang.srt.managers.schedule_batch import FINISH_LENGTH

        if self.phase(rid) != "Decoding":
            return Step(["Finish", rid], changed=False)
        req = self.reqs[rid]
        req.finished_reason = FINISH_LENGTH(length=len(req.output_ids))
        k = self._aligned(req)
        issued = bool(self.m.offload_kv_cache(req))
        if not issued:
            self.m.finalize_release_on_finish(req)
        out = "issued" if issued else ("full" if k > 0 else "none")
        return self._after(Step(["Finish", rid], fits=out != "full", outcome=out))

    def check(self) -> Step:
        before = (self.acked(), self.freed())
        self.m.check_offload_progress()
        return self._after(Step(["Check"], changed=(self.acked(), self.freed()) != before))

    def copy(self) -> Step:
        ok = self.h.complete_copy()
        return self._after(Step(["Copy", self.rank], changed=ok))

    def store(self) -> Step:
        assert self.h.storage is not None
        ok = self.h.storage.complete(1) == 1
        return self._after(Step(["Store", self.rank], changed=ok))

    def _after(self, step: Step) -> Step:
        """Observe what the step did (before other requests reuse freed memory), then let them."""
        self._observe_new_increments()
        self._observe_copies()
        self.h.scribble()
        return step

    # ---- the refinement mapping -------------------------------------------------------------------
    def _key(self, rid: str, hv: str | None) -> int:
        if hv is None:
            return 0
        w = self.where.get(hv)
        return w[1] if w is not None and w[0] == rid else -1

    def abstract(self) -> dict[str, Any]:
        """The spec's state record ``s`` for this rank."""
        h, m, ps = self.h, self.m, self.ps
        free = set(h.free_device_slots().tolist())
        phase = {r: self.phase(r) for r in self.rids}
        live = [r for r in self.rids if phase[r] in ("Decoding", "Finished")]
        length: dict[str, int] = {}
        dev: dict[str, list[int]] = {}
        partial = 0
        for r in self.rids:
            req = self.reqs[r]
            if r not in self.admitted:
                length[r], dev[r] = 0, []
                continue
            length[r] = int(req.kv_committed_len) // ps
            if r not in live:
                dev[r] = []
                continue
            idx = h.req_pool.req_to_token[req.req_pool_idx]
            pre = len(req.prefix_indices) // ps
            dev[r] = [
                i
                for i in range(pre, length[r])
                if not any(int(x) in free for x in idx[i * ps : (i + 1) * ps].tolist())
            ]
            partial += (int(req.kv.kv_allocated_len) - length[r] * ps) // ps
        st = {r: m.offloaded_state.get(r) for r in self.rids}
        chain: dict[str, list[int]] = {r: [] for r in self.rids}
        okeys: list[list[int]] = []
        for rid, hashes in self.staged:
            keys = [self._key(rid, hv) for hv in hashes]
            okeys.append(keys)
            if rid in chain:
                chain[rid] += keys
        assert h.storage is not None
        return {
            "phase": phase,
            "len": length,
            "dev": dev,
            "devFree": int(h.allocator.available_size()) // ps + partial,
            "locks": 0,
            "prot": int(h.tree.protected_size_) // ps,
            "treeOk": True,
            "hasSt": {r: st[r] is not None for r in self.rids},
            "inc": {r: (st[r].inc_len // ps if st[r] is not None else 0) for r in self.rids},
            "last": {r: (self._key(r, st[r].last_hash) if st[r] is not None else 0) for r in self.rids},
            "inflight": {r: int(m.offload_inflight.get(r, 0)) for r in self.rids},
            "rel": {r: int(phase[r] == "Released") for r in self.rids},
            "chain": chain,
            "ops": [{"r": i.rid, "lo": i.start // ps, "hi": i.end // ps} for i in self.increments],
            "okeys": okeys,
            "acked": self.acked(),
            "odata": {self.rank: list(self.copy_ok)},
            "stored": {self.rank: h.storage.writes},
            "freed": {self.rank: self.freed()},
            "hostFree": {self.rank: int(h.host_pool.available_size()) // ps},
            "store": {self.rank: self._store()},
        }

    def _store(self) -> list[dict[str, Any]]:
        out = []
        for hv, data in self.h.stored_pages().items():
            w = self.where.get(hv)
            if w is None:
                raise DecodeFailure(f"storage holds page {hv[:12]}… which is on no request's hash chain")
            rid, k = w
            toks = self.tokens[rid][(k - 1) * self.ps : k * self.ps]
            out.append({"r": rid, "k": k, "ok": bool(torch.equal(data, self.h.kv(toks)))})
        return sorted(out, key=lambda e: (e["r"], e["k"]))

    # ---- checks on the real objects ---------------------------------------------------------------
    def counters(self) -> dict[str, int]:
        """Every counter that must return to its initial value once all requests are released."""
        h, m = self.h, self.m
        return {
            "device_free": int(h.allocator.available_size()),
            "req_slots_free": int(h.req_pool.available_size()),
            "host_free": int(h.host_pool.available_size()),
            "protected": int(h.tree.protected_size_),
            "ongoing_offload": len(m.ongoing_offload),
            "ongoing_backup": len(m.ongoing_backup),
            "offloaded_state": len(m.offloaded_state),
            "offload_inflight": len(m.offload_inflight),
        }

    def check_real(self) -> None:
        """Invariants read off the real objects (independent of the mapping), most specific first."""
        h, m = self.h, self.m
        live = [r for r in self.rids if self.phase(r) in ("Decoding", "Finished")]
        # a decoding request reads exactly the KV it computed (none of its slots was freed and reused)
        for r in live:
            req = self.reqs[r]
            if req.finished():
                continue
            n = int(req.kv_committed_len)
            slots = h.req_pool.req_to_token[req.req_pool_idx, :n].to(torch.int64)
            if not torch.equal(h.device_kv(slots), h.kv(self.tokens[r][:n])):
                raise DecodeFailure(f"request {r} reads KV that is not its own (a slot was freed mid-decode)")
        # in-flight counts are exact, release waits for them
        for r in self.rids:
            n_in = sum(1 for v in m.ongoing_offload.values() if v[0].rid == r)
            if int(m.offload_inflight.get(r, 0)) != n_in:
                raise DecodeFailure(
                    f"offload_inflight[{r}] = {m.offload_inflight.get(r, 0)} but {n_in} in flight"
                )
            if self.phase(r) == "Released":
                if n_in:
                    raise DecodeFailure(f"request {r} was released with {n_in} increment(s) in flight")
                if r in m.offloaded_state:
                    raise DecodeFailure(f"request {r} was released but its offloaded_state remains")
        # device and request slots: free + held by live requests == capacity, nothing freed twice
        free = h.free_device_slots()
        if len(set(free.tolist())) != free.numel():
            raise DecodeFailure("a device slot is on the allocator's free list twice (double free)")
        rs = h.req_pool.free_slots
        if len(set(rs)) != len(rs):
            raise DecodeFailure("a request slot is on the free list twice (the request was released twice)")
        held = sum(int(self.reqs[r].kv.kv_allocated_len) - len(self.reqs[r].prefix_indices) for r in live)
        if free.numel() + held != h.cfg.device_tokens:
            raise DecodeFailure(
                f"device slots not conserved: free {free.numel()} + held by live requests {held} "
                f"!= {h.cfg.device_tokens}"
            )
        if len(rs) + len(live) != h.cfg.max_reqs:
            raise DecodeFailure(f"request slots: {len(rs)} free with {len(live)} live of {h.cfg.max_reqs}")
        # host slots: free + held by increments not yet freed after their backup == pool size
        hp = h.host_pool
        held_host = sum(len(v[1]) for v in m.ongoing_offload.values()) + sum(
            len(v[1]) for v in m.ongoing_backup.values()
        )
        if hp.available_size() + held_host != hp.size:
            raise DecodeFailure(
                f"host slots not conserved: free {hp.available_size()} + held {held_host} != {hp.size}"
            )
        if int(h.tree.protected_size_) != 0:
            raise DecodeFailure(f"protected_size_ = {h.tree.protected_size_} (nothing is protected)")
        # the page hashes handed to storage are the requests' hash chains, in order, no gap
        pre = self.prompt_len // self.ps
        for r in self.rids:
            got = [hv for rid, hashes in self.staged if rid == r for hv in hashes]
            if got != self.chains[r][pre : pre + len(got)]:
                raise DecodeFailure(f"request {r}: page hashes handed to storage are not its hash chain")
        # host copies and storage hold the KV that was written
        if not all(self.copy_ok):
            j = self.copy_ok.index(False)
            raise DecodeFailure(f"increment {j + 1} copied the wrong KV to host (a source slot was reused)")
        bad = [e for e in self._store() if not e["ok"]]
        if bad:
            raise DecodeFailure(f"storage holds wrong KV for {bad[0]['r']} page {bad[0]['k']}")

    # ---- teardown ----------------------------------------------------------------------------------
    def drain(self) -> None:
        """Finish every request, then let every copy, ack and backup happen (bounded rounds)."""
        for r in self.rids:
            if self.phase(r) == "Decoding":
                self.finish(r)
                self.check_real()
        assert self.h.storage is not None
        for _ in range(2 * len(self.increments) + 4):
            while self.h.complete_copy():
                self.check_real()
            self.check()
            self.check_real()
            while self.store().changed:
                self.check_real()
            self.check()
            self.check_real()

    def check_quiescent(self) -> None:
        """After :meth:`drain`: everything released and back to its initial value; storage holds
        exactly the offloaded part of each request's chain, with the right bytes."""
        for r in self.rids:
            if self.phase(r) not in ("Waiting", "Released"):
                raise DecodeFailure(
                    f"request {r} is {self.phase(r)} after finishing and draining (never released)"
                )
        now = self.counters()
        if now != self.initial:
            diff = {k: (self.initial[k], now[k]) for k in now if now[k] != self.initial[k]}
            raise DecodeFailure(f"leak after draining: {diff}")
        self.check_real()
        ps, pre = self.ps, self.prompt_len // self.ps
        stored = {(e["r"], e["k"]) for e in self._store()}
        for r in self.rids:
            n = sum(len(hs) for rid, hs in self.staged if rid == r)
            want = {(r, k) for k in range(pre + 1, pre + n + 1)}
            have = {x for x in stored if x[0] == r}
            if have != want:
                raise DecodeFailure(
                    f"request {r}: storage holds pages {sorted(k for _, k in have)}, expected {sorted(k for _, k in want)}"
                )
        del ps


__all__ = ["DecodeFailure", "DecodeWorld", "Increment", "Step", "token_id"]
