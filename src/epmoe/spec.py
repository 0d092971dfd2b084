"""The MoE facts of a model, parsed once from a Hugging Face ``config.json``.

Every family the project serves is read here and nowhere else: DeepSeek-V2/V3/R1, Kimi-K2 and
Kimi-K2.5 (``kimi_k2`` is the DeepSeek-V3 architecture; K2.5 keeps its language model under
``text_config``), GLM-4.5/4.6/4.7 (``glm4_moe``), Qwen1.5/Qwen2/Qwen3-MoE, Mixtral, OLMoE, gpt-oss and
Llama-4 (text part). The routing rules follow the Hugging Face transformers MoE blocks of each family; every
field is read through ``epmoe.config_fields.ConfigFields`` (typed, range-checked, transformers' defaults).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable, Literal, Mapping, NamedTuple

from epmoe.checks import MAX_EXPERTS, MAX_LAYERS, MAX_POSITIONS, MAX_VOCAB, MAX_WIDTH, read_text_file
from epmoe.config_fields import ConfigFields, json_text, transformers_rope_types

Scoring = Literal["softmax", "sigmoid"]
# How the router turns logits into top-k weights:
#   softmax_topk : softmax over all experts, then top-k (Qwen, OLMoE, Mixtral, DeepSeek-V2)
#   topk_softmax : top-k logits, then softmax over the chosen ones (gpt-oss)
#   sigmoid_topk : sigmoid scores, top-k chosen on score + correction bias (DeepSeek-V3, Kimi-K2)
#   topk_sigmoid : top-k logits, sigmoid of the chosen ones, weight applied to the expert input (Llama-4)
RouterKind = Literal["softmax_topk", "topk_softmax", "sigmoid_topk", "topk_sigmoid"]
GroupScore = Literal["max", "top2_sum"]

_DEEPSEEK_LIKE = {"deepseek_v2", "deepseek_v3", "kimi_k2", "glm4_moe"}
_QWEN = {"qwen2_moe", "qwen3_moe"}
_DENSE = {"llama", "mistral", "qwen2", "qwen3"}


@dataclass(frozen=True)
class AttentionSpec:
    """Attention facts the planner needs (per layer).

    Attributes:
        num_heads: query heads.
        num_kv_heads: key/value heads (GQA); equal to ``num_heads`` for MLA.
        head_dim: dimension of one query/key head (for MLA: ``qk_nope + qk_rope``).
        v_head_dim: dimension of one value head.
        kv_lora_rank: MLA compressed KV width, 0 when the model has no MLA.
        q_lora_rank: MLA query low-rank width, 0 when absent.
        qk_rope_head_dim: MLA decoupled RoPE key width, 0 when absent.
        layer_spans: per decoder layer, the most earlier positions (the current one included) a decode query
            attends: a ``sliding_attention`` layer's window (gpt-oss), a ``chunked_attention`` layer's chunk
            (Llama-4), ``None`` for full attention; empty when every layer attends the whole context.
    """

    num_heads: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    layer_spans: tuple[int | None, ...] = ()

    def attended_positions(self, context: int, num_layers: int) -> tuple[tuple[int, int], ...]:
        """``(layers, positions)`` groups: how many of the ``num_layers`` decoder layers read how many of
        ``context`` cached positions a decode step (``min(context, span)`` for a windowed or chunked layer, as the
        engine's decode kernel visits only those), largest first."""
        if not self.layer_spans:
            return ((num_layers, context),)
        counts: dict[int, int] = {}
        for span in self.layer_spans:
            n = context if span is None else min(context, span)
            counts[n] = counts.get(n, 0) + 1
        return tuple((layers, n) for n, layers in sorted(counts.items(), reverse=True))

    @property
    def is_mla(self) -> bool:
        """True for DeepSeek's multi-head latent attention."""
        return self.kv_lora_rank > 0


@dataclass(frozen=True)
class MoESpec:
    """The MoE facts of one model.

    Attributes:
        model_type: Hugging Face ``model_type`` of the language model (``kimi_k2`` kept as is).
        source: the file it was parsed from (for messages).
        num_layers: decoder layers in total.
        moe_layers: indices of the decoder layers whose MLP is an MoE block, ascending.
        num_experts: logical routed experts per MoE layer (``E``).
        top_k: routed experts per token (``K``).
        hidden_size: ``D``.
        moe_intermediate_size: ``F`` of one routed expert.
        dense_intermediate_size: intermediate size of the dense MLP layers (0 if none).
        num_shared_experts: shared experts per MoE layer (0 if none).
        shared_intermediate_size: total intermediate size of the shared-expert MLP (0 if none).
        shared_expert_gate: Qwen2-MoE's sigmoid gate on the shared expert output.
        router_kind: see ``RouterKind``.
        n_group: expert groups for grouped top-k (1 = not grouped).
        topk_group: groups kept per token.
        group_score: how a group is scored: ``max`` (DeepSeek-V2) or ``top2_sum`` (DeepSeek-V3).
        norm_topk_prob: renormalise the top-k weights to sum to one.
        routed_scaling_factor: multiplier on routed expert weights.
        correction_bias: DeepSeek-V3's ``e_score_correction_bias`` (selection only).
        router_bias: gpt-oss's router linear bias.
        expert_bias: gpt-oss's expert projection biases.
        hidden_act: activation of the experts (``silu``; one of ``experts.weights.ACTIVATIONS``).
        swiglu_limit: gpt-oss's clamp of the clamped SwiGLU, ``None`` for plain SwiGLU.
        swiglu_alpha: gpt-oss's sigmoid slope of the clamped SwiGLU.
        vocab_size: vocabulary size.
        max_position_embeddings: the longest sequence the model's positions cover (the engine's context unless
            ``max_model_len`` is given).
        attention: attention facts for the planner.
        expert_weight_format: routed expert storage in the published checkpoint:
            ``bf16``, ``fp8_block128`` (DeepSeek FP8, 128x128 scales), ``int4_group32`` (Kimi-K2.5),
            ``mxfp4`` (gpt-oss); another quantization keeps its own name (``compressed-tensors-int3``, ``awq``).
            ``bf16`` stands for every unquantized checkpoint, whatever its dtype (the code matches on it); people
            read ``expert_format_name``.
        checkpoint_dtype: the weights' dtype ``config.json`` names (``dtype``, ``torch_dtype`` before
            transformers 5; the language model's under ``text_config`` first), e.g. ``bfloat16``, ``float32``;
            ``None`` when it names none.
        defaults: ``(field, value)`` of the config fields that were absent and took the default of
            transformers' config class (``defaults_class``), in reading order; empty when none was.
        defaults_class: the transformers config class those defaults came from (``""`` when none).
        tie_word_embeddings: the LM head shares the embedding's weight (``config.json``'s field of that name; false
            for a config with a ``text_config``, whose model class decides which level's field ties: the parameter
            count then holds both tables).
    """

    model_type: str
    source: str
    num_layers: int
    moe_layers: tuple[int, ...]
    num_experts: int
    top_k: int
    hidden_size: int
    moe_intermediate_size: int
    dense_intermediate_size: int
    num_shared_experts: int
    shared_intermediate_size: int
    shared_expert_gate: bool
    router_kind: RouterKind
    n_group: int
    topk_group: int
    group_score: GroupScore
    norm_topk_prob: bool
    routed_scaling_factor: float
    correction_bias: bool
    router_bias: bool
    expert_bias: bool
    hidden_act: str
    swiglu_limit: float | None
    swiglu_alpha: float
    vocab_size: int
    max_position_embeddings: int
    attention: AttentionSpec
    expert_weight_format: str
    defaults: tuple[tuple[str, Any], ...] = ()
    defaults_class: str = ""
    checkpoint_dtype: str | None = None
    tie_word_embeddings: bool = False

    @property
    def expert_format_name(self) -> str:
        """The routed experts' storage as messages name it: the checkpoint's dtype for unquantized weights
        (``float32``, ``bfloat16``; ``unquantized`` when ``config.json`` names no dtype), else
        ``expert_weight_format``."""
        if self.expert_weight_format != "bf16":
            return self.expert_weight_format
        return self.checkpoint_dtype or "unquantized"

    @property
    def num_moe_layers(self) -> int:
        """``L``: the number of MoE layers."""
        return len(self.moe_layers)

    @property
    def scoring(self) -> Scoring:
        """Scoring function of the router: ``softmax`` or ``sigmoid``."""
        return "sigmoid" if self.router_kind in ("sigmoid_topk", "topk_sigmoid") else "softmax"

    @property
    def router_fp32_logits(self) -> bool:
        """The router computes its logits in float32 with a float32 weight (DeepSeek-V2/V3, Kimi-K2, GLM-4.x)."""
        return self.model_type in _DEEPSEEK_LIKE

    @property
    def round_router_weights(self) -> bool:
        """The softmax router's top-k weights are rounded to the logits' dtype (Qwen2/Qwen3-MoE, OLMoE)."""
        return self.model_type in ("qwen2_moe", "qwen3_moe", "olmoe")

    @property
    def weight_on_input(self) -> bool:
        """The routing weight scales an expert's input instead of its output (Llama-4's ``topk_sigmoid``)."""
        return self.router_kind == "topk_sigmoid"

    @property
    def dense_layers(self) -> tuple[int, ...]:
        """Decoder layers whose MLP is dense."""
        moe = set(self.moe_layers)
        return tuple(i for i in range(self.num_layers) if i not in moe)

    def describe_defaults(self) -> str:
        """The fields taken from transformers' defaults, in words (``""`` when none was), e.g.
        ``config.json has no n_group, topk_group: took transformers' Glm4MoeConfig defaults n_group=1,
        topk_group=1``."""
        if not self.defaults:
            return ""
        names = ", ".join(k for k, _ in self.defaults)
        values = ", ".join(f"{k}={v!r}" for k, v in self.defaults)
        return f"config.json has no {names}: took transformers' {self.defaults_class} defaults {values}"

    def expert_params(self) -> int:
        """Parameters of one routed expert (gate, up, down; plus biases where the model has them)."""
        d, f = self.hidden_size, self.moe_intermediate_size
        return 3 * d * f + ((2 * f + d) if self.expert_bias else 0)


class DenseModelError(ValueError):
    """Raised when MoE facts are asked of a dense model (for example an EAGLE-3 draft)."""


def language_model_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """Return the language-model part of a (possibly multimodal) config dict.

    Kimi-K2.5 and Llama-4 keep the text model under ``text_config``; other models are returned as is. Its
    ``quantization_config`` is the language model's, else the wrapper's (the one that describes its weights, which
    the spec and the checkpoint reader both read).
    """
    text = cfg.get("text_config")
    if isinstance(text, dict):
        merged = dict(text)
        if merged.get("quantization_config") is None:  # the wrapper's, where the language model names none
            merged["quantization_config"] = cfg.get("quantization_config")
        return merged
    return cfg


CONFIG_DTYPES = ("bfloat16", "float16", "float32", "float64", "half", "float", "double", "float8_e4m3fn",
                 "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu", "float4_e2m1fn_x2")
"""The dtype names a config.json's ``dtype`` (``torch_dtype``) may give: torch's floating dtypes, which transformers
reads it as."""


def _checkpoint_dtype(lm: dict[str, Any], top: dict[str, Any], source: str) -> str | None:
    """The weights' dtype ``config.json`` names (``dtype``; ``torch_dtype`` before transformers 5), the language
    model's (``lm``) first, else the top level's; ``None`` when neither names one. Every one given is checked.

    Raises:
        ValueError: the field is not one of ``CONFIG_DTYPES`` (file, field and value named).
    """
    named = [ConfigFields(part, source).str(key, choices=CONFIG_DTYPES)  # every one given is checked
             for part in (lm, top) for key in ("dtype", "torch_dtype") if part.get(key) is not None]
    return named[0] if named else None


def _check_rope(f: ConfigFields) -> None:
    """The RoPE fields transformers' rotary embeddings read, where the config gives them: ``rope_theta`` a positive
    number (at the top level, or in the RoPE object, where transformers 5 keeps it), and the object's ``rope_type``
    (``type`` in older configs) one transformers computes (``transformers_rope_types``). The object is
    ``rope_scaling`` (configs before transformers 5), else ``rope_parameters``, as transformers picks it.

    Raises:
        ValueError: a value of the wrong type or out of range (file, field and value named).
    """
    if f.has("rope_theta"):
        f.float("rope_theta", positive=True)
    rope = f.section("rope_scaling", "rope_parameters")
    if rope is not None:
        if rope.has("rope_theta"):
            rope.float("rope_theta", positive=True)
        rope.str("rope_type", "type", choices=transformers_rope_types(), fallback="default")


def _moe_layer_indices(f: ConfigFields, mt: str, num_layers: int) -> tuple[int, ...]:
    """The MoE layers by transformers' rule of each family (its decoder layer's choice of MLP)."""
    if mt in _DEEPSEEK_LIKE:
        first_dense = f.int("first_k_dense_replace", minimum=0, maximum=num_layers, fallback=0)
        freq = f.int("moe_layer_freq", fallback=1)
        if freq != 1:
            raise ValueError(
                f"{f.source}: field 'moe_layer_freq' is {freq}; only 1 is supported: transformers' {mt} model puts an "
                f"MoE block in every layer from first_k_dense_replace ({first_dense}) on"
            )
        return tuple(range(first_dense, num_layers))
    if mt in _QWEN:
        step = f.int("decoder_sparse_step")
        mlp_only = set(f.int_list("mlp_only_layers", maximum=num_layers - 1, fallback=[]))
        return tuple(i for i in range(num_layers) if i not in mlp_only and (i + 1) % step == 0)
    if mt == "llama4_text":
        if f.has("moe_layers"):
            return tuple(sorted(set(f.int_list("moe_layers", maximum=num_layers - 1))))
        step = f.int("interleave_moe_layer_step")
        return tuple(range(step - 1, num_layers, step))
    return tuple(range(num_layers))


FP8_DEFAULT_BLOCK = (128, 128)  # transformers' FineGrainedFP8Config default, when weight_block_size is absent


def fp8_block_size(qc: dict[str, Any], where: str) -> tuple[int, int]:
    """``weight_block_size`` of an FP8 ``quantization_config`` ``qc`` (``FP8_DEFAULT_BLOCK`` when absent or null).

    Raises:
        ValueError: anything but two positive integers (booleans and floats refused), named with ``where``.
    """
    size = qc.get("weight_block_size")
    if size is None:
        return FP8_DEFAULT_BLOCK
    if (not isinstance(size, list) or len(size) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in size)):
        raise ValueError(f"{where}: quantization_config.weight_block_size must be two positive integers, got "
                         f"{json_text(size)}")
    return int(size[0]), int(size[1])


