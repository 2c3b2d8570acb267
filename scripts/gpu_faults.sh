#!/usr/bin/env bash
# The fault table on a live sglang server with toolkv (GPU), then its decision log checked against the spec.
#
#   here, once per bundle:  bash scripts/gpu_bundle.sh                  (.gpu-bundle/)
#   on the GPU machine (checkout + .gpu-bundle):  bash scripts/gpu_faults.sh
#
# One server (RELEASE 0516: the Llama-3.2-1B shape on HiRadixCache; 0523: the Granite-8B shape on
# UnifiedRadixCache, no DualGemm), dummy weights, a small device pool (--max-total-tokens 16384, so that one
# request can hold it) and a host pool twice its size (--hicache-ratio 2, so that a dozen sessions fill it),
# TOOLKV_TTL_S=40 and TOOLKV_HANDOVER_TTL_S=5 so that the TTL rows end within the run.
# scripts/gpu_faults.py launches it (the last row restarts it), injects the faults and writes
# $OUT/faults_<release>_<policy>.json; then `toolkv trace-check --decisions` replays the server's decision log
# against the spec ($OUT/decisions_<release>_<policy>.json). $OUT/server_<release>_<policy>.log is its log.
# WRITE_POLICY (--hicache-write-policy, default write_back): under sglang's write-through the session's KV is
# usually on the host already when tool_start comes, so the session is Offloaded at once and no call can meet it
# Offloading; under write-back tool_start itself writes it, which is the path the Offloading rows need.
# Knobs: RELEASE (0516), WRITE_POLICY, ROWS (comma-separated, default all), PORT (30000), SKIP_INSTALL=1.
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=scripts/gpu_lib.sh
source "$ROOT/scripts/gpu_lib.sh"
BUNDLE=${BUNDLE:-$ROOT/.gpu-bundle}
OUT=${OUT:-/tmp/toolkv_faults}; mkdir -p "$OUT"
RELEASE=${RELEASE:-0516} PORT=${PORT:-30000} WRITE_POLICY=${WRITE_POLICY:-write_back}
T0=$SECONDS

if [ "${SKIP_INSTALL:-0}" != 1 ]; then
  bash "$BUNDLE/install.sh" "$BUNDLE" > "$OUT/install.log" 2>&1 || { tail -20 "$OUT/install.log"; exit 1; }
  tail -1 "$OUT/install.log"
fi
# shellcheck source=/dev/null
source "$BUNDLE/env.sh"
use_release "$RELEASE" || exit 2
case $RELEASE in 0516) MODEL=llama-3.2-1b ;; 0523) MODEL=granite-8b ;; esac
EP=$STAGE_ROOT/toolkv_ep; toolkv_entry_point "$EP"
export PYTHONPATH=$ROOT:$EP:$STAGED_DEPS:$PYTHONPATH

NAME=${RELEASE}_$WRITE_POLICY LOG=$OUT/server_${RELEASE}_$WRITE_POLICY.log; : > "$LOG"
"$PY" - "$OUT/launch.json" "$MODELS/$MODEL" "$PORT" "$WRITE_POLICY" <<'PY'
import json, sys
out, model, port, policy = sys.argv[1:5]
cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", model, "--load-format", "dummy",
       "--skip-tokenizer-init", "--attention-backend", "triton", "--sampling-backend", "pytorch",
       "--grammar-backend", "none", "--disable-cuda-graph", "--mem-fraction-static", "0.3",
       "--max-total-tokens", "16384", "--context-length", "16384", "--page-size", "1",
       "--enable-hierarchical-cache", "--hicache-ratio", "2", "--hicache-write-policy", policy, "--host", "127.0.0.1", "--port", port]
env = {"TOOLKV_ENABLE": "1", "TOOLKV_TTL_S": "40", "TOOLKV_HANDOVER_TTL_S": "5", "TOOLKV_SWEEP_EVERY": "16",
       "TOOLKV_RESTORE_ON_REQUEST": "1"}
json.dump({"cmd": cmd, "env": env, "url": f"http://127.0.0.1:{port}"}, open(out, "w"), indent=1)
PY
"$PY" "$ROOT/scripts/gpu_faults.py" --launch "$OUT/launch.json" --log "$LOG" --out "$OUT/faults_$NAME.json" \
  --release "$SGLANG_RELEASE" --rows "${ROWS:-}"
RC=$?
"$PY" -m toolkv.tools.cli trace-check --decisions "$LOG" --json > "$OUT/decisions_$NAME.json"
TRC=$?
echo "trace-check --decisions: rc=$TRC $(head -c 400 "$OUT/decisions_$NAME.json")"
BAD=$(grep -c -E "Traceback|AssertionError|out of memory|memory leak" "$LOG")
echo "server log: $BAD error lines; faults rc=$RC; $(( SECONDS - T0 )) s"
(( RC == 0 && TRC == 0 && BAD == 0 ))
