"""multi: tiers in order; the longest prefix wins lookups, saves reach every tier, a failing tier is skipped."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from kvdi_store_helpers import DictStore, Engine, make_settings, request, small_layout

from kvdi.connectors.cpu_offload import HostPoolStore
from kvdi.connectors.framing import HEADER_SIZE
from kvdi.connectors.keys import block_keys
from kvdi.connectors.multi import TieredStore, open_store
from kvdi.connectors.shared_storage import FileBlockStore
from kvdi.containers import build_engine_container
from kvdi.errors import ConfigError
from kvdi.settings import KvdiSettings, MultiSettings

LAYOUT = small_layout(block_size=4)
FRAME = HEADER_SIZE + LAYOUT.block_bytes
PROMPT = request(range(18))
KEYS = block_keys(PROMPT.prompt_token_ids, LAYOUT)


def settings_for(tmp_path: Path, slots: int = 16) -> KvdiSettings:
    return make_settings(tmp_path / "kv", cpu_offload={"max_bytes": slots * FRAME})


@pytest.fixture
def tiered(tmp_path: Path) -> Iterator[TieredStore]:
    store = open_store(MultiSettings(), LAYOUT, settings_for(tmp_path))
    yield store
    store.close()


def test_tiers_are_built_in_order_from_their_own_settings(tiered: TieredStore) -> None:
    assert [name for name, _ in tiered.tiers] == ["cpu_offload", "shared_storage"]
    assert isinstance(tiered.tiers[0][1], HostPoolStore) and isinstance(tiered.tiers[1][1], FileBlockStore)


def test_unknown_tier_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="KVDI_MULTI__TIERS"):
        open_store(MultiSettings(tiers=("no_such_tier",)), LAYOUT, settings_for(tmp_path))


def test_saves_reach_every_tier(tiered: TieredStore) -> None:
    Engine(tiered, LAYOUT, make_settings(), seed=1).prefill(PROMPT, (1, 2, 3, 4, 5))
    assert [store.count_prefix(KEYS) for _, store in tiered.tiers] == [4, 4]


def test_lookup_takes_the_longest_prefix_of_any_tier(tiered: TieredStore) -> None:
    Engine(tiered, LAYOUT, make_settings(), seed=1).prefill(PROMPT, (1, 2, 3, 4, 5))
    tiered.tiers[0][1].discard(KEYS[2])
    tiered.tiers[1][1].discard(KEYS[3])
    assert tiered.count_prefix(KEYS) == 3


def test_loads_fall_through_to_the_next_tier(tiered: TieredStore) -> None:
    producer = Engine(tiered, LAYOUT, make_settings(), seed=1)
    producer.prefill(PROMPT, (1, 2, 3, 4, 5))
    for key in KEYS[1:]:
        tiered.tiers[0][1].discard(key)
    consumer = Engine(tiered, LAYOUT, make_settings())
    assert consumer.prefill(PROMPT, (6, 7, 8, 9, 10)) == (16, set())
    assert torch.equal(torch.stack(producer.block(4)), torch.stack(consumer.block(9)))


def test_a_wrong_sized_object_in_a_fast_tier_is_skipped_for_a_good_one(tiered: TieredStore) -> None:
    Engine(tiered, LAYOUT, make_settings(), seed=1).prefill(PROMPT, (1, 2, 3, 4, 5))
    tiered.tiers[0][1].put_many([(KEYS[0], [b"short"])])
    consumer = Engine(tiered, LAYOUT, make_settings())
    assert consumer.prefill(PROMPT, (6, 7, 8, 9, 10)) == (16, set())
    assert consumer.worker.stats.corrupt_dropped == 0


def test_a_failing_tier_does_not_stop_the_others(tmp_path: Path, tiered: TieredStore) -> None:
    (tmp_path / "kv").rmdir()
    (tmp_path / "kv").write_text("not a directory")  # the disk tier can no longer write
    engine = Engine(tiered, LAYOUT, make_settings(), seed=1)
    engine.prefill(PROMPT, (1, 2, 3, 4, 5))
    assert (engine.worker.stats.saved_blocks, engine.worker.stats.save_failures) == (4, 0)
    assert tiered.tiers[0][1].count_prefix(KEYS) == 4
    assert tiered.tier_failures["shared_storage"] == 1


def test_save_fails_only_when_every_tier_fails(tmp_path: Path) -> None:
    (tmp_path / "a").write_text("x")
    (tmp_path / "b").write_text("x")
    store = TieredStore([("a", FileBlockStore(tmp_path / "a")), ("b", FileBlockStore(tmp_path / "b"))])
    engine = Engine(store, LAYOUT, make_settings(), seed=1)
    engine.prefill(PROMPT, (1, 2, 3, 4, 5))
    assert engine.worker.stats.save_failures == 4


def test_tiers_without_read_into_still_load(tmp_path: Path) -> None:
    store = TieredStore([("dict", DictStore()), ("disk", FileBlockStore(tmp_path / "kv"))])
    Engine(store, LAYOUT, make_settings(), seed=1).prefill(PROMPT, (1, 2, 3, 4, 5))
    assert Engine(store, LAYOUT, make_settings()).prefill(PROMPT, (6, 7, 8, 9, 10)) == (16, set())


def test_close_closes_every_tier(tiered: TieredStore) -> None:
    Engine(tiered, LAYOUT, make_settings(), seed=1).prefill(PROMPT, (1, 2, 3, 4, 5))
    tiered.close()
    assert tiered.tiers[0][1].count_prefix(KEYS) == 0  # the host pool was emptied


def test_engine_with_multi_generates_like_the_null_connector(tmp_path: Path) -> None:
    common: dict[str, Any] = {
        "allocator": {"device": "cpu", "num_blocks": 64, "block_size": 4},
        "model": {"num_layers": 2, "hidden_size": 64, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16,
                  "intermediate_size": 128, "vocab_size": 256, "max_model_len": 512},
        "shared_storage": {"path": str(tmp_path / "kv")},
    }  # fmt: skip
    prompts = [list(range(3, 40))]
    containers = [build_engine_container(kv_connector=c, **common) for c in ("null", "multi", "multi")]
    try:
        outputs = [c.engine().generate(prompts, 3)[0] for c in containers]
    finally:
        for c in containers:
            c.shutdown_resources()
    assert outputs[0].output_token_ids == outputs[1].output_token_ids == outputs[2].output_token_ids
    assert outputs[2].num_loaded_tokens == 36
