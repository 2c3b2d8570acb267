#!/usr/bin/env bash
# The agent benchmark's configurations on one GPU machine, same workload and seed for all.
#
#   here, once:   bash scripts/gpu_bundle.sh    (both sglang releases + toolkv's runtime deps in .gpu-bundle/)
#   device call (carry [".gpu-bundle"]):
#     bash scripts/gpu_agent_suite.sh REGIME SERVERS [DURATION_S]
#   REGIME  constrained: GPU KV pool capped at 120,000 tokens (--mem-fraction-static 0.3)
#           plentiful:   --mem-fraction-static 0.85 (about 800K tokens of 8B KV on an H200)
#   SERVERS comma list of
#     hicache16   --enable-hierarchical-cache --hicache-size 16: configs stock, explicit, zero-change
#     hicache80   the same with an 80 GB host pool (the strongest stock setting here): config stock-large
#     auto16      hicache16 with TOOLKV_POLICY=auto (keep / offload with early restore / let go per call,
#                 tool names sent): configs policy (explicit) and policy-zero-change (on-request)
#     radix       plain RadixCache: configs radix (stock) and pin (toolkv's GPU pin, TTL 30 s, budget
#                 half the device pool)
#     value16     the value comparison at a 16 GB host, one server: configs stock16, offload16
#     value64     the same at a 64 GB host: configs stock64, offload64
#     valueauto   16 GB host with TOOLKV_POLICY=auto: config auto16 (explicit, tool names sent)
# BENCH_ARGS (env) is appended to every bench (e.g. the closed 48-session load of docs/benchmarks.md);
# DRAIN (env, default 60) is the drain of every bench.
# RELEASE (env): 0516 (default) or 0523. Every server: Llama-3.1-8B shape (Granite-8B on 0.5.23), dummy weights, 64K context, triton attention, the toolkv plugin
# loaded (TOOLKV_ENABLE=1; the stock configs make no toolkv call and send no session id). Results:
# $OUT/<regime>/<config>.json and server logs. TOOLKV_SRC=<dir> runs the toolkv tree found there (e.g.
# an export of one commit) instead of this checkout.
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUNDLE=$ROOT/.gpu-bundle
# shellcheck source=scripts/gpu_lib.sh
source "$ROOT/scripts/gpu_lib.sh"
REGIME=${1:?regime} SERVERS=${2:?servers} DURATION=${3:-45}
OUT=${OUT:-/tmp/toolkv_agent_out}; RES=$OUT/$REGIME; mkdir -p "$RES"
case $REGIME in
  constrained) MEM=(--mem-fraction-static 0.3 --max-total-tokens 120000); POOL=120000 ;;
  plentiful) MEM=(--mem-fraction-static 0.85); POOL=800000 ;;
  *) echo "regime must be constrained or plentiful" >&2; exit 2 ;;
esac
[ -d /tmp/site-0516/sglang ] || bash "$BUNDLE/install.sh" "$BUNDLE" >/dev/null || exit 1
# shellcheck source=/dev/null
source "$BUNDLE/env.sh"
# RELEASE=0523: sglang 0.5.23 with the Granite-8B shape (its Llama builds DualGemm, which imports the cutlass
# DSL that the bundle leaves out); 0516 (default): sglang 0.5.16 with the Llama-3.1-8B shape.
RELEASE=${RELEASE:-0516}; use_release "$RELEASE" || exit 2
case $RELEASE in 0516) MODEL=llama-3.1-8b ;; 0523) MODEL=granite-8b ;; esac
EP=$STAGE_ROOT/toolkv_ep_suite; toolkv_entry_point "$EP"
SRC=${TOOLKV_SRC:-$ROOT}
export PYTHONPATH=$SRC:$EP:$STAGED_DEPS:$PYTHONPATH TOOLKV_ENABLE=1 TOOLKV_RESTORE_ON_REQUEST=1
PORT=30000 FAIL=0

