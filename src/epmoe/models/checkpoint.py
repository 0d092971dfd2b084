"""Reading a Hugging Face checkpoint directory tensor by tensor, and where each family keeps its experts.

Only the tensors asked for are read (``safetensors`` memory-maps the files and ``get_slice`` reads one
expert out of a fused ``[E, ...]`` tensor), so a rank never materialises experts it does not hold.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from safetensors import safe_open


class CheckpointReader:
    """Random access to the tensors of a local checkpoint (``model.safetensors`` or a sharded index).

    Args:
        directory: the checkpoint directory.

    Raises:
        FileNotFoundError: no directory, no ``config.json``, or no safetensors weights in it.
        ValueError: an index file naming a shard that does not exist.
    """

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise FileNotFoundError(f"checkpoint directory {str(self.directory)!r} does not exist")
        if not (self.directory / "config.json").is_file():
            raise FileNotFoundError(f"checkpoint directory {str(self.directory)!r} has no config.json")
        index = self.directory / "model.safetensors.index.json"
        if index.is_file():
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        else:
            files = sorted(self.directory.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"checkpoint directory {str(self.directory)!r} has no *.safetensors weights")
            weight_map = {}
            for f in files:
                with safe_open(str(f), framework="pt") as h:
                    weight_map.update({k: f.name for k in h.keys()})
        missing = sorted({f for f in weight_map.values() if not (self.directory / f).is_file()})
        if missing:
            raise ValueError(f"checkpoint {self.directory}: index names missing shard files {missing}")
        self.weight_map = weight_map
        self._handles: dict[str, object] = {}

    def _handle(self, name: str):
        file = self.weight_map[name]
        if file not in self._handles:
            self._handles[file] = safe_open(str(self.directory / file), framework="pt")
        return self._handles[file]

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def keys(self) -> list[str]:
        """All tensor names in the checkpoint."""
        return list(self.weight_map)

    def get(self, name: str, index: int | None = None) -> torch.Tensor:
        """Read tensor ``name`` (or only row ``index`` of its first dimension).

        Raises:
            KeyError: the checkpoint has no tensor of that name (the directory is named).
        """
        if name not in self.weight_map:
            raise KeyError(f"checkpoint {self.directory} has no tensor {name!r}")
        h = self._handle(name)
        if index is None:
            return h.get_tensor(name)
        return h.get_slice(name)[index]


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
FAMILY_LAYOUTS: dict[str, FamilyLayout] = {
    "deepseek_v2": FamilyLayout("mlp", "mlp", _GATE, "per_expert", shared="shared_experts"),
    "deepseek_v3": FamilyLayout(
        "mlp", "mlp", {"weight": "gate.weight", "e_score_correction_bias": "gate.e_score_correction_bias"},
        "per_expert", shared="shared_experts"),
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
}
FAMILY_LAYOUTS["kimi_k2"] = FAMILY_LAYOUTS["deepseek_v3"]


def family_layout(model_type: str) -> FamilyLayout:
    """The layout of ``model_type``.

    Raises:
        KeyError: unsupported model type (the supported ones are listed).
    """
    try:
        return FAMILY_LAYOUTS[model_type]
    except KeyError:
        raise KeyError(f"no checkpoint layout for model_type {model_type!r}; supported: {sorted(FAMILY_LAYOUTS)}") from None


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
    if layout.experts == "per_expert":
        gate, up, down = (reader.get(f"{block}.{n.format(e=expert)}") for n in layout.expert_names)
        return {"w13": torch.cat([gate, up], dim=0), "w2": down}
    gate_up = reader.get(f"{block}.experts.gate_up_proj", expert).t()  # [2F, D]
    down = reader.get(f"{block}.experts.down_proj", expert).t()  # [D, F]
    if layout.experts == "fused_concat":
        return {"w13": gate_up.contiguous(), "w2": down.contiguous()}
    out = {"w13": torch.cat([gate_up[0::2], gate_up[1::2]], dim=0), "w2": down.contiguous()}
    bias = reader.get(f"{block}.experts.gate_up_proj_bias", expert)
    out["b13"] = torch.cat([bias[0::2], bias[1::2]])
    out["b2"] = reader.get(f"{block}.experts.down_proj_bias", expert)
    return out
