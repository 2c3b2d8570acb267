#!/usr/bin/env bash
# GPU acceptance in one run: both sglang releases, real zero-change, a 48-session load, a CUDA fuzz campaign.
#
#   here, once per bundle:  bash scripts/gpu_bundle.sh            (.gpu-bundle/, about 60 MiB)
#   on the GPU machine (checkout + .gpu-bundle):  COMMIT=$(git rev-parse HEAD) bash scripts/gpu_acceptance.sh
#
# Per release (RELEASES, default "0516,0523"), one server with toolkv (zero-change and restore-on-request
# on), a chat tokenizer and sglang's xgrammar backend:
#   0.5.16  Llama-3.1-8B shape, HiRadixCache;  0.5.23  Granite-8B shape (no DualGemm, so no cutlass DSL
#   is needed), UnifiedRadixCache with the Python tree core; both --mem-fraction-static 0.3
#   --max-total-tokens 120000 --enable-hierarchical-cache --hicache-size 16, dummy weights.
# against which run, each under a time cap:
#   e2e          scripts/gpu_e2e.py on the plugin's defaults: during the tool the GPU copy is left unlocked and
#                evictable (lazy free, 0.5.16) or freed (0.5.23, whose backend frees at the ack), next turn
#                token-identical to a never-offloaded twin, prefix reused, stale epoch refused, restore on
#                request, nothing leaked
#   e2e_eager    (0.5.16) the same on a second server with TOOLKV_LAZY_FREE=0: the GPU copy is freed
#   zero_change  scripts/gpu_zero_change.py: chat answers finish_reason "tool_calls" (forced by
#                tool_choice "required"), toolkv offloads on it, the next chat turn restores and reuses
#   load         toolkv bench agent: 48 sessions starting together (tool calls and restores in bunches),
#                LOAD_S seconds; no crash, no 5xx beyond the documented refusals, every generate answered,
#                nothing protected or locked at the end, twins token-identical
#   server_log   no Traceback / AssertionError / out-of-memory in the server log
# and first, once (0.5.16): fuzz  the stateful campaign on CUDA pools (toolkv fuzz --device cuda), steps and violations.
# $OUT/acceptance.json: the commit, pass/fail per check, the numbers; $OUT/summary.txt the same as a table;
# $OUT/runs.tar.gz every JSON and log (per release: steps.tsv, e2e/zero_change/load JSON, server.log).
# Knobs: RELEASES, CHECKS_0516 (default e2e,zero_change,load,e2e_eager) / CHECKS_0523 (e2e,zero_change,load),
# LOAD_S (90), FUZZ_EXAMPLES (100), FUZZ_S (200: 100 examples took more than 90 s), PORT (30000),
# DEADLINE_S (560: no step runs past it), SKIP_INSTALL=1. Each release records the tree core its server ran
# (tree_core.txt: python on 0.5.23 here, the GPU machine's torch cannot load the wheel's Rust core).
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=scripts/gpu_lib.sh
source "$ROOT/scripts/gpu_lib.sh"
BUNDLE=${BUNDLE:-$ROOT/.gpu-bundle}
OUT=${OUT:-/tmp/toolkv_acceptance}; mkdir -p "$OUT"
# Work in WORK, hand back three files in OUT: acceptance.json, summary.txt, runs.tar.gz (every JSON and log)
WORK=${WORK:-/tmp/toolkv_acceptance_work}; rm -rf "$WORK"; mkdir -p "$WORK"
RELEASES=${RELEASES:-0516,0523} LOAD_S=${LOAD_S:-90} PORT=${PORT:-30000} DEADLINE_S=${DEADLINE_S:-560}
URL=http://127.0.0.1:$PORT
T0=$SECONDS
log() { echo "[$(( SECONDS - T0 )) s] $*"; }

if [ "${SKIP_INSTALL:-0}" != 1 ]; then  # SKIP_INSTALL=1: the bundle is installed already (an earlier script of the call)
  bash "$BUNDLE/install.sh" "$BUNDLE" > "$WORK/install.log" 2>&1 || { tail -20 "$WORK/install.log"; exit 1; }
  log "$(tail -1 "$WORK/install.log")"
