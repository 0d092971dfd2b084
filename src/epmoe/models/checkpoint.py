"""Reading a Hugging Face checkpoint directory tensor by tensor, and where each family keeps its experts.

Only the tensors asked for are read (``safetensors`` memory-maps the files and ``get_slice`` reads one
expert out of a fused ``[E, ...]`` tensor), so a rank never materialises experts it does not hold.

Block-FP8 checkpoints (DeepSeek-V3/R1, Kimi-K2: ``quantization_config.quant_method: fp8``,
``weight_block_size: [128, 128]``) store a linear weight as ``float8_e4m3fn`` with a companion
``<name>_scale_inv [ceil(N/128), ceil(K/128)]`` float32; the reader hands out the dequantized tensor
(``weight[i, j] * scale_inv[i // 128, j // 128]``) and hides the companions from ``keys()``.
Multimodal wrappers whose language model is under ``text_config`` (Kimi-K2.5) keep its tensors under
``language_model.``; the reader strips that prefix so names match the language model's own modules.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Literal, Mapping

import torch
from safetensors import safe_open

SCALE_SUFFIX = "_scale_inv"
_WRAPPER_PREFIX = "language_model."


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
        config = json.loads((self.directory / "config.json").read_text())
        self.prefix = ""
        if isinstance(config.get("text_config"), dict) and any(k.startswith(_WRAPPER_PREFIX) for k in weight_map):
            self.prefix = _WRAPPER_PREFIX
        self.weight_map = weight_map
        self.block_size = _block_size(config, self.directory)
        self._handles: dict[str, object] = {}

    def _handle(self, full_name: str):
        file = self.weight_map[full_name]
        if file not in self._handles:
            self._handles[file] = safe_open(str(self.directory / file), framework="pt")
        return self._handles[file]

    def __contains__(self, name: str) -> bool:
        return self.prefix + name in self.weight_map

    def shape(self, name: str) -> tuple[int, ...]:
        """Shape of tensor ``name`` from its file header (no data read).

        Raises:
            KeyError: the checkpoint has no tensor of that name (the directory is named).
        """
        full = self.prefix + name
        if full not in self.weight_map:
            raise KeyError(f"checkpoint {self.directory} has no tensor {name!r}")
        return tuple(self._handle(full).get_slice(full).get_shape())

    def keys(self) -> list[str]:
        """Names of the model tensors in the checkpoint (wrapper prefix stripped, ``_scale_inv`` companions
        and tensors outside the language model left out)."""
        n = len(self.prefix)
        return [k[n:] for k in self.weight_map if k.startswith(self.prefix) and not k.endswith(SCALE_SUFFIX)]

    @property
    def has_fp8(self) -> bool:
        """The checkpoint holds block-FP8 weights (at least one ``_scale_inv`` companion)."""
        return any(k.endswith(SCALE_SUFFIX) for k in self.weight_map)

    def get(self, name: str, index: int | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Read tensor ``name`` (or only row ``index`` of its first dimension).

        A ``float8_e4m3fn`` tensor with a ``<name>_scale_inv`` companion comes back dequantized
        (``q[i, j] * scale_inv[i // B, j // B]``, ``B`` the block size of ``quantization_config``; ragged
        last blocks included); with ``index`` only that row of both is read.

        Args:
            name: tensor name as the language model's modules name it.
            index: row of the first dimension to read, or ``None`` for the whole tensor.
            dtype: dtype of the result; ``None`` keeps the stored dtype (float32 for dequantized FP8).

        Raises:
            KeyError: the checkpoint has no tensor of that name (the directory is named).
            ValueError: a float8 tensor without its ``_scale_inv`` companion, or a scale of the wrong
                shape (the tensor is named).
        """
        full = self.prefix + name
        if full not in self.weight_map:
            raise KeyError(f"checkpoint {self.directory} has no tensor {name!r}")
        h = self._handle(full)
        tensor = h.get_tensor(full) if index is None else h.get_slice(full)[index]
        if tensor.dtype in _FLOAT8:
            scale_name = full + SCALE_SUFFIX
            if scale_name not in self.weight_map:
                raise ValueError(
                    f"checkpoint {self.directory}: tensor {full!r} is {tensor.dtype} but has no {scale_name!r} "
                    f"companion with its block scales; cannot dequantize it"
                )
            hs = self._handle(scale_name)
            if index is None:
                tensor = dequantize_blockwise(tensor, hs.get_tensor(scale_name), self.block_size, what=full)
            elif tensor.dim() >= 2:  # one expert of a fused [E, N, K] tensor: its own [nb, kb] scales
                tensor = dequantize_blockwise(tensor, hs.get_slice(scale_name)[index], self.block_size, what=full)
            else:  # one row of a [N, K] weight: the scale row of its block
                row = hs.get_slice(scale_name)[index // self.block_size[0]]
                tensor = dequantize_blockwise(tensor[None], row[None], self.block_size, what=f"{full}[{index}]")[0]
        return tensor if dtype is None else tensor.to(dtype)


_FLOAT8 = {getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n)}


def _block_size(config: dict, directory: Path) -> tuple[int, int]:
    """``quantization_config.weight_block_size`` (top level or under ``text_config``), default 128x128."""
    qc = config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config") or {}
    size = qc.get("weight_block_size") or [128, 128]
    if len(size) != 2 or not all(isinstance(b, int) and b > 0 for b in size):
        raise ValueError(f"{directory}/config.json: quantization_config.weight_block_size must be two positive "
                         f"integers, got {size!r}")
    return int(size[0]), int(size[1])


def dequantize_blockwise(
    q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] = (128, 128), what: str = "tensor"
) -> torch.Tensor:
    """Dequantize a block-quantized weight.

    Args:
        q: ``[..., N, K]`` float8 values.
        scale: ``[..., ceil(N/bn), ceil(K/bk)]`` float32 per-block multipliers (``weight_scale_inv``).
        block: ``(bn, bk)`` block size.
        what: tensor name for messages.

    Returns:
        ``[..., N, K]`` float32, ``q[..., i, j] * scale[..., i // bn, j // bk]``.

    Raises:
        ValueError: ``scale`` has the wrong shape (the tensor is named).
    """
    from epmoe.experts.fp8 import FP8_BLOCK, dequantize_block_fp8

    bn, bk = block
    n, k = q.shape[-2:]
    want = (*q.shape[:-2], -(-n // bn), -(-k // bk))
    if tuple(scale.shape) != want:
        raise ValueError(f"{what}: block scales {what}{SCALE_SUFFIX} have shape {tuple(scale.shape)}, expected "
                         f"{want} for a {tuple(q.shape)} weight in {bn}x{bk} blocks")
    if block == (FP8_BLOCK, FP8_BLOCK):
        lead = q.shape[:-2]
        out = dequantize_block_fp8(q.reshape(-1, n, k), scale.reshape(-1, *want[-2:]).float(), torch.float32)
        return out.reshape(*lead, n, k)
    full = scale.float().repeat_interleave(bn, dim=-2)[..., :n, :].repeat_interleave(bk, dim=-1)[..., :k]
    return q.float() * full


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
