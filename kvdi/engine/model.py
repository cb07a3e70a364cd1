"""A small decoder-only transformer whose attention reads and writes the paged KV cache.

Weights are random but fixed by ``ModelSettings.seed`` (drawn on the CPU in float32, so two
processes with the same settings hold the same model). Each layer's cache is one tensor of
shape ``[num_blocks, 2, block_size, num_kv_heads, head_dim]``; a sequence's block table maps
its token positions to blocks, so position ``p`` lives in block ``block_ids[p // block_size]``
at offset ``p % block_size``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvdi.allocator import AllocationPlan
from kvdi.layout import KVCacheSpec
from kvdi.settings import ModelSettings

LayerHook = Callable[[str], None]
ROPE_THETA = 10000.0
NORM_EPS = 1e-6


@dataclass(frozen=True)
class SequenceChunk:
    """Tokens ``[start, start + len(token_ids))`` of one sequence, computed against its block table.

    KV for positions ``[0, start)`` must already be in the cache (computed earlier or loaded).
    """

    token_ids: Sequence[int]
    start: int
    block_ids: Sequence[int]

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)


@dataclass(frozen=True)
class _Layer:
    attn_norm: torch.Tensor
    wq: torch.Tensor
    wk: torch.Tensor
    wv: torch.Tensor
    wo: torch.Tensor
    mlp_norm: torch.Tensor
    w_gate: torch.Tensor
    w_up: torch.Tensor
    w_down: torch.Tensor


class TransformerModel:
    """Embedding, ``num_layers`` x (RMSNorm, rotary GQA attention over the paged cache, SwiGLU MLP), norm, logits."""

    def __init__(self, model_settings: ModelSettings, layout: KVCacheSpec, plan: AllocationPlan) -> None:
        m = model_settings
        if m.head_dim % 2:
            raise ValueError(f"model.head_dim must be even for rotary positions, got {m.head_dim}")
        if (m.num_layers, m.num_kv_heads, m.head_dim) != (layout.num_layers, layout.num_kv_heads, layout.head_dim):
            raise ValueError(f"model settings {m} do not match the KV cache layout {layout}")
        self.settings = m
        self.layout = layout
        self.device = torch.device(plan.device)
        self.dtype: torch.dtype = getattr(torch, layout.dtype)
        self.layer_names = layout.layer_names
        self._scale = 1.0 / math.sqrt(m.head_dim)
        gen = torch.Generator(device="cpu").manual_seed(m.seed)

        def weight(rows: int, cols: int) -> torch.Tensor:
            w = torch.randn(rows, cols, generator=gen, dtype=torch.float32) / math.sqrt(cols)
            return w.to(device=self.device, dtype=self.dtype)

        def ones(n: int) -> torch.Tensor:
            return torch.ones(n, device=self.device, dtype=self.dtype)

        h, q_dim, kv_dim, inter = (
            m.hidden_size,
            m.num_heads * m.head_dim,
            m.num_kv_heads * m.head_dim,
            m.intermediate_size,
        )
        self.embedding = torch.randn(m.vocab_size, h, generator=gen, dtype=torch.float32).to(self.device, self.dtype)
        self.layers = tuple(
            _Layer(
                attn_norm=ones(h),
                wq=weight(q_dim, h),
                wk=weight(kv_dim, h),
                wv=weight(kv_dim, h),
                wo=weight(h, q_dim),
                mlp_norm=ones(h),
                w_gate=weight(inter, h),
                w_up=weight(inter, h),
                w_down=weight(h, inter),
            )
            for _ in range(m.num_layers)
        )
        self.final_norm = ones(h)
        self.lm_head = weight(m.vocab_size, h)
        half = m.head_dim // 2
        self._inv_freq = 1.0 / (ROPE_THETA ** (torch.arange(half, dtype=torch.float32, device=self.device) / half))

    @torch.inference_mode()
    def forward(
        self,
        chunks: Sequence[SequenceChunk],
        kv_caches: Mapping[str, torch.Tensor],
        *,
        before_attention: LayerHook | None = None,
        after_attention: LayerHook | None = None,
    ) -> torch.Tensor:
        """Compute every chunk, writing its KV into ``kv_caches``; return the logits of each chunk's last token.

        Returns a float32 tensor ``[len(chunks), vocab_size]``. ``before_attention(name)`` runs
        before a layer reads the cache, ``after_attention(name)`` after it wrote its KV.
        """
        if not chunks:
            return torch.empty(0, self.settings.vocab_size)
        for chunk in chunks:
            self._check(chunk)
        tokens = torch.tensor([t for c in chunks for t in c.token_ids], dtype=torch.long, device=self.device)
        if int(tokens.min()) < 0 or int(tokens.max()) >= self.settings.vocab_size:
            raise ValueError(f"token ids must be in [0, {self.settings.vocab_size}) (model.vocab_size)")
        positions = torch.cat([torch.arange(c.start, c.end, device=self.device) for c in chunks])
        cos, sin = self._rotary(positions)
        x = self.embedding[tokens]
        for name, layer in zip(self.layer_names, self.layers, strict=True):
            cache = kv_caches[name]
            h = _rms_norm(x, layer.attn_norm)
            q = (h @ layer.wq.T).view(len(tokens), self.settings.num_heads, -1)
            k = (h @ layer.wk.T).view(len(tokens), self.settings.num_kv_heads, -1)
            v = (h @ layer.wv.T).view(len(tokens), self.settings.num_kv_heads, -1)
            q, k = _apply_rotary(q, cos, sin), _apply_rotary(k, cos, sin)
            if before_attention is not None:
                before_attention(name)
            attn = self._attention(chunks, q, k, v, cache)
            if after_attention is not None:
                after_attention(name)
            x = x + attn @ layer.wo.T
            h = _rms_norm(x, layer.mlp_norm)
            x = x + (F.silu(h @ layer.w_gate.T) * (h @ layer.w_up.T)) @ layer.w_down.T
        last = torch.tensor([0, *(len(c.token_ids) for c in chunks)], device=self.device).cumsum(0)[1:] - 1
        out = _rms_norm(x[last], self.final_norm) @ self.lm_head.T
        return out.float().cpu()

    def _attention(
        self, chunks: Sequence[SequenceChunk], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor
    ) -> torch.Tensor:
        bs = self.layout.block_size
        outputs = []
        offset = 0
        for chunk in chunks:
            n = len(chunk.token_ids)
            table = torch.tensor(chunk.block_ids, dtype=torch.long, device=self.device)
            pos = torch.arange(chunk.start, chunk.end, device=self.device)
            blocks, slots = table[pos // bs], pos % bs
            cache[blocks, 0, slots] = k[offset : offset + n]
            cache[blocks, 1, slots] = v[offset : offset + n]
            # Gather exactly positions [0, end): unwritten slots of the last block are never read.
            used = table[: -(-chunk.end // bs)]
            kv_shape = (-1, self.settings.num_kv_heads, self.settings.head_dim)
            keys = cache[used, 0].reshape(kv_shape)[: chunk.end].transpose(0, 1)[None]
            values = cache[used, 1].reshape(kv_shape)[: chunk.end].transpose(0, 1)[None]
            query = q[offset : offset + n].transpose(0, 1)[None]
            # 4-D inputs reach the fused CPU/CUDA kernels; 3-D ones fall back to the slow math path.
            if chunk.start == 0:
                out = F.scaled_dot_product_attention(
                    query, keys, values, is_causal=True, scale=self._scale, enable_gqa=True
                )
            else:
                mask = torch.arange(chunk.end, device=self.device)[None, :] <= pos[:, None]
                out = F.scaled_dot_product_attention(
                    query, keys, values, attn_mask=mask, scale=self._scale, enable_gqa=True
                )
            outputs.append(out[0].transpose(0, 1).reshape(n, -1))
            offset += n
        return torch.cat(outputs)

    def _rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self._inv_freq[None, :]
        return freqs.cos().to(self.dtype)[:, None, :], freqs.sin().to(self.dtype)[:, None, :]

    def _check(self, chunk: SequenceChunk) -> None:
        if not chunk.token_ids:
            raise ValueError("a chunk must hold at least one token")
        if chunk.end > self.settings.max_model_len:
            raise ValueError(f"position {chunk.end - 1} exceeds model.max_model_len={self.settings.max_model_len}")
        if -(-chunk.end // self.layout.block_size) > len(chunk.block_ids):
            raise ValueError(f"block table of {len(chunk.block_ids)} blocks cannot hold {chunk.end} tokens")


def _rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + NORM_EPS) * weight


def _apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)
