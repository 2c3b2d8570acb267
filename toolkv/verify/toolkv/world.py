"""One real cache stack driven by spec actions: ``Replayer.apply(["ToolStart", "s1"])``.

Each spec action has an *executor*: what the scheduler, sglang and the client would do on the real
cache for that step — manager actions through ``ToolKVManager``, environment actions through the
real sglang calls. Executors live in a table per cache kind (:data:`HIRADIX`, :data:`RADIX`), so a
new spec action is one function and one table row. An action without an executor is an error, not
a skipped step.

The environment is the replayer's to choose, as it is TLC's: which node sglang evicts (by making it
the least recently used), when a copy finishes (the controllable copy engine), and how much memory
other requests hold ("ballast" allocations that make a ToolStart find the host full, or a ToolEnd
find no device memory, exactly when the spec's slot counters say so). Spec slots are node-sized;
token capacity is mapped onto them only at those two decisions.

sglang processes acknowledgements in issue order (``writing_check``/``loading_check`` stop at the
first unfinished ack); the spec lets acks arrive in any order. An edge that acknowledges a later
transfer first cannot happen in sglang: the executor raises :class:`Unrealizable`. A plain
``RadixCache`` backend (pin, shadow) shares only part of the spec's world — it has no host tier and
no transfers in flight — and an executor raises :class:`NotApplicable` for a step it cannot share.

The load-slot ring (``Ring > 0``: sglang's ``LayerDoneCounter``, three producer slots; the stack
refuses any other ``Ring``). ``load_back`` only enqueues (spec ``queued``); a start takes a slot
(spec ``ring``). Where the implementation's state space differs from the spec's, and how:

* ``StartLoads`` is toolkv's ``start_loads`` as the manager's ``tick`` calls it. The tick also
  runs the TTL sweep, a spec action of its own; when a protection is due the executor runs the
  tick's other two steps (``start_loads``, then ``load_ack``) without the sweep.
* ``SysStart`` is a prefill batch of another request with a host hit: ``load_back`` of a
  host-only prefix, then sglang's ``ready_to_load_host_cache``, which merges toolkv's queued loads
  into the same start. Those prefixes are not spec nodes (the spec abstracts sglang's own loads to
  their slot): each start inserts a fresh one host-only the way sglang lands an L3 prefetch
  (``_insert_helper_host``), so no write has to finish for it, and drops them again once sglang
  retired their loads. Both starts go through the same sglang call, so the replayer keeps a ledger
  of the loads it started as sglang's (the spec's ``who``); every other start is toolkv's.
* ``Admit`` of a parked session whose request loads its path back is that request's prefill batch:
  ``load_back`` (as ``PrefillAdder``'s ``init_load_back`` does), then sglang's
  ``ready_to_load_host_cache`` in the same step (``get_new_batch_prefill`` calls both), which
  starts the whole queue, toolkv's loads included: a start of sglang's in the ledger, at its
  cadence (two of its own loads in flight: no batch is built, :class:`Unrealizable`).
* ``RingDone`` is the copy engine finishing the oldest started load: its producer events and its
  ack's ``finish_event`` fire together (they are recorded at one position of the load stream).
* ``LoadAck`` is sglang's ``loading_check``, which retires every finished ack at the front of the
  queue in one call, and the manager's hook. sglang's own finished loads go with it (invisible to
  the spec); an edge whose ``loading_check`` would also retire another spec key's load cannot
  happen (:class:`Unrealizable`; with ``merge_acks`` the caller composes the spec's ``LoadAck`` of each).
  sglang's own finished loads are otherwise retired after every ring step (``retire_others``),
  unless that would retire one of toolkv's loads before its spec ``LoadAck``.
* ``TreeReset`` (``ring`` is empty there) does not start queued loads: ``flush_cache``'s
  ``reset()`` clears the load queue, as the spec's ``queued' = {}`` says.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from toolkv.core.backends.base import Backend
from toolkv.core.manager import ManagerConfig
from toolkv.core.treeops import TreeNode, attached, path_to, walk
from toolkv.errors import ToolKVError
from toolkv.testing.harness import CacheHarness, HarnessConfig, rkey
from toolkv.verify.toolkv import spec as specstep
from toolkv.verify.toolkv.mutants import mutant_manager
from toolkv.verify.toolkv.refinement import (
    ROOT,
    Bounds,
    NodeMap,
    abstract_state,
    check_invariants,
    check_step,
)

BACKENDS = ("hiradix", "pin", "shadow")
#: tokens of other requests' prefixes start here, far from the spec nodes' tokens (fresh from 1)
OTHER_TOKENS = 1 << 40
#: device room (in spec-node units) kept for sglang's own loads of other requests' prefixes
OTHER_LOADS = 16


class Unrealizable(Exception):
    """The spec step cannot happen in sglang (e.g. an ack out of issue order)."""


class NotApplicable(Exception):
    """The backend does not share this spec step (a plain RadixCache has no host tier)."""


class PolicyChose(Unrealizable):
    """Policy ``auto``: the production ``tool_start`` took other spec steps than the edge's (the
    spec leaves the choice among ``ToolStart``, ``Keep`` and ``LetGo``, and the demotions for room,
    open). The steps it took were checked: each is enabled in the spec and together they lead to
    the implementation's state. The walk cannot follow the edge from there."""


class UnknownAction(KeyError):
    """A spec action without an executor: add one to the table of its cache kind."""


@dataclass
class StepResult:
    action: tuple[Any, ...]
    error: str | None  # the typed error the manager answered with, if any
    violations: list[str]
    post: dict[str, Any] | None = field(default=None, repr=False)  # abstract state after the step

    @property
    def fits(self) -> bool:
        """The capacity decision the implementation took (for trace validation)."""
        return self.error not in ("host_memory_full", "device_memory_full")


Executor = Callable[["Replayer", list[str], Mapping[str, Any]], None]


