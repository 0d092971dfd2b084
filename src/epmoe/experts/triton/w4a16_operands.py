"""The A operand of the W4A16 tensor-core kernels (``w4a16_mma``, ``w4a16_wgmma``): the packed words of a weight tile
loaded in memory order, relabelled into the operand's order and widened to bf16 in registers, and what both kernel
pairs share around it (the tile loads, a row block's pairs, the gate/up and down epilogues).

Input order. A word ``c`` of a weight row holds inputs ``8 c + j`` (``j = 0..7``, bits ``4 j``). A dot over ``K`` is
a sum, so any order of the inputs does as long as both operands use it. A step of ``BLOCK_KW`` words is four
products, one per nibble plane ``j = 0..3``: plane ``A_j [BLOCK_N, 2 BLOCK_KW]`` holds at ``(n, 2 w + e)`` nibble ``j
+ 4 e`` of operand word ``w`` of row ``n``, and the activations' plane holds input ``8 c + j + 4 e`` of each token row
at ``2 w + e`` (each kernel module says how it lays the activations out). The nibbles ``j`` and ``j + 4`` are the two
16-bit lanes of ``(word >> 4 j) & 0x000F000F``: exactly the bf16x2 register of the A operand for inputs ``(2 w, 2 w +
1)`` (``k_width = 2``). Operand word ``w = 8 r + 4 h + q`` is memory word ``c = 2 R q + 2 r + h`` (``R = BLOCK_KW /
8``): the words the A operand wants in lane ``q`` of a row are then ``2 R`` consecutive words of memory, one 16-byte
load for ``BLOCK_KW = 16``. So each thread loads its own words in memory order (``_word_layout``) and the tile is
relabelled into the operand's order by reshapes and a permutation (``operand_order``): the same registers, no shared
memory and no data movement.

Widening a register (``_widen``, inline PTX): the two nibbles OR-ed into the mantissas of 128 (``lop3``), 136
subtracted in bf16x2 (exact: ``nib - 8``) and the pair multiplied by the group scale (one rounding, as
``experts.int4.dequantize_int4`` rounds its float32 product): about two instructions a weight. MXFP4 (gpt-oss):
its 16-byte blocks read as int32 words hold input ``8 c + j`` in nibble ``j`` of word ``c`` too, with one E8M0
scale a group of 32 (``grouped.packed_words``); ``_widen_e2m1`` places each E2M1 code's bits in a bf16 and takes two
exact products (the kernels choose it from the scales' dtype, uint8).

Source: the mantissa-OR widening is the trick of the W4A16 kernels (FasterTransformer; Marlin: Frantar et al.,
"MARLIN: Mixed-Precision Auto-Regressive Parallel Inference on Large Language Models", arXiv:2408.11743). The code is
our own.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from epmoe.experts.triton.decode import gated_activation
from epmoe.experts.triton.w4a16 import E2M1_LANES_PTX


@gluon.constexpr_function
def _word_layout(block_n, block_kw, num_warps, gw):
    """Register layout of a ``[block_n, block_kw // gw]`` tile in memory order (``gw = 1``: words; ``gw = G / 8``:
    their group scales): thread ``(g, q)`` of a warp holds rows ``g`` and ``g + 8`` of each of the warp's 16-row
    tiles and words ``[q R2, (q + 1) R2)`` (``R2 = block_kw / 4``, one 16-byte load for ``R2 = 4``), the words the
    A operand wants in that thread once the inputs are reordered (``operand_order``)."""
    r2 = block_kw // 4
    regs = [[0, (1 << i) // gw] for i in range(r2.bit_length() - 1) if 1 << i >= gw] + [[8, 0]]
    regs += [[16 * num_warps << i, 0] for i in range((block_n // (16 * num_warps)).bit_length() - 1)]
    lanes = [[0, r2 // gw], [0, 2 * r2 // gw], [1, 0], [2, 0], [4, 0]]
    warps = [[16 << i, 0] for i in range(num_warps.bit_length() - 1)]
    return gl.DistributedLinearLayout(regs, lanes, warps, [], [block_n, block_kw // gw])


@gluon.jit
def operand_order(words, BLOCK_N: gl.constexpr, BLOCK_KW: gl.constexpr, LAYOUT: gl.constexpr):
    """A word tile (or per-word tile) in memory order -> the order of the A operand: memory word ``c = 2 R q + 2 r +
    h`` is operand word ``8 r + 4 h + q`` (``R = BLOCK_KW / 8``), in ``LAYOUT`` (the same threads: no data moves)."""
    R: gl.constexpr = BLOCK_KW // 8
    t = gl.reshape(gl.permute(gl.reshape(words, [BLOCK_N, 4, R, 2]), [0, 2, 3, 1]), [BLOCK_N, BLOCK_KW])
    return gl.convert_layout(t, LAYOUT)


@gluon.jit
def scales_per_word(scales, GW: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_KW: gl.constexpr):
    """Group scales ``[BLOCK_N, BLOCK_KW / GW]`` -> one per word ``[BLOCK_N, BLOCK_KW]`` bf16 (copies in registers):
    INT4's bf16 scales as they are, MXFP4's E8M0 bytes (uint8) as ``e8m0_bf16`` makes them."""
    if scales.dtype == gl.uint8:
        scales = e8m0_bf16(scales)
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
def e8m0_bf16(s):
    """bf16 ``2 ** (s - 127)`` of E8M0 bytes ``s`` (uint8), exact: the exponent field ``s`` of a bf16 (``s = 0``, the
    subnormal ``2 ** -127``, as mantissa bit 6; ``s = 255`` reads as infinity)."""
    e = s.to(gl.int16)
    return ((e << 7) | ((e == 0).to(gl.int16) << 6)).to(gl.bfloat16, bitcast=True)


@gluon.jit
def _widen_e2m1(words, scale, J: gl.constexpr):
    """E2M1 codes ``J`` and ``J + 4`` of ``words`` (int32, MXFP4 blocks read as words) times ``scale`` (bf16, ``2 **
    (s - 127)``, the words' shape): two bf16 tensors of the words' shape. In each 16-bit lane the code's three
    magnitude bits go under the bf16 exponent (bits 6-8) and its sign onto bit 15, which reads as ``e2m1 * 2 **
    -126`` (code 1 a bf16 subnormal), then times ``2 ** 126`` and the scale: both products exact, as
    ``experts.mxfp4.dequantize_mxfp4`` widens (a product below bf16's normal range rounds once)."""
    SHIFT: gl.constexpr = f"shr.b32 t, t, {4 * J};" if J else ""
    return gl.inline_asm_elementwise(
        "{ .reg .b32 t, m, sg, big, nz, s2; mov.b32 t, $2; " + SHIFT + E2M1_LANES_PTX
        + " mov.b32 s2, {$3, $3}; fma.rn.bf16x2 t, t, s2, nz; mov.b32 {$0, $1}, t; }",
        "=h,=h,r,h", [words, scale], dtype=(gl.bfloat16, gl.bfloat16), is_pure=True, pack=1)


@gluon.jit
def widened_plane(words, scale, J: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_KW: gl.constexpr, A_LAYOUT: gl.constexpr,
                  MXFP4: gl.constexpr):
    """The A operand ``A_J [BLOCK_N, 2 BLOCK_KW]`` bf16 of operand-order words and scales ``[BLOCK_N, BLOCK_KW]``
    (module docstring): INT4 codes, or with ``MXFP4`` E2M1 codes (``_widen_e2m1``)."""
    if MXFP4:
        lo, hi = _widen_e2m1(words, scale, J)
    else:
        lo, hi = _widen(words, scale, J)
    a = gl.reshape(gl.join(lo, hi), [BLOCK_N, 2 * BLOCK_KW])
    return gl.convert_layout(a, A_LAYOUT, assert_trivial=True)


@gluon.jit
def block_rows(sorted_ptr, first, num_pairs, BLOCK_M: gl.constexpr, LAYOUT: gl.constexpr):
    """The pair ids of a row block's ``BLOCK_M`` sorted positions and which are real (padding: ``num_pairs``)."""
    pair = gl.load(sorted_ptr + first + gl.arange(0, BLOCK_M, layout=LAYOUT))
    return pair, pair < num_pairs


@gluon.jit
def weight_ptrs(base, s_base, rows0, stride_wn, stride_sn, BLOCK_N: gl.constexpr, BLOCK_KW: gl.constexpr,
                 GW: gl.constexpr, NUM_WARPS: gl.constexpr):
    """Pointers of a word tile (memory order) at word 0 of rows ``rows0 + [0, BLOCK_N)`` and of its scale tile, and
    those rows (for masks) in both layouts."""
    W_MEM: gl.constexpr = _word_layout(BLOCK_N, BLOCK_KW, NUM_WARPS, 1)
    S_MEM: gl.constexpr = _word_layout(BLOCK_N, BLOCK_KW, NUM_WARPS, GW)
    rows = rows0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, W_MEM))
    cols = gl.arange(0, BLOCK_KW, layout=gl.SliceLayout(0, W_MEM))
    s_rows = rows0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, S_MEM))
    s_cols = gl.arange(0, BLOCK_KW // GW, layout=gl.SliceLayout(0, S_MEM))
    w_ptrs = (base + rows.to(gl.int64)[:, None] * stride_wn) + cols[None, :]
    s_ptrs = (s_base + s_rows.to(gl.int64)[:, None] * stride_sn) + s_cols[None, :]
    return w_ptrs, s_ptrs, rows[:, None], cols[None, :], s_rows[:, None], (s_cols * GW)[None, :]


@gluon.jit
def load_tile(ptrs, rows, R_ROWS, cols, k_left, EVEN: gl.constexpr):
    """A word or scale tile (``ptrs``; ``cols`` in words), rows at or past ``R_ROWS`` and words at or past ``k_left``
    zero unless ``EVEN``. ``k_left`` is a multiple of 4 words (a row holds whole groups of at least 32 inputs), which
    the compiler is told, so that the masked word tiles still load as 16-byte vectors."""
    if EVEN:
        return gl.load(ptrs)
    else:
        return gl.load(ptrs, mask=(rows < R_ROWS) & (cols < (k_left // 4) * 4), other=0)


@gluon.jit
def gated_rows(acc_g, acc_u, b_ptr, tw_ptr, sorted_ptr, slot, pos, pid_n, num_pairs, F, act_limit, act_alpha,
               BLOCK_N: gl.constexpr, ROWS: gl.constexpr, MMA: gl.constexpr, ACT: gl.constexpr,
               HAS_BIAS: gl.constexpr, WEIGHT_ON_INPUT: gl.constexpr):
    """The gate/up epilogue of sorted positions ``[pos, pos + ROWS)`` (accumulators ``[BLOCK_N, ROWS]`` float32 in
    ``MMA``: rows ``f`` of ``F`` by token rows): routing weight (on the input), bias and the gated activation. Returns
    ``h`` float32, ``f`` and the mask of its real entries (``f < F``, real pairs)."""
    pair_c, valid_c = block_rows(sorted_ptr, pos, num_pairs, ROWS, gl.SliceLayout(0, MMA))
    f = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, MMA))
    f_ok = f < F
    if WEIGHT_ON_INPUT:
        tw = gl.load(tw_ptr + pair_c, mask=valid_c, other=0.0)
        acc_g *= tw[None, :]
        acc_u *= tw[None, :]
    if HAS_BIAS:
        acc_g += gl.load(b_ptr + slot * 2 * F + f, mask=f_ok, other=0.0).to(gl.float32)[:, None]
        acc_u += gl.load(b_ptr + slot * 2 * F + F + f, mask=f_ok, other=0.0).to(gl.float32)[:, None]
    return gated_activation(acc_g, acc_u, act_limit, act_alpha, ACT), f, f_ok[:, None] & valid_c[None, :]


@gluon.jit
def store_down_rows(acc, b_ptr, tw_ptr, y_ptr, sorted_ptr, pos, num_pairs, slot, pid_n, D, BLOCK_N: gl.constexpr,
                    ROWS: gl.constexpr, MMA: gl.constexpr, HAS_BIAS: gl.constexpr, WEIGHT_ON_INPUT: gl.constexpr):
    """The down epilogue of sorted positions ``[pos, pos + ROWS)`` (accumulator ``[BLOCK_N, ROWS]`` float32 in
    ``MMA``): bias, routing weight (on the output) and ``y [N, D]`` float32 at each pair's row."""
    pair_c, valid_c = block_rows(sorted_ptr, pos, num_pairs, ROWS, gl.SliceLayout(0, MMA))
    d = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, MMA))
    d_ok = d < D
    if HAS_BIAS:
        acc += gl.load(b_ptr + slot * D + d, mask=d_ok, other=0.0).to(gl.float32)[:, None]
    if not WEIGHT_ON_INPUT:
        acc *= gl.load(tw_ptr + pair_c, mask=valid_c, other=0.0)[None, :]
    y_ptrs = y_ptr + pair_c.to(gl.int64)[None, :] * D + d[:, None]
    gl.store(y_ptrs, acc, mask=d_ok[:, None] & valid_c[None, :])
