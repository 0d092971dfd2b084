"""The values of expert compute: the gated ``Activation``, ``ExpertWeights`` of one rank's slots, and the
``ExpertBackend`` contract every backend meets. They import nothing else of the package.

A backend computes, for every row ``t`` of ``x``::

    out[t] = sum_k  w[t, k] * expert_{slot[t, k]}(x[t])          (weight on the output; default)
    out[t] = sum_k  expert_{slot[t, k]}(w[t, k] * x[t])          (weight on the input; Llama-4)

over the ``k`` whose ``slot[t, k]`` is in ``[0, S)`` (``-1`` = that choice is served elsewhere; any
other id is skipped too, never read outside the weights: the dispatchers report such ids themselves).
Each expert is a gated MLP ``down(act(gate(x)) * up(x))``; gpt-oss uses the clamped SwiGLU
``(clamp(up, -l, l) + 1) * g * sigmoid(alpha * g)`` with ``g = clamp(gate, max=l)`` and projection biases.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol, Union

import torch
import torch.nn.functional as F

# the most (token, k) pairs of a call the Triton backend's decode kernels compute (bf16 and FP8 weights;
# ``experts.triton.decode``); above it the grouped kernels run
DECODE_MAX_PAIRS = 16

@dataclass(frozen=True)
class Activation:
    """The expert activation.

    Attributes:
        act: name of the gate activation (``silu``, ``gelu``, ``relu``).
        swiglu_limit: gpt-oss's clamp limit; ``None`` for the plain gated activation.
        swiglu_alpha: gpt-oss's sigmoid slope (used only with ``swiglu_limit``).
    """

    act: str = "silu"
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702

    def __post_init__(self) -> None:
        if self.act not in _ACTS:
            raise ValueError(f"activation {self.act!r} is not supported; supported: {sorted(_ACTS)}")

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """Apply the gated activation to ``gate`` and ``up`` (same shape) and return their product."""
        if self.swiglu_limit is None:
            return _ACTS[self.act](gate) * up
        limit = self.swiglu_limit
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.swiglu_alpha))


_ACTS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu": F.gelu,
    "relu": F.relu,
}
ACTIVATIONS: tuple[str, ...] = tuple(_ACTS)
"""The names ``Activation.act`` takes (``config.json``'s ``hidden_act`` of a served model)."""


@dataclass(frozen=True)
class ExpertWeights:
    """The weights of the ``S`` expert slots of one rank, one MoE layer.

    Attributes:
        w13: ``[S, 2F, D]`` gate rows ``[:F]`` then up rows ``[F:]`` (the fused gate/up projection).
        w2: ``[S, D, F]`` down projection.
        b13: ``[S, 2F]`` gate/up bias or ``None``.
        b2: ``[S, D]`` down bias or ``None``.
    """

    w13: torch.Tensor
    w2: torch.Tensor
    b13: torch.Tensor | None = None
    b2: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.w13.dim() != 3 or self.w2.dim() != 3:
            raise ValueError(
                f"w13 must be [S, 2F, D] and w2 [S, D, F]; got {tuple(self.w13.shape)} and {tuple(self.w2.shape)}"
            )
        s, two_f, d = self.w13.shape
        if two_f % 2 or tuple(self.w2.shape) != (s, d, two_f // 2):
            raise ValueError(
                f"w2 shape {tuple(self.w2.shape)} does not match w13 shape {tuple(self.w13.shape)}: "
                f"expected {(s, d, two_f // 2)}"
            )
        check_expert_biases(self.b13, self.b2, s, two_f, d)

    @property
    def num_slots(self) -> int:
        """``S``: local expert slots."""
        return self.w13.shape[0]

    @property
    def hidden_size(self) -> int:
        """``D``: the model's hidden size (the experts' input and output width)."""
        return self.w13.shape[2]


# ExpertWeights (bf16/fp16/fp32, block FP8) or the INT4 / MXFP4 packed values (``int4``, ``mxfp4``), which
# import this module; named by string so that this module imports nothing else of the package.
AnyExpertWeights = Union["ExpertWeights", "Int4ExpertWeights", "MXFP4ExpertWeights"]  # noqa: F821


class ExpertBackend(Protocol):
    """A grouped expert compute function (see the module docstring for the contract)."""

    def __call__(
        self,
        x: torch.Tensor,
        topk_slots: torch.Tensor,
        topk_weights: torch.Tensor,
        weights: AnyExpertWeights,
        activation: Activation,
        weight_on_input: bool = False,
        *,
        expected_pairs: int | None = None,
    ) -> torch.Tensor:
        """Args:
            x: ``[T, D]`` rows to compute (float32 / bfloat16 / float16).
            topk_slots: ``[T, K]`` int64 local slot ids in ``[0, S)``; ``-1`` (or any id outside
                ``[0, S)``, which every backend skips rather than reading outside the weights) = skip.
            topk_weights: ``[T, K]`` float routing weights.
            weights: the local slots' weights (plain, block FP8, INT4 or MXFP4).
            activation: the gated activation.
            weight_on_input: scale the expert input by the weight instead of its output (Llama-4).
            expected_pairs: the ``(row, k)`` pairs with a local slot this call is expected to compute, for
                backends that choose kernels and tiles by size without looking at the routing (a host
                synchronisation); never used for the result. ``None``: ``T * K``, exact when every slot is
                local; ``layer.MoELayer`` passes the pairs its own tokens route (what a rank receives on
                average under a balanced load), as its ``T * K`` also counts other ranks' pairs and padding rows
                (``None`` on a rank with no tokens of its own, which still receives other ranks' pairs).

        Returns:
            ``[T, D]`` in ``x.dtype``.
        """
        ...


def check_expert_biases(b13: torch.Tensor | None, b2: torch.Tensor | None, slots: int, two_f: int, d: int) -> None:
    """Check optional expert biases against their weights: ``b13 [S, 2F]`` and ``b2 [S, D]``, floating point.

    Raises:
        ValueError: a bias of another shape (named, with the shape expected).
        TypeError: a bias that is not floating point (named, with its dtype).
    """
    for name, b, shape in (("b13", b13, (slots, two_f)), ("b2", b2, (slots, d))):
        if b is None:
            continue
        if tuple(b.shape) != shape:
            raise ValueError(f"{name} must be {shape}, got {tuple(b.shape)}")
        if not b.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {b.dtype}")


def check_expert_call(x: torch.Tensor, topk_slots: torch.Tensor, topk_weights: torch.Tensor, hidden_size: int, *,
                      as_read: bool = True) -> None:
    """Check the operands of an expert compute call against each other and the weights' hidden size, before a kernel
    reads them by pointer: ``x [T, D]``, ``topk_slots [T, K]`` integer and ``topk_weights [T, K]``.

    Args:
        as_read: also check what the kernels read by pointer: ``x``'s rows contiguous along ``D``, ``topk_slots``
            and ``topk_weights`` contiguous, ``topk_weights`` floating point (the entry points that first make them
            so, such as ``triton.int4.int4_experts``, check the shapes only).

    Raises:
        ValueError: an operand of another shape, dtype or layout (named, with what it is).
    """
    if x.dim() != 2 or x.shape[1] != hidden_size:
        raise ValueError(f"x must be [T, D] with D = {hidden_size} (the weights' hidden size), got {tuple(x.shape)}")
    if topk_slots.dim() != 2 or topk_slots.shape[0] != x.shape[0]:
        raise ValueError(f"topk_slots must be [T, K] with T = {x.shape[0]} (x's rows), got {tuple(topk_slots.shape)}")
    if topk_slots.dtype.is_floating_point or topk_slots.dtype.is_complex or topk_slots.dtype == torch.bool:
        raise ValueError(f"topk_slots must hold integer slot ids, got dtype {topk_slots.dtype}")
    if tuple(topk_weights.shape) != tuple(topk_slots.shape):
        raise ValueError(f"topk_weights must have topk_slots' shape {tuple(topk_slots.shape)}, "
                         f"got {tuple(topk_weights.shape)}")
    if not as_read:
        return
    if x.shape[1] > 1 and x.stride(1) != 1:
        raise ValueError(f"x must be contiguous along D, got strides {tuple(x.stride())}")
    for name, t in (("topk_slots", topk_slots), ("topk_weights", topk_weights)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous, got strides {tuple(t.stride())}")
    if not topk_weights.dtype.is_floating_point:
        raise ValueError(f"topk_weights must be floating point, got {topk_weights.dtype}")
