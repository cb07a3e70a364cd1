"""The reference transformer: deterministic weights, paged attention equal to full attention."""

from __future__ import annotations

import pytest
import torch

from kvdi.engine.model import SequenceChunk
from tests.helpers.engine import BLOCK_SIZE, make_model


def caches_for(model_blocks: int = 16, fill: float = 0.0) -> dict[str, torch.Tensor]:
    shape = (model_blocks, 2, BLOCK_SIZE, 2, 16)
    return {f"layers.{i}": torch.full(shape, fill) for i in range(2)}


PROMPT = list(range(3, 30))


def test_same_seed_gives_same_logits_in_two_models() -> None:
    a, b = make_model(), make_model()
    blocks = list(range(8))
    out_a = a.forward([SequenceChunk(PROMPT, 0, blocks)], caches_for())
    out_b = b.forward([SequenceChunk(PROMPT, 0, blocks)], caches_for())
    assert torch.equal(out_a, out_b)


def test_other_seed_gives_other_logits() -> None:
    blocks = list(range(8))
    out_a = make_model().forward([SequenceChunk(PROMPT, 0, blocks)], caches_for())
    out_b = make_model(seed=1).forward([SequenceChunk(PROMPT, 0, blocks)], caches_for())
    assert not torch.allclose(out_a, out_b)


def test_prefill_in_chunks_matches_one_prefill() -> None:
    model = make_model()
    blocks = [5, 2, 7, 0, 1, 3, 4]
    whole = model.forward([SequenceChunk(PROMPT, 0, blocks)], caches_for())
    caches = caches_for()
    model.forward([SequenceChunk(PROMPT[:8], 0, blocks)], caches)
    model.forward([SequenceChunk(PROMPT[8:13], 8, blocks)], caches)
    last = model.forward([SequenceChunk(PROMPT[13:], 13, blocks)], caches)
    torch.testing.assert_close(last, whole, atol=1e-5, rtol=1e-5)


def test_decode_matches_prefill_of_the_longer_sequence() -> None:
    model = make_model()
    blocks = list(range(8))
    caches = caches_for()
    model.forward([SequenceChunk(PROMPT, 0, blocks)], caches)
    step = model.forward([SequenceChunk([42], len(PROMPT), blocks)], caches)
    full = model.forward([SequenceChunk([*PROMPT, 42], 0, blocks)], caches_for())
    torch.testing.assert_close(step, full, atol=1e-5, rtol=1e-5)


def test_batched_sequences_match_running_each_alone() -> None:
    model = make_model()
    other = [7, 7, 1, 9, 200]
    batch = model.forward([SequenceChunk(PROMPT, 0, range(8)), SequenceChunk(other, 0, [8, 9])], caches_for())
    alone = model.forward([SequenceChunk(other, 0, [8, 9])], caches_for())
    torch.testing.assert_close(batch[1:], alone, atol=1e-5, rtol=1e-5)


def test_nan_in_unused_cache_slots_does_not_reach_the_logits() -> None:
    model = make_model()
    clean = model.forward([SequenceChunk(PROMPT, 0, range(8))], caches_for())
    dirty = model.forward([SequenceChunk(PROMPT, 0, range(8))], caches_for(fill=float("nan")))
    assert torch.isfinite(dirty).all()
    torch.testing.assert_close(dirty, clean)


def test_forward_writes_kv_into_the_blocks_of_its_table() -> None:
    model = make_model()
    caches = caches_for()
    model.forward([SequenceChunk(PROMPT[:BLOCK_SIZE], 0, [6])], caches)
    written = [b for b in range(16) if caches["layers.0"][b].abs().sum() > 0]
    assert written == [6]


def test_gqa_query_heads_share_kv_heads() -> None:
    model = make_model(num_heads=8, num_kv_heads=2)
    out = model.forward([SequenceChunk(PROMPT, 0, range(8))], caches_for())
    assert out.shape == (1, 256)


def test_odd_head_dim_is_refused() -> None:
    with pytest.raises(ValueError, match="head_dim must be even"):
        make_model(head_dim=15)


def test_block_table_too_short_is_refused() -> None:
    with pytest.raises(ValueError, match="cannot hold"):
        make_model().forward([SequenceChunk(PROMPT, 0, [0, 1])], caches_for())
