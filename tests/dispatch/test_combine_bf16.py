"""The combine of bf16 results: each token's partial results from three or more ranks are summed in float32 and
rounded to bf16 once (bit-exact), in ``combine_rows`` and through the multi-rank dispatchers over gloo."""

from __future__ import annotations

import pytest
import torch

from epmoe.comm import Comm
from epmoe.dispatch import make_dispatcher
from epmoe.dispatch.blocks import ExactBlocks, FixedBlocks
from epmoe.dispatch.layout import combine_rows, route_layout
from epmoe.runtime.launch import RankInfo, init_group, spawn


def _spread_slots(t: int, g: int, s: int, k: int, seed: int) -> torch.Tensor:
    """``[T, K]`` slots of ``K`` distinct ranks per token (in random order), a random slot on each."""
    gen = torch.Generator().manual_seed(seed)
    ranks = torch.stack([torch.randperm(g, generator=gen)[:k] for _ in range(t)])
    return ranks * s + torch.randint(0, s, (t, k), generator=gen)


def _partials(num: int, t: int, d: int, seed: int) -> torch.Tensor:
    """``[num, T, D]`` bf16 values spread over four orders of magnitude, both signs."""
    gen = torch.Generator().manual_seed(seed)
    mag = 10.0 ** (torch.rand(num, t, d, generator=gen) * 4 - 2)
    return (torch.randn(num, t, d, generator=gen) * mag).to(torch.bfloat16)


@pytest.mark.parametrize("impl", ["torch", pytest.param("triton", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("fixed", [True, False])
@pytest.mark.parametrize("k", [3, 4])
def test_combine_rows_sums_ranks_in_float32_once_rounded(fixed, k, impl):
    """Tokens on 3 or 4 of 4 ranks; ``triton``: the GPU kernel on the same values."""
    device = "cuda" if impl == "triton" else "cpu"
    t, g, s, d = 24, 4, 2, 64
    cap = t  # every token fits: nothing overflows
    lay = route_layout(_spread_slots(t, g, s, k, seed=k).to(device), s, g, cap)
    pos, starts = lay.pos.cpu(), lay.starts.cpu()
    n = g * cap if fixed else int(lay.counts.sum())
    back = _partials(1, n, d, seed=10 + k)[0]
    first = [r * cap for r in range(g)] if fixed else starts.tolist()
    rows = [[back[first[r] + int(pos[tok, r])] for r in range(g) if pos[tok, r] >= 0] for tok in range(t)]
    assert all(len(r) == k for r in rows)
    want = torch.stack([sum((x.float() for x in r), torch.zeros(d)).to(torch.bfloat16) for r in rows])
    bf16_sum = torch.stack([sum(r[1:], r[0]) for r in rows])  # rounded after every addition
    assert not torch.equal(want, bf16_sum)  # the values tell the two sums apart
    blocks = FixedBlocks(cap) if fixed else ExactBlocks(lay.starts, n)
    out = combine_rows(back.to(device), lay.pos, blocks, impl=impl)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out.cpu(), want)


def _worker(info: RankInfo, t: int, d: int) -> dict:
    """Each rank's ``expert`` is ``y = a_r * x + b_r`` elementwise (bf16 out), with its own ``a_r, b_r [D]``; every
    token goes to every rank."""
    comm = Comm(init_group(info, "cpu"))
    g, s, rank = comm.size, 2, comm.rank
    gen = torch.Generator().manual_seed(5)
    a, b = torch.randn(g, d, generator=gen) * 3, torch.randn(g, d, generator=gen) * 0.05
    x = _partials(1, t, d, seed=20 + rank)[0]
    slots = _spread_slots(t, g, s, g, seed=30 + rank)
    parts = [(x.float() * a[r] + b[r]).to(torch.bfloat16) for r in range(g)]
    out = {"want": sum((p.float() for p in parts), torch.zeros(t, d)).to(torch.bfloat16),
           "bf16_sum": sum(parts[1:], parts[0])}
    for name, options in (("all_to_all", {}), ("fixed_capacity", {"capacity": t})):
        disp = make_dispatcher(name, comm, s, **options)
        h = disp.dispatch(x, slots, torch.rand(t, g, generator=gen))
        out[name] = disp.combine((h.recv_x.float() * a[rank] + b[rank]).to(torch.bfloat16), h)
    torch.distributed.destroy_process_group()
    return out


@pytest.mark.multiprocess
def test_three_rank_bf16_combine_is_the_float32_sum_rounded_once():
    for r in spawn(_worker, 3, (16, 48)):
        assert not torch.equal(r["want"], r["bf16_sum"])
        for name in ("all_to_all", "fixed_capacity"):
            assert r[name].dtype == torch.bfloat16
            assert torch.equal(r[name], r["want"]), name
