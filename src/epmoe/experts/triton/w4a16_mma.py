"""W4A16 expert compute on the tensor cores with the INT4 words widened straight into the MMA operand registers.

A Gluon kernel pair (Triton's layout-explicit dialect). The product is taken transposed: weight rows are the ``M``
side of ``mma.sync.m16n8k16`` (16 rows a warp tile), the token rows of one slot its ``N`` side, 8 at a time.

Row blocks and sub-blocks. The pairs are sorted by slot into blocks of ``MmaConfig.block_m`` rows (8, 16 or 32), a
slot's last block rounded up to a multiple of 8 rows (``align`` with ``tail_rows = 8``). A program widens each word
of its weight tile once and multiplies it with each 8-row sub-block of its block that holds rows (one MMA each); the
MMAs and activation loads of the sub-blocks past the block's rows are not issued. So a slot with ``c`` pairs costs
``ceil(c / block_m)`` widenings of its weights and ``ceil(c / 8)`` MMAs a widened register: a popular expert no
longer pays one widening per 8 of its tokens. The kernels branch on the block's sub-block count once, before the
loop over ``K`` (one straight-line loop per count).

Input order and widening: ``w4a16_operands`` (shared with ``w4a16_wgmma``; read its module docstring first). A step
of ``BLOCK_KW`` words is four MMAs, one per nibble plane ``j = 0..3``: the weights' plane ``A_j [BLOCK_N, 2
BLOCK_KW]`` widened from the words in registers, and ``B_j [2 BLOCK_KW, BLOCK_M]`` holding at ``(2 w + e, m)`` input
``8 c + j + 4 e`` of token row ``m`` (``w`` the operand word of memory word ``c``).

Activations are read from nibble-plane copies (``nibble_planes``: input ``8 c + j + 4 e`` at ``j * seg + 2 c + e``),
so a thread's part of ``B_j`` is also consecutive in memory (16-byte loads) and relabelled the same way
(``_b_operand``); the gate/up kernel writes ``h`` in that form for the down kernel.

1. ``mma_prologue``: one launch of ``_prologue_kernel``, whose program 0 aligns the pairs
   (``align_kernels.align_program``: pairs sorted by slot, ``block_m`` rows a block, a slot's last block rounded up
   to 8 rows) while the others write the activations' nibble-plane copy (``nibble_planes``) and program 1 zeroes
   the split counters. Above ``align_kernels.one_program``'s sizes, ``nibble_planes``,
   ``align_kernels.align_triton`` and a fill of the counters instead.
2. ``_gate_up_kernel``, grid ``SPLIT_MAX * NB * cdiv(F, BLOCK_N1)``: gate and up rows of a block's slot against the
   block's token rows (the next step's words and scales requested before this step's are widened), bias, routing
   weight (on the input), the gated activation; ``h`` stored per sorted position.
3. ``_down_kernel``, grid ``SPLIT_MAX * NB * cdiv(D, BLOCK_N2)``: ``w2`` rows against the block's ``h`` rows, bias,
   routing weight (on the output), ``y [N, D]`` float32 at each pair's row.
4. ``grouped.sum_pairs``: ``out[t] = sum_k y[t K + k]``.

Split reduction (``w4a16_split``). When a launch has few row blocks (decode; ``SPLIT_MAX > 1``), each tile's
reduction over ``K`` is split so that the GPU is filled.

Static grids, no host synchronisation: CUDA-graph safe. ``mma.sync`` with bf16 and ``bf16x2`` arithmetic: compute
capability 9.0 PTX (Hopper); bf16 activations only.

Source: feeding widened registers to ``mma.sync`` without shared memory is what the W4A16 kernels of Marlin do
(Frantar et al., "MARLIN: Mixed-Precision Auto-Regressive Parallel Inference on Large Language Models",
arXiv:2408.11743), after an offline reorder of the weights; here the order of the inputs is chosen instead
(``w4a16_operands``), so the checkpoint's packed layout is read as it is. The code is our own.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from epmoe.experts.int4 import INT4_PACK, Int4ExpertWeights
from epmoe.experts.mxfp4 import MXFP4ExpertWeights
from epmoe.experts.triton.align import Alignment, num_aligned_blocks, tail_rows_of
from epmoe.experts.triton.align_kernels import (
    PROGRAM_BLOCK,
    align_program,
    align_triton,
    alignment_buffers,
    one_program,
)
from epmoe.experts.triton.decode import zero_arrival_counters
from epmoe.experts.triton.grouped import act_code, packed_scales, packed_words, sum_pairs
from epmoe.experts.triton.w4a16 import row_strides
from epmoe.experts.triton.w4a16_mma_config import MmaConfig, check_mma_config, default_mma_config
from epmoe.experts.triton.w4a16_operands import (
    block_rows,
    gated_rows,
    load_tile,
    operand_order,
    scales_per_word,
    store_down_rows,
    weight_ptrs,
    widened_plane,
)
from epmoe.experts.triton.w4a16_split import (
    first_word,
    is_last_split,
    programs_wanted,
    reduced_partials,
    split_count,
    split_k_range,
    split_program_ids,
    split_workspace,
    store_partial,
)
from epmoe.experts.weights import Activation, check_expert_call


@gluon.constexpr_function
def _plane_layout(block_kw, block_m, num_warps):
    """Register layout of a step's tile ``[2 block_kw, block_m]`` of one nibble plane of the activations (memory
    order): thread ``(g, q)`` holds token rows ``g + 8 i``, elements ``[4 q R, 4 (q + 1) R)`` (``R = block_kw / 8``);
    every warp holds it all."""
    r4 = block_kw // 2
    regs = [[1 << i, 0] for i in range(r4.bit_length() - 1)]
    regs += [[0, 8 << i] for i in range((block_m // 8).bit_length() - 1)]
    lanes = [[r4, 0], [2 * r4, 0], [0, 1], [0, 2], [0, 4]]
    warps = [[0, 0] for _ in range(num_warps.bit_length() - 1)]
    return gl.DistributedLinearLayout(regs, lanes, warps, [], [2 * block_kw, block_m])


@gluon.jit
def _b_operand(v, BLOCK_KW: gl.constexpr, BLOCK_M: gl.constexpr, LAYOUT: gl.constexpr):
    """A nibble plane's tile in memory order (element ``2 c + e``) -> the B operand's order (``2 w + e``, ``w`` the
    operand word of memory word ``c`` as ``operand_order``), in ``LAYOUT``; register relabelling only."""
    R: gl.constexpr = BLOCK_KW // 8
    t = gl.reshape(gl.permute(gl.reshape(v, [4, R, 2, 2, BLOCK_M]), [1, 2, 0, 3, 4]), [2 * BLOCK_KW, BLOCK_M])
    return gl.convert_layout(t, LAYOUT)


@gluon.jit
def _load_inputs(ptrs, kk, k_left, EVEN: gl.constexpr):
    """A step's activation tile (``ptrs``), inputs at or past ``k_left`` (a multiple of 8: ``load_tile``) zero unless
    ``EVEN``."""
    if EVEN:
        return gl.load(ptrs)
    else:
        return gl.load(ptrs, mask=(kk < (k_left // 8) * 8)[:, None], other=0.0)


@gluon.jit
def _b_tile(v_ptrs, kk, k_left, BLOCK_KW: gl.constexpr, EVEN: gl.constexpr, B_LAYOUT: gl.constexpr):
    """One 8-row sub-block's B operand of a nibble plane (its activation tile at ``v_ptrs``)."""
    return _b_operand(_load_inputs(v_ptrs, kk, k_left, EVEN), BLOCK_KW, 8, B_LAYOUT)