serve() {  # $1 name, rest: launch flags
  local name=$1; shift
  LOG=$RES/server_$name.log
  setsid "$PY" -m sglang.launch_server --model-path "$MODELS/$MODEL" --load-format dummy \
    --skip-tokenizer-init --attention-backend triton --sampling-backend pytorch --grammar-backend none \
    --context-length 65536 --disable-cuda-graph --host 127.0.0.1 --port $PORT "${MEM[@]}" "$@" > "$LOG" 2>&1 &
  SERVER=$!
  local t0; t0=$(date +%s)
  until curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; do
    kill -0 "$SERVER" 2>/dev/null || { echo "$name: server died at start"; tail -20 "$LOG"; return 1; }
    [ $(( $(date +%s) - t0 )) -gt 300 ] && { echo "$name: not healthy after 300 s"; return 1; }
    sleep 2
  done
  echo "$name: healthy after $(( $(date +%s) - t0 )) s"
}
stop() { stop_group "$SERVER"; sleep 2; }
trap stop EXIT
bench() {  # $1 config label, $2 mode, rest: extra bench flags
  local cfg=$1 mode=$2; shift 2
  echo "== $REGIME / $cfg ($mode) =="
  (cd "$SRC" && "$PY" -m toolkv.tools.agent_bench --url "http://127.0.0.1:$PORT" --mode "$mode" --config "$cfg" \
    --duration "$DURATION" --drain "${DRAIN:-60}" --flush --out "$RES/$cfg.json" "$@" ${BENCH_ARGS:-}) || FAIL=1
}
IFS=, read -ra LIST <<< "$SERVERS"
for s in "${LIST[@]}"; do
  case $s in
    hicache16)
      export TOOLKV_TTL_S=600; unset TOOLKV_HOST_BUDGET_TOKENS
      serve hicache16 --enable-hierarchical-cache --hicache-size 16 || { FAIL=1; continue; }
      bench stock stock
      bench explicit explicit --twins 2 $([ "$REGIME" = constrained ] && echo --probe)
      bench zero-change on-request
      for p in ${POLICY_CONFIGS:-}; do bench "$p" explicit; done
      stop ;;
    auto16)
      export TOOLKV_TTL_S=600 TOOLKV_POLICY=auto; unset TOOLKV_HOST_BUDGET_TOKENS
      serve auto16 --enable-hierarchical-cache --hicache-size 16 || { FAIL=1; continue; }
      bench policy explicit --send-tool
      bench policy-zero-change on-request --send-tool
      unset TOOLKV_POLICY
      stop ;;
    value16|value64)
      export TOOLKV_TTL_S=600; unset TOOLKV_HOST_BUDGET_TOKENS TOOLKV_POLICY
      H=${s#value}
      serve "$s" --enable-hierarchical-cache --hicache-size "$H" || { FAIL=1; continue; }
      bench "stock$H" stock
      bench "offload$H" explicit
      stop ;;
    valueauto)
      export TOOLKV_TTL_S=600 TOOLKV_POLICY=auto; unset TOOLKV_HOST_BUDGET_TOKENS
      serve valueauto --enable-hierarchical-cache --hicache-size 16 || { FAIL=1; continue; }
      bench auto16 explicit --send-tool
      unset TOOLKV_POLICY
      stop ;;
    hicache80)
      serve hicache80 --enable-hierarchical-cache --hicache-size 80 || { FAIL=1; continue; }
      bench stock-large stock
      stop ;;
    radix)
      export TOOLKV_TTL_S=30 TOOLKV_HOST_BUDGET_TOKENS=$(( POOL / 2 ))
      serve radix || { FAIL=1; continue; }
      bench radix stock
      bench pin explicit
      stop ;;
    *) echo "unknown server $s" >&2; FAIL=1 ;;
  esac
done
for f in "$RES"/server_*.log; do grep -n "Traceback\|AssertionError\|Out of memory" "$f" | head -5 | sed "s|^|$(basename "$f"): |"; done
exit $FAIL
