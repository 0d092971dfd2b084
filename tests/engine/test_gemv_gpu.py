"""``engine.gemv`` on CUDA: the kernel equals ``F.linear`` in bf16 at the decode projections' shapes, as a
dependent launch inside a CUDA graph after the kernel whose output it reads."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from epmoe.engine.fused_norm import FusedRMSNorm
from epmoe.engine.gemv import GEMV_MAX_ROWS, gemv, gemv_fits, linear

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("n,k", [(2048, 4096), (5120, 2048), (1536, 7168), (37, 100)])
@pytest.mark.parametrize("m", [1, 2])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_equals_linear(n, k, m, bias):
    torch.manual_seed(n + k + m)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16) if bias else None
    want = F.linear(x.float(), w.float(), None if b is None else b.float())
    for pdl in (False, True):
        got = gemv(x, w, b, pdl=pdl)
        assert got.dtype == torch.bfloat16 and got.shape == (m, n)
        err = ((got.float() - want).norm() / want.norm()).item()
        assert err < 4e-3, (pdl, err)


def test_linear_in_a_graph_after_the_norm_it_reads():
    """norm -> ``linear`` (the kernel, a dependent launch) -> norm, captured and replayed on new rows: the replay
    equals the same modules run eagerly in float32 up to bf16 rounding."""
    torch.manual_seed(0)
    d, n = 2048, 5120
    norm = FusedRMSNorm(nn.Parameter(torch.rand(d, device="cuda", dtype=torch.bfloat16) + 0.5), 1e-6)
    proj = nn.Linear(d, n, bias=False, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(1, d, device="cuda", dtype=torch.bfloat16)
    assert gemv_fits(x, proj.weight, proj.bias)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        linear(proj, norm(x))
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = linear(proj, norm(x))
    for seed in (1, 2):
        torch.manual_seed(seed)
        x.copy_(torch.randn(1, d, device="cuda", dtype=torch.bfloat16))
        graph.replay()
        want = F.linear(norm(x).float(), proj.weight.float())
        assert ((out.float() - want).norm() / want.norm()).item() < 4e-3


def test_linear_takes_cublas_beyond_the_rows():
    proj = nn.Linear(256, 64, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(GEMV_MAX_ROWS + 1, 256, device="cuda", dtype=torch.bfloat16)
    assert not gemv_fits(x, proj.weight, proj.bias)
    assert torch.equal(linear(proj, x), proj(x))
