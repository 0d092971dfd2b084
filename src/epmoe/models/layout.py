"""Where each model family keeps the parts of an MoE block, in the module tree and in the checkpoint, and reading
one logical expert in our layout (widened, or packed as ``ExpertStorage`` keeps it) through a ``CheckpointReader``."""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal, Mapping

import torch

from epmoe.experts.storage import ExpertStorage
from epmoe.models.checkpoint import CheckpointReader

ExpertFormat = Literal["per_expert", "fused_interleaved", "fused_concat"]


@dataclass(frozen=True)
class FamilyLayout:
    """Where one model family keeps the parts of an MoE block, in the module tree and in the checkpoint.

    Attributes:
        moe_attr: attribute of the decoder layer holding the MoE block (``mlp`` or ``feed_forward``).
        ckpt_block: name of the block in checkpoint tensor names (Mixtral: ``block_sparse_moe``).
        router: our router parameter name -> checkpoint suffix.
        experts: ``per_expert`` (``experts.{e}.{gate,up,down}``), ``fused_interleaved`` (gpt-oss:
            ``gate_up_proj [E, D, 2F]`` with gate/up interleaved) or ``fused_concat`` (Llama-4:
            ``gate_up_proj [E, D, 2F]``, gate then up).
        expert_names: per-expert name patterns for gate, up and down (``{e}`` = expert id).
        shared: checkpoint prefix of the shared expert, or ``None``.
        shared_gate: checkpoint name of Qwen2-MoE's shared-expert gate, or ``None``.
        returns_tuple: the family's decoder layer unpacks ``(hidden, router_output)`` from the block.
    """

    moe_attr: str
    ckpt_block: str
    router: dict[str, str]
    experts: ExpertFormat
    expert_names: tuple[str, str, str] = ("experts.{e}.gate_proj.weight", "experts.{e}.up_proj.weight",
                                          "experts.{e}.down_proj.weight")
    shared: str | None = None
    shared_gate: str | None = None
    returns_tuple: bool = False


_GATE = {"weight": "gate.weight"}
_DEEPSEEK_V3 = FamilyLayout(
    "mlp", "mlp", {"weight": "gate.weight", "e_score_correction_bias": "gate.e_score_correction_bias"},
    "per_expert", shared="shared_experts")
# model_type -> its checkpoint layout (read-only)
FAMILY_LAYOUTS: Mapping[str, FamilyLayout] = MappingProxyType({
    "deepseek_v2": FamilyLayout("mlp", "mlp", _GATE, "per_expert", shared="shared_experts"),
    "deepseek_v3": _DEEPSEEK_V3,
    "kimi_k2": _DEEPSEEK_V3,
    "glm4_moe": _DEEPSEEK_V3,
    "qwen2_moe": FamilyLayout("mlp", "mlp", _GATE, "per_expert", shared="shared_expert",
                              shared_gate="shared_expert_gate.weight"),
    "qwen3_moe": FamilyLayout("mlp", "mlp", _GATE, "per_expert"),
    "olmoe": FamilyLayout("mlp", "mlp", _GATE, "per_expert"),
    "mixtral": FamilyLayout("mlp", "block_sparse_moe", _GATE, "per_expert",
                            expert_names=("experts.{e}.w1.weight", "experts.{e}.w3.weight", "experts.{e}.w2.weight")),
    "gpt_oss": FamilyLayout("mlp", "mlp", {"weight": "router.weight", "bias": "router.bias"},
                            "fused_interleaved", returns_tuple=True),
    "llama4_text": FamilyLayout("feed_forward", "feed_forward", {"weight": "router.weight"}, "fused_concat",
                                shared="shared_expert", returns_tuple=True),
})


def family_layout(model_type: str) -> FamilyLayout:
    """The layout of ``model_type``.

    Raises:
        KeyError: unsupported model type (the supported ones are listed).
    """
    try:
        return FAMILY_LAYOUTS[model_type]
    except KeyError:
        raise KeyError(f"no checkpoint layout for model_type {model_type!r}; supported: "
                       f"{sorted(FAMILY_LAYOUTS)}") from None


