#!/usr/bin/env bash
# Sessions that move between servers, on one GPU: two sglang 0.5.16 servers with toolkv and one shared
# L3 directory (HiCache's `file` storage backend) behind sglang's router, routing by session id; one
# server is drained, its sessions go on on the other. What is checked and why: scripts/gpu_fleet.py.
#
#   here, once per bundle:  RELEASES=0516 ROUTER=1 bash scripts/gpu_bundle.sh   (.gpu-bundle-fleet/, git-ignored)
#   GPU machine (checkout + .gpu-bundle-fleet carried, $OUT set):  bash scripts/gpu_fleet.sh
#
# $OUT gets three files: fleet.json (every check and number), summary.txt (the same as a table),
# logs.tar.gz (server, router and install logs). Exit 0 only if every check passed.
# Knobs: DEADLINE_S (500: the whole run, install included, is over by then and the results are
# written), BASELINE (1: also the round without L3), PORT (30000; +1000, +2000 the other servers,
# +3000 the router), FLEET_ARGS (more gpu_fleet.py flags, e.g. "--page-size 16 --host-ratio 0.5").
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=scripts/gpu_lib.sh
source "$ROOT/scripts/gpu_lib.sh"
BUNDLE=${BUNDLE:-$ROOT/.gpu-bundle-fleet}
OUT=${OUT:-/tmp/toolkv_fleet_out}; mkdir -p "$OUT"
WORK=${WORK:-/tmp/toolkv_fleet_work}; rm -rf "$WORK"; mkdir -p "$WORK"
L3=${L3:-/tmp/toolkv_fleet_l3}
DEADLINE_S=${DEADLINE_S:-500} BASELINE=${BASELINE:-1} PORT=${PORT:-30000}
T0=$SECONDS
log() { echo "[$(( SECONDS - T0 )) s] $*"; }

# every process group gpu_fleet.py started (it writes their ids to $WORK/pids), whatever stopped it
cleanup() {
  local pid
  if [ -f "$WORK/pids" ]; then
    while read -r pid; do kill -TERM -- -"$pid" 2>/dev/null; done < "$WORK/pids"
    sleep 2
    while read -r pid; do kill -KILL -- -"$pid" 2>/dev/null; done < "$WORK/pids"
  fi
  [ -f "$OUT/fleet.json" ] || printf '{"passed": false, "error": "%s"}\n' "${FAIL_WHY:-no results written}" > "$OUT/fleet.json"
  tar -czf "$OUT/logs.tar.gz" -C "$WORK" --exclude=pids . 2>/dev/null
  rm -rf "$L3"
}
trap cleanup EXIT

if ! bash "$BUNDLE/install.sh" "$BUNDLE" > "$WORK/install.log" 2>&1; then
  tail -20 "$WORK/install.log"; FAIL_WHY="bundle install failed (install.log)"; exit 1
fi
log "$(tail -1 "$WORK/install.log")"
# shellcheck source=/dev/null
source "$BUNDLE/env.sh"
use_release 0516 || { FAIL_WHY="sglang 0.5.16 is not in $BUNDLE"; exit 1; }

# toolkv's entry point. sglang-router 0.3.2 drops session_id from the bodies it forwards: gpu_fleet.py
# starts the servers with TOOLKV_SESSION_HEADER=X-SMG-Routing-Key, so toolkv labels a request with the
# router's routing key instead (docs/operations.md, "Behind sglang's router")
EP=$STAGE_ROOT/toolkv_ep; toolkv_entry_point "$EP"
export PYTHONPATH=$ROOT:$EP:$STAGED_DEPS:$PYTHONPATH
if ! "$PY" - > "$WORK/preflight.log" 2>&1 <<'PY'
import importlib.metadata as md
eps = {e.name: e.value for e in md.entry_points(group="sglang.srt.plugins")}
assert eps.get("toolkv") == "toolkv.sglang.plugin:register", eps
import sglang_router, sglang_router.sglang_router_rs, toolkv.sglang.plugin, transitions  # noqa: F401
from toolkv.sglang.config import ToolKVConfig
header = ToolKVConfig.from_env({"TOOLKV_SESSION_HEADER": "X-SMG-Routing-Key"}).session_header
assert header == "x-smg-routing-key", header
print("entry points:", eps, "router", sglang_router.__version__, "session header", header)
PY
then
  cat "$WORK/preflight.log"; FAIL_WHY="preflight failed (preflight.log)"; exit 1
fi
cat "$WORK/preflight.log"
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv,noheader > "$WORK/gpu.txt" 2>&1 || true

LEFT=$(( DEADLINE_S - (SECONDS - T0) - 20 ))
(( LEFT > 120 )) || { FAIL_WHY="only $LEFT s left after the install"; exit 1; }
FLAG=--baseline; [ "$BASELINE" = 1 ] || FLAG=--no-baseline
log "gpu_fleet.py, $LEFT s"
# shellcheck disable=SC2086  # FLEET_ARGS is a list of flags
timeout -k 10 $(( LEFT + 25 )) "$PY" "$ROOT/scripts/gpu_fleet.py" --model "$MODELS/llama-3.2-1b" --out "$OUT" \
  --work "$WORK" --l3-dir "$L3" --deadline-s "$LEFT" --port "$PORT" "$FLAG" ${FLEET_ARGS:-}
RC=$?
(( RC == 124 || RC == 137 )) && FAIL_WHY="gpu_fleet.py cut by the shell's timeout"
log "done, rc=$RC"
exit $RC
