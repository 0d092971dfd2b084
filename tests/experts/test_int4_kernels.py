"""The INT4 (W4A16) expert kernels (decode, fused grouped, widening) and the MXFP4 ones (decode, widening) against the
reference on the dequantized weights: under the Triton interpreter (``interpret``: ``TRITON_INTERPRET=1``, fp16 and
float32) and on a GPU (``gpu``: bf16, through the ``triton`` backend and each path directly, eagerly and replayed
from a CUDA graph).

    PYTHONPATH=/path/to/numpy<2.4:src TRITON_INTERPRET=1 pytest -q -m interpret tests/experts/test_int4_kernels.py
"""

import pytest
import torch

from epmoe.experts import Activation, ExpertWeights, get_expert_backend, reference_experts
from epmoe.experts.int4 import int4_expert_weights
from epmoe.experts.mxfp4 import mxfp4_expert_weights


def _weights(seed, s, d, f, bias, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    w13, w2 = torch.randn(s, 2 * f, d, generator=g) / d**0.5, torch.randn(s, d, f, generator=g) / f**0.5
    b13 = torch.randn(s, 2 * f, generator=g) * 0.1 if bias else None
    b2 = torch.randn(s, d, generator=g) * 0.1 if bias else None
    return ExpertWeights(*[None if v is None else v.to(device) for v in (w13, w2, b13, b2)])


def _ref(x, slots, tw, q, act, woi):
    deq = q.dequantize(torch.float64)
    w = ExpertWeights(deq.w13, deq.w2, *[None if b is None else b.double() for b in (deq.b13, deq.b2)])
    return reference_experts(x.double(), slots, tw.double(), w, act, woi)


def _rel(out, ref):
    return ((out.double() - ref).norm() / ref.norm()).item()


def _int4(seed, s, d, f, bias, group, dtype, device="cpu"):
    q = int4_expert_weights(_weights(seed, s, d, f, bias, device), group)
    return type(q)(q.w13_packed, q.w13_scale.to(dtype), q.w2_packed, q.w2_scale.to(dtype),
                   *[None if b is None else b.to(dtype) for b in (q.b13, q.b2)], group)


@pytest.mark.interpret
@pytest.mark.parametrize("dtype,group,act,bias,woi", [
    (torch.float32, 32, Activation(), False, False),
    (torch.float16, 64, Activation("silu", 7.0), True, False),
    (torch.float32, 32, Activation("gelu"), True, True),
])
def test_int4_decode_matches_reference(dtype, group, act, bias, woi):
    from epmoe.experts.triton.w4a16_decode import PackedDecodeConfig, packed_decode_experts

    s, d, f = 5, 192, 64  # D: 24 words, a ragged last step of 16 words
    q = _int4(group + bias, s, d, f, bias, group, dtype)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, d, generator=g).to(dtype)
    slots = torch.tensor([[0, -1, 4, 2], [1, 1, 7, 0], [-1, -1, -1, 3]])  # 7: outside [0, S), skipped
    tw = torch.rand(3, 4, generator=g)
    ref = _ref(x, slots, tw, q, act, woi)
    # one pair group per pair (ragged last row tile of the down kernel, words three steps in flight); then the pairs
    # shared among 2 groups per column tile (a program computes several pairs, requesting the next pair's first
    # words before its epilogue), two steps in flight; then gate/up rows past F (a ragged row tile)
    for cfg in (PackedDecodeConfig(32, 16, 128, 8, 4), PackedDecodeConfig(16, 8, 64, 8, 2, True, 8, stages=2),
                PackedDecodeConfig(128, 8, 32, 8, 4)):
        out = packed_decode_experts(x, slots, tw, q, act, woi, cfg)
        assert _rel(out, ref) < (1e-5 if dtype == torch.float32 else 2e-3)
    none = packed_decode_experts(x, torch.full((3, 4), -1), tw, q, act, woi, PackedDecodeConfig(32, 16, 128, 8, 4))
    assert not none.any()


@pytest.mark.interpret
@pytest.mark.parametrize("d", [1024, 1536])
def test_int4_decode_default_tiles_match_reference(d):
    from dataclasses import replace

    from epmoe.experts.triton.w4a16_decode import PackedDecodeConfig, packed_decode_experts

    # the default tiles (128 words a step, one warp): D = 1024 is one whole step of gate/up (its unmasked loop),
    # 1536 one and a half; the down kernel's 8 words of F = 64 a ragged step either way
    s, f, act = 3, 64, Activation()
    q = _int4(d, s, d, f, False, 32, torch.float32)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, d, generator=g)
    slots = torch.tensor([[2, -1], [0, 2]])
    tw = torch.rand(2, 2, generator=g)
    ref = _ref(x, slots, tw, q, act, False)
    # one program group per pair; then all pairs in one group (each program loops over the live pairs)
    for cfg in (PackedDecodeConfig(), replace(PackedDecodeConfig(), max_programs=16)):
        assert _rel(packed_decode_experts(x, slots, tw, q, act, False, cfg), ref) < 1e-5


@pytest.mark.interpret
@pytest.mark.parametrize("scale", [2.0**-20, 2.0**20])
def test_int4_decode_keeps_precision_over_the_activation_range(scale):
    from epmoe.experts.triton.w4a16_decode import packed_decode_experts

    # the nibbles are read as float32 subnormals against inputs pre-scaled by 2 ** (69 - p): activations (and the
    # intermediate h, about their square) far from 1 keep float32 precision, and the offset 8 comes off exactly
    s, d, f, act = 3, 1024, 64, Activation()
    q = _int4(5, s, d, f, False, 32, torch.float32)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, d, generator=g) * scale
    slots = torch.tensor([[2, 0], [1, 2]])
    tw = torch.rand(2, 2, generator=g)
    out = packed_decode_experts(x, slots, tw, q, act, False)
    assert out.abs().max() > 0 and torch.isfinite(out).all()
    assert _rel(out, _ref(x, slots, tw, q, act, False)) < 1e-5


@pytest.mark.interpret
def test_int4_decode_bf16_inputs():
    from dataclasses import replace

    from epmoe.experts.triton.w4a16_decode import PackedDecodeConfig, packed_decode_experts

    # bf16 rows: the de-interleaved inputs and h are kept in bf16 (h rounded as the model's MLP rounds it), or in
    # float32 with bf16_inputs off; both within bf16's error of the float64 reference
    s, d, f, act = 3, 1024, 64, Activation()
    q = _int4(5, s, d, f, False, 32, torch.bfloat16)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, d, generator=g).bfloat16()
    slots = torch.tensor([[2, 0], [1, 2]])
    tw = torch.rand(2, 2, generator=g)
    ref = _ref(x, slots, tw, q, act, False)
    narrow = packed_decode_experts(x, slots, tw, q, act, False)
    wide = packed_decode_experts(x, slots, tw, q, act, False, replace(PackedDecodeConfig(), bf16_inputs=False))
    assert narrow.dtype == torch.bfloat16 and _rel(narrow, ref) < 1e-2 and _rel(wide, ref) < 1e-2


