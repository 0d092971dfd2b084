"""W4A16 expert compute on the tensor cores with the INT4 weights widened straight into the MMA operand registers.

A Gluon kernel pair (Triton's layout-explicit dialect): the packed weight words are loaded in the register layout
of the ``mma.sync`` A operand (``DotOperandLayout(0, k_width=1)`` over words), so widening is elementwise and the
widened tile already sits where ``mma.sync.m16n8k16`` reads it: no shared memory, no layout conversion (checked at
compile time: ``convert_layout(..., assert_trivial=True)``).

The product is taken transposed (weights as the ``M`` side, up to ``BLOCK_M = 8`` token rows of one slot as ``N``),
so one 16-row weight tile feeds one ``m16n8k16`` per 16 inputs whatever the number of tokens.

Nibble order. A word ``w`` of a weight row holds inputs ``8 w + j`` (``j = 0..7``, bits ``4 j``). For ``j = 0..3``
the product over a step's words is one MMA over the plane ``A_j [BLOCK_N, 2 BLOCK_KW]`` whose element ``(n, 2 w +
e)`` is nibble ``j + 4 e`` of word ``(n, w)``, against ``B_j [2 BLOCK_KW, BLOCK_M]`` whose element ``(2 w + e, m)``
is input ``8 w + j + 4 e`` of token row ``m``: a dot over ``K`` is a sum, so any order of the inputs does, as long
as both operands use it. The two nibbles ``j`` and ``j + 4`` are the two 16-bit lanes of ``(word >> 4 j) &
0x000F000F``, which is the bf16x2 register the A operand holds for inputs ``(2 w, 2 w + 1)`` (``k_width = 2``).

Widening a register (``_widen``, inline PTX): the two nibbles OR-ed into the mantissas of 128 (``lop3``), 136
subtracted in bf16x2 (exact: ``nib - 8``) and the pair multiplied by the group scale (one rounding, as
``experts.int4.dequantize_int4`` rounds its float32 product): about two instructions a weight.

1. ``_gate_up_kernel``, grid ``(NB * cdiv(F, BLOCK_N1),)`` over the row blocks of ``align_kernels.align_triton``
   (pairs sorted by slot, ``BLOCK_M`` rows a block): gate and up rows of the block's slot against the block's token
   rows gathered from ``x`` in the nibble order above (the next step's words and scales requested before this
   step's are widened), bias, routing weight (on the input), the gated activation; ``h`` stored per sorted
   position, already in the nibble order of the down kernel's ``B`` (``h_order``).
2. ``_down_kernel``, grid ``(NB * cdiv(D, BLOCK_N2),)``: ``w2`` rows against the block's ``h`` rows, bias, routing
   weight (on the output), ``y [N, D]`` float32 at each pair's row.
3. ``grouped.sum_pairs_kernel``: ``out[t] = sum_k y[t K + k]``.

Static grids, no host synchronisation: CUDA-graph safe. Compiles for NVIDIA GPUs of compute capability 8.0 and up
(``mma.sync`` with bf16; the widening uses ``bf16x2`` arithmetic, sm_90 PTX).

Source: the mantissa-OR widening is the trick of the W4A16 kernels (FasterTransformer; Marlin: Frantar et al.,
"MARLIN: Mixed-Precision Auto-Regressive Parallel Inference on Large Language Models", arXiv:2408.11743), which
also feed widened registers to ``mma.sync`` without shared memory (after an offline reorder of the weights; here the
order of the inputs is chosen instead, so the checkpoint's layout is read as it is). The code is our own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from epmoe.experts.int4 import INT4_PACK, Int4ExpertWeights
from epmoe.experts.triton.align_kernels import align_triton
from epmoe.experts.triton.decode import gated_activation
from epmoe.experts.triton.grouped import act_code, sum_pairs_kernel
from epmoe.experts.weights import Activation

MMA_BLOCK_M = 8
"""Token rows of a row block: the ``N`` side of ``mma.sync.m16n8k16``."""


@dataclass(frozen=True)
class MmaConfig:
    """Tile shapes of the two kernels (powers of two).

    Attributes:
        block_n1: gate (and up) rows per gate/up program, a multiple of ``16 * num_warps``.
        block_kw1: int32 words (8 inputs each) of ``D`` per step of the gate/up program: at least 8 and at least
            ``G / 2`` (a thread's words of a row, ``block_kw / 4``, cover whole groups).
        block_n2: ``w2`` rows (output columns) per down program, a multiple of ``16 * num_warps``.
        block_kw2: words of ``F`` per step of the down program, as ``block_kw1``.
        num_warps: warps per program (each owns ``block_n / num_warps`` rows).
    """

    block_n1: int = 32
    block_kw1: int = 16
    block_n2: int = 32
    block_kw2: int = 16
    num_warps: int = 2


@gluon.constexpr_function
def _word_layout(block_n, block_kw, num_warps, gw):
    """Register layout of a ``[block_n, block_kw // gw]`` tile in memory order (``gw = 1``: words; ``gw = G / 8``:
    their group scales): thread ``(g, q)`` of a warp holds rows ``g`` and ``g + 8`` of each of the warp's 16-row
    tiles and words ``[q R2, (q + 1) R2)`` (``R2 = block_kw / 4``, one 16-byte load for ``R2 = 4``), the words the
    A operand wants in that thread once the inputs are reordered (``_operand``)."""
    r2 = block_kw // 4
    regs = [[0, (1 << i) // gw] for i in range(r2.bit_length() - 1) if 1 << i >= gw] + [[8, 0]]
    regs += [[16 * num_warps << i, 0] for i in range((block_n // (16 * num_warps)).bit_length() - 1)]
    lanes = [[0, r2 // gw], [0, 2 * r2 // gw], [1, 0], [2, 0], [4, 0]]
    warps = [[16 << i, 0] for i in range(num_warps.bit_length() - 1)]
    return gl.DistributedLinearLayout(regs, lanes, warps, [], [block_n, block_kw // gw])


@gluon.constexpr_function
def _input_layout(block_kw, block_m, num_warps):
    """Register layout of the ``[2 block_kw, block_m]`` activation tile of a step in memory order: thread ``(g, q)``
    holds token row ``g``, inputs ``[4 q R, 4 (q + 1) R)`` (``R = block_kw / 8``); every warp holds it all."""
    r4 = block_kw // 2
    regs = [[1 << i, 0] for i in range(r4.bit_length() - 1)]
    lanes = [[r4, 0], [2 * r4, 0], [0, 1], [0, 2], [0, 4]]
    warps = [[0, 0] for _ in range(num_warps.bit_length() - 1)]
    return gl.DistributedLinearLayout(regs, lanes, warps, [], [2 * block_kw, block_m])


@gluon.jit
def _operand(words, BLOCK_N: gl.constexpr, BLOCK_KW: gl.constexpr, LAYOUT: gl.constexpr):
    """A word tile (or per-word tile) in memory order -> the order of the A operand: memory word ``c = 2 R q + 2 r +
    h`` is operand word ``8 r + 4 h + q`` (``R = BLOCK_KW / 8``), in ``LAYOUT`` (the same threads: no data moves)."""
    R: gl.constexpr = BLOCK_KW // 8
    t = gl.reshape(gl.permute(gl.reshape(words, [BLOCK_N, 4, R, 2]), [0, 2, 3, 1]), [BLOCK_N, BLOCK_KW])
    return gl.convert_layout(t, LAYOUT)


@gluon.jit
def _b_operand(v, BLOCK_KW: gl.constexpr, BLOCK_M: gl.constexpr, LAYOUT: gl.constexpr):
    """An activation tile in memory order (element ``2 c + e``) -> the B operand's order (``2 w + e`` with ``w`` the
    operand word of memory word ``c``, as ``_operand``), in ``LAYOUT``."""
    R: gl.constexpr = BLOCK_KW // 8
    t = gl.reshape(gl.permute(gl.reshape(v, [4, R, 2, 2, BLOCK_M]), [1, 2, 0, 3, 4]), [2 * BLOCK_KW, BLOCK_M])
    return gl.convert_layout(t, LAYOUT)


@gluon.jit
def _per_word(scales, GW: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_KW: gl.constexpr):
    """Group scales ``[BLOCK_N, BLOCK_KW / GW]`` -> one per word ``[BLOCK_N, BLOCK_KW]`` (copies in registers)."""
    if GW >= 2:
        scales = gl.join(scales, scales)
    if GW >= 4:
        scales = gl.join(scales, scales)
    if GW >= 8:
        scales = gl.join(scales, scales)
    if GW >= 16:
        scales = gl.join(scales, scales)
    return gl.reshape(scales, [BLOCK_N, BLOCK_KW])


@gluon.jit
def _widen(words, scale, J: gl.constexpr):
    """Nibbles ``J`` and ``J + 4`` of ``words`` (int32) times ``scale`` (bf16, the words' shape): two bf16 tensors of
    the words' shape (see the module docstring)."""
    SHIFT: gl.constexpr = f"shr.b32 t, t, {4 * J};" if J else ""
    return gl.inline_asm_elementwise(
        "{ .reg .b32 t, one, off, s2; mov.b32 t, $2; " + SHIFT
        + " lop3.b32 t, t, 0x000F000F, 0x43004300, 0xEA; mov.b32 one, 0x3F803F80; mov.b32 off, 0xC308C308;"
        " fma.rn.bf16x2 t, t, one, off; mov.b32 s2, {$3, $3}; mul.rn.bf16x2 t, t, s2; mov.b32 {$0, $1}, t; }",
        "=h,=h,r,h", [words, scale], dtype=(gl.bfloat16, gl.bfloat16), is_pure=True, pack=1)


@gluon.jit
def _plane(words, scale, J: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_KW: gl.constexpr, A_LAYOUT: gl.constexpr):
    """The A operand ``A_J [BLOCK_N, 2 BLOCK_KW]`` bf16 of operand-order words and scales ``[BLOCK_N, BLOCK_KW]``
    (module docstring)."""
    lo, hi = _widen(words, scale, J)
    a = gl.reshape(gl.join(lo, hi), [BLOCK_N, 2 * BLOCK_KW])
    return gl.convert_layout(a, A_LAYOUT, assert_trivial=True)


@gluon.jit
def _load(ptrs, mask, EVEN: gl.constexpr):
    """``ptrs`` loaded, masked (zeros) unless ``EVEN`` (tiles that divide the tensor)."""
    if EVEN:
        return gl.load(ptrs)
    else:
        return gl.load(ptrs, mask=mask, other=0)


@gluon.jit
def _block_rows(sorted_ptr, first, num_pairs, BLOCK_M: gl.constexpr, LAYOUT: gl.constexpr):
    """The pair ids of a row block's ``BLOCK_M`` sorted positions and which are real (padding: ``num_pairs``)."""
    pair = gl.load(sorted_ptr + first + gl.arange(0, BLOCK_M, layout=LAYOUT))
    return pair, pair < num_pairs


@gluon.jit
def _weight_tiles(w_ptr, s_ptr, row0, R_ROWS, KW, stride_wn, stride_sn, BLOCK_N: gl.constexpr, BLOCK_KW: gl.constexpr,
                  GW: gl.constexpr, NUM_WARPS: gl.constexpr):
    """Pointers of a program's first word tile (memory order) and its scale tile, and the masks' parts: rows
    ``row0 + [0, BLOCK_N)`` of ``R_ROWS``, words of ``KW``."""
    W_MEM: gl.constexpr = _word_layout(BLOCK_N, BLOCK_KW, NUM_WARPS, 1)
    S_MEM: gl.constexpr = _word_layout(BLOCK_N, BLOCK_KW, NUM_WARPS, GW)
    rows = row0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, W_MEM))
    cols = gl.arange(0, BLOCK_KW, layout=gl.SliceLayout(0, W_MEM))
    s_rows = row0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, S_MEM))
    s_cols = gl.arange(0, BLOCK_KW // GW, layout=gl.SliceLayout(0, S_MEM))
    w_ptrs = (w_ptr + rows.to(gl.int64)[:, None] * stride_wn) + cols[None, :]
    s_ptrs = (s_ptr + s_rows.to(gl.int64)[:, None] * stride_sn) + s_cols[None, :]
    return w_ptrs, s_ptrs, (rows < R_ROWS)[:, None], cols[None, :], (s_rows < R_ROWS)[:, None], s_cols[None, :]


@gluon.jit
def _gate_up_kernel(
    xq_ptr, w_ptr, s_ptr, b_ptr, tw_ptr, h_ptr, sorted_ptr, block_slot_ptr, block_start_ptr,
    num_pairs, top_k, D, F, seg_x, seg_h, stride_x, stride_we, stride_wn, stride_se, stride_sn, stride_h, act_limit,
    act_alpha,
    BLOCK_N: gl.constexpr, BLOCK_KW: gl.constexpr, BLOCK_M: gl.constexpr, GW: gl.constexpr, ACT: gl.constexpr,
    HAS_BIAS: gl.constexpr, WEIGHT_ON_INPUT: gl.constexpr, NUM_WARPS: gl.constexpr, EVEN: gl.constexpr,
):
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NUM_WARPS, 1], instr_shape=[16, 8])
    W_LAYOUT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=1)
    A_LAYOUT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    B_LAYOUT: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
    X_MEM: gl.constexpr = _input_layout(BLOCK_KW, BLOCK_M, NUM_WARPS)
    num_n = gl.cdiv(F, BLOCK_N)
    pid_m = gl.program_id(0) // num_n
    pid_n = gl.program_id(0) % num_n
    slot = gl.load(block_slot_ptr + pid_m).to(gl.int64)
    if slot < 0:
        return
    first = gl.load(block_start_ptr + pid_m)
    DW = D // 8
    # B: the block's token rows of the nibble-plane copy of x (a padding row reads token 0: its column of the
    # product is never stored)
    pair_b, valid_b = _block_rows(sorted_ptr, first, num_pairs, BLOCK_M, gl.SliceLayout(0, X_MEM))
    tok_b = gl.where(valid_b, pair_b // top_k, 0).to(gl.int64)
    kk = gl.arange(0, 2 * BLOCK_KW, layout=gl.SliceLayout(1, X_MEM))
    x_ptrs = (xq_ptr + tok_b[None, :] * stride_x) + kk[:, None]
    # A: gate rows and up rows (F + rows) of the slot
    wg_ptrs, sg_ptrs, n_ok, cols, sn_ok, s_cols = _weight_tiles(
        w_ptr + slot * stride_we, s_ptr + slot * stride_se, pid_n * BLOCK_N, F, DW, stride_wn, stride_sn, BLOCK_N,
        BLOCK_KW, GW, NUM_WARPS)
    wu_ptrs = wg_ptrs + F * stride_wn
    su_ptrs = sg_ptrs + F * stride_sn
    wg = _load(wg_ptrs, n_ok & (cols < DW), EVEN)
    wu = _load(wu_ptrs, n_ok & (cols < DW), EVEN)
    sg = _load(sg_ptrs, sn_ok & (s_cols < DW // GW), EVEN)
    su = _load(su_ptrs, sn_ok & (s_cols < DW // GW), EVEN)
    acc_g = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=MMA)
    acc_u = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=MMA)
    for kw0 in range(0, DW, BLOCK_KW):
        # the next step's words and scales requested before this step's are widened
        nxt = n_ok & (cols < DW - kw0 - BLOCK_KW)
        s_nxt = sn_ok & (s_cols < (DW - kw0 - BLOCK_KW) // GW)
        wg_ptrs += BLOCK_KW
        wu_ptrs += BLOCK_KW
        sg_ptrs += BLOCK_KW // GW
        su_ptrs += BLOCK_KW // GW
        wg_next = _load(wg_ptrs, nxt, EVEN)
        wu_next = _load(wu_ptrs, nxt, EVEN)
        sg_next = _load(sg_ptrs, s_nxt, EVEN)
        su_next = _load(su_ptrs, s_nxt, EVEN)
        b_ok = (kk < 2 * (DW - kw0))[:, None]
        a_g = _operand(wg, BLOCK_N, BLOCK_KW, W_LAYOUT)
        a_u = _operand(wu, BLOCK_N, BLOCK_KW, W_LAYOUT)
        s_g = _operand(_per_word(sg, GW, BLOCK_N, BLOCK_KW), BLOCK_N, BLOCK_KW, W_LAYOUT)
        s_u = _operand(_per_word(su, GW, BLOCK_N, BLOCK_KW), BLOCK_N, BLOCK_KW, W_LAYOUT)
        for j in gl.static_range(4):
            b = _b_operand(_load(x_ptrs + j * seg_x, b_ok, EVEN), BLOCK_KW, BLOCK_M, B_LAYOUT)
            acc_g = mma_v2(_plane(a_g, s_g, j, BLOCK_N, BLOCK_KW, A_LAYOUT), b, acc_g)
            acc_u = mma_v2(_plane(a_u, s_u, j, BLOCK_N, BLOCK_KW, A_LAYOUT), b, acc_u)
        x_ptrs += 2 * BLOCK_KW
        wg = wg_next
        wu = wu_next
        sg = sg_next
        su = su_next
    # epilogue in the accumulator layout: rows f of F, columns the block's token rows
    pair_c, valid_c = _block_rows(sorted_ptr, first, num_pairs, BLOCK_M, gl.SliceLayout(0, MMA))
    f = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, MMA))
    f_ok = f < F
    if WEIGHT_ON_INPUT:
        tw = gl.load(tw_ptr + pair_c, mask=valid_c, other=0.0)
        acc_g *= tw[None, :]
        acc_u *= tw[None, :]
    if HAS_BIAS:
        acc_g += gl.load(b_ptr + slot * 2 * F + f, mask=f_ok, other=0.0).to(gl.float32)[:, None]
        acc_u += gl.load(b_ptr + slot * 2 * F + F + f, mask=f_ok, other=0.0).to(gl.float32)[:, None]
    h = gated_activation(acc_g, acc_u, act_limit, act_alpha, ACT)
    h_ptrs = h_ptr + (first + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, MMA))).to(gl.int64)[None, :] * stride_h
    gl.store(h_ptrs + _plane_position(f, seg_h)[:, None], h.to(h_ptr.dtype.element_ty),
             mask=f_ok[:, None] & valid_c[None, :])


