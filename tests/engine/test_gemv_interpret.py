"""``gemv.gemv_triton`` against ``F.linear`` under the Triton interpreter (CPU; runs only with
``TRITON_INTERPRET=1``; ``PYTHONPATH=/tmp/np23`` puts numpy<2.4 first, see ``test_paged_decode_interpret``)."""

import pytest
import torch
import torch.nn.functional as F

from epmoe.engine.gemv import GemvConfig, gemv_triton

pytestmark = pytest.mark.interpret


@pytest.mark.parametrize("m,n,k,bias", [(1, 40, 96, False), (3, 128, 64, True), (16, 33, 300, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kernel_matches_linear(m, n, k, bias, dtype):
    g = torch.Generator().manual_seed(m * n + k)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = torch.randn(n, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    got = gemv_triton(x, w, b, GemvConfig(block_n=16, block_k=64, num_warps=4, num_stages=2))
    want = F.linear(x.float(), w.float(), None if b is None else b.float())
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol * k ** 0.5)


def test_too_many_rows_or_mismatched_shapes_are_refused():
    with pytest.raises(ValueError, match="at most 16 rows, got 17"):
        gemv_triton(torch.zeros(17, 8), torch.zeros(4, 8))
    with pytest.raises(ValueError, match=r"x \[2, 8\], weight \[4, 9\] and bias None do not agree"):
        gemv_triton(torch.zeros(2, 8), torch.zeros(4, 9))
