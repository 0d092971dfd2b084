"""MoESpec parsed from every shipped real config.json, with the numbers asserted."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from epmoe.spec import DenseModelError, load_moe_spec, parse_moe_spec

from .conftest import CONFIGS

# file: (model_type, moe layers, first moe layer, E, K, n_group, topk_group, shared experts,
#        shared intermediate, router kind, norm_topk, routed scaling, F, weight format)
EXPECTED = {
    "deepseek-v3": ("deepseek_v3", 58, 3, 256, 8, 8, 4, 1, 2048, "sigmoid_topk", True, 2.5, 2048, "fp8_block128"),
    "deepseek-r1": ("deepseek_v3", 58, 3, 256, 8, 8, 4, 1, 2048, "sigmoid_topk", True, 2.5, 2048, "fp8_block128"),
    "deepseek-v2-lite": ("deepseek_v2", 26, 1, 64, 6, 1, 1, 2, 2816, "softmax_topk", False, 1.0, 1408, "bf16"),
    "kimi-k2-instruct": ("kimi_k2", 60, 1, 384, 8, 1, 1, 1, 2048, "sigmoid_topk", True, 2.827, 2048, "fp8_block128"),
    "kimi-k2.5": ("kimi_k2", 60, 1, 384, 8, 1, 1, 1, 2048, "sigmoid_topk", True, 2.827, 2048, "int4_group32"),
    "glm-4.5": ("glm4_moe", 89, 3, 160, 8, 1, 1, 1, 1536, "sigmoid_topk", True, 2.5, 1536, "bf16"),
    "glm-4.5-air": ("glm4_moe", 45, 1, 128, 8, 1, 1, 1, 1408, "sigmoid_topk", True, 1.0, 1408, "bf16"),
    "glm-4.7-fp8": ("glm4_moe", 89, 3, 160, 8, 1, 1, 1, 1536, "sigmoid_topk", True, 2.5, 1536, "bf16"),
    "qwen1.5-moe-a2.7b": ("qwen2_moe", 24, 0, 60, 4, 1, 1, 1, 5632, "softmax_topk", False, 1.0, 1408, "bf16"),
    "qwen3-30b-a3b": ("qwen3_moe", 48, 0, 128, 8, 1, 1, 0, 0, "softmax_topk", True, 1.0, 768, "bf16"),
    "qwen3-235b-a22b": ("qwen3_moe", 94, 0, 128, 8, 1, 1, 0, 0, "softmax_topk", True, 1.0, 1536, "bf16"),
    "mixtral-8x7b": ("mixtral", 32, 0, 8, 2, 1, 1, 0, 0, "softmax_topk", True, 1.0, 14336, "bf16"),
    "mixtral-8x22b": ("mixtral", 56, 0, 8, 2, 1, 1, 0, 0, "softmax_topk", True, 1.0, 16384, "bf16"),
    "olmoe-1b-7b-0924": ("olmoe", 16, 0, 64, 8, 1, 1, 0, 0, "softmax_topk", False, 1.0, 1024, "bf16"),
    "gpt-oss-20b": ("gpt_oss", 24, 0, 32, 4, 1, 1, 0, 0, "topk_softmax", False, 1.0, 2880, "mxfp4"),
    "llama-4-scout-17b-16e-instruct": ("llama4_text", 48, 0, 16, 1, 1, 1, 1, 8192, "topk_sigmoid", False, 1.0, 8192,
                                       "bf16"),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_every_shipped_moe_config(name):
    s = load_moe_spec(CONFIGS / f"{name}.config.json")
    got = (s.model_type, s.num_moe_layers, s.moe_layers[0], s.num_experts, s.top_k, s.n_group, s.topk_group,
           s.num_shared_experts, s.shared_intermediate_size, s.router_kind, s.norm_topk_prob,
           s.routed_scaling_factor, s.moe_intermediate_size, s.expert_weight_format)
    assert got == EXPECTED[name]
    assert s.moe_layers == tuple(range(s.moe_layers[0], s.num_layers))


def test_family_specific_facts():
    v3 = load_moe_spec(CONFIGS / "deepseek-v3.config.json")
    got = (v3.hidden_size, v3.correction_bias, v3.group_score, v3.attention.kv_lora_rank)
    assert got == (7168, True, "top2_sum", 512)
    assert v3.scoring == "sigmoid" and v3.dense_layers == (0, 1, 2)
    gpt = load_moe_spec(CONFIGS / "gpt-oss-20b.config.json")
    assert (gpt.swiglu_limit, gpt.swiglu_alpha, gpt.router_bias, gpt.expert_bias) == (7.0, 1.702, True, True)
    qwen2 = load_moe_spec(CONFIGS / "qwen1.5-moe-a2.7b.config.json")
    assert qwen2.shared_expert_gate and qwen2.scoring == "softmax"
    llama4 = load_moe_spec(CONFIGS / "llama-4-scout-17b-16e-instruct.config.json")
    assert llama4.scoring == "sigmoid" and llama4.hidden_size == 5120
    k25 = load_moe_spec(CONFIGS / "kimi-k2.5.config.json")  # language model under text_config
    assert (k25.hidden_size, k25.num_layers, k25.vocab_size) == (7168, 61, 163840)
    glm = load_moe_spec(CONFIGS / "glm-4.5.config.json")  # DeepSeek-V3's router on GQA attention (no MLA)
    got = (glm.correction_bias, glm.group_score, glm.router_fp32_logits, glm.attention.is_mla,
           glm.attention.num_kv_heads, glm.attention.head_dim, glm.dense_intermediate_size, glm.vocab_size)
    assert got == (True, "top2_sum", True, False, 8, 128, 12288, 151552)
    # the trimmed GLM-4.7 copy leaves the routing fields to transformers' Glm4MoeConfig defaults, and says so
    glm47 = load_moe_spec(CONFIGS / "glm-4.7-fp8.config.json")
    assert glm47.defaults_class == "Glm4MoeConfig"
    assert dict(glm47.defaults) == {"hidden_act": "silu", "n_group": 1, "topk_group": 1, "norm_topk_prob": True}


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("eagle3-draft-*.json")), ids=lambda p: p.name)
def test_eagle3_drafts_are_dense(path):
    with pytest.raises(DenseModelError, match="dense model with no MoE layers"):
        load_moe_spec(path)


def _v3() -> dict:
    return json.loads((CONFIGS / "deepseek-v3.config.json").read_text())


def test_missing_field_names_field_and_file():
    cfg = _v3()
    del cfg["model_type"]
    with pytest.raises(ValueError, match=r"myfile\.json: missing field 'model_type' in config\.json"):
        parse_moe_spec(cfg, "myfile.json")


def _qwen2() -> dict:
    return json.loads((CONFIGS / "qwen1.5-moe-a2.7b.config.json").read_text())


@pytest.mark.parametrize("name, field", [("qwen1.5-moe-a2.7b", "vocab_size"), ("deepseek-v3", "n_routed_experts"),
                                         ("deepseek-v3", "first_k_dense_replace"), ("glm-4.5-air", "n_shared_experts"),
                                         ("mixtral-8x7b", "num_key_value_heads"),
                                         ("qwen3-30b-a3b", "max_position_embeddings")])
def test_absent_field_takes_transformers_default(name, field):
    """An absent field gets the value transformers' own config class gives it, and the spec says so."""
    from transformers import AutoConfig

    cfg = json.loads((CONFIGS / f"{name}.config.json").read_text())
    del cfg[field]
    want = getattr(AutoConfig.for_model(cfg["model_type"], **{k: v for k, v in cfg.items() if k != "model_type"}),
                   field)
    s = parse_moe_spec(cfg, "c.json")
    assert dict(s.defaults) == {**dict(load_moe_spec(CONFIGS / f"{name}.config.json").defaults), field: want}
    assert s.defaults_class == type(AutoConfig.for_model(cfg["model_type"])).__name__
    got = {"vocab_size": s.vocab_size, "n_routed_experts": s.num_experts, "n_shared_experts": s.num_shared_experts,
           "first_k_dense_replace": s.moe_layers[0], "num_key_value_heads": s.attention.num_kv_heads,
           "max_position_embeddings": s.max_position_embeddings}[field]
    assert got == want


