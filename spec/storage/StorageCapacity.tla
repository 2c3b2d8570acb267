--------------------------- MODULE StorageCapacity ---------------------------
(***************************************************************************)
(* L3 as capacity, not only overflow (issue 37): StorageTier.tla with the  *)
(* two rules the policy adds when it stores by predicted return.           *)
(*                                                                         *)
(*  * Store by predicted return.  Besides a full host's victim, an        *)
(*    Offloaded session is stored as soon as it is offloaded when it is    *)
(*    predicted away longer than its L3 round trip (core/session/l3.py    *)
(*    store_early).  The prediction is the environment's: due[s] says the  *)
(*    session is predicted back within the horizon, and it may change at   *)
(*    any time (Predict: a call running past its median is predicted      *)
(*    longer).  A session due soon is stored only as a full host's victim *)
(*    (a tool_start short of room); never early (EarlyStoreNotDue;        *)
(*    mutant StoreDueSoon stores it anyway).                               *)
(*  * Host room.  A tool_start short of free slots counts as room the host *)
(*    copies evict_host may free: unprotected, not read by a write to     *)
(*    storage, a load or a GPU->host write (a Stored session's host copy  *)
(*    is such a copy once its StoreAck released it), and evicts them      *)
(*    (HostRoom).  A copy whose store is in flight is still protected and  *)
(*    is never room (mutant CountStoringAsRoom counts it, and the evicted  *)
(*    copy breaks HostProtectionOwned and StoreSourcePresent).             *)
(*                                                                         *)
(* Everything else is StorageTier.tla's, unchanged: the conformance replay *)
(* and the L3 table check that module's graph; this one is model checked  *)
(* (spec/storage/configs.toml) with its own mutants.                      *)
(***************************************************************************)
EXTENDS StorageTier

CONSTANT CapBug  \* "none", "StoreDueSoon" or "CountStoringAsRoom"

ASSUME CapBug \in {"none", "StoreDueSoon", "CountStoringAsRoom"}

VARIABLES
    due,        \* [Sessions -> BOOLEAN]: predicted back within the store horizon
    earlyDue    \* [Sessions -> BOOLEAN]: history: stored early while due soon

cvars == <<vars, due, earlyDue>>

\* A tool_start is short of free host slots: the host must make room.
HostShort == \E t \in Sessions : phase[t] = "Running" /\ hostFree < P

\* The host copies the manager counts as room (sglang's evict_host may free them).
Evictable(t) ==
    \/ hostN[t] > 0 /\ ~hprot[t] /\ ~wr[t] /\ ~ld[t] /\ ~gw[t]
    \/ CapBug = "CountStoringAsRoom" /\ phase[t] = "Storing"
Room == SumOver([t \in Sessions |-> IF Evictable(t) THEN hostN[t] ELSE 0], Sessions)

CInit == Init /\ due \in [Sessions -> BOOLEAN] /\ earlyDue = [s \in Sessions |-> FALSE]

\* The prediction moves (a call past its median is predicted longer, a hint is given, ...).
Predict(s) ==
    /\ phase[s] \in Waiting
    /\ due' = [due EXCEPT ![s] = ~@]
    /\ UNCHANGED <<vars, earlyDue>>

\* Store, by predicted return (not due soon) or as a full host's victim (any Offloaded session).
CStore(s) ==
    /\ Store(s)
    /\ ~due[s] \/ HostShort \/ CapBug = "StoreDueSoon"
    /\ earlyDue' = [earlyDue EXCEPT ![s] = @ \/ (due[s] /\ ~HostShort)]
    /\ UNCHANGED due

\* tool_start short of free slots: evict_host frees the counted copies (all of them, a superset
\* of the LRU shortfall sglang frees), then the start as StorageTier's.
HostRoom(s) ==
    /\ phase[s] = "Running"
    /\ hostFree < P
    /\ hostFree + Room >= P
    /\ phase' = [phase EXCEPT ![s] = "Offloading"]
    /\ gw' = [gw EXCEPT ![s] = TRUE]
    /\ hostN' = [t \in Sessions |-> IF t = s THEN P ELSE IF Evictable(t) THEN 0 ELSE hostN[t]]
    /\ hprot' = [hprot EXCEPT ![s] = TRUE]
    /\ hostFree' = hostFree + Room - P
    /\ UNCHANGED <<gpu, ld, wr, wn, wfail, l3, l3prot, pin, pf, rn, rfail, viaL3, due, earlyDue>>

Keep(A) == A /\ UNCHANGED <<due, earlyDue>>

CNext ==
    \E s \in Sessions :
        \/ Keep(ToolStart(s)) \/ HostRoom(s) \/ Keep(HostAck(s)) \/ CStore(s) \/ Keep(StoreAck(s))
        \/ Keep(ToolEnd(s)) \/ Keep(PrefetchAck(s)) \/ Keep(LoadAck(s)) \/ Keep(Expire(s))
        \/ Keep(Close(s)) \/ Keep(StorePage(s)) \/ Keep(StoreRefused(s)) \/ Keep(ReadPage(s))
        \/ Keep(HostEvict(s)) \/ Predict(s)
        \/ \E p \in Pg : Keep(L3Evict(s, p))

CSpec == CInit /\ [][CNext]_cvars

(* Invariants, besides StorageTier's *)

\* No session due soon was ever stored except as a full host's victim.
EarlyStoreNotDue == \A s \in Sessions : ~earlyDue[s]

\* The room counted never includes a protected copy (a store in flight keeps its host copy
\* protected until the whole StoreAck).
RoomNotProtected == \A s \in Sessions : Evictable(s) => ~hprot[s]
=============================================================================
