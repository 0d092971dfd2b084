"""The Triton alignment (``align_triton``): ``align.align_reference``'s padded slot blocks computed on the GPU, in
static grids and without host synchronisation (CUDA-graph safe); the order of pairs inside a slot may differ (atomics):

1. a sentinel fill of the sorted positions and ``_count_kernel``: per-slot pair counts with atomics.
2. ``_offsets_kernel`` (one program per group of row blocks, each recomputing the small per-slot prefix
   sums): each slot's first padded position, and every row block's slot, first position and rows.
3. ``_scatter_kernel``: each pair takes a position in its slot's group (atomics; the order inside a
   group does not change any row's result).
   For few pairs x slots (``_SMALL_ALIGN``) ``_align_small_kernel`` does 1-3 in one program and one launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from epmoe.experts.triton.align import Alignment, num_aligned_blocks, tail_rows_of

_SMALL_ALIGN = 1 << 14  # pairs x slots (padded to powers of two) that _align_small_kernel takes in one program


@triton.jit
def _count_kernel(slots_ptr, counts_ptr, num_pairs, num_slots, BLOCK: tl.constexpr):
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    key = tl.load(slots_ptr + idx, mask=idx < num_pairs, other=-1)
    ok = (key >= 0) & (key < num_slots)
    tl.atomic_add(counts_ptr + tl.where(ok, key, 0), tl.full([BLOCK], 1, tl.int32), mask=ok)


@triton.jit
def _slot_layout(counts, BLOCK_M: tl.constexpr, TAIL: tl.constexpr):
    """From per-slot row counts ``[S_PAD]``: each slot's first padded position, blocks, first block and
    rows of its last block, rounded up to a multiple of ``TAIL`` (``align.align_reference`` computes the same)."""
    nblk = (counts + BLOCK_M - 1) // BLOCK_M
    if TAIL < BLOCK_M:
        last_rows = (counts - (nblk - 1) * BLOCK_M + TAIL - 1) // TAIL * TAIL
    else:
        last_rows = tl.full(counts.shape, BLOCK_M, tl.int32)
    padded = tl.where(counts > 0, (nblk - 1) * BLOCK_M + last_rows, 0)
    blk_end = tl.cumsum(nblk, 0)
    return tl.cumsum(padded, 0) - padded, nblk, blk_end - nblk, last_rows


@triton.jit
def _block_layout(
    b0, s, start, nblk, blk_begin, last_rows, num_blocks, block_slot_ptr, block_start_ptr, block_rows_ptr,
    BLOCK_M: tl.constexpr, BLOCK_B: tl.constexpr,
):
    """Slot, first sorted position and rows of blocks ``[b0, b0 + BLOCK_B)``."""
    b = b0 + tl.arange(0, BLOCK_B)
    mine = (blk_begin[None, :] <= b[:, None]) & (b[:, None] < (blk_begin + nblk)[None, :])
    used = tl.sum(mine.to(tl.int32), axis=1) > 0
    j = b - tl.sum(tl.where(mine, blk_begin[None, :], 0), axis=1)
    last = j == tl.sum(tl.where(mine, nblk[None, :], 0), axis=1) - 1
    rows = tl.where(last, tl.sum(tl.where(mine, last_rows[None, :], 0), axis=1), BLOCK_M)
    first = tl.sum(tl.where(mine, start[None, :], 0), axis=1) + j * BLOCK_M
    ok = b < num_blocks
    tl.store(block_slot_ptr + b, tl.where(used, tl.sum(tl.where(mine, s[None, :], 0), axis=1), -1), mask=ok)
    tl.store(block_start_ptr + b, tl.where(used, first, 0), mask=ok)
    tl.store(block_rows_ptr + b, tl.where(used, rows, 0), mask=ok)


@triton.jit
def _offsets_kernel(
    counts_ptr, cursor_ptr, block_slot_ptr, block_start_ptr, block_rows_ptr, num_slots, num_blocks,
    BLOCK_M: tl.constexpr, TAIL: tl.constexpr, S_PAD: tl.constexpr, BLOCK_B: tl.constexpr,
):
    # one program per BLOCK_B blocks; each recomputes the (small) per-slot prefix sums
    s = tl.arange(0, S_PAD)
    counts = tl.load(counts_ptr + s, mask=s < num_slots, other=0)
    start, nblk, blk_begin, last_rows = _slot_layout(counts, BLOCK_M, TAIL)
    if tl.program_id(0) == 0:
        tl.store(cursor_ptr + s, start, mask=s < num_slots)
    _block_layout(tl.program_id(0) * BLOCK_B, s, start, nblk, blk_begin, last_rows, num_blocks, block_slot_ptr,
                  block_start_ptr, block_rows_ptr, BLOCK_M, BLOCK_B)


@triton.jit
def _align_small_kernel(
    slots_ptr, cursor_ptr, block_slot_ptr, block_start_ptr, block_rows_ptr, sorted_ptr, num_pairs, num_slots,
    num_blocks, BLOCK_M: tl.constexpr, TAIL: tl.constexpr, S_PAD: tl.constexpr, N_PAD: tl.constexpr,
    BLOCK_B: tl.constexpr, BLOCK: tl.constexpr,
):
    idx = tl.arange(0, N_PAD)
    key = tl.load(slots_ptr + idx, mask=idx < num_pairs, other=-1)
    ok = (key >= 0) & (key < num_slots)
    s = tl.arange(0, S_PAD)
    counts = tl.sum(((key[:, None] == s[None, :]) & ok[:, None]).to(tl.int32), axis=0)
    start, nblk, blk_begin, last_rows = _slot_layout(counts, BLOCK_M, TAIL)
    tl.store(cursor_ptr + s, start, mask=s < num_slots)
    for b0 in range(0, num_blocks, BLOCK_B):
        _block_layout(b0, s, start, nblk, blk_begin, last_rows, num_blocks, block_slot_ptr, block_start_ptr,
                      block_rows_ptr, BLOCK_M, BLOCK_B)
    for i0 in range(0, num_blocks * BLOCK_M, BLOCK):
        i = i0 + tl.arange(0, BLOCK)
        tl.store(sorted_ptr + i, tl.full([BLOCK], 0, tl.int32) + num_pairs, mask=i < num_blocks * BLOCK_M)
    tl.debug_barrier()
    pos = tl.atomic_add(cursor_ptr + tl.where(ok, key, 0), tl.full([N_PAD], 1, tl.int32), mask=ok)
    tl.store(sorted_ptr + pos, idx.to(tl.int32), mask=ok)


@triton.jit
def _scatter_kernel(slots_ptr, cursor_ptr, sorted_ptr, num_pairs, num_slots, BLOCK: tl.constexpr):
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    key = tl.load(slots_ptr + idx, mask=idx < num_pairs, other=-1)
    ok = (key >= 0) & (key < num_slots)
    pos = tl.atomic_add(cursor_ptr + tl.where(ok, key, 0), tl.full([BLOCK], 1, tl.int32), mask=ok)
    tl.store(sorted_ptr + pos, idx.to(tl.int32), mask=ok)


def align_triton(topk_slots: torch.Tensor, num_slots: int, block_m: int, half_tail: bool = False,
                 tail_rows: int | None = None) -> Alignment:
    """Same blocks as ``align_reference`` (order inside a slot may differ: atomics); CUDA-graph safe.

    Up to ``_SMALL_ALIGN`` (pairs x slots, both padded to powers of two) one program does it all in one
    launch (decode: launches dominate); above, a sentinel fill, a count, an offsets and a scatter launch (the
    one program's work grows with pairs x slots; the bound is from H200 timings of both ways as CUDA-graph
    replays).

    Args:
        topk_slots: ``[T, K]`` int64 CUDA local slot ids, ``-1`` = skip.
        num_slots: ``S``.
        block_m: rows per full block.
        half_tail: half-size last blocks (see ``align``).
        tail_rows: last blocks rounded up to a multiple of this many rows (see ``align``; overrides ``half_tail``).

    Raises:
        ValueError: as ``align.align_reference``.
    """
    tail = tail_rows_of(block_m, half_tail, tail_rows)
    device = topk_slots.device
    n = topk_slots.numel()
    nb = num_aligned_blocks(n, num_slots, block_m)
    flat = topk_slots.reshape(-1)
    cursor = torch.empty(num_slots, dtype=torch.int32, device=device)
    layout = torch.empty(3, nb, dtype=torch.int32, device=device)
    block_slot, block_start, block_rows = layout.unbind(0)
    s_pad = triton.next_power_of_2(num_slots)
    n_pad = triton.next_power_of_2(max(n, 16))
    if n_pad * s_pad <= _SMALL_ALIGN:
        sorted_ids = torch.empty(nb * block_m, dtype=torch.int32, device=device)
        _align_small_kernel[(1,)](
            flat, cursor, block_slot, block_start, block_rows, sorted_ids, n, num_slots, nb,
            BLOCK_M=block_m, TAIL=tail, S_PAD=s_pad, N_PAD=n_pad, BLOCK_B=max(16, 8192 // s_pad),
            BLOCK=1024, num_warps=8,
        )
    else:
        sorted_ids = torch.full((nb * block_m,), n, dtype=torch.int32, device=device)
        counts = torch.zeros(num_slots, dtype=torch.int32, device=device)
        block = 1024
        grid = (max(1, triton.cdiv(n, block)),)
        _count_kernel[grid](flat, counts, n, num_slots, BLOCK=block)
        block_b = max(8, 2048 // s_pad)
        _offsets_kernel[(triton.cdiv(nb, block_b),)](
            counts, cursor, block_slot, block_start, block_rows, num_slots, nb,
            BLOCK_M=block_m, TAIL=tail, S_PAD=s_pad, BLOCK_B=block_b, num_warps=4,
        )
        _scatter_kernel[grid](flat, cursor, sorted_ids, n, num_slots, BLOCK=block)
    return Alignment(sorted_ids, block_slot, block_start, block_rows, block_m)
