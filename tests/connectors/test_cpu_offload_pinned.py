"""cpu_offload's page-locked pool (next to a CUDA cache), with a recording registrar where CUDA is absent.

What is checked: the pool registers exactly its bytes (``num_slots x frame``, not a power of two) at
the address it uses, once, at the first write; it unregisters that address and unmaps on close; a
driver refusal leaves a working pageable pool; a CPU engine never pins. The real ``cudaHostRegister``
path (``is_pinned``, asynchronous copies) is in ``tests/test_cuda.py``.
"""

from __future__ import annotations

import logging

import pytest
import torch

from kvdi.connectors.cpu_offload import HostPoolStore, pins_for_device
from kvdi.connectors.pinned import HostRegion
from kvdi.connectors.store.framing import HEADER_SIZE
from kvdi.connectors.store.keys import block_keys
from tests.helpers.store import Engine, make_settings, request, small_layout

LAYOUT = small_layout(block_size=4)
FRAME = HEADER_SIZE + LAYOUT.block_bytes
PROMPT = request(range(18))


class Registrar:
    """Records register/unregister calls; ``refuse`` makes register fail as a driver would."""

    def __init__(self, refuse: bool = False) -> None:
        self.calls: list[tuple[str, int, int]] = []
        self.refuse = refuse

    def register(self, ptr: int, nbytes: int) -> None:
        if self.refuse:
            raise RuntimeError("cudaHostRegister(...) failed with CUDA error 2 (out of memory)")
        self.calls.append(("register", ptr, nbytes))

    def unregister(self, ptr: int) -> None:
        self.calls.append(("unregister", ptr, 0))


def test_the_pinned_pool_registers_exactly_its_bytes_at_first_write_and_releases_them_on_close() -> None:
    registrar = Registrar()
    store = HostPoolStore(5, FRAME, pin_memory=True, registrar=registrar)
    assert registrar.calls == [] and store.pinned_bytes == 0  # nothing taken before a block is stored
    producer = Engine(store, LAYOUT, make_settings(), seed=3)
    producer.prefill(PROMPT, (1, 2, 3, 4, 5))
    ((call, ptr, nbytes),) = registrar.calls
    assert (call, nbytes) == ("register", 5 * FRAME) and store.pinned_bytes == 5 * FRAME
    assert store._pool is not None and ptr == store._pool.ctypes.data  # the range the slots live in
    consumer = Engine(store, LAYOUT, make_settings())
    assert consumer.prefill(PROMPT, (9, 10, 11, 12, 13)) == (16, set())  # verified and placed from the slots
    assert all(torch.equal(a, b) for a, b in zip(producer.block(4), consumer.block(12), strict=True))
    store.close()
    assert registrar.calls[1:] == [("unregister", ptr, 0)] and store.pinned_bytes == 0


def test_a_refused_registration_leaves_a_working_pageable_pool(caplog: pytest.LogCaptureFixture) -> None:
    store = HostPoolStore(4, FRAME, pin_memory=True, registrar=Registrar(refuse=True))
    with caplog.at_level(logging.WARNING):
        Engine(store, LAYOUT, make_settings(), seed=3).prefill(PROMPT, (1, 2, 3, 4))
    assert "page-locking the" in caplog.text and store.pinned_bytes == 0
    assert store.count_prefix(block_keys(PROMPT.prompt_token_ids, LAYOUT)) == 4


def test_a_host_region_is_exactly_its_size_page_aligned_and_closes_twice() -> None:
    registrar = Registrar()
    region = HostRegion(12345, registrar)
    assert region.array is not None and region.array.nbytes == 12345 and region.ptr % 4096 == 0
    region.array[:] = 7
    assert region.tensor().sum().item() == 7 * 12345
    region.close()
    region.close()
    assert registrar.calls == [("register", region.ptr, 12345), ("unregister", region.ptr, 0)]
    assert region.array is None and not region.pinned


def test_a_cpu_engine_never_pins_the_pool() -> None:
    assert not pins_for_device(make_settings(allocator={"device": "cpu"}))
    assert not pins_for_device(make_settings(allocator={"device": "auto", "pin_memory": False}))
