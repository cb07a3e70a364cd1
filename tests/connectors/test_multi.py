"""multi: tiers in order; the longest prefix wins lookups, saves reach every tier, a failing tier is skipped.

Tiers are registered store connectors, resolved through the container's registry.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from dependency_injector import providers

from kvdi.connectors.cpu_offload import HostPoolStore
from kvdi.connectors.multi import TieredStore
from kvdi.connectors.shared_storage import FileBlockStore
from kvdi.connectors.store.framing import HEADER_SIZE
from kvdi.connectors.store.keys import block_keys
from kvdi.containers import KVTransferContainer, build_engine_container, build_kv_container
from kvdi.errors import ConfigError
from kvdi.registry import ConnectorRegistry
from tests.helpers.registry import install_entry_point, write_module
from tests.helpers.store import DictStore, Engine, make_settings, request, small_layout

ROOT = Path(__file__).resolve().parents[2]

LAYOUT = small_layout(block_size=4)
FRAME = HEADER_SIZE + LAYOUT.block_bytes
PROMPT = request(range(18))
KEYS = block_keys(PROMPT.prompt_token_ids, LAYOUT)

STORES = ", ".join(ConnectorRegistry().store_names())  # the registry's store connectors, as errors list them


def multi_container(tmp_path: Path, **overrides: Any) -> KVTransferContainer:
    """A real container for ``multi`` (its registry resolves the tiers) whose layout is this test's."""
    c = build_kv_container(
        kv_connector="multi",
        engine_id="test",
        shared_storage={"path": str(tmp_path / "kv")},
        cpu_offload={"max_bytes": 16 * FRAME},
        **overrides,
    )
    c.layout.override(providers.Object(LAYOUT))
    return c


@pytest.fixture
def tiered(kvdi_env: Path, tmp_path: Path) -> Iterator[TieredStore]:
    c = multi_container(tmp_path)
    store = c.backend()
    assert isinstance(store, TieredStore)
    yield store
    c.shutdown_resources()


def test_tiers_are_built_in_order_from_their_own_settings(tiered: TieredStore) -> None:
    assert [name for name, _ in tiered.tiers] == ["cpu_offload", "shared_storage"]
    assert isinstance(tiered.tiers[0][1], HostPoolStore) and isinstance(tiered.tiers[1][1], FileBlockStore)


def test_a_misspelt_tier_is_a_config_error_with_did_you_mean(kvdi_env: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        multi_container(tmp_path, multi={"tiers": ["cpu_offload", "shared_storag"]})
    assert str(err.value) == (
        "keyword argument multi.tiers names 'shared_storag', which is not a registered connector; "
        f"store connectors: {STORES} (did you mean 'shared_storage'?)"
    )


@pytest.mark.parametrize("tier", ["p2p", "null"])
def test_a_connector_that_is_not_a_store_is_refused_at_build_time(kvdi_env: Path, tier: str) -> None:
    with pytest.raises(
        ConfigError, match=f"keyword argument multi.tiers names '{tier}', which is not a store connector"
    ):
        build_kv_container(kv_connector="multi", multi={"tiers": ["cpu_offload", tier]})


def kvdi_check(env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.upper().startswith("KVDI_") and k != "VLLM_USE_V1"}
    return subprocess.run(
        [sys.executable, "-m", "kvdi.cli", "check"],
        env={**base, "PYTHONPATH": str(ROOT), "KVDI_KV_CONNECTOR": "multi", **env},
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    ("tiers", "message"),
    [
        ('["cpu_offload","p2p"]', "names 'p2p', which is not a store connector"),
        ('["cpu_ofload"]', "names 'cpu_ofload', which is not a registered connector; store connectors: "
                           f"{STORES} (did you mean 'cpu_offload'?)"),
    ],
)  # fmt: skip
def test_kvdi_check_refuses_a_bad_tier_with_one_line(tmp_path: Path, tiers: str, message: str) -> None:
    r = kvdi_check({"KVDI_MULTI__TIERS": tiers}, tmp_path)
    assert (r.returncode, r.stdout) == (2, "")
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("kvdi: error: KVDI_MULTI__TIERS ")
    assert message in r.stderr


THIRD_PARTY_STORE = """
from kvdi.registry import ConnectorSpec


class MemoryStore:
    \"\"\"A third-party BlockStore: a dict.\"\"\"

    def __init__(self):
        self.objects = {}

    def count_prefix(self, keys):
        n = 0
        while n < len(keys) and keys[n] in self.objects:
            n += 1
        return n

    def get_many(self, keys):
        return [self.objects.get(k) for k in keys]

    def put_many(self, items):
        for key, pieces in items:
            self.objects[key] = b"".join(bytes(p) for p in pieces)
        return len(items)

    def discard(self, key):
        self.objects.pop(key, None)

    def close(self):
        self.objects.clear()


def open_store(options, layout, settings):
    return MemoryStore()


SPEC = ConnectorSpec(
    "memory",
    "kvdi.connectors.store:StoreSchedulerConnector",
    "kvdi.connectors.store:StoreWorkerConnector",
    backend=__name__ + ":open_store",
)
"""


def test_an_entry_point_store_connector_can_be_a_tier(
    kvdi_env: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(tmp_path))
    module = write_module(tmp_path, THIRD_PARTY_STORE)
    install_entry_point(tmp_path, "third_party_memory", module, "SPEC")
    c = build_kv_container(
        kv_connector="multi",
        multi={"tiers": ["third_party_memory", "shared_storage"]},
        shared_storage={"path": str(tmp_path / "kv")},
    )
    try:
        assert [t.name for t in c.tiers()] == ["third_party_memory", "shared_storage"]
        assert c.tiers()[0].connector.origin == "entry-point"
        store = c.backend()
        assert type(store.tiers[0][1]).__name__ == "MemoryStore" and isinstance(store.tiers[1][1], FileBlockStore)
        Engine(store, LAYOUT, make_settings(), seed=1).prefill(PROMPT, (1, 2, 3, 4, 5))
        assert [tier.count_prefix(KEYS) for _, tier in store.tiers] == [4, 4]
    finally:
        c.shutdown_resources()


def test_put_many_returns_the_most_objects_any_tier_holds(tmp_path: Path) -> None:
    (tmp_path / "broken").write_text("not a directory")
    store = TieredStore([("dict", DictStore()), ("disk", FileBlockStore(tmp_path / "broken"))])
    assert store.put_many([(KEYS[0], [b"a"]), (KEYS[1], [b"b"])]) == 2


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
