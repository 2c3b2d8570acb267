#!/usr/bin/env bash
# toolkv end-to-end on the GPU machine: stock sglang 0.5.16 + the toolkv plugin, dummy weights, HiCache.
#
#   here (once per bundle):  bash scripts/gpu_e2e.sh stage
#       builds .gpu-bundle/ with scripts/gpu_bundle.sh if missing (both sglang releases, toolkv's deps)
#   GPU machine (checkout + .gpu-bundle):  bash scripts/gpu_e2e.sh run [1b|8b] [server flags...]
#       installs the bundle, makes the entry point visible, launches the server with TOOLKV_ENABLE=1,
#       runs scripts/gpu_e2e.py, copies results + server log to $OUT. Exit 0 only if every check passed.
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=scripts/gpu_lib.sh
source "$ROOT/scripts/gpu_lib.sh"
BUNDLE=$ROOT/.gpu-bundle
ACTION=${1:-run}

if [ "$ACTION" = stage ]; then
  set -e
  [ -f "$BUNDLE/bundle.tar.xz" ] || bash "$ROOT/scripts/gpu_bundle.sh" "$BUNDLE"
  exit 0
fi
[ "$ACTION" = run ] || { echo "usage: gpu_e2e.sh stage | run [1b|8b] [server flags...]" >&2; exit 2; }
SIZE=${2:-1b}
EXTRA=("${@:3}")  # extra server flags, e.g. --tp 2 on a two-GPU machine
OUT=${OUT:-/tmp/toolkv_e2e_out}
mkdir -p "$OUT"

bash "$BUNDLE/install.sh" "$BUNDLE" || exit 1
# shellcheck source=/dev/null
source "$BUNDLE/env.sh"
use_release 0516
case $SIZE in 1b) CFG=llama-3.2-1b ;; 8b) CFG=llama-3.1-8b ;; *) echo "size must be 1b or 8b" >&2; exit 2 ;; esac
MODEL=$STAGE_ROOT/models/$CFG PORT=${PORT:-30000}

# toolkv from the checkout, its dependency from the bundle, and a dist-info carrying the entry point:
# importlib.metadata.entry_points() scans every sys.path entry for *.dist-info/entry_points.txt.
toolkv_entry_point "$STAGE_ROOT/toolkv_ep"; EP=$STAGE_ROOT/toolkv_ep
export PYTHONPATH=$ROOT:$EP:$STAGED_DEPS:$PYTHONPATH
# the check asserts the GPU copy is freed during the tool call: the eager path (lazy free leaves it)
export TOOLKV_LAZY_FREE=${TOOLKV_LAZY_FREE:-0} TOOLKV_ENABLE=1 TOOLKV_TTL_S=${TOOLKV_TTL_S:-120} TOOLKV_SWEEP_EVERY=${TOOLKV_SWEEP_EVERY:-16}
"$PY" - <<'PY' || exit 1
import importlib.metadata as md
eps = [e.value for e in md.entry_points(group="sglang.srt.plugins") if e.name == "toolkv"]
assert eps == ["toolkv.sglang.plugin:register"], eps
import toolkv.sglang.plugin, transitions  # noqa: F401
print("toolkv entry point visible:", eps)
PY

LOG=$OUT/server.log
if "$PY" -c "import socket, sys; sys.exit(socket.socket().connect_ex(('127.0.0.1', $PORT)))"; then
  echo "port $PORT is already in use" >&2; exit 1
fi
# Same launch as serve_smoke.sh (verified on the H200), plus toolkv. --page-size 1 keeps token counts exact.
setsid "$PY" -m sglang.launch_server --model-path "$MODEL" --load-format dummy --skip-tokenizer-init \
  --attention-backend triton --sampling-backend pytorch --grammar-backend none \
  --enable-hierarchical-cache --hicache-size 16 --mem-fraction-static 0.3 --disable-cuda-graph \
  --context-length 8192 --host 127.0.0.1 --port "$PORT" "${EXTRA[@]}" > "$LOG" 2>&1 &
SERVER=$!
stop_server() { stop_group "$SERVER"; }
trap stop_server EXIT

"$PY" "$ROOT/scripts/gpu_e2e.py" --url "http://127.0.0.1:$PORT" --pid "$SERVER" --out "$OUT/results.json"
RC=$?
stop_server
grep -n "toolkv" "$LOG" | head -n 40 > "$OUT/server_toolkv_lines.txt" || true
echo "--- last 30 lines of $LOG"; tail -n 30 "$LOG"
exit $RC
