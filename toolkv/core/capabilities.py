"""What a backend can do beyond the :class:`~toolkv.core.backends.base.Backend` protocol, as
``typing.Protocol``s, checked once where the manager gets its backend.

Not every cache has every tier: a plain RadixCache (pin, shadow) has no host tree to park on and no
storage tier; a HiRadixCache and a UnifiedRadixCache have both (``hicache_storage.py``,
``unified_storage.py``). The manager used to
ask ``getattr(backend, "pin_cost", None)`` at each use and call the L3 methods through
``type: ignore``. Here each optional ability is a protocol, :func:`capabilities_of` checks the
backend against all of them once, and the manager holds the answer, typed: ``caps.storage`` is a
:class:`StorageTier` or ``None``, never an ``Any`` a typo could hide behind.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

from toolkv.core.record import SessionRecord
from toolkv.core.treeops import Tree, TreeNode

FetchAnswer = Literal["host", "prefetching", "refused"]


@runtime_checkable
class HostSized(Protocol):
    """The backend knows what an offload would add on host (the policy's host test counts that,
    not the whole path: with write-through most of a path is backed up already)."""

    def host_need(self, leaf: TreeNode) -> int: ...


@runtime_checkable
class PinPriced(Protocol):
    """The backend knows what a pin costs the device and what sglang promised running requests
    (``headroom``, a callable the scheduler side rebinds to sglang's own count): the hand-over's
    room check (``check_pin_room``) needs both."""

    tree: Tree
    headroom: Callable[[], int]

    def pin_cost(self, leaf: TreeNode) -> int: ...


@runtime_checkable
class LockPriced(Protocol):
    """The backend's ``tool_start`` takes device locks (a HiCache write locks each node it copies,
    and its path, until the copy is acknowledged; the pin fallback's offload is a path lock) and
    knows what they take from what sglang may evict: sglang has promised running requests the
    room (``headroom``) and admits the next chunk of a chunked prefill without a check, so the
    offload's room check (``check_offload_room``) needs both."""

    tree: Tree
    headroom: Callable[[], int]

    def offload_lock_cost(self, leaf: TreeNode) -> int: ...


@runtime_checkable
class Parking(Protocol):
    """The backend's host copy lives in sglang's tree, so a restore can be left to sglang's own
    ``load_back`` at admission (spec ``Park``) and a hand-over pin can give way to the host copy
    (spec ``Unpin`` to ``Parked``)."""

    parks: bool

    def reprotect(self, rec: SessionRecord) -> bool: ...


@runtime_checkable
class LazyFree(Protocol):
    """The backend can leave a finished offload's GPU copies to sglang's own eviction instead of
    freeing them (spec ``LazyFree``): they stay on the device, unlocked and backed up, and sglang's
    eviction demotes them to the host copy (which the session protects) only when it needs the
    room, so a session whose copy survives comes back with nothing to load. A plain RadixCache
    (pin, shadow) has no such eviction: it would delete them."""

    def leave_gpu(self, recs: Sequence[SessionRecord]) -> None: ...


@runtime_checkable
class StorageTier(Protocol):
    """The L3 storage tier of ``spec/storage/StorageTier.tla`` (sglang's
    ``--hicache-storage-backend``). Every answer read off an asynchronous event is agreed across
    tensor-parallel ranks inside the backend."""

    def storage_enabled(self) -> bool: ...
    def store(self, rec: SessionRecord) -> bool: ...
    def store_ack(self, rec: SessionRecord) -> bool | None: ...
    def storage_prefetch(self, rec: SessionRecord, rid: str) -> FetchAnswer: ...
    def prefetch_ack(self, rec: SessionRecord) -> bool | None: ...
    def protect_host_prefix(self, rec: SessionRecord) -> int: ...
    def drop_storage(self, rec: SessionRecord) -> None: ...
    def let_go_storage(self, rec: SessionRecord) -> bool: ...
    def hold_pins_for_read(self, rec: SessionRecord) -> None: ...
    def poll_storage(self) -> int: ...


@dataclass(frozen=True)
class Capabilities:
    """The optional abilities of one backend (``None``: it has not got that one)."""

    host_sized: HostSized | None
    pin_priced: PinPriced | None
    parking: Parking | None
    storage: StorageTier | None
    lazy_free: LazyFree | None = None
    lock_priced: LockPriced | None = None

    @property
    def parks(self) -> bool:
        """Whether a restore can be left to sglang's own load-back (a HiCache host tree)."""
        return self.parking is not None and bool(self.parking.parks)


def capabilities_of(backend: object) -> Capabilities:
    """Check ``backend`` against every capability protocol, once (``isinstance`` against a
    runtime-checkable protocol looks for each member, so this is not free per call)."""
    return Capabilities(
        host_sized=backend if isinstance(backend, HostSized) else None,
        pin_priced=backend if isinstance(backend, PinPriced) else None,
        parking=backend if isinstance(backend, Parking) else None,
        storage=backend if isinstance(backend, StorageTier) else None,
        lazy_free=backend if isinstance(backend, LazyFree) else None,
        lock_priced=backend if isinstance(backend, LockPriced) else None,
    )
