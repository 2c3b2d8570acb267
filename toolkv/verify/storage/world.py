"""The L3 storage tier as ``spec/storage/StorageTier.tla`` sees it, on real parts: one method per
spec action, and the refinement mapping from the real objects to the spec's state.

The stack is :class:`~toolkv.testing.storage_harness.StorageCacheHarness` (a real HiRadixCache
whose controller runs sglang's ``HiCacheFile`` backend on a directory and its real storage
threads), :class:`~toolkv.testing.storage_gate.StorageGate` (the threads wait at each page until
the step lets one through) and ``ToolKVManager`` over ``HiRadixBackend`` (or one of the storage
mutants of ``toolkv.verify.toolkv.mutants``). Each session owns one path of ``P`` pages; tokens
differ between sessions, so their pages (sglang's chained page hashes) do too.

| spec action | what runs |
|---|---|
| ``ToolStart(s)`` | the clock moves on one second (distinct deadlines), ``manager.tool_start`` |
| ``HostAck(s)`` | the copy engine finishes s's GPU→host write (refused if an older one is pending: sglang retires acks in issue order); one scheduler iteration (``check_hicache_events``, then the manager's ``tick``) |
| ``Store(s)`` | ``manager.store`` (``HiRadixBackend.store`` → sglang ``write_backup_storage``) |
| ``StorePage(s)`` / ``StoreRefused(s)`` | the backup thread's next ``HiCacheFile.set`` is let through / answers ``False`` (storage full) |
| ``StoreAck(s)`` | the backup thread acknowledged the operation; one scheduler iteration (``drain_storage_control_queues``, the tick's ``store_ack``) |
| ``ToolEndFromHost(s)`` / ``StoragePrefetch(s)`` / ``ToolEndAtArrival(s)`` | ``manager.tool_end`` (the implementation chooses; the manager is built with ``l3_read_at_arrival`` = ``ReadAtArrival``); for a prefetch, sglang's hit query and one scheduler iteration (the host slots are allocated) |
| ``ReadPage(s)`` | the I/O thread's next ``HiCacheFile.get`` is let through (a missing file ends the read) |
| ``PrefetchAck(s)`` | sglang's prefetch is complete; one scheduler iteration (``check_prefetch_progress`` in ``prefetch_ack`` or ``poll_storage``, the restore it starts) |
| ``LoadAck(s)`` | the copy engine finishes s's host→GPU load; one scheduler iteration |
| ``Expire(s)`` | the clock moves to s's deadline, ``manager.ttl_sweep`` |
| ``Close(s)`` | ``manager.close`` |
| ``L3Evict(s, p)`` | the page's file is deleted, as the backend's evictor would |
| ``HostEvict(s)`` | sglang's ``evict_host`` with s's host copy the least recently used |

The refinement mapping (:meth:`StorageWorld.abstract`), per session:

| spec | implementation |
|---|---|
| ``phase`` | ``kv_meta``: ``state`` (``Restoring`` → ``Loading``, ``Handover`` → ``Runnable``), and for ``Offloaded`` its ``l3`` (``storing`` → ``Storing``, ``stored`` → ``Stored``, ``fetching`` → ``Prefetching``) |
| ``gpu`` | every token of the path on the device and no load into it in flight |
| ``hostN`` | pages of the path's leading nodes that have a host copy in the tree |
| ``hprot`` | ``kv_meta`` ``protected`` (toolkv's ``protect_host``) |
| ``gw`` / ``ld`` | a GPU→host write on the path not acknowledged (``write_through_pending_id``) / a load into it in ``ongoing_load_back`` |
| ``wr`` | a write-to-storage operation toolkv issued for the path whose ack sglang has not drained |
| ``wn``, ``wfail`` / ``rn``, ``rfail`` | what the gate saw of s's last write / read: pages let through, a page refused / pages read, a page missing |
| ``l3`` | the path's pages whose file ``HiCacheFile.exists`` |
| ``l3prot`` / ``pin`` | toolkv's storage record of s exists and was not released / names a prefetch (``StorageCopy.rid``) |
| ``pf`` | sglang's ``ongoing_prefetch`` holds a prefetch of s |
| ``hostFree`` | free pages of the host pool (the pool beyond ``HostSlots`` pages is held by the world) |
| ``viaL3`` (history) | a whole read of s was acknowledged into ``Loading`` |

:meth:`check_real` checks what the mapping cannot see: every readable GPU copy, acknowledged host
copy and stored page holds exactly the bytes computed for its tokens (freed device slots scribbled
first), and sglang's ``host_ref_counter`` on every node is what toolkv, sglang's writes to storage
and its prefetches hold. :meth:`restart` closes everything, lets every thread finish, drains the
stack and requires every lock, host reference and slot back at its initial value.
"""