@pytest.mark.interpret
@pytest.mark.parametrize("d", [1024, 1536])
def test_int4_decode_split_reduction_matches_reference(d):
    from dataclasses import replace

    from epmoe.experts.triton.w4a16_decode import PackedDecodeConfig, packed_decode_experts

    # few live pairs: each gets several gate/up program groups, which split its reduction over D (128-word steps):
    # D = 1024 in 4 splits of 32 words rounded up to a step (one whole step, three empty splits); D = 1536 a whole
    # step and a ragged one. One live pair of four (split 4), two (split 2), three (no split: 3 * 2 > 4 groups)
    s, f, act = 3, 64, Activation("silu", 7.0)
    q = _int4(d + 1, s, d, f, True, 32, torch.float32)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, d, generator=g)
    tw = torch.rand(2, 2, generator=g)
    # 16 row tiles, 64 programs: four pair groups, which the splits share
    cfg = replace(PackedDecodeConfig(), max_programs=64, split_max=4)
    for slots in (torch.tensor([[-1, 2], [-1, -1]]), torch.tensor([[1, -1], [-1, 1]]), torch.tensor([[0, 2], [1, -1]])):
        ref = _ref(x, slots, tw, q, act, True)
        out = packed_decode_experts(x, slots, tw, q, act, True, cfg)
        assert _rel(out, ref) < 1e-5
        assert torch.equal(out, packed_decode_experts(x, slots, tw, q, act, True, cfg))  # partials summed in order
        assert _rel(packed_decode_experts(x, slots, tw, q, act, True, replace(cfg, split_max=1)), ref) < 1e-5


@pytest.mark.interpret
def test_int4_dequantized_path_and_dequantize_kernel():
    from epmoe.experts.int4 import dequantize_int4
    from epmoe.experts.triton.int4 import dequantize_int4_triton, int4_dequantized_experts, int4_experts

    q = _int4(3, 4, 128, 64, True, 32, torch.float16)
    out = torch.full((4, 128, 128), 7.0)
    counts = torch.tensor([2, 0, 1, 0, 9], dtype=torch.int32)  # slots 1 and 3 have no pairs: left as they were
    dequantize_int4_triton(q.w13_packed, q.w13_scale, 32, out, counts)
    want = dequantize_int4(q.w13_packed, q.w13_scale, 32, torch.float32)
    assert torch.equal(out[[0, 2]], want[[0, 2]]) and bool((out[[1, 3]] == 7.0).all())
    x = torch.randn(9, 128).half()
    slots = torch.tensor([[0, 2], [2, -1], [0, 0], [-1, 2], [2, 0], [0, 2], [2, 2], [-1, -1], [0, 2]])
    tw = torch.rand(9, 2)
    act = Activation("silu", 7.0)
    ref = _ref(x, slots, tw, q, act, False)
    assert _rel(int4_dequantized_experts(x, slots, tw, q, act), ref) < 2e-3  # 18 pairs
    assert _rel(int4_experts(x[:5], slots[:5], tw[:5], q, act), ref[:5]) < 2e-3  # 10 pairs: the decode kernels


@pytest.mark.interpret
@pytest.mark.parametrize("dtype,group,act,bias,woi", [
    (torch.float32, 32, Activation(), False, False),
    (torch.float16, 64, Activation("silu", 7.0), True, True),
])
def test_int4_grouped_matches_reference(dtype, group, act, bias, woi):
    from epmoe.experts.triton.grouped import TileConfig
    from epmoe.experts.triton.int4 import int4_grouped_experts

    s, d, f = 4, 192, 64  # D: 24 words, a ragged last step of 16; F: 8 words, half a step
    q = _int4(group + bias + 7, s, d, f, bias, group, dtype)
    g = torch.Generator().manual_seed(2)
    t, k = 11, 3
    x = torch.randn(t, d, generator=g).to(dtype)
    slots = torch.randint(-1, s, (t, k), generator=g)
    slots[:6, 0] = 1  # slot 1: 6 or more rows, a full 16-row block and a half-size 8-row tail at block_m 16 / 32
    slots[0, 1] = 7  # outside [0, S): skipped
    tw = torch.rand(t, k, generator=g)
    ref = _ref(x, slots, tw, q, act, woi)
    # 16-row blocks, weights on the right, 16 and 32 words a step; transposed products; 32-row blocks with half-size
    # last blocks
    for cfg in (TileConfig(16, 16, 16, 128, 4, 1), TileConfig(16, 16, 16, 256, 4, 1),
                TileConfig(16, 32, 16, 128, 4, 1, swap_ab=True), TileConfig(32, 16, 32, 128, 4, 1, half_tail=True,
                                                                            swap_ab=True)):
        out = int4_grouped_experts(x, slots, tw, q, act, woi, cfg)
        assert _rel(out, ref) < (1e-5 if dtype == torch.float32 else 2e-3), cfg
    with pytest.raises(ValueError, match="block_k a power of two of at least 128"):
        int4_grouped_experts(x, slots, tw, q, act, woi, TileConfig(16, 16, 16, 64, 4, 1))


@pytest.mark.interpret
def test_mxfp4_widening_and_experts():
    from epmoe.experts.mxfp4 import dequantize_mxfp4
    from epmoe.experts.triton.mxfp4 import dequantize_mxfp4_triton, mxfp4_experts

    q = mxfp4_expert_weights(_weights(5, 4, 96, 64, True))
    blocks = q.w13_blocks.clone()
    blocks[0, 0, 0] = torch.arange(16, dtype=torch.uint8) * 17  # every E2M1 code, in both nibbles
    scales = q.w13_scales.clone()
    scales[0, 1, 0] = 0  # 2 ** -127
    out = torch.full((4, 128, 96), 7.0)
    dequantize_mxfp4_triton(blocks, scales, out, torch.tensor([1, 0, 3, 0], dtype=torch.int32))
    want = dequantize_mxfp4(blocks, scales, torch.float32)
    assert torch.equal(out[[0, 2]], want[[0, 2]]) and bool((out[[1, 3]] == 7.0).all())
    q = type(q)(q.w13_blocks, q.w13_scales, q.w2_blocks, q.w2_scales, q.b13.half(), q.b2.half())
    x = torch.randn(9, 96).half()
    slots = torch.tensor([[0, 2], [2, -1], [0, 0], [-1, 2], [2, 0], [0, 2], [2, 2], [-1, -1], [0, 2]])
    tw = torch.rand(9, 2)
    act = Activation("silu", 7.0)
    assert _rel(mxfp4_experts(x, slots, tw, q, act), _ref(x, slots, tw, q, act, False)) < 2e-3  # 18 pairs


def _mxfp4_case(seed, s, d, f, device="cpu"):
    """MXFP4 weights with biases, every E2M1 code in both nibbles of slot 0's first byte block and one scale of 0
    (``2 ** -127``)."""
    q = mxfp4_expert_weights(_weights(seed, s, d, f, True, device))
    blocks, scales = q.w13_blocks.clone(), q.w13_scales.clone()
    blocks[0, 0, 0] = torch.arange(16, dtype=torch.uint8) * 17
    scales[0, 1, 0] = 0
    return type(q)(blocks, scales, q.w2_blocks, q.w2_scales, q.b13, q.b2)


