----------------------------- MODULE StorageTier -----------------------------
(***************************************************************************)
(* The L3 storage tier under toolkv's session protection: a paused        *)
(* session's KV on the GPU, in the host pool, and in HiCache's storage     *)
(* backend (--hicache-storage-backend: file, mooncake, ...), shared by     *)
(* every server.                                                           *)
(*                                                                         *)
(* Unit: one KV page.  Every session owns P pages (its radix path, as one  *)
(* copy per tier).  The GPU->host offload of spec/ToolKV.tla appears here  *)
(* in its simplest form (one write with one ack), because this model is   *)
(* about what lies below the host copy:                                    *)
(*                                                                         *)
(*  * write-to-storage (sglang's write_backup_storage -> write_storage):    *)
(*    the backup thread writes the host copy to storage one page at a time *)
(*    (_page_backup; the backend may refuse a page, storage full, and the  *)
(*    operation stops there), then acknowledges the operation            *)
(*    (ack_backup_queue, drained by the scheduler; HiRadixCache does not   *)
(*    read how many pages were written, so toolkv's StoreAck counts the    *)
(*    pages in storage itself); sglang protects the source host copy for   *)
(*    the whole write (node.protect_host / release_host);                  *)
(*  * prefetch-from-storage (prefetch_from_storage -> prefetch): host      *)
(*    slots are allocated for the session, the prefetch I/O thread reads   *)
(*    one page at a time (a missing page ends the read, get() returns      *)
(*    None), and check_prefetch_progress acknowledges it with the number of*)
(*    pages it read, inserting them into the host tree;                    *)
(*  * the session's restore path L3 -> host -> GPU, and TTL / close.       *)
(*                                                                         *)
(* What the protection means in L3: a storage page of a session that holds *)
(* its L3 protection is never deleted (the backend's own eviction, e.g.    *)
(* HiCacheFile's LRU evictor, may delete any other page at any time), and *)
(* a prefetch pins the storage copy it reads until its own ack, whoever    *)
(* releases the session meanwhile.                                         *)
(*                                                                         *)
(* The TTL is a sweep that may fire at any time while the session waits   *)
(* for its tool (no clock: a superset of the timed behaviours).  BUG       *)
(* switches on one seeded defect at a time (docs/spec.md, "The storage     *)
(* tier").                                                                 *)
(***************************************************************************)
EXTENDS Naturals, FiniteSets, TLC

CONSTANTS
    Sessions,   \* agent sessions (model values)
    P,          \* pages per session
    HostSlots,  \* host pool size, in pages
    StoreFails, \* BOOLEAN: the storage backend may refuse a page (storage full)
    ReadAtArrival, \* BOOLEAN: a Stored session's tool_end reads nothing (l3_read_at_arrival)
    BUG         \* "none" or the name of one seeded defect

Bugs == {"none", "RestoreBeforeStoreAck", "TrustShortAck", "LateL3Protect", "ReleaseDropsPin",
         "ArrivalKeepsPin"}

ASSUME /\ P \in Nat \ {0} /\ HostSlots \in Nat /\ StoreFails \in BOOLEAN
       /\ ReadAtArrival \in BOOLEAN /\ BUG \in Bugs

Pg == 1..P

Phases == {"Running",     \* the session's request runs (its KV on the GPU), or will arrive
                          \* with nothing held (ToolEndAtArrival: no GPU copy, sglang reads)
           "Offloading",  \* tool_start: GPU->host write in flight
           "Offloaded",   \* the host copy is whole and protected; GPU copy freed
           "Storing",     \* demoted: the host copy is being written to storage
           "Stored",      \* the session's KV is (only) guaranteed in storage
           "Prefetching", \* tool_end: storage->host prefetch in flight
           "Loading",     \* host->GPU load in flight
           "Runnable",    \* the KV is back on the GPU (the hand-over of ToolKV.tla)
           "Expired", "Lost", "Closed"}

VARIABLES
    phase,    \* [Sessions -> Phases]: the manager's session state
    gpu,      \* [Sessions -> BOOLEAN]: the session's GPU copy is there (and readable)
    hostN,    \* [Sessions -> 0..P]: pages of the session's host copy in the host tree
    hprot,    \* [Sessions -> BOOLEAN]: toolkv's protection of the host copy (protect_host)
    gw,       \* [Sessions -> BOOLEAN]: a GPU->host write is in flight
    ld,       \* [Sessions -> BOOLEAN]: a host->GPU load is in flight
    wr,       \* [Sessions -> BOOLEAN]: a write-to-storage operation is in flight (its ack not drained)
    wn,       \* [Sessions -> 0..P]: pages that operation has written (completed_tokens)
    wfail,    \* [Sessions -> BOOLEAN]: the backend refused a page; the operation stopped
    l3,       \* [Sessions -> SUBSET Pg]: the session's pages present in storage
    l3prot,   \* [Sessions -> BOOLEAN]: toolkv's protection of the session's storage copy
    pin,      \* [Sessions -> 0..1]: a prefetch's pin on the session's storage copy
    pf,       \* [Sessions -> BOOLEAN]: a prefetch is in flight (its ack not processed)
    rn,       \* [Sessions -> 0..P]: pages that prefetch has read into its host slots
    rfail,    \* [Sessions -> BOOLEAN]: the prefetch found a page missing; it stopped
    viaL3,    \* [Sessions -> BOOLEAN]: history: the session's KV came back through L3
    hostFree  \* free host slots, in pages

vars == <<phase, gpu, hostN, hprot, gw, ld, wr, wn, wfail, l3, l3prot, pin, pf, rn, rfail,
          viaL3, hostFree>>

Sym == Permutations(Sessions)

RECURSIVE SumOver(_, _)
SumOver(f, S) == IF S = {} THEN 0
                 ELSE LET x == CHOOSE y \in S : TRUE IN f[x] + SumOver(f, S \ {x})

\* Host slots a session holds: its host copy plus the slots a prefetch allocated for it.
HostHeld == [s \in Sessions |-> hostN[s] + (IF pf[s] THEN P ELSE 0)]

Waiting == {"Offloading", "Offloaded", "Storing", "Stored", "Prefetching"}  \* the TTL applies

-----------------------------------------------------------------------------
Init ==
    /\ phase = [s \in Sessions |-> "Running"]
    /\ gpu = [s \in Sessions |-> TRUE]
    /\ hostN = [s \in Sessions |-> 0]
    /\ hprot = [s \in Sessions |-> FALSE]
    /\ gw = [s \in Sessions |-> FALSE]
    /\ ld = [s \in Sessions |-> FALSE]
    /\ wr = [s \in Sessions |-> FALSE]
    /\ wn = [s \in Sessions |-> 0]
    /\ wfail = [s \in Sessions |-> FALSE]
    /\ l3 = [s \in Sessions |-> {}]
    /\ l3prot = [s \in Sessions |-> FALSE]
    /\ pin = [s \in Sessions |-> 0]
    /\ pf = [s \in Sessions |-> FALSE]
    /\ rn = [s \in Sessions |-> 0]
    /\ rfail = [s \in Sessions |-> FALSE]
    /\ viaL3 = [s \in Sessions |-> FALSE]
    /\ hostFree = HostSlots

-----------------------------------------------------------------------------
(* The manager (toolkv) *)

\* tool_start: write the GPU copy to host (all or nothing: the host must take every page),
\* protect the host copy.  A start that does not fit changes nothing.
ToolStart(s) ==
    /\ phase[s] = "Running"
    /\ gpu[s]   \* a session back through ToolEndAtArrival has no GPU copy until its request runs
    /\ hostFree >= P
    /\ phase' = [phase EXCEPT ![s] = "Offloading"]
    /\ gw' = [gw EXCEPT ![s] = TRUE]
    /\ hostN' = [hostN EXCEPT ![s] = P]
    /\ hprot' = [hprot EXCEPT ![s] = TRUE]
    /\ hostFree' = hostFree - P
    /\ UNCHANGED <<gpu, ld, wr, wn, wfail, l3, l3prot, pin, pf, rn, rfail, viaL3>>

\* The GPU->host write is acknowledged; the manager frees the GPU copy if the session still
\* offloads (a session released meanwhile keeps its GPU copy, unprotected).
HostAck(s) ==
    /\ gw[s]
    /\ gw' = [gw EXCEPT ![s] = FALSE]
    /\ IF phase[s] = "Offloading"
       THEN /\ phase' = [phase EXCEPT ![s] = "Offloaded"]
            /\ gpu' = [gpu EXCEPT ![s] = FALSE]
       ELSE UNCHANGED <<phase, gpu>>
    /\ UNCHANGED <<hostN, hprot, ld, wr, wn, wfail, l3, l3prot, pin, pf, rn, rfail, viaL3, hostFree>>

\* Store (the policy demotes the session: a long tool, or the host must make room): write the
\* protected host copy to storage.  The storage copy is protected from the moment the write is
\* issued, so that no page already written can be evicted before the last one lands
\* (LateL3Protect protects it only at the ack).  The host protection stays until the ack.
Store(s) ==
    /\ phase[s] = "Offloaded"
    /\ ~wr[s]
    /\ phase' = [phase EXCEPT ![s] = "Storing"]
    /\ wr' = [wr EXCEPT ![s] = TRUE]
    /\ wn' = [wn EXCEPT ![s] = 0]
    /\ wfail' = [wfail EXCEPT ![s] = FALSE]
    /\ l3prot' = [l3prot EXCEPT ![s] = BUG # "LateL3Protect"]
    /\ UNCHANGED <<gpu, hostN, hprot, gw, ld, l3, pin, pf, rn, rfail, viaL3, hostFree>>

\* The write-to-storage ack (drain_backup, then the manager's hook).  A whole write: the host
\* protection is released (HiCache may now evict the host copy), the session lives in
\* storage.  A short write (the backend refused a page): the session keeps its host copy,
\* protected, and may be demoted again; its partial storage copy is left unprotected
\* (TrustShortAck takes the short copy for a whole one).
StoreAck(s) ==
    /\ wr[s]
    /\ wn[s] = P \/ wfail[s]
    /\ wr' = [wr EXCEPT ![s] = FALSE]
    /\ LET whole == wn[s] = P \/ BUG = "TrustShortAck" IN
       IF phase[s] = "Storing"
       THEN /\ phase' = [phase EXCEPT ![s] = IF whole THEN "Stored" ELSE "Offloaded"]
            /\ hprot' = [hprot EXCEPT ![s] = ~whole]
            /\ l3prot' = [l3prot EXCEPT ![s] = whole]
       ELSE UNCHANGED <<phase, hprot, l3prot>>
    /\ UNCHANGED <<gpu, hostN, gw, ld, wn, wfail, l3, pin, pf, rn, rfail, viaL3, hostFree>>

\* Start the host->GPU load of a whole, protected host copy.
LoadFromHost(s) ==
    /\ phase' = [phase EXCEPT ![s] = "Loading"]
    /\ ld' = [ld EXCEPT ![s] = TRUE]
    /\ hprot' = [hprot EXCEPT ![s] = TRUE]

\* tool_end from the host copy while there is one (Offloaded; Storing: the write goes on;
\* Stored with the host copy not yet evicted: re-protected).  RestoreBeforeStoreAck goes to
\* storage instead while the write is still in flight.
ToolEndFromHost(s) ==
    /\ \/ phase[s] = "Offloaded"
       \/ phase[s] = "Storing" /\ BUG # "RestoreBeforeStoreAck"
       \/ phase[s] = "Stored" /\ hostN[s] = P /\ ~ReadAtArrival
    /\ LoadFromHost(s)
    /\ l3prot' = [l3prot EXCEPT ![s] = FALSE]   \* the session no longer relies on storage
    /\ UNCHANGED <<gpu, hostN, gw, wr, wn, wfail, l3, pin, pf, rn, rfail, viaL3, hostFree>>

\* tool_end with the host copy gone: prefetch from storage into freshly allocated host slots,
\* pinning the storage copy.  No host room: nothing changes (retried; the TTL bounds the wait).
StoragePrefetch(s) ==
    /\ \/ phase[s] = "Stored" /\ hostN[s] = 0 /\ ~ReadAtArrival
       \/ phase[s] = "Storing" /\ BUG = "RestoreBeforeStoreAck"
    /\ ~pf[s]
    /\ hostFree >= P
    /\ phase' = [phase EXCEPT ![s] = "Prefetching"]
    /\ pf' = [pf EXCEPT ![s] = TRUE]
    /\ pin' = [pin EXCEPT ![s] = 1]
    /\ rn' = [rn EXCEPT ![s] = 0]
    /\ rfail' = [rfail EXCEPT ![s] = FALSE]
    /\ hprot' = [hprot EXCEPT ![s] = FALSE]
    /\ l3prot' = [l3prot EXCEPT ![s] = TRUE]
    /\ hostFree' = hostFree - P
    /\ UNCHANGED <<gpu, hostN, gw, ld, wr, wn, wfail, l3, viaL3>>

\* tool_end of a Stored session with ReadAtArrival (toolkv's l3_read_at_arrival): toolkv reads
\* nothing.  The session's protections end (ToolKV.tla's Demote, then its ToolEnd of the Released
\* session: Running), its storage copy stays in storage unprotected and unpinned by toolkv, and
\* its host copy, if not yet evicted, stays unprotected: sglang's own prefetch at the next
\* request's arrival reads what storage still holds (not modelled: sglang's read, whatever it
\* finds; what is missing is recomputed).  ArrivalKeepsPin keeps the storage protection.
ToolEndAtArrival(s) ==
    /\ ReadAtArrival
    /\ phase[s] = "Stored"
    /\ phase' = [phase EXCEPT ![s] = "Running"]
    /\ hprot' = [hprot EXCEPT ![s] = FALSE]
    /\ l3prot' = [l3prot EXCEPT ![s] = BUG = "ArrivalKeepsPin"]
    /\ UNCHANGED <<gpu, hostN, gw, ld, wr, wn, wfail, l3, pin, pf, rn, rfail, viaL3, hostFree>>

ToolEnd(s) == ToolEndFromHost(s) \/ StoragePrefetch(s) \/ ToolEndAtArrival(s)

\* The prefetch ack (check_prefetch_progress, then the manager's hook): the pages read enter
\* the host tree, the slots of pages not read are freed, the prefetch's pin ends.  A whole
\* read: the storage protection has done its job and is released, the host copy is protected
\* and loaded to the GPU.  A short read: the session's KV is lost (its next turn recomputes
\* what is missing); the pages read stay in the host tree, unprotected.
PrefetchAck(s) ==
    /\ pf[s]
    /\ rn[s] = P \/ rfail[s]
    /\ pf' = [pf EXCEPT ![s] = FALSE]
    /\ pin' = [pin EXCEPT ![s] = 0]
    /\ hostN' = [hostN EXCEPT ![s] = rn[s]]
    /\ hostFree' = hostFree + (P - rn[s])
    /\ IF phase[s] = "Prefetching"
       THEN /\ l3prot' = [l3prot EXCEPT ![s] = FALSE]
            /\ IF rn[s] = P
               THEN /\ LoadFromHost(s)
                    /\ viaL3' = [viaL3 EXCEPT ![s] = TRUE]
               ELSE /\ phase' = [phase EXCEPT ![s] = "Lost"]
                    /\ UNCHANGED <<ld, hprot, viaL3>>
       ELSE UNCHANGED <<phase, ld, hprot, l3prot, viaL3>>
    /\ UNCHANGED <<gpu, gw, wr, wn, wfail, l3, rn, rfail>>

\* The host->GPU load is acknowledged: the GPU copy is readable; a restoring session is
\* handed over (its host protection ends).
LoadAck(s) ==
    /\ ld[s]
    /\ ld' = [ld EXCEPT ![s] = FALSE]
    /\ gpu' = [gpu EXCEPT ![s] = TRUE]
    /\ IF phase[s] = "Loading"
       THEN /\ phase' = [phase EXCEPT ![s] = "Runnable"]
            /\ hprot' = [hprot EXCEPT ![s] = FALSE]
       ELSE UNCHANGED <<phase, hprot>>
    /\ UNCHANGED <<hostN, gw, wr, wn, wfail, l3, l3prot, pin, pf, rn, rfail, viaL3, hostFree>>

\* Release what the session holds: its host and storage protections (a load in flight keeps
\* the host copy through its own lock; a write in flight through sglang's; a prefetch in
\* flight through its pin, which ReleaseDropsPin drops as well).
Release(s, to) ==
    /\ phase' = [phase EXCEPT ![s] = to]
    /\ hprot' = [hprot EXCEPT ![s] = FALSE]
    /\ l3prot' = [l3prot EXCEPT ![s] = FALSE]
    /\ pin' = IF BUG = "ReleaseDropsPin" THEN [pin EXCEPT ![s] = 0] ELSE pin
    /\ UNCHANGED <<gpu, hostN, gw, ld, wr, wn, wfail, l3, pf, rn, rfail, viaL3, hostFree>>

\* The TTL sweep: a session still waiting for its tool is released.  (A Loading session's
\* tool_end was accepted: the TTL no longer applies, as in ToolKV.tla.)
Expire(s) == phase[s] \in Waiting /\ Release(s, "Expired")

\* close: any session not yet closed.
Close(s) == phase[s] # "Closed" /\ Release(s, "Closed")

-----------------------------------------------------------------------------
(* sglang's threads and the environment *)

\* The backup thread writes the next page of the operation (a page already in storage is
\* skipped by the backend's exists() check and counts as written).  The source is the host
\* copy, which sglang's own protection keeps for the whole operation.
StorePage(s) ==
    /\ wr[s] /\ ~wfail[s] /\ wn[s] < P
    /\ wn' = [wn EXCEPT ![s] = @ + 1]
    /\ l3' = [l3 EXCEPT ![s] = @ \cup {wn[s] + 1}]
    /\ UNCHANGED <<phase, gpu, hostN, hprot, gw, ld, wr, wfail, l3prot, pin, pf, rn, rfail, viaL3, hostFree>>

\* The backend refuses the next page (HiCacheFile's evictor finds no room): the operation
\* stops and is acknowledged with what it wrote.
StoreRefused(s) ==
    /\ StoreFails /\ wr[s] /\ ~wfail[s] /\ wn[s] < P
    /\ wfail' = [wfail EXCEPT ![s] = TRUE]
    /\ UNCHANGED <<phase, gpu, hostN, hprot, gw, ld, wr, wn, l3, l3prot, pin, pf, rn, rfail, viaL3, hostFree>>

\* The prefetch I/O thread reads the next page into its host slot, or finds it missing and
\* stops (get() returned None).
ReadPage(s) ==
    /\ pf[s] /\ ~rfail[s] /\ rn[s] < P
    /\ IF rn[s] + 1 \in l3[s]
       THEN /\ rn' = [rn EXCEPT ![s] = @ + 1]
            /\ UNCHANGED rfail
       ELSE /\ rfail' = [rfail EXCEPT ![s] = TRUE]
            /\ UNCHANGED rn
    /\ UNCHANGED <<phase, gpu, hostN, hprot, gw, ld, wr, wn, wfail, l3, l3prot, pin, pf, viaL3, hostFree>>

\* The storage backend deletes a page (its own eviction, or another tenant's): only a page of
\* a copy that is neither protected by its session nor pinned by a prefetch.
L3Evict(s, p) ==
    /\ p \in l3[s] /\ ~l3prot[s] /\ pin[s] = 0
    /\ l3' = [l3 EXCEPT ![s] = @ \ {p}]
    /\ UNCHANGED <<phase, gpu, hostN, hprot, gw, ld, wr, wn, wfail, l3prot, pin, pf, rn, rfail, viaL3, hostFree>>

\* HiCache's evict_host frees a host copy that nothing holds: no toolkv protection, no write to
\* storage reading it, no load or GPU->host write on it.
HostEvict(s) ==
    /\ hostN[s] > 0 /\ ~hprot[s] /\ ~wr[s] /\ ~ld[s] /\ ~gw[s]
    /\ hostN' = [hostN EXCEPT ![s] = 0]
    /\ hostFree' = hostFree + hostN[s]
    /\ UNCHANGED <<phase, gpu, hprot, gw, ld, wr, wn, wfail, l3, l3prot, pin, pf, rn, rfail, viaL3>>

-----------------------------------------------------------------------------
Next ==
    \E s \in Sessions :
        \/ ToolStart(s) \/ HostAck(s) \/ Store(s) \/ StoreAck(s) \/ ToolEnd(s)
        \/ PrefetchAck(s) \/ LoadAck(s) \/ Expire(s) \/ Close(s)
        \/ StorePage(s) \/ StoreRefused(s) \/ ReadPage(s) \/ HostEvict(s)
        \/ \E p \in Pg : L3Evict(s, p)

Spec == Init /\ [][Next]_vars

\* Copy engines, the backup and prefetch threads and the scheduler's ack processing keep
\* running; the TTL sweep keeps running.  Clients need not call tool_end or close, the policy
\* need not demote, and the backend need not refuse or evict.
Fairness == \A s \in Sessions :
    /\ WF_vars(HostAck(s)) /\ WF_vars(StorePage(s)) /\ WF_vars(StoreAck(s))
    /\ WF_vars(ReadPage(s)) /\ WF_vars(PrefetchAck(s)) /\ WF_vars(LoadAck(s))
    /\ WF_vars(Expire(s))

LiveSpec == Spec /\ Fairness

-----------------------------------------------------------------------------
(* Invariants *)

TypeOK ==
    /\ phase \in [Sessions -> Phases]
    /\ gpu \in [Sessions -> BOOLEAN]
    /\ hostN \in [Sessions -> 0..P]
    /\ wn \in [Sessions -> 0..P] /\ rn \in [Sessions -> 0..P]
    /\ l3 \in [Sessions -> SUBSET Pg]
    /\ pin \in [Sessions -> 0..1]
    /\ hostFree \in 0..HostSlots

\* Every host slot is free or held exactly once (no leak, no double free).
HostAccounting == hostFree + SumOver(HostHeld, Sessions) = HostSlots

\* toolkv protects only whole host copies, and only of sessions that rely on them.
HostProtectionOwned ==
    \A s \in Sessions : hprot[s] =>
        /\ hostN[s] = P
        /\ phase[s] \in {"Offloading", "Offloaded", "Storing", "Stored", "Loading"}

\* A write to storage always reads a whole host copy (sglang's protection keeps it).
StoreSourcePresent == \A s \in Sessions : wr[s] => hostN[s] = P

\* A session that lives in storage has a whole storage copy there, and holds its protection.
StoredWhole == \A s \in Sessions : phase[s] = "Stored" => l3[s] = Pg /\ l3prot[s]

\* A restore from storage starts only from a copy whose write was acknowledged whole: no write
\* to it is in flight, every page is there, and the session protects it.
RestoreSourceWhole ==
    \A s \in Sessions : phase[s] = "Prefetching" => ~wr[s] /\ l3[s] = Pg /\ l3prot[s]

\* No storage page a prefetch has still to read is deleted while it reads, whoever released
\* the session meanwhile.
ReadSourcePresent ==
    \A s \in Sessions : pf[s] => {p \in Pg : p > rn[s]} \subseteq l3[s]

\* The restore path: a session loading to the GPU loads a whole, protected host copy, and a
\* runnable session has its GPU copy.
LoadSourceWhole == \A s \in Sessions : phase[s] = "Loading" => hostN[s] = P /\ hprot[s] /\ ld[s]
RunnableOnGpu == \A s \in Sessions : phase[s] = "Runnable" => gpu[s]

\* A released session holds no protection in either tier.
ReleasedHoldsNothing ==
    \A s \in Sessions : phase[s] \in {"Expired", "Lost", "Closed", "Runnable", "Running"} =>
        ~hprot[s] /\ ~l3prot[s]

(* Liveness (under Fairness) *)

\* Every prefetch pin is released, and every protection ends (tool_end or not).
PinReleased == \A s \in Sessions : pin[s] = 1 ~> pin[s] = 0
ProtectionReleased == \A s \in Sessions : (hprot[s] \/ l3prot[s]) ~> ~(hprot[s] \/ l3prot[s])

-----------------------------------------------------------------------------
(* Witnesses: each Never... must be refuted by TLC (the scenario is reachable) *)

\* A session demoted to storage, its host copy evicted, is restored L3 -> host -> GPU.
NeverRestoreFromL3 == \A s \in Sessions : ~(phase[s] = "Runnable" /\ viaL3[s])

\* A write refused by the backend leaves the session on its (protected) host copy.
NeverShortWrite == \A s \in Sessions : ~(phase[s] = "Offloaded" /\ l3[s] # {} /\ l3[s] # Pg)

\* A session closed while its prefetch reads keeps the storage copy pinned until the ack.
NeverPinnedAfterClose == \A s \in Sessions : ~(phase[s] = "Closed" /\ pin[s] = 1)

\* A Stored session's tool_end with ReadAtArrival leaves its whole storage copy to sglang's read.
NeverArrivalRead == \A s \in Sessions : ~(phase[s] = "Running" /\ ~gpu[s] /\ l3[s] = Pg)
=============================================================================
