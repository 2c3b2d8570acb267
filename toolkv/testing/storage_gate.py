"""Page-by-page control of the storage I/O that sglang's storage threads do through ``HiCacheFile``.

Why: sglang's backup thread writes a whole write-to-storage operation, and its prefetch I/O thread
reads a whole prefetch, on their own time. ``spec/storage/StorageTier.tla`` models them one page
at a time (``StorePage``, ``StoreRefused``, ``ReadPage``), and the states between two pages are
where the hazards live (a page evicted before the last lands, a release while a read is half
done). On a server the threads are merely slow there; here they wait at a gate until the test
lets one page through. This is a timing double only, like ``ControlledTransferEngine`` for the
copy engine: the page still goes through the real ``HiCacheFile.set`` / ``get`` (the file
written, the ``exists()`` skip, the missing file that ends a read), and sglang's threads, queues
and acknowledgements run unchanged.

A page the gate refuses (``refuse``) is what ``HiCacheFile.set`` answers when its evictor finds no
room: ``False``, and sglang's ``_page_backup`` stops the operation there.

The threads also wait before they acknowledge: the backup thread before it puts toolkv's finished
write on ``ack_backup_queue`` (lane ``store_ack``), the I/O thread before it publishes what it read
(its first ``PrefetchOperation.increment`` or ``mark_terminate``: lane ``prefetch_ack``). On a
server a thread can be descheduled there too; here it is what keeps the spec's ``StoreAck`` and
``PrefetchAck`` separate steps: otherwise any scheduler iteration after the last page (a load's
ack, say) would take them along.

sglang also writes every acknowledged host copy to storage on its own (HiRadixCache's
``_finish_write_through_ack`` → ``write_backup_storage``), a write the storage model does not have.
The gate tells those operations from toolkv's (:meth:`tag_next_as_toolkv` around the manager's
store step, read when the operation is queued) and refuses their pages at once, as a full storage
would, so that they neither wait for the test nor put pages in storage the model does not know of.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

Kind = Literal["set", "get", "store_ack", "prefetch_ack"]
Verdict = Literal["pass", "refuse"]
_WAIT_S = 20.0


class GateTimeout(AssertionError):
    """A storage thread did not arrive at, or come back from, the gate in time."""


@dataclass
class _Lane:
    """One direction of storage I/O (one sglang thread uses it)."""

    waiting: str | None = None  # the page key the thread waits with
    verdict: Verdict | None = None
    result: Any = None  # what the real call returned (set: bool; get: tensor or None)
    done: int = 0  # calls finished through the gate


class StorageGate:
    """Wraps one ``HiCacheFile`` instance's ``set``/``get`` and its controller's backup queue.

    ``waiting(kind)`` says which page a thread waits with (None: none yet); ``release(kind,
    verdict)`` lets it through and returns what the real call answered. ``open()`` lets every call
    through from then on (teardown). Only sglang's backup thread calls ``set`` and only its
    prefetch I/O thread calls ``get`` (``batch_set``/``batch_get`` loop over them), so each lane
    has at most one waiter."""

    def __init__(self, backend: Any, controller: Any) -> None:
        self.backend, self.controller = backend, controller
        self._real_set: Callable[..., bool] = backend.set
        self._real_get: Callable[..., Any] = backend.get
        self._real_backup: Callable[[Any], None] = controller._page_backup
        self._real_put: Callable[..., None] = controller.backup_queue.put
        self._real_ack_put: Callable[..., None] = controller.ack_backup_queue.put
        self._real_prefetch: Callable[..., Any] = controller.prefetch
        self._real_release: Callable[[Any], None] = controller.append_host_mem_release
        self._real_transfer: Callable[[Any], None] = controller._page_transfer
        self._scheduler = threading.get_ident()  # the thread that drives the stack
        self._cv = threading.Condition()
        self._lanes: dict[Kind, _Lane] = {k: _Lane() for k in ("set", "get", "store_ack", "prefetch_ack")}
        self._open = False
        self._next_toolkv = False
        self._serving_toolkv = False  # the backup thread's current operation is toolkv's
        self.toolkv_ops: set[int] = set()  # ids of the write-to-storage operations toolkv issued
        self.acked_ops: set[int] = set()  # toolkv's writes the backup thread has acknowledged
        self.published: set[str] = set()  # prefetches (request ids) whose progress is published
        self.reads_queued = 0  # prefetches handed to the I/O thread (their host slots allocated)
        self.reads_done = 0  # prefetches the I/O thread finished (it then returns the unread slots)
        self.reading: str | None = None  # the request id of the prefetch the I/O thread reads
        self.refused_sglang_pages = 0
        backend.set = self._set
        backend.get = self._get
        controller._page_backup = self._page_backup
        controller.backup_queue.put = self._put
        controller.ack_backup_queue.put = self._ack_put
        controller.prefetch = self._prefetch
        controller.append_host_mem_release = self._release_slots
        controller._page_transfer = self._page_transfer
        self._real_buffer_put: Callable[..., None] = controller.prefetch_buffer.put
        controller.prefetch_buffer.put = self._buffer_put

    def uninstall(self) -> None:
        """Put the real methods back (the instance attributes shadowed them)."""
        self.open()
        for obj, name in (
            (self.backend, "set"), (self.backend, "get"), (self.controller, "_page_backup"),
            (self.controller, "prefetch"), (self.controller, "append_host_mem_release"),
            (self.controller, "_page_transfer"),
            (self.controller.backup_queue, "put"), (self.controller.prefetch_buffer, "put"),
            (self.controller.ack_backup_queue, "put"),
        ):  # fmt: skip
            obj.__dict__.pop(name, None)

    # ---- the scheduler thread's side ------------------------------------------------------------------
    def tag_next_as_toolkv(self, on: bool) -> None:
        """Operations queued while ``on`` are toolkv's (its store step); the rest are sglang's own."""
        self._next_toolkv = on

    def open(self) -> None:
        """Let every call through, now and from now on."""
        with self._cv:
            self._open = True
            for lane in self._lanes.values():
                if lane.waiting is not None and lane.verdict is None:
                    lane.verdict = "pass"
            self._cv.notify_all()

    def close_gate(self) -> None:
        """Gate again (after :meth:`open`): the next call waits for :meth:`release`."""
        with self._cv:
            self._open = False

    def waiting(self, kind: Kind, timeout_s: float = _WAIT_S) -> str | None:
        """The key the thread of ``kind`` waits at the gate with, waiting up to ``timeout_s`` for
        it to arrive (0: do not wait)."""
        lane = self._lanes[kind]
        with self._cv:
            self._cv.wait_for(lambda: lane.waiting is not None and lane.verdict is None, timeout=timeout_s)
            return lane.waiting if lane.verdict is None else None

    def describe(self) -> str:
        """Where the threads wait, for a failure message."""
        with self._cv:
            lanes = {k: (lane.waiting, lane.verdict, lane.done) for k, lane in self._lanes.items()}
            return (
                f"lanes {lanes}, reading {self.reading}, reads {self.reads_done}/{self.reads_queued}, "
                f"open {self._open}"
            )

    def at(self, kinds: tuple[Kind, ...], timeout_s: float = _WAIT_S) -> tuple[Kind, str] | None:
        """Where a thread waits among ``kinds`` (one thread's lanes, e.g. ``("set", "store_ack")``
        for the backup thread), waiting up to ``timeout_s`` for it to arrive at one of them."""
        lanes = [(k, self._lanes[k]) for k in kinds]

        def found() -> tuple[Kind, str] | None:
            for k, lane in lanes:
                if lane.waiting is not None and lane.verdict is None:
                    return k, lane.waiting
            return None

        with self._cv:
            self._cv.wait_for(lambda: found() is not None, timeout=timeout_s)
            return found()

    def release(self, kind: Kind, verdict: Verdict, key: str | None = None) -> Any:
        """Let the waiting call of ``kind`` through (``pass``: the real call; ``refuse``: ``set``
        answers False) and wait until it returned; returns its answer. ``key``: the page the
        caller saw waiting (the call let through must be that one)."""
        lane = self._lanes[kind]
        with self._cv:
            if lane.waiting is None or lane.verdict is not None:
                raise GateTimeout(f"no {kind} waits at the gate")
            if key is not None and lane.waiting != key:
                raise GateTimeout(f"the {kind} waiting is {lane.waiting}, not {key}")
            before = lane.done
            lane.verdict = verdict
            self._cv.notify_all()
            if not self._cv.wait_for(lambda: lane.done > before, timeout=_WAIT_S):
                raise GateTimeout(f"the {kind} let through never came back")
            return lane.result

    # ---- sglang's threads' side -------------------------------------------------------------------------
    def _put(self, item: Any, *args: Any, **kwargs: Any) -> None:
        if item is not None and self._next_toolkv:
            self.toolkv_ops.add(int(item.id))
        self._real_put(item, *args, **kwargs)

    def _ack_put(self, item: Any, *args: Any, **kwargs: Any) -> None:
        """The backup thread acknowledges a finished write: toolkv's waits for ``store_ack``."""
        if item is not None and int(item.id) in self.toolkv_ops:
            self._pass("store_ack", str(item.id))
            try:
                self._real_ack_put(item, *args, **kwargs)
            finally:
                self.acked_ops.add(int(item.id))
                self._finish("store_ack", None)
            return
        self._real_ack_put(item, *args, **kwargs)

    def _prefetch(self, *args: Any, **kwargs: Any) -> Any:
        """``HiCacheController.prefetch``: the operation's first publication of its progress by the
        I/O thread waits for ``prefetch_ack`` (the I/O thread reaches it only after the scheduler
        allocated its host slots, so patching the new operation here is in time)."""
        op = self._real_prefetch(*args, **kwargs)
        real_inc, real_term = op.increment, op.mark_terminate
        held = [False]

        def hold() -> None:
            if held[0] or threading.get_ident() == self._scheduler:
                return
            held[0] = True
            self._pass("prefetch_ack", str(op.request_id))
            self.published.add(str(op.request_id))
            self._finish("prefetch_ack", None)

        def increment(num_tokens: int) -> bool:
            hold()
            return bool(real_inc(num_tokens))

        def mark_terminate() -> None:
            hold()
            real_term()

        op.increment, op.mark_terminate = increment, mark_terminate
        return op

    def _buffer_put(self, item: Any, *args: Any, **kwargs: Any) -> None:
        if item is not None:
            with self._cv:
                self.reads_queued += 1
        self._real_buffer_put(item, *args, **kwargs)

    def idle_reads(self) -> bool:
        """The I/O thread has finished every prefetch handed to it (slots returned included)."""
        with self._cv:
            return self.reads_done >= self.reads_queued

    def _page_transfer(self, operation: Any) -> None:
        """The I/O thread reads one prefetch: which one, for the steps that name a session."""
        with self._cv:
            self.reading = str(operation.request_id)
        self._real_transfer(operation)

    def _release_slots(self, host_indices: Any) -> None:
        """``append_host_mem_release``: the I/O thread calls it once at the end of every prefetch
        (with the slots of the pages it did not read, maybe none), which is how the test knows
        the thread is done with one."""
        self._real_release(host_indices)
        if threading.get_ident() != self._scheduler:
            with self._cv:
                self.reads_done += 1
                self._cv.notify_all()

    def _page_backup(self, operation: Any) -> None:
        self._serving_toolkv = int(operation.id) in self.toolkv_ops
        try:
            self._real_backup(operation)
        finally:
            self._serving_toolkv = False

    def _pass(self, kind: Kind, key: str) -> Verdict:
        """Wait for the test's verdict on this page (at once when open)."""
        lane = self._lanes[kind]
        with self._cv:
            if self._open:
                return "pass"
            lane.waiting, lane.verdict = key, None
            self._cv.notify_all()
            deadline = time.monotonic() + 10 * _WAIT_S
            while lane.verdict is None and not self._open:
                self._cv.wait(timeout=max(0.0, deadline - time.monotonic()))
                if time.monotonic() > deadline:  # a stuck test: let the thread go rather than hang
                    lane.verdict = "refuse"
            verdict: Verdict = lane.verdict or "pass"
            lane.waiting = None
            return verdict

    def _finish(self, kind: Kind, result: Any) -> None:
        lane = self._lanes[kind]
        with self._cv:
            lane.result, lane.verdict = result, None
            lane.done += 1
            self._cv.notify_all()

    def _set(self, key: str, value: Any = None, *args: Any, **kwargs: Any) -> bool:
        if not self._serving_toolkv:  # sglang's own write of a host copy: storage full
            self.refused_sglang_pages += 1
            return False
        ok = False
        try:
            if self._pass("set", key) == "pass":
                ok = bool(self._real_set(key, value, *args, **kwargs))
            return ok
        finally:
            self._finish("set", ok)

    def _get(self, key: str, target_location: Any = None, *args: Any, **kwargs: Any) -> Any:
        got: Any = None
        try:
            if self._pass("get", key) == "pass":
                got = self._real_get(key, target_location, *args, **kwargs)
            return got
        finally:
            self._finish("get", got)


__all__ = ["GateTimeout", "StorageGate"]
