"""W4A16 expert compute in Triton for INT4 group-quantized weights (``experts.int4``), bf16 activations.

The weights stay packed in HBM (a quarter of the bf16 bytes plus one scale per ``G`` inputs). Four paths, all
with static grids and no host synchronisation (CUDA-graph safe); ``int4_experts`` picks one from the number of
pairs ``N = T * K``, the activations' dtype and the local slots (``int4_path``; the switch points are set from the
H200 benchmark): for bf16 the tensor-core kernels of ``w4a16_mma`` (the words widened into the MMA registers) and
on Hopper, at prefill sizes, those of ``w4a16_wgmma`` (widened into the A operand of the warpgroup MMA), and the three
below:

Decode (``int4_decode_experts``): one matrix-vector product per (token, k) pair on the CUDA cores, reading the
packed weights directly, in three launches with the structure of the bf16 decode kernels (``decode``: live pairs
numbered on the device and shared among ``Int4DecodeConfig.max_programs // column tiles`` pair groups, register
double buffering of the weight tiles, programmatic dependent launches on Hopper, the sum over ``K`` fused into the
down kernel by arrival counters).

Layout. Every thread owns whole int32 words, never a part of one: a program's weight tile is
``[BLOCK_KW / GW, R, GW]`` words (groups of ``G`` inputs, ``R`` rows, the ``GW = G / 8`` words of a group), the
``GW`` words of a group in one thread (one 16-byte load for ``G = 32``); the gate/up kernel's tile holds its
``BLOCK_N`` gate rows and the same ``BLOCK_N`` up rows (``R = 2 BLOCK_N``), the down kernel's its ``BLOCK_N``
rows. The vector ``v`` (``x`` or ``h``) is read from a de-interleaved, pre-scaled copy ``vt`` (bf16 for bf16 rows,
``Int4DecodeConfig.bf16_inputs``; float32 otherwise): within each group of ``G`` inputs, input ``j`` of the
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
   pairs (``Int4DecodeConfig.split_max``) the groups split each pair's reduction over ``D`` instead: each
   split stores its partial sums and takes a ticket from its tile's counter, and the last sums the partials in
   split order before the epilogue (the threadfence-reduction pattern of the CUDA samples).
3. ``_decode_down_kernel``, grid ``(cdiv(D, BLOCK_N2), groups)``: the same over ``w2`` and ``h``, ``y [N, D]``
   float32; the last program to arrive for column tile ``j`` sums it over each token's ``K`` pairs in a fixed
   order into ``out`` (bitwise reproducible).

On Hopper (``Int4DecodeConfig.pdl``) steps 2 and 3 are programmatic dependent launches: each requests its
first weight tiles before waiting (``griddepcontrol.wait``) for the previous launch's output.

Every pair re-reads its expert's weights, so the decode path's cost grows with the pairs; the other paths' grow
with the local slots in use:

Fused grouped (``int4_grouped_experts``): the grouped kernels of ``grouped`` (alignment of the pairs to row blocks
of one slot, gate/up and down GEMMs on the tensor cores, ``sum_pairs_kernel``) with the INT4 word tiles widened in
registers, one ``tl.dot`` per nibble of a step (the nibble-split product of ``w4a16``), the activations read from a
nibble-major copy; a slot's packed weights are read once per row block. Tile shapes from
``grouped.default_int4_config``.

Dequantized (``int4_dequantized_experts``): the slots that have at least one live pair are widened to the
compute dtype in one launch (``_dequantize_kernel``: one read of their packed weights, one
write of the widened ones, into a workspace the size of the bf16 experts; slots without pairs are skipped),
then ``grouped.triton_experts`` runs the grouped bf16 GEMMs on them. The weights are stored in INT4; this
path computes as the bf16 one does, plus the widening (kept beside the fused path for the benchmark's comparison).

Source: the packed format is compressed-tensors' ``pack-quantized`` (see ``experts.int4``); splitting the
widening from the GEMM for large batches is what vLLM's compressed-tensors MoE does where no fused W4A16 GEMM
applies; widening a nibble by reading its bits as a float's mantissa is the trick of the W4A16 GPU kernels
(FasterTransformer, Marlin: Frantar et al., "MARLIN: Mixed-Precision Auto-Regressive Parallel Inference on Large
Language Models", 2024; there OR-ed into the mantissa of a float constant that is then subtracted), here as a
float32 subnormal with the nibble left in place. The code is our own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from epmoe.experts.int4 import INT4_PACK, Int4ExpertWeights
from epmoe.experts.triton.decode import (
    DECODE_MAX_PAIRS,
    gated_h,
    live_pair,
    live_pairs,
    pair_grid,
    sum_pairs_on_arrival,
    zero_arrival_counters,
)
from epmoe.experts.triton.grouped import TileConfig, act_code, default_int4_config, grouped_experts, triton_experts
from epmoe.experts.triton.pdl import pdl_launch
from epmoe.experts.triton.w4a16_mma import default_mma_config, packed_mma_experts
from epmoe.experts.triton.w4a16_wgmma import default_wgmma_config, packed_wgmma_experts
from epmoe.experts.weights import Activation, ExpertWeights, check_expert_call

_ZERO_BLOCK = 1024

INT4_DECODE_MAX_PAIRS = DECODE_MAX_PAIRS
"""``int4_experts`` takes the decode kernels for up to this many ``(token, k)`` pairs ``N = T * K`` (static: no look
at the routing), the fused grouped path above. Set from the H200 run of ``benchmarks/moe_layer.py --cases
kimi_int4,kimi_full_int4`` (columns ``int4_decode`` against ``int4_grouped``)."""

INT4_DECODE_MAX_BF16_PAIRS = 8
"""With bf16 activations, ``int4_experts`` takes the decode kernels up to this many expected pairs, the MMA path from
there on: each live pair costs the decode kernels one read of its expert's weights, while the MMA path starts higher
(its alignment launch and counters) and grows with the slots touched. Set from the H200 run of 2026-12-03
(``benchmarks/moe_layer.py --cases kimi_int4,kimi_full_int4 --sizes 1,2,4,8,64``, columns ``int4_decode`` against
``int4_mma``, ``benchmarks/results/moe_layer_int4_decode_1warp_h200.json``): faster at 1, 6 and 8 live pairs, slower
at 9 and 16; 8 expected pairs were 8 live on all 384 experts (decode 8% faster) and 9 on the EP-8 shard (5% slower):
the threshold favours the one-token step of a model whose experts are all local. The expected pairs are an estimate:
a step whose routing sends more pairs to this rank pays one weight read per live pair."""

INT4_DEQUANT_MIN_PAIRS: int | None = None
"""``int4_experts`` takes the widening path (``int4_dequantized_experts``) from this many pairs on; ``None``: never
(the fused grouped path for every batch above ``INT4_DECODE_MAX_PAIRS``). Set from the same H200 run (column
``int4_dequant`` against ``int4_grouped``)."""


@dataclass(frozen=True)
class Int4DecodeConfig:
    """Tile shapes of the INT4 decode kernels (all sizes powers of two; see the module docstring's layout). The
    defaults (one warp a program, 128 words a step, each thread one group of eight rows: the step's inputs are loaded
    in the word tile's own layout and serve eight rows) were the fastest per layer inside a graph of several layers
    of twelve tile shapes timed on the H200 for Kimi-K2.5's experts at one token (``G = 32``; a one-off probe), and
    within 1% of the fastest alone (three stages) in ``benchmarks/moe_layer.py --sweep``, which times the
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
def _deinterleave_kernel(x_ptr, xt_ptr, count_ptr, num_counters, DW, stride_x, GW: tl.constexpr,
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
    tl.store(xt_ptr + t * 8 * DW + dest, (v * _nibble_scale(offs_j)[None, :]).to(xt_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _gate_up_rows(pid_n, F, BLOCK_N: tl.constexpr):
    """The ``2 * BLOCK_N`` weight rows of gate/up program ``pid_n`` and which are in range: its ``BLOCK_N`` gate rows,
    then the same ``BLOCK_N`` up rows (``F`` further); one tile, so that a thread's inputs serve the gate and up rows
    it holds alike."""
    r = tl.arange(0, 2 * BLOCK_N)
    n = pid_n * BLOCK_N + r % BLOCK_N
    return n + (r // BLOCK_N) * F, n < F


@triton.jit
def _gate_up_sums(
    xt_ptr, w_ptr, s_ptr, token, slot, w, w1, kw_begin, KW, DW, stride_we, stride_se, w_rows, s_rows, rows_ok,
    offs_kw, offs_g, BLOCK_N: tl.constexpr, BLOCK_KW: tl.constexpr, GW: tl.constexpr, EVEN: tl.constexpr,
    STAGES: tl.constexpr,
):
    """The gate and up dot products ``[BLOCK_N]`` float32 of this program's rows (``_gate_up_rows``) over the ``KW``
    words from ``kw_begin`` (whole steps unless they end at ``DW``) for ``token``'s inputs, from the range's first two
    word tiles ``w``, ``w1`` already requested."""
    NG: tl.constexpr = BLOCK_KW // GW
    w_ptrs = w_ptr + slot * stride_we + w_rows + kw_begin
    s_ptrs = s_ptr + slot * stride_se + s_rows + kw_begin // GW
    v_ptrs = xt_ptr + token.to(tl.int64) * 8 * DW + 8 * kw_begin + _input_tile(offs_g, GW)
    acc = tl.zeros((NG, 2 * BLOCK_N), dtype=tl.float32)
    for kw0 in range(0, KW, BLOCK_KW):
        # register buffering, STAGES - 1 steps ahead: the words of step k + STAGES - 1 are requested before step
        # k's are widened (Triton software-pipelines only loads that feed tl.dot)
        nxt = (offs_kw < KW - kw0 - (STAGES - 1) * BLOCK_KW)[:, None, :] & rows_ok[None, :, None]
        w2 = tl.load(w_ptrs + (STAGES - 1) * BLOCK_KW, mask=nxt, other=0)
        if EVEN:
            sc = tl.load(s_ptrs).to(tl.float32)
        else:
            sc = tl.load(s_ptrs, mask=(offs_g < (KW - kw0) // GW)[:, None] & rows_ok[None, :], other=0.0).to(tl.float32)
        acc += _group_dots(w, _load_inputs(v_ptrs, (offs_kw < KW - kw0)[:, None, :], GW, EVEN)) * sc
        if STAGES == 3:
            w = w1
            w1 = w2
        else:
            w = w2
        w_ptrs += BLOCK_KW
        s_ptrs += NG
        v_ptrs += 8 * BLOCK_KW
    sums = tl.sum(acc, axis=0) * 1.2089258196146292e+24  # 2 ** 80: _group_dots' scale undone
    return tl.split(tl.permute(tl.reshape(sums, [2, BLOCK_N]), [1, 0]))


@triton.jit
def _gate_up_finish(
    tw_ptr, b_ptr, h_ptr, pair, slot, gs, us, F, act_limit, act_alpha, offs_n, GW: tl.constexpr, ACT: tl.constexpr,
    HAS_BIAS: tl.constexpr, WEIGHT_ON_INPUT: tl.constexpr,
):
    """A pair's ``h`` for this program's rows ``offs_n`` from their whole gate and up sums: bias, routing weight, the
    gated activation, stored in the layout of ``xt`` (for the down kernel)."""
    n_ok = offs_n < F
    h = gated_h(tw_ptr, b_ptr, pair, slot, gs, us, F, act_limit, act_alpha, offs_n, n_ok, ACT, HAS_BIAS,
                WEIGHT_ON_INPUT)
    tl.store(h_ptr + pair * F + _input_offsets(offs_n, GW), (h * _nibble_scale(offs_n % 8)).to(h_ptr.dtype.element_ty),
             mask=n_ok)


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
    EVEN: tl.constexpr, STAGES: tl.constexpr,
):
    pid_n = tl.program_id(0)
    group = tl.program_id(1)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
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
                                   w_rows, s_rows, rows_ok, offs_kw, offs_g, BLOCK_N, BLOCK_KW, GW, EVEN, STAGES)
            _gate_up_finish(tw_ptr, b_ptr, h_ptr, group, slot, gs, us, F, act_limit, act_alpha, offs_n, GW, ACT,
                            HAS_BIAS, WEIGHT_ON_INPUT)
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
                                       BLOCK_KW, GW, EVEN, STAGES)
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
                                    ACT, HAS_BIAS, WEIGHT_ON_INPUT)
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
                                           EVEN, STAGES)
                    more = i + PAIR_GROUPS < n_live
                    w, w1 = _first_tiles(w_ptr + next_slot * stride_we + w_rows, first & more, second & more,
                                         BLOCK_KW, STAGES)
                    _gate_up_finish(tw_ptr, b_ptr, h_ptr, pair, slot, gs, us, F, act_limit, act_alpha, offs_n, GW,
                                    ACT, HAS_BIAS, WEIGHT_ON_INPUT)
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
):
    """``y`` of one pair for this program's columns from its first two word tiles ``w``, ``w1`` already requested;
    with ``PREFETCH`` returns the first two tiles of ``next_slot``."""
    NG: tl.constexpr = BLOCK_KW // GW
    w_ptrs = w_ptr + slot * stride_we + w_rows
    s_ptrs = s_ptr + slot * stride_se + s_rows
    v_ptrs = h_ptr + pair * F + _input_tile(offs_g, GW)
    acc = tl.zeros((NG, BLOCK_N), dtype=tl.float32)
    for kw0 in range(0, FW, BLOCK_KW):
        w2 = tl.load(w_ptrs + (STAGES - 1) * BLOCK_KW,
                     mask=(offs_kw < FW - kw0 - (STAGES - 1) * BLOCK_KW)[:, None, :] & n_ok[None, :, None], other=0)
        if EVEN:
            sc = tl.load(s_ptrs).to(tl.float32)
        else:
            sc = tl.load(s_ptrs, mask=(offs_g < (FW - kw0) // GW)[:, None] & n_ok[None, :], other=0.0).to(tl.float32)
        acc += _group_dots(w, _load_inputs(v_ptrs, (offs_kw < FW - kw0)[:, None, :], GW, EVEN)) * sc
        if STAGES == 3:
            w = w1
            w1 = w2
        else:
            w = w2
        w_ptrs += BLOCK_KW
        s_ptrs += NG
        v_ptrs += 8 * BLOCK_KW
    if PREFETCH:
        w, w1 = _first_tiles(w_ptr + next_slot * stride_we + w_rows, first & more, second & more, BLOCK_KW, STAGES)
    y = tl.sum(acc, axis=0) * 1.2089258196146292e+24  # 2 ** 80: _group_dots' scale undone
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
    PDL: tl.constexpr, EVEN: tl.constexpr, STAGES: tl.constexpr,
):
    pid_n = tl.program_id(0)
    group = tl.program_id(1)
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
                       HAS_BIAS, WEIGHT_ON_INPUT, False, EVEN, STAGES)
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
                               EVEN, STAGES)
            pair = next_pair
            slot = next_slot
    sum_pairs_on_arrival(slots_ptr, y_ptr, count_ptr, out_ptr, pid_n, num_tokens, top_k, num_slots, D, stride_o,
                         offs_n, n_ok, K_PAD, GROUPS)


def _is_pow2(v: int) -> bool:
    return v > 0 and v & (v - 1) == 0


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
        config: tile shapes; ``Int4DecodeConfig()`` when ``None`` (``benchmarks/moe_layer.py --sweep`` times
            the alternatives in ``INT4_DECODE_SWEEP``).

    Returns:
        ``[T, D]`` in ``x.dtype``.

    Raises:
        ValueError: operands of other shapes or layouts than ``experts.weights.check_expert_call`` takes.
        ValueError: a step (``8 * block_kw``) that is not a multiple of the group size, a tile size that is not
            a power of two, or ``stages`` not 2 or 3.
    """
    check_expert_call(x, topk_slots, topk_weights, weights.hidden_size)
    cfg = config if config is not None else Int4DecodeConfig()
    t, k = topk_slots.shape
    n = t * k
    g = weights.group_size
    if (INT4_PACK * cfg.block_kw1) % g or (INT4_PACK * cfg.block_kw2) % g:
        raise ValueError(f"8 * block_kw1 and 8 * block_kw2 must be multiples of the group size {g}, got {cfg}")
    for name in ("block_n1", "block_kw1", "block_n2", "block_kw2"):
        if not _is_pow2(getattr(cfg, name)):
            raise ValueError(f"Int4DecodeConfig.{name} must be a power of two, got {getattr(cfg, name)!r}")
    if cfg.stages not in (2, 3):
        raise ValueError(f"stages must be 2 or 3, got {cfg.stages}")
    if not _is_pow2(cfg.split_max):
        raise ValueError(f"Int4DecodeConfig.split_max must be a power of two, got {cfg.split_max!r}")
    s, d, f = weights.num_slots, weights.hidden_size, weights.intermediate_size
    w13, s13, w2, s2 = weights.w13_packed, weights.w13_scale, weights.w2_packed, weights.w2_scale
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
    gw = g // INT4_PACK
    pdl = cfg.pdl and pdl_launch(x)
    block_w = min(512, triton.next_power_of_2(dw))
    _deinterleave_kernel[(t, triton.cdiv(dw, block_w))](x, xt, split_count, split_count.numel() if split_log2 else 0,
                                                          dw, x.stride(0), GW=gw, BLOCK_W=block_w,
                                                          ZERO_BLOCK=_ZERO_BLOCK, PDL=pdl)
    _decode_gate_up_kernel[(tiles1, groups1)](
        xt, topk_slots, topk_weights, w13, s13, b13, h, count, split_ws, split_count, n, s, k, grid2[0], f, dw,
        w13.stride(0), w13.stride(1), s13.stride(0), s13.stride(1), float(limit), float(activation.swiglu_alpha),
        BLOCK_N=cfg.block_n1, BLOCK_KW=cfg.block_kw1, GW=gw, N_PAD=n_pad, GROUPS=groups1, PAIR_GROUPS=pair_groups,
        SPLIT_LOG2=split_log2, ONE_PAIR=groups1 == n and not split_log2, ACT=act_code(activation),
        HAS_BIAS=weights.b13 is not None, WEIGHT_ON_INPUT=weight_on_input, ZERO_BLOCK=_ZERO_BLOCK, PDL=pdl,
        EVEN=dw % cfg.block_kw1 == 0 and f % cfg.block_n1 == 0, STAGES=cfg.stages, num_warps=cfg.num_warps,
        launch_pdl=pdl,
    )
    _decode_down_kernel[grid2](
        h, topk_slots, topk_weights, w2, s2, b2, y, count, out, t, k, n, s, d, f, f // INT4_PACK,
        w2.stride(0), w2.stride(1), s2.stride(0), s2.stride(1), out.stride(0),
        BLOCK_N=cfg.block_n2, BLOCK_KW=cfg.block_kw2, GW=gw, K_PAD=triton.next_power_of_2(k),
        N_PAD=n_pad, GROUPS=grid2[1], ONE_PAIR=grid2[1] == n, HAS_BIAS=weights.b2 is not None,
        WEIGHT_ON_INPUT=weight_on_input, PDL=pdl, EVEN=f // INT4_PACK % cfg.block_kw2 == 0 and d % cfg.block_n2 == 0,
        STAGES=cfg.stages, num_warps=cfg.num_warps, launch_pdl=pdl,
    )
    return out


def int4_dequantized_experts(
    x: torch.Tensor,
    topk_slots: torch.Tensor,
    topk_weights: torch.Tensor,
    weights: Int4ExpertWeights,
    activation: Activation,
    weight_on_input: bool = False,
    *,
    expected_pairs: int | None = None,
) -> torch.Tensor:
    """INT4 expert compute for many pairs: the slots with live pairs widened to ``x.dtype`` in one launch, then
    ``grouped.triton_experts`` (given ``expected_pairs``; see the module docstring). Arguments and result as
    ``int4_decode_experts`` (``x`` bf16/fp16); needs a workspace of ``S * 3 * D * F`` elements of ``x.dtype``.

    Raises:
        ValueError: operands of other shapes than ``experts.weights.check_expert_call`` takes.
    """
    check_expert_call(x, topk_slots, topk_weights, weights.hidden_size, as_read=False)
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
    return triton_experts(x, topk_slots, topk_weights, ExpertWeights(w13, w2, b13, b2), activation, weight_on_input,
                          expected_pairs=expected_pairs)


INT4_WGMMA_MIN_PAIRS_PER_SLOT = 16
"""``int4_path`` takes the wgmma kernels (``w4a16_wgmma``, Hopper only) from this many ``(token, k)`` pairs per local
slot on average, the MMA path below. Set from the H200 run of ``benchmarks/int4_prefill.py --sizes
512,1024,2048,4096`` (Kimi-K2.5's shard and all 384 experts): the MMA path was 10-19% faster at 11 pairs a slot, the
wgmma kernels with 64-row blocks and 32-row tails 25% faster at 21."""


def int4_path(num_pairs: int, dtype: torch.dtype, num_slots: int, hopper: bool = False) -> str:
    """The path ``int4_experts`` takes for ``num_pairs`` pairs of activations in ``dtype`` over ``num_slots`` local
    slots on a GPU of compute capability 9.0 (``hopper``) or another: bf16 takes ``"decode"`` up to
    ``INT4_DECODE_MAX_BF16_PAIRS`` pairs, else on Hopper ``"wgmma"`` from ``INT4_WGMMA_MIN_PAIRS_PER_SLOT`` pairs a
    slot on, else ``"mma"`` (at every size: the H200 run of
    ``benchmarks/moe_layer.py --cases kimi_int4,kimi_full_int4``, column ``int4_mma`` against ``int4_grouped``); fp16
    takes ``"decode"`` up to ``INT4_DECODE_MAX_PAIRS``, else ``"dequant"`` (from ``INT4_DEQUANT_MIN_PAIRS`` on) or
    ``"grouped"``. ``num_pairs`` is the pairs expected (``int4_experts``' ``expected_pairs``), so the pairs a slot
    are ``num_pairs / num_slots``."""
    small = num_pairs <= INT4_DECODE_MAX_PAIRS
    if dtype == torch.bfloat16:
        if num_pairs <= INT4_DECODE_MAX_BF16_PAIRS:
            return "decode"
        return "wgmma" if hopper and num_pairs >= INT4_WGMMA_MIN_PAIRS_PER_SLOT * num_slots else "mma"
    if small:
        return "decode"
    if INT4_DEQUANT_MIN_PAIRS is not None and num_pairs >= INT4_DEQUANT_MIN_PAIRS:
        return "dequant"
    return "grouped"


def int4_grouped_experts(
    x: torch.Tensor,
    topk_slots: torch.Tensor,
    topk_weights: torch.Tensor,
    weights: Int4ExpertWeights,
    activation: Activation,
    weight_on_input: bool = False,
    config: TileConfig | None = None,
) -> torch.Tensor:
    """INT4 expert compute by the grouped kernels of ``grouped`` with the weights widened in registers (``w4a16``):
    the pairs aligned to row blocks of one slot, each block's products on the tensor cores, reading the packed
    weights once per row block (see the module docstring).

    Args:
        x: ``[T, D]`` bf16/fp16 (or float32) rows, contiguous along ``D``.
        topk_slots: ``[T, K]`` int64 local slot ids; an id outside ``[0, S)`` (``-1``) skips.
        topk_weights: ``[T, K]`` float routing weights.
        weights: the packed weights (contiguous).
        activation: the gated activation.
        weight_on_input: scale the expert input by the weight instead of its output.
        config: tile shapes (``block_k`` in inputs); ``grouped.default_int4_config`` when ``None``.

    Returns:
        ``[T, D]`` in ``x.dtype``.

    Raises:
        ValueError: operands of other shapes than ``experts.weights.check_expert_call`` takes.
        ValueError: ``config.block_k`` not a power of two of at least 128.
    """
    check_expert_call(x, topk_slots, topk_weights, weights.hidden_size, as_read=False)
    t, k = topk_slots.shape
    if t * k == 0:  # no pair: no expert adds to any row
        return torch.zeros(t, weights.hidden_size, dtype=x.dtype, device=x.device)
    cfg = config if config is not None else default_int4_config(t * k, weights.num_slots)
    if x.stride(1) != 1:
        x = x.contiguous()
    return grouped_experts(x, topk_slots.contiguous(), topk_weights.float().contiguous(), weights, activation,
                           weight_on_input, cfg)


def int4_experts(
    x: torch.Tensor,
    topk_slots: torch.Tensor,
    topk_weights: torch.Tensor,
    weights: Int4ExpertWeights,
    activation: Activation,
    weight_on_input: bool = False,
    *,
    expected_pairs: int | None = None,
) -> torch.Tensor:
    """INT4 expert compute on CUDA (contract of ``experts.ExpertBackend``); graph safe.

    The path is ``int4_path(T * K, x.dtype, S, hopper)``: the decode kernels for a few pairs (each pair reads its
    expert's weights: the cost grows with the live pairs), the tensor-core kernels of ``w4a16_mma`` for bf16 (the words
    widened into the MMA registers, one read and widening of a slot's words per 16-row block, one MMA per 8 of its
    rows), on Hopper from ``INT4_WGMMA_MIN_PAIRS_PER_SLOT`` pairs a slot those of
    ``w4a16_wgmma`` (``default_wgmma_config`` picks the rows a block), for fp16 the fused grouped kernels (``tl.dot`` on
    widened tiles), the widening path from ``INT4_DEQUANT_MIN_PAIRS`` on where that is set.
    ``N`` is ``expected_pairs`` (``ExpertBackend``), ``T * K`` when ``None`` (static: no look at the routing).

    Raises:
        ValueError: operands of other shapes than ``experts.weights.check_expert_call`` takes.
        TypeError: ``x`` not bf16/fp16.
    """
    check_expert_call(x, topk_slots, topk_weights, weights.hidden_size, as_read=False)
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"the INT4 expert kernels compute in bf16 or fp16, got x of dtype {x.dtype}")
    t, k = topk_slots.shape
    if t * k == 0:  # no pair: no expert adds to any row
        return torch.zeros(t, weights.hidden_size, dtype=x.dtype, device=x.device)
    if x.stride(1) != 1:
        x = x.contiguous()
    slots = topk_slots.contiguous()
    tw = topk_weights.float().contiguous()
    n, s, g = t * k if expected_pairs is None else expected_pairs, weights.num_slots, weights.group_size
    path = int4_path(n, x.dtype, s, x.is_cuda and torch.cuda.get_device_capability(x.device) == (9, 0))
    if path == "wgmma":
        return packed_wgmma_experts(x, slots, tw, weights, activation, weight_on_input, default_wgmma_config(g, n, s))
    if path == "mma":
        return packed_mma_experts(x, slots, tw, weights, activation, weight_on_input, default_mma_config(g, n, s))
    if path == "decode":
        return int4_decode_experts(x, slots, tw, weights, activation, weight_on_input)
    if path == "dequant":
        return int4_dequantized_experts(x, slots, tw, weights, activation, weight_on_input, expected_pairs=n)
    return int4_grouped_experts(x, slots, tw, weights, activation, weight_on_input, default_int4_config(n, s))


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