def _run_ptx(ptx, word):
    """Emulate the integer PTX of ``w4a16_dots.e2m1_pair_ptx`` on ``word`` (numpy uint32 array): the two float32
    outputs."""
    import re

    import numpy as np

    regs = {"$2": word.astype(np.uint32)}
    for ins in [i.strip() for i in ptx.strip("{} ").split(";") if i.strip()]:
        op, args = ins.split(None, 1)
        a = [x.strip() for x in re.split(r",(?![^{]*})", args)]
        val = [regs[x] if x in regs else np.uint32(int(x, 0)) if x[0].isdigit() else None for x in a]
        if op.startswith(".reg"):
            continue
        if op == "shl.b32":
            regs[a[0]] = (val[1] << np.uint32(val[2])).astype(np.uint32)
        elif op == "shr.b32":
            regs[a[0]] = val[1] >> np.uint32(val[2])
        elif op == "and.b32":
            regs[a[0]] = val[1] & val[2]
        elif op == "lop3.b32":  # bit i of the result: bit (4 a_i + 2 b_i + c_i) of the table
            x, y, z, lut = val[1], val[2], np.broadcast_to(val[3], val[1].shape), int(a[4], 0)
            out = np.zeros_like(x)
            for bit in range(32):
                idx = (((x >> bit) & 1) << 2) | (((y >> bit) & 1) << 1) | ((z >> bit) & 1)
                out |= ((np.uint32(lut) >> idx) & 1).astype(np.uint32) << np.uint32(bit)
            regs[a[0]] = out
        elif op == "mov.b32":
            lo, hi = a[0].strip("{}").split(",")
            regs[lo.strip()], regs[hi.strip()] = val[1] & 0xFFFF, val[1] >> 16
        elif op == "cvt.f32.f16":
            regs[a[0]] = regs[a[1]].astype(np.uint16).view(np.float16).astype(np.float32)
        else:
            raise AssertionError(f"unexpected PTX instruction {ins!r}")
    return regs["$0"], regs["$1"]


@pytest.mark.interpret
def test_e2m1_pair_ptx_widens_every_code():
    import numpy as np

    from epmoe.experts.mxfp4 import E2M1_VALUES
    from epmoe.experts.triton.w4a16_dots import e2m1_pair_ptx

    # every code in every nibble (nibble j of word w: code (w + j) % 16), then random words: each output lane is
    # the E2M1 value of nibble j or j + 4 times 2 ** -14, exactly
    words = np.array([sum(((w + j) % 16) << (4 * j) for j in range(8)) for w in range(16)], dtype=np.uint64)
    words = np.concatenate([words, np.random.default_rng(0).integers(0, 2**32, 512, dtype=np.uint64)])
    words = words.astype(np.uint32)
    table = np.array(E2M1_VALUES, dtype=np.float32) * np.float32(2.0**-14)
    for j in range(4):
        lo, hi = _run_ptx(e2m1_pair_ptx(j), words)
        assert np.array_equal(lo, table[(words >> (4 * j)) & 0xF]), j
        assert np.array_equal(hi, table[(words >> (4 * j + 16)) & 0xF]), j
        assert np.array_equal(np.signbit(lo), ((words >> (4 * j + 3)) & 1) == 1), j  # -0 keeps its sign


@pytest.mark.interpret
@pytest.mark.parametrize("dtype,act,woi", [
    (torch.float32, Activation("silu", 7.0), False),
    (torch.float32, Activation("gelu"), True),
    (torch.float16, Activation(), False),
])
def test_mxfp4_decode_matches_reference(dtype, act, woi):
    from epmoe.experts.triton.mxfp4 import MXFP4_DECODE_CONFIG, mxfp4_experts, mxfp4_widened_experts
    from epmoe.experts.triton.w4a16_decode import PackedDecodeConfig, packed_decode_experts

    q = _mxfp4_case(3, 4, 96, 64)  # D: 3 blocks of 32 (12 words), F: 2 blocks
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 96, generator=g).to(dtype)
    slots = torch.tensor([[0, -1, 3, 2], [1, 1, 7, 0], [-1, -1, -1, 3]])  # 7: outside [0, S), skipped
    tw = torch.rand(3, 4, generator=g)
    ref = _ref(x, slots, tw, q, act, woi)
    # the default tiles and MXFP4's (one part step of 12 of 128 words); 8-word steps (a whole one and a part one)
    # with gate/up rows past F; 4-word steps with 16 programs a launch (pairs shared among groups) and splits of D
    for cfg in (PackedDecodeConfig(), MXFP4_DECODE_CONFIG, PackedDecodeConfig(4, 8, 8, 8, 2, stages=3),
                PackedDecodeConfig(4, 4, 8, 4, 1, max_programs=16, split_max=4)):
        out = packed_decode_experts(x, slots, tw, q, act, woi, cfg)
        assert _rel(out, ref) < (1e-5 if dtype == torch.float32 else 2e-3), cfg
        assert out.dtype == dtype and torch.equal(out, packed_decode_experts(x, slots, tw, q, act, woi, cfg))
    if dtype == torch.float16:  # the backend's entry takes the decode kernels, with MXFP4's tiles, up to 8 pairs
        two = (x[:2], slots[:2], tw[:2])
        assert torch.equal(mxfp4_experts(*two, q, act, woi),
                           packed_decode_experts(*two, q, act, woi, MXFP4_DECODE_CONFIG))
        assert _rel(mxfp4_widened_experts(x, slots, tw, q, act, woi), ref) < 2e-3
    none = packed_decode_experts(x, torch.full((3, 4), -1), tw, q, act, woi)
    assert none.shape == (3, 96) and not none.any()


@pytest.mark.interpret
@pytest.mark.parametrize("dtype,act,woi", [
    (torch.float32, Activation("silu", 7.0), False),
    (torch.float16, Activation("gelu"), True),
])
def test_mxfp4_grouped_matches_reference(dtype, act, woi):
    from epmoe.experts.triton.grouped import TileConfig, default_int4_config
    from epmoe.experts.triton.mxfp4 import mxfp4_experts, mxfp4_grouped_experts

    s, d, f = 4, 192, 64  # D: 6 blocks of 32 (24 words, a ragged last step of 16); F: 2 blocks, half a step
    q = _mxfp4_case(11, s, d, f)
    q = type(q)(q.w13_blocks, q.w13_scales, q.w2_blocks, q.w2_scales, q.b13.to(dtype), q.b2.to(dtype))
    g = torch.Generator().manual_seed(4)
    t, k = 23, 3
    x = torch.randn(t, d, generator=g).to(dtype)
    slots = torch.randint(-1, s, (t, k), generator=g)
    slots[:6, 0] = 0  # slot 0 (every E2M1 code, a scale of 0): a full 16-row block and a half-size tail at 32 rows
    slots[0, 1] = 7  # outside [0, S): skipped
    tw = torch.rand(t, k, generator=g)
    ref = _ref(x, slots, tw, q, act, woi)
    for cfg in (TileConfig(16, 16, 16, 128, 4, 1), TileConfig(16, 32, 16, 256, 4, 1),
                TileConfig(32, 16, 32, 128, 4, 1, half_tail=True, swap_ab=True)):
        out = mxfp4_grouped_experts(x, slots, tw, q, act, woi, cfg)
        assert out.dtype == dtype and _rel(out, ref) < (1e-5 if dtype == torch.float32 else 2e-3), cfg
    if dtype == torch.float16:  # past 8 pairs the backend's entry takes the grouped kernels, tiles by the rows a slot
        x, slots, tw = torch.randn(3, d).to(dtype), torch.randint(0, s, (3, 4)), torch.rand(3, 4)
        want = mxfp4_grouped_experts(x, slots, tw, q, act, woi, default_int4_config(12, s))
        assert torch.equal(mxfp4_experts(x, slots, tw, q, act, woi), want)
        assert _rel(want, _ref(x, slots, tw, q, act, woi)) < 2e-3
    with pytest.raises(ValueError, match="block_k a power of two of at least 128"):
        mxfp4_grouped_experts(x, slots, tw, q, act, woi, TileConfig(16, 16, 16, 64, 4, 1))
    strided = type(q)(q.w13_blocks.transpose(0, 1).contiguous().transpose(0, 1), q.w13_scales, q.w2_blocks,
                      q.w2_scales, q.b13, q.b2)
    with pytest.raises(ValueError, match="w13_blocks contiguous"):
        mxfp4_grouped_experts(x, slots, tw, strided, act, woi)


