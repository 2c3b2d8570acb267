"""What toolkv does differently when HiCache's storage backend is Mooncake
(``--hicache-storage-backend mooncake``): ``spec/storage/SharedTier.tla``.

Mooncake's master evicts on its own (above its high watermark, approximate LRU) and honours none
of toolkv's records: only its leases (seconds), incomplete puts, hard pins and soft pins whose
deadline is ahead (``-allow_evict_soft_pinned_objects=false`` makes a soft pin a guarantee, not a
priority). sglang's ``MooncakeStore`` puts without a soft pin, and a page it put could be evicted
before toolkv's ``StoreAck`` (mutant ``PinAtAck``). So at ``Store`` toolkv writes the session's
pages itself from its protected host copy with one ``batch_upsert_from`` whose ``ReplicateConfig``
carries ``soft_pin_action=ENABLE`` and a deadline past the session's TTL (spec ``StorePage``: the
master commits the pin with the put, ``PutKept``); at a whole ``StoreAck`` it puts the session's
manifest beside them, pinned alike: its epoch and tokens, which is what a server that never saw
the session needs to adopt it (spec ``ToolEnd`` on a server with ``owner = NoServer``). A store
not acknowledged whole has its pins released by an upsert with ``soft_pin_action=DISABLE``
(``PinsReleased``).
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


def soft_unpin_config() -> Any:
    """Mooncake's ``ReplicateConfig`` of an upsert that ends its object's soft pin
    (``SoftPinAction.DISABLE``): the master may evict it again."""
    from mooncake.store import ReplicateConfig, SoftPinAction

    config = ReplicateConfig()
    config.soft_pin_action = SoftPinAction.DISABLE
    return config


def page_rows(host_indices: torch.Tensor, page: int, which: Sequence[int]) -> torch.Tensor:
    """The host slots of pages ``which`` (indices into the copy's pages) of ``host_indices``."""
    return torch.cat([host_indices[i * page : (i + 1) * page] for i in which])


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

    def _upsert(self, keys: Sequence[str], host_indices: torch.Tensor, config: Any) -> list[str]:
        """One ``batch_upsert_from`` of ``keys`` (sglang's page hashes) from ``host_indices``;
        the keys whose every object was written. A layout sglang splits over several buffers is
        not written here (none)."""
        s = self.storage
        if s.mem_pool_host.kv_buffer is None or not keys:
            return []
        tagged = s._tag_keys(list(keys))
        key_strs, ptrs, sizes = s._batch_preprocess(tagged, host_indices)
        if s._uses_multi_buffer(ptrs):
            return []
        per = len(key_strs) // len(keys)  # objects per page (sglang may split a page, e.g. k and v)
        codes = [int(c) for c in self.client.batch_upsert_from(key_strs, ptrs, sizes, config)]
        return [k for i, k in enumerate(keys) if all(c == 0 for c in codes[i * per : (i + 1) * per])]

    def put_pinned(self, keys: Sequence[str], host_indices: torch.Tensor) -> list[str]:
        """Spec ``StorePage``: one upsert of every page of ``keys`` (root first) from
        ``host_indices`` (the host copy, protected by the caller), each put carrying the soft pin
        (the master commits it with the put). Returns the keys written and pinned."""
        return self._upsert(keys, host_indices, self._pin_config())

    def unpin_pages(self, keys: Sequence[str], host_indices: torch.Tensor, which: set[str]) -> None:
        """``PinsReleased``: the soft pins of the pages ``which`` (of the copy ``keys`` put from
        ``host_indices``, still protected) end: an upsert with ``SoftPinAction.DISABLE``."""
        idx = [i for i, k in enumerate(keys) if k in which]
        if idx:
            page = int(self.storage.mem_pool_host.page_size)
            self._upsert([keys[i] for i in idx], page_rows(host_indices, page, idx), soft_unpin_config())

    def landed(self, keys: Sequence[str]) -> bool:
        """The pinned put of ``keys`` has finished: always (``batch_upsert_from`` returns when it
        has)."""
        return True

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
