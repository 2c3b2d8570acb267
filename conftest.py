"""Repository-wide pytest configuration.

* Hypothesis profiles are registered once here (``toolkv.verify.profiles``); ``HYPOTHESIS_PROFILE``
  picks one (``make test`` uses ``ci``; a local run defaults to ``dev``, with the example database).
* GPU tests skip cleanly where there is no CUDA.
"""

from __future__ import annotations

import pytest

from toolkv.verify import profiles

profiles.load()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_items = [i for i in items if i.get_closest_marker("gpu")]
    if not gpu_items:
        return
    try:
        import torch

        has_cuda = bool(torch.cuda.is_available())
    except Exception:  # pragma: no cover - torch missing entirely
        has_cuda = False
    if not has_cuda:
        skip = pytest.mark.skip(reason="needs CUDA (run on the GPU machine: scripts/gpu_run.sh)")
        for item in gpu_items:
            item.add_marker(skip)
