#!/usr/bin/env bash
# toolkv on the GPU machine: real CUDA pools, pinned host pool, sgl-kernel copies, real streams.
#
#   here, once:   bash scripts/gpu_bundle.sh   (both sglang releases, toolkv's runtime and test deps)
#   device call (carry [".gpu-bundle"]):  bash scripts/gpu_run.sh fuzz     # tests + transfer bench + campaign
#                                         bash scripts/gpu_run.sh mutants  # kill table on CUDA
# Everything lands in $OUT (JSON + logs); the last lines printed are a short summary.
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUNDLE=$ROOT/.gpu-bundle
ACTION=${1:-fuzz}
OUT=${OUT:-/tmp/toolkv_gpu_out}

mkdir -p "$OUT"
bash "$BUNDLE/install.sh" "$BUNDLE" > "$OUT/install.log" 2>&1 || { tail -20 "$OUT/install.log"; exit 1; }
# shellcheck source=/dev/null
source "$BUNDLE/env.sh"
use_release 0516
export PYTHONPATH=$ROOT:$STAGED_TEST_DEPS:$STAGED_DEPS:$PYTHONPATH OMP_NUM_THREADS=4
cd "$ROOT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
"$PY" -c "import torch, sglang; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'sglang', sglang.__version__)" | tee "$OUT/versions.txt"

case $ACTION in
  fuzz)
    echo "== GPU tests (round trips on CUDA pools)"
    TOOLKV_GPU_EXAMPLES=${TOOLKV_GPU_EXAMPLES:-20} timeout 200 "$PY" -m pytest -q -m gpu fuzz/test_gpu.py \
      -p no:cacheprovider > "$OUT/pytest_gpu.log" 2>&1; echo "pytest rc=$?" | tee -a "$OUT/pytest_gpu.log"
    tail -3 "$OUT/pytest_gpu.log"
    echo "== transfer benchmark (toolkv offload/restore vs raw pinned copy, same run)"
    timeout 120 "$PY" -m toolkv.tools.cli bench transfer --device cuda --tokens 512,8192 --out "$OUT/transfer.json" \
      2>&1 | grep -v -i warn | tee "$OUT/transfer.txt"
    echo "== stateful campaign on CUDA (target >= 20,000 steps)"
    timeout "${FUZZ_TIMEOUT:-330}" "$PY" -m toolkv.tools.cli fuzz --device cuda --examples "${FUZZ_EXAMPLES:-700}" \
      --steps 80 --seed 11 --every 50 --out "$OUT/fuzz_gpu.json" > "$OUT/fuzz_gpu.log" 2>&1
    echo "fuzz rc=$?" | tee -a "$OUT/fuzz_gpu.log"; grep -v -i warn "$OUT/fuzz_gpu.log" | tail -4
    ;;
  mutants)
    timeout "${FUZZ_TIMEOUT:-420}" "$PY" -m toolkv.tools.cli fuzz --device cuda --mutants --no-shrink \
      --examples "${KILL_EXAMPLES:-300}" --steps 60 --seed 7 --every 100 --out "$OUT/kill_gpu.json" \
      > "$OUT/kill_gpu.log" 2>&1
    echo "mutants rc=$?" | tee -a "$OUT/kill_gpu.log"; grep -v -i warn "$OUT/kill_gpu.log" | tail -14
    ;;
  *) echo "usage: gpu_run.sh fuzz | mutants" >&2; exit 2 ;;
esac
