"""Routing-to-slot alignment: the (token, k) pairs grouped by slot, each group padded to a block.

A grouped GEMM over the rows of many experts works on row blocks of ``block_m`` rows that all belong to
one slot. The alignment sorts the ``N = T * K`` (token, k) pairs by slot and pads each slot's group to a
multiple of ``block_m`` with a sentinel pair id ``N``, so block ``b`` covers sorted positions
``[b * block_m, (b + 1) * block_m)`` of slot ``block_slot[b]``. Pairs whose slot is ``-1`` (served on
another rank) are left out. All sizes are static functions of ``(N, S, block_m)``, so nothing reads the
routing on the host: the alignment can be captured in a CUDA graph.

The padded-block layout follows vLLM's ``moe_align_block_size`` (vllm/model_executor/layers/fused_moe)
and SGLang's kernel of the same name; this is our own implementation of the idea. The Triton version
in ``triton_moe`` produces the same groups (the order of pairs inside a slot may differ: it uses
atomics) and is checked against this one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def num_aligned_blocks(num_pairs: int, num_slots: int, block_m: int) -> int:
    """Static upper bound on the number of row blocks: ``min(ceil(N / block_m) + S, N)``, at least 1.

    Each non-empty block holds at least one pair (so at most ``N`` blocks), and padding adds less than
    one block per slot.

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
        block_m: rows per block.
    """

    sorted_pair_ids: torch.Tensor
    block_slot: torch.Tensor
    block_m: int


def align_reference(topk_slots: torch.Tensor, num_slots: int, block_m: int) -> Alignment:
    """Align pairs to slot blocks with plain PyTorch ops (no host sync; stable order within a slot).

    Args:
        topk_slots: ``[T, K]`` int64 local slot ids in ``[0, S)``, ``-1`` = skip.
        num_slots: ``S``.
        block_m: rows per block (positive).

    Returns:
        The ``Alignment``; ``NB = num_aligned_blocks(T * K, S, block_m)``.

    Raises:
        ValueError: ``block_m`` not positive.
    """
    if block_m <= 0:
        raise ValueError(f"block_m must be positive, got {block_m}")
    device = topk_slots.device
    n = topk_slots.numel()
    nb = num_aligned_blocks(n, num_slots, block_m)
    key = torch.where(topk_slots >= 0, topk_slots, num_slots).reshape(-1)
    counts = torch.zeros(num_slots + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    counts = counts[:num_slots]
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    padded_start = padded_end - padded
    group_start = torch.cumsum(counts, 0) - counts

    order = torch.argsort(key, stable=True)
    sorted_key = key[order]
    valid = sorted_key < num_slots
    safe_key = sorted_key.clamp(max=num_slots - 1)
    rank_in_slot = torch.arange(n, device=device) - group_start[safe_key]
    dest = torch.where(valid, padded_start[safe_key] + rank_in_slot, nb * block_m)
    sorted_pair_ids = torch.full((nb * block_m + 1,), n, dtype=torch.int32, device=device)
    sorted_pair_ids.scatter_(0, dest, order.to(torch.int32))

    block_row = torch.arange(nb, device=device) * block_m
    block_slot = torch.searchsorted(padded_end, block_row, right=True)
    block_slot = torch.where(block_slot < num_slots, block_slot, -1).to(torch.int32)
    return Alignment(sorted_pair_ids[:-1], block_slot, block_m)
