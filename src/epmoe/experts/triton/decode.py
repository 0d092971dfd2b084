"""Decode-size expert compute in Triton: two launches, no alignment, every SM streaming weights.

For a handful of (token, k) pairs (``N = T * K <= DECODE_MAX_PAIRS``) the grouped GEMM of
``grouped`` wastes most of its time outside the weight stream: an alignment launch, row blocks of 16
for one row, a separate sum launch, and too few programs to keep 132 SMs reading one expert. Here each
pair is its own matrix-vector product and the work is cut along the output columns only:

The live pairs (slot in ``[0, S)``; ``-1`` and any other id skip) are numbered in order on the device;
with ``G`` pair groups, program ``(j, g)`` of a launch computes column tile ``j`` of live pairs
``g, g + G, g + 2G, ...``.
``G = min(N, max_programs // tiles)`` (``DecodeConfig.max_programs``): a layer with all pairs local
(Qwen3-30B-A3B on one GPU, 8 pairs x 96 tiles) gets one group per pair as before, while an expert-parallel
shard whose pairs are mostly served on other ranks (a DeepSeek-V3 EP8 shard: 8 pairs, about one local,
512 tiles) launches 2 groups instead of 8 programs per tile, most of which would only exit.

1. ``_decode_gate_up_kernel``, grid ``(cdiv(F, BLOCK_N1), G)``: for each of its pairs, program
   ``(j, g)`` reads the ``BLOCK_N1`` gate rows and ``BLOCK_N1`` up rows of the pair's expert (full ``D``
   length, so every row read is contiguous), applies bias, routing weight (weight on input) and the
   gated activation, and writes ``h [N, F]`` float32, already multiplied by the routing weight when
   the weight goes on the output. Program ``(0, 0)`` also zeroes the arrival counters of step 2 (safe:
   step 2 reads them only after step 1 has ended).
2. ``_decode_down_kernel``, grid ``(cdiv(D, BLOCK_N2), G)``: for each of its pairs, program ``(j, g)``
   reads ``BLOCK_N2`` rows of the pair's ``w2`` (full ``F`` length) and writes ``y [N, D]`` float32 for
   its columns, then takes a ticket from column tile ``j``'s arrival counter; the program that arrives
   last for tile ``j`` sums that tile over each token's ``K`` pairs in a fixed order and writes ``out``
   (the threadfence-reduction pattern of the CUDA samples; no float atomics, so results are bitwise
   reproducible).

Both kernels keep two weight tiles in flight per program by register double buffering (tile ``k + 1``
is requested before tile ``k`` is reduced, and the next pair's first tile before the last tile of this
pair; Triton software-pipelines only loads that feed ``tl.dot``).
On Hopper both kernels are programmatic dependent launches (``DecodeConfig.pdl``). Step 1's programs are placed
while the kernel before it (the router) runs and wait (``griddepcontrol.wait``) for it before reading anything;
then they allow step 2, whose programs are placed while step 1's last programs run, request their first ``w2`` tile
(the slots and weights are complete: step 1 allowed the launch only after its own wait) and only then wait for
step 1's ``h``; this hides the launch gaps. The down launch lets the next kernel (the next
layer's norm, itself a dependent launch) be placed at its start. The decode kernels read weights with the
evict-first policy (each is read once a step).

No host synchronisation and static grids: CUDA-graph safe. Block FP8 weights are read as
float8_e4m3fn (half the bytes) and widened in registers; the 128x128 block scale is folded into the
vector (``x`` or ``h``) since all rows of a program share one scale row (``BLOCK_N`` divides 128).

Floor at one token: the active experts' weight bytes over HBM bandwidth (Qwen3-30B-A3B: 8 x 9.4 MB,
17.8 us at 4.25 TB/s; DeepSeek-V3 shard: 1 x 88 MB, 20.7 us).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from epmoe.experts.fp8 import FP8_BLOCK, BlockFP8ExpertWeights, kernel_operands
from epmoe.experts.triton.pdl import pdl_launch
from epmoe.experts.weights import DECODE_MAX_PAIRS, Activation, ExpertWeights, check_expert_call

_ZERO_BLOCK = 1024
_TILE_BYTES = 8192


@dataclass(frozen=True)
class DecodeConfig:
    """Tile shapes of the two decode kernels.

    Attributes:
        block_n1: gate (and up) rows per gate/up program; divides 128 for FP8 weights.
        block_k1: ``D`` elements per step of the gate/up program.
        block_n2: ``w2`` rows (output columns) per down program; divides 128 for FP8 weights.
        block_k2: ``F`` elements per step of the down program.
        num_warps: warps per program.
        pdl: launch both kernels as programmatic dependent launches (Hopper): the gate/up programs are
            placed while the kernel before runs and wait for it; the down programs start while the gate/up
            launch's last programs run, read their first ``w2`` tile, and wait (``griddepcontrol.wait``) only
            before reading ``h``. Taken only where ``pdl.pdl_launch`` allows it
            (compute capability 9.0 or later, ``EPMOE_PDL`` not 0).
        max_programs: programs per launch, at most (and at least one pair group): the live pairs are
            shared among ``max_programs // column tiles`` pair groups per column tile (see the module
            docstring), so a layer whose pairs are mostly on other ranks does not launch idle programs.
    """

    block_n1: int = 8
    block_k1: int = 512
    block_n2: int = 32
    block_k2: int = 256
    num_warps: int = 4
    pdl: bool = True
    max_programs: int = 1024


def default_decode_config(d: int, f: int, weight_bytes: int) -> DecodeConfig:
    """Tile shapes from the expert's size and the weight element size (static: no look at the routing).

    Each loop step reads ``_TILE_BYTES`` (8 KB) of weights per program (gate and up together), so that
    with the register double buffering each program has 16 KB in flight and several programs per SM
    cover the ~50 KB an SM needs at full HBM bandwidth. Large experts (``F >= 1536`` / ``D >= 4096``,
    DeepSeek-V3) get half as many rows per program, so that one active expert alone still spreads
    over about four programs per SM. Chosen from the H200 sweep of ``benchmarks/moe_layer.py``:
    Qwen3-30B-A3B (D 2048, F 768) best at ``(8, 256, 32, 128)``, DeepSeek-V3 (D 7168, F 2048) at
    ``(4, 512, 16, 256)``.

    Args:
        d: hidden size ``D``.
        f: expert intermediate size ``F``.
        weight_bytes: bytes per weight element (2 for bf16/fp16, 1 for FP8).
    """
    block_n1 = 4 if f >= 1536 else 8
    block_n2 = 16 if d >= 4096 else 32
    return DecodeConfig(block_n1, _TILE_BYTES // (2 * block_n1 * weight_bytes), block_n2,
                        _TILE_BYTES // (block_n2 * weight_bytes), 4, True, 1024)


@triton.jit
def gated_activation(g, u, act_limit, act_alpha, ACT: tl.constexpr):
    """``act(g) * u`` in float32 for the activation code ``ACT`` (0 silu, 1 gelu, 2 relu, 3 gpt-oss's
    clamped SwiGLU ``(clamp(u, -l, l) + 1) * g' * sigmoid(alpha * g')`` with ``g' = min(g, l)``); shared by
    the decode and grouped kernels."""
    if ACT == 0:
        h = g / (1.0 + tl.exp(-g)) * u
    elif ACT == 1:
        h = 0.5 * g * (1.0 + tl.erf(g * 0.7071067811865476)) * u
    elif ACT == 2:
        h = tl.maximum(g, 0.0) * u
    else:
        gc = tl.minimum(g, act_limit)
        uc = tl.minimum(tl.maximum(u, -act_limit), act_limit)
        h = (uc + 1.0) * (gc / (1.0 + tl.exp(-gc * act_alpha)))
    return h


@triton.jit
def gated_h(tw_ptr, b_ptr, pair, slot, g, u, F, act_limit, act_alpha, offs_n, n_ok, ACT: tl.constexpr,
            HAS_BIAS: tl.constexpr, WEIGHT_ON_INPUT: tl.constexpr):
    """A pair's ``h`` float32 for the rows ``offs_n`` of its expert from their whole gate and up sums ``g``, ``u``:
    the routing weight (on the input), the biases, the gated activation, the routing weight (on the output); shared
    by the decode kernels of every weight format."""
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
    return h


@triton.jit
def live_pair(idx, sl, live, rank, i):
    """Pair index and slot of the ``i``-th live pair (0 and 0 when there is none)."""
    sel = live & (rank == i)
    return tl.sum(tl.where(sel, idx, 0), 0), tl.sum(tl.where(sel, sl, 0), 0).to(tl.int64)


@triton.jit
def zero_arrival_counters(count_ptr, num_counters, ZERO_BLOCK: tl.constexpr):
    """Zero the down kernel's ``num_counters`` int32 arrival counters (``sum_pairs_on_arrival``); run by one program
    of the gate/up launch, which the down launch follows."""
    for i in range(0, num_counters, ZERO_BLOCK):
        zi = i + tl.arange(0, ZERO_BLOCK)
        tl.store(count_ptr + zi, tl.zeros([ZERO_BLOCK], dtype=tl.int32), mask=zi < num_counters)


@triton.jit
def sum_pairs_on_arrival(slots_ptr, y_ptr, count_ptr, out_ptr, pid_n, num_tokens, top_k, num_slots, D, stride_o,
                         offs_n, n_ok, K_PAD: tl.constexpr, GROUPS: tl.constexpr):
    """A down program's last act: take a ticket from column tile ``pid_n``'s arrival counter; the program that
    arrives last (of ``GROUPS``) sums the tile's ``y [N, D]`` float32 rows over each token's ``K`` live pairs, in
    a fixed order, into ``out`` (the threadfence-reduction pattern: no float atomics, bitwise reproducible)."""
    tl.debug_barrier()
    ticket = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel")
    if ticket == GROUPS - 1:
        offs_j = tl.arange(0, K_PAD)
        j_ok = offs_j < top_k
        for t in range(0, num_tokens):
            slj = tl.load(slots_ptr + t * top_k + offs_j, mask=j_ok, other=-1)
            yrows = (t * top_k + offs_j).to(tl.int64)
            v = tl.load(y_ptr + yrows[:, None] * D + offs_n[None, :],
                        mask=((slj >= 0) & (slj < num_slots))[:, None] & n_ok[None, :],
                        other=0.0, cache_modifier=".cg")
            tl.store(out_ptr + t * stride_o + offs_n, tl.sum(v, axis=0).to(out_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def live_pairs(slots_ptr, num_pairs, num_slots, N_PAD: tl.constexpr):
    """The pairs' slots ``[N_PAD]``, which are live (slot in ``[0, S)``), their rank among the live, how many."""
    idx = tl.arange(0, N_PAD)
    sl = tl.load(slots_ptr + idx, mask=idx < num_pairs, other=-1)
    live = (sl >= 0) & (sl < num_slots)
    return idx, sl, live, tl.cumsum(live.to(tl.int32), 0) - 1, tl.sum(live.to(tl.int32), 0)


