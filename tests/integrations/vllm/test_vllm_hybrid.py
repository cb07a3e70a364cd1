"""kvdi's halves for several KV cache groups (kvdi.integrations.vllm.hybrid, .halves) over a real shared_storage store.

Two groups overlay the same CPU tensors (as vLLM's hybrid manager lays them out): a full
attention group and a sliding-window group. Engine 1 stores a prompt; engine 2 loads it into
other block ids; a corrupt object of one group fails that request's load (``failed_recving``).
The same halves run inside real vLLM in tests/real_vllm/test_vllm_hybrid.py.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kvdi.connectors.base import KVRequest
from kvdi.errors import ConfigError
from kvdi.integrations.vllm.groups import GroupSpec
from kvdi.integrations.vllm.halves import open_hybrid
from kvdi.integrations.vllm.hybrid import HybridScheduler, HybridWorker
from kvdi.integrations.vllm.parallel import RankSlice
from kvdi.integrations.vllm.requests import RequestTracker
from kvdi.integrations.vllm.shared import SHARED
from kvdi.layout import KVCacheSpec

BASE = KVCacheSpec("m", 4, 2, 8, 4, "float32")
GROUPS = (GroupSpec(0, "full", ("l.0", "l.2"), 4, 0, 2, 8), GroupSpec(1, "sliding", ("l.1", "l.3"), 4, 8, 2, 8))
PROMPT = KVRequest("r", tuple(range(3, 21)))  # 18 tokens: 4 full blocks, 2 tokens
NUM_BLOCKS = 16


SCATTERED = replace(BASE, block_order="hnc")  # a layer's block lies in one run per KV head (vLLM's LHBNC)


class Engine:
    """Both hybrid halves of one engine over its own CPU cache (two tensors, each shared by two groups' layers).

    ``scattered``: vLLM's 4-D ``[B, H, N, C]`` views with heads outermost (``LHBNC``), so each
    group's blocks go through its own LayoutBridge; otherwise the contiguous CPU layout."""

    def __init__(self, engine_id: str, store: Path, seed: int | None, scattered: bool = False) -> None:
        kwargs = {"kv_connector": "shared_storage", "shared_storage": {"path": str(store)}, "engine_id": engine_id}
        self.engine_id = engine_id
        base = SCATTERED if scattered else BASE
        self.container = SHARED.acquire(engine_id, kwargs, base)
        self.tracker = RequestTracker()
        args = (GROUPS, base, kwargs, RankSlice(), self.tracker, False)
        self.scheduler = open_hybrid(self.container, False, *args)
        self.worker = open_hybrid(self.container, True, *args)
        assert isinstance(self.scheduler, HybridScheduler) and isinstance(self.worker, HybridWorker)
        gen = torch.Generator().manual_seed(seed or 0)
        make = (lambda: torch.rand((NUM_BLOCKS, 2, 4, 16), generator=gen)) if seed is not None else None
        self.tensors = [make() if make else torch.zeros((NUM_BLOCKS, 2, 4, 16)) for _ in range(2)]
        if scattered:  # the same values, heads outermost in memory
            self.tensors = [t.permute(1, 0, 2, 3).contiguous().permute(1, 0, 2, 3) for t in self.tensors]
        caches = {"l.0": self.tensors[0], "l.1": self.tensors[0], "l.2": self.tensors[1], "l.3": self.tensors[1]}
        self.worker.register_vllm_caches(caches, NUM_BLOCKS)

    def step(self, new: list[tuple[tuple[list[int], ...], int, int]] | None = None) -> tuple[set[str], set[str]]:
        """One engine step scheduling ``new`` = [(block ids per group, computed, scheduled)] for PROMPT."""
        reqs = [
            SimpleNamespace(
                req_id=PROMPT.request_id,
                prompt_token_ids=list(PROMPT.prompt_token_ids),
                block_ids=ids,
                num_computed_tokens=computed,
            )
            for ids, computed, _ in new or ()
        ]
        cached = SimpleNamespace(req_ids=[], resumed_req_ids=set(), new_block_ids=[], num_computed_tokens=[])
        scheduled = {PROMPT.request_id: new[0][2]} if new else {}
        output = SimpleNamespace(
            scheduled_new_reqs=reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=scheduled,
            finished_req_ids=set(),
        )
        self.tracker.remember(PROMPT)
        meta = self.scheduler.build_connector_meta(self.tracker.translate(output))
        self.worker.bind_connector_metadata(meta)
        self.worker.start_load_kv()
        self.worker.wait_for_save()
        sending, recving = self.worker.get_finished(set())
        self.worker.clear_connector_metadata()
        return sending or set(), recving or set()

    def until_received(self, recving: set[str] | None = None) -> tuple[set[str], set[str]]:
        """Step until a load is reported (``recving``: the report of the step that started it, maybe it)."""
        for _ in range(200):
            if recving:
                return recving, self.worker.take_failed(recving)
            _, recving = self.step()
            time.sleep(0.01)
        raise AssertionError("the asynchronous load never finished")

    def block(self, block_id: int) -> torch.Tensor:
        """The bytes of ``block_id`` in every layer (the groups overlay the same tensors)."""
        return torch.stack([t[block_id] for t in self.tensors])

    def close(self) -> None:
        self.scheduler.shutdown()
        self.worker.shutdown()
        SHARED.release(self.engine_id)


@pytest.fixture
def engines(tmp_path: Path) -> Iterator[list[Engine]]:
    made: list[Engine] = []
    yield made
    for engine in made:
        engine.close()


def _store(tmp_path: Path, engines: list[Engine], scattered: bool = False) -> Engine:
    producer = Engine("e1", tmp_path / "store", seed=1, scattered=scattered)
    engines.append(producer)
    assert producer.scheduler.get_num_new_matched_tokens(PROMPT, 0) == (0, False)
    producer.step([(([1, 2, 3, 4, 5], [6, 7, 8, 9, 10]), 0, 18)])
    for half in producer.worker.halves:  # saves may run in the background
        half.flush()  # type: ignore[attr-defined]
    return producer


def _objects(store: Path) -> dict[bytes, list[Path]]:
    """Stored objects by the layout fingerprint in their header."""
    found: dict[bytes, list[Path]] = {}
    for path in store.rglob("*"):
        if path.is_file() and not path.name.startswith("."):
            found.setdefault(path.read_bytes()[8:24], []).append(path)
    return found


def test_each_group_stores_its_own_blocks_and_sliding_only_in_window(tmp_path: Path, engines: list[Engine]) -> None:
    _store(tmp_path, engines)
    counts = sorted(len(paths) for paths in _objects(tmp_path / "store").values())
    # full attention: 4 blocks; sliding window (2 blocks): only blocks 2 and 3 (the window at the hit boundary)
    assert counts == [2, 4]


@pytest.mark.parametrize("scattered", [False, True])
def test_a_second_engine_loads_each_group_into_its_own_block_ids(
    tmp_path: Path, engines: list[Engine], scattered: bool
) -> None:
    """Each group's blocks land in that group's block ids, zero-copy or (scattered) through the group's bridge."""
    producer = _store(tmp_path, engines, scattered)
    consumer = Engine("e2", tmp_path / "store", seed=None, scattered=scattered)
    engines.append(consumer)
    assert consumer.scheduler.get_num_new_matched_tokens(PROMPT, 0) == (16, True)
    ids = ([11, 12, 13, 14, 15], [1, 2, 3, 4, 5])
    consumer.scheduler.allocated(PROMPT, ids, 16)
    recving, failed = consumer.until_received(consumer.step([(ids, 16, 2)])[1])
    assert (recving, failed) == ({"r"}, set())
    for src, dst in zip([1, 2, 3, 4], [11, 12, 13, 14], strict=True):  # full group: layers l.0 and l.2
        assert torch.equal(producer.block(src), consumer.block(dst))
    for src, dst in zip([8, 9], [3, 4], strict=True):  # sliding group: the window only
        assert torch.equal(producer.block(src), consumer.block(dst))
    assert all(not t[1:3].any() for t in consumer.tensors)  # blocks that slid out: no bytes loaded
    assert all(not b.direct for b in consumer.worker.bridges) == scattered
    budget = consumer.worker.context.settings.allocator.max_staging_bytes
    assert sum(b.scratch_bytes for b in consumer.worker.bridges) <= budget  # the groups share one staging budget


@pytest.mark.parametrize("scattered", [False, True])
def test_a_corrupt_object_of_one_group_fails_the_request(
    tmp_path: Path, engines: list[Engine], scattered: bool
) -> None:
    """A bad object of the sliding group fails the whole request (per request, never block ids), bridged or not."""
    _store(tmp_path, engines, scattered)
    objects = _objects(tmp_path / "store")
    sliding = min(objects.values(), key=len)[0]
    data = bytearray(sliding.read_bytes())
    data[-1] ^= 0xFF
    sliding.write_bytes(bytes(data))
    consumer = Engine("e3", tmp_path / "store", seed=None, scattered=scattered)
    engines.append(consumer)
    n, load_async = consumer.scheduler.get_num_new_matched_tokens(PROMPT, 0)
    assert (n, load_async) == (16, True)
    ids = ([11, 12, 13, 14, 15], [1, 2, 3, 4, 5])
    consumer.scheduler.allocated(PROMPT, ids, 16)
    assert consumer.until_received(consumer.step([(ids, 16, 2)])[1]) == ({"r"}, {"r"})
    assert consumer.worker.get_block_ids_with_load_errors() == set()  # never block ids: vLLM refuses them here


def test_connectors_that_cannot_store_groups_are_refused(tmp_path: Path) -> None:
    kwargs: dict[str, Any] = {"kv_connector": "null", "engine_id": "e4"}
    container = SHARED.acquire("e4", kwargs, BASE)
    try:
        with pytest.raises(ConfigError, match="2 KV cache groups.*disable-hybrid-kv-cache-manager"):
            open_hybrid(container, False, GROUPS, BASE, kwargs, RankSlice(), RequestTracker(), False)
    finally:
        SHARED.release("e4")


def test_a_finished_request_is_reported_once_when_every_groups_saves_are_done(
    tmp_path: Path, engines: list[Engine]
) -> None:
    """Asynchronous saves hold the request's blocks in every group; vLLM hears of it once, after the last group."""
    producer = _store(tmp_path, engines)
    delay_free, _ = producer.scheduler.request_finished(PROMPT, [])
    assert delay_free  # transfer.async_save is on by default: vLLM keeps the blocks until finished sending
    reports = []
    for _ in range(200):
        sending, _ = producer.worker.get_finished({"r"} if not reports else set())
        reports.append(sending)
        if any(reports):
            break
        time.sleep(0.01)
    reports += [producer.worker.get_finished(set())[0] for _ in range(3)]
    assert [r for r in reports if r] == [{"r"}]
