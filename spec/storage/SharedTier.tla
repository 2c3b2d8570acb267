----------------------------- MODULE SharedTier -----------------------------
(***************************************************************************)
(* The L3 tier shared by a fleet when it is Mooncake: what differs from    *)
(* the file backend of StorageTier.tla, and the session that moves between *)
(* servers.                                                                *)
(*                                                                         *)
(* StorageTier.tla's L3Evict may take a page only of a copy that toolkv    *)
(* does not protect: HiCacheFile has no evictor toolkv cannot see (toolkv  *)
(* refuses a file backend with one).  Mooncake's master evicts on its own  *)
(* (above its high watermark, approximate LRU) and knows nothing of        *)
(* toolkv's record: it skips only objects that are hard-pinned, leased (a  *)
(* lease is seconds long, from an exists or a read), not yet complete, or  *)
(* soft-pinned while their soft-pin deadline is ahead (with the master's   *)
(* allow_evict_soft_pinned_objects off).  So the protection toolkv holds   *)
(* over a stored copy must be Mooncake's soft pin, with a deadline past    *)
(* the session's TTL: the pin lapses only once toolkv no longer relies on  *)
(* it.  The pin is taken by the put itself (toolkv writes the session's    *)
(* pages with one upsert whose ReplicateConfig carries soft_pin_action     *)
(* ENABLE; sglang's own backup puts carry none): between a page's put and  *)
(* the StoreAck nothing else would keep the master from evicting it, and   *)
(* a store whose pages went before the ack comes back short (mutant        *)
(* PinAtAck, the pin taken only at the ack: PutKept).  The pins of a store *)
(* that is not acknowledged whole (short, released, a new epoch) are       *)
(* released at once (PinsReleased); only a server that died mid-store      *)
(* leaves them to their deadline (mutant ShortKeepsPin keeps them).        *)
(*                                                                         *)
(* The fleet: servers run toolkv each, one shared tier.  A server that is  *)
(* drained takes its toolkv records with it; the session is then known to  *)
(* no server (owner = NoServer), and what survives is the tier: its pages  *)
(* and its manifest (one small object: the session's epoch and token      *)
(* count, written and pinned with the pages at the StoreAck).  A tool_end  *)
(* that reaches a server that does not know the session adopts it when the *)
(* manifest is there and names the epoch the call carries; a stale epoch  *)
(* is refused as on the server that stored it.  The adopted session is     *)
(* read at arrival (StorageTier.tla's ToolEndAtArrival): sglang's prefetch *)
(* of the next request reads the tier on the adopting server.              *)
(*                                                                         *)
(* Unit: one page; the GPU and host tiers are left to StorageTier.tla (a   *)
(* Running session's KV is on its server's GPU; a Storing one's host copy  *)
(* is protected by its server until the ack).  No clock: a pin lapses, the *)
(* TTL fires and servers are drained at any time their guards allow.       *)
(*                                                                         *)
(* Faults.  A server killed mid-store is Drain of a Storing session: its   *)
(* pages may be in the tier, unpinned, and no manifest names them; a       *)
(* server adopts only what a manifest names, so the manifest is what keeps *)
(* a partial store from being adopted as whole (mutant ManifestAtStore     *)
(* writes it when the store starts).  The manifest carries the epoch it    *)
(* was written at and goes at the arrival read on whichever server, or an  *)
(* older epoch's copy would be adopted by a stale tool_end after a newer   *)
(* store died with its server (mutant ManifestKept).  With Restart, the    *)
(* master is restarted (MasterRestart): it keeps its object metadata in    *)
(* memory, so every copy in the tier is gone, acknowledged or not; the     *)
(* StoreAck asks the tier whether each page exists (batch_is_exist) rather *)
(* than counting the backup thread's puts (mutant AckByPuts), so a store   *)
(* whose pages a restart wiped is short and the session keeps its host     *)
(* copy.  A copy lost after its ack is history (lost): the session is then *)
(* neither adopted (no manifest) nor restored from a partial copy; its     *)
(* next turn recomputes what the tier no longer holds.  The store full is  *)
(* StorageTier.tla's short write (a put refused): StoreAck short here.     *)
(*                                                                         *)
(* The pin budget.  The master evicts no page whose soft pin is ahead, so  *)
(* pinned copies that fill the store make it refuse every later put.  A    *)
(* server cannot ask Mooncake's client for the tier's capacity (its        *)
(* MooncakeDistributedStore has no such call; only the master knows the    *)
(* mounted segments), so the budget is per server: PinBudget pages that    *)
(* this server's puts may hold soft-pinned at once (the operator's share   *)
(* of the tier over the fleet).  A Store that would exceed it is not       *)
(* pinned-put: it is refused, and the session stays on its protected host  *)
(* copy as with any refused Store.  The pages a server's puts pinned stay  *)
(* charged to it (pinner) when another server adopts the session.  Mutant  *)
(* NoPinCap: no cap (PinsWithinBudget).                                    *)
(***************************************************************************)
EXTENDS Naturals, FiniteSets

CONSTANTS
    Sessions,  \* agent sessions (model values)
    Servers,   \* servers of the fleet (model values)
    NoServer,  \* owner of a session no server knows (a model value not in Servers)
    P,         \* pages per session
    MaxEpoch,  \* bound on tool calls per session
    Restart,   \* BOOLEAN: the master may be restarted (its objects lost)
    PinBudget, \* pages one server's puts may hold soft-pinned in the tier at once
    BUG        \* "none" or the name of one seeded defect

Bugs == {"none", "NoSoftPin", "PinTtlShort", "NoEpochFence", "ManifestAtStore", "ManifestKept",
         "AckByPuts", "PinAtAck", "ShortKeepsPin", "LetGoEarly", "NoPinCap"}

ASSUME /\ P \in Nat \ {0} /\ MaxEpoch \in Nat /\ BUG \in Bugs /\ NoServer \notin Servers
       /\ Restart \in BOOLEAN /\ PinBudget \in Nat

NoManifest == 0  \* manifest[s]: no manifest in the tier (epochs of stores start at 1)

Pg == 1..P

Phases == {"Running",   \* the session's request runs on its owner (KV on its GPU)
           "Storing",   \* tool_start, the policy stores it: the pages are being put to the tier
           "Stored",    \* StoreAck whole: the copy and the manifest are in the tier, pinned
           "Arriving",  \* tool_end accepted; the next request's arrival read has not run yet
           "Closed"}    \* closed, expired, or lost with its server

VARIABLES
    phase,     \* [Sessions -> Phases]
    owner,     \* [Sessions -> Servers \cup {NoServer}]: the server whose toolkv knows the session
    epoch,     \* [Sessions -> 0..MaxEpoch]: the session's epoch (one per tool call)
    l3,        \* [Sessions -> SUBSET Pg]: the session's pages in the tier
    put,       \* [Sessions -> SUBSET Pg]: pages the backup thread put for the current store
    manifest,  \* [Sessions -> 0..MaxEpoch]: the epoch the session's manifest in the tier names
               \* (NoManifest: none)
    spin,      \* [Sessions -> BOOLEAN]: Mooncake's soft pin on the copy (deadline ahead)
    ppin,      \* [Sessions -> SUBSET Pg]: pages the current store's puts soft-pinned, before its ack
    l3prot,    \* [Sessions -> BOOLEAN]: toolkv relies on the copy in the tier
    alive,     \* [Servers -> BOOLEAN]: the server has not been drained
    adopted,   \* [Sessions -> BOOLEAN]: history: a server other than the storing one took it
    stale,     \* [Sessions -> BOOLEAN]: history: a tool_end with a stale epoch was accepted
    lost,      \* [Sessions -> BOOLEAN]: history: a restart wiped the session's acknowledged copy
    wiped,     \* [Sessions -> BOOLEAN]: history: a restart during the current store
    pinner     \* [Sessions -> Servers \cup {NoServer}]: the server whose puts took the session's pins

vars == <<phase, owner, epoch, l3, put, manifest, spin, ppin, l3prot, alive, adopted, stale, lost,
          wiped, pinner>>

Init ==
    /\ phase = [s \in Sessions |-> "Running"]
    /\ owner \in [Sessions -> Servers]
    /\ epoch = [s \in Sessions |-> 0]
    /\ l3 = [s \in Sessions |-> {}]
    /\ put = [s \in Sessions |-> {}]
    /\ manifest = [s \in Sessions |-> NoManifest]
    /\ spin = [s \in Sessions |-> FALSE]
    /\ l3prot = [s \in Sessions |-> FALSE]
    /\ alive = [v \in Servers |-> TRUE]
    /\ adopted = [s \in Sessions |-> FALSE]
    /\ stale = [s \in Sessions |-> FALSE]
    /\ lost = [s \in Sessions |-> FALSE]
    /\ ppin = [s \in Sessions |-> {}]
    /\ wiped = [s \in Sessions |-> FALSE]
    /\ pinner = [s \in Sessions |-> NoServer]

Known(s) == owner[s] # NoServer

\* The session's pages under a soft pin: those its current store's puts took, and its copy's.
Pinned(s) == ppin[s] \cup (IF spin[s] THEN l3[s] ELSE {})

RECURSIVE SumPinned(_)
SumPinned(S) == IF S = {} THEN 0 ELSE LET t == CHOOSE t \in S : TRUE
                                      IN Cardinality(Pinned(t)) + SumPinned(S \ {t})

\* What the server counts against its budget for a session: a store in flight all its P pages
\* (its puts are under way: the implementation puts them all in one upsert at the Store), else
\* the pages its pins hold.
Charge(t) == IF phase[t] = "Storing" THEN P ELSE Cardinality(Pinned(t))

RECURSIVE SumCharge(_)
SumCharge(S) == IF S = {} THEN 0 ELSE LET t == CHOOSE t \in S : TRUE
                                      IN Charge(t) + SumCharge(S \ {t})

\* Pages server v counts against its budget, leaving out session s (whose store replaces its own).
PinnedBy(v, s) == SumCharge({t \in Sessions \ {s} : pinner[t] = v})

\* The cap: a store of P pages fits the server's pin budget (NoPinCap: no cap).
PinFits(s) == BUG = "NoPinCap" \/ PinnedBy(owner[s], s) + P <= PinBudget

-----------------------------------------------------------------------------
(* toolkv on the session's server *)

\* tool_start, then Store: the session's pages are put to the tier (toolkv's upsert from the
\* protected host copy, each put soft-pinned; PinAtAck leaves the write to sglang's backup thread,
\* whose puts carry no soft pin).  The epoch of the new call.  ManifestAtStore writes the manifest (and
\* pins it) now, before any page is in the tier.
Store(s) ==
    /\ phase[s] = "Running" /\ Known(s) /\ epoch[s] < MaxEpoch
    /\ PinFits(s)
    /\ phase' = [phase EXCEPT ![s] = "Storing"]
    /\ pinner' = [pinner EXCEPT ![s] = owner[s]]
    /\ epoch' = [epoch EXCEPT ![s] = @ + 1]
    /\ put' = [put EXCEPT ![s] = {}]
    /\ lost' = [lost EXCEPT ![s] = FALSE]
    /\ wiped' = [wiped EXCEPT ![s] = FALSE]
    /\ IF BUG = "ManifestAtStore"
       THEN /\ manifest' = [manifest EXCEPT ![s] = epoch[s] + 1]
            /\ spin' = [spin EXCEPT ![s] = TRUE]
       ELSE UNCHANGED <<manifest, spin>>
    /\ UNCHANGED <<owner, l3, ppin, l3prot, alive, adopted, stale>>

\* One more page is put (PutStart .. PutEnd: readable once complete), soft-pinned by its put's
\* ReplicateConfig (none under PinAtAck, nor under NoSoftPin).
StorePage(s, p) ==
    /\ phase[s] = "Storing" /\ p \notin put[s]
    /\ l3' = [l3 EXCEPT ![s] = @ \cup {p}]
    /\ put' = [put EXCEPT ![s] = @ \cup {p}]
    /\ ppin' = [ppin EXCEPT ![s] = IF BUG \in {"PinAtAck", "NoSoftPin"} THEN @ ELSE @ \cup {p}]
    /\ UNCHANGED <<phase, owner, epoch, manifest, spin, l3prot, alive, adopted, stale, lost, wiped, pinner>>

\* The StoreAck: every page exists (batch_is_exist), then the manifest is put beside them with
\* soft_pin_action ENABLE; the pages' pins, taken by their puts, are now the copy's (PinAtAck
\* pins the pages only here, by an upsert of every page).  NoSoftPin trusts the master with
\* toolkv's record alone, as sglang's puts do.  Short (a page missing at the check: only a
\* restart takes a pinned page): the session stays on its protected host copy (Running here: its
\* next turn needs nothing from the tier) and the pins its puts took are released (ShortKeepsPin
\* keeps them).  AckByPuts takes the puts for the tier's word.
StoreAck(s) ==
    /\ phase[s] = "Storing" /\ Known(s)
    /\ IF (IF BUG = "AckByPuts" THEN put[s] ELSE l3[s]) = Pg
       THEN /\ phase' = [phase EXCEPT ![s] = "Stored"]
            /\ manifest' = [manifest EXCEPT ![s] = epoch[s]]
            /\ spin' = [spin EXCEPT ![s] = BUG # "NoSoftPin"]
            /\ l3prot' = [l3prot EXCEPT ![s] = TRUE]
            /\ ppin' = [ppin EXCEPT ![s] = {}]
       ELSE /\ phase' = [phase EXCEPT ![s] = "Running"]
            /\ ppin' = [ppin EXCEPT ![s] = IF BUG = "ShortKeepsPin" THEN @ ELSE {}]
            /\ UNCHANGED <<manifest, spin, l3prot>>
    /\ UNCHANGED <<owner, epoch, l3, put, alive, adopted, stale, lost, wiped, pinner>>

\* A tool_end with epoch e reaches server v.  On the server that knows the session: accepted for
\* its epoch (the read at arrival follows).  On a server that does not know it, whatever the
\* session's phase was (that server cannot see it): adopted when the tier holds a manifest that
\* names e and its pin's deadline is ahead (the manifest records it; NoEpochFence adopts whatever
\* epoch the call carries); the adopter relies on the copy until the arrival read.  Anything else
\* is refused and changes nothing (unknown_session, stale epoch).
ToolEnd(s, v, e) ==
    /\ alive[v]
    /\ \/ owner[s] = v /\ phase[s] = "Stored" /\ e = epoch[s]
       \/ owner[s] = NoServer /\ manifest[s] # NoManifest /\ spin[s]
          /\ (e = manifest[s] \/ BUG = "NoEpochFence")
    /\ phase' = [phase EXCEPT ![s] = "Arriving"]
    /\ adopted' = [adopted EXCEPT ![s] = @ \/ owner[s] # v]
    /\ owner' = [owner EXCEPT ![s] = v]
    /\ stale' = [stale EXCEPT ![s] = @ \/ e # epoch[s]]
    /\ l3prot' = [l3prot EXCEPT ![s] = TRUE]
    /\ UNCHANGED <<epoch, l3, put, manifest, spin, ppin, alive, lost, wiped, pinner>>

\* The next request arrives on the session's server: sglang's prefetch reads what the tier holds
\* (a lease covers each read) and toolkv's reliance on the copy ends; the pin lapses at its
\* deadline.  The manifest is removed, on the adopting server and on the one that stored it alike:
\* the session is known again (ManifestKept leaves it to its pin's deadline).
ArrivalRead(s) ==
    /\ phase[s] = "Arriving"
    /\ phase' = [phase EXCEPT ![s] = "Running"]
    /\ l3prot' = [l3prot EXCEPT ![s] = FALSE]
    /\ manifest' = [manifest EXCEPT ![s] = IF BUG = "ManifestKept" THEN @ ELSE NoManifest]
    /\ UNCHANGED <<owner, epoch, l3, put, spin, ppin, alive, adopted, stale, lost, wiped, pinner>>

\* The TTL or close, on the server that knows the session; for a session no server knows, its
\* TTL passing (its pin's deadline is later still).  A store in flight is let go: the pins its
\* puts took are released.
Release(s) ==
    /\ (Known(s) => alive[owner[s]]) /\ phase[s] # "Closed"
    /\ phase' = [phase EXCEPT ![s] = "Closed"]
    /\ l3prot' = [l3prot EXCEPT ![s] = FALSE]
    /\ ppin' = [ppin EXCEPT ![s] = {}]
    /\ UNCHANGED <<owner, epoch, l3, put, manifest, spin, alive, adopted, stale, lost, wiped, pinner>>

\* A server that is drained but stays up (the router sends it nothing new) lets go of a session
\* the tier holds whole: its record goes as Drain's would, the copy and its manifest stay, pinned,
\* for the server its next tool_end reaches (which adopts it, owner = NoServer).  Only a Stored
\* one: a store in flight has no manifest yet (LetGoEarly lets it go: UnknownOnlyStored).  The
\* other sessions of a drained server are let go by Release (nothing of theirs is in the tier
\* whole; their next turn, routed elsewhere, recomputes them), once nothing of theirs is in flight.
LetGo(s) ==
    /\ Known(s) /\ alive[owner[s]]
    /\ phase[s] = "Stored" \/ (BUG = "LetGoEarly" /\ phase[s] = "Storing")
    /\ owner' = [owner EXCEPT ![s] = NoServer]
    /\ UNCHANGED <<phase, epoch, l3, put, manifest, spin, ppin, l3prot, alive, adopted, stale, lost,
                   wiped, pinner>>

-----------------------------------------------------------------------------
(* The fleet and the tier *)

\* A server is drained (or killed): its toolkv records go with it.  Its Stored sessions are known
\* to no server; their copies stay in the tier, pinned.  A session mid-store or running there is
\* lost (its write was never acknowledged: no manifest; the pins its puts took stay to their
\* deadline, PutPinLapse: nobody is left to release them).  One server stays.
Drain(v) ==
    /\ alive[v] /\ \E w \in Servers \ {v} : alive[w]
    /\ alive' = [alive EXCEPT ![v] = FALSE]
    /\ owner' = [s \in Sessions |-> IF owner[s] = v THEN NoServer ELSE owner[s]]
    /\ phase' = [s \in Sessions |->
                    IF owner[s] = v /\ phase[s] \in {"Running", "Storing", "Arriving"}
                    THEN "Closed" ELSE phase[s]]
    /\ l3prot' = [s \in Sessions |->
                    IF owner[s] = v /\ phase[s] # "Stored" THEN FALSE ELSE l3prot[s]]
    /\ UNCHANGED <<epoch, l3, put, manifest, spin, ppin, adopted, stale, lost, wiped, pinner>>

\* The soft pin's deadline passes.  toolkv sets it past the session's TTL, so it passes only once
\* toolkv no longer relies on the copy (PinTtlShort: a deadline shorter than the TTL).
PinLapse(s) ==
    /\ spin[s] /\ (~l3prot[s] \/ BUG = "PinTtlShort")
    /\ spin' = [spin EXCEPT ![s] = FALSE]
    /\ UNCHANGED <<phase, owner, epoch, l3, put, manifest, ppin, l3prot, alive, adopted, stale, lost,
                   wiped, pinner>>

\* The deadline of the pins a store's puts took passes; while the store is in flight it is ahead
\* (the same deadline, past the TTL).
PutPinLapse(s) ==
    /\ ppin[s] # {} /\ (phase[s] # "Storing" \/ BUG = "PinTtlShort")
    /\ ppin' = [ppin EXCEPT ![s] = {}]
    /\ UNCHANGED <<phase, owner, epoch, l3, put, manifest, spin, l3prot, alive, adopted, stale, lost,
                   wiped, pinner>>

\* Mooncake's master evicts a complete object that is not soft-pinned (its lease, seconds long,
\* is taken to have expired: any time).  toolkv's own record does not stop it.
MasterEvictPage(s, p) ==
    /\ p \in l3[s] /\ ~spin[s] /\ p \notin ppin[s]
    /\ l3' = [l3 EXCEPT ![s] = @ \ {p}]
    /\ UNCHANGED <<phase, owner, epoch, put, manifest, spin, ppin, l3prot, alive, adopted, stale, lost,
                   wiped, pinner>>

MasterEvictManifest(s) ==
    /\ manifest[s] # NoManifest /\ ~spin[s]
    /\ manifest' = [manifest EXCEPT ![s] = NoManifest]
    /\ UNCHANGED <<phase, owner, epoch, l3, put, spin, ppin, l3prot, alive, adopted, stale, lost,
                   wiped, pinner>>

\* Restart: the master is restarted; it held every object's metadata in memory, so the tier is
\* empty afterwards (the storage nodes mount their memory again, empty to the new master).  A
\* session whose acknowledged copy was there has lost it (history).
MasterRestart ==
    /\ Restart
    /\ \E s \in Sessions : l3[s] # {} \/ manifest[s] # NoManifest
    /\ lost' = [s \in Sessions |-> lost[s] \/ phase[s] \in {"Stored", "Arriving"}]
    /\ l3' = [s \in Sessions |-> {}]
    /\ manifest' = [s \in Sessions |-> NoManifest]
    /\ spin' = [s \in Sessions |-> FALSE]
    /\ ppin' = [s \in Sessions |-> {}]
    /\ wiped' = [s \in Sessions |-> wiped[s] \/ phase[s] = "Storing"]
    /\ UNCHANGED <<phase, owner, epoch, put, l3prot, alive, adopted, stale, pinner>>

Next ==
    \/ \E s \in Sessions :
        \/ Store(s) \/ StoreAck(s) \/ ArrivalRead(s) \/ Release(s) \/ PinLapse(s) \/ PutPinLapse(s)
        \/ LetGo(s)
        \/ MasterEvictManifest(s)
        \/ \E p \in Pg : StorePage(s, p) \/ MasterEvictPage(s, p)
        \/ \E v \in Servers, e \in 0..MaxEpoch : ToolEnd(s, v, e)
    \/ \E v \in Servers : Drain(v)
    \/ MasterRestart

Spec == Init /\ [][Next]_vars

-----------------------------------------------------------------------------
(* Invariants *)

TypeOK ==
    /\ phase \in [Sessions -> Phases]
    /\ owner \in [Sessions -> Servers \cup {NoServer}]
    /\ epoch \in [Sessions -> 0..MaxEpoch]
    /\ l3 \in [Sessions -> SUBSET Pg]
    /\ put \in [Sessions -> SUBSET Pg]
    /\ manifest \in [Sessions -> 0..MaxEpoch]
    /\ ppin \in [Sessions -> SUBSET Pg]
    /\ alive \in [Servers -> BOOLEAN]
    /\ pinner \in [Sessions -> Servers \cup {NoServer}]

\* A session no server knows is a Stored one whose server was drained (or a closed one).
UnknownOnlyStored == \A s \in Sessions : ~Known(s) => phase[s] \in {"Stored", "Closed"}

\* Every copy toolkv relies on in the tier holds Mooncake's soft pin: the master honours nothing
\* else (but a restart, which takes pins and objects alike).
ReliedOnIsPinned == \A s \in Sessions : l3prot[s] /\ ~lost[s] => spin[s]

\* A Stored session, known or not, and one whose tool_end was accepted have their whole copy and
\* their manifest in the tier: the arrival read finds every page, on whichever server.  Only a
\* restart after the ack takes it (lost); a session is never adopted from a partial copy.
StoredWhole ==
    \A s \in Sessions : phase[s] \in {"Stored", "Arriving"} /\ ~lost[s] =>
        l3[s] = Pg /\ manifest[s] = epoch[s]

\* The epoch fence survives the move: no tool_end with a stale epoch is ever accepted.
FenceHeld == \A s \in Sessions : ~stale[s]

\* The session has one owner among the live servers, or none.
OwnerAlive == \A s \in Sessions : Known(s) /\ phase[s] # "Closed" => alive[owner[s]]

\* A page put for the current store stays in the tier until the StoreAck, whatever the master's
\* eviction does: only a restart takes it (wiped).  So a store all of whose puts landed is never
\* short (mutant PinAtAck: pinned only at the ack, a page put first may be evicted before it).
PutKept == \A s \in Sessions : phase[s] = "Storing" /\ ~wiped[s] => put[s] \subseteq l3[s]

\* The pins a store's puts took outlive the store only on a server that died mid-store (nobody is
\* left to release them; their deadline ends them): a short ack, a release, a new epoch let them
\* go at once (mutant ShortKeepsPin).
PinsReleased == \A s \in Sessions : ppin[s] # {} => phase[s] = "Storing" \/ (phase[s] = "Closed" /\ ~Known(s))

\* The pages one server's puts hold soft-pinned never exceed its pin budget: the store does not
\* fill the tier with pins the master may not evict (mutant NoPinCap).
PinsWithinBudget == \A v \in Servers : SumPinned({t \in Sessions : pinner[t] = v}) <= PinBudget

(* Witnesses: refuted by TLC (the scenario is reachable) *)

\* A session stored on one server, that server drained, adopted and read at arrival on another.
NeverAdopted == \A s \in Sessions : ~(adopted[s] /\ phase[s] = "Running")
=============================================================================