@pytest.mark.interpret
def test_int4_entry_takes_any_layout_and_no_pairs():
    """``int4_experts`` (the backend's entry) and the grouped INT4 path take rows whose elements are not adjacent and
    non-contiguous int32 slot ids (laid out for the kernels on the way); with no pairs (K = 0) every row is 0."""
    from epmoe.experts.triton.int4 import int4_experts, int4_grouped_experts

    s, d, f = 3, 128, 64
    q = _int4(11, s, d, f, False, 32, torch.float16)
    x = torch.randn(d, 4).half().t()  # [4, D], stride (1, 4)
    slots = torch.randint(-1, s, (2, 4)).int().t()
    tw = torch.rand(2, 4).t()
    ref = _ref(x, slots.long(), tw, q, Activation(), False)
    for out in (int4_experts(x, slots, tw, q, Activation()), int4_grouped_experts(x, slots, tw, q, Activation())):
        assert _rel(out, ref) < 2e-3
    for fn in (int4_experts, int4_grouped_experts):
        none = fn(x, slots[:, :0], tw[:, :0], q, Activation())
        assert none.shape == (4, d) and not none.any()


@pytest.mark.interpret  # the kernel module needs Triton (absent from CPU-only installs)
def test_int4_step_must_cover_whole_groups():
    from epmoe.experts.triton.w4a16_decode import PackedDecodeConfig, packed_decode_experts

    q = int4_expert_weights(_weights(0, 2, 128, 64, False), 64)
    x, slots, tw = torch.randn(1, 128), torch.zeros(1, 2, dtype=torch.long), torch.ones(1, 2)
    with pytest.raises(ValueError, match="multiples of the group size 64"):
        packed_decode_experts(x, slots, tw, q, Activation(), config=PackedDecodeConfig(8, 4, 16, 8, 4))
    with pytest.raises(ValueError, match="stages must be 2 or 3, got 4"):
        packed_decode_experts(x, slots, tw, q, Activation(), config=PackedDecodeConfig(8, 8, 16, 8, 4, stages=4))
    with pytest.raises(ValueError, match="PackedDecodeConfig.block_n2 must be a power of two, got 12"):
        packed_decode_experts(x, slots, tw, q, Activation(), config=PackedDecodeConfig(8, 8, 12, 8, 4))
    with pytest.raises(ValueError, match="PackedDecodeConfig.split_max must be a power of two, got 3"):
        packed_decode_experts(x, slots, tw, q, Activation(), config=PackedDecodeConfig(8, 8, 16, 8, 4, split_max=3))
    with pytest.raises(ValueError, match="x must be contiguous along D"):  # read by pointer: checked first
        packed_decode_experts(torch.randn(256, 1)[::2].t(), slots, tw, q, Activation())


@pytest.mark.interpret  # the kernel module needs Triton (absent from CPU-only installs)
def test_int4_path_choice():
    from epmoe.experts.triton.int4 import int4_path

    bf16, fp16 = torch.bfloat16, torch.float16
    # up to eight expected pairs (an EP-8 shard's decode step of up to eight tokens, or one token over all 384 of
    # Kimi-K2.5's experts): the decode kernels; more pairs: the MMA path
    assert int4_path(1, bf16, 48) == "decode"
    assert int4_path(4, bf16, 64) == "decode"
    assert int4_path(8, bf16, 48) == "decode"
    assert int4_path(8, bf16, 384) == "decode"
    assert int4_path(9, bf16, 48) == "mma"
    assert int4_path(9, bf16, 384) == "mma"
    assert int4_path(17, bf16, 48) == "mma"
    assert int4_path(32768, bf16, 48) == "mma"
    # Hopper: the wgmma kernels from 16 pairs a local slot on (a 768-token prefill on a shard of 48 experts at top-8
    # is 768 pairs), the MMA path below and for decode steps
    assert int4_path(768, bf16, 48, hopper=True) == "wgmma"
    assert int4_path(767, bf16, 48, hopper=True) == "mma"
    assert int4_path(8, bf16, 384, hopper=True) == "decode"
    assert int4_path(9, bf16, 384, hopper=True) == "mma"
    assert int4_path(1, bf16, 48, hopper=True) == "decode"
    assert int4_path(32768, fp16, 48, hopper=True) == "grouped"
    # fp16: no MMA path
    assert int4_path(8, fp16, 384) == "decode"
    assert int4_path(100, fp16, 384) == "grouped"


def test_int4_mma_tiles_by_size_and_their_checks():
    # plain Python (no Triton): the tiles the backend takes and the ones the kernels refuse
    from epmoe.experts.triton.w4a16_mma_config import MmaConfig, check_mma_config, default_mma_config

    # 16-row blocks at every size (8-row sub-blocks: a slot with at most 8 pairs issues one MMA a widened register)
    for pairs, slots in ((8, 384), (2048, 384), (6144, 384), (768, 48)):
        assert default_mma_config(32, pairs, slots).block_m == 16
    # steps of at least half a group
    assert default_mma_config(128, 8, 384).block_kw1 == 64
    # registers capped to 128 for sparse pairs (at most 2 a slot), to 168 for other one-token steps and shards
    assert default_mma_config(32, 8, 384).maxnreg == 128
    assert default_mma_config(32, 64, 384).maxnreg == 128
    assert default_mma_config(32, 768, 384).maxnreg == 128
    assert default_mma_config(32, 769, 384).maxnreg is None
    assert default_mma_config(32, 2048, 384).maxnreg is None
    assert default_mma_config(32, 0, 384).maxnreg is None
    assert default_mma_config(32, 96, 48).maxnreg == 128
    assert default_mma_config(32, 512, 48).maxnreg == 168
    assert default_mma_config(32, 8, 2).maxnreg == 168
    for cfg, message in [
        (MmaConfig(block_kw1=16), "block_kw1 must be a power of two of at least 8 words and of half the group size 64"),
        (MmaConfig(block_kw1=32, block_kw2=24), "block_kw2 must be a power of two .* got 24"),
        (MmaConfig(64, 32, 32, 32, 4), r"block_n2 must be a power of two and a multiple of 16 \* num_warps \(64\)"),
        (MmaConfig(block_kw1=32, block_kw2=32, split_max=3), "split_max must be a power of two, got 3"),
        (MmaConfig(block_kw1=32, block_kw2=32, block_m=24), "block_m must be 8, 16 or 32, got 24"),
        (MmaConfig(block_kw1=32, block_kw2=32, block_m=64), "block_m must be 8, 16 or 32, got 64"),
    ]:
        with pytest.raises(ValueError, match=message):
            check_mma_config(cfg, 64)
    check_mma_config(default_mma_config(64), 64)


