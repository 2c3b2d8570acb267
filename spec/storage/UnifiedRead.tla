----------------------------- MODULE UnifiedRead -----------------------------
(***************************************************************************)
(* sglang 0.5.23's read from storage (UnifiedRadixCache): StorageTier.tla  *)
(* with the one step 0.5.23 adds between sglang's read and toolkv's        *)
(* PrefetchAck (EarlyInsert = TRUE; FALSE is 0.5.16's HiRadixCache).       *)
(*                                                                         *)
(* On 0.5.16 the pages read enter the host tree inside                     *)
(* check_prefetch_progress, the call toolkv's PrefetchAck makes, and are   *)
(* protected by toolkv in the same step.  On 0.5.23 sglang's own ack drain *)
(* (check_hicache_events) inserts them as soon as the read completes and   *)
(* returns the anchor's host lock, before toolkv's tick; until then they   *)
(* are unprotected host copies sglang's host eviction may take (leaf       *)
(* first: the last page read).  And the hit's host slots are allocated at  *)
(* that drain, not at the call: a hit sglang cannot allocate slots for is  *)
(* revoked, nothing read.  Either way (ReadLost) toolkv's PrefetchAck      *)
(* finds the read short although the storage copy was whole and pinned:    *)
(* it must read the host tree, not trust a whole, pinned copy to have been *)
(* read whole (mutant TrustWholeRead, which is sound on 0.5.16 and loads a *)
(* short host copy on 0.5.23).                                             *)
(*                                                                         *)
(* Everything else is StorageTier.tla's, unchanged (spec/storage/          *)
(* configs.toml checks this module's configs; docs/sglang_versions.md maps *)
(* each action onto sglang 0.5.23's primitives).                          *)
(***************************************************************************)
EXTENDS StorageTier

CONSTANTS
    EarlyInsert,  \* BOOLEAN: sglang 0.5.23 (the read enters the host tree before toolkv's ack)
    ReadBug       \* "none" or "TrustWholeRead"

ASSUME EarlyInsert \in BOOLEAN /\ ReadBug \in {"none", "TrustWholeRead"}

\* Between sglang's read and toolkv's ack (0.5.23 only): the host eviction takes the last page
\* read from the host tree (or the hit is revoked for want of host slots: nothing read).  The
\* slot goes back with the prefetch's others at the ack (HostHeld counts a prefetch as P).
ReadLost(s) ==
    /\ EarlyInsert
    /\ pf[s] /\ ~rfail[s]
    /\ rn' = [rn EXCEPT ![s] = IF @ > 0 THEN @ - 1 ELSE 0]
    /\ rfail' = [rfail EXCEPT ![s] = TRUE]
    /\ UNCHANGED <<phase, gpu, hostN, hprot, gw, ld, wr, wn, wfail, l3, l3prot, pin, pf, viaL3,
                   hostFree>>

\* TrustWholeRead: a prefetch of a whole copy that storage still holds whole (it is pinned) is
\* taken for a whole read, whatever the host tree holds: the session loads its host copy.
PrefetchAckTrusting(s) ==
    /\ ReadBug = "TrustWholeRead"
    /\ pf[s] /\ rfail[s] /\ phase[s] = "Prefetching"
    /\ {p \in Pg : p > rn[s]} \subseteq l3[s]
    /\ pf' = [pf EXCEPT ![s] = FALSE]
    /\ pin' = [pin EXCEPT ![s] = 0]
    /\ hostN' = [hostN EXCEPT ![s] = rn[s]]
    /\ hostFree' = hostFree + (P - rn[s])
    /\ l3prot' = [l3prot EXCEPT ![s] = FALSE]
    /\ LoadFromHost(s)
    /\ viaL3' = [viaL3 EXCEPT ![s] = TRUE]
    /\ UNCHANGED <<gpu, gw, wr, wn, wfail, l3, rn, rfail>>

NextU == Next \/ \E s \in Sessions : ReadLost(s) \/ PrefetchAckTrusting(s)

SpecU == Init /\ [][NextU]_vars

LiveSpecU == SpecU /\ Fairness

\* Witness: a session whose whole, pinned storage copy was read comes back short (Lost) only on
\* 0.5.23; TLC must refute it there and finds it an invariant on 0.5.16.
NeverLostWholeCopy == \A s \in Sessions : ~(phase[s] = "Lost" /\ l3[s] = Pg)
=============================================================================
