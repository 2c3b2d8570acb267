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

# ---- shared by the value scripts (gpu_value_repeat.sh, gpu_l3_capacity.sh); they define say() ----

# value_load LOAD: the load's bench arguments, duration and rounds (DEF_ARGS, DEF_DURATION, DEF_REPEATS)
value_load() {
  case $1 in
    value)
      DEF_ARGS="--sessions 48 --arrival-rate 0 --turns 6 --first-tokens 3000 --growth 900 --output 32 \
--max-context 16384 --warmup 0"
      DEF_DURATION=75 DEF_REPEATS=2 ;;
    named96)
      DEF_ARGS="--sessions 96 --arrival-rate 0 --turns 5 --first-tokens 3000 --growth 900 --output 32 \
--max-context 16384 --warmup 0 --tool-shape named"
      DEF_DURATION=100 DEF_REPEATS=1 ;;
    *) return 1 ;;
  esac
}

# VALUE_SERVER_FLAGS: the value servers' sglang flags (Llama-3.1-8B shape, dummy weights, the GPU KV pool
# capped at 120,000 tokens), less --port, --mem-fraction-static and the cache's flags
VALUE_SERVER_FLAGS=(--load-format dummy --skip-tokenizer-init --attention-backend triton --sampling-backend pytorch
  --grammar-backend none --context-length 65536 --disable-cuda-graph --host 127.0.0.1 --max-total-tokens 120000)

# stage_0516 EP_NAME: the bundle installed (once per machine), its environment, sglang 0.5.16 and toolkv's
# plugin entry point on PYTHONPATH. Exit status 1: the install failed, 2: no 0.5.16 in the bundle.
stage_0516() {
  if [ ! -d /tmp/site-0516/sglang ]; then
    bash "$BUNDLE/install.sh" "$BUNDLE" >/dev/null || { say "bundle install failed"; return 1; }
    say "bundle installed"
  fi
  # shellcheck source=/dev/null
  source "$BUNDLE/env.sh"
  use_release 0516 || return 2
  EP=$STAGE_ROOT/$1; toolkv_entry_point "$EP"
  PYTHONPATH=$EP:$STAGED_DEPS:$PYTHONPATH
}

# check_bench_args: agent_bench's parser on $BENCH_ARGS (run from $SRC with $PY), before any GPU time goes on them
check_bench_args() {
  # shellcheck disable=SC2086
  (cd "$SRC" && "$PY" -c 'import sys; from toolkv.tools.agent_bench import parser; parser().parse_args(sys.argv[1:])' \
    --out /dev/null --duration "$DURATION" $BENCH_ARGS) || { say "BENCH_ARGS refused by agent_bench: $BENCH_ARGS"; return 2; }
}

# wait_healthy PID PORT LOG DEADLINE [NAME]: until the server answers /health; 1 if it dies or SECONDS passes DEADLINE
wait_healthy() {
  local pid=$1 port=$2 log=$3 deadline=$4 name=${5:+$5: } t0=$SECONDS
  until curl -sf "http://127.0.0.1:$port/health" >/dev/null; do
    kill -0 "$pid" 2>/dev/null || { say "${name}server died at start"; tail -20 "$log"; return 1; }
    (( SECONDS > deadline )) && { say "${name}server not healthy after $(( SECONDS - t0 )) s"; tail -20 "$log"; return 1; }
    sleep 2
  done
}

# agent_bench_run URL CONFIG DIR LIMIT_S FLAGS: one bench of $BENCH_ARGS ($DURATION s, drain $DRAIN, the cache
# flushed first) into DIR/CONFIG.json and .log, killed after LIMIT_S; returns agent_bench's exit status
agent_bench_run() {
  local url=$1 cfg=$2 dir=$3 limit=$4 flags=$5
  # shellcheck disable=SC2086
  (cd "$SRC" && timeout -k 5 "$limit" "$PY" -m toolkv.tools.agent_bench --url "$url" \
    --config "$cfg" $flags --duration "$DURATION" --drain "$DRAIN" --flush --out "$dir/$cfg.json" \
    $BENCH_ARGS) > "$dir/$cfg.log" 2>&1
}

# bench_outcome DIR CONFIG: one line on a finished bench (turns, errors, checks, decisions, calls, the
# eviction-harm count toolkv:kv_recomputed_after_evict_tokens_total over the run) and a
# warning where the flush before it did not answer 200 (a cache it left would hand the next config the KV)
bench_outcome() {
  local dir=$1 cfg=$2 what="no result" flush
  [ -f "$dir/$cfg.json" ] && what=$("$PY" - "$dir/$cfg.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
s = r["summary"]
ok = sum(1 for t in r["turns"] if t.get("status") == 200)
bad = [k for k, v in r["checks"].items() if not v]
dec = s.get("decisions") or {}
harm = s.get("recomputed_after_evict_tokens")  # eviction harm over this run (toolkv bench agent)
print(f"{ok} turns, {s.get('errors', 0)} errors, {'passed' if r['passed'] else 'FAILED ' + '; '.join(bad)}"
      + (f", decisions {dec}" if dec else "") + f", calls {s.get('calls', {})}"
      + (f", recomputed after evict session {harm['session']} other {harm['other']}" if harm else ""))
if r.get("policy") == "auto" and set(dec) == {"offload"}:  # the offload policy answers "offload" every time
    print("    WARNING: every decision was offload: does this server apply tool_start's per-call policy?")
PY
)
  flush=$(grep -m1 -o 'flush_cache: [0-9]*' "$dir/$cfg.log" | cut -d' ' -f2)
  [ "$flush" = 200 ] || what="$what; WARNING: flush_cache answered ${flush:-nothing}"
  echo "$what"
}
