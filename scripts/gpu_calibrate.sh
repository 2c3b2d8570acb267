#!/usr/bin/env bash
# Calibrate the twin's time profile (toolkv twin --profile) on one H200, in one device call of < 10 min.
#
#   here, once:   bash scripts/gpu_bundle.sh    (both sglang releases + toolkv's runtime deps in .gpu-bundle/)
#   device call (carry [".gpu-bundle"]):   bash scripts/gpu_calibrate.sh
#   dry run here (no server, synthetic points): bash scripts/gpu_calibrate.sh --dry-run
#
# Server: the agent benchmark's constrained one (Llama-3.1-8B shape, dummy weights, 64K context, triton
# attention, --mem-fraction-static 0.3 --max-total-tokens 120000, HiCache 16 GB, the toolkv plugin for the
# copy measurements). Measures prefill time vs new tokens and cached context, decode step time vs batch and
# context, and toolkv's offload/restore copy times (python -m toolkv.twin.calibrate), fits the profile and
# writes $OUT/calibration/{profile.json,points.json} and the server log. Budget: ~60 s server start,
# measurements stop after CAL_BUDGET_S (330 s) whatever is left.
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OUT=${OUT:-/tmp/toolkv_calibrate_out}; RES=$OUT/calibration; mkdir -p "$RES"
if [ "${1:-}" = "--dry-run" ]; then
  PY=${PY:-$ROOT/.venv/bin/python}
  (cd "$ROOT" && "$PY" -m toolkv.twin.calibrate --dry-run --out "$RES") && echo "dry run: $RES/profile.json"
  exit $?
fi
BUNDLE=$ROOT/.gpu-bundle
# shellcheck source=scripts/gpu_lib.sh
source "$ROOT/scripts/gpu_lib.sh"
[ -d /tmp/site-0516/sglang ] || bash "$BUNDLE/install.sh" "$BUNDLE" >/dev/null || exit 1
# shellcheck source=/dev/null
source "$BUNDLE/env.sh"; use_flashinfer_stub
EP=$STAGE_ROOT/toolkv_ep_cal; toolkv_entry_point "$EP"
export PYTHONPATH=$ROOT:$EP:$STAGED_DEPS:$PYTHONPATH TOOLKV_ENABLE=1 TOOLKV_TTL_S=600
PORT=30000 LOG=$RES/server.log
setsid "$PY" -m sglang.launch_server --model-path "$STAGE_ROOT/models/llama-3.1-8b" --load-format dummy \
  --skip-tokenizer-init --attention-backend triton --sampling-backend pytorch --grammar-backend none \
  --context-length 65536 --disable-cuda-graph --host 127.0.0.1 --port $PORT \
  --mem-fraction-static 0.3 --max-total-tokens 120000 --enable-hierarchical-cache --hicache-size 16 > "$LOG" 2>&1 &
SERVER=$!
trap 'stop_group "$SERVER"' EXIT
t0=$(date +%s)
until curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; do
  kill -0 "$SERVER" 2>/dev/null || { echo "server died at start"; tail -20 "$LOG"; exit 1; }
  [ $(( $(date +%s) - t0 )) -gt 200 ] && { echo "not healthy after 200 s"; exit 1; }
  sleep 2
done
echo "healthy after $(( $(date +%s) - t0 )) s"
(cd "$ROOT" && "$PY" -m toolkv.twin.calibrate --url "http://127.0.0.1:$PORT" --out "$RES" \
  --budget-s "${CAL_BUDGET_S:-330}") || exit 1
grep -n "Traceback\|Out of memory" "$LOG" | head -5
echo "profile: $RES/profile.json (toolkv twin --profile $RES/profile.json)"