from __future__ import annotations

import contextlib
import shutil
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from toolkv.core.backends.hiradix import HiRadixBackend
from toolkv.core.manager import ManagerConfig, ToolKVManager
from toolkv.core.policy import PolicyConfig
from toolkv.core.treeops import TreeNode, path_to, walk
from toolkv.errors import ToolKVError
from toolkv.testing.harness import HarnessConfig
from toolkv.testing.storage_gate import GateTimeout, StorageGate
from toolkv.testing.storage_harness import StorageCacheHarness
from toolkv.verify.storage.spec import SESSION_VARS, WAITING, Act, State, StorageBounds
from toolkv.verify.toolkv.mutants import STORAGE_MUTANTS

PAGE_SIZE = 8  # tokens per page: a session's path is >= 2 pages, above sglang's load_back_threshold (10)
TTL_S = 100.0
_WAIT_S = 20.0
_SETTLE_S = 5.0  # the storage threads finish in milliseconds once the gate is open
_PHASES = {"Restoring": "Loading", "Handover": "Runnable"}
_L3_PHASES = {"storing": "Storing", "stored": "Stored", "fetching": "Prefetching"}


class Unrealizable(Exception):
    """The spec step cannot happen in sglang now (e.g. acks out of issue order, a host copy that
    still has its device copy)."""


class WorldFailure(AssertionError):
    """A check on the real objects failed, or the implementation did not take a step the spec
    says it must be able to take (the message says which)."""


@dataclass
class StepResult:
    """What one action did: the spec action and the typed error a refused call answered with."""

    act: Act
    error: str | None = None


@dataclass
class _Io:
    """The gate's view of one session's last write to storage and last read from it."""

    wn: int = 0
    wfail: bool = False
    rn: int = 0
    rfail: bool = False
    via_l3: bool = False
    ops: set[int] = field(default_factory=set)  # toolkv's write operations on the path


