"""MXFP4 expert compute on CUDA, always on the packed weights: the decode kernels of ``w4a16_decode`` for a few pairs,
above them (bf16 on Hopper) the tensor-core kernels of ``w4a16_mma`` and ``w4a16_wgmma``, which widen the blocks, read
as INT4's words, into the MMA registers, or (fp16, other GPUs) the grouped kernels of ``grouped`` widening the packed
tiles in registers (``w4a16``); and, for comparison in ``benchmarks/moe_layer.py``, the widening path (the slots in
use widened to the compute dtype in memory, then the bf16 grouped kernels).

Decode (``w4a16_decode.packed_decode_experts``, the backend's path up to ``MXFP4_BACKEND_DECODE_PAIRS`` pairs): the
INT4 decode kernels, a block's 16 bytes read as four words and its E8M0 byte as the group scale, each E2M1 code
widened through fp16 (see ``w4a16_decode``). A pair reads 17 bytes per 32 weights, against the widening path's 17
read, 64 written and 64 read again in bf16.

``_dequantize_kernel``, grid ``(S * N, cdiv(K / 32, BLOCK_B))``: program ``(r, j)`` reads ``BLOCK_B`` 16-byte
blocks of weight row ``r`` and their E8M0 scales and writes the ``32 * BLOCK_B`` values; rows of slots without a
live pair exit at once. An E2M1 code ``c`` (sign ``c >> 3``, exponent ``(c >> 1) & 3``, mantissa ``c & 1``) is
decoded arithmetically, and the block scale ``2 ** (s - 127)`` is built from its bits (``s << 23`` as a float32;
``s = 0`` is ``2 ** -127``, a subnormal), so the widened values equal ``experts.mxfp4.dequantize_mxfp4``'s.
The weights stay MXFP4 in memory; the widened copy is a workspace of each call (the size of the bf16 experts).

Source: E2M1 and E8M0 as the OCP Microscaling Formats (MX) v1.0 specification defines them; placing a narrow
format's bits in a wider float's is the widening trick of the W4A16 kernels (``w4a16``: FasterTransformer, Marlin);
the code is our own.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import triton
import triton.language as tl

from epmoe.experts.mxfp4 import MXFP4_BLOCK, MXFP4_BYTES, MXFP4ExpertWeights
from epmoe.experts.triton.grouped import TileConfig, default_int4_config, grouped_experts, triton_experts
from epmoe.experts.triton.w4a16_decode import PackedDecodeConfig, packed_decode_experts
from epmoe.experts.triton.w4a16_mma import packed_mma_experts
from epmoe.experts.triton.w4a16_mma_config import default_mma_config
from epmoe.experts.triton.w4a16_wgmma import packed_wgmma_experts
from epmoe.experts.triton.w4a16_wgmma_config import WGMMA_DOWN_REGS, WgmmaConfig, default_wgmma_config
from epmoe.experts.weights import Activation, ExpertWeights, check_expert_call

MXFP4_BACKEND_DECODE_PAIRS = 8
"""``mxfp4_path`` takes the decode kernels up to this many pairs (two tokens at gpt-oss's top-4), the tensor-core (or
grouped) kernels above: a decode pair reads its expert's weights on its own, a row block reads them once for the
slot's pairs. Set from an H100 A/B of the decode kernels with ``MXFP4_DECODE_CONFIG`` against the MMA kernels at
one and two tokens of gpt-oss-20b's and gpt-oss-120b's layers (README, "MXFP4 decode on INT4's kernels"): faster at
both."""

MXFP4_DECODE_CONFIG = PackedDecodeConfig(block_n1=2, block_kw1=128, block_n2=8, block_kw2=128, num_warps=1,
                                         max_programs=16384)
"""The decode kernels' tiles for MXFP4 (``PackedDecodeConfig``'s defaults are INT4's): half the gate/up rows a
program, so twice the programs over gpt-oss's 2880-wide rows, and up to 16384 programs a launch instead of 1024 (at
one token gpt-oss's gate/up rows make 11520 tiles of two: a capped grid loops over them). The fastest at one token of
gpt-oss-20b's layer in the H200 sweep of ``MXFP4_DECODE_SWEEP`` and within 1% of the fastest at two, and the fastest
of three caps through the engine at batch 1 and 8 on an H100 (``benchmarks/HISTORY.md``, twenty-first session).
``benchmarks/moe_layer.py --sweep`` times ``MXFP4_DECODE_SWEEP`` beside it."""


MXFP4_WGMMA_MIN_PAIRS_PER_SLOT = 16
"""``mxfp4_path`` takes the wgmma kernels (Hopper, bf16) from this many pairs a local slot on average, the MMA
kernels below (as ``int4.INT4_WGMMA_MIN_PAIRS_PER_SLOT``). The H100 run of ``benchmarks/moe_layer.py --cases
gptoss20b_mxfp4,gptoss_mxfp4`` (``moe_layer_mxfp4_mma_h100.json``) has the MMA kernels faster at 8 pairs a slot and
the wgmma kernels faster at 32."""


def mxfp4_wgmma_config(num_pairs: int, num_slots: int) -> WgmmaConfig:
    """The wgmma tiles ``mxfp4_experts`` takes for ``num_pairs`` expected pairs over ``num_slots`` local slots:
    ``default_wgmma_config``'s (groups of ``MXFP4_BLOCK``), with the down program's steps of 16 words and its registers
    capped at ``WGMMA_DOWN_REGS`` at every block size, so two programs share an SM. Set from an H100 A/B of the wgmma
    kernels at 256-4096 tokens of gpt-oss-20b's and gpt-oss-120b's layers against ``default_wgmma_config``'s down tiles
    of then (README's gpt-oss section, and ``benchmarks/results/mxfp4_wgmma_down_regs_h100.txt``): faster at every
    size. INT4 takes them with its 128-row blocks only: with 64-row blocks (1024 and 2048 tokens of Kimi-K2.5's layer)
    they were slower."""
    return replace(default_wgmma_config(MXFP4_BLOCK, num_pairs, num_slots), block_kw2=16, maxnreg2=WGMMA_DOWN_REGS)


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
    """MXFP4 expert compute on CUDA (contract of ``experts.ExpertBackend``; graph safe), on the packed weights, by
    ``mxfp4_path`` of the larger of ``T * K`` and the expected pairs: ``w4a16_decode.packed_decode_experts`` up to
    ``MXFP4_BACKEND_DECODE_PAIRS``, above them for bf16 on Hopper the tensor-core kernels of ``w4a16_mma`` or (from
    ``MXFP4_WGMMA_MIN_PAIRS_PER_SLOT`` pairs a slot) ``w4a16_wgmma``, otherwise ``mxfp4_grouped_experts``.

    Raises:
        ValueError: operands of other shapes than ``experts.weights.check_expert_call`` takes.
        TypeError: ``x`` not bf16/fp16.
    """
    check_expert_call(x, topk_slots, topk_weights, weights.hidden_size, as_read=False)
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"the triton expert backend computes in bf16 or fp16, got x of dtype {x.dtype}")
    n = topk_slots.numel()
    if n == 0:  # no pair: no expert adds to any row
        return torch.zeros(x.shape, dtype=x.dtype, device=x.device)
    x = x if x.stride(1) == 1 else x.contiguous()
    slots, tw = topk_slots.contiguous(), topk_weights.float().contiguous()
    expected = n if expected_pairs is None else expected_pairs
    s = weights.num_slots
    path = mxfp4_path(max(n, expected), x.dtype, s, x.is_cuda and torch.cuda.get_device_capability(x.device) == (9, 0))
    if path == "decode":
        return packed_decode_experts(x, slots, tw, weights, activation, weight_on_input, MXFP4_DECODE_CONFIG)
    if path == "wgmma":
        return packed_wgmma_experts(x, slots, tw, weights, activation, weight_on_input,
                                    mxfp4_wgmma_config(expected, s))
    if path == "mma":
        return packed_mma_experts(x, slots, tw, weights, activation, weight_on_input,
                                  default_mma_config(MXFP4_BLOCK, expected, s))
    return mxfp4_grouped_experts(x, slots, tw, weights, activation, weight_on_input, default_int4_config(expected, s))


def mxfp4_path(num_pairs: int, dtype: torch.dtype, num_slots: int, hopper: bool = False) -> str:
    """The path ``mxfp4_experts`` takes for ``num_pairs`` pairs (the larger of those in the call and those expected)
    of activations in ``dtype`` over ``num_slots`` local slots on a GPU of compute capability 9.0 (``hopper``) or
    another: ``"decode"`` up to ``MXFP4_BACKEND_DECODE_PAIRS``; above, bf16 on Hopper ``"wgmma"`` from
    ``MXFP4_WGMMA_MIN_PAIRS_PER_SLOT`` pairs a slot on, else ``"mma"`` (the packed kernels of ``w4a16_mma`` and
    ``w4a16_wgmma``, which widen the words into the tensor cores' registers); fp16, or bf16 on other GPUs,
    ``"grouped"``."""
    if num_pairs <= MXFP4_BACKEND_DECODE_PAIRS:
        return "decode"
    if dtype != torch.bfloat16 or not hopper:
        return "grouped"
    return "wgmma" if num_pairs >= MXFP4_WGMMA_MIN_PAIRS_PER_SLOT * num_slots else "mma"


def mxfp4_grouped_experts(
    x: torch.Tensor,
    topk_slots: torch.Tensor,
    topk_weights: torch.Tensor,
    weights: MXFP4ExpertWeights,
    activation: Activation,
    weight_on_input: bool = False,
    config: TileConfig | None = None,
) -> torch.Tensor:
    """MXFP4 expert compute by the grouped kernels of ``grouped`` with the packed tiles widened in registers
    (``w4a16``): the pairs aligned to row blocks of one slot, each block's products on the tensor cores, reading
    the packed weights once per row block. Graph safe.

    Args:
        x: ``[T, D]`` bf16/fp16 (or float32) rows, contiguous along ``D``.
        topk_slots: ``[T, K]`` int64 local slot ids, contiguous; an id outside ``[0, S)`` (``-1``) skips.
        topk_weights: ``[T, K]`` float32 routing weights, contiguous.
        weights: the slots' MXFP4 weights (blocks contiguous, scales of a row contiguous: ``grouped.packed_words``).
        activation: the gated activation.
        weight_on_input: scale the expert input by the weight instead of its output.
        config: tile shapes (``block_k`` in inputs); ``grouped.default_int4_config`` of ``T * K`` pairs when
            ``None``.

    Returns:
        ``[T, D]`` in ``x.dtype``.

    Raises:
        ValueError: operands of other shapes or layouts than ``experts.weights.check_expert_call`` takes, blocks not
            contiguous or scale rows not contiguous (named), ``config.block_k`` not a power of two of at least 128.
    """
    cfg = config if config is not None else default_int4_config(topk_slots.numel(), weights.num_slots)
    return grouped_experts(x, topk_slots, topk_weights, weights, activation, weight_on_input, cfg)


def mxfp4_widened_experts(
    x: torch.Tensor,
    topk_slots: torch.Tensor,
    topk_weights: torch.Tensor,
    weights: MXFP4ExpertWeights,
    activation: Activation,
    weight_on_input: bool = False,
    *,
    expected_pairs: int | None = None,
) -> torch.Tensor:
    """The slots with live pairs widened to ``x.dtype`` (bf16/fp16), then ``grouped.triton_experts`` (given
    ``expected_pairs``; the bf16 decode kernels for a few pairs); a workspace of ``S * 3 * D * F`` elements of
    ``x.dtype``. Graph safe.

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
