"""Shared cases of ``engine.mla_rope``'s tests: random queries, projections, rotary tables, a latent pool and the
slots a step writes."""

import torch

# (tokens, heads, nope_dim, rope, kv_lora_rank, interleave)
CASES = [
    (3, 4, 8, 8, 16, True),
    (5, 2, 16, 8, 24, False),
    (1, 64, 128, 64, 512, True),
    (4, 3, 0, 4, 12, False),
]


def make_mla_rope_case(t: int, h: int, dn: int, dr: int, rank: int, dtype: torch.dtype, slots: int = 40,
                       seed: int = 0):
    """``(q, compressed, cos, sin, norm_weight, pool, slot_mapping)``; ``cos``/``sin`` as transformers gives them
    (``cat(freqs, freqs)`` times a scale), the pool zero, the slots distinct."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(t, h, dn + dr, generator=g).to(dtype)
    compressed = torch.randn(t, rank + dr, generator=g).to(dtype)
    angles = torch.rand(t, dr // 2, generator=g) * 6.0
    cos = (torch.cat([angles, angles], -1).cos() * 1.1).to(dtype)
    sin = (torch.cat([angles, angles], -1).sin() * 1.1).to(dtype)
    weight = (torch.rand(rank, generator=g) + 0.5).to(dtype)
    pool = torch.zeros(slots, rank + dr, dtype=dtype)
    slot_mapping = torch.randperm(slots, generator=g)[:t]
    return q, compressed, cos, sin, weight, pool, slot_mapping
