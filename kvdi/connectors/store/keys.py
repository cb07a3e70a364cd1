"""Prefix-chained block keys: what a block of KV is stored under.

Key ``i`` of a prompt hashes key ``i - 1`` with the token ids of block ``i``, so a key
names the whole prefix up to the end of its block: two prompts share key ``i`` exactly
when they share their first ``i + 1`` blocks. The chain is seeded with the layout
fingerprint (so KV of another model, dtype or block size never matches) and an optional
per-request salt (so tenants with different salts never share KV). Hashes are BLAKE2b-128;
Python's ``hash`` is never used (it is salted per process).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from kvdi.layout import KVCacheSpec

KEY_BYTES = 16
_DOMAIN = b"kvdi-block-key-v1"


def chain_seed(fingerprint: bytes, salt: str | bytes | None = None) -> bytes:
    """The key before block 0: the layout fingerprint and the salt (None and "" differ)."""
    h = hashlib.blake2b(_DOMAIN, digest_size=KEY_BYTES)
    h.update(len(fingerprint).to_bytes(4, "little"))
    h.update(fingerprint)
    if salt is None:
        h.update(b"\x00")
    else:
        # surrogatepass: a lone surrogate in a request's cache_salt is still a distinct salt, never an error
        raw = salt.encode("utf-8", "surrogatepass") if isinstance(salt, str) else bytes(salt)
        h.update(b"\x01" + len(raw).to_bytes(8, "little"))
        h.update(raw)
    return h.digest()


def compose_salt(cache_salt: str | None, lora_name: str | None = None, mm_hashes: Sequence[str] = ()) -> str | None:
    """One salt for a request's cache salt, LoRA adapter and multimodal inputs; None when it has none.

    Each part is tagged and length-prefixed (``s5:hello|l3:ada|m8:...``), so two different
    requests can never compose the same salt, whatever characters their parts contain.
    """
    parts = [("s", cache_salt), ("l", lora_name), *(("m", h) for h in mm_hashes)]
    present = [f"{tag}{len(value)}:{value}" for tag, value in parts if value is not None]
    return "|".join(present) if present else None


def chain_keys(token_ids: Sequence[int], block_size: int, seed: bytes) -> list[bytes]:
    """Keys of the full blocks of ``token_ids`` (a trailing partial block gets none), chained from ``seed``."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    num_blocks = len(token_ids) // block_size
    if num_blocks == 0:
        return []
    # Tokens as fixed-width little-endian int64 so (1, 23) and (12, 3) never hash alike.
    tokens = np.asarray(token_ids[: num_blocks * block_size], dtype="<i8").tobytes()
    step = block_size * 8
    keys: list[bytes] = []
    prev = seed
    for i in range(num_blocks):
        h = hashlib.blake2b(prev, digest_size=KEY_BYTES)
        h.update(tokens[i * step : (i + 1) * step])
        prev = h.digest()
        keys.append(prev)
    return keys


def block_keys(token_ids: Sequence[int], layout: KVCacheSpec, salt: str | bytes | None = None) -> list[bytes]:
    """One 16-byte key per full block of ``token_ids`` under ``layout``, isolated by ``salt``."""
    return chain_keys(token_ids, layout.block_size, chain_seed(layout.fingerprint(), salt))


__all__ = ["KEY_BYTES", "block_keys", "chain_keys", "chain_seed", "compose_salt"]
