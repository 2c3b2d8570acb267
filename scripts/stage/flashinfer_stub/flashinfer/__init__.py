"""A stand-in for flashinfer-python that only imports: it has no kernels (test double, named as such).

The GPU runs launch sglang with ``--attention-backend triton --sampling-backend pytorch`` and
``SGLANG_IS_FLASHINFER_AVAILABLE=false``, so no flashinfer kernel is ever called; but sglang 0.5.16
imports ``flashinfer.sampling`` and ``flashinfer.prefill`` at module level on CUDA, and the real package (with
its JIT toolchain) does not fit the staging size limit next to two sglang releases. Every name here
raises if it is called, so a launch that would use it fails loudly instead of computing garbage.
"""

__version__ = "0.0.0+import-only"


def _no_kernel(*_args: object, **_kwargs: object) -> None:
    raise RuntimeError(
        "flashinfer import-only stand-in: this launch must use --attention-backend triton, "
        "--sampling-backend pytorch and SGLANG_IS_FLASHINFER_AVAILABLE=false"
    )