@triton.jit
def _gate_up_pair(
    x_ptr, tw_ptr, w_ptr, ws_ptr, b_ptr, h_ptr, pair, slot, wg, wu, next_slot, more, pid_n, top_k, D, F,
    stride_x, stride_we, stride_wn, stride_se, stride_sn, act_limit, act_alpha, rows, offs_n, n_ok, offs_k, first,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ACT: tl.constexpr, FP8: tl.constexpr, HAS_BIAS: tl.constexpr,
    WEIGHT_ON_INPUT: tl.constexpr, PREFETCH: tl.constexpr,
):
    """``h`` of one pair for column tile ``pid_n``, from its first tiles ``wg``/``wu`` already requested;
    with ``PREFETCH`` returns the first tiles of ``next_slot`` (requested before this pair's epilogue)."""
    wg_ptrs = w_ptr + slot * stride_we + rows
    wu_ptrs = wg_ptrs + F * stride_wn
    x_ptrs = x_ptr + (pair // top_k).to(tl.int64) * stride_x + offs_k
    g = tl.zeros((BLOCK_N,), dtype=tl.float32)
    u = tl.zeros((BLOCK_N,), dtype=tl.float32)
    # register double buffering: tile k + 1 is requested before tile k is reduced (Triton pipelines only
    # loads that feed tl.dot), so two tiles per program are in flight.
    for k0 in range(0, D, BLOCK_K):
        k_ok = offs_k < D - k0
        nxt = n_ok[:, None] & (offs_k < D - k0 - BLOCK_K)[None, :]
        wg_next = tl.load(wg_ptrs + BLOCK_K, mask=nxt, other=0.0, eviction_policy="evict_first")
        wu_next = tl.load(wu_ptrs + BLOCK_K, mask=nxt, other=0.0, eviction_policy="evict_first")
        xk = tl.load(x_ptrs, mask=k_ok, other=0.0).to(tl.float32)
        if FP8:
            s_row = ws_ptr + slot * stride_se + (k0 + offs_k) // 128
            sg = tl.load(s_row + (pid_n * BLOCK_N // 128) * stride_sn, mask=k_ok, other=0.0)
            su = tl.load(s_row + ((F + pid_n * BLOCK_N) // 128) * stride_sn, mask=k_ok, other=0.0)
            g += tl.sum(wg.to(tl.float32) * (xk * sg)[None, :], axis=1)
            u += tl.sum(wu.to(tl.float32) * (xk * su)[None, :], axis=1)
        else:
            g += tl.sum(wg.to(tl.float32) * xk[None, :], axis=1)
            u += tl.sum(wu.to(tl.float32) * xk[None, :], axis=1)
        wg = wg_next
        wu = wu_next
        x_ptrs += BLOCK_K
        wg_ptrs += BLOCK_K
        wu_ptrs += BLOCK_K
    if PREFETCH:
        wg = tl.load(w_ptr + next_slot * stride_we + rows, mask=first & more, other=0.0,
                     eviction_policy="evict_first")
        wu = tl.load(w_ptr + next_slot * stride_we + F * stride_wn + rows, mask=first & more, other=0.0,
                     eviction_policy="evict_first")
    h = gated_h(tw_ptr, b_ptr, pair, slot, g, u, F, act_limit, act_alpha, offs_n, n_ok, ACT, HAS_BIAS,
                WEIGHT_ON_INPUT)
    tl.store(h_ptr + pair * F + offs_n, h, mask=n_ok)
    return wg, wu


@triton.jit
def _decode_gate_up_kernel(
    x_ptr, slots_ptr, tw_ptr, w_ptr, ws_ptr, b_ptr, h_ptr, count_ptr,
    num_pairs, num_slots, top_k, num_counters, D, F, stride_x, stride_we, stride_wn, stride_se, stride_sn, act_limit,
    act_alpha, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, N_PAD: tl.constexpr, GROUPS: tl.constexpr,
    ONE_PAIR: tl.constexpr, ACT: tl.constexpr, FP8: tl.constexpr, HAS_BIAS: tl.constexpr,
    WEIGHT_ON_INPUT: tl.constexpr,
    ZERO_BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    pid_n = tl.program_id(0)
    group = tl.program_id(1)
    if PDL:  # placed while the router runs; allows the down launch only once the router's slots are complete
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    if (pid_n == 0) & (group == 0):
        zero_arrival_counters(count_ptr, num_counters, ZERO_BLOCK)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < F
    offs_k = tl.arange(0, BLOCK_K)
    rows = offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    first = n_ok[:, None] & (offs_k < D)[None, :]
    if ONE_PAIR:
        # one group per pair (all pairs usually live): program (j, p) computes pair p, straight-line code
        slot = tl.load(slots_ptr + group)
        if (slot < 0) | (slot >= num_slots):
            return
        slot = slot.to(tl.int64)
        wg = tl.load(w_ptr + slot * stride_we + rows, mask=first, other=0.0,
                     eviction_policy="evict_first")
        wu = tl.load(w_ptr + slot * stride_we + F * stride_wn + rows, mask=first, other=0.0,
                     eviction_policy="evict_first")
        _gate_up_pair(x_ptr, tw_ptr, w_ptr, ws_ptr, b_ptr, h_ptr, group, slot, wg, wu, slot, False, pid_n, top_k,
                      D, F, stride_x, stride_we, stride_wn, stride_se, stride_sn, act_limit, act_alpha, rows, offs_n,
                      n_ok, offs_k, first, BLOCK_N, BLOCK_K, ACT, FP8, HAS_BIAS, WEIGHT_ON_INPUT, False)
    else:
        # live pairs group, group + GROUPS, ...; the next pair's first tiles are requested before this
        # pair's epilogue
        idx, sl, live, rank, n_live = live_pairs(slots_ptr, num_pairs, num_slots, N_PAD)
        pair, slot = live_pair(idx, sl, live, rank, group)
        wg = tl.load(w_ptr + slot * stride_we + rows, mask=first & (group < n_live), other=0.0,
                     eviction_policy="evict_first")
        wu = tl.load(w_ptr + slot * stride_we + F * stride_wn + rows, mask=first & (group < n_live), other=0.0,
                     eviction_policy="evict_first")
        for i in range(group, n_live, GROUPS):
            next_pair, next_slot = live_pair(idx, sl, live, rank, i + GROUPS)
            wg, wu = _gate_up_pair(x_ptr, tw_ptr, w_ptr, ws_ptr, b_ptr, h_ptr, pair, slot, wg, wu, next_slot,
                                   i + GROUPS < n_live, pid_n, top_k, D, F, stride_x, stride_we, stride_wn, stride_se,
                                   stride_sn, act_limit, act_alpha, rows, offs_n, n_ok, offs_k, first, BLOCK_N,
                                   BLOCK_K, ACT, FP8, HAS_BIAS, WEIGHT_ON_INPUT, True)
            pair = next_pair
            slot = next_slot


@triton.jit
def _down_pair(
    h_ptr, tw_ptr, w_ptr, ws_ptr, b_ptr, y_ptr, pair, slot, w, next_slot, more, pid_n, D, F,
    stride_we, stride_se, stride_sn, rows, offs_n, n_ok, offs_k, first,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FP8: tl.constexpr, HAS_BIAS: tl.constexpr,
    WEIGHT_ON_INPUT: tl.constexpr, PREFETCH: tl.constexpr,
):
    """``y`` of one pair for column tile ``pid_n`` from its first ``w2`` tile ``w`` already requested; with
    ``PREFETCH`` returns the first tile of ``next_slot``."""
    w_ptrs = w_ptr + slot * stride_we + rows
    h_ptrs = h_ptr + pair * F + offs_k
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, F, BLOCK_K):
        k_ok = offs_k < F - k0
        w_next = tl.load(w_ptrs + BLOCK_K, mask=n_ok[:, None] & (offs_k < F - k0 - BLOCK_K)[None, :], other=0.0,
                         eviction_policy="evict_first")
        hk = tl.load(h_ptrs, mask=k_ok, other=0.0)
        if FP8:
            sc = tl.load(ws_ptr + slot * stride_se + (pid_n * BLOCK_N // 128) * stride_sn + (k0 + offs_k) // 128,
                         mask=k_ok, other=0.0)
            hk *= sc
        acc += tl.sum(w.to(tl.float32) * hk[None, :], axis=1)
        w = w_next
        h_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if PREFETCH:
        w = tl.load(w_ptr + next_slot * stride_we + rows, mask=first & more, other=0.0)
    if HAS_BIAS:
        b = tl.load(b_ptr + slot * D + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        if not WEIGHT_ON_INPUT:
            b *= tl.load(tw_ptr + pair)
        acc += b
    tl.store(y_ptr + pair * D + offs_n, acc, mask=n_ok)
    return w


@triton.jit
def _decode_down_kernel(
    h_ptr, slots_ptr, tw_ptr, w_ptr, ws_ptr, b_ptr, y_ptr, count_ptr, out_ptr,
    num_tokens, top_k, num_pairs, num_slots, D, F, stride_we, stride_wn, stride_se, stride_sn, stride_o,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_PAD: tl.constexpr, N_PAD: tl.constexpr, GROUPS: tl.constexpr,
    ONE_PAIR: tl.constexpr, FP8: tl.constexpr, HAS_BIAS: tl.constexpr, WEIGHT_ON_INPUT: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:  # the next layer's norm may be placed while this launch runs (it waits for it)
        tl.extra.cuda.gdc_launch_dependents()
    pid_n = tl.program_id(0)
    group = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < D
    offs_k = tl.arange(0, BLOCK_K)
    rows = offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    first = n_ok[:, None] & (offs_k < F)[None, :]
    # slots and weights are complete once the gate/up launch allows this one (it does so after its own wait for the
    # router): read them before the wait.
    if ONE_PAIR:
        slot = tl.load(slots_ptr + group)
        live = (slot >= 0) & (slot < num_slots)
        slot = tl.where(live, slot, 0).to(tl.int64)
        w = tl.load(w_ptr + slot * stride_we + rows, mask=first & live, other=0.0, eviction_policy="evict_first")
        if PDL:
            tl.extra.cuda.gdc_wait()
        if live:
            _down_pair(h_ptr, tw_ptr, w_ptr, ws_ptr, b_ptr, y_ptr, group, slot, w, slot, False, pid_n, D, F,
                       stride_we, stride_se, stride_sn, rows, offs_n, n_ok, offs_k, first, BLOCK_N, BLOCK_K, FP8,
                       HAS_BIAS, WEIGHT_ON_INPUT, False)
    else:
        idx, sl, live, rank, n_live = live_pairs(slots_ptr, num_pairs, num_slots, N_PAD)
        pair, slot = live_pair(idx, sl, live, rank, group)
        w = tl.load(w_ptr + slot * stride_we + rows, mask=first & (group < n_live), other=0.0,
                    eviction_policy="evict_first")
        if PDL:
            tl.extra.cuda.gdc_wait()
        for i in range(group, n_live, GROUPS):
            next_pair, next_slot = live_pair(idx, sl, live, rank, i + GROUPS)
            w = _down_pair(h_ptr, tw_ptr, w_ptr, ws_ptr, b_ptr, y_ptr, pair, slot, w, next_slot, i + GROUPS < n_live,
                           pid_n, D, F, stride_we, stride_se, stride_sn, rows, offs_n, n_ok, offs_k, first, BLOCK_N,
                           BLOCK_K, FP8, HAS_BIAS, WEIGHT_ON_INPUT, True)
            pair = next_pair
            slot = next_slot
    sum_pairs_on_arrival(slots_ptr, y_ptr, count_ptr, out_ptr, pid_n, num_tokens, top_k, num_slots, D, stride_o,
                         offs_n, n_ok, K_PAD, GROUPS)


def pair_grid(tiles: int, num_pairs: int, max_programs: int) -> tuple[int, int]:
    """``(tiles, groups)``: as many pair groups as fit in ``max_programs`` programs, 1 to ``num_pairs``."""
    return tiles, max(1, min(num_pairs, max_programs // tiles))


def decode_experts(
    x: torch.Tensor,
    topk_slots: torch.Tensor,
    topk_weights: torch.Tensor,
    weights: ExpertWeights,
    act_code: int,
    activation: Activation,
    weight_on_input: bool = False,
    config: DecodeConfig | None = None,
) -> torch.Tensor:
    """Expert compute for ``T * K <= DECODE_MAX_PAIRS`` pairs in two launches (see the module docstring).

    Args:
        x: ``[T, D]`` bf16/fp16 rows (contiguous along ``D``).
        topk_slots: ``[T, K]`` int64 contiguous local slot ids; an id outside ``[0, S)`` (``-1``) skips.
        topk_weights: ``[T, K]`` float32 contiguous routing weights.
        weights: ``ExpertWeights`` in ``x.dtype`` (contiguous) or ``BlockFP8ExpertWeights``.
        act_code: the kernels' activation code (``grouped.act_code``).
        activation: the gated activation (its clamp limit and slope).
        weight_on_input: scale the expert input by the weight instead of its output.
        config: tile shapes; ``default_decode_config`` when ``None``.

    Returns:
        ``[T, D]`` in ``x.dtype``.

    Raises:
        ValueError: operands of other shapes or layouts than ``experts.weights.check_expert_call`` takes.
        ValueError: more than ``DECODE_MAX_PAIRS`` pairs, or FP8 weights with ``block_n1``/``block_n2``
            not dividing 128.
    """
    check_expert_call(x, topk_slots, topk_weights, weights.hidden_size)
    t, k = topk_slots.shape
    cfg = config if config is not None else default_decode_config(
        x.shape[1], weights.w2.shape[2], weights.w13.element_size())
    n = t * k
    if n > DECODE_MAX_PAIRS:
        raise ValueError(f"decode_experts takes at most {DECODE_MAX_PAIRS} (token, k) pairs, got {n}")
    fp8 = isinstance(weights, BlockFP8ExpertWeights)
    if fp8 and (FP8_BLOCK % cfg.block_n1 or FP8_BLOCK % cfg.block_n2):
        raise ValueError(f"block FP8 weights need block_n1 and block_n2 dividing {FP8_BLOCK}, got {cfg}")
    w13, w2 = weights.w13, weights.w2
    s, two_f, d = w13.shape
    f = two_f // 2
    dev = x.device
    h = torch.empty(n, f, dtype=torch.float32, device=dev)
    y = torch.empty(n, d, dtype=torch.float32, device=dev)
    grid1 = pair_grid(triton.cdiv(f, cfg.block_n1), n, cfg.max_programs)
    grid2 = pair_grid(triton.cdiv(d, cfg.block_n2), n, cfg.max_programs)
    n_pad = triton.next_power_of_2(n)
    count = torch.empty(grid2[0], dtype=torch.int32, device=dev)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    ops = kernel_operands(weights, topk_weights)
    limit = activation.swiglu_limit if activation.swiglu_limit is not None else 0.0
    pdl = cfg.pdl and pdl_launch(x)  # griddepcontrol needs compute capability 9.0
    _decode_gate_up_kernel[grid1](
        x, topk_slots, topk_weights, w13, ops.s13, ops.b13, h, count,
        n, s, k, grid2[0], d, f, x.stride(0), w13.stride(0), w13.stride(1), *ops.strides13,
        float(limit), float(activation.swiglu_alpha),
        BLOCK_N=cfg.block_n1, BLOCK_K=cfg.block_k1, N_PAD=n_pad, GROUPS=grid1[1], ONE_PAIR=grid1[1] == n,
        ACT=act_code, FP8=fp8, HAS_BIAS=weights.b13 is not None, WEIGHT_ON_INPUT=weight_on_input,
        ZERO_BLOCK=_ZERO_BLOCK, PDL=pdl, num_warps=cfg.num_warps, launch_pdl=pdl,
    )
    _decode_down_kernel[grid2](
        h, topk_slots, topk_weights, w2, ops.s2, ops.b2, y, count, out,
        t, k, n, s, d, f, w2.stride(0), w2.stride(1), *ops.strides2, out.stride(0),
        BLOCK_N=cfg.block_n2, BLOCK_K=cfg.block_k2, K_PAD=triton.next_power_of_2(k), N_PAD=n_pad,
        GROUPS=grid2[1], ONE_PAIR=grid2[1] == n, FP8=fp8, HAS_BIAS=weights.b2 is not None,
        WEIGHT_ON_INPUT=weight_on_input, PDL=pdl, num_warps=cfg.num_warps, launch_pdl=pdl,
    )
    return out
