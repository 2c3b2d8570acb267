#!/usr/bin/env bash
# Tensor parallel on two GPUs: both sglang releases with --tp 2, every decision agreed on both ranks.
#
#   here, once per bundle:  bash scripts/gpu_bundle.sh            (.gpu-bundle/, about 60 MiB)
#   on a machine with two GPUs (checkout + .gpu-bundle):  COMMIT=$(git rev-parse HEAD) bash scripts/gpu_tp2.sh
#
# Per release (RELEASES, default "0516,0523"), one server with toolkv and --tp 2 (the server flags of
# scripts/gpu_acceptance.sh: 8B shape, dummy weights, --enable-hierarchical-cache --hicache-size 16 per rank),
# load-adaptive protection (park, unpin) and lazy free on (TOOLKV_ADAPTIVE=1 TOOLKV_LAZY_FREE=1), and the
# toolkv logger at DEBUG in every process (rank 1 writes its decision lines at DEBUG), against which run:
#   kv_meta     GET /session/kv_meta answers tp_size 2
#   e2e         scripts/gpu_e2e.py (the end-to-end checks: next turn token-identical to a never-offloaded twin,
#               prefix reused, stale epoch refused, restore on request, nothing leaked)
#   load        toolkv bench agent: 48 sessions starting together, LOAD_S (120) seconds; no crash, no 5xx beyond
#               the documented refusals, every generate answered, nothing protected or locked at the end
#   server_log  no Traceback / AssertionError / out-of-memory / NCCL or gloo timeout in the server log
#   decisions   the server log's decision lines split by rank (rank=0, rank=1): each replayed by
#               `toolkv trace-check --decisions` against the spec's session table, and the two ranks' lines
#               identical apart from the rank field (the same decisions in the same order)
# $OUT/tp2.json: the commit, pass/fail per check and release, the numbers; $OUT/summary.txt the same as a
# table; $OUT/runs.tar.gz every JSON and log. Knobs: RELEASES, LOAD_S (120), PORT (30000), DEADLINE_S (560:
# no step runs past it), SKIP_INSTALL=1, TREE_CORE=rust (0.5.23 on sglang's default Rust tree core where
# scripts/stage/tree_core_probe.py says it loads; else the Python core, recorded in tree_core.txt).
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=scripts/gpu_lib.sh
source "$ROOT/scripts/gpu_lib.sh"
BUNDLE=${BUNDLE:-$ROOT/.gpu-bundle}
OUT=${OUT:-/tmp/toolkv_tp2}; mkdir -p "$OUT"
WORK=${WORK:-/tmp/toolkv_tp2_work}; rm -rf "$WORK"; mkdir -p "$WORK"
RELEASES=${RELEASES:-0516,0523} LOAD_S=${LOAD_S:-120} PORT=${PORT:-30000} DEADLINE_S=${DEADLINE_S:-560}
URL=http://127.0.0.1:$PORT
T0=$SECONDS
log() { echo "[$(( SECONDS - T0 )) s] $*"; }

if [ "${SKIP_INSTALL:-0}" != 1 ]; then
  bash "$BUNDLE/install.sh" "$BUNDLE" > "$WORK/install.log" 2>&1 || { tail -20 "$WORK/install.log"; exit 1; }
  log "$(tail -1 "$WORK/install.log")"
fi
# shellcheck source=/dev/null
source "$BUNDLE/env.sh"
EP=$STAGE_ROOT/toolkv_ep; toolkv_entry_point "$EP"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$WORK/gpu.txt" 2>&1 || true
if (( $(grep -c . "$WORK/gpu.txt") < 2 )); then
  log "needs two GPUs; nvidia-smi lists: $(cat "$WORK/gpu.txt")"; cp "$WORK/gpu.txt" "$OUT/"; exit 2
fi
# every process (the HTTP one and each scheduler rank) starts with the toolkv logger at DEBUG: rank 1's
# decision lines are DEBUG (toolkv.sglang.observe), and sglang's own loggers stay at --log-level
LOGCFG=$WORK/logcfg; mkdir -p "$LOGCFG"
printf 'import logging\nlogging.getLogger("toolkv").setLevel(logging.DEBUG)\n' > "$LOGCFG/sitecustomize.py"

