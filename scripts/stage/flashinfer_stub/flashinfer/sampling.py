"""The names sglang 0.5.16's sampler and sgl_kernel's sampling import from ``flashinfer.sampling``.

With ``--sampling-backend pytorch`` sglang samples with torch ops and calls none of them; each
raises if called.
"""

from flashinfer import _no_kernel

min_p_sampling_from_probs = _no_kernel
top_k_top_p_sampling_from_probs = _no_kernel
top_k_renorm_probs = _no_kernel
top_p_renorm_probs = _no_kernel
