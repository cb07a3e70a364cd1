"""Saves to a store that writes one object per request on a pool come in batches of the size it asks for."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from kvdi.connectors.store.writes import MAX_SAVE_BATCH_BLOCKS, save_batch_blocks
from kvdi.settings import load_settings
from tests.connectors.test_async_transfers import step
from tests.helpers.store import DictStore, Engine, small_layout

pytest.importorskip("torch")


class BatchedStore(DictStore):
    """A dict store that asks for ``save_batch_blocks`` and records the size of every put_many."""

    def __init__(self, batch: object) -> None:
        super().__init__()
        self.save_batch_blocks = batch
        self.calls: list[int] = []

    def put_many(self, items: Sequence[tuple[bytes, Sequence[bytes | bytearray | memoryview]]]) -> int:
        self.calls.append(len(items))
        return super().put_many(items)


@pytest.mark.parametrize(("batch", "calls"), [(3, [3, 1]), (0, [1, 1, 1, 1]), (True, [1, 1, 1, 1])])
def test_saves_from_a_cpu_cache_go_in_the_store_s_batches(batch: object, calls: list[int]) -> None:
    store = BatchedStore(batch)
    settings = load_settings(kv_role="kv_both", engine_id="e", transfer={"async_save": False, "async_load": "off"})
    engine = Engine(store, small_layout(block_size=4, num_layers=64), settings, seed=1)
    engine.worker._chunk = 1  # as if each block were CHUNK_BYTES: one block per call without a batch
    step(engine)
    assert store.calls == calls and len(store.objects) == 4


def test_the_batch_is_bounded() -> None:
    assert save_batch_blocks(BatchedStore(10**9)) == MAX_SAVE_BATCH_BLOCKS
    assert save_batch_blocks(BatchedStore("64")) == 0


def test_an_s3_store_asks_for_four_blocks_per_worker() -> None:
    pytest.importorskip("boto3")
    from kvdi.connectors.s3 import S3BlockStore, S3Settings

    store = S3BlockStore(S3Settings(bucket="kvdi-batch", endpoint_url="http://127.0.0.1:9", workers=5))
    try:
        assert save_batch_blocks(store) == 20
    finally:
        store.close()
