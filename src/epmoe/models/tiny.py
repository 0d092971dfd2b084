"""Small real-format checkpoints of every served family, written by transformers itself.

Each entry keeps the routing architecture of the real model (scoring, grouping, shared experts,
dense-first layers, biases) and scales the sizes down so a whole model runs on two CPU cores in
seconds. ``build_tiny_checkpoint`` calls ``save_pretrained``: the tensors have the published names and
layout, and a byte-level tokenizer is saved beside them.

The quantized families (``QUANTIZED_FAMILIES``) start from such a checkpoint and rewrite its routed experts in
the published quantized layout, with the format's own package doing the quantization:

- ``kimi-k2.5-int4``: Kimi-K2.5 as published: a ``kimi_k25`` config with the language model under
  ``text_config`` (``model_type: kimi_k2``) and its ``quantization_config`` (compressed-tensors,
  ``pack-quantized``, 4-bit symmetric int, group 32, the published ``ignore`` list), every tensor under
  ``language_model.``, the routed experts as ``weight_packed`` int32 / ``weight_scale`` bf16 / ``weight_shape``
  (quantized and packed by ``compressed-tensors``), everything else unquantized.
- ``gpt-oss-mxfp4``: gpt-oss as published: ``quantization_config.quant_method: mxfp4``, the fused experts as
  ``gate_up_proj_blocks`` / ``_scales`` and ``down_proj_blocks`` / ``_scales`` (values rounded to E2M1 and packed
  by ``compressed-tensors``' FP4 helpers, E8M0 block scales by its MX rule), gate/up rows interleaved, biases
  unquantized.
- ``deepseek-v3-fp8``: DeepSeek-V3 as published: ``quantization_config`` ``fp8`` in 128x128 blocks, every linear
  weight of the decoder layers (attention, dense MLPs, shared and routed experts; not the router, embeddings or
  ``lm_head``) as ``float8_e4m3fn`` with a float32 ``_scale_inv`` companion (``experts.fp8.quantize_block_fp8``: no
  package quantizes DeepSeek's layout), the routed experts' intermediate size 128 (one whole block, so that they
  are served as stored).
"""

from __future__ import annotations

import inspect
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

# Shared small sizes: hidden 64, 4 heads, vocab 259 (256 bytes + bos/eos/pad).
_COMMON: dict[str, Any] = dict(
    hidden_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=259, max_position_embeddings=256,
    bos_token_id=256, eos_token_id=257, pad_token_id=258, tie_word_embeddings=False, initializer_range=0.05,
)
_MLA: dict[str, Any] = dict(
    num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
    rope_scaling=None,
)

