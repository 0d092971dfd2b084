"""CPU checks of the fast expert path: backend fallback, alignment, FP8 block format, grouped_mm."""

import pytest
import torch

from epmoe.experts import EXPERT_BACKENDS, Activation, ExpertWeights, get_expert_backend, reference_experts
from epmoe.experts.fp8 import BlockFP8ExpertWeights, block_fp8_expert_weights, quantize_block_fp8
from epmoe.experts.triton.align import align_reference, num_aligned_blocks
from epmoe.experts.weights import check_expert_call


def _problem(seed, s=6, d=256, f=128, t=11, k=3, bias=False):
    g = torch.Generator().manual_seed(seed)
    w = ExpertWeights(
        torch.randn(s, 2 * f, d, generator=g) / 16,
        torch.randn(s, d, f, generator=g) / 12,
        torch.randn(s, 2 * f, generator=g) if bias else None,
        torch.randn(s, d, generator=g) if bias else None,
    )
    x = torch.randn(t, d, generator=g)
    slots = torch.randint(-1, s, (t, k), generator=g)
    tw = torch.rand(t, k, generator=g)
    return w, x, slots, tw


def test_registry_names_fast_backends():
    assert {"reference", "triton", "grouped_mm"} <= set(EXPERT_BACKENDS)
    with pytest.raises(KeyError, match="supported"):
        get_expert_backend("cutlass")


@pytest.mark.parametrize("name", ["triton", "grouped_mm"])
@pytest.mark.parametrize("act", [Activation(), Activation("gelu"), Activation("silu", 7.0)])
@pytest.mark.parametrize("woi", [False, True])
def test_backend_on_cpu_equals_reference(name, act, woi):
    w, x, slots, tw = _problem(3, bias=act.swiglu_limit is not None)
    ref = reference_experts(x, slots, tw, w, act, woi)
    out = get_expert_backend(name)(x, slots, tw, w, act, woi)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["reference", "triton", "grouped_mm"])
def test_expected_pairs_leave_the_result_unchanged(name):
    # the pairs an expert-parallel layer expects only choose kernels and tiles (fewer or more than T * K here)
    w, x, slots, tw = _problem(6)
    want = reference_experts(x, slots, tw, w, Activation())
    for expected in (1, slots.numel(), 10**6):
        out = get_expert_backend(name)(x, slots, tw, w, Activation(), expected_pairs=expected)
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["reference", "triton", "grouped_mm"])
def test_backends_skip_slot_ids_outside_the_slots(name):
    """An id outside ``[0, S)`` (a one-rank dispatcher passes them on; it reports them at combine) is
    skipped like ``-1``, never read outside the weights."""
    w, x, slots, tw = _problem(5)
    bad = slots.clone()
    bad[0, 0], bad[3, 1], bad[7, 2], bad[9, 0] = 6, 100, -5, 2**40  # 2**40: no buffer sized by the id
    want = reference_experts(x, torch.where((bad >= 0) & (bad < 6), bad, -1), tw, w, Activation())
    torch.testing.assert_close(get_expert_backend(name)(x, bad, tw, w, Activation()), want, rtol=1e-5, atol=1e-5)


def test_expert_call_operands_are_checked_by_name():
    w, x, slots, tw = _problem(2)
    check_expert_call(x, slots, tw, w.hidden_size)
    check_expert_call(x[:, :256], slots.t().contiguous().t(), tw.double(), w.hidden_size, as_read=False)
    bad = [
        ((x[:, :128], slots, tw), "x must be \\[T, D\\] with D = 256"),
        ((x, slots[:3], tw), "topk_slots must be \\[T, K\\] with T = 11"),
        ((x, slots.float(), tw), "topk_slots must hold integer slot ids, got dtype torch.float32"),
        ((x, slots, tw[:, :2]), "topk_weights must have topk_slots' shape \\(11, 3\\), got \\(11, 2\\)"),
        ((torch.randn(256, 11).t(), slots, tw), "x must be contiguous along D"),
        ((x, slots.t().contiguous().t(), tw), "topk_slots must be contiguous"),
        ((x, slots, tw.t().contiguous().t()), "topk_weights must be contiguous"),
        ((x, slots, (tw * 4).int()), "topk_weights must be floating point, got torch.int32"),
    ]
    for args, msg in bad:
        with pytest.raises(ValueError, match=msg):
            check_expert_call(*args, w.hidden_size)


@pytest.mark.parametrize("block_m,half,tail", [(1, False, None), (4, False, None), (16, False, None), (4, True, None),
                                               (16, True, None), (16, False, 4), (16, True, 8)])