def expert_tensor_names(layout: FamilyLayout, block: str, expert: int) -> list[str]:
    """The checkpoint tensors holding logical expert ``expert`` of one MoE block (the one place they are spelled).

    Args:
        layout: the family layout.
        block: checkpoint prefix of the MoE block, e.g. ``model.layers.3.mlp``.
        expert: logical expert id (fused layouts hold every expert in the same tensors).

    Returns:
        ``per_expert``: gate, up, down; fused layouts: ``gate_up_proj``, ``down_proj`` (and for
        ``fused_interleaved`` their biases), each ``[E, ...]``.
    """
    if layout.experts == "per_expert":
        return [f"{block}.{n.format(e=expert)}" for n in layout.expert_names]
    names = [f"{block}.experts.gate_up_proj", f"{block}.experts.down_proj"]
    if layout.experts == "fused_interleaved":
        names += [f"{block}.experts.gate_up_proj_bias", f"{block}.experts.down_proj_bias"]
    return names


def expert_tensor_shapes(layout: FamilyLayout, num_experts: int, hidden: int, inter: int) -> list[tuple[int, ...]]:
    """The shapes of the tensors ``expert_tensor_names`` lists, in its order, as the published layout stores them
    (unquantized or block-FP8: the float8 tensor has the weight's shape).

    Args:
        layout: the family layout.
        num_experts: ``E`` (fused layouts hold every expert in one tensor).
        hidden: ``D``.
        inter: ``F``, one routed expert's intermediate size.

    Returns:
        ``per_expert``: gate ``[F, D]``, up ``[F, D]``, down ``[D, F]``; fused: ``gate_up_proj [E, D, 2F]``,
        ``down_proj [E, F, D]`` (and ``fused_interleaved``'s biases ``[E, 2F]``, ``[E, D]``).
    """
    if layout.experts == "per_expert":
        return [(inter, hidden), (inter, hidden), (hidden, inter)]
    shapes = [(num_experts, hidden, 2 * inter), (num_experts, inter, hidden)]
    if layout.experts == "fused_interleaved":
        shapes += [(num_experts, 2 * inter), (num_experts, hidden)]
    return shapes


def read_expert(
    reader: CheckpointReader, layout: FamilyLayout, block: str, expert: int
) -> dict[str, torch.Tensor]:
    """Read one logical expert of one MoE block in our layout.

    Args:
        reader: the checkpoint.
        layout: the family layout.
        block: checkpoint prefix of the MoE block, e.g. ``model.layers.3.mlp``.
        expert: logical expert id.

    Returns:
        ``w13 [2F, D]`` (gate rows, then up rows), ``w2 [D, F]``, and for gpt-oss ``b13 [2F]``, ``b2 [D]``.

    Raises:
        KeyError: a tensor of this expert is missing (its name is in the message).
    """
    names = expert_tensor_names(layout, block, expert)
    if layout.experts == "per_expert":
        gate, up, down = (reader.get(n) for n in names)
        return {"w13": torch.cat([gate, up], dim=0), "w2": down}
    gate_up = reader.get(names[0], expert).t()  # [2F, D]
    down = reader.get(names[1], expert).t()  # [D, F]
    if layout.experts == "fused_concat":
        return {"w13": gate_up.contiguous(), "w2": down.contiguous()}
    out = {"w13": torch.cat([gate_up[0::2], gate_up[1::2]], dim=0), "w2": down.contiguous()}
    bias = reader.get(names[2], expert)
    out["b13"] = torch.cat([bias[0::2], bias[1::2]])
    out["b2"] = reader.get(names[3], expert)
    return out


