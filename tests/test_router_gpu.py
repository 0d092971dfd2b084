"""The fused Triton router on the GPU against the PyTorch router on the same GPU (bf16 and float32 logits)."""

import json
from pathlib import Path

import pytest
import torch

from epmoe.routing import Router
from epmoe.spec import parse_moe_spec

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CONFIGS = Path(__file__).resolve().parents[1] / "data" / "configs"


@pytest.mark.parametrize("name", ["deepseek-v3", "kimi-k2-instruct", "qwen3-30b-a3b", "mixtral-8x7b",
                                  "deepseek-v2-lite"])
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
