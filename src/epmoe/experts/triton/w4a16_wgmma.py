"""W4A16 expert compute at prefill sizes on Hopper's warpgroup MMA, the INT4 words widened straight into the A operand.

A Gluon kernel pair, the prefill variant of ``w4a16_mma`` (read the module docstring of ``w4a16_operands`` first: the
input order, the widening and the helpers are shared). The product is taken transposed as there: 64 weight rows of a
warpgroup (four warps, 16 rows each) are the ``M`` side of ``wgmma.mma_async.m64nNk16``, a row block of
``WgmmaConfig.block_m`` (64 or 128) token rows of one slot its ``N`` side, so each widened weight register feeds
``block_m / 8`` tensor-core products (``w4a16_mma``: one or two ``mma.sync`` of 8 tokens). A program of ``block_n``
weight rows has one or two warpgroups (``num_warps`` 4 or 8), each issuing its ``wgmma`` once or twice (``block_n = 16
num_warps`` or twice that), all on the same activations in shared memory.

A (weights), in registers. Each thread loads its words and group scales in memory order
(``w4a16_operands._word_layout``), relabels them into the operand order (``operand_order``) and widens them plane by
plane (``widened_plane``) into ``DotOperandLayout(0, <v3 layout>, k_width=2)``: a warp's part of the v3 A operand (16
rows of its warpgroup's 64, warps stacked along ``M``) is the ``mma.sync.m16n8k16`` A fragment, so the relabelling is
the same and ``convert_layout(..., assert_trivial=True)`` proves at compile time that no data moves.

B (activations), in shared memory. A step of ``BLOCK_KW`` words is four products of ``K = 2 BLOCK_KW``, one per nibble
plane ``j``; plane ``j``'s B holds at ``(2 w + e, m)`` input ``8 c + j + 4 e`` of token row ``m`` (``w`` the operand
word of memory word ``c``). The activations are copied once into that operand order (``wgmma_planes``: a step's four
planes, ``8 BLOCK_KW`` values, consecutive in a row, zero-padded to whole steps), so a row's part of a plane is
``4 BLOCK_KW`` consecutive bytes and goes to shared memory by ``cp.async`` 16-byte copies, no registers
(``NVMMASharedLayout``, K-major). ``STAGES`` buffers: after step ``s``'s barrier every warp has waited for step
``s - 1``'s products up to its last plane, so the buffer of step ``s - 2`` is free and step ``s + STAGES - 2`` is
requested into it (``STAGES - 2`` steps ahead); the next step's words and scales are loaded into registers before
this step's are widened (with ``WgmmaConfig.words_smem`` the gate/up words are instead staged through shared memory
with the activations, ``STAGES - 2`` steps ahead). ``warpgroup_mma(..., is_async=True)`` with at most one plane in
flight while the next plane is widened.

Tail blocks. A slot of ``c`` pairs padded to whole ``block_m``-row blocks computes up to ``block_m - 1`` padding rows
(at 85 pairs a slot a third of the rows, at 21 four fifths, with 128-row blocks). With ``WgmmaConfig.tail_rows`` the
alignment rounds a slot's last block up to a multiple of ``tail_rows`` instead (``align``), and a block of ``r <
block_m`` rows runs the same code at ``r`` rows, a further compiled branch of each kernel chosen by the block's row
count: 32 or 64 rows a ``wgmma`` of that ``N``; 96 rows (``block_m`` 128, ``tail_rows`` 32) two parts of 64 and 32
rows, each widened plane feeding both parts' ``wgmma`` (the A operand does not depend on ``N``), so the slot's
weights are read and widened once, as for a whole block.

1. ``wgmma_planes(x)`` and ``align_kernels.align_triton`` (pairs sorted by slot, ``block_m`` rows a block, a slot's
   last block rounded up to a multiple of ``tail_rows``).
2. ``_gate_up_kernel``, grid ``NB * cdiv(F, block_n1)``: gate and up rows of a block's slot against the block's gathered
   token rows (pair id ``// K``), bias, routing weight (on the input), the gated activation; ``h`` stored per sorted
   position in the operand order of the down kernel's steps (zero-padded to whole steps).
3. ``_down_kernel``, grid ``NB * cdiv(D, block_n2)``: ``w2`` rows against the block's ``h`` rows (consecutive sorted
   positions), bias, routing weight (on the output), ``y [N, D]`` float32 at each pair's row.
4. ``grouped.sum_pairs``: ``out[t] = sum_k y[t K + k]``.

Static grids, no host synchronisation: CUDA-graph safe. ``wgmma`` and ``cp.async``: compute capability 9.0 (Hopper);
bf16 activations only. No split reduction: this is the prefill kernel (many row blocks); decode sizes take
``w4a16_mma``.

Source: a mixed-input GEMM with the narrow operand widened in registers as the wgmma A operand and the wide one in
shared memory is the design of Machete (Neural Magic's Hopper W4A16 GEMM in vLLM) and of Marlin's Hopper successors
(Frantar et al., "MARLIN: Mixed-Precision Auto-Regressive Parallel Inference on Large Language Models",
arXiv:2408.11743, for the widening); they reorder the weights offline, here the checkpoint's packed layout is read as
it is and the activations are reordered instead. The code is our own.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

from epmoe.experts.int4 import INT4_PACK, Int4ExpertWeights
from epmoe.experts.mxfp4 import MXFP4ExpertWeights
from epmoe.experts.triton.align_kernels import align_triton
from epmoe.experts.triton.grouped import act_code, packed_scales, packed_words, sum_pairs
from epmoe.experts.triton.w4a16 import row_strides
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
from epmoe.experts.triton.w4a16_wgmma_config import WgmmaConfig, check_wgmma_config, default_wgmma_config
from epmoe.experts.weights import Activation, check_expert_call


def _operand_segment(k: int, block_kw: int) -> int:
    """Values a row of ``k`` inputs takes in the operand-order copies: ``k`` rounded up to whole steps."""
    step = INT4_PACK * block_kw
    return -(-k // step) * step


_PLANES_BLOCK = 2048  # outputs a program of _planes_kernel writes (whole steps for block_kw up to 64)


@triton.jit
def _planes_kernel(x_ptr, out_ptr, K, KP, stride_x, stride_o, BLOCK_KW: tl.constexpr, BLOCK: tl.constexpr):
    """Grid ``(T, cdiv(KP, BLOCK))``: outputs ``[BLOCK]`` of one row of ``wgmma_planes``, each read from its input
    (the inverse of ``_operand_position``; zero past ``K``), stored contiguously."""
    t = tl.program_id(0).to(tl.int64)
    o = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    R: tl.constexpr = BLOCK_KW // 8
    i = o % (8 * BLOCK_KW)
    j = i // (2 * BLOCK_KW)
    w = (i % (2 * BLOCK_KW)) // 2
    c = 2 * R * (w % 4) + 2 * (w // 8) + (w // 4) % 2
    n = (o - i) + 8 * c + j + 4 * (i % 2)
    v = tl.load(x_ptr + t * stride_x + n, mask=(n < K) & (o < KP), other=0.0)
    tl.store(out_ptr + t * stride_o + o, v, mask=o < KP)


def wgmma_planes(x: torch.Tensor, block_kw: int) -> torch.Tensor:
    """``x [T, K]`` (``K`` a multiple of 8, contiguous along ``K``; CUDA, or any device under ``TRITON_INTERPRET=1``)
    -> its operand-order copy ``[T, KP]`` (``KP``: ``K`` rounded up to whole steps of ``8 block_kw`` inputs, the
    padding zero): input ``8 c + j + 4 e`` of step ``s`` (memory word ``c = 2 R q + 2 r + h`` of the step, ``R =
    block_kw / 8``) at ``8 block_kw s + 2 block_kw j + 2 (8 r + 4 h + q) + e`` (``_operand_position``), by one launch
    of ``_planes_kernel``."""
    t, k = x.shape
    kp = _operand_segment(k, block_kw)
    out = torch.empty(t, kp, dtype=x.dtype, device=x.device)
    if t and kp:
        _planes_kernel[(t, triton.cdiv(kp, _PLANES_BLOCK))](x, out, k, kp, x.stride(0), out.stride(0),
                                                            BLOCK_KW=block_kw, BLOCK=_PLANES_BLOCK)
    return out


@gluon.jit
def _operand_position(n, BLOCK_KW: gl.constexpr):
    """Where input ``n`` of a row goes in its operand-order copy (``wgmma_planes``)."""
    R: gl.constexpr = BLOCK_KW // 8
    i = n % (8 * BLOCK_KW)
    c = i // 8
    w = 8 * ((c // 2) % R) + 4 * (c % 2) + c // (2 * R)
    return (n - i) + (i % 4) * (2 * BLOCK_KW) + 2 * w + (i // 4) % 2


@gluon.constexpr_function
def _copy_layout(block_kw, num_warps):
    """Register layout of a step's activation pointers ``[4, block_m, 2 block_kw]`` (plane, token row, value): 8
    values (16 bytes) a thread, the four planes of a token row in the same thread (one row address a token row)."""
    tk = block_kw // 4
    return gl.BlockedLayout([4, 1, 8], [1, 32 // tk, tk], [1, num_warps, 1], [2, 1, 0])


@gluon.constexpr_function
def _b_smem_layout(block_kw):
    """Shared layout of the activation buffers ``[STAGES, 4 block_m, 2 block_kw]`` bf16 (K-major B)."""
    return gl.NVMMASharedLayout(swizzle_byte_width=min(128, 4 * block_kw), element_bitwidth=16, rank=2)


@gluon.constexpr_function
def _mma_layout(rows, num_warps):
    """The ``wgmma`` accumulator layout of a part of ``rows`` token rows (``N``; warpgroups stacked along ``M``)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, rows, 16])