INT4_SCHEME = {"type": "int", "symmetric": True, "strategy": "group"}
"""The compressed-tensors weight scheme epmoe reads 4-bit weights in (Kimi-K2/K2.5's, ``pack-quantized``), field ->
value; an absent or null field is compressed-tensors' default, which is this value where a ``group_size`` is given."""

INT4_FORMAT = "pack-quantized"
"""The compressed-tensors ``format`` 4-bit weights are read in (absent or null: this one)."""


class Int4Departure(NamedTuple):
    """How a 4-bit int compressed-tensors config group departs from what epmoe reads (``int4_scheme_departure``).

    Attributes:
        field: the field, from the group down (``format``, ``weights.symmetric``), or ``format`` of the whole
            ``quantization_config`` where ``in_group`` is false.
        in_group: the field is the group's (else the config's).
        value: its value.
        wanted: what epmoe reads instead, as messages say it (``symmetric true``).
        name: the experts' unserved format (``compressed-tensors-int4-asymmetric``).
    """

    field: str
    in_group: bool
    value: Any
    wanted: str
    name: str


def int4_scheme_departure(qc: dict[str, Any], weights: dict[str, Any],
                          group: dict[str, Any] | None = None) -> Int4Departure | None:
    """The first field of a 4-bit int compressed-tensors config group ``group`` (its ``weights``) that departs from
    what epmoe reads (``INT4_FORMAT``, ``INT4_SCHEME``, no activation ordering); ``None`` when the group is read.
    The format is the group's own where it names one, else the config's (``qc``). The spec names such experts by
    ``name`` as unserved (``_weight_format``) and the checkpoint reader refuses them by ``field``, one rule for
    both."""
    for in_group, fmt in ((True, (group or {}).get("format")), (False, qc.get("format"))):
        if fmt is not None:
            if fmt != INT4_FORMAT:
                return Int4Departure("format", in_group, fmt, f"format {json.dumps(INT4_FORMAT)}",
                                     f"compressed-tensors-int4-{fmt}")
            break
    for field, want in INT4_SCHEME.items():
        if weights.get(field) is not None and weights[field] != want:
            name = "asymmetric" if field == "symmetric" else str(weights[field])
            return Int4Departure(f"weights.{field}", True, weights[field], f"{field} {json.dumps(want)}",
                                 f"compressed-tensors-int4-{name}")
    if weights.get("actorder") not in (None, False):  # columns reordered: the packed order is not the inputs'
        return Int4Departure("weights.actorder", True, weights["actorder"], "no activation ordering",
                             "compressed-tensors-int4-actorder")
    return None