@pytest.mark.interpret
def test_int4_mma_refuses_bad_input():
    from epmoe.experts.triton.w4a16_mma import packed_mma_experts
    from epmoe.experts.triton.w4a16_mma_config import MmaConfig

    q = int4_expert_weights(_weights(0, 2, 256, 128, False), 64)
    x, slots, tw = torch.randn(1, 256), torch.zeros(1, 2, dtype=torch.long), torch.ones(1, 2)
    with pytest.raises(TypeError, match="compute in bf16, got x of dtype torch.float32"):
        packed_mma_experts(x, slots, tw, q, Activation())
    # the tiles are checked against the weights' group size (64) before anything runs
    with pytest.raises(ValueError, match="block_kw1 must be a power of two of at least 8 words and of half the group "
                                         "size 64"):
        packed_mma_experts(x.bfloat16(), slots, tw, q, Activation(), config=MmaConfig(block_kw1=16))


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 2, 16, 100, 1500])  # 16 pairs and fewer: decode kernels; more: fused grouped
@pytest.mark.parametrize("case", ["silu", "swiglu_bias_woi", "skip"])
def test_int4_backend_on_gpu(t, case):
    s, d, f, k = 12, 1024, 512, 8
    q = _int4(t, s, d, f, case != "silu", 32, torch.bfloat16, "cuda")
    act = Activation("silu", 7.0) if case == "swiglu_bias_woi" else Activation()
    woi = case == "swiglu_bias_woi"
    x = torch.randn(t, d, device="cuda", dtype=torch.bfloat16)
    slots = torch.randint(0, s, (t, k), device="cuda")
    if case == "skip":
        slots = torch.where(torch.rand(t, k, device="cuda") < 0.8, -1, slots)
        slots[0, 0] = 3
    tw = torch.rand(t, k, device="cuda")
    ref = _ref(x, slots, tw, q, act, woi)
    backend = get_expert_backend("triton")
    out = backend(x, slots, tw, q, act, woi)
    assert _rel(out, ref) < 1e-2
    # the pairs an expert-parallel layer expects choose other kernels and tiles, never another result
    for expected in (1, 17, 16 * s, 64 * s):
        assert _rel(backend(x, slots, tw, q, act, woi, expected_pairs=expected), ref) < 1e-2, expected
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = backend(x, slots, tw, q, act, woi)
    x.copy_(torch.randn_like(x))
    graph.replay()
    assert torch.equal(captured, backend(x, slots, tw, q, act, woi))


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 16, 100, 1500])
@pytest.mark.parametrize("case", ["silu", "swiglu_bias_woi", "skip_g64", "fp16"])
def test_int4_grouped_and_dequant_paths_on_gpu(t, case):
    from epmoe.experts.triton.grouped import TileConfig
    from epmoe.experts.triton.int4 import int4_dequantized_experts, int4_grouped_experts

    s, d, f, k = 12, 1024, 512, 8
    dtype = torch.float16 if case == "fp16" else torch.bfloat16  # the two widenings in PTX (w4a16._widen_pairs)
    q = _int4(t + 1, s, d, f, case in ("swiglu_bias_woi", "skip_g64"), 64 if case == "skip_g64" else 32, dtype,
              "cuda")
    act = Activation("silu", 7.0) if case == "swiglu_bias_woi" else Activation()
    woi = case == "swiglu_bias_woi"
    x = torch.randn(t, d, device="cuda", dtype=dtype)
    slots = torch.randint(0, s, (t, k), device="cuda")
    if case == "skip_g64":
        slots = torch.where(torch.rand(t, k, device="cuda") < 0.8, -1, slots)
        slots[0, 0] = 3
    tw = torch.rand(t, k, device="cuda")
    ref = _ref(x, slots, tw, q, act, woi)
    # the default tiles; transposed products; 64-row blocks with half-size last blocks; a 32-word step
    for cfg in (None, TileConfig(16, 64, 64, 128, 4, 3, swap_ab=True),
                TileConfig(64, 64, 128, 128, 4, 3, half_tail=True), TileConfig(16, 32, 64, 256, 4, 3)):
        assert _rel(int4_grouped_experts(x, slots, tw, q, act, woi, cfg), ref) < 1e-2, cfg
    assert _rel(int4_dequantized_experts(x, slots, tw, q, act, woi), ref) < 1e-2
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = int4_grouped_experts(x, slots, tw, q, act, woi)
    x.copy_(torch.randn_like(x))
    graph.replay()
    assert torch.equal(captured, int4_grouped_experts(x, slots, tw, q, act, woi))


@pytest.mark.gpu
@pytest.mark.parametrize("d,f", [(2880, 2880), (96, 64)])
def test_mxfp4_decode_on_gpu(d, f):
    from epmoe.experts.triton.mxfp4 import MXFP4_DECODE_CONFIG
    from epmoe.experts.triton.w4a16_decode import PackedDecodeConfig, packed_decode_experts

    # the PTX widening against the float32 reference: every E2M1 code and a scale of 0 (_mxfp4_case), gpt-oss's
    # 360-word rows (whole 128-word steps and a part one) and a small ragged case; one pair per program group, all
    # pairs in one group, splits of D; a CUDA-graph replay with new rows
    q = _mxfp4_case(5, 6, d, f, "cuda")
    act = Activation("silu", 7.0)
    x = torch.randn(2, d, device="cuda", dtype=torch.bfloat16)
    slots = torch.tensor([[0, 3, -1, 5], [2, 0, 0, 9]], device="cuda")  # 9: outside [0, S), skipped
    tw = torch.rand(2, 4, device="cuda")
    ref = _ref(x, slots, tw, q, act, False)
    for cfg in (PackedDecodeConfig(), MXFP4_DECODE_CONFIG, PackedDecodeConfig(max_programs=16),
                PackedDecodeConfig(8, 64, 8, 64, 2, stages=3, split_max=4)):
        out = packed_decode_experts(x, slots, tw, q, act, False, cfg)
        assert _rel(out, ref) < 1e-2, cfg
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = packed_decode_experts(x, slots, tw, q, act)
    x.copy_(torch.randn_like(x))
    graph.replay()
    assert torch.equal(captured, packed_decode_experts(x, slots, tw, q, act))
    assert _rel(captured, _ref(x, slots, tw, q, act, False)) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 2, 4, 16, 17, 300])  # decode kernels up to two tokens, MMA/wgmma above
def test_mxfp4_backend_on_gpu(t):
    s, d, f, k = 8, 2880, 2880, 4  # gpt-oss's D and F: 90 blocks of 32, a ragged last step
    q = _mxfp4_case(t, s, d, f, "cuda")
    q = type(q)(q.w13_blocks, q.w13_scales, q.w2_blocks, q.w2_scales, q.b13.bfloat16(), q.b2.bfloat16())
    act = Activation("silu", 7.0)
    x = torch.randn(t, d, device="cuda", dtype=torch.bfloat16)
    slots = torch.randint(0, s, (t, k), device="cuda")
    slots[0, 0] = 0
    tw = torch.rand(t, k, device="cuda")
    backend = get_expert_backend("triton")
    assert _rel(backend(x, slots, tw, q, act), _ref(x, slots, tw, q, act, False)) < 1e-2
    if t <= 17:  # replayed from a CUDA graph with new rows
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = backend(x, slots, tw, q, act)
        x.copy_(torch.randn_like(x))
        graph.replay()
        assert torch.equal(captured, backend(x, slots, tw, q, act))
        assert _rel(captured, _ref(x, slots, tw, q, act, False)) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("t", [2, 40, 300])  # one row block a slot; partly filled 64/128-row blocks; several a slot