fi
# shellcheck source=/dev/null
source "$BUNDLE/env.sh"
EP=$STAGE_ROOT/toolkv_ep; toolkv_entry_point "$EP"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$WORK/gpu.txt" 2>&1 || true

# step NAME CAP_S CMD...: run one check with a time cap (never past DEADLINE_S of the whole run, so that
# the results are always handed back), record rc and seconds in $R/steps.tsv (124: cut by its cap)
step() {
  local name=$1 cap=$2 t=$SECONDS rc left; shift 2
  left=$(( DEADLINE_S - (SECONDS - T0) ))
  if (( left < 20 )); then log "$REL $name skipped: run deadline"; printf '%s\t124\t0\n' "$name" >> "$R/steps.tsv"; return; fi
  (( cap > left )) && cap=$left
  log "$REL $name (cap ${cap} s)"
  timeout -k 10 "$cap" "$@" > "$R/$name.log" 2>&1; rc=$?
  printf '%s\t%s\t%s\n' "$name" "$rc" "$(( SECONDS - t ))" >> "$R/steps.tsv"
  grep -E "^(PASS|FAIL)|TOOLKV_|config=" "$R/$name.log" | tail -n 40
  log "$REL $name rc=$rc"
}

serve() {  # launch flags...; exports SERVER, returns non-zero if not healthy in 300 s
  setsid "$PY" -m sglang.launch_server --model-path "$MODELS/$MODEL" --tokenizer-path "$CHAT_TOKENIZER" \
    --load-format dummy --attention-backend triton --sampling-backend pytorch --disable-cuda-graph \
    --enable-hierarchical-cache --hicache-size 16 --mem-fraction-static 0.3 --max-total-tokens 120000 \
    --context-length 32768 --enable-cache-report --host 127.0.0.1 --port "$PORT" "$@" > "$R/server.log" 2>&1 &
  SERVER=$!
  local t=$SECONDS
  until curl -sf "$URL/health" >/dev/null; do
    kill -0 "$SERVER" 2>/dev/null || { log "server died at start"; tail -15 "$R/server.log"; return 1; }
    (( SECONDS - t > 300 || SECONDS - T0 > DEADLINE_S )) && { log "server not healthy after $(( SECONDS - t )) s"; return 1; }
    sleep 2
  done
  log "$REL server healthy after $(( SECONDS - t )) s"
}
trap '[ -n "${SERVER:-}" ] && stop_group "$SERVER"' EXIT

if [[ ",$RELEASES," == *",0516,"* ]]; then
  R=$WORK/fuzz; REL=cuda; mkdir -p "$R"; : > "$R/steps.tsv"
  use_release 0516
  export PYTHONPATH=$ROOT:$STAGED_TEST_DEPS:$STAGED_DEPS:$PYTHONPATH OMP_NUM_THREADS=4
  # --no-shrink: a failure is reported at once with its steps (shrinking CUDA steps outlasts any cap)
  step fuzz "${FUZZ_S:-200}" "$PY" -m toolkv.tools.cli fuzz --device cuda --examples "${FUZZ_EXAMPLES:-100}" --steps 60 \
    --seed 11 --every 10 --no-shrink --out "$R/fuzz_gpu.json"
fi

