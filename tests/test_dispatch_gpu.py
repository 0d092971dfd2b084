"""The Triton dispatch layout kernels on the GPU, bf16: equal to the PyTorch steps, bit for bit.

Single process (the layout steps are local to a rank); the multi-GPU dispatch itself is checked by
``benchmarks/multigpu.py`` against the one-rank layer.
"""

import pytest
import torch

from epmoe.dispatch_layout import combine_rows, pack_rows, route_layout, unpack_rows

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


@pytest.mark.parametrize("t,k,g,s,cap,d", [
    (1, 8, 2, 128, 1, 7168),      # DeepSeek-V3 decode over 2 ranks
    (4096, 8, 2, 128, 4096, 7168),
    (513, 8, 8, 32, 100, 7168),   # overflow: capacity below the counts
    (77, 6, 16, 4, 77, 2050),     # many ranks, ragged D
    (0, 8, 4, 8, 4, 256),
])
@pytest.mark.parametrize("fixed", [True, False])
def test_triton_steps_equal_torch_bf16(t, k, g, s, cap, d, fixed):
    gen = torch.Generator(device="cuda").manual_seed(t + g)
    slots = torch.randint(0, g * s, (t, k), generator=gen, device="cuda")
    slots[:, 0] = torch.where(torch.rand(t, generator=gen, device="cuda") < 0.3, -1, slots[:, 0])
    if t > 2:  # out-of-range ids go nowhere and are counted: one above P, one below -1
        slots[1, -1], slots[2, 0] = g * s, -3
    elif t > 1:
        slots[1, -1] = g * s
    x = torch.randn(t, d, generator=gen, device="cuda").to(torch.bfloat16)
    w = torch.rand(t, k, generator=gen, device="cuda")
    if not fixed:
        cap = t
    lays = {impl: route_layout(slots, s, g, cap, impl=impl) for impl in ("torch", "triton")}
    ref, tri = lays["torch"], lays["triton"]
    assert torch.equal(ref.pos, tri.pos) and torch.equal(ref.counts, tri.counts) and torch.equal(ref.starts, tri.starts)
    assert ref.invalid.item() == tri.invalid.item() == int((t > 1) + (t > 2))
    for rank in range(g):
        valid = min(int(ref.counts[rank]), cap)
        assert torch.equal(ref.row_token[rank, :valid], tri.row_token[rank, :valid])
    starts = None if fixed else ref.starts
    n = g * cap if fixed else int(ref.counts.sum())
    bufs = {impl: pack_rows(x, slots, w, lays[impl], s, starts, n, impl=impl) for impl in ("torch", "triton")}
    assert torch.equal(_bits(bufs["torch"]), _bits(bufs["triton"]))
    parts = {impl: unpack_rows(bufs[impl], d, k, impl=impl) for impl in ("torch", "triton")}
    for a, b in zip(parts["torch"], parts["triton"]):
        assert torch.equal(_bits(a), _bits(b)) if a.dtype == torch.bfloat16 else torch.equal(a, b)
    back = torch.randn(n, d, generator=gen, device="cuda").to(torch.bfloat16)
    want = combine_rows(back, ref.pos, starts, cap, impl="torch")
    assert torch.equal(combine_rows(back, ref.pos, starts, cap, impl="triton"), want)
    # the strided view of the receive buffer works as combine input too
    wide = torch.cat([back, back[:, :8]], dim=1)[:, :d]
    assert torch.equal(combine_rows(wide, ref.pos, starts, cap, impl="triton"), want)


def test_triton_experts_read_rows_of_a_wider_buffer():
    from epmoe.experts import Activation, ExpertWeights
    from epmoe.kernels.triton_moe import triton_experts

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
