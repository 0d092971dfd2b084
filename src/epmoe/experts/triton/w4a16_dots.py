"""The arithmetic of the W4A16 decode kernels (``w4a16_decode``) on packed INT4 and MXFP4 words: the tile layout,
the widening of the codes in registers and the group dot products of a matrix-vector step.

Layout. Every thread owns whole int32 words, never a part of one: a program's weight tile is
``[BLOCK_KW / GW, R, GW]`` words (groups of ``G`` inputs, ``R`` rows, the ``GW = G / 8`` words of a group), the
``GW`` words of a group in one thread (one 16-byte load for ``G = 32``); the gate/up kernel's tile holds its
``BLOCK_N`` gate rows and the same ``BLOCK_N`` up rows (``R = 2 BLOCK_N``), the down kernel's its ``BLOCK_N``
rows. The vector ``v`` (``x`` or ``h``) is read from a de-interleaved, pre-scaled copy ``vt`` (bf16 for bf16 rows,
``PackedDecodeConfig.bf16_inputs``; float32 otherwise): within each group of ``G`` inputs, input ``j`` of the
group's ``GW`` words is stored contiguously (``vt[(n // G) * G + (n % 8) * GW + (n // 8) % GW] = v[n] * 2 ** (69 -
p_j)``, ``j = n % 8``), so a thread reads the eight inputs of its words as eight vector loads at constant offsets
from one address. The input tile is ``[BLOCK_KW / GW, 1, GW]``, broadcast
over the rows, so a step reads its inputs once whatever the rows (an earlier tile of the rows' shape read them once
per row); depending on the tile shape Triton loads it in the word tile's own layout or in another, moved to it once
a step.

Nibble ``j`` is widened without a shift or an integer-to-float conversion: the word masked to it, ``w & (0xF <<
p_j)``, read as float32 is a subnormal number, ``nib * 2 ** (p_j - 149)`` exactly (the mantissa bits hold the
nibble; the kernels' PTX keeps subnormals: no ``.ftz``), whose product with the pre-scaled input is ``nib * v[n] *
2 ** -80``, exact up to the product's rounding. ``p_j = 4 j`` for ``j <= 4``; the top three nibbles are taken from
``w >> 12`` (one shift a word) at ``p_j = 4 j - 12``, all within the 23 mantissa bits. So a nibble costs one AND and
one multiply-add, in the thread's registers. The products of a group's words are summed in the thread; the
nibbles' offset 8 is taken off once per group and row as ``8 * 2 ** -80 * sum(v)`` over the group's inputs (the
same for every row, from the inputs the thread holds), then the group's scale multiplies and the sum accumulates
per ``[group, row]``; the groups are reduced across threads once per pair, after the last step, and ``2 ** 80``
undone. The scale ``2 ** (69 - p_j)`` keeps a pre-scaled input finite for ``|v| < 2 ** 59`` and a product normal
(full precision) for ``|v| >= 2 ** -46``.

MXFP4. A block's 16 bytes read as four int32 words have INT4's nibble order (input ``8 w + j`` of the block in nibble
``j`` of word ``w``), and its E8M0 scale is the group scale (``G = 32``, ``GW = 4``), so the same tiles, loads and
reductions serve it; only the widening and the scales differ. An E2M1 code is 1 sign, 2 exponent and 1 mantissa
bit, not linear in its bits, so it is widened through fp16: codes ``j`` and ``j + 4`` of a word, 16 bits apart, are
placed in the two 16-bit lanes of one register at once (``e2m1_pair``: their three magnitude bits shifted under the
fp16 exponent, bits 9-11, their sign bits onto bits 15 and 31, one ``lop3`` joining them), which read as ``e2m1 *
2 ** -14`` (code 1 an fp16 subnormal, exact), then converted to float32 (exact). So a code costs about two
integer operations, one conversion and one multiply-add. The inputs are pre-scaled by ``2 ** 14`` (exact) in place
of INT4's ``2 ** (69 - p_j)``, there is no offset to take off, and the group scale ``2 ** (s - 127)`` is built from
the E8M0 bits (``s = 0`` as ``2 ** -127``). Under the Triton interpreter (no PTX) the same values are computed
arithmetically.

Source: the packed INT4 format is compressed-tensors' ``pack-quantized`` and MXFP4 the OCP Microscaling Formats
(MX) v1.0 specification's, as gpt-oss stores it; widening a nibble by reading its bits as a float's mantissa is the
trick of the W4A16 GPU kernels (FasterTransformer, Marlin: Frantar et al., "MARLIN: Mixed-Precision Auto-Regressive
Parallel Inference on Large Language Models", 2024; there OR-ed into the mantissa of a float constant that is then
subtracted), here as a float32 subnormal with the nibble left in place. The code is our own.
"""

