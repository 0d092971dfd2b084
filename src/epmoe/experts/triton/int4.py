"""W4A16 expert compute in Triton: INT4 group-quantized weights (``experts.int4``) read packed, bf16 activations.

The weights stay packed in HBM (a quarter of the bf16 bytes plus one scale per ``G`` inputs) and are widened in
registers. Two paths, both with static grids and no host synchronisation (CUDA-graph safe):

Decode (``N = T * K <= DECODE_MAX_PAIRS`` pairs), three launches, no alignment, matrix-vector products on the
CUDA cores:

1. ``_decode_gate_up_kernel``, grid ``(cdiv(F, BLOCK_N1), N)``: program ``(j, p)`` reads ``BLOCK_N1`` gate rows
   and ``BLOCK_N1`` up rows of pair ``p``'s expert, ``BLOCK_KW1`` int32 words (``8 * BLOCK_KW1`` inputs) a
   step, as ``[BLOCK_N, BLOCK_KW]`` words; each word is split into its eight 4-bit fields against the
   matching ``[BLOCK_KW, 8]`` inputs, the products summed per group of ``G`` inputs and multiplied by that
   group's scale. The offset ``-8`` of the stored values is applied once per word, as ``-8 * sum(x)``, not per
   value. Bias, routing weight and activation follow; ``h [N, F]`` float32.
2. ``_decode_down_kernel``, grid ``(cdiv(D, BLOCK_N2), N)``: the same over ``w2`` with ``h``; ``y [N, D]``.
3. ``grouped.sum_pairs_kernel``: ``out[t] = sum_k y[t * K + k]``.

Grouped (more pairs): ``grouped.align_triton`` groups the pairs by slot in blocks of ``BLOCK_M`` rows, then per
(row block, column tile) a GEMM whose weight tile is widened in registers and fed to ``tl.dot`` as the left
operand (swap-AB: the program computes ``acc^T [BLOCK_N, BLOCK_M] = W [BLOCK_N, BLOCK_K] @ x^T``, so the
register-resident widened weights are the operand Hopper's wgmma takes from registers and the gathered token
rows the one it takes from shared memory). The weight tile's words are addressed per input
(``word = k // 8``, the field ``k % 8``), as vLLM's GPTQ/AWQ MoE kernel does; repeated words are served by L1.

Source: the swap-AB weight-only scheme follows vLLM's ``fused_moe`` W4A16 Triton kernels
(vllm/model_executor/layers/fused_moe/fused_moe.py, ``fused_moe_kernel_gptq_awq``) and Marlin's
(arXiv:2408.11743) observation that decode-size W4A16 is weight-read bound; the code is our own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from epmoe.experts.int4 import INT4_PACK, Int4ExpertWeights
from epmoe.experts.triton.decode import DECODE_MAX_PAIRS, gated_activation
from epmoe.experts.triton.grouped import act_code, align_triton, sum_pairs_kernel
from epmoe.experts.weights import Activation


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
    block_kw1: int = 64
    block_n2: int = 16
    block_kw2: int = 64
    num_warps: int = 4


@dataclass(frozen=True)
class Int4TileConfig:
    """Tile shapes of the INT4 grouped kernels.

    Attributes:
        block_m: token rows per block (the alignment unit; the ``N`` side of the swapped product).
        block_n1: ``F`` rows (gate and up each) per gate/up program.
        block_n2: ``D`` rows per down program.
        block_k: inputs per step, a multiple of the group size.
        num_warps: warps per program.
        num_stages: software pipeline depth.
    """

    block_m: int
    block_n1: int
    block_n2: int
    block_k: int
    num_warps: int
    num_stages: int


def default_int4_config(num_pairs: int, num_slots: int, group_size: int) -> Int4TileConfig:
    """Grouped tile shapes from the expected rows per slot ``N / S`` (static: no look at the routing): 16-row
    blocks up to 16 rows per slot (weight-read bound), 64-row blocks up to 96, 128-row blocks above; 128
    weight rows a program, ``max(64, G)`` inputs a step."""
    rows = num_pairs / max(num_slots, 1)
    bk = max(64, group_size)
    if rows <= 16:
        return Int4TileConfig(16, 64, 64, bk, 4, 3)
    if rows <= 96:
        return Int4TileConfig(64, 128, 128, bk, 8, 3)
    return Int4TileConfig(128, 128, 128, bk, 8, 3)


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
    """INT4 expert compute for ``T * K <= DECODE_MAX_PAIRS`` pairs in three launches (see the module docstring).

    Args:
        x: ``[T, D]`` bf16/fp16 (or float32) rows, contiguous along ``D``.
        topk_slots: ``[T, K]`` int64 contiguous local slot ids; an id outside ``[0, S)`` (``-1``) skips.
        topk_weights: ``[T, K]`` float32 contiguous routing weights.
        weights: the packed weights (contiguous).
        activation: the gated activation.
        weight_on_input: scale the expert input by the weight instead of its output.
        config: tile shapes; ``Int4DecodeConfig()`` when ``None``.

    Returns:
        ``[T, D]`` in ``x.dtype``.

    Raises:
        ValueError: more than ``DECODE_MAX_PAIRS`` pairs, or a step (``8 * block_kw``) that is not a multiple of
            the group size.
    """
    cfg = config if config is not None else Int4DecodeConfig()
    t, k = topk_slots.shape
    n = t * k
    if n > DECODE_MAX_PAIRS:
        raise ValueError(f"int4_decode_experts takes at most {DECODE_MAX_PAIRS} (token, k) pairs, got {n}")
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


@triton.jit
def _int4_tile(w_ptr, s_ptr, slot, stride_we, stride_wn, stride_se, stride_sn, row0, k0, offs_n, n_ok, offs_k, K,
               GROUP: tl.constexpr):
    """Weight rows ``row0 + offs_n`` at inputs ``k0 + offs_k``, widened: ``[BLOCK_N, BLOCK_K]`` float32."""
    k = k0 + offs_k
    k_ok = k < K
    rows = (row0 + offs_n)[:, None].to(tl.int64)
    words = tl.load(w_ptr + slot * stride_we + rows * stride_wn + (k // 8)[None, :],
                    mask=n_ok[:, None] & k_ok[None, :], other=0)
    sc = tl.load(s_ptr + slot * stride_se + rows * stride_sn + (k // GROUP)[None, :],
                 mask=n_ok[:, None] & k_ok[None, :], other=0.0)
    nib = (words >> ((k % 8) * 4)[None, :]) & 0xF
    return (nib - 8).to(tl.float32) * sc.to(tl.float32)


@triton.jit
def _grouped_gate_up_kernel(
    x_ptr, w_ptr, s_ptr, b_ptr, tw_ptr, h_ptr, sorted_ptr, block_slot_ptr, block_start_ptr,
    num_pairs, top_k, D, F, stride_x, stride_we, stride_wn, stride_se, stride_sn, act_limit, act_alpha,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr, ACT: tl.constexpr,
    HAS_BIAS: tl.constexpr, WEIGHT_ON_INPUT: tl.constexpr,
):
    num_n = tl.cdiv(F, BLOCK_N)
    pid_m = tl.program_id(0) // num_n
    pid_n = tl.program_id(0) % num_n
    slot = tl.load(block_slot_ptr + pid_m).to(tl.int64)
    if slot < 0:
        return
    rows = tl.load(block_start_ptr + pid_m) + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ptr + rows)
    valid = pair < num_pairs
    tok = (pair // top_k).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < F
    offs_k = tl.arange(0, BLOCK_K)
    xt_ptrs = x_ptr + tok[None, :] * stride_x + offs_k[:, None]  # x^T [BLOCK_K, BLOCK_M]
    acc_g = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(0, D, BLOCK_K):
        xt = tl.load(xt_ptrs, mask=(offs_k < D - k0)[:, None] & valid[None, :], other=0.0)
        wg = _int4_tile(w_ptr, s_ptr, slot, stride_we, stride_wn, stride_se, stride_sn, pid_n * BLOCK_N, k0,
                        tl.arange(0, BLOCK_N), n_ok, offs_k, D, GROUP)
        wu = _int4_tile(w_ptr, s_ptr, slot, stride_we, stride_wn, stride_se, stride_sn, F + pid_n * BLOCK_N, k0,
                        tl.arange(0, BLOCK_N), n_ok, offs_k, D, GROUP)
        acc_g = tl.dot(wg.to(xt.dtype), xt, acc_g)
        acc_u = tl.dot(wu.to(xt.dtype), xt, acc_u)
        xt_ptrs += BLOCK_K
    if WEIGHT_ON_INPUT:
        tw = tl.load(tw_ptr + pair, mask=valid, other=0.0)
        acc_g *= tw[None, :]
        acc_u *= tw[None, :]
    if HAS_BIAS:
        acc_g += tl.load(b_ptr + slot * 2 * F + offs_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
        acc_u += tl.load(b_ptr + slot * 2 * F + F + offs_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    h = gated_activation(acc_g, acc_u, act_limit, act_alpha, ACT)
    h_ptrs = h_ptr + rows[None, :].to(tl.int64) * F + offs_n[:, None]
    tl.store(h_ptrs, h.to(h_ptr.dtype.element_ty), mask=valid[None, :] & n_ok[:, None])


@triton.jit
def _grouped_down_kernel(
    h_ptr, w_ptr, s_ptr, b_ptr, tw_ptr, y_ptr, sorted_ptr, block_slot_ptr, block_start_ptr,
    num_pairs, D, F, stride_we, stride_wn, stride_se, stride_sn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
    HAS_BIAS: tl.constexpr, WEIGHT_ON_INPUT: tl.constexpr,
):
    num_n = tl.cdiv(D, BLOCK_N)
    pid_m = tl.program_id(0) // num_n
    pid_n = tl.program_id(0) % num_n
    slot = tl.load(block_slot_ptr + pid_m).to(tl.int64)
    if slot < 0:
        return
    rows = tl.load(block_start_ptr + pid_m) + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ptr + rows)
    valid = pair < num_pairs
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < D
    offs_k = tl.arange(0, BLOCK_K)
    ht_ptrs = h_ptr + rows[None, :].to(tl.int64) * F + offs_k[:, None]  # h^T [BLOCK_K, BLOCK_M]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(0, F, BLOCK_K):
        ht = tl.load(ht_ptrs, mask=(offs_k < F - k0)[:, None] & valid[None, :], other=0.0)
        w = _int4_tile(w_ptr, s_ptr, slot, stride_we, stride_wn, stride_se, stride_sn, pid_n * BLOCK_N, k0,
                       tl.arange(0, BLOCK_N), n_ok, offs_k, F, GROUP)
        acc = tl.dot(w.to(ht.dtype), ht, acc)
        ht_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(b_ptr + slot * D + offs_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    if not WEIGHT_ON_INPUT:
        acc *= tl.load(tw_ptr + pair, mask=valid, other=0.0)[None, :]
    y_ptrs = y_ptr + pair[None, :].to(tl.int64) * D + offs_n[:, None]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=valid[None, :] & n_ok[:, None])


def int4_grouped_experts(
    x: torch.Tensor,
    topk_slots: torch.Tensor,
    topk_weights: torch.Tensor,
    weights: Int4ExpertWeights,
    activation: Activation,
    weight_on_input: bool = False,
    config: Int4TileConfig | None = None,
) -> torch.Tensor:
    """INT4 expert compute for any number of pairs: alignment, swap-AB grouped GEMMs, sum (module docstring).

    Args: as ``int4_decode_experts``; ``config`` the tile shapes (``default_int4_config`` when ``None``).

    Raises:
        ValueError: ``block_k`` not a multiple of the group size.
    """
    t, k = topk_slots.shape
    n = t * k
    s, d, f = weights.num_slots, weights.hidden_size, weights.intermediate_size
    g = weights.group_size
    cfg = config if config is not None else default_int4_config(n, s, g)
    if cfg.block_k % g:
        raise ValueError(f"block_k must be a multiple of the group size {g}, got {cfg}")
    aln = align_triton(topk_slots, s, cfg.block_m)
    nb = aln.block_slot.shape[0]
    w13, s13, w2, s2 = weights.w13_packed, weights.w13_scale, weights.w2_packed, weights.w2_scale
    h = torch.empty(nb * cfg.block_m, f, dtype=x.dtype, device=x.device)
    y = torch.empty(n, d, dtype=x.dtype, device=x.device)
    out = torch.empty(t, d, dtype=x.dtype, device=x.device)
    b13 = weights.b13 if weights.b13 is not None else topk_weights
    b2 = weights.b2 if weights.b2 is not None else topk_weights
    limit = activation.swiglu_limit if activation.swiglu_limit is not None else 0.0
    _grouped_gate_up_kernel[(nb * triton.cdiv(f, cfg.block_n1),)](
        x, w13, s13, b13, topk_weights, h, aln.sorted_pair_ids, aln.block_slot, aln.block_start,
        n, k, d, f, x.stride(0), w13.stride(0), w13.stride(1), s13.stride(0), s13.stride(1),
        float(limit), float(activation.swiglu_alpha),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n1, BLOCK_K=cfg.block_k, GROUP=g, ACT=act_code(activation),
        HAS_BIAS=weights.b13 is not None, WEIGHT_ON_INPUT=weight_on_input,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    _grouped_down_kernel[(nb * triton.cdiv(d, cfg.block_n2),)](
        h, w2, s2, b2, topk_weights, y, aln.sorted_pair_ids, aln.block_slot, aln.block_start,
        n, d, f, w2.stride(0), w2.stride(1), s2.stride(0), s2.stride(1),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n2, BLOCK_K=cfg.block_k, GROUP=g,
        HAS_BIAS=weights.b2 is not None, WEIGHT_ON_INPUT=weight_on_input,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    block_d = min(1024, triton.next_power_of_2(d))
    sum_pairs_kernel[(t, triton.cdiv(d, block_d))](y, topk_slots, out, d, k, s, BLOCK_D=block_d)
    return out


def int4_experts(
    x: torch.Tensor,
    topk_slots: torch.Tensor,
    topk_weights: torch.Tensor,
    weights: Int4ExpertWeights,
    activation: Activation,
    weight_on_input: bool = False,
) -> torch.Tensor:
    """INT4 expert compute on CUDA (contract of ``experts.ExpertBackend``): the decode kernels up to
    ``DECODE_MAX_PAIRS`` pairs, the grouped ones above; graph safe.

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
    if t * k <= DECODE_MAX_PAIRS:
        return int4_decode_experts(x, slots, tw, weights, activation, weight_on_input)
    return int4_grouped_experts(x, slots, tw, weights, activation, weight_on_input)


