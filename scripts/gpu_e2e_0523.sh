#!/usr/bin/env bash
# toolkv end-to-end on the GPU machine with stock sglang 0.5.23 (UnifiedRadixCache) + the toolkv plugin:
# the same checks as scripts/gpu_e2e.sh runs for 0.5.16 (scripts/gpu_e2e.py: device tokens freed during the
# tool call, the next turn identical to a never-offloaded twin, prefix reused, stale epoch refused, restore on
# request, nothing leaked).
#
#   here (once per bundle):  bash scripts/gpu_e2e_0523.sh stage
#       builds .gpu-bundle/ with scripts/gpu_bundle.sh if missing (both sglang releases, toolkv's deps)
#   GPU machine (checkout + .gpu-bundle):  bash scripts/gpu_e2e_0523.sh run [server flags...]
#       installs the bundle, makes the entry point visible, launches the server with TOOLKV_ENABLE=1 and the
#       Python tree core, runs scripts/gpu_e2e.py, copies results + server log to $OUT. Exit 0 only if every
#       check passed.
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
[ "$ACTION" = run ] || { echo "usage: gpu_e2e_0523.sh stage | run [server flags...]" >&2; exit 2; }
EXTRA=("${@:2}")  # extra server flags, e.g. --tp 2 on a two-GPU machine
OUT=${OUT:-/tmp/toolkv_e2e_0523_out}
mkdir -p "$OUT"

bash "$BUNDLE/install.sh" "$BUNDLE" || exit 1
# shellcheck source=/dev/null
source "$BUNDLE/env.sh"
use_release 0523   # also SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=python, the kernel-version skip, no flashinfer
# Granite-8B's shape: 0.5.23's Llama builds DualGemm, whose module imports the cutlass DSL (not in the bundle)
MODEL=$MODELS/granite-8b PORT=${PORT:-30000}

# toolkv from the checkout, its dependencies from the bundle, and a dist-info carrying the entry point:
# importlib.metadata.entry_points() scans every sys.path entry for *.dist-info/entry_points.txt.
toolkv_entry_point "$STAGE_ROOT/toolkv_ep_0523"; EP=$STAGE_ROOT/toolkv_ep_0523
export PYTHONPATH=$ROOT:$EP:$STAGED_DEPS:$PYTHONPATH
export TOOLKV_ENABLE=1 TOOLKV_TTL_S=${TOOLKV_TTL_S:-120} TOOLKV_SWEEP_EVERY=${TOOLKV_SWEEP_EVERY:-16}
"$PY" - <<'PY' || exit 1
import importlib.metadata as md
eps = [e.value for e in md.entry_points(group="sglang.srt.plugins") if e.name == "toolkv"]
assert eps == ["toolkv.sglang.plugin:register"], eps
import sglang, sgl_kernel, torch, transitions  # noqa: F401
import toolkv.sglang.plugin  # noqa: F401
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache  # noqa: F401
print("sglang", sglang.__version__, "torch", torch.__version__, "sgl_kernel", sgl_kernel.__file__)
print("toolkv entry point visible:", eps)
PY

LOG=$OUT/server.log
if "$PY" -c "import socket, sys; sys.exit(socket.socket().connect_ex(('127.0.0.1', $PORT)))"; then
  echo "port $PORT is already in use" >&2; exit 1
fi
# The 0.5.16 e2e launch (gpu_e2e.sh), on 0.5.23. --page-size 1 (the default) keeps token counts exact.
setsid "$PY" -m sglang.launch_server --model-path "$MODEL" --load-format dummy --skip-tokenizer-init \
  --attention-backend triton --sampling-backend pytorch --grammar-backend none \
  --enable-hierarchical-cache --hicache-size 16 --mem-fraction-static 0.3 --disable-cuda-graph \
  --context-length 8192 --host 127.0.0.1 --port "$PORT" "${EXTRA[@]}" > "$LOG" 2>&1 &
SERVER=$!
stop_server() { stop_group "$SERVER"; }
trap stop_server EXIT

"$PY" "$ROOT/scripts/gpu_e2e.py" --url "http://127.0.0.1:$PORT" --pid "$SERVER" --out "$OUT/results.json" --backend unified
RC=$?
stop_server
grep -n "toolkv" "$LOG" | head -n 40 > "$OUT/server_toolkv_lines.txt" || true
echo "--- last 30 lines of $LOG"; tail -n 30 "$LOG"
exit $RC