@gluon.jit
def _dot_step(words, scales, v0, v1, v2, v3, kk, k_left, seg, acc0, acc1, acc2, acc3, ACTIVE: gl.constexpr,
              BLOCK_N: gl.constexpr, BLOCK_KW: gl.constexpr, GW: gl.constexpr, MMA: gl.constexpr, EVEN: gl.constexpr):
    """The accumulators of ``ACTIVE`` 8-row sub-blocks plus one step's product: the word and scale tiles (memory order)
    widened plane by plane into the A operand once, each plane multiplied with the nibble plane (at ``v_i + j *
    seg``) of each sub-block. A plane's activation tiles are requested before it is widened, so that their loads
    overlap the widening."""
    W_LAYOUT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=1)
    A_LAYOUT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    B_LAYOUT: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
    MXFP4: gl.constexpr = scales.dtype == gl.uint8
    a = operand_order(words, BLOCK_N, BLOCK_KW, W_LAYOUT)
    sw = operand_order(scales_per_word(scales, GW, BLOCK_N, BLOCK_KW), BLOCK_N, BLOCK_KW, W_LAYOUT)
    for j in gl.static_range(4):
        b0 = _b_tile(v0 + j * seg, kk, k_left, BLOCK_KW, EVEN, B_LAYOUT)
        if ACTIVE > 1:
            b1 = _b_tile(v1 + j * seg, kk, k_left, BLOCK_KW, EVEN, B_LAYOUT)
        if ACTIVE > 2:
            b2 = _b_tile(v2 + j * seg, kk, k_left, BLOCK_KW, EVEN, B_LAYOUT)
        if ACTIVE > 3:
            b3 = _b_tile(v3 + j * seg, kk, k_left, BLOCK_KW, EVEN, B_LAYOUT)
        aj = widened_plane(a, sw, j, BLOCK_N, BLOCK_KW, A_LAYOUT, MXFP4)
        acc0 = mma_v2(aj, b0, acc0)
        if ACTIVE > 1:
            acc1 = mma_v2(aj, b1, acc1)
        if ACTIVE > 2:
            acc2 = mma_v2(aj, b2, acc2)
        if ACTIVE > 3:
            acc3 = mma_v2(aj, b3, acc3)
    return acc0, acc1, acc2, acc3


