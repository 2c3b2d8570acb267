"""Repository-wide pytest configuration.

* Hypothesis profiles are registered once here (``toolkv.verify.profiles``); ``HYPOTHESIS_PROFILE``
  picks one (``make test`` uses ``ci``; a local run defaults to ``dev``, with the example database).
* GPU tests skip cleanly where there is no CUDA.
* Parallel runs: ``make test`` runs ``pytest -n 2 --dist loadfile`` (pytest-xdist). Each test module
  runs whole on one worker, so module-scoped fixtures run once and module state stays whole (the
  action-coverage test of ``model_tests/test_conformance.py`` reads the replays before it). Not
  ``--dist loadgroup``: xdist 3.8 groups by rewriting ``item._nodeid``, which pytest 9.2 no longer
  reads, so its groups are silently ignored. Each worker gets a free port of its own for its
  single-process gloo group (``MASTER_PORT``; the harnesses only set a default). The longest
  modules go first (``LONGEST_FIRST``, with ``--no-loadscope-reorder``).
"""

from __future__ import annotations

import os
import socket

import pytest

from toolkv.verify import profiles

profiles.load()


def _free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def pytest_configure(config: pytest.Config) -> None:
    # an xdist worker: its own gloo port (two workers must not derive the same one from their pids)
    if os.environ.get("PYTEST_XDIST_WORKER") and "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = _free_port()


#: Modules that take longest under ``make test`` (its ``--durations`` and stage times, docs/testing.md),
#: longest first. ``make test`` runs them first, one per worker, and the rest after them, most
#: tests first (what xdist's own ``--loadscope-reorder`` does; ``make test`` turns that off so this
#: order holds): a long module that starts last holds one worker while the other has finished.
LONGEST_FIRST = ("model_tests/test_conformance.py", "fuzz/test_stateful.py")


def _longest_first(items: list[pytest.Item]) -> None:
    by_module: dict[str, list[pytest.Item]] = {}
    for item in items:
        by_module.setdefault(item.nodeid.split("::", 1)[0], []).append(item)
    rank = {m: i for i, m in enumerate(LONGEST_FIRST)}
    order = sorted(by_module, key=lambda m: (rank.get(m, len(rank)), -len(by_module[m])))
    items[:] = [item for m in order for item in by_module[m]]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER"):  # every worker collects the same order
        _longest_first(items)
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
