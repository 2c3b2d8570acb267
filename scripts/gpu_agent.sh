#!/usr/bin/env bash
# Agent load on a stock sglang 0.5.16 server with the toolkv plugin, on the GPU machine.
#
#   here, once:   bash scripts/gpu_bundle.sh    (both sglang releases + toolkv's runtime deps in .gpu-bundle/)
#   device call (carry [".gpu-bundle"]):
#     bash scripts/gpu_agent.sh MODE DURATION_S [TWINS] [-- extra launch_server flags]
#   MODE: stock | explicit | on-request (see toolkv/tools/agent_bench.py).  TOOLKV_SRC=<dir> runs
#   another toolkv tree (e.g. an older release) and TOOLKV_EP its entry point.
# Server: Llama-3.1-8B shape, dummy weights, HiCache with a 16 GB host pool, GPU pool capped at
# 120,000 tokens, 16K context, triton attention. Results and logs go to $OUT/<MODE>/.
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUNDLE=$ROOT/.gpu-bundle
# shellcheck source=scripts/gpu_lib.sh
source "$ROOT/scripts/gpu_lib.sh"
MODE=${1:?mode} DURATION=${2:?duration} TWINS=${3:-0}
shift $(( $# < 3 ? $# : 3 )); [ "${1:-}" = "--" ] && shift
EXTRA=("$@")
OUT=${OUT:-/tmp/toolkv_agent_out}; RUN=$OUT/${RUN_NAME:-$MODE}; mkdir -p "$RUN"
[ -d /tmp/site-0516/sglang ] || bash "$BUNDLE/install.sh" "$BUNDLE" >/dev/null || exit 1
# shellcheck source=/dev/null
source "$BUNDLE/env.sh"; use_flashinfer_stub
SRC=${TOOLKV_SRC:-$ROOT} EPV=${TOOLKV_EP:-toolkv.sglang.plugin:register}
EP=$STAGE_ROOT/toolkv_ep_$$; toolkv_entry_point "$EP" "$EPV"
export PYTHONPATH=$SRC:$EP:$STAGED_DEPS:$PYTHONPATH
if [ "$MODE" = stock ]; then export TOOLKV_ENABLE=0; else export TOOLKV_ENABLE=1; fi
export TOOLKV_TTL_S=${TOOLKV_TTL_S:-120} TOOLKV_RESTORE_ON_REQUEST=1
PORT=30000 LOG=$RUN/server.log
setsid "$PY" -m sglang.launch_server --model-path "$STAGE_ROOT/models/llama-3.1-8b" --load-format dummy \
  --skip-tokenizer-init --attention-backend triton --sampling-backend pytorch --grammar-backend none \
  --enable-hierarchical-cache --hicache-size 16 --mem-fraction-static 0.3 --max-total-tokens 120000 \
  --context-length 16384 --disable-cuda-graph --host 127.0.0.1 --port $PORT "${EXTRA[@]}" > "$LOG" 2>&1 &
SERVER=$!
stop_server() { stop_group "$SERVER"; }
trap stop_server EXIT
t0=$(date +%s)
until curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; do
  kill -0 "$SERVER" 2>/dev/null || { echo "server died at start"; tail -30 "$LOG"; exit 1; }
  [ $(( $(date +%s) - t0 )) -gt 300 ] && { echo "server not healthy after 300 s"; exit 1; }
  sleep 2
done
echo "server healthy after $(( $(date +%s) - t0 )) s ($MODE)"
PYTHONPATH=$ROOT "$PY" -m toolkv.tools.agent_bench --url "http://127.0.0.1:$PORT" --mode "$MODE" --duration "$DURATION" \
  --twins "$TWINS" --out "$RUN/results.json" ${BENCH_ARGS:-}
RC=$?
kill -0 "$SERVER" 2>/dev/null && ALIVE=1 || ALIVE=0
echo "server alive at the end: $ALIVE"
grep -n "Traceback\|AssertionError\|Error\b" "$LOG" | head -20 > "$RUN/server_errors.txt"
grep -c "" "$RUN/server_errors.txt" | xargs echo "server error lines:"
head -5 "$RUN/server_errors.txt"
grep -n "toolkv" "$LOG" | head -40 > "$RUN/server_toolkv_lines.txt"
exit $(( RC != 0 || ALIVE == 0 ))
