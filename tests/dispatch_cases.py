"""One check shared by the interpreter and GPU tests of the Triton dispatch layout kernels."""

from __future__ import annotations

import torch

from epmoe.dispatch.layout import combine_rows, pack_rows, route_layout, unpack_rows


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits: metadata floats read as fp16/bf16 can be NaN, which ``torch.equal`` calls unequal."""
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def assert_triton_steps_equal_torch(t: int, k: int, g: int, s: int, cap: int, d: int, dtype: torch.dtype,
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
    starts = None if fixed else ref.starts
    n = g * cap if fixed else int(ref.counts.sum())
    bufs = {impl: pack_rows(x, slots, w, lays[impl], s, starts, n, impl=impl) for impl in ("torch", "triton")}
    assert torch.equal(_bits(bufs["torch"]), _bits(bufs["triton"]))
    parts = {impl: unpack_rows(bufs[impl], d, k, impl=impl) for impl in ("torch", "triton")}
    for a, b in zip(parts["torch"], parts["triton"]):
        assert torch.equal(_bits(a), _bits(b)) if a.dtype != torch.int64 else torch.equal(a, b)
    back = torch.randn(n, d, generator=gen, device=device).to(dtype)
    want = combine_rows(back, ref.pos, starts, cap, impl="torch")
    assert torch.equal(combine_rows(back, ref.pos, starts, cap, impl="triton"), want)
    wide = torch.cat([back, back[:, :8]], dim=1)[:, :d]  # a strided view of a wider buffer works too
    assert torch.equal(combine_rows(wide, ref.pos, starts, cap, impl="triton"), want)
