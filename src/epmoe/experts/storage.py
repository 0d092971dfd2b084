"""How a rank stores its routed experts: the parameter tensors of each served weight format.

``ExpertStorage.of(weight_format)`` maps a checkpoint's routed-expert format (``MoESpec.expert_weight_format``)
to what the experts are served in:

- ``bf16`` (any float), ``fp8``, ``fp8_block128`` -> ``plain``, the compute dtype (FP8 dequantized on load):
  ``w13 [S, 2F, D]``, ``w2 [S, D, F]``.
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

from epmoe.experts.int4 import INT4_PACK, Int4ExpertWeights, check_int4_group_size
from epmoe.experts.mxfp4 import MXFP4_BLOCK, MXFP4_BYTES, MXFP4ExpertWeights
from epmoe.experts.weights import AnyExpertWeights, ExpertWeights

StorageKind = Literal["plain", "int4", "mxfp4"]
_PLAIN_FORMATS = ("bf16", "fp8", "fp8_block128")
_INT4_PREFIX = "int4_group"


@dataclass(frozen=True)
class ExpertStorage:
    """The served storage of routed expert weights.

    Attributes:
        kind: ``plain``, ``int4`` or ``mxfp4``.
        group_size: INT4 inputs per scale (0 for the other kinds).
    """

    kind: StorageKind = "plain"
    group_size: int = 0

    @classmethod
    def of(cls, weight_format: str) -> "ExpertStorage":
        """The storage that serves checkpoints of ``weight_format``.

        Raises:
            ValueError: an unknown format, or an INT4 group size the kernels do not take (named).
        """
        if weight_format in _PLAIN_FORMATS:
            return cls("plain")
        if weight_format == "mxfp4":
            return cls("mxfp4")
        if weight_format.startswith(_INT4_PREFIX) and weight_format[len(_INT4_PREFIX):].isdigit():
            group = int(weight_format[len(_INT4_PREFIX):])
            check_int4_group_size(group, f"quantization_config weights.group_size (format {weight_format!r})")
            return cls("int4", group)
        raise ValueError(f"routed expert weight format {weight_format!r} is not served; served: unquantized, "
                         f"{', '.join(_PLAIN_FORMATS[1:])} (dequantized on load), int4_group{{32,64,128}} "
                         f"(compressed-tensors pack-quantized) and mxfp4")

    @property
    def format_name(self) -> str:
        """A short name for reports: ``plain``, ``int4 (group 32)``, ``mxfp4``."""
        return f"int4 (group {self.group_size})" if self.kind == "int4" else self.kind

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
        return ExpertWeights(tensors["w13"], tensors["w2"], b13, b2)

    def bytes_per_expert(self, d: int, f: int, dtype_bytes: int = 2) -> int:
        """Bytes of one expert's ``w13`` and ``w2`` (packed values and scales; no biases) with scales and plain
        weights of ``dtype_bytes`` bytes per element."""
        return sum(_numel(shape) * (torch.empty(0, dtype=dt).element_size() if dt is not None else dtype_bytes)
                   for shape, dt in self.shapes(1, d, f, False).values())


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for v in shape:
        n *= v
    return n
