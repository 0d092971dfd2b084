"""The decode kernels under the Triton interpreter (CPU; runs only with ``TRITON_INTERPRET=1``).

    PYTHONPATH=/path/to/cpu/triton:src TRITON_INTERPRET=1 pytest -q -m interpret tests/experts

fp16 and float32 (the interpreter has no bf16), biases with the clamped SwiGLU, weight on input, ragged
``D``/``F``, skipped pairs, block FP8 weights; without the programmatic dependent launch (a Hopper feature).
"""

import pytest
import torch

from epmoe.experts import Activation, ExpertWeights, reference_experts

pytestmark = pytest.mark.interpret


def _weights(seed, s, d, f, bias, dtype):
    g = torch.Generator().manual_seed(seed)
    w = [torch.randn(s, 2 * f, d, generator=g) / d**0.5, torch.randn(s, d, f, generator=g) / f**0.5,
         torch.randn(s, 2 * f, generator=g) * 0.1 if bias else None,
         torch.randn(s, d, generator=g) * 0.1 if bias else None]
    return ExpertWeights(*[None if v is None else v.to(dtype) for v in w])


def _f64(w):
    return ExpertWeights(*[None if v is None else v.double() for v in (w.w13, w.w2, w.b13, w.b2)])


@pytest.mark.parametrize("t,k,d,f,dtype,act,bias,woi", [
    (1, 8, 256, 128, torch.float16, Activation(), False, False),
    (2, 8, 300, 96, torch.float16, Activation("silu", 7.0), True, False),
    (3, 5, 200, 72, torch.float32, Activation("gelu"), True, True),
    (1, 4, 130, 40, torch.float32, Activation("relu"), False, True),
])
def test_decode_matches_reference(t, k, d, f, dtype, act, bias, woi):
    from epmoe.experts.triton.decode import DecodeConfig, decode_experts
    from epmoe.experts.triton.grouped import act_code

    w = _weights(t + d, 6, d, f, bias, dtype)
    x = torch.randn(t, d).to(dtype)
    slots = torch.randint(-1, 6, (t, k))
    slots[0, 0] = 2
    tw = torch.rand(t, k)
    ref = reference_experts(x.double(), slots, tw.double(), _f64(w), act, woi)
    # max_programs 1024: one pair group per pair; 40: 2-3 groups; 1: one group takes every live pair
    for max_programs in (1024, 40, 1):
        cfg = DecodeConfig(8, 64, 16, 32, 4, False, max_programs)
        out = decode_experts(x, slots, tw, w, act_code(act), act, woi, cfg)
        rel = ((out.double() - ref).norm() / ref.norm()).item()
        assert rel < (2e-3 if dtype == torch.float16 else 1e-5)
        assert torch.equal(out, decode_experts(x, slots, tw, w, act_code(act), act, woi, cfg))


def test_decode_all_skipped_and_fp8():
    from epmoe.experts.fp8 import block_fp8_expert_weights
    from epmoe.experts.triton.decode import DecodeConfig, decode_experts

    cfg = DecodeConfig(8, 64, 16, 64, 4, False, 50)
    w = _weights(7, 4, 384, 256, True, torch.float32)
    x = torch.randn(2, 384).half()
    tw = torch.rand(2, 4)
    none = decode_experts(x, torch.full((2, 4), -1), tw, _weights(7, 4, 384, 256, True, torch.float16), 0,
                          Activation(), False, cfg)
    assert not none.any()
    q = block_fp8_expert_weights(w)
    slots = torch.tensor([[1, -1, 3, 0], [-1, -1, 2, 2]])
    ref = reference_experts(x.double(), slots, tw.double(), _f64(q.dequantize(torch.float64)), Activation())
    out = decode_experts(x, slots, tw, q, 0, Activation(), False, cfg)
    assert ((out.double() - ref).norm() / ref.norm()).item() < 2e-3


