"""The paged MLA decode Triton kernel under the Triton interpreter (CPU; runs only with ``TRITON_INTERPRET=1``).

    PYTHONPATH=src:/tmp/np23 TRITON_INTERPRET=1 python -m pytest -q tests/engine/test_mla_decode_interpret.py

``mla_decode_triton`` against ``mla_decode_reference`` (and the naive float64 computation), float32 and fp16
(the interpreter has no bf16), single pass and split-K, head counts that do and do not fill the kernel's head
block, latent and rope sizes below the 16-wide ``tl.dot`` minimum, padding rows, and with ``out`` and a
workspace given. See ``test_paged_decode_interpret`` for the NumPy pin.
"""

import numpy as np
import pytest
import torch

from epmoe.engine.mla_decode import mla_decode_reference
from epmoe.engine.paged_decode import paged_decode_workspace_numel

from .test_mla import _case, _naive

pytestmark = pytest.mark.interpret

# name: (context lengths, H, kv_lora_rank, qk_rope_head_dim, block size)
CASES = {
    "tiny": ([9, 0, 1, 40], 4, 16, 8, 4),
    "heads-over-block": ([70, 3], 20, 32, 16, 16),
    "odd-block": ([33, 17, 0], 16, 24, 8, 5),
}


@pytest.fixture(autouse=True)
def _interpreter_numpy():
    if tuple(int(x) for x in np.__version__.split(".")[:2]) >= (2, 4):
        pytest.fail(f"the Triton interpreter's dynamic loop bounds fail with NumPy {np.__version__}; run with "
                    "numpy<2.4 first on PYTHONPATH (see test_paged_decode_interpret's docstring)")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("name", list(CASES))
def test_kernel_matches_reference(name, dtype, splits):
    from epmoe.engine.mla_decode import mla_decode_triton

    ctx, h, dv, dr, bs = CASES[name]
    q, cache, tables, ctx_t = _case(len(name), ctx, h, dv, dr, bs, dtype=dtype)
    scale = (dv + dr) ** -0.5
    got = mla_decode_triton(q, cache, tables, ctx_t, scale, dv, splits=splits)
    assert got.shape == (len(ctx), h, dv) and got.dtype == dtype
    if dtype == torch.float32:
        assert _rel(got, _naive(q, cache, tables, ctx_t, scale, dv)) < 1e-5
    else:
        assert _rel(got, mla_decode_reference(q, cache, tables, ctx_t, scale, dv)) < 5e-3
    for j, n in enumerate(ctx):
        if n == 0:
            assert torch.equal(got[j], torch.zeros_like(got[j]))


@pytest.mark.parametrize("splits", [1, 4])
def test_kernel_writes_out_and_uses_workspace(splits):
    from epmoe.engine.mla_decode import mla_decode_triton

    q, cache, tables, ctx = _case(7, [80, 0, 33, 1], 18, 32, 16, 16)
    want = _naive(q, cache, tables, ctx, 0.2, 32)
    out = torch.full((4, 18, 32), float("nan"))
    ws = torch.full((paged_decode_workspace_numel(4, 18, 32, splits),), float("nan"))
    got = mla_decode_triton(q, cache, tables, ctx, 0.2, 32, out=out, splits=splits, workspace=ws)
    assert got is out and _rel(out, want) < 1e-5
    with pytest.raises(ValueError, match="workspace must be a 1-D float32 tensor"):
        mla_decode_triton(q, cache, tables, ctx, 0.2, 32, out=out, splits=2, workspace=ws[:10])
    with pytest.raises(ValueError, match="splits must be a power of two"):
        mla_decode_triton(q, cache, tables, ctx, 0.2, 32, splits=3)


@pytest.mark.parametrize("heads", [64, 72])
def test_wide_programs_match_reference(heads):
    """Batches of 16-bit rows whose 64-head programs outnumber the SMs take the wide tile (``mla_decode_tiles``; CPU
    tensors count 132 SMs): 133 rows of 64 heads (one wide program a row) and of 72 (a second, partly filled head
    block); float32 rows keep the 16-head tile."""
    from epmoe.engine.mla_decode import mla_decode_tiles, mla_decode_triton

    ctx = [(7 * i) % 41 for i in range(133)]   # 0 (padding rows) to 40 positions
    assert mla_decode_tiles(len(ctx), heads, "cpu", torch.float16) == (64, 8)
    assert mla_decode_tiles(len(ctx), heads, "cpu", torch.float32) == (16, 4)
    q, cache, tables, ctx_t = _case(11, ctx, heads, 16, 16, 8, dtype=torch.float16)
    got = mla_decode_triton(q, cache, tables, ctx_t, 0.25, 16)
    assert got.shape == (133, heads, 16) and got.dtype == torch.float16
    assert _rel(got, mla_decode_reference(q, cache, tables, ctx_t, 0.25, 16)) < 5e-3
    for j, n in enumerate(ctx):
        if n == 0:
            assert torch.equal(got[j], torch.zeros_like(got[j]))


def test_wide_tile_by_the_longest_context_with_splits():
    """The 64-head tile chosen by the longest-context hint (``max_context``: two rows of 128 heads, four 64-head groups,
    take it from 8192 positions; the hint only picks the tile, so it is given here above the rows' real 200), with
    split-K over block tables of 256 positions; it agrees with the reference, padding row included."""
    from epmoe.engine.mla_decode import mla_decode_splits, mla_decode_tiles, mla_decode_triton, wide_tile_min_context

    ctx = [200, 0]
    heads = 128
    least = wide_tile_min_context(len(ctx), heads, "cpu", torch.float16)
    assert least == 8192
    assert mla_decode_tiles(len(ctx), heads, "cpu", torch.float16, max_context=least) == (64, 8)
    q, cache, tables, ctx_t = _case(13, ctx, heads, 16, 16, 8, dtype=torch.float16)
    tables = torch.cat([tables, tables[:, :1].expand(2, 7)], dim=1).contiguous()   # 256 positions a row
    assert mla_decode_splits(len(ctx), heads, 256, "cpu", max_context=least) == 4    # 256 // 64 keys a split
    got = mla_decode_triton(q, cache, tables, ctx_t, 0.25, 16, max_context=least)
    assert _rel(got, mla_decode_reference(q, cache, tables, ctx_t, 0.25, 16)) < 5e-3
    assert torch.equal(got[1], torch.zeros_like(got[1]))
