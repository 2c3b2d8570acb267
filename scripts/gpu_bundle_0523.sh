#!/usr/bin/env bash
# Build the offline bundle that stages sglang 0.5.23 on the GPU machine (no internet there; CPython 3.12,
# torch 2.11.0+cu130). Runs here, where PyPI is reachable.
#
#   usage: bash scripts/gpu_bundle_0523.sh [OUTDIR]        (default OUTDIR: .gpu-bundle-0523, git-ignored)
#
# OUTDIR receives bundle.tar.xz (+ .sha256), install.sh and env.sh: OUTDIR alone is what a device call
# carries (the carry limit is 64 MiB). Wheels are pinned with sha256 in scripts/gpu_bundle_0523.requirements.txt
# and cached in $WHEEL_CACHE (default: a folder under $TMPDIR), outside OUTDIR.
# What is cut, and why it is safe on this launch (see docs/sglang_versions.md, "GPU staging"):
#   sglang-kernel: only the python files, sm90/common_ops.abi3.so and spatial_ops.abi3.so are kept (the
#     other .so files, flash_ops at 1.1 GB first, are loaded lazily and never on an H200 with our flags);
#   sglang: the Rust extensions _server, _bench, _grpc and _multimodal (loaded lazily by the Rust server,
#     gRPC and two multimodal processors; never by python -m sglang.launch_server for a text model);
#   xgrammar: its static library and C++ headers (python never loads them).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
REQ=$ROOT/scripts/gpu_bundle_0523.requirements.txt
OUT=${1:-$ROOT/.gpu-bundle-0523}
CACHE=${WHEEL_CACHE:-${TMPDIR:-/tmp}/toolkv-0523-wheels}
START=$SECONDS
mkdir -p "$OUT" "$CACHE"
OUT=$(cd "$OUT" && pwd)
STAGE=$(mktemp -d "${TMPDIR:-/tmp}/toolkv-0523-bundle.XXXXXX")
trap 'rm -rf "$STAGE"' EXIT

# 1. The pinned wheels for the remote interpreter: CPython 3.12, x86_64, glibc 2.39 (every manylinux tag up to 2_39).
PLATFORMS=()
for v in $(seq 39 -1 5); do PLATFORMS+=(--platform "manylinux_2_${v}_x86_64"); done
PLATFORMS+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
echo "[1/4] pip download -> $CACHE"
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${PLATFORMS[@]}" -d "$CACHE" -r "$REQ" --disable-pip-version-check --quiet

# 2. Repack: every wheel re-zipped uncompressed (same files, same bytes) so that xz compresses across them,
#    minus the members named above; the sglang-kernel subset as a plain tree.
echo "[2/4] repack wheels, extract the sgl_kernel subset"
python3 - "$REQ" "$CACHE" "$STAGE" <<'PY'
import hashlib, os, re, shutil, sys, zipfile

req, cache, stage = sys.argv[1:]
KEEP_SO = {"sgl_kernel/sm90/common_ops.abi3.so", "sgl_kernel/spatial_ops.abi3.so"}
DROP = {
    "xgrammar": ("xgrammar/lib/", "xgrammar/include/"),
    "sglang": tuple(f"sglang/srt/rust_extensions/{m}.cpython-312-x86_64-linux-gnu.so"
                    for m in ("_server", "_bench", "_grpc", "_multimodal")),
}


def find_wheel(name, version, sha256):
    prefix = re.sub(r"[-_.]+", "_", name).lower() + f"-{version}-"
    for f in sorted(os.listdir(cache)):
        if f.lower().startswith(prefix) and f.endswith(".whl"):
            path = os.path.join(cache, f)
            with open(path, "rb") as fh:
                if hashlib.file_digest(fh, "sha256").hexdigest() == sha256:
                    return path
    sys.exit(f"no wheel in {cache} for {name}=={version} with the pinned sha256")


