"""MLA's work between its projections and its attention, as one kernel: the latent's norm, the rotary embedding of
the queries and of the shared rotary key, and the write of each token's latent entry into the cache.

After ``q_b_proj`` (or ``q_proj``) and ``kv_a_proj_with_mqa``, transformers' MLA attention (DeepSeek-V3, Kimi-K2)
normalises the compressed latent (``kv_a_layernorm``), rotates the last ``qk_rope_head_dim`` values of every
query head and the rotary key (``apply_rotary_pos_emb`` or, with ``rope_interleave``,
``apply_rotary_pos_emb_interleave``: some ten elementwise launches, slices, products, sums and concatenations), and
the engine then writes ``[c_kv, k_rope]`` into the latent cache (a concatenation and a scatter). At one decode token
those launches cost several times what they read. ``mla_rope_write`` does it in one launch (grid ``(T, G + 1)``):
programs ``g < G`` rotate the rotary parts of query heads ``g * HB .. g * HB + HB - 1`` in place, program ``G``
normalises the token's latent, rotates its key and stores both into the token's cache slot. ``HB`` is one head at
small batches (many one-warp programs, the shortest chain) and ``WIDE_HEADS`` heads from ``WIDE_MIN_ROWS`` head
rows (``rope_heads_per_program``): a program of one head moves 4 * ``rope`` bytes, so at large batches and in
prefill the launch would otherwise be tens of thousands of programs doing almost nothing each.

Rotary embedding: pairs ``(x1, x2)`` are rotated to ``(x1 c - x2 s, x2 c + x1 s)`` and stored as the two halves
``[x1 c - x2 s, x2 c + x1 s]``, with ``c, s`` the first half of the model's own cosine and sine (``cat(freqs,
freqs)``, any scaling the rotary module applies kept). The pairs are the two halves of the rotary part
(``rotate_half``), or its even and odd values with ``rope_interleave``, which transformers rotates into the same
half layout. Norm: transformers' RMSNorm (mean of squares in float32, the normalised row cast to the input dtype,
times the weight). Arithmetic in float32 with one rounding per stored value, where transformers rounds after each
elementwise product and sum in the model dtype (the same in float32). CUDA runs the Triton kernel, CPU
``mla_rope_write_reference``. DeepSeek-V2's complex rotary keeps transformers' function (``engine.mla``).
"""

from __future__ import annotations

import functools

import torch

from epmoe.checks import check_int, is_int
from epmoe.experts.triton.pdl import pdl_launch

WIDE_HEADS = 16
"""Query heads a program rotates from ``WIDE_MIN_ROWS`` head rows on (``rope_heads_per_program``)."""

MAX_HEADS_PER_PROGRAM = 64
"""The most query heads ``mla_rope_write_triton`` lets one program rotate (``heads_per_program``)."""

WIDE_MIN_ROWS = 4096
"""Tokens times query heads from which a program rotates ``WIDE_HEADS`` heads (DeepSeek-V3 from 32 tokens, Kimi-K2
from 64), not one."""


