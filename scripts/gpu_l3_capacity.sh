#!/usr/bin/env bash
# L3 as capacity on the GPU (issue 37, item 2), one device call: on the value load, stock sglang 0.5.16 at a
# 16 GB host pool, the same with sglang's own L3 tier (HiCacheFile on the machine's local disk), toolkv at
# 16 GB with that L3, and stock sglang at a 64 GB host pool, taking turns, each config twice where the
# budget allows; the L3 disk's write and read rates are measured in the same call, before the servers start.
#
#   here, once:   RELEASES=0516 bash scripts/gpu_bundle.sh .gpu-bundle-0516   (git-ignored)
#   device call (carry [".gpu-bundle-0516", "out/src"], $OUT set; one call, under its 600-s limit):
#     BUNDLE=$PWD/.gpu-bundle-0516 TOOLKV_SRC=$PWD/out/src bash scripts/gpu_l3_capacity.sh
#     (a second call, for the second run of each config: CONFIGS="stock64 toolkv16l3 stock16l3 stock16" ...)
#   here, after the call:
#     mkdir -p runs/A && tar -xzf <files_at>/l3/results.tar.gz -C runs/A
#     python -m toolkv.tools.value_report runs/A          (two calls: runs/A/r1 runs/B/r1 ...)
#     python scripts/stage/l3_capacity.py report runs/A --disk runs/A/disk.json
#
# Three servers, started together at the beginning (one start-up, about 2 minutes, for all of them; four
# configs one after another with a restart each would not fit in a call), on ports PORT, PORT+1, PORT+2:
#   srv16    --hicache-size 16                                         config stock16
#   srv16l3  --hicache-size 16 --hicache-storage-backend file           configs stock16l3, toolkv16l3
#            --hicache-storage-prefetch-policy wait_complete,
#            SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR=$L3_ROOT/toolkv_l3_srv16l3 (emptied before, removed after)
#   srv64    --hicache-size 64                                         config stock64
# Each as gpu_value_repeat.sh's server (Llama-3.1-8B shape, dummy weights, GPU KV pool capped at 120,000
# tokens, TOOLKV_ENABLE=1 TOOLKV_RESTORE_ON_REQUEST=1 TOOLKV_TTL_S=600, TOOLKV_L3=1, no TOOLKV_POLICY),
# plus --enable-metrics (sglang's L3 counters and toolkv's, the L3 evidence). The configs:
#   stock16, stock16l3, stock64   --mode stock                      (no toolkv call, no session id)
#   toolkv16l3                    --mode explicit --policy offload
# stock16l3 and toolkv16l3 share srv16l3 as stock16 and offload16 share gpu_value_repeat.sh's server
# (a stock bench makes no toolkv call); before each bench there its L3 is emptied (the backend's clear,
# then what is left), after it HiCache's background writes are waited for (at most L3_QUIET_S) and the L3
# directory counted. Every bench flushes its server's cache first and replays the same plan (seed 0).
#
# Why three servers and not four. Host memory: the pools are pinned, 16+16+64 = 96 GB of the machine's
# 128 GiB with three sglang process trees beside them; a fourth (16+16+16+64 = 112 GB) would leave too
# little. GPU memory: sglang sizes its KV pool as free memory at profiling minus (1 - mem-fraction-static)
# x free memory at its start (kv_cache_configurator._profile_available_bytes); servers started together
# each see the others' weights and pools appear in between, so 0.3 (the single-server setting) fails.
# MEM_FRACTION 0.75 leaves room for the 120,000-token pool (14.7 GiB) in any order of the three
# start-ups (worst: all start at 138 GiB free, the other two already hold 2 x 30 GiB: 64 - 0.25 x 138 =
# 29 GiB); the pool itself stays capped by --max-total-tokens, and each server's log is checked for it.
# In use the three hold about 3 x 33 GiB of the 139.
# Fairness: the benches run one at a time; an idle server runs no GPU work (its scheduler loop keeps
# about one CPU core of 16 busy), so a bench against one of three servers measures that server alone.
#
# Environment:
#   CONFIGS    (default "stock16 stock16l3 toolkv16l3 stock64") the order of round 1; round 2 runs it
#              reversed (so that the config the budget cuts from a round is another one)
#   REPEATS    (default 2) rounds; BENCH_ARGS, DURATION, DRAIN: as gpu_value_repeat.sh's LOAD=value
#   BUDGET_S   (default 500; a 560 ran past a 600-s call: stopping three servers and packing take ~45 s) / MIN_LEFT_S (default DURATION + 25, at least 100): no bench starts with fewer
#              than MIN_LEFT_S seconds left; a bench still running at BUDGET_S + 5 is killed; the servers are
#              stopped and the results written in either case. About 100 s a bench after ~150 s of set-up:
#              round 1 (4 benches) fits a call, just; round 2 needs a second call (CONFIGS reversed).
#   MEM_FRACTION (default 0.75) every server's --mem-fraction-static
#   L3_ROOT    (default /tmp, or the checkout where /tmp is a tmpfs) the local disk the L3 directory is on;
#   L3_MIN_FREE (default 0: off) SGLANG_HICACHE_FILE_BACKEND_MIN_FREE_SPACE: with a floor, HiCacheFile evicts
#              (LRU) to keep that much of the disk free, and toolkv then refuses every L3 store (the evictor
#              may delete pages it protects: the first run's 2 victims were l3_store_refused). Off, each bench
#              empties the L3 directory first and one bench wrote at most 34 GB; L3_QUIET_S (default 20) the
#              wait for L3 writes after a bench
#   DISK_PROBE_MB (default 1024), DISK_PROBE_FILES (default 2048): the disk probe's sizes
#   WORK       (default /tmp/toolkv_l3_capacity) raw results: $WORK/runs/r<k>/<config>.json (+ .log,
#              .metrics.before/.after, .l3.txt, .decisions.txt)
#   BUNDLE (default .gpu-bundle), TOOLKV_SRC, PORT (default 30000), DRY_RUN_STUB, PY: as gpu_value_repeat.sh
#              (a dry run launches three stand-ins, scripts/stage/fleet_stub.py, the L3 one with --storage)
# $OUT/l3/ gets: report.md (value_report over the runs, then scripts/stage/l3_capacity.py's disk line, L3
# evidence and × stock64 table), results.tar.gz (r<k>/..., disk.json, machine.txt, report.md: a folder of
# runs for value_report once extracted), server_logs.tar.gz (the three server logs), server_errors.txt
# (tracebacks): all refreshed after every bench, so a call killed at its limit still returns the last.
set -uo pipefail
T0=$SECONDS
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUNDLE=${BUNDLE:-.gpu-bundle}; [[ $BUNDLE == /* ]] || BUNDLE=$ROOT/$BUNDLE
# shellcheck source=scripts/gpu_lib.sh
source "$ROOT/scripts/gpu_lib.sh"
value_load value
BENCH_ARGS=${BENCH_ARGS:-$DEF_ARGS} DURATION=${DURATION:-$DEF_DURATION} REPEATS=${REPEATS:-2}
DRAIN=${DRAIN:-20} BUDGET_S=${BUDGET_S:-500} CONFIGS=${CONFIGS:-stock16 stock16l3 toolkv16l3 stock64}
MIN_LEFT_S=${MIN_LEFT_S:-$(( DURATION + 25 > 100 ? DURATION + 25 : 100 ))}
PORT=${PORT:-30000} SRC=${TOOLKV_SRC:-$ROOT} MEM_FRACTION=${MEM_FRACTION:-0.75}
L3_MIN_FREE=${L3_MIN_FREE:-0} L3_QUIET_S=${L3_QUIET_S:-20}
OUT=${OUT:-/tmp/toolkv_l3_out}; RES=$OUT/l3
WORK=${WORK:-/tmp/toolkv_l3_capacity}
rm -rf "$WORK" && mkdir -p "$WORK/runs" "$RES" || exit 2
FAIL=0
el() { echo $(( SECONDS - T0 )); }
say() { printf '[%4d s] %s\n' "$(el)" "$*"; }

server_of() {  # the server a config runs on
  case $1 in
    stock16) echo srv16 ;;
    stock16l3|toolkv16l3) echo srv16l3 ;;
    stock64) echo srv64 ;;
    *) return 1 ;;
  esac
}
flags_of() { case $1 in stock*) echo "--mode stock" ;; toolkv*) echo "--mode explicit --policy offload" ;; esac; }
declare -A PORT_OF=([srv16]=$PORT [srv16l3]=$(( PORT + 1 )) [srv64]=$(( PORT + 2 )))
declare -A HOST_GB=([srv16]=16 [srv16l3]=16 [srv64]=64)
declare -A PID_OF=() UP=()
SERVERS=()
for c in $CONFIGS; do
  s=$(server_of "$c") || { echo "unknown config $c (stock16, stock16l3, toolkv16l3, stock64)" >&2; exit 2; }
  [[ " ${SERVERS[*]} " == *" $s "* ]] || SERVERS+=("$s")
done
say "CONFIGS=[$CONFIGS] REPEATS=$REPEATS DURATION=$DURATION DRAIN=$DRAIN BUDGET_S=$BUDGET_S MIN_LEFT_S=$MIN_LEFT_S"
say "BENCH_ARGS=$BENCH_ARGS"
say "servers: ${SERVERS[*]}; MEM_FRACTION=$MEM_FRACTION"

# 1. The interpreter: the bundle's sglang 0.5.16, or the stand-in of a dry run.
if [ -n "${DRY_RUN_STUB:-}" ]; then
  PY=${PY:-python3}
  say "dry run: stand-in servers $DRY_RUN_STUB, python $PY"
else
  stage_0516 toolkv_ep_l3 || exit $?
fi
export PYTHONPATH=$SRC${PYTHONPATH:+:$PYTHONPATH} TOOLKV_ENABLE=1 TOOLKV_RESTORE_ON_REQUEST=1 TOOLKV_TTL_S=600 TOOLKV_L3=1
unset TOOLKV_HOST_BUDGET_TOKENS TOOLKV_POLICY
check_bench_args || exit 2

# 2. The machine: memory, GPU, the L3 disk and its rates (before any server, so that nothing else uses it).
{ echo "== free -g"; free -g; echo "== nproc: $(nproc)"; echo "== df -h"; df -h 2>/dev/null
  nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv 2>/dev/null; } > "$WORK/machine.txt"
if [ -z "${DRY_RUN_STUB:-}" ]; then
  avail=$(awk '/MemAvailable/ {printf "%d", $2 / 1e6}' /proc/meminfo)
  need=0; for s in "${SERVERS[@]}"; do need=$(( need + HOST_GB[$s] + 8 )); done
  say "host memory: $avail GB available, the servers' host pools and processes need about $need GB"
  if (( avail < need )) && [[ " ${SERVERS[*]} " == *" srv64 "* ]]; then
    say "not enough host memory for srv64 beside the others: stock64 is not run in this call"
    SERVERS=("${SERVERS[@]/srv64}"); FAIL=1
  fi
fi
L3_ROOT=${L3_ROOT:-}
if [ -z "$L3_ROOT" ]; then
  L3_ROOT=/tmp
  case $(stat -f -c %T /tmp 2>/dev/null) in
    tmpfs|ramfs) L3_ROOT=$ROOT/.l3_scratch; say "/tmp is in memory (tmpfs): L3 goes to $L3_ROOT" ;;
  esac
fi
L3DIR=$L3_ROOT/toolkv_l3_srv16l3
rm -rf "$L3DIR" && mkdir -p "$L3DIR" || { say "cannot make $L3DIR"; exit 2; }
"$PY" "$ROOT/scripts/stage/l3_capacity.py" disk "$L3_ROOT/toolkv_l3_probe" --out "$WORK/disk.json" \
  --mb "${DISK_PROBE_MB:-1024}" --files "${DISK_PROBE_FILES:-2048}" > "$WORK/disk.txt" 2>&1 ||
  { say "disk probe failed: $(tail -2 "$WORK/disk.txt")"; FAIL=1; }
rm -rf "$L3_ROOT/toolkv_l3_probe"
say "$(tail -1 "$WORK/disk.txt")"

# 3. The servers, started together.
launch() {  # $1 server
  local s=$1 port=${PORT_OF[$1]} log=$WORK/server_$1.log
  if [ -n "${DRY_RUN_STUB:-}" ]; then
    if [ "$s" = srv16l3 ]; then
      setsid "$PY" "$DRY_RUN_STUB" --port "$port" --l3-dir "$L3DIR" --storage > "$log" 2>&1 &
    else
      mkdir -p "$WORK/stub_$s"; setsid "$PY" "$DRY_RUN_STUB" --port "$port" --l3-dir "$WORK/stub_$s" > "$log" 2>&1 &
    fi
  else
    local l3=()
    [ "$s" = srv16l3 ] && l3=(--hicache-storage-backend file --hicache-storage-prefetch-policy wait_complete)
    SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR=$L3DIR SGLANG_HICACHE_FILE_BACKEND_MIN_FREE_SPACE=$L3_MIN_FREE \
      setsid "$PY" -m sglang.launch_server --model-path "$MODELS/llama-3.1-8b" "${VALUE_SERVER_FLAGS[@]}" \
      --port "$port" --mem-fraction-static "$MEM_FRACTION" --enable-metrics \
      --enable-hierarchical-cache --hicache-size "${HOST_GB[$s]}" "${l3[@]}" > "$log" 2>&1 &
  fi
  PID_OF[$s]=$!
}
stop_all() {  # every server's group at once (each may take up to 15 s)
  local s stoppers=()
  for s in "${!PID_OF[@]}"; do stop_group "${PID_OF[$s]}" & stoppers+=($!); done
  (( ${#stoppers[@]} )) && wait "${stoppers[@]}"
  PID_OF=()
}
trap stop_all EXIT
t_start=$SECONDS
for s in "${SERVERS[@]}"; do [ -n "$s" ] && launch "$s"; done
wait_s=$(( BUDGET_S - MIN_LEFT_S - $(el) )); (( wait_s > 300 )) && wait_s=300; (( wait_s < 60 )) && wait_s=60
for s in "${SERVERS[@]}"; do
  [ -n "$s" ] || continue
  if wait_healthy "${PID_OF[$s]}" "${PORT_OF[$s]}" "$WORK/server_$s.log" $(( t_start + wait_s )) "$s"; then
    UP[$s]=1
    pool=$(grep -ao 'max_total_num_tokens=[0-9]*' "$WORK/server_$s.log" | head -1)
    say "$s healthy after $(( SECONDS - t_start )) s${pool:+ ($pool)}"
    [ -z "${DRY_RUN_STUB:-}" ] && [ "$pool" != max_total_num_tokens=120000 ] &&
      say "WARNING: $s's KV pool is not the 120,000 tokens of the value runs"
  else
    FAIL=1
  fi
done
nvidia-smi --query-gpu=memory.used,memory.total --format=csv >> "$WORK/machine.txt" 2>/dev/null
{ echo "== after start-up: free -g"; free -g; } >> "$WORK/machine.txt"
if [ -n "${UP[srv16l3]:-}" ] && [[ " $CONFIGS " == *" toolkv16l3 "* ]]; then
  code=$(curl -s -o "$WORK/preflight.json" -w '%{http_code}' -H 'Content-Type: application/json' \
    -d '{"session_id": "toolkv-policy-preflight", "policy": "offload"}' \
    "http://127.0.0.1:${PORT_OF[srv16l3]}/session/tool_start")
  say "srv16l3: preflight tool_start with a per-call policy on an unknown session: $code"
fi

# 4. What comes back, refreshed after every bench.
snapshot() {
  {
    # this checkout's value_report (it knows the l3 names), whatever tree TOOLKV_SRC serves
    (cd "$ROOT" && "$PY" -m toolkv.tools.value_report "$WORK/runs") 2> "$WORK/report.err" ||
      echo "no value report: $(cat "$WORK/report.err")"
    echo
    "$PY" "$ROOT/scripts/stage/l3_capacity.py" report "$WORK/runs" --disk "$WORK/disk.json" 2>&1
  } > "$WORK/report.md"
  cp "$WORK/report.md" "$RES/report.md"
  local runs; runs=$(cd "$WORK/runs" && echo r*)
  [ "$runs" = "r*" ] && runs=
  # shellcheck disable=SC2086
  tar -czf "$RES/results.tar.gz.part" -C "$WORK/runs" $runs -C "$WORK" report.md disk.json disk.txt machine.txt \
    2>/dev/null && mv "$RES/results.tar.gz.part" "$RES/results.tar.gz"
  rm -f "$RES/results.tar.gz.part"
  (cd "$WORK" && tar -czf "$RES/server_logs.tar.gz" server_*.log 2>/dev/null)
}
metrics() {  # $1 server, $2 file: the L3 and toolkv series of its /metrics
  curl -s -m 10 "http://127.0.0.1:${PORT_OF[$1]}/metrics" 2>/dev/null |
    grep -aE '^(sglang:(prefetched|backuped)_tokens_total|toolkv:(events_total|tokens_total|decisions_total))' > "$2"
}
l3_empty() {  # srv16l3's L3: the backend's clear, then whatever it left
  local code
  code=$(curl -s -m 60 -o /dev/null -w '%{http_code}' -X POST "http://127.0.0.1:${PORT_OF[srv16l3]}/hicache/storage-backend/clear")
  find "$L3DIR" -mindepth 1 -delete 2>/dev/null
  echo "$code"
}

bench() {  # $1 round, $2 config
  local k=$1 cfg=$2 s; s=$(server_of "$2")
  local dir=$WORK/runs/r$k left=$(( BUDGET_S - $(el) )) t0=$SECONDS rc log=$WORK/server_$s.log off
  mkdir -p "$dir"
  if [ "$s" = srv16l3 ]; then say "r$k $cfg: L3 emptied (clear: $(l3_empty))"; fi
  metrics "$s" "$dir/$cfg.metrics.before"
  off=$(stat -c %s "$log")
  say "r$k $cfg: start on $s ($(flags_of "$cfg")), $left s of the budget left"
  agent_bench_run "http://127.0.0.1:${PORT_OF[$s]}" "$cfg" "$dir" $(( left + 5 )) "$(flags_of "$cfg")"
  rc=$?
  (( rc == 124 || rc == 137 )) && say "r$k $cfg: killed at the budget (BUDGET_S=$BUDGET_S)"
  (( rc != 0 )) && FAIL=1
  local what; what=$(bench_outcome "$dir" "$cfg")
  if [ "$s" = srv16l3 ]; then  # HiCache writes L3 in the background: wait, then count
    local q=$(( BUDGET_S + 5 - $(el) )); (( q > L3_QUIET_S )) && q=$L3_QUIET_S; (( q < 1 )) && q=1
    "$PY" "$ROOT/scripts/stage/l3_capacity.py" quiet "$L3DIR" --limit "$q" --stable 2 > "$dir/$cfg.l3.txt"
    what="$what; L3 $(cat "$dir/$cfg.l3.txt")"
  fi
  metrics "$s" "$dir/$cfg.metrics.after"
  tail -c +$(( off + 1 )) "$log" | grep -a "toolkv decision" > "$dir/$cfg.decisions.txt"
  say "r$k $cfg: done in $(( SECONDS - t0 )) s, rc $rc: $what; $(wc -l < "$dir/$cfg.decisions.txt") decision lines"
  (( rc != 0 )) && tail -3 "$dir/$cfg.log" | sed 's/^/    /'
  snapshot
}

SKIPPED=0 order=$CONFIGS
for k in $(seq 1 "$REPEATS"); do
  for cfg in $order; do
    if [ -z "${UP[$(server_of "$cfg")]:-}" ]; then say "r$k $cfg: not run ($(server_of "$cfg") is not up)"; continue; fi
    if (( BUDGET_S - $(el) < MIN_LEFT_S )); then SKIPPED=$(( SKIPPED + 1 )); continue; fi
    bench "$k" "$cfg"
  done
  order=$(echo "$order" | tr ' ' '\n' | tac | tr '\n' ' ')
done
(( SKIPPED > 0 )) && say "budget: $SKIPPED benches not started (fewer than $MIN_LEFT_S s left of $BUDGET_S)"
compgen -G "$WORK/runs/r*/*.json" >/dev/null || { say "no bench left a result"; FAIL=1; }
stop_all
say "servers stopped"

# 5. The server logs: tracebacks; the report; the L3 directory goes.
: > "$RES/server_errors.txt"
for f in "$WORK"/server_*.log; do
  [ -f "$f" ] && grep -an "Traceback\|AssertionError\|Out of memory\|Not enough" "$f" | sed "s|^|$(basename "$f"):|" >> "$RES/server_errors.txt"
done
if [ -s "$RES/server_errors.txt" ]; then
  say "server logs: $(wc -l < "$RES/server_errors.txt") error lines (server_errors.txt):"; head -10 "$RES/server_errors.txt"
  FAIL=1
else
  say "server logs: no traceback"
fi
snapshot
rm -rf "$L3DIR"
say "results in $RES: $(cd "$RES" && echo *)"
echo
cat "$WORK/report.md"
exit $FAIL
