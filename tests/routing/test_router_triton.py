"""The fused Triton router (``routing.router_triton``) against the PyTorch router.

``interpret``: under the Triton interpreter on CPU (``TRITON_INTERPRET=1`` with a CPU Triton on the path),
real configs of every routing flavour the kernel serves; float32 logits (DeepSeek's router runs in float32)
and fp16 for the Qwen rounding (the interpreter has no bf16). ``gpu``: on the GPU against the PyTorch router
on the same GPU (bf16 and float32 logits).
"""

import json
from pathlib import Path

import pytest
import torch

from epmoe.routing import Router
from epmoe.spec import parse_moe_spec

CONFIGS = Path(__file__).resolve().parents[2] / "data" / "configs"


@pytest.mark.interpret
@pytest.mark.parametrize("name,dtype", [
    ("deepseek-v3", torch.float32),          # sigmoid, correction bias, 8 groups by top-2 sum, top-8
    ("kimi-k2-instruct", torch.float32),     # sigmoid over 384 experts (not a power of two)
    ("deepseek-v2-lite", torch.float32),     # softmax, top-6, no renormalisation
    ("qwen3-30b-a3b", torch.float16),        # softmax, renormalised, rounded to the logits' dtype
    ("mixtral-8x7b", torch.float32),         # softmax top-2
])
def test_fused_router_matches_torch(name, dtype):
    from epmoe.routing.router import kernel_flags
    from epmoe.routing.router_triton import route_triton, supports

    spec = parse_moe_spec(json.loads((CONFIGS / f"{name}.config.json").read_text()), name)
    assert supports(spec.router_kind)
    router = Router(spec, dtype=dtype, impl="torch")
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        router.weight.normal_(0, 0.05, generator=gen)
        if router.e_score_correction_bias is not None:
            router.e_score_correction_bias.normal_(0, 0.1, generator=gen)
    x = torch.randn(37, spec.hidden_size, generator=gen).to(dtype)
    idx, w = router(x)
    logits = torch.nn.functional.linear(x.float() if router.fp32_logits else x, router.weight.to(
        torch.float32 if router.fp32_logits else dtype), router.bias)
    fidx, fw = route_triton(logits, router.e_score_correction_bias, **kernel_flags(spec))
    assert fidx.dtype == torch.int64 and fw.dtype == torch.float32
    # the chosen logits are the same multiset for every token (an exact tie at the k-th place, common in
    # fp16 logits, may be broken either way: the fused kernel takes the lower expert id)
    assert torch.equal(logits.gather(1, idx).sort(dim=1).values, logits.gather(1, fidx).sort(dim=1).values)
    order, forder = idx.sort(dim=1), fidx.sort(dim=1)
    same = (order.values == forder.values).all(dim=1)
    assert same.float().mean() > 0.9
    got, want = fw.gather(1, forder.indices)[same], w.gather(1, order.indices)[same]
    assert torch.allclose(got, want, rtol=2e-6 if dtype == torch.float32 else 1e-3, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["deepseek-v3", "kimi-k2-instruct", "qwen3-30b-a3b", "mixtral-8x7b",
                                  "deepseek-v2-lite", "glm-4.5"])
@pytest.mark.parametrize("t", [1, 8, 1000])
def test_fused_router_matches_torch_on_gpu(name, t):
    spec = parse_moe_spec(json.loads((CONFIGS / f"{name}.config.json").read_text()), name)
    fused = Router(spec, dtype=torch.bfloat16, device="cuda")
    plain = Router(spec, dtype=torch.bfloat16, device="cuda", impl="torch")
    gen = torch.Generator(device="cuda").manual_seed(t)
    with torch.no_grad():
        fused.weight.normal_(0, 0.05, generator=gen)
        if fused.e_score_correction_bias is not None:
            fused.e_score_correction_bias.normal_(0, 0.1, generator=gen)
    plain.load_state_dict(fused.state_dict())
    x = torch.randn(t, spec.hidden_size, generator=gen, device="cuda").bfloat16()
    (fi, fw), (pi, pw) = fused(x), plain(x)
    logits = torch.nn.functional.linear(x.float(), fused.weight.float()) if fused.fp32_logits else \
        torch.nn.functional.linear(x, fused.weight, fused.bias)
    # the same chosen logits for every token (exact ties at the k-th place may be broken differently)
    assert torch.equal(logits.gather(1, fi).sort(dim=1).values, logits.gather(1, pi).sort(dim=1).values)
    fo, po = fi.sort(dim=1), pi.sort(dim=1)
    same = (fo.values == po.values).all(dim=1)
    assert same.float().mean() >= 0.95
    assert torch.allclose(fw.gather(1, fo.indices)[same], pw.gather(1, po.indices)[same], rtol=1e-5, atol=1e-7)


def _slots_and_record(device: str) -> None:
    """``route_to_slots``: the same slots as ``SlotMap`` on the routed ids and the same counts as the recorder's
    ``record`` (with and without a row mask), in the fused launch."""
    from epmoe.loads import ExpertLoadRecorder, LoadRecord
    from epmoe.routing.router import kernel_flags
    from epmoe.routing.router_triton import route_triton

    spec = parse_moe_spec(json.loads((CONFIGS / "deepseek-v3.config.json").read_text()), "deepseek-v3")
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(23, spec.num_experts, generator=gen).to(device)
    bias = (torch.randn(spec.num_experts, generator=gen) * 0.1).to(device)
    table = torch.randperm(spec.num_experts + 40, generator=gen)[: spec.num_experts].to(device)  # 40 spare slots
    ref = ExpertLoadRecorder(num_layers=3, num_slots=spec.num_experts + 40, window=2)
    got = ExpertLoadRecorder(num_layers=3, num_slots=spec.num_experts + 40, window=2, device=device)
    mask = (torch.rand(23, generator=gen) > 0.4).long()
    for layer, m in ((0, None), (2, mask)):
        ref.mask_rows(m)
        got.mask_rows(None if m is None else m.to(device))
        record = got.load_record(layer, 23) if device == "cuda" else LoadRecord(got._counts, got._pos, layer,
                                                                                 got._row_mask)
        idx, w, slots = route_triton(logits, bias, **kernel_flags(spec), slot_table=table, record=record)
        plain_idx, plain_w = route_triton(logits, bias, **kernel_flags(spec))
        assert torch.equal(idx, plain_idx) and torch.equal(w, plain_w)
        assert torch.equal(slots, table[idx])
        ref.record(layer, slots.cpu())
        assert torch.equal(got._counts.cpu(), ref._counts), layer
    assert ref._counts.sum() == 23 * spec.top_k + int(mask.sum()) * spec.top_k


@pytest.mark.interpret
def test_fused_slots_and_load_record_interpreter():
    _slots_and_record("cpu")


@pytest.mark.gpu
def test_fused_slots_and_load_record_gpu():
    _slots_and_record("cuda")
