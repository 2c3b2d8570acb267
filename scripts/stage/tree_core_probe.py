"""Can sglang's bundled Rust tree core run next to the installed torch? One line, and the exit code.

    python scripts/stage/tree_core_probe.py        (with the sglang >= 0.5.21 to check on sys.path)

sglang 0.5.21+ ships its Rust tree core (``sglang/srt/mem_cache/rust_tree_core/mem_cache.*.so``)
compiled against the torch its wheel pins (0.5.23: torch 2.14.1). The extension reads tensors
through torch's C++ headers, so it hard-codes where a tensor keeps its dtype, size and device. With
a torch whose tensor layout differs (torch 2.11 keeps an extra pointer in every tensor), the import
succeeds and every tensor is misread: an insert of an int64 tensor of n elements is refused as
"insert value must be an int64 tensor, got <dtype number n mod 65536>", or panics, or crashes the
process, depending on n (docs/sglang_versions.md, "The tree core").

The probe runs sglang's own adapter, ``RustUnifiedTreeCore``, in a child process (a crash there is
an answer, not the end of the probe): a 3-token insert with an int64 value, a match of it, and the
device indices read back. Exit 0: usable; 1: not usable with this torch (the line says why);
2: no Rust tree core in this sglang.
"""

from __future__ import annotations

import subprocess
import sys

CHILD = r"""
from array import array
import torch
from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.rust_tree_core.adapter import RustUnifiedTreeCore
from sglang.srt.mem_cache.unified_cache.components import ComponentType

core = RustUnifiedTreeCore(CacheInitParams(disable=False, req_to_token_pool=None,
    token_to_kv_pool_allocator=None, page_size=1, tree_components=(ComponentType.FULL,)))
key = RadixKey(array("q", [11, 12, 13]))
step = core.begin_insert(InsertParams(key=key, value=torch.tensor([7, 8, 9], dtype=torch.int64)))
while step.result is None:
    step = core.resume_insert()
core.end_insert()
match = core.match_prefix(MatchPrefixParams(key=key))
back = core.collect_full_device_indices(match.last_device_node, core.root_node_handle())
assert match.device_prefix_len == 3 and back.tolist() == [7, 8, 9], (match.device_prefix_len, back)
print("ok")
"""


def main() -> int:
    try:
        import torch
    except ImportError:
        print("tree core probe: no torch", flush=True)
        return 2
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("sglang")  # a top-level spec: sglang itself is not imported here
    if spec is None or spec.origin is None:
        print(f"tree core probe: no sglang on sys.path (torch {torch.__version__})")
        return 2
    if not (Path(spec.origin).parent / "srt/mem_cache/rust_tree_core/adapter.py").is_file():
        print(f"tree core probe: this sglang has no Rust tree core (torch {torch.__version__})")
        return 2
    child = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=300)
    if child.returncode == 0 and child.stdout.strip().endswith("ok"):
        print(f"tree core probe: the bundled Rust tree core works with torch {torch.__version__}")
        return 0
    lines = [ln for ln in (child.stderr or "").splitlines() if ln.strip()]
    why = next((ln.strip() for ln in reversed(lines) if "Error" in ln or "panicked" in ln), "")
    if child.returncode < 0:
        why = f"the child process died of signal {-child.returncode}" + (f" ({why})" if why else "")
    print(
        f"tree core probe: the bundled Rust tree core is NOT usable with torch {torch.__version__}: "
        f"{why or f'exit {child.returncode}'}; sglang's wheel builds it against the torch it pins, "
        "so run with that torch, or set SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=python"
    )
    return 1


if __name__ == "__main__":
    sys.exit(main())
