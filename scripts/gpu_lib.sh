# Sourced by the GPU scripts (scripts/gpu_*.sh): the steps each of them needs the same way.

# stage_deps ROOT BUNDLE: toolkv's pure-Python runtime dependencies (transitions, prometheus_client),
# copied from the checkout's .venv into BUNDLE/toolkv_deps (the GPU machine has no package index).
stage_deps() {
  local root=$1 bundle=$2 sp
  sp=$("$root/.venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  rm -rf "$bundle/toolkv_deps" && mkdir -p "$bundle/toolkv_deps"
  cp -r "$sp/transitions" "$sp"/transitions-*.dist-info "$sp/prometheus_client" "$sp"/prometheus_client-*.dist-info \
    "$bundle/toolkv_deps/"
  find "$bundle/toolkv_deps" -name __pycache__ -prune -exec rm -rf {} +
  du -sh "$bundle"
}

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
