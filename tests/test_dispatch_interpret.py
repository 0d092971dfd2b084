"""The Triton dispatch layout kernels equal the PyTorch steps, under the Triton interpreter (CPU).

    PYTHONPATH=/path/to/cpu/triton:src TRITON_INTERPRET=1 pytest -q tests/test_dispatch_interpret.py

fp16 and float32 (the interpreter has no bf16); the same cases run in bf16 on the GPU in
``tests/test_dispatch_gpu.py``.
"""

import os

import pytest
import torch

from epmoe.dispatch_layout import combine_rows, pack_rows, route_layout, unpack_rows

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


@pytest.mark.parametrize("t,k,g,s,cap,d,dtype", [
    (1, 8, 2, 16, 1, 64, torch.float16),       # decode: one token, two ranks
    (37, 4, 3, 5, 9, 100, torch.float16),      # ragged D, overflow (capacity below the counts)
    (300, 6, 8, 4, 300, 40, torch.float32),    # two position blocks, no overflow
    (2000, 8, 2, 16, 1500, 16, torch.float16), # eight position blocks, overflow
    (0, 2, 2, 3, 2, 8, torch.float16),         # no tokens
])
@pytest.mark.parametrize("fixed", [True, False])
def test_triton_steps_equal_torch(t, k, g, s, cap, d, dtype, fixed):
    gen = torch.Generator().manual_seed(t + g)
    slots = torch.randint(0, g * s, (t, k), generator=gen)
    slots[:, 0] = torch.where(torch.rand(t, generator=gen) < 0.3, -1, slots[:, 0])
    if t > 2:  # out-of-range ids go nowhere and are counted: one above P, one below -1
        slots[1, -1], slots[2, 0] = g * s, -3
    elif t > 1:
        slots[1, -1] = g * s
    x = torch.randn(t, d, generator=gen).to(dtype)
    w = torch.rand(t, k, generator=gen)
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
    # bitwise (metadata bits read as fp16 can be NaN, which torch.equal calls unequal)
    assert torch.equal(_bits(bufs["torch"]), _bits(bufs["triton"]))
    parts = {impl: unpack_rows(bufs[impl], d, k, impl=impl) for impl in ("torch", "triton")}
    for a, b in zip(parts["torch"], parts["triton"]):
        assert torch.equal(a, b)
    back = torch.randn(n, d, generator=gen).to(dtype)
    want = combine_rows(back, ref.pos, starts, cap, impl="torch")
    assert torch.equal(combine_rows(back, ref.pos, starts, cap, impl="triton"), want)