def test_qwen2_moe_without_vocab_size_loads_with_the_default(tmp_path):
    cfg = _qwen2()
    del cfg["vocab_size"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    s = load_moe_spec(tmp_path)
    assert s.vocab_size == 151936 and s.defaults == (("vocab_size", 151936),)
    assert s.defaults_class == "Qwen2MoeConfig"
    assert load_moe_spec(CONFIGS / "qwen1.5-moe-a2.7b.config.json").defaults == ()


@pytest.mark.parametrize("name, model_type, want", [("qwen3-30b-a3b", "qwen3_moe", 768),
                                                     ("qwen1.5-moe-a2.7b", "qwen2_moe", 1408)])
def test_qwen_without_moe_intermediate_size_takes_transformers_default_not_the_dense_size(name, model_type, want):
    """Qwen's experts are ``moe_intermediate_size`` wide; absent, transformers' own default, never the dense MLP's
    ``intermediate_size`` (Qwen3-30B-A3B: 6144, eight times the expert's 768), and the spec says so."""
    from transformers import AutoConfig

    cfg = json.loads((CONFIGS / f"{name}.config.json").read_text())
    del cfg["moe_intermediate_size"]
    assert want == AutoConfig.for_model(model_type).moe_intermediate_size != cfg["intermediate_size"]
    s = parse_moe_spec(cfg, "q.json")
    assert s.moe_intermediate_size == want
    assert dict(s.defaults)["moe_intermediate_size"] == want


def test_explicit_null_is_what_transformers_derives():
    lite = load_moe_spec(CONFIGS / "deepseek-v2-lite.config.json")  # "q_lora_rank": null: no query LoRA
    assert lite.attention.q_lora_rank == 0 and lite.defaults == ()
    cfg = {**_v3(), "n_group": None, "topk_group": None}
    s = parse_moe_spec(cfg, "v3.json")
    assert (s.n_group, s.topk_group) == (1, 1)


# Values that were accepted silently (and changed what ``plan`` printed): each refused naming file, field, value.
@pytest.mark.parametrize(
    "name, edit, message",
    [
        ("deepseek-v3", {"n_shared_experts": -1},
         r"v3\.json: field 'n_shared_experts' must be an integer in \[0, 1048576\], got -1$"),
        ("qwen3-30b-a3b", {"decoder_sparse_step": -2},
         r"v3\.json: field 'decoder_sparse_step' must be a positive integer, got -2$"),
        ("qwen3-30b-a3b", {"decoder_sparse_step": 0},
         r"v3\.json: field 'decoder_sparse_step' must be a positive integer, got 0$"),
        ("deepseek-v3", {"moe_layer_freq": 0}, r"v3\.json: field 'moe_layer_freq' must be a positive integer, got 0$"),
        ("deepseek-v3", {"first_k_dense_replace": "3"},
         r"v3\.json: field 'first_k_dense_replace' must be an integer in \[0, 61\], got \"3\" \(a string\)$"),
        ("deepseek-v3", {"routed_scaling_factor": "2.5"},
         r"v3\.json: field 'routed_scaling_factor' must be a positive number, got \"2\.5\" \(a string\)$"),
        ("qwen3-30b-a3b", {"num_key_value_heads": "4"},
         r"v3\.json: field 'num_key_value_heads' must be an integer in \[1, 32\], got \"4\" \(a string\)$"),
        ("qwen3-30b-a3b", {"num_experts": "128"},
         r"v3\.json: field 'num_experts' must be an integer in \[1, 1048576\], got \"128\" \(a string\)$"),
        ("deepseek-v3", {"n_routed_experts": True},
         r"field 'n_routed_experts' must be an integer in \[1, 1048576\], got true$"),
        ("deepseek-v3", {"norm_topk_prob": "yes"}, r"field 'norm_topk_prob' must be true or false, got \"yes\""),
        # MLA's latent width: 0 had planned the model as grouped-query attention without a word
        ("deepseek-v3", {"kv_lora_rank": 0}, r"field 'kv_lora_rank' must be an integer in \[1, 1048576\], got 0$"),
        ("deepseek-v3", {"routed_scaling_factor": 0},
         r"field 'routed_scaling_factor' must be a positive number, got 0"),
        ("qwen3-30b-a3b", {"mlp_only_layers": [3, "4"]},
         r"field 'mlp_only_layers'\[1\] must be an integer in \[0, 47\], got \"4\" \(a string\)"),
        ("qwen3-30b-a3b", {"mlp_only_layers": [48]}, r"field 'mlp_only_layers'\[0\] must be an integer in \[0, 47\]"),
        ("glm-4.5", {"n_group": 0}, r"field 'n_group' must be an integer in \[1, 1048576\], got 0"),
        ("gpt-oss-20b", {"swiglu_limit": float("inf")}, r"field 'swiglu_limit' must be a positive number, got inf"),
        # the context (was 4096 for 0, taken as is when negative)
        ("qwen3-30b-a3b", {"max_position_embeddings": 0},
         r"v3\.json: field 'max_position_embeddings' must be an integer in \[1, 16777216\], got 0$"),
        ("qwen3-30b-a3b", {"max_position_embeddings": -4},
         r"v3\.json: field 'max_position_embeddings' must be an integer in \[1, 16777216\], got -4$"),
        ("qwen3-30b-a3b", {"max_position_embeddings": 256.7},
         r"v3\.json: field 'max_position_embeddings' must be an integer in \[1, 16777216\], got 256\.7$"),
        ("qwen3-30b-a3b", {"max_position_embeddings": "256"},
         r"v3\.json: field 'max_position_embeddings' must be an integer in \[1, 16777216\], got \"256\" \(a string\)$"),
        # norm and RoPE: top level, and in the RoPE object (rope_scaling, or transformers 5's rope_parameters)
        ("qwen3-30b-a3b", {"rms_norm_eps": -1}, r"v3\.json: field 'rms_norm_eps' must be a positive number, got -1$"),
        ("qwen3-30b-a3b", {"rms_norm_eps": 0.0},
         r"v3\.json: field 'rms_norm_eps' must be a positive number, got 0\.0$"),
        ("qwen3-30b-a3b", {"rope_theta": -5.0}, r"v3\.json: field 'rope_theta' must be a positive number, got -5\.0$"),
        ("qwen3-30b-a3b", {"rope_parameters": {"rope_type": "default", "rope_theta": 0}},
         r"v3\.json: field 'rope_parameters\.rope_theta' must be a positive number, got 0$"),
        ("deepseek-v3", {"rope_scaling": {"type": "bogus", "factor": 40}},
         r"v3\.json: field 'rope_scaling\.type' must be one of \"default\", \"linear\", \"dynamic\", \"yarn\", .*, got "
         r"\"bogus\" \(a string\)$"),
        ("qwen3-30b-a3b", {"rope_parameters": {"rope_type": "bogus", "rope_theta": 1e6}},
         r"v3\.json: field 'rope_parameters\.rope_type' must be one of \"default\", .*\"llama3\".*, got \"bogus\""),
        ("qwen3-30b-a3b", {"rope_scaling": "yarn"},
         r"v3\.json: field 'rope_scaling' must be a JSON object, got \"yarn\" \(a string\)$"),
        # the embedding's padding row (was transformers' bare assertion when the model was built)
        ("qwen3-30b-a3b", {"pad_token_id": 151936},
         r"v3\.json: field 'pad_token_id' must be an integer in \[0, 151935\], got 151936$"),
        ("qwen3-30b-a3b", {"pad_token_id": -1},
         r"v3\.json: field 'pad_token_id' must be an integer in \[0, 151935\], got -1$"),
        # the wrapper's and the quantization's objects (were AttributeErrors: 'str' object has no attribute 'get')
        ("qwen3-30b-a3b", {"text_config": [1]}, r"v3\.json: field 'text_config' must be a JSON object, got \[1\]$"),
        ("qwen3-30b-a3b", {"quantization_config": "fp8"},
         r"v3\.json: field 'quantization_config' must be a JSON object, got \"fp8\" \(a string\)$"),
        ("qwen3-30b-a3b", {"quantization_config": {"quant_method": 8}},
         r"v3\.json: field 'quantization_config\.quant_method' must be a string, got 8$"),
        ("qwen3-30b-a3b", {"quantization_config": {"quant_method": "compressed-tensors", "config_groups": "x"}},
         r"v3\.json: field 'quantization_config\.config_groups' must be a JSON object, got \"x\" \(a string\)$"),
        ("qwen3-30b-a3b", {"quantization_config": {"config_groups": {"g": {"weights": [4]}}}},
         r"v3\.json: field 'quantization_config\.config_groups\.g\.weights' must be a JSON object, got \[4\]$"),
        ("qwen3-30b-a3b", {"quantization_config": {"config_groups": {"g": {"weights": {"num_bits": "4"}}}}},
         r"v3\.json: field 'quantization_config\.config_groups\.g\.weights\.num_bits' must be a positive integer, "
         r"got \"4\" \(a string\)$"),
        # the experts' activation (was a bare KeyError: bogus when the model was built)
        ("qwen3-30b-a3b", {"hidden_act": "bogus"},
         r"v3\.json: field 'hidden_act' must be one of \"silu\", \"gelu\", \"relu\", got \"bogus\" \(a string\)$"),
    ],
)
def test_bad_values_are_refused_with_field_value_and_file(name, edit, message):
    cfg = {**json.loads((CONFIGS / f"{name}.config.json").read_text()), **edit}
    with pytest.raises(ValueError, match=message):
        parse_moe_spec(cfg, "v3.json")


def test_a_wrapped_language_model_names_its_fields_by_path():
    """Kimi-K2.5 keeps its language model under text_config: its fields are named there, its quantization_config
    too, apart from a wrapper's (both are checked)."""
    k25 = json.loads((CONFIGS / "kimi-k2.5.config.json").read_text())
    bad = {**k25, "text_config": {**k25["text_config"], "hidden_size": -1}}
    with pytest.raises(ValueError, match=r"k25\.json: field 'text_config\.hidden_size' must be an integer in "
                                         r"\[1, 1048576\], got -1$"):
        parse_moe_spec(bad, "k25.json")
    bad = {**k25, "text_config": {**k25["text_config"], "quantization_config": 5}}
    with pytest.raises(ValueError, match=r"field 'text_config\.quantization_config' must be a JSON object, got 5$"):
        parse_moe_spec(bad, "k25.json")
    assert parse_moe_spec(k25, "k25.json").expert_weight_format == "int4_group32"


def test_rope_types_are_those_transformers_computes():
    """Every ``rope_type`` transformers' rotary embeddings compute is accepted, the shipped configs' included
    (DeepSeek's ``type: yarn``, Llama-4's ``llama3``), and a config without a RoPE object is fine."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for rope_type in ("default", *ROPE_INIT_FUNCTIONS):
        cfg = {**json.loads((CONFIGS / "qwen3-30b-a3b.config.json").read_text()),
               "rope_parameters": {"rope_type": rope_type, "rope_theta": 1e6}}
        parse_moe_spec(cfg, "q.json")
    assert load_moe_spec(CONFIGS / "qwen3-30b-a3b.config.json").max_position_embeddings == 40960


def test_moe_layer_freq_other_than_one_is_refused():
    with pytest.raises(ValueError, match=r"field 'moe_layer_freq' is 2; only 1 is supported: transformers' deepseek_v3 "
                                         r"model puts an MoE block in every layer from first_k_dense_replace \(3\) on"):
        parse_moe_spec({**_v3(), "moe_layer_freq": 2}, "v3.json")


@pytest.mark.parametrize(
    "edit, message",
    [
        ({"n_group": 7}, r"n_group \(7\) must divide the number of routed experts \(256\)"),
        ({"topk_group": 9}, r"topk_group \(9\) must lie in \[1, n_group=8\]"),
        ({"num_experts_per_tok": 300}, r"num_experts_per_tok \(300\) exceeds the number of experts \(256\)"),
        ({"scoring_func": "softmax"}, r"field 'scoring_func' must be one of \"sigmoid\", got \"softmax\""),
        ({"first_k_dense_replace": 70}, r"field 'first_k_dense_replace' must be an integer in \[0, 61\], got 70"),
        ({"hidden_size": -1}, r"'hidden_size' must be an integer in \[1, 1048576\], got -1"),
        ({"first_k_dense_replace": 61}, r"has no MoE layers"),
    ],
)
def test_contradictory_fields(edit, message):
    cfg = {**_v3(), **edit}
    with pytest.raises(ValueError, match=message):
        parse_moe_spec(cfg, "v3.json")


def test_gpt_oss_contradictory_top_k():
    cfg = json.loads((CONFIGS / "gpt-oss-20b.config.json").read_text())
    cfg["experts_per_token"] = 2
    with pytest.raises(ValueError, match=r"num_experts_per_tok \(4\) contradicts experts_per_token \(2\)"):
        parse_moe_spec(cfg, "g.json")


def test_not_json_and_missing_file(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_moe_spec(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"'.*nope.json' does not exist \(expected a model directory holding "
                                                 r"config.json, or a config file\)"):
        load_moe_spec(tmp_path / "nope.json")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match=r"config file '.*empty/config.json' does not exist"):
        load_moe_spec(empty)


def test_unknown_family_without_experts_is_named_as_unsupported():
    with pytest.raises(DenseModelError, match=r"model_type 'foo_moe' is not a supported MoE family \(deepseek_v2.*"
                                              r"names no routed experts \(n_routed_experts"):
        parse_moe_spec({"model_type": "foo_moe"}, "foo/config.json")


@pytest.mark.parametrize("model_type", ["qwen2_moe", "qwen3_moe"])
@pytest.mark.parametrize("step, mlp_only", [(2, [3]), (3, [5]), (2, []), (1, [0, 4]), (4, [6])])
def test_qwen_moe_layers_are_those_transformers_builds(model_type, step, mlp_only):
    """``decoder_sparse_step`` and ``mlp_only_layers``: the MoE layers are exactly the layers transformers' own model
    gives a sparse MoE block (``(i + 1) % step == 0`` and ``i`` not in ``mlp_only_layers``)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        model_type, num_hidden_layers=8, hidden_size=16, intermediate_size=24, moe_intermediate_size=8,
        shared_expert_intermediate_size=8, num_attention_heads=2, num_key_value_heads=1, num_experts=4,
        num_experts_per_tok=2, vocab_size=32, decoder_sparse_step=step, mlp_only_layers=mlp_only,
    )
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    layers = model.model.layers
    built = tuple(i for i, layer in enumerate(layers) if type(layer.mlp).__name__.endswith("SparseMoeBlock"))
    spec = parse_moe_spec(json.loads(config.to_json_string()), "qwen.json")
    assert spec.moe_layers == built
    assert built == tuple(i for i in range(8) if (i + 1) % step == 0 and i not in mlp_only)  # the rule, spelled out
    assert spec.dense_intermediate_size == 24