def _weight_format(cfg: dict[str, Any], source: str, prefix: str = "") -> str:
    """The routed experts' storage named from ``quantization_config`` (see ``MoESpec.expert_weight_format``): a
    quantization epmoe does not serve keeps its own name (``compressed-tensors-int3``, ``awq``), so that whoever
    reads it (``ExpertStorage.of``, the planner's sizes) refuses it by that name instead of taking it for bf16.

    Raises:
        ValueError: ``quantization_config``, its ``config_groups``, a group or a group's ``weights`` that is not a
            JSON object, a ``quant_method`` or weights ``type`` that is not a string, a ``num_bits`` that is not a
            positive integer (file, field and value named); an FP8 ``weight_block_size`` that is not two positive
            integers (``fp8_block_size``).
    """
    quant = ConfigFields(cfg, source, prefix=prefix).section("quantization_config")
    if quant is None:
        return "bf16"
    qc = quant.cfg
    method = quant.str("quant_method") if quant.has("quant_method") else None
    if method == "fp8":
        return "fp8_block128" if fp8_block_size(qc, source) == (128, 128) else "fp8"
    if method == "mxfp4":
        return "mxfp4"
    if method == "compressed-tensors" or (method is None and "config_groups" in qc):
        groups = quant.section("config_groups")
        found = []  # every group's format: one the experts could be stored in that is not served names them
        for name in groups.cfg if groups is not None else ():
            group = groups.section(name)
            w = group.section("weights") if group is not None else None
            if w is None:
                continue
            # absent or null: compressed-tensors' defaults (QuantizationArgs: 8-bit int, symmetric)
            bits, kind = w.int("num_bits", fallback=8), w.str("type", fallback="int")
            w.bool("symmetric", fallback=True)
            if bits == 4 and kind == "int":
                departure = int4_scheme_departure(qc, w.cfg, group.cfg)
                if departure is not None:  # another packing, zero points, per channel, reordered columns, ...
                    found.append(departure.name)
                elif w.has("group_size"):
                    found.append(f"int4_group{w.int('group_size')}")
                else:
                    found.append(f"compressed-tensors-int4-{w.str('strategy', fallback='tensor')}")
            else:
                found.append(f"compressed-tensors-{kind}{bits}")
        unserved = [f for f in found if not f.startswith("int4_group")]
        return (unserved or found or ["bf16"])[0]
    return method or "bf16"


