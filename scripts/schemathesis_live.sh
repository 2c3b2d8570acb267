#!/usr/bin/env bash
# schemathesis over toolkv's HTTP API of a live sglang server (the GPU machine), recorded as JSON.
#
#   here (once):  bash scripts/schemathesis_live.sh stage
#       downloads schemathesis and its dependency closure as CPython 3.12 wheels (the GPU machine's
#       python) into .gpu-bundle/fuzz_wheels/; the GPU machine has no package index.
#   device:       bash scripts/schemathesis_live.sh run URL [--api-key KEY] [--examples N]
#       URL is a running server launched with TOOLKV_ENABLE=1 (e.g. the launch in gpu_e2e.sh).
#       Installs the wheels into a private folder, creates three sessions with one /generate each
#       (input_ids: the server may run --skip-tokenizer-init), then runs `toolkv fuzz-http` against
#       URL and writes $OUT/schemathesis_live.json. Exit 0 only with no server error and no refusal
#       that changed kv_meta.
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
WHEELS=$ROOT/.gpu-bundle/fuzz_wheels
ACTION=${1:-}

if [ "$ACTION" = stage ]; then
  set -e
  rm -rf "$WHEELS" && mkdir -p "$WHEELS"
  pins=$(grep -iE '^(schemathesis|hypothesis|hypothesis-graphql|graphql-core|harfile|jsonschema_rs|pyrate-limiter|werkzeug)==' \
    "$ROOT/requirements/lock-cpu.txt")
  # shellcheck disable=SC2086
  "$ROOT/.venv/bin/python" -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
    -d "$WHEELS" $pins
  ls "$WHEELS" | wc -l
  du -sh "$WHEELS"
  exit 0
fi
[ "$ACTION" = run ] && [ $# -ge 2 ] || {
  echo "usage: schemathesis_live.sh stage | run URL [--api-key KEY] [--examples N]" >&2; exit 2; }
URL=${2%/}
shift 2
OUT=${OUT:-/tmp/toolkv_schemathesis_out}
PY=${PY:-/opt/torch/.venv/bin/python3}
mkdir -p "$OUT"
SITE=$OUT/fuzz_site
"$PY" -m pip install -q --no-index --find-links "$WHEELS" --target "$SITE" schemathesis || exit 1
export PYTHONPATH=$ROOT:$SITE:${PYTHONPATH:-}

API_KEY=
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do [ "${args[$i]}" = --api-key ] && API_KEY=${args[$((i + 1))]:-}; done

"$PY" - "$URL" "$API_KEY" <<'PY' || exit 1
import sys, httpx
url, key = sys.argv[1], sys.argv[2]
h = {"Authorization": f"Bearer {key}"} if key else {}
with httpx.Client(base_url=url, headers=h, timeout=120) as c:
    for i, sid in enumerate(["fuzz-1", "fuzz-2", "fuzz-3"]):
        body = {"input_ids": list(range(1000 + 100 * i, 1000 + 100 * i + 64)), "session_id": sid,
                "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
        r = c.post("/generate", json=body)
        r.raise_for_status()
        m = c.get("/session/kv_meta", params={"session_id": sid})
        print(sid, m.status_code, m.json().get("state"))
        assert m.status_code == 200, m.text
PY

"$PY" -m toolkv.tools.cli fuzz-http "$URL" --session fuzz-1 --session fuzz-2 --session fuzz-3 --json "$@" \
  > "$OUT/schemathesis_live.json"
RC=$?
cat "$OUT/schemathesis_live.json"
exit $RC