def test_defaults_of_a_config_class_that_is_not_a_dataclass(monkeypatch):
    """Older transformers configs declare their defaults as ``__init__`` keywords: they are read the same way."""
    import transformers

    from epmoe.config_fields import ConfigFields, transformers_defaults

    class OldStyleConfig:
        attribute_map = {"num_local_experts": "num_experts"}

        def __init__(self, vocab_size=32000, num_experts=8, head_dim=None, **kwargs):
            self.vocab_size = vocab_size

    monkeypatch.setattr(transformers, "CONFIG_MAPPING", {"old_moe": OldStyleConfig})
    transformers_defaults.cache_clear()
    try:
        assert transformers_defaults("old_moe") == ("OldStyleConfig", {"vocab_size": 32000, "num_experts": 8},
                                                    {"num_local_experts": "num_experts"})
        f = ConfigFields({"hidden_size": 64}, "old.json", "old_moe")
        assert (f.int("vocab_size"), f.int("num_local_experts"), f.int("head_dim", fallback=16)) == (32000, 8, 16)
        assert f.defaulted == {"vocab_size": 32000, "num_local_experts": 8} and f.defaults_class == "OldStyleConfig"
        with pytest.raises(ValueError, match=r"old\.json: missing field 'rope_theta' in config\.json \(and "
                                             r"transformers' old_moe config declares no default\)"):
            f.float("rope_theta")
    finally:
        transformers_defaults.cache_clear()