@gluon.jit
def _copy(smem, ptrs, step, nsteps, stage, BLOCK_KW: gl.constexpr):
    """Copy the four plane tiles of step ``min(step, nsteps - 1)`` of one part of a block (``ptrs``: ``_step_ptrs``)
    into buffer ``stage`` ``[4 rows, 2 BLOCK_KW]`` (``cp.async``)."""
    buf = smem.index(stage).reshape([4, ptrs.shape[1], 2 * BLOCK_KW])
    async_copy.async_copy_global_to_shared(buf, ptrs + gl.minimum(step, nsteps - 1) * (8 * BLOCK_KW))


@gluon.jit
def _request(smem, ptrs, smem_hi, ptrs_hi, step, nsteps, stage, BLOCK_KW: gl.constexpr, HI: gl.constexpr):
    """Copy step ``step`` of the block's first part and, when ``HI``, of its second part (``_copy``): one commit
    group."""
    _copy(smem, ptrs, step, nsteps, stage, BLOCK_KW)
    if HI > 0:
        _copy(smem_hi, ptrs_hi, step, nsteps, stage, BLOCK_KW)
    async_copy.commit_group()


@gluon.constexpr_function
def _word_smem_layout():
    """Shared layout of the word buffers ``[STAGES, block_n, block_kw]`` int32: unswizzled, each thread's 16-byte
    vector where it reads it back (a warp's 8 rows of 16 words are 512 consecutive bytes)."""
    return gl.SwizzledSharedLayout(vec=4, per_phase=1, max_phase=1, order=[1, 0])


