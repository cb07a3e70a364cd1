"""cpu_offload's page-locked pool (next to a CUDA cache), with a recording registrar where CUDA is absent.

What is checked: the pool registers exactly its bytes (``num_slots x frame``, not a power of two) at
the address it uses, once, at the first write; it unregisters that address and unmaps on close; a
driver refusal leaves a working pageable pool; a CPU engine never pins. The real ``cudaHostRegister``
path (``is_pinned``, asynchronous copies) is in ``tests/test_cuda.py``.
"""

from __future__ import annotations

import logging
from pathlib import Path

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


def vm_flags(ptr: int) -> list[str]:
    """The VmFlags the kernel shows for the mapping holding address ``ptr`` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= ptr < end
        elif inside and head == "VmFlags:":
            return line.split()[1:]
    return []


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs Linux /proc/self/smaps")
def test_a_huge_page_region_asks_the_kernel_for_huge_pages_and_a_plain_one_does_not() -> None:
    huge, plain = HostRegion(8 << 20, huge_pages=True), HostRegion(8 << 20)
    try:
        assert huge.array is not None and huge.ptr % 4096 == 0 and not huge.pinned
        huge.array[:] = 3
        assert int(huge.array.sum()) == 3 * (8 << 20)
        assert "hg" in vm_flags(huge.ptr) and "hg" not in vm_flags(plain.ptr)  # MADV_HUGEPAGE
    finally:
        huge.close()
        plain.close()


def test_a_cpu_engine_never_pins_the_pool() -> None:
    assert not pins_for_device(make_settings(allocator={"device": "cpu"}))
    assert not pins_for_device(make_settings(allocator={"device": "auto", "pin_memory": False}))