def test_a_config_that_is_not_utf8_is_named(tmp_path):
    path = tmp_path / "config.json"
    path.write_bytes(b"\xff\xfe\x00\x01")
    with pytest.raises(ValueError, match=r"config file '.*config\.json' is not UTF-8 text \(byte 0xff at position "
                                         r"0\)$"):
        load_moe_spec(tmp_path)
    with pytest.raises(ValueError, match=r"^config file '/dev/zero' is not a regular file$"):
        load_moe_spec("/dev/zero")


def test_a_mistyped_symmetric_is_named(tmp_path):  # "false" was taken for an asymmetric scheme
    cfg = json.loads((CONFIGS / "kimi-k2.5.config.json").read_text())
    cfg["text_config"]["quantization_config"]["config_groups"]["group_0"]["weights"]["symmetric"] = "false"
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"field 'text_config\.quantization_config\.config_groups\.group_0\.weights\."
                                         r"symmetric' must be true or false, got \"false\" \(a string\)$"):
        load_moe_spec(path)


@pytest.mark.parametrize("edit,fmt", [
    (lambda qc: qc["config_groups"]["group_0"]["weights"].update(num_bits=3), "compressed-tensors-int3"),
    (lambda qc: qc["config_groups"]["group_0"]["weights"].update(num_bits=8, type="float"),
     "compressed-tensors-float8"),
    (lambda qc: (qc.clear(), qc.update(quant_method="awq", bits=4)), "awq"),
    (lambda qc: qc.update(quant_method="foo"), "foo"),  # config_groups under another method: was served as INT4
    # compressed-tensors' defaults for what a group leaves out: 8-bit int (was taken for bf16)
    (lambda qc: qc["config_groups"]["group_0"]["weights"].pop("num_bits"), "compressed-tensors-int8"),
    # 4-bit groups the INT4 kernels would read wrongly (was int4_group32: plan priced them, run refused them)
    (lambda qc: qc["config_groups"]["group_0"]["weights"].update(symmetric=False),
     "compressed-tensors-int4-asymmetric"),
    (lambda qc: qc.update(format="marlin-24"), "compressed-tensors-int4-marlin-24"),
    (lambda qc: qc["config_groups"]["group_0"]["weights"].update(strategy="channel", group_size=None),
     "compressed-tensors-int4-channel"),
    # found by the second check: a second group, a group's own format, reordered columns (were int4_group32)
    (lambda qc: qc["config_groups"].update(group_1={**qc["config_groups"]["group_0"], "weights": {
        **qc["config_groups"]["group_0"]["weights"], "symmetric": False}}), "compressed-tensors-int4-asymmetric"),
    (lambda qc: qc["config_groups"]["group_0"].update(format="float-quantized"),
     "compressed-tensors-int4-float-quantized"),
    (lambda qc: qc["config_groups"]["group_0"]["weights"].update(actorder="group"), "compressed-tensors-int4-actorder"),
])
def test_an_unserved_quantization_keeps_its_name(tmp_path, edit, fmt):
    # a quantization epmoe does not serve is named as what it is, never taken for bf16 (whose sizes it would print)
    from epmoe.doctor import check_expert_storage

    cfg = json.loads((CONFIGS / "kimi-k2.5.config.json").read_text())
    edit(cfg["text_config"]["quantization_config"])
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    spec = load_moe_spec(path)
    assert spec.expert_weight_format == fmt
    (finding,) = check_expert_storage(spec, 8, 0)
    assert finding.severity == "error"
    assert f"routed expert weight format {fmt!r} is not served" in finding.what


