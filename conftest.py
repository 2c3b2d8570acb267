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


def _extensions_dir() -> str:
    """A torch-extension build directory of the installed sglang's own. sglang 0.5.16 and 0.5.23
    both JIT-build an extension named ``hicache_hash_cpp`` (the page hashes of the storage tier,
    ``mem_cache/cpp_utils/native_hash.py``) from their own source, into torch's one default
    directory: the two test environments, which ``make test`` runs side by side, would rebuild
    each other's build (about 20 s each time) or load the other release's library."""
    from importlib.metadata import version

    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "torch_extensions", f"sglang-{version('sglang')}")


def pytest_configure(config: pytest.Config) -> None:
    # an xdist worker: its own gloo port (two workers must not derive the same one from their pids)
    if os.environ.get("PYTEST_XDIST_WORKER") and "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = _free_port()
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", _extensions_dir())


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


#: Tests ``make test`` leaves to ``make test-long`` from here (marked ``slow`` at collection, so their
#: modules stay as their owners wrote them), each with what still covers its property in
#: ``make test`` (``model_tests/test_make_test_cover.py`` checks the covers; docs/testing.md). The
#: conformance replays left to ``make test-long`` are ``LONG_CASES`` in ``model_tests/test_conformance.py``.
LONG: dict[str, str] = {
    # the kill table's slowest search (91 examples, about half the kill table's time): that the
    # checks catch the defect is TLC's counterexample replayed on the same broken implementation
    "fuzz/test_stateful.py::test_every_mutant_is_killed[DoubleLoad]": "model_tests/test_conformance.py::"
    "test_mutant_trace_reproduces_on_the_broken_implementation_only[DoubleLoad]",
}


@pytest.hookimpl(tryfirst=True)  # before -m "not slow" deselects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.nodeid in LONG:
            item.add_marker(pytest.mark.slow)
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
