"""``mla_rope_write``'s Triton kernel on CUDA against its PyTorch reference on the same GPU (bf16 and float32, the
shared cases and Kimi-K2.5's shape at several tokens), and inside a CUDA graph replayed with new inputs.

    PYTHONPATH=src python -m pytest -q tests/engine/test_mla_rope_gpu.py
"""

import pytest
import torch

from epmoe.engine.mla_rope import mla_rope_write, mla_rope_write_reference

from .mla_rope_cases import CASES, make_mla_rope_case

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("case", CASES + [(7, 64, 128, 64, 512, True), (2, 128, 128, 64, 512, False),
                                          (256, 64, 128, 64, 512, True), (33, 128, 128, 64, 512, False)])
def test_kernel_matches_reference(case, dtype):
    """The last two cases take 16 heads a program (``rope_heads_per_program``), the others one."""
    t, h, dn, dr, rank, interleave = case
    args = [x.cuda() for x in make_mla_rope_case(t, h, dn, dr, rank, dtype, slots=max(40, 2 * t))]
    q, compressed, cos, sin, weight, pool, slots = args
    want_q, want_pool = q.clone(), pool.clone()
    mla_rope_write_reference(want_q, compressed, cos, sin, weight, 1e-6, want_pool, slots, dn, interleave)
    mla_rope_write(q, compressed, cos, sin, weight, 1e-6, pool, slots, dn, interleave)
    tol = 1e-6 if dtype == torch.float32 else 8e-3
    torch.testing.assert_close(q, want_q, rtol=tol, atol=tol)
    torch.testing.assert_close(pool, want_pool, rtol=tol, atol=tol)


def test_graph_replay():
    t, h, dn, dr, rank = 2, 64, 128, 64, 512
    q, compressed, cos, sin, weight, pool, slots = (x.cuda() for x in
                                                    make_mla_rope_case(t, h, dn, dr, rank, torch.bfloat16))
    src = q.clone()
    mla_rope_write(q, compressed, cos, sin, weight, 1e-6, pool, slots, dn, True)  # compile outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        mla_rope_write(q, compressed, cos, sin, weight, 1e-6, pool, slots, dn, True)
    new = make_mla_rope_case(t, h, dn, dr, rank, torch.bfloat16, seed=5)
    for dst, val in zip((src, compressed, cos, sin, slots), (new[0], new[1], new[2], new[3], new[6])):
        dst.copy_(val)
    q.copy_(src)
    pool.zero_()
    g.replay()
    want_q, want_pool = src.clone(), torch.zeros_like(pool)
    mla_rope_write_reference(want_q, compressed, cos, sin, weight, 1e-6, want_pool, slots, dn, True)
    torch.testing.assert_close(q, want_q, rtol=8e-3, atol=8e-3)
    torch.testing.assert_close(pool, want_pool, rtol=8e-3, atol=8e-3)
