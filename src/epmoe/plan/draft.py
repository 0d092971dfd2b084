"""A speculative-decoding draft model's facts: its sizes, and the memory it adds on each GPU.

An MoE draft is described by its ``MoESpec`` (the planner prices it like a target); a dense draft
(EAGLE-3: one decoder layer reading the target's hidden states) by its weight bytes and KV-cache bytes
per token, computed from its ``config.json``. Used by ``epmoe doctor``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from epmoe.config_fields import ConfigFields
from epmoe.plan.costs import ACT_BYTES
from epmoe.plan.request import StrategyPlan
from epmoe.spec import DenseModelError, MoESpec, language_model_config, load_moe_spec, read_config


@dataclass(frozen=True)
class DraftModel:
    """What doctor and the planner need of a draft model.

    Attributes:
        name: file or directory name, for messages.
        hidden_size: ``D`` of the draft.
        vocab_size: vocabulary the draft reads tokens from (EAGLE-3: the target's).
        spec: the MoE facts of an MoE draft, ``None`` for a dense one.
        weight_bytes: weights of a dense draft, bytes (whole on every GPU); 0 for an MoE draft (planned).
        kv_bytes_per_token: KV-cache bytes of a dense draft per token, all its layers, all heads; 0 for an MoE draft.
        kv_heads: KV heads of a dense draft (split by attention TP, one per rank at least).
        num_layers: decoder layers of a dense draft.
        step_params: parameters a dense draft's forward reads (all but the embedding, which is a row gather):
            its decoder layers, EAGLE-3's ``fc`` and the LM head.
        head_vocab: rows of the LM head (EAGLE-3: ``draft_vocab_size``).
        dtype_bytes: bytes per weight (``torch_dtype`` float32: 4, else 2).
    """

    name: str
    hidden_size: int
    vocab_size: int
    spec: MoESpec | None = None
    weight_bytes: float = 0.0
    kv_bytes_per_token: float = 0.0
    kv_heads: int = 1
    num_layers: int = 0
    step_params: float = 0.0
    head_vocab: int = 0
    dtype_bytes: int = 2


def _read_config(path: str) -> dict[str, Any]:
    return language_model_config(read_config(path)[0])


def dense_draft(cfg: dict[str, Any], name: str) -> DraftModel:
    """A dense draft's sizes from its ``config.json`` object.

    Weights: embedding ``[V, D]``, per layer attention (EAGLE-3: q/k/v read ``2 D``, the embedding and the fused
    target hidden state) and a SwiGLU MLP ``3 D I``, EAGLE-3's ``fc [D, 3 D]``, and the LM head
    ``[draft_vocab_size or V, D]``, in ``torch_dtype`` (float32: 4 B, else 2 B).

    Raises:
        ValueError: a size field missing or not a positive integer (named).
    """
    mt = cfg.get("model_type")
    f = ConfigFields(cfg, name, mt if isinstance(mt, str) else None)
    d = f.int("hidden_size")
    v = f.int("vocab_size")
    layers = f.int("num_hidden_layers")
    inter = f.int("intermediate_size")
    heads = f.int("num_attention_heads")
    kv_heads = f.int("num_key_value_heads", maximum=heads, fallback=heads)
    head_dim = f.int("head_dim", fallback=max(1, d // heads))
    eagle3 = "eagle_config" in cfg or any("Eagle3" in str(a) for a in cfg.get("architectures") or [])
    attn_in = 2 * d if eagle3 else d
    attn = attn_in * (heads + 2 * kv_heads) * head_dim + heads * head_dim * d
    head_vocab = f.int("draft_vocab_size", fallback=v)
    step = layers * (attn + 3 * d * inter) + (3 * d * d if eagle3 else 0) + head_vocab * d
    dtype_bytes = 4 if (cfg.get("torch_dtype") or cfg.get("dtype")) == "float32" else 2
    kv = layers * 2 * kv_heads * head_dim * ACT_BYTES
    return DraftModel(name, d, v, weight_bytes=(v * d + step) * dtype_bytes, kv_bytes_per_token=kv, kv_heads=kv_heads,
                      num_layers=layers, step_params=step, head_vocab=head_vocab, dtype_bytes=dtype_bytes)


# EAGLE-3 heads as SpecForge and others train them: Llama head size 128 and a 32000-token draft vocabulary
# (data/configs/eagle3-draft-*.config.json all use draft_vocab_size 32000; the Kimi-K2 head uses head_dim 128).
EAGLE3_HEAD_DIM = 128
EAGLE3_DRAFT_VOCAB = 32000


def default_eagle3_draft(spec: MoESpec) -> DraftModel:
    """The EAGLE-3 head of ``spec``'s sizes, for pricing speculation when no draft is given: one Llama decoder layer
    of the target's hidden size, attention and KV heads and dense intermediate size, head size 128, a 32000-token
    draft vocabulary, bf16 (the published Kimi-K2 EAGLE-3 head, data/configs/eagle3-draft-kimi-k2-instruct-aq-
    medai.config.json, has exactly these sizes for Kimi-K2/K2.5)."""
    a = spec.attention
    cfg = {"hidden_size": spec.hidden_size, "vocab_size": spec.vocab_size, "num_hidden_layers": 1,
           "intermediate_size": spec.dense_intermediate_size or spec.moe_intermediate_size,
           "num_attention_heads": a.num_heads, "num_key_value_heads": a.num_kv_heads, "head_dim": EAGLE3_HEAD_DIM,
           "draft_vocab_size": EAGLE3_DRAFT_VOCAB, "architectures": ["LlamaForCausalLMEagle3"]}
    return dense_draft(cfg, f"EAGLE-3 head of {Path(spec.source).name}")


def read_draft(path: str) -> DraftModel:
    """Read a draft model's config: an MoE draft's ``MoESpec``, or a dense (EAGLE-3) draft's sizes (``dense_draft``).

    Raises:
        FileNotFoundError: no config there.
        ValueError: not JSON, or a size field missing, of the wrong type or out of range (file, field and value
            named; an absent field takes the default of transformers' config class of its ``model_type``).
    """
    name = Path(path).name
    try:
        spec = load_moe_spec(path)
    except DenseModelError:
        spec = None
    if spec is not None:
        return DraftModel(name, spec.hidden_size, spec.vocab_size, spec=spec)
    return dense_draft(_read_config(path), name)


def draft_bytes(draft: DraftModel | None, draft_plan: dict[str, StrategyPlan], s: StrategyPlan, batch: int,
                 ep: int) -> float:
    """Bytes the draft adds on one GPU under target strategy ``s``: weights and KV cache.

    Args:
        draft: the draft (``None``: no draft, 0 bytes).
        draft_plan: the planner's plans of an MoE draft by strategy name (its memory is taken from the
            plan of the same strategy; 0 when that strategy was not planned for it).
        s: the target's strategy.
        batch: sequences in flight.
        ep: GPUs of the EP group (data-parallel attention splits the sequences over them).
    """
    if draft is None:
        return 0.0
    if draft.spec is not None:
        same = draft_plan.get(s.strategy.name)
        if same is None:
            return 0.0
        m = same.steps[0].memory
        return m.weights + m.kv_cache
    dp = s.strategy.mode == "a2a_dp_attn"
    seqs = math.ceil(batch / ep) if dp else batch
    tp = 1 if dp else s.strategy.attn_tp
    kv = draft.kv_bytes_per_token * max(1, draft.kv_heads // tp) / draft.kv_heads
    return draft.weight_bytes + seqs * kv
