"""``skinny_linear``'s split-K kernel under the Triton interpreter (CPU; runs only with ``TRITON_INTERPRET=1``).

    PYTHONPATH=/tmp/np23 TRITON_INTERPRET=1 python -m pytest -q tests/engine/test_skinny_interpret.py

float16 (the interpreter has no bf16) against ``F.linear`` in float32, with and without a split of K and a bias,
for a column count that is not a multiple of the column tile; the arrival counters are back at zero after every
launch, so a second launch on the same counters gives the same result.
"""

import pytest
import torch
import torch.nn.functional as F

from epmoe.engine.skinny import SKINNY_MAX_ROWS, skinny_linear, split_k

pytestmark = pytest.mark.interpret


@pytest.mark.parametrize("m,n,k,bias", [(1, 100, 1024, True), (3, 64, 1024, False), (SKINNY_MAX_ROWS, 40, 256, True)])
def test_kernel_matches_linear(m, n, k, bias):
    gen = torch.Generator().manual_seed(m * n + k)
    x = torch.randn(m, k, generator=gen).half()
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).half()
    b = torch.randn(n, generator=gen).half() if bias else None
    want = F.linear(x.float(), w.float(), None if b is None else b.float())
    counters = torch.zeros(8, dtype=torch.int32)
    assert split_k(n, k) == (4 if k == 1024 else 1)
    first = skinny_linear(x, w, b, counters)
    assert first.dtype == torch.float16 and first.shape == (m, n)
    torch.testing.assert_close(first.float(), want, rtol=2e-3, atol=2e-3)
    assert not counters.any()
    assert torch.equal(skinny_linear(x, w, b, counters), first)


def test_bad_input_named():
    x = torch.zeros(SKINNY_MAX_ROWS + 1, 256, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"skinny_linear takes \[M <= 16, K\]"):
        skinny_linear(x, torch.zeros(32, 256, dtype=torch.float16), None, torch.zeros(1, dtype=torch.int32))
    with pytest.raises(ValueError, match="needs 2 int32 arrival counters, got 1"):
        skinny_linear(x[:2], torch.zeros(40, 256, dtype=torch.float16), None, torch.zeros(1, dtype=torch.int32))
