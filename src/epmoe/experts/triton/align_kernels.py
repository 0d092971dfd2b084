"""The Triton alignment (``align_triton``): ``align.align_reference``'s padded slot blocks computed on the GPU, in
static grids and without host synchronisation (CUDA-graph safe); the order of pairs inside a slot may differ (atomics).

Up to ``ONE_PROGRAM_PAIRS`` pairs and ``ONE_PROGRAM_SLOTS`` slots, one program does it all (``align_program``, one
launch: at decode sizes the launches are what the alignment costs); its work grows with the pairs plus the slots
times their most blocks, not with pairs times slots:

1. per-slot pair counts as histograms of ``BLOCK`` pairs at a time, in registers;
2. each slot's first padded position and blocks (``_slot_layout``); each block's slot, first position and rows
   stored slot-wise, one store per slot and block, and the blocks past the last used marked unused;
3. the padding positions (each slot's last block past its rows, and the positions past the last used block) given
   the sentinel pair id;
4. each pair takes a position in its slot's group (atomics on the slots' cursors; the order inside a group does not
   change any row's result).

Kernels of other launches may run ``align_program`` in one of their programs (``w4a16_mma``'s prologue does, beside
the activation copy). Above those sizes, five launches of many programs: a sentinel fill, a zero fill of the counts,
``_count_kernel`` (counts with atomics), ``_offsets_kernel`` (one program per group of row blocks, each recomputing
the per-slot prefix sums) and ``_scatter_kernel`` (as 4).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from epmoe.experts.triton.align import Alignment, num_aligned_blocks, tail_rows_of

ONE_PROGRAM_PAIRS = 2048
"""Most pairs ``align_program`` takes in one program (``align_triton``; set from H100 timings of both ways as CUDA-graph
replays, ``benchmarks/align.py``)."""
ONE_PROGRAM_SLOTS = 2048
"""Most slots ``align_program`` takes in one program (its per-slot vectors are ``next_power_of_2(S)`` long)."""
PROGRAM_BLOCK = 1024
"""Pairs (or positions) a step of ``align_program`` handles (its ``BLOCK``)."""


@triton.jit
def _count_kernel(slots_ptr, counts_ptr, num_pairs, num_slots, BLOCK: tl.constexpr):
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    key = tl.load(slots_ptr + idx, mask=idx < num_pairs, other=-1)
    ok = (key >= 0) & (key < num_slots)
    tl.atomic_add(counts_ptr + tl.where(ok, key, 0), tl.full([BLOCK], 1, tl.int32), mask=ok)


@triton.jit
def _slot_layout(counts, BLOCK_M: tl.constexpr, TAIL: tl.constexpr):
    """From per-slot row counts ``[S_PAD]``: each slot's first padded position, blocks, first block, rows of its last
    block (rounded up to a multiple of ``TAIL``) and padded rows (``align.align_reference`` computes the same)."""
    nblk = (counts + BLOCK_M - 1) // BLOCK_M
    if TAIL < BLOCK_M:
        last_rows = (counts - (nblk - 1) * BLOCK_M + TAIL - 1) // TAIL * TAIL
    else:
        last_rows = tl.full(counts.shape, BLOCK_M, tl.int32)
    padded = tl.where(counts > 0, (nblk - 1) * BLOCK_M + last_rows, 0)
    blk_end = tl.cumsum(nblk, 0)
    return tl.cumsum(padded, 0) - padded, nblk, blk_end - nblk, last_rows, padded


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
    start, nblk, blk_begin, last_rows, _ = _slot_layout(counts, BLOCK_M, TAIL)
    if tl.program_id(0) == 0:
        tl.store(cursor_ptr + s, start, mask=s < num_slots)
    _block_layout(tl.program_id(0) * BLOCK_B, s, start, nblk, blk_begin, last_rows, num_blocks, block_slot_ptr,
                  block_start_ptr, block_rows_ptr, BLOCK_M, BLOCK_B)


@triton.jit
def align_program(
    slots_ptr, cursor_ptr, block_slot_ptr, block_start_ptr, block_rows_ptr, sorted_ptr, num_pairs, num_slots,
    num_blocks, BLOCK_M: tl.constexpr, TAIL: tl.constexpr, S_PAD: tl.constexpr, BLOCK: tl.constexpr,
):
    """The whole alignment in the calling program (see the module docstring): ``slots [N]`` int64 -> the
    ``Alignment``'s ``block_slot``, ``block_start``, ``block_rows [num_blocks]`` and ``sorted [num_blocks * BLOCK_M]``
    int32; ``cursor [S]`` int32 is scratch. ``S_PAD`` is ``next_power_of_2(num_slots)``."""
    counts = tl.zeros([S_PAD], tl.int32)
    for i0 in range(0, num_pairs, BLOCK):
        idx = i0 + tl.arange(0, BLOCK)
        key = tl.load(slots_ptr + idx, mask=idx < num_pairs, other=-1)
        ok = (key >= 0) & (key < num_slots)
        counts += tl.histogram(tl.where(ok, key, 0).to(tl.int32), S_PAD, mask=ok)
    s = tl.arange(0, S_PAD)
    start, nblk, blk_begin, last_rows, padded = _slot_layout(counts, BLOCK_M, TAIL)
    tl.store(cursor_ptr + s, start, mask=s < num_slots)
    for j in range(0, tl.max(nblk, 0)):  # block j of every slot that has one (a slot past num_slots has none)
        has = j < nblk
        b = blk_begin + j
        tl.store(block_slot_ptr + b, s, mask=has)
        tl.store(block_start_ptr + b, start + j * BLOCK_M, mask=has)
        tl.store(block_rows_ptr + b, tl.where(j == nblk - 1, last_rows, BLOCK_M), mask=has)
    for b0 in range(tl.sum(nblk, 0), num_blocks, BLOCK):  # the blocks past the last used
        b = b0 + tl.arange(0, BLOCK)
        unused = b < num_blocks
        tl.store(block_slot_ptr + b, tl.full([BLOCK], -1, tl.int32), mask=unused)
        tl.store(block_start_ptr + b, tl.zeros([BLOCK], tl.int32), mask=unused)
        tl.store(block_rows_ptr + b, tl.zeros([BLOCK], tl.int32), mask=unused)
    sentinel = tl.zeros([S_PAD], tl.int32) + num_pairs
    for r in range(0, tl.max(padded - counts, 0)):  # each slot's last block past its rows
        tl.store(sorted_ptr + start + counts + r, sentinel, mask=r < padded - counts)
    for i0 in range(tl.sum(padded, 0), num_blocks * BLOCK_M, BLOCK):  # the positions past the last used block
        i = i0 + tl.arange(0, BLOCK)
        tl.store(sorted_ptr + i, tl.zeros([BLOCK], tl.int32) + num_pairs, mask=i < num_blocks * BLOCK_M)
    tl.debug_barrier()  # the cursors stored above, before any thread's atomics on them
    for i0 in range(0, num_pairs, BLOCK):
        idx = i0 + tl.arange(0, BLOCK)
        key = tl.load(slots_ptr + idx, mask=idx < num_pairs, other=-1)
        ok = (key >= 0) & (key < num_slots)
        pos = tl.atomic_add(cursor_ptr + tl.where(ok, key, 0), tl.full([BLOCK], 1, tl.int32), mask=ok)
        tl.store(sorted_ptr + pos, idx.to(tl.int32), mask=ok)


@triton.jit
def _align_one_kernel(
    slots_ptr, cursor_ptr, block_slot_ptr, block_start_ptr, block_rows_ptr, sorted_ptr, num_pairs, num_slots,
    num_blocks, BLOCK_M: tl.constexpr, TAIL: tl.constexpr, S_PAD: tl.constexpr, BLOCK: tl.constexpr,
):
    align_program(slots_ptr, cursor_ptr, block_slot_ptr, block_start_ptr, block_rows_ptr, sorted_ptr, num_pairs,
                  num_slots, num_blocks, BLOCK_M, TAIL, S_PAD, BLOCK)


def one_program(num_pairs: int, num_slots: int) -> bool:
    """Whether ``align_program`` takes ``num_pairs`` pairs over ``num_slots`` slots in one program."""
    return num_pairs <= ONE_PROGRAM_PAIRS and num_slots <= ONE_PROGRAM_SLOTS


@triton.jit
def _scatter_kernel(slots_ptr, cursor_ptr, sorted_ptr, num_pairs, num_slots, BLOCK: tl.constexpr):
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    key = tl.load(slots_ptr + idx, mask=idx < num_pairs, other=-1)
    ok = (key >= 0) & (key < num_slots)
    pos = tl.atomic_add(cursor_ptr + tl.where(ok, key, 0), tl.full([BLOCK], 1, tl.int32), mask=ok)
    tl.store(sorted_ptr + pos, idx.to(tl.int32), mask=ok)


def alignment_buffers(num_pairs: int, num_slots: int, block_m: int,
                      device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The uninitialised int32 buffers of an alignment: the slots' cursors ``[S]`` (scratch), the blocks' slot, first
    position and rows ``[3, NB]`` and the sorted pair ids ``[NB * block_m]`` (``NB = num_aligned_blocks``)."""
    nb = num_aligned_blocks(num_pairs, num_slots, block_m)
    return (torch.empty(num_slots, dtype=torch.int32, device=device),
            torch.empty(3, nb, dtype=torch.int32, device=device),
            torch.empty(nb * block_m, dtype=torch.int32, device=device))


