#!/usr/bin/env bash
# Repeated, interleaved value runs on ONE sglang 0.5.16 server (issue 33): stock16, offload16 and auto16 take
# turns (stock, offload, auto, stock, offload, auto, ...) on the same server, the per-call policy choosing
# offload or auto for each agent, so that a run-to-run drift of the machine hits every config alike and each
# round (a repetition) has its own stock reference.
#
#   here, once:   bash scripts/gpu_bundle.sh            (.gpu-bundle/, git-ignored)
#   device call (carry [".gpu-bundle"], $OUT set; one call, under its 600-s limit):
#     bash scripts/gpu_value_repeat.sh                   the value load of docs/benchmarks.md, REPEATS=2
#     LOAD=named96 bash scripts/gpu_value_repeat.sh      96 sessions, four named tools of 1-25 s, REPEATS=1
#   here, after the call (the results come back as one archive):
#     mkdir -p runs/A && tar -xzf <files_at>/value/results.tar.gz -C runs/A
#     python -m toolkv.tools.value_report runs/A          (several calls: runs/A/r1 runs/A/r2 runs/B/r1 ...)
#
# The server is gpu_agent_suite.sh's value16 server: constrained regime (GPU KV pool capped at 120,000
# tokens), --enable-hierarchical-cache --hicache-size 16, TOOLKV_ENABLE=1 TOOLKV_RESTORE_ON_REQUEST=1
# TOOLKV_TTL_S=600, no TOOLKV_POLICY (the offload default): the agents ask for their policy per call.
#   stock16    --mode stock                                   (no toolkv call, no session id)
#   offload16  --mode explicit --policy offload
#   auto16     --mode explicit --policy auto --send-tool
# Every bench flushes the cache first (--flush) and replays the same plan (seed 0).
#
# Environment:
#   LOAD       value (default): --sessions 48 --arrival-rate 0 --turns 6 --first-tokens 3000 --growth 900
#                --output 32 --max-context 16384 --warmup 0, DURATION 75, REPEATS 2
#              named96: --sessions 96 --arrival-rate 0 --turns 5 --first-tokens 3000 (2-4K) --growth 900
#                --output 32 --max-context 16384 --warmup 0 --tool-shape named, DURATION 100, REPEATS 1
#   BENCH_ARGS replaces the load's bench arguments; DURATION, DRAIN (default 20) every bench's
#   REPEATS    rounds of CONFIGS; CONFIGS (default "stock16 offload16 auto16") the order within a round
#              (a later call can start elsewhere, e.g. "auto16 stock16 offload16", so that the round the
#              budget cuts short drops another config)
#   BUDGET_S   (default 570) seconds from the script's start: no bench starts with fewer than MIN_LEFT_S
#              (default DURATION + 25, at least 100) left, a bench still running at BUDGET_S + 5 is
#              killed; the server is stopped and the report written in either case
#   WORK       (default /tmp/toolkv_value_repeat) raw results: $WORK/$LOAD/runs/r<k>/<config>.json (+ .log)
#   BUNDLE     (default .gpu-bundle) the staged bundle, relative to the checkout; only sglang 0.5.16 is
#              used, so a 0.5.16-only bundle carries less: RELEASES=0516 bash scripts/gpu_bundle.sh DIR
#   TOOLKV_SRC=<dir> runs the toolkv tree found there instead of this checkout; PORT (default 30000)
#   DRY_RUN_STUB=<stand-in server script> CPU dry run: no bundle, no sglang; the stand-in
#              (scripts/stage/fleet_stub.py) is launched instead, with $PY (default python3)
# $OUT/$LOAD/ gets (at most 8 files come back from a device call): report.md (value_report over the
# runs so far), results.tar.gz (r<k>/<config>.json and .log, report.md, toolkv_decisions.txt: a folder of
# runs for value_report once extracted), server.log.gz, toolkv_decisions.txt.gz (all refreshed after
# every bench: a call killed at its limit still returns the last), server_errors.txt (tracebacks).
set -uo pipefail
T0=$SECONDS
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUNDLE=${BUNDLE:-.gpu-bundle}; [[ $BUNDLE == /* ]] || BUNDLE=$ROOT/$BUNDLE
# shellcheck source=scripts/gpu_lib.sh
source "$ROOT/scripts/gpu_lib.sh"
LOAD=${LOAD:-value}
value_load "$LOAD" || { echo "LOAD must be value or named96" >&2; exit 2; }
BENCH_ARGS=${BENCH_ARGS:-$DEF_ARGS} DURATION=${DURATION:-$DEF_DURATION} REPEATS=${REPEATS:-$DEF_REPEATS}
DRAIN=${DRAIN:-20} BUDGET_S=${BUDGET_S:-570} CONFIGS=${CONFIGS:-stock16 offload16 auto16}
MIN_LEFT_S=${MIN_LEFT_S:-$(( DURATION + 25 > 100 ? DURATION + 25 : 100 ))}
PORT=${PORT:-30000} SRC=${TOOLKV_SRC:-$ROOT}
OUT=${OUT:-/tmp/toolkv_value_out}; RES=$OUT/$LOAD
WORK=${WORK:-/tmp/toolkv_value_repeat}/$LOAD
rm -rf "$WORK" && mkdir -p "$WORK/runs" "$RES" || exit 2
LOG=$WORK/server.log
FAIL=0 SERVER=
el() { echo $(( SECONDS - T0 )); }
say() { printf '[%4d s] %s\n' "$(el)" "$*"; }

flags_of() {  # the bench flags of a config
  case $1 in
    stock*) echo "--mode stock" ;;
    offload*) echo "--mode explicit --policy offload" ;;
    auto*) echo "--mode explicit --policy auto --send-tool" ;;
    *) return 1 ;;
  esac
}
for c in $CONFIGS; do flags_of "$c" >/dev/null || { echo "unknown config $c (stock*, offload*, auto*)" >&2; exit 2; }; done
say "LOAD=$LOAD REPEATS=$REPEATS CONFIGS=[$CONFIGS] DURATION=$DURATION DRAIN=$DRAIN BUDGET_S=$BUDGET_S MIN_LEFT_S=$MIN_LEFT_S"
say "BENCH_ARGS=$BENCH_ARGS"

# 1. The interpreter: the bundle's sglang 0.5.16, or the stand-in of a dry run.
if [ -n "${DRY_RUN_STUB:-}" ]; then
  PY=${PY:-python3}
  say "dry run: stand-in server $DRY_RUN_STUB, python $PY"
else
  stage_0516 toolkv_ep_value || exit $?
fi
export PYTHONPATH=$SRC${PYTHONPATH:+:$PYTHONPATH} TOOLKV_ENABLE=1 TOOLKV_RESTORE_ON_REQUEST=1 TOOLKV_TTL_S=600
unset TOOLKV_HOST_BUDGET_TOKENS TOOLKV_POLICY
# the bench arguments are checked before any GPU time goes on them (e.g. a --tool-shape this tree lacks)
check_bench_args || exit 2

# 2. One server for every bench.
serve() {
  local t0=$SECONDS wait_s=$(( BUDGET_S - MIN_LEFT_S - $(el) ))
  (( wait_s > 300 )) && wait_s=300
  (( wait_s < 60 )) && wait_s=60
  if [ -n "${DRY_RUN_STUB:-}" ]; then
    setsid "$PY" "$DRY_RUN_STUB" --port "$PORT" --l3-dir "$WORK" > "$LOG" 2>&1 &
  else
    setsid "$PY" -m sglang.launch_server --model-path "$MODELS/llama-3.1-8b" "${VALUE_SERVER_FLAGS[@]}" \
      --port "$PORT" --mem-fraction-static 0.3 --enable-hierarchical-cache --hicache-size 16 > "$LOG" 2>&1 &
  fi
  SERVER=$!
  wait_healthy "$SERVER" "$PORT" "$LOG" $(( t0 + wait_s )) || return 1
  say "server healthy after $(( SECONDS - t0 )) s"
}
stop() { if [ -n "$SERVER" ]; then stop_group "$SERVER"; SERVER=; fi; }
trap stop EXIT

# 3. What comes back, refreshed after every bench (a call killed at its limit still returns the last).
snapshot() {
  (cd "$SRC" && "$PY" -m toolkv.tools.value_report "$WORK/runs") > "$WORK/report.md" 2> "$WORK/report.err" ||
    { echo "no report: $(cat "$WORK/report.err")" > "$WORK/report.md"; }
  cp "$WORK/report.md" "$RES/report.md"
  grep -a "toolkv decision" "$LOG" > "$WORK/toolkv_decisions.txt" 2>/dev/null
  local runs; runs=$(cd "$WORK/runs" && echo r*)
  if [ "$runs" != "r*" ]; then
    # shellcheck disable=SC2086
    tar -czf "$RES/results.tar.gz.part" -C "$WORK/runs" $runs -C "$WORK" report.md toolkv_decisions.txt &&
      mv "$RES/results.tar.gz.part" "$RES/results.tar.gz"
    rm -f "$RES/results.tar.gz.part"
  fi
  gzip -c "$WORK/toolkv_decisions.txt" > "$RES/toolkv_decisions.txt.gz"
  [ -f "$LOG" ] && gzip -c "$LOG" > "$RES/server.log.gz"
}

bench() {  # $1 round, $2 config
  local k=$1 cfg=$2 dir=$WORK/runs/r$1 left=$(( BUDGET_S - $(el) )) t0=$SECONDS rc
  mkdir -p "$dir"
  say "r$k $cfg: start ($(flags_of "$cfg")), $left s of the budget left"
  agent_bench_run "http://127.0.0.1:$PORT" "$cfg" "$dir" $(( left + 5 )) "$(flags_of "$cfg")"
  rc=$?
  (( rc == 124 || rc == 137 )) && say "r$k $cfg: killed at the budget (BUDGET_S=$BUDGET_S)"
  (( rc != 0 )) && FAIL=1
  local what; what=$(bench_outcome "$dir" "$cfg")
  say "r$k $cfg: done in $(( SECONDS - t0 )) s, rc $rc: $what"
  (( rc != 0 )) && tail -3 "$dir/$cfg.log" | sed 's/^/    /'
  snapshot
}

SKIPPED=0
if serve; then
  # the per-call policy must reach toolkv: a server without it refuses the field (extra="forbid": 400/422)
  if [[ " $CONFIGS " == *" offload"* || " $CONFIGS " == *" auto"* ]]; then
    code=$(curl -s -o "$WORK/preflight.json" -w '%{http_code}' -H 'Content-Type: application/json' \
      -d '{"session_id": "toolkv-policy-preflight", "policy": "auto"}' "http://127.0.0.1:$PORT/session/tool_start")
    if [ "$code" = 400 ] || [ "$code" = 422 ]; then
      say "the server refuses tool_start's policy field ($code: $(head -c 300 "$WORK/preflight.json")): no per-call policy"
      FAIL=1 SKIPPED=-1
    else
      say "per-call policy accepted (preflight tool_start on an unknown session: $code)"
    fi
  fi
  if (( SKIPPED == 0 )); then
    for k in $(seq 1 "$REPEATS"); do
      for cfg in $CONFIGS; do
        if (( BUDGET_S - $(el) < MIN_LEFT_S )); then SKIPPED=$(( SKIPPED + 1 )); continue; fi
        bench "$k" "$cfg"
      done
    done
    (( SKIPPED > 0 )) && say "budget: $SKIPPED benches not started (fewer than $MIN_LEFT_S s left of $BUDGET_S)"
    compgen -G "$WORK/runs/r*/*.json" >/dev/null || { say "no bench left a result"; FAIL=1; }
  fi
else
  FAIL=1
fi
stop
say "server stopped"

# 4. The server log: tracebacks, the decision lines, the report.
grep -an "Traceback\|AssertionError\|Out of memory" "$LOG" > "$RES/server_errors.txt" 2>/dev/null
if [ -s "$RES/server_errors.txt" ]; then
  say "server log: $(wc -l < "$RES/server_errors.txt") traceback lines (server_errors.txt):"; head -10 "$RES/server_errors.txt"
  FAIL=1
else
  say "server log: no traceback"
fi
snapshot
say "$(wc -l < "$WORK/toolkv_decisions.txt") toolkv decision lines; results in $RES: $(cd "$RES" && echo *)"
echo
cat "$WORK/report.md"
exit $FAIL
