#!/usr/bin/env bash
# Build the offline staging bundle for the GPU machine: sglang 0.5.16 AND 0.5.23 with their pinned
# dependencies, dummy-model configs, a chat tokenizer, toolkv's runtime and test dependencies. The GPU
# machine has no internet (CPython 3.12, torch 2.11.0+cu130); this runs where PyPI is reachable.
#
#   usage: bash scripts/gpu_bundle.sh [OUTDIR]        (default OUTDIR: .gpu-bundle, git-ignored)
#          RELEASES=0516 ROUTER=1 bash scripts/gpu_bundle.sh [OUTDIR]   (default OUTDIR: .gpu-bundle-fleet)
#
# OUTDIR is what one GPU call carries (the carry limit is 64 MiB): bundle.tar.xz (+ .sha256), install.sh,
# env.sh. The two releases share one xz stream (identical wheels stored once, the rest compressed across
# each other); what is cut from the wheels and why: scripts/stage/repack.py.
# RELEASES (default 0516,0523) picks the sglang releases; ROUTER=1 adds sglang's router (sglang-router,
# stripped: scripts/gpu_bundle_router.requirements.txt), which does not fit beside both releases, for the
# multi-server run (scripts/gpu_fleet.sh: RELEASES=0516 ROUTER=1, about 49 MiB).
# On the GPU machine:  bash OUTDIR/install.sh OUTDIR && source OUTDIR/env.sh && use_release 0516   (or 0523)
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
RELEASES=${RELEASES:-0516,0523} ROUTER=${ROUTER:-0}
if [ "$ROUTER" = 1 ]; then OUT=${1:-$ROOT/.gpu-bundle-fleet}; else OUT=${1:-$ROOT/.gpu-bundle}; fi
CACHE=${WHEEL_CACHE:-${TMPDIR:-/tmp}/toolkv-gpu-wheels}
PYHERE=${PYHERE:-$ROOT/.venv/bin/python}   # has tokenizers (for the chat tokenizer) and toolkv's deps
START=$SECONDS
mkdir -p "$OUT" "$CACHE"
OUT=$(cd "$OUT" && pwd)
STAGE=$(mktemp -d "${TMPDIR:-/tmp}/toolkv-gpu-bundle.XXXXXX")
trap 'rm -rf "$STAGE"' EXIT
# the requirement sets, as repack.py's NAME=FILE arguments: one per release, and the router's
SETS=() REQS=()
IFS=, read -ra RELS <<< "$RELEASES"
for rel in "${RELS[@]}"; do
  req=$ROOT/scripts/gpu_bundle_$rel.requirements.txt
  [ -f "$req" ] || { echo "no requirements for release $rel ($req)" >&2; exit 2; }
  SETS+=("site-$rel=$req") REQS+=("$req")
done
if [ "$ROUTER" = 1 ]; then
  SETS+=("router=$ROOT/scripts/gpu_bundle_router.requirements.txt") REQS+=("$ROOT/scripts/gpu_bundle_router.requirements.txt")
fi

# 1. Pinned wheels for the remote interpreter: CPython 3.12, x86_64, glibc 2.39.
PLATFORMS=()
for v in $(seq 39 -1 5); do PLATFORMS+=(--platform "manylinux_2_${v}_x86_64"); done
PLATFORMS+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
echo "[1/5] pip download -> $CACHE"
for req in "${REQS[@]}"; do
  python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${PLATFORMS[@]}" -d "$CACHE" -r "$req" --disable-pip-version-check --quiet 2>&1 | grep -v "^WARNING: Location" || true
done
# test dependencies of the CUDA fuzz campaign (pure Python, pinned as in the CPU lock; hypothesis is compiled).
# A ROUTER=1 bundle leaves them out, and the chat tokenizer: the multi-server run needs neither (it sends
# token ids), and the carried working tree, bundle included, must stay under 64 MiB.
if [ "$ROUTER" != 1 ]; then
  mkdir -p "$STAGE/test_wheels"
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${PLATFORMS[@]}" -d "$STAGE/test_wheels" --disable-pip-version-check \
    attrs==26.1.0 sortedcontainers==2.4.0 pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1 hypothesis==6.170.17 \
    2>&1 | grep -v "^WARNING: Location" || true
fi

