"""The Triton dispatch layout kernels on the GPU, bf16: equal to the PyTorch steps, bit for bit.

Single process (the layout steps are local to a rank); the multi-GPU dispatch itself is checked by
``benchmarks/multigpu.py`` against the one-rank layer.
"""

import pytest
import torch

from .dispatch_cases import assert_triton_steps_equal_torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("t,k,g,s,cap,d", [
    (1, 8, 2, 128, 1, 7168),      # DeepSeek-V3 decode over 2 ranks
    (4096, 8, 2, 128, 4096, 7168),
    (513, 8, 8, 32, 100, 7168),   # overflow: capacity below the counts
    (77, 6, 16, 4, 77, 2050),     # many ranks, ragged D
    (0, 8, 4, 8, 4, 256),
])
@pytest.mark.parametrize("fixed", [True, False])
def test_triton_steps_equal_torch_bf16(t, k, g, s, cap, d, fixed):
    assert_triton_steps_equal_torch(t, k, g, s, cap, d, torch.bfloat16, fixed, "cuda")


def test_triton_experts_read_rows_of_a_wider_buffer():
    from epmoe.experts import Activation, ExpertWeights
    from epmoe.experts.triton.grouped import triton_experts

    gen = torch.Generator(device="cuda").manual_seed(5)
    s, d, f, k = 8, 512, 256, 4
    w = ExpertWeights((torch.randn(s, 2 * f, d, generator=gen, device="cuda") / d**0.5).bfloat16(),
                      (torch.randn(s, d, f, generator=gen, device="cuda") / f**0.5).bfloat16())
    for t in (2, 300):  # decode path and grouped path
        buf = torch.randn(t, d + 34, generator=gen, device="cuda").bfloat16()
        slots = torch.randint(-1, s, (t, k), generator=gen, device="cuda")
        tw = torch.rand(t, k, generator=gen, device="cuda")
        view = buf[:, :d]
        assert view.stride(0) == d + 34
        out = triton_experts(view, slots, tw, w, Activation())
        assert out.is_contiguous() and torch.equal(out, triton_experts(view.contiguous(), slots, tw, w, Activation()))