@triton.jit
def _dequantize_kernel(p_ptr, s_ptr, out_ptr, KW, GROUP: tl.constexpr, BLOCK_W: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs_w = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    ok = offs_w < KW
    words = tl.load(p_ptr + row * KW + offs_w, mask=ok, other=0)
    sc = tl.load(s_ptr + row * (KW * 8 // GROUP) + offs_w * 8 // GROUP, mask=ok, other=0.0).to(tl.float32)
    nib = (words[:, None] >> (tl.arange(0, 8) * 4)[None, :]) & 0xF
    vals = (nib - 8).to(tl.float32) * sc[:, None]
    dest = out_ptr + row * KW * 8 + offs_w[:, None] * 8 + tl.arange(0, 8)[None, :]
    tl.store(dest, vals.to(out_ptr.dtype.element_ty), mask=ok[:, None])


def dequantize_int4_triton(packed: torch.Tensor, scale: torch.Tensor, group_size: int,
                           out: torch.Tensor) -> torch.Tensor:
    """``experts.int4.dequantize_int4`` in one Triton launch, into ``out``: ``packed [..., N, K/8]`` int32 and
    ``scale [..., N, K/G]`` (both contiguous) -> ``out [..., N, K]`` (contiguous, its dtype), returned. One read of
    the packed weights and one write of the widened ones (the "dequantize, then a bf16 GEMM" peer of the INT4
    kernels in ``benchmarks/moe_layer.py``).

    Raises:
        ValueError: shapes that do not fit each other.
    """
    kw = packed.shape[-1]
    if (tuple(out.shape) != (*packed.shape[:-1], kw * INT4_PACK)
            or tuple(scale.shape) != (*packed.shape[:-1], kw * INT4_PACK // group_size)):
        raise ValueError(f"packed {tuple(packed.shape)}, scale {tuple(scale.shape)} and out {tuple(out.shape)} do not "
                         f"fit group size {group_size}")
    rows = packed.numel() // kw
    block_w = min(256, triton.next_power_of_2(kw))
    _dequantize_kernel[(rows, triton.cdiv(kw, block_w))](packed, scale, out, kw, GROUP=group_size, BLOCK_W=block_w)
    return out