@gluon.jit
def _plane_position(n, seg):
    """Where input ``n = 8 c + j + 4 e`` of a row goes in its nibble-plane copy: plane ``j`` (at ``j * seg``), at
    ``2 c + e``."""
    return (n % 4) * seg + 2 * (n // 8) + (n // 4) % 2


@gluon.jit
def _down_kernel(
    h_ptr, w_ptr, s_ptr, b_ptr, tw_ptr, y_ptr, sorted_ptr, block_slot_ptr, block_start_ptr,
    num_pairs, D, F, seg_h, stride_we, stride_wn, stride_se, stride_sn, stride_h,
    BLOCK_N: gl.constexpr, BLOCK_KW: gl.constexpr, BLOCK_M: gl.constexpr, GW: gl.constexpr,
    HAS_BIAS: gl.constexpr, WEIGHT_ON_INPUT: gl.constexpr, NUM_WARPS: gl.constexpr, EVEN: gl.constexpr,
):
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NUM_WARPS, 1], instr_shape=[16, 8])
    W_LAYOUT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=1)
    A_LAYOUT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    B_LAYOUT: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
    H_MEM: gl.constexpr = _input_layout(BLOCK_KW, BLOCK_M, NUM_WARPS)
    num_n = gl.cdiv(D, BLOCK_N)
    pid_m = gl.program_id(0) // num_n
    pid_n = gl.program_id(0) % num_n
    slot = gl.load(block_slot_ptr + pid_m).to(gl.int64)
    if slot < 0:
        return
    first = gl.load(block_start_ptr + pid_m)
    FW = F // 8
    # B: the block's h rows (a padding row was never written: its column of the product is never stored)
    kk = gl.arange(0, 2 * BLOCK_KW, layout=gl.SliceLayout(1, H_MEM))
    m_b = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, H_MEM))
    h_ptrs = (h_ptr + (first + m_b).to(gl.int64)[None, :] * stride_h) + kk[:, None]
    w_ptrs, s_ptrs, n_ok, cols, sn_ok, s_cols = _weight_tiles(
        w_ptr + slot * stride_we, s_ptr + slot * stride_se, pid_n * BLOCK_N, D, FW, stride_wn, stride_sn, BLOCK_N,
        BLOCK_KW, GW, NUM_WARPS)
    w = _load(w_ptrs, n_ok & (cols < FW), EVEN)
    sc = _load(s_ptrs, sn_ok & (s_cols < FW // GW), EVEN)
    acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=MMA)
    for kw0 in range(0, FW, BLOCK_KW):
        w_ptrs += BLOCK_KW
        s_ptrs += BLOCK_KW // GW
        w_next = _load(w_ptrs, n_ok & (cols < FW - kw0 - BLOCK_KW), EVEN)
        sc_next = _load(s_ptrs, sn_ok & (s_cols < (FW - kw0 - BLOCK_KW) // GW), EVEN)
        b_ok = (kk < 2 * (FW - kw0))[:, None]
        a = _operand(w, BLOCK_N, BLOCK_KW, W_LAYOUT)
        s_w = _operand(_per_word(sc, GW, BLOCK_N, BLOCK_KW), BLOCK_N, BLOCK_KW, W_LAYOUT)
        for j in gl.static_range(4):
            b = _b_operand(_load(h_ptrs + j * seg_h, b_ok, EVEN), BLOCK_KW, BLOCK_M, B_LAYOUT)
            acc = mma_v2(_plane(a, s_w, j, BLOCK_N, BLOCK_KW, A_LAYOUT), b, acc)
        h_ptrs += 2 * BLOCK_KW
        w = w_next
        sc = sc_next
    pair_c, valid_c = _block_rows(sorted_ptr, first, num_pairs, BLOCK_M, gl.SliceLayout(0, MMA))
    d = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, MMA))
    d_ok = d < D
    if HAS_BIAS:
        acc += gl.load(b_ptr + slot * D + d, mask=d_ok, other=0.0).to(gl.float32)[:, None]
    if not WEIGHT_ON_INPUT:
        acc *= gl.load(tw_ptr + pair_c, mask=valid_c, other=0.0)[None, :]
    y_ptrs = y_ptr + pair_c.to(gl.int64)[None, :] * D + d[:, None]
    gl.store(y_ptrs, acc, mask=d_ok[:, None] & valid_c[None, :])


def default_mma_config(group_size: int) -> MmaConfig:
    """``MmaConfig()`` with steps of at least half a group (``block_kw >= G / 2``)."""
    kw = max(MmaConfig.block_kw1, group_size // 2)
    return MmaConfig(block_kw1=kw, block_kw2=kw)


def plane_segment(k: int) -> int:
    """Elements per nibble plane of a row of ``k`` inputs in the kernels' activation copies: ``k / 4`` rounded up to a
    multiple of 16 (so the planes start 32-byte aligned and the loads are 16-byte vectors)."""
    return -(-k // 64) * 16


def nibble_planes(x: torch.Tensor) -> torch.Tensor:
    """``x [T, K]`` (``K`` a multiple of 8) -> its nibble-plane copy ``[T, 4 * plane_segment(K)]``: input ``8 c + j +
    4 e`` of a row at ``j * plane_segment(K) + 2 c + e`` (the planes' padding is never read)."""
    t, k = x.shape
    out = torch.empty(t, 4, plane_segment(k), dtype=x.dtype, device=x.device)
    out[:, :, :k // 4] = x.view(t, k // 8, 2, 4).permute(0, 3, 1, 2).reshape(t, 4, k // 4)
    return out.view(t, 4 * plane_segment(k))


def _check(cfg: MmaConfig, group_size: int) -> None:
    for name in ("block_n1", "block_n2"):
        v = getattr(cfg, name)
        if v % (16 * cfg.num_warps) or v & (v - 1):
            raise ValueError(f"MmaConfig.{name} must be a power of two and a multiple of 16 * num_warps "
                             f"({16 * cfg.num_warps}), got {v}")
    for name in ("block_kw1", "block_kw2"):
        v = getattr(cfg, name)
        if v < 8 or v & (v - 1) or 2 * v < group_size:
            raise ValueError(f"MmaConfig.{name} must be a power of two of at least 8 words and of half the group size "
                             f"{group_size} (a thread's words of a row cover whole groups), got {v}")


def int4_mma_experts(
    x: torch.Tensor,
    topk_slots: torch.Tensor,
    topk_weights: torch.Tensor,
    weights: Int4ExpertWeights,
    activation: Activation,
    weight_on_input: bool = False,
    config: MmaConfig | None = None,
) -> torch.Tensor:
    """INT4 expert compute on the tensor cores, weights widened into the MMA registers (see the module docstring).

    Args:
        x: ``[T, D]`` bf16 CUDA rows, contiguous along ``D``.
        topk_slots: ``[T, K]`` int64 contiguous local slot ids; an id outside ``[0, S)`` (``-1``) skips.
        topk_weights: ``[T, K]`` float32 contiguous routing weights.
        weights: the packed weights (contiguous).
        activation: the gated activation.
        weight_on_input: scale the expert input by the weight instead of its output.
        config: tile shapes; ``default_mma_config(G)`` when ``None``.

    Returns:
        ``[T, D]`` bf16.

    Raises:
        TypeError: ``x`` not bf16.
        ValueError: a ``config`` outside the constraints of ``MmaConfig``.
    """
    if x.dtype != torch.bfloat16:
        raise TypeError(f"the INT4 MMA kernels compute in bf16, got x of dtype {x.dtype}")
    g = weights.group_size
    cfg = config if config is not None else default_mma_config(g)
    _check(cfg, g)
    t, k = topk_slots.shape
    n = t * k
    s, d, f = weights.num_slots, weights.hidden_size, weights.intermediate_size
    out = torch.empty(t, d, dtype=x.dtype, device=x.device)
    if n == 0:
        return out
    w13, s13, w2, s2 = weights.w13_packed, weights.w13_scale, weights.w2_packed, weights.w2_scale
    xq = nibble_planes(x)
    aln = align_triton(topk_slots, s, MMA_BLOCK_M)
    nb = aln.block_slot.shape[0]
    seg_h = plane_segment(f)
    h = torch.empty(nb * MMA_BLOCK_M, 4 * seg_h, dtype=x.dtype, device=x.device)
    y = torch.empty(n, d, dtype=torch.float32, device=x.device)
    placeholder = topk_weights
    limit = activation.swiglu_limit if activation.swiglu_limit is not None else 0.0
    gw = g // INT4_PACK
    _gate_up_kernel[(nb * triton.cdiv(f, cfg.block_n1),)](
        xq, w13, s13, weights.b13 if weights.b13 is not None else placeholder, topk_weights, h, aln.sorted_pair_ids,
        aln.block_slot, aln.block_start, n, k, d, f, plane_segment(d), seg_h, xq.stride(0), w13.stride(0),
        w13.stride(1), s13.stride(0), s13.stride(1), h.stride(0), float(limit), float(activation.swiglu_alpha),
        BLOCK_N=cfg.block_n1, BLOCK_KW=cfg.block_kw1, BLOCK_M=MMA_BLOCK_M, GW=gw, ACT=act_code(activation),
        HAS_BIAS=weights.b13 is not None, WEIGHT_ON_INPUT=weight_on_input, NUM_WARPS=cfg.num_warps,
        EVEN=(d // INT4_PACK) % cfg.block_kw1 == 0 and f % cfg.block_n1 == 0, num_warps=cfg.num_warps,
    )
    _down_kernel[(nb * triton.cdiv(d, cfg.block_n2),)](
        h, w2, s2, weights.b2 if weights.b2 is not None else placeholder, topk_weights, y, aln.sorted_pair_ids,
        aln.block_slot, aln.block_start, n, d, f, seg_h, w2.stride(0), w2.stride(1), s2.stride(0), s2.stride(1),
        h.stride(0), BLOCK_N=cfg.block_n2, BLOCK_KW=cfg.block_kw2, BLOCK_M=MMA_BLOCK_M, GW=gw,
        HAS_BIAS=weights.b2 is not None, WEIGHT_ON_INPUT=weight_on_input, NUM_WARPS=cfg.num_warps,
        EVEN=(f // INT4_PACK) % cfg.block_kw2 == 0 and d % cfg.block_n2 == 0, num_warps=cfg.num_warps,
    )
    block_d = min(1024, triton.next_power_of_2(d))
    sum_pairs_kernel[(t, triton.cdiv(d, block_d))](y, topk_slots, out, d, k, s, BLOCK_D=block_d)
    return out
