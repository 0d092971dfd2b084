"""Shared cases of the ``rope_qkv`` tests (random projected tokens, rotary tables and a shuffled slot mapping) and of
``rope_decode_attention``'s (decode rows over a paged cache)."""

from __future__ import annotations

from dataclasses import dataclass

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


# (sequences as (context after the step, rows fed), H, Hkv, D, R/2, norm, block size, window, sinks): padding rows
# (context 0), one-token contexts, sequences fed several rows (a prompt fed row-wise, verify rows) across splits and
# blocks, the newest position at a block's first slot and mid-block, GLM's partial rotary, a window, sinks
DECODE_CASES = [
    ([(37, 1), (1, 1), (16, 3), (0, 1)], 4, 2, 16, 8, True, 16, None, False),
    ([(70, 5), (33, 1), (5, 2)], 4, 2, 16, 4, True, 4, None, False),
    ([(100, 1), (129, 4), (2, 2)], 4, 4, 32, 16, False, 16, 20, True),
    ([(9, 1), (64, 9)], 8, 1, 64, 32, False, 5, None, False),
]


@dataclass
class RopeDecodeCase:
    """One step's single-token rows for ``rope_decode_attention``: un-rotated q/k/v rows, a random cache holding the
    positions before each sequence's first row, block tables over a shuffled pool, each row's slot and its
    sequence's first position."""

    qkv: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    heads: int
    kv_heads: int
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    slots: torch.Tensor
    first_positions: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    window: int | None
    sinks: torch.Tensor | None

    def args(self) -> tuple:
        """``rope_decode_attention``'s positional arguments (eps 1e-6, scale ``D ** -0.5``)."""
        return (self.qkv, self.cos, self.sin, self.heads, self.kv_heads, self.q_norm, self.k_norm, 1e-6,
                self.k_cache, self.v_cache, self.slots, self.first_positions, self.block_tables, self.context_lens,
                self.k_cache.shape[-1] ** -0.5)

    def options(self) -> dict:
        return {"sliding_window": self.window, "sinks": self.sinks}

    def to(self, device: str) -> RopeDecodeCase:
        moved = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in vars(self).items()}
        return RopeDecodeCase(**moved)

    def workspace(self, splits: int) -> torch.Tensor | None:
        from epmoe.engine.paged_decode import paged_decode_workspace

        if splits == 1:
            return None
        q = self.qkv.new_empty(self.qkv.shape[0], self.heads, self.k_cache.shape[-1])
        return paged_decode_workspace(q, self.v_cache, splits)

    def reference(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``rope_qkv_reference`` on the live rows (every new key written first), then ``paged_decode_reference``,
        on CPU copies: the output ``[B, H, D]`` and the caches it leaves."""
        from epmoe.engine.paged_decode import paged_decode_reference
        from epmoe.engine.rope_attention import rope_qkv_reference

        c = self.to("cpu")
        k, v = c.k_cache.clone(), c.v_cache.clone()
        live = c.context_lens > 0
        q = c.qkv.new_zeros(c.qkv.shape[0], c.heads, k.shape[-1])
        q[live] = rope_qkv_reference(c.qkv[live], c.cos[live], c.sin[live], c.heads, c.kv_heads, c.q_norm, c.k_norm,
                                     1e-6, k, v, c.slots[live])
        out = paged_decode_reference(q, k, v, c.block_tables, c.context_lens, k.shape[-1] ** -0.5,
                                     sliding_window=c.window, sinks=c.sinks)
        return out, k, v


def make_rope_decode_case(seqs: list[tuple[int, int]], h: int, hkv: int, d: int, half: int, norm: bool, bs: int,
                          window: int | None, sinks: bool, dtype: torch.dtype) -> RopeDecodeCase:
    """A ``DECODE_CASES`` entry's inputs on the CPU, in ``dtype`` (the sinks in float32): each sequence's rows
    consecutive, in position order, with its block table."""
    gen = torch.Generator().manual_seed(len(seqs) * 100 + d)
    need = [max(1, -(-c // bs)) for c, _ in seqs]
    nb = sum(need) + 2
    tables = torch.randperm(nb, generator=gen)[:sum(need)].split(need)
    mb = max(need)
    ctx, first, table_rows = [], [], []
    for (c, n), t in zip(seqs, tables):
        rows = [c - n + 1 + i for i in range(n)] if c else [0]
        ctx += rows
        first += [max(0, c - n)] * len(rows)
        table_rows += [torch.cat([t, t.new_zeros(mb - len(t))])] * len(rows)
    b = len(ctx)
    block_tables = torch.stack(table_rows).to(torch.int32)
    context_lens = torch.tensor(ctx, dtype=torch.int32)
    newest = (context_lens - 1).clamp_min(0).long()
    slots = block_tables.long().gather(1, (newest // bs)[:, None])[:, 0] * bs + newest % bs
    freq = 1.0 / (10000 ** (torch.arange(half, dtype=torch.float32) / half))
    angle = newest.float()[:, None] * freq
    return RopeDecodeCase(
        torch.randn(b, (h + 2 * hkv) * d, generator=gen).to(dtype), torch.cos(angle).to(dtype),
        torch.sin(angle).to(dtype), h, hkv,
        (1 + 0.1 * torch.randn(d, generator=gen)).to(dtype) if norm else None,
        (1 + 0.1 * torch.randn(d, generator=gen)).to(dtype) if norm else None,
        torch.randn(nb, bs, hkv, d, generator=gen).to(dtype), torch.randn(nb, bs, hkv, d, generator=gen).to(dtype),
        slots, torch.tensor(first, dtype=torch.int32), block_tables, context_lens, window,
        torch.randn(h, generator=gen) if sinks else None)
