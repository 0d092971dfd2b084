"""MXFP4 expert compute on CUDA: the slots in use widened to the compute dtype in one Triton launch, then the bf16
kernels of ``grouped`` (``triton_experts``: the decode kernels for few pairs, the grouped GEMMs above).

``_dequantize_kernel``, grid ``(S * N, cdiv(K / 32, BLOCK_B))``: program ``(r, j)`` reads ``BLOCK_B`` 16-byte
blocks of weight row ``r`` and their E8M0 scales and writes the ``32 * BLOCK_B`` values; rows of slots without a
live pair exit at once. An E2M1 code ``c`` (sign ``c >> 3``, exponent ``(c >> 1) & 3``, mantissa ``c & 1``) is
decoded arithmetically, and the block scale ``2 ** (s - 127)`` is built from its bits (``s << 23`` as a float32;
``s = 0`` is ``2 ** -127``, a subnormal), so the widened values equal ``experts.mxfp4.dequantize_mxfp4``'s.
The weights stay MXFP4 in memory; the widened copy is a workspace of each call (the size of the bf16 experts).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from epmoe.experts.mxfp4 import MXFP4_BLOCK, MXFP4_BYTES, MXFP4ExpertWeights
from epmoe.experts.triton.grouped import triton_experts
from epmoe.experts.weights import Activation, ExpertWeights, check_expert_call


@triton.jit
def _e2m1(code):
    """float32 value of 4-bit E2M1 codes (integer tensor)."""
    e = (code >> 1) & 3
    m = (code & 1).to(tl.float32)
    mag = tl.where(e == 0, 0.5 * m, (1.0 + 0.5 * m) * tl.where(e == 3, 4.0, tl.where(e == 2, 2.0, 1.0)))
    return tl.where((code >> 3) != 0, -mag, mag)


@triton.jit
def _dequantize_kernel(b_ptr, s_ptr, out_ptr, counts_ptr, NB, ROWS_PER_SLOT, BLOCK_B: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    if tl.load(counts_ptr + row // ROWS_PER_SLOT) == 0:
        return
    offs_b = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
    ok = offs_b < NB
    offs_j = tl.arange(0, 16)
    byte = tl.load(b_ptr + row * NB * 16 + offs_b[:, None] * 16 + offs_j[None, :], mask=ok[:, None], other=0)
    s = tl.load(s_ptr + row * NB + offs_b, mask=ok, other=127).to(tl.int32)
    scale = tl.where(s == 0, 2.0 ** -127, (s << 23).to(tl.float32, bitcast=True))[:, None]
    b = byte.to(tl.int32)
    dest = out_ptr + row * NB * 32 + offs_b[:, None] * 32 + 2 * offs_j[None, :]
    tl.store(dest, (_e2m1(b & 0xF) * scale).to(out_ptr.dtype.element_ty), mask=ok[:, None])
    tl.store(dest + 1, (_e2m1(b >> 4) * scale).to(out_ptr.dtype.element_ty), mask=ok[:, None])


def dequantize_mxfp4_triton(blocks: torch.Tensor, scales: torch.Tensor, out: torch.Tensor,
                            slot_counts: torch.Tensor) -> torch.Tensor:
    """Widen ``blocks [S, N, K/32, 16]`` uint8 / ``scales [S, N, K/32]`` uint8 (contiguous) into ``out [S, N, K]``
    (contiguous, its dtype) for the slots whose ``slot_counts [S (+ more)]`` int32 entry is not 0 (the other rows
    of ``out`` are left as they were); returns ``out``.

    Raises:
        ValueError: shapes that do not fit each other.
    """
    s, n, nb, width = blocks.shape
    if width != MXFP4_BYTES or tuple(scales.shape) != (s, n, nb) or tuple(out.shape) != (s, n, nb * MXFP4_BLOCK):
        raise ValueError(f"blocks {tuple(blocks.shape)}, scales {tuple(scales.shape)} and out {tuple(out.shape)} do "
                         f"not fit: expected [S, N, K/32, 16], [S, N, K/32] and [S, N, K]")
    block_b = min(64, triton.next_power_of_2(nb))
    _dequantize_kernel[(s * n, triton.cdiv(nb, block_b))](blocks, scales, out, slot_counts, nb, n, BLOCK_B=block_b)
    return out


def mxfp4_experts(
    x: torch.Tensor,
    topk_slots: torch.Tensor,
    topk_weights: torch.Tensor,
    weights: MXFP4ExpertWeights,
    activation: Activation,
    weight_on_input: bool = False,
    *,
    expected_pairs: int | None = None,
) -> torch.Tensor:
    """MXFP4 expert compute on CUDA (contract of ``experts.ExpertBackend``; graph safe): the slots with live pairs
    widened to ``x.dtype`` (bf16/fp16), then ``grouped.triton_experts`` (given ``expected_pairs``). Needs a workspace
    of ``S * 3 * D * F`` elements of ``x.dtype``.

    Raises:
        ValueError: operands of other shapes than ``experts.weights.check_expert_call`` takes.
        TypeError: ``x`` not bf16/fp16 (from ``triton_experts``).
    """
    check_expert_call(x, topk_slots, topk_weights, weights.hidden_size, as_read=False)
    s = weights.num_slots
    key = torch.where((topk_slots >= 0) & (topk_slots < s), topk_slots, s).reshape(-1)
    counts = torch.zeros(s + 1, dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, key, torch.ones_like(key, dtype=torch.int32))
    d, f = weights.hidden_size, weights.intermediate_size
    w13 = dequantize_mxfp4_triton(weights.w13_blocks, weights.w13_scales,
                                  torch.empty(s, 2 * f, d, dtype=x.dtype, device=x.device), counts)
    w2 = dequantize_mxfp4_triton(weights.w2_blocks, weights.w2_scales,
                                 torch.empty(s, d, f, dtype=x.dtype, device=x.device), counts)
    b13 = None if weights.b13 is None else weights.b13.to(x.dtype)
    b2 = None if weights.b2 is None else weights.b2.to(x.dtype)
    return triton_experts(x, topk_slots, topk_weights, ExpertWeights(w13, w2, b13, b2), activation, weight_on_input,
                          expected_pairs=expected_pairs)
