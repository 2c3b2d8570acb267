------------------------------- MODULE ToolKV -------------------------------
(***************************************************************************)
(* Tool-call-aware KV-cache tiering on top of SGLang's HiRadixCache.      *)
(*                                                                         *)
(* The model has three layers that move concurrently:                      *)
(*   - the radix tree as HiRadixCache keeps it (device copy, host copy,    *)
(*     lock_ref, host_ref_counter, in-flight write and load acks);         *)
(*   - the toolkv manager (ToolStart, WriteAck, ToolEnd, LoadAck,          *)
(*     TtlSweep, Close), which must only ever act on the current tree;     *)
(*   - the environment: other requests, HiCache's own eviction and         *)
(*     write-through, splits, flushes and the clock.                       *)
(*                                                                         *)
(* Every action is deterministic once its parameters are fixed, and it     *)
(* records itself in the history variable `act`, so that an edge of the    *)
(* state graph can be replayed on the Python implementation.  A constant   *)
(* BUG switches on one seeded defect at a time (see docs/caveats.md).      *)
(***************************************************************************)
EXTENDS Integers, FiniteSets, Sequences, TLC

CONSTANTS
    Nodes,      \* identities of TreeNode objects; never reused (Python object identity)
    Sessions,   \* agent sessions
    Root,       \* the radix root: always on device and on host, never evicted
    NoNode,     \* "no node" (a null reference, also "no ack key")
    DevSlots,   \* device KV slots; every node occupies exactly one while on device
    HostSlots,  \* host KV slots; every node occupies exactly one while backed up
    MaxEpoch,   \* bound on offloads per session (epochs are 1..MaxEpoch)
    MaxTime,    \* the clock saturates here; deadlines are clamped to it
    TTL,        \* ticks a protection may live without a ToolEnd
    KeepTTL,    \* ticks a GPU pin of the policy (Keep, an early restore once loaded) may wait for its
                \* ToolEnd; never more than TTL (the implementation's keep_ttl_s, clipped to ttl_s)
    MaxResets,  \* bound on flush_cache / tree resets
    EnvLocks,   \* BOOLEAN: model other requests locking shared prefixes
    EnvWrites,  \* BOOLEAN: model HiCache's own write-through backups
    Hist,       \* BOOLEAN: maintain the history variables act and tgt
    Ring,       \* producer slots of sglang's layer-done counter (3 in 0.5.16); 0 = not modelled
    SysLoads,   \* BOOLEAN: sglang starts host->GPU loads of its own (prefill batches with host hits)
    Policy,     \* BOOLEAN: the per-call policy's actions (Keep, LetGo, Demote, Prefetch) are enabled
    LazyFree,   \* BOOLEAN: an offload leaves its acknowledged GPU copies to HiCache's own eviction
                \* (GpuEvict) instead of freeing them (FreeSet) at ToolStart / WriteAck
    Unmirror,   \* BOOLEAN: a ToolStart short of host room may drop the host mirror of a device copy a
                \* running request locks (HostUnmirror): sglang writes it again at the request's
                \* finish (write-through) or at its eviction (write-back); the device copy stays
    Promised,   \* device slots sglang has promised a request and will allocate without asking again:
                \* the rest of a chunked prefill (its next chunk is admitted unchecked once the
                \* prefill budget is spent) or a running batch's decode; 0 = not modelled
    BUG         \* "none" or the name of one seeded defect

Bugs == {"none", "HostLockLeak", "DoubleLoad", "OrphanHost", "EvictProtected",
         "StaleNode", "NoTtl", "FreeBeforeAck", "EarlyRunnable",
         "SplitCopiesHostRef", "NoEpochCheck", "EpochReuse", "RingOverrun", "RingTwoFree",
         "KeepNoPin", "DemoteKeepsRef", "EarlyKept",
         "EarlyRelease", "RoomIgnored", "RoomEvictsProtected", "KeepFullTtl", "WarmFullTtl",
         "ParkUnprotected", "ResidentNoPin", "ClosedKeepsRef", "WriteLockFree", "PinPricedByLoad",
         "UnmirrorProtected", "UnmirrorInFlight"}

ASSUME /\ Root \notin Nodes /\ NoNode \notin Nodes /\ Root # NoNode
       /\ DevSlots \in Nat /\ HostSlots \in Nat
       /\ MaxEpoch \in Nat \ {0} /\ MaxTime \in Nat /\ TTL \in Nat /\ KeepTTL \in Nat /\ MaxResets \in Nat
       /\ EnvLocks \in BOOLEAN /\ EnvWrites \in BOOLEAN /\ Hist \in BOOLEAN
       /\ Ring \in Nat /\ SysLoads \in BOOLEAN /\ (SysLoads => Ring > 0) /\ Policy \in BOOLEAN
       /\ LazyFree \in BOOLEAN /\ Unmirror \in BOOLEAN
       /\ Promised \in 0..DevSlots
       /\ BUG \in Bugs

VARIABLES
    \* ---- radix tree (HiRadixCache) ----
    status,    \* [Nodes -> {"Unborn","InTree","Gone"}]; Gone = detached, possibly still referenced
    parent,    \* [Nodes -> Nodes \cup {Root}]; a VARIABLE because a split inserts a new prefix node
    dev,       \* [Nodes -> BOOLEAN]; node.value is not None (a device slot is held)
    host,      \* [Nodes -> BOOLEAN]; node.host_value is not None (a host slot is held)
    lockRef,   \* [Nodes -> Nat]; path lock count (inc/dec_lock_ref walk to the root)
    hostRef,   \* [Nodes -> Nat]; host_ref_counter (protect_host / release_host)
    writeKey,  \* [Nodes -> Nodes \cup {NoNode}]; ack id of the D2H write that fills this host copy
    loadKey,   \* [Nodes -> Nodes \cup {NoNode}]; ack id of the H2D load that fills this device copy
    loadAcks,  \* [Nodes -> Nat]; in-flight load acks keyed by node id (ongoing_load_back)
    extLock,   \* [Nodes -> BOOLEAN]; some other request holds a path lock ending here
    queued,    \* SUBSET Nodes: load keys enqueued by load_back whose DMA has not started (load_queue)
    ring,      \* Seq([who, keys]): started loads still in flight, oldest first; each holds one
               \* producer slot of the layer-done counter (start_loading merges the whole queue)
    devFree,   \* free device slots
    hostFree,  \* free host slots
    \* ---- toolkv manager, per session ----
    phase,     \* [Sessions -> Phases]
    ref,       \* [Sessions -> Nodes \cup {NoNode}]; the session's last node (may go stale)
    epoch,     \* [Sessions -> 0..MaxEpoch]; bumped by every successful ToolStart
    prot,      \* [Sessions -> Nodes \cup {NoNode}]; the node whose host copy this session protects
    deadline,  \* [Sessions -> 0..MaxTime]; TTL deadline of the protection
    \* ---- environment ----
    now,       \* 0..MaxTime
    resets,    \* 0..MaxResets, number of tree resets so far
    \* ---- history (for invariants over steps and for replay) ----
    act,       \* the last action with its parameters, e.g. <<"ToolStart", s>>
    tgt        \* the session-referenced nodes the last manager step acted upon

treeVars == <<status, parent, dev, host, lockRef, hostRef, writeKey, loadKey, loadAcks, extLock,
              devFree, hostFree, queued, ring>>
sessVars == <<phase, ref, epoch, prot, deadline>>
envVars  == <<now, resets>>
core     == <<treeVars, sessVars, envVars>>
vars     == <<core, act, tgt>>

\* TLC fingerprints states by this view: `act` is history only and would multiply the state
\* count by the number of distinct labels.  `tgt` stays in because NoStaleTarget reads it.
View == <<core, tgt>>

Sym == Permutations(Nodes) \cup Permutations(Sessions)

\* New: the manager has never heard of the session (no turn recorded yet); Close is refused then.
\* The per-call policy adds three phases of a paused session: Kept (its KV stays on the GPU under
\* a session pin), Prefetching (an early restore is loading it before tool_end) and Released
\* (nothing is held: the policy let it go, or demoted it from the host).
\* Handover: the tool call is over and the KV is on the GPU, pinned until the session's next
\* request has matched and locked its prefix (Admit) or the pin's TTL ends the wait.
\* Parked (load-adaptive protection): the tool call is over but its next request would wait behind
\* others, so nothing is loaded or pinned: the host copy stays protected until that request is
\* admitted (Admit: sglang's own load_back brings it in) or the TTL ends the wait.
Phases == {"New", "Running", "Offloading", "Offloaded", "Restoring", "Runnable", "Expired", "Lost", "Closed",
           "Kept", "Prefetching", "Released", "Handover", "Parked"}
\* The phases that hold a host protection (prot, host_ref_counter).
Protecting == {"Offloading", "Offloaded", "Restoring", "Prefetching", "Parked"}
\* The phases that hold a session pin: a path lock on the session's node, as a running request holds.
\* The EarlyRelease mutant is the old manager: it let go at the load ack, so its hand-over holds nothing.
Pinning == IF BUG = "EarlyRelease" THEN {"Restoring", "Prefetching", "Kept"}
           ELSE {"Restoring", "Prefetching", "Kept", "Handover"}
\* The phases the TTL applies to: a tool call whose tool_end was accepted (Restoring) is no longer
\* abandoned; its load ack ends the protection, so the sweep leaves it alone.  A kept or
\* prefetched session is still waiting for its tool_end, so the TTL bounds its pin.
\* A hand-over waits for a request that may never come: the TTL bounds it too.
Expiring == {"Offloading", "Offloaded", "Prefetching", "Kept", "Handover", "Parked"}
\* The phases whose KV a tree reset loses.
Holding == Protecting \cup {"Kept", "Handover"}
\* A paused session is resolved once it holds nothing and waits for nothing of the manager.
Settled == {"Runnable", "Expired", "Lost", "Closed", "Released"}

-----------------------------------------------------------------------------
(* Tree helpers *)

InTree == {n \in Nodes : status[n] = "InTree"}

\* n and its ancestors up to (excluding) the root.  Bounded so that it also terminates on
\* detached nodes, whose parent pointers Python keeps.
RECURSIVE PathUpTo(_, _)
PathUpTo(n, k) == IF n = Root \/ n = NoNode \/ k = 0 THEN {} ELSE {n} \cup PathUpTo(parent[n], k - 1)
Path(n) == PathUpTo(n, Cardinality(Nodes))

Kids(n) == {c \in InTree : parent[c] = n}

\* Number of keys in K whose path passes through m: the lock a set of path locks puts on m.
Through(m, K) == Cardinality({k \in K : m \in Path(k)})

\* Add d path locks for every key in K.
Locked(lr, K, d) == [m \in Nodes |-> lr[m] + d * Through(m, K)]

\* The whole path of n is on device and no load into it is in flight: a forward may read it.
PathValid(n) == IF n = Root THEN TRUE
                ELSE status[n] = "InTree" /\ \A m \in Path(n) : dev[m] /\ loadKey[m] = NoNode

WriteKeys == {writeKey[m] : m \in Nodes} \ {NoNode}

\* The tier of a node, as the manager and the metrics would report it.
Tier(n) ==
    CASE status[n] = "Unborn"                 -> "Unborn"
      [] status[n] = "Gone"                   -> "Evicted"
      [] dev[n] /\ loadKey[n] # NoNode        -> "Loading"
      [] dev[n] /\ writeKey[n] # NoNode       -> "BackingUp"
      [] dev[n]                               -> "GPU"
      [] hostRef[n] > 0                       -> "CpuProtected"
      [] OTHER                                -> "CpuUnprotected"

\* Nodes whose GPU copy the manager frees when the sessions with leaves L finish offloading:
\* walk up from each leaf, freeing a node only if it is backed up with its write acked, not
\* locked, not loading, and every child still on device is itself being freed (bottom-up,
\* device leaves only, as _evict_backuped requires).  The fixpoint is order-independent.
FreeSet(L, d, wk, lk, lr) ==
    LET Cand == UNION {Path(l) : l \in L}
        Ok(m, F) == /\ d[m] /\ host[m] /\ wk[m] = NoNode /\ lk[m] = NoNode /\ lr[m] = 0
                    /\ \A c \in Kids(m) : d[c] => c \in F
        Step(F) == F \cup {m \in Cand : Ok(m, F) /\ (m \in L \/ \E c \in F : parent[c] = m)}
        RECURSIVE Fix(_, _)
        Fix(F, k) == IF k = 0 THEN F ELSE Fix(Step(F), k - 1)
    IN Fix({}, Cardinality(Nodes))

\* The FreeBeforeAck mutant frees without waiting for the ack and ignores locks.
FreeSetNoAck(L, d) ==
    LET Cand == UNION {Path(l) : l \in L}
        Ok(m, F) == d[m] /\ host[m] /\ \A c \in Kids(m) : d[c] => c \in F
        Step(F) == F \cup {m \in Cand : Ok(m, F) /\ (m \in L \/ \E c \in F : parent[c] = m)}
        RECURSIVE Fix(_, _)
        Fix(F, k) == IF k = 0 THEN F ELSE Fix(Step(F), k - 1)
    IN Fix({}, Cardinality(Nodes))

\* Capacity decisions, named so that trace validation (TraceCheck.tla) can replace them with the
\* decisions the implementation actually took against its token-granular pools (cfg `<-`).
\* Host copies sglang's evict_host may free on demand: host-only (evict_host skips a node still on
\* device), unlocked, and no node of its subtree protected (it evicts leaves, so a protected
\* descendant keeps its ancestors).  The set is closed towards the leaves, so it can be freed
\* leaf by leaf.  A ToolStart's own path is never in it: W # {} means the leaf is on device, and
\* device copies are closed towards the root.  RoomEvictsProtected ignores the protections.
HostEvictable ==
    {m \in InTree : /\ host[m] /\ ~dev[m] /\ lockRef[m] = 0
                   /\ (BUG = "RoomEvictsProtected" \/ \A c \in InTree : m \in Path(c) => hostRef[c] = 0)}
\* Host mirrors a ToolStart of the path ending at n may drop (Unmirror): the host copy of a node on
\* the device that a request locks (the device copy cannot go while it runs), with no write or load
\* in flight on it (the host copy is a load's source, a write's target), no protection, and off n's
\* own path; closed towards the leaves over host copies (a backed-up prefix stays contiguous from
\* the root, as write_backup requires, and a protected descendant keeps its ancestors' copies).
\* UnmirrorProtected ignores protections; UnmirrorInFlight drops a copy whose write is in flight.
MirrorOk(m, n) ==
    /\ host[m] /\ dev[m] /\ lockRef[m] > 0 /\ m \notin Path(n) /\ loadKey[m] = NoNode
    /\ BUG = "UnmirrorInFlight" \/ writeKey[m] = NoNode
    /\ BUG = "UnmirrorProtected" \/ hostRef[m] = 0
MirrorRoom(n) ==
    IF ~Unmirror THEN {}
    ELSE {m \in InTree : MirrorOk(m, n) /\ \A c \in InTree : (m \in Path(c) /\ host[c]) => MirrorOk(c, n)}
\* ToolStart: the unbacked path fits on host, counting the copies evict_host can free for it and the
\* mirrors it may drop (RoomIgnored: only the free slots, the old rule that refused while HiCache could
\* make room).
HostFits(W, n) == Cardinality(W) <= hostFree + IF BUG = "RoomIgnored" THEN 0
                                                ELSE Cardinality(HostEvictable) + Cardinality(MirrorRoom(n))
\* ... but not into the free slots alone: room must be made first (HostRoom).
HostShort(W) == Cardinality(W) > hostFree
DevFits(C) == Cardinality(C) <= devFree       \* ToolEnd: the evicted path fits on device
InsertFits == devFree >= 1                    \* a turn's new leaf fits on device
WriteFits == hostFree >= 1                    \* a write-through fits on host
SplitFits(n) == (dev[n] => devFree >= 1) /\ (host[n] => hostFree >= 1)

\* The device room sglang may still take without asking anyone (its prefill budget reads it so:
\* free slots plus the evictable ones): free slots and unlocked device copies, which its eviction
\* can free leaf by leaf (a lock is a path lock, so unlocked nodes are closed towards the leaves).
RoomOf(df, d, lr) == df + Cardinality({m \in InTree : d[m] /\ lr[m] = 0})
DevRoom == RoomOf(devFree, dev, lockRef)
\* A step that leaves free slots df, device copies d and locks lr keeps sglang's promise.  Every
\* manager step that takes device room checks it (PromiseKept); so do the environment's steps,
\* whose admission counts the room live (PrefillAdder's budget), which is what the model assumes
\* of sglang: only toolkv's actions are under test.  A ToolStart's writes lock the nodes they copy
\* and their paths until the ack (write_backup's inc_lock_ref): resident unlocked copies stop
\* being evictable (WriteLockFree: the offload counts its writes as free of device room).  A
\* ToolEnd's load takes free slots and its pin locks the resident path (PinPricedByLoad: it
\* counts only the slots to load, as if the resident path stayed evictable).
PromiseFits(df, d, lr) == Promised <= RoomOf(df, d, lr)

\* The load-slot ring.  start_loading (cache_controller.py:782-835) merges the whole load queue into
\* one transfer and takes the next producer slot; update_producer (cache_controller.py:97-104)
\* asserts that slot's last-layer event has fired.  The load stream runs in order, so the slots
\* in flight are always the most recent ones: the next slot is busy exactly when all Ring are.
InFlight(k) == k \in queued \/ \E i \in 1..Len(ring) : k \in ring[i].keys
SysInFlight == Cardinality({i \in 1..Len(ring) : ring[i].who = "sys"})
StartLoad(who) == /\ ring' = Append(ring, [who |-> who, keys |-> queued])
                  /\ queued' = {}

Rec(a, t) == IF Hist THEN act' = a /\ tgt' = t ELSE UNCHANGED <<act, tgt>>

Min(a, b) == IF a < b THEN a ELSE b

\* The keep TTL: a pin the policy chose holds device memory nobody else can use, so a client that
\* vanished mid-call must not hold it for the whole TTL.  Keep arms it (KeepFullTtl: the full TTL);
\* an early restore that becomes Kept keeps the sooner of its deadline and the keep TTL
\* (WarmFullTtl: it keeps the offload's full-TTL deadline).  The sweep ends it as any deadline.
KeepFor == Min(KeepTTL, TTL)
KeepDeadline == Min(now + IF BUG = "KeepFullTtl" THEN TTL ELSE KeepFor, MaxTime)
WarmDeadline(d) == IF BUG = "WarmFullTtl" THEN d
                   ELSE IF d < now THEN now ELSE Min(d, now + KeepFor)

-----------------------------------------------------------------------------
Init ==
    /\ status = [n \in Nodes |-> "Unborn"]
    /\ parent = [n \in Nodes |-> Root]
    /\ dev = [n \in Nodes |-> FALSE]
    /\ host = [n \in Nodes |-> FALSE]
    /\ lockRef = [n \in Nodes |-> 0]
    /\ hostRef = [n \in Nodes |-> 0]
    /\ writeKey = [n \in Nodes |-> NoNode]
    /\ loadKey = [n \in Nodes |-> NoNode]
    /\ loadAcks = [n \in Nodes |-> 0]
    /\ extLock = [n \in Nodes |-> FALSE]
    /\ queued = {}
    /\ ring = <<>>
    /\ devFree = DevSlots
    /\ hostFree = HostSlots
    /\ phase = [s \in Sessions |-> "New"]
    /\ ref = [s \in Sessions |-> NoNode]
    /\ epoch = [s \in Sessions |-> 0]
    /\ prot = [s \in Sessions |-> NoNode]
    /\ deadline = [s \in Sessions |-> 0]
    /\ now = 0
    /\ resets = 0
    /\ act = <<"Init">>
    /\ tgt = {}

-----------------------------------------------------------------------------
(* Manager actions *)

\* tool_start: re-validate the session's node; back up its path root-down (write_backup needs
\* a backed-up parent; all-or-nothing against the free host slots); protect the leaf; bump
\* the epoch; arm the TTL.  If nothing is in flight, finish the offload at once.
ToolStart(s) ==
    LET n == ref[s] IN
    /\ phase[s] = "Running" /\ n # NoNode /\ epoch[s] < MaxEpoch
    /\ IF status[n] # "InTree" /\ BUG # "StaleNode"
       THEN \* stale reference: the token walk finds no live node; forget it, touch nothing
            /\ ref' = [ref EXCEPT ![s] = NoNode]
            /\ UNCHANGED <<treeVars, phase, epoch, prot, deadline, envVars>>
            /\ Rec(<<"ToolStart", s>>, {})
       ELSE
         LET W == {m \in Path(n) : ~host[m]} IN
         IF ~HostFits(W, n)
         THEN \* host pool full at write, nothing evictable: the offload is refused, nothing changes
              /\ UNCHANGED core
              /\ Rec(<<"ToolStart", s>>, {})
         ELSE IF HostShort(W)
         THEN FALSE  \* HostRoom first
         ELSE
           LET wk2 == [m \in Nodes |-> IF m \in W THEN m ELSE writeKey[m]]
               lr2 == Locked(lockRef, W, 1)
               clean == \A m \in Path(n) : wk2[m] = NoNode
               \* LazyFree: the acknowledged copies stay on device, unlocked and backed up, for
               \* GpuEvict to take when HiCache needs the room (the implementation makes them its
               \* first eviction victims); nothing is freed that the device does not need.
               F == IF BUG = "FreeBeforeAck" THEN FreeSetNoAck({n}, dev)
                    ELSE IF clean /\ ~LazyFree THEN FreeSet({n}, dev, wk2, loadKey, lr2) ELSE {}
           IN
           IF ~PromiseFits(devFree, dev, lr2) /\ BUG # "WriteLockFree"
           THEN \* the writes' locks would take device room sglang promised: refused, nothing changes
                /\ UNCHANGED core
                /\ Rec(<<"ToolStart", s>>, {})
           ELSE
           /\ host' = [m \in Nodes |-> host[m] \/ m \in W]
           /\ hostFree' = hostFree - Cardinality(W)
           /\ writeKey' = wk2
           /\ lockRef' = lr2
           /\ hostRef' = [hostRef EXCEPT ![n] = @ + 1]
           /\ dev' = [m \in Nodes |-> dev[m] /\ m \notin F]
           /\ devFree' = devFree + Cardinality(F)
           /\ prot' = [prot EXCEPT ![s] = n]
           /\ epoch' = [epoch EXCEPT ![s] = @ + 1]
           /\ deadline' = [deadline EXCEPT ![s] = Min(now + TTL, MaxTime)]
           /\ phase' = [phase EXCEPT ![s] = IF clean \/ BUG = "FreeBeforeAck" THEN "Offloaded"
                                                ELSE "Offloading"]
           /\ UNCHANGED <<status, parent, loadKey, loadAcks, extLock, queued, ring, ref, envVars>>
           /\ Rec(<<"ToolStart", s>>, {n})

\* writing_check acknowledged the D2H write with id k: clear its pending marks, drop its path
\* lock, then (manager hook) finish every offloading session whose path is now fully acked:
\* free the GPU copies bottom-up and mark it Offloaded.
WriteAck(k) ==
    /\ \E m \in Nodes : writeKey[m] = k
    /\ LET wk2 == [m \in Nodes |-> IF writeKey[m] = k THEN NoNode ELSE writeKey[m]]
           lr2 == Locked(lockRef, {k}, -1)
           Done == {s \in Sessions : phase[s] = "Offloading" /\ \A m \in Path(ref[s]) : wk2[m] = NoNode}
           F == IF LazyFree THEN {} ELSE FreeSet({ref[s] : s \in Done}, dev, wk2, loadKey, lr2)
       IN
       /\ writeKey' = wk2
       /\ lockRef' = lr2
       /\ dev' = [m \in Nodes |-> dev[m] /\ m \notin F]
       /\ devFree' = devFree + Cardinality(F)
       /\ phase' = [s \in Sessions |-> IF s \in Done THEN "Offloaded" ELSE phase[s]]
       /\ UNCHANGED <<status, parent, host, hostRef, loadKey, loadAcks, extLock, hostFree,
                      queued, ring, ref, epoch, prot, deadline, envVars>>
       /\ Rec(<<"WriteAck", k>>, {ref[s] : s \in Done})

\* The restore of n's path, loading C, keeps the promise: its loads take |C| free slots and its pin
\* (the load's lock, then the hand-over's) locks the whole path (PinPricedByLoad: only |C| counts).
RestoreFits(n, C) ==
    IF BUG = "PinPricedByLoad" THEN Promised <= DevRoom - Cardinality(C)
    ELSE PromiseFits(devFree - Cardinality(C), [m \in Nodes |-> dev[m] \/ m \in C], Locked(lockRef, {n}, 1))

\* tool_end with epoch e.  A stale epoch, or a session that is not offloading/offloaded,
\* changes nothing.  Otherwise load_back the evicted part of the path (all or nothing against
\* the free device slots).  On load-back failure the session stays Offloaded and keeps its
\* protection (the client may retry; the TTL bounds the wait).  On success the manager pins
\* the path (its own path lock) until the loads are acked; if nothing is in flight the
\* session is Runnable at once and the protection is released.
ToolEnd(s, e) ==
    LET n == ref[s]
        C == {m \in Path(n) : ~dev[m]}
    IN
    /\ phase[s] \in {"Offloading", "Offloaded", "Restoring", "Expired", "Lost", "Kept", "Prefetching", "Released"}
    /\ e \in 0..MaxEpoch
    /\ IF phase[s] \in {"Kept", "Prefetching", "Released"} /\ e = epoch[s]
       THEN \* Kept: drop the pin, the path is resident.  Prefetching: the early restore becomes the
            \* restore (its pin and protection stay until LoadAck).  Released: nothing is held; the
            \* KV is wherever HiCache left it, and the next turn recomputes what is missing.
            \* Kept: the pin stays until the next request holds the path (Handover).
            /\ phase' = [phase EXCEPT ![s] = CASE phase[s] = "Kept" -> "Handover"
                                                [] phase[s] = "Prefetching" -> "Restoring"
                                                [] OTHER -> "Running"]
            /\ lockRef' = IF phase[s] = "Kept" /\ BUG = "EarlyRelease" THEN Locked(lockRef, {n}, -1)
                          ELSE lockRef
            /\ deadline' = IF phase[s] = "Kept" THEN [deadline EXCEPT ![s] = Min(now + TTL, MaxTime)]
                           ELSE deadline
            /\ UNCHANGED <<status, parent, dev, host, hostRef, writeKey, loadKey, loadAcks, extLock,
                           devFree, hostFree, queued, ring, ref, epoch, prot, envVars>>
            /\ Rec(<<"ToolEnd", s, e>>, IF phase[s] = "Released" THEN {} ELSE {n})
       ELSE IF phase[s] \in {"Offloading", "Offloaded"} /\ (e = epoch[s] \/ BUG = "NoEpochCheck")
       THEN IF ~DevFits(C) \/ (BUG = "RingOverrun" /\ C # {} /\ Len(ring) >= Ring) \/ ~RestoreFits(n, C)
            THEN \* load-back failure (no device memory)
                 /\ IF BUG = "HostLockLeak"
                    THEN \* the session is given up but its host_ref is never released
                         /\ phase' = [phase EXCEPT ![s] = "Expired"]
                         /\ UNCHANGED <<treeVars, ref, epoch, prot, deadline, envVars>>
                    ELSE UNCHANGED core
                 /\ Rec(<<"ToolEnd", s, e>>, {n})
            ELSE
              LET lk2 == [m \in Nodes |-> IF m \in C THEN n ELSE loadKey[m]]
                  loads == IF C = {} THEN 0 ELSE 1
                  ready == \A m \in Path(n) : lk2[m] = NoNode
                  runnable == ready \/ BUG = "EarlyRunnable"
                  \* the pin is held through the load and the hand-over alike; also when nothing
                  \* is to load (ResidentNoPin: "the path is resident, nothing to hold" -- the usual
                  \* case with LazyFree, and HiCache may evict the path before the next request)
                  pin == IF runnable /\ (BUG = "EarlyRelease" \/ (BUG = "ResidentNoPin" /\ C = {}))
                         THEN 0 ELSE 1
              IN
              /\ dev' = [m \in Nodes |-> dev[m] \/ m \in C]
              /\ devFree' = devFree - Cardinality(C)
              /\ loadKey' = lk2
              /\ loadAcks' = [loadAcks EXCEPT ![n] = @ + loads]
              /\ lockRef' = Locked(lockRef, {n}, loads + pin)
              /\ phase' = [phase EXCEPT ![s] = IF runnable THEN "Handover" ELSE "Restoring"]
              /\ prot' = [prot EXCEPT ![s] = IF runnable THEN NoNode ELSE n]
              /\ hostRef' = [hostRef EXCEPT ![n] = IF runnable THEN @ - 1 ELSE @]
              /\ deadline' = IF runnable THEN [deadline EXCEPT ![s] = Min(now + TTL, MaxTime)] ELSE deadline
              \* load_back only enqueues; the DMA starts when a producer slot is taken (StartLoads,
              \* SysStart).  The RingOverrun mutant is the old code: start at once, in the request
              \* handler, checking only that the next slot is free.
              /\ IF Ring = 0 \/ C = {} THEN UNCHANGED <<queued, ring>>
                 ELSE IF BUG = "RingOverrun"
                      THEN /\ ring' = Append(ring, [who |-> "tkv", keys |-> queued \cup {n}])
                           /\ queued' = {}
                      ELSE /\ queued' = queued \cup {n}
                           /\ UNCHANGED ring
              /\ UNCHANGED <<status, parent, host, writeKey, extLock, hostFree, ref, epoch, envVars>>
              /\ Rec(<<"ToolEnd", s, e>>, {n})
       ELSE IF BUG = "DoubleLoad" /\ phase[s] = "Restoring" /\ e = epoch[s] /\ loadKey[n] # NoNode
       THEN \* a retried tool_end issues a second load for a node whose load is still in flight
            /\ loadAcks' = [loadAcks EXCEPT ![n] = @ + 1]
            /\ lockRef' = Locked(lockRef, {n}, 1)
            /\ UNCHANGED <<status, parent, dev, host, hostRef, writeKey, loadKey, extLock, devFree,
                           hostFree, queued, ring, sessVars, envVars>>
            /\ Rec(<<"ToolEnd", s, e>>, {n})
       ELSE /\ UNCHANGED core
            /\ Rec(<<"ToolEnd", s, e>>, {})

\* loading_check acknowledged the H2D load with id k: the loaded nodes become readable, the
\* load's path lock is dropped, and (manager hook) every restoring session whose whole path is
\* now readable is handed over: its pin stays until its next request holds the path (Admit),
\* its protection is returned (evict_host never frees a copy still on device, so the pin keeps
\* the host copy too).
LoadAck(k) ==
    /\ loadAcks[k] > 0
    /\ ~InFlight(k)
    /\ LET la2 == [loadAcks EXCEPT ![k] = @ - 1]
           lk2 == IF la2[k] = 0 THEN [m \in Nodes |-> IF loadKey[m] = k THEN NoNode ELSE loadKey[m]]
                  ELSE loadKey
           Loaded(s) == \A m \in Path(ref[s]) : dev[m] /\ lk2[m] = NoNode
           Done == {s \in Sessions : phase[s] = "Restoring" /\ Loaded(s)}
           \* an early restore that is readable now: Kept until its tool_end (EarlyKept: any ack)
           Warm == {s \in Sessions : phase[s] = "Prefetching" /\ (Loaded(s) \/ BUG = "EarlyKept")}
           \* EarlyRelease (the old manager) drops the restoring session's pin here
           pins == [m \in Nodes |-> IF BUG = "EarlyRelease" THEN Cardinality({s \in Done : m \in Path(ref[s])})
                                   ELSE 0]
       IN
       /\ loadAcks' = la2
       /\ loadKey' = lk2
       /\ lockRef' = [m \in Nodes |-> lockRef[m] - Through(m, {k}) - pins[m]]
       /\ phase' = [s \in Sessions |-> IF s \in Done THEN "Handover"
                                       ELSE IF s \in Warm THEN "Kept" ELSE phase[s]]
       /\ prot' = [s \in Sessions |-> IF s \in Done \cup Warm THEN NoNode ELSE prot[s]]
       /\ hostRef' = [m \in Nodes |-> hostRef[m] - Cardinality({s \in Done \cup Warm : prot[s] = m})]
       /\ deadline' = [s \in Sessions |-> IF s \in Done THEN Min(now + TTL, MaxTime)
                                          ELSE IF s \in Warm THEN WarmDeadline(deadline[s])
                                          ELSE deadline[s]]
       /\ UNCHANGED <<status, parent, dev, host, writeKey, extLock, devFree, hostFree,
                      queued, ring, ref, epoch, envVars>>
       /\ Rec(<<"LoadAck", k>>, {ref[s] : s \in Done \cup Warm})

\* The manager's tick starts the queued loads, only when no load at all is in flight: then the
\* ring has Ring - 1 free slots after this start, and sglang's own cadence (SysStart) can never
\* come round to a busy slot.  The RingTwoFree mutant starts when the next two slots are free,
\* the tempting "account for the ring" rule that TLC shows is not enough.
StartLoads ==
    /\ Ring > 0 /\ queued # {}
    /\ IF BUG = "RingTwoFree" THEN Len(ring) <= Ring - 2 ELSE ring = <<>>
    /\ StartLoad("tkv")
    /\ UNCHANGED <<status, parent, dev, host, lockRef, hostRef, writeKey, loadKey, loadAcks, extLock,
                   devFree, hostFree, sessVars, envVars>>
    /\ Rec(<<"StartLoads">>, {})

\* Release everything the sessions S hold: their protections and their pins.
Released(S) ==
    /\ prot' = [s \in Sessions |-> IF s \in S THEN NoNode ELSE prot[s]]
    /\ hostRef' = [m \in Nodes |-> hostRef[m] - Cardinality({s \in S : prot[s] = m})]
    /\ lockRef' = [m \in Nodes |->
                     lockRef[m] - Cardinality({s \in S : phase[s] \in Pinning /\ m \in Path(ref[s])})]

\* The periodic sweep (driven from the scheduler loop): every protection past its deadline whose
\* tool_end has not been accepted is released and its session expires.
TtlSweep ==
    LET Due == {s \in Sessions : phase[s] \in Expiring /\ deadline[s] <= now} IN
    /\ BUG # "NoTtl"
    /\ Due # {}
    /\ Released(Due)
    \* an expired hand-over leaves the KV on the GPU, unpinned: the session is simply runnable; so
    \* does an expired park (its tool call is over; the KV is wherever HiCache keeps it)
    /\ phase' = [s \in Sessions |-> IF s \in Due THEN IF phase[s] \in {"Handover", "Parked"} THEN "Runnable"
                                                    ELSE "Expired"
                                    ELSE phase[s]]
    /\ epoch' = IF BUG = "EpochReuse" THEN [s \in Sessions |-> IF s \in Due THEN 0 ELSE epoch[s]]
                ELSE epoch
    /\ UNCHANGED <<status, parent, dev, host, writeKey, loadKey, loadAcks, extLock, devFree, hostFree,
                   queued, ring, ref, deadline, envVars>>
    /\ Rec(<<"TtlSweep">>, {IF prot[s] # NoNode THEN prot[s] ELSE ref[s] : s \in Due})

-----------------------------------------------------------------------------
(* The per-call policy (docs/policy.md).  Which action runs at a tool_start, and when a demotion or
   an early restore happens, is the policy's choice from durations, sizes and pressure; the spec
   leaves every choice open, so each of them is checked. *)

\* tool_start, keep: the session's KV stays on the GPU.  Its path must be resident and readable;
\* the session pins it (one path lock) until tool_end, the keep TTL or close.
Keep(s) ==
    LET n == ref[s] IN
    /\ Policy /\ phase[s] = "Running" /\ n # NoNode /\ epoch[s] < MaxEpoch
    /\ PathValid(n)
    /\ PromiseFits(devFree, dev, Locked(lockRef, {n}, 1))
    /\ lockRef' = IF BUG = "KeepNoPin" THEN lockRef ELSE Locked(lockRef, {n}, 1)
    /\ epoch' = [epoch EXCEPT ![s] = @ + 1]
    /\ deadline' = [deadline EXCEPT ![s] = KeepDeadline]
    /\ phase' = [phase EXCEPT ![s] = "Kept"]
    /\ UNCHANGED <<status, parent, dev, host, hostRef, writeKey, loadKey, loadAcks, extLock, devFree,
                   hostFree, queued, ring, ref, prot, envVars>>
    /\ Rec(<<"Keep", s>>, {n})

\* tool_start, let go: nothing is held; the tool call still gets its epoch (tool_end fencing).
LetGo(s) ==
    /\ Policy /\ phase[s] = "Running" /\ epoch[s] < MaxEpoch
    /\ epoch' = [epoch EXCEPT ![s] = @ + 1]
    /\ phase' = [phase EXCEPT ![s] = "Released"]
    /\ UNCHANGED <<treeVars, ref, prot, deadline, envVars>>
    /\ Rec(<<"LetGo", s>>, {})

\* The host budget is reached: an offloaded session is demoted.  Its protection is released, so
\* HiCache may evict its host copy; the next turn then recomputes, never reads it as protected.
Demote(s) ==
    /\ Policy /\ phase[s] = "Offloaded"
    /\ IF BUG = "DemoteKeepsRef" THEN UNCHANGED <<prot, hostRef, lockRef>> ELSE Released({s})
    /\ phase' = [phase EXCEPT ![s] = "Released"]
    /\ UNCHANGED <<status, parent, dev, host, writeKey, loadKey, loadAcks, extLock, devFree, hostFree,
                   queued, ring, ref, epoch, deadline, envVars>>
    /\ Rec(<<"Demote", s>>, {prot[s]})

\* Early restore: before tool_end, load the evicted part of an offloaded session's path (as
\* ToolEnd does; refused, i.e. not taken, when it does not fit).  The session pins the path and
\* keeps its protection until the load is acknowledged, then it is Kept until its tool_end; the
\* TTL still applies, so an early restore never outlives its tool call, and once Kept it waits at
\* most the keep TTL, as a kept session does.
Prefetch(s) ==
    LET n == ref[s]
        C == {m \in Path(n) : ~dev[m]}
        lk2 == [m \in Nodes |-> IF m \in C THEN n ELSE loadKey[m]]
        loads == IF C = {} THEN 0 ELSE 1
        \* EarlyKept: Kept at once, with the load still in flight
        ready == (\A m \in Path(n) : lk2[m] = NoNode) \/ BUG = "EarlyKept"
    IN
    /\ Policy /\ phase[s] = "Offloaded"
    /\ DevFits(C)
    /\ RestoreFits(n, C)
    /\ dev' = [m \in Nodes |-> dev[m] \/ m \in C]
    /\ devFree' = devFree - Cardinality(C)
    /\ loadKey' = lk2
    /\ loadAcks' = [loadAcks EXCEPT ![n] = @ + loads]
    /\ lockRef' = Locked(lockRef, {n}, loads + 1)
    /\ phase' = [phase EXCEPT ![s] = IF ready THEN "Kept" ELSE "Prefetching"]
    /\ prot' = [prot EXCEPT ![s] = IF ready THEN NoNode ELSE n]
    /\ hostRef' = [hostRef EXCEPT ![n] = IF ready THEN @ - 1 ELSE @]
    /\ IF Ring = 0 \/ C = {} THEN UNCHANGED <<queued, ring>>
       ELSE /\ queued' = queued \cup {n}
            /\ UNCHANGED ring
    /\ deadline' = IF ready THEN [deadline EXCEPT ![s] = WarmDeadline(@)] ELSE deadline
    /\ UNCHANGED <<status, parent, host, writeKey, extLock, hostFree, ref, epoch, envVars>>
    /\ Rec(<<"Prefetch", s>>, {n})

\* tool_start found the host short of free slots for the session's unbacked path, but HiCache can
\* free enough unprotected host copies (HostFits): the manager has sglang's evict_host free one
\* evictable host leaf m, as HostEvict would.  Repeated until ToolStart fits the free slots.
HostRoom(s, m) ==
    LET n == ref[s]
        W == {x \in Path(n) : ~host[x]}
    IN
    /\ phase[s] = "Running" /\ n # NoNode /\ status[n] = "InTree" /\ epoch[s] < MaxEpoch
    /\ HostShort(W) /\ HostFits(W, n)
    /\ m \in HostEvictable /\ Kids(m) = {}
    /\ status' = [status EXCEPT ![m] = "Gone"]
    /\ host' = [host EXCEPT ![m] = FALSE]
    /\ hostFree' = hostFree + 1
    /\ UNCHANGED <<queued, ring, parent, dev, lockRef, hostRef, writeKey, loadKey, loadAcks, extLock, devFree,
                   sessVars, envVars>>
    /\ Rec(<<"HostRoom", s, m>>, {})

\* ...or, once no evictable host copy is left, has one mirror m dropped (Unmirror): the host copy of
\* a node a running request locks on the device, a leaf of the host copies (its children have
\* none).  The node stays in the tree on the device; sglang writes its host copy again when the
\* request finishes (write_through's hit at insert) or when eviction would drop it (write_back).
HostUnmirror(s, m) ==
    LET n == ref[s]
        W == {x \in Path(n) : ~host[x]}
    IN
    /\ Unmirror /\ phase[s] = "Running" /\ n # NoNode /\ status[n] = "InTree" /\ epoch[s] < MaxEpoch
    /\ HostShort(W) /\ HostFits(W, n) /\ HostEvictable = {}
    /\ m \in MirrorRoom(n) /\ \A c \in Kids(m) : ~host[c]
    /\ host' = [host EXCEPT ![m] = FALSE]
    /\ hostFree' = hostFree + 1
    /\ UNCHANGED <<queued, ring, status, parent, dev, lockRef, hostRef, writeKey, loadKey, loadAcks, extLock,
                   devFree, sessVars, envVars>>
    /\ Rec(<<"HostUnmirror", s, m>>, {})

\* The session's next request is admitted (the scheduler's hook after PrefillAdder matched and
\* locked its prefix): the request's own lock now holds the path, so the hand-over's pin goes.
\* A parked session's request is admitted the way sglang admits any request with a host hit:
\* init_load_back loads the evicted part of the path if the device can take it (the load and the
\* request's lock hold the path), else the request recomputes it and locks only its device
\* prefix. Either way the request no longer needs toolkv, and the protection goes.
\* With the ring (Ring > 0) the load is the request's own batch's, as in SysStart: PrefillAdder's
\* init_load_back and the ready_to_load_host_cache that gives the batch its consumer index run
\* in one step of the scheduler (get_new_batch_prefill), so the batch starts the whole queue,
\* toolkv's queued loads included, in one slot of its own ("sys"), at sglang's cadence (at most
\* one of its own loads in flight: the batch before last has finished).  No scheduler step lies
\* between the two calls, so the load is never left queued for StartLoads (toolkv's tick).
Admit(s) ==
    LET n == ref[s] IN
    IF phase[s] = "Parked"
    THEN LET C == {m \in Path(n) : ~dev[m]}
             loads == IF C = {} THEN 0 ELSE 1
         IN
         \* another session's load may be in flight on the path (a prefetch of a longer path
         \* through this one): sglang's match sees those nodes on the device and the request's
         \* forward waits for the load, so C holds only nodes nobody is loading
         /\ n # NoNode /\ status[n] = "InTree" /\ ~extLock[n]
         /\ prot' = [prot EXCEPT ![s] = NoNode]
         /\ hostRef' = IF prot[s] # NoNode THEN [hostRef EXCEPT ![prot[s]] = @ - 1] ELSE hostRef
         /\ phase' = [phase EXCEPT ![s] = "Runnable"]
         /\ IF DevFits(C) /\ PromiseFits(devFree - Cardinality(C), [m \in Nodes |-> dev[m] \/ m \in C],
                                          Locked(lockRef, {n}, 1))
            THEN /\ dev' = [m \in Nodes |-> dev[m] \/ m \in C]
                 /\ devFree' = devFree - Cardinality(C)
                 /\ loadKey' = [m \in Nodes |-> IF m \in C THEN n ELSE loadKey[m]]
                 /\ loadAcks' = [loadAcks EXCEPT ![n] = @ + loads]
                 /\ lockRef' = Locked(lockRef, {n}, 1 + loads)
                 /\ extLock' = [extLock EXCEPT ![n] = TRUE]
                 /\ IF Ring = 0 \/ C = {} THEN UNCHANGED <<queued, ring>>
                    ELSE /\ SysInFlight <= 1
                         /\ ring' = Append(ring, [who |-> "sys", keys |-> queued \cup {n}])
                         /\ queued' = {}
            ELSE UNCHANGED <<dev, devFree, loadKey, loadAcks, lockRef, extLock, queued, ring>>
         /\ UNCHANGED <<status, parent, host, writeKey, hostFree, ref, epoch, deadline, envVars>>
         /\ Rec(<<"Admit", s>>, {n})
    ELSE
    /\ phase[s] = "Handover" /\ n # NoNode /\ PathValid(n) /\ ~extLock[n]
    /\ extLock' = [extLock EXCEPT ![n] = TRUE]
    /\ lockRef' = IF BUG = "EarlyRelease" THEN Locked(lockRef, {n}, 1) ELSE lockRef
    /\ phase' = [phase EXCEPT ![s] = "Runnable"]
    /\ UNCHANGED <<status, parent, dev, host, hostRef, writeKey, loadKey, loadAcks, devFree, hostFree,
                   queued, ring, ref, epoch, prot, deadline, envVars>>
    /\ Rec(<<"Admit", s>>, {n})

\* Load-adaptive protection.  tool_end with the current epoch, when the session's next request
\* would wait behind others (which requests queue is the scheduler's, so the spec leaves the choice
\* open): nothing is loaded or pinned; the host copy stays protected until the request is admitted
\* (Admit) or the TTL ends the wait.  A write still in flight finishes and frees nothing (WriteAck
\* frees only Offloading sessions' copies).  ParkUnprotected: the protection is dropped at the park,
\* so HiCache may evict the host copy while the request waits (ParkedKeepsKV).
Park(s, e) ==
    /\ Policy /\ phase[s] \in {"Offloading", "Offloaded"} /\ e = epoch[s]
    /\ phase' = [phase EXCEPT ![s] = "Parked"]
    /\ deadline' = [deadline EXCEPT ![s] = Min(now + TTL, MaxTime)]
    /\ IF BUG = "ParkUnprotected"
       THEN /\ prot' = [prot EXCEPT ![s] = NoNode]
            /\ hostRef' = [hostRef EXCEPT ![prot[s]] = @ - 1]
       ELSE UNCHANGED <<prot, hostRef>>
    /\ UNCHANGED <<status, parent, dev, host, lockRef, writeKey, loadKey, loadAcks, extLock, devFree,
                   hostFree, queued, ring, ref, epoch, envVars>>
    /\ Rec(<<"Park", s, e>>, {ref[s]})

\* The room is needed (queued requests need what the hand-over pins hold): the pin goes.  A path
\* backed up on host whole is protected there again (Parked: its admission loads whatever sglang
\* evicts meanwhile); one that is not (a kept path never written) is simply Runnable.
Unpin(s) ==
    LET n == ref[s]
        backed == \A m \in Path(n) : host[m]
    IN
    /\ Policy /\ BUG # "EarlyRelease" /\ phase[s] = "Handover"
    /\ lockRef' = Locked(lockRef, {n}, -1)
    /\ phase' = [phase EXCEPT ![s] = IF backed THEN "Parked" ELSE "Runnable"]
    /\ prot' = [prot EXCEPT ![s] = IF backed THEN n ELSE NoNode]
    /\ hostRef' = IF backed THEN [hostRef EXCEPT ![n] = @ + 1] ELSE hostRef
    /\ deadline' = IF backed THEN [deadline EXCEPT ![s] = Min(now + TTL, MaxTime)] ELSE deadline
    /\ UNCHANGED <<status, parent, dev, host, writeKey, loadKey, loadAcks, extLock, devFree, hostFree,
                   queued, ring, ref, epoch, envVars>>
    /\ Rec(<<"Unpin", s>>, {n})

\* The client closes the session (or it is dropped): release whatever it holds.
Close(s) ==
    /\ phase[s] \notin {"New", "Closed"}
    /\ Released({s})
    /\ phase' = [phase EXCEPT ![s] = "Closed"]
    \* The record stays (kv_meta, the epoch fence) but lets go of its node: a reference would keep
    \* the node, and every evicted ancestor through its parent link, alive for as long as the record
    \* is remembered (ClosedKeepsRef: the closed history held the whole path of every closed session).
    /\ ref' = IF BUG = "ClosedKeepsRef" THEN ref ELSE [ref EXCEPT ![s] = NoNode]
    /\ UNCHANGED <<status, parent, dev, host, writeKey, loadKey, loadAcks, extLock, devFree, hostFree,
                   queued, ring, epoch, deadline, envVars>>
    /\ Rec(<<"Close", s>>, ({prot[s]} \cup IF phase[s] \in Pinning THEN {ref[s]} ELSE {}) \ {NoNode})

-----------------------------------------------------------------------------
(* Environment actions: what the rest of SGLang does concurrently *)

\* Another request matches the prefix ending at n and locks it while it runs.
Lock(n) ==
    /\ EnvLocks /\ n \in InTree /\ ~extLock[n] /\ PathValid(n)
    /\ PromiseFits(devFree, dev, Locked(lockRef, {n}, 1))   \* sglang's admission counts the lock
    /\ extLock' = [extLock EXCEPT ![n] = TRUE]
    /\ lockRef' = Locked(lockRef, {n}, 1)
    /\ UNCHANGED <<queued, ring, status, parent, dev, host, hostRef, writeKey, loadKey, loadAcks, devFree, hostFree,
                   sessVars, envVars>>
    /\ Rec(<<"Lock", n>>, {})

Unlock(n) ==
    /\ extLock[n]
    /\ extLock' = [extLock EXCEPT ![n] = FALSE]
    /\ lockRef' = Locked(lockRef, {n}, -1)
    /\ UNCHANGED <<queued, ring, status, parent, dev, host, hostRef, writeKey, loadKey, loadAcks, devFree, hostFree,
                   sessVars, envVars>>
    /\ Rec(<<"Unlock", n>>, {})

\* Device eviction of an unlocked device leaf: a backed-up node stays in the tree host-only
\* (_evict_backuped), any other node is deleted (_evict_regular).
GpuEvict(n) ==
    /\ n \in InTree /\ dev[n] /\ lockRef[n] = 0
    /\ writeKey[n] = NoNode /\ loadKey[n] = NoNode
    /\ \A c \in Kids(n) : ~dev[c]
    /\ dev' = [dev EXCEPT ![n] = FALSE]
    /\ devFree' = devFree + 1
    /\ IF ~host[n] \/ (BUG = "OrphanHost" /\ Kids(n) = {})
       THEN status' = [status EXCEPT ![n] = "Gone"]   \* OrphanHost: the host copy leaks
       ELSE UNCHANGED status
    /\ UNCHANGED <<queued, ring, parent, host, lockRef, hostRef, writeKey, loadKey, loadAcks, extLock, hostFree,
                   sessVars, envVars>>
    /\ Rec(<<"GpuEvict", n>>, {})

\* evict_host: a host-only leaf (no child in the tree), unlocked and unprotected, is deleted
\* and its host slot freed.
HostEvict(n) ==
    /\ n \in InTree /\ host[n] /\ ~dev[n] /\ Kids(n) = {} /\ lockRef[n] = 0
    /\ IF BUG = "EvictProtected" THEN TRUE ELSE hostRef[n] = 0
    /\ status' = [status EXCEPT ![n] = "Gone"]
    /\ host' = [host EXCEPT ![n] = FALSE]
    /\ hostFree' = hostFree + 1
    /\ UNCHANGED <<queued, ring, parent, dev, lockRef, hostRef, writeKey, loadKey, loadAcks, extLock, devFree,
                   sessVars, envVars>>
    /\ Rec(<<"HostEvict", n>>, {})

\* HiCache's write-through: write_backup of a device node whose parent is backed up.
WriteThrough(n) ==
    /\ EnvWrites /\ n \in InTree /\ dev[n] /\ ~host[n] /\ loadKey[n] = NoNode
    /\ IF parent[n] = Root THEN TRUE ELSE host[parent[n]]
    /\ WriteFits
    /\ PromiseFits(devFree, dev, Locked(lockRef, {n}, 1))   \* sglang's own write, of its own node
    /\ host' = [host EXCEPT ![n] = TRUE]
    /\ hostFree' = hostFree - 1
    /\ writeKey' = [writeKey EXCEPT ![n] = n]
    /\ lockRef' = Locked(lockRef, {n}, 1)
    /\ UNCHANGED <<queued, ring, status, parent, dev, hostRef, loadKey, loadAcks, extLock, devFree, sessVars, envVars>>
    /\ Rec(<<"WriteThrough", n>>, {})

\* A diverging insert splits n: the fresh node m becomes n's prefix, between n and its parent.
\* n keeps its identity (the suffix).  m copies lock_ref and the in-flight marks but NOT
\* host_ref_counter.  Slot abstraction: every node holds one slot per tier, so the split
\* needs a free slot wherever n has a copy.
Split(n, m) ==
    /\ n \in InTree /\ status[m] = "Unborn"
    /\ SplitFits(n)
    \* the slot abstraction's extra device slot for the new prefix (a real split allocates none)
    /\ (Promised > 0 /\ dev[n] /\ lockRef[n] > 0) => Promised <= DevRoom - 1
    /\ status' = [status EXCEPT ![m] = "InTree"]
    /\ parent' = [parent EXCEPT ![m] = parent[n], ![n] = m]
    /\ dev' = [dev EXCEPT ![m] = dev[n]]
    /\ host' = [host EXCEPT ![m] = host[n]]
    /\ lockRef' = [lockRef EXCEPT ![m] = lockRef[n]]
    /\ hostRef' = [hostRef EXCEPT ![m] = IF BUG = "SplitCopiesHostRef" THEN hostRef[n] ELSE 0]
    /\ writeKey' = [writeKey EXCEPT ![m] = writeKey[n]]
    /\ loadKey' = [loadKey EXCEPT ![m] = loadKey[n]]
    /\ devFree' = devFree - (IF dev[n] THEN 1 ELSE 0)
    /\ hostFree' = hostFree - (IF host[n] THEN 1 ELSE 0)
    /\ UNCHANGED <<queued, ring, loadAcks, extLock, sessVars, envVars>>
    /\ Rec(<<"Split", n, m>>, {})

\* Session s's turn finishes (cache_finished_req): its new leaf n lands under p, on device. A
\* session whose offload expired, or was lost with the tree, simply continues with a new turn.
Insert(s, p, n) ==
    /\ phase[s] \in {"New", "Running", "Runnable", "Expired", "Lost", "Released"}
    /\ status[n] = "Unborn"
    /\ PathValid(p)
    /\ InsertFits
    /\ status' = [status EXCEPT ![n] = "InTree"]
    /\ parent' = [parent EXCEPT ![n] = p]
    /\ dev' = [dev EXCEPT ![n] = TRUE]
    /\ devFree' = devFree - 1
    /\ ref' = [ref EXCEPT ![s] = n]
    /\ phase' = [phase EXCEPT ![s] = "Running"]
    /\ UNCHANGED <<queued, ring, host, lockRef, hostRef, writeKey, loadKey, loadAcks, extLock, hostFree,
                   epoch, prot, deadline, envVars>>
    /\ Rec(<<"Insert", s, p, n>>, {})

\* flush_cache (only on a fully idle scheduler): a new tree.  The manager's reset hook drops every
\* protection and pin without releasing (the objects are gone) and marks offloaded and kept
\* sessions Lost; running sessions keep their now stale reference and must re-resolve it.
TreeReset ==
    /\ resets < MaxResets
    /\ \A n \in Nodes : ~extLock[n]
    \* flush_cache needs is_fully_idle (scheduler.py:3686-3730): no request runs, no DMA in
    \* flight, and no write-through or load-back pending (ongoing_write_through and
    \* ongoing_load_back empty; load_back enters the latter when it queues)
    /\ ring = <<>>
    /\ WriteKeys = {}
    /\ \A k \in Nodes : loadAcks[k] = 0
    /\ queued' = {}                \* controller.reset clears the load queue
    /\ status' = [n \in Nodes |-> IF status[n] = "InTree" THEN "Gone" ELSE status[n]]
    /\ dev' = [n \in Nodes |-> FALSE]
    /\ host' = [n \in Nodes |-> FALSE]
    /\ lockRef' = [n \in Nodes |-> 0]
    /\ hostRef' = [n \in Nodes |-> 0]
    /\ writeKey' = [n \in Nodes |-> NoNode]
    /\ loadKey' = [n \in Nodes |-> NoNode]
    /\ loadAcks' = [n \in Nodes |-> 0]
    /\ devFree' = DevSlots
    /\ hostFree' = HostSlots
    /\ phase' = [s \in Sessions |-> IF phase[s] \in Holding THEN "Lost" ELSE phase[s]]
    /\ prot' = [s \in Sessions |-> NoNode]
    /\ resets' = resets + 1
    /\ UNCHANGED <<parent, extLock, ring, ref, epoch, deadline, now>>
    /\ Rec(<<"TreeReset">>, {})

\* sglang builds a prefill batch with host hits of its own and calls ready_to_load_host_cache
\* (scheduler.py:3064-3068): the whole queue, toolkv's loads included, is started in one slot.
\* sglang never checks the ring; its cadence keeps it safe on its own: the batch that consumed
\* the load before last has finished (overlap scheduling keeps one batch in flight), so at most
\* one of its own loads is still running.  That cadence is the guard here, not a check.
SysStart ==
    /\ SysLoads /\ SysInFlight <= 1
    /\ StartLoad("sys")
    /\ UNCHANGED <<status, parent, dev, host, lockRef, hostRef, writeKey, loadKey, loadAcks, extLock,
                   devFree, hostFree, sessVars, envVars>>
    /\ Rec(<<"SysStart">>, {})

\* The oldest started load finishes its last layer: its producer slot is free again.
RingDone ==
    /\ ring # <<>>
    /\ ring' = Tail(ring)
    /\ UNCHANGED <<status, parent, dev, host, lockRef, hostRef, writeKey, loadKey, loadAcks, extLock,
                   queued, devFree, hostFree, sessVars, envVars>>
    /\ Rec(<<"RingDone">>, {})

Tick ==
    /\ now < MaxTime
    /\ now' = now + 1
    /\ UNCHANGED <<treeVars, sessVars, resets>>
    /\ Rec(<<"Tick">>, {})

-----------------------------------------------------------------------------
ManagerNext ==
    \/ \E s \in Sessions : ToolStart(s) \/ Close(s)
    \/ \E s \in Sessions : Keep(s) \/ LetGo(s) \/ Demote(s) \/ Prefetch(s) \/ Unpin(s)
    \/ \E s \in Sessions, e \in 1..MaxEpoch : Park(s, e)
    \/ \E s \in Sessions, m \in Nodes : HostRoom(s, m) \/ HostUnmirror(s, m)
    \/ \E s \in Sessions, e \in 0..MaxEpoch : ToolEnd(s, e)
    \/ \E k \in Nodes : WriteAck(k) \/ LoadAck(k)
    \/ TtlSweep
    \/ StartLoads

EnvNext ==
    \/ \E n \in Nodes : Lock(n) \/ Unlock(n) \/ GpuEvict(n) \/ HostEvict(n) \/ WriteThrough(n)
    \/ \E n, m \in Nodes : Split(n, m)
    \/ \E s \in Sessions, p \in Nodes \cup {Root}, n \in Nodes : Insert(s, p, n)
    \/ \E s \in Sessions : Admit(s)
    \/ TreeReset
    \/ SysStart \/ RingDone
    \/ Tick

Next == ManagerNext \/ EnvNext

\* Acks, the clock and the sweep are fair; tool_end is not (clients may vanish).
Fairness ==
    /\ \A k \in Nodes : WF_vars(WriteAck(k)) /\ WF_vars(LoadAck(k))
    /\ WF_vars(Tick)
    /\ WF_vars(TtlSweep)
    /\ WF_vars(StartLoads) /\ WF_vars(RingDone)

Spec == Init /\ [][Next]_vars
LiveSpec == Spec /\ Fairness

-----------------------------------------------------------------------------
(* Invariants *)

TypeOK ==
    /\ status \in [Nodes -> {"Unborn", "InTree", "Gone"}]
    /\ parent \in [Nodes -> Nodes \cup {Root}]
    /\ dev \in [Nodes -> BOOLEAN]
    /\ host \in [Nodes -> BOOLEAN]
    /\ lockRef \in [Nodes -> Nat]
    /\ hostRef \in [Nodes -> Nat]
    /\ writeKey \in [Nodes -> Nodes \cup {NoNode}]
    /\ loadKey \in [Nodes -> Nodes \cup {NoNode}]
    /\ loadAcks \in [Nodes -> Nat]
    /\ extLock \in [Nodes -> BOOLEAN]
    /\ queued \subseteq Nodes
    /\ ring \in Seq([who : {"tkv", "sys"}, keys : SUBSET Nodes])
    /\ devFree \in 0..DevSlots
    /\ hostFree \in 0..HostSlots
    /\ phase \in [Sessions -> Phases]
    /\ ref \in [Sessions -> Nodes \cup {NoNode}]
    /\ epoch \in [Sessions -> 0..MaxEpoch]
    /\ prot \in [Sessions -> Nodes \cup {NoNode}]
    /\ deadline \in [Sessions -> 0..MaxTime]
    /\ now \in 0..MaxTime
    /\ resets \in 0..MaxResets

\* Every slot is either free or held by exactly one copy (no leak, no double free).
SlotAccounting ==
    /\ devFree + Cardinality({n \in Nodes : dev[n]}) = DevSlots
    /\ hostFree + Cardinality({n \in Nodes : host[n]}) = HostSlots

\* The tree is a tree, device copies are closed towards the root (only device leaves are ever
\* freed), host copies are closed towards the root (write_backup is root-down), and a node in
\* the tree has at least one copy.
TreeShape ==
    \A n \in InTree :
        /\ parent[n] = Root \/ parent[n] \in InTree
        /\ n \notin Path(parent[n])
        /\ dev[n] \/ host[n]
        /\ parent[n] # Root => (dev[n] => dev[parent[n]]) /\ (host[n] => host[parent[n]])

\* lock_ref is exactly the sum of the path locks that are held: in-flight writes and loads,
\* other requests, and the pins of restoring, prefetching and kept sessions.
LockAccounting ==
    \A n \in Nodes :
        lockRef[n] = Through(n, WriteKeys)
                     + Through(n, {k \in Nodes : loadAcks[k] >= 1})
                     + Through(n, {k \in Nodes : loadAcks[k] >= 2})
                     + Through(n, {k \in Nodes : extLock[k]})
                     + Cardinality({s \in Sessions : phase[s] \in Pinning /\ n \in Path(ref[s])})

\* host_ref_counter equals the protections that sessions hold.
HostRefAccounting == \A n \in Nodes : hostRef[n] = Cardinality({s \in Sessions : prot[s] = n})

\* Caveat 1: no protection outlives its session's offload.
ProtectionOwned ==
    \A s \in Sessions : prot[s] # NoNode => phase[s] \in Protecting /\ prot[s] = ref[s]

\* Caveat 2: at most one load ack in flight per id, only for ids of the current tree, and
\* every loading node is covered by a pending ack.
LoadAckSane ==
    /\ \A k \in Nodes : loadAcks[k] <= 1 /\ (loadAcks[k] > 0 => status[k] = "InTree")
    /\ \A n \in Nodes : loadKey[n] # NoNode => status[n] = "InTree" /\ dev[n] /\ loadAcks[loadKey[n]] = 1

\* Caveat 3: no host slot (and no device slot) is held by a node outside the tree.
NoOrphanHost == \A n \in Nodes : (host[n] \/ dev[n]) => status[n] = "InTree"

\* Caveat 4: a protected node is never host-evicted.
ProtectedHasHost == \A s \in Sessions : prot[s] # NoNode => status[prot[s]] = "InTree" /\ host[prot[s]]

\* Caveat 5: the manager never acts on a node outside the current tree.
NoStaleTarget == \A n \in tgt : status[n] = "InTree"

\* Caveat 7 (write side): no GPU copy is freed while its write ack is pending.
NoFreeWhilePending == \A n \in Nodes : writeKey[n] # NoNode => dev[n] /\ host[n] /\ status[n] = "InTree"

\* The load-slot ring: no start ever takes a producer slot whose load is still in flight (the
\* assertion in update_producer that took the server down), and only pending loads are queued.
RingBounded ==
    /\ Len(ring) <= Ring
    /\ \A k \in queued : loadAcks[k] = 1
    /\ \A i \in 1..Len(ring) : \A k \in ring[i].keys : loadAcks[k] = 1

\* Policy: a kept session's whole path is resident and readable (its pin keeps it so); an early
\* restore is Kept only once its load is acknowledged.
KeptIsResident == \A s \in Sessions : phase[s] = "Kept" => PathValid(ref[s])

\* Policy: a GPU pin that waits for its tool_end (Kept) is due within the keep TTL, not the TTL of
\* a host protection (KeepFullTtl, WarmFullTtl: armed with the full TTL).  The sweep releases it
\* once due (PinReleased).
KeptWithinKeepTTL == \A s \in Sessions : phase[s] = "Kept" => deadline[s] <= now + KeepFor

\* Hand-over: a session whose tool call is over keeps its whole path resident and readable until
\* its next request holds it (EarlyRelease, the old manager, lets sglang evict it meanwhile).
HandoverResident == \A s \in Sessions : phase[s] = "Handover" => PathValid(ref[s])

\* Load-adaptive protection: while a parked session's request waits, its KV survives on host (the
\* protection keeps HiCache's evict_host off it; ParkUnprotected lets it go).
ParkedKeepsKV == \A s \in Sessions : phase[s] = "Parked" => status[ref[s]] = "InTree" /\ host[ref[s]]

\* Policy: a released (let go or demoted) session holds nothing that HiCache must respect.
ReleasedHoldsNothing == \A s \in Sessions : phase[s] = "Released" => prot[s] = NoNode

\* sglang's promise of device room is kept: what it may still allocate without asking is free or
\* evictable (the 0.5.23 crash: a burst of tool_starts locked the evictable room the rest of a
\* chunked prefill counted on, and its unchecked next chunk failed to allocate).
\* A node's host copy has its parent's beside it (write_backup writes root-down, evict_host and
\* HostUnmirror take leaves of the host copies): what a restore loads is a contiguous prefix.
HostPrefixClosed == \A m \in InTree : (host[m] /\ parent[m] # Root) => host[parent[m]]

PromiseKept == Promised <= DevRoom

\* A closed record references no node (the closed history is bounded by count, not by bytes: a
\* node reference would keep the session's evicted path alive).
ClosedHoldsNoNode == \A s \in Sessions : phase[s] = "Closed" => ref[s] = NoNode

-----------------------------------------------------------------------------
(* Properties of steps *)

\* Caveat 7 (read side): a session becomes Runnable only when its whole path is readable.  A parked
\* session is the exception by design: its request was admitted and reads through sglang's own
\* load_back, which the forward waits for (or its wait expired and it holds nothing).
RunnableOnlyWhenLoaded ==
    [][\A s \in Sessions : (phase'[s] \in {"Runnable", "Handover"} /\ phase[s] \notin {"Runnable", "Handover", "Parked"})
                            => PathValid(ref[s])']_vars

\* A tool_start is refused for host room only when sglang could not free enough for it either
\* (RoomIgnored, the old rule, refuses while unprotected host copies could make the room), or
\* when its writes' locks would take device room sglang promised.
RefuseOnlyWhenFull ==
    [][(act'[1] = "ToolStart" /\ phase[act'[2]] = "Running" /\ ref[act'[2]] # NoNode
        /\ status[ref[act'[2]]] = "InTree" /\ epoch[act'[2]] < MaxEpoch /\ UNCHANGED core)
       => \/ Cardinality({m \in Path(ref[act'[2]]) : ~host[m]}) > hostFree + Cardinality(HostEvictable)
          \/ ~PromiseFits(devFree, dev, Locked(lockRef, {m \in Path(ref[act'[2]]) : ~host[m]}, 1))]_vars

\* A tool_end whose epoch is not the session's current one changes nothing.
StaleEpochNoop ==
    [][(act'[1] = "ToolEnd" /\ act'[3] # epoch[act'[2]]) => UNCHANGED core]_vars

EpochMonotone == [][\A s \in Sessions : epoch'[s] >= epoch[s]]_vars

(* Liveness (under Fairness) *)

\* Every offload ends: the session becomes runnable, expires, is lost with the tree, or closes.
OffloadResolves == \A s \in Sessions : phase[s] \in Protecting ~> phase[s] \in Settled

\* Caveat 6: every protection is eventually released.
ProtectionReleased == \A s \in Sessions : prot[s] # NoNode ~> prot[s] = NoNode

\* Policy: every session pin (kept, prefetching, restoring) is eventually released, whether or
\* not the tool_end comes: an early restore never outlives its tool call.
PinReleased == \A s \in Sessions : phase[s] \in Pinning ~> phase[s] \notin Pinning

\* Every hand-over ends, whether or not the next request comes.
HandoverEnds == \A s \in Sessions : phase[s] = "Handover" ~> phase[s] # "Handover"

\* Every park ends, whether or not the next request comes.
ParkEnds == \A s \in Sessions : phase[s] = "Parked" ~> phase[s] # "Parked"

=============================================================================
