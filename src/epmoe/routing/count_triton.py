"""Counting routed (token, k) pairs per physical slot as one Triton kernel (CUDA): ``loads.ExpertLoadRecorder.record``.

The PyTorch composition launches about seven kernels per MoE layer and step (the ``-1`` test and
replacement, the window offset's integer arithmetic, the row mask's expansion, the index sum, the
scatter), which in a CUDA-graph-replayed decode step at one token cost several times the layer's routing
itself. Here one program per ``BLOCK`` (token, k) pairs reads the window position and the row mask on the
device and adds each counted pair to its slot's count with an integer atomic: same counts, exactly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 256


@triton.jit
def add_slot_counts(counts_ptr, pos_ptr, layer, num_layers, width, slots, m, ok):
    """Add ``m`` (int64, 0 = not counted) to the current window step's count of each slot in ``slots`` of layer
    ``layer`` (ids outside ``[0, width - 1)`` to column ``width - 1``) where ``ok``; shared with the fused router."""
    col = tl.where((slots >= 0) & (slots < width - 1), slots, width - 1)
    row = (tl.load(pos_ptr) * num_layers + layer) * width
    tl.atomic_add(counts_ptr + row + col, m, mask=ok & (m != 0))


@triton.jit
def _record_kernel(slots_ptr, mask_ptr, pos_ptr, counts_ptr, n, layer, num_layers, width,
                   K: tl.constexpr, HAS_MASK: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    s = tl.load(slots_ptr + i, mask=ok, other=-1)
    if HAS_MASK:
        m = tl.load(mask_ptr + i // K, mask=ok, other=0).to(tl.int64)
    else:
        m = tl.full([BLOCK], 1, tl.int64)
    add_slot_counts(counts_ptr, pos_ptr, layer, num_layers, width, s, m, ok)


def count_slots_triton(counts: torch.Tensor, pos: torch.Tensor, layer: int, topk_slots: torch.Tensor,
                  row_mask: torch.Tensor | None) -> None:
    """Add one forward's routing to ``counts`` (the recorder's arguments, checked there; imports nothing else of
    the package).

    Args:
        counts: ``[W, L, P + 1]`` int64 contiguous window of counts (column ``P`` takes the ``-1`` entries).
        pos: ``[1]`` int64 window position of the current step.
        layer: MoE layer index.
        topk_slots: ``[T, K]`` int64 contiguous global physical slot ids, ``-1`` = none.
        row_mask: ``[T]`` int64 (1 = count the row), or ``None`` = every row.
    """
    t, k = topk_slots.shape
    n = t * k
    if n == 0:
        return
    mask = row_mask if row_mask is not None else topk_slots
    _record_kernel[(triton.cdiv(n, _BLOCK),)](
        topk_slots, mask, pos, counts, n, layer, counts.shape[1], counts.shape[2],
        K=k, HAS_MASK=row_mask is not None, BLOCK=_BLOCK, num_warps=4,
    )