@pytest.mark.parametrize("shape", ["gptoss", "ragged_skip_woi"])
def test_mxfp4_mma_and_wgmma_paths_on_gpu(t, shape):
    # gpt-oss's D = F = 2880 (360 words a row: not a multiple of 16, masked steps); or D 288 / F 160 (36 / 20 words,
    # a part step in both kernels and F a part row tile) with half the pairs skipped and the weight on the input;
    # every E2M1 code and a scale of 0 (2 ** -127) in slot 0
    from epmoe.experts.triton.mxfp4 import mxfp4_wgmma_config
    from epmoe.experts.triton.w4a16_mma import packed_mma_experts
    from epmoe.experts.triton.w4a16_mma_config import MmaConfig
    from epmoe.experts.triton.w4a16_wgmma import packed_wgmma_experts
    from epmoe.experts.triton.w4a16_wgmma_config import WgmmaConfig

    s, k = 8, 4
    d, f = (2880, 2880) if shape == "gptoss" else (288, 160)
    q = _mxfp4_case(t, s, d, f, "cuda")
    q = type(q)(q.w13_blocks, q.w13_scales, q.w2_blocks, q.w2_scales, q.b13.bfloat16(), q.b2.bfloat16())
    act, woi = Activation("silu", 7.0), "woi" in shape
    x = torch.randn(t, d, device="cuda", dtype=torch.bfloat16)
    slots = torch.randint(0, s, (t, k), device="cuda")
    if "skip" in shape:
        slots = torch.where(torch.rand(t, k, device="cuda") < 0.5, -1, slots)
    slots[0, 0] = 0
    tw = torch.rand(t, k, device="cuda")
    ref = _ref(x, slots, tw, q, act, woi)
    for cfg in (None, MmaConfig(64, 16, 64, 16, 2, maxnreg=168), MmaConfig(32, 32, 32, 32, 2, block_m=32)):
        assert _rel(packed_mma_experts(x, slots, tw, q, act, woi, cfg), ref) < 1e-2, cfg
    for cfg in (None, WgmmaConfig(64, 16, 32, tail_rows=32), WgmmaConfig(128, 16, 32, tail_rows=32),
                WgmmaConfig(64, 16, 16, 3, 4, 64, 64), mxfp4_wgmma_config(t * k, s), mxfp4_wgmma_config(10**6, s),
                WgmmaConfig(128, 16, 16, 4, tail_rows=32, words_smem=True)):
        assert _rel(packed_wgmma_experts(x, slots, tw, q, act, woi, cfg), ref) < 1e-2, cfg
    _assert_replay_equals_eager(lambda: packed_mma_experts(x, slots, tw, q, act, woi), x)


@pytest.mark.interpret  # the kernel modules need Triton (absent from CPU-only installs)
def test_mxfp4_path_choice_and_refusals():
    from epmoe.experts.triton.grouped import packed_words
    from epmoe.experts.triton.mxfp4 import MXFP4_WGMMA_MIN_PAIRS_PER_SLOT, mxfp4_path, mxfp4_wgmma_config
    from epmoe.experts.triton.w4a16_mma import packed_mma_experts
    from epmoe.experts.triton.w4a16_wgmma import packed_wgmma_experts
    from epmoe.experts.triton.w4a16_wgmma_config import WgmmaConfig

    bf16, fp16 = torch.bfloat16, torch.float16
    assert mxfp4_path(4, bf16, 32, True) == "decode"
    assert mxfp4_path(8, bf16, 32, True) == "decode"  # two tokens at top-4
    assert mxfp4_path(9, bf16, 32, True) == "mma"
    assert mxfp4_path(MXFP4_WGMMA_MIN_PAIRS_PER_SLOT * 32 - 1, bf16, 32, True) == "mma"
    assert mxfp4_path(MXFP4_WGMMA_MIN_PAIRS_PER_SLOT * 32, bf16, 32, True) == "wgmma"
    assert mxfp4_path(4096, bf16, 32, False) == "grouped"  # the MMA kernels' PTX is Hopper's
    assert mxfp4_path(4096, fp16, 32, True) == "grouped"
    # the wgmma tiles: the default's blocks, 16-word down steps, the down program at 128 registers
    assert mxfp4_wgmma_config(64 * 32 - 1, 32) == WgmmaConfig(64, 16, 16, 3, 8, 128, 128, 32, maxnreg2=128)
    assert mxfp4_wgmma_config(64 * 32, 32) == WgmmaConfig(128, 16, 16, 3, 8, 128, 128, 32, maxnreg2=128,
                                                          words_smem=True)
    q = _mxfp4_case(0, 2, 96, 64)
    words13, words2, gw = packed_words(q, "MMA")
    assert words13.shape == (2, 128, 12) and words2.shape == (2, 96, 8) and gw == 4 and words13.dtype == torch.int32
    x, slots, tw = torch.randn(1, 96), torch.zeros(1, 2, dtype=torch.long), torch.ones(1, 2)
    for fn in (packed_mma_experts, packed_wgmma_experts):
        with pytest.raises(TypeError, match="compute in bf16, got x of dtype torch.float32"):
            fn(x, slots, tw, q, Activation())
    # rows of whole 4-word vectors only (MXFP4's 16-byte blocks always are; an INT4 row padded by 2 words is not)
    q4 = int4_expert_weights(_weights(0, 2, 256, 128, False), 32)
    wide = torch.zeros(2, 256, 34, dtype=torch.int32)
    wide[:, :, :32] = q4.w13_packed
    odd = type(q4)(wide[:, :, :32], q4.w13_scale, q4.w2_packed, q4.w2_scale, group_size=32)
    with pytest.raises(ValueError, match=r"the MMA kernels read packed w13 rows of whole 4-word vectors, got word "
                                         r"strides \(8704, 34, 1\)"):
        packed_mma_experts(torch.randn(1, 256).bfloat16(), slots, tw, odd, Activation())
    # MXFP4 blocks and any scales: named where a row is not contiguous
    strided = type(q)(q.w13_blocks.transpose(0, 1).contiguous().transpose(0, 1), q.w13_scales, q.w2_blocks,
                      q.w2_scales, q.b13, q.b2)
    with pytest.raises(ValueError, match=r"the wgmma kernels read w13_blocks contiguous, got strides \(48, 96, 16, "
                                         r"1\)"):
        packed_wgmma_experts(x.bfloat16(), slots, tw, strided, Activation())
    cols = type(q4)(q4.w13_packed, q4.w13_scale.transpose(1, 2).contiguous().transpose(1, 2), q4.w2_packed,
                    q4.w2_scale, group_size=32)
    with pytest.raises(ValueError, match=r"the MMA kernels read the w13 scales of a row contiguous, got strides "
                                         r"\(2048, 1, 256\)"):
        packed_mma_experts(torch.randn(1, 256).bfloat16(), slots, tw, cols, Activation())


def _kernel_case(case: str, t: int, seed: int, device: str = "cuda"):
    """The inputs of the INT4 tensor-core kernels' GPU tests: ``(group, q, act, woi, x, slots, tw, ref)`` for ``t``
    tokens over 6 slots, top-8, in ``case`` (``silu_g128``, ``swiglu_bias_woi_g64``, or ``ragged_skip``: D of 136
    words and F of 68 words leave a part step in both kernels and F a part row tile, and half the pairs skip)."""
    s, k = 6, 8
    d, f = (1088, 544) if case.startswith("ragged") else (1024, 512)
    group = {"silu_g128": 128, "swiglu_bias_woi_g64": 64, "ragged_skip": 32}[case]
    q = _int4(seed, s, d, f, "bias" in case, group, torch.bfloat16, device)
    act = Activation("silu", 7.0) if "swiglu" in case else Activation()
    woi = "woi" in case
    x = torch.randn(t, d, device=device, dtype=torch.bfloat16)
    slots = torch.randint(0, s, (t, k), device=device)
    if "skip" in case:
        slots = torch.where(torch.rand(t, k, device=device) < 0.5, -1, slots)
        slots[0, 0] = 3
    tw = torch.rand(t, k, device=device)
    return group, q, act, woi, x, slots, tw, _ref(x, slots, tw, q, act, woi)