@gluon.jit
def _request_words(wsm_g, wg_ptrs, wsm_u, wu_ptrs, rows, R_ROWS, cols, DW, step, nsteps, stage,
                   BLOCK_KW: gl.constexpr, EVEN: gl.constexpr):
    """Copy the gate and up word tiles of step ``min(step, nsteps - 1)`` into buffer ``stage`` (``cp.async``, before
    ``_request`` commits the step's group); rows at or past ``R_ROWS`` and words past the row's end are zero unless
    ``EVEN`` (``w4a16_operands.load_tile``'s masks)."""
    kw = gl.minimum(step, nsteps - 1) * BLOCK_KW
    if EVEN:
        async_copy.async_copy_global_to_shared(wsm_g.index(stage), wg_ptrs + kw)
        async_copy.async_copy_global_to_shared(wsm_u.index(stage), wu_ptrs + kw)
    else:
        ok = (rows < R_ROWS) & (cols < ((DW - kw) // 4) * 4)
        async_copy.async_copy_global_to_shared(wsm_g.index(stage), wg_ptrs + kw, mask=ok)
        async_copy.async_copy_global_to_shared(wsm_u.index(stage), wu_ptrs + kw, mask=ok)


@gluon.jit
def _step_ptrs(row_ptrs, BLOCK_M: gl.constexpr, BLOCK_KW: gl.constexpr, NUM_WARPS: gl.constexpr):
    """Pointers of step 0's planes ``[4, BLOCK_M, 2 BLOCK_KW]`` (plane ``j`` of token row ``m`` goes to row ``j
    BLOCK_M + m`` of a buffer) from the token rows' addresses in the operand-order copy (``row_ptrs [BLOCK_M]`` in
    ``_row_layout``)."""
    COPY: gl.constexpr = _copy_layout(BLOCK_KW, NUM_WARPS)
    j = gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, COPY)))
    kk = gl.arange(0, 2 * BLOCK_KW, layout=gl.SliceLayout(0, gl.SliceLayout(1, COPY)))
    return row_ptrs[None, :, None] + ((j * (2 * BLOCK_KW))[:, None, None] + kk[None, None, :])


@gluon.constexpr_function
def _row_layout(block_kw, num_warps):
    """Layout of a block's token rows ``[block_m]`` for ``_step_ptrs``."""
    return gl.SliceLayout(0, gl.SliceLayout(2, _copy_layout(block_kw, num_warps)))


@gluon.jit
def _wait_step(s, STAGES: gl.constexpr):
    """Wait for step ``s``'s activations (this thread's copies; every thread's after the barrier, and every warp's
    products of step ``s - 2`` are done). Returns the step's buffer index."""
    async_copy.wait_group(STAGES - 3)
    fence_async_shared()
    gl.thread_barrier()
    return s % STAGES


