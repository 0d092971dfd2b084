"""MXFP4 expert weights as gpt-oss stores them: E2M1 values in 32-wide blocks with one E8M0 scale per block.

A weight ``W [S, N, Kd]`` is stored as ``blocks [S, N, Kd/32, 16]`` uint8 (two E2M1 values a byte, the low
nibble first) and ``scales [S, N, Kd/32]`` uint8 (E8M0: the block's multiplier is ``2 ** (scale - 127)``), with
``W[s, n, k] = e2m1(nibble k) * 2 ** (scales[s, n, k // 32] - 127)``. E2M1 is 1 sign, 2 exponent and 1 mantissa
bit: the values ``0, 0.5, 1, 1.5, 2, 3, 4, 6`` and their negatives.

Source: the OCP Microscaling Formats (MX) v1.0 specification and the gpt-oss checkpoint layout
(``*_blocks`` / ``*_scales``, as read by transformers' ``convert_moe_packed_tensors``); the code is our own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from epmoe.experts.weights import ExpertWeights, check_expert_biases

MXFP4_BLOCK = 32
MXFP4_BYTES = MXFP4_BLOCK // 2
E8M0_BIAS = 127
E8M0_NAN = 255  # the E8M0 code the OCP MX specification reserves for NaN
E8M0_MAX_FINITE = 252  # the largest scale whose blocks' values (up to 6 x 2 ** (s - 127)) are finite in float32
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


@dataclass(frozen=True)
class MXFP4ExpertWeights:
    """The weights of the ``S`` expert slots of one rank in MXFP4.

    Attributes:
        w13_blocks: ``[S, 2F, D/32, 16]`` uint8, gate rows ``[:F]`` then up rows ``[F:]`` (gpt-oss interleaves
            them on disk; the loader separates them).
        w13_scales: ``[S, 2F, D/32]`` uint8 E8M0.
        w2_blocks: ``[S, D, F/32, 16]`` uint8.
        w2_scales: ``[S, D, F/32]`` uint8 E8M0.
        b13: ``[S, 2F]`` gate/up bias or ``None``.
        b2: ``[S, D]`` down bias or ``None``.

    Raises:
        TypeError: a field that is not a tensor, blocks or scales not uint8, biases not floating point.
        ValueError: inconsistent or empty shapes (named).
    """

    w13_blocks: torch.Tensor
    w13_scales: torch.Tensor
    w2_blocks: torch.Tensor
    w2_scales: torch.Tensor
    b13: torch.Tensor | None = None
    b2: torch.Tensor | None = None

    def __post_init__(self) -> None:
        for name, optional in (("w13_blocks", False), ("w13_scales", False), ("w2_blocks", False),
                               ("w2_scales", False), ("b13", True), ("b2", True)):
            value = getattr(self, name)
            if not isinstance(value, torch.Tensor) and not (optional and value is None):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
        for name in ("w13_blocks", "w13_scales", "w2_blocks", "w2_scales"):
            if getattr(self, name).dtype != torch.uint8:
                raise TypeError(f"{name} must be uint8, got {getattr(self, name).dtype}")
        if self.w13_blocks.dim() != 4 or self.w13_blocks.shape[-1] != MXFP4_BYTES:
            raise ValueError(f"w13_blocks must be [S, 2F, D/32, 16], got {tuple(self.w13_blocks.shape)}")
        s, two_f, nb, _ = self.w13_blocks.shape
        d, f = nb * MXFP4_BLOCK, two_f // 2
        if two_f == 0 or nb == 0:
            raise ValueError(f"w13_blocks {tuple(self.w13_blocks.shape)} holds no weights: 2F and D/32 must be "
                             f"positive")
        if two_f % 2:
            raise ValueError(f"w13_blocks has {two_f} rows; gate and up rows (2F) must be an even count")
        if f % MXFP4_BLOCK:
            raise ValueError(f"F ({f}) must be a multiple of {MXFP4_BLOCK} for MXFP4 weights")
        want = {"w13_scales": (s, two_f, nb), "w2_blocks": (s, d, f // MXFP4_BLOCK, MXFP4_BYTES),
                "w2_scales": (s, d, f // MXFP4_BLOCK)}
        for name, shape in want.items():
            if tuple(getattr(self, name).shape) != shape:
                raise ValueError(f"{name} has shape {tuple(getattr(self, name).shape)}, expected {shape} for "
                                 f"w13_blocks {tuple(self.w13_blocks.shape)}")
        check_expert_biases(self.b13, self.b2, s, two_f, d)

    @property
    def num_slots(self) -> int:
        """``S``: local expert slots."""
        return self.w13_blocks.shape[0]

    @property
    def hidden_size(self) -> int:
        """``D``."""
        return self.w13_blocks.shape[2] * MXFP4_BLOCK

    @property
    def intermediate_size(self) -> int:
        """``F``."""
        return self.w13_blocks.shape[1] // 2

    def dequantize(self, dtype: torch.dtype = torch.bfloat16) -> ExpertWeights:
        """The same weights in ``dtype`` (``w13 [S, 2F, D]``, ``w2 [S, D, F]``; for the reference backend)."""
        return ExpertWeights(dequantize_mxfp4(self.w13_blocks, self.w13_scales, dtype),
                             dequantize_mxfp4(self.w2_blocks, self.w2_scales, dtype), self.b13, self.b2)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``blocks [..., N, K/32, 16]`` uint8 and ``scales [..., N, K/32]`` uint8 -> ``[..., N, K]`` in ``dtype``
    (exact: every MXFP4 value is a float32). A scale of 255, E8M0's NaN code, gives NaN for its block, as the OCP MX
    specification defines it (the checkpoint reader refuses such a scale).

    Raises:
        TypeError: blocks or scales not uint8, ``dtype`` not a floating-point dtype.
        ValueError: shapes that do not fit each other.
    """
    for name, t in (("blocks", blocks), ("scales", scales)):
        if t.dtype != torch.uint8:
            raise TypeError(f"MXFP4 {name} must be uint8, got {t.dtype}")
    if not dtype.is_floating_point:
        raise TypeError(f"MXFP4 values dequantize to a floating-point dtype, got {dtype}")
    if blocks.dim() < 2 or blocks.shape[-1] != MXFP4_BYTES or tuple(scales.shape) != tuple(blocks.shape[:-1]):
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not fit: expected "
                         f"blocks [..., K/32, 16] and scales [..., K/32]")
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    b = blocks.long()
    vals = torch.stack((lut[b & 0xF], lut[b >> 4]), dim=-1).flatten(-2)  # [..., K/32, 32]
    w = torch.ldexp(vals, (scales.long() - E8M0_BIAS).unsqueeze(-1).float())
    w = torch.where((scales == E8M0_NAN).unsqueeze(-1), float("nan"), w)
    return w.flatten(-2).to(dtype)


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 quantization of ``w [..., N, K]`` (``K`` a multiple of 32).

    Each block's scale is ``2 ** (floor(log2(amax)) - 2)`` (the OCP MX rule: the block maximum's exponent minus
    E2M1's largest exponent, 2), values are rounded to the nearest E2M1 value (a tie to the smaller magnitude) and
    saturate at 6 (times the block's scale).

    Returns:
        ``(blocks [..., N, K/32, 16] uint8, scales [..., N, K/32] uint8)``.

    Raises:
        TypeError: ``w`` not a real floating-point tensor.
        ValueError: ``w`` of no dimension, ``K`` not a multiple of 32, or ``w`` holding NaN or infinity (no MXFP4
            code stands for them; the count and the first position named).
    """
    if not isinstance(w, torch.Tensor) or not w.is_floating_point():
        raise TypeError(f"w must be a real floating-point tensor, got "
                        f"{w.dtype if isinstance(w, torch.Tensor) else type(w).__name__}")
    if w.dim() == 0:
        raise ValueError("w must have at least one dimension (its last is K, a multiple of 32), got a 0-d tensor")
    if w.shape[-1] % MXFP4_BLOCK:
        raise ValueError(f"the input dimension ({w.shape[-1]}) must be a multiple of {MXFP4_BLOCK} for MXFP4")
    bad = ~torch.isfinite(w)
    if bad.any():
        raise ValueError(f"w holds {int(bad.sum())} NaN or infinite values (the first at "
                         f"{tuple(bad.nonzero()[0].tolist())}): MXFP4 has no code for them")
    groups = w.float().unflatten(-1, (-1, MXFP4_BLOCK))
    amax = groups.abs().amax(-1).clamp(min=2.0 ** -120)
    exp = (torch.floor(torch.log2(amax)) - 2).clamp(-E8M0_BIAS, E8M0_BIAS)
    scaled = groups / torch.exp2(exp).unsqueeze(-1)
    lut = torch.tensor(E2M1_VALUES[:8], dtype=torch.float32, device=w.device)
    mag = (scaled.abs().unsqueeze(-1) - lut).abs().argmin(-1)  # nearest magnitude code 0..7 (first on a tie)
    code = (mag | ((scaled < 0).long() << 3)).to(torch.uint8).unflatten(-1, (-1, 2))
    blocks = code[..., 0] | (code[..., 1] << 4)
    return blocks, (exp + E8M0_BIAS).to(torch.uint8)


def mxfp4_expert_weights(weights: ExpertWeights) -> MXFP4ExpertWeights:
    """Quantize the ``w13``/``w2`` of ``weights`` to MXFP4 (``quantize_mxfp4``; biases kept as they are)."""
    b13, s13 = quantize_mxfp4(weights.w13)
    b2, s2 = quantize_mxfp4(weights.w2)
    return MXFP4ExpertWeights(b13, s13, b2, s2, weights.b13, weights.b2)