def test_format_name_is_the_checkpoints_dtype_for_unquantized_experts():
    # expert_weight_format keeps "bf16" for every unquantized checkpoint (storage and planner match on it); the name
    # people read is the dtype config.json gives, under text_config first, "torch_dtype" before transformers 5
    names = {n: load_moe_spec(CONFIGS / f"{n}.config.json") for n in
             ("qwen3-30b-a3b", "kimi-k2.5", "deepseek-v3", "gpt-oss-20b")}
    got = {n: (s.expert_weight_format, s.checkpoint_dtype, s.expert_format_name) for n, s in names.items()}
    assert got == {"qwen3-30b-a3b": ("bf16", "bfloat16", "bfloat16"),
                   "kimi-k2.5": ("int4_group32", "bfloat16", "int4_group32"),
                   "deepseek-v3": ("fp8_block128", "bfloat16", "fp8_block128"),
                   "gpt-oss-20b": ("mxfp4", None, "mxfp4")}  # its config.json names no dtype
    cfg = json.loads((CONFIGS / "mixtral-8x7b.config.json").read_text())
    cfg["torch_dtype"] = "float32"
    assert parse_moe_spec(cfg).expert_format_name == "float32"
    cfg["dtype"] = "float16"  # transformers 5's name wins
    assert parse_moe_spec(cfg).expert_format_name == "float16"
    del cfg["dtype"], cfg["torch_dtype"]
    assert (parse_moe_spec(cfg).checkpoint_dtype, parse_moe_spec(cfg).expert_format_name) == (None, "unquantized")
    cfg["dtype"] = 16
    with pytest.raises(ValueError, match=r"<dict>: field 'dtype' must be one of \"bfloat16\", .*, got 16$"):
        parse_moe_spec(cfg)