@gluon.jit
def _x_ptrs(xw_ptr, sorted_ptr, pos, num_pairs, top_k, stride_x, ROWS: gl.constexpr, BLOCK_KW: gl.constexpr,
            NUM_WARPS: gl.constexpr):
    """Step 0's plane pointers (``_step_ptrs``) of the token rows of sorted positions ``[pos, pos + ROWS)`` in the
    operand-order copy of ``x`` (a padding row reads token 0: its column of the product is never stored)."""
    pair, valid = block_rows(sorted_ptr, pos, num_pairs, ROWS, _row_layout(BLOCK_KW, NUM_WARPS))
    tok = gl.where(valid, pair // top_k, 0).to(gl.int64)
    return _step_ptrs(xw_ptr + tok * stride_x, ROWS, BLOCK_KW, NUM_WARPS)


@gluon.jit
def _gate_up_kernel(
    xw_ptr, w_ptr, s_ptr, b_ptr, tw_ptr, h_ptr, sorted_ptr, block_slot_ptr, block_start_ptr, block_rows_ptr,
    num_pairs, top_k, D, F, stride_x, stride_we, stride_wn, stride_se, stride_sn, stride_h, act_limit, act_alpha,
    BLOCK_N: gl.constexpr, BLOCK_KW: gl.constexpr, BLOCK_KW2: gl.constexpr, BLOCK_M: gl.constexpr, GW: gl.constexpr,
    STAGES: gl.constexpr, NUM_WARPS: gl.constexpr, ACT: gl.constexpr, HAS_BIAS: gl.constexpr,
    WEIGHT_ON_INPUT: gl.constexpr, EVEN: gl.constexpr, TAIL: gl.constexpr, WORDS_SMEM: gl.constexpr,
):
    num_n = gl.cdiv(F, BLOCK_N)
    pid_m = gl.program_id(0) // num_n
    pid_n = gl.program_id(0) % num_n
    slot = gl.load(block_slot_ptr + pid_m).to(gl.int64)
    if slot < 0:
        return
    first = gl.load(block_start_ptr + pid_m)
    # a slot's last block of fewer rows (a multiple of TAIL) runs the same code at its rows: BLOCK_M / 2, TAIL, or
    # BLOCK_M / 2 + TAIL rows as two parts on the same widened weights
    rows = BLOCK_M
    if TAIL < BLOCK_M:
        rows = gl.load(block_rows_ptr + pid_m)
    if TAIL == BLOCK_M or rows == BLOCK_M:
        _gate_up_rows(xw_ptr, w_ptr, s_ptr, b_ptr, tw_ptr, h_ptr, sorted_ptr, slot, first, pid_n, num_pairs, top_k, D,
                      F, stride_x, stride_we, stride_wn, stride_se, stride_sn, stride_h, act_limit, act_alpha,
                      BLOCK_N, BLOCK_KW, BLOCK_KW2, BLOCK_M, 0, GW, STAGES, NUM_WARPS, ACT, HAS_BIAS,
                      WEIGHT_ON_INPUT, EVEN, WORDS_SMEM)
    elif rows == BLOCK_M // 2:
        _gate_up_rows(xw_ptr, w_ptr, s_ptr, b_ptr, tw_ptr, h_ptr, sorted_ptr, slot, first, pid_n, num_pairs, top_k, D,
                      F, stride_x, stride_we, stride_wn, stride_se, stride_sn, stride_h, act_limit, act_alpha,
                      BLOCK_N, BLOCK_KW, BLOCK_KW2, BLOCK_M // 2, 0, GW, STAGES, NUM_WARPS, ACT, HAS_BIAS,
                      WEIGHT_ON_INPUT, EVEN, WORDS_SMEM)
    elif TAIL == BLOCK_M // 4:
        if rows == TAIL:
            _gate_up_rows(xw_ptr, w_ptr, s_ptr, b_ptr, tw_ptr, h_ptr, sorted_ptr, slot, first, pid_n, num_pairs,
                          top_k, D, F, stride_x, stride_we, stride_wn, stride_se, stride_sn, stride_h, act_limit,
                          act_alpha, BLOCK_N, BLOCK_KW, BLOCK_KW2, TAIL, 0, GW, STAGES, NUM_WARPS, ACT, HAS_BIAS,
                          WEIGHT_ON_INPUT, EVEN, WORDS_SMEM)
        else:
            _gate_up_rows(xw_ptr, w_ptr, s_ptr, b_ptr, tw_ptr, h_ptr, sorted_ptr, slot, first, pid_n, num_pairs,
                          top_k, D, F, stride_x, stride_we, stride_wn, stride_se, stride_sn, stride_h, act_limit,
                          act_alpha, BLOCK_N, BLOCK_KW, BLOCK_KW2, BLOCK_M // 2, TAIL, GW, STAGES, NUM_WARPS, ACT,
                          HAS_BIAS, WEIGHT_ON_INPUT, EVEN, WORDS_SMEM)


@gluon.jit
def _gate_up_rows(
    xw_ptr, w_ptr, s_ptr, b_ptr, tw_ptr, h_ptr, sorted_ptr, slot, first, pid_n, num_pairs, top_k, D, F, stride_x,
    stride_we, stride_wn, stride_se, stride_sn, stride_h, act_limit, act_alpha,
    BLOCK_N: gl.constexpr, BLOCK_KW: gl.constexpr, BLOCK_KW2: gl.constexpr, LO: gl.constexpr, HI: gl.constexpr,
    GW: gl.constexpr, STAGES: gl.constexpr, NUM_WARPS: gl.constexpr, ACT: gl.constexpr, HAS_BIAS: gl.constexpr,
    WEIGHT_ON_INPUT: gl.constexpr, EVEN: gl.constexpr, WORDS_SMEM: gl.constexpr,
):
    """``h`` of the ``LO + HI`` sorted positions from ``first`` (slot ``slot``; ``HI`` 0: one part), gate and up rows
    of column tile ``pid_n``: each widened plane feeds the ``wgmma`` of the first ``LO`` rows and of the next
    ``HI``."""
    MMA: gl.constexpr = _mma_layout(LO, NUM_WARPS)
    W_LAYOUT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=1)
    A_LAYOUT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    DW = D // 8
    nsteps = gl.cdiv(DW, BLOCK_KW)
    # B: the parts' token rows of the operand-order copy of x
    x_ptrs = _x_ptrs(xw_ptr, sorted_ptr, first, num_pairs, top_k, stride_x, LO, BLOCK_KW, NUM_WARPS)
    smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, 4 * LO, 2 * BLOCK_KW], _b_smem_layout(BLOCK_KW))
    x_hi = x_ptrs
    smem_hi = smem
    if HI > 0:
        MMA_HI: gl.constexpr = _mma_layout(HI, NUM_WARPS)
        A_HI: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA_HI, k_width=2)
        x_hi = _x_ptrs(xw_ptr, sorted_ptr, first + LO, num_pairs, top_k, stride_x, HI, BLOCK_KW, NUM_WARPS)
        smem_hi = gl.allocate_shared_memory(gl.bfloat16, [STAGES, 4 * HI, 2 * BLOCK_KW], _b_smem_layout(BLOCK_KW))
    # A: gate rows and up rows (F + rows) of the slot
    stride_we, stride_wn = row_strides(stride_we, stride_wn)
    wg_ptrs, sg_ptrs, rows, w_cols, s_rows, s_cols = weight_ptrs(
        w_ptr + slot * stride_we, s_ptr + slot * stride_se, pid_n * BLOCK_N, stride_wn, stride_sn, BLOCK_N, BLOCK_KW,
        GW, NUM_WARPS)
    wu_ptrs = wg_ptrs + F * stride_wn
    su_ptrs = sg_ptrs + F * stride_sn
    if WORDS_SMEM:  # the words staged through shared memory with the activations
        wsm_g = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_N, BLOCK_KW], _word_smem_layout())
        wsm_u = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_N, BLOCK_KW], _word_smem_layout())
        for i in gl.static_range(STAGES - 2):
            _request_words(wsm_g, wg_ptrs, wsm_u, wu_ptrs, rows, F, w_cols, DW, i, nsteps, i, BLOCK_KW, EVEN)
            _request(smem, x_ptrs, smem_hi, x_hi, i, nsteps, i, BLOCK_KW, HI)
    else:
        for i in gl.static_range(STAGES - 2):
            _request(smem, x_ptrs, smem_hi, x_hi, i, nsteps, i, BLOCK_KW, HI)
        wg = load_tile(wg_ptrs, rows, F, w_cols, DW, EVEN)
        wu = load_tile(wu_ptrs, rows, F, w_cols, DW, EVEN)
    sg = load_tile(sg_ptrs, s_rows, F, s_cols, DW, EVEN)
    su = load_tile(su_ptrs, s_rows, F, s_cols, DW, EVEN)
    acc_g = gl.zeros([BLOCK_N, LO], gl.float32, layout=MMA)
    acc_u = gl.zeros([BLOCK_N, LO], gl.float32, layout=MMA)
    if HI > 0:
        acc_g2 = gl.zeros([BLOCK_N, HI], gl.float32, layout=MMA_HI)
        acc_u2 = gl.zeros([BLOCK_N, HI], gl.float32, layout=MMA_HI)
    for s in range(0, nsteps):
        # step s's activations in, step s - 2's buffer free: request step s + STAGES - 2 into it
        stage = _wait_step(s, STAGES)
        if WORDS_SMEM:
            W_MEM: gl.constexpr = wg_ptrs.type.layout
            wg = wsm_g.index(stage).load(W_MEM)
            wu = wsm_u.index(stage).load(W_MEM)
            _request_words(wsm_g, wg_ptrs, wsm_u, wu_ptrs, rows, F, w_cols, DW, s + STAGES - 2, nsteps,
                           (s + STAGES - 2) % STAGES, BLOCK_KW, EVEN)
        _request(smem, x_ptrs, smem_hi, x_hi, s + STAGES - 2, nsteps, (s + STAGES - 2) % STAGES, BLOCK_KW, HI)
        # the next step's words (unless staged) and scales (the last step's own again) while this step's are widened
        kw = gl.minimum(s + 1, nsteps - 1) * BLOCK_KW
        if not WORDS_SMEM:
            wg_next = load_tile(wg_ptrs + kw, rows, F, w_cols, DW - kw, EVEN)
            wu_next = load_tile(wu_ptrs + kw, rows, F, w_cols, DW - kw, EVEN)
        sg_next = load_tile(sg_ptrs + kw // GW, s_rows, F, s_cols, DW - kw, EVEN)
        su_next = load_tile(su_ptrs + kw // GW, s_rows, F, s_cols, DW - kw, EVEN)
        ag = operand_order(wg, BLOCK_N, BLOCK_KW, W_LAYOUT)
        au = operand_order(wu, BLOCK_N, BLOCK_KW, W_LAYOUT)
        cg = operand_order(scales_per_word(sg, GW, BLOCK_N, BLOCK_KW), BLOCK_N, BLOCK_KW, W_LAYOUT)
        cu = operand_order(scales_per_word(su, GW, BLOCK_N, BLOCK_KW), BLOCK_N, BLOCK_KW, W_LAYOUT)
        for j in gl.static_range(4):
            pg = widened_plane(ag, cg, j, BLOCK_N, BLOCK_KW, A_LAYOUT, sg.dtype == gl.uint8)
            pu = widened_plane(au, cu, j, BLOCK_N, BLOCK_KW, A_LAYOUT, su.dtype == gl.uint8)
            b = smem.index(stage).slice(j * LO, LO).permute((1, 0))
            acc_g = warpgroup_mma(pg, b, acc_g, is_async=True)
            acc_u = warpgroup_mma(pu, b, acc_u, is_async=True)
            if HI > 0:
                b2 = smem_hi.index(stage).slice(j * HI, HI).permute((1, 0))
                acc_g2 = warpgroup_mma(gl.convert_layout(pg, A_HI, assert_trivial=True), b2, acc_g2, is_async=True)
                acc_u2 = warpgroup_mma(gl.convert_layout(pu, A_HI, assert_trivial=True), b2, acc_u2, is_async=True)
                acc_g, acc_u, acc_g2, acc_u2 = warpgroup_mma_wait(4, deps=[acc_g, acc_u, acc_g2, acc_u2])
            else:
                acc_g, acc_u = warpgroup_mma_wait(2, deps=[acc_g, acc_u])
        if not WORDS_SMEM:
            wg = wg_next
            wu = wu_next
        sg = sg_next
        su = su_next
    if HI > 0:
        acc_g, acc_u, acc_g2, acc_u2 = warpgroup_mma_wait(0, deps=[acc_g, acc_u, acc_g2, acc_u2])
    else:
        acc_g, acc_u = warpgroup_mma_wait(0, deps=[acc_g, acc_u])
    async_copy.wait_group(0)
    _gate_up_store(acc_g, acc_u, h_ptr, b_ptr, tw_ptr, sorted_ptr, slot, first, pid_n, num_pairs, F, stride_h,
                   act_limit, act_alpha, BLOCK_N, BLOCK_KW2, LO, NUM_WARPS, ACT, HAS_BIAS, WEIGHT_ON_INPUT)
    if HI > 0:
        _gate_up_store(acc_g2, acc_u2, h_ptr, b_ptr, tw_ptr, sorted_ptr, slot, first + LO, pid_n, num_pairs, F,
                       stride_h, act_limit, act_alpha, BLOCK_N, BLOCK_KW2, HI, NUM_WARPS, ACT, HAS_BIAS,
                       WEIGHT_ON_INPUT)


@gluon.jit
def _gate_up_store(acc_g, acc_u, h_ptr, b_ptr, tw_ptr, sorted_ptr, slot, pos, pid_n, num_pairs, F, stride_h,
                   act_limit, act_alpha, BLOCK_N: gl.constexpr, BLOCK_KW2: gl.constexpr, ROWS: gl.constexpr,
                   NUM_WARPS: gl.constexpr, ACT: gl.constexpr, HAS_BIAS: gl.constexpr, WEIGHT_ON_INPUT: gl.constexpr):
    """The epilogue of sorted positions ``[pos, pos + ROWS)`` in the accumulator layout (rows ``f`` of ``F``, columns
    the token rows): routing weight (on the input), bias, the gated activation, ``h`` stored in the down kernel's
    operand order."""
    MMA: gl.constexpr = _mma_layout(ROWS, NUM_WARPS)
    h, f, ok = gated_rows(acc_g, acc_u, b_ptr, tw_ptr, sorted_ptr, slot, pos, pid_n, num_pairs, F, act_limit,
                          act_alpha, BLOCK_N, ROWS, MMA, ACT, HAS_BIAS, WEIGHT_ON_INPUT)
    m_c = gl.arange(0, ROWS, layout=gl.SliceLayout(0, MMA))
    h_ptrs = h_ptr + (pos + m_c).to(gl.int64)[None, :] * stride_h + _operand_position(f, BLOCK_KW2)[:, None]
    gl.store(h_ptrs, h.to(h_ptr.dtype.element_ty), mask=ok)


@gluon.jit
def _down_kernel(
    h_ptr, w_ptr, s_ptr, b_ptr, tw_ptr, y_ptr, sorted_ptr, block_slot_ptr, block_start_ptr, block_rows_ptr,
    num_pairs, D, F, stride_we, stride_wn, stride_se, stride_sn, stride_h,
    BLOCK_N: gl.constexpr, BLOCK_KW: gl.constexpr, BLOCK_M: gl.constexpr, GW: gl.constexpr, STAGES: gl.constexpr,
    NUM_WARPS: gl.constexpr, HAS_BIAS: gl.constexpr, WEIGHT_ON_INPUT: gl.constexpr, EVEN: gl.constexpr,
    TAIL: gl.constexpr,
):
    num_n = gl.cdiv(D, BLOCK_N)
    pid_m = gl.program_id(0) // num_n
    pid_n = gl.program_id(0) % num_n
    slot = gl.load(block_slot_ptr + pid_m).to(gl.int64)
    if slot < 0:
        return
    first = gl.load(block_start_ptr + pid_m)
    rows = BLOCK_M
    if TAIL < BLOCK_M:
        rows = gl.load(block_rows_ptr + pid_m)
    if TAIL == BLOCK_M or rows == BLOCK_M:
        _down_rows(h_ptr, w_ptr, s_ptr, b_ptr, tw_ptr, y_ptr, sorted_ptr, slot, first, pid_n, num_pairs, D, F,
                   stride_we, stride_wn, stride_se, stride_sn, stride_h, BLOCK_N, BLOCK_KW, BLOCK_M, 0, GW, STAGES,
                   NUM_WARPS, HAS_BIAS, WEIGHT_ON_INPUT, EVEN)
    elif rows == BLOCK_M // 2:
        _down_rows(h_ptr, w_ptr, s_ptr, b_ptr, tw_ptr, y_ptr, sorted_ptr, slot, first, pid_n, num_pairs, D, F,
                   stride_we, stride_wn, stride_se, stride_sn, stride_h, BLOCK_N, BLOCK_KW, BLOCK_M // 2, 0, GW,
                   STAGES, NUM_WARPS, HAS_BIAS, WEIGHT_ON_INPUT, EVEN)
    elif TAIL == BLOCK_M // 4:
        if rows == TAIL:
            _down_rows(h_ptr, w_ptr, s_ptr, b_ptr, tw_ptr, y_ptr, sorted_ptr, slot, first, pid_n, num_pairs, D, F,
                       stride_we, stride_wn, stride_se, stride_sn, stride_h, BLOCK_N, BLOCK_KW, TAIL, 0, GW, STAGES,
                       NUM_WARPS, HAS_BIAS, WEIGHT_ON_INPUT, EVEN)
        else:
            _down_rows(h_ptr, w_ptr, s_ptr, b_ptr, tw_ptr, y_ptr, sorted_ptr, slot, first, pid_n, num_pairs, D, F,
                       stride_we, stride_wn, stride_se, stride_sn, stride_h, BLOCK_N, BLOCK_KW, BLOCK_M // 2, TAIL, GW,
                       STAGES, NUM_WARPS, HAS_BIAS, WEIGHT_ON_INPUT, EVEN)


@gluon.jit
def _down_rows(
    h_ptr, w_ptr, s_ptr, b_ptr, tw_ptr, y_ptr, sorted_ptr, slot, first, pid_n, num_pairs, D, F, stride_we, stride_wn,
    stride_se, stride_sn, stride_h, BLOCK_N: gl.constexpr, BLOCK_KW: gl.constexpr, LO: gl.constexpr,
    HI: gl.constexpr, GW: gl.constexpr, STAGES: gl.constexpr, NUM_WARPS: gl.constexpr, HAS_BIAS: gl.constexpr,
    WEIGHT_ON_INPUT: gl.constexpr, EVEN: gl.constexpr,
):
    """``y`` of the pairs at the ``LO + HI`` sorted positions from ``first`` (slot ``slot``; ``HI`` 0: one part),
    columns of tile ``pid_n``, as ``_gate_up_rows``."""
    MMA: gl.constexpr = _mma_layout(LO, NUM_WARPS)
    W_LAYOUT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=1)
    A_LAYOUT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    FW = F // 8
    nsteps = gl.cdiv(FW, BLOCK_KW)
    # B: the parts' h rows (a padding row was never written: its column of the product is never stored)
    m_b = gl.arange(0, LO, layout=_row_layout(BLOCK_KW, NUM_WARPS))
    h_ptrs = _step_ptrs(h_ptr + (first + m_b).to(gl.int64) * stride_h, LO, BLOCK_KW, NUM_WARPS)
    smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, 4 * LO, 2 * BLOCK_KW], _b_smem_layout(BLOCK_KW))
    h_hi = h_ptrs
    smem_hi = smem
    if HI > 0:
        MMA_HI: gl.constexpr = _mma_layout(HI, NUM_WARPS)
        A_HI: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA_HI, k_width=2)
        m_hi = gl.arange(0, HI, layout=_row_layout(BLOCK_KW, NUM_WARPS))
        h_hi = _step_ptrs(h_ptr + (first + LO + m_hi).to(gl.int64) * stride_h, HI, BLOCK_KW, NUM_WARPS)
        smem_hi = gl.allocate_shared_memory(gl.bfloat16, [STAGES, 4 * HI, 2 * BLOCK_KW], _b_smem_layout(BLOCK_KW))
    for i in gl.static_range(STAGES - 2):
        _request(smem, h_ptrs, smem_hi, h_hi, i, nsteps, i, BLOCK_KW, HI)
    stride_we, stride_wn = row_strides(stride_we, stride_wn)
    w_ptrs, s_ptrs, rows, w_cols, s_rows, s_cols = weight_ptrs(
        w_ptr + slot * stride_we, s_ptr + slot * stride_se, pid_n * BLOCK_N, stride_wn, stride_sn, BLOCK_N, BLOCK_KW,
        GW, NUM_WARPS)
    w = load_tile(w_ptrs, rows, D, w_cols, FW, EVEN)
    sc = load_tile(s_ptrs, s_rows, D, s_cols, FW, EVEN)
    acc = gl.zeros([BLOCK_N, LO], gl.float32, layout=MMA)
    if HI > 0:
        acc2 = gl.zeros([BLOCK_N, HI], gl.float32, layout=MMA_HI)
    for s in range(0, nsteps):
        stage = _wait_step(s, STAGES)
        _request(smem, h_ptrs, smem_hi, h_hi, s + STAGES - 2, nsteps, (s + STAGES - 2) % STAGES, BLOCK_KW, HI)
        kw = gl.minimum(s + 1, nsteps - 1) * BLOCK_KW
        w_next = load_tile(w_ptrs + kw, rows, D, w_cols, FW - kw, EVEN)
        sc_next = load_tile(s_ptrs + kw // GW, s_rows, D, s_cols, FW - kw, EVEN)
        a = operand_order(w, BLOCK_N, BLOCK_KW, W_LAYOUT)
        c = operand_order(scales_per_word(sc, GW, BLOCK_N, BLOCK_KW), BLOCK_N, BLOCK_KW, W_LAYOUT)
        for j in gl.static_range(4):
            p = widened_plane(a, c, j, BLOCK_N, BLOCK_KW, A_LAYOUT, sc.dtype == gl.uint8)
            acc = warpgroup_mma(p, smem.index(stage).slice(j * LO, LO).permute((1, 0)), acc, is_async=True)
            if HI > 0:
                b2 = smem_hi.index(stage).slice(j * HI, HI).permute((1, 0))
                acc2 = warpgroup_mma(gl.convert_layout(p, A_HI, assert_trivial=True), b2, acc2, is_async=True)
                acc, acc2 = warpgroup_mma_wait(2, deps=[acc, acc2])
            else:
                acc = warpgroup_mma_wait(1, deps=[acc])
        w = w_next
        sc = sc_next
    if HI > 0:
        acc, acc2 = warpgroup_mma_wait(0, deps=[acc, acc2])
    else:
        acc = warpgroup_mma_wait(0, deps=[acc])
    async_copy.wait_group(0)
    _down_store(acc, y_ptr, b_ptr, tw_ptr, sorted_ptr, slot, first, pid_n, num_pairs, D, BLOCK_N, LO, NUM_WARPS,
                HAS_BIAS, WEIGHT_ON_INPUT)
    if HI > 0:
        _down_store(acc2, y_ptr, b_ptr, tw_ptr, sorted_ptr, slot, first + LO, pid_n, num_pairs, D, BLOCK_N, HI,
                    NUM_WARPS, HAS_BIAS, WEIGHT_ON_INPUT)


@gluon.jit
def _down_store(acc, y_ptr, b_ptr, tw_ptr, sorted_ptr, slot, pos, pid_n, num_pairs, D, BLOCK_N: gl.constexpr,
                ROWS: gl.constexpr, NUM_WARPS: gl.constexpr, HAS_BIAS: gl.constexpr, WEIGHT_ON_INPUT: gl.constexpr):
    """The epilogue of sorted positions ``[pos, pos + ROWS)``: bias, routing weight (on the output), ``y [N, D]``
    float32 at each pair's row."""
    store_down_rows(acc, b_ptr, tw_ptr, y_ptr, sorted_ptr, pos, num_pairs, slot, pid_n, D, BLOCK_N, ROWS,
                    _mma_layout(ROWS, NUM_WARPS), HAS_BIAS, WEIGHT_ON_INPUT)


def packed_wgmma_experts(
    x: torch.Tensor,
    topk_slots: torch.Tensor,
    topk_weights: torch.Tensor,
    weights: Int4ExpertWeights | MXFP4ExpertWeights,
    activation: Activation,
    weight_on_input: bool = False,
    config: WgmmaConfig | None = None,
) -> torch.Tensor:
    """INT4 or MXFP4 expert compute on Hopper's warpgroup MMA, the packed weights widened into the A operand
    registers (see the module docstring; MXFP4 as ``w4a16_mma.packed_mma_experts`` reads it); for prefill sizes
    (many pairs a slot).

    Args:
        x: ``[T, D]`` bf16 CUDA rows, contiguous along ``D``.
        topk_slots: ``[T, K]`` int64 contiguous local slot ids; an id outside ``[0, S)`` (``-1``) skips.
        topk_weights: ``[T, K]`` float32 contiguous routing weights.
        weights: the packed weights (rows contiguous, word strides multiples of 4).
        activation: the gated activation.
        weight_on_input: scale the expert input by the weight instead of its output.
        config: tile shapes; ``default_wgmma_config(G, T * K, S)`` when ``None``.

    Returns:
        ``[T, D]`` bf16.

    Raises:
        ValueError: operands of other shapes or layouts than ``experts.weights.check_expert_call`` takes, packed word
            strides that are not multiples of 4.
        TypeError: ``x`` not bf16.
        ValueError: a ``config`` outside the constraints of ``WgmmaConfig``.
    """
    check_expert_call(x, topk_slots, topk_weights, weights.hidden_size)
    if x.dtype != torch.bfloat16:
        raise TypeError(f"the packed wgmma kernels compute in bf16, got x of dtype {x.dtype}")
    w13, w2, gw = packed_words(weights, "wgmma")
    s13, s2 = packed_scales(weights)
    g = gw * INT4_PACK
    t, k = topk_slots.shape
    n = t * k
    s, d, f = weights.num_slots, weights.hidden_size, weights.intermediate_size
    cfg = config if config is not None else default_wgmma_config(g, n, s)
    check_wgmma_config(cfg, g)
    if n == 0:  # no pair: no expert adds to any row
        return torch.zeros(t, d, dtype=x.dtype, device=x.device)
    out = torch.empty(t, d, dtype=x.dtype, device=x.device)
    xw = wgmma_planes(x, cfg.block_kw1)
    bm = cfg.block_m
    tail = cfg.tail_rows if cfg.tail_rows is not None else bm
    aln = align_triton(topk_slots, s, bm, tail_rows=tail)
    nb = aln.block_slot.shape[0]
    fp = _operand_segment(f, cfg.block_kw2)
    # the down kernel reads whole steps: the padding past F must be zero (the padded weights are)
    h = (torch.zeros if fp != f else torch.empty)(nb * bm, fp, dtype=x.dtype, device=x.device)
    y = torch.empty(n, d, dtype=torch.float32, device=x.device)
    placeholder = topk_weights
    limit = activation.swiglu_limit if activation.swiglu_limit is not None else 0.0
    n1, n2, nw = cfg.block_n1, cfg.block_n2, cfg.num_warps
    _gate_up_kernel[(nb * triton.cdiv(f, n1),)](
        xw, w13, s13, weights.b13 if weights.b13 is not None else placeholder, topk_weights, h, aln.sorted_pair_ids,
        aln.block_slot, aln.block_start, aln.block_rows, n, k, d, f, xw.stride(0), w13.stride(0), w13.stride(1),
        s13.stride(0), s13.stride(1), h.stride(0), float(limit), float(activation.swiglu_alpha),
        BLOCK_N=n1, BLOCK_KW=cfg.block_kw1, BLOCK_KW2=cfg.block_kw2, BLOCK_M=bm, GW=gw, STAGES=cfg.stages,
        NUM_WARPS=nw, ACT=act_code(activation), HAS_BIAS=weights.b13 is not None, WEIGHT_ON_INPUT=weight_on_input,
        EVEN=(d // INT4_PACK) % cfg.block_kw1 == 0 and f % n1 == 0, TAIL=tail, WORDS_SMEM=cfg.words_smem, num_warps=nw,
    )
    _down_kernel[(nb * triton.cdiv(d, n2),)](
        h, w2, s2, weights.b2 if weights.b2 is not None else placeholder, topk_weights, y, aln.sorted_pair_ids,
        aln.block_slot, aln.block_start, aln.block_rows, n, d, f, w2.stride(0), w2.stride(1), s2.stride(0),
        s2.stride(1), h.stride(0), BLOCK_N=n2, BLOCK_KW=cfg.block_kw2, BLOCK_M=bm, GW=gw, STAGES=cfg.stages,
        NUM_WARPS=nw, HAS_BIAS=weights.b2 is not None, WEIGHT_ON_INPUT=weight_on_input,
        EVEN=(f // INT4_PACK) % cfg.block_kw2 == 0 and d % n2 == 0, TAIL=tail, num_warps=nw, maxnreg=cfg.maxnreg2,
    )
    return sum_pairs(y, topk_slots, out, s)
