"""How a rank stores its routed experts: the parameter tensors of each served weight format.

``ExpertStorage.of(weight_format, F)`` maps a checkpoint's routed-expert format (``MoESpec.expert_weight_format``)
and the experts' intermediate size ``F`` to what the experts are served in:

- ``bf16`` (any float), ``fp8`` (FP8 in blocks other than 128x128) -> ``plain``, the compute dtype (FP8 dequantized
  on load): ``w13 [S, 2F, D]``, ``w2 [S, D, F]``.
- ``fp8_block128`` (DeepSeek-V3/R1, Kimi-K2, Qwen3 FP8) -> ``fp8`` (``fp8.BlockFP8ExpertWeights``, kept as stored):
  ``w13 [S, 2F, D]`` and ``w2 [S, D, F]`` float8_e4m3fn, ``w13_scale [S, ceil(2F/128), ceil(D/128)]`` and
  ``w2_scale [S, ceil(D/128), ceil(F/128)]`` float32; where ``F`` is not a multiple of 128 (the gate and up rows of
  ``w13`` would share a scale block) -> ``plain``, dequantized on load (``dequantized_reason`` says why).
- ``int4_group{G}`` -> ``int4`` (``int4.Int4ExpertWeights``, kept packed): ``w13_packed [S, 2F, D/8]`` int32,
  ``w13_scale [S, 2F, D/G]``, ``w2_packed [S, D, F/8]`` int32, ``w2_scale [S, D, F/G]``.
- ``mxfp4`` -> ``mxfp4`` (``mxfp4.MXFP4ExpertWeights``, kept packed): ``w13_blocks [S, 2F, D/32, 16]`` uint8,
  ``w13_scales [S, 2F, D/32]`` uint8, ``w2_blocks [S, D, F/32, 16]``, ``w2_scales [S, D, F/32]``.

Biases (gpt-oss) are ``b13 [S, 2F]`` and ``b2 [S, D]`` in the compute dtype in every format; INT4 scales are held in
the compute dtype too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Mapping

import torch

from epmoe.experts.fp8 import FP8_BLOCK, BlockFP8ExpertWeights
from epmoe.experts.int4 import INT4_PACK, Int4ExpertWeights, check_int4_group_size
from epmoe.experts.mxfp4 import MXFP4_BLOCK, MXFP4_BYTES, MXFP4ExpertWeights
from epmoe.experts.weights import AnyExpertWeights, ExpertWeights

StorageKind = Literal["plain", "fp8", "int4", "mxfp4"]
_PLAIN_FORMATS = ("bf16", "fp8")
_FP8_BLOCK128 = "fp8_block128"
_INT4_PREFIX = "int4_group"


@dataclass(frozen=True)
class ExpertStorage:
    """The served storage of routed expert weights.

    Attributes:
        kind: ``plain``, ``fp8``, ``int4`` or ``mxfp4``.
        group_size: INT4 inputs per scale (0 for the other kinds).
    """

    kind: StorageKind = "plain"
    group_size: int = 0

    @classmethod
    def of(cls, weight_format: str, intermediate_size: int) -> "ExpertStorage":
        """The storage that serves checkpoints of ``weight_format`` whose routed experts have intermediate size
        ``intermediate_size`` (``F``).

        Raises:
            ValueError: an unknown format, or an INT4 group size the kernels do not take (named).
        """
        if weight_format in _PLAIN_FORMATS:
            return cls("plain")
        if weight_format == _FP8_BLOCK128:
            return cls("plain") if dequantized_reason(weight_format, intermediate_size) else cls("fp8")
        if weight_format == "mxfp4":
            return cls("mxfp4")
        if weight_format.startswith(_INT4_PREFIX) and weight_format[len(_INT4_PREFIX):].isdigit():
            group = int(weight_format[len(_INT4_PREFIX):])
            check_int4_group_size(group, f"quantization_config weights.group_size (format {weight_format!r})")
            return cls("int4", group)
        raise ValueError(f"routed expert weight format {weight_format!r} is not served; served: unquantized, "
                         f"{_FP8_BLOCK128}, fp8 in other blocks (dequantized on load), int4_group{{32,64,128}} "
                         f"(compressed-tensors pack-quantized) and mxfp4")

    @property
    def format_name(self) -> str:
        """A short name for reports: ``plain``, ``fp8 (block 128)``, ``int4 (group 32)``, ``mxfp4``."""
        if self.kind == "int4":
            return f"int4 (group {self.group_size})"
        return f"fp8 (block {FP8_BLOCK})" if self.kind == "fp8" else self.kind

    def shapes(self, num_slots: int, d: int, f: int,
               bias: bool) -> dict[str, tuple[tuple[int, ...], torch.dtype | None]]:
        """Name -> ``(shape, dtype)`` of every parameter of ``num_slots`` slots; dtype ``None`` = the compute dtype.

        Raises:
            ValueError: ``D`` or ``F`` not a multiple of the format's block (named).
        """
        s = num_slots
        out: dict[str, tuple[tuple[int, ...], torch.dtype | None]]
        if self.kind == "plain":
            out = {"w13": ((s, 2 * f, d), None), "w2": ((s, d, f), None)}
        elif self.kind == "fp8":
            if f % FP8_BLOCK:
                raise ValueError(f"expert intermediate size F ({f}) must be a multiple of {FP8_BLOCK} for "
                                 f"{self.format_name} experts")
            nd, nf = -(-d // FP8_BLOCK), f // FP8_BLOCK
            out = {"w13": ((s, 2 * f, d), torch.float8_e4m3fn), "w13_scale": ((s, 2 * nf, nd), torch.float32),
                   "w2": ((s, d, f), torch.float8_e4m3fn), "w2_scale": ((s, nd, nf), torch.float32)}
        else:
            unit = self.group_size if self.kind == "int4" else MXFP4_BLOCK
            for name, n in (("hidden size D", d), ("expert intermediate size F", f)):
                if n % unit:
                    raise ValueError(f"{name} ({n}) must be a multiple of {unit} for {self.format_name} experts")
            if self.kind == "int4":
                g = self.group_size
                out = {"w13_packed": ((s, 2 * f, d // INT4_PACK), torch.int32),
                       "w13_scale": ((s, 2 * f, d // g), None),
                       "w2_packed": ((s, d, f // INT4_PACK), torch.int32), "w2_scale": ((s, d, f // g), None)}
            else:
                b = MXFP4_BLOCK
                out = {"w13_blocks": ((s, 2 * f, d // b, MXFP4_BYTES), torch.uint8),
                       "w13_scales": ((s, 2 * f, d // b), torch.uint8),
                       "w2_blocks": ((s, d, f // b, MXFP4_BYTES), torch.uint8),
                       "w2_scales": ((s, d, f // b), torch.uint8)}
        if bias:
            out["b13"] = ((s, 2 * f), None)
            out["b2"] = ((s, d), None)
        return out

    def weights(self, tensors: Mapping[str, torch.Tensor]) -> AnyExpertWeights:
        """The expert-weights value of the parameters ``tensors`` (named as ``shapes`` names them)."""
        b13, b2 = tensors.get("b13"), tensors.get("b2")
        if self.kind == "int4":
            return Int4ExpertWeights(tensors["w13_packed"], tensors["w13_scale"], tensors["w2_packed"],
                                     tensors["w2_scale"], b13, b2, self.group_size)
        if self.kind == "mxfp4":
            return MXFP4ExpertWeights(tensors["w13_blocks"], tensors["w13_scales"], tensors["w2_blocks"],
                                      tensors["w2_scales"], b13, b2)
        if self.kind == "fp8":
            return BlockFP8ExpertWeights(tensors["w13"], tensors["w2"], b13, b2, w13_scale=tensors["w13_scale"],
                                         w2_scale=tensors["w2_scale"])
        return ExpertWeights(tensors["w13"], tensors["w2"], b13, b2)

    def bytes_per_expert(self, d: int, f: int, dtype_bytes: int = 2) -> int:
        """Bytes of one expert's ``w13`` and ``w2`` (packed values and scales; no biases) with scales and plain
        weights of ``dtype_bytes`` bytes per element."""
        return sum(_numel(shape) * (torch.empty(0, dtype=dt).element_size() if dt is not None else dtype_bytes)
                   for shape, dt in self.shapes(1, d, f, False).values())


def dequantized_reason(weight_format: str, intermediate_size: int) -> str:
    """Why routed experts of an FP8 ``weight_format`` are served dequantized (``plain``) rather than as stored, in
    words for reports; ``""`` when they are not (another format, or block FP8 the kernels take)."""
    if weight_format == "fp8":
        return "FP8 in blocks other than 128x128 is dequantized on load"
    if weight_format == _FP8_BLOCK128 and intermediate_size % FP8_BLOCK:
        return (f"FP8 dequantized on load: the expert intermediate size F ({intermediate_size}) is not a multiple of "
                f"{FP8_BLOCK}, so the gate and up rows would share a scale block")
    return ""


def held_as(weight_format: str, intermediate_size: int, parallel: str, dtype: str) -> str:
    """How ``epmoe run`` and ``epmoe serve`` hold routed experts of ``weight_format`` and intermediate size
    ``intermediate_size`` under ``parallel`` (``ep`` or ``tp``) in the compute ``dtype``, for reports: a quantized
    format kept as stored (``fp8 (block 128) as stored``), or the compute dtype, with the reason where a quantized
    checkpoint is dequantized on load.

    Raises:
        ValueError: a format that is not served (``ExpertStorage.of``).
    """
    storage = ExpertStorage.of(weight_format, intermediate_size)
    if storage.kind != "plain":
        if parallel == "tp":
            return f"{dtype} ({storage.format_name} dequantized on load: --parallel tp)"
        return f"{storage.format_name} as stored"
    reason = dequantized_reason(weight_format, intermediate_size)
    return f"{dtype} ({reason})" if reason else dtype


def served_format(weight_format: str, intermediate_size: int) -> str:
    """The format the routed experts of ``weight_format`` are served in, as the planner prices it: ``bf16`` where
    ``ExpertStorage.of`` dequantizes them on load, else ``weight_format``."""
    return "bf16" if dequantized_reason(weight_format, intermediate_size) else weight_format


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for v in shape:
        n *= v
    return n
