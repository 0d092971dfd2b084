"""W4A16 decode kernels (``packed_decode_experts``) for INT4 (``experts.int4``) and MXFP4 (``experts.mxfp4``) expert
weights as stored: one matrix-vector product per (token, k) pair on the CUDA cores, reading the
packed weights directly, in three launches with the structure of the bf16 decode kernels (``decode``: live pairs
numbered on the device and shared among ``PackedDecodeConfig.max_programs // column tiles`` pair groups, register
double buffering of the weight tiles, programmatic dependent launches on Hopper, the sum over ``K`` fused into the
down kernel by arrival counters).

The tile layout and the widening of the codes in registers (INT4 nibbles read as float32 subnormals, MXFP4's E2M1
codes through fp16), with their sources, are ``w4a16_dots``'s; this module holds the launches.

1. ``_deinterleave_kernel``, grid ``(T, cdiv(D / 8, BLOCK_W))``: ``x [T, D]`` -> ``xt [T, D]`` in ``w4a16_dots``'s
   layout; program ``(0, 0)`` zeroes the gate/up launch's split counters.
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
from epmoe.experts.triton.w4a16 import row_strides
from epmoe.experts.triton.w4a16_dots import (
    FMT_INT4,
    FMT_MXFP4,
    FMT_MXFP4_PTX,
    first_tiles,
    input_offsets,
    input_scale,
    input_tile,
    range_dots,
    row_tile,
    tile_masks,
    unscale,
)
from epmoe.experts.weights import Activation, check_expert_call

_ZERO_BLOCK = 1024


@dataclass(frozen=True)
class PackedDecodeConfig:
    """Tile shapes of the INT4 and MXFP4 decode kernels (all sizes powers of two; see ``w4a16_dots``'s layout).
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
    dest = input_offsets(offs_w[:, None] * 8 + offs_j[None, :], GW)
    tl.store(xt_ptr + t * 8 * DW + dest, (v * input_scale(offs_j, FMT)[None, :]).to(xt_ptr.dtype.element_ty), mask=ok)


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
    STAGES: tl.constexpr, FMT: tl.constexpr,
):
    """The gate and up dot products ``[BLOCK_N]`` float32 of this program's rows (``_gate_up_rows``) over the ``KW``
    words from ``kw_begin`` (whole steps unless they end at ``DW``) for ``token``'s inputs, from the range's first two
    word tiles ``w``, ``w1`` already requested."""
    w_ptrs = w_ptr + slot * stride_we + w_rows + kw_begin
    s_ptrs = s_ptr + slot * stride_se + s_rows + kw_begin // GW
    v_ptrs = xt_ptr + token.to(tl.int64) * 8 * DW + 8 * kw_begin + input_tile(offs_g, GW)
    acc, w, w1 = range_dots(w, w1, w_ptrs, s_ptrs, v_ptrs, KW, offs_kw, offs_g, rows_ok, BLOCK_KW, GW, EVEN, STAGES,
                             FMT)
    sums = unscale(tl.sum(acc, axis=0), FMT)
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
    hs = h * input_scale(offs_n % 8, FMT)
    tl.store(h_ptr + pair * F + input_offsets(offs_n, GW), hs.to(h_ptr.dtype.element_ty), mask=n_ok)


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
    offs_g, offs_kw, w_rows, s_rows, first, second = row_tile(rows, rows_ok, DW, stride_wn, stride_sn, BLOCK_KW, GW)
    # slots and weights were complete before the launch chain began (the de-interleave launch before this one is an
    # ordinary launch): request the first words before the wait. Every program waits, also one without a pair, so
    # that this launch ends only after the de-interleave launch has.
    if ONE_PAIR:
        slot = tl.load(slots_ptr + group)
        live = (slot >= 0) & (slot < num_slots)
        slot = tl.where(live, slot, 0).to(tl.int64)
        w, w1 = first_tiles(w_ptr + slot * stride_we + w_rows, first & live, second & live, BLOCK_KW, STAGES)
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
            f1, f2 = tile_masks(offs_kw, rows_ok & mine, kw_len, BLOCK_KW)
            w, w1 = first_tiles(w_ptr + slot * stride_we + w_rows + kw_begin, f1, f2, BLOCK_KW, STAGES)
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
            w, w1 = first_tiles(w_ptr + slot * stride_we + w_rows, first & any_pair, second & any_pair, BLOCK_KW,
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
                    w, w1 = first_tiles(w_ptr + next_slot * stride_we + w_rows, first & more, second & more,
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
    v_ptrs = h_ptr + pair * F + input_tile(offs_g, GW)
    acc, w, w1 = range_dots(w, w1, w_ptrs, s_ptrs, v_ptrs, FW, offs_kw, offs_g, n_ok, BLOCK_KW, GW, EVEN, STAGES,
                             FMT)
    if PREFETCH:
        w, w1 = first_tiles(w_ptr + next_slot * stride_we + w_rows, first & more, second & more, BLOCK_KW, STAGES)
    y = unscale(tl.sum(acc, axis=0), FMT)
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
    offs_g, offs_kw, w_rows, s_rows, first, second = row_tile(offs_n, n_ok, FW, stride_wn, stride_sn, BLOCK_KW, GW)
    if ONE_PAIR:
        slot = tl.load(slots_ptr + group)
        live = (slot >= 0) & (slot < num_slots)
        slot = tl.where(live, slot, 0).to(tl.int64)
        w, w1 = first_tiles(w_ptr + slot * stride_we + w_rows, first & live, second & live, BLOCK_KW, STAGES)
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
        w, w1 = first_tiles(w_ptr + slot * stride_we + w_rows, first & any_pair, second & any_pair, BLOCK_KW, STAGES)
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