IFS=, read -ra LIST <<< "$RELEASES"
for REL in "${LIST[@]}"; do
  R=$WORK/$REL; mkdir -p "$R"; : > "$R/steps.tsv"
  use_release "$REL" || continue
  case $REL in 0516) MODEL=llama-3.1-8b BACKEND=hiradix LAZY=1 ;; 0523) MODEL=granite-8b BACKEND=unified LAZY= ;; esac
  echo "${SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND:-default}" > "$R/tree_core.txt"
  export PYTHONPATH=$ROOT:$EP:$STAGED_DEPS:$PYTHONPATH
  export TOOLKV_ENABLE=1 TOOLKV_ZERO_CHANGE=1 TOOLKV_RESTORE_ON_REQUEST=1 TOOLKV_TTL_S=120
  GRAMMAR=xgrammar
  # a tool-call parser: without one sglang never turns a chat answer into tool_calls (pythonic: a required
  # call is constrained to sglang's JSON-array schema on both releases)
  if ! serve --tool-call-parser pythonic --constrained-json-disable-any-whitespace; then
    stop_group "$SERVER"
    # a grammar backend that cannot start: every check but zero-change can still run without one
    grep -qi "grammar" "$R/server.log" || { printf 'server\t1\t0\n' >> "$R/steps.tsv"; continue; }
    printf 'server_xgrammar\t1\t0\n' >> "$R/steps.tsv"; GRAMMAR=none
    cp "$R/server.log" "$R/server_xgrammar_failed.log"
    serve --grammar-backend none || { printf 'server\t1\t0\n' >> "$R/steps.tsv"; stop_group "$SERVER"; continue; }
  fi
  DEF_CHECKS=e2e,zero_change,load; [ "$REL" = 0516 ] && DEF_CHECKS=$DEF_CHECKS,e2e_eager
  CHECKS=CHECKS_$REL; CHECKS=",${!CHECKS:-$DEF_CHECKS},"
  echo "${CHECKS:1:-1},server_log" > "$R/asked.txt"   # what the summary expects of this release
  [[ $CHECKS == *,e2e,* ]] && step e2e 150 "$PY" "$ROOT/scripts/gpu_e2e.py" --url "$URL" --pid "$SERVER" --out "$R/e2e.json" \
    --backend "$BACKEND" ${LAZY:+--lazy-free "$LAZY"}
  if [ "$GRAMMAR" = xgrammar ] && [[ $CHECKS == *,zero_change,* ]]; then
    step zero_change 120 "$PY" "$ROOT/scripts/gpu_zero_change.py" --url "$URL" --out "$R/zero_change.json"
  fi
  [[ $CHECKS == *,load,* ]] && step load $(( LOAD_S + 200 )) "$PY" -m toolkv.tools.agent_bench --url "$URL" --mode explicit --config load48 \
    --sessions 48 --arrival-rate 0 --turns 6 --first-tokens 3000 --growth 900 --output 32 --max-context 16384 \
    --duration "$LOAD_S" --warmup 0 --drain 20 --twins 2 --flush --out "$R/load.json"
  stop_group "$SERVER"; SERVER=
  BAD=$(grep -c -E "Traceback|AssertionError|out of memory|Out of memory" "$R/server.log")
  if [[ $CHECKS == *,e2e_eager,* ]]; then  # the GPU copy freed at the ack (TOOLKV_LAZY_FREE=0)
    mv "$R/server.log" "$R/server_default.log"
    if TOOLKV_LAZY_FREE=0 serve --grammar-backend none; then
      step e2e_eager 150 "$PY" "$ROOT/scripts/gpu_e2e.py" --url "$URL" --pid "$SERVER" --out "$R/e2e_eager.json" \
        --backend "$BACKEND" --lazy-free 0
    else
      printf 'e2e_eager\t1\t0\n' >> "$R/steps.tsv"
    fi
    stop_group "$SERVER"; SERVER=
    BAD=$(( BAD + $(grep -c -E "Traceback|AssertionError|out of memory|Out of memory" "$R/server.log") ))
    mv "$R/server.log" "$R/server_eager.log"
  fi
  printf 'server_log\t%s\t0\n' "$(( BAD > 0 ))" >> "$R/steps.tsv"
  log "$REL server log: $BAD error lines"
done

grep -v -i warn "$WORK/fuzz/fuzz.log" 2>/dev/null | tail -n 25
"$PY" -c 'import json, sys; r = json.load(open(sys.argv[1])); [print("FUZZ FAILURE", json.dumps(x.get("failure"))[:3000]) for x in r if x.get("failure")]' \
  "$WORK/fuzz/fuzz_gpu.json" 2>/dev/null
COMMIT=${COMMIT:-unknown} "$PY" "$ROOT/scripts/acceptance_summary.py" "$WORK" > "$WORK/summary.txt"
cp "$WORK/summary.txt" "$WORK/acceptance.json" "$OUT/"
tar -czf "$OUT/runs.tar.gz" -C "$WORK" .
cat "$OUT/summary.txt"
log "done"
grep -q "^ACCEPTANCE PASS" "$OUT/summary.txt"