# step NAME CAP_S CMD...: one check under a time cap (never past DEADLINE_S), rc and seconds in $R/steps.tsv
step() {
  local name=$1 cap=$2 t=$SECONDS rc left; shift 2
  left=$(( DEADLINE_S - (SECONDS - T0) ))
  if (( left < 20 )); then log "$REL $name skipped: run deadline"; printf '%s\t124\t0\n' "$name" >> "$R/steps.tsv"; return; fi
  (( cap > left )) && cap=$left
  log "$REL $name (cap ${cap} s)"
  timeout -k 10 "$cap" "$@" > "$R/$name.log" 2>&1; rc=$?
  printf '%s\t%s\t%s\n' "$name" "$rc" "$(( SECONDS - t ))" >> "$R/steps.tsv"
  grep -E "^(PASS|FAIL)|TOOLKV_|config=|tp_size" "$R/$name.log" | tail -n 40
  log "$REL $name rc=$rc"
}

serve() {  # launch flags...; exports SERVER, returns non-zero if not healthy in 420 s (two ranks load)
  setsid "$PY" -m sglang.launch_server --model-path "$MODELS/$MODEL" --tokenizer-path "$CHAT_TOKENIZER" \
    --load-format dummy --attention-backend triton --sampling-backend pytorch --disable-cuda-graph \
    --enable-hierarchical-cache --hicache-size 16 --mem-fraction-static 0.3 --max-total-tokens 120000 \
    --context-length 32768 --enable-cache-report --grammar-backend none --host 127.0.0.1 --port "$PORT" \
    --tp 2 "$@" > "$R/server.log" 2>&1 &
  SERVER=$!
  local t=$SECONDS
  until curl -sf "$URL/health" >/dev/null; do
    kill -0 "$SERVER" 2>/dev/null || { log "server died at start"; tail -15 "$R/server.log"; return 1; }
    (( SECONDS - t > 420 || SECONDS - T0 > DEADLINE_S )) && { log "server not healthy after $(( SECONDS - t )) s"; return 1; }
    sleep 2
  done
  log "$REL server healthy after $(( SECONDS - t )) s"
}
trap '[ -n "${SERVER:-}" ] && stop_group "$SERVER"' EXIT

# decisions LOG: each rank's decision lines replayed against the spec, then the ranks compared line by line
decisions() {
  local r
  for r in 0 1; do
    grep -a "toolkv decision " "$1" | grep -a -E " rank=$r( |$)" | sed -E 's/^.*(toolkv decision )/\1/' > "$R/decisions_rank$r.log"
    sed -E "s/ rank=$r( |$)/\1/" "$R/decisions_rank$r.log" > "$R/decisions_rank$r.cmp"
    echo "rank $r: $(wc -l < "$R/decisions_rank$r.log") decision lines"
    "$PY" -m toolkv.tools.cli trace-check --decisions "$R/decisions_rank$r.log" --json > "$R/trace_check_rank$r.json" \
      || { echo "FAIL trace-check rank $r"; return 1; }
  done
  [ -s "$R/decisions_rank0.cmp" ] || { echo "FAIL no decision lines of rank 0"; return 1; }
  diff "$R/decisions_rank0.cmp" "$R/decisions_rank1.cmp" > "$R/decisions.diff" \
    || { echo "FAIL the ranks' decision lines differ ($(grep -c '^[<>]' "$R/decisions.diff") lines)"; head -20 "$R/decisions.diff"; return 1; }
  echo "PASS both ranks: the same $(wc -l < "$R/decisions_rank0.cmp") decision lines, each replayed by the spec"
}

