"""Fused MoE expert compute in Triton: align pairs to slot blocks, gate/up GEMM + activation, down GEMM.

Pipeline for ``x [T, D]`` and ``topk_slots [T, K]`` (``N = T * K`` pairs), all launches of static grid
size and no host synchronisation (CUDA-graph safe):

1-3. ``align_kernels.align_triton``: the pairs sorted by slot into padded row blocks (full blocks of ``BM`` rows, with
   ``half_tail`` a half-size last block when at most ``BM / 2`` rows are left), in one launch or five. Up to
   ``decode.DECODE_MAX_PAIRS`` pairs none of this runs: ``decode`` computes them in two launches without
   alignment.
4. ``_gate_up_kernel``: per (row block, F tile): rows gathered from ``x`` by pair id, gate and up tiles
   accumulated side by side in float32, bias, the gated activation, stored as ``h [NB*BM, F]``.
5. ``_down_kernel``: per (row block, D tile): ``h @ w2[slot].T``, bias, times the routing weight,
   stored at the pair's row of ``y [N, D]``.
6. ``sum_pairs_kernel``: ``out[t] = sum_k y[t*K + k]`` over the pairs whose slot is in ``[0, S)``.

In 4 and 5 a half-size block runs the same code with ``BM / 2`` rows (a second compiled branch), so the
padding multiplied is under ``BM / 2`` rows per slot. With ``TileConfig.tma`` the weight tiles (and
the down kernel's ``h`` rows, which are contiguous per block) are read through Hopper's tensor memory
accelerator from host-built descriptors; the token rows of step 4 are a gather, read with ordinary
loads.

INT4 group-quantized weights (``Int4ExpertWeights``, through ``grouped_experts``: ``int4.int4_grouped_experts``)
and MXFP4 weights (``MXFP4ExpertWeights``: ``mxfp4.mxfp4_grouped_experts``, their blocks read as the same int32
words) are read packed and widened in registers, eight ``tl.dot`` a step, one per 4-bit field of the step's words, on
activations (``x``, and ``h``, which the gate/up kernel then writes) in a nibble-major order (``w4a16``); ordinary
loads, no TMA.

Block-quantized FP8 weights (``BlockFP8ExpertWeights``) are read as float8_e4m3fn and widened in
registers; ``BLOCK_K == 128``, so each K step sees one 128x128 block scale. Blocks of 64 rows or more
multiply the widened weight tile by its scale (in float32, then rounded to bf16) and accumulate the dot
in place; smaller blocks scale the tile product instead, which is cheaper for a 16-row product (on an
H200, DeepSeek-V3 shard: 1.22x faster at 4096 tokens, 1.26x slower at 32). Activations stay bf16.

Sources: the padded block alignment and the gathered-row grouped GEMM follow the design of vLLM's
``fused_moe`` Triton kernel (vllm/model_executor/layers/fused_moe/fused_moe.py) and SGLang's
``moe_align_block_size``; the block FP8 format is DeepSeek-V3's (arXiv:2412.19437, section 3.3). The
code here is our own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from epmoe.experts.fp8 import FP8_BLOCK, BlockFP8ExpertWeights, KernelOperands, kernel_operands
from epmoe.experts.int4 import INT4_PACK, Int4ExpertWeights
from epmoe.experts.mxfp4 import MXFP4_BLOCK, MXFP4ExpertWeights
from epmoe.experts.triton.align_kernels import align_triton
from epmoe.experts.triton.decode import DECODE_MAX_PAIRS, decode_experts, gated_activation
from epmoe.experts.triton.w4a16 import (
    nibble_major,
    nibble_major_cols,
    nibble_segment,
    nibble_segment_of,
    packed_down_acc,
    packed_gate_up_acc,
    widen_code,
)
from epmoe.experts.weights import Activation, ExpertWeights, check_expert_call

_ACT_CODES = {"silu": 0, "gelu": 1, "relu": 2}
_CLAMPED_SWIGLU = 3


@dataclass(frozen=True)
class TileConfig:
    """Tile shapes of the two GEMM kernels.

    Attributes:
        block_m: rows per block (the alignment unit).
        block_n1: F columns per gate/up program (gate and up each; the program computes ``2 * block_n1``).
        block_n2: D columns per down program.
        block_k: reduction step (must be 128 for FP8 weights).
        num_warps: warps per program.
        num_stages: software pipeline depth.
        tma: read the weight tiles (and the down kernel's ``h`` rows) through Hopper's tensor memory
            accelerator (host-built tensor descriptors); bf16/fp16 weights only. The gathered token rows
            are always read with ordinary loads (Hopper's TMA has no row gather).
        half_tail: a slot's last row block has ``block_m / 2`` rows when no more are left (see ``align``);
            used when ``block_m >= 32``.
        swap_ab: INT4 and MXFP4 weights only: each step computes the transposed products ``W_j^T @ A_j^T`` (the
            widened weight tile as ``tl.dot``'s left operand; see ``w4a16``). For INT4 and MXFP4 weights
            ``block_k`` counts inputs (``block_k / 8`` words a step) and ``tma`` is ignored.
    """

    block_m: int
    block_n1: int
    block_n2: int
    block_k: int
    num_warps: int
    num_stages: int
    tma: bool = False
    half_tail: bool = False
    swap_ab: bool = False


def default_config(num_pairs: int, num_slots: int, fp8: bool) -> TileConfig:
    """Tile shapes from the expected rows per slot ``N / S`` (static: no look at the routing).

    Up to 16 rows per slot the layer is weight-read bound: 16-row blocks, narrow column tiles so that
    several programs per expert keep every SM streaming weights. Above, TMA weight tiles and half-size
    last blocks; up to 32 rows 64-row blocks, beyond 128-row blocks (Hopper wgmma tiles) with four
    pipeline stages. Chosen from the H200 sweep of ``benchmarks/moe_layer.py --sweep`` (Qwen3-30B-A3B at
    4096 tokens: TMA 8% and half-size last blocks another 6% faster in kernel time). Block FP8 weights
    keep the ordinary loads (their scales are applied per 128-wide step), with 128-wide column tiles:
    64-row blocks up to 256 estimated rows, 128-row blocks above (best of eight tile shapes on the H200
    for the DeepSeek-V3 shard at 1024 and 4096 tokens). ``N`` counts the pairs of other ranks (slot
    ``-1``) too, so under expert parallelism the estimate is high.
    """
    rows = num_pairs / max(num_slots, 1)
    if rows <= 16:
        return TileConfig(16, 32, 64, 128, 4, 3)
    if fp8:
        return TileConfig(64, 128, 128, 128, 4, 3) if rows <= 256 else TileConfig(128, 128, 128, 128, 8, 3)
    if rows <= 32:
        return TileConfig(64, 64, 128, 64, 4, 4, tma=True, half_tail=True)
    return TileConfig(128, 128, 256, 64, 8, 4, tma=True, half_tail=True)


def default_int4_config(num_pairs: int, num_slots: int) -> TileConfig:
    """Tile shapes of the grouped path for INT4 weights from the expected rows per slot ``N / S`` (static, as
    ``default_config``; ``N`` counts the pairs of other ranks too). Every row block widens its slot's weights again,
    so the blocks are as tall as the rows allow: 16 rows up to 16 rows per slot (weight-read bound: narrow column
    tiles, many programs), 64-row blocks with half-size last blocks up to 64, 128 above. 256 inputs (32 words) a
    step: compiled for sm_90 (Triton 3.6) a 16-row step then moves its widened tiles to the dot operand's layout
    through shared memory (``ldmatrix``) instead of warp shuffles, fewer instructions a weight than with 16 words.
    A first choice from the compiled code, not from timings: ``benchmarks/moe_layer.py --sweep``
    (``INT4_GROUPED_SWEEP``) is there to confirm or move it.
    """
    rows = num_pairs / max(num_slots, 1)
    if rows <= 16:
        return TileConfig(16, 32, 64, 256, 4, 3)
    if rows <= 64:
        return TileConfig(64, 64, 128, 256, 8, 3, half_tail=True)
    return TileConfig(128, 64, 128, 256, 8, 2, half_tail=True)


@triton.jit
def _gate_up_rows(
    x_ptr, w_ptr, w_desc, ws_ptr, b_ptr, tw_ptr, h_ptr, sorted_ptr, slot, first, pid_n,
    num_pairs, top_k, D, F, stride_x, stride_we, stride_wn, stride_se, stride_sn, act_limit, act_alpha,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ACT: tl.constexpr, FP8: tl.constexpr, HAS_BIAS: tl.constexpr, WEIGHT_ON_INPUT: tl.constexpr, TMA: tl.constexpr,
    GW: tl.constexpr, SWAP_AB: tl.constexpr, WIDEN: tl.constexpr,
):
    """``h`` for sorted positions ``[first, first + BLOCK_M)`` of ``slot`` and F columns of tile ``pid_n``."""
    rows = first + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ptr + rows)
    valid = pair < num_pairs
    tok = (pair // top_k).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < F
    if GW > 0:
        acc_g, acc_u = packed_gate_up_acc(x_ptr, w_ptr, ws_ptr, slot, tok, valid, offs_n, n_ok, D, F, stride_x,
                                        stride_we, stride_wn, stride_se, stride_sn, BLOCK_M, BLOCK_N, BLOCK_K // 8,
                                        GW, SWAP_AB, WIDEN)
    else:
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = x_ptr + tok[:, None] * stride_x + offs_k[None, :]
        wg_ptrs = w_ptr + slot * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
        wu_ptrs = wg_ptrs + F * stride_wn
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        row_g = (slot * 2 * F + pid_n * BLOCK_N).to(tl.int32)
        for k0 in range(0, D, BLOCK_K):
            k_ok = offs_k < D - k0
            a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
            if TMA:
                acc_g = tl.dot(a, w_desc.load([row_g, k0]).T, acc_g)
                acc_u = tl.dot(a, w_desc.load([row_g + F, k0]).T, acc_u)
            elif FP8:
                wg = tl.load(wg_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
                wu = tl.load(wu_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
                kb = k0 // BLOCK_K
                sg = tl.load(ws_ptr + slot * stride_se + (pid_n * BLOCK_N // 128) * stride_sn + kb)
                su = tl.load(ws_ptr + slot * stride_se + ((F + pid_n * BLOCK_N) // 128) * stride_sn + kb)
                if BLOCK_M >= 64:  # scale the weight tile: the dot accumulates in place
                    acc_g = tl.dot(a, (wg.to(tl.float32) * sg).to(a.dtype), acc_g)
                    acc_u = tl.dot(a, (wu.to(tl.float32) * su).to(a.dtype), acc_u)
                else:  # few rows: scaling the small tile product is cheaper
                    acc_g += tl.dot(a, wg.to(a.dtype)) * sg
                    acc_u += tl.dot(a, wu.to(a.dtype)) * su
            else:
                wg = tl.load(wg_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
                wu = tl.load(wu_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
                acc_g = tl.dot(a, wg, acc_g)
                acc_u = tl.dot(a, wu, acc_u)
            a_ptrs += BLOCK_K
            wg_ptrs += BLOCK_K
            wu_ptrs += BLOCK_K
    if WEIGHT_ON_INPUT:
        tw = tl.load(tw_ptr + pair, mask=valid, other=0.0)
        acc_g *= tw[:, None]
        acc_u *= tw[:, None]
    if HAS_BIAS:
        acc_g += tl.load(b_ptr + slot * 2 * F + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        acc_u += tl.load(b_ptr + slot * 2 * F + F + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    h = gated_activation(acc_g, acc_u, act_limit, act_alpha, ACT)
    if GW > 0:  # nibble-major h for the INT4 down kernel
        h_ptrs = h_ptr + rows[:, None].to(tl.int64) * (8 * nibble_segment_of(F)) + nibble_major_cols(offs_n, F)[None, :]
    else:
        h_ptrs = h_ptr + rows[:, None].to(tl.int64) * F + offs_n[None, :]
    tl.store(h_ptrs, h.to(h_ptr.dtype.element_ty), mask=valid[:, None] & n_ok[None, :])


@triton.jit
def _gate_up_kernel(
    x_ptr, w_ptr, w_desc, ws_ptr, b_ptr, tw_ptr, h_ptr, sorted_ptr, block_slot_ptr, block_start_ptr, block_rows_ptr,
    num_pairs, top_k, D, F, stride_x, stride_we, stride_wn, stride_se, stride_sn,
    act_limit, act_alpha,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ACT: tl.constexpr, FP8: tl.constexpr, HAS_BIAS: tl.constexpr, WEIGHT_ON_INPUT: tl.constexpr,
    TMA: tl.constexpr, HALF_TAIL: tl.constexpr, GW: tl.constexpr, SWAP_AB: tl.constexpr, WIDEN: tl.constexpr,
):
    num_n = tl.cdiv(F, BLOCK_N)
    pid_m = tl.program_id(0) // num_n
    pid_n = tl.program_id(0) % num_n
    slot = tl.load(block_slot_ptr + pid_m).to(tl.int64)
    if slot < 0:
        return
    first = tl.load(block_start_ptr + pid_m)
    if HALF_TAIL and tl.load(block_rows_ptr + pid_m) < BLOCK_M:
        _gate_up_rows(x_ptr, w_ptr, w_desc, ws_ptr, b_ptr, tw_ptr, h_ptr, sorted_ptr, slot, first, pid_n,
                      num_pairs, top_k, D, F, stride_x, stride_we, stride_wn, stride_se, stride_sn, act_limit,
                      act_alpha, BLOCK_M // 2, BLOCK_N, BLOCK_K, ACT, FP8, HAS_BIAS, WEIGHT_ON_INPUT, TMA, GW,
                      SWAP_AB, WIDEN)
    else:
        _gate_up_rows(x_ptr, w_ptr, w_desc, ws_ptr, b_ptr, tw_ptr, h_ptr, sorted_ptr, slot, first, pid_n,
                      num_pairs, top_k, D, F, stride_x, stride_we, stride_wn, stride_se, stride_sn, act_limit,
                      act_alpha, BLOCK_M, BLOCK_N, BLOCK_K, ACT, FP8, HAS_BIAS, WEIGHT_ON_INPUT, TMA, GW, SWAP_AB,
                      WIDEN)


@triton.jit
def _down_rows(
    h_ptr, h_desc, w_ptr, w_desc, ws_ptr, b_ptr, tw_ptr, y_ptr, sorted_ptr, slot, first, pid_n,
    num_pairs, D, F, stride_we, stride_wn, stride_se, stride_sn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    FP8: tl.constexpr, HAS_BIAS: tl.constexpr, WEIGHT_ON_INPUT: tl.constexpr, TMA: tl.constexpr,
    GW: tl.constexpr, SWAP_AB: tl.constexpr, WIDEN: tl.constexpr,
):
    """``y`` rows of the pairs at sorted positions ``[first, first + BLOCK_M)``, D columns of tile ``pid_n``."""
    rows = first + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ptr + rows)
    valid = pair < num_pairs
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < D
    if GW > 0:
        acc = packed_down_acc(h_ptr, w_ptr, ws_ptr, slot, rows, valid, offs_n, n_ok, F, stride_we, stride_wn, stride_se,
                            stride_sn, BLOCK_M, BLOCK_N, BLOCK_K // 8, GW, SWAP_AB, WIDEN)
    elif TMA:
        # padding rows of h were never written: their products land in rows the store masks out.
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        row_w = (slot * D + pid_n * BLOCK_N).to(tl.int32)
        for k0 in range(0, F, BLOCK_K):
            acc = tl.dot(h_desc.load([first, k0]), w_desc.load([row_w, k0]).T, acc)
    else:
        offs_k = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        a_ptrs = h_ptr + rows[:, None].to(tl.int64) * F + offs_k[None, :]
        w_ptrs = w_ptr + slot * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
        for k0 in range(0, F, BLOCK_K):
            k_ok = offs_k < F - k0
            a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            if FP8:
                sc = tl.load(ws_ptr + slot * stride_se + (pid_n * BLOCK_N // 128) * stride_sn + k0 // BLOCK_K)
                if BLOCK_M >= 64:
                    acc = tl.dot(a, (w.to(tl.float32) * sc).to(a.dtype), acc)
                else:
                    acc += tl.dot(a, w.to(a.dtype)) * sc
            else:
                acc = tl.dot(a, w, acc)
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(b_ptr + slot * D + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if not WEIGHT_ON_INPUT:
        tw = tl.load(tw_ptr + pair, mask=valid, other=0.0)
        acc *= tw[:, None]
    y_ptrs = y_ptr + pair[:, None].to(tl.int64) * D + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=valid[:, None] & n_ok[None, :])


@triton.jit
def _down_kernel(
    h_ptr, h_desc, h_half_desc, w_ptr, w_desc, ws_ptr, b_ptr, tw_ptr, y_ptr, sorted_ptr, block_slot_ptr,
    block_start_ptr, block_rows_ptr, num_pairs, D, F, stride_we, stride_wn, stride_se, stride_sn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    FP8: tl.constexpr, HAS_BIAS: tl.constexpr, WEIGHT_ON_INPUT: tl.constexpr, TMA: tl.constexpr,
    HALF_TAIL: tl.constexpr, GW: tl.constexpr, SWAP_AB: tl.constexpr, WIDEN: tl.constexpr,
):
    num_n = tl.cdiv(D, BLOCK_N)
    pid_m = tl.program_id(0) // num_n
    pid_n = tl.program_id(0) % num_n
    slot = tl.load(block_slot_ptr + pid_m).to(tl.int64)
    if slot < 0:
        return
    first = tl.load(block_start_ptr + pid_m)
    if HALF_TAIL and tl.load(block_rows_ptr + pid_m) < BLOCK_M:
        _down_rows(h_ptr, h_half_desc, w_ptr, w_desc, ws_ptr, b_ptr, tw_ptr, y_ptr, sorted_ptr, slot, first, pid_n,
                   num_pairs, D, F, stride_we, stride_wn, stride_se, stride_sn,
                   BLOCK_M // 2, BLOCK_N, BLOCK_K, FP8, HAS_BIAS, WEIGHT_ON_INPUT, TMA, GW, SWAP_AB, WIDEN)
    else:
        _down_rows(h_ptr, h_desc, w_ptr, w_desc, ws_ptr, b_ptr, tw_ptr, y_ptr, sorted_ptr, slot, first, pid_n,
                   num_pairs, D, F, stride_we, stride_wn, stride_se, stride_sn,
                   BLOCK_M, BLOCK_N, BLOCK_K, FP8, HAS_BIAS, WEIGHT_ON_INPUT, TMA, GW, SWAP_AB, WIDEN)


@triton.jit
def sum_pairs_kernel(y_ptr, slots_ptr, out_ptr, D, top_k, num_slots, BLOCK_D: tl.constexpr):
    """Grid ``(T, cdiv(D, BLOCK_D))``: ``out[t] = sum_k y[t * K + k]`` (``y [N, D]``, ``out [T, D]`` contiguous) over
    the ``k`` whose slot is in ``[0, S)``, in a fixed order (``sum_pairs``)."""
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = offs < D
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for k in range(0, top_k):
        sl = tl.load(slots_ptr + t * top_k + k)
        here = (sl >= 0) & (sl < num_slots)
        acc += tl.load(y_ptr + (t * top_k + k) * D + offs, mask=d_ok & here, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * D + offs, acc.to(out_ptr.dtype.element_ty), mask=d_ok)


def sum_pairs(y: torch.Tensor, topk_slots: torch.Tensor, out: torch.Tensor, num_slots: int) -> torch.Tensor:
    """``out [T, D]`` = the sum over each token's ``K`` pairs of ``y [T * K, D]`` float32 (pairs whose slot is outside
    ``[0, num_slots)`` left out), by ``sum_pairs_kernel``; ``topk_slots [T, K]`` int64 contiguous. Returns ``out``."""
    t, k = topk_slots.shape
    d = out.shape[1]
    block_d = min(1024, triton.next_power_of_2(d))
    sum_pairs_kernel[(t, triton.cdiv(d, block_d))](y, topk_slots, out, d, k, num_slots, BLOCK_D=block_d)
    return out


def act_code(activation: Activation) -> int:
    return _CLAMPED_SWIGLU if activation.swiglu_limit is not None else _ACT_CODES[activation.act]


def triton_experts(
    x: torch.Tensor,
    topk_slots: torch.Tensor,
    topk_weights: torch.Tensor,
    weights: ExpertWeights,
    activation: Activation,
    weight_on_input: bool = False,
    config: TileConfig | None = None,
    *,
    expected_pairs: int | None = None,
) -> torch.Tensor:
    """Fused expert compute on CUDA (contract of ``experts.ExpertBackend``); graph safe.

    Args:
        x: ``[T, D]`` bf16 or fp16 CUDA rows.
        topk_slots: ``[T, K]`` int64 local slot ids, ``-1`` = skip.
        topk_weights: ``[T, K]`` float routing weights.
        weights: ``ExpertWeights`` in ``x.dtype``, or ``BlockFP8ExpertWeights``.
        activation: the gated activation.
        weight_on_input: scale the expert input by the weight instead of its output.
        config: tile shapes of the grouped path; ``None`` = ``decode.decode_experts`` when both the expected
            pairs and ``T * K`` are at most ``DECODE_MAX_PAIRS``, else the grouped path with ``default_config``.
        expected_pairs: the pairs the tile choice counts (``ExpertBackend``); ``None``: ``T * K``.

    Returns:
        ``[T, D]`` in ``x.dtype``.

    Raises:
        ValueError: operands of other shapes than ``experts.weights.check_expert_call`` takes.
        TypeError: ``x`` not bf16/fp16, or weights of another dtype than ``x`` (unless block FP8).
        ValueError: a ``config`` the weights cannot take (see ``grouped_experts``).
    """
    check_expert_call(x, topk_slots, topk_weights, weights.hidden_size, as_read=False)
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"the triton expert backend computes in bf16 or fp16, got x of dtype {x.dtype}")
    fp8 = isinstance(weights, BlockFP8ExpertWeights)
    if not fp8 and (weights.w13.dtype != x.dtype or weights.w2.dtype != x.dtype):
        raise TypeError(
            f"the triton expert backend needs weights in x's dtype {x.dtype} or block FP8, got "
            f"{weights.w13.dtype} and {weights.w2.dtype}"
        )
    t, k = topk_slots.shape
    n = t * k
    if n == 0:  # no pair: no expert adds to any row
        return torch.zeros(t, weights.hidden_size, dtype=x.dtype, device=x.device)
    if x.stride(1) != 1:  # rows may sit in a wider buffer (a dispatcher's receive buffer): only D must be dense
        x = x.contiguous()
    slots = topk_slots.contiguous()
    tw = topk_weights.float().contiguous()
    pairs = n if expected_pairs is None else expected_pairs
    # the decode kernels take at most DECODE_MAX_PAIRS pairs in all (each is read, and summed per token, whether
    # local or not), however few the expected local ones
    if config is None and pairs <= DECODE_MAX_PAIRS and n <= DECODE_MAX_PAIRS:
        return decode_experts(x, slots, tw, weights, act_code(activation), activation, weight_on_input)
    cfg = config if config is not None else default_config(pairs, weights.w13.shape[0], fp8)
    return grouped_experts(x, slots, tw, weights, activation, weight_on_input, cfg)


def grouped_experts(
    x: torch.Tensor,
    topk_slots: torch.Tensor,
    topk_weights: torch.Tensor,
    weights: ExpertWeights | Int4ExpertWeights | MXFP4ExpertWeights,
    activation: Activation,
    weight_on_input: bool,
    config: TileConfig,
) -> torch.Tensor:
    """The grouped path (steps 1-6 of the module docstring) with tile shapes ``config``, whatever the batch size.

    Args:
        x: ``[T, D]`` CUDA rows, contiguous along ``D``: bf16/fp16 (float32 too for INT4 and MXFP4 weights).
        topk_slots: ``[T, K]`` int64 contiguous local slot ids, ``-1`` (or any id outside ``[0, S)``) = skip.
        topk_weights: ``[T, K]`` float32 contiguous routing weights.
        weights: ``ExpertWeights`` in ``x.dtype``, ``BlockFP8ExpertWeights``, ``Int4ExpertWeights`` or
            ``MXFP4ExpertWeights`` (contiguous packed tensors and scales), as the callers (``triton_experts``,
            ``int4.int4_experts``, ``mxfp4.mxfp4_experts``) have checked.
        activation, weight_on_input: as ``triton_experts``.
        config: the tile shapes.

    Returns:
        ``[T, D]`` in ``x.dtype``.

    Raises:
        ValueError: operands of other shapes or layouts than ``experts.weights.check_expert_call`` takes.
        ValueError: block FP8 weights without ``block_k == 128`` and ``block_n`` dividing 128; INT4 or MXFP4 weights
            with a step (``block_k``) that is not a power of two of at least 128 inputs (16 words: ``tl.dot``'s
            smallest reduction) or packed rows whose strides are not multiples of 4 words; ``swap_ab`` with weights
            that are neither.
    """
    check_expert_call(x, topk_slots, topk_weights, weights.hidden_size)
    cfg = config
    fp8 = isinstance(weights, BlockFP8ExpertWeights)
    mx = isinstance(weights, MXFP4ExpertWeights)
    packed = mx or isinstance(weights, Int4ExpertWeights)  # both read as packed int32 words (w4a16)
    if fp8 and (cfg.block_k != FP8_BLOCK or FP8_BLOCK % cfg.block_n1 or FP8_BLOCK % cfg.block_n2):
        raise ValueError(f"block FP8 weights need block_k == 128 and block_n dividing 128, got {cfg}")
    if packed and (cfg.block_k < 128 or cfg.block_k & (cfg.block_k - 1)):
        raise ValueError(f"INT4 and MXFP4 weights need block_k a power of two of at least 128 inputs, got {cfg}")
    if cfg.swap_ab and not packed:
        raise ValueError(f"swap_ab is for INT4 and MXFP4 weights only, got {cfg} for {type(weights).__name__}")
    t, k = topk_slots.shape
    n = t * k
    if packed:
        s, d, f = weights.num_slots, weights.hidden_size, weights.intermediate_size
        ops = packed_kernel_operands(weights, topk_weights)
        w13, w2, gw = packed_words(weights, "grouped")
        x = nibble_major(x)
    else:
        s, d, f = weights.w13.shape[0], weights.w13.shape[2], weights.w13.shape[1] // 2
        w13, w2 = weights.w13.contiguous(), weights.w2.contiguous()
        ops = kernel_operands(weights, topk_weights)
        gw = 0
    out = torch.empty(t, d, dtype=x.dtype, device=x.device)
    # TMA rows must start 16-byte aligned: D and F multiples of 8 elements.
    tma = cfg.tma and not fp8 and not packed and d % 8 == 0 and f % 8 == 0
    half = cfg.half_tail and cfg.block_m >= 32
    widen = widen_code(mx, x) if packed else 0
    aln = align_triton(topk_slots, s, cfg.block_m, half)
    nb = aln.block_slot.shape[0]
    h = torch.empty(nb * cfg.block_m, INT4_PACK * nibble_segment(f) if packed else f, dtype=x.dtype, device=x.device)
    y = torch.empty(n, d, dtype=x.dtype, device=x.device)
    limit = activation.swiglu_limit if activation.swiglu_limit is not None else 0.0
    if tma:
        w13_desc = TensorDescriptor.from_tensor(w13.view(s * 2 * f, d), [cfg.block_n1, cfg.block_k])
        w2_desc = TensorDescriptor.from_tensor(w2.view(s * d, f), [cfg.block_n2, cfg.block_k])
        h_desc = TensorDescriptor.from_tensor(h, [cfg.block_m, cfg.block_k])
        h_half_desc = TensorDescriptor.from_tensor(h, [max(cfg.block_m // 2, 16), cfg.block_k])
    else:
        w13_desc, w2_desc, h_desc, h_half_desc = w13, w2, h, h
    _gate_up_kernel[(nb * triton.cdiv(f, cfg.block_n1),)](
        x, w13, w13_desc, ops.s13, ops.b13, topk_weights, h, aln.sorted_pair_ids, aln.block_slot, aln.block_start,
        aln.block_rows, n, k, d, f, x.stride(0), w13.stride(0), w13.stride(1), *ops.strides13,
        float(limit), float(activation.swiglu_alpha),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n1, BLOCK_K=cfg.block_k,
        ACT=act_code(activation), FP8=fp8, HAS_BIAS=weights.b13 is not None, WEIGHT_ON_INPUT=weight_on_input,
        TMA=tma, HALF_TAIL=half, GW=gw, SWAP_AB=cfg.swap_ab, WIDEN=widen,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    _down_kernel[(nb * triton.cdiv(d, cfg.block_n2),)](
        h, h_desc, h_half_desc, w2, w2_desc, ops.s2, ops.b2, topk_weights, y, aln.sorted_pair_ids, aln.block_slot,
        aln.block_start, aln.block_rows,
        n, d, f, w2.stride(0), w2.stride(1), *ops.strides2,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n2, BLOCK_K=cfg.block_k,
        FP8=fp8, HAS_BIAS=weights.b2 is not None, WEIGHT_ON_INPUT=weight_on_input, TMA=tma, HALF_TAIL=half, GW=gw,
        SWAP_AB=cfg.swap_ab, WIDEN=widen, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    sum_pairs(y, topk_slots, out, s)
    return out


def mxfp4_words(blocks: torch.Tensor) -> torch.Tensor:
    """``blocks [S, N, K/32, 16]`` uint8 (contiguous) as the ``[S, N, K/8]`` int32 words the grouped kernels read
    (a view: input ``8 w + j`` of a row in nibble ``j`` of word ``w``, as INT4's packing)."""
    return blocks.view(torch.int32).flatten(2)


def packed_words(weights: Int4ExpertWeights | MXFP4ExpertWeights, kernels: str
                 ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The ``w13 [S, 2F, D/8]`` and ``w2 [S, D, F/8]`` int32 words of INT4 or MXFP4 ``weights`` (MXFP4's blocks read
    as words, ``mxfp4_words``) and the words a group scale covers (``G / 8``; MXFP4: 4).

    Raises:
        ValueError: MXFP4 blocks that are not contiguous, word strides (slot, row) that are not multiples of 4 or
            rows that are not contiguous, scale rows that are not contiguous: the ``kernels`` (named in the message)
            read whole 16-byte vectors of a row.
    """
    for name, t in zip(("w13 scales", "w2 scales"), packed_scales(weights)):
        if t.stride(-1) != 1:
            raise ValueError(f"the {kernels} kernels read the {name} of a row contiguous, got strides "
                             f"{tuple(t.stride())}")
    if isinstance(weights, MXFP4ExpertWeights):
        for name in ("w13_blocks", "w2_blocks"):
            if not getattr(weights, name).is_contiguous():
                raise ValueError(f"the {kernels} kernels read {name} contiguous, got strides "
                                 f"{tuple(getattr(weights, name).stride())}")
        w13, w2 = mxfp4_words(weights.w13_blocks), mxfp4_words(weights.w2_blocks)
        gw = MXFP4_BLOCK // INT4_PACK
    else:
        w13, w2 = weights.w13_packed, weights.w2_packed
        gw = weights.group_size // INT4_PACK
    for name, w in (("w13", w13), ("w2", w2)):
        if w.stride(2) != 1 or w.stride(0) % 4 or w.stride(1) % 4:
            raise ValueError(f"the {kernels} kernels read packed {name} rows of whole 4-word vectors, got word "
                             f"strides {tuple(w.stride())}")
    return w13, w2, gw


def packed_scales(weights: Int4ExpertWeights | MXFP4ExpertWeights) -> tuple[torch.Tensor, torch.Tensor]:
    """The group scales of ``w13`` and ``w2`` of INT4 (float) or MXFP4 (E8M0 uint8) ``weights``."""
    if isinstance(weights, MXFP4ExpertWeights):
        return weights.w13_scales, weights.w2_scales
    return weights.w13_scale, weights.w2_scale


def packed_kernel_operands(weights: Int4ExpertWeights | MXFP4ExpertWeights, placeholder: torch.Tensor
                         ) -> KernelOperands:
    """The group scales (with their ``(slot, row)`` strides) and biases of INT4 or MXFP4 ``weights`` as kernel
    arguments, ``placeholder`` in the place of an absent bias (as ``fp8.kernel_operands``)."""
    s13, s2 = packed_scales(weights)
    return KernelOperands(s13, (s13.stride(0), s13.stride(1)), s2, (s2.stride(0), s2.stride(1)),
                          weights.b13 if weights.b13 is not None else placeholder,
                          weights.b2 if weights.b2 is not None else placeholder)
