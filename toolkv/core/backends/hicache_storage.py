"""HiRadixCache's L3 storage tier for toolkv (``spec/storage/StorageTier.tla``), the backend half
of ``toolkv.core.session.l3``: the :class:`~toolkv.core.capabilities.StorageTier` abilities of
:class:`~toolkv.core.backends.hiradix.HiRadixBackend`, in a module of their own.

A protected session's host copy goes down to sglang's storage backend and comes back through the
host: Store -> StoreAck (host protection released; HiCache may evict the host copy), then at
tool_end StoragePrefetch -> PrefetchAck (the pages are back in the host tree, protected) and the
ordinary restore host->GPU. Every step uses sglang's own primitives.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal

import torch

from toolkv.core.backends.base import Agreement, ProtectionLedger
from toolkv.core.backends.mooncake_tier import Manifest, MooncakeTier, is_mooncake
from toolkv.core.record import SessionRecord
from toolkv.core.treeops import Tree, TreeNode, is_root, path_to, walk


@dataclass
class StorageCopy:
    """toolkv's record of one session's copy in HiCache's L3 storage tier
    (``spec/storage/StorageTier.tla``: its variables ``wr``, ``l3prot``, ``pf`` and ``pin``).

    The record *is* the storage protection: a page key listed here must not be deleted while the
    record exists, and a record with ``rid`` set is pinned by the prefetch that reads it, whoever
    releases the session meanwhile (mutant ``ReleaseDropsPin``). sglang's storage backends know
    neither, which is why :meth:`HiRadixBackend.store` refuses a backend that evicts on its own."""

    keys: list[str]  # sglang's chained page hashes of the session's path, root first
    tokens: int  # page-aligned tokens the copy covers
    whole: bool = False  # StoreAck found every page in storage
    rid: str | None = None  # the request id of the prefetch reading the copy (its pin)
    released: bool = False  # the session let go while the prefetch read: dropped at its ack
    #: on Mooncake (SharedTier.tla ``ppin``): the pages whose put took a soft pin, and the host
    #: slots of the protected host copy they were put from (until the whole ack: released from
    #: them if the store is not acknowledged whole)
    pinned: list[str] = field(default_factory=list)
    host: torch.Tensor | None = None


#: :meth:`HiCacheStorage._read_from`'s answer for "the host copy is whole: restore from it" (not
#: None: on sglang 0.5.23's Rust tree core the root, where a prefetch may start, is None)
FROM_HOST: Final = "from host"


def _ntok(nodes: Sequence[TreeNode]) -> int:
    """Tokens held by ``nodes`` (key length equals value and host_value length; ``len`` of a
    RadixKey is a few times cheaper than ``len`` of a tensor)."""
    return sum(len(n.key) for n in nodes)


class HiCacheStorage:
    """The storage-tier steps of :class:`~toolkv.core.backends.hiradix.HiRadixBackend` (a mixin
    over its tree, agreement, protection ledger and storage records). A step a seeded defect
    changes is a small method of its own (:meth:`_store_whole`, :meth:`_read_from`,
    :meth:`_release_storage`), overridden from outside by ``toolkv.verify.toolkv.mutants``.

    What reads or calls sglang's release-specific API is a small method too (:meth:`_page_keys`,
    :meth:`_write_to_storage`, :meth:`_storing`, :meth:`_lookup`, :meth:`_start_prefetch`,
    :meth:`_prefetch_finished`): 0.5.23's ``UnifiedRadixCache`` has the same storage path behind
    node ids and request handles, and ``toolkv.core.backends.unified_storage`` overrides these
    alone; the spec's actions above them are this class's, on both releases."""

    tree: Tree
    agree: Agreement
    _ledger: ProtectionLedger
    _l3: dict[str, StorageCopy]  # sessions' copies in the L3 storage tier, by session id
    #: on Mooncake: a whole copy's page keys whose soft pins this server took and has not released,
    #: by session, once the copy's record went for sglang's read at arrival (released at the
    #: session's next store, close or TTL: the read has been made by then)
    _held: dict[str, list[str]]
    _reading: set[str]  # sessions whose whole copy sglang reads at arrival (the pins wait for it)
    pins_left: int  # soft pins left to their deadline: the host held no longer the bytes to end them
    pin_cap_refused: int  # stores refused by the pin budget (SharedTier.tla's PinFits)
    #: SharedTier.tla's ``PinBudget`` in tokens: the most this server's puts may hold soft-pinned in
    #: a shared Mooncake tier at once (a page shared by several sessions counts once); None: no cap.
    #: The manager sets it from ``l3_pin_tokens``
    pin_budget_tokens: int | None = None
    #: the soft pin's deadline on Mooncake (spec/storage/SharedTier.tla); the manager sets it past
    #: its TTL (L3Tier); Mooncake's own default is 30 minutes
    pin_ttl_ms: int = 30 * 60 * 1000

    def _take_host_protection(self, rec: SessionRecord, leaf: TreeNode) -> None:
        raise NotImplementedError  # the host tier's (HiRadixBackend)

    def _host_backed(self, m: TreeNode) -> bool:
        raise NotImplementedError  # the host tier's (HostRestore)

    def _release_protection(self, rec: SessionRecord) -> None:
        raise NotImplementedError  # the host tier's (HiRadixBackend)

    # A protected session's host copy goes down to sglang's storage backend and comes back through
    # the host: Store -> StoreAck (host protection released; HiCache may evict the host copy), then
    # at tool_end StoragePrefetch -> PrefetchAck (the pages are back in the host tree, protected)
    # and the ordinary restore host->GPU (``restore``). Every step uses sglang's own primitives:
    # ``write_backup_storage`` (the backup thread writes the pages, sglang's ``protect_host`` keeps
    # the source until the ack), ``prefetch_from_storage`` and ``check_prefetch_progress`` (the
    # prefetch threads read the pages into host slots sglang allocates). The acks arrive through
    # the scheduler's ``check_hicache_events`` (``drain_storage_control_queues``), as sglang's own.
    # ``check_prefetch_progress`` holds collectives: like the other steps here it must run on
    # every TP rank in the same scheduler step.

    @property
    def storage_copies(self) -> dict[str, StorageCopy]:
        """The sessions' storage copies toolkv holds (read only; for kv_meta and tests)."""
        return dict(self._l3)

    def storage_enabled(self) -> bool:
        """True when the cache runs with an L3 backend (``--hicache-storage-backend``)."""
        return bool(getattr(self.tree, "enable_storage", False))

    def _storage(self) -> Any:
        return self.tree.cache_controller.storage_backend

    def shared_tier(self) -> MooncakeTier | None:
        """Mooncake's soft pin and the session manifests, when the storage backend is Mooncake
        (``spec/storage/SharedTier.tla``); None for a backend whose eviction toolkv sees (``file``).
        A backend with a ``toolkv_shared_tier`` of its own (the twin's store with Mooncake's
        semantics) answers for itself."""
        if not self.storage_enabled():
            return None
        own = getattr(self._storage(), "toolkv_shared_tier", None)
        if own is not None:
            tier: MooncakeTier | None = own(self.pin_ttl_ms)
            return tier
        if not is_mooncake(self._storage()):
            return None
        return MooncakeTier(self._storage(), self.pin_ttl_ms)

    def _stored_pages(self, keys: Sequence[str]) -> int:
        """Leading pages of ``keys`` the backend holds (its ``batch_exists``: the prefix sglang's own
        hit query would prefetch)."""
        return int(self._storage().batch_exists(list(keys)))

    def _storing(self, m: TreeNode) -> bool:
        """A write of ``m`` to storage is in flight (its ack not yet drained by the scheduler)."""
        return any(x is m for x in self.tree.ongoing_backup.values())

    def _evicts_on_its_own(self) -> bool:
        """The backend may delete pages by itself: HiCacheFile with a size cap or a free-space
        watermark runs an LRU evictor that knows nothing of toolkv's protection (spec
        ``L3Evict`` may only take unprotected, unpinned pages), and has no pin to ask it."""
        evictor = getattr(self._storage(), "_evictor", None)
        return bool(getattr(evictor, "enabled", False))

    def store(self, rec: SessionRecord) -> bool:
        """Spec ``Store``: write the session's protected host copy to storage. The copy is
        protected in storage from now on (``LateL3Protect`` waited for the ack, and a page
        written first could be evicted before the last one landed); the host protection stays
        until :meth:`store_ack`. Nodes whose pages are all in storage already (HiCache writes
        every acknowledged host copy to storage itself) are not written again. Returns False,
        changing nothing, when the session is not offloaded to host (a host write still in
        flight), the path has no page hashes, the backend evicts on its own, or on a shared Mooncake
        tier the pinned put would pass the pin budget (:meth:`can_pin`)."""
        leaf = rec.protected
        if not self.storage_enabled() or leaf is None or rec.session_id in self._l3:
            return False
        tree = self.tree
        path = path_to(tree, leaf)
        per_node = self._page_keys(path)
        if not self.agree.all_true(per_node is not None and not self._evicts_on_its_own()):
            return False
        assert per_node is not None
        keys = [k for node_keys in per_node for k in node_keys]
        tier = self.shared_tier()
        if not self.agree.all_true(tier is None or self.can_pin(rec, keys)):
            self.pin_cap_refused += 1
            return False
        self._forget_manifest(rec.session_id)  # an older epoch's, left by a failed remove
        copy = StorageCopy(keys=keys, tokens=len(keys) * tree.page_size)
        if tier is not None:
            old = self._held.pop(rec.session_id, [])
            self._put_pinned(tier, copy, path)
            kept = set(copy.pinned)  # the new epoch's put pinned its pages anew; the rest go now
            self._release_pins(rec, [k for k in old if k not in kept])
        else:
            have = self._stored_pages(keys)
            done = 0
            for m, node_keys in zip(path, per_node, strict=True):  # root-down, from the first page missing
                n = len(node_keys)
                if done + n > have and not self._storing(m):
                    self._write_to_storage(m)
                done += n
        self._l3[rec.session_id] = copy
        return True

    def can_pin(self, rec: SessionRecord, keys: Sequence[str]) -> bool:
        """SharedTier.tla's ``PinFits``: the pinned put of ``keys`` keeps what this server's puts
        hold soft-pinned within :attr:`pin_budget_tokens`: the pages its other sessions rely on the
        pins of (a store in flight counts whole: its one upsert puts every page), with ``keys``,
        each page once. The session's own older pins are left out (its new store replaces them).
        Pins left to their deadline (``pins_left``) are not counted: nothing here can end them,
        and the master lets them go at the deadline. Mutant ``NoPinCap``: no cap, and the pinned
        copies fill the store (the master may evict none of them and refuses later puts)."""
        if self.pin_budget_tokens is None:
            return True
        pages = self._held_elsewhere(rec.session_id) | set(keys)
        return len(pages) * int(self.tree.page_size) <= self.pin_budget_tokens

    def _put_pinned(self, tier: MooncakeTier, copy: StorageCopy, path: Sequence[TreeNode]) -> None:
        """SharedTier.tla's ``StorePage`` on Mooncake: every page of the copy put from the protected
        host copy by one upsert whose ``ReplicateConfig`` carries the soft pin, so that from its put
        on the master evicts none of them (sglang's backup puts carry no pin, and a page it put
        could be evicted before the ack: mutant ``PinAtAck``, ``PutKept``). Pages already in the
        tier (HiCache writes every host copy through) are pinned by the same upsert."""
        host = torch.cat([m.host_value for m in path])[: copy.tokens]
        copy.host = host
        copy.pinned = tier.put_pinned(copy.keys, host)

    def _page_keys(self, path: Sequence[TreeNode]) -> list[list[str]] | None:
        """Each node's page hashes, root first; None unless every node has an acknowledged host
        copy (a host write in flight has nothing to store yet) and a hash per page."""
        page = self.tree.page_size
        ready = all(m.host_value is not None and m.write_through_pending_id is None for m in path)
        if not ready or not all(
            m.hash_value is not None and len(m.hash_value) == len(m.key) // page for m in path
        ):
            return None
        return [list(m.hash_value) for m in path]

    def _write_to_storage(self, m: TreeNode) -> None:
        """Write ``m``'s host copy to storage: sglang's ``write_backup_storage`` (its backup thread;
        ``protect_host`` on ``m`` until the backup ack is drained)."""
        self.tree.write_backup_storage(m)

    def store_ack(self, rec: SessionRecord) -> bool | None:
        """Spec ``StoreAck``: None while a write of the path is in flight. Then whole (every page
        is in storage): the host protection is released, so HiCache may evict the host copy, and
        the session lives in storage; True. Short (the backend refused a page: sglang's backup
        stops at the first failed batch and its ack does not say so): the record is dropped, the
        session keeps its protected host copy and may be stored again; False. Taking a short copy
        for a whole one is mutant ``TrustShortAck``."""
        copy = self._l3.get(rec.session_id)
        assert copy is not None and not copy.whole, "store_ack follows store"
        assert rec.protected is not None
        if any(self._storing(m) for m in path_to(self.tree, rec.protected)):  # lockstep on every rank
            return None
        tier = self.shared_tier()
        if not self.agree.all_true(tier is None or tier.landed(copy.keys)):  # the pinned put's time
            return None
        if not self.agree.all_true(self._store_whole(copy) and self._manifest_in_tier(rec, copy)):
            self._unpin(copy, rec.session_id)
            del self._l3[rec.session_id]
            return False
        copy.whole = True
        copy.host = None  # the host copy is HiCache's to evict from now on
        self._release_protection(rec)
        return True

    def _unpin(self, copy: StorageCopy, session_id: str) -> None:
        """SharedTier.tla's ``PinsReleased``: the pins a store's puts took, released when the store
        is not acknowledged whole (short, the session released or restored from host meanwhile),
        from the host copy they were put from (still protected). A page another of this server's
        copies holds too (a shared prefix) keeps its pin; mutant ``ShortKeepsPin`` leaves them to
        their deadline. A whole copy's pins are :meth:`_release_pins`'."""
        tier = self.shared_tier()
        if tier is None or not copy.pinned or copy.host is None:
            return
        held = {k for sid, c in self._l3.items() if sid != session_id for k in c.keys}
        keys = [k for k in copy.pinned if k not in held]
        if keys:
            tier.unpin_pages(copy.keys, copy.host, set(keys))
        copy.pinned = []

    def _held_elsewhere(self, session_id: str) -> set[str]:
        """Page keys another of this server's sessions relies on the pin of (a shared prefix)."""
        out = {k for sid, c in self._l3.items() if sid != session_id for k in c.keys}
        out.update(k for sid, ks in self._held.items() if sid != session_id for k in ks)
        return out

    def _release_pins(self, rec: SessionRecord, keys: Sequence[str]) -> None:
        """``PinsReleased`` / ``PinLapse`` once toolkv no longer relies on a whole copy (read back,
        its host copy restored, the session closed or expired, a new epoch stored): the soft pins
        of ``keys`` (root first) end by an upsert with ``SoftPinAction.DISABLE`` from the host
        copy, for the leading pages the host tree holds (the bytes the upsert writes). A page
        another of this server's sessions relies on keeps its pin; a page the host no longer
        holds keeps it to its deadline (counted: ``pins_left``)."""
        tier = self.shared_tier()
        if tier is None or not keys:
            return
        held = self._held_elsewhere(rec.session_id)
        host = self._host_slots(rec, len(keys))
        page = self.tree.page_size
        n = int(host.numel()) // page
        which = {k for k in keys[:n] if k not in held}
        if which:
            tier.unpin_pages(list(keys[:n]), host[: n * page], which)
        self.pins_left += max(0, len(keys) - n)

    def _host_slots(self, rec: SessionRecord, pages: int) -> torch.Tensor:
        """The host slots of the leading pages of the session's path the host tree holds (at most
        ``pages``)."""
        node, _ = self._lookup(rec.tokens[: pages * self.tree.page_size], rec.extra_key)
        node = self._host_anchor(node)
        if is_root(self.tree, node):
            return torch.empty(0, dtype=torch.int64)
        vals = []
        for m in path_to(self.tree, node):
            if m.host_value is None:
                break
            vals.append(m.host_value)
        if not vals:
            return torch.empty(0, dtype=torch.int64)
        return torch.cat(vals)[: pages * self.tree.page_size]

    def hold_pins_for_read(self, rec: SessionRecord) -> None:
        """SharedTier.tla's ``ArrivalRead``: the tool_end of a session stored whole lets its record
        go, and sglang reads the copy at the next request's arrival: its pins stay until the
        session's next store, close or TTL (the read has been made by then)."""
        self._reading.add(rec.session_id)

    def _manifest_in_tier(self, rec: SessionRecord, copy: StorageCopy) -> bool:
        """SharedTier.tla's ``StoreAck`` on Mooncake, before the host protection goes: every page's
        put took the soft pin, and the session's manifest goes beside them, pinned alike (what a
        server that never saw the session adopts it by). The master honours nothing else (mutant
        ``NoSoftPin`` trusts it with toolkv's record). True on ``file``."""
        tier = self.shared_tier()
        if tier is None:
            return True
        if len(copy.pinned) != len(copy.keys):
            return False
        manifest = Manifest(
            rec.session_id, rec.epoch, array("q", rec.tokens[: copy.tokens]), rec.extra_key,
            tier.pin_deadline_ms(),
        )  # fmt: skip
        return tier.put_manifest(manifest)

    def _forget_manifest(self, session_id: str) -> None:
        """SharedTier.tla's ``ArrivalRead`` on Mooncake: the session's manifest goes once its own
        server takes it back from the tier (tool_end, a read back, close, TTL) or stores it anew,
        so that only the copy of the session's current epoch can ever be adopted (mutant
        ``ManifestKept``). Nothing on ``file``."""
        tier = self.shared_tier()
        if tier is not None:
            tier.drop_manifest(session_id)

    def _store_whole(self, copy: StorageCopy) -> bool:
        """Every page of the copy is in storage (the check ``TrustShortAck`` leaves out)."""
        return self._stored_pages(copy.keys) == len(copy.keys)

    def storage_prefetch(self, rec: SessionRecord, rid: str) -> Literal["host", "prefetching", "refused"]:
        """Spec ``ToolEnd`` of a stored session. ``"host"`` (``ToolEndFromHost``): HiCache has not
        evicted the host copy yet; it is protected again and the storage copy let go, restore
        from it. ``"prefetching"`` (``StoragePrefetch``): ``prefetch_from_storage`` under request
        id ``rid`` reads the missing pages into host slots sglang allocates; the storage copy
        stays protected and is pinned by the prefetch until :meth:`prefetch_ack`. ``"refused"``:
        sglang did not start a prefetch (below its threshold, or its prefetch budget is spent);
        nothing changed, retry or let the TTL end it."""
        copy = self._l3.get(rec.session_id)
        assert copy is not None and copy.rid is None, "a session with a storage copy, no prefetch yet"
        tokens = rec.tokens[: copy.tokens]
        node, matched = self._lookup(tokens, rec.extra_key)
        host_node = self._read_from(copy, node, matched)
        if host_node is FROM_HOST:
            self._protect_host_path(rec, node)
            del self._l3[rec.session_id]
            self._forget_manifest(rec.session_id)
            self._release_pins(rec, copy.keys)
            return "host"
        if not self._start_prefetch(rid, host_node, tokens, rec.extra_key):
            return "refused"
        copy.rid = rid
        return "prefetching"

    def _lookup(self, tokens: Sequence[int], extra_key: str | None) -> tuple[TreeNode, int]:
        """The deepest node of the tree whose path is a prefix of ``tokens``, whatever its tier,
        and the tokens its path covers."""
        return walk(self.tree, tokens, extra_key)

    def _host_depth(self, host_node: TreeNode) -> int:
        """Tokens on the path of ``host_node`` (0 for the root)."""
        return 0 if is_root(self.tree, host_node) else _ntok(path_to(self.tree, host_node))

    def _start_prefetch(
        self, rid: str, host_node: TreeNode, tokens: Sequence[int], extra_key: str | None
    ) -> bool:
        """sglang's ``prefetch_from_storage`` of ``tokens`` below ``host_node`` under request id
        ``rid``. True: it started (sglang's ``ongoing_prefetch`` has it: lockstep state, the same
        on every rank); False: refused (below the threshold, its budget spent)."""
        tree = self.tree
        rest = array("q", tokens[self._host_depth(host_node) :])
        tree.prefetch_from_storage(rid, host_node, rest, host_node.get_last_hash_value())
        return rid in tree.ongoing_prefetch

    def _read_from(self, copy: StorageCopy, node: TreeNode, matched: int) -> TreeNode:
        """Where a restore of a session with a storage copy reads from: :data:`FROM_HOST` while its
        host copy is whole (spec ``ToolEndFromHost``: protected again, the storage copy let go); else the
        deepest node of the path with a host copy, below which a prefetch reads the storage copy,
        and only a copy whose write was acknowledged whole (``RestoreSourceWhole``; mutant
        ``RestoreBeforeStoreAck`` reads one still being written)."""
        if self.agree.all_true(matched >= copy.tokens):
            return FROM_HOST
        assert copy.whole, "a prefetch reads only a storage copy whose write was acknowledged whole"
        return self._host_anchor(node)

    def _host_anchor(self, node: TreeNode) -> TreeNode:
        """The deepest node of ``node``'s path with a host copy (the root if none)."""
        tree = self.tree
        while not is_root(tree, node) and not self._host_backed(node):
            node = node.parent
        return node

    def prefetch_ack(self, rec: SessionRecord) -> bool | None:
        """Spec ``PrefetchAck``: None until sglang's ``check_prefetch_progress`` says the prefetch is
        done (under the ``wait_complete`` policy: every page its hit query found was read). Then
        the pin and the storage protection end. Whole (the host tree holds the session's whole
        path again): the host copy is protected, ``rec.node`` is its leaf, and ``restore`` loads
        it to the GPU; True. Short (a page was missing when read) or the session was released
        meanwhile: False, the pages read stay in the host tree unprotected and the session's next
        turn recomputes the rest."""
        copy = self._l3.get(rec.session_id)
        assert copy is not None and copy.rid is not None, "prefetch_ack follows storage_prefetch"
        if not self._prefetch_done(copy):
            return None
        del self._l3[rec.session_id]
        self._forget_manifest(rec.session_id)
        self._release_pins(rec, copy.keys)  # what was read is on host
        if copy.released:
            return False
        node, matched = self._lookup(rec.tokens[: copy.tokens], rec.extra_key)
        if not self._read_whole(copy, matched):
            return False
        self._protect_host_path(rec, node)
        return True

    def _read_whole(self, copy: StorageCopy, matched: int) -> bool:
        """The host tree holds the session's whole copy again (agreed across ranks). Read off the
        tree, never the read's own count: on 0.5.23 the pages enter the host tree before this ack,
        unprotected, and the host eviction may have taken one (``spec/storage/UnifiedRead.tla``;
        mutant ``TrustWholeRead`` trusts a whole, pinned copy to have been read whole)."""
        return self.agree.all_true(matched >= copy.tokens)

    def poll_storage(self) -> int:
        """Finish the prefetches of sessions released while they read (their pins held the storage
        copies until now); call once per scheduler tick on every rank. Returns how many ended."""
        ended = 0
        for sid, copy in list(self._l3.items()):
            if copy.released and copy.rid is not None and self._prefetch_done(copy):
                del self._l3[sid]
                self._unpin_released(sid, copy)
                ended += 1
        return ended

    def _unpin_released(self, session_id: str, copy: StorageCopy) -> None:
        """The pins of a released session's copy, once the prefetch that read it is done: the
        record is gone, so only what this server's other sessions hold keeps a pin; the host slots
        are looked up by the copy's keys (none: the pins keep to their deadline)."""
        tier = self.shared_tier()
        if tier is None:
            return
        held = self._held_elsewhere(session_id)
        self.pins_left += sum(1 for k in copy.keys if k not in held)

    def _prefetch_done(self, copy: StorageCopy) -> bool:
        """sglang's ``check_prefetch_progress`` for the copy's prefetch: True once its pages are in
        the host tree and its host slots and last-host-node protection are returned."""
        assert copy.rid is not None
        if not self._prefetch_finished(copy.rid):
            return False
        copy.rid = None
        return True

    def _prefetch_finished(self, rid: str) -> bool:
        """sglang's ``check_prefetch_progress`` (collectives: every rank, the same step), then its
        per-request count of tokens read (``pop_prefetch_loaded_tokens``) let go."""
        if not self.tree.check_prefetch_progress(rid):
            return False
        self.tree.pop_prefetch_loaded_tokens(rid)
        return True

    def _protect_host_path(self, rec: SessionRecord, leaf: TreeNode) -> None:
        """Protect the host copy of ``leaf``'s path for the session again (as ``offload`` does)."""
        rec.node = leaf
        self._take_host_protection(rec, leaf)
        rec.protected = leaf
        self._ledger.take(rec.session_id, path_to(self.tree, leaf))

    def let_go_storage(self, rec: SessionRecord) -> bool:
        """SharedTier.tla's ``LetGo``: a server that is drained forgets a session whose copy the
        shared tier holds whole (acknowledged, its pages and manifest pinned, no read of it in
        flight); the record goes, the tier's copy and manifest stay for the server that adopts it.
        False, changing nothing, for any other copy (mutant ``LetGoEarly`` lets a store in flight
        go: no manifest names it, nobody can adopt it)."""
        copy = self._l3.get(rec.session_id)
        if copy is None or not copy.whole or copy.rid is not None or self.shared_tier() is None:
            return False
        del self._l3[rec.session_id]
        return True

    def drop_storage(self, rec: SessionRecord) -> None:
        """The session is restored from its host copy while a store was in flight or done (spec
        ``ToolEndFromHost``: the storage protection is dropped; the host protection stays)."""
        self._release_storage(rec)

    def protect_host_prefix(self, rec: SessionRecord) -> int:
        """After a short ``prefetch_ack``: protect the part of the session's path that is on host
        (the pages read before the missing one), so that it can be restored like a whole copy;
        ``rec.node`` becomes its last node. Returns its tokens (0: nothing came back, nothing
        protected). The rest is left to the next request to recompute."""
        node, _ = self._lookup(rec.tokens, rec.extra_key)
        node = self._host_anchor(node)
        tokens = self._host_depth(node)
        if not self.agree.all_true(tokens > 0):
            return 0
        self._protect_host_path(rec, node)
        return tokens

    def _release_storage(self, rec: SessionRecord) -> None:
        """Close or the TTL: the session's storage protection ends. A prefetch reading the copy
        keeps its pin until its own ack (``poll_storage``): dropping it now is mutant
        ``ReleaseDropsPin``, and the backend could delete a page the prefetch has still to read."""
        held = self._held
        reading = rec.session_id in self._reading
        self._reading.discard(rec.session_id)
        if not reading:  # an earlier copy's pins, kept for sglang's read at arrival: read by now
            self._release_pins(rec, held.pop(rec.session_id, []))
        copy = self._l3.get(rec.session_id)
        if copy is None:
            return
        if copy.whole:
            self._forget_manifest(rec.session_id)
            if reading:
                held[rec.session_id] = copy.keys
            elif copy.rid is None:
                self._release_pins(rec, copy.keys)
        else:
            self._unpin(copy, rec.session_id)
        if copy.rid is not None:
            copy.released = True
        else:
            del self._l3[rec.session_id]