@pytest.mark.parametrize("tma,half", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("act,bias,woi", [(Activation(), False, False), (Activation("silu", 7.0), True, True)])
def test_grouped_matches_reference(tma, half, act, bias, woi):
    from epmoe.experts.triton.grouped import TileConfig, triton_experts

    t, k, s, d, f = 21, 4, 6, 96, 40
    w = _weights(3, s, d, f, bias, torch.float16)
    x = torch.randn(t, d).half()
    slots = torch.randint(-1, s, (t, k))
    tw = torch.rand(t, k)
    ref = reference_experts(x.double(), slots, tw.double(), _f64(w), act, woi)
    cfg = TileConfig(32, 16, 32, 32, 4, 2, tma, half)
    out = triton_experts(x, slots, tw, w, act, woi, cfg)
    assert ((out.double() - ref).norm() / ref.norm()).item() < 2e-3


def test_few_expected_pairs_among_many_take_the_grouped_path():
    """An expert-parallel shard's call: 32 pairs, 4 expected local (``expected_pairs``): more pairs than the decode
    kernels take, so the grouped kernels run (the result as the reference's)."""
    from epmoe.experts.triton.grouped import triton_experts

    t, k, s, d, f = 4, 8, 6, 64, 32
    w = _weights(5, s, d, f, False, torch.float16)
    x = torch.randn(t, d).half()
    slots = torch.full((t, k), -1)
    slots[torch.arange(t), torch.arange(t)] = torch.arange(t)
    tw = torch.rand(t, k)
    ref = reference_experts(x.double(), slots, tw.double(), _f64(w), Activation())
    out = triton_experts(x, slots, tw, w, Activation(), expected_pairs=4)
    assert ((out.double() - ref).norm() / ref.norm()).item() < 2e-3


def test_backend_entry_takes_any_layout_and_no_pairs():
    """``triton_experts`` (the backend's entry) takes rows inside a wider buffer, non-contiguous int32 slot ids and
    fp16 routing weights (it lays them out for the kernels), on both paths; with no pairs (K = 0) every row is 0."""
    from epmoe.experts.triton.grouped import TileConfig, triton_experts

    t, k, s, d, f = 5, 3, 4, 64, 32
    w = _weights(9, s, d, f, False, torch.float16)
    wide = torch.randn(t, d + 16).half()
    x = wide[:, 8:8 + d]
    slots = torch.randint(-1, s, (k, t)).int().t()
    tw = torch.rand(k, t).half().t()
    ref = reference_experts(x.double(), slots.long(), tw.double(), _f64(w), Activation())
    for cfg in (None, TileConfig(16, 16, 32, 32, 4, 2)):  # the decode kernels (15 pairs), the grouped path
        out = triton_experts(x, slots, tw, w, Activation(), config=cfg)
        assert ((out.double() - ref).norm() / ref.norm()).item() < 2e-3
    none = triton_experts(x, slots[:, :0], tw[:, :0], w, Activation())
    assert none.shape == (t, d) and not none.any()


@pytest.mark.parametrize("block_m,half", [(16, False), (64, True)])
def test_grouped_fp8_matches_dequantized_reference(block_m, half):
    """Block FP8 weights on the grouped path (each weight tile scaled by its block scale before the dot):
    biases, skipped pairs, a half-size last block."""
    from epmoe.experts.fp8 import block_fp8_expert_weights
    from epmoe.experts.triton.grouped import TileConfig, triton_experts

    t, k, s, d, f = 40, 4, 5, 256, 128
    q = block_fp8_expert_weights(_weights(4, s, d, f, True, torch.float32))
    x = torch.randn(t, d).half()
    slots = torch.randint(-1, s, (t, k))
    tw = torch.rand(t, k)
    act = Activation("silu", 7.0)
    ref = reference_experts(x.double(), slots, tw.double(), _f64(q.dequantize(torch.float64)), act)
    out = triton_experts(x, slots, tw, q, act, False, TileConfig(block_m, 32, 64, 128, 4, 2, False, half))
    assert ((out.double() - ref).norm() / ref.norm()).item() < 2e-3


@pytest.mark.parametrize("t", [2, 30])
def test_kernels_skip_slot_ids_outside_the_slots(t):
    """Decode (2 tokens) and grouped (30 tokens) paths skip ids outside ``[0, S)`` like ``-1``."""
    from epmoe.experts.triton.decode import DecodeConfig, decode_experts
    from epmoe.experts.triton.grouped import TileConfig, act_code, triton_experts

    k, s, d, f = 4, 5, 64, 32
    w = _weights(6, s, d, f, True, torch.float16)
    x = torch.randn(t, d).half()
    bad = torch.randint(-1, s, (t, k))
    bad[0, 0], bad[1, 1], bad[-1, 3] = s, 100, -7
    tw = torch.rand(t, k)
    ref = reference_experts(x.double(), torch.where((bad >= 0) & (bad < s), bad, -1), tw.double(), _f64(w),
                            Activation())
    if t * k <= 16:
        out = decode_experts(x, bad, tw, w, act_code(Activation()), Activation(), False,
                             DecodeConfig(8, 64, 16, 32, 4, False, 1024))
    else:
        out = triton_experts(x, bad, tw, w, Activation(), False, TileConfig(16, 16, 32, 32, 4, 2))
    assert ((out.double() - ref).norm() / ref.norm()).item() < 2e-3


@pytest.mark.parametrize("n_tokens,tail,s", [(7, None, 40), (3000, None, 40), (7, 8, 40), (3000, 8, 40),
                                             (250, 8, 40), (0, None, 40), (9, 8, 384), (60, None, 3000)])
def test_alignment_equals_reference(n_tokens, tail, s):
    """Both alignment paths (one program, up to 2048 pairs and 2048 slots; fill + count + offsets + scatter), with
    half-size last blocks or last blocks rounded up to a multiple of a quarter block; no pairs; more slots than
    pairs."""
    from epmoe.experts.triton.align import align_reference
    from epmoe.experts.triton.align_kernels import align_triton, one_program

    assert one_program(n_tokens * 8, s) == (n_tokens * 8 <= 2048 and s <= 2048)
    slots = torch.randint(-1, s, (n_tokens, 8))
    a, b = align_triton(slots, s, 32, True, tail), align_reference(slots, s, 32, True, tail)
    assert torch.equal(a.block_slot, b.block_slot) and torch.equal(a.block_start, b.block_start)
    assert torch.equal(a.block_rows, b.block_rows)
    assert torch.equal(a.sorted_pair_ids.sort().values, b.sorted_pair_ids.sort().values)  # the sentinels too
    for blk in range(a.block_slot.numel()):
        lo, hi = int(a.block_start[blk]), int(a.block_start[blk] + a.block_rows[blk])
        assert sorted(a.sorted_pair_ids[lo:hi].tolist()) == sorted(b.sorted_pair_ids[lo:hi].tolist())
