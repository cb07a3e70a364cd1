"""What ``bench_remote.py`` asks of Redis itself: the keys a loading round reads, their raw transfer, ``auto``'s pick.

Key names follow kvdi's key chain (``kvdi.connectors.store.keys``) under ``KEY_PREFIX``; the raw
transfer is redis-py with no kvdi code in the way, so a loading round can be set against it.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

KEY_PREFIX = "bench-remote:"


def loaded_keys(client: Any, prompts: list[list[int]], block_size: int) -> list[bytes]:
    """Redis keys of the blocks vLLM loads for ``prompts`` (the chain seeded from any stored object's layout)."""
    from kvdi.connectors.store.keys import chain_keys, chain_seed

    width = len(KEY_PREFIX) + 32
    some = next(k for k in client.scan_iter(match=KEY_PREFIX + "*", count=1000) if len(k) == width)
    seed = chain_seed(client.get(some)[8:24], None)  # the frame header's layout fingerprint
    prefix = KEY_PREFIX.encode()
    return [
        prefix + k.hex().encode()
        for p in prompts
        for k in chain_keys(p, block_size, seed)[: (len(p) - 1) // block_size]
    ]


def raw_transfer(url: str, keys: list[bytes], tries: int) -> dict[str, Any]:
    """Median seconds of one pipelined GET of ``keys`` over a fresh connection to ``url``, with bytes and misses."""
    import redis

    client = redis.Redis.from_url(url)
    client.ping()  # the connection is up: the figure is the transfer
    times, values = [], []
    for _ in range(tries):
        start = time.perf_counter()
        pipe = client.pipeline(transaction=False)
        for k in keys:
            pipe.get(k)
        values = pipe.execute()
        times.append(time.perf_counter() - start)
    client.close()
    return {
        "seconds": statistics.median(times),
        "all_s": times,
        "bytes": sum(len(v) for v in values if v),
        "missing": sum(v is None for v in values),
        "keys": len(keys),
    }


def auto_pick(hit_bytes: int, delays_ms: list[float] | None = None) -> dict[str, Any]:
    """What ``transfer.async_load=auto`` does for these hits: kvdi's own rule (``load_policy.auto_way``). In vLLM a
    store whose lookup takes ``AUTO_PREFETCH_LOOKUP_S`` or more prefetches: behind the proxy a lookup takes at least
    2 x the delay each way, so ``by_delay`` says, per delay, what ``auto`` picks there."""
    from kvdi.connectors.redis.server import RedisBlockStore
    from kvdi.connectors.store.load_policy import ASYNC_LOAD_MIN_BYTES, AUTO_PREFETCH_LOOKUP_S, auto_way

    remote = bool(RedisBlockStore.prefers_async_load)
    path = "on" if auto_way(remote, None, hit_bytes, prefetch_here=False) == "background" else "off"
    why = (
        f"redis prefers_async_load={remote}; largest hit {hit_bytes / 2**20:.1f} MiB vs "
        f"{ASYNC_LOAD_MIN_BYTES / 2**20:.0f} MiB threshold; prefetch where a lookup takes "
        f">= {AUTO_PREFETCH_LOOKUP_S * 1e3:g} ms"
    )
    by_delay = {
        f"{d:g}": "prefetch" if auto_way(remote, 2 * d / 1e3, hit_bytes, prefetch_here=True) == "prefetch" else path
        for d in delays_ms or []
    }
    return {"path": path, "why": why, "by_delay": by_delay}
