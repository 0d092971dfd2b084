"""MoESpec parsed from every shipped real config.json, with the numbers asserted."""

from __future__ import annotations

import json

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


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("eagle3-draft-*.json")), ids=lambda p: p.name)
def test_eagle3_drafts_are_dense(path):
    with pytest.raises(DenseModelError, match="dense model with no MoE layers"):
        load_moe_spec(path)


def _v3() -> dict:
    return json.loads((CONFIGS / "deepseek-v3.config.json").read_text())


def test_missing_field_names_field_and_file():
    cfg = _v3()
    del cfg["n_routed_experts"]
    with pytest.raises(ValueError, match=r"myfile\.json: missing field 'n_routed_experts'"):
        parse_moe_spec(cfg, "myfile.json")


@pytest.mark.parametrize(
    "edit, message",
    [
        ({"n_group": 7}, r"n_group \(7\) must divide the number of routed experts \(256\)"),
        ({"topk_group": 9}, r"topk_group \(9\) must lie in \[1, n_group=8\]"),
        ({"num_experts_per_tok": 300}, r"num_experts_per_tok \(300\) exceeds the number of experts \(256\)"),
        ({"scoring_func": "softmax"}, r"expects scoring_func 'sigmoid'"),
        ({"first_k_dense_replace": 70}, r"first_k_dense_replace \(70\)"),
        ({"hidden_size": -1}, r"'hidden_size' must be a positive integer, got -1"),
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