def rope_heads_per_program(tokens: int, heads: int) -> int:
    """Query heads one program of ``mla_rope_write``'s launch rotates: 1 below ``WIDE_MIN_ROWS`` head rows, else
    ``WIDE_HEADS`` (fewer where the model has fewer, a power of two).

    Raises:
        ValueError: ``tokens`` not an integer >= 0 or ``heads`` not an integer >= 1 (named)."""
    tokens = check_int("rope_heads_per_program: tokens", tokens, 0)
    heads = check_int("rope_heads_per_program: heads", heads, 1)
    if tokens * heads < WIDE_MIN_ROWS:
        return 1
    return min(WIDE_HEADS, 1 << (heads - 1).bit_length())


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def mla_rope_kernel(q_ptr, c_ptr, cos_ptr, sin_ptr, nw_ptr, cache_ptr, slot_ptr,
                        stride_qt, stride_qh, stride_ct, stride_cos, stride_cache, eps,
                        H: tl.constexpr, HB: tl.constexpr, DN: tl.constexpr, HALF: tl.constexpr, R: tl.constexpr,
                        R_PAD: tl.constexpr, INTERLEAVE: tl.constexpr, PDL: tl.constexpr):
        if PDL:  # everything it reads but the norm weight comes from the projections before: wait at once
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        t = tl.program_id(0).to(tl.int64)
        g = tl.program_id(1)
        i = tl.arange(0, HALF)
        if INTERLEAVE:
            p1 = 2 * i
            p2 = 2 * i + 1
        else:
            p1 = i
            p2 = HALF + i
        c = tl.load(cos_ptr + t * stride_cos + i).to(tl.float32)
        s = tl.load(sin_ptr + t * stride_cos + i).to(tl.float32)
        if g * HB < H:  # HB query heads' rotary parts, in place (both values are loaded before either store)
            h = g * HB + tl.arange(0, HB)
            ok = (h < H)[:, None]
            base = q_ptr + t * stride_qt + h[:, None] * stride_qh + DN
            x1 = tl.load(base + p1[None, :], mask=ok).to(tl.float32)
            x2 = tl.load(base + p2[None, :], mask=ok).to(tl.float32)
            tl.store(base + i[None, :], (x1 * c[None, :] - x2 * s[None, :]).to(q_ptr.dtype.element_ty), mask=ok)
            tl.store(base + HALF + i[None, :], (x2 * c[None, :] + x1 * s[None, :]).to(q_ptr.dtype.element_ty),
                     mask=ok)
        else:  # the token's latent entry: normalised c_kv, then the rotated key
            row = c_ptr + t * stride_ct
            r = tl.arange(0, R_PAD)
            r_ok = r < R
            x = tl.load(row + r, mask=r_ok, other=0.0).to(tl.float32)
            inv = tl.rsqrt(tl.sum(x * x, 0) / R + eps)
            w = tl.load(nw_ptr + r, mask=r_ok, other=0.0).to(tl.float32)
            y = (x * inv).to(c_ptr.dtype.element_ty).to(tl.float32) * w
            k1 = tl.load(row + R + p1).to(tl.float32)
            k2 = tl.load(row + R + p2).to(tl.float32)
            dst = cache_ptr + tl.load(slot_ptr + t) * stride_cache
            tl.store(dst + r, y.to(cache_ptr.dtype.element_ty), mask=r_ok)
            tl.store(dst + R + i, (k1 * c - k2 * s).to(cache_ptr.dtype.element_ty))
            tl.store(dst + R + HALF + i, (k2 * c + k1 * s).to(cache_ptr.dtype.element_ty))

    return triton, mla_rope_kernel


def _check(q: torch.Tensor, compressed: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
           norm_weight: torch.Tensor, pool: torch.Tensor, slot_mapping: torch.Tensor, nope_dim: int) -> None:
    t, _, width = q.shape
    rank = norm_weight.shape[0]
    rope = width - nope_dim
    if q.stride(-1) != 1 or compressed.stride(-1) != 1:
        raise ValueError(f"q {q.stride()} and compressed {compressed.stride()} must be contiguous along their last "
                         "dimension")
    if rope <= 0 or rope % 2 or rope & (rope - 1):
        raise ValueError(f"the rotary part of a query head (width {width} - nope_dim {nope_dim} = {rope}) must be a "
                         "positive power of two")
    if norm_weight.dim() != 1 or compressed.shape != (t, rank + rope):
        raise ValueError(f"compressed {tuple(compressed.shape)} must be [T={t}, kv_lora_rank + rope = {rank + rope}] "
                         f"(norm_weight {tuple(norm_weight.shape)})")
    if cos.shape != (t, rope) or sin.shape != cos.shape or cos.stride() != sin.stride() or cos.stride(-1) != 1:
        raise ValueError(f"cos {tuple(cos.shape)} {cos.stride()} and sin {tuple(sin.shape)} {sin.stride()} must both "
                         f"be [T={t}, {rope}] with the same strides, contiguous along the last dimension")
    if pool.dim() != 2 or pool.shape[1] != rank + rope or not pool.is_contiguous():
        raise ValueError(f"the latent pool must be [slots, {rank + rope}] contiguous, got {tuple(pool.shape)}")
    if slot_mapping.shape != (t,) or slot_mapping.dtype != torch.int64:
        raise ValueError(f"slot_mapping must be [T={t}] int64, got {tuple(slot_mapping.shape)} {slot_mapping.dtype}")


