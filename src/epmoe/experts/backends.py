"""The registered fast backends and their device choice: Triton on CUDA, the reference elsewhere.

Chosen behaviour on CPU (DESIGN.md rule 7): the ``triton`` backend computes CPU tensors with
``experts.reference_experts`` (block FP8, INT4 and MXFP4 weights dequantized first), so one backend name serves a model
wherever it runs. CUDA tensors without an importable Triton raise ``RuntimeError`` naming the backend and
the missing package; nothing falls back silently on the GPU.
"""

from __future__ import annotations

import torch

from epmoe.experts.fp8 import BlockFP8ExpertWeights
from epmoe.experts.int4 import Int4ExpertWeights
from epmoe.experts.mxfp4 import MXFP4ExpertWeights
from epmoe.experts.reference import reference_experts
from epmoe.experts.weights import Activation, AnyExpertWeights, ExpertBackend, ExpertWeights


def plain_weights(weights: AnyExpertWeights, dtype: torch.dtype) -> ExpertWeights:
    """``weights`` as ``ExpertWeights`` in ``dtype``: quantized ones (block FP8, INT4, MXFP4) dequantized, plain
    ones as they are."""
    if isinstance(weights, (BlockFP8ExpertWeights, Int4ExpertWeights, MXFP4ExpertWeights)):
        return weights.dequantize(dtype)
    return weights


def describe_expert_backend(name: str, device: str) -> str:
    """What the expert backend ``name`` computes with on ``device`` (``cpu`` or ``cuda``), for reports: ``name``
    itself, except ``triton`` on the CPU, which runs the reference (the chosen behaviour above), said in words.
    """
    if name == "triton" and device != "cuda":
        return f"triton: the reference on {device} (the Triton kernels take CUDA tensors only)"
    return name


def make_triton_backend() -> ExpertBackend:
    """The ``triton`` expert backend: ``grouped.triton_experts`` on CUDA (INT4 weights: ``int4.int4_experts``; MXFP4
    weights: ``mxfp4.mxfp4_experts``, on the packed weights), the reference on CPU.

    Triton is imported here, once per backend built; on a machine without it the backend still serves
    CPU tensors.
    """
    try:
        from epmoe.experts.triton import grouped, int4, mxfp4
    except ImportError as err:
        missing: str | None = f"{err}"
        grouped = int4 = mxfp4 = None
    else:
        missing = None

    def backend(
        x: torch.Tensor,
        topk_slots: torch.Tensor,
        topk_weights: torch.Tensor,
        weights: AnyExpertWeights,
        activation: Activation,
        weight_on_input: bool = False,
        *,
        expected_pairs: int | None = None,
    ) -> torch.Tensor:
        if not x.is_cuda:
            return reference_experts(x, topk_slots, topk_weights, plain_weights(weights, x.dtype), activation,
                                     weight_on_input)
        if grouped is None:
            raise RuntimeError(f"expert backend 'triton' needs the triton package for CUDA tensors: {missing}")
        if isinstance(weights, Int4ExpertWeights):
            return int4.int4_experts(x, topk_slots, topk_weights, weights, activation, weight_on_input,
                                     expected_pairs=expected_pairs)
        if isinstance(weights, MXFP4ExpertWeights):
            return mxfp4.mxfp4_experts(x, topk_slots, topk_weights, weights, activation, weight_on_input,
                                       expected_pairs=expected_pairs)
        return grouped.triton_experts(x, topk_slots, topk_weights, weights, activation, weight_on_input,
                                      expected_pairs=expected_pairs)

    return backend


def make_grouped_mm_backend() -> ExpertBackend:
    """The ``grouped_mm`` expert backend (``grouped_mm.grouped_mm_experts``; quantized weights dequantized per call:
    the "dequantize, then grouped GEMM" peer of the INT4 kernels)."""
    from epmoe.experts.grouped_mm import grouped_mm_experts

    def backend(
        x: torch.Tensor,
        topk_slots: torch.Tensor,
        topk_weights: torch.Tensor,
        weights: AnyExpertWeights,
        activation: Activation,
        weight_on_input: bool = False,
        *,
        expected_pairs: int | None = None,
    ) -> torch.Tensor:
        return grouped_mm_experts(x, topk_slots, topk_weights, plain_weights(weights, x.dtype), activation,
                                  weight_on_input)

    return backend
