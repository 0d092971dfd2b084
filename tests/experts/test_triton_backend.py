"""GPU-only checks of the Triton expert backend against the reference (marked ``gpu``: skipped without CUDA)."""

import pytest
import torch

from epmoe.experts import Activation, ExpertWeights, get_expert_backend, reference_experts
from epmoe.experts.triton.align import align_reference
from epmoe.experts.triton.pdl import pdl_launch

from ..late_writer import late_writer

pytestmark = pytest.mark.gpu


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def _weights(s, d, f, bias, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(s * 7 + d)
    w13 = torch.randn(s, 2 * f, d, device="cuda", generator=g) / d**0.5
    w2 = torch.randn(s, d, f, device="cuda", generator=g) / f**0.5
    b13 = torch.randn(s, 2 * f, device="cuda", generator=g) * 0.1 if bias else None
    b2 = torch.randn(s, d, device="cuda", generator=g) * 0.1 if bias else None
    def cast(t):
        return None if t is None else t.to(dtype)

    return ExpertWeights(cast(w13), cast(w2), cast(b13), cast(b2))


@pytest.mark.parametrize("t", [1, 5, 64, 300, 2048])
@pytest.mark.parametrize("case", ["silu", "gelu_woi", "swiglu_bias", "skip"])
def test_triton_matches_reference(t, case):
    s, d, f, k = 16, 512, 256, 4
    w = _weights(s, d, f, bias=case == "swiglu_bias")
    act = {"silu": Activation(), "gelu_woi": Activation("gelu"), "swiglu_bias": Activation("silu", 7.0),
           "skip": Activation()}[case]
    x = torch.randn(t, d, device="cuda", dtype=torch.bfloat16)
    slots = torch.randint(0, s, (t, k), device="cuda")
    if case == "skip":
        slots = torch.where(torch.rand(t, k, device="cuda") < 0.7, -1, slots)
        slots[0, 0] = 0  # at least one pair, so the reference is not all zeros (0/0 relative error)
    tw = torch.rand(t, k, device="cuda")
    woi = case == "gelu_woi"
    ref = reference_experts(x.double(), slots, tw.double(), ExpertWeights(
        w.w13.double(), w.w2.double(), None if w.b13 is None else w.b13.double(),
        None if w.b2 is None else w.b2.double()), act, woi)
    out = get_expert_backend("triton")(x, slots, tw, w, act, woi)
    assert _rel(out, ref) < 2e-2


def test_triton_alignment_groups_equal_reference():
    from epmoe.experts.triton.align_kernels import align_triton

    for t, bm, half in ((777, 16, False), (777, 64, False), (3, 16, False), (50, 16, False), (777, 64, True),
                        (50, 32, True), (5000, 128, True)):
        slots = torch.randint(-1, 32, (t, 8), device="cuda")
        a, b = align_triton(slots, 32, bm, half), align_reference(slots, 32, bm, half)
        assert torch.equal(a.block_slot, b.block_slot)
        assert torch.equal(a.block_start, b.block_start) and torch.equal(a.block_rows, b.block_rows)
        assert torch.equal(_placed_slot(a, slots), _placed_slot(b, slots))


def _placed_slot(aln, slots):
    """``[N]`` slot of the block each pair was placed in (-1 = not placed); each pair placed at most once."""
    n = slots.numel()
    ids = aln.sorted_pair_ids.long()
    real = ids < n
    pos = torch.arange(ids.numel(), device=ids.device)
    inside = (pos[:, None] >= aln.block_start[None, :]) & (pos[:, None] < (aln.block_start + aln.block_rows)[None, :])
    block = inside.int().argmax(dim=1)
    placed = torch.full((n,), -1, dtype=torch.int64, device=ids.device)
    placed[ids[real]] = aln.block_slot[block[real]].long()
    assert int(real.sum()) == int((slots >= 0).sum())
    assert torch.equal(placed, slots.reshape(-1))
    return placed


@pytest.mark.parametrize("t", [1, 2, 100])
def test_triton_fp8_matches_dequantized_reference(t):
    from epmoe.experts.fp8 import block_fp8_expert_weights

    s, d, f, k = 8, 512, 256, 4
    w = block_fp8_expert_weights(_weights(s, d, f, bias=False, dtype=torch.float32))
    x = torch.randn(t, d, device="cuda", dtype=torch.bfloat16)
    slots = torch.randint(0, s, (t, k), device="cuda")
    tw = torch.rand(t, k, device="cuda")
    deq = w.dequantize(torch.float64)
    ref = reference_experts(x.double(), slots, tw.double(), deq, Activation())
    out = get_expert_backend("triton")(x, slots, tw, w, Activation())
    assert _rel(out, ref) < 2e-2


def test_decode_path_is_reproducible_and_graph_safe():
    """The decode kernels (T * K <= 16) give bitwise equal results eagerly and from a CUDA graph."""
    s, d, f, k = 16, 512, 256, 8
    w = _weights(s, d, f, bias=True)
    act = Activation("silu", 7.0)
    x = torch.randn(2, d, device="cuda", dtype=torch.bfloat16)
    slots = torch.randint(-1, s, (2, k), device="cuda")
    tw = torch.rand(2, k, device="cuda")
    backend = get_expert_backend("triton")
    eager = backend(x, slots, tw, w, act)
    graph = torch.cuda.CUDAGraph()
    backend(x, slots, tw, w, act)
    with torch.cuda.graph(graph):
        static = backend(x, slots, tw, w, act)
    for _ in range(3):
        graph.replay()
        assert torch.equal(static, eager)


def test_decode_path_waits_for_a_late_router_in_a_graph():
    """The kernel before the decode kernels (where the router is) lets them start at once and writes the slots
    50 us later: the replay computes the slots written, not the -1s the buffer held (the gate/up launch lets the
    down launch, which reads the slots before its own wait, start only after its wait)."""
    from epmoe.experts.triton.decode import decode_experts
    from epmoe.experts.triton.grouped import act_code

    s, d, f, k = 16, 2048, 768, 8
    w = _weights(s, d, f, bias=False)
    act = Activation()
    x = torch.randn(1, d, device="cuda", dtype=torch.bfloat16)
    if not pdl_launch(x):
        pytest.skip("no programmatic dependent launch on this GPU or with EPMOE_PDL=0: the order it checks is moot")
    tw = torch.rand(1, k, device="cuda")
    routed = torch.randperm(s, device="cuda")[:k].view(1, k)
    slots = torch.full_like(routed, -1)

    def step():
        late_writer()[(1,)](routed, slots, k, 50_000, BLOCK=k)
        return decode_experts(x, slots, tw, w, act_code(act), act)

    want = decode_experts(x, routed, tw, w, act_code(act), act)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for _ in range(3):
        slots.fill_(-1)
        graph.replay()
        assert torch.equal(out, want)


@pytest.mark.parametrize("pdl", [True, False])
@pytest.mark.parametrize("t,k,d,f", [(1, 8, 512, 256), (3, 5, 600, 384), (2, 8, 7168, 2048)])
def test_decode_configs_match_reference(pdl, t, k, d, f):
    """Decode kernels with and without the programmatic dependent launch, ragged ``D``/``F``, skipped pairs."""
    from epmoe.experts.triton.decode import DecodeConfig, decode_experts
    from epmoe.experts.triton.grouped import act_code

    s = 4
    w = _weights(s, d, f, bias=True)
    act = Activation("silu", 7.0)
    x = torch.randn(t, d, device="cuda", dtype=torch.bfloat16)
    slots = torch.randint(-1, s, (t, k), device="cuda")
    slots[0, 0] = 1
    tw = torch.rand(t, k, device="cuda")
    ref = reference_experts(x.double(), slots, tw.double(), ExpertWeights(
        w.w13.double(), w.w2.double(), w.b13.double(), w.b2.double()), act)
    for cfg in (DecodeConfig(pdl=pdl), DecodeConfig(4, 1024, 16, 512, 8, pdl), DecodeConfig(pdl=pdl, max_programs=1),
                DecodeConfig(pdl=pdl, max_programs=100)):
        out = decode_experts(x, slots, tw, w, act_code(act), act, config=cfg)
        assert _rel(out, ref) < 2e-2


@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize("block_m", [64, 128])
@pytest.mark.parametrize("half", [False, True])
@pytest.mark.parametrize("t,d,f", [(700, 512, 256), (300, 520, 200)])
def test_grouped_tile_configs_match_reference(half, tma, block_m, t, d, f):
    """Grouped path at prefill tile shapes, with and without TMA, ragged ``D``/``F``, bias, skipped pairs."""
    from epmoe.experts.triton.grouped import TileConfig, triton_experts

    s, k = 8, 4
    w = _weights(s, d, f, bias=True)
    act = Activation("silu", 7.0)
    x = torch.randn(t, d, device="cuda", dtype=torch.bfloat16)
    slots = torch.where(torch.rand(t, k, device="cuda") < 0.3, -1, torch.randint(0, s, (t, k), device="cuda"))
    tw = torch.rand(t, k, device="cuda")
    ref = reference_experts(x.double(), slots, tw.double(), ExpertWeights(
        w.w13.double(), w.w2.double(), w.b13.double(), w.b2.double()), act)
    cfg = TileConfig(block_m, 128, 256, 64, 8, 3, tma, half)
    out = triton_experts(x, slots, tw, w, act, config=cfg)
    assert _rel(out, ref) < 2e-2
