"""The one name sglang's vision attention imports from ``flashinfer.prefill``; it raises if called."""

from flashinfer import _no_kernel

cudnn_batch_prefill_with_kv_cache = _no_kernel