@gluon.jit
def _x_ptrs(xq_ptr, sorted_ptr, pos, num_pairs, top_k, stride_x, kk, begin, LAYOUT: gl.constexpr):
    """Pointers ``[2 BLOCK_KW, 8]`` at word ``begin`` of the nibble planes of the token rows of sorted positions
    ``[pos, pos + 8)`` (a padding row reads token 0: its column of the product is never stored)."""
    pair, valid = block_rows(sorted_ptr, pos, num_pairs, 8, gl.SliceLayout(0, LAYOUT))
    tok = gl.where(valid, pair // top_k, 0).to(gl.int64)
    return (xq_ptr + tok[None, :] * stride_x + 2 * begin) + kk[:, None]


@gluon.jit
def _pick(a0, a1, a2, a3, i: gl.constexpr):
    """Accumulator ``i`` of four."""
    if i == 0:
        return a0
    elif i == 1:
        return a1
    elif i == 2:
        return a2
    else:
        return a3


@gluon.jit
def _gate_up_loop(x0, x1, x2, x3, kk, seg_x, wg_ptrs, sg_ptrs, rows, cols, s_rows, s_cols, F, stride_wn, stride_sn,
                  begin, end, DW, ACTIVE: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_KW: gl.constexpr,
                  GW: gl.constexpr, MMA: gl.constexpr, EVEN: gl.constexpr):
    """The gate and up accumulators of ``ACTIVE`` sub-blocks (token rows at ``x_i``) over words ``[begin, end)`` of
    the gate rows at ``wg_ptrs`` (the up rows ``F`` rows further). One loop per ``ACTIVE``, the kernel branching on
    the count once: with a branch per plane, the compiler hoisted the planes' widening out of the branches and held
    all four planes in registers."""
    wu_ptrs = wg_ptrs + F * stride_wn
    su_ptrs = sg_ptrs + F * stride_sn
    wg = load_tile(wg_ptrs, rows, F, cols, end - begin, EVEN)
    wu = load_tile(wu_ptrs, rows, F, cols, end - begin, EVEN)
    sg = load_tile(sg_ptrs, s_rows, F, s_cols, end - begin, EVEN)
    su = load_tile(su_ptrs, s_rows, F, s_cols, end - begin, EVEN)
    g0 = gl.zeros([BLOCK_N, 8], gl.float32, layout=MMA)
    g1 = g0
    g2 = g0
    g3 = g0
    u0 = g0
    u1 = g0
    u2 = g0
    u3 = g0
    for kw0 in range(begin, end, BLOCK_KW):
        # the next step's words and scales requested before this step's are widened (the last step's own again)
        step = gl.where(kw0 + BLOCK_KW < end, BLOCK_KW, 0)
        wg_ptrs += step
        wu_ptrs += step
        sg_ptrs += step // GW
        su_ptrs += step // GW
        left = end - kw0 - step
        wg_next = load_tile(wg_ptrs, rows, F, cols, left, EVEN)
        wu_next = load_tile(wu_ptrs, rows, F, cols, left, EVEN)
        sg_next = load_tile(sg_ptrs, s_rows, F, s_cols, left, EVEN)
        su_next = load_tile(su_ptrs, s_rows, F, s_cols, left, EVEN)
        k_left = 2 * (DW - kw0)
        g0, g1, g2, g3 = _dot_step(wg, sg, x0, x1, x2, x3, kk, k_left, seg_x, g0, g1, g2, g3, ACTIVE, BLOCK_N,
                                   BLOCK_KW, GW, MMA, EVEN)
        u0, u1, u2, u3 = _dot_step(wu, su, x0, x1, x2, x3, kk, k_left, seg_x, u0, u1, u2, u3, ACTIVE, BLOCK_N,
                                   BLOCK_KW, GW, MMA, EVEN)
        x0 += 2 * BLOCK_KW
        if ACTIVE > 1:
            x1 += 2 * BLOCK_KW
        if ACTIVE > 2:
            x2 += 2 * BLOCK_KW
        if ACTIVE > 3:
            x3 += 2 * BLOCK_KW
        wg = wg_next
        wu = wu_next
        sg = sg_next
        su = su_next
    return g0, g1, g2, g3, u0, u1, u2, u3


@gluon.jit
def _gate_up_kernel(
    xq_ptr, w_ptr, s_ptr, b_ptr, tw_ptr, h_ptr, sorted_ptr, block_slot_ptr, block_start_ptr, block_rows_ptr, ws_ptr,
    count_ptr, num_pairs, num_blocks, top_k, D, F, seg_x, seg_h, stride_x, stride_we, stride_wn, stride_se, stride_sn,
    stride_h, act_limit, act_alpha, BLOCK_N: gl.constexpr, BLOCK_KW: gl.constexpr, NSUB: gl.constexpr,
    GW: gl.constexpr, ACT: gl.constexpr, HAS_BIAS: gl.constexpr, WEIGHT_ON_INPUT: gl.constexpr,
    NUM_WARPS: gl.constexpr, EVEN: gl.constexpr, NB_PAD: gl.constexpr, SPLIT_MAX: gl.constexpr, TARGET: gl.constexpr,
):
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NUM_WARPS, 1], instr_shape=[16, 8])
    X_MEM: gl.constexpr = _plane_layout(BLOCK_KW, 8, NUM_WARPS)
    num_n = gl.cdiv(F, BLOCK_N)
    pid_m, pid_n, pid_s = split_program_ids(num_n, SPLIT_MAX)
    slot = gl.load(block_slot_ptr + pid_m).to(gl.int64)
    if slot < 0:
        return
    split = split_count(block_slot_ptr, num_blocks, num_n, NB_PAD, SPLIT_MAX, TARGET)
    if pid_s >= split:
        return
    first = gl.load(block_start_ptr + pid_m)
    nsub = gl.load(block_rows_ptr + pid_m) // 8  # the block's 8-row sub-blocks that hold rows
    DW = D // 8
    begin, end = split_k_range(pid_s, split, DW, BLOCK_KW, EVEN)
    # B: each sub-block's token rows of the nibble planes of x (a sub-block past the block's rows is never read)
    kk = gl.arange(0, 2 * BLOCK_KW, layout=gl.SliceLayout(1, X_MEM))
    x0 = _x_ptrs(xq_ptr, sorted_ptr, first, num_pairs, top_k, stride_x, kk, begin, X_MEM)
    x1 = x0
    x2 = x0
    x3 = x0
    if NSUB > 1:
        x1 = _x_ptrs(xq_ptr, sorted_ptr, first + 8, num_pairs, top_k, stride_x, kk, begin, X_MEM)
    if NSUB > 2:
        x2 = _x_ptrs(xq_ptr, sorted_ptr, first + 16, num_pairs, top_k, stride_x, kk, begin, X_MEM)
        x3 = _x_ptrs(xq_ptr, sorted_ptr, first + 24, num_pairs, top_k, stride_x, kk, begin, X_MEM)
    # A: gate rows and up rows (F + rows) of the slot
    w0 = first_word(begin, DW, BLOCK_KW, EVEN)
    stride_we, stride_wn = row_strides(stride_we, stride_wn)
    wg_ptrs, sg_ptrs, rows, cols, s_rows, s_cols = weight_ptrs(
        w_ptr + slot * stride_we + w0, s_ptr + slot * stride_se + w0 // GW, pid_n * BLOCK_N, stride_wn, stride_sn,
        BLOCK_N, BLOCK_KW, GW, NUM_WARPS)
    if NSUB == 1:
        g0, g1, g2, g3, u0, u1, u2, u3 = _gate_up_loop(
            x0, x1, x2, x3, kk, seg_x, wg_ptrs, sg_ptrs, rows, cols, s_rows, s_cols, F, stride_wn, stride_sn, begin,
            end, DW, 1, BLOCK_N, BLOCK_KW, GW, MMA, EVEN)
    elif NSUB == 2:
        if nsub > 1:
            g0, g1, g2, g3, u0, u1, u2, u3 = _gate_up_loop(
                x0, x1, x2, x3, kk, seg_x, wg_ptrs, sg_ptrs, rows, cols, s_rows, s_cols, F, stride_wn, stride_sn,
                begin, end, DW, 2, BLOCK_N, BLOCK_KW, GW, MMA, EVEN)
        else:
            g0, g1, g2, g3, u0, u1, u2, u3 = _gate_up_loop(
                x0, x1, x2, x3, kk, seg_x, wg_ptrs, sg_ptrs, rows, cols, s_rows, s_cols, F, stride_wn, stride_sn,
                begin, end, DW, 1, BLOCK_N, BLOCK_KW, GW, MMA, EVEN)
    else:
        if nsub > 3:
            g0, g1, g2, g3, u0, u1, u2, u3 = _gate_up_loop(
                x0, x1, x2, x3, kk, seg_x, wg_ptrs, sg_ptrs, rows, cols, s_rows, s_cols, F, stride_wn, stride_sn,
                begin, end, DW, 4, BLOCK_N, BLOCK_KW, GW, MMA, EVEN)
        elif nsub > 2:
            g0, g1, g2, g3, u0, u1, u2, u3 = _gate_up_loop(
                x0, x1, x2, x3, kk, seg_x, wg_ptrs, sg_ptrs, rows, cols, s_rows, s_cols, F, stride_wn, stride_sn,
                begin, end, DW, 3, BLOCK_N, BLOCK_KW, GW, MMA, EVEN)
        elif nsub > 1:
            g0, g1, g2, g3, u0, u1, u2, u3 = _gate_up_loop(
                x0, x1, x2, x3, kk, seg_x, wg_ptrs, sg_ptrs, rows, cols, s_rows, s_cols, F, stride_wn, stride_sn,
                begin, end, DW, 2, BLOCK_N, BLOCK_KW, GW, MMA, EVEN)
        else:
            g0, g1, g2, g3, u0, u1, u2, u3 = _gate_up_loop(
                x0, x1, x2, x3, kk, seg_x, wg_ptrs, sg_ptrs, rows, cols, s_rows, s_cols, F, stride_wn, stride_sn,
                begin, end, DW, 1, BLOCK_N, BLOCK_KW, GW, MMA, EVEN)
    last = True
    if SPLIT_MAX > 1:
        if split > 1:
            tile = pid_m * num_n + pid_n
            for i in gl.static_range(NSUB):
                if i < nsub:
                    store_partial(ws_ptr, _pick(g0, g1, g2, g3, i), 2 * i, tile, pid_s, 2 * NSUB, SPLIT_MAX, BLOCK_N,
                                  MMA)
                    store_partial(ws_ptr, _pick(u0, u1, u2, u3, i), 2 * i + 1, tile, pid_s, 2 * NSUB, SPLIT_MAX,
                                  BLOCK_N, MMA)
            last = is_last_split(count_ptr, tile, split)
            if last:
                g0 = reduced_partials(ws_ptr, 0, tile, split, 2 * NSUB, SPLIT_MAX, BLOCK_N, MMA)
                u0 = reduced_partials(ws_ptr, 1, tile, split, 2 * NSUB, SPLIT_MAX, BLOCK_N, MMA)
                if NSUB > 1:
                    if nsub > 1:
                        g1 = reduced_partials(ws_ptr, 2, tile, split, 2 * NSUB, SPLIT_MAX, BLOCK_N, MMA)
                        u1 = reduced_partials(ws_ptr, 3, tile, split, 2 * NSUB, SPLIT_MAX, BLOCK_N, MMA)
                if NSUB > 2:
                    if nsub > 2:
                        g2 = reduced_partials(ws_ptr, 4, tile, split, 2 * NSUB, SPLIT_MAX, BLOCK_N, MMA)
                        u2 = reduced_partials(ws_ptr, 5, tile, split, 2 * NSUB, SPLIT_MAX, BLOCK_N, MMA)
                    if nsub > 3:
                        g3 = reduced_partials(ws_ptr, 6, tile, split, 2 * NSUB, SPLIT_MAX, BLOCK_N, MMA)
                        u3 = reduced_partials(ws_ptr, 7, tile, split, 2 * NSUB, SPLIT_MAX, BLOCK_N, MMA)
    if last:
        for i in gl.static_range(NSUB):
            if i < nsub:
                _gate_up_epilogue(_pick(g0, g1, g2, g3, i), _pick(u0, u1, u2, u3, i), b_ptr, tw_ptr, h_ptr,
                                  sorted_ptr, first + 8 * i, num_pairs, slot, pid_n, F, seg_h, stride_h, act_limit,
                                  act_alpha, BLOCK_N, MMA, ACT, HAS_BIAS, WEIGHT_ON_INPUT)


