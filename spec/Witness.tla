------------------------------ MODULE Witness ------------------------------
(***************************************************************************)
(* Reachability witnesses: each property claims a scenario NEVER happens.  *)
(* spec-check expects TLC to refute every one of them, which shows that    *)
(* the safety run really explores the hazardous corners (no vacuity).      *)
(***************************************************************************)
EXTENDS ToolKV

\* tool_start refused because the host pool cannot take the path's backups.
NeverHostFullAtWrite ==
    [][~(act'[1] = "ToolStart" /\ ref'[act'[2]] # NoNode /\ phase'[act'[2]] = "Running")]_vars

\* tool_end with the right epoch, but load_back finds no device memory.
NeverLoadBackFailure ==
    [][~(act'[1] = "ToolEnd" /\ phase[act'[2]] = "Offloaded" /\ act'[3] = epoch[act'[2]]
         /\ phase'[act'[2]] = "Offloaded")]_vars

\* tool_start finds the remembered node gone and re-resolution fails.
NeverStaleResolved ==
    [][~(act'[1] = "ToolStart" /\ ref[act'[2]] # NoNode /\ ref'[act'[2]] = NoNode)]_vars

\* A protected node is split while its session is offloaded or offloading.
NeverSplitProtected ==
    [][~(act'[1] = "Split" /\ hostRef[act'[2]] > 0)]_vars

\* A write ack lets the manager free GPU copies.
NeverFreeOnAck ==
    [][~(act'[1] = "WriteAck" /\ devFree' > devFree)]_vars

\* LazyFree: HiCache's eviction takes the GPU copy an offload left on the device.
NeverLazyEvicted ==
    [][~(act'[1] = "GpuEvict" /\ \E s \in Sessions : phase[s] = "Offloaded" /\ act'[2] \in Path(ref[s]))]_vars

\* LazyFree: a tool_end finds the offloaded path still on the GPU and hands it over with no load.
NeverResidentHandover ==
    [][~(act'[1] = "ToolEnd" /\ phase[act'[2]] = "Offloaded" /\ phase'[act'[2]] = "Handover"
         /\ loadAcks' = loadAcks)]_vars

\* A load ack completes a restore: the session is handed over to its next request.
NeverRestoreCompletes ==
    [][~(act'[1] = "LoadAck" /\ \E s \in Sessions : phase[s] = "Restoring" /\ phase'[s] = "Handover")]_vars

\* A restored session's next request is admitted while its path is pinned: the hand-over ends.
NeverHandedOver ==
    [][~(act'[1] = "Admit")]_vars

\* A tool_start short of free host slots makes room by evicting an unprotected host copy.
NeverRoomMade ==
    [][~(act'[1] = "HostRoom")]_vars

\* A tool_start short of host room drops the mirror of a device copy another request locks (Unmirror).
NeverUnmirrored ==
    [][~(act'[1] = "HostUnmirror")]_vars

\* A tree reset loses an offloaded session.
NeverLostOnReset == \A s \in Sessions : phase[s] # "Lost"

\* A toolkv restore's load and two of sglang's own loads are in flight together (a full ring).
NeverBunchedLoads ==
    ~(Len(ring) = Ring /\ \E i \in 1..Len(ring) : ring[i].who = "tkv")

\* Both sessions hold protections at the same time.
NeverTwoProtected == Cardinality({s \in Sessions : prot[s] # NoNode}) < 2

\* Policy: an early restore's load is acknowledged and the session waits Kept for its tool_end.
NeverPrefetchWarm ==
    [][~(act'[1] = "LoadAck" /\ \E s \in Sessions : phase[s] = "Prefetching" /\ phase'[s] = "Kept")]_vars

\* Policy: a kept session's tool_end finds its KV resident.
NeverKeptResumed ==
    [][~(act'[1] = "ToolEnd" /\ phase[act'[2]] = "Kept" /\ phase'[act'[2]] = "Handover")]_vars

\* Load-adaptive protection: a parked session's request is admitted and sglang's load_back loads
\* its evicted KV; and a hand-over gives its pin up for the room (Unpin to Parked).
NeverParkedAdmitted ==
    [][~(act'[1] = "Admit" /\ phase[act'[2]] = "Parked" /\ loadAcks'[ref[act'[2]]] > loadAcks[ref[act'[2]]])]_vars
NeverUnpinnedParked ==
    [][~(act'[1] = "Unpin" /\ phase'[act'[2]] = "Parked")]_vars

\* With the ring: a parked session's admission loads its path back and its batch starts the load
\* together with toolkv's queued restore of another session (one "sys" slot, nothing left queued).
NeverParkedAdmitTakesQueue ==
    [][~(act'[1] = "Admit" /\ phase[act'[2]] = "Parked" /\ queued # {} /\ Len(ring') > Len(ring))]_vars

\* Policy: HiCache evicts the host copy of a demoted session.
NeverDemotedEvicted ==
    [][~(act'[1] = "HostEvict" /\ \E s \in Sessions : phase[s] = "Released" /\ act'[2] = ref[s])]_vars
=============================================================================