@dataclass(frozen=True)
class FamilyFacts:
    """The routed-expert facts one family parser reads from a config (the rest is common to all families).

    Attributes:
        num_experts: ``E`` routed experts per MoE layer.
        moe_inter: ``F``, a routed expert's intermediate size.
        router_kind: see ``RouterKind``.
        n_group, topk_group, group_score: grouped top-k (1, 1, ``max`` = none).
        norm: renormalise the top-k weights.
        scale: the routed scaling factor.
        correction: DeepSeek-V3's score-correction bias.
        router_bias, expert_bias: gpt-oss's router and expert projection biases.
        n_shared, shared_inter, shared_gate: shared experts, their total intermediate size, Qwen2-MoE's gate.
        swiglu_limit, swiglu_alpha: gpt-oss's clamped SwiGLU.
        dense_inter: the dense MLP's intermediate size, ``None`` = the config's ``intermediate_size``.
    """

    num_experts: int
    moe_inter: int
    router_kind: RouterKind
    n_group: int = 1
    topk_group: int = 1
    group_score: GroupScore = "max"
    norm: bool = False
    scale: float = 1.0
    correction: bool = False
    router_bias: bool = False
    expert_bias: bool = False
    n_shared: int = 0
    shared_inter: int = 0
    shared_gate: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702
    dense_inter: int | None = None