def align_triton(topk_slots: torch.Tensor, num_slots: int, block_m: int, half_tail: bool = False,
                 tail_rows: int | None = None) -> Alignment:
    """Same blocks as ``align_reference`` (order inside a slot may differ: atomics); CUDA-graph safe.

    One launch of one program where ``one_program`` takes the sizes (decode: launches dominate); above, five
    launches: a sentinel fill, a zero fill of the counts, and the count, offsets and scatter kernels.

    Args:
        topk_slots: ``[T, K]`` int64 CUDA local slot ids; an id outside ``[0, S)`` (``-1``) skips.
        num_slots: ``S``.
        block_m: rows per full block.
        half_tail: half-size last blocks (see ``align``).
        tail_rows: last blocks rounded up to a multiple of this many rows (see ``align``; overrides ``half_tail``).

    Raises:
        ValueError: as ``align.align_reference``.
    """
    tail = tail_rows_of(block_m, half_tail, tail_rows)
    n = topk_slots.numel()
    flat = topk_slots.reshape(-1)
    cursor, layout, sorted_ids = alignment_buffers(n, num_slots, block_m, topk_slots.device)
    block_slot, block_start, block_rows = layout.unbind(0)
    nb = block_slot.numel()
    s_pad = triton.next_power_of_2(num_slots)
    if one_program(n, num_slots):
        _align_one_kernel[(1,)](flat, cursor, block_slot, block_start, block_rows, sorted_ids, n, num_slots, nb,
                                BLOCK_M=block_m, TAIL=tail, S_PAD=s_pad, BLOCK=PROGRAM_BLOCK, num_warps=8)
    else:
        sorted_ids.fill_(n)
        counts = torch.zeros(num_slots, dtype=torch.int32, device=topk_slots.device)
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
