"""Routing-to-slot alignment: the (token, k) pairs grouped by slot, each group padded to whole blocks.

A grouped GEMM over the rows of many experts works on row blocks that all belong to one slot. The
alignment sorts the ``N = T * K`` (token, k) pairs by slot and pads each slot's group with a sentinel
pair id ``N``: a slot of ``c`` rows gets ``ceil(c / block_m)`` blocks of ``block_m`` rows, and with
``half_tail`` its last block has ``block_m / 2`` rows when at most that many rows are left, so the
padding computed is under ``block_m / 2`` rows per slot instead of under ``block_m`` (at 4096 tokens and
about 256 rows per expert, a 1.25x padded GEMM becomes about 1.12x); more generally ``tail_rows`` rounds the
rows of a slot's last block up to a multiple of ``tail_rows`` (``half_tail``: ``block_m / 2``; the INT4 wgmma
kernels also take ``block_m / 4``: a last block of 32, 64, 96 or 128 rows). Block ``b`` covers sorted positions
``[block_start[b], block_start[b] + block_rows[b])`` of slot ``block_slot[b]``. Pairs whose slot is outside
``[0, S)`` (``-1``: served on another rank) are left out. All sizes are static functions of ``(N, S, block_m)``, so
nothing reads the routing on the host: the alignment can be captured in a CUDA graph.

The padded-block layout follows vLLM's ``moe_align_block_size`` (vllm/model_executor/layers/fused_moe)
and SGLang's kernel of the same name; the half-size last block and this implementation are our own.
``align_kernels.align_triton`` produces the same blocks on the GPU (the order of pairs inside a slot may differ:
it uses atomics) and is checked against ``align_reference``. This module needs no Triton.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def num_aligned_blocks(num_pairs: int, num_slots: int, block_m: int) -> int:
    """Static upper bound on the number of row blocks: ``min(ceil(N / block_m) + S, N)``, at least 1.

    Each non-empty block holds at least one pair (so at most ``N`` blocks), and a slot has less than one
    block more than its rows fill. Sorted positions are at most ``NB * block_m``.

    Args:
        num_pairs: ``N = T * K`` (token, k) pairs.
        num_slots: ``S`` local slots.
        block_m: rows per block.
    """
    return max(1, min(-(-num_pairs // block_m) + num_slots, num_pairs))


@dataclass(frozen=True)
class Alignment:
    """The pairs grouped by slot, padded to blocks.

    Attributes:
        sorted_pair_ids: ``[NB * block_m]`` int32 pair id ``t * K + k`` at each sorted position;
            ``N`` = padding.
        block_slot: ``[NB]`` int32 slot of each block, ``-1`` = block unused.
        block_start: ``[NB]`` int32 first sorted position of each block (0 for unused blocks).
        block_rows: ``[NB]`` int32 rows of each block: ``block_m``, a multiple of the tail rows below it (a
            slot's last block; ``block_m // 2`` with ``half_tail``) or 0 (unused).
        block_m: rows of a full block.
    """

    sorted_pair_ids: torch.Tensor
    block_slot: torch.Tensor
    block_start: torch.Tensor
    block_rows: torch.Tensor
    block_m: int


def tail_rows_of(block_m: int, half_tail: bool, tail_rows: int | None) -> int:
    """The rows a slot's last block is rounded up to a multiple of: ``tail_rows``, else ``block_m / 2`` with
    ``half_tail``, else ``block_m``.

    Raises:
        ValueError: ``block_m`` not positive, odd with ``half_tail``, or ``tail_rows`` not a positive divisor of it.
    """
    if block_m <= 0 or (half_tail and block_m % 2):
        raise ValueError(f"block_m must be positive (and even with half_tail), got {block_m}")
    if tail_rows is None:
        return block_m // 2 if half_tail else block_m
    if tail_rows <= 0 or block_m % tail_rows:
        raise ValueError(f"tail_rows must be a positive divisor of block_m ({block_m}), got {tail_rows}")
    return tail_rows


def align_reference(topk_slots: torch.Tensor, num_slots: int, block_m: int, half_tail: bool = False,
                    tail_rows: int | None = None) -> Alignment:
    """Align pairs to slot blocks with plain PyTorch ops (no host sync; stable order within a slot).

    Args:
        topk_slots: ``[T, K]`` int64 local slot ids; an id outside ``[0, S)`` (``-1``) skips.
        num_slots: ``S``.
        block_m: rows per full block (positive; even when ``half_tail``).
        half_tail: give a slot's last block ``block_m // 2`` rows when at most that many are left.
        tail_rows: give a slot's last block its rows rounded up to a multiple of ``tail_rows`` (a divisor of
            ``block_m``; overrides ``half_tail``).

    Returns:
        The ``Alignment``; ``NB = num_aligned_blocks(T * K, S, block_m)``.

    Raises:
        ValueError: ``block_m`` not positive, odd with ``half_tail``, or ``tail_rows`` not a divisor of it.
    """
    tail = tail_rows_of(block_m, half_tail, tail_rows)
    device = topk_slots.device
    n = topk_slots.numel()
    nb = num_aligned_blocks(n, num_slots, block_m)
    key = torch.where((topk_slots >= 0) & (topk_slots < num_slots), topk_slots, num_slots).reshape(-1)
    counts = torch.zeros(num_slots + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    counts = counts[:num_slots]
    nblk = (counts + block_m - 1) // block_m
    last = counts - (nblk - 1) * block_m
    last_rows = (last + tail - 1) // tail * tail
    padded = torch.where(counts > 0, (nblk - 1) * block_m + last_rows, 0)
    padded_start = torch.cumsum(padded, 0) - padded
    group_start = torch.cumsum(counts, 0) - counts

    order = torch.argsort(key, stable=True)
    sorted_key = key[order]
    valid = sorted_key < num_slots
    safe_key = sorted_key.clamp(max=num_slots - 1)
    rank_in_slot = torch.arange(n, device=device) - group_start[safe_key]
    dest = torch.where(valid, padded_start[safe_key] + rank_in_slot, nb * block_m)
    sorted_pair_ids = torch.full((nb * block_m + 1,), n, dtype=torch.int32, device=device)
    sorted_pair_ids.scatter_(0, dest, order.to(torch.int32))

    blk_end = torch.cumsum(nblk, 0)
    b = torch.arange(nb, device=device)
    slot = torch.searchsorted(blk_end, b, right=True)
    used = slot < num_slots
    safe = slot.clamp(max=num_slots - 1)
    j = b - (blk_end - nblk)[safe]
    start = torch.where(used, padded_start[safe] + j * block_m, 0)
    rows = torch.where(used, torch.where(j == nblk[safe] - 1, last_rows[safe], block_m), 0)
    return Alignment(sorted_pair_ids[:-1], torch.where(used, slot, -1).to(torch.int32), start.to(torch.int32),
                     rows.to(torch.int32), block_m)
