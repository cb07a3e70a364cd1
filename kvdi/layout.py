"""The KV layout contract: the shape of the paged cache and the one format version of stored KV.

Keys, frames, stores, p2p and the vLLM adapter all agree on a :class:`KVCacheSpec`; its
:meth:`~KVCacheSpec.fingerprint` changes whenever anything that decides how stored bytes are
read changes, including :data:`FORMAT_VERSION`. Importing this module imports no torch.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvdi.settings import KvdiSettings

FORMAT_VERSION = 3
"""Version of kvdi's stored-KV format (frame header and payload order); bump on any change."""

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
"""Bytes per element of each cache dtype kvdi supports."""


@dataclass(frozen=True)
class KVCacheSpec:
    """Shape of the paged KV cache; also the layout that stored KV must match.

    ``group`` names one of vLLM's KV cache groups (its kind, window, block size and layers)
    when a hybrid model stores each group on its own (empty otherwise); ``page_bytes``, when
    set, is one layer's block in bytes for state that is not K and V (vLLM's Mamba pages).
    ``block_order`` names the order of a stored block's bytes (vLLM's KV cache layouts:
    ``"nhc"`` or ``"hnc"``, :mod:`kvdi.integrations.vllm.views`; empty: kvdi's
    :attr:`block_shape`). Each enters the fingerprint only when set, so layouts without them
    keep theirs.
    """

    model_id: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str
    group: str = ""
    page_bytes: int = 0
    block_order: str = ""

    @classmethod
    def from_settings(cls, settings: KvdiSettings) -> KVCacheSpec:
        m, a = settings.model, settings.allocator
        return cls(m.model_id, m.num_layers, m.num_kv_heads, m.head_dim, a.block_size, a.dtype)

    @property
    def layer_names(self) -> tuple[str, ...]:
        """Names of the per-layer cache tensors, in forward order."""
        return tuple(f"layers.{i}" for i in range(self.num_layers))

    @property
    def block_shape(self) -> tuple[int, int, int, int]:
        """Shape of one block of one layer: ``(2, block_size, num_kv_heads, head_dim)``."""
        return (2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def layer_block_bytes(self) -> int:
        """Bytes of one block of one layer (K and V, or ``page_bytes`` when set)."""
        if self.page_bytes:
            return self.page_bytes
        return 2 * self.block_size * self.num_kv_heads * self.head_dim * DTYPE_BYTES[self.dtype]

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across all layers: the payload of one stored object."""
        return self.layer_block_bytes * self.num_layers

    def fingerprint(self) -> bytes:
        """16 bytes that change whenever any layout field or :data:`FORMAT_VERSION` changes."""
        text = "|".join(
            str(v)
            for v in (
                self.model_id,
                self.dtype,
                self.num_layers,
                self.num_kv_heads,
                self.head_dim,
                self.block_size,
                FORMAT_VERSION,
            )
        )
        if self.group or self.page_bytes:
            text += f"|group={self.group}|page={self.page_bytes}"
        if self.block_order:
            text += f"|order={self.block_order}"
        return hashlib.blake2b(text.encode(), digest_size=16).digest()


__all__ = ["DTYPE_BYTES", "FORMAT_VERSION", "KVCacheSpec"]