TINY_FAMILIES: dict[str, dict[str, Any]] = {
    # Kimi-K2.5's language model (DeepSeek-V3 architecture, model_type kimi_k2 in the real file):
    # sigmoid scoring with a correction bias, n_group 1, 1 shared expert, first layer dense,
    # routed_scaling_factor 2.827, top-k normalised. 384 experts top-8 scaled to 16 experts top-4.
    "kimi-k2.5": dict(
        model_type="deepseek_v3", num_hidden_layers=3, first_k_dense_replace=1, n_routed_experts=16,
        num_experts_per_tok=4, n_group=1, topk_group=1, n_shared_experts=1, moe_intermediate_size=32,
        intermediate_size=128, routed_scaling_factor=2.827, norm_topk_prob=True, **_MLA,
    ),
    # DeepSeek-V3: 8 groups / top-4 groups scaled to 4 groups / top-2 groups.
    "deepseek-v3": dict(
        model_type="deepseek_v3", num_hidden_layers=3, first_k_dense_replace=1, n_routed_experts=16,
        num_experts_per_tok=4, n_group=4, topk_group=2, n_shared_experts=1, moe_intermediate_size=32,
        intermediate_size=128, routed_scaling_factor=2.5, norm_topk_prob=True, **_MLA,
    ),
    # DeepSeek-V2 with device-limited (group_limited_greedy) routing, 2 shared experts, softmax.
    "deepseek-v2": dict(
        model_type="deepseek_v2", num_hidden_layers=3, first_k_dense_replace=1, n_routed_experts=16,
        num_experts_per_tok=4, n_group=4, topk_group=2, topk_method="group_limited_greedy", n_shared_experts=2,
        moe_intermediate_size=32, intermediate_size=128, routed_scaling_factor=1.0, **_MLA,
    ),
    # GLM-4.5 (glm4_moe): the DeepSeek-V3 router (sigmoid, correction bias, grouped top-k by top-2 sums,
    # routed_scaling_factor 2.5, normalised) with 1 shared expert and the first 3 of 92 layers dense, on GQA
    # attention with q/k/v biases, QK norm and rotary on half of each head. 160 experts top-8 scaled to 16
    # experts top-4 in 4 groups (2 kept), so the grouping is exercised; the first of 3 layers dense.
    "glm4.5": dict(
        model_type="glm4_moe", num_hidden_layers=3, first_k_dense_replace=1, n_routed_experts=16,
        num_experts_per_tok=4, n_group=4, topk_group=2, n_shared_experts=1, moe_intermediate_size=32,
        intermediate_size=128, routed_scaling_factor=2.5, norm_topk_prob=True, head_dim=16, attention_bias=True,
        use_qk_norm=True, partial_rotary_factor=0.5,
    ),
    "qwen2-moe": dict(
        model_type="qwen2_moe", num_hidden_layers=2, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=48, intermediate_size=96, norm_topk_prob=False,
    ),
    "qwen3-moe": dict(
        model_type="qwen3_moe", num_hidden_layers=2, num_experts=16, num_experts_per_tok=4,
        moe_intermediate_size=32, intermediate_size=96, norm_topk_prob=True, head_dim=16,
    ),
    "mixtral": dict(model_type="mixtral", num_hidden_layers=2, num_local_experts=8, num_experts_per_tok=2,
                    intermediate_size=32),
    "olmoe": dict(model_type="olmoe", num_hidden_layers=2, num_experts=16, num_experts_per_tok=4,
                  intermediate_size=32, num_key_value_heads=4),
    "gpt-oss": dict(
        model_type="gpt_oss", num_hidden_layers=2, num_local_experts=8, num_experts_per_tok=4,
        intermediate_size=32, head_dim=16, layer_types=["sliding_attention", "full_attention"], sliding_window=8,
        swiglu_limit=7.0, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    ),
    "llama4": dict(
        model_type="llama4_text", num_hidden_layers=2, num_local_experts=8, num_experts_per_tok=1,
        intermediate_size=32, intermediate_size_mlp=64, head_dim=16, interleave_moe_layer_step=1,
        no_rope_layers=[1, 1], attention_chunk_size=64, rope_scaling=None,
    ),
}

DEFAULT_FAMILY = "kimi-k2.5"

# quantized family -> (the family its transformers checkpoint is built from, the routed-expert format)
QUANTIZED_FAMILIES: dict[str, tuple[str, str]] = {
    "kimi-k2.5-int4": ("kimi-k2.5", "int4"),
    "gpt-oss-mxfp4": ("gpt-oss", "mxfp4"),
    "deepseek-v3-fp8": ("deepseek-v3", "fp8"),
}
INT4_GROUP = 32
# Kimi-K2.5's published quantization_config (under text_config)
KIMI_K25_QUANTIZATION: dict[str, Any] = {
    "config_groups": {"group_0": {
        "input_activations": None, "output_activations": None, "targets": ["Linear"],
        "weights": {"actorder": None, "block_structure": None, "dynamic": False, "group_size": INT4_GROUP,
                    "num_bits": 4, "observer": "minmax", "observer_kwargs": {}, "strategy": "group",
                    "symmetric": True, "type": "int"}}},
    "format": "pack-quantized",
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"],
    "kv_cache_scheme": None, "quant_method": "compressed-tensors", "quantization_status": "compressed",
}
# DeepSeek-V3's published quantization_config
DEEPSEEK_FP8_QUANTIZATION: dict[str, Any] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                             "weight_block_size": [128, 128]}
_FP8_UNQUANTIZED = ("embed_tokens.weight", "lm_head.weight", "mlp.gate.weight")  # DeepSeek keeps these in bf16
GPT_OSS_QUANTIZATION: dict[str, Any] = {
    "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
                               "lm_head"],
    "quant_method": "mxfp4",
}


def _byte_tokenizer():
    """A byte-level BPE tokenizer with no merges: token ``i < 256`` is byte ``i``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_chars = sorted(alphabet, key=lambda c: _byte_of(c))
    vocab = {ch: i for i, ch in enumerate(byte_chars)}
    vocab.update({"<s>": 256, "</s>": 257, "<pad>": 258})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def _byte_of(ch: str) -> int:
    """GPT-2's byte -> printable-char table, inverted."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    if ord(ch) in printable:
        return ord(ch)
    extra = [b for b in range(256) if b not in printable]
    return extra[ord(ch) - 256]