IFS=, read -ra LIST <<< "$RELEASES"
for REL in "${LIST[@]}"; do
  R=$WORK/$REL; mkdir -p "$R"; : > "$R/steps.tsv"
  use_release "$REL" || continue
  case $REL in 0516) MODEL=llama-3.1-8b BACKEND=hiradix ;; 0523) MODEL=granite-8b BACKEND=unified ;; esac
  [ "$REL" = 0523 ] && [ "${TREE_CORE:-}" = rust ] && { use_default_tree_core || log "the Rust tree core does not load here"; }
  echo "${SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND:-default}" > "$R/tree_core.txt"
  export PYTHONPATH=$ROOT:$LOGCFG:$EP:$STAGED_DEPS:$PYTHONPATH
  export TOOLKV_ENABLE=1 TOOLKV_RESTORE_ON_REQUEST=1 TOOLKV_TTL_S=120 TOOLKV_ADAPTIVE=1 TOOLKV_LAZY_FREE=1
  if ! serve; then printf 'server\t1\t0\n' >> "$R/steps.tsv"; stop_group "$SERVER"; SERVER=; continue; fi
  step kv_meta 30 "$PY" -c 'import json, sys, urllib.request
m = json.load(urllib.request.urlopen(sys.argv[1] + "/session/kv_meta", timeout=20))
json.dump(m, open(sys.argv[2], "w"), indent=1)
print("tp_size", m.get("tp_size")); sys.exit(0 if m.get("tp_size") == 2 else 1)' "$URL" "$R/kv_meta.json"
  step e2e 200 "$PY" "$ROOT/scripts/gpu_e2e.py" --url "$URL" --pid "$SERVER" --out "$R/e2e.json" --backend "$BACKEND" --lazy-free 1
  step load $(( LOAD_S + 200 )) "$PY" -m toolkv.tools.agent_bench --url "$URL" --mode explicit --config tp2_load48 \
    --sessions 48 --arrival-rate 0 --turns 6 --first-tokens 3000 --growth 900 --output 32 --max-context 16384 \
    --duration "$LOAD_S" --warmup 0 --drain 20 --twins 2 --flush --out "$R/load.json"
  stop_group "$SERVER"; SERVER=
  BAD=$(grep -c -a -E "Traceback|AssertionError|out of memory|Out of memory|Timed out|NCCL error|ProcessGroupGloo" "$R/server.log")
  printf 'server_log\t%s\t0\n' "$(( BAD > 0 ))" >> "$R/steps.tsv"
  log "$REL server log: $BAD error lines"
  step decisions 120 decisions "$R/server.log"
done

"$PY" - "$WORK" "${COMMIT:-unknown}" > "$WORK/summary.txt" <<'EOF'
import json, sys
from pathlib import Path
work, commit = Path(sys.argv[1]), sys.argv[2]
out = {"commit": commit, "gpus": (work / "gpu.txt").read_text().splitlines(), "releases": {}}
ok = True
for rel in sorted(p for p in work.iterdir() if (p / "steps.tsv").exists()):
    steps = {n: {"rc": int(rc), "s": int(s)} for n, rc, s in (l.split("\t") for l in (rel / "steps.tsv").read_text().splitlines() if l)}
    need = ["kv_meta", "e2e", "load", "server_log", "decisions"]
    got = {n: steps.get(n, {"rc": "missing"}) for n in need}
    rel_ok = all(v.get("rc") == 0 for v in got.values())
    tree = (rel / "tree_core.txt").read_text().strip() if (rel / "tree_core.txt").exists() else "?"
    out["releases"][rel.name] = {"pass": rel_ok, "tree_core": tree, "steps": got}
    ok &= rel_ok
out["pass"] = ok and bool(out["releases"])
(work / "tp2.json").write_text(json.dumps(out, indent=1))
print(f"TP2 {'PASS' if out['pass'] else 'FAIL'} commit {commit}")
for rel, r in out["releases"].items():
    print(f"{rel} (tree core {r['tree_core']}): " + " ".join(f"{n}={v['rc']}" for n, v in r["steps"].items()))
EOF
cp "$WORK/summary.txt" "$WORK/tp2.json" "$OUT/" 2>/dev/null
tar -czf "$OUT/runs.tar.gz" -C "$WORK" .
cat "$OUT/summary.txt"
log "done"
grep -q "^TP2 PASS" "$OUT/summary.txt"
