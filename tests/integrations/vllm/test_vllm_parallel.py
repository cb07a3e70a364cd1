"""Per-rank slices under tensor/pipeline parallelism (kvdi.integrations.vllm.parallel), without vLLM."""

from __future__ import annotations

from kvdi.connectors.base import BlockTransfer, BlockTransferMetadata
from kvdi.integrations.vllm.block_index import BlockIndex
from kvdi.integrations.vllm.parallel import AllRanksStore, RankSlice

TP2 = RankSlice(tp_size=2)


def test_one_rank_changes_nothing() -> None:
    one = RankSlice()
    meta = BlockTransferMetadata(loads=(BlockTransfer("r", (1,), (b"k" * 16,)),))
    assert not one.sliced and one.layout_tag() == one.rank_tag() == "" and one.key(b"k" * 16) == b"k" * 16
    assert one.rekey(meta) is meta


def test_each_rank_has_its_own_key_and_tag_per_block() -> None:
    ranks = TP2.ranks()
    keys = {rank.key(b"k" * 16) for rank in ranks}
    assert len(ranks) == 2 and len(keys) == 2 and all(len(k) == 16 for k in keys)
    assert {r.rank_tag() for r in ranks} == {".rank0-0", ".rank1-0"} and TP2.layout_tag() == "@tp2pp1"
    assert RankSlice(tp_size=2, pp_size=2).ranks()[3] == RankSlice(2, 2, 1, 1)


def test_rekey_replaces_load_and_save_keys_for_the_rank() -> None:
    rank1 = RankSlice(tp_size=2, tp_rank=1)
    meta = BlockTransferMetadata(
        loads=(BlockTransfer("r", (1, 2), (b"a" * 16, b"b" * 16)),), saves=(BlockTransfer("s", (3,), (b"c" * 16,)),)
    )
    out = rank1.rekey(meta)
    assert out.loads[0].block_ids == (1, 2) and out.loads[0].block_keys == (rank1.key(b"a" * 16), rank1.key(b"b" * 16))
    assert out.saves[0].block_keys == (rank1.key(b"c" * 16),)


def test_rekey_keeps_the_asynchronous_parts_of_store_metadata() -> None:
    from kvdi.connectors.store.scheduler import StoreTransferMetadata

    rank1 = RankSlice(tp_size=2, tp_rank=1)
    meta = StoreTransferMetadata(
        (), (BlockTransfer("s", (2,), (b"b",)),), (BlockTransfer("r", (1,), (b"a",)),), async_save=True
    )
    out = rank1.rekey(meta)
    assert isinstance(out, StoreTransferMetadata) and out.async_save
    assert out.async_loads == (BlockTransfer("r", (1,), (rank1.key(b"a"),)),)
    assert out.saves == (BlockTransfer("s", (2,), (rank1.key(b"b"),)),)


def test_a_block_counts_only_when_every_rank_stored_its_slice() -> None:
    backend = BlockIndex(capacity=100)
    keys = [bytes([i]) * 16 for i in range(4)]
    rank0, rank1 = TP2.ranks()
    backend.add([rank0.key(k) for k in keys])
    backend.add([rank1.key(k) for k in keys[:2]])
    view = AllRanksStore(backend, TP2)
    assert view.count_prefix(keys) == 2
    view.discard(keys[0])
    assert view.count_prefix(keys) == 0 and backend.count_prefix([rank0.key(keys[1])]) == 1
