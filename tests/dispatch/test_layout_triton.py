"""The Triton dispatch layout kernels (``dispatch.layout_triton``) equal the PyTorch steps, bit for bit.

``interpret``: under the Triton interpreter on CPU (``TRITON_INTERPRET=1``), fp16 and float32 (the
interpreter has no bf16). ``gpu``: the same cases in bf16 on the GPU. Single process (the layout steps are
local to a rank); the multi-GPU dispatch itself is checked by ``benchmarks/multigpu.py`` against the
one-rank layer.
"""

from __future__ import annotations

import pytest
import torch

from epmoe.dispatch.blocks import ExactBlocks, FixedBlocks
from epmoe.dispatch.layout import combine_rows, pack_rows, route_layout, unpack_rows


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits: metadata floats read as fp16/bf16 can be NaN, which ``torch.equal`` calls unequal."""
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def _assert_triton_steps_equal_torch(t: int, k: int, g: int, s: int, cap: int, d: int, dtype: torch.dtype,
                                    fixed: bool, device: str) -> None:
    """Every layout step, Triton against PyTorch, bit for bit (``cap`` is replaced by ``t`` when not fixed).

    The slots include skipped choices and, from 2, 3 and 4 tokens on, ids above ``P`` and below ``-1`` (the
    last token's in the last position block, so that the count of such tokens sums over blocks).
    """
    gen = torch.Generator(device=device).manual_seed(t + g)
    slots = torch.randint(0, g * s, (t, k), generator=gen, device=device)
    slots[:, 0] = torch.where(torch.rand(t, generator=gen, device=device) < 0.3, -1, slots[:, 0])
    if t > 1:  # out-of-range ids go nowhere and are counted
        slots[1, -1] = g * s
    if t > 2:
        slots[2, 0] = -3
    if t > 3:
        slots[t - 1, 1] = g * s + 5
    x = torch.randn(t, d, generator=gen, device=device).to(dtype)
    w = torch.rand(t, k, generator=gen, device=device)
    if not fixed:
        cap = t
    lays = {impl: route_layout(slots, s, g, cap, impl=impl) for impl in ("torch", "triton")}
    ref, tri = lays["torch"], lays["triton"]
    assert torch.equal(ref.pos, tri.pos) and torch.equal(ref.counts, tri.counts) and torch.equal(ref.starts, tri.starts)
    assert ref.invalid.item() == tri.invalid.item() == int(t > 1) + int(t > 2) + int(t > 3)
    for rank in range(g):
        valid = min(int(ref.counts[rank]), cap)
        assert torch.equal(ref.row_token[rank, :valid], tri.row_token[rank, :valid])
    n = g * cap if fixed else int(ref.counts.sum())
    blocks = {impl: FixedBlocks(cap) if fixed else ExactBlocks(lays[impl].starts, n) for impl in ("torch", "triton")}
    bufs = {impl: pack_rows(x, slots, w, lays[impl], s, blocks[impl], impl=impl) for impl in ("torch", "triton")}
    assert torch.equal(_bits(bufs["torch"]), _bits(bufs["triton"]))
    parts = {impl: unpack_rows(bufs[impl], d, k, impl=impl) for impl in ("torch", "triton")}
    for a, b in zip(parts["torch"], parts["triton"]):
        assert torch.equal(_bits(a), _bits(b)) if a.is_floating_point() else torch.equal(a, b)
    back = torch.randn(n, d, generator=gen, device=device).to(dtype)
    want = combine_rows(back, ref.pos, blocks["torch"], impl="torch")
    assert torch.equal(combine_rows(back, ref.pos, blocks["torch"], impl="triton"), want)
    wide = torch.cat([back, back[:, :8]], dim=1)[:, :d]  # a strided view of a wider buffer works too
    assert torch.equal(combine_rows(wide, ref.pos, blocks["torch"], impl="triton"), want)


@pytest.mark.interpret
@pytest.mark.parametrize("t,k,g,s,cap,d,dtype", [
    (1, 8, 2, 16, 1, 64, torch.float16),       # decode: one token, two ranks
    (37, 4, 3, 5, 9, 100, torch.float16),      # ragged D, overflow (capacity below the counts)
    (300, 6, 8, 4, 300, 40, torch.float32),    # two position blocks, no overflow
    (2000, 8, 2, 16, 1500, 16, torch.float16), # eight position blocks, overflow
    (0, 2, 2, 3, 2, 8, torch.float16),         # no tokens
])
@pytest.mark.parametrize("fixed", [True, False])
def test_triton_steps_equal_torch(t, k, g, s, cap, d, dtype, fixed):
    _assert_triton_steps_equal_torch(t, k, g, s, cap, d, dtype, fixed, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("t,k,g,s,cap,d", [
    (1, 8, 2, 128, 1, 7168),      # DeepSeek-V3 decode over 2 ranks
    (4096, 8, 2, 128, 4096, 7168),
    (513, 8, 8, 32, 100, 7168),   # overflow: capacity below the counts
    (77, 6, 16, 4, 77, 2050),     # many ranks, ragged D
    (0, 8, 4, 8, 4, 256),
])
@pytest.mark.parametrize("fixed", [True, False])
def test_triton_steps_equal_torch_bf16(t, k, g, s, cap, d, fixed):
    _assert_triton_steps_equal_torch(t, k, g, s, cap, d, torch.bfloat16, fixed, "cuda")


@pytest.mark.gpu
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