class Replayer:
    """One real cache stack plus a manager, driven one spec action at a time.

    ``capacity="spec"`` maps the spec's node-granular slots onto the token pools with ballast
    (conformance replay); ``capacity="real"`` leaves the pools alone: refusals happen when the real
    pools are full, and the step result reports the decision (fuzzing, trace validation).
    ``backend`` is ``hiradix`` (HiRadixCache), or ``pin`` / ``shadow`` (plain RadixCache)."""

    def __init__(
        self,
        bounds: Bounds,
        *,
        backend: str = "hiradix",
        caveats: frozenset[str] = frozenset(),
        env_bugs: frozenset[str] = frozenset(),
        page_size: int = 1,
        seed: int = 0,
        capacity: str = "spec",
        device_tokens: int | None = None,
        host_ratio: float = 1.0,
        device: str = "cpu",
        io_backend: str = "direct",
        ttl: float | None = None,
        keep_ttl: float | None = None,
        kv_shape: tuple[int, int, int] = (2, 2, 4),
        dtype: torch.dtype = torch.float32,
        fill: bool = True,
        hi_backend: Callable[[Any], Backend] | None = None,
        merge_acks: bool = False,
        policy: str = "offload",
    ) -> None:
        """``fill=False`` skips writing each turn's KV bytes (the conformance replay compares states,
        not bytes; the fuzz campaign checks bytes and needs them). ``hi_backend`` builds the
        HiRadixCache backend from the tree instead of the production choice (a seeded defect that
        lives in a backend subclass, e.g. ``toolkv.verify.toolkv.mutants.RingTwoFreeBackend``). ``merge_acks``
        (``Ring > 0``): a ``LoadAck`` may retire other spec keys' finished loads in the same
        ``loading_check``, and the caller composes the spec's ``LoadAck`` of each (the fuzz
        campaign does); without it such an edge is :class:`Unrealizable`."""
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        self.b = bounds
        self.backend_name = backend
        self.capacity = capacity
        self.caveats = caveats
        self.hi_backend = hi_backend
        self.merge_acks = merge_acks
        # Environment defects: what a misconfigured sglang does. "OrphanHost": a backed-up leaf is
        # deleted with its host copy still allocated (SessionRadixCache's release path + HiCache,
        # which the plugin refuses to run with).
        self.env_bugs = env_bugs
        self.ps = page_size
        self.fill = fill
        self.ttl = float(ttl if ttl is not None else bounds.ttl)
        # spec KeepTTL: how long a pin waits for its tool_end (Keep, an early restore once loaded)
        keep = keep_ttl if keep_ttl is not None else bounds.keep_ttl
        self.keep_ttl = float(keep if keep is not None else self.ttl)
        # "auto": tool_start is the per-call policy's choice among ToolStart, Keep and LetGo (and
        # Demote of others); the caller maps the outcome onto spec steps (the fuzz campaign does)
        self.policy = policy
        self.unit = 4 * max(16, page_size)  # tokens per spec node: halves of splits stay >= 10 (load_back)
        others = OTHER_LOADS if bounds.sys_loads else 0
        cap = device_tokens or (len(bounds.nodes) + bounds.dev_slots + 4 + others) * self.unit
        self.h = CacheHarness(
            HarnessConfig(
                kind="hiradix" if backend == "hiradix" else "radix",
                page_size=page_size,
                device_tokens=cap,
                host_ratio=host_ratio,
                write_policy="write_through",
                device=device,
                io_backend=io_backend,
                layers=kv_shape[0],
                heads=kv_shape[1],
                head_dim=kv_shape[2],
                dtype=dtype,
            ),
            seed=seed,
        )
        if self.h.is_hi:  # HiCache's own write-through is the spec's explicit WriteThrough action here
            self.h.tree.write_through_threshold = 10**9
            slots = self.h.tree.cache_controller.layer_done_counter.num_counters
            if bounds.ring not in (0, slots):
                raise ValueError(
                    f"sglang's load ring has {slots} producer slots; the model says Ring = {bounds.ring}"
                )
        self.executors: Mapping[str, Executor] = HIRADIX if self.h.is_hi else RADIX
        self._fresh = 1
        self.env_host_slots: set[int] = set()  # host slots held by other requests (fuzz memory pressure)
        self._start()

    def _start(self) -> None:
        """A fresh manager and name map over the (empty) tree."""
        tree = self.h.tree
        backend: Backend | None = None
        if self.backend_name == "pin":
            from toolkv.core.backends.pin import PinBackend

            backend = PinBackend(tree)
        elif self.backend_name == "shadow":
            from toolkv.core.backends.shadow import ShadowBackend

            backend = ShadowBackend(tree)
        elif self.hi_backend is not None:
            backend = self.hi_backend(tree)
        # seeded defects (mutation testing) are subclasses built outside the production code
        self.mgr = mutant_manager(
            tree,
            backend,
            # a hand-over lives as long as the spec's TTL, a pin waiting for its tool_end as long as
            # its KeepTTL; early restores are drawn as spec Prefetch steps, never started by the
            # tick behind a step
            config=ManagerConfig(
                ttl_s=self.ttl,
                handover_ttl_s=self.ttl,
                keep_ttl_s=self.keep_ttl,
                policy=self.policy,
                prefetch=False,
                idle_ttl_s=float("inf"),  # the spec closes sessions only when told to
                lazy_free=self.b.lazy_free,  # spec LazyFree: leave finished offloads' GPU copies
                unmirror=self.b.unmirror,  # spec Unmirror (off: the executable spec lacks HostUnmirror)
                # the spec's Park and Unpin are steps of their own (the replayer calls them), not
                # the tool_end's choice under load; no L3 tier here
                adaptive=False,
                l3_read_at_arrival=False,
            ),
            caveats=self.caveats,
        )
        self.nodes = NodeMap()
        self.tokens: dict[str, list[int]] = {}  # spec node -> tokens from the root to its end
        self.ext: set[str] = set()
        # the fuzz campaign's admissions of Restoring sessions (AdmitLoading): session -> its node;
        # the request's own lock is taken at the load ack, the spec's Admit then
        self.pending_admits: dict[str, str] = {}
        self.resets = 0
        self._ballast_dev: torch.Tensor | None = None
        self._ballast_host: torch.Tensor | None = None
        self.starts: list[tuple[Any, str]] = []  # (load ack, "sys"): sglang's own starts (spec `who`)
        # spec Admit of a parked session: (key node, the deepest ancestor on device before its load)
        self.request_loads: list[tuple[TreeNode, TreeNode]] = []
        self.others: list[TreeNode] = []  # other requests' prefixes that sglang's own loads load
        self._other_fresh = OTHER_TOKENS
        self._victims = 0  # victims picked so far (each gets an access time below all before it)

    def restart(self) -> None:
        """Back to the spec's initial state on the same stack: let every copy finish and retire it
        (as a fully idle scheduler would), reset the tree, pools and load-slot ring, new manager.
        Cheaper than a new stack by two orders of magnitude; the conformance replay starts every
        walk from here."""
        h, tree = self.h, self.h.tree
        self._release_ballast()
        _drain(self)
        if h.is_hi:
            tree.ongoing_write_through.clear()
            tree.ongoing_load_back.clear()
            tree.cache_controller.layer_done_counter.reset()
        tree.reset()
        h.allocator.clear()
        self.env_host_slots.clear()
        self._start()

    def close(self) -> None:
        self.h.close()

    # ---- state ----------------------------------------------------------------------------------------
    def abstract(self) -> dict[str, Any]:
        st = abstract_state(
            self.mgr,
            self.nodes,
            self.b,
            ext_locks=self.ext,
            resets=self.resets,
            env_host_slots=self.env_host_slots,
            load_starter=self.starter_of,
            request_loads=self.request_load_chains(),
        )
        st["extLock"] = {n: n in self.ext for n in self.b.nodes}
        return st

    def request_load_chains(self) -> list[tuple[TreeNode, list[TreeNode]]]:
        """The loads of admitted parked sessions' requests still in flight: (key node, the nodes it
        fills), walked now. sglang's ``ongoing_load_back`` holds only the key node of each; until
        its ack every node of the chain holds device slots without its bytes (the request waits
        for the load before it reads), so the KV oracle must not read them either. Finished loads
        are dropped from the list here."""
        if not self.h.is_hi:
            return []
        ongoing = self.h.tree.ongoing_load_back
        self.request_loads = [(leaf, b) for leaf, b in self.request_loads if leaf.id in ongoing]
        return [(leaf, _chain_to(leaf, boundary)) for leaf, boundary in self.request_loads]

    # ---- the load-slot ring -------------------------------------------------------------------------
    def starter_of(self, ack: Any) -> str:
        """Who started the load of ``ack``: ``"sys"`` if this replayer started it as sglang's own
        (``SysStart``), else ``"tkv"``: nothing but toolkv's backend starts loads otherwise, wherever
        it does so (a defective backend may start one in ``tool_end``)."""
        return next((who for a, who in self.starts if a is ack), "tkv")

    def record_start(self, before: int, who: str) -> None:
        """Note who started the loads appended to ``ack_load_queue`` since it held ``before``;
        forget loads sglang has retired."""
        queue = self.h.tree.cache_controller.ack_load_queue
        live = {id(a) for a in queue}
        self.starts = [(a, w) for a, w in self.starts if id(a) in live]
        self.starts += [(a, who) for a in queue[before:]]

    def idle_tick(self) -> None:
        """The scheduler tick calls ``start_loads`` every iteration, not only where the spec's
        ``StartLoads`` is enabled; where it is not, the call must change nothing (a stuttering
        step). The conformance replay probes that at every state with a queued load."""
        self.mgr.backend.start_loads()

    def other_prefix(self) -> TreeNode:
        """A fresh host-only prefix of another request (not a spec node), for sglang's own load.
        Inserted the way sglang lands a prefetched prefix on host (``_insert_helper_host``): no
        write has to finish for it, so no toolkv write is acknowledged as a side effect."""
        tree = self.h.tree
        host = self.h.host_pool.alloc(self.unit)
        assert host is not None, "host pool checked by the caller"
        tokens = list(range(self._other_fresh, self._other_fresh + self.unit))
        self._other_fresh += self.unit
        if self.fill:  # the bytes a prefetch would have landed: loads of it stay checkable
            self._fill_host(host, tokens)
        key = rkey(tokens)
        tree._insert_helper_host(tree.root_node, key, host, [f"other{t}" for t in tokens[:: self.ps]])
        node = tree.root_node.children[key.child_key(self.ps)]
        self.others.append(node)
        return node

    def make_lru(self, node: TreeNode, *, other: bool = False) -> None:
        """Make ``node`` the least recently used leaf, strictly: sglang's LRU heap is built from a
        ``set`` of leaves (``evictable_leaves``, ``evictable_host_leaves``), whose order follows
        the nodes' addresses, so a tie in access time would let the run, not the step, pick the
        victim (a replayed example could then evict another node and draw differently: Hypothesis's
        ``FlakyStrategyDefinition``). Each victim gets an access time below every earlier one,
        other requests' prefixes (``other``) below every spec node."""
        self._victims += 1
        node.last_access_time = (-2e18 if other else -1e18) - 1e6 * self._victims

    def _fill_host(self, host: torch.Tensor, tokens: list[int]) -> None:
        """Write the deterministic KV of ``tokens`` into host slots ``host`` (either host layout)."""
        hp, ps = self.h.host_pool, self.ps
        exp = self.h.expected_kv(tokens)
        for kv, buf in enumerate((hp.k_buffer, hp.v_buffer)):
            for layer in range(self.h.cfg.layers):
                if hp.layout == "layer_first":
                    buf[layer][host] = exp[kv, layer].to(buf.dtype)
                else:  # page_first_direct: [page, layer, page_size, heads, dim]
                    for j, slot in enumerate(host.tolist()):
                        buf[slot // ps, layer, slot % ps] = exp[kv, layer, j].to(buf.dtype)

    def retire_others(self) -> None:
        """What sglang does to its own finished loads between batches: ``loading_check`` retires
        them (skipped when it would also retire a load of a spec node: that is the spec's
        ``LoadAck``, not this step), then their prefixes are evicted (device, then host) to make
        room, as memory pressure would. Invisible to the spec; run after every ring step, so
        other requests' prefixes hold memory only while their loads are unretired."""
        tree = self.h.tree
        finished = finished_load_ids(tree)
        if finished - {o.id for o in self.others}:
            return
        if finished:
            tree.loading_check()
        for o in [o for o in self.others if o.lock_ref == 0 and attached(tree, o)]:
            self.make_lru(o, other=True)  # below any spec node the environment made the LRU victim
            if o.value is not None:
                self.h.evict_device(len(o.key))
            self.h.evict_host(len(o.key))
            assert not attached(tree, o), "sglang kept another request's retired prefix"
        self.others = [o for o in self.others if attached(tree, o)]

    def obj(self, name: str) -> TreeNode:
        return self.nodes.obj[name]

    def tokens_of(self, node: TreeNode) -> list[int]:
        out: list[int] = []
        for m in path_to(self.h.tree, node):
            out.extend(m.key.token_ids)
        return out

    def resolve(self, name: str) -> TreeNode | None:
        """The live node for a spec name: its object if attached, else (a backend that re-inserts
        KV, i.e. shadow) the node whose key ends exactly at the name's last token."""
        o = self.nodes.obj.get(name)
        if o is not None and attached(self.h.tree, o):
            return o
        toks = self.tokens.get(name)
        if not toks or self.backend_name != "shadow":
            return None
        node, matched = walk(self.h.tree, toks)
        if matched != len(toks) or node is self.h.tree.root_node:
            return None
        self.nodes.obj[name], self.nodes.gen[name] = node, self.mgr.tree_gen
        return node

    # ---- ballast: how much memory other requests hold ------------------------------------------------
    def _release_ballast(self) -> None:
        if self._ballast_dev is not None:
            self.h.allocator.free(self._ballast_dev)
            self._ballast_dev = None
        if self._ballast_host is not None:
            self.h.host_pool.free(self._ballast_host)
            self._ballast_host = None

    def device_free_exactly(self, tokens: int) -> None:
        if self.capacity != "spec":
            return
        extra = self.h.allocator.available_size() - max(tokens, 0)
        if extra > 0:
            self._ballast_dev = self.h.allocator.alloc(extra)
            assert self._ballast_dev is not None

    def host_free_exactly(self, tokens: int) -> None:
        if self.capacity != "spec":
            return
        extra = self.h.host_pool.available_size() - max(tokens, 0)
        if extra > 0:
            self._ballast_host = self.h.host_pool.alloc(extra)
            assert self._ballast_host is not None

    # ---- one spec action -------------------------------------------------------------------------------
    def apply(
        self, act: Sequence[Any], pre: Mapping[str, Any] | None = None, *, check: bool = True
    ) -> StepResult:
        """Execute spec action ``act`` (e.g. ``("ToolStart", "s1")``). ``pre`` is the state before it
        in the spec's variables (the spec's own state in a conformance replay; computed from the
        implementation if not given): the environment's memory choices depend on it. ``check``
        evaluates the spec's invariants and step properties on the implementation's state after."""
        pre = pre if pre is not None else self.abstract()
        name, args = str(act[0]), [str(a) for a in act[1:]]
        exe = self.executors.get(name)
        if exe is None:
            raise UnknownAction(f"no executor for spec action {name!r} on a {self.h.cfg.kind} cache")
        self._release_ballast()
        error: str | None = None
        try:
            exe(self, args, pre)
        except ToolKVError as exc:
            error = exc.code
        finally:
            self._release_ballast()
        self._take_pending_admits()
        if not check:
            return StepResult(tuple(act), error, [])
        post = self.abstract()
        return StepResult(
            tuple(act),
            error,
            check_invariants(post, self.b) + check_step(pre, post, self.b, tuple(act)),
            post,
        )

    def _take_pending_admits(self) -> None:
        """A request admitted while its session's load was in flight (``AdmitLoading``) holds the
        path from the load ack on: once the manager has ended the hand-over (Runnable), the
        request's lock is taken, as the spec's ``Admit`` that the campaign takes right after the
        ``LoadAck`` puts it (``extLock``). A session that left Restoring otherwise (expired,
        closed, the tree reset) has no request to lock for."""
        for s, n in list(self.pending_admits.items()):
            rec = self.mgr.sessions.get(s)
            state = None if rec is None else rec.state
            if state == "Restoring":
                continue
            del self.pending_admits[s]
            o = self.resolve(n) if state == "Runnable" else None
            if o is not None and n not in self.ext:
                self.h.tree.inc_lock_ref(o)
                self.ext.add(n)

    # ---- helpers shared by executors ---------------------------------------------------------------
    def insert(self, s: str, p: str, n: str) -> None:
        """Session ``s`` finishes a turn: fresh tokens under ``p``'s path land as node ``n``."""
        from sglang.srt.mem_cache.base_prefix_cache import InsertParams

        tree = self.h.tree
        parent = None if p == ROOT else self.resolve(p)
        if p != ROOT and parent is None:
            raise NotApplicable("the node is not in this backend's tree")
        prefix_tokens: list[int] = [] if parent is None else self.tokens_of(parent)
        fresh = list(range(self._fresh, self._fresh + self.unit))
        self._fresh += self.unit
        tokens = prefix_tokens + fresh
        new = self.h.allocator.alloc(self.unit)
        if new is None:
            if self.capacity == "spec":
                raise AssertionError("the replayer sized the device pool too small")
            raise Unrealizable("no device memory for the turn")
        if self.fill:
            self.h.fill_kv(new, fresh)
        prefix_idx = torch.cat([m.value for m in path_to(tree, parent)]).to(new.device) if parent else new[:0]
        res = tree.insert(InsertParams(key=rkey(tokens), value=torch.cat([prefix_idx, new])))
        assert int(res.prefix_len) == len(prefix_tokens), "insert matched more than the parent path"
        leaf, matched = walk(tree, tokens)
        assert matched == len(tokens)
        self.nodes.add(n, leaf, self.mgr.tree_gen)
        self.tokens[n] = tokens
        self.mgr.insert(s, tokens)

    def split(self, n: str, m: str) -> None:
        """A request diverges inside ``n``: sglang's ``_split_node`` (via ``match_prefix``) makes the
        fresh prefix ``m``; ``n`` keeps its identity."""
        from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams

        o = self.resolve(n)
        if o is None:
            raise NotApplicable("the node is not in this backend's tree")
        half = (len(o.key) // 2) // self.ps * self.ps
        assert half > 0, "node too short to split"
        tokens = self.tokens_of(o.parent) if o.parent is not self.h.tree.root_node else []
        tokens += list(o.key.token_ids[:half])
        self.h.tree.match_prefix(MatchPrefixParams(key=rkey(tokens)))
        assert len(o.key) == len(o.key.token_ids) and o.parent is not None
        self.nodes.add(m, o.parent, self.mgr.tree_gen)
        self.tokens[m] = tokens

    def evict(self, name: str, host: bool = False) -> bool:
        """Make ``name`` the least recently used node and let sglang evict (device or host) as much as
        it holds; True when it left the tree."""
        o = self.resolve(name)
        if o is None:
            return True
        self.make_lru(o)  # the environment picks the victim
        if host:
            self.h.evict_host(len(o.key))
        else:
            self.h.evict_device(len(o.key))
        return not attached(self.h.tree, o)


# ---- executors on a HiRadixCache -------------------------------------------------------------------
def _complete_ack(r: Replayer, queue: list[Any], name: str) -> None:
    rid = r.obj(name).id
    for i, ack in enumerate(queue):
        if rid in ack.node_ids:
            if i:
                raise Unrealizable("ack out of issue order (sglang retires acks oldest first)")
            ack.finish_event.synchronize()
            return
    raise Unrealizable("no ack in flight for this key")


def hi_insert(r: Replayer, a: list[str], pre: Mapping[str, Any]) -> None:
    r.insert(a[0], a[1], a[2])


def hi_tool_start(r: Replayer, a: list[str], pre: Mapping[str, Any]) -> None:
    """Spec ``ToolStart``: enabled with free slots enough, or refused when even the evictable host
    copies would not make room (``HostFits``); the host pool is sized so (the evictable copies are
    the tree's own, the same as the spec's)."""
    rec = r.mgr.sessions.get(a[0])
    tree = r.h.tree
    if rec is not None and rec.node is not None and attached(tree, rec.node):
        w = [m for m in path_to(tree, rec.node) if m.host_value is None]
        if len(w) > pre["hostFree"]:
            room = r.mgr.backend.host_evictable_tokens()  # type: ignore[attr-defined]
            r.host_free_exactly(sum(len(m.key) for m in w) - r.ps - room)
    _tool_start(r, a[0], pre)


def _tool_start(r: Replayer, s: str, pre: Mapping[str, Any] | None = None) -> None:
    """Spec ``ToolStart``. A conformance replay (``capacity="spec"``) with ``policy="offload"`` runs
    exactly it, the manager's ``offload``; with ``policy="auto"`` the production ``tool_start``
    (:func:`policy_tool_start`); elsewhere (fuzzing, traces) the production ``tool_start``, whose
    demotions for room and policy choices the caller maps onto spec steps."""
    if r.capacity != "spec":
        r.mgr.tool_start(s)
    elif r.policy == "auto" and pre is not None and r.h.is_hi:
        policy_tool_start(r, "ToolStart", s, pre)
    else:
        r.mgr.offload(s)


#: policy auto, conformance replay: the client's ``expected_s`` per spec action. Keep: a short tool;
#: ToolStart and LetGo: a long one, longer for each later session, so that an earlier session may
#: demote a later one (predicted back after it) and never the other way round.
AUTO_SHORT_S = 0.0
AUTO_LONG_S = 10.0


def _auto_hint(r: Replayer, label: str, s: str) -> float:
    if label == "Keep":
        return AUTO_SHORT_S
    i = r.b.sessions.index(s) if s in r.b.sessions else 0
    return AUTO_LONG_S * 100.0**i


def policy_steps(
    pre: Mapping[str, Any], post: Mapping[str, Any], s: str, sessions: Sequence[str]
) -> list[list[Any]]:
    """The spec steps one production ``tool_start`` of ``s`` stands for, read off the states before
    and after: the sessions it demoted for host room (``Demote``, they commute), the host copies
    sglang freed for it (``HostRoom``, leaves first), then its choice: ``Keep`` (the session is
    kept), ``LetGo`` (released) or ``ToolStart`` (offloaded, or a refusal that changed nothing)."""
    main: list[Any] = ["ToolStart", s]
    if pre["phase"][s] == "Running" and post["phase"][s] == "Kept":
        main = ["Keep", s]
    elif pre["phase"][s] == "Running" and post["phase"][s] == "Released":
        main = ["LetGo", s]
    demoted = [
        x for x in sessions if x != s and pre["phase"][x] == "Offloaded" and post["phase"][x] == "Released"
    ]
    gone = [
        n
        for n, h in pre["host"].items()
        if h and not post["host"].get(n, False) and post["status"].get(n) == "Gone"
    ]

    def depth(n: str) -> int:
        k = 0
        while n != ROOT:
            n, k = pre["parent"][n], k + 1
        return k

    rooms = [["HostRoom", s, n] for n in sorted(gone, key=depth, reverse=True)]
    return [*(["Demote", x] for x in sorted(demoted)), *rooms, main]


def policy_tool_start(r: Replayer, label: str, s: str, pre: Mapping[str, Any]) -> None:
    """Policy ``auto`` in a conformance replay: the spec's ``ToolStart``, ``Keep`` and ``LetGo`` of a
    running session are all the production ``tool_start`` — ``decide`` on the pressure the backend
    reads off the pools (sized as the spec state says), the demotion candidates when the host is
    full — steered towards the edge by the client's hint (:func:`_auto_hint`) and, for ``LetGo``,
    by a host with no free room. Where the policy takes the edge's step, the walk compares the
    state as usual. Where it takes other spec steps (:func:`policy_steps`), each must be enabled
    in the spec and together lead to the implementation's state: then :class:`PolicyChose` (the
    edge is left to another walk); otherwise the comparison with the edge's target reports it.

    Demotions are checked at node granularity, which the host ballast of ``hi_tool_start`` (one
    page short) matches while a refused path is at most one node short of room, as it is with one
    host slot."""
    if label == "LetGo":
        r.host_free_exactly(0)  # the host cannot take it (its evictable copies still count)
    try:
        r.mgr.tool_start(s, expected_s=_auto_hint(r, label, s))
    finally:
        r._release_ballast()
    post = r.abstract()
    chain = policy_steps(pre, post, s, r.b.sessions)
    if chain == [[label, s]]:
        return
    st: Mapping[str, Any] | None = pre
    rules = r.b.rules()
    for a in chain:
        st = specstep.successor(st, a, rules) if st is not None else None
    keys = [k for k in post if k not in ("act", "tgt")]
    if st is None or any(st[k] != post[k] for k in keys):
        return  # not the spec's steps: the state comparison reports the divergence
    rec = r.mgr.sessions.get(s)
    why = rec.reason if rec is not None else "-"
    raise PolicyChose(f"{label}: tool_start took {' '.join(str(a[0]) for a in chain)} ({why})")


def admit(r: Replayer, a: list[str], pre: Mapping[str, Any]) -> None:
    """Spec ``Admit``: the session's next request is admitted; it locks the prefix (as
    ``PrefillAdder`` does) and the scheduler hook ends the hand-over. A parked session's request
    is admitted as sglang admits a host hit: ``load_back`` of the evicted path where the spec's
    device takes it (DevFits), the request's lock on the path; else it recomputes (no lock).
    With the ring (``Ring > 0``) its batch then starts the load, with the whole queue (toolkv's
    queued loads included), by sglang's own ``ready_to_load_host_cache``, as
    ``get_new_batch_prefill`` does in the same scheduler step: a start of sglang's (spec
    ``who = "sys"``), at sglang's cadence (spec ``SysInFlight <= 1``: where two of its own loads
    are still in flight, no such batch is built, and the step is :class:`Unrealizable`)."""
    n = pre["ref"][a[0]]
    o = r.resolve(n)
    if o is None:
        raise NotApplicable("the node is not in this backend's tree")
    if pre["phase"][a[0]] == "Parked":
        missing = [m for m in specstep.path(pre, n, len(r.b.nodes)) if not pre["dev"][m]]
        # the spec's device decides where its slots are the pools' (conformance); with real pools
        # (the fuzz campaign) sglang's load_back does, and a load it refuses is not this step
        if r.capacity != "spec" or len(missing) <= pre["devFree"]:
            chain = [m for m in path_to(r.h.tree, o) if m.value is None]
            need = sum(len(m.key) for m in chain)
            if r.capacity != "spec" and need > r.h.allocator.available_size():
                # load_back would evict for it: GpuEvict steps the spec's Admit does not take
                raise Unrealizable("no free device memory for the admitted request's load-back")
            ring = r.b.ring > 0 and bool(missing)
            if ring and sum(1 for x in pre.get("ring", ()) if x["who"] == "sys") > 1:
                raise Unrealizable("sglang's cadence: two of its own loads in flight, no batch is built")
            tree = r.h.tree
            if missing and tree.load_back(o) is None:
                raise Unrealizable("sglang would not load this path back")
            if ring:  # the request's batch: ready_to_load_host_cache starts the whole queue
                before = len(tree.cache_controller.ack_load_queue)
                assert tree.ready_to_load_host_cache() >= 0, "sglang started no load"
                r.record_start(before, "sys")
            if chain:
                r.request_loads.append((o, chain[0].parent))
            tree.inc_lock_ref(o)
            r.ext.add(n)
        r.mgr.admit(a[0])
        return
    r.h.tree.inc_lock_ref(o)
    r.ext.add(n)
    r.mgr.admit(a[0])


def admit_loading(r: Replayer, a: list[str], pre: Mapping[str, Any]) -> None:
    """The fuzz campaign's admission of a Restoring session's next request while its load is in
    flight (sglang matched the path being loaded; the batch's forward waits for the load). The
    spec has no step for it (a stutter: the manager only notes it); the load ack then ends the
    hand-over at once, the spec's ``LoadAck`` and ``Admit`` in a row
    (:meth:`Replayer._take_pending_admits` takes the request's lock there)."""
    if pre["phase"][a[0]] != "Restoring":
        raise NotApplicable("only a session whose load is in flight")
    assert r.mgr.admit(a[0]) is False, "an admission while loading ends no hand-over yet"
    r.pending_admits[a[0]] = pre["ref"][a[0]]


def hi_write_ack(r: Replayer, a: list[str], pre: Mapping[str, Any]) -> None:
    """Spec ``WriteAck(k)``: sglang retires the write of ``k`` and the manager reacts.

    ``writing_check`` retires every finished ack at the front of the queue in one call. On a GPU
    the copies queued behind this one finish on their own (the CUDA campaign saw one call retire
    three), while the spec's step retires one: the writes behind it are the environment's later
    ``WriteAck`` steps, so they are held back from this call and put back, in order, after it."""
    tree = r.h.tree
    queue = tree.cache_controller.ack_write_queue
    _complete_ack(r, queue, a[0])
    held = queue[1:]
    del queue[1:]
    try:
        tree.writing_check()
    finally:
        queue.extend(held)
    r.mgr.write_ack()


def hi_tool_end(r: Replayer, a: list[str], pre: Mapping[str, Any]) -> None:
    rec = r.mgr.sessions.get(a[0])
    tree = r.h.tree
    headroom = r.mgr.backend.headroom  # type: ignore[attr-defined]  # the driver's promise, put back after
    if rec is not None and rec.node is not None and attached(tree, rec.node):
        c = [m for m in path_to(tree, rec.node) if m.value is None]
        if len(c) > pre["devFree"]:
            r.device_free_exactly(sum(len(m.key) for m in c) - r.ps)
            if r.capacity == "spec":  # and running requests were promised what eviction could free
                evictable = int(tree.evictable_size())
                r.mgr.backend.headroom = lambda: evictable  # type: ignore[attr-defined]
    try:
        r.mgr.tool_end(a[0], int(a[1]))
    finally:
        r.mgr.backend.headroom = headroom  # type: ignore[attr-defined]


def _start_queued(r: Replayer, name: str) -> None:
    """A load that ``load_back`` only queued is started by the scheduler tick's ``start_loads``
    (spec ``StartLoads``; with ``Ring = 0`` an internal step of the load) before it can finish."""
    ctrl = r.h.tree.cache_controller
    rid = r.obj(name).id
    if any(rid in op.node_ids for op in ctrl.load_queue) and not r.mgr.backend.start_loads():
        raise Unrealizable("the load ring is busy: the queued load cannot start yet")


def _drain(r: Replayer, *, start_queued: bool = True) -> None:
    """What a fully idle scheduler has: every transfer finished and retired, and (``start_queued``)
    no load queued. Without it, queued loads stay for ``reset()`` to drop."""
    h, tree = r.h, r.h.tree
    h.synchronize()
    if h.is_hi:
        while start_queued and tree.cache_controller.load_queue:
            r.mgr.backend.start_loads()
            h.synchronize()
        tree.writing_check()
        tree.loading_check()


def finished_load_ids(tree: Any) -> set[int]:
    """Node ids of the finished acks at the front of ``ack_load_queue``: what the next
    ``loading_check`` retires."""
    out: set[int] = set()
    for ack in tree.cache_controller.ack_load_queue:
        if not ack.finish_event.query():
            break
        out.update(ack.node_ids)
    return out


def hi_load_ack(r: Replayer, a: list[str], pre: Mapping[str, Any]) -> None:
    tree = r.h.tree
    if r.b.ring > 0:  # the spec's RingDone already finished the copy: loading_check retires it
        more = finished_load_ids(tree) - {r.obj(a[0]).id} - {o.id for o in r.others}
        if more and not r.merge_acks:
            raise Unrealizable("loading_check retires every finished load at once")
    else:
        _start_queued(r, a[0])
        _complete_ack(r, tree.cache_controller.ack_load_queue, a[0])
    tree.loading_check()
    r.mgr.load_ack()
    r.retire_others()


def hi_start_loads(r: Replayer, a: list[str], pre: Mapping[str, Any]) -> None:
    """Spec ``StartLoads``: the scheduler tick's ``start_loads`` (it starts the queue only when no
    load is in flight). When a protection is due the tick would also sweep (spec ``TtlSweep``, an
    action of its own): then only the tick's other steps run."""
    mgr = r.mgr
    due = any(pre["phase"][s] in specstep.EXPIRING and pre["deadline"][s] <= pre["now"] for s in r.b.sessions)
    if due:
        mgr.backend.start_loads()
        mgr.load_ack()
    else:
        mgr.tick(mgr.now)


def hi_sys_start(r: Replayer, a: list[str], pre: Mapping[str, Any]) -> None:
    """Spec ``SysStart``: a prefill batch of another request hits a host-only prefix; sglang loads
    it back (``load_back``, as ``init_load_back`` does) and starts the whole load queue in one
    producer slot (``ready_to_load_host_cache``), toolkv's queued loads included."""
    tree = r.h.tree
    r.retire_others()
    if r.h.allocator.available_size() < r.unit or r.h.host_pool.available_size() < r.unit:
        raise Unrealizable("no memory for another request's prefix: that batch loads nothing")
    node = r.other_prefix()
    before = len(tree.cache_controller.ack_load_queue)
    assert tree.load_back(node) is not None, "the replayer sized the device pool too small"
    assert tree.ready_to_load_host_cache() >= 0, "sglang started no load"
    r.record_start(before, "sys")


def hi_ring_done(r: Replayer, a: list[str], pre: Mapping[str, Any]) -> None:
    """Spec ``RingDone``: the copy engine finishes the oldest started load; its producer slot's
    events fire with its ack's ``finish_event`` (retiring the ack is ``LoadAck``)."""
    for ack in r.h.tree.cache_controller.ack_load_queue:
        if not ack.finish_event.query():
            ack.finish_event.synchronize()
            r.retire_others()
            return
    raise AssertionError("the spec has a load in flight; sglang has none")


def ttl_sweep(r: Replayer, a: list[str], pre: Mapping[str, Any]) -> None:
    mgr = r.mgr
    if pre["now"] >= r.b.max_time:
        # the spec's clock saturates at MaxTime ("MaxTime or later") and clamps deadlines to it:
        # every armed deadline is due there. Real time simply moves on that far.
        due = [x.deadline for x in mgr.sessions.values() if x.state in specstep.EXPIRING]
        mgr.set_clock(max([mgr.now, *due]))
    mgr.ttl_sweep()


def close(r: Replayer, a: list[str], pre: Mapping[str, Any]) -> None:
    r.mgr.close(a[0])


# the per-call policy: the manager's spec actions (tool_start's choice among them is the policy's)
def keep(r: Replayer, a: list[str], pre: Mapping[str, Any]) -> None:
    if _auto_choice(r, a[0], pre):
        policy_tool_start(r, "Keep", a[0], pre)
    else:
        r.mgr.keep(a[0])


def let_go(r: Replayer, a: list[str], pre: Mapping[str, Any]) -> None:
    if _auto_choice(r, a[0], pre):
        policy_tool_start(r, "LetGo", a[0], pre)
    else:
        r.mgr.let_go(a[0])


def _auto_choice(r: Replayer, s: str, pre: Mapping[str, Any]) -> bool:
    """Whether this Keep/LetGo is the auto policy's tool_start (conformance replay, running session);
    elsewhere the explicit call (a refusal in any other phase is checked as a stutter)."""
    return r.policy == "auto" and r.capacity == "spec" and r.h.is_hi and pre["phase"].get(s) == "Running"


def demote(r: Replayer, a: list[str], pre: Mapping[str, Any]) -> None:
    r.mgr.demote(a[0])


def hi_prefetch(r: Replayer, a: list[str], pre: Mapping[str, Any]) -> None:
    """Spec ``Prefetch``: enabled only where the evicted path fits (DevFits), so the device is
    sized as the spec says and the manager's early restore must go through."""
    r.mgr.prefetch(a[0])


def _chain_to(leaf: TreeNode, boundary: TreeNode) -> list[TreeNode]:
    """The nodes a load keyed by ``leaf`` fills: from ``leaf`` up to ``boundary`` (exclusive),
    walked now, so that a node a split inserted into the chain while it loads is in it too."""
    out = []
    node: TreeNode | None = leaf
    while node is not None and node is not boundary:
        out.append(node)
        node = node.parent
    return out


def park(r: Replayer, a: list[str], pre: Mapping[str, Any]) -> None:
    """Spec ``Park``: the explicit call (a server's tool_end parks when its queue needs the room)."""
    r.mgr.park(a[0], int(a[1]))


def unpin(r: Replayer, a: list[str], pre: Mapping[str, Any]) -> None:
    """Spec ``Unpin``: the explicit call (a server's tick unpins when its queue needs the room)."""
    r.mgr.unpin(a[0])


POLICY: dict[str, Executor] = {
    "Keep": keep, "LetGo": let_go, "Demote": demote, "Prefetch": hi_prefetch, "Park": park, "Unpin": unpin,
}  # fmt: skip


def lock(r: Replayer, a: list[str], pre: Mapping[str, Any]) -> None:
    o = r.resolve(a[0])
    if o is None:
        raise NotApplicable("the node is not in this backend's tree")
    r.h.tree.inc_lock_ref(o)
    r.ext.add(a[0])


def unlock(r: Replayer, a: list[str], pre: Mapping[str, Any]) -> None:
    o = r.resolve(a[0])
    if o is None:
        raise NotApplicable("the node is not in this backend's tree")
    r.h.tree.dec_lock_ref(o)
    r.ext.discard(a[0])


def hi_gpu_evict(r: Replayer, a: list[str], pre: Mapping[str, Any]) -> None:
    tree = r.h.tree
    o = r.obj(a[0])
    if "OrphanHost" in r.env_bugs and o.host_value is not None:
        tree.cache_controller.mem_pool_device_allocator.free(o.value)
        tree._delete_leaf(o)
        return
    r.make_lru(o)  # the environment picks the victim: make it the LRU leaf
    r.h.evict_device(len(o.key))
    if o.value is not None and attached(tree, o):
        raise Unrealizable("sglang would not GPU-evict this node")


def hi_host_evict(r: Replayer, a: list[str], pre: Mapping[str, Any]) -> None:
    if not r.evict(a[0], host=True):
        raise Unrealizable("sglang would not host-evict this node")


def hi_host_room(r: Replayer, a: list[str], pre: Mapping[str, Any]) -> None:
    """Spec ``HostRoom``: ``evict_host`` frees the evictable host leaf the spec names (made the
    least recently used); the manager's own room-making is the same call with a token count."""
    if not r.evict(a[1], host=True):
        raise Unrealizable("sglang would not host-evict this node")


def hi_write_through(r: Replayer, a: list[str], pre: Mapping[str, Any]) -> None:
    o = r.obj(a[0])
    if r.h.tree.write_backup(o) != len(o.key):
        raise Unrealizable("host pool full: sglang skips the write-through")


def split(r: Replayer, a: list[str], pre: Mapping[str, Any]) -> None:
    r.split(a[0], a[1])


def hi_tree_reset(r: Replayer, a: list[str], pre: Mapping[str, Any]) -> None:
    # flush_cache only runs when the scheduler is fully idle, which counts sglang's in-flight writes
    # and loads as busy: they have finished and been retired (reset() itself does not clear
    # ongoing_write_through / ongoing_load_back).
    tree = r.h.tree
    _drain(r, start_queued=r.b.ring == 0)  # Ring > 0: reset() drops the queue (spec queued' = {})
    tree.reset()
    r.h.allocator.clear()
    r.others.clear()
    r.starts.clear()
    r.resets += 1
    r.mgr.tree_reset()


def tick(r: Replayer, a: list[str], pre: Mapping[str, Any]) -> None:
    r.mgr.set_clock(r.mgr.now + 1)


#: spec action -> executor on a HiRadixCache (the spec's own world).
HIRADIX: dict[str, Executor] = {
    "Insert": hi_insert,
    "ToolStart": hi_tool_start,
    "WriteAck": hi_write_ack,
    "ToolEnd": hi_tool_end,
    "LoadAck": hi_load_ack,
    "TtlSweep": ttl_sweep,
    "Close": close,
    "Lock": lock,
    "Unlock": unlock,
    "GpuEvict": hi_gpu_evict,
    "HostEvict": hi_host_evict,
    "HostRoom": hi_host_room,
    "Admit": admit,
    "AdmitLoading": admit_loading,  # the fuzz campaign's only: no spec action (a stutter)
    "WriteThrough": hi_write_through,
    "Split": split,
    "TreeReset": hi_tree_reset,
    "Tick": tick,
    "StartLoads": hi_start_loads,
    "SysStart": hi_sys_start,
    "RingDone": hi_ring_done,
    **POLICY,
}


# ---- executors on a plain RadixCache (pin, shadow) -------------------------------------------------
def _spec_path(pre: Mapping[str, Any], r: Replayer, n: str) -> list[str]:
    return specstep.path(pre, n, len(r.b.nodes))


def _budget_refuses(r: Replayer, need: int) -> None:
    """Make the backend's budget one token short of ``need`` (the environment's choice, as ballast
    is for the host pool): the spec's ToolStart finds no room."""
    if need <= 0:
        raise NotApplicable("this backend moves nothing here, so it cannot run out of room")
    be: Any = r.mgr.backend
    used = be.pinned_tokens if r.backend_name == "pin" else be.host_tokens
    be.budget_tokens = used + need - 1


def rx_tool_start(r: Replayer, a: list[str], pre: Mapping[str, Any]) -> None:
    s = a[0]
    n = pre["ref"][s]
    rec = r.mgr.sessions.get(s)
    refused = (
        pre["phase"][s] == "Running"
        and n != specstep.NO
        and pre["status"][n] == "InTree"
        and not specstep._host_fits(
            pre, r.b.rules(), [m for m in _spec_path(pre, r, n) if not pre["host"][m]]
        )[0]
    )
    be: Any = r.mgr.backend
    if refused and rec is not None and rec.node is not None and attached(r.h.tree, rec.node):
        if r.backend_name == "pin":
            need = sum(len(m.key) for m in path_to(r.h.tree, rec.node))
        else:
            need = sum(len(m.key) for m in be._exclusive(rec.node))
        _budget_refuses(r, need)
    try:
        _tool_start(r, s)
    finally:
        be.budget_tokens = None


def rx_tool_end(r: Replayer, a: list[str], pre: Mapping[str, Any]) -> None:
    s, e = a[0], int(a[1])
    n = pre["ref"][s]
    refused = (
        pre["phase"][s] in ("Offloading", "Offloaded")
        and e == pre["epoch"][s]
        and len([m for m in _spec_path(pre, r, n) if not pre["dev"][m]]) > pre["devFree"]
    )
    if refused:
        if r.backend_name == "pin":
            raise NotApplicable("pin needs no device memory to restore: it cannot be refused")
        rec = r.mgr.sessions[s]
        need = rec.backend_state.tokens if rec.backend_state is not None else 0
        if need == 0:
            raise NotApplicable("shadow has nothing to copy back here: it cannot be refused")
        r.device_free_exactly(need - r.ps)
    r.mgr.tool_end(s, e)


def rx_acks(r: Replayer, a: list[str], pre: Mapping[str, Any]) -> None:
    """A synchronous backend finished every copy inside the call: the manager's ack hooks find
    nothing to do (the spec's in-flight phases collapse onto the settled ones)."""
    r.mgr.write_ack()
    r.mgr.load_ack()


def rx_gpu_evict(r: Replayer, a: list[str], pre: Mapping[str, Any]) -> None:
    if pre["host"][a[0]]:
        raise NotApplicable("a plain RadixCache has no host copy to keep: eviction deletes")
    if not r.evict(a[0]):
        raise NotApplicable("this backend still holds a descendant on the device")


def rx_host_evict(r: Replayer, a: list[str], pre: Mapping[str, Any]) -> None:
    # the spec deletes an unprotected host-only leaf; here its KV is on the device (pin never
    # frees it) or already gone (shadow removed it): delete it, or nothing to do
    if not r.evict(a[0]):
        raise NotApplicable("this backend still holds the node on the device")


def rx_write_through(r: Replayer, a: list[str], pre: Mapping[str, Any]) -> None:
    """No host tier, no write-through: nothing happens."""


def rx_no_ring(r: Replayer, a: list[str], pre: Mapping[str, Any]) -> None:
    raise NotApplicable("a plain RadixCache has no load-slot ring: its backends copy synchronously")


def rx_tree_reset(r: Replayer, a: list[str], pre: Mapping[str, Any]) -> None:
    r.h.tree.reset()
    r.h.allocator.clear()
    r.resets += 1
    r.mgr.tree_reset()


#: spec action -> executor on a plain RadixCache (the pin and shadow backends).
RADIX: dict[str, Executor] = {
    **HIRADIX,
    "ToolStart": rx_tool_start,
    "WriteAck": rx_acks,
    "ToolEnd": rx_tool_end,
    "LoadAck": rx_acks,
    "GpuEvict": rx_gpu_evict,
    "HostEvict": rx_host_evict,
    "HostRoom": lambda r, a, pre: rx_host_evict(r, a[1:], pre),
    "WriteThrough": rx_write_through,
    "TreeReset": rx_tree_reset,
    "StartLoads": rx_no_ring,
    "SysStart": rx_no_ring,
    "RingDone": rx_no_ring,
}


__all__ = [
    "BACKENDS",
    "HIRADIX",
    "RADIX",
    "NotApplicable",
    "Replayer",
    "StepResult",
    "UnknownAction",
    "Unrealizable",
]