def read_expert_packed(
    reader: CheckpointReader, layout: FamilyLayout, block: str, expert: int, storage: ExpertStorage, d: int, f: int
) -> dict[str, torch.Tensor]:
    """Read one logical expert of one MoE block packed, as ``ExpertStorage`` keeps it (not widened).

    Args:
        reader: the checkpoint.
        layout: the family layout (block FP8 and INT4: per-expert tensors, DeepSeek-V3/R1, Kimi-K2/K2.5, Qwen3;
            MXFP4: gpt-oss's fused interleaved ones).
        block: checkpoint prefix of the MoE block, e.g. ``model.layers.3.mlp``.
        expert: logical expert id.
        storage: ``fp8``, ``int4`` or ``mxfp4`` storage.
        d, f: hidden and expert intermediate size from config.json (checked against the stored shapes).

    Returns:
        block FP8: ``w13 [2F, D]`` and ``w2 [D, F]`` float8_e4m3fn, ``w13_scale [2F/128, ceil(D/128)]`` and
        ``w2_scale [ceil(D/128), F/128]`` float32 (gate rows, then up rows);
        INT4: ``w13_packed [2F, D/8]``, ``w13_scale [2F, D/G]``, ``w2_packed [D, F/8]``, ``w2_scale [D, F/G]``;
        MXFP4: ``w13_blocks [2F, D/32, 16]``, ``w13_scales [2F, D/32]``, ``w2_blocks [D, F/32, 16]``, ``w2_scales
        [D, F/32]``, ``b13 [2F]``, ``b2 [D]`` (gate rows first, then up rows: gpt-oss's interleaving undone).

    Raises:
        KeyError: a tensor of this expert is missing, or stored unquantized (its name is in the message).
        ValueError: a missing scale or shape companion, a ``weight_shape`` that disagrees with config.json, a
            layout the format is not published in (each names the tensor or the layout).
    """
    names = expert_tensor_names(layout, block, expert)
    if storage.kind in ("fp8", "int4") and layout.experts != "per_expert":
        raise ValueError(f"{storage.format_name} experts are read from per-expert tensors; {block} uses the "
                         f"{layout.experts} layout")
    if storage.kind == "fp8":
        (gate, gate_s), (up, up_s), (down, down_s) = (reader.get_fp8(n) for n in names)
        for name, got, want in zip(names, (gate.shape, up.shape, down.shape), ((f, d), (f, d), (d, f))):
            if tuple(got) != want:
                raise ValueError(f"checkpoint {reader.directory}: tensor {reader.prefix + name!r} has shape "
                                 f"{tuple(got)}, expected {want} from config.json")
        return {"w13": torch.cat([gate, up]), "w13_scale": torch.cat([gate_s, up_s]), "w2": down, "w2_scale": down_s}
    if storage.kind == "int4":
        gate, up, down = (reader.get_int4(n, expect=want) for n, want in zip(names, ((f, d), (f, d), (d, f))))
        return {"w13_packed": torch.cat([gate.packed, up.packed]), "w13_scale": torch.cat([gate.scale, up.scale]),
                "w2_packed": down.packed, "w2_scale": down.scale}
    if storage.kind != "mxfp4" or layout.experts != "fused_interleaved":
        raise ValueError(f"{block}: {storage.format_name} experts in the {layout.experts} layout are not a published "
                         f"format (MXFP4 is read from gpt-oss's fused interleaved tensors)")
    gu_blocks, gu_scales = reader.get_mxfp4(names[0], expert)
    down_blocks, down_scales = reader.get_mxfp4(names[1], expert)
    for name, got, want in ((names[0], gu_blocks.shape, (2 * f, d // 32, 16)),
                            (names[1], down_blocks.shape, (d, f // 32, 16))):
        if tuple(got) != want:
            raise ValueError(f"checkpoint {reader.directory}: tensor {reader.prefix + name + '_blocks'!r} holds "
                             f"experts of shape {tuple(got)}, expected {want} from config.json")
    bias = reader.get(names[2], expert)
    return {"w13_blocks": torch.cat([gu_blocks[0::2], gu_blocks[1::2]]),
            "w13_scales": torch.cat([gu_scales[0::2], gu_scales[1::2]]),
            "w2_blocks": down_blocks, "w2_scales": down_scales,
            "b13": torch.cat([bias[0::2], bias[1::2]]), "b2": reader.get(names[3], expert)}
