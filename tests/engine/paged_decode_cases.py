"""Random paged-KV decode cases and a naive dense oracle, shared by the paged decode attention tests."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PagedCase:
    """One batch of inputs for ``paged_decode_attention`` (keyword options included)."""

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    scale: float
    sliding_window: int | None
    chunk_size: int | None
    sinks: torch.Tensor | None

    def args(self) -> tuple:
        return self.q, self.k_cache, self.v_cache, self.block_tables, self.context_lens, self.scale

    def options(self) -> dict:
        return {"sliding_window": self.sliding_window, "chunk_size": self.chunk_size, "sinks": self.sinks}


def make_case(seed: int, ctx: list[int], h: int, hkv: int, dk: int, dv: int, bs: int, *, mb: int | None = None,
              window: int | None = None, chunk: int | None = None, sinks: bool = False,
              dtype: torch.dtype = torch.float32, device: str = "cpu", strided_q: bool = False,
              spare_blocks: int = 3) -> PagedCase:
    """Random q/K/V (never zeros), block tables over a shuffled pool of blocks, random ids past each context."""
    g = torch.Generator().manual_seed(seed)
    b = len(ctx)
    need = [-(-c // bs) for c in ctx]
    mb = mb if mb is not None else max(1, max(need))
    nb = sum(need) + spare_blocks
    perm = torch.randperm(nb, generator=g)
    tables = torch.randint(0, nb, (b, mb), generator=g, dtype=torch.int64)   # arbitrary ids past the context
    used = 0
    for i, n in enumerate(need):
        tables[i, :n] = perm[used:used + n]
        used += n
    if strided_q:
        q = torch.randn(h, b, dk + 5, generator=g).transpose(0, 1)[:, :, 2:dk + 2]
    else:
        q = torch.randn(b, h, dk, generator=g)
    k = torch.randn(nb, bs, hkv, dk, generator=g)
    v = torch.randn(nb, bs, hkv, dv, generator=g)
    s = torch.randn(h, generator=g) * 2.0 if sinks else None
    return PagedCase(q.to(device=device, dtype=dtype), k.to(device=device, dtype=dtype),
                     v.to(device=device, dtype=dtype), tables.to(device=device, dtype=torch.int32),
                     torch.tensor(ctx, dtype=torch.int32, device=device), dk ** -0.5, window, chunk,
                     None if s is None else s.to(device))


def naive_dense(c: PagedCase) -> torch.Tensor:
    """Float64 oracle: per sequence, gather the kept K/V rows into dense tensors, mask, softmax with the sink."""
    b, h, _ = c.q.shape
    _, bs, hkv, dv = c.v_cache.shape
    out = torch.zeros(b, h, dv, dtype=torch.float64)
    tables = c.block_tables.cpu().long()
    for i, n in enumerate(c.context_lens.cpu().tolist()):
        if n == 0:
            continue
        pos = torch.arange(n)
        k = c.k_cache.cpu().double()[tables[i, pos // bs], pos % bs]            # [n, Hkv, Dk]
        v = c.v_cache.cpu().double()[tables[i, pos // bs], pos % bs]            # [n, Hkv, Dv]
        keep = torch.ones(n, dtype=torch.bool)
        if c.sliding_window is not None:
            keep &= pos > n - 1 - c.sliding_window
        if c.chunk_size is not None:
            keep &= pos // c.chunk_size == (n - 1) // c.chunk_size
        for hh in range(h):
            kv = hh // (h // hkv)
            logits = (k[:, kv] @ c.q[i, hh].cpu().double()) * c.scale
            logits = torch.where(keep, logits, torch.tensor(float("-inf"), dtype=torch.float64))
            if c.sinks is not None:
                logits = torch.cat([logits, c.sinks[hh].cpu().double().reshape(1)])
            p = torch.softmax(logits, dim=0)[:n]
            out[i, hh] = p @ v[:, kv]
    return out


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want| in float64."""
    want = want.double().cpu()
    return ((got.double().cpu() - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


# (ctx lens, H, Hkv, Dk, Dv, BS, options): GQA ratios 1/2/4/8, MQA, Dk != Dv, block sizes 1/16/5,
# windows, chunks, sinks, padding rows.
CASES = [
    ([37, 1, 16], 4, 2, 16, 16, 16, {}),
    ([5, 0, 9, 3], 8, 1, 24, 40, 1, {}),
    ([70, 33], 6, 6, 48, 32, 16, {"strided_q": True}),
    ([100, 5, 128], 8, 2, 32, 32, 16, {"window": 20, "sinks": True}),
    ([64, 65, 10, 0], 4, 4, 16, 16, 16, {"chunk": 32}),
    ([50, 31, 0, 7], 8, 4, 16, 24, 1, {"window": 9, "chunk": 16, "sinks": True}),
    ([300, 129, 128, 0], 16, 2, 64, 64, 16, {"window": 128, "sinks": True}),
    ([12, 200], 4, 2, 20, 12, 5, {"window": 500, "mb": 50}),
    ([0, 0], 4, 2, 16, 16, 16, {"sinks": True}),
    ([193], 4, 1, 96, 64, 16, {"chunk": 64}),
]