def _deepseek(f: ConfigFields, mt: str) -> FamilyFacts:
    """DeepSeek-V2 (softmax, optionally group-limited), DeepSeek-V3/R1 and Kimi-K2 (sigmoid, ``noaux_tc``), and
    GLM-4.5/4.6/4.7 (``glm4_moe``: the DeepSeek-V3 router and shared experts, with GQA attention instead of MLA)."""
    num_experts = f.int("n_routed_experts", "num_local_experts", maximum=MAX_EXPERTS)
    moe_inter = f.int("moe_intermediate_size", maximum=MAX_WIDTH)
    n_shared = f.int("n_shared_experts", minimum=0, maximum=MAX_EXPERTS, fallback=0)
    common = dict(
        num_experts=num_experts, moe_inter=moe_inter, n_shared=n_shared, shared_inter=n_shared * moe_inter,
        scale=f.float("routed_scaling_factor", positive=True, fallback=1.0),
    )
    n_group = f.int("n_group", maximum=MAX_EXPERTS, fallback=1)
    topk_group = f.int("topk_group", maximum=MAX_EXPERTS, fallback=1)
    if mt == "deepseek_v2":
        f.str("scoring_func", choices=("softmax",), fallback="softmax")
        method = f.str("topk_method", choices=("greedy", "group_limited_greedy"), fallback="greedy")
        if method == "greedy":
            n_group, topk_group = 1, 1
        return FamilyFacts(router_kind="softmax_topk", n_group=n_group, topk_group=topk_group, **common)
    if mt != "glm4_moe":  # GLM configs do not spell out the (only) router they have
        f.str("scoring_func", choices=("sigmoid",), fallback="sigmoid")
        f.str("topk_method", choices=("noaux_tc",), fallback="noaux_tc")
    return FamilyFacts(router_kind="sigmoid_topk", n_group=n_group, topk_group=topk_group, group_score="top2_sum",
                       norm=f.bool("norm_topk_prob", fallback=True), correction=True, **common)


def _qwen_olmoe(f: ConfigFields, mt: str) -> FamilyFacts:
    """Qwen1.5/Qwen2-MoE (a gated shared expert), Qwen3-MoE and OLMoE: softmax, then top-k."""
    num_experts = f.int("num_experts", "num_local_experts", maximum=MAX_EXPERTS)
    # Qwen's experts are moe_intermediate_size wide (absent: transformers' default), never intermediate_size,
    # which is its dense MLP's
    moe_inter = f.int("intermediate_size" if mt == "olmoe" else "moe_intermediate_size", maximum=MAX_WIDTH)
    shared_inter = (f.int("shared_expert_intermediate_size", minimum=0, maximum=MAX_WIDTH, fallback=0)
                    if mt == "qwen2_moe" else 0)
    return FamilyFacts(
        num_experts=num_experts, moe_inter=moe_inter, router_kind="softmax_topk",
        norm=f.bool("norm_topk_prob", fallback=False),
        n_shared=1 if shared_inter > 0 else 0, shared_inter=shared_inter, shared_gate=shared_inter > 0,
    )


def _mixtral(f: ConfigFields, mt: str) -> FamilyFacts:
    """Mixtral: softmax, top-k, renormalised; every layer is MoE."""
    return FamilyFacts(num_experts=f.int("num_local_experts", maximum=MAX_EXPERTS),
                       moe_inter=f.int("intermediate_size", maximum=MAX_WIDTH),
                       router_kind="softmax_topk", norm=True, dense_inter=0)


def _gpt_oss(f: ConfigFields, mt: str) -> FamilyFacts:
    """gpt-oss: top-k logits with a router bias, softmax over them; biased experts with the clamped SwiGLU."""
    return FamilyFacts(num_experts=f.int("num_local_experts", maximum=MAX_EXPERTS),
                       moe_inter=f.int("intermediate_size", maximum=MAX_WIDTH),
                       router_kind="topk_softmax", router_bias=True, expert_bias=True,
                       swiglu_limit=f.float("swiglu_limit", positive=True),
                       swiglu_alpha=f.float("swiglu_alpha", positive=True, fallback=1.702), dense_inter=0)


