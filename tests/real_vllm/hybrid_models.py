"""Tiny random hybrid models for the real-vLLM tests, written with transformers at test time (no downloads).

- :func:`make_tiny_gemma3`: sliding-window and full-attention layers (vLLM: one KV cache group per kind);
- :func:`make_tiny_qwen3_next`: linear attention (gated DeltaNet) beside full attention, bf16.

Nothing here imports vLLM; engines run in subprocesses (``engine_run.py``).
"""

from __future__ import annotations

import re
from pathlib import Path

from tests.real_vllm.vllm_support import VOCAB

SLIDING_WINDOW = 64
"""Tokens in the tiny Gemma3's sliding window (two 32-token blocks)."""


def _noisy_norms(model: object) -> None:
    """Random norm weights: with all-equal norms a random tiny model greedily repeats one token id."""
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():  # type: ignore[attr-defined]
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.5)


def make_tiny_gemma3(directory: Path, *, window: int = SLIDING_WINDOW) -> Path:
    """Write a random 4-layer Gemma3 (sliding, full, sliding, full; head_dim 32) to ``directory``."""
    if (directory / "config.json").exists():
        return directory
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig  # type: ignore[import-not-found,unused-ignore]

    torch.manual_seed(0)
    config = Gemma3TextConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        query_pre_attn_scalar=32,
        sliding_window=window,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    model = Gemma3ForCausalLM(config).to(torch.float32)
    _noisy_norms(model)
    model.save_pretrained(directory, safe_serialization=True)
    return directory


def max_concurrency(log_text: str) -> float:
    """vLLM's logged "Maximum concurrency for N tokens per request: Xx" (the last one in ``log_text``)."""
    found = re.findall(r"Maximum concurrency for [\d,]+ tokens per request: ([\d.]+)x", log_text)
    if not found:
        raise AssertionError("vLLM logged no maximum concurrency")
    return float(found[-1])


def make_tiny_qwen3_next(directory: Path) -> Path:
    """Write a random 2-layer Qwen3-Next (gated DeltaNet linear attention, then full attention; bf16, MoE)."""
    if (directory / "config.json").exists():
        return directory
    import torch
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM  # type: ignore[import-not-found,unused-ignore]

    torch.manual_seed(0)
    config = Qwen3NextConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        linear_key_head_dim=128,  # vLLM's CPU kernels need 128
        linear_value_head_dim=128,
        linear_num_key_heads=1,
        linear_num_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
        layer_types=["linear_attention", "full_attention"],
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = Qwen3NextForCausalLM(config).to(torch.bfloat16)
    _noisy_norms(model)
    model.save_pretrained(directory, safe_serialization=True)
    return directory
