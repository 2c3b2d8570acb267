#!/usr/bin/env bash
# The twin's regime map on the GPU machine's CPU cores (the twin needs no GPU; the map is 960 runs of
# 5-20 CPU-seconds each, hours on 2 cores, minutes on 16).
#
#   here, once:   RELEASES=0516 bash scripts/gpu_bundle.sh .gpu-bundle-0516   (git-ignored)
#                 rm -rf out/src && mkdir -p out/src && git archive HEAD toolkv pyproject.toml | tar -x -C out/src
#   device call (carry [".gpu-bundle-0516", "out/src"]):
#     BUNDLE=$PWD/.gpu-bundle-0516 TOOLKV_SRC=$PWD/out/src CONFIGS=stock,offload,auto \
#       JOURNAL_FROM=docs/results/twin/map.runs.jsonl KEEP=stock,stock4x bash scripts/gpu_twin_map.sh
#   here, after the call (every run is in the journal, so this runs nothing and writes the map):
#     cp <files_at>/map.runs.jsonl docs/results/twin/map.runs.jsonl
#     toolkv twin map --out docs/results/twin/map.json --plot docs/results/twin/map.png
#
# CONFIGS: the configs to run (stock must be among them: every ratio is against the stock run of the
# same seed). JOURNAL_FROM + KEEP: start the journal with the runs of these configs from an earlier
# journal (stock and stock4x make no toolkv call, so a toolkv change leaves them as they were), and
# run only the rest. LIMIT_S (default 520): the map is stopped after this many seconds; a stopped map
# resumes from its journal. $OUT gets map.runs.jsonl, map.log (progress) and map.txt (the table).
# L3MAP_ARGS (optional): then the 16 GB + L3 against stock64 sweep, python -m toolkv.twin.l3map with
# these arguments on every core (L3MAP_LIMIT_S, default 240), into $OUT/l3map.json and l3map.log.
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUNDLE=${BUNDLE:-$ROOT/.gpu-bundle-0516} SRC=${TOOLKV_SRC:-$ROOT} CONFIGS=${CONFIGS:-stock,offload,auto,stock4x}
LIMIT_S=${LIMIT_S:-520} OUT=${OUT:?set OUT}
bash "$BUNDLE/install.sh" "$BUNDLE" > "$OUT/install.log" 2>&1 || { echo "bundle install failed"; tail "$OUT/install.log"; exit 1; }
# shellcheck source=/dev/null
source "$BUNDLE/env.sh"; use_release 0516 || exit 1
CORES=$(nproc --all)   # before OMP_NUM_THREADS=1: GNU nproc honours it
export PYTHONPATH=$SRC:$STAGED_DEPS:$PYTHONPATH CUDA_VISIBLE_DEVICES="" OMP_NUM_THREADS=1 PYTHONHASHSEED=0
J=$OUT/map.runs.jsonl; : > "$J"
if [ -n "${JOURNAL_FROM:-}" ]; then
  $PY - "$ROOT/$JOURNAL_FROM" "${KEEP:-stock,stock4x}" "$J" <<'PYEOF'
import json, sys
keep = set(sys.argv[2].split(","))
rows = [l for l in open(sys.argv[1]) if l.strip() and json.loads(l)["config"] in keep]
open(sys.argv[3], "w").writelines(rows)
print(f"journal: {len(rows)} runs of {sorted(keep)} kept", file=sys.stderr)
PYEOF
fi
echo "cores: $CORES"
t0=$SECONDS
timeout "$LIMIT_S" "$PY" -m toolkv.tools.cli twin map --jobs "$CORES" --configs "$CONFIGS" --journal "$J" \
  --out /tmp/map.json > "$OUT/map.txt" 2> "$OUT/map.log"
rc=$?
echo "map rc=$rc in $((SECONDS - t0)) s, $(wc -l < "$J") runs in the journal"
tail -3 "$OUT/map.log"; tail -15 "$OUT/map.txt"
if [ -n "${L3MAP_ARGS:-}" ]; then
  t0=$SECONDS
  # shellcheck disable=SC2086
  timeout "${L3MAP_LIMIT_S:-240}" "$PY" -m toolkv.twin.l3map $L3MAP_ARGS --jobs "$CORES" --out "$OUT/l3map.json" \
    > "$OUT/l3map.txt" 2> "$OUT/l3map.log"
  echo "l3map rc=$? in $((SECONDS - t0)) s"; tail -3 "$OUT/l3map.log"; tail -20 "$OUT/l3map.txt"
fi
exit 0