@pytest.mark.parametrize("name, model_type, field, alias, value", [
    ("mixtral-8x7b", "mixtral", "num_local_experts", "num_experts", 16),
    ("gpt-oss-20b", "gpt_oss", "num_local_experts", "num_experts", 8),
])
def test_a_field_named_by_its_transformers_alias_is_read(tmp_path, name, model_type, field, alias, value):
    """A config naming a field by an alias of its config class's ``attribute_map`` gives that value, as
    transformers reads it, never the class default."""
    import transformers

    cfg = json.loads((CONFIGS / f"{name}.config.json").read_text())
    del cfg[field]
    cfg[alias] = value
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    assert getattr(transformers.CONFIG_MAPPING[model_type].from_dict(cfg), field) == value
    spec = load_moe_spec(path)
    assert spec.num_experts == value
    assert field not in dict(spec.defaults)


def test_windowed_and_chunked_layers_are_read_from_layer_types():
    # gpt-oss: alternating 128-position sliding windows; Llama-4: transformers' rule without layer_types (RoPE
    # layers chunked at attention_chunk_size, every 4th full); Qwen3: every layer full
    oss = load_moe_spec(CONFIGS / "gpt-oss-20b.config.json").attention
    assert oss.layer_spans == (128, None) * 12
    assert oss.attended_positions(4096, 24) == ((12, 4096), (12, 128))
    assert oss.attended_positions(100, 24) == ((24, 100),)  # a context inside the window: every layer reads it all
    llama = load_moe_spec(CONFIGS / "llama-4-scout-17b-16e-instruct.config.json").attention
    assert llama.layer_spans == (8192, 8192, 8192, None) * 12
    assert llama.attended_positions(32768, 48) == ((12, 32768), (36, 8192))
    qwen = load_moe_spec(CONFIGS / "qwen3-30b-a3b.config.json").attention
    assert qwen.layer_spans == () and qwen.attended_positions(4096, 48) == ((48, 4096),)
    cfg = json.loads((CONFIGS / "gpt-oss-20b.config.json").read_text())
    with pytest.raises(ValueError, match=r"layer_types has 23 entries, expected one per layer \(24\)"):
        parse_moe_spec({**cfg, "layer_types": cfg["layer_types"][:23]})
    with pytest.raises(ValueError, match="layer_types names 'sliding_attention' layers but sliding_window is null; "
                                         "expected a positive integer"):
        parse_moe_spec({**cfg, "sliding_window": None})