def mla_rope_write_reference(q: torch.Tensor, compressed: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                             norm_weight: torch.Tensor, eps: float, pool: torch.Tensor, slot_mapping: torch.Tensor,
                             nope_dim: int, interleave: bool) -> None:
    """``mla_rope_write`` in PyTorch (CPU, and the kernel's test reference); same arguments and effect."""
    rank = norm_weight.shape[0]
    half = (q.shape[-1] - nope_dim) // 2

    def rotate(x: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        x = x.float()
        x1, x2 = (x[..., 0::2], x[..., 1::2]) if interleave else (x[..., :half], x[..., half:])
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)

    c, s = cos[:, :half].float(), sin[:, :half].float()
    q[..., nope_dim:] = rotate(q[..., nope_dim:], c[:, None], s[:, None]).to(q.dtype)
    x = compressed[:, :rank].float()
    normed = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)).to(compressed.dtype).float()
    entry = torch.cat([normed * norm_weight.float(), rotate(compressed[:, rank:], c, s)], dim=-1)
    pool.index_copy_(0, slot_mapping, entry.to(pool.dtype))


def mla_rope_write(q: torch.Tensor, compressed: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   norm_weight: torch.Tensor, eps: float, pool: torch.Tensor, slot_mapping: torch.Tensor,
                   nope_dim: int, interleave: bool) -> None:
    """Rotate the queries' rotary parts in place and store each token's latent entry ``[norm(c_kv), rope(k_rope)]``.

    CUDA tensors run one Triton launch (grid ``(T, ceil(H / HB) + 1)``, ``HB`` from ``rope_heads_per_program``), CPU
    tensors ``mla_rope_write_reference``. No host synchronisation (CUDA-graph safe).

    Args:
        q: ``[T, H, nope_dim + rope]`` the queries (``q_b_proj``'s output per head), contiguous along the last
            dimension; the last ``rope`` values of each head are rotated in place.
        compressed: ``[T, kv_lora_rank + rope]`` ``kv_a_proj_with_mqa``'s output (the latent, then the rotary key),
            in ``q``'s dtype.
        cos, sin: ``[T, rope]`` the model's rotary cosine and sine (``cat(freqs, freqs)``: the first half is read),
            same strides, contiguous along the last dimension.
        norm_weight: ``[kv_lora_rank]`` ``kv_a_layernorm``'s weight; eps: its epsilon.
        pool: ``[slots, kv_lora_rank + rope]`` the layer's latent cache, flat over its blocks, contiguous.
        slot_mapping: ``[T]`` int64 flat cache slot of each token.
        nope_dim: ``qk_nope_head_dim``.
        interleave: the rotary pairs are interleaved (DeepSeek-V3's ``rope_interleave``), else halves.

    Raises:
        ValueError: shapes, strides or dtypes that do not agree (named); ``rope`` not a power of two.
    """
    _check(q, compressed, cos, sin, norm_weight, pool, slot_mapping, nope_dim)
    run = mla_rope_write_triton if q.device.type == "cuda" else mla_rope_write_reference
    run(q, compressed, cos, sin, norm_weight, eps, pool, slot_mapping, nope_dim, interleave)


def mla_rope_write_triton(q: torch.Tensor, compressed: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                          norm_weight: torch.Tensor, eps: float, pool: torch.Tensor, slot_mapping: torch.Tensor,
                          nope_dim: int, interleave: bool, heads_per_program: int | None = None) -> None:
    """``mla_rope_write``'s Triton launch (CUDA, or CPU tensors under the Triton interpreter); arguments checked
    there. ``heads_per_program``: a power of two up to ``MAX_HEADS_PER_PROGRAM``, ``rope_heads_per_program`` where
    ``None`` (tests choose it).

    Raises:
        ValueError: ``heads_per_program`` not a power of two in ``[1, MAX_HEADS_PER_PROGRAM]``."""
    t, h, width = q.shape
    hb = rope_heads_per_program(t, h) if heads_per_program is None else heads_per_program
    if not is_int(hb) or not 1 <= hb <= MAX_HEADS_PER_PROGRAM or hb & (hb - 1):
        raise ValueError(f"heads_per_program must be a power of two from 1 to {MAX_HEADS_PER_PROGRAM}, got {hb!r}")
    hb = int(hb)
    if not t:
        return
    triton, kernel = _kernel()
    rank = norm_weight.shape[0]
    pdl = pdl_launch(q)
    kernel[(t, triton.cdiv(h, hb) + 1)](
        q, compressed, cos, sin, norm_weight, pool, slot_mapping,
        q.stride(0), q.stride(1), compressed.stride(0), cos.stride(0), pool.stride(0), float(eps),
        H=h, HB=hb, DN=nope_dim, HALF=(width - nope_dim) // 2, R=rank, R_PAD=triton.next_power_of_2(rank),
        INTERLEAVE=interleave, PDL=pdl, num_warps=1 if hb == 1 else 4, launch_pdl=pdl,
    )
