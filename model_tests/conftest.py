"""Shared, session-scoped TLC products for the model tests: each conformance graph is dumped and
read once per test session (TLC and the reader cost seconds per graph; several tests walk them)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from toolkv.verify.tla.tlc import StateGraph, TlaToolError, Toolchain
from toolkv.verify.toolkv.conformance import GraphConfig, dump_graph, load_conformance
from toolkv.verify.toolkv.refinement import Bounds

SPEC = Path(__file__).resolve().parents[1] / "spec"


@pytest.fixture(scope="session")
def tools() -> Iterator[Toolchain]:
    try:
        yield Toolchain.locate()
    except TlaToolError as exc:  # pragma: no cover - environment dependent
        pytest.skip(f"TLA+ toolchain unavailable: {exc}")


class Graphs:
    """Conformance graphs by name, dumped on first use."""

    def __init__(self, tools: Toolchain, work: Path) -> None:
        self.tools, self.work = tools, work
        self.configs, self.pending = load_conformance(SPEC)
        self._cache: dict[str, tuple[StateGraph, Bounds]] = {}

    def config(self, name: str) -> GraphConfig:
        return next(c for c in self.configs if c.name == name)

    def get(self, name: str) -> tuple[StateGraph, Bounds]:
        if name not in self._cache:
            d = self.work / name
            d.mkdir(exist_ok=True)
            self._cache[name] = dump_graph(self.tools, SPEC, self.config(name), d)
        return self._cache[name]


@pytest.fixture(scope="session")
def graphs(tools: Toolchain, tmp_path_factory: pytest.TempPathFactory) -> Graphs:
    return Graphs(tools, tmp_path_factory.mktemp("graphs"))