@gluon.jit
def _gate_up_epilogue(acc_g, acc_u, b_ptr, tw_ptr, h_ptr, sorted_ptr, pos, num_pairs, slot, pid_n, F, seg_h,
                      stride_h, act_limit, act_alpha, BLOCK_N: gl.constexpr, MMA: gl.constexpr, ACT: gl.constexpr,
                      HAS_BIAS: gl.constexpr, WEIGHT_ON_INPUT: gl.constexpr):
    """``gated_rows`` of the sub-block of sorted positions ``[pos, pos + 8)``, ``h`` stored in nibble-plane form."""
    h, f, ok = gated_rows(acc_g, acc_u, b_ptr, tw_ptr, sorted_ptr, slot, pos, pid_n, num_pairs, F, act_limit,
                          act_alpha, BLOCK_N, 8, MMA, ACT, HAS_BIAS, WEIGHT_ON_INPUT)
    m_c = gl.arange(0, 8, layout=gl.SliceLayout(0, MMA))
    h_ptrs = h_ptr + (pos + m_c).to(gl.int64)[None, :] * stride_h + _plane_position(f, seg_h)[:, None]
    gl.store(h_ptrs, h.to(h_ptr.dtype.element_ty), mask=ok)


@gluon.jit
def _plane_position(n, seg):
    """Where input ``n = 8 c + j + 4 e`` of a row goes in its nibble-plane copy (``nibble_planes``): plane ``j`` (at
    ``j * seg``), at ``2 c + e``."""
    return (n % 4) * seg + 2 * (n // 8) + (n // 4) % 2


@gluon.jit
def _down_loop(h0, stride_h, kk, seg_h, w_ptrs, s_ptrs, rows, cols, s_rows, s_cols, D, begin, end, FW,
               ACTIVE: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_KW: gl.constexpr, GW: gl.constexpr,
               MMA: gl.constexpr, EVEN: gl.constexpr):
    """The accumulators of ``ACTIVE`` sub-blocks (``h`` rows at ``h0``, each next sub-block 8 rows further) over
    words ``[begin, end)`` of the ``w2`` rows at ``w_ptrs`` (one loop per count, as ``_gate_up_loop``)."""
    w = load_tile(w_ptrs, rows, D, cols, end - begin, EVEN)
    sc = load_tile(s_ptrs, s_rows, D, s_cols, end - begin, EVEN)
    a0 = gl.zeros([BLOCK_N, 8], gl.float32, layout=MMA)
    a1 = a0
    a2 = a0
    a3 = a0
    for kw0 in range(begin, end, BLOCK_KW):
        step = gl.where(kw0 + BLOCK_KW < end, BLOCK_KW, 0)
        w_ptrs += step
        s_ptrs += step // GW
        left = end - kw0 - step
        w_next = load_tile(w_ptrs, rows, D, cols, left, EVEN)
        sc_next = load_tile(s_ptrs, s_rows, D, s_cols, left, EVEN)
        a0, a1, a2, a3 = _dot_step(w, sc, h0, h0 + 8 * stride_h, h0 + 16 * stride_h, h0 + 24 * stride_h, kk,
                                   2 * (FW - kw0), seg_h, a0, a1, a2, a3, ACTIVE, BLOCK_N, BLOCK_KW, GW, MMA, EVEN)
        h0 += 2 * BLOCK_KW
        w = w_next
        sc = sc_next
    return a0, a1, a2, a3


@gluon.jit
def _down_kernel(
    h_ptr, w_ptr, s_ptr, b_ptr, tw_ptr, y_ptr, sorted_ptr, block_slot_ptr, block_start_ptr, block_rows_ptr, ws_ptr,
    count_ptr, num_pairs, num_blocks, D, F, seg_h, stride_we, stride_wn, stride_se, stride_sn, stride_h,
    BLOCK_N: gl.constexpr, BLOCK_KW: gl.constexpr, NSUB: gl.constexpr, GW: gl.constexpr, HAS_BIAS: gl.constexpr,
    WEIGHT_ON_INPUT: gl.constexpr, NUM_WARPS: gl.constexpr, EVEN: gl.constexpr, NB_PAD: gl.constexpr,
    SPLIT_MAX: gl.constexpr, TARGET: gl.constexpr,
):
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NUM_WARPS, 1], instr_shape=[16, 8])
    H_MEM: gl.constexpr = _plane_layout(BLOCK_KW, 8, NUM_WARPS)
    num_n = gl.cdiv(D, BLOCK_N)
    pid_m, pid_n, pid_s = split_program_ids(num_n, SPLIT_MAX)
    slot = gl.load(block_slot_ptr + pid_m).to(gl.int64)
    if slot < 0:
        return
    split = split_count(block_slot_ptr, num_blocks, num_n, NB_PAD, SPLIT_MAX, TARGET)
    if pid_s >= split:
        return
    first = gl.load(block_start_ptr + pid_m)
    nsub = gl.load(block_rows_ptr + pid_m) // 8
    FW = F // 8
    begin, end = split_k_range(pid_s, split, FW, BLOCK_KW, EVEN)
    # B: each sub-block's h rows (a padding row was never written: its column of the product is never stored)
    kk = gl.arange(0, 2 * BLOCK_KW, layout=gl.SliceLayout(1, H_MEM))
    m_b = gl.arange(0, 8, layout=gl.SliceLayout(0, H_MEM))
    h0 = (h_ptr + (first + m_b).to(gl.int64)[None, :] * stride_h + 2 * begin) + kk[:, None]
    w0 = first_word(begin, FW, BLOCK_KW, EVEN)
    stride_we, stride_wn = row_strides(stride_we, stride_wn)
    w_ptrs, s_ptrs, rows, cols, s_rows, s_cols = weight_ptrs(
        w_ptr + slot * stride_we + w0, s_ptr + slot * stride_se + w0 // GW, pid_n * BLOCK_N, stride_wn, stride_sn,
        BLOCK_N, BLOCK_KW, GW, NUM_WARPS)
    if NSUB == 1:
        a0, a1, a2, a3 = _down_loop(h0, stride_h, kk, seg_h, w_ptrs, s_ptrs, rows, cols, s_rows, s_cols, D, begin,
                                    end, FW, 1, BLOCK_N, BLOCK_KW, GW, MMA, EVEN)
    elif NSUB == 2:
        if nsub > 1:
            a0, a1, a2, a3 = _down_loop(h0, stride_h, kk, seg_h, w_ptrs, s_ptrs, rows, cols, s_rows, s_cols, D,
                                        begin, end, FW, 2, BLOCK_N, BLOCK_KW, GW, MMA, EVEN)
        else:
            a0, a1, a2, a3 = _down_loop(h0, stride_h, kk, seg_h, w_ptrs, s_ptrs, rows, cols, s_rows, s_cols, D,
                                        begin, end, FW, 1, BLOCK_N, BLOCK_KW, GW, MMA, EVEN)
    else:
        if nsub > 3:
            a0, a1, a2, a3 = _down_loop(h0, stride_h, kk, seg_h, w_ptrs, s_ptrs, rows, cols, s_rows, s_cols, D,
                                        begin, end, FW, 4, BLOCK_N, BLOCK_KW, GW, MMA, EVEN)
        elif nsub > 2:
            a0, a1, a2, a3 = _down_loop(h0, stride_h, kk, seg_h, w_ptrs, s_ptrs, rows, cols, s_rows, s_cols, D,
                                        begin, end, FW, 3, BLOCK_N, BLOCK_KW, GW, MMA, EVEN)
        elif nsub > 1:
            a0, a1, a2, a3 = _down_loop(h0, stride_h, kk, seg_h, w_ptrs, s_ptrs, rows, cols, s_rows, s_cols, D,
                                        begin, end, FW, 2, BLOCK_N, BLOCK_KW, GW, MMA, EVEN)
        else:
            a0, a1, a2, a3 = _down_loop(h0, stride_h, kk, seg_h, w_ptrs, s_ptrs, rows, cols, s_rows, s_cols, D,
                                        begin, end, FW, 1, BLOCK_N, BLOCK_KW, GW, MMA, EVEN)
    last = True
    if SPLIT_MAX > 1:
        if split > 1:
            tile = pid_m * num_n + pid_n
            for i in gl.static_range(NSUB):
                if i < nsub:
                    store_partial(ws_ptr, _pick(a0, a1, a2, a3, i), i, tile, pid_s, NSUB, SPLIT_MAX, BLOCK_N, MMA)
            last = is_last_split(count_ptr, tile, split)
            if last:
                a0 = reduced_partials(ws_ptr, 0, tile, split, NSUB, SPLIT_MAX, BLOCK_N, MMA)
                if NSUB > 1:
                    if nsub > 1:
                        a1 = reduced_partials(ws_ptr, 1, tile, split, NSUB, SPLIT_MAX, BLOCK_N, MMA)
                if NSUB > 2:
                    if nsub > 2:
                        a2 = reduced_partials(ws_ptr, 2, tile, split, NSUB, SPLIT_MAX, BLOCK_N, MMA)
                    if nsub > 3:
                        a3 = reduced_partials(ws_ptr, 3, tile, split, NSUB, SPLIT_MAX, BLOCK_N, MMA)
    if last:
        for i in gl.static_range(NSUB):
            if i < nsub:
                store_down_rows(_pick(a0, a1, a2, a3, i), b_ptr, tw_ptr, y_ptr, sorted_ptr, first + 8 * i, num_pairs,
                                slot, pid_n, D, BLOCK_N, 8, MMA, HAS_BIAS, WEIGHT_ON_INPUT)