def _llama4(f: ConfigFields, mt: str) -> FamilyFacts:
    """Llama-4 (text): top-k logits, sigmoid weight on the expert input; one shared expert."""
    num_experts = f.int("num_local_experts", maximum=MAX_EXPERTS)
    moe_inter = f.int("intermediate_size", maximum=MAX_WIDTH)
    return FamilyFacts(num_experts=num_experts, moe_inter=moe_inter, router_kind="topk_sigmoid", n_shared=1,
                       shared_inter=moe_inter,
                       dense_inter=f.int("intermediate_size_mlp", minimum=0, maximum=MAX_WIDTH, fallback=0))


# model_type -> the parser of its routed-expert facts (read-only, like ``models.layout.FAMILY_LAYOUTS``)
FAMILY_PARSERS: Mapping[str, Callable[[ConfigFields, str], FamilyFacts]] = MappingProxyType({
    **dict.fromkeys(sorted(_DEEPSEEK_LIKE), _deepseek),
    **dict.fromkeys(sorted(_QWEN | {"olmoe"}), _qwen_olmoe),
    "mixtral": _mixtral,
    "gpt_oss": _gpt_oss,
    "llama4_text": _llama4,
})


def _layer_spans(cfg: dict[str, Any], mt: str, num_layers: int, source: str) -> tuple[int | None, ...]:
    """``AttentionSpec.layer_spans`` from ``layer_types`` (``sliding_attention``: ``sliding_window``;
    ``chunked_attention``: ``attention_chunk_size``), or for Llama-4 without it from transformers' rule (the layers
    with RoPE, all but every ``no_rope_layer_interval``-th, are chunked); ``()`` when every layer is full.

    Raises:
        ValueError: ``layer_types`` not one entry a layer, or a windowed layer without a positive size (named).
    """
    types = cfg.get("layer_types")
    if not types and mt == "llama4_text" and cfg.get("attention_chunk_size"):
        interval = cfg.get("no_rope_layer_interval") or 4
        rope = cfg.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(num_layers)]
        types = ["chunked_attention" if r else "full_attention" for r in rope]
    if not types:
        return ()
    if not isinstance(types, list) or len(types) != num_layers:
        count = len(types) if isinstance(types, list) else json_text(types)
        raise ValueError(f"{source}: layer_types has {count} entries, expected one per layer ({num_layers})")
    sizes = {"sliding_attention": "sliding_window", "chunked_attention": "attention_chunk_size"}
    spans: list[int | None] = []
    for kind in types:
        field = sizes.get(kind)
        size = cfg.get(field) if field else None
        if field and (not isinstance(size, int) or isinstance(size, bool) or size < 1):
            raise ValueError(f"{source}: layer_types names {kind!r} layers but {field} is {json_text(size)}; "
                             f"expected a positive integer")
        spans.append(size)
    return tuple(spans) if any(x is not None for x in spans) else ()


