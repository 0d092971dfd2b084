"""DeepSeek-style block-quantized FP8 expert weights: float8_e4m3fn values, one float32 scale per 128x128.

A weight ``W [S, N, Kd]`` is stored as ``Q [S, N, Kd]`` float8_e4m3fn and ``scale [S, ceil(N/128),
ceil(Kd/128)]`` float32 with ``W[s, n, k] ~= Q[s, n, k] * scale[s, n // 128, k // 128]`` (the format of
DeepSeek-V3's checkpoints, ``weight_scale_inv``). Activations stay in bf16 (weight-only quantization):
decode is weight-read bound, so halving the weight bytes is what pays.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from epmoe.experts.weights import ExpertWeights

FP8_BLOCK = 128
_FP8_MAX = 448.0


@dataclass(frozen=True)
class BlockFP8ExpertWeights(ExpertWeights):
    """``ExpertWeights`` whose ``w13``/``w2`` are float8_e4m3fn with 128x128 block scales.

    Attributes:
        w13_scale: ``[S, ceil(2F/128), ceil(D/128)]`` float32.
        w2_scale: ``[S, ceil(D/128), ceil(F/128)]`` float32.

    Raises:
        ValueError: a scale missing or of the wrong shape, or ``F`` not a multiple of 128 (the gate and
            up halves of ``w13`` must not share a scale block).
        TypeError: weights not float8_e4m3fn.
    """

    w13_scale: torch.Tensor | None = None
    w2_scale: torch.Tensor | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.w13.dtype != torch.float8_e4m3fn or self.w2.dtype != torch.float8_e4m3fn:
            raise TypeError(f"w13/w2 must be float8_e4m3fn, got {self.w13.dtype} and {self.w2.dtype}")
        s, two_f, d = self.w13.shape
        if (two_f // 2) % FP8_BLOCK:
            raise ValueError(f"F ({two_f // 2}) must be a multiple of {FP8_BLOCK} for block FP8 weights")
        for name, scale, want in (
            ("w13_scale", self.w13_scale, (s, _blocks(two_f), _blocks(d))),
            ("w2_scale", self.w2_scale, (s, _blocks(d), _blocks(two_f // 2))),
        ):
            if scale is None:
                raise ValueError(f"{name} is required for block FP8 weights (expected shape {want})")
            if tuple(scale.shape) != want:
                raise ValueError(f"{name} must be {want}, got {tuple(scale.shape)}")

    def dequantize(self, dtype: torch.dtype = torch.bfloat16) -> ExpertWeights:
        """The same weights in ``dtype`` (for the reference backend)."""
        assert self.w13_scale is not None and self.w2_scale is not None, "validated in __post_init__"
        return ExpertWeights(
            dequantize_block_fp8(self.w13, self.w13_scale, dtype),
            dequantize_block_fp8(self.w2, self.w2_scale, dtype),
            self.b13,
            self.b2,
        )


def _blocks(n: int) -> int:
    return -(-n // FP8_BLOCK)


def _block_view(w: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """Pad ``[S, N, Kd]`` to block multiples and view it as ``[S, N/128, 128, Kd/128, 128]``."""
    s, n, k = w.shape
    pn, pk = _blocks(n) * FP8_BLOCK, _blocks(k) * FP8_BLOCK
    padded = torch.nn.functional.pad(w, (0, pk - k, 0, pn - n))
    return padded.view(s, pn // FP8_BLOCK, FP8_BLOCK, pk // FP8_BLOCK, FP8_BLOCK), n, k


def quantize_block_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``w [S, N, Kd]`` (any float dtype) to float8_e4m3fn with 128x128 block scales.

    Returns:
        ``(q [S, N, Kd] float8_e4m3fn, scale [S, ceil(N/128), ceil(Kd/128)] float32)``, each block's
        scale its absolute maximum / 448 (the e4m3 maximum).
    """
    blocks, n, k = _block_view(w.float())
    amax = blocks.abs().amax(dim=(2, 4), keepdim=True).clamp(min=1e-12)
    scale = amax / _FP8_MAX
    q = (blocks / scale).clamp(-_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn)
    s = w.shape[0]
    q = q.view(s, q.shape[1] * FP8_BLOCK, q.shape[3] * FP8_BLOCK)[:, :n, :k].contiguous()
    return q, scale.squeeze(4).squeeze(2).contiguous()


def dequantize_block_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Inverse of ``quantize_block_fp8``: ``[S, N, Kd]`` in ``dtype``."""
    blocks, n, k = _block_view(q.float())
    w = blocks * scale[:, :, None, :, None]
    s = q.shape[0]
    return w.view(s, w.shape[1] * FP8_BLOCK, w.shape[3] * FP8_BLOCK)[:, :n, :k].to(dtype)


def block_fp8_expert_weights(weights: ExpertWeights) -> BlockFP8ExpertWeights:
    """Quantize the ``w13``/``w2`` of ``weights`` to block FP8 (biases kept as they are)."""
    w13, s13 = quantize_block_fp8(weights.w13)
    w2, s2 = quantize_block_fp8(weights.w2)
    return BlockFP8ExpertWeights(w13, w2, weights.b13, weights.b2, w13_scale=s13, w2_scale=s2)


@dataclass(frozen=True)
class KernelOperands:
    """The optional operands of the expert kernels, with a placeholder tensor where one is absent.

    Attributes:
        s13, s2: the block scales of ``w13`` / ``w2`` (FP8 weights), else the placeholder.
        strides13, strides2: their ``(slot, row block)`` strides, ``(0, 0)`` without FP8.
        b13, b2: the biases, else the placeholder (the kernels read them only when present).
    """

    s13: torch.Tensor
    strides13: tuple[int, int]
    s2: torch.Tensor
    strides2: tuple[int, int]
    b13: torch.Tensor
    b2: torch.Tensor


def kernel_operands(weights: ExpertWeights, placeholder: torch.Tensor) -> KernelOperands:
    """Scales (block-FP8 weights) and biases of ``weights`` as kernel arguments; ``placeholder`` (any
    tensor on the same device) fills the slots of absent ones, which a kernel never reads."""
    if isinstance(weights, BlockFP8ExpertWeights):
        s13, s2 = weights.w13_scale, weights.w2_scale
        strides13, strides2 = (s13.stride(0), s13.stride(1)), (s2.stride(0), s2.stride(1))
    else:
        s13 = s2 = placeholder
        strides13 = strides2 = (0, 0)
    b13 = weights.b13 if weights.b13 is not None else placeholder
    b2 = weights.b2 if weights.b2 is not None else placeholder
    return KernelOperands(s13, strides13, s2, strides2, b13, b2)
