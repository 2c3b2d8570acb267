# Sourced by the GPU scripts (scripts/gpu_*.sh): the steps each of them needs the same way.

# toolkv_entry_point DIR [VALUE]: a dist-info in DIR declaring toolkv's sglang plugin entry point
# (importlib.metadata.entry_points() scans every sys.path entry for *.dist-info/entry_points.txt).
toolkv_entry_point() {
  local ep=$1 value=${2:-toolkv.sglang.plugin:register}
  rm -rf "$ep" && mkdir -p "$ep/toolkv-0.1.0.dist-info"
  printf 'Metadata-Version: 2.1\nName: toolkv\nVersion: 0.1.0\n' > "$ep/toolkv-0.1.0.dist-info/METADATA"
  printf '[sglang.srt.plugins]\ntoolkv = %s\n' "$value" > "$ep/toolkv-0.1.0.dist-info/entry_points.txt"
}

# stop_group PID: TERM the server's process group, KILL it if it is still there after 15 s.
stop_group() {
  local pid=$1
  kill -TERM -- -"$pid" 2>/dev/null || return 0
  for _ in $(seq 30); do kill -0 -- -"$pid" 2>/dev/null || return 0; sleep 0.5; done
  kill -KILL -- -"$pid" 2>/dev/null
}

# use_default_tree_core: after `use_release 0523`, hand the radix tree back to sglang's default core
# (Rust) for a stock baseline, but only where that core works with the installed torch
# (scripts/stage/tree_core_probe.py, a few seconds). sglang 0.5.23's wheel compiles its Rust tree
# core against torch 2.14.1, the torch it pins; next to torch 2.11 (the GPU machine's) the core
# misreads every tensor and the scheduler dies at its first insert ("insert value must be an int64
# tensor, got Int": docs/sglang_versions.md, "The tree core"). Where the probe fails this prints
# why and returns 1, and SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND stays as use_release set it.
use_default_tree_core() {
  local root
  root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
  "${PY:-python3}" "$root/scripts/stage/tree_core_probe.py" || return 1
  unset SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND
}