from __future__ import annotations

import triton
import triton.language as tl

from epmoe.experts.triton.w4a16 import e2m1_f16, e8m0_f32

FMT_INT4 = tl.constexpr(0)
FMT_MXFP4 = tl.constexpr(1)  # MXFP4 widened arithmetically (the Triton interpreter, float32 under test)
FMT_MXFP4_PTX = tl.constexpr(2)  # MXFP4 widened by inline PTX (CUDA)
MXFP4_INPUT_SCALE = tl.constexpr(16384.0)  # 2 ** 14, the inputs' pre-scaling for MXFP4 (``e2m1_pair``)


@triton.jit
def nibble_scale(j):
    """``2 ** (69 - p_j)`` float32 for input ``j`` (int32 tensor, 0..7) of a word (see the module docstring)."""
    pos = tl.where(j < 5, 4 * j, 4 * j - 12)
    return ((196 - pos) << 23).to(tl.float32, bitcast=True)


@triton.jit
def load_inputs(v_ptrs, v_ok, GW: tl.constexpr, EVEN: tl.constexpr):
    """The eight pre-scaled input tiles ``[NG, 1, GW]`` float32 of a step, ``v_ptrs`` at input 0 of each
    group's words, input ``j`` at ``+ j * GW`` (see ``input_offsets``); unmasked when ``EVEN``."""
    if EVEN:
        return (tl.load(v_ptrs).to(tl.float32), tl.load(v_ptrs + GW).to(tl.float32),
                tl.load(v_ptrs + 2 * GW).to(tl.float32), tl.load(v_ptrs + 3 * GW).to(tl.float32),
                tl.load(v_ptrs + 4 * GW).to(tl.float32), tl.load(v_ptrs + 5 * GW).to(tl.float32),
                tl.load(v_ptrs + 6 * GW).to(tl.float32), tl.load(v_ptrs + 7 * GW).to(tl.float32))
    else:
        return (tl.load(v_ptrs, mask=v_ok, other=0.0).to(tl.float32),
                tl.load(v_ptrs + GW, mask=v_ok, other=0.0).to(tl.float32),
                tl.load(v_ptrs + 2 * GW, mask=v_ok, other=0.0).to(tl.float32),
                tl.load(v_ptrs + 3 * GW, mask=v_ok, other=0.0).to(tl.float32),
                tl.load(v_ptrs + 4 * GW, mask=v_ok, other=0.0).to(tl.float32),
                tl.load(v_ptrs + 5 * GW, mask=v_ok, other=0.0).to(tl.float32),
                tl.load(v_ptrs + 6 * GW, mask=v_ok, other=0.0).to(tl.float32),
                tl.load(v_ptrs + 7 * GW, mask=v_ok, other=0.0).to(tl.float32))


@triton.jit
def input_tile(offs_g, GW: tl.constexpr):
    """``[NG, 1, GW]`` offsets of input 0 of the words of a step's groups in the de-interleaved vector, broadcast
    over the rows of the word tile ``[NG, R, GW]`` (see the module docstring's layout)."""
    return offs_g[:, None, None] * (8 * GW) + tl.arange(0, GW)[None, None, :]