def test_a_layer_count_past_the_bound_is_named():
    """``num_hidden_layers`` 1e9 made plan and doctor build per-layer tables until memory ran out (no message);
    now refused by name, with the bound."""
    cfg = json.loads((CONFIGS / "deepseek-v3.config.json").read_text())
    with pytest.raises(ValueError, match=r"num_hidden_layers.* must be an integer in \[1, 65536\], got 1000000000"):
        parse_moe_spec({**cfg, "num_hidden_layers": 10**9}, "config.json")
    assert parse_moe_spec({**cfg, "num_hidden_layers": 65536}).num_layers == 65536
    # a hidden size of 2**40 was an "ok" of 11679793152.0 GiB per rank in doctor
    with pytest.raises(ValueError, match=r"hidden_size.* must be an integer in \[1, 1048576\], got 1099511627776"):
        parse_moe_spec({**cfg, "hidden_size": 2**40}, "config.json")


@pytest.mark.parametrize("name, field, value, bound", [
    ("deepseek-v3", "n_routed_experts", 10**20, r"\[1, 1048576\]"),
    ("qwen3-30b-a3b", "num_experts", 10**20, r"\[1, 1048576\]"),
    ("mixtral-8x7b", "num_local_experts", 2**21, r"\[1, 1048576\]"),
    ("deepseek-v3", "n_shared_experts", 2**21, r"\[0, 1048576\]"),
    ("qwen3-30b-a3b", "moe_intermediate_size", 2**30, r"\[1, 1048576\]"),
    ("mixtral-8x7b", "intermediate_size", 2**30, r"\[1, 1048576\]"),
    ("qwen3-30b-a3b", "vocab_size", 10**12, r"\[1, 16777216\]"),
    ("qwen3-30b-a3b", "num_attention_heads", 2**30, r"\[1, 1048576\]"),
    ("deepseek-v3", "kv_lora_rank", 2**30, r"\[1, 1048576\]"),
    # 10**9 made each rank of run fail allocating its block tables, in the allocator's words
    ("qwen3-30b-a3b", "max_position_embeddings", 10**9, r"\[1, 16777216\]"),
])
def test_a_size_past_its_bound_is_named(name, field, value, bound):
    """``num_experts`` 1e20 was priced by plan (a step of 4.6e15 ms) and called ok by doctor; every size the spec
    reads now has a bound, named with the field."""
    cfg = json.loads((CONFIGS / f"{name}.config.json").read_text())
    with pytest.raises(ValueError, match=rf"field '{field}' must be an integer in {bound}, got {value}$"):
        parse_moe_spec({**cfg, field: value}, "config.json")


