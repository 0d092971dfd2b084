"""``engine.gemv`` on CUDA: the kernel equals ``F.linear`` in bf16 at the decode projections' shapes, as a
dependent launch inside a CUDA graph after the kernel whose output it reads (a norm, and a kernel that lets its
dependents start at once and writes the rows only after a long wait: the kernel must wait for it)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from epmoe.engine.fused_norm import FusedRMSNorm
from epmoe.engine.gemv import GEMV_MAX_ROWS, gemv, gemv_add_norm, gemv_fits, linear
from epmoe.experts.triton.pdl import pdl_launch

from ..late_writer import late_writer

pytestmark = pytest.mark.gpu


def _captured(step):
    """``step`` run once on a side stream (compiling its kernels), then captured: ``(graph, its result)``."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.no_grad():
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.no_grad():
        out = step()
    return graph, out


@pytest.mark.parametrize("n,k", [(2048, 4096), (5120, 2048), (1536, 7168), (7168, 8192), (37, 100)])
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


@pytest.mark.parametrize("late", [False, True])
def test_linear_in_a_graph_after_the_norm_it_reads(late):
    """norm -> ``linear`` (the kernel, a dependent launch) -> norm, captured and replayed on new rows: the replay
    equals the same modules run eagerly in float32 up to bf16 rounding (the norm allowing its dependents at its
    start or after its wait, ``late_dependents``)."""
    torch.manual_seed(0)
    d, n = 2048, 5120
    norm = FusedRMSNorm(nn.Parameter(torch.rand(d, device="cuda", dtype=torch.bfloat16) + 0.5), 1e-6,
                        late_dependents=late)
    proj = nn.Linear(d, n, bias=False, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(1, d, device="cuda", dtype=torch.bfloat16)
    assert gemv_fits(x, proj.weight, proj.bias)
    if late and not pdl_launch(x):
        pytest.skip("no programmatic dependent launch on this GPU or with EPMOE_PDL=0: late_dependents is moot")
    graph, out = _captured(lambda: linear(proj, norm(x)))
    for seed in (1, 2):
        torch.manual_seed(seed)
        x.copy_(torch.randn(1, d, device="cuda", dtype=torch.bfloat16))
        graph.replay()
        want = F.linear(norm(x).float(), proj.weight.float())
        assert ((out.float() - want).norm() / want.norm()).item() < 4e-3


def test_linear_waits_for_a_late_writer_in_a_graph():
    """The kernel before ``linear``'s lets it start at once and writes its rows 50 us later: the replayed
    projection is of the rows written, not of what the buffer held before (the wait is where it must be)."""
    torch.manual_seed(0)
    d, n = 4096, 2048
    proj = nn.Linear(d, n, bias=False, device="cuda", dtype=torch.bfloat16)
    src = torch.randn(1, d, device="cuda", dtype=torch.bfloat16)
    x = torch.zeros(1, d, device="cuda", dtype=torch.bfloat16)
    kernel = late_writer()

    def step():
        kernel[(1,)](src, x, d, 50_000, BLOCK=d)
        return linear(proj, x)

    graph, out = _captured(step)
    for seed in (1, 2):
        torch.manual_seed(seed)
        src.copy_(torch.randn(1, d, device="cuda", dtype=torch.bfloat16))
        x.zero_()
        graph.replay()
        want = F.linear(src.float(), proj.weight.float())
        assert ((out.float() - want).norm() / want.norm()).item() < 4e-3


def test_linear_takes_cublas_beyond_the_rows():
    proj = nn.Linear(256, 64, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(GEMV_MAX_ROWS + 1, 256, device="cuda", dtype=torch.bfloat16)
    assert not gemv_fits(x, proj.weight, proj.bias)
    with torch.no_grad():
        assert torch.equal(linear(proj, x), proj(x))


@pytest.mark.parametrize("m", [1, 2])
def test_gemv_add_norm_waits_for_a_late_writer_in_a_graph(m):
    """The folded add, norm and projection after a kernel that writes the block's output rows 50 us after letting
    its dependents start: the replay's sum is the rows written plus the residual, exactly, and its projection is
    ``FusedRMSNorm.add_forward`` then ``F.linear``'s, up to bf16 rounding (it reads the rows after its wait)."""
    torch.manual_seed(0)
    d, n = 2048, 5120
    norm = FusedRMSNorm(nn.Parameter(torch.rand(d, device="cuda", dtype=torch.bfloat16) + 0.5), 1e-6)
    proj = nn.Linear(d, n, bias=False, device="cuda", dtype=torch.bfloat16)
    src = torch.randn(m, d, device="cuda", dtype=torch.bfloat16)
    x = torch.zeros(m, d, device="cuda", dtype=torch.bfloat16)
    r = torch.randn(m, d, device="cuda", dtype=torch.bfloat16)
    kernel = late_writer()

    def step():
        kernel[(1,)](src, x, m * d, 50_000, BLOCK=triton_block(m * d))
        return gemv_add_norm(x, r, norm.weight, norm.eps, proj.weight, pdl=pdl_launch(x))

    graph, (out, summed) = _captured(step)
    for seed in (1, 2):
        torch.manual_seed(seed)
        src.copy_(torch.randn(m, d, device="cuda", dtype=torch.bfloat16))
        x.zero_()
        graph.replay()
        normed, want_sum = norm.add_forward(src, r)
        assert torch.equal(summed, want_sum)
        want = F.linear(normed.float(), proj.weight.float())
        assert ((out.float() - want).norm() / want.norm()).item() < 4e-3


def triton_block(n: int) -> int:
    return 1 << (n - 1).bit_length()