class TinyBuildError(ValueError):
    """A tiny checkpoint its family and overrides do not make (``build_tiny_checkpoint``); the message names them."""


def build_tiny_checkpoint(
    family: str, directory: str | Path, seed: int = 0, dtype: torch.dtype = torch.float32,
    overrides: dict[str, Any] | None = None,
) -> Path:
    """Write a small checkpoint of ``family`` to ``directory`` with transformers' ``save_pretrained``.

    Routers get non-trivial weights (and DeepSeek-V3 a non-zero correction bias) so that routing is
    spread over all experts; everything else keeps transformers' own initialisation.

    Args:
        family: a key of ``TINY_FAMILIES`` or ``QUANTIZED_FAMILIES`` (the latter written in float32 with the
            routed experts quantized; ``dtype`` does not apply).
        directory: output directory (created).
        seed: RNG seed of the weights.
        dtype: dtype the tensors are saved in.
        overrides: config fields replacing the family's (e.g. ``hidden_size`` past one 128-wide FP8 block).

    Returns:
        The directory.

    Raises:
        KeyError: unknown family (the known ones are listed).
        TinyBuildError: (a ``ValueError``) an override that is no field of the family's config, or values the model
            cannot be built with (transformers' or torch's message, the overrides named); nothing is left in
            ``directory``'s place.
    """
    out = Path(directory)
    staging = Path(tempfile.mkdtemp(prefix="epmoe-tiny-"))  # built whole there, then moved: nothing half-written
    try:
        try:
            _build_tiny(family, staging, seed, dtype, overrides)
        except (KeyError, TinyBuildError):
            raise
        except Exception as exc:  # transformers', huggingface_hub's and torch's own errors of a config they refuse
            raise TinyBuildError(f"tiny {family!r} with overrides {overrides or {}} cannot be built: "
                                 f"{type(exc).__name__}: {exc}") from None
        out.mkdir(parents=True, exist_ok=True)
        for built in staging.iterdir():
            shutil.move(str(built), out / built.name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def _build_tiny(family: str, out: Path, seed: int, dtype: torch.dtype, overrides: dict[str, Any] | None) -> Path:
    """``build_tiny_checkpoint``'s work (its errors raw)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if family in QUANTIZED_FAMILIES:
        return _build_quantized(family, out, seed, overrides)
    if family not in TINY_FAMILIES:
        raise KeyError(f"unknown tiny family {family!r}; known: {sorted(TINY_FAMILIES) + sorted(QUANTIZED_FAMILIES)}")
    model_type = TINY_FAMILIES[family]["model_type"]
    default = AutoConfig.for_model(model_type)  # the fields its config class declares, with their aliases
    known = {*_COMMON, *TINY_FAMILIES[family], *vars(default), *inspect.signature(type(default).__init__).parameters,
             *getattr(default, "attribute_map", {})}
    unknown = sorted(set(overrides or {}) - known)
    if unknown:
        raise TinyBuildError(f"tiny {family!r}: override(s) {unknown} are no fields of transformers' {model_type} "
                             f"config")
    kwargs = {**_COMMON, **TINY_FAMILIES[family], **(overrides or {})}
    kwargs.pop("model_type")
    config = AutoConfig.for_model(model_type, **kwargs)
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("gate.weight", "router.weight")) and param.dim() == 2 and param.shape[0] > 1:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.5)
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn(buf.shape, generator=gen) * 0.05)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    _byte_tokenizer().save_pretrained(out)
    (out / "epmoe_tiny.json").write_text(json.dumps({"family": family, "seed": seed, "overrides": overrides or {}}))
    return out


def build_tiny_dense_checkpoint(directory: str | Path, model_type: str = "qwen3", seed: int = 0,
                                dtype: torch.dtype = torch.float32, num_hidden_layers: int = 1) -> Path:
    """A small dense checkpoint (a speculative decoding draft) with the tiny families' vocabulary and tokenizer,
    written by transformers' ``save_pretrained``.

    Args:
        directory: output directory (created).
        model_type: a transformers dense causal LM type (``qwen3``, ``llama``, ...).
        seed: RNG seed of the weights.
        dtype: dtype the tensors are saved in.
        num_hidden_layers: decoder layers.

    Returns:
        The directory.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = {**_COMMON, "num_hidden_layers": num_hidden_layers, "intermediate_size": 96, "head_dim": 16}
    config = AutoConfig.for_model(model_type, **kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    _byte_tokenizer().save_pretrained(out)
    return out


def build_tiny_eagle3_config(directory: str | Path, template: str | Path, target: str | Path,
                             draft_vocab_size: int = 200, aux_layer_ids: list[int] | None = None) -> Path:
    """An EAGLE-3 head's ``config.json`` for a small target: a published draft config (``template``, e.g.
    ``data/configs/eagle3-draft-kimi-k2-instruct-aq-medai.config.json``) with its sizes scaled to the
    target's hidden size and vocabulary (no weights: the engine makes random ones).

    Args:
        directory: output directory (created).
        template: the draft config it follows.
        target: the target checkpoint directory.
        draft_vocab_size: the head's vocabulary (mapped to the target's by ``d2t``).
        aux_layer_ids: ``eagle_aux_hidden_state_layer_ids`` (``None`` = the template's, dropped when past the
            target's layers: the default layers then).

    Returns:
        The directory.
    """
    cfg = json.loads(Path(template).read_text())
    target_cfg = json.loads((Path(target) / "config.json").read_text())
    heads = target_cfg["num_attention_heads"]
    cfg.update(hidden_size=target_cfg["hidden_size"], num_attention_heads=heads, num_key_value_heads=2,
               head_dim=target_cfg["hidden_size"] // heads, intermediate_size=2 * target_cfg["hidden_size"],
               vocab_size=target_cfg["vocab_size"], draft_vocab_size=draft_vocab_size,
               max_position_embeddings=target_cfg["max_position_embeddings"], bos_token_id=_COMMON["bos_token_id"],
               eos_token_id=_COMMON["eos_token_id"])
    eagle = dict(cfg.get("eagle_config") or {})
    ids = aux_layer_ids if aux_layer_ids is not None else eagle.get("eagle_aux_hidden_state_layer_ids")
    if ids is not None and all(i < target_cfg["num_hidden_layers"] for i in ids):
        eagle["eagle_aux_hidden_state_layer_ids"] = list(ids)
    else:
        eagle.pop("eagle_aux_hidden_state_layer_ids", None)
    cfg["eagle_config"] = eagle
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def _build_quantized(family: str, out: Path, seed: int, overrides: dict[str, Any] | None) -> Path:
    """Write ``family`` of ``QUANTIZED_FAMILIES``: its base checkpoint by transformers, then the routed experts
    rewritten in the published quantized layout (see the module docstring)."""
    import tempfile

    from safetensors.torch import load_file, save_file

    base_family, fmt = QUANTIZED_FAMILIES[family]
    if fmt == "fp8":  # routed experts of whole 128-row blocks (unless the caller sizes them otherwise)
        overrides = {"moe_intermediate_size": 128, **(overrides or {})}
    with tempfile.TemporaryDirectory(prefix=f"{family}-base-") as tmp:
        base = build_tiny_checkpoint(base_family, tmp, seed=seed, overrides=overrides)
        tensors: dict[str, torch.Tensor] = {}
        for f in sorted(base.glob("*.safetensors")):
            tensors.update(load_file(f))
        config = json.loads((base / "config.json").read_text())
        out.mkdir(parents=True, exist_ok=True)
        for f in base.iterdir():
            if f.suffix != ".safetensors" and f.name not in ("model.safetensors.index.json", "config.json"):
                shutil.copy(f, out / f.name)
    if fmt == "int4":
        tensors = {f"language_model.{k}": v for k, v in _int4_experts(tensors).items()}
        text = {**config, "model_type": "kimi_k2", "quantization_config": KIMI_K25_QUANTIZATION}
        config = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
                  "auto_map": {"AutoConfig": "configuration_kimi_k25.KimiK25Config"}, "text_config": text,
                  "bos_token_id": config.get("bos_token_id"), "eos_token_id": config.get("eos_token_id"),
                  "pad_token_id": config.get("pad_token_id"), "tie_word_embeddings": False}
    elif fmt == "fp8":
        tensors = _fp8_linear_weights(tensors)
        config = {**config, "quantization_config": DEEPSEEK_FP8_QUANTIZATION}
    else:
        tensors = _mxfp4_experts(tensors)
        config = {**config, "quantization_config": GPT_OSS_QUANTIZATION}
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=1))
    (out / "epmoe_tiny.json").write_text(json.dumps({"family": family, "seed": seed, "overrides": overrides or {}}))
    return out