os.makedirs(f"{stage}/wheels")
for line in open(req):
    line = line.split("#", 1)[0].strip()
    if not line:
        continue
    name, version, sha = re.fullmatch(r"(\S+)==(\S+)\s+--hash=sha256:([0-9a-f]{64})", line).groups()
    src = zipfile.ZipFile(find_wheel(name, version, sha))
    if name == "sglang-kernel":
        kept = 0
        for info in src.infolist():
            if info.is_dir() or (info.filename.endswith(".so") and info.filename not in KEEP_SO):
                continue
            dst = f"{stage}/sgl_kernel_subset/{info.filename}"
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            with src.open(info) as fin, open(dst, "wb") as fout:
                shutil.copyfileobj(fin, fout, 1 << 20)
            kept += info.file_size
        print(f"  sglang-kernel {version}: kept {kept / 2**20:.1f} MiB")
        continue
    drop = DROP.get(name, ())
    dropped = 0
    with zipfile.ZipFile(f"{stage}/wheels/{os.path.basename(src.filename)}", "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            if info.filename.startswith(drop):
                dropped += info.file_size
                continue
            data = src.read(info)
            if drop and info.filename.endswith(".dist-info/RECORD"):  # forget the dropped files
                data = b"".join(l for l in data.splitlines(True) if not l.startswith(tuple(d.encode() for d in drop)))
            out = zipfile.ZipInfo(info.filename, date_time=info.date_time)
            out.external_attr, out.create_system = info.external_attr, info.create_system
            dst.writestr(out, data)
    if dropped:
        print(f"  {name} {version}: dropped {dropped / 2**20:.1f} MiB")
print(f"  {len(os.listdir(f'{stage}/wheels'))} wheels in wheels/")
PY

# The dummy-weight model: Llama-3.2-1B's public shape, for --load-format dummy.
mkdir -p "$STAGE/model_configs/llama-3.2-1b"
cat > "$STAGE/model_configs/llama-3.2-1b/config.json" <<'JSON'
{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192,
 "num_attention_heads": 32, "num_key_value_heads": 8, "num_hidden_layers": 16, "head_dim": 64, "vocab_size": 128256,
 "max_position_embeddings": 131072, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
 "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                  "original_max_position_embeddings": 8192, "rope_type": "llama3"},
 "tie_word_embeddings": true, "torch_dtype": "bfloat16", "bos_token_id": 128000, "eos_token_id": 128001,
 "hidden_act": "silu", "attention_bias": false, "mlp_bias": false, "initializer_range": 0.02, "use_cache": true}
JSON

# 3. One deterministic xz stream, plus the two scripts that use it on the GPU machine.
echo "[3/4] tar | xz -9e"
tar --sort=name --owner=0 --group=0 --numeric-owner --mtime='2026-01-01 00:00:00Z' \
    -C "$STAGE" -cf - wheels sgl_kernel_subset model_configs | xz -9e -T"${XZ_THREADS:-0}" > "$OUT/bundle.tar.xz.part"
mv "$OUT/bundle.tar.xz.part" "$OUT/bundle.tar.xz"
(cd "$OUT" && sha256sum bundle.tar.xz > bundle.tar.xz.sha256)

cat > "$OUT/install.sh" <<'SH'
#!/usr/bin/env bash
# Install the offline sglang 0.5.23 bundle (no network): $STAGE_ROOT/site (pip --no-index --no-deps --target)
# and $STAGE_ROOT/models. Starts from scratch each run. PY: CPython 3.12 with torch 2.11 and pip.
set -euo pipefail
B=$(cd "${1:?usage: install.sh BUNDLE_DIR}" && pwd)
PY=${PY:-/opt/torch/.venv/bin/python3}
P=${STAGE_ROOT:-/tmp}
STAGE=$P/stage-0523 SITE=$P/site-0523 MODELS=$P/models-0523
(cd "$B" && sha256sum --quiet -c bundle.tar.xz.sha256)
rm -rf "$STAGE" "$SITE" "$MODELS" && mkdir -p "$STAGE" "$SITE"
tar -C "$STAGE" -xJf "$B/bundle.tar.xz" 2>/dev/null ||
  "$PY" -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter="data")' "$B/bundle.tar.xz" "$STAGE"
"$PY" -m pip install --no-index --no-deps --no-compile --disable-pip-version-check -q --target "$SITE" "$STAGE"/wheels/*.whl
cp -r "$STAGE"/sgl_kernel_subset/. "$SITE"/
cp -r "$STAGE"/model_configs "$MODELS"
rm -rf "$STAGE"
echo "installed sglang 0.5.23 into $SITE ($(du -sh "$SITE" | cut -f1)); model configs in $MODELS"
SH
cat > "$OUT/env.sh" <<'SH'
# Source after install.sh: the staged sglang 0.5.23 first on the path, offline, and the settings its
# launch needs on this machine (see docs/sglang_versions.md, "GPU staging").
export STAGE_ROOT=${STAGE_ROOT:-/tmp}
export PY=${PY:-/opt/torch/.venv/bin/python3}
export PYTHONPATH=$STAGE_ROOT/site-0523
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
export SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK=1   # sglang-kernel 0.4.5: 0.4.9+ cannot load on torch 2.11
export SGLANG_IS_FLASHINFER_AVAILABLE=false     # no flashinfer in the bundle: triton attention, pytorch sampling
export SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=python   # toolkv refuses to start without it
SH

# 4. Report; the carried folder must fit the 64 MiB limit.
BYTES=$(stat -c %s "$OUT/bundle.tar.xz")
TOTAL=$(du -sb "$OUT" | cut -f1)
echo "[4/4] $OUT/bundle.tar.xz: $BYTES bytes ($(python3 -c "print(f'{$BYTES / 2**20:.1f}')") MiB)," \
     "folder $(python3 -c "print(f'{$TOTAL / 2**20:.1f}')") MiB, built in $((SECONDS - START)) s"
if (( TOTAL > 64 * 1048576 )); then echo "ERROR: $OUT exceeds the 64 MiB carry limit" >&2; exit 1; fi