def _assert_replay_equals_eager(run, x: torch.Tensor) -> None:
    """``run()`` captured in a CUDA graph and replayed on new values of its input ``x`` equals it run eagerly
    (bitwise)."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run()
    x.copy_(torch.randn_like(x))
    graph.replay()
    assert torch.equal(captured, run())


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 5, 64])  # one row block per slot; several (9 and more pairs on a slot)
@pytest.mark.parametrize("case", ["silu_g128", "swiglu_bias_woi_g64", "ragged_skip"])
def test_int4_mma_path_on_gpu(t, case):
    from epmoe.experts.triton.w4a16_mma import packed_mma_experts
    from epmoe.experts.triton.w4a16_mma_config import MmaConfig

    group, q, act, woi, x, slots, tw, ref = _kernel_case(case, t, t + 7)
    # the default tiles (16-row blocks); capped registers; four warps and two 16-row tiles a warp in the down kernel;
    # one warp; 8- and 32-row blocks (at 64 tokens slots with 1-4 sub-blocks of rows)
    kw = max(16, group // 2)
    for cfg in (None, MmaConfig(block_kw1=kw, block_kw2=kw, maxnreg=168), MmaConfig(64, kw, 128, kw, 4),
                MmaConfig(16, kw, 16, 2 * kw, 1), MmaConfig(32, kw, 32, kw, 2, block_m=8),
                MmaConfig(16, kw, 64, kw, 1, block_m=32)):
        assert _rel(packed_mma_experts(x, slots, tw, q, act, woi, cfg), ref) < 1e-2, cfg
    _assert_replay_equals_eager(lambda: packed_mma_experts(x, slots, tw, q, act, woi), x)


def test_wgmma_tiles_by_size_and_their_checks():
    # plain Python (no Triton): the tiles the backend takes and the ones the kernels refuse, for groups of 64
    from epmoe.experts.triton.w4a16_wgmma_config import WgmmaConfig, check_wgmma_config, default_wgmma_config

    # 64-row blocks below 64 pairs a slot (and when the pairs are not known), 128-row blocks (their gate/up words
    # through shared memory) from there for groups of 32; down steps of at least 32 words; 32-row tails always
    assert default_wgmma_config(32) == WgmmaConfig(64, 16, 32, 3, 8, 128, 128, 32)
    assert default_wgmma_config(32, 64 * 48 - 1, 48) == WgmmaConfig(64, 16, 32, 3, 8, 128, 128, 32)
    assert default_wgmma_config(32, 64 * 48, 48) == WgmmaConfig(128, 16, 16, 3, 8, 128, 128, 32, maxnreg2=128,
                                                                 words_smem=True)
    assert default_wgmma_config(64, 10**6, 48) == WgmmaConfig(64, 32, 32, 3, 8, 128, 128, 32)
    assert default_wgmma_config(128, 10**6, 48) == WgmmaConfig(64, 64, 64, 3, 8, 128, 128, 32)
    for cfg in (default_wgmma_config(32, 10**6, 48), default_wgmma_config(64), default_wgmma_config(128)):
        check_wgmma_config(cfg, 2 * cfg.block_kw1)
    for cfg, message in [
        (WgmmaConfig(block_kw1=32, block_kw2=16), "block_kw2 must be 16, 32 or 64 words and at least half the group "
                                                  "size 64"),
        (WgmmaConfig(block_kw1=8), "block_kw1 must be 16, 32 or 64 words .* got 8"),
        (WgmmaConfig(block_kw1=1000), "block_kw1 must be 16, 32 or 64 words .* got 1000"),  # before its buffers
        (WgmmaConfig(block_m="128"), "block_m must be 64 or 128, got '128'"),
        (WgmmaConfig(block_m=32, block_kw1=32, block_kw2=32), "block_m must be 64 or 128, got 32"),
        (WgmmaConfig(block_kw1=32, block_kw2=32, tail_rows=48),
         r"tail_rows must be None, block_m / 2 or block_m / 4 \(block_m 128\).* 48"),
        (WgmmaConfig(64, 32, 32, tail_rows=16), r"tail_rows .* \(block_m 64\) and at least 32 .* got 16"),
        (WgmmaConfig(block_kw1=32, block_kw2=32, stages=2), "stages must be 3 or 4, got 2"),
        (WgmmaConfig(64, 64, 64, 4), "stages 4 x block_m 64 x block_kw 64 takes 262144 bytes of shared memory"),
        (WgmmaConfig(64, 32, 32, num_warps=2), r"num_warps must be 4 or 8 \(whole warpgroups\), got 2"),
        (WgmmaConfig(64, 32, 32, 3, 4, 64, 256), r"block_n2 must be 16 or 32 times num_warps \(4\), got 256"),
        # 262144 bytes of activation buffers and 262144 of word buffers (256 rows of gate and of up, 32 words, 4
        # stages)
        (WgmmaConfig(128, 32, 32, 4, 8, 256, 128, words_smem=True),
         "stages 4 x block_m 128 x block_kw 32 with words_smem takes 524288 bytes"),
        (WgmmaConfig(64, 32, 32, maxnreg2=16), "maxnreg2 must be None or 32 to 255 registers a thread, got 16"),
        (WgmmaConfig(64, 32, 32, maxnreg2=256), "maxnreg2 must be None or 32 to 255 registers a thread, got 256"),
    ]:
        with pytest.raises(ValueError, match=message):
            check_wgmma_config(cfg, 64)


@pytest.mark.interpret  # the kernel module needs Triton (absent from CPU-only installs)
def test_int4_wgmma_refuses_bad_input():
    from epmoe.experts.triton.w4a16_wgmma import packed_wgmma_experts
    from epmoe.experts.triton.w4a16_wgmma_config import WgmmaConfig

    q = int4_expert_weights(_weights(0, 2, 256, 128, False), 64)
    x, slots, tw = torch.randn(1, 256), torch.zeros(1, 2, dtype=torch.long), torch.ones(1, 2)
    with pytest.raises(TypeError, match="compute in bf16, got x of dtype torch.float32"):
        packed_wgmma_experts(x, slots, tw, q, Activation())
    # the tiles are checked against the weights' group size (64) before anything runs
    with pytest.raises(ValueError, match="block_kw2 must be 16, 32 or 64 words and at least half the group size 64"):
        packed_wgmma_experts(x.bfloat16(), slots, tw, q, Activation(), config=WgmmaConfig(block_kw1=32, block_kw2=16))


@pytest.mark.interpret
def test_int4_wgmma_operand_order():
    # the activations' operand-order copy puts every input where the down kernel's h store (_operand_position) and
    # the weights' relabelling (w4a16_mma.operand_order: memory word 2 R q + 2 r + h -> operand word 8 r + 4 h + q)
    # put it
    from epmoe.experts.triton.w4a16_wgmma import wgmma_planes

    for bkw in (16, 32, 64):
        r, k = bkw // 8, 8 * bkw + 40  # a whole step and a part step
        nib = torch.randint(0, 16, (3, k), dtype=torch.float64)
        x = torch.randn(2, k, dtype=torch.float64)
        xw = wgmma_planes(x, bkw)
        assert xw.shape == (2, 16 * bkw) and (xw == 0).sum().item() == 2 * (16 * bkw - k)  # zero padding
        acc = torch.zeros(3, 2, dtype=torch.float64)
        padded = torch.nn.functional.pad(nib, (0, 16 * bkw - k))
        for s in range(2):
            words = padded[:, 8 * bkw * s:8 * bkw * (s + 1)].view(3, 4, r, 2, 8).permute(0, 2, 3, 1, 4)
            words = words.reshape(3, bkw, 8)
            for j in range(4):
                a = torch.stack([words[:, :, j], words[:, :, j + 4]], -1).reshape(3, 2 * bkw)
                acc += a @ xw[:, 8 * bkw * s + 2 * bkw * j:8 * bkw * s + 2 * bkw * (j + 1)].T
        assert torch.allclose(acc, nib @ x.T)


_PROLOGUE_CASES = [(1, 8, 48), (8, 8, 384), (37, 4, 20), (300, 8, 16), (0, 8, 48)]


@pytest.mark.interpret
@pytest.mark.parametrize("t,k,s", _PROLOGUE_CASES)
def test_mma_prologue_equals_its_parts(t, k, s):
    _check_mma_prologue(t, k, s, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("t,k,s", _PROLOGUE_CASES)
def test_mma_prologue_equals_its_parts_on_gpu(t, k, s):
    _check_mma_prologue(t, k, s, "cuda")


def _check_mma_prologue(t, k, s, device):
    # the MMA path's one prologue launch writes what nibble_planes and the alignment give, and zeroes the counters,
    # also with no rows (300 tokens of 8 pairs: above align_kernels.one_program, the separate launches); the slots
    # a column slice of a wider tensor (not contiguous)
    from epmoe.experts.triton.align import align_reference
    from epmoe.experts.triton.w4a16_mma import mma_prologue, nibble_planes, plane_segment

    d = 200  # a plane segment of 64 elements, 50 of them inputs
    x = torch.randn(t, d, dtype=torch.float16, device=device)
    slots = torch.randint(-1, s, (t, k + 3), device=device)[:, :k]
    counters = (torch.full((5,), 7, dtype=torch.int32, device=device),
                torch.full((3,), 9, dtype=torch.int32, device=device))
    xq, aln = mma_prologue(x, slots, s, 16, counters)
    assert all(c.eq(0).all() for c in counters)
    seg = plane_segment(d)
    inputs = torch.arange(4 * seg) % seg < d // 4  # the planes' padding is never read
    assert torch.equal(xq[:, inputs], nibble_planes(x)[:, inputs])
    ref = align_reference(slots, s, 16, tail_rows=8)
    for name in ("block_slot", "block_start", "block_rows"):
        assert torch.equal(getattr(aln, name), getattr(ref, name)), name
    assert torch.equal(aln.sorted_pair_ids.sort().values, ref.sorted_pair_ids.sort().values)
    for slot in range(s):  # each slot's pairs in its own blocks (their order inside the slot's blocks may differ)
        blocks = (ref.block_slot == slot).nonzero().flatten().tolist()
        where = [i for b in blocks for i in range(int(ref.block_start[b]), int(ref.block_start[b] + ref.block_rows[b]))]
        assert sorted(aln.sorted_pair_ids[where].tolist()) == sorted(ref.sorted_pair_ids[where].tolist()), slot
    with pytest.raises(ValueError, match=r"tail_rows must be a positive divisor of block_m \(12\), got 8"):
        mma_prologue(x, slots, s, 12, counters)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [40, 300])  # partly filled 64/128-row blocks; several blocks a slot
@pytest.mark.parametrize("case", ["silu_g128", "swiglu_bias_woi_g64", "ragged_skip"])
def test_int4_wgmma_path_on_gpu(t, case):
    from epmoe.experts.triton.w4a16_wgmma import packed_wgmma_experts
    from epmoe.experts.triton.w4a16_wgmma_config import WgmmaConfig

    group, q, act, woi, x, slots, tw, ref = _kernel_case(case, t, t + 11)
    # the default tiles (two warpgroups); 64-row blocks; four buffers (three of 64-word steps fill shared memory);
    # 32-word steps in one kernel (64 for groups of 128); one warpgroup of 64 rows; one warpgroup issuing its wgmma
    # twice (128 rows) in the down kernel; 32-row tails (block_m 128: last blocks of 32, 64 or 96 rows; 64: of 32
    # rows), with two warpgroups and with one
    kw = max(16, group // 2)
    bm = 128 if kw == 16 else 64
    # the words staged through shared memory (three and four buffers) where the buffers fit: steps of 16 and 32 words
    # (and 64-row blocks of four)
    words = [WgmmaConfig(m, kw, kw, s, tail_rows=32, words_smem=True) for m, s in ((bm, 3), (bm, 4), (64, 4))
             if 16 * s * m * kw + s * 2 * 128 * kw * 4 <= 232448]
    assert len(words) == {16: 3, 32: 1, 64: 0}[kw], words
    for cfg in (None, WgmmaConfig(64, kw, kw), WgmmaConfig(bm, kw, kw, 4 if kw < 64 else 3),
                WgmmaConfig(64, max(32, kw), kw),
                WgmmaConfig(bm, kw, kw, 3, 4, 64, 64), WgmmaConfig(bm, kw, kw, 3, 4, 64, 128),
                WgmmaConfig(bm, kw, kw, tail_rows=32), WgmmaConfig(bm, kw, kw, 3, 4, 64, 128, tail_rows=32),
                *words):
        assert _rel(packed_wgmma_experts(x, slots, tw, q, act, woi, cfg), ref) < 1e-2, cfg
    _assert_replay_equals_eager(lambda: packed_wgmma_experts(x, slots, tw, q, act, woi), x)


@pytest.mark.gpu
def test_int4_wgmma_tail_blocks_on_gpu():
    # slots of 1, 33, 64, 65, 85 and 130 pairs and an empty one: with block_m 128 and 32-row tails, last blocks of
    # 32, 64, 96 (a 64-row and a 32-row wgmma on the same widened weights) and 128 rows; with 64-row tails or
    # block_m 64, the block boundaries at 32/33 and 64/65 rows; six pairs skipped; bias; Kimi-K2.5's groups of 32
    # (other groups, the routing weight on the input and ragged shapes with tails: test_int4_wgmma_path_on_gpu)
    from epmoe.experts.triton.align_kernels import align_triton
    from epmoe.experts.triton.w4a16_wgmma import packed_wgmma_experts
    from epmoe.experts.triton.w4a16_wgmma_config import WgmmaConfig

    counts, s, k, group = [1, 33, 64, 65, 85, 130, 0], 7, 8, 32
    g = torch.Generator().manual_seed(0)
    ids = torch.cat([torch.full((c,), i) for i, c in enumerate(counts)] + [torch.full((6,), -1)])
    slots = ids[torch.randperm(ids.numel(), generator=g)].view(-1, k).cuda()
    t, d, f = slots.shape[0], 1024, 512
    rows = align_triton(slots, s, 128, tail_rows=32).block_rows
    assert sorted(set(rows[rows > 0].tolist())) == [32, 64, 96, 128]
    q = _int4(group, s, d, f, True, group, torch.bfloat16, "cuda")
    act = Activation("silu", 7.0)
    x = torch.randn(t, d, device="cuda", dtype=torch.bfloat16)
    tw = torch.rand(t, k, device="cuda")
    configs = [WgmmaConfig(64, tail_rows=32), WgmmaConfig(tail_rows=64), WgmmaConfig(num_warps=4, block_n1=64,
               block_n2=128, tail_rows=32), WgmmaConfig(tail_rows=32)]
    ref = _ref(x, slots, tw, q, act, False)
    for cfg in configs:
        assert _rel(packed_wgmma_experts(x, slots, tw, q, act, False, cfg), ref) < 1e-2, cfg
    # replayed from a CUDA graph on new inputs (the pairs' order inside a slot, so which part of a block a pair is
    # computed in, may differ between runs: checked against the reference, not bitwise against an eager run)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = packed_wgmma_experts(x, slots, tw, q, act, False, configs[-1])
    x.copy_(torch.randn_like(x))
    graph.replay()
    assert _rel(captured, _ref(x, slots, tw, q, act, False)) < 1e-2

