"""Grouped expert compute: the routed expert MLPs of the slots one rank holds.

``weights`` holds the values (``Activation``, ``ExpertWeights``, the ``ExpertBackend`` contract) and ``fp8``
the block FP8 weights; ``reference`` is the plain, exact backend every fast one is tested against;
``grouped_mm`` the PyTorch composition; ``triton/`` the fused Triton kernels (imported on first use);
``backends`` builds the registered backends with their device choice. Backends sit behind the read-only
registry ``EXPERT_BACKENDS`` (``get_expert_backend``).
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Callable, Mapping

from epmoe.experts.backends import make_grouped_mm_backend, make_triton_backend
from epmoe.experts.fp8 import BlockFP8ExpertWeights
from epmoe.experts.reference import reference_experts
from epmoe.experts.weights import Activation, ExpertBackend, ExpertWeights

__all__ = [
    "EXPERT_BACKENDS", "Activation", "BlockFP8ExpertWeights", "ExpertBackend", "ExpertWeights", "get_expert_backend",
    "reference_experts",
]


def _reference() -> ExpertBackend:
    return reference_experts


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
