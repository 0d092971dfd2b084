"""W4A16 expert compute in Triton for INT4 group-quantized weights (``experts.int4``), bf16 activations.

The weights stay packed in HBM (a quarter of the bf16 bytes plus one scale per ``G`` inputs). Two paths, both
with static grids and no host synchronisation (CUDA-graph safe); ``int4_experts`` picks one from static sizes:

Decode (``int4_decode_experts``; up to ``max(DECODE_MAX_PAIRS, S)`` pairs, ``S`` the local slots), three
launches, no alignment, one matrix-vector product per (token, k) pair on the CUDA cores, reading the packed
weights directly:

1. ``_decode_gate_up_kernel``, grid ``(cdiv(F, BLOCK_N1), N)``: program ``(j, p)`` reads ``BLOCK_N1`` gate rows
   and ``BLOCK_N1`` up rows of pair ``p``'s expert, ``BLOCK_KW1`` int32 words (``8 * BLOCK_KW1`` inputs) a
   step, as ``[BLOCK_N, BLOCK_KW]`` words; each word is split into its eight 4-bit fields against the
   matching ``[BLOCK_KW, 8]`` inputs, the products summed per group of ``G`` inputs and multiplied by that
   group's scale. The offset ``-8`` of the stored values is applied once per word, as ``-8 * sum(x)``, not per
   value. Bias, routing weight and activation follow; ``h [N, F]`` float32. Programs of pairs served on other
   ranks (slot ``-1``) exit at once.
2. ``_decode_down_kernel``, grid ``(cdiv(D, BLOCK_N2), N)``: the same over ``w2`` with ``h``; ``y [N, D]``.
3. ``grouped.sum_pairs_kernel``: ``out[t] = sum_k y[t * K + k]``.

Every pair re-reads its expert's weights, so the decode path's cost grows with the pairs; the other path's
grows with the local slots:

Dequantized (``int4_dequantized_experts``; more pairs): the slots that have at least one live pair are
widened to the compute dtype in one launch (``_dequantize_kernel``: one read of their packed weights, one
write of the widened ones, into a workspace the size of the bf16 experts; slots without pairs are skipped),
then ``grouped.triton_experts`` runs the grouped bf16 GEMMs on them. The weights are stored in INT4; this
path computes as the bf16 one does, plus the widening.

Source: the packed format is compressed-tensors' ``pack-quantized`` (see ``experts.int4``); splitting the
widening from the GEMM for large batches is what vLLM's compressed-tensors MoE does where no fused W4A16 GEMM
applies. The code is our own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from epmoe.experts.int4 import INT4_PACK, Int4ExpertWeights
from epmoe.experts.triton.decode import DECODE_MAX_PAIRS, gated_activation
from epmoe.experts.triton.grouped import act_code, sum_pairs_kernel, triton_experts
from epmoe.experts.weights import Activation, ExpertWeights


@dataclass(frozen=True)
class Int4DecodeConfig:
    """Tile shapes of the INT4 decode kernels.

    Attributes:
        block_n1: gate (and up) rows per gate/up program.
        block_kw1: int32 words (8 inputs each) of ``D`` per step of the gate/up program; ``8 * block_kw1`` a
            multiple of the group size.
        block_n2: ``w2`` rows (output columns) per down program.
        block_kw2: words of ``F`` per step of the down program.
        num_warps: warps per program.
    """

    block_n1: int = 8
    block_kw1: int = 128
    block_n2: int = 16
    block_kw2: int = 128
    num_warps: int = 4


@triton.jit
def _matvec_int4(w_ptrs, s_ptrs, x_ptrs, n_ok, KW, BLOCK_N: tl.constexpr, BLOCK_KW: tl.constexpr,
                 GROUP: tl.constexpr):
    """``sum_k W[n, k] * x[k]`` for ``BLOCK_N`` rows: ``w_ptrs [BLOCK_N, BLOCK_KW]`` at the rows' first words,
    ``s_ptrs [BLOCK_N, BLOCK_KW * 8 / GROUP]`` at their first scales, ``x_ptrs [BLOCK_KW, 8]`` at the inputs;
    ``KW`` words a row."""
    GW: tl.constexpr = GROUP // 8  # words per group
    NG: tl.constexpr = BLOCK_KW // GW  # groups per step
    offs_w = tl.arange(0, BLOCK_KW)
    offs_g = tl.arange(0, NG)
    shifts = (tl.arange(0, 8) * 4)[None, None, :]
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for kw0 in range(0, KW, BLOCK_KW):
        w_ok = offs_w < KW - kw0
        words = tl.load(w_ptrs + kw0, mask=n_ok[:, None] & w_ok[None, :], other=0)
        x = tl.load(x_ptrs + kw0 * 8, mask=w_ok[:, None], other=0.0).to(tl.float32)
        sc = tl.load(s_ptrs + kw0 // GW, mask=n_ok[:, None] & (offs_g < (KW - kw0) // GW)[None, :], other=0.0)
        nib = ((words[:, :, None] >> shifts) & 0xF).to(tl.float32)
        part = tl.sum(nib * x[None, :, :], axis=2) - 8.0 * tl.sum(x, axis=1)[None, :]  # [BLOCK_N, BLOCK_KW]
        per_group = tl.sum(tl.reshape(part, (BLOCK_N, NG, GW)), axis=2)
        acc += tl.sum(per_group * sc.to(tl.float32), axis=1)
    return acc


@triton.jit
def _decode_gate_up_kernel(
    x_ptr, slots_ptr, tw_ptr, w_ptr, s_ptr, b_ptr, h_ptr, num_slots, top_k, F, DW,
    stride_x, stride_we, stride_wn, stride_se, stride_sn, act_limit, act_alpha,
    BLOCK_N: tl.constexpr, BLOCK_KW: tl.constexpr, GROUP: tl.constexpr, ACT: tl.constexpr,
    HAS_BIAS: tl.constexpr, WEIGHT_ON_INPUT: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pair = tl.program_id(1)
    slot = tl.load(slots_ptr + pair)
    if (slot < 0) | (slot >= num_slots):
        return
    slot = slot.to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < F
    rows = offs_n[:, None].to(tl.int64)
    w_ptrs = w_ptr + slot * stride_we + rows * stride_wn + tl.arange(0, BLOCK_KW)[None, :]
    s_ptrs = s_ptr + slot * stride_se + rows * stride_sn + tl.arange(0, BLOCK_KW // (GROUP // 8))[None, :]
    x_ptrs = (x_ptr + (pair // top_k).to(tl.int64) * stride_x + tl.arange(0, BLOCK_KW)[:, None] * 8
              + tl.arange(0, 8)[None, :])
    g = _matvec_int4(w_ptrs, s_ptrs, x_ptrs, n_ok, DW, BLOCK_N, BLOCK_KW, GROUP)
    u = _matvec_int4(w_ptrs + F * stride_wn, s_ptrs + F * stride_sn, x_ptrs, n_ok, DW, BLOCK_N, BLOCK_KW, GROUP)
    tw = tl.load(tw_ptr + pair)
    if WEIGHT_ON_INPUT:
        g *= tw
        u *= tw
    if HAS_BIAS:
        g += tl.load(b_ptr + slot * 2 * F + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        u += tl.load(b_ptr + slot * 2 * F + F + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    h = gated_activation(g, u, act_limit, act_alpha, ACT)
    if not WEIGHT_ON_INPUT:
        h *= tw
    tl.store(h_ptr + pair * F + offs_n, h, mask=n_ok)


@triton.jit
def _decode_down_kernel(
    h_ptr, slots_ptr, tw_ptr, w_ptr, s_ptr, b_ptr, y_ptr, num_slots, D, F, FW,
    stride_we, stride_wn, stride_se, stride_sn,
    BLOCK_N: tl.constexpr, BLOCK_KW: tl.constexpr, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr,
    WEIGHT_ON_INPUT: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pair = tl.program_id(1)
    slot = tl.load(slots_ptr + pair)
    if (slot < 0) | (slot >= num_slots):
        return
    slot = slot.to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < D
    rows = offs_n[:, None].to(tl.int64)
    w_ptrs = w_ptr + slot * stride_we + rows * stride_wn + tl.arange(0, BLOCK_KW)[None, :]
    s_ptrs = s_ptr + slot * stride_se + rows * stride_sn + tl.arange(0, BLOCK_KW // (GROUP // 8))[None, :]
    h_ptrs = h_ptr + pair.to(tl.int64) * F + tl.arange(0, BLOCK_KW)[:, None] * 8 + tl.arange(0, 8)[None, :]
    acc = _matvec_int4(w_ptrs, s_ptrs, h_ptrs, n_ok, FW, BLOCK_N, BLOCK_KW, GROUP)
    if HAS_BIAS:
        b = tl.load(b_ptr + slot * D + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        if not WEIGHT_ON_INPUT:
            b *= tl.load(tw_ptr + pair)
        acc += b
    tl.store(y_ptr + pair * D + offs_n, acc, mask=n_ok)


def int4_decode_experts(
    x: torch.Tensor,
    topk_slots: torch.Tensor,
    topk_weights: torch.Tensor,
    weights: Int4ExpertWeights,
    activation: Activation,
    weight_on_input: bool = False,
    config: Int4DecodeConfig | None = None,
) -> torch.Tensor:
    """INT4 expert compute as one matrix-vector product per pair, in three launches (see the module docstring).

    Args:
        x: ``[T, D]`` bf16/fp16 (or float32) rows, contiguous along ``D``.
        topk_slots: ``[T, K]`` int64 contiguous local slot ids; an id outside ``[0, S)`` (``-1``) skips.
        topk_weights: ``[T, K]`` float32 contiguous routing weights.
        weights: the packed weights (contiguous).
        activation: the gated activation.
        weight_on_input: scale the expert input by the weight instead of its output.
        config: tile shapes; ``Int4DecodeConfig()`` when ``None`` (the best of the H200 sweep of
            ``benchmarks/moe_layer.py`` for the Kimi-K2.5 shard at one token).

    Returns:
        ``[T, D]`` in ``x.dtype``.

    Raises:
        ValueError: a step (``8 * block_kw``) that is not a multiple of the group size.
    """
    cfg = config if config is not None else Int4DecodeConfig()
    t, k = topk_slots.shape
    n = t * k
    g = weights.group_size
    if (INT4_PACK * cfg.block_kw1) % g or (INT4_PACK * cfg.block_kw2) % g:
        raise ValueError(f"8 * block_kw1 and 8 * block_kw2 must be multiples of the group size {g}, got {cfg}")
    s, d, f = weights.num_slots, weights.hidden_size, weights.intermediate_size
    w13, s13, w2, s2 = weights.w13_packed, weights.w13_scale, weights.w2_packed, weights.w2_scale
    dev = x.device
    h = torch.empty(n, f, dtype=torch.float32, device=dev)
    y = torch.empty(n, d, dtype=torch.float32, device=dev)
    out = torch.empty(t, d, dtype=x.dtype, device=dev)
    placeholder = topk_weights
    b13 = weights.b13 if weights.b13 is not None else placeholder
    b2 = weights.b2 if weights.b2 is not None else placeholder
    limit = activation.swiglu_limit if activation.swiglu_limit is not None else 0.0
    _decode_gate_up_kernel[(triton.cdiv(f, cfg.block_n1), n)](
        x, topk_slots, topk_weights, w13, s13, b13, h, s, k, f, d // INT4_PACK,
        x.stride(0), w13.stride(0), w13.stride(1), s13.stride(0), s13.stride(1), float(limit),
        float(activation.swiglu_alpha), BLOCK_N=cfg.block_n1, BLOCK_KW=cfg.block_kw1, GROUP=g,
        ACT=act_code(activation), HAS_BIAS=weights.b13 is not None, WEIGHT_ON_INPUT=weight_on_input,
        num_warps=cfg.num_warps,
    )
    _decode_down_kernel[(triton.cdiv(d, cfg.block_n2), n)](
        h, topk_slots, topk_weights, w2, s2, b2, y, s, d, f, f // INT4_PACK,
        w2.stride(0), w2.stride(1), s2.stride(0), s2.stride(1),
        BLOCK_N=cfg.block_n2, BLOCK_KW=cfg.block_kw2, GROUP=g, HAS_BIAS=weights.b2 is not None,
        WEIGHT_ON_INPUT=weight_on_input, num_warps=cfg.num_warps,
    )
    block_d = min(1024, triton.next_power_of_2(d))
    sum_pairs_kernel[(t, triton.cdiv(d, block_d))](y, topk_slots, out, d, k, s, BLOCK_D=block_d)
    return out


def int4_dequantized_experts(
    x: torch.Tensor,
    topk_slots: torch.Tensor,
    topk_weights: torch.Tensor,
    weights: Int4ExpertWeights,
    activation: Activation,
    weight_on_input: bool = False,
) -> torch.Tensor:
    """INT4 expert compute for many pairs: the slots with live pairs widened to ``x.dtype`` in one launch, then
    ``grouped.triton_experts`` (see the module docstring). Arguments and result as ``int4_decode_experts``
    (``x`` bf16/fp16); needs a workspace of ``S * 3 * D * F`` elements of ``x.dtype``."""
    s = weights.num_slots
    key = torch.where((topk_slots >= 0) & (topk_slots < s), topk_slots, s).reshape(-1)
    counts = torch.zeros(s + 1, dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, key, torch.ones_like(key, dtype=torch.int32))
    d, f, g = weights.hidden_size, weights.intermediate_size, weights.group_size
    w13 = torch.empty(s, 2 * f, d, dtype=x.dtype, device=x.device)
    w2 = torch.empty(s, d, f, dtype=x.dtype, device=x.device)
    dequantize_int4_triton(weights.w13_packed, weights.w13_scale, g, w13, counts)
    dequantize_int4_triton(weights.w2_packed, weights.w2_scale, g, w2, counts)
    b13 = None if weights.b13 is None else weights.b13.to(x.dtype)
    b2 = None if weights.b2 is None else weights.b2.to(x.dtype)
    return triton_experts(x, topk_slots, topk_weights, ExpertWeights(w13, w2, b13, b2), activation, weight_on_input)


def int4_experts(
    x: torch.Tensor,
    topk_slots: torch.Tensor,
    topk_weights: torch.Tensor,
    weights: Int4ExpertWeights,
    activation: Activation,
    weight_on_input: bool = False,
) -> torch.Tensor:
    """INT4 expert compute on CUDA (contract of ``experts.ExpertBackend``); graph safe.

    ``N = T * K`` pairs up to ``max(DECODE_MAX_PAIRS, S)`` (``S`` local slots) take the decode kernels, more the
    dequantized path: the decode path costs about one expert read per live pair, the dequantized one about one
    widening per local slot (both read the packed bytes; the widening also writes four times as many), and ``N``
    bounds the live pairs (static: no look at the routing).

    Raises:
        TypeError: ``x`` not bf16/fp16.
    """
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"the INT4 expert kernels compute in bf16 or fp16, got x of dtype {x.dtype}")
    t, k = topk_slots.shape
    if t * k == 0:
        return torch.empty(t, weights.hidden_size, dtype=x.dtype, device=x.device)
    if x.stride(1) != 1:
        x = x.contiguous()
    slots = topk_slots.contiguous()
    tw = topk_weights.float().contiguous()
    if t * k <= max(DECODE_MAX_PAIRS, weights.num_slots):
        return int4_decode_experts(x, slots, tw, weights, activation, weight_on_input)
    return int4_dequantized_experts(x, slots, tw, weights, activation, weight_on_input)


@triton.jit
def _dequantize_kernel(p_ptr, s_ptr, out_ptr, counts_ptr, KW, ROWS_PER_SLOT, GROUP: tl.constexpr,
                       BLOCK_W: tl.constexpr, SKIP_EMPTY: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    if SKIP_EMPTY:
        if tl.load(counts_ptr + row // ROWS_PER_SLOT) == 0:
            return
    offs_w = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    ok = offs_w < KW
    words = tl.load(p_ptr + row * KW + offs_w, mask=ok, other=0)
    sc = tl.load(s_ptr + row * (KW * 8 // GROUP) + offs_w * 8 // GROUP, mask=ok, other=0.0).to(tl.float32)
    nib = (words[:, None] >> (tl.arange(0, 8) * 4)[None, :]) & 0xF
    vals = (nib - 8).to(tl.float32) * sc[:, None]
    dest = out_ptr + row * KW * 8 + offs_w[:, None] * 8 + tl.arange(0, 8)[None, :]
    tl.store(dest, vals.to(out_ptr.dtype.element_ty), mask=ok[:, None])


def dequantize_int4_triton(packed: torch.Tensor, scale: torch.Tensor, group_size: int, out: torch.Tensor,
                           slot_counts: torch.Tensor | None = None) -> torch.Tensor:
    """``experts.int4.dequantize_int4`` in one Triton launch, into ``out``: ``packed [..., N, K/8]`` int32 and
    ``scale [..., N, K/G]`` (both contiguous) -> ``out [..., N, K]`` (contiguous, its dtype), returned. One read of
    the packed weights and one write of the widened ones.

    Args:
        packed, scale, group_size, out: as above.
        slot_counts: ``[S (+ more)]`` int32 for ``[S, N, K/8]`` weights: slots whose count is 0 are skipped (their
            rows of ``out`` are left as they were); ``None`` = widen everything.

    Raises:
        ValueError: shapes that do not fit each other.
    """
    kw = packed.shape[-1]
    if (tuple(out.shape) != (*packed.shape[:-1], kw * INT4_PACK)
            or tuple(scale.shape) != (*packed.shape[:-1], kw * INT4_PACK // group_size)):
        raise ValueError(f"packed {tuple(packed.shape)}, scale {tuple(scale.shape)} and out {tuple(out.shape)} do not "
                         f"fit group size {group_size}")
    rows = packed.numel() // kw
    rows_per_slot = packed.shape[-2] if packed.dim() == 3 else rows
    block_w = min(256, triton.next_power_of_2(kw))
    _dequantize_kernel[(rows, triton.cdiv(kw, block_w))](
        packed, scale, out, slot_counts if slot_counts is not None else packed, kw, rows_per_slot,
        GROUP=group_size, BLOCK_W=block_w, SKIP_EMPTY=slot_counts is not None)
    return out