# 2. Repack both releases' wheels into one stage.
echo "[2/5] repack wheels, extract the sgl_kernel subset$(if [ "$ROUTER" = 1 ]; then echo ", strip the router"; fi)"
python3 "$ROOT/scripts/stage/repack.py" "$CACHE" "$STAGE" "${SETS[@]}"

# 3. Model configs, the flashinfer stand-in, the chat tokenizer, toolkv's runtime deps.
echo "[3/5] model configs, tokenizer, toolkv deps"
cp -r "$ROOT/scripts/stage/model_configs" "$STAGE/"
if [ "$ROUTER" != 1 ]; then "$PYHERE" "$ROOT/scripts/stage/make_tokenizer.py" "$STAGE/tokenizer"; fi
SP=$("$PYHERE" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
mkdir -p "$STAGE/toolkv_deps"
cp -r "$SP/transitions" "$SP"/transitions-*.dist-info "$SP/prometheus_client" "$SP"/prometheus_client-*.dist-info \
  "$STAGE/toolkv_deps/"
find "$STAGE" -name __pycache__ -prune -exec rm -rf {} +

# 4. One deterministic xz stream (wheels sorted by name: the two sglang wheels sit side by side).
echo "[4/5] tar | xz -9e (a few minutes)"
PARTS=(wheels)
for rel in "${RELS[@]}"; do PARTS+=("site-$rel.txt"); done
PARTS+=(sgl_kernel_subset model_configs toolkv_deps)
if [ "$ROUTER" = 1 ]; then PARTS+=(sglang_router_tree); else PARTS+=(tokenizer test_wheels); fi
tar --sort=name --owner=0 --group=0 --numeric-owner --mtime='2026-01-01 00:00:00Z' -C "$STAGE" -cf - "${PARTS[@]}" \
  | xz -9e -T"${XZ_THREADS:-0}" > "$OUT/bundle.tar.xz.part"
mv "$OUT/bundle.tar.xz.part" "$OUT/bundle.tar.xz"
(cd "$OUT" && sha256sum bundle.tar.xz > bundle.tar.xz.sha256)
rm -rf "$OUT/toolkv_deps" "$OUT/flashinfer_stub"  # an older layout kept toolkv_deps beside the archive
# a few plain Python files, beside the archive so that they can change without rebuilding it
cp -r "$ROOT/scripts/stage/flashinfer_stub" "$OUT/"
find "$OUT/flashinfer_stub" -name __pycache__ -prune -exec rm -rf {} +

cat > "$OUT/install.sh" <<'SH'
#!/usr/bin/env bash
# Install the offline bundle (no network), from scratch, under $STAGE_ROOT (default /tmp):
#   site-0516/ site-0523/  sglang 0.5.16 / 0.5.23, those the bundle holds (pip --no-index --no-deps --target),
#                          the sgl_kernel subset in each, and sglang_router in each when the bundle has it
#   fi_stub/ models/ tokenizer/ toolkv_deps/ toolkv_test_deps/
# PY: CPython 3.12 with torch 2.11 and pip (default: the GPU machine's torch venv).
set -euo pipefail
B=$(cd "${1:?usage: install.sh BUNDLE_DIR}" && pwd)
PY=${PY:-/opt/torch/.venv/bin/python3}
P=${STAGE_ROOT:-/tmp}
T0=$SECONDS
(cd "$B" && sha256sum --quiet -c bundle.tar.xz.sha256)
rm -rf "$P/stage" && mkdir -p "$P/stage"
tar -C "$P/stage" -xJf "$B/bundle.tar.xz" 2>/dev/null ||
  "$PY" -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter="data")' "$B/bundle.tar.xz" "$P/stage"
PIP=("$PY" -m pip install --no-index --no-deps --no-compile --disable-pip-version-check -q)
SITES=()
for list in "$P"/stage/site-*.txt; do
  site=$(basename "$list" .txt) && SITES+=("${site#site-}")
  rm -rf "${P:?}/$site" && mkdir -p "$P/$site"
  mapfile -t WHEELS < <(sed "s|^|$P/stage/wheels/|" "$list")
  "${PIP[@]}" --target "$P/$site" "${WHEELS[@]}"
  cp -r "$P/stage/sgl_kernel_subset/." "$P/$site/"
  # sglang's router (ROUTER=1 bundles): a plain tree, its extension stripped (scripts/stage/repack.py)
  if [ -d "$P/stage/sglang_router_tree" ]; then cp -r "$P/stage/sglang_router_tree/." "$P/$site/"; fi