def test_an_unknown_dtype_is_named():
    """``torch_dtype: "float99"`` was reported as the experts' storage by doctor and priced as bf16 by plan."""
    cfg = json.loads((CONFIGS / "qwen3-30b-a3b.config.json").read_text())
    with pytest.raises(ValueError, match=r"field 'torch_dtype' must be one of \"bfloat16\", .*got \"float99\""):
        parse_moe_spec({**cfg, "torch_dtype": "float99"}, "config.json")
    assert parse_moe_spec({**cfg, "torch_dtype": "float16"}).checkpoint_dtype == "float16"
    # every dtype given is checked: a valid dtype does not pass a bad torch_dtype, nor text_config's a bad top level
    with pytest.raises(ValueError, match=r"field 'torch_dtype' must be one of .*got \"float99\""):
        parse_moe_spec({**cfg, "dtype": "bfloat16", "torch_dtype": "float99"}, "config.json")
    kimi = json.loads((CONFIGS / "kimi-k2.5.config.json").read_text())
    with pytest.raises(ValueError, match=r"field 'dtype' must be one of .*got \"float99\""):
        parse_moe_spec({**kimi, "dtype": "float99"}, "config.json")



def test_a_null_field_without_a_rule_is_named_not_defaulted():
    """``hidden_size: null`` was reported as absent and took transformers' default 7168; transformers' config keeps
    the null (its model cannot be built from it). A null that transformers derives a value for (``q_lora_rank``,
    ``num_key_value_heads``) still is."""
    cfg = json.loads((CONFIGS / "deepseek-v3.config.json").read_text())
    with pytest.raises(ValueError, match=r"^config\.json: field 'hidden_size' is null in config\.json; give its value "
                                         r"or leave it out for transformers' default$"):
        parse_moe_spec({**cfg, "hidden_size": None}, "config.json")
    # a field transformers declares no default for is not advised away ("leave it out" for model_type misled)
    with pytest.raises(ValueError, match=r"^config\.json: field 'model_type' is null in config\.json; give its "
                                         r"value$"):
        parse_moe_spec({**cfg, "model_type": None}, "config.json")
    derived = parse_moe_spec({**cfg, "num_key_value_heads": None, "q_lora_rank": None})
    assert derived.attention.num_kv_heads == cfg["num_attention_heads"]


def test_a_huge_or_waiting_config_file_is_refused_before_it_is_read(tmp_path):
    """A 3 GB file given as --config was read whole; a kernel file that waits for data (``/proc/kmsg``) blocked."""
    from epmoe.checks import MAX_TEXT_BYTES, read_text_file

    big = tmp_path / "config.json"
    with open(big, "wb") as f:
        f.truncate(MAX_TEXT_BYTES + 1)  # sparse: no disk, no time
    with pytest.raises(ValueError, match=rf"^config file '.*config\.json' is larger than {MAX_TEXT_BYTES} bytes, "
                                         rf"the most read for a config file; is it the file meant\? \(it holds "
                                         rf"{MAX_TEXT_BYTES + 1} bytes\)$"):
        load_moe_spec(tmp_path)
    # a kernel file lists no size: the bound holds on what is read
    with pytest.raises(ValueError, match=r"^status '/proc/self/status' is larger than 16 bytes"):
        read_text_file("/proc/self/status", "status", max_bytes=16)
    assert read_text_file("/proc/self/status", "status").startswith("Name:")
    if os.path.exists("/proc/kmsg"):  # root reads it without waiting refused; others cannot open it
        code = ("from epmoe.checks import read_text_file\ntry:\n    read_text_file('/proc/kmsg', 'config file')\n"
                "except ValueError as exc:\n    print(exc)\n")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60).stdout
        assert re.fullmatch(r"config file '/proc/kmsg' (has nothing to read without waiting \(a kernel or device "
                            r"file\?\)|cannot be read: .+)\n", out), out


def test_arrival_span_message_shows_a_span_just_past_the_day():
    """A span just past the bound read '8.64e+04 s, past the 86400 s', as if it were within it."""
    from epmoe.checks import MAX_ARRIVAL_SPAN_S, check_arrival_span

    check_arrival_span("--request-rate", 1.0, int(MAX_ARRIVAL_SPAN_S) + 1)  # exactly one day: let through
    with pytest.raises(ValueError, match=r"--request-rate 1\.0 spreads 86402 prompts over 86401 s, past the 86400 s"):
        check_arrival_span("--request-rate", 1.0, int(MAX_ARRIVAL_SPAN_S) + 2)
    with pytest.raises(ValueError, match=r"--request-rate 1e-310 spreads 2 prompts over more seconds than a float "
                                         r"holds, past"):  # was "over inf s"
        check_arrival_span("--request-rate", 1e-310, 2)


def test_a_wrapped_configs_own_eos_ids_are_read_and_checked(tmp_path):
    """A wrapper (text_config) that names end-of-sequence ids of its own: they were neither used nor checked, so
    an id past the vocabulary there passed every check before the start."""
    import json

    from epmoe.engine.tokenizer import eos_token_ids

    cfg = {"model_type": "kimi_k25", "eos_token_id": 7, "text_config": {"eos_token_id": 5, "vocab_size": 100}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert eos_token_ids(str(tmp_path / "config.json"), None, vocab_size=100) == {5, 7}
    cfg["eos_token_id"] = 999999
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"config\.json': eos_token_id 999999 is outside the model's vocabulary "
                                         r"\[0, 100\)"):
        eos_token_ids(str(tmp_path / "config.json"), None, vocab_size=100)
