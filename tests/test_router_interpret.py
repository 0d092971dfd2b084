"""The fused Triton router (``kernels.triton_router``) against the PyTorch router, under the Triton interpreter.

    PYTHONPATH=/path/to/cpu/triton:src TRITON_INTERPRET=1 pytest -q tests/test_router_interpret.py

Real configs of every routing flavour the kernel serves; float32 logits (DeepSeek's router runs in
float32) and fp16 for the Qwen rounding (the interpreter has no bf16).
"""

import json
import os
from pathlib import Path

import pytest
import torch

from epmoe.routing import Router
from epmoe.spec import parse_moe_spec

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")
CONFIGS = Path(__file__).resolve().parents[1] / "data" / "configs"


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
