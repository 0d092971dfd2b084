"""``engine.gemv``: the decode projections' kernel under the Triton interpreter (against ``F.linear``), the
operand checks, and ``linear``'s choice (the module itself wherever the kernel does not apply)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from epmoe.engine.gemv import GEMV_MAX_K, GEMV_MAX_ROWS, gemv, gemv_fits, linear


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])  # the interpreter has no bf16
@pytest.mark.parametrize("m,n,k", [(1, 37, 100), (2, 64, 128), (3, 9, 200), (1, 5, 16)])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_equals_linear(dtype, m, n, k, bias):
    """Ragged ``N`` (a last program's masked rows), ``K`` not a power of two (masked columns), three rows (a
    masked fourth), with and without a bias; rows with a stride (a view of wider rows)."""
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    wide = torch.randn(m, k + 8, generator=gen).to(dtype)
    x = wide[:, 3:k + 3]  # row stride k + 8, contiguous along K
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    got = gemv(x, w, b, pdl=False)
    want = F.linear(x.float(), w.float(), None if b is None else b.float())
    assert got.shape == (m, n) and got.dtype == dtype
    torch.testing.assert_close(got.float(), want, rtol=2e-3 if dtype == torch.float16 else 1e-5,
                               atol=2e-3 if dtype == torch.float16 else 1e-5)


def test_gemv_refuses_operands_by_name():
    x = torch.randn(1, 64)
    with pytest.raises(ValueError, match=r"x \(1, 64\), weight \(8, 32\) and bias None do not agree"):
        gemv(x, torch.randn(8, 32))
    with pytest.raises(ValueError, match=r"bias \(7,\) do not agree"):
        gemv(x, torch.randn(8, 64), torch.randn(7))
    with pytest.raises(ValueError, match=f"K <= {GEMV_MAX_K}.*K {GEMV_MAX_K + 1}"):
        gemv(torch.randn(1, GEMV_MAX_K + 1), torch.randn(2, GEMV_MAX_K + 1))
    with pytest.raises(ValueError, match=r"weight strides \(1, 8\)"):
        gemv(x, torch.randn(64, 8).t())
    with pytest.raises(ValueError, match=r"x strides \(1, 2\)"):
        gemv(torch.randn(64, 2).t(), torch.randn(8, 64))


def test_gemv_no_rows_or_outputs():
    assert gemv(torch.randn(0, 64), torch.randn(8, 64)).shape == (0, 8)
    assert gemv(torch.randn(2, 64), torch.randn(0, 64)).shape == (2, 0)


def test_linear_is_the_module_where_the_kernel_does_not_apply():
    """On the CPU (no dependent launches), for a subclass of ``nn.Linear`` and for more rows than
    ``GEMV_MAX_ROWS``, ``linear`` returns what the module returns, with its leading dimensions."""
    torch.manual_seed(0)
    lin = nn.Linear(64, 24).to(torch.bfloat16)
    x = torch.randn(1, 1, 64, dtype=torch.bfloat16)
    assert not gemv_fits(x[0], lin.weight, lin.bias)  # CPU
    assert torch.equal(linear(lin, x), lin(x))

    class Scaled(nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    scaled = Scaled(64, 24)
    xf = torch.randn(1, GEMV_MAX_ROWS + 1, 64)
    assert torch.equal(linear(scaled, xf), 2 * F.linear(xf, scaled.weight, scaled.bias))
    assert linear(lin, x).shape == (1, 1, 24)
