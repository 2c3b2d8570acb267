"""What toolkv does differently when HiCache's storage backend is Mooncake
(``--hicache-storage-backend mooncake``): ``spec/storage/SharedTier.tla``.

Mooncake's master evicts on its own (above its high watermark, approximate LRU) and honours none
of toolkv's records: only its leases (seconds), incomplete puts, hard pins and soft pins whose
deadline is ahead (``-allow_evict_soft_pinned_objects=false`` makes a soft pin a guarantee, not a
priority). sglang's ``MooncakeStore`` puts without a soft pin. So at a whole ``StoreAck`` toolkv
re-writes the session's pages from its still-protected host copy with one
``batch_upsert_from`` carrying ``soft_pin_action=ENABLE`` and a deadline past the session's TTL
(spec ``StoreAck``: the upsert also puts back a page the master evicted since the check), and puts
the session's manifest beside them, pinned alike: its epoch and tokens, which is what a server
that never saw the session needs to adopt it (spec ``ToolEnd`` on a server with
``owner = NoServer``).
"""

from __future__ import annotations

import json
import time
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

#: the manifest's key in the tier, beside sglang's page keys (never a page hash: those are hex)
MANIFEST_PREFIX = "toolkv-session:"


def soft_pin_config(ttl_ms: int) -> Any:
    """Mooncake's ``ReplicateConfig`` of a put that soft-pins its object for ``ttl_ms``: the master's
    eviction skips it until then (the store's own protection primitive)."""
    from mooncake.store import ReplicateConfig, SoftPinAction

    config = ReplicateConfig()
    config.soft_pin_action = SoftPinAction.ENABLE
    config.soft_pin_ttl_ms = int(ttl_ms)
    return config


class MooncakeTierError(RuntimeError):
    """Mooncake refused an operation toolkv needs (its error code is in the message)."""


@dataclass(frozen=True)
class Manifest:
    """A stored session as the tier knows it: enough for another server to adopt it.
    ``pinned_until_ms`` (wall clock, ms since the epoch) is its soft pin's deadline, the same as its
    pages': past it the master may have evicted a page while the manifest is still there, so an
    adopter refuses it (SharedTier.tla's ``ToolEnd`` on ``owner = NoServer`` needs ``spin``)."""

    session_id: str
    epoch: int
    tokens: array[int]
    extra_key: str | None
    pinned_until_ms: int = 0

    def encode(self) -> bytes:
        return json.dumps(
            {"session_id": self.session_id, "epoch": self.epoch, "extra_key": self.extra_key,
             "tokens": self.tokens.tobytes().hex(), "pinned_until_ms": self.pinned_until_ms}
        ).encode()  # fmt: skip

    @classmethod
    def decode(cls, raw: bytes) -> Manifest:
        d = json.loads(raw.decode())
        return cls(
            d["session_id"], int(d["epoch"]), array("q", bytes.fromhex(d["tokens"])), d["extra_key"],
            int(d.get("pinned_until_ms", 0)),
        )  # fmt: skip

    def pinned(self, now_ms: float | None = None) -> bool:
        """The pin's deadline is still ahead (``now_ms``: the wall clock by default)."""
        return (time.time() * 1000 if now_ms is None else now_ms) < self.pinned_until_ms


def is_mooncake(storage: Any) -> bool:
    """sglang's ``MooncakeStore`` (by name: sglang imports mooncake only when the backend is on)."""
    return type(storage).__name__ == "MooncakeStore" and hasattr(storage, "store")


class MooncakeTier:
    """Mooncake's soft pin and the session manifest over sglang's ``MooncakeStore`` instance.

    ``pin_ttl_ms`` is the soft pin's deadline after the write; the manager sets it past its TTL
    (``PinTtlShort`` is the mutant where it is not)."""

    def __init__(self, storage: Any, pin_ttl_ms: int) -> None:
        self.storage = storage
        self.client = storage.store  # MooncakeDistributedStore
        self.pin_ttl_ms = int(pin_ttl_ms)

    def _pin_config(self) -> Any:
        return soft_pin_config(self.pin_ttl_ms)

    def pin_pages(self, keys: Sequence[str], host_indices: torch.Tensor) -> bool:
        """Spec ``StoreAck``'s pin: one upsert of every page of ``keys`` (sglang's page hashes,
        root first) from ``host_indices`` (the host copy, protected by the caller until this
        returns), with the soft pin. True when every object was written and pinned."""
        s = self.storage
        if s.mem_pool_host.kv_buffer is None:
            return False
        tagged = s._tag_keys(list(keys))
        key_strs, ptrs, sizes = s._batch_preprocess(tagged, host_indices)
        if s._uses_multi_buffer(ptrs):  # a layout sglang splits over several buffers: not pinned here
            return False
        codes = self.client.batch_upsert_from(key_strs, ptrs, sizes, self._pin_config())
        return all(int(c) == 0 for c in codes)

    def pin_deadline_ms(self) -> int:
        """The wall-clock deadline (ms) of a pin taken now, recorded in the manifest; a little
        short of the master's (which counts from its own write, a moment later)."""
        return int(time.time() * 1000) + self.pin_ttl_ms

    def put_manifest(self, m: Manifest) -> bool:
        """The session's manifest, pinned like its pages (upsert: a newer epoch replaces it)."""
        rc = self.client.upsert(MANIFEST_PREFIX + m.session_id, m.encode(), self._pin_config())
        return int(rc) == 0

    def find_manifest(self, session_id: str) -> Manifest | None:
        """The manifest of a session stored by any server, or None (never stored, or evicted
        once its pin lapsed)."""
        key = MANIFEST_PREFIX + session_id
        if int(self.client.is_exist(key)) != 1:
            return None
        raw = self.client.get(key)
        return Manifest.decode(bytes(raw)) if raw else None

    def drop_manifest(self, session_id: str) -> None:
        """The session is known again (its tool_end accepted, on this server or by adoption), over
        (close, TTL), or stored anew: its manifest goes (SharedTier.tla's ``ArrivalRead``; mutant
        ``ManifestKept`` leaves it, and after a newer store dies with its server a stale tool_end
        would adopt the older copy). A remove the master refuses (a lease from a read in flight)
        leaves it to lapse with its pin; a newer store's upsert replaces it."""
        self.client.remove(MANIFEST_PREFIX + session_id)
