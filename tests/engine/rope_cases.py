"""Shared cases of the ``rope_qkv`` tests: random projected tokens, rotary tables and a shuffled slot mapping."""

from __future__ import annotations

import torch

# (H, Hkv, D, R/2 rotated half, per-head norm)
CASES = [
    (4, 2, 16, 8, True),     # Qwen3-MoE: GQA, full rotary, q/k norm
    (4, 2, 16, 4, True),     # GLM-4.5: rotary on half of each head, q/k norm
    (4, 4, 32, 16, False),   # Mixtral / Qwen2-MoE / gpt-oss: no norm
    (8, 1, 64, 32, False),   # one kv head
]


def make_rope_case(h: int, hkv: int, d: int, half: int, norm: bool, dtype: torch.dtype, t: int = 5,
                   num_blocks: int = 6, block_size: int = 4, seed: int = 0):
    """``(qkv, cos, sin, q_norm, k_norm, k_cache, v_cache, slots)`` with every token in its own shuffled slot."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(t, (h + 2 * hkv) * d, generator=gen).to(dtype)
    pos = torch.arange(t, dtype=torch.float32)[:, None] * 3 + 1
    freq = 1.0 / (10000 ** (torch.arange(half, dtype=torch.float32) / half))
    cos, sin = torch.cos(pos * freq).to(dtype), torch.sin(pos * freq).to(dtype)
    q_norm = (1 + 0.1 * torch.randn(d, generator=gen)).to(dtype) if norm else None
    k_norm = (1 + 0.1 * torch.randn(d, generator=gen)).to(dtype) if norm else None
    k_cache = torch.zeros(num_blocks, block_size, hkv, d, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.randperm(num_blocks * block_size - block_size, generator=gen)[:t] + block_size
    return qkv, cos, sin, q_norm, k_norm, k_cache, v_cache, slots
