#!/usr/bin/env bash
# Does a toolkv server survive a loaded launch? Each launch is a FRESH sglang server (the crash that
# matters here is the scheduler process exiting, which ends the server), the 96-session agent load with
# four named tools, then: did the server stay up, what did the bench measure, how many tool_starts
# toolkv refused because their copy would have locked device room sglang had promised.
#
#   here, once:   bash scripts/gpu_bundle.sh            (.gpu-bundle/, git-ignored)
#   device call (carry [".gpu-bundle"], $OUT set; one call, under its 600-s limit):
#     bash scripts/gpu_launches.sh                       0.5.23, CONFIGS "offload stock offload auto offload"
#     RELEASE=0516 bash scripts/gpu_launches.sh
#
# Every server: the value load's flags (scripts/gpu_lib.sh VALUE_SERVER_FLAGS: dummy weights, triton
# attention, no CUDA graph, GPU KV pool capped at 120,000 tokens) with --mem-fraction-static 0.3
# --enable-hierarchical-cache --hicache-size 16 --hicache-write-policy $WRITE_POLICY (default
# write_through), Granite-8B shape on 0.5.23 (Llama-3.1-8B on 0.5.16), TOOLKV_ENABLE=1 TOOLKV_TTL_S=120
# TOOLKV_SWEEP_EVERY=16, every other toolkv setting at the plugin's default. On 0.5.23 the tree core is
# the Python one on both sides (the GPU machine's torch cannot load the wheel's Rust core: use_release).
#   offload  --mode explicit (the server's default policy, offload)
#   auto     TOOLKV_POLICY=auto, --mode explicit --send-tool
#   stock    --mode stock (no toolkv call, no session id)
# The load: LOAD (default named96, scripts/gpu_lib.sh value_load), DURATION (default 70), DRAIN
# (default 10). BUDGET_S (default 575): no launch starts with less than MIN_LEFT_S (default 160) left.
# $OUT/launches/ (3 files: a device call returns at most 8): summary.json and summary.md (one row per
# launch), runs.tar.gz (per launch: <n>_<config>.json, the bench's; its output; the decision lines;
# <n>_<config>_server_tail.txt, the last 150 lines of a server that died, with its traceback). Raw logs
# stay in WORK (default /tmp/toolkv_launches).
set -uo pipefail
T0=$SECONDS
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUNDLE=${BUNDLE:-.gpu-bundle}; [[ $BUNDLE == /* ]] || BUNDLE=$ROOT/$BUNDLE
# shellcheck source=scripts/gpu_lib.sh
source "$ROOT/scripts/gpu_lib.sh"
RELEASE=${RELEASE:-0523} LOAD=${LOAD:-named96} WRITE_POLICY=${WRITE_POLICY:-write_through}
value_load "$LOAD" || { echo "LOAD must be value or named96" >&2; exit 2; }
BENCH_ARGS=${BENCH_ARGS:-$DEF_ARGS} DURATION=${DURATION:-70} DRAIN=${DRAIN:-10}
CONFIGS=${CONFIGS:-offload stock offload auto offload} BUDGET_S=${BUDGET_S:-575} MIN_LEFT_S=${MIN_LEFT_S:-160}
OUT=${OUT:-/tmp/toolkv_launches_out}; DEST=$OUT/launches; mkdir -p "$DEST"
RES=${WORK:-/tmp/toolkv_launches}; rm -rf "$RES" && mkdir -p "$RES" || exit 2
PORT=${PORT:-30000} SRC=$ROOT
say() { echo "[$(( SECONDS - T0 ))s] $*"; }

[ -d "/tmp/site-$RELEASE/sglang" ] || bash "$BUNDLE/install.sh" "$BUNDLE" >/dev/null || { say "bundle install failed"; exit 1; }
# shellcheck source=/dev/null
source "$BUNDLE/env.sh"
use_release "$RELEASE" || exit 2
case $RELEASE in 0516) MODEL=llama-3.1-8b ;; 0523) MODEL=granite-8b ;; esac
EP=$STAGE_ROOT/toolkv_ep_launches; toolkv_entry_point "$EP"
export PYTHONPATH=$SRC:$EP:$STAGED_DEPS:$PYTHONPATH
check_bench_args || exit 2
say "release $RELEASE, model $MODEL, tree core ${SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND:-default}, load $LOAD, configs: $CONFIGS"

SERVER=""
stop() { [ -n "$SERVER" ] && stop_group "$SERVER"; SERVER=""; sleep 2; }
trap stop EXIT
ROWS=$RES/rows.jsonl; : > "$ROWS"
n=0
for cfg in $CONFIGS; do
  n=$((n + 1))
  left=$(( BUDGET_S - (SECONDS - T0) ))
  if [ "$left" -lt "$MIN_LEFT_S" ]; then say "launch $n ($cfg) skipped: ${left}s left"; continue; fi
  policy=offload mode=explicit extra=()
  case $cfg in
    offload) ;;
    auto) policy=auto extra=(--send-tool) ;;
    stock) mode=stock ;;
    *) say "unknown config $cfg"; continue ;;
  esac
  LOG=$RES/${n}_${cfg}_server.log
  env TOOLKV_ENABLE=1 TOOLKV_TTL_S=120 TOOLKV_SWEEP_EVERY=16 TOOLKV_POLICY=$policy \
    setsid "$PY" -m sglang.launch_server --model-path "$MODELS/$MODEL" "${VALUE_SERVER_FLAGS[@]}" --port "$PORT" \
    --mem-fraction-static 0.3 --enable-hierarchical-cache --hicache-size 16 --hicache-write-policy "$WRITE_POLICY" \
    > "$LOG" 2>&1 &
  SERVER=$!
  t0=$SECONDS healthy=0
  until curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; do
    kill -0 "$SERVER" 2>/dev/null || break
    [ $(( SECONDS - t0 )) -gt 240 ] && break
    sleep 2
  done
  curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && healthy=1
  say "launch $n $cfg: healthy=$healthy after $(( SECONDS - t0 ))s"
  bench_rc=-1
  if [ $healthy = 1 ]; then
    # shellcheck disable=SC2086
    (cd "$SRC" && timeout $(( DURATION + DRAIN + 60 )) "$PY" -m toolkv.tools.agent_bench --url "http://127.0.0.1:$PORT" \
      --mode $mode --config "$cfg" --duration "$DURATION" --drain "$DRAIN" --flush --out "$RES/${n}_${cfg}.json" \
      "${extra[@]}" $BENCH_ARGS) > "$RES/${n}_${cfg}_bench.txt" 2>&1
    bench_rc=$?
  fi
  alive=0; kill -0 "$SERVER" 2>/dev/null && curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && alive=1
  exc=$(grep -c "Scheduler hit an exception" "$LOG")
  oom=$(grep -c "Out of memory" "$LOG")
  refused=$(grep "toolkv decision op=tool_start" "$LOG" | grep -c "reason=device_memory_full")
  [ $alive = 1 ] || tail -150 "$LOG" > "$RES/${n}_${cfg}_server_tail.txt"
  grep "toolkv decision" "$LOG" | gzip > "$RES/${n}_${cfg}_decisions.txt.gz" 2>/dev/null
  "$PY" - "$RES/${n}_${cfg}.json" "$n" "$cfg" "$healthy" "$alive" "$exc" "$oom" "$refused" "$bench_rc" >> "$ROWS" <<'EOF'
import json, sys
path, n, cfg, healthy, alive, exc, oom, refused, rc = sys.argv[1:]
row = {"launch": int(n), "config": cfg, "healthy": healthy == "1", "alive_after": alive == "1",
       "scheduler_exceptions": int(exc), "out_of_memory_lines": int(oom),
       "tool_start_refused_device_room": int(refused), "bench_rc": int(rc)}
try:
    d = json.load(open(path))
    s = d.get("summary", d)
    for k in ("closed_turns_per_s", "turns_per_s", "resumed_ttft_p90_s", "resumed_cache_hit", "http_5xx"):
        if k in s:
            row[k] = s[k]
except (OSError, ValueError):
    pass
row["passed"] = d.get("passed") if "d" in dir() else None
print(json.dumps(row))
EOF
  say "launch $n $cfg: alive_after=$alive scheduler_exceptions=$exc oom=$oom refused_device_room=$refused bench_rc=$bench_rc"
  stop
done
"$PY" - "$ROWS" "$RES" "$RELEASE" <<'EOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
res, rel = sys.argv[2], sys.argv[3]
json.dump({"release": rel, "launches": rows}, open(f"{res}/summary.json", "w"), indent=1)
keys = sorted({k for r in rows for k in r} - {"launch", "config"})
with open(f"{res}/summary.md", "w") as f:
    f.write("| launch | config | " + " | ".join(keys) + " |\n|" + "---|" * (len(keys) + 2) + "\n")
    for r in rows:
        f.write(f"| {r['launch']} | {r['config']} | " + " | ".join(str(r.get(k, "")) for k in keys) + " |\n")
print(open(f"{res}/summary.md").read())
EOF
cp "$RES/summary.json" "$RES/summary.md" "$DEST/"
(cd "$RES" && tar -czf "$DEST/runs.tar.gz" --exclude='*_server.log' --exclude=rows.jsonl .)