def test_alignment_groups_pairs_by_slot(block_m, half, tail):
    _, _, slots, _ = _problem(4, s=7, t=50, k=4)
    n, s = slots.numel(), 7
    a = align_reference(slots, s, block_m, half, tail)
    tail = tail or (block_m // 2 if half else block_m)
    nb = num_aligned_blocks(n, s, block_m)
    assert a.sorted_pair_ids.shape == (nb * block_m,) and a.block_slot.shape == (nb,)
    flat = slots.reshape(-1)
    counts = torch.bincount(flat[flat >= 0], minlength=s)
    seen, end = [], 0
    for b in range(nb):
        if a.block_slot[b] < 0:
            assert int(a.block_rows[b]) == 0
            continue
        start, rows = int(a.block_start[b]), int(a.block_rows[b])
        assert start == end  # blocks tile the sorted positions without gaps or overlaps
        end = start + rows
        ids = a.sorted_pair_ids[start:end]
        real = ids[ids < n]
        assert real.numel() > 0 and bool((flat[real.long()] == a.block_slot[b]).all())
        seen += real.tolist()
        last = b + 1 == nb or int(a.block_slot[b + 1]) != int(a.block_slot[b])
        left = int(counts[a.block_slot[b]]) % block_m or block_m
        # a shorter block only as a slot's last block: its rows rounded up to a multiple of the tail rows
        assert rows == (-(-left // tail) * tail if last else block_m)
    assert sorted(seen) == (flat >= 0).nonzero().flatten().tolist()
    used = a.block_slot[a.block_slot >= 0]
    assert bool((used[1:] >= used[:-1]).all())
    assert bool((a.sorted_pair_ids[end:] == n).all())


def test_alignment_half_tail_pads_less():
    slots = torch.tensor([[0], [0], [0], [0], [0], [1], [2], [2], [2], [2], [2], [2], [2]])
    full, half = align_reference(slots, 3, 4), align_reference(slots, 3, 4, half_tail=True)
    # slot 0: 5 rows -> 4 + 4 (full) or 4 + 2 (half); slot 1: 1 row -> 4 or 2; slot 2: 7 rows -> 4 + 4 either way
    assert full.block_rows[:5].tolist() == [4, 4, 4, 4, 4] and half.block_rows[:5].tolist() == [4, 2, 2, 4, 4]
    assert half.block_start[:5].tolist() == [0, 4, 6, 8, 12] and half.block_slot[:5].tolist() == [0, 0, 1, 2, 2]
    with pytest.raises(ValueError, match="block_m"):
        align_reference(slots, 3, 5, half_tail=True)
    # quarter tails: slot 0 (5 rows) 4 + 1, slot 1 (1 row) 1, slot 2 (7 rows) 4 + 3
    quarter = align_reference(slots, 3, 4, tail_rows=1)
    assert quarter.block_rows[:5].tolist() == [4, 1, 1, 4, 3] and quarter.block_start[:5].tolist() == [0, 4, 5, 6, 10]
    with pytest.raises(ValueError, match=r"tail_rows must be a positive divisor of block_m \(4\), got 3"):
        align_reference(slots, 3, 4, tail_rows=3)


def test_alignment_all_skipped():
    slots = torch.full((5, 2), -1)
    a = align_reference(slots, 4, 8)
    assert bool((a.block_slot == -1).all()) and bool((a.sorted_pair_ids == 10).all())


def test_alignment_skips_every_id_outside_the_slots():
    # -1, -5, S and above all skip, as the Triton alignment does (they indexed past the counts before)
    slots = torch.tensor([[0, 4, 1], [-5, 2, 7], [3, 2, -1]])
    a, b = align_reference(slots, 3, 2), align_reference(torch.where(slots.ge(0) & slots.lt(3), slots, -1), 3, 2)
    assert torch.equal(a.block_slot, b.block_slot) and torch.equal(a.sorted_pair_ids, b.sorted_pair_ids)
    assert a.block_slot.tolist()[:4] == [0, 1, 2, -1] and a.block_rows.tolist()[:3] == [2, 2, 2]


def test_fp8_roundtrip_and_fallback():
    w, x, slots, tw = _problem(5)
    q = block_fp8_expert_weights(w)
    assert q.w13.dtype == torch.float8_e4m3fn and q.w13_scale.shape == (6, 2, 2) and q.w2_scale.shape == (6, 2, 1)
    deq = q.dequantize(torch.float32)
    assert ((deq.w13 - w.w13).norm() / w.w13.norm()).item() < 0.05
    ref = reference_experts(x, slots, tw, deq, Activation())
    out = get_expert_backend("triton")(x, slots, tw, q, Activation())
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_fp8_quantize_handles_ragged_blocks():
    w = torch.randn(2, 200, 130)
    q, scale = quantize_block_fp8(w)
    assert q.shape == (2, 200, 130) and scale.shape == (2, 2, 2)


def test_fp8_weights_validate():
    w, *_ = _problem(6)
    q = block_fp8_expert_weights(w)
    with pytest.raises(ValueError, match="w2_scale is required"):
        BlockFP8ExpertWeights(q.w13, q.w2, w13_scale=q.w13_scale)
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        BlockFP8ExpertWeights(w.w13, w.w2, w13_scale=q.w13_scale, w2_scale=q.w2_scale)
