"""INT4 and MXFP4 weight tiles of the grouped kernels (``grouped``), widened in registers: the nibble-split W4A16
product.

A weight row of ``K`` inputs is stored as ``K / 8`` int32 words, input ``8 w + j`` in bits ``4j .. 4j+3`` of word
``w`` as ``q + 8`` (``experts.int4``). Regrouping a ``[BLOCK_KW, BLOCK_N]`` word tile into ``[8 * BLOCK_KW,
BLOCK_N]`` inputs in registers costs layout moves, but a dot over ``K`` is a sum, so the inputs may be taken in any
order: a step of ``BLOCK_KW`` words is eight products, one per nibble ``j``, of the activation tile ``A_j [BLOCK_M,
BLOCK_KW]`` (inputs ``8 (kw0 + w) + j``) and the weight tile ``W_j [BLOCK_KW, BLOCK_N]`` widened from the word tile
loaded once per step. The activations are read from a nibble-major copy (``nibble_major``: input ``8 w + j`` of
a row at ``j * nibble_segment(K) + w``, 32-byte aligned segments), so ``A_j`` is a contiguous load of each row,
software-pipelined by Triton as a ``tl.dot`` operand; the gate/up kernel writes ``h`` in that order for the down
kernel.

Widening without an integer-to-float conversion (quarter rate on the CUDA cores), rounded once to the activation
dtype as ``experts.int4.dequantize_int4`` rounds (the product ``(q - 8) * scale`` is exact in float32):

- bf16/fp16 on a GPU (``PTX``): two words at a time in inline PTX (``_widen_pairs``): the halves of the two words
  holding nibble ``j`` side by side in one register (``prmt``), shifted, masked and OR-ed into the mantissas of 128
  (bf16) or 1024 (fp16) in both 16-bit lanes at once (``lop3``), the constant plus 8 subtracted (exact) and the
  pair multiplied by its two scales, in packed 16-bit arithmetic: about two instructions a weight (fp16: the
  scales converted to fp16 first, exact within fp16's normal range).
- otherwise (float32 activations; the Triton interpreter, which runs no PTX): the nibble OR-ed into the mantissa
  of ``2 ** 23`` reads as the float32 ``2 ** 23 + nib``; subtracting ``2 ** 23 + 8`` is exact and leaves
  ``nib - 8``, times the scale in float32.

MXFP4 weights (gpt-oss's, ``experts.mxfp4``) take the same kernels: a row of ``blocks [N, K/32, 16]`` bytes read as
``K / 8`` little-endian int32 words holds input ``8 w + j`` in nibble ``j`` of word ``w`` too (two E2M1 codes a
byte, the low nibble first), with one E8M0 scale per 32 inputs (``GW = 4``), ``2 ** (s - 127)`` built from the
scale's bits (``_scale_tile``). bf16 on a GPU: two words at a time in inline PTX (``_widen_e2m1_pairs``), a code's
3 magnitude bits under the bf16 exponent and its sign on the sign bit, then two exact packed products. Otherwise:
the same bits under an fp16's exponent (``e2m1 * 2 ** -14``, exact), widened to float32, times ``2 ** 14`` and the
scale. Either way the weight is rounded once to the activation dtype, as ``experts.mxfp4.dequantize_mxfp4`` rounds.

The scale tile (word ``w``'s group is ``(kw0 + w) // (G / 8)``, one load with repeated addresses) is read once per
step and serves the eight nibbles; it is requested a step ahead in registers (a load of 16 bits a thread, which
Triton's software pipelining leaves out).

``SWAP_AB`` computes the transposed product ``acc^T [BLOCK_N, BLOCK_M] = W_j^T @ A_j^T``: the weight rows are the
product's ``M`` side and a block of 16 token rows its ``N`` side, so 64 or more weight rows run on Hopper's wgmma
(Triton takes ``M >= 64`` for it) where 16-row blocks would otherwise run on ``mma.sync``.

Source: the mantissa-OR widening is the trick of the W4A16 GPU kernels (FasterTransformer; Marlin: Frantar et al.,
"MARLIN: Mixed-Precision Auto-Regressive Parallel Inference on Large Language Models", arXiv:2408.11743), the
swapped operands for few rows the arrangement of vLLM's W4A16 MoE Triton kernel; the nibble-split order is our own.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from epmoe.experts.int4 import INT4_PACK

WIDEN_INT4 = tl.constexpr(0)
"""``WIDEN`` code: INT4 words widened in float32 (float32 activations; the Triton interpreter)."""
WIDEN_INT4_PTX = tl.constexpr(1)
"""``WIDEN`` code: INT4 words widened two at a time by inline PTX (bf16/fp16 activations on a GPU)."""
WIDEN_MXFP4 = tl.constexpr(2)
"""``WIDEN`` code: MXFP4 words (E2M1 codes, E8M0 scales) widened in float32 (fp16/float32 activations; the Triton
interpreter)."""
WIDEN_MXFP4_PTX = tl.constexpr(3)
"""``WIDEN`` code: MXFP4 words widened two at a time by inline PTX (bf16 activations on a GPU)."""


E2M1_LANES_PTX = tl.constexpr(" shl.b32 m, t, 6; shl.b32 sg, t, 12; and.b32 sg, sg, 0x80008000;"
                              " lop3.b32 t, m, 0x01C001C0, sg, 0xEA; mov.b32 big, 0x7E807E80; mov.b32 nz, 0x80008000;"
                              " fma.rn.bf16x2 t, t, big, nz;")
"""PTX (registers ``t``, ``m``, ``sg``, ``big``, ``nz``): the E2M1 codes in bits 0-3 of the two 16-bit lanes of
``t`` as bf16 values in ``t``: the 3 magnitude bits under the exponent (bits 6-8), the sign on bit 15 (reading as
``e2m1 * 2 ** -126``), times ``2 ** 126`` (exact); ``nz`` holds ``-0`` in both lanes for the scale's product after
it. Both the grouped kernels' and the MMA kernels' MXFP4 widening."""


def widen_code(mxfp4: bool, x: torch.Tensor) -> int:
    """The ``WIDEN`` code of the grouped kernels for packed weights (MXFP4 when ``mxfp4``, else INT4) and
    activations ``x``: by inline PTX on a GPU for INT4 with bf16/fp16 and MXFP4 with bf16, in float32 otherwise
    (and so under the Triton interpreter, which runs no PTX)."""
    if mxfp4:
        return WIDEN_MXFP4_PTX.value if x.is_cuda and x.dtype == torch.bfloat16 else WIDEN_MXFP4.value
    ptx = x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)
    return WIDEN_INT4_PTX.value if ptx else WIDEN_INT4.value


def nibble_segment(k: int) -> int:
    """Elements per nibble segment of a nibble-major row of ``k`` inputs: ``k / 8`` rounded up to a multiple of 16
    (32-byte aligned segments: the activation tiles load as 16-byte vectors, which Triton pipelines)."""
    return -(-k // (INT4_PACK * 16)) * 16


def nibble_major(x: torch.Tensor) -> torch.Tensor:
    """``x [T, K]`` (``K`` a multiple of 8, any row stride) -> its nibble-major copy ``[T, 8 * nibble_segment(K)]``,
    input ``8 w + j`` of a row at ``j * nibble_segment(K) + w`` (the segments' padding is never read)."""
    t, k = x.shape
    seg = nibble_segment(k)
    out = torch.empty(t, INT4_PACK, seg, dtype=x.dtype, device=x.device)
    out[:, :, :k // INT4_PACK] = x.unflatten(1, (k // INT4_PACK, INT4_PACK)).transpose(1, 2)
    return out.view(t, INT4_PACK * seg)


@triton.jit
def nibble_segment_of(K):
    """``nibble_segment(K)`` in a kernel, known to the compiler as a multiple of 16."""
    return tl.multiple_of((K + 127) // 128 * 16, 16)


@triton.jit
def nibble_major_cols(offs, K):
    """Where input ``offs`` (int tensor) of a row of ``K`` inputs goes in its nibble-major copy."""
    return (offs % 8) * nibble_segment_of(K) + offs // 8


@triton.jit
def _widen_pairs(words, scale, J: tl.constexpr):
    """Nibble ``J`` of ``words`` (int32) times ``scale`` (bf16 or fp16: the result's dtype), two words a PTX block,
    in the 16-bit lanes: the two words' halves holding nibble ``J`` side by side (``prmt``), the nibbles OR-ed into
    the mantissas of 128 (bf16) or 1024 (fp16) (``lop3``), 136 or 1032 subtracted (exact) and the pair multiplied by
    its two scales (one rounding, as ``experts.int4.dequantize_int4`` rounds its float32 product, for scales stored
    in this dtype; others are rounded to it first)."""
    HALF: tl.constexpr = "0x7632" if J >= 4 else "0x5410"
    SHIFT: tl.constexpr = f"shr.b32 t, t, {4 * (J % 4)};" if J % 4 else ""
    if scale.dtype == tl.bfloat16:
        return tl.inline_asm_elementwise(
            "{ .reg .b32 t, one, off, nz; prmt.b32 t, $1, $2, " + HALF + "; " + SHIFT
            + " lop3.b32 t, t, 0x000F000F, 0x43004300, 0xEA; mov.b32 one, 0x3F803F80; mov.b32 off, 0xC308C308;"
            " mov.b32 nz, 0x80008000; fma.rn.bf16x2 t, t, one, off; fma.rn.bf16x2 $0, t, $3, nz; }",
            "=r,r,r,r", [words, scale], dtype=tl.bfloat16, is_pure=True, pack=2)
    else:
        return tl.inline_asm_elementwise(
            "{ .reg .b32 t, one, off, nz; prmt.b32 t, $1, $2, " + HALF + "; " + SHIFT
            + " lop3.b32 t, t, 0x000F000F, 0x64006400, 0xEA; mov.b32 one, 0x3C003C00; mov.b32 off, 0xE408E408;"
            " mov.b32 nz, 0x80008000; fma.rn.f16x2 t, t, one, off; fma.rn.f16x2 $0, t, $3, nz; }",
            "=r,r,r,r", [words, scale], dtype=tl.float16, is_pure=True, pack=2)


@triton.jit
def _widen_e2m1_pairs(words, scale, J: tl.constexpr):
    """E2M1 code ``J`` of ``words`` (int32) times ``scale`` (bf16, ``2 ** (s - 127)``), two words a PTX block, in
    the 16-bit lanes: the two words' halves holding code ``J`` side by side (``prmt``), its magnitude bits shifted
    under the exponent (bits 6-8) and its sign onto bit 15, which reads as ``e2m1 * 2 ** -126`` (code 1 a bf16
    subnormal), times ``2 ** 126`` and the scale (both exact: every product is an E2M1 value times a power of two,
    rounded only where it falls below bf16's normal range, as ``experts.mxfp4.dequantize_mxfp4`` rounds)."""
    HALF: tl.constexpr = "0x7632" if J >= 4 else "0x5410"
    SHIFT: tl.constexpr = f"shr.b32 t, t, {4 * (J % 4)};" if J % 4 else ""
    return tl.inline_asm_elementwise(
        "{ .reg .b32 t, m, sg, big, nz; prmt.b32 t, $1, $2, " + HALF + "; " + SHIFT + E2M1_LANES_PTX
        + " fma.rn.bf16x2 $0, t, $3, nz; }",
        "=r,r,r,r", [words, scale], dtype=tl.bfloat16, is_pure=True, pack=2)


@triton.jit
def _nibble_dot(a, words, scale, acc, J: tl.constexpr, SWAP_AB: tl.constexpr, WIDEN: tl.constexpr):
    """``acc + A_j @ W_j`` (or ``+ W_j^T @ A_j^T`` with ``SWAP_AB``), ``W_j`` nibble ``J`` of ``words`` (int32)
    widened to ``a.dtype`` with ``scale`` (the word tile's shape, from ``_scale_tile``) as ``WIDEN`` says (see
    ``widen_code``)."""
    if WIDEN == WIDEN_INT4_PTX:
        w = _widen_pairs(words, scale, J)
    elif WIDEN == WIDEN_MXFP4_PTX:
        w = _widen_e2m1_pairs(words, scale, J)
    elif WIDEN == WIDEN_MXFP4:
        nib = (words.to(tl.uint32, bitcast=True) >> (4 * J)) & 0xF
        w = ((e2m1_f16(nib) * 16384.0) * scale).to(a.dtype)  # the E2M1 value, exact, times 2 ** (s - 127)
    else:
        f = (((words.to(tl.uint32, bitcast=True) >> (4 * J)) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True)
        w = ((f - 8388616.0) * scale).to(a.dtype)  # 2 ** 23 + 8
    if SWAP_AB:
        return tl.dot(w, a, acc)
    else:
        return tl.dot(a, w, acc)


@triton.jit
def _scale_tile(s, DTYPE: tl.constexpr, WIDEN: tl.constexpr):
    """The multipliers of a loaded scale tile ``s``: INT4's scales in ``DTYPE``; MXFP4's E8M0 bytes as
    ``2 ** (s - 127)`` built from their bits (``s = 0``, the subnormal ``2 ** -127``, by value), in float32, or in
    bf16 (exact) for the PTX widening."""
    if WIDEN == WIDEN_MXFP4_PTX:
        out = e8m0_f32(s).to(tl.bfloat16)
    elif WIDEN == WIDEN_MXFP4:
        out = e8m0_f32(s)
    else:
        out = s.to(DTYPE)
    return out


@triton.jit
def e8m0_f32(s):
    """float32 ``2 ** (s - 127)`` of E8M0 bytes ``s``."""
    e = s.to(tl.int32)
    return tl.where(e == 0, 2.0 ** -127, (e << 23).to(tl.float32, bitcast=True))


@triton.jit
def e2m1_f16(nib):
    """E2M1 codes ``nib`` (integer tensor, 0..15) as float32 ``e2m1 * 2 ** -14``, exact: the 3 magnitude bits under an
    fp16's exponent (bits 9-11), the sign on bit 15 (code 1, 0.5, an fp16 subnormal), widened from fp16."""
    return (((nib & 7) << 9) | ((nib & 8) << 12)).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def row_strides(stride_we, stride_wn):
    """The packed weights' slot and row strides (words), known to the compiler as multiples of 4: a row holds whole
    groups of at least 32 inputs, 16 bytes or more, so the word tiles load as 16-byte vectors even where the row
    is not a multiple of 16 words (gpt-oss's 2880 inputs: 360 words), which Triton's argument specialisation
    would not see (a product by 4 it does; ``tl.multiple_of`` on a scalar it drops)."""
    return (stride_we // 4) * 4, (stride_wn // 4) * 4


@triton.jit
def _tile_offsets(offs_kw, rows, stride_r, SWAP_AB: tl.constexpr):
    """Offsets of a tile of words ``offs_kw`` of rows ``rows``: ``[BLOCK_KW, R]``, or ``[R, BLOCK_KW]`` with
    ``SWAP_AB``."""
    if SWAP_AB:
        return rows[:, None] * stride_r + offs_kw[None, :]
    else:
        return offs_kw[:, None] + rows[None, :] * stride_r


@triton.jit
def _tile_mask(k_ok, r_ok, SWAP_AB: tl.constexpr):
    if SWAP_AB:
        return r_ok[:, None] & k_ok[None, :]
    else:
        return k_ok[:, None] & r_ok[None, :]


@triton.jit
def packed_gate_up_acc(
    xp_ptr, w_ptr, s_ptr, slot, tok, valid, offs_n, n_ok, D, F, stride_x, stride_we, stride_wn, stride_se,
    stride_sn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KW: tl.constexpr, GW: tl.constexpr,
    SWAP_AB: tl.constexpr, WIDEN: tl.constexpr,
):
    """Gate and up accumulators ``[BLOCK_M, BLOCK_N]`` float32 of token rows ``tok`` (``valid`` of them) read from the
    nibble-major ``xp`` (row stride ``stride_x``) and gate rows ``offs_n`` (up rows ``F + offs_n``) of ``slot``'s
    packed ``w13 [S, 2F, D/8]`` with scales ``[S, 2F, D/G]`` (``GW = G / 8`` words a group)."""
    SCALE_DTYPE: tl.constexpr = xp_ptr.dtype.element_ty if WIDEN == WIDEN_INT4_PTX else tl.float32
    DW = tl.multiple_of(D // 8, GW)  # D is a multiple of the group size
    SEG = nibble_segment_of(D)
    stride_we, stride_wn = row_strides(stride_we, stride_wn)
    offs_kw = tl.arange(0, BLOCK_KW)
    rows_n = offs_n.to(tl.int64)
    wg_ptrs = w_ptr + slot * stride_we + _tile_offsets(offs_kw, rows_n, stride_wn, SWAP_AB)
    wu_ptrs = wg_ptrs + F * stride_wn
    sg_ptrs = s_ptr + slot * stride_se + _tile_offsets(offs_kw // GW, rows_n, stride_sn, SWAP_AB)
    su_ptrs = sg_ptrs + F * stride_sn
    a_ptrs = xp_ptr + _tile_offsets(offs_kw, tok, stride_x, not SWAP_AB)
    if SWAP_AB:
        acc_g = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    s_ok = _tile_mask(offs_kw < DW, n_ok, SWAP_AB)
    sg = tl.load(sg_ptrs, mask=s_ok, other=0)
    su = tl.load(su_ptrs, mask=s_ok, other=0)
    for kw0 in range(0, DW, BLOCK_KW):
        k_ok = offs_kw < DW - kw0
        w_ok = _tile_mask(k_ok, n_ok, SWAP_AB)
        a_ok = _tile_mask(k_ok, valid, not SWAP_AB)
        wg = tl.load(wg_ptrs, mask=w_ok, other=0)
        wu = tl.load(wu_ptrs, mask=w_ok, other=0)
        # the next step's scales requested now (Triton pipelines only loads of 32 bits or more a thread)
        s_ok = _tile_mask(offs_kw < DW - kw0 - BLOCK_KW, n_ok, SWAP_AB)
        sg_ptrs += BLOCK_KW // GW
        su_ptrs += BLOCK_KW // GW
        sg_next = tl.load(sg_ptrs, mask=s_ok, other=0)
        su_next = tl.load(su_ptrs, mask=s_ok, other=0)
        sgf = _scale_tile(sg, SCALE_DTYPE, WIDEN)
        suf = _scale_tile(su, SCALE_DTYPE, WIDEN)
        for j in tl.static_range(8):
            a = tl.load(a_ptrs + j * SEG, mask=a_ok, other=0.0)
            acc_g = _nibble_dot(a, wg, sgf, acc_g, j, SWAP_AB, WIDEN)
            acc_u = _nibble_dot(a, wu, suf, acc_u, j, SWAP_AB, WIDEN)
        sg = sg_next
        su = su_next
        wg_ptrs += BLOCK_KW
        wu_ptrs += BLOCK_KW
        a_ptrs += BLOCK_KW
    if SWAP_AB:
        return tl.trans(acc_g), tl.trans(acc_u)
    else:
        return acc_g, acc_u


@triton.jit
def packed_down_acc(
    hp_ptr, w_ptr, s_ptr, slot, rows, valid, offs_n, n_ok, F, stride_we, stride_wn, stride_se, stride_sn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KW: tl.constexpr, GW: tl.constexpr, SWAP_AB: tl.constexpr,
    WIDEN: tl.constexpr,
):
    """Down accumulator ``[BLOCK_M, BLOCK_N]`` float32 of rows ``rows`` (``valid`` of them) of the nibble-major
    ``h [NB * BLOCK_M, 8 * nibble_segment(F)]`` and output columns ``offs_n`` of ``slot``'s packed ``w2 [S, D, F/8]``
    with scales ``[S, D, F/G]``."""
    SCALE_DTYPE: tl.constexpr = hp_ptr.dtype.element_ty if WIDEN == WIDEN_INT4_PTX else tl.float32
    FW = tl.multiple_of(F // 8, GW)
    SEG = nibble_segment_of(F)
    stride_we, stride_wn = row_strides(stride_we, stride_wn)
    offs_kw = tl.arange(0, BLOCK_KW)
    rows_n = offs_n.to(tl.int64)
    w_ptrs = w_ptr + slot * stride_we + _tile_offsets(offs_kw, rows_n, stride_wn, SWAP_AB)
    s_ptrs = s_ptr + slot * stride_se + _tile_offsets(offs_kw // GW, rows_n, stride_sn, SWAP_AB)
    a_ptrs = hp_ptr + _tile_offsets(offs_kw, rows.to(tl.int64), 8 * SEG, not SWAP_AB)
    if SWAP_AB:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    sc = tl.load(s_ptrs, mask=_tile_mask(offs_kw < FW, n_ok, SWAP_AB), other=0)
    for kw0 in range(0, FW, BLOCK_KW):
        k_ok = offs_kw < FW - kw0
        w_ok = _tile_mask(k_ok, n_ok, SWAP_AB)
        a_ok = _tile_mask(k_ok, valid, not SWAP_AB)
        w = tl.load(w_ptrs, mask=w_ok, other=0)
        s_ptrs += BLOCK_KW // GW
        sc_next = tl.load(s_ptrs, mask=_tile_mask(offs_kw < FW - kw0 - BLOCK_KW, n_ok, SWAP_AB), other=0)
        scf = _scale_tile(sc, SCALE_DTYPE, WIDEN)
        for j in tl.static_range(8):
            acc = _nibble_dot(tl.load(a_ptrs + j * SEG, mask=a_ok, other=0.0), w, scf, acc, j, SWAP_AB, WIDEN)
        sc = sc_next
        w_ptrs += BLOCK_KW
        a_ptrs += BLOCK_KW
    if SWAP_AB:
        return tl.trans(acc)
    else:
        return acc