done
ROUTER_NOTE=
if [ -d "$P/stage/sglang_router_tree" ]; then ROUTER_NOTE=" with sglang-router"; fi
rm -rf "$P/toolkv_test_deps"  # a ROUTER=1 bundle has no test wheels and no chat tokenizer
if [ -d "$P/stage/test_wheels" ]; then "${PIP[@]}" --target "$P/toolkv_test_deps" "$P"/stage/test_wheels/*.whl; fi
for d in models:model_configs tokenizer:tokenizer toolkv_deps:toolkv_deps; do
  rm -rf "${P:?}/${d%%:*}"
  if [ -d "$P/stage/${d#*:}" ]; then cp -r "$P/stage/${d#*:}" "$P/${d%%:*}"; fi
done
rm -rf "$P/fi_stub" && cp -r "$B/flashinfer_stub" "$P/fi_stub"
rm -rf "$P/stage"
echo "installed sglang ${SITES[*]}$ROUTER_NOTE under $P in $((SECONDS - T0)) s; models: $(cd "$P/models" && echo */)"
SH
cat > "$OUT/env.sh" <<'SH'
# Source after install.sh, then pick a release:  use_release 0516 | use_release 0523
# Both launch with triton attention and pytorch sampling, so flashinfer is never called: 0.5.16 imports
# it at module level (the import-only stand-in answers), 0.5.23 is told it is absent.
export STAGE_ROOT=${STAGE_ROOT:-/tmp}
export PY=${PY:-/opt/torch/.venv/bin/python3}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
export SGLANG_IS_FLASHINFER_AVAILABLE=false
export STAGED_DEPS=$STAGE_ROOT/toolkv_deps STAGED_TEST_DEPS=$STAGE_ROOT/toolkv_test_deps
export CHAT_TOKENIZER=$STAGE_ROOT/tokenizer MODELS=$STAGE_ROOT/models
use_release() {
  [ -d "$STAGE_ROOT/site-${1:-}" ] || { echo "use_release: sglang ${1:-?} is not installed under $STAGE_ROOT" >&2; return 2; }
  case $1 in
    0516) export PYTHONPATH=$STAGE_ROOT/fi_stub:$STAGE_ROOT/site-0516 SGLANG_RELEASE=0.5.16
          unset SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND ;;
    # sglang-kernel 0.4.5 (0.4.9+ needs torch >= 2.12); toolkv needs the Python tree core
    0523) export PYTHONPATH=$STAGE_ROOT/site-0523 SGLANG_RELEASE=0.5.23 SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK=1 \
                 SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=python ;;
    *) echo "use_release 0516|0523" >&2; return 2 ;;
  esac
}
# compatibility with the scripts written for the 0.5.16-only bundle
use_flashinfer_stub() { use_release 0516; }
# the first release the bundle holds (0516 unless it was built without it)
if [ -d "$STAGE_ROOT/site-0516" ]; then use_release 0516; else use_release 0523; fi
SH

# 5. Report; the carried folder must fit the 64 MiB limit.
BYTES=$(stat -c %s "$OUT/bundle.tar.xz")
TOTAL=$(du -sb "$OUT" | cut -f1)
echo "[5/5] bundle.tar.xz: $BYTES bytes ($(python3 -c "print(f'{$BYTES / 2**20:.1f}')") MiB)," \
     "folder $(python3 -c "print(f'{$TOTAL / 2**20:.1f}')") MiB, built in $((SECONDS - START)) s"
if (( TOTAL > 64 * 1048576 )); then echo "ERROR: $OUT exceeds the 64 MiB carry limit" >&2; exit 1; fi
# what travels with it: the working tree (tracked and untracked files that git does not ignore)
TREE=$(cd "$ROOT" && git ls-files -z --cached --others --exclude-standard | xargs -0 du -cb 2>/dev/null | awk 'END {print $1}')
echo "      with the working tree ($(python3 -c "print(f'{${TREE:-0} / 2**20:.1f}')") MiB): $(python3 -c "print(f'{(${TREE:-0} + $TOTAL) / 2**20:.1f}')") MiB of 64"
if (( ${TREE:-0} + TOTAL > 64 * 1048576 )); then echo "WARNING: the working tree and $OUT together exceed 64 MiB" >&2; fi
