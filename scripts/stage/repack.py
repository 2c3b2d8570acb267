"""Repack pinned wheels for one compressed staging bundle (used by scripts/gpu_bundle.sh).

    python repack.py CACHE STAGE NAME=REQUIREMENTS [NAME=REQUIREMENTS ...]

For every requirements file (lines ``name==version --hash=sha256:...``) the wheel with that hash is
taken from CACHE (the hash is re-checked here). Each wheel is re-zipped *uncompressed* (same files,
same bytes) into STAGE/wheels/, once even when several releases pin the same file, so that xz
compresses across wheels and two sglang releases cost little more than one. What is cut, and why
that is safe on our launch flags:

* sglang-kernel: only its Python files and the two shared objects an H200 loads
  (``sm90/common_ops``, ``spatial_ops``) go in, as a plain tree in STAGE/sgl_kernel_subset/; the other
  kernels (``flash_ops`` first, 1.1 GB) are loaded lazily and never with triton attention;
* xgrammar: its static library and C++ headers (Python loads only its extension module);
* sglang >= 0.5.21: the Rust extensions of the Rust server, bench, gRPC and multimodal processors,
  loaded lazily and never by ``python -m sglang.launch_server`` for a text model;
* sglang-router (only in a set that pins it, ``ROUTER=1`` in gpu_bundle.sh): unpacked as a plain
  tree in STAGE/sglang_router_tree/ with its one Rust extension stripped of its symbol tables
  (``strip --strip-unneeded`` keeps the dynamic symbols Python imports through; 88 -> 68 MiB, 16 MiB
  once compressed). A tree rather than a re-zipped wheel because the stripped file no longer
  matches the wheel's RECORD; ``python -m sglang_router.launch_router`` needs only the package on
  ``sys.path``. Its Requires-Dist (setproctitle, aiohttp, orjson, uvicorn, fastapi) are in the
  0.5.16 set or on the GPU machine's image (aiohttp).

STAGE/NAME.txt lists the wheel files of each release, for install.sh (written only for a set that
has wheels: a set of the router alone has none).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import zipfile

KERNEL = "sglang-kernel"
ROUTER = "sglang-router"
ROUTER_TREE = "sglang_router_tree"
KEEP_SO = {"sgl_kernel/sm90/common_ops.abi3.so", "sgl_kernel/spatial_ops.abi3.so"}
DROP = {
    "xgrammar": ("xgrammar/lib/", "xgrammar/include/"),
    "sglang": tuple(
        f"sglang/srt/rust_extensions/{m}.cpython-312-x86_64-linux-gnu.so"
        for m in ("_server", "_bench", "_grpc", "_multimodal")
    ),
}
PIN = re.compile(r"(\S+)==(\S+)\s+--hash=sha256:([0-9a-f]{64})")


def pins(path: str) -> list[tuple[str, str, str]]:
    out = []
    with open(path) as fh:
        lines = fh.read().splitlines()
    for line in lines:
        line = line.split("#", 1)[0].strip()
        if line:
            m = PIN.fullmatch(line)
            if m is None:
                sys.exit(f"{path}: not a pinned line: {line!r}")
            out.append((m[1], m[2], m[3]))
    return out


def find_wheel(cache: str, name: str, version: str, sha256: str) -> str:
    prefix = re.sub(r"[-_.]+", "_", name).lower() + f"-{version}-"
    for f in sorted(os.listdir(cache)):
        if f.lower().startswith(prefix) and f.endswith(".whl"):
            path = os.path.join(cache, f)
            with open(path, "rb") as fh:
                if hashlib.file_digest(fh, "sha256").hexdigest() == sha256:
                    return path
    sys.exit(f"no wheel in {cache} for {name}=={version} with the pinned sha256")


def kernel_subset(src: zipfile.ZipFile, stage: str) -> int:
    kept = 0
    for info in src.infolist():
        if info.is_dir() or (info.filename.endswith(".so") and info.filename not in KEEP_SO):
            continue
        dst = f"{stage}/sgl_kernel_subset/{info.filename}"
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        with src.open(info) as fin, open(dst, "wb") as fout:
            shutil.copyfileobj(fin, fout, 1 << 20)
        kept += info.file_size
    return kept


def router_tree(src: zipfile.ZipFile, stage: str) -> tuple[int, int]:
    """Unpack the router wheel into STAGE/ROUTER_TREE, stripping its shared objects. Returns the
    bytes of the tree before and after stripping. Fails without ``strip``: unstripped, the router
    alone takes a third of the 64 MiB a GPU call can carry."""
    strip = shutil.which("strip")
    if strip is None:
        sys.exit("repack: `strip` (binutils) is needed to fit sglang-router into the bundle")
    before = after = 0
    for info in src.infolist():
        if info.is_dir():
            continue
        dst = f"{stage}/{ROUTER_TREE}/{info.filename}"
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        with src.open(info) as fin, open(dst, "wb") as fout:
            shutil.copyfileobj(fin, fout, 1 << 20)
        os.chmod(dst, 0o755 if info.filename.endswith(".so") else 0o644)
        before += info.file_size
        if info.filename.endswith(".so"):
            subprocess.run([strip, "--strip-unneeded", dst], check=True)
        after += os.path.getsize(dst)
    return before, after


def restore_stored(src: zipfile.ZipFile, dst_path: str, drop: tuple[str, ...]) -> int:
    dropped = 0
    with zipfile.ZipFile(dst_path, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            if drop and info.filename.startswith(drop):
                dropped += info.file_size
                continue
            data = src.read(info)
            if drop and info.filename.endswith(".dist-info/RECORD"):  # forget the dropped files
                gone = tuple(d.encode() for d in drop)
                data = b"".join(line for line in data.splitlines(True) if not line.startswith(gone))
            out = zipfile.ZipInfo(info.filename, date_time=info.date_time)
            out.external_attr, out.create_system = info.external_attr, info.create_system
            dst.writestr(out, data)
    return dropped


def main() -> None:
    cache, stage, *sets = sys.argv[1:]
    os.makedirs(f"{stage}/wheels", exist_ok=True)
    done: set[str] = set()
    for spec in sets:
        release, req = spec.split("=", 1)
        files = []
        for name, version, sha in pins(req):
            path = find_wheel(cache, name, version, sha)
            base = os.path.basename(path)
            if name == KERNEL:
                if "kernel" not in done:
                    print(
                        f"  {name} {version}: kept {kernel_subset(zipfile.ZipFile(path), stage) / 2**20:.1f} MiB"
                    )
                    done.add("kernel")
                continue
            if name == ROUTER:
                if "router" not in done:
                    before, after = router_tree(zipfile.ZipFile(path), stage)
                    print(f"  {name} {version}: {before / 2**20:.1f} MiB unpacked, {after / 2**20:.1f} MiB stripped")
                    done.add("router")
                continue
            files.append(base)
            if base in done:
                continue
            done.add(base)
            dropped = restore_stored(zipfile.ZipFile(path), f"{stage}/wheels/{base}", DROP.get(name, ()))
            if dropped:
                print(f"  {name} {version}: dropped {dropped / 2**20:.1f} MiB")
        if files:
            with open(f"{stage}/{release}.txt", "w") as fh:
                fh.write("\n".join(files) + "\n")
            print(f"  {release}: {len(files)} wheels")
    print(f"  {len(os.listdir(f'{stage}/wheels'))} distinct wheels in wheels/")


if __name__ == "__main__":
    main()