def _until(done: Callable[[], bool], what: str, timeout_s: float = _WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            raise WorldFailure(f"sglang's storage threads never {what}")
        time.sleep(0.0005)


def _readers(controller: Any) -> list[threading.Thread]:
    """The live prefetch I/O threads of ``controller``. sglang 0.5.16's ``HiCacheController.reset()``
    (HiRadixCache's constructor calls it) stops and joins the prefetch and backup threads but not
    the prefetch I/O thread, and clears the stop event as soon as the prefetch thread has joined:
    an I/O thread whose one-second wait for work ends after that keeps running next to the one
    the restarted prefetch thread starts, and both take prefetches from the same queue (on a
    loaded machine, now and then)."""

    def reader(t: threading.Thread) -> bool:
        target = getattr(t, "_target", None)  # the bound method the thread runs
        return getattr(target, "__self__", None) is controller and getattr(target, "__name__", "") == (
            "prefetch_io_aux_func"
        )

    return [t for t in threading.enumerate() if t.is_alive() and reader(t)]


def _one_reader(build: Callable[[], StorageCacheHarness], attempts: int = 5) -> StorageCacheHarness:
    """A stack with exactly one prefetch I/O thread (see :func:`_readers`), because the steps here
    read storage one page at a time, in the order one thread reads it. Right after the build the
    restarted prefetch thread may not have started its I/O thread yet, and the old one may be on
    its way out: wait (briefly) for one reader, the controller's own; two that stay mean sglang
    left the old one running, and the stack is built again."""
    for _ in range(attempts):
        h = build()
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            readers = _readers(h.controller)
            if len(readers) == 1 and readers[0] is getattr(h.controller, "prefetch_io_aux_thread", None):
                return h
            time.sleep(0.005)
        h.close()
    raise WorldFailure(f"sglang left a second prefetch I/O thread running {attempts} times in a row")


class StorageWorld:
    """One real stack driven by StorageTier actions. ``mutant``: a key of
    ``toolkv.verify.toolkv.mutants.STORAGE_MUTANTS`` (None: the production manager and backend)."""

    def __init__(
        self,
        bounds: StorageBounds,
        storage_dir: Path,
        *,
        mutant: str | None = None,
        page_size: int = PAGE_SIZE,
        seed: int = 0,
    ) -> None:
        self.b = bounds
        self.ps = page_size
        self.mutant = mutant
        self.storage_dir = Path(storage_dir)
        device = 4 * len(bounds.sessions) * bounds.pages * page_size + 8 * page_size
        cfg = HarnessConfig(
            device_tokens=device, host_ratio=2.0, page_size=page_size, write_policy="write_through_selective"
        )
        self.h = _one_reader(lambda: StorageCacheHarness(cfg, self.storage_dir, seed=seed))
        try:
            self.gate = StorageGate(self.h.backend, self.h.controller)
            pool = self.h.host_pool
            spare = int(pool.available_size()) - (bounds.host_slots + 1) * page_size
            assert spare >= 0, "the host pool is smaller than the model's"
            # the host pool beyond HostSlots pages (and one scratch page) is held by the world
            self._ballast = pool.alloc(spare) if spare else None
            self._scratch = pool.alloc(page_size)
            self.initial = self.h.accounting()
            self.tokens = {
                s: [100_000 * (i + 1) + k + 1 for k in range(bounds.pages * page_size)]
                for i, s in enumerate(bounds.sessions)
            }
            self.keys = {
                s: list(self.h.controller.get_hash_str(t, None, page_size=page_size))
                for s, t in self.tokens.items()
            }
            self.start()
        except BaseException:
            self.h.close()
            raise

    # ---- lifecycle -----------------------------------------------------------------------------------
    def start(self) -> None:
        """The spec's ``Init``: every session has finished a turn; its KV is on the GPU only."""
        mcls, bcls = STORAGE_MUTANTS[self.mutant] if self.mutant else (ToolKVManager, HiRadixBackend)
        self.be: HiRadixBackend = bcls(self.h.tree)
        # Store is the spec's explicit step here (ToolKVManager.store): no store by predicted return
        # (StorageCapacity.tla models that one; a call run long would otherwise be stored unasked)
        cfg = ManagerConfig(
            ttl_s=TTL_S,
            handover_ttl_s=TTL_S,
            idle_ttl_s=float("inf"),
            policy_config=PolicyConfig(l3_store_margin_s=1e9),
            l3_read_at_arrival=self.b.read_at_arrival,
            # the storage spec's tool_end restores (no Park) and frees on the write's ack (no LazyFree)
            adaptive=False,
            lazy_free=False,
            unmirror=False,  # the storage spec has no HostUnmirror (spec/ToolKV.tla's MC_unmirror checks it)
        )
        self.mgr: ToolKVManager = mcls(self.h.tree, self.be, config=cfg)
        self.epoch: dict[str, int] = {s: 0 for s in self.b.sessions}
        self.io: dict[str, _Io] = {s: _Io() for s in self.b.sessions}
        self.kv_checked = 0
        for s, toks in self.tokens.items():
            self.mgr.admit(s)
            if not self.h.run_request(toks):
                raise WorldFailure("no device memory for a session's turn")
            self.h.fill_kv(self.h.match(toks).device_indices, toks)
            self.mgr.insert(s, toks)
        self.gate.close_gate()
        self.live = True
        self.used = False  # no action taken since Init

    def restart(self) -> None:
        """Back to ``Init`` on the same stack: :meth:`settle`, then a fresh manager and turns."""
        self.settle()
        self.start()

    def settle(self, *, force: bool = False) -> None:
        """Close every session, let every copy and storage thread finish, drain the stack and the
        storage directory. Raises :class:`WorldFailure` unless every lock, host reference and slot
        is back at its initial value and toolkv holds no storage record. ``force``: a prefetch
        nobody acknowledges is finished the way the scheduler would (after a failure, to reuse
        the stack); the accounting is still checked."""
        self.live = False
        self.gate.open()
        for s in self.b.sessions:
            with contextlib.suppress(ToolKVError):
                self.mgr.close(s)
        self._quiesce(force)
        self.h.drain()
        self._quiesce(force)
        leak = self.be.storage_copies
        got = self.h.accounting()
        for f in self.storage_dir.iterdir():
            f.unlink()
        self.gate.toolkv_ops.clear()
        self.gate.acked_ops.clear()
        self.gate.published.clear()
        if leak or got != self.initial:
            raise WorldFailure(
                f"not everything returned: storage records {sorted(leak)}, {got} != {self.initial}"
            )

    def _quiesce(self, force: bool = False) -> None:
        """Scheduler iterations, every copy finished, until nothing is in flight: no GPU/host copy,
        no write to or read from storage, nothing queued for or by sglang's storage threads. A
        prefetch that sglang has finished but no storage record of toolkv's names any more will
        never be acknowledged (mutant ``ReleaseDropsPin``): that is reported at once."""
        tree = self.h.tree
        deadline = time.monotonic() + _SETTLE_S
        while True:
            self.h.synchronize()
            self.iteration()
            busy = tree.ongoing_write_through or tree.ongoing_load_back or tree.ongoing_prefetch
            if not (busy or tree.ongoing_backup or self._queued_storage_work()) and self.gate.idle_reads():
                self.h.check_events()  # the slots the I/O thread returned last
                return
            pinned = {c.rid for c in self.be.storage_copies.values()}
            orphans = [
                rid for rid, (_n, _k, op) in tree.ongoing_prefetch.items()
                if rid not in pinned and op.host_indices is not None and tree.can_terminate_prefetch(op)
            ]  # fmt: skip
            if orphans and not force:
                raise WorldFailure(f"prefetches done but acknowledged by nobody: {orphans}")
            for rid in orphans:
                tree.check_prefetch_progress(rid)
                tree.pop_prefetch_loaded_tokens(rid)
            if time.monotonic() > deadline:
                raise WorldFailure(
                    f"storage work never finished: prefetches {list(tree.ongoing_prefetch)}, "
                    f"backups {list(tree.ongoing_backup)}"
                )
            time.sleep(0.0005)

    def _finish_leftovers(self) -> None:
        tree = self.h.tree
        deadline = time.monotonic() + _WAIT_S
        while tree.ongoing_prefetch and time.monotonic() < deadline:
            self.h.check_events()
            for rid in list(tree.ongoing_prefetch):
                if tree.check_prefetch_progress(rid):
                    tree.pop_prefetch_loaded_tokens(rid)
            time.sleep(0.001)
        time.sleep(0.01)  # the I/O thread returns the slots of pages it did not read
        self.h.check_events()

    def _queued_storage_work(self) -> bool:
        c = self.h.controller
        return any(
            q.qsize()
            for q in (c.backup_queue, c.ack_backup_queue, c.prefetch_queue, c.prefetch_hit_queue,
                      c.prefetch_revoke_queue, c.host_mem_release_queue)
        ) or bool(getattr(c, "prefetch_buffer", None) and c.prefetch_buffer.qsize())  # fmt: skip

    def close(self) -> None:
        """Stop sglang's storage threads and free the stack (no checks: see :meth:`settle`). A
        prefetch nobody finishes (mutant ``ReleaseDropsPin``) is finished here the way the
        scheduler would, so that sglang's detach does not free its host slots a second time."""
        try:
            self.gate.uninstall()
            self._finish_leftovers()
        finally:
            self.h.close()
            shutil.rmtree(self.storage_dir, ignore_errors=True)

    def __enter__(self) -> StorageWorld:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def iteration(self) -> None:
        """One scheduler iteration: sglang's ``check_hicache_events``, then toolkv's tick."""
        self.h.check_events()
        self.mgr.tick(self.mgr.now)

    # ---- the actions -----------------------------------------------------------------------------------
    def apply(self, act: Act) -> StepResult:
        """Run spec action ``act``; a manager call the implementation refuses returns its error code."""
        name = str(act[0])
        fn: Callable[..., None] = getattr(self, _METHODS[name])
        self.used = True
        try:
            fn(*act[1:])
        except ToolKVError as exc:
            return StepResult(tuple(act), exc.code)
        except GateTimeout as exc:  # a thread did not arrive or moved on: a failure of the step
            raise WorldFailure(f"{list(act)}: {exc} ({self.gate.describe()})") from exc
        return StepResult(tuple(act))

    def tool_start(self, s: str) -> None:
        """The clock moves on first, so that every session gets its own deadline, but never as far
        as a deadline already armed (only ``Expire`` lets a deadline pass)."""
        now = self.mgr.now
        deadlines = [self.mgr.kv_meta(x).get("deadline") for x in self.b.sessions]
        ahead = [float(d) - now for d in deadlines if isinstance(d, (int, float)) and d > now]
        self.mgr.set_clock(now + min([1.0, *(d / 2 for d in ahead)]))
        self.epoch[s] = int(self.mgr.tool_start(s)["epoch"])  # type: ignore[call-overload]

    def host_ack(self, s: str) -> None:
        self._finish_oldest(s, self.h.controller.ack_write_queue, "GPU->host write", "write")
        self.iteration()
        self._drain_sglang_writes()

    def _finish_oldest(self, s: str, queue: Any, what: str, kind: str) -> None:
        """Complete the oldest unfinished transfer of ``queue`` — which must be one of ``s``'s:
        sglang retires acks in issue order, so an older one of another session comes first."""
        mine = {n.id for n in self._path(s)}
        pending = [a for a in queue if not a.finish_event.query()]
        idx = [i for i, a in enumerate(pending) if mine & set(a.node_ids)]
        if not idx:
            raise WorldFailure(f"no {what} of {s} is in flight")
        if idx[0] != 0:
            raise Unrealizable(
                f"an older {kind} is not acknowledged yet (sglang retires acks in issue order)"
            )
        pending[0].finish_event.synchronize()

    def _drain_sglang_writes(self) -> None:
        """sglang writes the acknowledged host copy to storage on its own (the gate refuses it at
        once); wait for that write's ack and drain it, so that its protection of the host copy
        does not outlive the step. One that waits behind a write of toolkv's (one backup thread,
        in issue order) stays: the steps it blocks are unrealizable until then."""
        tree, toolkv = self.h.tree, self.gate.toolkv_ops
        q = self.h.controller.ack_backup_queue
        acked = {int(op.id) for op in list(q.queue)}
        ahead = [k for k in tree.ongoing_backup if k in toolkv and k not in acked]
        own = [k for k in tree.ongoing_backup if k not in toolkv and (not ahead or k < min(ahead))]
        if not own:
            return
        _until(lambda: set(own) <= {int(op.id) for op in list(q.queue)}, "acknowledged its own write")
        self.iteration()

    def sglang_writing(self, s: str) -> bool:
        """sglang's own write of s's host copy to storage is still queued (behind one of toolkv's
        writes: one backup thread, in order)."""
        mine = {id(n) for n in self._path(s)}
        return any(
            id(n) in mine for k, n in self.h.tree.ongoing_backup.items() if k not in self.gate.toolkv_ops
        )

    def store(self, s: str) -> None:
        if self.sglang_writing(s):
            raise Unrealizable(
                "sglang's own write of the host copy is still queued (one backup thread, in order)"
            )
        before = set(self.h.tree.ongoing_backup)
        self.gate.tag_next_as_toolkv(True)
        try:
            self.mgr.store(s)
        finally:
            self.gate.tag_next_as_toolkv(False)
        new = set(self.h.tree.ongoing_backup) - before
        if new:
            self.io[s] = _Io(ops=new, rn=self.io[s].rn, rfail=self.io[s].rfail, via_l3=self.io[s].via_l3)

    def _write(self, s: str, verdict: str) -> bool:
        where = self.gate.at(("set", "store_ack"))
        io = self.io[s]
        if where is None:
            raise WorldFailure(f"no write of {s} to storage waits for its next page")
        kind, key = where
        if kind == "store_ack":
            raise Unrealizable("the backup thread waits to acknowledge a write first (one thread, in order)")
        if key not in self.keys[s]:
            raise Unrealizable(
                "the backup thread writes another session's operation first (one thread, in order)"
            )
        if self.keys[s].index(key) != io.wn:
            raise WorldFailure(
                f"the backup thread writes page {self.keys[s].index(key) + 1} of {s}, not {io.wn + 1}"
            )
        ok = bool(self.gate.release("set", verdict, key))  # type: ignore[arg-type]
        if ok:
            io.wn += 1
        else:
            io.wfail = True
        return ok

    def store_page(self, s: str) -> None:
        if not self._write(s, "pass"):
            raise WorldFailure(f"HiCacheFile refused page {self.io[s].wn + 1} of {s}")

    def store_refused(self, s: str) -> None:
        self._write(s, "refuse")

    def store_ack(self, s: str) -> None:
        where = self.gate.at(("set", "store_ack"))
        if where is None or where[0] != "store_ack":
            raise WorldFailure(f"the backup thread has no finished write of {s} to acknowledge")
        key = where[1]
        if int(key) not in self.io[s].ops:
            raise Unrealizable(
                "the backup thread acknowledges another session's write first (one thread, in order)"
            )
        self.gate.release("store_ack", "pass")
        self.iteration()
        self._drain_sglang_writes()  # the backup thread is free for the writes queued behind

    def tool_end(self, s: str) -> None:
        before = set(self.h.tree.ongoing_prefetch)
        self.mgr.tool_end(s, self.epoch[s])
        started = [rid for rid in self.h.tree.ongoing_prefetch if rid not in before]
        if not started:
            return
        io = self.io[s]
        io.rn, io.rfail = 0, False
        op = self.h.tree.ongoing_prefetch[started[0]][2]
        c = self.h.controller
        _until(
            lambda: (
                op in list(c.prefetch_hit_queue.queue) or started[0] in list(c.prefetch_revoke_queue.queue)
            ),
            "ran the storage hit query",
        )
        self.iteration()  # the host slots for the pages found

    def read_page(self, s: str) -> None:
        where = self.gate.at(("get", "prefetch_ack"))
        io = self.io[s]
        if where is None:
            raise WorldFailure(f"no read of {s} from storage waits for its next page")
        kind, key = where
        if kind == "prefetch_ack":
            raise Unrealizable(
                "the I/O thread waits to publish another prefetch first (one thread, in order)"
            )
        op = self._prefetch_op(s)
        if key not in self.keys[s] or op is None or self.gate.reading != op.request_id:
            raise Unrealizable("the I/O thread reads another session's prefetch first (one thread, in order)")
        if self.keys[s].index(key) != io.rn:
            raise WorldFailure(
                f"the I/O thread reads page {self.keys[s].index(key) + 1} of {s}, not {io.rn + 1} "
                f"({self.gate.describe()}; prefetches {self._prefetches()})"
            )
        if self.gate.release("get", "pass", key) is not None:
            io.rn += 1
            return
        # a missing page ends the read: sglang's batch_get still asks for the pages after it (and
        # _generic_page_get drops them), so those come back empty, unread
        io.rfail = True
        deadline = time.monotonic() + _WAIT_S
        while self.gate.waiting("prefetch_ack", 0.0) is None:
            if self.gate.waiting("get", 0.005) is not None:
                self.gate.release("get", "refuse")
            if time.monotonic() > deadline:
                raise WorldFailure(f"the read of {s} never ended at its missing page")

    def prefetch_ack(self, s: str) -> None:
        op = self._prefetch_op(s)
        if op is None:
            raise WorldFailure(f"no prefetch of {s} is in flight")
        where = self.gate.at(("get", "prefetch_ack"))
        if where is None:
            raise WorldFailure(f"the I/O thread has not finished reading {s}")
        kind, key = where
        if kind == "get":
            raise WorldFailure(f"the I/O thread still reads pages of {s}'s prefetch")
        if key != op.request_id:
            raise Unrealizable(
                "the I/O thread finishes another session's prefetch first (one thread, in order)"
            )
        done = self.gate.reads_done
        self.gate.release("prefetch_ack", "pass")
        _until(lambda: self.gate.reads_done > done, "finished a prefetch")
        was_prefetching = self._phase(s) == "Prefetching"
        self.iteration()
        self.iteration()  # the host slots the I/O thread returned for the pages it did not read
        if was_prefetching and self._phase(s) == "Loading" and self.io[s].rn == self.b.pages:
            self.io[s].via_l3 = True

    def load_ack(self, s: str) -> None:
        ctrl = self.h.controller
        if ctrl.load_queue:
            self.be.start_loads()
        self._finish_oldest(s, ctrl.ack_load_queue, "host->GPU load", "load")
        self.iteration()

    def expire(self, s: str) -> None:
        """The clock reaches s's deadline (while s waits for its tool: the spec's ``Waiting``), and
        the sweep runs: s expires, with every session whose deadline came earlier."""
        deadline = self.mgr.kv_meta(s).get("deadline")
        if deadline is not None and self._phase(s) in WAITING:
            self.mgr.set_clock(max(self.mgr.now, float(deadline)))  # type: ignore[arg-type]
        self.mgr.ttl_sweep()

    def close_session(self, s: str) -> None:
        self.mgr.close(s)

    def l3_evict(self, s: str, p: int) -> None:
        """The backend deletes a page, honouring toolkv's records as the spec's ``L3Evict`` requires
        (a backend that evicts on its own is refused by ``store``): never a page of a copy toolkv
        protects or a prefetch pins."""
        copy = self.be.storage_copies.get(s)
        if copy is not None and (not copy.released or copy.rid is not None):
            raise Unrealizable("toolkv's record protects or pins this storage copy")
        path = self.storage_dir / f"{self.keys[s][int(p) - 1]}{self.h.backend.config_suffix}.bin"
        if not path.exists():
            raise WorldFailure(f"page {p} of {s} is not in storage")
        path.unlink()

    def host_evict(self, s: str) -> None:
        nodes = [n for n in self._path(s) if n.host_value is not None]
        if not nodes:
            raise WorldFailure(f"{s} has no host copy")
        if any(n.value is not None for n in nodes):
            raise Unrealizable("sglang frees a host copy only once its device copy is gone")
        if any(n.host_ref_counter > 0 for n in nodes):  # else evict_host would take other copies
            raise Unrealizable("sglang holds this host copy (its own write of it to storage is queued)")
        for n in nodes:
            n.last_access_time = -1e18  # the environment picks the victim: the least recently used
        self.h.evict_host(sum(len(n.host_value) for n in nodes))
        if any(n.parent is not None and n.parent.children.get(n.key.child_key(self.ps)) is n for n in nodes):
            raise WorldFailure(f"sglang's evict_host kept {s}'s host copy, which nothing holds")

    # ---- who the copy engine and sglang's threads serve next ----------------------------------------
    def next_acks(self) -> dict[str, str]:
        """Which session each in-order step can serve now: ``HostAck``/``LoadAck`` (the oldest
        unfinished copy: sglang retires acks in issue order), ``StorePage``/``StoreAck`` (where the
        backup thread waits: at a page, or to acknowledge), ``ReadPage``/``PrefetchAck`` (where the
        I/O thread waits). A thread with work of toolkv's queued is waited for (it arrives in
        milliseconds); one without is not."""
        out: dict[str, str] = {}
        ctrl, tree, gate = self.h.controller, self.h.tree, self.gate
        for name, q in (("HostAck", ctrl.ack_write_queue), ("LoadAck", ctrl.ack_load_queue)):
            pending = [a for a in q if not a.finish_event.query()]
            ids = set(pending[0].node_ids) if pending else set()
            if not ids and name == "LoadAck" and ctrl.load_queue:
                ids = set(ctrl.load_queue[0].node_ids)
            for s in self.b.sessions:
                if ids & {n.id for n in self._path(s)}:
                    out[name] = s
        page_of = {k: s for s, keys in self.keys.items() for k in keys}
        if any(k in gate.toolkv_ops and k not in gate.acked_ops for k in tree.ongoing_backup):
            where = gate.at(("set", "store_ack"), 2.0)
            if where is not None and where[0] == "set":
                out["StorePage"] = out["StoreRefused"] = page_of.get(where[1], "")
            elif where is not None:
                out["StoreAck"] = next((s for s in self.b.sessions if int(where[1]) in self.io[s].ops), "")
        reading = [
            rid for rid, (_n, _k, op) in tree.ongoing_prefetch.items()
            if op.host_indices is not None and rid not in gate.published
        ]  # fmt: skip
        if reading:
            where = gate.at(("get", "prefetch_ack"), 2.0)
            if where is not None and where[0] == "get":
                reader = next(
                    (s for s in self.b.sessions if (gate.reading or "").startswith(f"toolkv-l3:{s}:")), ""
                )
                out["ReadPage"] = reader if page_of.get(where[1]) == reader else ""
            elif where is not None:
                out["PrefetchAck"] = next(
                    (s for s in self.b.sessions if where[1].startswith(f"toolkv-l3:{s}:")), ""
                )
        return out

    # ---- reading the real objects --------------------------------------------------------------------
    def _path(self, s: str) -> list[TreeNode]:
        """The tree nodes along s's tokens, root first (those present)."""
        node, matched = walk(self.h.tree, self.tokens[s])
        return path_to(self.h.tree, node) if matched else []

    def _rec_meta(self, s: str) -> dict[str, object]:
        return self.mgr.kv_meta(s)

    def _phase(self, s: str) -> str:
        meta = self._rec_meta(s)
        state = str(meta["state"])
        if state == "Offloaded" and meta.get("l3"):
            return _L3_PHASES[str(meta["l3"])]
        return _PHASES.get(state, state)

    def _prefetches(self) -> list[tuple[str, int, int, bool]]:
        """sglang's prefetches in flight: request id, pages found, tokens read, terminated."""
        return [
            (rid, len(op.hash_value), int(op.completed_tokens), op.is_terminated())
            for rid, (_n, _k, op) in self.h.tree.ongoing_prefetch.items()
        ]

    def _prefetch_op(self, s: str) -> Any:
        for rid, (_node, _key, op) in self.h.tree.ongoing_prefetch.items():
            if rid.startswith(f"toolkv-l3:{s}:"):
                return op
        return None

    def abstract(self) -> State:
        """The spec state the real objects stand for (the refinement mapping of the module doc)."""
        tree, ps = self.h.tree, self.ps
        st: State = {v: {} for v in SESSION_VARS}
        copies = self.be.storage_copies
        storing = {int(k) for k in tree.ongoing_backup}
        for s in self.b.sessions:
            path = self._path(s)
            meta = self._rec_meta(s)
            host = 0
            for n in path:
                if n.host_value is None:
                    break
                host += len(n.host_value)
            dev = sum(len(n.value) for n in path if n.value is not None)
            loading = any(tree.ongoing_load_back.get(n.id) is n for n in path)
            copy = copies.get(s)
            io = self.io[s]
            st["phase"][s] = self._phase(s)
            st["gpu"][s] = dev == len(self.tokens[s]) and not loading
            st["hostN"][s] = host // ps
            st["hprot"][s] = bool(meta["protected"])
            st["gw"][s] = any(n.write_through_pending_id is not None for n in path)
            st["ld"][s] = loading
            st["wr"][s] = bool(io.ops & storing)
            st["wn"][s] = io.wn
            st["wfail"][s] = io.wfail
            st["l3"][s] = [i + 1 for i, k in enumerate(self.keys[s]) if self.h.backend.exists(k)]
            st["l3prot"][s] = copy is not None and not copy.released
            st["pin"][s] = 1 if copy is not None and copy.rid is not None else 0
            st["pf"][s] = self._prefetch_op(s) is not None
            st["rn"][s] = io.rn
            st["rfail"][s] = io.rfail
            st["viaL3"][s] = io.via_l3
        st["hostFree"] = int(self.h.host_pool.available_size()) // ps
        return st

    def check_real(self) -> list[str]:
        """What the mapping cannot see: KV bytes of every copy, and sglang's host references."""
        bad: list[str] = []
        h, tree = self.h, self.h.tree
        h.scribble_unreferenced()
        st = self.abstract()
        for s in self.b.sessions:
            toks = self.tokens[s]
            path = self._path(s)
            if st["gpu"][s]:
                got = h.device_kv(h.match(toks).device_indices)
                self.kv_checked += got.numel() * got.element_size()
                if not torch.equal(got, h.expected_kv(toks)):
                    bad.append(f"KvIntegrity(gpu {s})")
            if not st["gw"][s] and st["hostN"][s]:
                idx = []
                for n in path:
                    if n.host_value is None:
                        break
                    idx.append(n.host_value)
                hv = torch.cat(idx)
                got = h.host_kv(hv)
                self.kv_checked += got.numel() * got.element_size()
                if not torch.equal(got, h.expected_kv(toks[: len(hv)])):
                    bad.append(f"KvIntegrity(host {s})")
            for p in st["l3"][s]:
                if not self._stored_page_right(s, p):
                    bad.append(f"KvIntegrity(storage {s} page {p})")
        want: Counter[int] = Counter()
        for rec_node in (self.mgr.sessions[s].protected for s in self.mgr.sessions):
            if rec_node is not None:
                want[id(rec_node)] += 1
        for node in tree.ongoing_backup.values():
            want[id(node)] += 1
        for last_host_node, _key, _op in tree.ongoing_prefetch.values():
            want[id(last_host_node)] += 1
        for node in h.iter_nodes():
            if node.host_ref_counter != want[id(node)]:
                bad.append("HostRefAccounting")
                break
        return bad

    def _stored_page_right(self, s: str, p: int) -> bool:
        """Read page ``p`` of ``s`` back with the real ``HiCacheFile.get`` (past the gate) into a
        scratch host page and compare it with the KV computed for its tokens."""
        pool = self.h.host_pool
        buf = pool.get_dummy_flat_data_page()
        if self.gate._real_get(self.keys[s][p - 1], buf) is None:
            return True  # deleted meanwhile: l3 is read again next step
        pool.set_from_flat_data_page(int(self._scratch[0]), buf)
        got = self.h.host_kv(self._scratch)
        self.kv_checked += got.numel() * got.element_size()
        toks = self.tokens[s][(p - 1) * self.ps : p * self.ps]
        return torch.equal(got, self.h.expected_kv(toks))


_METHODS = {
    "ToolStart": "tool_start",
    "HostAck": "host_ack",
    "Store": "store",
    "StorePage": "store_page",
    "StoreRefused": "store_refused",
    "StoreAck": "store_ack",
    "ToolEndFromHost": "tool_end",
    "StoragePrefetch": "tool_end",
    "ToolEndAtArrival": "tool_end",
    "ToolEnd": "tool_end",
    "ReadPage": "read_page",
    "PrefetchAck": "prefetch_ack",
    "LoadAck": "load_ack",
    "Expire": "expire",
    "Close": "close_session",
    "L3Evict": "l3_evict",
    "HostEvict": "host_evict",
}

__all__ = ["PAGE_SIZE", "StepResult", "StorageWorld", "Unrealizable", "WorldFailure"]
