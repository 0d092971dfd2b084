"""``RopeAttention``: the fused q/k/v projection, norm, rotary and cache write against transformers' own modules."""

from __future__ import annotations

import copy
import sys

import pytest
import torch

from epmoe.engine.attention import AttnBatch
from epmoe.engine.kv_cache import KVCache, KVLayout
from epmoe.engine.rope_attention import RopeAttention, install_rope_attention, rope_qkv, rope_qkv_reference
from epmoe.models.tiny import build_tiny_checkpoint

from .rope_cases import CASES, make_rope_case

ROPE = ["qwen3-moe", "qwen2-moe", "mixtral", "glm4.5", "gpt-oss"]


def _model(family: str, tmp_path):
    from transformers import AutoModelForCausalLM

    d = build_tiny_checkpoint(family, tmp_path / family)
    return AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()


@pytest.mark.parametrize("family", ROPE)
def test_queries_keys_and_values_equal_transformers(family, tmp_path):
    """Layer 0's queries, cached keys and values equal what transformers' module computes before attention."""
    model = _model(family, tmp_path)
    attn = model.model.layers[0].self_attn
    original = copy.deepcopy(attn)
    t = 7
    x = torch.randn(1, t, model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    positions = torch.arange(3, 3 + t)[None]
    cos, sin = model.model.rotary_emb(x, positions)
    modeling = sys.modules[type(original).__module__]
    shape = (1, t, -1, original.head_dim)
    q, k, v = (getattr(original, n)(x).view(shape) for n in ("q_proj", "k_proj", "v_proj"))
    if getattr(original, "q_norm", None) is not None and getattr(original, "use_qk_norm", True):
        q, k = original.q_norm(q), original.k_norm(k)
    q, k = modeling.apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)

    fused = RopeAttention(attn)
    layout = KVLayout.from_config(model.config)
    kv = KVCache(layout, 4, 4, torch.float32, torch.device("cpu"))
    slots = torch.tensor([5, 4, 13, 12, 6, 7, 14])
    cos_h, sin_h = fused._cos_sin((cos, sin))
    got_q = rope_qkv(fused.qkv_proj(x[0]), cos_h, sin_h, fused.num_heads, fused.num_kv_heads,
                     None if fused.q_norm is None else fused.q_norm.weight,
                     None if fused.k_norm is None else fused.k_norm.weight, fused.eps, kv.k[0], kv.v[0], slots)
    torch.testing.assert_close(got_q, q[0].transpose(0, 1), rtol=1e-5, atol=1e-5)
    keys, values = kv.read(0, slots)
    torch.testing.assert_close(keys, k[0].transpose(0, 1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(values, v[0], rtol=0, atol=0)


@pytest.mark.parametrize("family", ROPE)
def test_forward_equals_transformers_attention(family, tmp_path):
    """The whole module on one 6-token prompt (a prefill chunk) against transformers' eager attention."""
    from epmoe.engine.attention import PrefillChunk

    model = _model(family, tmp_path)
    model.config._attn_implementation = "eager"
    layer = 1 if family == "gpt-oss" else 0  # gpt-oss: layer 1 is full attention (layer 0 slides over 8)
    attn = model.model.layers[layer].self_attn
    t = 6
    x = torch.randn(1, t, model.config.hidden_size, generator=torch.Generator().manual_seed(2))
    positions = torch.arange(t)[None]
    pe = model.model.rotary_emb(x, positions)
    mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
    want, _ = attn(x, position_embeddings=pe, attention_mask=mask)
    fused = RopeAttention(copy.deepcopy(attn))
    kv = KVCache(KVLayout.from_config(model.config), 4, 4, torch.float32, torch.device("cpu"))
    slots = torch.arange(4, 4 + t)
    batch = AttnBatch(kv, slots, 0, torch.zeros(0, 1, dtype=torch.int32), torch.zeros(0, dtype=torch.int32),
                      (PrefillChunk(0, t, 0, slots),))
    got, _ = fused(x, position_embeddings=pe, epmoe_batch=batch)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_install_replaces_the_rope_families_only(tmp_path):
    qwen = _model("qwen3-moe", tmp_path)
    assert install_rope_attention(qwen) == 2 == install_rope_attention(qwen)
    attn = qwen.model.layers[0].self_attn
    assert isinstance(attn, RopeAttention) and not hasattr(attn, "q_proj") and attn.qkv_proj.out_features == 8 * 16
    llama = _model("llama4", tmp_path)
    assert install_rope_attention(llama) == 0
    with pytest.raises(ValueError, match="RopeAttention serves model types .* not 'llama4_text'"):
        RopeAttention(llama.model.layers[0].self_attn)


def test_install_reads_the_rotary_fraction_where_transformers_does(tmp_path):
    """GLM's partial rotary comes in ``rope_parameters``: 16-dim heads rotating 12 dims have a half of 6, which is
    no tile of the kernel, so transformers' module stays; rotating 8 (the tiny GLM's 0.5) the layers are fused."""
    from transformers import AutoModelForCausalLM

    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75}
    d = build_tiny_checkpoint("glm4.5", tmp_path / "glm-075", overrides={"rope_parameters": rope})
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    assert model.model.rotary_emb.inv_freq.numel() == 6  # transformers rotates 12 of the 16 dims
    assert install_rope_attention(model) == 0
    glm = _model("glm4.5", tmp_path)
    assert install_rope_attention(glm) == glm.config.num_hidden_layers == 3


def test_forward_outside_the_engine_is_refused(tmp_path):
    attn = RopeAttention(_model("mixtral", tmp_path).model.layers[0].self_attn)
    with pytest.raises(ValueError, match="needs the engine's epmoe_batch"):
        attn(torch.zeros(1, 2, attn.qkv_proj.in_features), position_embeddings=None)


def test_rope_qkv_checks_shapes():
    qkv, cos, sin, qn, kn, kc, vc, slots = make_rope_case(*CASES[0], torch.float32)
    with pytest.raises(ValueError, match="qkv has 128 columns; \\(H \\+ 2 Hkv\\) D = 96"):
        rope_qkv(qkv, cos, sin, 2, 2, qn, kn, 1e-6, kc, vc, slots)
    with pytest.raises(ValueError, match="must both be \\[T=5, R/2\\] with R <= head_dim 16"):
        rope_qkv(qkv, torch.cat([cos, cos], 1), torch.cat([sin, sin], 1), 4, 2, qn, kn, 1e-6, kc, vc, slots)
    with pytest.raises(ValueError, match="q_norm and k_norm go together"):
        rope_qkv(qkv, cos, sin, 4, 2, qn, None, 1e-6, kc, vc, slots)


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("t", [5, 1500])  # a program a token; ROPE_PREFILL_TOKENS tokens a program
def test_triton_matches_reference_bf16(case, t):
    args = make_rope_case(*case, torch.bfloat16, t=t, num_blocks=t // 4 + 2)
    qkv, cos, sin, qn, kn, kc, vc, slots = args
    ref_k, ref_v = kc.clone(), vc.clone()
    want = rope_qkv_reference(qkv, cos, sin, case[0], case[1], qn, kn, 1e-6, ref_k, ref_v, slots)
    dev = [a.cuda() if isinstance(a, torch.Tensor) else a for a in args]
    got = rope_qkv(dev[0], dev[1], dev[2], case[0], case[1], dev[3], dev[4], 1e-6, dev[5], dev[6], dev[7])
    torch.testing.assert_close(got.cpu().float(), want.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(dev[5].cpu().float(), ref_k.float(), rtol=2e-2, atol=2e-2)
    assert torch.equal(dev[6].cpu(), ref_v)