def parse_moe_spec(cfg: dict[str, Any], source: str = "<dict>") -> MoESpec:
    """Parse the MoE facts from a Hugging Face config dict.

    Every field goes through ``ConfigFields`` (type and range checked; an absent field takes the default
    transformers' config class of the model type declares, listed in ``MoESpec.defaults``).

    Args:
        cfg: the JSON object of a ``config.json`` (multimodal wrappers are unwrapped via ``text_config``).
        source: name used in error messages (usually the file path).

    Returns:
        The validated ``MoESpec``.

    Raises:
        DenseModelError: the config describes a dense model (no routed experts), e.g. an EAGLE-3 draft.
        ValueError: a field is missing, of the wrong type or range, or contradicts another (file, field and
            value named).
    """
    text = ConfigFields(cfg, source).section("text_config")  # a wrapper's language model: an object or nothing
    # both quantization objects are checked (the wrapper's and the language model's), each named by its path
    top_format = _weight_format(cfg, source)
    weight_format = _weight_format(text.cfg, source, "text_config.") if text is not None and text.has(
        "quantization_config") else top_format
    top, cfg = cfg, language_model_config(cfg)
    where = "text_config." if text is not None else ""  # the language model's fields named by their path
    mt = ConfigFields(cfg, source, prefix=where).str("model_type")
    expert_fields = ("n_routed_experts", "num_experts", "num_local_experts")
    if mt in _DENSE:
        arch = ", ".join(cfg.get("architectures") or []) or mt
        raise DenseModelError(
            f"{source}: model_type {mt!r} ({arch}) is a dense model with no MoE layers "
            f"(EAGLE-3 drafts are one dense decoder layer); it has no experts to place"
        )
    if mt not in FAMILY_PARSERS and not any(k in cfg for k in expert_fields):
        raise DenseModelError(
            f"{source}: model_type {mt!r} is not a supported MoE family ({', '.join(sorted(FAMILY_PARSERS))}) and "
            f"its config names no routed experts ({' / '.join(expert_fields)}): read as a dense model, "
            f"it has no experts to place"
        )
    if mt not in FAMILY_PARSERS:
        raise ValueError(f"{source}: model_type {mt!r} is not supported; supported: {sorted(FAMILY_PARSERS)}")

    from epmoe.experts.weights import ACTIVATIONS

    f = ConfigFields(cfg, source, mt, prefix=where)
    num_layers = f.int("num_hidden_layers", maximum=MAX_LAYERS)
    hidden = f.int("hidden_size", maximum=MAX_WIDTH)
    vocab = f.int("vocab_size", maximum=MAX_VOCAB)
    if cfg.get("pad_token_id") is not None:  # the embedding's padding row (transformers asserts it lies in the table)
        f.int("pad_token_id", minimum=0, maximum=vocab - 1)
    num_heads = f.int("num_attention_heads", maximum=MAX_WIDTH)
    hidden_act = f.str("hidden_act", choices=ACTIVATIONS, fallback="silu")
    max_positions = f.int("max_position_embeddings", maximum=MAX_POSITIONS)
    # a composite config's tying is its model class's rule (Kimi-K2.5 reads the top level, true when absent; Llama-4
    # its text_config): read only where there is one level, else both tables are counted (an overestimate)
    if cfg.get("tie_word_embeddings", False) is None:
        raise ValueError(f"{source}: field {where + 'tie_word_embeddings'!r} is null in config.json; give true or "
                         f"false, or leave it out for transformers' default")
    tied = f.bool("tie_word_embeddings", fallback=False) if not where else False
    if f.has("rms_norm_eps"):
        f.float("rms_norm_eps", positive=True)
    _check_rope(f)

    facts = FAMILY_PARSERS[mt](f, mt)
    num_experts, moe_inter, n_group, topk_group = facts.num_experts, facts.moe_inter, facts.n_group, facts.topk_group
    dense_inter = (facts.dense_inter if facts.dense_inter is not None
                   else f.int("intermediate_size", minimum=0, maximum=MAX_WIDTH, fallback=0))

    top_k = f.int("num_experts_per_tok", "experts_per_token")
    both = f.has("experts_per_token") and f.has("num_experts_per_tok")
    if both and cfg["experts_per_token"] != cfg["num_experts_per_tok"]:
        raise ValueError(
            f"{source}: num_experts_per_tok ({cfg['num_experts_per_tok']}) contradicts "
            f"experts_per_token ({cfg['experts_per_token']})"
        )
    if top_k > num_experts:
        raise ValueError(f"{source}: num_experts_per_tok ({top_k}) exceeds the number of experts ({num_experts})")
    if num_experts % n_group:
        raise ValueError(f"{source}: n_group ({n_group}) must divide the number of routed experts ({num_experts})")
    if topk_group > n_group:
        raise ValueError(f"{source}: topk_group ({topk_group}) must lie in [1, n_group={n_group}]")
    if n_group > 1 and topk_group * (num_experts // n_group) < top_k:
        raise ValueError(
            f"{source}: topk_group ({topk_group}) groups of {num_experts // n_group} experts cannot hold "
            f"num_experts_per_tok ({top_k}) experts"
        )
    moe_layers = _moe_layer_indices(f, mt, num_layers)
    if not moe_layers:
        raise DenseModelError(f"{source}: {mt} config has no MoE layers (all {num_layers} layers are dense)")

    # MLA's compressed KV width: absent (or null) for grouped-query attention; given, at least 1 (0 names no MLA)
    kv_lora = f.int("kv_lora_rank", minimum=1, maximum=MAX_WIDTH) if f.has("kv_lora_rank") else 0
    if kv_lora:
        nope = f.int("qk_nope_head_dim", maximum=MAX_WIDTH)
        rope = f.int("qk_rope_head_dim", maximum=MAX_WIDTH)
        attention = AttentionSpec(
            num_heads=num_heads, num_kv_heads=num_heads, head_dim=nope + rope,
            v_head_dim=f.int("v_head_dim", maximum=MAX_WIDTH), kv_lora_rank=kv_lora,
            q_lora_rank=f.int("q_lora_rank", minimum=0, maximum=MAX_WIDTH, fallback=0), qk_rope_head_dim=rope,
        )
    else:
        num_kv = f.int("num_key_value_heads", maximum=num_heads, fallback=num_heads)
        if num_heads % num_kv:
            raise ValueError(f"{source}: num_key_value_heads ({num_kv}) must divide num_attention_heads ({num_heads})")
        head_dim = f.int("head_dim", maximum=MAX_WIDTH, fallback=max(1, hidden // num_heads))
        attention = AttentionSpec(num_heads=num_heads, num_kv_heads=num_kv, head_dim=head_dim, v_head_dim=head_dim,
                                  layer_spans=_layer_spans(cfg, mt, num_layers, source))

    return MoESpec(
        model_type=mt, source=source, num_layers=num_layers, moe_layers=moe_layers,
        num_experts=num_experts, top_k=top_k, hidden_size=hidden, moe_intermediate_size=moe_inter,
        dense_intermediate_size=dense_inter if len(moe_layers) < num_layers or mt == "llama4_text" else 0,
        num_shared_experts=facts.n_shared, shared_intermediate_size=facts.shared_inter,
        shared_expert_gate=facts.shared_gate, router_kind=facts.router_kind, n_group=n_group, topk_group=topk_group,
        group_score=facts.group_score, norm_topk_prob=facts.norm, routed_scaling_factor=facts.scale,
        correction_bias=facts.correction, router_bias=facts.router_bias, expert_bias=facts.expert_bias,
        hidden_act=hidden_act, swiglu_limit=facts.swiglu_limit, swiglu_alpha=facts.swiglu_alpha, vocab_size=vocab,
        max_position_embeddings=max_positions, attention=attention, expert_weight_format=weight_format,
        defaults=tuple(f.defaulted.items()), defaults_class=f.defaults_class,
        checkpoint_dtype=_checkpoint_dtype(cfg, top, source), tie_word_embeddings=tied,
    )


def is_checkpoint_dir(path: str | Path) -> bool:
    """Whether ``path`` names a directory holding a ``config.json`` (what ``--model`` takes; its weights files are
    checked where they are read)."""
    return bool(str(path)) and (Path(path) / "config.json").is_file()


def check_checkpoint_dir(path: str | Path, what: str) -> None:
    """Refuse a ``path`` that is not a checkpoint directory (``is_checkpoint_dir``); ``what`` names it.

    Raises:
        ValueError: no ``config.json`` in a directory at ``path``, with what a checkpoint directory holds.
    """
    if not is_checkpoint_dir(path):
        raise ValueError(f"{what} {str(path)!r} is not a checkpoint directory (a config.json, and its *.safetensors "
                         f"weights unless --load-format dummy)")


_CONFIG_PATH = "expected a model directory holding config.json, or a config file"  # what a config path names


def check_config_path(path: str | Path, what: str, *, parse: bool = False) -> None:
    """Refuse a ``path`` that names no config (what ``--config`` and doctor's ``--model`` take: a ``config.json``
    or a directory holding one), before it is read; ``what`` names it (``--config``, ``model``).

    Args:
        path: the path given.
        what: its flag or field, for the message.
        parse: also read the file as ``read_config`` does (``plan`` and ``balance``: its JSON errors then name
            ``what``; ``doctor`` reports them as findings instead).

    Raises:
        ValueError: the path is empty, does not exist, is a directory without a ``config.json`` file, or neither a
            file nor a directory (a pipe, a device), with what it should name; with ``parse``, a file that is empty,
            not JSON or not a JSON object.
    """
    p = Path(path)
    if not str(path):  # Path("") is "." (the working directory)
        raise ValueError(f"{what} is empty ({_CONFIG_PATH})")
    if not p.exists():
        raise ValueError(f"{what} {str(path)!r} does not exist ({_CONFIG_PATH})")
    if p.is_dir() and not (p / "config.json").is_file():
        raise ValueError(f"{what} {str(path)!r} is a directory without a config.json file ({_CONFIG_PATH})")
    if not p.is_dir() and not p.is_file():
        raise ValueError(f"{what} {str(path)!r} is neither a file nor a directory ({_CONFIG_PATH})")
    if parse:
        file = p / "config.json" if p.is_dir() else p
        try:
            text = read_text_file(file, "config file")
        except ValueError as exc:  # not UTF-8, too large: named by the flag too
            raise ValueError(f"{what}: {exc}") from exc
        _parse_config(text, f"{what} {str(file)!r}")


def _parse_config(text: str, name: str) -> dict[str, Any]:
    """``text`` as a JSON object; ``name`` (the file, or the flag and file) leads the messages.

    Raises:
        ValueError: ``text`` is empty (whitespace only), not JSON or not a JSON object.
    """
    if not text.strip():
        raise ValueError(f"{name} is empty ({_CONFIG_PATH})")
    try:
        cfg = json.loads(text)
    except ValueError as exc:  # JSONDecodeError, or an integer past Python's digit limit for int()
        reason = (exc if isinstance(exc, json.JSONDecodeError)
                  else f"a number of more than {sys.get_int_max_str_digits()} digits")
        raise ValueError(f"{name}: not valid JSON ({reason})") from exc
    if not isinstance(cfg, dict):
        raise ValueError(f"{name}: expected a JSON object, got {type(cfg).__name__}")
    return cfg


def read_config(path: str | Path) -> tuple[dict[str, Any], Path]:
    """Read a ``config.json`` (or the one in a checkpoint directory) as a JSON object.

    Returns:
        The object and the file's path.

    Raises:
        FileNotFoundError: no such file.
        ValueError: the file is empty, not JSON or not a JSON object.
    """
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"{str(p)!r} does not exist ({_CONFIG_PATH})")
    if p.is_dir():
        p = p / "config.json"
    return _parse_config(read_text_file(p, "config file"), str(p)), p


def load_moe_spec(path: str | Path) -> MoESpec:
    """Read a ``config.json`` (or a checkpoint directory holding one) and parse its MoE facts.

    Args:
        path: a ``config.json`` file or a directory containing ``config.json``.

    Raises:
        FileNotFoundError: no such file.
        ValueError: the file is not JSON, or a field is missing or contradictory (named in the message).
        DenseModelError: the model has no MoE layers.
    """
    cfg, p = read_config(path)
    return parse_moe_spec(cfg, str(p))
