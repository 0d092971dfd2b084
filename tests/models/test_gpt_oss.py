"""gpt-oss experts against transformers' own: non-zero, interleaved gate/up biases and the clamped SwiGLU driven past
``swiglu_limit`` on both sides of ``up`` and of ``gate`` (the tiny checkpoint's zero biases and small
pre-activations would hide a wrong de-interleave or a one-sided clamp)."""

from __future__ import annotations

import pytest
import torch

from epmoe.comm import Comm
from epmoe.layer import MoELayerOptions
from epmoe.placement import ExpertPlacement

LIMIT = 1.5


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The tiny gpt-oss checkpoint with ``swiglu_limit`` 1.5, larger ``gate_up_proj`` and random biases, re-saved
    by transformers."""
    from transformers import AutoModelForCausalLM

    from epmoe.models.tiny import build_tiny_checkpoint

    root = tmp_path_factory.mktemp("gpt-oss")
    base = build_tiny_checkpoint("gpt-oss", root / "base", seed=4, overrides={"swiglu_limit": LIMIT})
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for layer in model.model.layers:
            experts = layer.mlp.experts
            experts.gate_up_proj.mul_(6.0)
            experts.gate_up_proj_bias.copy_(torch.randn(experts.gate_up_proj_bias.shape, generator=gen))
            experts.down_proj_bias.copy_(torch.randn(experts.down_proj_bias.shape, generator=gen) * 0.5)
    model.save_pretrained(root / "biased")
    return root / "biased"


def test_gpt_oss_biases_and_clamped_swiglu_match_transformers(checkpoint):
    from transformers import AutoModelForCausalLM

    from epmoe.models.hf import load_ep_model

    ref = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    assert ref.config.swiglu_limit == LIMIT
    ep = load_ep_model(str(checkpoint), ExpertPlacement.trivial(2, 8, 1), Comm(None),
                       options=MoELayerOptions(dispatcher="local"))
    x = torch.randn(48, ref.config.hidden_size, generator=torch.Generator().manual_seed(6))
    for index, layer in enumerate(ep.moe_layers):
        mlp = ref.model.layers[index].mlp
        assert mlp.experts.gate_up_proj_bias.abs().min() > 0
        with torch.no_grad():
            _, _, chosen = mlp.router(x)
            pre = torch.einsum("td,tkdf->tkf", x, mlp.experts.gate_up_proj[chosen]) + mlp.experts.gate_up_proj_bias[
                chosen]
            gate, up = pre[..., ::2], pre[..., 1::2]
            # the routed pre-activations cross the limit on every side the clamp has (and gate below -limit,
            # where gpt-oss does not clamp)
            assert (up > LIMIT).any() and (up < -LIMIT).any() and (gate > LIMIT).any() and (gate < -LIMIT).any()
            ours, theirs = layer(x), mlp(x[None])[0][0]
        assert float((ours - theirs).norm() / theirs.norm()) < 1e-5, index
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        ours, theirs = ep.model(ids).logits, ref(ids).logits
    assert float((ours - theirs).norm() / theirs.norm()) < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 4, 300])  # the decode kernel and the grouped one
def test_triton_clamped_swiglu_past_the_limit_matches_reference(t):
    """The Triton kernels' clamped SwiGLU with biases, on pre-activations well past ``swiglu_limit`` (bf16 against
    the float64 reference)."""
    from epmoe.experts import Activation, ExpertWeights, get_expert_backend, reference_experts

    s, d, f, k = 8, 256, 128, 4
    g = torch.Generator(device="cuda").manual_seed(t)
    w = ExpertWeights(torch.randn(s, 2 * f, d, device="cuda", generator=g) * 3 / d**0.5,
                      torch.randn(s, d, f, device="cuda", generator=g) / f**0.5,
                      torch.randn(s, 2 * f, device="cuda", generator=g), torch.randn(s, d, device="cuda", generator=g))
    act = Activation("silu", LIMIT)
    x = torch.randn(t, d, device="cuda", generator=g).to(torch.bfloat16)
    slots = torch.stack([torch.randperm(s, device="cuda", generator=g)[:k] for _ in range(t)])
    tw = torch.rand(t, k, device="cuda", generator=g)
    w16 = ExpertWeights(*(p.to(torch.bfloat16) for p in (w.w13, w.w2, w.b13, w.b2)))
    w64 = ExpertWeights(*(p.double() for p in (w16.w13, w16.w2, w16.b13, w16.b2)))
    pre = torch.einsum("td,tkfd->tkf", x.double(), w64.w13[slots]) + w64.b13[slots]
    gate, up = pre[..., :f], pre[..., f:]
    assert (up > LIMIT).any() and (up < -LIMIT).any() and (gate > LIMIT).any() and (gate < -LIMIT).any()
    ref = reference_experts(x.double(), slots, tw.double(), w64, act)
    out = get_expert_backend("triton")(x, slots, tw, w16, act, False)
    assert float((out.double() - ref).norm() / ref.norm()) < 2e-2
