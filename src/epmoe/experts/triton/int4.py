"""W4A16 expert compute in Triton for INT4 group-quantized weights (``experts.int4``), bf16 activations.

The weights stay packed in HBM (a quarter of the bf16 bytes plus one scale per ``G`` inputs). Four paths, all
with static grids and no host synchronisation (CUDA-graph safe); ``int4_experts`` picks one from the number of
pairs ``N = T * K``, the activations' dtype and the local slots (``int4_path``; the switch points are set from the
H200 benchmark): for bf16 the tensor-core kernels of ``w4a16_mma`` (the words widened into the MMA registers) and
on Hopper, at prefill sizes, those of ``w4a16_wgmma`` (widened into the A operand of the warpgroup MMA), for a few
pairs the decode kernels of ``w4a16_decode`` (one matrix-vector product per pair on the CUDA cores; each pair re-reads
its expert's weights, so their cost grows with the pairs, the other paths' with the local slots in use), and the two
below:

Fused grouped (``int4_grouped_experts``): the grouped kernels of ``grouped`` (alignment of the pairs to row blocks
of one slot, gate/up and down GEMMs on the tensor cores, ``sum_pairs_kernel``) with the INT4 word tiles widened in
registers, one ``tl.dot`` per nibble of a step (the nibble-split product of ``w4a16``), the activations read from a
nibble-major copy; a slot's packed weights are read once per row block. Tile shapes from
``grouped.default_int4_config``.

Dequantized (``int4_dequantized_experts``): the slots that have at least one live pair are widened to the
compute dtype in one launch (``_dequantize_kernel``: one read of their packed weights, one
write of the widened ones, into a workspace the size of the bf16 experts; slots without pairs are skipped),
then ``grouped.triton_experts`` runs the grouped bf16 GEMMs on them. The weights are stored in INT4; this
path computes as the bf16 one does, plus the widening (kept beside the fused path for the benchmark's comparison).

Source: the packed format is compressed-tensors' ``pack-quantized`` (see ``experts.int4``); splitting the
widening from the GEMM for large batches is what vLLM's compressed-tensors MoE does where no fused W4A16 GEMM
applies. The code is our own.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from epmoe.experts.int4 import INT4_PACK, Int4ExpertWeights
from epmoe.experts.triton.decode import DECODE_MAX_PAIRS
from epmoe.experts.triton.grouped import TileConfig, default_int4_config, grouped_experts, triton_experts
from epmoe.experts.triton.w4a16_decode import packed_decode_experts
from epmoe.experts.triton.w4a16_mma import packed_mma_experts
from epmoe.experts.triton.w4a16_mma_config import default_mma_config
from epmoe.experts.triton.w4a16_wgmma import packed_wgmma_experts
from epmoe.experts.triton.w4a16_wgmma_config import default_wgmma_config
from epmoe.experts.weights import Activation, ExpertWeights, check_expert_call

INT4_DECODE_MAX_PAIRS = DECODE_MAX_PAIRS
"""``int4_experts`` takes the decode kernels for up to this many ``(token, k)`` pairs ``N = T * K`` (static: no look
at the routing), the fused grouped path above. Set from the H200 run of ``benchmarks/moe_layer.py --cases
kimi_int4,kimi_full_int4`` (columns ``int4_decode`` against ``int4_grouped``)."""

INT4_DECODE_MAX_BF16_PAIRS = 8
"""With bf16 activations, ``int4_experts`` takes the decode kernels up to this many expected pairs, the MMA path from
there on: each live pair costs the decode kernels one read of its expert's weights, while the MMA path starts higher
(its alignment launch and counters) and grows with the slots touched. Set from the H200 run of 2026-12-03
(``benchmarks/moe_layer.py --cases kimi_int4,kimi_full_int4 --sizes 1,2,4,8,64``, columns ``int4_decode`` against
``int4_mma``, ``benchmarks/results/moe_layer_int4_decode_1warp_h200.json``): faster at 1, 6 and 8 live pairs, slower
at 9 and 16; 8 expected pairs were 8 live on all 384 experts (decode 8% faster) and 9 on the EP-8 shard (5% slower):
the threshold favours the one-token step of a model whose experts are all local. The expected pairs are an estimate:
a step whose routing sends more pairs to this rank pays one weight read per live pair."""

INT4_DEQUANT_MIN_PAIRS: int | None = None
"""``int4_experts`` takes the widening path (``int4_dequantized_experts``) from this many pairs on; ``None``: never
(the fused grouped path for every batch above ``INT4_DECODE_MAX_PAIRS``). Set from the same H200 run (column
``int4_dequant`` against ``int4_grouped``)."""


def int4_dequantized_experts(
    x: torch.Tensor,
    topk_slots: torch.Tensor,
    topk_weights: torch.Tensor,
    weights: Int4ExpertWeights,
    activation: Activation,
    weight_on_input: bool = False,
    *,
    expected_pairs: int | None = None,
) -> torch.Tensor:
    """INT4 expert compute for many pairs: the slots with live pairs widened to ``x.dtype`` in one launch, then
    ``grouped.triton_experts`` (given ``expected_pairs``; see the module docstring). Arguments and result as
    ``w4a16_decode.packed_decode_experts`` (``x`` bf16/fp16); needs a workspace of ``S * 3 * D * F`` elements of
    ``x.dtype``.

    Raises:
        ValueError: operands of other shapes than ``experts.weights.check_expert_call`` takes.
    """
    check_expert_call(x, topk_slots, topk_weights, weights.hidden_size, as_read=False)
    s = weights.num_slots
    key = torch.where((topk_slots >= 0) & (topk_slots < s), topk_slots, s).reshape(-1)
    counts = torch.zeros(s + 1, dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, key, torch.ones_like(key, dtype=torch.int32))
    d, f, g = weights.hidden_size, weights.intermediate_size, weights.group_size
    w13 = torch.empty(s, 2 * f, d, dtype=x.dtype, device=x.device)
    w2 = torch.empty(s, d, f, dtype=x.dtype, device=x.device)
    dequantize_int4_triton(weights.w13_packed, weights.w13_scale, g, w13, counts)
    dequantize_int4_triton(weights.w2_packed, weights.w2_scale, g, w2, counts)
    b13 = None if weights.b13 is None else weights.b13.to(x.dtype)
    b2 = None if weights.b2 is None else weights.b2.to(x.dtype)
    return triton_experts(x, topk_slots, topk_weights, ExpertWeights(w13, w2, b13, b2), activation, weight_on_input,
                          expected_pairs=expected_pairs)


INT4_WGMMA_MIN_PAIRS_PER_SLOT = 16
"""``int4_path`` takes the wgmma kernels (``w4a16_wgmma``, Hopper only) from this many ``(token, k)`` pairs per local
slot on average, the MMA path below. Set from the H200 run of ``benchmarks/int4_prefill.py --sizes
512,1024,2048,4096`` (Kimi-K2.5's shard and all 384 experts): the MMA path was 10-19% faster at 11 pairs a slot, the
wgmma kernels with 64-row blocks and 32-row tails 25% faster at 21."""


def int4_path(num_pairs: int, dtype: torch.dtype, num_slots: int, hopper: bool = False) -> str:
    """The path ``int4_experts`` takes for ``num_pairs`` pairs of activations in ``dtype`` over ``num_slots`` local
    slots on a GPU of compute capability 9.0 (``hopper``) or another: bf16 takes ``"decode"`` up to
    ``INT4_DECODE_MAX_BF16_PAIRS`` pairs, else on Hopper ``"wgmma"`` from ``INT4_WGMMA_MIN_PAIRS_PER_SLOT`` pairs a
    slot on, else ``"mma"`` (at every size: the H200 run of
    ``benchmarks/moe_layer.py --cases kimi_int4,kimi_full_int4``, column ``int4_mma`` against ``int4_grouped``); fp16
    takes ``"decode"`` up to ``INT4_DECODE_MAX_PAIRS``, else ``"dequant"`` (from ``INT4_DEQUANT_MIN_PAIRS`` on) or
    ``"grouped"``. ``num_pairs`` is the pairs expected (``int4_experts``' ``expected_pairs``), so the pairs a slot
    are ``num_pairs / num_slots``."""
    small = num_pairs <= INT4_DECODE_MAX_PAIRS
    if dtype == torch.bfloat16:
        if num_pairs <= INT4_DECODE_MAX_BF16_PAIRS:
            return "decode"
        return "wgmma" if hopper and num_pairs >= INT4_WGMMA_MIN_PAIRS_PER_SLOT * num_slots else "mma"
    if small:
        return "decode"
    if INT4_DEQUANT_MIN_PAIRS is not None and num_pairs >= INT4_DEQUANT_MIN_PAIRS:
        return "dequant"
    return "grouped"


def int4_grouped_experts(
    x: torch.Tensor,
    topk_slots: torch.Tensor,
    topk_weights: torch.Tensor,
    weights: Int4ExpertWeights,
    activation: Activation,
    weight_on_input: bool = False,
    config: TileConfig | None = None,
) -> torch.Tensor:
    """INT4 expert compute by the grouped kernels of ``grouped`` with the weights widened in registers (``w4a16``):
    the pairs aligned to row blocks of one slot, each block's products on the tensor cores, reading the packed
    weights once per row block (see the module docstring).

    Args:
        x: ``[T, D]`` bf16/fp16 (or float32) rows, contiguous along ``D``.
        topk_slots: ``[T, K]`` int64 local slot ids; an id outside ``[0, S)`` (``-1``) skips.
        topk_weights: ``[T, K]`` float routing weights.
        weights: the packed weights (contiguous).
        activation: the gated activation.
        weight_on_input: scale the expert input by the weight instead of its output.
        config: tile shapes (``block_k`` in inputs); ``grouped.default_int4_config`` when ``None``.

    Returns:
        ``[T, D]`` in ``x.dtype``.

    Raises:
        ValueError: operands of other shapes than ``experts.weights.check_expert_call`` takes.
        ValueError: ``config.block_k`` not a power of two of at least 128.
    """
    check_expert_call(x, topk_slots, topk_weights, weights.hidden_size, as_read=False)
    t, k = topk_slots.shape
    if t * k == 0:  # no pair: no expert adds to any row
        return torch.zeros(t, weights.hidden_size, dtype=x.dtype, device=x.device)
    cfg = config if config is not None else default_int4_config(t * k, weights.num_slots)
    if x.stride(1) != 1:
        x = x.contiguous()
    return grouped_experts(x, topk_slots.contiguous(), topk_weights.float().contiguous(), weights, activation,
                           weight_on_input, cfg)


def int4_experts(
    x: torch.Tensor,
    topk_slots: torch.Tensor,
    topk_weights: torch.Tensor,
    weights: Int4ExpertWeights,
    activation: Activation,
    weight_on_input: bool = False,
    *,
    expected_pairs: int | None = None,
) -> torch.Tensor:
    """INT4 expert compute on CUDA (contract of ``experts.ExpertBackend``); graph safe.

    The path is ``int4_path(T * K, x.dtype, S, hopper)``: the decode kernels for a few pairs (each pair reads its
    expert's weights: the cost grows with the live pairs), the tensor-core kernels of ``w4a16_mma`` for bf16 (the words
    widened into the MMA registers, one read and widening of a slot's words per 16-row block, one MMA per 8 of its
    rows), on Hopper from ``INT4_WGMMA_MIN_PAIRS_PER_SLOT`` pairs a slot those of
    ``w4a16_wgmma`` (``default_wgmma_config`` picks the rows a block), for fp16 the fused grouped kernels (``tl.dot`` on
    widened tiles), the widening path from ``INT4_DEQUANT_MIN_PAIRS`` on where that is set.
    ``N`` is ``expected_pairs`` (``ExpertBackend``), ``T * K`` when ``None`` (static: no look at the routing).

    Raises:
        ValueError: operands of other shapes than ``experts.weights.check_expert_call`` takes.
        TypeError: ``x`` not bf16/fp16.
    """
    check_expert_call(x, topk_slots, topk_weights, weights.hidden_size, as_read=False)
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"the INT4 expert kernels compute in bf16 or fp16, got x of dtype {x.dtype}")
    t, k = topk_slots.shape
    if t * k == 0:  # no pair: no expert adds to any row
        return torch.zeros(t, weights.hidden_size, dtype=x.dtype, device=x.device)
    if x.stride(1) != 1:
        x = x.contiguous()
    slots = topk_slots.contiguous()
    tw = topk_weights.float().contiguous()
    n, s, g = t * k if expected_pairs is None else expected_pairs, weights.num_slots, weights.group_size
    path = int4_path(n, x.dtype, s, x.is_cuda and torch.cuda.get_device_capability(x.device) == (9, 0))
    if path == "wgmma":
        return packed_wgmma_experts(x, slots, tw, weights, activation, weight_on_input, default_wgmma_config(g, n, s))
    if path == "mma":
        return packed_mma_experts(x, slots, tw, weights, activation, weight_on_input, default_mma_config(g, n, s))
    if path == "decode":
        return packed_decode_experts(x, slots, tw, weights, activation, weight_on_input)
    if path == "dequant":
        return int4_dequantized_experts(x, slots, tw, weights, activation, weight_on_input, expected_pairs=n)
    return int4_grouped_experts(x, slots, tw, weights, activation, weight_on_input, default_int4_config(n, s))


@triton.jit
def _dequantize_kernel(p_ptr, s_ptr, out_ptr, counts_ptr, KW, ROWS_PER_SLOT, GROUP: tl.constexpr,
                       BLOCK_W: tl.constexpr, SKIP_EMPTY: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    if SKIP_EMPTY:
        if tl.load(counts_ptr + row // ROWS_PER_SLOT) == 0:
            return
    offs_w = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    ok = offs_w < KW
    words = tl.load(p_ptr + row * KW + offs_w, mask=ok, other=0)
    sc = tl.load(s_ptr + row * (KW * 8 // GROUP) + offs_w * 8 // GROUP, mask=ok, other=0.0).to(tl.float32)
    nib = (words[:, None] >> (tl.arange(0, 8) * 4)[None, :]) & 0xF
    vals = (nib - 8).to(tl.float32) * sc[:, None]
    dest = out_ptr + row * KW * 8 + offs_w[:, None] * 8 + tl.arange(0, 8)[None, :]
    tl.store(dest, vals.to(out_ptr.dtype.element_ty), mask=ok[:, None])


def dequantize_int4_triton(packed: torch.Tensor, scale: torch.Tensor, group_size: int, out: torch.Tensor,
                           slot_counts: torch.Tensor | None = None) -> torch.Tensor:
    """``experts.int4.dequantize_int4`` in one Triton launch, into ``out``: ``packed [..., N, K/8]`` int32 and
    ``scale [..., N, K/G]`` (both contiguous) -> ``out [..., N, K]`` (contiguous, its dtype), returned. One read of
    the packed weights and one write of the widened ones.

    Args:
        packed, scale, group_size, out: as above.
        slot_counts: ``[S (+ more)]`` int32 for ``[S, N, K/8]`` weights: slots whose count is 0 are skipped (their
            rows of ``out`` are left as they were); ``None`` = widen everything.

    Raises:
        ValueError: shapes that do not fit each other.
    """
    kw = packed.shape[-1]
    if (tuple(out.shape) != (*packed.shape[:-1], kw * INT4_PACK)
            or tuple(scale.shape) != (*packed.shape[:-1], kw * INT4_PACK // group_size)):
        raise ValueError(f"packed {tuple(packed.shape)}, scale {tuple(scale.shape)} and out {tuple(out.shape)} do not "
                         f"fit group size {group_size}")
    rows = packed.numel() // kw
    rows_per_slot = packed.shape[-2] if packed.dim() == 3 else rows
    block_w = min(256, triton.next_power_of_2(kw))
    _dequantize_kernel[(rows, triton.cdiv(kw, block_w))](
        packed, scale, out, slot_counts if slot_counts is not None else packed, kw, rows_per_slot,
        GROUP=group_size, BLOCK_W=block_w, SKIP_EMPTY=slot_counts is not None)
    return out
