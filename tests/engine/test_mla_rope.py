"""``engine.mla_rope``'s PyTorch path against transformers' own MLA pieces (DeepSeek-V3's RMSNorm and both rotary
functions), its errors, and which MLA modules take it (``MLAAttention._latent_norm``). The Triton kernel runs in
``test_mla_rope_interpret`` (interpreter) and on CUDA in ``test_mla_decode_gpu``'s engine tests."""

from __future__ import annotations

import pytest
import torch

from epmoe.engine.mla_rope import (
    WIDE_HEADS,
    WIDE_MIN_ROWS,
    mla_rope_write,
    mla_rope_write_triton,
    rope_heads_per_program,
)

from .mla_rope_cases import CASES, make_mla_rope_case


@pytest.mark.parametrize("case", CASES)
def test_reference_equals_transformers(case):
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds

    t, h, dn, dr, rank, interleave = case
    q, compressed, cos, sin, weight, pool, slots = make_mla_rope_case(t, h, dn, dr, rank, torch.float32)
    norm = ds.DeepseekV3RMSNorm(rank, eps=1e-6)
    norm.weight.data.copy_(weight)
    rotary = ds.apply_rotary_pos_emb_interleave if interleave else ds.apply_rotary_pos_emb
    q_rope, k_rope = rotary(q[..., dn:].transpose(0, 1)[None], compressed[None, None, :, rank:], cos[None], sin[None])
    want_q = torch.cat([q[..., :dn], q_rope[0].transpose(0, 1)], -1)
    want_entry = torch.cat([norm(compressed[:, :rank]), k_rope[0, 0]], -1)

    mla_rope_write(q, compressed, cos, sin, weight, 1e-6, pool, slots, dn, interleave)
    torch.testing.assert_close(q, want_q, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(pool[slots], want_entry, rtol=1e-6, atol=1e-6)
    untouched = torch.ones(pool.shape[0], dtype=torch.bool)
    untouched[slots] = False
    assert not pool[untouched].any()


@pytest.mark.parametrize("bad, match", [
    ("compressed", r"compressed \(3, 23\) must be \[T=3, kv_lora_rank \+ rope = 24\]"),
    ("cos", r"cos \(3, 4\).*must both be \[T=3, 8\]"),
    ("slots", r"slot_mapping must be \[T=3\] int64, got \(3,\) torch.int32"),
    ("rope", r"rotary part of a query head \(width 14 - nope_dim 8 = 6\) must be a positive power of two"),
    ("pool", r"latent pool must be \[slots, 24\] contiguous, got \(40, 25\)"),
])
def test_bad_inputs_named(bad, match):
    q, compressed, cos, sin, weight, pool, slots = make_mla_rope_case(3, 4, 8, 8, 16, torch.float32)
    if bad == "compressed":
        compressed = compressed[:, :-1]
    elif bad == "cos":
        cos = cos[:, :4]
    elif bad == "slots":
        slots = slots.int()
    elif bad == "rope":
        q = q[..., :-2]
    elif bad == "pool":
        pool = torch.zeros(40, 25)
    before = pool.clone()
    with pytest.raises(ValueError, match=match):
        mla_rope_write(q, compressed, cos, sin, weight, 1e-6, pool, slots, 8, True)
    assert torch.equal(pool, before)


@pytest.mark.parametrize("variant, fused", [("v3", True), ("v3-yarn-no-qlora", True), ("v2", False)])
def test_which_modules_take_the_kernel(variant, fused):
    """DeepSeek-V3's modules (interleaved or rotate-half rope, transformers' or the engine's fused norm) take
    ``mla_rope_write`` on CUDA; DeepSeek-V2's complex rotary keeps transformers' function."""
    from epmoe.engine.fused_norm import fuse_norms
    from epmoe.engine.mla import MLAAttention

    from .test_mla import VARIANTS, _model

    model = _model(variant)
    attn = MLAAttention(model.model.layers[0].self_attn)
    assert attn.interleave == VARIANTS[variant][1].get("rope_interleave", False)
    got = attn._latent_norm()
    assert (got is not None) == fused
    if fused:
        assert got[0] is attn.kv_a_layernorm.weight and got[1] == model.config.rms_norm_eps
        fuse_norms(attn)
        assert type(attn.kv_a_layernorm).__name__ == "FusedRMSNorm"
        assert attn._latent_norm()[0] is attn.kv_a_layernorm.weight


def test_heads_per_program():
    """One head a program below ``WIDE_MIN_ROWS`` head rows, ``WIDE_HEADS`` from there (a power of two no wider than
    the model's heads); bad counts named."""
    assert rope_heads_per_program(1, 64) == rope_heads_per_program(63, 64) == 1
    assert rope_heads_per_program(WIDE_MIN_ROWS // 64, 64) == rope_heads_per_program(4096, 128) == WIDE_HEADS
    assert rope_heads_per_program(WIDE_MIN_ROWS, 3) == 4 and rope_heads_per_program(WIDE_MIN_ROWS, 1) == 1
    assert rope_heads_per_program(0, 64) == 1
    for tokens, heads, shown in ((-1, 64, "tokens must be an integer >= 0, got -1"),
                                 (8, 0, "heads must be an integer >= 1, got 0"),
                                 (2.0, 64, "tokens must be an integer >= 0, got 2.0"),
                                 (8, True, "heads must be an integer >= 1, got True")):
        with pytest.raises(ValueError, match=f"rope_heads_per_program: {shown}"):
            rope_heads_per_program(tokens, heads)
    q, compressed, cos, sin, weight, pool, slots = make_mla_rope_case(*CASES[0][:5], torch.float32)
    for bad in (3, 0, 2.0, True, 128, 2 ** 40):
        with pytest.raises(ValueError, match=f"heads_per_program must be a power of two from 1 to 64, got {bad}"):
            mla_rope_write_triton(q, compressed, cos, sin, weight, 1e-6, pool, slots, CASES[0][2], True, bad)
