"""The model forward of the drivers that check KV bytes (the soak, the demo, the fault bench).

TEST DOUBLE of the GPU's forward pass, as thin as what it stands for: a batch that
:class:`~toolkv.twin.scheduler.TwinScheduler` formed has its memory allocated and its rows of
``req_to_token`` written; the forward then writes each new position's KV (the harness's KV is a
function of the token id: :meth:`~toolkv.testing.base.TreeHarness.expected_kv`) and reads the
prefix every request reuses, which must hold exactly its tokens' KV. A restore that moved the
wrong bytes, or a slot freed and reused while still in the tree, shows here as a mismatch.

Before that, a prefill waits for the HiCache loads into its prefixes, as sglang's forward waits on
the load's event (the copy engine finishes every load in flight). The twin's own runs skip all of
this: they count tokens and time, not bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from toolkv.twin.scheduler import Batch, TwinScheduler


@dataclass
class KVForward:
    """Writes and checks the KV of each batch run over ``harness`` by ``sched``."""

    harness: Any  # toolkv.testing.base.TreeHarness
    sched: TwinScheduler
    bytes_checked: int = 0
    byte_mismatches: int = 0
    mismatched: list[str] = field(default_factory=list)  # rids whose reused prefix was wrong

    def run(self, batch: Batch) -> None:
        """The forward of ``batch``: loads finish, reused prefixes are checked, new KV written."""
        h, sched = self.harness, self.sched
        r2t = h.req_pool.req_to_token
        if batch.mode == "prefill":
            if h.is_hi:
                h.complete("load")
            for req, (p, n) in zip(batch.reqs, batch.chunks, strict=True):
                ids = [*req.origin_input_ids, *req.output_ids]
                row = r2t[sched._req_row(req), : p + n].to(torch.int64)
                self.check(req, ids, row[:p])
                if n:
                    h.fill_kv(row[p:], ids[p : p + n])
        else:
            for req in batch.reqs:
                pos = sched._committed_len(req) - 1  # the position _commit_decode just allotted
                n_in = len(req.origin_input_ids)  # (a decode position is past the prompt unless retracted)
                token = req.origin_input_ids[pos] if pos < n_in else req.output_ids[pos - n_in]
                h.fill_kv(r2t[sched._req_row(req), pos : pos + 1].to(torch.int64), [token])

    def check(self, req: Any, tokens: list[int], indices: torch.Tensor) -> bool:
        """The ``len(indices)`` first tokens of ``tokens`` have exactly their KV at ``indices``."""
        ok = self.equal(tokens, indices)
        if not ok:
            self.mismatched.append(str(req.rid))
        return ok

    def equal(self, tokens: list[int], indices: torch.Tensor) -> bool:
        """Counted comparison of the device KV at ``indices`` with ``tokens``' KV."""
        n = len(indices)
        if n == 0:
            return True
        got = self.harness.device_kv(indices).float()
        ok = bool(torch.equal(got, self.harness.expected_kv(tokens[:n])))
        self.bytes_checked += got.numel() * got.element_size()
        self.byte_mismatches += 0 if ok else 1
        return ok
