"""W4A16 decode kernels (``packed_decode_experts``) for INT4 (``experts.int4``) and MXFP4 (``experts.mxfp4``) expert
weights as stored: one matrix-vector product per (token, k) pair on the CUDA cores, reading the
packed weights directly, in three launches with the structure of the bf16 decode kernels (``decode``: live pairs
numbered on the device and shared among ``PackedDecodeConfig.max_programs // column tiles`` pair groups, register
double buffering of the weight tiles, programmatic dependent launches on Hopper, the sum over ``K`` fused into the
down kernel by arrival counters).

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

1. ``_deinterleave_kernel``, grid ``(T, cdiv(D / 8, BLOCK_W))``: ``x [T, D]`` -> ``xt [T, D]`` as above;
   program ``(0, 0)`` zeroes the gate/up launch's split counters.
2. ``_decode_gate_up_kernel``, grid ``(cdiv(F, BLOCK_N1), groups)``: for each of its live pairs, program
   ``(j, g)`` reads ``BLOCK_N1`` gate and ``BLOCK_N1`` up rows of the pair's expert, ``BLOCK_KW1`` words a step
   (the next step's words requested before this step's are widened; the input tiles shared by gate and up),
   applies bias, routing weight and the gated activation and writes ``h [N, F]`` (``xt``'s dtype) in the layout of
   ``xt``, for the down kernel. Program ``(0, 0)`` zeroes the down kernel's arrival counters. With few live
   pairs (``PackedDecodeConfig.split_max``) the groups split each pair's reduction over ``D`` instead: each
   split stores its partial sums and takes a ticket from its tile's counter, and the last sums the partials in
   split order before the epilogue (the threadfence-reduction pattern of the CUDA samples).
3. ``_decode_down_kernel``, grid ``(cdiv(D, BLOCK_N2), groups)``: the same over ``w2`` and ``h``, ``y [N, D]``
   float32; the last program to arrive for column tile ``j`` sums it over each token's ``K`` pairs in a fixed
   order into ``out`` (bitwise reproducible).

On Hopper (``PackedDecodeConfig.pdl``) steps 2 and 3 are programmatic dependent launches: each requests its
first weight tiles before waiting (``griddepcontrol.wait``) for the previous launch's output, and each allows its own
dependents at its start: the down launch, and after it the kernel that follows the experts (a dependent launch waits
for this one before it reads ``out``), which so requests its own weights while the down kernel runs.

MXFP4. A block's 16 bytes read as four int32 words have INT4's nibble order (input ``8 w + j`` of the block in nibble
``j`` of word ``w``), and its E8M0 scale is the group scale (``G = 32``, ``GW = 4``), so the same tiles, loads and
reductions serve it; only the widening and the scales differ. An E2M1 code is 1 sign, 2 exponent and 1 mantissa
bit, not linear in its bits, so it is widened through fp16: codes ``j`` and ``j + 4`` of a word, 16 bits apart, are
placed in the two 16-bit lanes of one register at once (``_e2m1_pair``: their three magnitude bits shifted under the
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

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from epmoe.experts.int4 import INT4_PACK, Int4ExpertWeights
from epmoe.experts.mxfp4 import MXFP4ExpertWeights
from epmoe.experts.triton.decode import (
    gated_h,
    live_pair,
    live_pairs,
    pair_grid,
    sum_pairs_on_arrival,
    zero_arrival_counters,
)
from epmoe.experts.triton.grouped import act_code, packed_scales, packed_words
from epmoe.experts.triton.pdl import pdl_launch
from epmoe.experts.triton.w4a16 import e2m1_f16, e8m0_f32, row_strides
from epmoe.experts.weights import Activation, check_expert_call

_ZERO_BLOCK = 1024
FMT_INT4 = tl.constexpr(0)
FMT_MXFP4 = tl.constexpr(1)  # MXFP4 widened arithmetically (the Triton interpreter, float32 under test)
FMT_MXFP4_PTX = tl.constexpr(2)  # MXFP4 widened by inline PTX (CUDA)
MXFP4_INPUT_SCALE = tl.constexpr(16384.0)  # 2 ** 14, the inputs' pre-scaling for MXFP4 (``_e2m1_pair``)


@dataclass(frozen=True)
class PackedDecodeConfig:
    """Tile shapes of the INT4 and MXFP4 decode kernels (all sizes powers of two; see the module docstring's layout).
    The defaults (one warp a program, 128 words a step, each thread one group of eight rows: the step's inputs are
    loaded in the word tile's own layout and serve eight rows) were the fastest per layer inside a graph of several
    layers of twelve tile shapes timed on the H200 for Kimi-K2.5's experts at one token (``G = 32``; a one-off
    probe), and within 1% of the fastest alone (three stages) in ``benchmarks/moe_layer.py --sweep``, which times the
    alternatives of ``INT4_DECODE_SWEEP`` beside the default.

    Attributes:
        block_n1: gate (and up) rows per gate/up program.
        block_kw1: int32 words (8 inputs each) of ``D`` per step of the gate/up program; ``8 * block_kw1`` a
            multiple of the group size.
        block_n2: ``w2`` rows (output columns) per down program.
        block_kw2: words of ``F`` per step of the down program; ``8 * block_kw2`` a multiple of the group size.
        num_warps: warps per program.
        pdl: launch the gate/up and down kernels as programmatic dependent launches (Hopper): each requests
            its first weight tiles before waiting for the previous launch's output. Off for tensors not on a
            CUDA device of compute capability 9.0 or more (and so under the Triton interpreter), or with
            ``EPMOE_PDL=0`` (``pdl.pdl_launch``).
        max_programs: programs per launch, at most (and at least one pair group), as
            ``decode.DecodeConfig.max_programs``.
        stages: word tiles of a program in registers, 2 or 3: the words of step ``k + stages - 1`` are requested
            before step ``k``'s are widened (3: twice the bytes in flight, for one active expert spread thin).
        split_max: a gate/up program's reduction over ``D`` may be split up to this many ways (a power of two) when
            few pairs are live: the launch has at least ``split_max`` pair groups (fewer where ``max_programs``
            does not allow them), and with ``L`` live pairs each gets ``split`` of them, the largest power of two
            up to ``split_max`` with ``L * split`` within the groups (chosen on the device), each computing a
            whole-step range of ``D``; the last of a tile's splits to arrive sums the partials in split order and
            finishes the tile. 1: never. The same routing gives the same bits; a pair's sums are split, and so
            rounded, by how many pairs are live with it (as the MMA path's split reduction is).
            The default 2 was the fastest of 1, 2, 4 and 8 for one live pair of Kimi-K2.5's experts on the H200
            (a one-off probe): the kernels hold about 240 registers a thread, so an SM holds 8 one-warp programs,
            and 4 splits of one pair's 512 row tiles already need two waves.
        bf16_inputs: with bf16 rows, keep the de-interleaved inputs ``xt`` and the intermediate ``h`` in bf16 (the
            pre-scaling by a power of two is exact; ``h`` is rounded to bf16 as the model's own MLP rounds it): a
            thread then reads half as many input bytes beside its words. Other dtypes keep float32.
    """

    block_n1: int = 4
    block_kw1: int = 128
    block_n2: int = 8
    block_kw2: int = 128
    num_warps: int = 1
    pdl: bool = True
    max_programs: int = 1024
    stages: int = 2
    split_max: int = 2
    bf16_inputs: bool = True


@triton.jit
def _nibble_scale(j):
    """``2 ** (69 - p_j)`` float32 for input ``j`` (int32 tensor, 0..7) of a word (see the module docstring)."""
    pos = tl.where(j < 5, 4 * j, 4 * j - 12)
    return ((196 - pos) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _load_inputs(v_ptrs, v_ok, GW: tl.constexpr, EVEN: tl.constexpr):
    """The eight pre-scaled input tiles ``[NG, 1, GW]`` float32 of a step, ``v_ptrs`` at input 0 of each
    group's words, input ``j`` at ``+ j * GW`` (see ``_input_offsets``); unmasked when ``EVEN``."""
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
def _input_tile(offs_g, GW: tl.constexpr):
    """``[NG, 1, GW]`` offsets of input 0 of the words of a step's groups in the de-interleaved vector, broadcast
    over the rows of the word tile ``[NG, R, GW]`` (see the module docstring's layout)."""
    return offs_g[:, None, None] * (8 * GW) + tl.arange(0, GW)[None, None, :]


@triton.jit
def _input_offsets(n, GW: tl.constexpr):
    """Where input ``n`` (int32 tensor) of a vector goes in its de-interleaved copy: per group of ``G = 8 GW``
    inputs, input ``j`` of the group's ``GW`` words contiguous at ``j * GW``."""
    return (n // (8 * GW)) * (8 * GW) + (n % 8) * GW + (n // 8) % GW


@triton.jit
def _group_dots(w, v):
    """Per group and row, ``2 ** -80 * sum`` over the group's inputs of ``(nib - 8) * v``: ``w [NG, R, GW]`` int32
    words, ``v`` their eight input tiles (``_load_inputs``); ``[NG, R]`` float32 (see the module docstring)."""
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
    """The PTX of ``_e2m1_pair`` for codes ``j`` and ``j + 4`` (``j`` in 0..3; input ``$2`` a word, outputs ``$0``,
    ``$1`` float32): the magnitude bits of nibbles ``j`` (bits ``4 j``..``4 j + 2``) and ``j + 4`` shifted to bits 9-11
    of the two 16-bit lanes, their sign bits (``4 j + 3``, ``4 j + 19``) to bits 15 and 31, joined by one ``lop3``
    (``(m & 0x0E000E00) | s``), each lane converted from fp16."""
    j = int(j)
    mag = f"shl.b32 m, $2, {9 - 4 * j};" if j < 3 else "shr.b32 m, $2, 3;"
    sign = f"shl.b32 s, $2, {12 - 4 * j}; and.b32 s, s, 0x80008000;" if j < 3 else "and.b32 s, $2, 0x80008000;"
    return ("{ .reg .b32 m, s; .reg .b16 l, h; " + mag + " " + sign + " lop3.b32 m, m, 0x0E000E00, s, 0xEA;"
            " mov.b32 {l, h}, m; cvt.f32.f16 $0, l; cvt.f32.f16 $1, h; }")


@triton.jit
def _e2m1_pair(w, J: tl.constexpr, PTX: tl.constexpr):
    """E2M1 codes ``J`` and ``J + 4`` (``J`` in 0..3) of words ``w`` (int32) as two float32 tensors of ``w``'s shape,
    each ``e2m1 * 2 ** -14`` exactly (see the module docstring): by inline PTX (``e2m1_pair_ptx``) with ``PTX``,
    arithmetically otherwise."""
    if PTX:
        return tl.inline_asm_elementwise(e2m1_pair_ptx(J), "=r,=r,r", [w], dtype=(tl.float32, tl.float32),
                                         is_pure=True, pack=1)
    else:
        return e2m1_f16((w >> (4 * J)) & 0xF), e2m1_f16((w >> (4 * J + 16)) & 0xF)


@triton.jit
def _e2m1_group_dots(w, v, PTX: tl.constexpr):
    """Per group and row, ``sum`` over the group's inputs of ``e2m1 * v``: ``w [NG, R, GW]`` int32 words (MXFP4
    blocks), ``v`` their eight input tiles pre-scaled by ``2 ** 14`` (``_load_inputs``); ``[NG, R]`` float32."""
    lo, hi = _e2m1_pair(w, 0, PTX)
    acc = lo * v[0]
    acc += hi * v[4]  # one multiply-add a code
    lo, hi = _e2m1_pair(w, 1, PTX)
    acc += lo * v[1]
    acc += hi * v[5]
    lo, hi = _e2m1_pair(w, 2, PTX)
    acc += lo * v[2]
    acc += hi * v[6]
    lo, hi = _e2m1_pair(w, 3, PTX)
    acc += lo * v[3]
    acc += hi * v[7]
    return tl.sum(acc, axis=2)


@triton.jit
def _input_scale(j, FMT: tl.constexpr):
    """The pre-scaling float32 of input ``j`` (int32 tensor, 0..7) of a word: ``_nibble_scale`` for INT4, ``2 **
    14`` for MXFP4."""
    if FMT == FMT_INT4:
        return _nibble_scale(j)
    else:
        return tl.zeros(j.shape, tl.float32) + MXFP4_INPUT_SCALE


@triton.jit
def _scaled_dots(w, v, s, FMT: tl.constexpr):
    """``[NG, R]`` float32: the group dots of words ``w`` with inputs ``v`` times the loaded group scales ``s`` (INT4:
    float; MXFP4: E8M0 bytes), in the scale the format's pre-scaling leaves (``_unscale``)."""
    if FMT == FMT_INT4:
        return _group_dots(w, v) * s.to(tl.float32)
    else:
        return _e2m1_group_dots(w, v, FMT == FMT_MXFP4_PTX) * e8m0_f32(s)


@triton.jit
def _unscale(sums, FMT: tl.constexpr):
    """Sums of ``_scaled_dots`` in the inputs' own scale: INT4's ``2 ** -80`` undone; MXFP4's is 1."""
    if FMT == FMT_INT4:
        return sums * 1.2089258196146292e+24  # 2 ** 80
    else:
        return sums


@triton.jit
def _row_tile(offs_n, n_ok, KW, stride_wn, stride_sn, BLOCK_KW: tl.constexpr, GW: tl.constexpr):
    """The word layout of a program's ``R`` rows ``offs_n`` over ``KW`` words (see the module docstring): the group
    and word offsets of a step, the ``[NG, R, GW]`` word and ``[NG, R]`` scale offsets of its rows, and the masks of
    its first two word tiles."""
    offs_g = tl.arange(0, BLOCK_KW // GW)
    offs_kw = offs_g[:, None] * GW + tl.arange(0, GW)[None, :]
    rows = offs_n.to(tl.int64)
    w_rows = offs_kw[:, None, :] + rows[None, :, None] * stride_wn
    s_rows = offs_g[:, None] + rows[None, :] * stride_sn
    first, second = _tile_masks(offs_kw, n_ok, KW, BLOCK_KW)
    return offs_g, offs_kw, w_rows, s_rows, first, second


@triton.jit
def _tile_masks(offs_kw, n_ok, KW, BLOCK_KW: tl.constexpr):
    """The masks of the first two word tiles ``[NG, R, GW]`` of rows ``n_ok`` over ``KW`` words."""
    return ((offs_kw < KW)[:, None, :] & n_ok[None, :, None],
            (offs_kw < KW - BLOCK_KW)[:, None, :] & n_ok[None, :, None])


@triton.jit
def _first_tiles(ptrs, first, second, BLOCK_KW: tl.constexpr, STAGES: tl.constexpr):
    """Word tiles 0 and 1 of a row tile (``ptrs`` at its first words), masked by ``first`` and ``second``; with
    ``STAGES == 2`` tile 0 twice (tile 1 is requested in the first step)."""
    t0 = tl.load(ptrs, mask=first, other=0)
    if STAGES == 3:
        return t0, tl.load(ptrs + BLOCK_KW, mask=second, other=0)
    else:
        return t0, t0


@triton.jit
def _deinterleave_kernel(x_ptr, xt_ptr, count_ptr, num_counters, DW, stride_x, GW: tl.constexpr, FMT: tl.constexpr,
                         BLOCK_W: tl.constexpr, ZERO_BLOCK: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):  # the gate/up launch's split counters (read after its wait)
        zero_arrival_counters(count_ptr, num_counters, ZERO_BLOCK)
    t = tl.program_id(0).to(tl.int64)
    offs_w = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    offs_j = tl.arange(0, 8)
    ok = (offs_w < DW)[:, None]
    v = tl.load(x_ptr + t * stride_x + offs_w[:, None] * 8 + offs_j[None, :], mask=ok, other=0.0).to(tl.float32)
    dest = _input_offsets(offs_w[:, None] * 8 + offs_j[None, :], GW)
    tl.store(xt_ptr + t * 8 * DW + dest, (v * _input_scale(offs_j, FMT)[None, :]).to(xt_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _gate_up_rows(pid_n, F, BLOCK_N: tl.constexpr):
    """The ``2 * BLOCK_N`` weight rows of gate/up program ``pid_n`` and which are in range: its ``BLOCK_N`` gate rows,
    then the same ``BLOCK_N`` up rows (``F`` further); one tile, so that a thread's inputs serve the gate and up rows
    it holds alike."""
    r = tl.arange(0, 2 * BLOCK_N)
    n = pid_n * BLOCK_N + r % BLOCK_N
    return n + (r // BLOCK_N) * F, n < F


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
        acc += _scaled_dots(w, _load_inputs(v_ptrs + 8 * kw0, (offs_kw < KW - kw0)[:, None, :], GW, WHOLE), sc, FMT)
        if STAGES == 3:
            w = w1
            w1 = w2
        else:
            w = w2
    return acc, w, w1


@triton.jit
def _range_dots(w, w1, w_ptrs, s_ptrs, v_ptrs, KW, offs_kw, offs_g, rows_ok, BLOCK_KW: tl.constexpr,
                GW: tl.constexpr, EVEN: tl.constexpr, STAGES: tl.constexpr, FMT: tl.constexpr):
    """``[NG, R]`` float32 group dots of a range of ``KW`` words (``_steps``; the whole steps unmasked where the rows
    are all in range, ``EVEN``, then the last part step masked) and the next two word tiles."""
    acc = tl.zeros((BLOCK_KW // GW, w.shape[1]), dtype=tl.float32)
    whole = (KW // BLOCK_KW) * BLOCK_KW if EVEN else 0
    acc, w, w1 = _steps(acc, w, w1, w_ptrs, s_ptrs, v_ptrs, 0, whole, KW, offs_kw, offs_g, rows_ok, BLOCK_KW, GW,
                        EVEN, STAGES, FMT)
    return _steps(acc, w, w1, w_ptrs, s_ptrs, v_ptrs, whole, KW, KW, offs_kw, offs_g, rows_ok, BLOCK_KW, GW, False,
                  STAGES, FMT)


@triton.jit
def _gate_up_sums(
    xt_ptr, w_ptr, s_ptr, token, slot, w, w1, kw_begin, KW, DW, stride_we, stride_se, w_rows, s_rows, rows_ok,
    offs_kw, offs_g, BLOCK_N: tl.constexpr, BLOCK_KW: tl.constexpr, GW: tl.constexpr, EVEN: tl.constexpr,
    STAGES: tl.constexpr, FMT: tl.constexpr,
):
    """The gate and up dot products ``[BLOCK_N]`` float32 of this program's rows (``_gate_up_rows``) over the ``KW``
    words from ``kw_begin`` (whole steps unless they end at ``DW``) for ``token``'s inputs, from the range's first two
    word tiles ``w``, ``w1`` already requested."""
    w_ptrs = w_ptr + slot * stride_we + w_rows + kw_begin
    s_ptrs = s_ptr + slot * stride_se + s_rows + kw_begin // GW
    v_ptrs = xt_ptr + token.to(tl.int64) * 8 * DW + 8 * kw_begin + _input_tile(offs_g, GW)
    acc, w, w1 = _range_dots(w, w1, w_ptrs, s_ptrs, v_ptrs, KW, offs_kw, offs_g, rows_ok, BLOCK_KW, GW, EVEN, STAGES,
                             FMT)
    sums = _unscale(tl.sum(acc, axis=0), FMT)
    return tl.split(tl.permute(tl.reshape(sums, [2, BLOCK_N]), [1, 0]))


@triton.jit
def _gate_up_finish(
    tw_ptr, b_ptr, h_ptr, pair, slot, gs, us, F, act_limit, act_alpha, offs_n, GW: tl.constexpr, ACT: tl.constexpr,
    HAS_BIAS: tl.constexpr, WEIGHT_ON_INPUT: tl.constexpr, FMT: tl.constexpr,
):
    """A pair's ``h`` for this program's rows ``offs_n`` from their whole gate and up sums: bias, routing weight, the
    gated activation, stored in the layout of ``xt`` (for the down kernel)."""
    n_ok = offs_n < F
    h = gated_h(tw_ptr, b_ptr, pair, slot, gs, us, F, act_limit, act_alpha, offs_n, n_ok, ACT, HAS_BIAS,
                WEIGHT_ON_INPUT)
    hs = h * _input_scale(offs_n % 8, FMT)
    tl.store(h_ptr + pair * F + _input_offsets(offs_n, GW), hs.to(h_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _split_of(n_live, GROUPS: tl.constexpr, SPLIT_LOG2: tl.constexpr):
    """The largest power of two ``split`` up to ``2 ** SPLIT_LOG2`` with ``n_live * split <= GROUPS``, at least 1."""
    split = 1
    for _ in tl.static_range(SPLIT_LOG2):
        split = tl.where(n_live * 2 * split <= GROUPS, 2 * split, split)
    return split


@triton.jit
def _decode_gate_up_kernel(
    xt_ptr, slots_ptr, tw_ptr, w_ptr, s_ptr, b_ptr, h_ptr, count_ptr, ws_ptr, split_count_ptr, num_pairs, num_slots,
    top_k, num_counters, F, DW, stride_we, stride_wn, stride_se, stride_sn, act_limit, act_alpha,
    BLOCK_N: tl.constexpr, BLOCK_KW: tl.constexpr, GW: tl.constexpr, N_PAD: tl.constexpr, GROUPS: tl.constexpr,
    PAIR_GROUPS: tl.constexpr, SPLIT_LOG2: tl.constexpr, ONE_PAIR: tl.constexpr, ACT: tl.constexpr,
    HAS_BIAS: tl.constexpr, WEIGHT_ON_INPUT: tl.constexpr, ZERO_BLOCK: tl.constexpr, PDL: tl.constexpr,
    EVEN: tl.constexpr, STAGES: tl.constexpr, FMT: tl.constexpr,
):
    pid_n = tl.program_id(0)
    group = tl.program_id(1)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    DW = (DW // 4) * 4  # whole groups of at least 4 words: the word tiles load as 16-byte vectors (row_strides)
    stride_we, stride_wn = row_strides(stride_we, stride_wn)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows, rows_ok = _gate_up_rows(pid_n, F, BLOCK_N)
    offs_g, offs_kw, w_rows, s_rows, first, second = _row_tile(rows, rows_ok, DW, stride_wn, stride_sn, BLOCK_KW, GW)
    # slots and weights were complete before the launch chain began (the de-interleave launch before this one is an
    # ordinary launch): request the first words before the wait. Every program waits, also one without a pair, so
    # that this launch ends only after the de-interleave launch has.
    if ONE_PAIR:
        slot = tl.load(slots_ptr + group)
        live = (slot >= 0) & (slot < num_slots)
        slot = tl.where(live, slot, 0).to(tl.int64)
        w, w1 = _first_tiles(w_ptr + slot * stride_we + w_rows, first & live, second & live, BLOCK_KW, STAGES)
        if PDL:
            tl.extra.cuda.gdc_wait()
        if live:
            gs, us = _gate_up_sums(xt_ptr, w_ptr, s_ptr, group // top_k, slot, w, w1, 0, DW, DW, stride_we, stride_se,
                                   w_rows, s_rows, rows_ok, offs_kw, offs_g, BLOCK_N, BLOCK_KW, GW, EVEN, STAGES, FMT)
            _gate_up_finish(tw_ptr, b_ptr, h_ptr, group, slot, gs, us, F, act_limit, act_alpha, offs_n, GW, ACT,
                            HAS_BIAS, WEIGHT_ON_INPUT, FMT)
    else:
        idx, sl, live, rank, n_live = live_pairs(slots_ptr, num_pairs, num_slots, N_PAD)
        split = _split_of(n_live, GROUPS, SPLIT_LOG2)
        if split > 1:
            # few live pairs: group g computes split g % split of live pair g // split, over whole steps of D
            i = group // split
            part = group % split
            pair, slot = live_pair(idx, sl, live, rank, i)
            mine = i < n_live
            chunk = tl.cdiv(tl.cdiv(DW, split), BLOCK_KW) * BLOCK_KW
            kw_begin = tl.minimum(part * chunk, DW)
            kw_len = tl.minimum(chunk, DW - kw_begin)
            f1, f2 = _tile_masks(offs_kw, rows_ok & mine, kw_len, BLOCK_KW)
            w, w1 = _first_tiles(w_ptr + slot * stride_we + w_rows + kw_begin, f1, f2, BLOCK_KW, STAGES)
            if PDL:
                tl.extra.cuda.gdc_wait()
            if mine:
                gs, us = _gate_up_sums(xt_ptr, w_ptr, s_ptr, pair // top_k, slot, w, w1, kw_begin, kw_len, DW,
                                       stride_we, stride_se, w_rows, s_rows, rows_ok, offs_kw, offs_g, BLOCK_N,
                                       BLOCK_KW, GW, EVEN, STAGES, FMT)
                # the threadfence reduction: the partials are visible to the program that takes the last ticket
                tile = i * tl.num_programs(0) + pid_n
                r = tl.arange(0, BLOCK_N)
                parts = ws_ptr + tile.to(tl.int64) * ((1 << SPLIT_LOG2) * 2 * BLOCK_N)
                tl.store(parts + part * 2 * BLOCK_N + r, gs)
                tl.store(parts + part * 2 * BLOCK_N + BLOCK_N + r, us)
                tl.debug_barrier()
                ticket = tl.atomic_add(split_count_ptr + tile, 1, sem="acq_rel")
                if ticket == split - 1:
                    gs = tl.zeros((BLOCK_N,), dtype=tl.float32)
                    us = tl.zeros((BLOCK_N,), dtype=tl.float32)
                    for j in range(0, split):
                        gs += tl.load(parts + j * 2 * BLOCK_N + r, cache_modifier=".cg")
                        us += tl.load(parts + j * 2 * BLOCK_N + BLOCK_N + r, cache_modifier=".cg")
                    _gate_up_finish(tw_ptr, b_ptr, h_ptr, pair, slot, gs, us, F, act_limit, act_alpha, offs_n, GW,
                                    ACT, HAS_BIAS, WEIGHT_ON_INPUT, FMT)
        else:
            # live pairs group, group + PAIR_GROUPS, ...; the next pair's first words are requested before this
            # pair's epilogue (the groups from PAIR_GROUPS on, there for the splits, only wait)
            pair, slot = live_pair(idx, sl, live, rank, group)
            any_pair = (group < n_live) & (group < PAIR_GROUPS)
            w, w1 = _first_tiles(w_ptr + slot * stride_we + w_rows, first & any_pair, second & any_pair, BLOCK_KW,
                                 STAGES)
            if PDL:
                tl.extra.cuda.gdc_wait()
            if group < PAIR_GROUPS:
                for i in range(group, n_live, PAIR_GROUPS):
                    next_pair, next_slot = live_pair(idx, sl, live, rank, i + PAIR_GROUPS)
                    gs, us = _gate_up_sums(xt_ptr, w_ptr, s_ptr, pair // top_k, slot, w, w1, 0, DW, DW, stride_we,
                                           stride_se, w_rows, s_rows, rows_ok, offs_kw, offs_g, BLOCK_N, BLOCK_KW, GW,
                                           EVEN, STAGES, FMT)
                    more = i + PAIR_GROUPS < n_live
                    w, w1 = _first_tiles(w_ptr + next_slot * stride_we + w_rows, first & more, second & more,
                                         BLOCK_KW, STAGES)
                    _gate_up_finish(tw_ptr, b_ptr, h_ptr, pair, slot, gs, us, F, act_limit, act_alpha, offs_n, GW,
                                    ACT, HAS_BIAS, WEIGHT_ON_INPUT, FMT)
                    pair = next_pair
                    slot = next_slot
    if (pid_n == 0) & (group == 0):  # after the wait: the down launch reads them once this launch has ended
        zero_arrival_counters(count_ptr, num_counters, ZERO_BLOCK)


@triton.jit
def _down_pair(
    h_ptr, tw_ptr, w_ptr, s_ptr, b_ptr, y_ptr, pair, slot, w, w1, next_slot, more, D, F, FW, stride_we, stride_se,
    w_rows, s_rows, offs_n, n_ok, offs_kw, offs_g, first, second,
    BLOCK_N: tl.constexpr, BLOCK_KW: tl.constexpr, GW: tl.constexpr, HAS_BIAS: tl.constexpr,
    WEIGHT_ON_INPUT: tl.constexpr, PREFETCH: tl.constexpr, EVEN: tl.constexpr, STAGES: tl.constexpr,
    FMT: tl.constexpr,
):
    """``y`` of one pair for this program's columns from its first two word tiles ``w``, ``w1`` already requested;
    with ``PREFETCH`` returns the first two tiles of ``next_slot``."""
    w_ptrs = w_ptr + slot * stride_we + w_rows
    s_ptrs = s_ptr + slot * stride_se + s_rows
    v_ptrs = h_ptr + pair * F + _input_tile(offs_g, GW)
    acc, w, w1 = _range_dots(w, w1, w_ptrs, s_ptrs, v_ptrs, FW, offs_kw, offs_g, n_ok, BLOCK_KW, GW, EVEN, STAGES,
                             FMT)
    if PREFETCH:
        w, w1 = _first_tiles(w_ptr + next_slot * stride_we + w_rows, first & more, second & more, BLOCK_KW, STAGES)
    y = _unscale(tl.sum(acc, axis=0), FMT)
    if HAS_BIAS:
        b = tl.load(b_ptr + slot * D + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        if not WEIGHT_ON_INPUT:
            b *= tl.load(tw_ptr + pair)
        y += b
    tl.store(y_ptr + pair * D + offs_n, y, mask=n_ok)
    return w, w1


@triton.jit
def _decode_down_kernel(
    h_ptr, slots_ptr, tw_ptr, w_ptr, s_ptr, b_ptr, y_ptr, count_ptr, out_ptr,
    num_tokens, top_k, num_pairs, num_slots, D, F, FW, stride_we, stride_wn, stride_se, stride_sn, stride_o,
    BLOCK_N: tl.constexpr, BLOCK_KW: tl.constexpr, GW: tl.constexpr, K_PAD: tl.constexpr, N_PAD: tl.constexpr,
    GROUPS: tl.constexpr, ONE_PAIR: tl.constexpr, HAS_BIAS: tl.constexpr, WEIGHT_ON_INPUT: tl.constexpr,
    PDL: tl.constexpr, EVEN: tl.constexpr, STAGES: tl.constexpr, FMT: tl.constexpr,
):
    if PDL:  # the kernel after this launch (the next layer's q/k/v projection) may request its weights while it runs
        tl.extra.cuda.gdc_launch_dependents()
    pid_n = tl.program_id(0)
    group = tl.program_id(1)
    FW = (FW // 4) * 4  # as DW in the gate/up kernel
    stride_we, stride_wn = row_strides(stride_we, stride_wn)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < D
    offs_g, offs_kw, w_rows, s_rows, first, second = _row_tile(offs_n, n_ok, FW, stride_wn, stride_sn, BLOCK_KW, GW)
    if ONE_PAIR:
        slot = tl.load(slots_ptr + group)
        live = (slot >= 0) & (slot < num_slots)
        slot = tl.where(live, slot, 0).to(tl.int64)
        w, w1 = _first_tiles(w_ptr + slot * stride_we + w_rows, first & live, second & live, BLOCK_KW, STAGES)
        if PDL:
            tl.extra.cuda.gdc_wait()
        if live:
            _down_pair(h_ptr, tw_ptr, w_ptr, s_ptr, b_ptr, y_ptr, group, slot, w, w1, slot, False, D, F, FW, stride_we,
                       stride_se, w_rows, s_rows, offs_n, n_ok, offs_kw, offs_g, first, second, BLOCK_N, BLOCK_KW, GW,
                       HAS_BIAS, WEIGHT_ON_INPUT, False, EVEN, STAGES, FMT)
    else:
        idx, sl, live, rank, n_live = live_pairs(slots_ptr, num_pairs, num_slots, N_PAD)
        pair, slot = live_pair(idx, sl, live, rank, group)
        any_pair = group < n_live
        w, w1 = _first_tiles(w_ptr + slot * stride_we + w_rows, first & any_pair, second & any_pair, BLOCK_KW, STAGES)
        if PDL:
            tl.extra.cuda.gdc_wait()
        for i in range(group, n_live, GROUPS):
            next_pair, next_slot = live_pair(idx, sl, live, rank, i + GROUPS)
            w, w1 = _down_pair(h_ptr, tw_ptr, w_ptr, s_ptr, b_ptr, y_ptr, pair, slot, w, w1, next_slot,
                               i + GROUPS < n_live, D, F, FW, stride_we, stride_se, w_rows, s_rows, offs_n, n_ok,
                               offs_kw, offs_g, first, second, BLOCK_N, BLOCK_KW, GW, HAS_BIAS, WEIGHT_ON_INPUT, True,
                               EVEN, STAGES, FMT)
            pair = next_pair
            slot = next_slot
    sum_pairs_on_arrival(slots_ptr, y_ptr, count_ptr, out_ptr, pid_n, num_tokens, top_k, num_slots, D, stride_o,
                         offs_n, n_ok, K_PAD, GROUPS)


def _is_pow2(v: int) -> bool:
    return v > 0 and v & (v - 1) == 0


def packed_decode_experts(
    x: torch.Tensor,
    topk_slots: torch.Tensor,
    topk_weights: torch.Tensor,
    weights: Int4ExpertWeights | MXFP4ExpertWeights,
    activation: Activation,
    weight_on_input: bool = False,
    config: PackedDecodeConfig | None = None,
) -> torch.Tensor:
    """INT4 or MXFP4 expert compute as one matrix-vector product per pair, in three launches (see the module
    docstring).

    Args:
        x: ``[T, D]`` bf16/fp16 (or float32) rows, contiguous along ``D``.
        topk_slots: ``[T, K]`` int64 contiguous local slot ids; an id outside ``[0, S)`` (``-1``) skips.
        topk_weights: ``[T, K]`` float32 contiguous routing weights.
        weights: the packed weights: INT4 (words and scales of rows contiguous) or MXFP4 (blocks contiguous, scales
            of rows contiguous).
        activation: the gated activation.
        weight_on_input: scale the expert input by the weight instead of its output.
        config: tile shapes; ``PackedDecodeConfig()`` when ``None`` (``benchmarks/moe_layer.py --sweep`` times
            the alternatives in ``INT4_DECODE_SWEEP`` and ``MXFP4_DECODE_SWEEP``).

    Returns:
        ``[T, D]`` in ``x.dtype``.

    Raises:
        ValueError: operands of other shapes or layouts than ``experts.weights.check_expert_call`` takes, or weights
            in another layout (named; ``grouped.packed_words``).
        ValueError: a step (``8 * block_kw``) that is not a multiple of the group size, a tile size that is not
            a power of two, or ``stages`` not 2 or 3.
    """
    check_expert_call(x, topk_slots, topk_weights, weights.hidden_size)
    cfg = config if config is not None else PackedDecodeConfig()
    t, k = topk_slots.shape
    n = t * k
    w13, w2, gw = packed_words(weights, "decode")
    s13, s2 = packed_scales(weights)
    g = gw * INT4_PACK
    if (INT4_PACK * cfg.block_kw1) % g or (INT4_PACK * cfg.block_kw2) % g:
        raise ValueError(f"8 * block_kw1 and 8 * block_kw2 must be multiples of the group size {g}, got {cfg}")
    for name in ("block_n1", "block_kw1", "block_n2", "block_kw2"):
        if not _is_pow2(getattr(cfg, name)):
            raise ValueError(f"PackedDecodeConfig.{name} must be a power of two, got {getattr(cfg, name)!r}")
    if cfg.stages not in (2, 3):
        raise ValueError(f"stages must be 2 or 3, got {cfg.stages}")
    if not _is_pow2(cfg.split_max):
        raise ValueError(f"PackedDecodeConfig.split_max must be a power of two, got {cfg.split_max!r}")
    s, d, f = weights.num_slots, weights.hidden_size, weights.intermediate_size
    dev = x.device
    dw = d // INT4_PACK
    vdt = torch.bfloat16 if cfg.bf16_inputs and x.dtype == torch.bfloat16 else torch.float32
    xt = torch.empty(t, d, dtype=vdt, device=dev)
    h = torch.empty(n, f, dtype=vdt, device=dev)
    y = torch.empty(n, d, dtype=torch.float32, device=dev)
    out = torch.empty(t, d, dtype=x.dtype, device=dev)
    tiles1, pair_groups = pair_grid(triton.cdiv(f, cfg.block_n1), n, cfg.max_programs)
    # at least split groups (a power of two up to split_max, within max_programs): with few live pairs each gets
    # several, which split its reduction over D
    split_cap = 1 << (min(cfg.split_max, max(1, cfg.max_programs // tiles1)).bit_length() - 1)
    groups1 = max(pair_groups, split_cap) if n > 0 else pair_groups
    split_log2 = (split_cap.bit_length() - 1) if groups1 > 1 else 0
    grid2 = pair_grid(triton.cdiv(d, cfg.block_n2), n, cfg.max_programs)
    count = torch.empty(grid2[0], dtype=torch.int32, device=dev)
    n_pad = triton.next_power_of_2(max(n, 1))
    placeholder = topk_weights
    if split_log2:  # at most groups1 / 2 live pairs split, one counter and split_cap partials a (pair, tile)
        split_tiles = groups1 // 2 * tiles1
        split_count = torch.empty(split_tiles, dtype=torch.int32, device=dev)
        split_ws = torch.empty(split_tiles * split_cap * 2 * cfg.block_n1, dtype=torch.float32, device=dev)
    else:
        split_count, split_ws = count, placeholder
    b13 = weights.b13 if weights.b13 is not None else placeholder
    b2 = weights.b2 if weights.b2 is not None else placeholder
    limit = activation.swiglu_limit if activation.swiglu_limit is not None else 0.0
    if isinstance(weights, MXFP4ExpertWeights):
        fmt = FMT_MXFP4_PTX.value if x.is_cuda else FMT_MXFP4.value
    else:
        fmt = FMT_INT4.value
    pdl = cfg.pdl and pdl_launch(x)
    block_w = min(512, triton.next_power_of_2(dw))
    _deinterleave_kernel[(t, triton.cdiv(dw, block_w))](x, xt, split_count, split_count.numel() if split_log2 else 0,
                                                          dw, x.stride(0), GW=gw, FMT=fmt, BLOCK_W=block_w,
                                                          ZERO_BLOCK=_ZERO_BLOCK, PDL=pdl)
    _decode_gate_up_kernel[(tiles1, groups1)](
        xt, topk_slots, topk_weights, w13, s13, b13, h, count, split_ws, split_count, n, s, k, grid2[0], f, dw,
        w13.stride(0), w13.stride(1), s13.stride(0), s13.stride(1), float(limit), float(activation.swiglu_alpha),
        BLOCK_N=cfg.block_n1, BLOCK_KW=cfg.block_kw1, GW=gw, N_PAD=n_pad, GROUPS=groups1, PAIR_GROUPS=pair_groups,
        SPLIT_LOG2=split_log2, ONE_PAIR=groups1 == n and not split_log2, ACT=act_code(activation),
        HAS_BIAS=weights.b13 is not None, WEIGHT_ON_INPUT=weight_on_input, ZERO_BLOCK=_ZERO_BLOCK, PDL=pdl,
        EVEN=f % cfg.block_n1 == 0, STAGES=cfg.stages, FMT=fmt,
        num_warps=cfg.num_warps, launch_pdl=pdl,
    )
    _decode_down_kernel[grid2](
        h, topk_slots, topk_weights, w2, s2, b2, y, count, out, t, k, n, s, d, f, f // INT4_PACK,
        w2.stride(0), w2.stride(1), s2.stride(0), s2.stride(1), out.stride(0),
        BLOCK_N=cfg.block_n2, BLOCK_KW=cfg.block_kw2, GW=gw, K_PAD=triton.next_power_of_2(k),
        N_PAD=n_pad, GROUPS=grid2[1], ONE_PAIR=grid2[1] == n, HAS_BIAS=weights.b2 is not None,
        WEIGHT_ON_INPUT=weight_on_input, PDL=pdl, EVEN=d % cfg.block_n2 == 0,
        STAGES=cfg.stages, FMT=fmt, num_warps=cfg.num_warps, launch_pdl=pdl,
    )
    return out


