"""The twin's Mooncake store (``L3Pages(mooncake=True)``) evicts from an LRU heap that parks pinned
pages. Against the plain definition (walk every page least recently used first, skip the pinned,
take the first 5 % of the capacity), on random puts, pins, unpins, touches and clock moves: the
same pages stay, the same ones are evicted, the same puts are refused."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from toolkv.twin.storage import EVICTION_RATIO, L3Pages


@dataclass
class Plain:
    """The definition, as the store was written before the heap: ``order`` is the LRU order."""

    capacity: int
    now: float = 0.0
    order: dict[str, None] = field(default_factory=dict)
    pins: dict[str, float] = field(default_factory=dict)
    refused: int = 0
    evicted: int = 0

    def touch(self, k: str) -> None:
        if k in self.order:
            del self.order[k]
            self.order[k] = None

    def put(self, k: str, pin_until: float | None) -> bool:
        if k not in self.order:
            if len(self.order) >= self.capacity:
                want = max(1, int(EVICTION_RATIO * self.capacity))
                gone = [x for x in self.order if self.pins.get(x, -1.0) <= self.now][:want]
                for x in gone:
                    del self.order[x]
                    self.pins.pop(x, None)
                self.evicted += len(gone)
            if len(self.order) >= self.capacity:
                self.refused += 1
                return False
            self.order[k] = None
        else:
            self.touch(k)
        if pin_until is not None:
            self.pins[k] = max(self.pins.get(k, -1.0), pin_until)
        return True

    def unpin(self, k: str) -> bool:
        return self.pins.pop(k, None) is not None


KEYS = st.sampled_from([f"p{i}" for i in range(16)])
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("put"), KEYS, st.none() | st.floats(0, 8)),
        st.tuples(st.just("touch"), KEYS, st.none()),
        st.tuples(st.just("unpin"), KEYS, st.none()),
        st.tuples(st.just("clock"), st.just(""), st.floats(0, 5)),
    ),
    max_size=400,
)


# a pinned page the eviction passed over comes back once its deadline passes, and once it is unpinned
@example(ops=[("put", "a", 5.0), ("put", "b", None), ("put", "c", None), ("clock", "", 10.0), ("put", "d", None)],
         capacity=2)  # fmt: skip
@example(ops=[("put", "a", 99.0), ("put", "b", None), ("put", "c", None), ("unpin", "a", None), ("put", "d", None)],
         capacity=2)  # fmt: skip
@settings(max_examples=300, deadline=None)
@given(ops=OPS, capacity=st.integers(1, 12))
def test_the_heap_evicts_what_the_lru_walk_would(
    ops: list[tuple[str, str, float | None]], capacity: int
) -> None:
    store, ref = L3Pages(capacity_pages=capacity, mooncake=True), Plain(capacity)
    page = torch.zeros(1)
    for op, k, x in ops:
        if op == "put":
            assert store.put(k, page, pin_until=x) == ref.put(k, x)
        elif op == "touch":
            store.touch(k)
            ref.touch(k)
        elif op == "unpin":
            assert store.unpin(k) == ref.unpin(k)
        else:
            assert x is not None
            store.now = ref.now = store.now + x
        assert set(store.pages) == set(ref.order)
        assert (store.evicted, store.refused) == (ref.evicted, ref.refused)