def _int4_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Routed expert ``...mlp.experts.{e}.{gate,up,down}_proj.weight`` -> compressed-tensors' pack-quantized triple
    (``quantize`` with min-max group scales, ``pack_to_int32``); scales in bf16 as Kimi-K2.5 stores them."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import quantize
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    args = QuantizationArgs(num_bits=4, type="int", strategy="group", group_size=INT4_GROUP, symmetric=True)
    out: dict[str, torch.Tensor] = {}
    for name, w in tensors.items():
        if ".mlp.experts." not in name or not name.endswith("_proj.weight"):
            out[name] = w
            continue
        groups = w.float().unflatten(-1, (-1, INT4_GROUP))
        scale, zero_point = calculate_qparams(groups.amin(-1), groups.amax(-1), args)
        scale = scale.to(torch.bfloat16)
        q = quantize(w.float(), scale.float(), zero_point, args, dtype=torch.int8)
        out[name + "_packed"] = pack_to_int32(q, 4)
        out[name + "_scale"] = scale
        out[name + "_shape"] = torch.tensor(list(w.shape), dtype=torch.int64)
    return out


def _fp8_linear_weights(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every 2-d ``.weight`` but the router's, the embeddings' and ``lm_head``'s -> ``float8_e4m3fn`` and its
    ``_scale_inv`` ``[ceil(N/128), ceil(K/128)]`` float32, as DeepSeek-V3 stores them."""
    from epmoe.experts.fp8 import quantize_block_fp8

    out: dict[str, torch.Tensor] = {}
    for name, w in tensors.items():
        if w.dim() == 2 and name.endswith(".weight") and not name.endswith(_FP8_UNQUANTIZED):
            q, scale = quantize_block_fp8(w.float()[None])
            out[name], out[name + "_scale_inv"] = q[0], scale[0]
        else:
            out[name] = w
    return out


def _mxfp4_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """gpt-oss's fused ``...experts.gate_up_proj [E, D, 2F]`` and ``down_proj [E, F, D]`` -> ``_blocks
    [E, N, K/32, 16]`` uint8 and ``_scales [E, N, K/32]`` uint8 (``N`` the output dimension: the transpose of
    transformers' layout, gate/up rows still interleaved), by compressed-tensors' MX scale rule and FP4 packing."""
    from compressed_tensors.compressors.nvfp4.helpers import pack_fp4_to_uint8
    from compressed_tensors.quantization.utils.fp4_utils import cast_to_fp4
    from compressed_tensors.quantization.utils.mxfp_utils import generate_mx_scales

    out: dict[str, torch.Tensor] = {}
    for name, w in tensors.items():
        if not name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            out[name] = w
            continue
        rows = w.float().transpose(1, 2)  # [E, N, K]
        groups = rows.unflatten(-1, (-1, 32))
        exponent = generate_mx_scales(groups.abs().amax(-1))  # biased E8M0, as float
        values = cast_to_fp4(groups / torch.exp2(exponent - 127).unsqueeze(-1))
        packed = pack_fp4_to_uint8(values.reshape(-1, 32))
        out[name + "_blocks"] = packed.reshape(*groups.shape[:-1], 16).contiguous()
        out[name + "_scales"] = exponent.to(torch.uint8).contiguous()
    return out


def default_cache_dir() -> Path:
    """``$EPMOE_CACHE`` or ``~/.cache/epmoe``."""
    return Path(os.environ.get("EPMOE_CACHE", Path.home() / ".cache" / "epmoe"))


def ensure_default_checkpoint(cache_dir: str | Path | None = None) -> Path:
    """The built-in checkpoint directory, built once with transformers and cached (atomic rename).

    Raises:
        ValueError: the cache path is a file, or the cached checkpoint cannot be read (with the fix).
    """
    root = Path(cache_dir) if cache_dir else default_cache_dir()
    if root.exists() and not root.is_dir():
        raise ValueError(f"cache directory {str(root)!r} (EPMOE_CACHE) is a file: point EPMOE_CACHE at a directory")
    target = root / f"{DEFAULT_FAMILY}-tiny"
    if (target / "epmoe_tiny.json").is_file():
        from epmoe.models.hf import check_checkpoint

        try:
            reader = check_checkpoint(str(target))  # its config.json against the weights' headers, as the loader
            for name in reader.keys():  # read every tensor header and payload once: catches truncation
                reader.get(name)
        except Exception as exc:
            raise ValueError(
                f"the cached built-in checkpoint {str(target)!r} is unreadable ({type(exc).__name__}: {exc}); "
                f"delete that directory and run again to rebuild it"
            ) from None
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".{target.name}.{os.getpid()}"
    build_tiny_checkpoint(DEFAULT_FAMILY, tmp)
    try:
        tmp.rename(target)
    except OSError:  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
    return target
