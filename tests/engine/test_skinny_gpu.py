"""``engine.skinny`` on CUDA: the split-K projection equals ``F.linear`` up to bf16 rounding at Qwen3-30B-A3B's
projection shapes, and a CUDA graph of it replays with new inputs to the eager results, bit for bit."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from epmoe.engine.skinny import SkinnyLinear, skinny_linear, split_k

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("n,k,bias", [(5120, 2048, False), (2048, 4096, False), (1000, 512, True)])
@pytest.mark.parametrize("m", [1, 4, 16])
def test_matches_linear(n, k, bias, m):
    gen = torch.Generator(device="cuda").manual_seed(n + m)
    x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=gen) / k ** 0.5).bfloat16()
    b = torch.randn(n, device="cuda", generator=gen).bfloat16() if bias else None
    counters = torch.zeros(-(-n // 32), dtype=torch.int32, device="cuda")
    got = skinny_linear(x, w, b, counters)
    want = F.linear(x.float(), w.float(), None if b is None else b.float())
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)
    assert not counters.any()


def test_module_in_a_graph():
    lin = nn.Linear(4096, 2048, bias=False, device="cuda", dtype=torch.bfloat16)
    mod = SkinnyLinear(lin)
    assert split_k(2048, 4096) > 1
    x = torch.randn(2, 4096, device="cuda", dtype=torch.bfloat16)
    eager = [mod(torch.randn(2, 4096, device="cuda", dtype=torch.bfloat16)) for _ in range(2)]  # counters made here
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = mod(x)
    for _ in range(2):
        x.copy_(torch.randn(2, 4096, device="cuda", dtype=torch.bfloat16))
        graph.replay()
        assert torch.equal(out, mod(x))
        torch.testing.assert_close(out.float(), F.linear(x, lin.weight).float(), rtol=2e-2, atol=2e-2)
    assert eager[0].shape == (2, 2048) and not mod._counters.any()
    big = torch.randn(40, 4096, device="cuda", dtype=torch.bfloat16)  # past 16 rows: F.linear
    assert torch.equal(mod(big), F.linear(big, lin.weight))
