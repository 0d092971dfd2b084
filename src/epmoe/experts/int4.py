"""INT4 group-quantized expert weights in compressed-tensors' ``pack-quantized`` format (Kimi-K2/K2.5).

A weight ``W [S, N, Kd]`` is stored as ``packed [S, N, Kd/8]`` int32 and ``scale [S, N, Kd/G]`` with
``W[s, n, k] = (q[s, n, k] - 8) * scale[s, n, k // G]``, where ``q`` is the 4-bit field of bits ``4j .. 4j+3``
of word ``packed[s, n, k // 8]`` for ``j = k % 8`` (eight values per int32 along the input dimension, least
significant nibble first, each stored as ``value + 8``; symmetric, no zero point). ``G`` is the group size
(Kimi-K2.5: 32). Activations stay in bf16 (weight-only quantization, W4A16): decode is weight-read bound,
so a quarter of the bf16 bytes is what pays.

Source: the format of compressed-tensors' ``PackedQuantizationCompressor`` (``pack_to_int32`` /
``unpack_from_int32``, https://github.com/vllm-project/compressed-tensors) as Kimi-K2.5's checkpoint uses
it; the code here is our own and is tested against that package.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from epmoe.experts.weights import ExpertWeights, check_expert_biases

INT4_PACK = 8
INT4_GROUP_SIZES = (32, 64, 128)
_INT4_OFFSET = 8
_SHIFTS = tuple(4 * j for j in range(INT4_PACK))


def check_int4_group_size(group_size: int, what: str = "group_size") -> None:
    """Raise ``ValueError`` naming ``what`` unless ``group_size`` is one the INT4 kernels take
    (``INT4_GROUP_SIZES``)."""
    if group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"{what} is {group_size!r}; the INT4 expert kernels take group sizes {INT4_GROUP_SIZES}")


@dataclass(frozen=True)
class Int4ExpertWeights:
    """The weights of the ``S`` expert slots of one rank, INT4 packed with one scale per ``G`` inputs.

    Attributes:
        w13_packed: ``[S, 2F, D/8]`` int32, gate rows ``[:F]`` then up rows ``[F:]``.
        w13_scale: ``[S, 2F, D/G]`` float (bf16 in the checkpoints).
        w2_packed: ``[S, D, F/8]`` int32.
        w2_scale: ``[S, D, F/G]`` float.
        b13: ``[S, 2F]`` gate/up bias or ``None``.
        b2: ``[S, D]`` down bias or ``None``.
        group_size: ``G``, one of ``INT4_GROUP_SIZES``.

    Raises:
        TypeError: packed tensors not int32 or scales not floating point.
        ValueError: inconsistent or empty shapes (both named), or an unsupported group size.
    """

    w13_packed: torch.Tensor
    w13_scale: torch.Tensor
    w2_packed: torch.Tensor
    w2_scale: torch.Tensor
    b13: torch.Tensor | None = None
    b2: torch.Tensor | None = None
    group_size: int = 32

    def __post_init__(self) -> None:
        check_int4_group_size(self.group_size)
        for name in ("w13_packed", "w2_packed"):
            t = getattr(self, name)
            if t.dtype != torch.int32 or t.dim() != 3:
                raise TypeError(f"{name} must be a 3-d int32 tensor, got {t.dtype} of shape {tuple(t.shape)}")
        for name in ("w13_scale", "w2_scale"):
            if not getattr(self, name).is_floating_point():
                raise TypeError(f"{name} must be floating point, got {getattr(self, name).dtype}")
        s, two_f, dw = self.w13_packed.shape
        d, f, g = dw * INT4_PACK, two_f // 2, self.group_size
        if two_f == 0 or dw == 0:
            raise ValueError(f"w13_packed {tuple(self.w13_packed.shape)} holds no weights: 2F and D/8 must be positive")
        want = {"w13_scale": (s, two_f, d // g), "w2_packed": (s, d, f // INT4_PACK),
                "w2_scale": (s, d, f // g)}
        if two_f % 2 or d % g or f % g:
            raise ValueError(f"w13_packed shape {tuple(self.w13_packed.shape)} gives D {d} and F {f}; both must be "
                             f"multiples of the group size {g}")
        for name, shape in want.items():
            if tuple(getattr(self, name).shape) != shape:
                raise ValueError(f"{name} has shape {tuple(getattr(self, name).shape)}, expected {shape} for "
                                 f"w13_packed {tuple(self.w13_packed.shape)} and group size {g}")
        check_expert_biases(self.b13, self.b2, s, two_f, d)

    @property
    def num_slots(self) -> int:
        """``S``: local expert slots."""
        return self.w13_packed.shape[0]

    @property
    def hidden_size(self) -> int:
        """``D``."""
        return self.w13_packed.shape[2] * INT4_PACK

    @property
    def intermediate_size(self) -> int:
        """``F``."""
        return self.w13_packed.shape[1] // 2

    def dequantize(self, dtype: torch.dtype = torch.bfloat16) -> ExpertWeights:
        """The same weights in ``dtype`` (``w13 [S, 2F, D]``, ``w2 [S, D, F]``; for the reference backend)."""
        return ExpertWeights(dequantize_int4(self.w13_packed, self.w13_scale, self.group_size, dtype),
                             dequantize_int4(self.w2_packed, self.w2_scale, self.group_size, dtype),
                             self.b13, self.b2)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """The signed 4-bit values of ``packed [..., K/8]`` int32: ``[..., K]`` int8 in ``[-8, 7]`` (byte-order free:
    fields are read with shifts)."""
    shifts = torch.tensor(_SHIFTS, dtype=torch.int32, device=packed.device)
    nibbles = (packed.unsqueeze(-1) >> shifts) & 0xF
    return (nibbles - _INT4_OFFSET).to(torch.int8).flatten(-2)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Inverse of ``unpack_int4``: ``q [..., K]`` integers in ``[-8, 7]`` (``K`` a multiple of 8) -> ``[..., K/8]``
    int32.

    Raises:
        ValueError: ``K`` not a multiple of 8, or a value outside ``[-8, 7]``.
    """
    if q.shape[-1] % INT4_PACK:
        raise ValueError(f"the last dimension ({q.shape[-1]}) must be a multiple of {INT4_PACK} to pack INT4")
    if q.numel() and (int(q.min()) < -_INT4_OFFSET or int(q.max()) > _INT4_OFFSET - 1):
        raise ValueError(f"INT4 values must lie in [-8, 7], got [{int(q.min())}, {int(q.max())}]")
    u = (q.to(torch.int64) + _INT4_OFFSET).unflatten(-1, (-1, INT4_PACK))
    shifts = torch.tensor(_SHIFTS, dtype=torch.int64, device=q.device)
    word = (u << shifts).sum(-1)
    return (word - ((word >> 31) << 32)).to(torch.int32)  # two's complement of the high bit


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, group_size: int,
                    dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``packed [..., N, K/8]`` int32 and ``scale [..., N, K/G]`` -> ``[..., N, K]`` in ``dtype`` (computed in float32).

    Raises:
        ValueError: ``scale`` does not have ``K / group_size`` columns.
    """
    q = unpack_int4(packed)
    k = q.shape[-1]
    if k % group_size or scale.shape[-1] != k // group_size or scale.shape[:-1] != q.shape[:-1]:
        raise ValueError(f"INT4 scale of shape {tuple(scale.shape)} does not fit packed weights of shape "
                         f"{tuple(packed.shape)} ({k} inputs) with group size {group_size}")
    w = q.float().unflatten(-1, (-1, group_size)) * scale.float().unsqueeze(-1)
    return w.flatten(-2).to(dtype)


def quantize_int4(w: torch.Tensor, group_size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric INT4 quantization of ``w [..., N, K]`` with one scale per ``group_size`` inputs.

    The scale of a group is its absolute maximum / 7.5 (compressed-tensors' symmetric min-max range for
    4 bits, ``(q_max - q_min) / 2``), values are rounded to the nearest and clamped to ``[-8, 7]``.

    Returns:
        ``(packed [..., N, K/8] int32, scale [..., N, K/G] in w.dtype)``.

    Raises:
        ValueError: ``K`` not a multiple of ``group_size`` (or of 8).
    """
    k = w.shape[-1]
    if k % group_size or group_size % INT4_PACK:
        raise ValueError(f"the input dimension ({k}) must be a multiple of the group size ({group_size}), "
                         f"itself a multiple of {INT4_PACK}")
    groups = w.float().unflatten(-1, (-1, group_size))
    scale = (groups.abs().amax(-1) / 7.5).clamp(min=torch.finfo(torch.float32).tiny).to(w.dtype)
    q = torch.round(groups / scale.float().unsqueeze(-1)).clamp(-_INT4_OFFSET, _INT4_OFFSET - 1).flatten(-2)
    return pack_int4(q.to(torch.int8)), scale


def int4_expert_weights(weights: ExpertWeights, group_size: int = 32) -> Int4ExpertWeights:
    """Quantize the ``w13``/``w2`` of ``weights`` to INT4 (``quantize_int4``; biases kept as they are)."""
    p13, s13 = quantize_int4(weights.w13, group_size)
    p2, s2 = quantize_int4(weights.w2, group_size)
    return Int4ExpertWeights(p13, s13, p2, s2, weights.b13, weights.b2, group_size)
