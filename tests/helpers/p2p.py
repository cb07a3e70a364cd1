"""Shared pieces of the p2p attack tests (tests/connectors/test_p2p_security.py, test_p2p_pairing_attacks.py):
settings of a producer or consumer process, random caches, one hand-driven scheduler step."""

from __future__ import annotations

import time
from typing import Any

import torch

from kvdi.connectors.base import KVRequest, ScheduledRequest, SchedulerOutput

TIMEOUT_S = 3.0
PROMPT = KVRequest("req-1", tuple(range(13)))  # block size 4: 3 loadable blocks


def p2p_settings(role: str, port: int, token: str | None, connect_timeout_s: float = 10.0) -> Any:
    from kvdi.settings import load_settings

    p2p: dict[str, Any] = {"kv_port": port, "kv_rank": 0 if role == "kv_producer" else 1, "timeout_s": TIMEOUT_S}
    p2p |= {"connect_timeout_s": connect_timeout_s} | ({"auth_token": token} if token is not None else {})
    return load_settings(
        kv_connector="p2p",
        kv_role=role,
        p2p=p2p,
        model={"num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "head_dim": 8, "hidden_size": 32},
        allocator={"device": "cpu", "num_blocks": 16, "block_size": 4},
        transfer={"async_load": "off"},  # one synchronous step driven by hand
    )


def random_caches(layout: Any, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn((16, *layout.block_shape), generator=gen) for n in layout.layer_names}


def step(blocks: tuple[int, ...], computed: int) -> SchedulerOutput:
    return SchedulerOutput(1, (ScheduledRequest(PROMPT, blocks, computed, len(PROMPT.prompt_token_ids) - computed),))


def poll_until(ready: Any, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready() and time.monotonic() < deadline:
        time.sleep(0.02)
