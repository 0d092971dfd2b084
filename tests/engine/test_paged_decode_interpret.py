"""The paged decode Triton kernels under the Triton interpreter (CPU; runs only with ``TRITON_INTERPRET=1``).

    TRITON_INTERPRET=1 python -m pytest -q tests/engine/test_paged_decode_interpret.py

``paged_decode_triton`` against ``paged_decode_reference`` on the shared cases, float32 and fp16 (the
interpreter has no bf16), single pass and split-K (with and without a given workspace and ``out``).

Triton 3.6's interpreter turns a loop bound computed in the kernel into an int with ``int()`` of a
1-element array, an error since NumPy 2.4; with a newer NumPy installed, put an older one first on the path:

    pip install --target /tmp/np23 "numpy<2.4"
    PYTHONPATH=/tmp/np23 TRITON_INTERPRET=1 python -m pytest -q tests/engine/test_paged_decode_interpret.py
"""


import numpy as np
import pytest
import torch

from epmoe.engine.paged_decode import paged_decode_reference, paged_decode_workspace

from .paged_decode_cases import CASES, make_case, naive_dense, rel_err

pytestmark = pytest.mark.interpret


@pytest.fixture(autouse=True)
def _interpreter_numpy():
    if tuple(int(x) for x in np.__version__.split(".")[:2]) >= (2, 4):
        pytest.fail(f"the Triton interpreter's dynamic loop bounds fail with NumPy {np.__version__} (int() of a "
                    "1-element array); run with numpy<2.4 first on PYTHONPATH (see this module's docstring)")


@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("i", range(len(CASES)))
def test_kernel_matches_reference(i, dtype, splits):
    from epmoe.engine.paged_decode import paged_decode_triton

    ctx, h, hkv, dk, dv, bs, opts = CASES[i]
    c = make_case(i, ctx, h, hkv, dk, dv, bs, dtype=dtype, **opts)
    want = paged_decode_reference(*c.args(), **c.options())
    got = paged_decode_triton(*c.args(), **c.options(), splits=splits)
    assert got.shape == want.shape and got.dtype == dtype
    if dtype == torch.float32:
        assert rel_err(got, naive_dense(c)) < 1e-5
    else:
        assert rel_err(got, want) < 5e-3
    for j, n in enumerate(ctx):
        if n == 0:
            assert torch.equal(got[j], torch.zeros_like(got[j]))


@pytest.mark.parametrize("splits", [1, 2, 8])
def test_kernel_writes_out_and_uses_workspace(splits):
    from epmoe.engine.paged_decode import paged_decode_triton

    c = make_case(21, [150, 0, 64, 1], 8, 2, 32, 24, 16, window=100, sinks=True)
    want = naive_dense(c)
    out = torch.full((4, 8, 24), float("nan"))
    ws = paged_decode_workspace(c.q, c.v_cache, splits).fill_(float("nan"))
    got = paged_decode_triton(*c.args(), **c.options(), out=out, splits=splits, workspace=ws)
    assert got is out
    assert rel_err(out, want) < 1e-5
    # out given without a workspace: the single-pass kernel, same result
    out2 = torch.full_like(out, float("nan"))
    paged_decode_triton(*c.args(), **c.options(), out=out2, splits=splits)
    assert rel_err(out2, want) < 1e-5


@pytest.mark.parametrize("opts", [{}, {"window": 700, "sinks": True}, {"chunk": 640, "sinks": True}])
def test_many_splits_with_empty_ones(opts):
    """64 splits of 16 positions (float32, Dv 128): the reduce merges up to 63 splits holding positions, never reading
    the NaN-filled accumulators of the empty splits; a row of 5 positions has one split holding them and a padding
    row none."""
    from epmoe.engine.paged_decode import paged_decode_triton

    c = make_case(23, [1000, 5, 0, 333], 4, 2, 128, 128, 16, **opts)
    want = naive_dense(c)
    ws = paged_decode_workspace(c.q, c.v_cache, 64).fill_(float("nan"))
    got = paged_decode_triton(*c.args(), **c.options(), splits=64, workspace=ws)
    assert rel_err(got, want) < 1e-5
    assert torch.equal(got[2], torch.zeros_like(got[2]))


def test_split_and_workspace_errors():
    from epmoe.engine.paged_decode import paged_decode_triton

    c = make_case(22, [10], 4, 2, 16, 16, 16)
    with pytest.raises(ValueError, match="splits must be a power of two"):
        paged_decode_triton(*c.args(), splits=3)
    with pytest.raises(ValueError, match="workspace must be a 1-D float32"):
        paged_decode_triton(*c.args(), splits=2, workspace=torch.empty(10))
