---------------------------- MODULE DecodeOffload ----------------------------
(***************************************************************************)
(* SGLang's decode-side KV offload (DecodeKVCacheOffloadManager, 0.5.16), *)
(* as the scheduler drives it on a prefill/decode-disaggregated decode     *)
(* server with --disaggregation-decode-enable-offload-kvcache.             *)
(*                                                                         *)
(* Unit: one KV page.  A request arrives with Pre pages of prompt KV (the  *)
(* page-aligned prompt, already stored by the prefill side), decodes one   *)
(* page at a time, and after each step the scheduler calls                *)
(* offload_kv_cache: every Stride-aligned run of new pages is written      *)
(* device->host (an "increment", one ack id each).  Once per scheduler     *)
(* iteration check_offload_progress agrees the ack counts across TP ranks  *)
(* (all_reduce MIN), retires write acks in issue order (hashes each page,  *)
(* chaining on the request's last hash, and hands the host copy to the     *)
(* storage backup thread), releases a finished request once none of its   *)
(* increments is in flight, and frees the host slots of increments whose   *)
(* storage backup the backup thread acknowledged.                          *)
(*                                                                         *)
(* Per rank, two engines run on their own time: the copy engine finishes   *)
(* device->host copies in FIFO order (Copy), and the backup thread writes   *)
(* staged increments to storage in FIFO order (Store).                     *)
(*                                                                         *)
(* Freed device slots are reused by other requests at once (pessimistic):  *)
(* a copy that reads a freed slot copies another request's KV.  Likewise a *)
(* freed host slot.                                                        *)
(*                                                                         *)
(* Page hashes are abstracted as chain lengths: the hash of a request's    *)
(* page i computed from the hash of its first i pages is i+1; from any     *)
(* other prior it is -1 (a hash that is not on the request's chain).       *)
(*                                                                         *)
(* Every manager action is one pure function from the record of all state  *)
(* variables (Now) to the next record, so that the per-iteration ack loop  *)
(* folds over increments exactly as the Python loop does.  BUG switches on *)
(* one seeded defect at a time (docs/decode_offload.md).                   *)
(***************************************************************************)
EXTENDS Integers, Sequences, FiniteSets, TLC

CONSTANTS
    Reqs,      \* decoding requests
    Ranks,     \* tensor-parallel ranks
    Pre,       \* pages of page-aligned prompt KV a request arrives with
    MaxLen,    \* bound on a request's committed KV, in pages
    Stride,    \* offload stride, in pages
    DevSlots,  \* device KV page slots
    HostSlots, \* host KV page slots of the manager's own host pool, per rank
    TreePre,   \* prompt pages a decode radix cache already holds (0: ChunkCache, the default)
    RadixFix,  \* BOOLEAN: release frees only the request's own pages and unlocks the prefix
    BUG        \* "none" or the name of one seeded defect

Bugs == {"none", "EagerPrefillFree", "NoReleaseGuard", "NoReleaseGuardOnly",
         "FinalizeIgnoresInflight", "HostFreeAtWriteAck", "LocalAckCounts",
         "HashNotChained", "GapOnHostFull", "NoReleaseAtAck"}

ASSUME /\ Pre \in Nat /\ MaxLen \in Nat /\ MaxLen >= Pre /\ Stride \in Nat \ {0}
       /\ DevSlots \in Nat /\ HostSlots \in Nat /\ TreePre \in 0..Pre
       /\ RadixFix \in BOOLEAN /\ BUG \in Bugs /\ Ranks # {}

VARIABLES
    s,         \* the whole state as one record (fields below), so that every action is one
               \* evaluation of a pure function: s' = F(s)
    act,       \* history: the last action and its parameters
    note       \* history: what it decided (offload outcome, requests released, acks retired)

\* ---- the scheduler and the device pool (identical on every rank) ----
phase == s.phase        \* [Reqs -> Phases]
len == s.len            \* [Reqs -> 0..MaxLen]: committed KV pages (kv_committed_len / page_size)
dev == s.dev            \* [Reqs -> SUBSET Nat]: pages whose device slot the request owns
devFree == s.devFree    \* free device slots (allocator.available_size / page_size)
locks == s.locks        \* lock_ref of the decode radix cache's prefix node (TreePre > 0)
prot == s.prot          \* tree_cache.protected_size_, in pages
treeOk == s.treeOk      \* the radix cache's prefix pages still own their device slots
\* ---- the offload manager's per-request state (identical on every rank) ----
hasSt == s.hasSt        \* [Reqs -> BOOLEAN]: offloaded_state[rid] exists
inc == s.inc            \* [Reqs -> Nat]: offloaded_state.inc_len, in pages (0 without a state)
last == s.last          \* [Reqs -> Int]: offloaded_state.last_hash as a chain length (-1: off chain; 0 without a state)
inflight == s.inflight  \* [Reqs -> Nat]: offload_inflight[rid]
rel == s.rel            \* [Reqs -> Nat]: releases that ran their side effects
chain == s.chain        \* [Reqs -> Seq(Int)]: page hashes handed to write_storage, in order
\* ---- increments: ack ids 1..Len(ops) in issue order ----
ops == s.ops            \* Seq([r, lo, hi]): pages lo..hi-1 of request r
okeys == s.okeys        \* Seq(Seq(Int)): the page hashes of each acknowledged increment
acked == s.acked        \* write acks the manager has retired (the same on every rank)
\* ---- per rank: the copy engine, the backup thread, the host pool, storage ----
odata == s.odata        \* [Ranks -> Seq(BOOLEAN)]: finished copies; TRUE iff the right KV was copied
stored == s.stored      \* [Ranks -> Nat]: staged increments the backup thread has written
freed == s.freed        \* [Ranks -> Nat]: increments whose host slots were freed after their backup ack
hostFree == s.hostFree  \* [Ranks -> Int]: free host slots
store == s.store        \* [Ranks -> SUBSET [r, k, ok]]: page hash k of r stored, bytes right iff ok

Phases == {"Waiting", "Decoding", "Finished", "Released"}
Live == {"Decoding", "Finished"}

vars == <<s, act, note>>
View == s
Sym == Permutations(Reqs) \cup Permutations(Ranks)

-----------------------------------------------------------------------------
(* Helpers *)

Min(S) == CHOOSE x \in S : \A y \in S : x <= y
Range(a, b) == a..(b - 1)
Pages(o) == Range(o.lo, o.hi)
Size(o) == o.hi - o.lo

RECURSIVE SumSizes(_, _, _)
SumSizes(os, i, j) == IF i > j THEN 0 ELSE Size(os[i]) + SumSizes(os, i + 1, j)

\* The request's own device pages: everything committed except the radix cache's prefix.
Own(r, n) == {i \in Range(0, n) : i >= TreePre}

\* _compute_prefix_hash(tokens of pages lo..hi-1, prior): a chain continues only from the
\* hash of exactly the pages before lo.
Hashes(prior, lo, hi) == [j \in 1..(hi - lo) |-> IF prior = lo THEN lo + j ELSE -1]

\* The hash a new OffloadedState starts from: the prompt's page-aligned chain (None = 0 pages).
PromptHash == Pre

\* Capacity decisions, named so that trace validation can substitute the implementation's own
\* (its pools count tokens; the spec counts pages).
HostFits(k) == \A rk \in Ranks : hostFree[rk] >= k     \* cache_controller.write found host slots
DevFits(k) == devFree >= k                              \* the scheduler could allocate k pages

Now == s
Set(M) == s' = M

Rec(a, n) == act' = a /\ note' = n

-----------------------------------------------------------------------------
(* The manager's methods, as functions of the state record *)

\* _release_finished_req(req, prefill_len).  The guard: ReqToTokenPool.free set req_pool_idx
\* to None, so a released request is skipped.  Otherwise: free req_to_token[0:prefill_len]
\* (which includes the radix cache's prefix pages when it has any), free [prefill_len:
\* committed], free the request slot, and subtract len(prefix_indices) from the tree's
\* protected_size_ directly.  RadixFix frees only the request's own pages and unlocks.
Release(M, r) ==
    IF M.phase[r] = "Released" /\ BUG \notin {"NoReleaseGuard", "NoReleaseGuardOnly"} THEN M
    ELSE
      LET prefill == IF BUG = "EagerPrefillFree" THEN {} ELSE Range(TreePre, Pre) \* freed early
          own == (Own(r, M.len[r]) \ Range(TreePre, Pre)) \cup prefill
          tree == TreePre > 0 /\ ~RadixFix
      IN [M EXCEPT !.phase[r] = "Released",
                   !.dev[r] = {},
                   !.devFree = @ + Cardinality(own) + (IF tree THEN TreePre ELSE 0),
                   !.treeOk = @ /\ ~tree,
                   !.locks = IF TreePre > 0 /\ RadixFix THEN @ - 1 ELSE @,
                   !.prot = IF TreePre = 0 THEN @
                            ELSE IF RadixFix THEN (IF M.locks = 1 THEN @ - TreePre ELSE @)
                            ELSE @ - TreePre,
                   !.hasSt[r] = FALSE,    \* del offloaded_state[rid]
                   !.inc[r] = 0,
                   !.last[r] = 0,
                   !.rel[r] = @ + 1]

\* offload_kv_cache(req) always first makes sure offloaded_state[rid] exists.
WithState(M, r) == IF M.hasSt[r] THEN M
                   ELSE LET M1 == [M EXCEPT !.hasSt[r] = TRUE, !.inc[r] = 0, !.last[r] = PromptHash]
                        IN IF BUG = "EagerPrefillFree"
                           THEN \* the pre-fix code freed the prefill slots here, mid-decode
                                LET P == Range(TreePre, Pre) \cap M.dev[r]
                                IN [M1 EXCEPT !.dev[r] = @ \ P, !.devFree = @ + Cardinality(P)]
                           ELSE M1

Aligned(M, r) == LET n == M.len[r] - Pre - M.inc[r] IN (n \div Stride) * Stride

\* The three outcomes of offload_kv_cache: nothing stride-aligned to write ("none"), the host
\* pool refused the write ("full": logged, False returned), or an increment was issued.
Outcome(M, r) == LET k == Aligned(WithState(M, r), r) IN
                 IF k = 0 THEN "none" ELSE IF HostFits(k) THEN "issued" ELSE "full"

Offloaded(M, r) ==
    LET M1 == WithState(M, r)
        k == Aligned(M1, r)
        lo == Pre + M1.inc[r]
        out == Outcome(M, r)
    IN CASE out = "issued" ->
              [M1 EXCEPT !.ops = Append(@, [r |-> r, lo |-> lo, hi |-> lo + k]),
                         !.hostFree = [rk \in Ranks |-> @[rk] - k],
                         !.inflight[r] = @ + 1,
                         !.inc[r] = @ + k]
         [] out = "full" /\ BUG = "GapOnHostFull" -> [M1 EXCEPT !.inc[r] = @ + k]
         [] OTHER -> M1

\* finalize_release_on_finish(req): release now unless an increment is still in flight (then
\* the last write ack releases it).
Finalize(M, r) ==
    IF M.inflight[r] > 0 /\ BUG \notin {"FinalizeIgnoresInflight", "NoReleaseGuard"} THEN M
    ELSE Release(M, r)

\* The bytes a copy of increment j reads now: right iff every source page is still owned.
CopyOk(M, j) == Pages(M.ops[j]) \subseteq M.dev[M.ops[j].r]

\* finish_event.synchronize(): every rank's copy engine finishes the copies up to increment j.
Sync(M, j) ==
    [M EXCEPT !.odata = [rk \in Ranks |->
        IF Len(@[rk]) >= j THEN @[rk]
        ELSE [i \in 1..j |-> IF i <= Len(@[rk]) THEN @[rk][i] ELSE CopyOk(M, i)]]]

\* One iteration of _check_offload_progress's loop: retire write ack j.
AckOne(M, j) ==
    LET M1 == Sync(M, j)
        o == M1.ops[j]
        r == o.r
        prior == IF BUG = "HashNotChained" THEN 0
                 ELSE IF M1.hasSt[r] THEN M1.last[r] ELSE 0      \* None when the state is gone
        keys == Hashes(prior, o.lo, o.hi)
        M2 == [M1 EXCEPT !.acked = j,
                         !.inflight[r] = IF @ <= 1 THEN 0 ELSE @ - 1,
                         !.chain[r] = @ \o keys,
                         !.okeys = Append(@, keys),
                         !.last[r] = IF M1.hasSt[r] THEN keys[Len(keys)] ELSE @,
                         !.hostFree = IF BUG = "HostFreeAtWriteAck"
                                      THEN [rk \in Ranks |-> @[rk] + Size(o)] ELSE @]
    IN IF M2.phase[r] \in {"Finished", "Released"} /\ M2.inflight[r] = 0 /\ BUG # "NoReleaseAtAck"
       THEN Release(M2, r)
       ELSE M2

RECURSIVE AckFold(_, _, _)
AckFold(M, i, j) == IF i > j THEN M ELSE AckFold(AckOne(M, i), i + 1, j)

\* How many backup acks each rank retires: the all_reduce MIN of the queue lengths.
BackupCounts == LET local == [rk \in Ranks |-> stored[rk] - freed[rk]]
                IN IF BUG = "LocalAckCounts" THEN local
                   ELSE [rk \in Ranks |-> Min({local[x] : x \in Ranks})]

-----------------------------------------------------------------------------
Init ==
    /\ s = [phase |-> [r \in Reqs |-> "Waiting"], len |-> [r \in Reqs |-> 0],
            dev |-> [r \in Reqs |-> {}], devFree |-> DevSlots - TreePre, locks |-> 0, prot |-> 0,
            treeOk |-> TRUE, hasSt |-> [r \in Reqs |-> FALSE], inc |-> [r \in Reqs |-> 0],
            last |-> [r \in Reqs |-> 0], inflight |-> [r \in Reqs |-> 0], rel |-> [r \in Reqs |-> 0],
            chain |-> [r \in Reqs |-> <<>>], ops |-> <<>>, okeys |-> <<>>, acked |-> 0,
            odata |-> [rk \in Ranks |-> <<>>], stored |-> [rk \in Ranks |-> 0],
            freed |-> [rk \in Ranks |-> 0], hostFree |-> [rk \in Ranks |-> HostSlots],
            store |-> [rk \in Ranks |-> {}]]
    /\ act = <<"Init">>
    /\ note = <<>>

\* The request's prompt KV arrives from the prefill side into freshly allocated slots; with a
\* decode radix cache the prompt's first TreePre pages are a locked prefix hit instead.
Admit(r) ==
    /\ phase[r] = "Waiting"
    /\ DevFits(Pre - TreePre)
    /\ Set([Now EXCEPT !.phase[r] = "Decoding", !.len[r] = Pre, !.dev[r] = Range(TreePre, Pre),
                       !.devFree = @ - (Pre - TreePre),
                       !.locks = IF TreePre > 0 THEN @ + 1 ELSE @,
                       !.prot = IF TreePre > 0 /\ locks = 0 THEN @ + TreePre ELSE @])
    /\ Rec(<<"Admit", r>>, <<>>)

\* One more page of KV is computed (the forward pass writes its slot).
Decode(r) ==
    /\ phase[r] = "Decoding" /\ len[r] < MaxLen
    /\ DevFits(1)
    /\ Set([Now EXCEPT !.len[r] = @ + 1, !.dev[r] = @ \cup {len[r]}, !.devFree = @ - 1])
    /\ Rec(<<"Decode", r>>, <<>>)

\* The scheduler calls offload_kv_cache(req) for a request that is still decoding.
Offload(r) ==
    /\ phase[r] = "Decoding"
    /\ Set(Offloaded(Now, r))
    /\ Rec(<<"Offload", r>>, <<Outcome(Now, r)>>)

\* The request finishes: offload_kv_cache(req) once more, and if that issued nothing,
\* finalize_release_on_finish(req).
Finish(r) ==
    /\ phase[r] = "Decoding"
    /\ LET M1 == [Now EXCEPT !.phase[r] = "Finished"]
           out == Outcome(M1, r)
       IN /\ Set(IF out = "issued" THEN Offloaded(M1, r) ELSE Finalize(Offloaded(M1, r), r))
          /\ Rec(<<"Finish", r>>, <<out, inflight[r]>>)

\* check_offload_progress: agree the counts, retire every queued write ack in order, then free
\* the host slots of as many backed-up increments as every rank has acknowledged.
Check ==
    LET nW == Len(ops) - acked
        nB == BackupCounts
        M1 == AckFold(Now, acked + 1, Len(ops))
        M2 == [M1 EXCEPT !.freed = [rk \in Ranks |-> @[rk] + nB[rk]],
                         !.hostFree = [rk \in Ranks |->
                             @[rk] + SumSizes(ops, freed[rk] + 1, freed[rk] + nB[rk])]]
    IN /\ nW > 0 \/ \E rk \in Ranks : nB[rk] > 0
       /\ Set(M2)
       /\ Rec(<<"Check">>, <<nW, {r \in Reqs : M2.phase[r] = "Released" /\ phase[r] # "Released"}>>)

\* Rank rk's copy engine finishes its oldest pending device->host copy.
Copy(rk) ==
    /\ Len(odata[rk]) < Len(ops)
    /\ Set([Now EXCEPT !.odata[rk] = Append(@, CopyOk(Now, Len(@) + 1))])
    /\ Rec(<<"Copy", rk>>, <<>>)

\* Rank rk's backup thread writes its oldest staged increment to storage; a page whose hash
\* is already stored is skipped (the file backend's exists() check).  The bytes are right iff
\* the copy was right and the host slots are still the increment's.
Store(rk) ==
    /\ stored[rk] < acked
    /\ LET j == stored[rk] + 1
           r == ops[j].r
           ok == odata[rk][j] /\ j > freed[rk] /\ BUG # "HostFreeAtWriteAck"
           have == {e.k : e \in {e2 \in store[rk] : e2.r = r}}
           new == {[r |-> r, k |-> k, ok |-> ok] : k \in {okeys[j][i] : i \in DOMAIN okeys[j]} \ have}
       IN Set([Now EXCEPT !.stored[rk] = j, !.store[rk] = @ \cup new])
    /\ Rec(<<"Store", rk>>, <<>>)

-----------------------------------------------------------------------------
Next ==
    \/ \E r \in Reqs : Admit(r) \/ Decode(r) \/ Offload(r) \/ Finish(r)
    \/ Check
    \/ \E rk \in Ranks : Copy(rk) \/ Store(rk)

\* The scheduler loop keeps iterating; copy engines and backup threads keep running.
\* Requests need not finish (no fairness on Finish).
\* WF_vars(Check) written out with Check's guard in place of ENABLED <<Check>>_vars (they are
\* equal: a Check whose guard holds always retires something), because TLC re-evaluates the
\* whole ack fold for every ENABLED test.
CheckDue == Len(ops) > acked \/ \E rk \in Ranks : BackupCounts[rk] > 0
Fairness == /\ <>[]CheckDue => []<><<Check>>_vars
            /\ \A rk \in Ranks : WF_vars(Copy(rk)) /\ WF_vars(Store(rk))

Spec == Init /\ [][Next]_vars
LiveSpec == Spec /\ Fairness

-----------------------------------------------------------------------------
(* Invariants *)

OpIds == 1..Len(ops)
Pending == {j \in OpIds : j > acked}

TypeOK ==
    /\ phase \in [Reqs -> Phases]
    /\ len \in [Reqs -> 0..MaxLen]
    /\ dev \in [Reqs -> SUBSET Range(0, MaxLen)]
    /\ hasSt \in [Reqs -> BOOLEAN]
    /\ inflight \in [Reqs -> Nat]
    /\ acked \in 0..Len(ops)
    /\ \A rk \in Ranks : stored[rk] \in 0..acked /\ freed[rk] \in 0..Len(ops)
                         /\ Len(odata[rk]) \in acked..Len(ops)

\* Every device slot is free, owned by exactly one live request, or the radix prefix's.
SlotAccounting ==
    devFree + Cardinality(UNION {{<<r, i>> : i \in dev[r]} : r \in Reqs}) + TreePre = DevSlots

\* No slot is freed while a live request can still read it: a decoding request owns every
\* committed page of its own, and the prefix pages it reads are still the tree's.
LiveReadsOwned ==
    \A r \in Reqs : phase[r] = "Decoding" => dev[r] = Own(r, len[r])

TreeSlotsOwned == treeOk

\* The prefix lock and protected_size_ agree (inc_lock_ref/dec_lock_ref bookkeeping).
ProtectedMatchesLocks ==
    /\ locks = Cardinality({r \in Reqs : TreePre > 0 /\ phase[r] \in Live})
    /\ prot = IF locks > 0 THEN TreePre ELSE 0

\* No device slot is freed while a device->host copy of it is pending on any rank.
NoFreeUnderCopy ==
    \A rk \in Ranks : \A j \in OpIds :
        j > Len(odata[rk]) => Pages(ops[j]) \subseteq dev[ops[j].r]

\* Each request is released exactly once, and only after it finished.
ReleasedOnce ==
    \A r \in Reqs : /\ rel[r] <= 1
                    /\ (phase[r] = "Released") <=> (rel[r] = 1)

\* The in-flight count is exactly the request's unacknowledged increments (never negative),
\* and a released request has none.
InflightAccounting ==
    \A r \in Reqs : inflight[r] = Cardinality({j \in Pending : ops[j].r = r})

ReleaseWaits == \A r \in Reqs : phase[r] = "Released" => \A j \in Pending : ops[j].r # r

\* Host slots: held by every increment whose backup ack has not been processed, freed exactly
\* once after it.
HostAccounting ==
    \A rk \in Ranks : hostFree[rk] + SumSizes(ops, freed[rk] + 1, Len(ops)) = HostSlots

HostFreedAfterBackup == \A rk \in Ranks : freed[rk] <= stored[rk]

\* The page hashes a request handed to storage are the hash chain of its token sequence from
\* the prompt on: pages Pre+1, Pre+2, ... in order, no gap, no duplicate.
HashChain == \A r \in Reqs : chain[r] = [j \in 1..Len(chain[r]) |-> Pre + j]

\* Offloaded increments are covered by write acks in order without gap: the state's inc_len
\* is the sum of the request's increments.
IncAccounting ==
    \A r \in Reqs : hasSt[r] =>
        inc[r] = SumSizes(SelectSeq(ops, LAMBDA o : o.r = r), 1, Len(SelectSeq(ops, LAMBDA o : o.r = r)))

\* The host copies and storage hold the KV that was written.
HostCopiesRight == \A rk \in Ranks : \A j \in DOMAIN odata[rk] : odata[rk][j]
StorageRight == \A rk \in Ranks : \A e \in store[rk] : e.ok

\* Every rank frees host memory in lockstep (its host pool is identical to the others').
RanksAgree == \A a, b \in Ranks : freed[a] = freed[b] /\ hostFree[a] = hostFree[b]

\* The fairness condition's stand-in for ENABLED <<Check>>_vars is exact.
CheckDueExact == CheckDue <=> ENABLED <<Check>>_vars

(* Liveness (under Fairness) *)

\* A finished request is eventually released when acks keep coming.
FinishedReleased == \A r \in Reqs : phase[r] = "Finished" ~> phase[r] = "Released"

\* Every increment's host slots eventually come back, on every rank.
HostReturned == \A rk \in Ranks : \A n \in 1..(Cardinality(Reqs) * MaxLen) :
                    Len(ops) >= n ~> freed[rk] >= n

-----------------------------------------------------------------------------
(* Witnesses: each Never... must be refuted by TLC (the scenario is reachable) *)

NeverHostFull == ~(act[1] \in {"Offload", "Finish"} /\ note[1] = "full")
NeverReleaseAtAck == ~(act[1] = "Check" /\ note[2] # {})
NeverFinishWaits == ~(act[1] = "Finish" /\ note[1] # "issued" /\ note[2] > 0)
NeverTwoAcksPerCheck == ~(act[1] = "Check" /\ note[1] >= 2)
NeverSkew == \A a, b \in Ranks : stored[a] = stored[b] /\ Len(odata[a]) = Len(odata[b])
NeverStoredTwice == ~(\E r \in Reqs : Len(chain[r]) >= 2)
=============================================================================
