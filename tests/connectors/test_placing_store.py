"""``place_many``: a declared capability (a store that places verified blocks itself), used by the worker's reads."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvdi.connectors.store import PlacingStore, StoreCapabilities
from kvdi.connectors.store.framing import HEADER_SIZE
from tests.helpers.store import DictStore, Engine, make_settings, request, small_layout

LAYOUT = small_layout(block_size=4)
PROMPT = request(range(18))


class PlacingDictStore(DictStore):
    """A test double: places each stored frame's payload into the pieces itself; ``refuse`` keys are misses."""

    def __init__(self) -> None:
        super().__init__()
        self.placed: list[int] = []
        self.refuse: set[bytes] = set()

    def place_many(self, items: Sequence[tuple[bytes, Sequence[memoryview]]]) -> list[int | None]:
        out: list[int | None] = []
        for key, pieces in items:
            frame = self.objects.get(key)
            if frame is None or key in self.refuse:
                out.append(None)
                continue
            payload, at = memoryview(frame)[HEADER_SIZE:], 0
            for piece in pieces:
                piece[:] = payload[at : at + piece.nbytes]
                at += piece.nbytes
            out.append(at)
        self.placed.append(len(items))
        return out


def test_place_many_is_a_declared_capability() -> None:
    assert isinstance(PlacingDictStore(), PlacingStore)
    assert StoreCapabilities.of(PlacingDictStore()).place is not None
    assert StoreCapabilities.of(DictStore()).place is None


def test_the_worker_loads_through_place_many_and_a_refused_block_is_a_miss() -> None:
    """The second engine's blocks come from place_many (the double's frames are never handed out whole); the block
    it refuses is reported failed and the ones after it are not offered as loaded bytes of the first engine."""
    store = PlacingDictStore()
    first = Engine(store, LAYOUT, make_settings(), seed=1)
    first.prefill(PROMPT, (1, 2, 3, 4, 5))
    store.get_many = None  # type: ignore[assignment,method-assign]  # any frame read would raise

    second = Engine(store, LAYOUT, make_settings())
    assert second.prefill(PROMPT, (6, 7, 8, 9, 10)) == (16, set())
    assert store.placed and sum(store.placed) == 4
    for saved, loaded in zip((1, 2, 3, 4), (6, 7, 8, 9), strict=True):
        assert all(torch.equal(a, b) for a, b in zip(first.block(saved), second.block(loaded), strict=True))

    keys = sorted(store.objects)
    store.refuse = set(keys)
    third = Engine(store, LAYOUT, make_settings())
    loaded, failed = third.prefill(PROMPT, (11, 12, 13, 14, 15))
    assert loaded == 16 and failed == {11, 12, 13, 14}