def plane_segment(k: int) -> int:
    """Elements per nibble plane of a row of ``k`` inputs in the kernels' activation copies: ``k / 4`` rounded up to a
    multiple of 16 (the planes start 32-byte aligned: the loads are 16-byte vectors)."""
    return -(-k // 64) * 16


def nibble_planes(x: torch.Tensor) -> torch.Tensor:
    """``x [T, K]`` (``K`` a multiple of 8) -> its nibble-plane copy ``[T, 4 * plane_segment(K)]``: input ``8 c + j +
    4 e`` of a row at ``j * plane_segment(K) + 2 c + e`` (the planes' padding is never read)."""
    t, k = x.shape
    out = torch.empty(t, 4, plane_segment(k), dtype=x.dtype, device=x.device)
    out[:, :, :k // 4] = x.view(t, k // 8, 2, 4).permute(0, 3, 1, 2).reshape(t, 4, k // 4)
    return out.view(t, 4 * plane_segment(k))


_PLANES_BLOCK = 2048  # outputs a plane-copy program of _prologue_kernel writes
_ZERO_BLOCK = 1024


@triton.jit
def _prologue_kernel(
    slots_ptr, cursor_ptr, block_slot_ptr, block_start_ptr, block_rows_ptr, sorted_ptr, x_ptr, xq_ptr, count1_ptr,
    count2_ptr, num_count1, num_count2, num_pairs, num_slots, num_blocks, num_out, K, SEG, stride_x,
    BLOCK_M: tl.constexpr, TAIL: tl.constexpr, S_PAD: tl.constexpr, BLOCK: tl.constexpr, PLANES_BLOCK: tl.constexpr,
    ZERO_BLOCK: tl.constexpr,
):
    """Grid ``1 + max(1, cdiv(T * 4 * SEG, PLANES_BLOCK))``: program 0 aligns the pairs (``align_program``); program 1
    also zeroes the two launches' split counters; programs from 1 write ``PLANES_BLOCK`` outputs each of the
    nibble-plane copy ``xq [T, 4 SEG]`` (``nibble_planes``), each read from its input (the planes' padding is not
    written)."""
    pid = tl.program_id(0)
    if pid == 0:
        align_program(slots_ptr, cursor_ptr, block_slot_ptr, block_start_ptr, block_rows_ptr, sorted_ptr, num_pairs,
                      num_slots, num_blocks, BLOCK_M, TAIL, S_PAD, BLOCK)
    else:
        if pid == 1:
            zero_arrival_counters(count1_ptr, num_count1, ZERO_BLOCK)
            zero_arrival_counters(count2_ptr, num_count2, ZERO_BLOCK)
        o = (pid - 1).to(tl.int64) * PLANES_BLOCK + tl.arange(0, PLANES_BLOCK)
        t = o // (4 * SEG)
        q = o % SEG
        n = 8 * (q // 2) + (o % (4 * SEG)) // SEG + 4 * (q % 2)
        ok = (o < num_out) & (q < K // 4)
        tl.store(xq_ptr + o, tl.load(x_ptr + t * stride_x + n, mask=ok), mask=ok)


def mma_prologue(x: torch.Tensor, topk_slots: torch.Tensor, num_slots: int, block_m: int,
                 counters: tuple[torch.Tensor | None, torch.Tensor | None]) -> tuple[torch.Tensor, Alignment]:
    """The activations' nibble-plane copy and the pairs' alignment, with the split counters zeroed: one launch
    (``_prologue_kernel``) where ``align_kernels.one_program`` takes the sizes, else ``nibble_planes``,
    ``align_kernels.align_triton`` and fills.

    Args:
        x: ``[T, K]`` rows (``K`` a multiple of 8); CUDA, or any device under ``TRITON_INTERPRET=1``.
        topk_slots: ``[T, top_k]`` int64 local slot ids; an id outside ``[0, num_slots)`` skips.
        num_slots: ``S``.
        block_m: rows per full block (a multiple of 8: a slot's last block is rounded up to a multiple of 8 rows).
        counters: two int32 tensors to zero (either may be ``None``).

    Returns:
        ``(xq [T, 4 * plane_segment(K)], alignment)`` as ``nibble_planes(x)`` (the planes' padding unwritten) and
        ``align_kernels.align_triton(topk_slots, num_slots, block_m, tail_rows=8)`` give them.

    Raises:
        ValueError: ``block_m`` not a positive multiple of 8 (``align.tail_rows_of``).
    """
    tail_rows_of(block_m, False, 8)
    t, k = x.shape
    n = topk_slots.numel()
    if not one_program(n, num_slots):
        for c in counters:
            if c is not None:
                c.zero_()
        return nibble_planes(x), align_triton(topk_slots, num_slots, block_m, tail_rows=8)
    x = x if x.stride(1) == 1 else x.contiguous()
    seg = plane_segment(k)
    xq = torch.empty(t, 4 * seg, dtype=x.dtype, device=x.device)
    cursor, layout, sorted_ids = alignment_buffers(n, num_slots, block_m, x.device)
    c1, c2 = (c if c is not None else cursor for c in counters)
    # program 1 zeroes the counters, also where there are no rows to copy
    _prologue_kernel[(1 + max(1, triton.cdiv(xq.numel(), _PLANES_BLOCK)),)](
        topk_slots.reshape(-1), cursor, layout[0], layout[1], layout[2], sorted_ids, x, xq, c1, c2,
        0 if counters[0] is None else c1.numel(), 0 if counters[1] is None else c2.numel(), n, num_slots,
        layout.shape[1], xq.numel(), k, seg, x.stride(0), BLOCK_M=block_m, TAIL=8,
        S_PAD=triton.next_power_of_2(num_slots), BLOCK=PROGRAM_BLOCK, PLANES_BLOCK=_PLANES_BLOCK,
        ZERO_BLOCK=_ZERO_BLOCK, num_warps=8,
    )
    return xq, Alignment(sorted_ids, layout[0], layout[1], layout[2], block_m)


def packed_mma_experts(
    x: torch.Tensor,
    topk_slots: torch.Tensor,
    topk_weights: torch.Tensor,
    weights: Int4ExpertWeights | MXFP4ExpertWeights,
    activation: Activation,
    weight_on_input: bool = False,
    config: MmaConfig | None = None,
) -> torch.Tensor:
    """INT4 or MXFP4 expert compute on the tensor cores, the packed weights widened into the MMA registers (see the
    module docstring; MXFP4's blocks are read as words, ``grouped.packed_words``, with groups of 32 and their E8M0
    scales).

    Args:
        x: ``[T, D]`` bf16 CUDA rows, contiguous along ``D``.
        topk_slots: ``[T, K]`` int64 contiguous local slot ids; an id outside ``[0, S)`` (``-1``) skips.
        topk_weights: ``[T, K]`` float32 contiguous routing weights.
        weights: the packed weights (rows contiguous, word strides multiples of 4).
        activation: the gated activation.
        weight_on_input: scale the expert input by the weight instead of its output.
        config: tile shapes; ``default_mma_config(G, T * K, S)`` when ``None``.

    Returns:
        ``[T, D]`` bf16.

    Raises:
        ValueError: operands of other shapes or layouts than ``experts.weights.check_expert_call`` takes, packed word
            strides that are not multiples of 4.
        TypeError: ``x`` not bf16.
        ValueError: a ``config`` outside the constraints of ``MmaConfig``.
    """
    check_expert_call(x, topk_slots, topk_weights, weights.hidden_size)
    if x.dtype != torch.bfloat16:
        raise TypeError(f"the packed MMA kernels compute in bf16, got x of dtype {x.dtype}")
    w13, w2, gw = packed_words(weights, "MMA")
    s13, s2 = packed_scales(weights)
    g = gw * INT4_PACK
    t, k = topk_slots.shape
    n = t * k
    s, d, f = weights.num_slots, weights.hidden_size, weights.intermediate_size
    cfg = config if config is not None else default_mma_config(g, n, s)
    check_mma_config(cfg, g)
    if n == 0:  # no pair: no expert adds to any row
        return torch.zeros(t, d, dtype=x.dtype, device=x.device)
    out = torch.empty(t, d, dtype=x.dtype, device=x.device)
    bm = cfg.block_m
    nb = num_aligned_blocks(n, s, bm)
    seg_h = plane_segment(f)
    h = torch.empty(nb * bm, 4 * seg_h, dtype=x.dtype, device=x.device)
    y = torch.empty(n, d, dtype=torch.float32, device=x.device)
    placeholder = topk_weights
    limit = activation.swiglu_limit if activation.swiglu_limit is not None else 0.0
    n1, n2 = triton.cdiv(f, cfg.block_n1), triton.cdiv(d, cfg.block_n2)
    # few row blocks (decode): each tile's reduction may be split, up to split_max ways, so that the active blocks'
    # programs fill the GPU (the split is chosen on the device from the blocks in use)
    target = programs_wanted(x.device, cfg.num_warps)
    split1, ws1, count1 = split_workspace(cfg.split_max, nb, n1, 2 * cfg.block_n1 * bm, target, placeholder)
    split2, ws2, count2 = split_workspace(cfg.split_max, nb, n2, cfg.block_n2 * bm, target, placeholder)
    xq, aln = mma_prologue(x, topk_slots, s, bm, (count1 if split1 > 1 else None, count2 if split2 > 1 else None))
    nb_pad = triton.next_power_of_2(nb)
    _gate_up_kernel[(nb * n1 * split1,)](
        xq, w13, s13, weights.b13 if weights.b13 is not None else placeholder, topk_weights, h, aln.sorted_pair_ids,
        aln.block_slot, aln.block_start, aln.block_rows, ws1, count1, n, nb, k, d, f, plane_segment(d), seg_h,
        xq.stride(0), w13.stride(0), w13.stride(1), s13.stride(0), s13.stride(1), h.stride(0), float(limit),
        float(activation.swiglu_alpha),
        BLOCK_N=cfg.block_n1, BLOCK_KW=cfg.block_kw1, NSUB=bm // 8, GW=gw, ACT=act_code(activation),
        HAS_BIAS=weights.b13 is not None, WEIGHT_ON_INPUT=weight_on_input, NUM_WARPS=cfg.num_warps,
        EVEN=(d // INT4_PACK) % cfg.block_kw1 == 0 and f % cfg.block_n1 == 0, NB_PAD=nb_pad, SPLIT_MAX=split1,
        TARGET=target, num_warps=cfg.num_warps, maxnreg=cfg.maxnreg,
    )
    _down_kernel[(nb * n2 * split2,)](
        h, w2, s2, weights.b2 if weights.b2 is not None else placeholder, topk_weights, y, aln.sorted_pair_ids,
        aln.block_slot, aln.block_start, aln.block_rows, ws2, count2, n, nb, d, f, seg_h,
        w2.stride(0), w2.stride(1), s2.stride(0), s2.stride(1), h.stride(0),
        BLOCK_N=cfg.block_n2, BLOCK_KW=cfg.block_kw2, NSUB=bm // 8, GW=gw, HAS_BIAS=weights.b2 is not None,
        WEIGHT_ON_INPUT=weight_on_input, NUM_WARPS=cfg.num_warps,
        EVEN=(f // INT4_PACK) % cfg.block_kw2 == 0 and d % cfg.block_n2 == 0, NB_PAD=nb_pad, SPLIT_MAX=split2,
        TARGET=target, num_warps=cfg.num_warps, maxnreg=cfg.maxnreg,
    )
    return sum_pairs(y, topk_slots, out, s)
