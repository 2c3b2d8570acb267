"""Fixtures shared by the tests in tests/ (the repository-wide configuration, Hypothesis profiles
and GPU skips, is the top-level conftest.py).

``replayer``: the real cache stack driven by spec actions (the conformance ``Replayer``), over the
test module's ``BOUNDS``, on the backend named by an indirect parameter (``hiradix`` without one);
closed afterwards. Helpers that go with it (``step``, ``kv_intact``, ``leak_free``, ``spec_bounds``)
are in ``_spec_steps.py``.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from _spec_steps import make_replayer

from toolkv.verify.toolkv.world import Replayer


@pytest.fixture
def replayer(request: pytest.FixtureRequest) -> Iterator[Replayer]:
    r = make_replayer(request.module.BOUNDS, backend=getattr(request, "param", "hiradix"))
    try:
        yield r
    finally:
        r.close()
