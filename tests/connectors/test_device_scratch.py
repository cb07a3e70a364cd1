"""A device cache's scratch: taken at the first staged copy, never at registration, and within the budget.

vLLM sizes its KV cache from the free device memory before it registers the caches with kvdi, so a
device buffer taken at registration would come out of memory vLLM already counted as free. A staged
:class:`CacheIO` takes only its host ring when it is made; its device scratch (one chunk of rows and
the chunk's ids) comes at its first copy, once, and a chunk never holds more than
``allocator.max_staging_bytes`` (the device staging the allocation plan counts).
"""

from __future__ import annotations

from pathlib import Path

import torch

from kvdi.allocator import StagingBuffers
from kvdi.connectors.store.blockio import SLOTS, CacheIO
from kvdi.containers import build_engine_container

LAYERS, BLOCKS, LAYER_BYTES, CHUNK = 2, 8, 64, 4
ROW = LAYERS * LAYER_BYTES


class Recorded(StagingBuffers):
    """Staging that records each request as (owner, bytes)."""

    def __init__(self) -> None:
        super().__init__(pin_memory=False)
        self.asked: list[tuple[str, int]] = []

    def __call__(self, nbytes: int, *, device: str | torch.device = "cpu", owner: str | None = None) -> torch.Tensor:
        self.asked.append((owner or "", nbytes))
        return super().__call__(nbytes, device=device, owner=owner)


def staged() -> tuple[CacheIO, Recorded, list[torch.Tensor]]:
    caches = [torch.arange(BLOCKS * LAYER_BYTES // 4, dtype=torch.float32).view(BLOCKS, -1) + k for k in range(LAYERS)]
    buffers = Recorded()
    return CacheIO(caches, LAYER_BYTES, chunk=CHUNK, staging=True, buffers=buffers, owner="io"), buffers, caches


def test_a_staged_cache_takes_its_host_ring_when_made_and_its_device_scratch_at_the_first_copy_only() -> None:
    io, buffers, caches = staged()
    assert buffers.asked == [("io", SLOTS * CHUNK * ROW), ("io/index", SLOTS * CHUNK * 8)]
    assert io.device_scratch_bytes == 0
    pieces = io.save_pieces([5, 2])
    assert buffers.asked[2:] == [("io/scratch", CHUNK * ROW), ("io/index-dev", CHUNK * 8)]
    assert io.device_scratch_bytes == CHUNK * (ROW + 8)
    expected = torch.cat([c[5].view(torch.uint8) for c in caches]).numpy().tobytes()
    assert bytes(pieces[0][0]) == expected  # the copy went through the scratch it took
    io.save_pieces([1])
    io.load_pieces(0, 3)[0][:] = bytes(ROW)
    io.commit_load(0, 3)
    io.finish()
    assert len(buffers.asked) == 4  # later saves and loads reuse it
    assert not any(bool(c[3].any()) for c in caches)


def test_a_cache_that_is_only_registered_holds_no_device_memory(kvdi_env: Path, tmp_path: Path) -> None:
    """The engine allocator's count after registering a cache off the CPU (torch's meta device): host only."""
    model = {"num_layers": 2, "hidden_size": 64, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16}
    c = build_engine_container(
        kv_connector="cpu_offload",
        model=model,
        allocator={"device": "cpu", "num_blocks": 64, "block_size": 16, "max_staging_bytes": 3 * 8192},
        cpu_offload={"max_bytes": 1 << 20},
    )
    try:
        worker, alloc = c.kv.worker_connector(), c.alloc.allocator()
        layout = c.alloc.layout()
        meta = {n: torch.empty((64, *layout.block_shape), device="meta") for n in layout.layer_names}
        worker.register_kv_caches(meta)
        # max_staging_bytes holds 3 blocks: a chunk of 3 rows (not the 32 MiB default, nor the cache's 64 blocks)
        assert alloc.staging_nbytes == {"cpu": SLOTS * 3 * (layout.block_bytes + 8)}
    finally:
        c.shutdown_resources()