@triton.jit
def input_offsets(n, GW: tl.constexpr):
    """Where input ``n`` (int32 tensor) of a vector goes in its de-interleaved copy: per group of ``G = 8 GW``
    inputs, input ``j`` of the group's ``GW`` words contiguous at ``j * GW``."""
    return (n // (8 * GW)) * (8 * GW) + (n % 8) * GW + (n // 8) % GW


@triton.jit
def group_dots(w, v):
    """Per group and row, ``2 ** -80 * sum`` over the group's inputs of ``(nib - 8) * v``: ``w [NG, R, GW]`` int32
    words, ``v`` their eight input tiles (``load_inputs``); ``[NG, R]`` float32 (see the module docstring)."""
    hi = w >> 12
    acc = (w & 0xF).to(tl.float32, bitcast=True) * v[0]
    acc += (w & 0xF0).to(tl.float32, bitcast=True) * v[1]
    acc += (w & 0xF00).to(tl.float32, bitcast=True) * v[2]
    acc += (w & 0xF000).to(tl.float32, bitcast=True) * v[3]
    acc += (w & 0xF0000).to(tl.float32, bitcast=True) * v[4]
    acc += (hi & 0xF00).to(tl.float32, bitcast=True) * v[5]
    acc += (hi & 0xF000).to(tl.float32, bitcast=True) * v[6]
    acc += (hi & 0xF0000).to(tl.float32, bitcast=True) * v[7]
    # the nibbles' offset: 8 * 2 ** -80 * sum(v) = 2 ** -77 * sum_j 2 ** (p_j - 69) * v_j, the same for every row
    s = (v[0] * 1.6940658945086007e-21 + v[1] * 2.710505431213761e-20 + v[2] * 4.336808689942018e-19
         + v[3] * 6.938893903907228e-18 + v[4] * 1.1102230246251565e-16 + v[5] * 4.336808689942018e-19
         + v[6] * 6.938893903907228e-18 + v[7] * 1.1102230246251565e-16)
    return tl.sum(acc, axis=2) - tl.sum(s, axis=2) * 6.617444900424222e-24


@triton.constexpr_function
def e2m1_pair_ptx(j):
    """The PTX of ``e2m1_pair`` for codes ``j`` and ``j + 4`` (``j`` in 0..3; input ``$2`` a word, outputs ``$0``,
    ``$1`` float32): the magnitude bits of nibbles ``j`` (bits ``4 j``..``4 j + 2``) and ``j + 4`` shifted to bits 9-11
    of the two 16-bit lanes, their sign bits (``4 j + 3``, ``4 j + 19``) to bits 15 and 31, joined by one ``lop3``
    (``(m & 0x0E000E00) | s``), each lane converted from fp16."""
    j = int(j)
    mag = f"shl.b32 m, $2, {9 - 4 * j};" if j < 3 else "shr.b32 m, $2, 3;"
    sign = f"shl.b32 s, $2, {12 - 4 * j}; and.b32 s, s, 0x80008000;" if j < 3 else "and.b32 s, $2, 0x80008000;"
    return ("{ .reg .b32 m, s; .reg .b16 l, h; " + mag + " " + sign + " lop3.b32 m, m, 0x0E000E00, s, 0xEA;"
            " mov.b32 {l, h}, m; cvt.f32.f16 $0, l; cvt.f32.f16 $1, h; }")


@triton.jit
def e2m1_pair(w, J: tl.constexpr, PTX: tl.constexpr):
    """E2M1 codes ``J`` and ``J + 4`` (``J`` in 0..3) of words ``w`` (int32) as two float32 tensors of ``w``'s shape,
    each ``e2m1 * 2 ** -14`` exactly (see the module docstring): by inline PTX (``e2m1_pair_ptx``) with ``PTX``,
    arithmetically otherwise."""
    if PTX:
        return tl.inline_asm_elementwise(e2m1_pair_ptx(J), "=r,=r,r", [w], dtype=(tl.float32, tl.float32),
                                         is_pure=True, pack=1)
    else:
        return e2m1_f16((w >> (4 * J)) & 0xF), e2m1_f16((w >> (4 * J + 16)) & 0xF)


@triton.jit
def e2m1_group_dots(w, v, PTX: tl.constexpr):
    """Per group and row, ``sum`` over the group's inputs of ``e2m1 * v``: ``w [NG, R, GW]`` int32 words (MXFP4
    blocks), ``v`` their eight input tiles pre-scaled by ``2 ** 14`` (``load_inputs``); ``[NG, R]`` float32."""
    lo, hi = e2m1_pair(w, 0, PTX)
    acc = lo * v[0]
    acc += hi * v[4]  # one multiply-add a code
    lo, hi = e2m1_pair(w, 1, PTX)
    acc += lo * v[1]
    acc += hi * v[5]
    lo, hi = e2m1_pair(w, 2, PTX)
    acc += lo * v[2]
    acc += hi * v[6]
    lo, hi = e2m1_pair(w, 3, PTX)
    acc += lo * v[3]
    acc += hi * v[7]
    return tl.sum(acc, axis=2)


@triton.jit
def input_scale(j, FMT: tl.constexpr):
    """The pre-scaling float32 of input ``j`` (int32 tensor, 0..7) of a word: ``nibble_scale`` for INT4, ``2 **
    14`` for MXFP4."""
    if FMT == FMT_INT4:
        return nibble_scale(j)
    else:
        return tl.zeros(j.shape, tl.float32) + MXFP4_INPUT_SCALE


@triton.jit
def scaled_dots(w, v, s, FMT: tl.constexpr):
    """``[NG, R]`` float32: the group dots of words ``w`` with inputs ``v`` times the loaded group scales ``s`` (INT4:
    float; MXFP4: E8M0 bytes), in the scale the format's pre-scaling leaves (``unscale``)."""
    if FMT == FMT_INT4:
        return group_dots(w, v) * s.to(tl.float32)
    else:
        return e2m1_group_dots(w, v, FMT == FMT_MXFP4_PTX) * e8m0_f32(s)


@triton.jit
def unscale(sums, FMT: tl.constexpr):
    """Sums of ``scaled_dots`` in the inputs' own scale: INT4's ``2 ** -80`` undone; MXFP4's is 1."""
    if FMT == FMT_INT4:
        return sums * 1.2089258196146292e+24  # 2 ** 80
    else:
        return sums


@triton.jit
def row_tile(offs_n, n_ok, KW, stride_wn, stride_sn, BLOCK_KW: tl.constexpr, GW: tl.constexpr):
    """The word layout of a program's ``R`` rows ``offs_n`` over ``KW`` words (see the module docstring): the group
    and word offsets of a step, the ``[NG, R, GW]`` word and ``[NG, R]`` scale offsets of its rows, and the masks of
    its first two word tiles."""
    offs_g = tl.arange(0, BLOCK_KW // GW)
    offs_kw = offs_g[:, None] * GW + tl.arange(0, GW)[None, :]
    rows = offs_n.to(tl.int64)
    w_rows = offs_kw[:, None, :] + rows[None, :, None] * stride_wn
    s_rows = offs_g[:, None] + rows[None, :] * stride_sn
    first, second = tile_masks(offs_kw, n_ok, KW, BLOCK_KW)
    return offs_g, offs_kw, w_rows, s_rows, first, second


@triton.jit
def tile_masks(offs_kw, n_ok, KW, BLOCK_KW: tl.constexpr):
    """The masks of the first two word tiles ``[NG, R, GW]`` of rows ``n_ok`` over ``KW`` words."""
    return ((offs_kw < KW)[:, None, :] & n_ok[None, :, None],
            (offs_kw < KW - BLOCK_KW)[:, None, :] & n_ok[None, :, None])


@triton.jit
def first_tiles(ptrs, first, second, BLOCK_KW: tl.constexpr, STAGES: tl.constexpr):
    """Word tiles 0 and 1 of a row tile (``ptrs`` at its first words), masked by ``first`` and ``second``; with
    ``STAGES == 2`` tile 0 twice (tile 1 is requested in the first step)."""
    t0 = tl.load(ptrs, mask=first, other=0)
    if STAGES == 3:
        return t0, tl.load(ptrs + BLOCK_KW, mask=second, other=0)
    else:
        return t0, t0


@triton.jit
def _steps(acc, w, w1, w_ptrs, s_ptrs, v_ptrs, kw_from, kw_to, KW, offs_kw, offs_g, rows_ok, BLOCK_KW: tl.constexpr,
           GW: tl.constexpr, WHOLE: tl.constexpr, STAGES: tl.constexpr, FMT: tl.constexpr):
    """Steps ``kw_from, kw_from + BLOCK_KW, ..`` up to ``kw_to`` of a range of ``KW`` words (``w_ptrs``, ``s_ptrs``,
    ``v_ptrs`` at its start) added to ``acc [NG, R]``, from the step's word tiles ``w``, ``w1`` already requested;
    with ``WHOLE`` the steps hold ``BLOCK_KW`` words of rows all in range, read without masks. Register buffering,
    ``STAGES - 1`` steps ahead: the words of step ``k + STAGES - 1`` are requested before step ``k``'s are widened
    (Triton software-pipelines only loads that feed ``tl.dot``). Returns ``acc`` and the next two word tiles."""
    for kw0 in range(kw_from, kw_to, BLOCK_KW):
        nxt = (offs_kw < KW - kw0 - (STAGES - 1) * BLOCK_KW)[:, None, :] & rows_ok[None, :, None]
        w2 = tl.load(w_ptrs + kw0 + (STAGES - 1) * BLOCK_KW, mask=nxt, other=0)
        if WHOLE:
            sc = tl.load(s_ptrs + kw0 // GW)
        else:
            sc = tl.load(s_ptrs + kw0 // GW, mask=(offs_g < (KW - kw0) // GW)[:, None] & rows_ok[None, :], other=0)
        acc += scaled_dots(w, load_inputs(v_ptrs + 8 * kw0, (offs_kw < KW - kw0)[:, None, :], GW, WHOLE), sc, FMT)
        if STAGES == 3:
            w = w1
            w1 = w2
        else:
            w = w2
    return acc, w, w1


@triton.jit
def range_dots(w, w1, w_ptrs, s_ptrs, v_ptrs, KW, offs_kw, offs_g, rows_ok, BLOCK_KW: tl.constexpr,
                GW: tl.constexpr, EVEN: tl.constexpr, STAGES: tl.constexpr, FMT: tl.constexpr):
    """``[NG, R]`` float32 group dots of a range of ``KW`` words (``_steps``; the whole steps unmasked where the rows
    are all in range, ``EVEN``, then the last part step masked) and the next two word tiles."""
    acc = tl.zeros((BLOCK_KW // GW, w.shape[1]), dtype=tl.float32)
    whole = (KW // BLOCK_KW) * BLOCK_KW if EVEN else 0
    acc, w, w1 = _steps(acc, w, w1, w_ptrs, s_ptrs, v_ptrs, 0, whole, KW, offs_kw, offs_g, rows_ok, BLOCK_KW, GW,
                        EVEN, STAGES, FMT)
    return _steps(acc, w, w1, w_ptrs, s_ptrs, v_ptrs, whole, KW, KW, offs_kw, offs_g, rows_ok, BLOCK_KW, GW, False,
                  STAGES, FMT)
