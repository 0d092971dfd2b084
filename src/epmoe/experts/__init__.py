"""Grouped expert compute: the routed expert MLPs of the slots one rank holds.

``weights`` holds the values (``Activation``, ``ExpertWeights``, the ``ExpertBackend`` contract), ``fp8``
the block FP8 weights, ``int4`` the INT4 pack-quantized weights (Kimi-K2.5) and ``mxfp4`` the MXFP4 weights
(gpt-oss); ``reference`` is the plain, exact backend every fast one is tested against (quantized weights
dequantized first);
``grouped_mm`` the PyTorch composition; ``triton/`` the fused Triton kernels (imported on first use);
``backends`` builds the registered backends with their device choice. Backends sit behind the read-only
registry ``EXPERT_BACKENDS`` (``get_expert_backend``).
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Callable, Mapping

import torch

from epmoe.experts.backends import (
    describe_expert_backend,
    make_grouped_mm_backend,
    make_triton_backend,
    plain_weights,
)
from epmoe.experts.fp8 import BlockFP8ExpertWeights
from epmoe.experts.int4 import Int4ExpertWeights
from epmoe.experts.mxfp4 import MXFP4ExpertWeights
from epmoe.experts.reference import reference_experts
from epmoe.experts.weights import Activation, AnyExpertWeights, ExpertBackend, ExpertWeights

__all__ = [
    "EXPERT_BACKENDS", "Activation", "AnyExpertWeights", "BlockFP8ExpertWeights", "ExpertBackend", "ExpertWeights",
    "Int4ExpertWeights", "MXFP4ExpertWeights", "describe_expert_backend", "get_expert_backend", "plain_weights",
    "reference_experts",
]


def _reference() -> ExpertBackend:
    def backend(x: torch.Tensor, topk_slots: torch.Tensor, topk_weights: torch.Tensor, weights: AnyExpertWeights,
                activation: Activation, weight_on_input: bool = False, *,
                expected_pairs: int | None = None) -> torch.Tensor:
        return reference_experts(x, topk_slots, topk_weights, plain_weights(weights, x.dtype), activation,
                                 weight_on_input)

    return backend


EXPERT_BACKENDS: Mapping[str, Callable[[], ExpertBackend]] = MappingProxyType({
    "reference": _reference,
    "triton": make_triton_backend,  # imports Triton lazily; CPU tensors use the reference
    "grouped_mm": make_grouped_mm_backend,
})
def get_expert_backend(name: str) -> ExpertBackend:
    """Return the expert compute backend registered as ``name``.

    Raises:
        KeyError: unknown name (the message lists the registered ones).
    """
    try:
        factory = EXPERT_BACKENDS[name]
    except KeyError:
        raise KeyError(f"unknown expert backend {name!r}; supported: {sorted(EXPERT_BACKENDS)}") from None
    return factory()
