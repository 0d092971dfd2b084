"""The dispatch layout steps (``dispatch_layout``) against a loop over tokens, in both layouts, on CPU."""

import numpy as np
import pytest
import torch

from epmoe.dispatch.blocks import ExactBlocks, FixedBlocks
from epmoe.dispatch.layout import combine_rows, meta_columns, pack_rows, route_layout, unpack_rows


def _problem(seed, t, k, g, s, dtype=torch.float32, d=12):
    gen = torch.Generator().manual_seed(seed)
    slots = torch.randint(0, g * s, (t, k), generator=gen)
    slots[:, -1] = torch.where(torch.rand(t, generator=gen) < 0.4, -1, slots[:, -1])
    return torch.randn(t, d, generator=gen).to(dtype), slots, torch.rand(t, k, generator=gen)


def _expected_blocks(slots, g, s):
    """Per rank, the tokens that go there in order, and each token's (local slot, weight index) there."""
    blocks = [[] for _ in range(g)]
    for t, row in enumerate(slots.tolist()):
        for rank in sorted({v // s for v in row if v >= 0}):
            blocks[rank].append(t)
    return blocks


def test_route_layout_small_example():
    # 2 ranks of 3 slots: token 0 -> rank 0 and 1, token 1 -> rank 1, token 2 -> nowhere, token 3 -> rank 0
    slots = torch.tensor([[0, 4], [5, 3], [-1, -1], [2, 1]])
    lay = route_layout(slots, 3, 2, capacity=4)
    assert lay.pos.tolist() == [[0, 0], [-1, 1], [-1, -1], [1, -1]]
    assert lay.counts.tolist() == [2, 2]
    assert lay.starts.tolist() == [0, 2]
    assert lay.row_token[0, :2].tolist() == [0, 3] and lay.row_token[1, :2].tolist() == [0, 1]
    # capacity 1: positions past it stay in pos (overflow), the row table keeps the first token only
    lay1 = route_layout(slots, 3, 2, capacity=1)
    assert lay1.pos.tolist() == lay.pos.tolist() and lay1.counts.tolist() == [2, 2]
    assert lay1.row_token.tolist() == [[0], [0]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fixed", [True, False])
def test_pack_unpack_combine_match_a_loop(dtype, fixed):
    t, k, g, s, d = 9, 3, 3, 4, 12
    x, slots, w = _problem(1, t, k, g, s, dtype, d)
    cap = 5 if fixed else t
    lay = route_layout(slots, s, g, cap)
    blocks = _expected_blocks(slots, g, s)
    n = g * cap if fixed else sum(len(b) for b in blocks)
    layout = FixedBlocks(cap) if fixed else ExactBlocks(lay.starts, n)
    buf = pack_rows(x, slots, w, lay, s, layout)
    assert buf.shape == (n, d + meta_columns(dtype, k)) and buf.dtype == dtype
    rx, rs, rw, count, bad = unpack_rows(buf, d, k)
    row = 0
    for rank in range(g):
        first = rank * cap if fixed else row
        for p, tok in enumerate(blocks[rank][:cap]):
            r = first + p
            assert torch.equal(rx[r], x[tok])
            here = [(v // s == rank) and v >= 0 for v in slots[tok].tolist()]
            assert rs[r].tolist() == [v - rank * s if h else -1 for v, h in zip(slots[tok].tolist(), here)]
            assert rw[r].tolist() == [float(wv) if h else 0.0 for wv, h in zip(w[tok].tolist(), here)]
        if fixed:  # padding rows: zero hidden state, no slot
            for r in range(first + min(len(blocks[rank]), cap), first + cap):
                assert not rx[r].any() and rs[r].tolist() == [-1] * k and not rw[r].any()
        row += len(blocks[rank])
    assert count.tolist() == [max(len(b) for b in blocks)] * n and not bad.any()
    assert rs.dtype == torch.int64 and rw.dtype == torch.float32
    assert count.dtype == torch.int32 and bad.dtype == torch.bool

    # combine: results = received rows times (rank + 1); each token sums over the ranks that took it
    scale = torch.cat([torch.full((cap if fixed else len(blocks[r]), 1), r + 1.0) for r in range(g)])
    back = (rx.float() * scale).to(dtype)
    out = combine_rows(back, lay.pos, layout)
    for tok in range(t):
        ranks = [r for r in range(g) if tok in blocks[r][:cap]]
        want = sum(((x[tok].float() * (r + 1)).to(dtype).float() for r in ranks), torch.zeros(d))
        assert torch.equal(out[tok], want.to(dtype)), tok


def test_overflowed_tokens_are_not_sent_and_not_summed():
    slots = torch.tensor([[0], [1], [2], [3]])  # 4 tokens to rank 0 of 2 (4 slots each), capacity 3
    x = torch.arange(4.0).repeat_interleave(4).view(4, 4) + 1
    lay = route_layout(slots, 4, 2, 3)
    buf = pack_rows(x, slots, torch.ones(4, 1), lay, 4, FixedBlocks(3))
    rx, rs, _, count, _ = unpack_rows(buf, 4, 1)
    assert rx[:3, 0].tolist() == [1.0, 2.0, 3.0] and rs[:, 0].tolist() == [0, 1, 2, -1, -1, -1]
    assert count[0].item() == 4  # the count before the cut: the overflow signal
    out = combine_rows(rx, lay.pos, FixedBlocks(3))
    assert out[:, 0].tolist() == [1.0, 2.0, 3.0, 0.0]


def test_no_tokens_and_odd_hidden_size():
    x, slots, w = _problem(2, 0, 2, 2, 3, torch.bfloat16, d=7)
    lay = route_layout(slots, 3, 2, 2)
    buf = pack_rows(x, slots, w, lay, 3, FixedBlocks(2))
    rx, rs, rw, count, bad = unpack_rows(buf, 7, 2)
    assert buf.shape == (4, 7 + meta_columns(torch.bfloat16, 2)) and not rx.any()
    assert (rs == -1).all() and count.tolist() == [0] * 4 and not bad.any()
    assert combine_rows(rx, lay.pos, FixedBlocks(2)).shape == (0, 7)
    x, slots, w = _problem(3, 5, 2, 2, 3, torch.bfloat16, d=7)  # odd D: metadata not 4-byte aligned
    lay = route_layout(slots, 3, 2, 5)
    rx, rs, rw, _, _ = unpack_rows(pack_rows(x, slots, w, lay, 3, FixedBlocks(5)), 7, 2)
    blocks = _expected_blocks(slots, 2, 3)
    assert torch.equal(rx[: len(blocks[0])], x[blocks[0]])


def test_meta_columns_and_bad_impl():
    assert meta_columns(torch.bfloat16, 8) == 34 and meta_columns(torch.float32, 8) == 17
    with pytest.raises(TypeError, match="2- or 4-byte"):
        meta_columns(torch.float64, 8)
    with pytest.raises(ValueError, match="impl must be"):
        route_layout(torch.zeros(1, 1, dtype=torch.int64), 1, 1, 1, impl="cuda")
    for dtype in (torch.float32, torch.bool, torch.uint8):
        with pytest.raises(TypeError, match=f"topk_slots must be int32 or int64 slot ids, got {dtype}"):
            route_layout(torch.zeros(1, 2, dtype=dtype), 4, 2, 1)
    with pytest.raises(ValueError, match="num_ranks must be an integer >= 1, got 2.0"):
        route_layout(torch.zeros(1, 2, dtype=torch.int64), 4, 2.0, 1)
    # numpy integers are integers, as for the dispatchers
    lay = route_layout(torch.tensor([[0, 5]]), np.int64(4), np.int32(2), np.int64(1))
    assert lay.counts.tolist() == [1, 1] and lay.row_token.shape == (2, 1)


def test_inconsistent_layout_arguments_refused():
    x, slots, w = _problem(4, 6, 3, 2, 4)
    lay = route_layout(slots, 4, 2, 6)
    with pytest.raises(ValueError, match="fixed blocks of 4 rows, but the layout was routed with capacity 6"):
        pack_rows(x, slots, w, lay, 4, FixedBlocks(4))
    with pytest.raises(ValueError, match=r"row_starts must be \[G=2\], got shape \(1,\)"):
        pack_rows(x, slots, w, lay, 4, ExactBlocks(lay.starts[:1], int(lay.counts.sum())))
    with pytest.raises(ValueError, match=r"exact blocks need a layout that cannot overflow \(capacity >= T = 6\)"):
        pack_rows(x, slots, w, route_layout(slots, 4, 2, 5), 4, ExactBlocks(lay.starts, int(lay.counts.sum())))
    with pytest.raises(TypeError, match="blocks must be FixedBlocks or ExactBlocks, got NoneType"):
        pack_rows(x, slots, w, lay, 4, None)
    with pytest.raises(ValueError, match="FixedBlocks.capacity must be an integer >= 0, got -1"):
        FixedBlocks(-1)
    with pytest.raises(TypeError, match=r"ExactBlocks.row_starts must be a \[G\] int32/int64 tensor, got list"):
        ExactBlocks([0, 3], 6)
    buf = pack_rows(x, slots, w, lay, 4, FixedBlocks(6))
    with pytest.raises(ValueError, match=r"recv must be float rows \[R, D \+ meta columns\] = \[R, 12 \+ 5\] for K=2"):
        unpack_rows(buf, 12, 2)  # K one short: the row width says K=3
    with pytest.raises(ValueError, match="recv must be float rows"):
        unpack_rows(buf.to(torch.int32), 12, 3)
    with pytest.raises(ValueError, match="fixed blocks of 4 rows for 2 ranks are 8 rows, got 12"):
        combine_rows(buf[:, :12], lay.pos, FixedBlocks(4))  # a capacity other than the layout's
    with pytest.raises(ValueError, match=r"row_starts must be \[G=2\]"):
        combine_rows(buf[:, :12], lay.pos, ExactBlocks(lay.starts[:1], 12))
    with pytest.raises(ValueError, match="exact blocks of 11 rows, got 12"):
        combine_rows(buf[:, :12], lay.pos, ExactBlocks(lay.starts, 11))


@pytest.mark.parametrize("t", [0, 1, 2])
def test_odd_hidden_size_in_half_precision_with_few_rows(t):
    x, slots, w = _problem(5, t, 2, 1, 4, torch.bfloat16, d=3)
    lay = route_layout(slots, 4, 1, max(t, 1))
    buf = pack_rows(x, slots, w, lay, 4, FixedBlocks(max(t, 1)))
    rx, rs, rw, _, _ = unpack_rows(buf, 3, 2)
    assert torch.equal(rx[:t], x) and torch.equal(rs[:t], slots)


def test_out_of_range_ids_are_counted_and_flagged_in_every_row():
    x, slots, w = _problem(6, 5, 2, 2, 4)
    slots[3, 1] = 8  # = G * S: outside
    lay = route_layout(slots, 4, 2, 5)
    assert lay.invalid.item() == 1
    _, _, _, count, bad = unpack_rows(pack_rows(x, slots, w, lay, 4, FixedBlocks(5)), 12, 2)
    own = int(lay.counts.max())
    assert count.tolist() == [own] * 10 and bad.all()  # flagged in every row, padding rows too
