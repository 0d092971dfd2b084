"""The fused Triton router (``routing.router_triton``) against the PyTorch router.

``interpret``: under the Triton interpreter on CPU (``TRITON_INTERPRET=1`` with a CPU Triton on the path),
real configs of every routing flavour the kernel serves; float32 logits (DeepSeek's router runs in float32)
and fp16 for the Qwen rounding. ``gpu``: on the GPU against the PyTorch router on the same GPU (bf16 and
float32 logits).

The gate in the router's launch (``route_gate_triton``) against ``F.linear`` then ``route_triton``: on inputs
whose logits are exact in float32 in any summation order (``_grid_router``), so the two must agree bit for bit
(experts, weights, slots, load counts), in the interpreter on the small configs and on the GPU on real widths,
there also inside a replayed CUDA graph.
"""

import json
import math
from pathlib import Path

import pytest
import torch

from epmoe.routing import Router
from epmoe.spec import parse_moe_spec

CONFIGS = Path(__file__).resolve().parents[2] / "data" / "configs"


@pytest.mark.interpret
@pytest.mark.parametrize("name,dtype", [
    ("deepseek-v3", torch.float32),          # sigmoid, correction bias, 8 groups by top-2 sum, top-8
    ("kimi-k2-instruct", torch.float32),     # sigmoid over 384 experts (not a power of two)
    ("deepseek-v2-lite", torch.float32),     # softmax, top-6, no renormalisation
    ("qwen3-30b-a3b", torch.float16),        # softmax, renormalised, rounded to the logits' dtype
    ("mixtral-8x7b", torch.float32),         # softmax top-2
])
def test_fused_router_matches_torch(name, dtype):
    from epmoe.routing.router import kernel_flags
    from epmoe.routing.router_triton import route_triton, supports

    spec = parse_moe_spec(json.loads((CONFIGS / f"{name}.config.json").read_text()), name)
    assert supports(spec.router_kind)
    router = Router(spec, dtype=dtype, impl="torch")
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        router.weight.normal_(0, 0.05, generator=gen)
        if router.e_score_correction_bias is not None:
            router.e_score_correction_bias.normal_(0, 0.1, generator=gen)
    x = torch.randn(37, spec.hidden_size, generator=gen).to(dtype)
    idx, w = router(x)
    logits = torch.nn.functional.linear(x.float() if router.fp32_logits else x, router.weight.to(
        torch.float32 if router.fp32_logits else dtype), router.bias)
    fidx, fw = route_triton(logits, router.e_score_correction_bias, **kernel_flags(spec))
    assert fidx.dtype == torch.int64 and fw.dtype == torch.float32
    # the chosen logits are the same multiset for every token (an exact tie at the k-th place, common in
    # fp16 logits, may be broken either way: the fused kernel takes the lower expert id)
    assert torch.equal(logits.gather(1, idx).sort(dim=1).values, logits.gather(1, fidx).sort(dim=1).values)
    order, forder = idx.sort(dim=1), fidx.sort(dim=1)
    same = (order.values == forder.values).all(dim=1)
    assert same.float().mean() > 0.9
    got, want = fw.gather(1, forder.indices)[same], w.gather(1, order.indices)[same]
    assert torch.allclose(got, want, rtol=2e-6 if dtype == torch.float32 else 1e-3, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["deepseek-v3", "kimi-k2-instruct", "qwen3-30b-a3b", "mixtral-8x7b",
                                  "deepseek-v2-lite", "glm-4.5", "gpt-oss-20b", "llama-4-scout-17b-16e-instruct"])
@pytest.mark.parametrize("t", [1, 8, 1000])
def test_fused_router_matches_torch_on_gpu(name, t):
    spec = parse_moe_spec(json.loads((CONFIGS / f"{name}.config.json").read_text()), name)
    # the top-k kernel on F.linear's logits (the gate in the kernel's launch: test_gate_fused_router_on_gpu)
    # float32 logits on the grid (their float32 product through bfloat16 pieces differs from F.linear's in the last
    # bits on random values, and may then choose another expert at a near tie: test_gate_logits_bf16_pieces_on_gpu)
    fused = Router(spec, dtype=torch.bfloat16, device="cuda", fused_gate_max_tokens=0)
    plain = Router(spec, dtype=torch.bfloat16, device="cuda", impl="torch")
    gen = torch.Generator(device="cuda").manual_seed(t)
    if fused.fp32_logits:
        fused.load_state_dict(_grid_router(spec, torch.bfloat16, "cuda", gen).state_dict())
    else:
        with torch.no_grad():
            fused.weight.normal_(0, 0.05, generator=gen)
            if fused.e_score_correction_bias is not None:
                fused.e_score_correction_bias.normal_(0, 0.1, generator=gen)
    plain.load_state_dict(fused.state_dict())
    x = (_grid_x(t, spec.hidden_size, torch.bfloat16, "cuda", gen) if fused.fp32_logits
         else torch.randn(t, spec.hidden_size, generator=gen, device="cuda").bfloat16())
    (fi, fw), (pi, pw) = fused(x), plain(x)
    logits = torch.nn.functional.linear(x.float(), fused.weight.float()) if fused.fp32_logits else \
        torch.nn.functional.linear(x, fused.weight, fused.bias)
    # the same chosen logits for every token (exact ties at the k-th place may be broken differently)
    assert torch.equal(logits.gather(1, fi).sort(dim=1).values, logits.gather(1, pi).sort(dim=1).values)
    fo, po = fi.sort(dim=1), pi.sort(dim=1)
    same = (fo.values == po.values).all(dim=1)
    assert same.float().mean() >= 0.95
    assert torch.allclose(fw.gather(1, fo.indices)[same], pw.gather(1, po.indices)[same], rtol=1e-5, atol=1e-7)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["deepseek-v3", "kimi-k2-instruct"])
def test_gate_logits_bf16_pieces_on_gpu(name):
    """Above the fused gate's tokens a float32-logit router multiplies bf16 rows by its weight's bfloat16 pieces:
    three for random float32 values, one for a bf16 checkpoint's gate, each within float32 accumulation of the
    exact product; a router whose first call is a CUDA-graph capture keeps the float32 product there."""
    import torch.nn.functional as F

    spec = parse_moe_spec(json.loads((CONFIGS / f"{name}.config.json").read_text()), name)
    router = Router(spec, dtype=torch.bfloat16, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(2)
    with torch.no_grad():
        router.weight.normal_(0, 0.05, generator=gen)
    x = torch.randn(64, spec.hidden_size, generator=gen, device="cuda").bfloat16()

    def check(pieces: int) -> None:
        got = router._gate_logits(x).double()
        w = router.weight.double()
        exact = F.linear(x.double(), w)
        bound = 2e-6 * F.linear(x.double().abs(), w.abs())  # float32 sums; two pieces would be ~4x over
        assert router._pieces[1].shape[0] == pieces
        assert ((got - exact).abs() <= bound).all(), (got - exact).abs().max()

    check(3)
    with torch.no_grad():
        router.weight.copy_(router.weight.bfloat16().float())  # a new version of the weight: pieces made again
    check(1)

    fresh = Router(spec, dtype=torch.bfloat16, device="cuda")
    fresh.load_state_dict(router.state_dict())
    out = torch.empty(64, spec.num_experts, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(fresh._gate_logits(x))
    graph.replay()
    assert fresh._pieces is None
    assert torch.equal(out, F.linear(x.float(), fresh.weight))

    cast = fresh.to(torch.bfloat16)  # a weight no longer float32 (a model cast whole): F.linear widens it, as before
    assert torch.equal(cast._gate_logits(x), cast._logits(x)) and cast._pieces is None


def _slots_and_record(device: str) -> None:
    """``route_to_slots``: the same slots as ``SlotMap`` on the routed ids and the same counts as the recorder's
    ``record`` (with and without a row mask), in the fused launch."""
    from epmoe.loads import ExpertLoadRecorder, LoadRecord
    from epmoe.routing.router import kernel_flags
    from epmoe.routing.router_triton import route_triton

    spec = parse_moe_spec(json.loads((CONFIGS / "deepseek-v3.config.json").read_text()), "deepseek-v3")
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(23, spec.num_experts, generator=gen).to(device)
    bias = (torch.randn(spec.num_experts, generator=gen) * 0.1).to(device)
    table = torch.randperm(spec.num_experts + 40, generator=gen)[: spec.num_experts].to(device)  # 40 spare slots
    ref = ExpertLoadRecorder(num_layers=3, num_slots=spec.num_experts + 40, window=2)
    got = ExpertLoadRecorder(num_layers=3, num_slots=spec.num_experts + 40, window=2, device=device)
    mask = (torch.rand(23, generator=gen) > 0.4).long()
    for layer, m in ((0, None), (2, mask)):
        ref.mask_rows(m)
        got.mask_rows(None if m is None else m.to(device))
        record = got.load_record(layer, 23) if device == "cuda" else LoadRecord(got._counts, got._pos, layer,
                                                                                 got._row_mask)
        idx, w, slots = route_triton(logits, bias, **kernel_flags(spec), slot_table=table, record=record)
        plain_idx, plain_w = route_triton(logits, bias, **kernel_flags(spec))
        assert torch.equal(idx, plain_idx) and torch.equal(w, plain_w)
        assert torch.equal(slots, table[idx])
        ref.record(layer, slots.cpu())
        assert torch.equal(got._counts.cpu(), ref._counts), layer
    assert ref._counts.sum() == 23 * spec.top_k + int(mask.sum()) * spec.top_k


@pytest.mark.interpret
def test_fused_slots_and_load_record_interpreter():
    _slots_and_record("cpu")


@pytest.mark.gpu
def test_fused_slots_and_load_record_gpu():
    _slots_and_record("cuda")


def _tiny_spec(family: str, **overrides):
    from epmoe.models.tiny import _COMMON, TINY_FAMILIES

    return parse_moe_spec({**_COMMON, **TINY_FAMILIES[family], **overrides}, family)


def _grid_router(spec, dtype, device, gen, bias: bool = False) -> Router:
    """A router (``impl='torch'``) whose weight is multiples of ``1/(64 s)`` up to ``1/(4 s)`` (``s`` the power of two
    nearest ``sqrt(D / 64)``, so the logits keep their spread at any width) and bias multiples of 1/8: with
    ``_grid_x`` every product and partial sum of a logit is exact in float32 (under ``D * 2**7`` units of
    ``2**-9 / s``), so any summation order gives the same logits."""
    router = Router(spec, dtype=dtype, device=device, impl="torch")
    s = 2.0 ** round(math.log2(math.sqrt(spec.hidden_size / 64)))
    with torch.no_grad():
        router.weight.copy_(torch.randint(-16, 17, router.weight.shape, generator=gen, device=device) / (64 * s))
        if bias:
            router.bias = torch.nn.Parameter(
                (torch.randint(-16, 17, (spec.num_experts,), generator=gen, device=device) / 8).to(dtype),
                requires_grad=False)
        if router.e_score_correction_bias is not None:
            router.e_score_correction_bias.normal_(0, 0.1, generator=gen)
    return router


def _grid_x(t: int, d: int, dtype, device, gen) -> torch.Tensor:
    """``[t, d]`` hidden states, multiples of 1/8 up to 1 (see ``_grid_router``)."""
    return (torch.randint(-8, 9, (t, d), generator=gen, device=device) / 8).to(dtype)


def _gate_fused_vs_two_launch(router: Router, x: torch.Tensor, arrivals: torch.Tensor, row_mask) -> tuple:
    """``route_gate_triton`` against ``F.linear`` + ``route_triton`` on the same tokens, both with a slot table and
    a load record; asserts they agree exactly and the arrival counters are back at 0; returns the fused outputs and
    counts."""
    from epmoe.loads import LoadRecord
    from epmoe.routing.router import kernel_flags
    from epmoe.routing.router_triton import route_gate_triton, route_triton

    spec, dev = router.spec, x.device
    e, p = spec.num_experts, spec.num_experts + 5
    table = torch.randperm(p, generator=torch.Generator().manual_seed(x.shape[0]))[:e].to(dev)
    counts = [torch.zeros(2, 3, p + 1, dtype=torch.int64, device=dev) for _ in range(2)]
    pos = torch.ones(1, dtype=torch.int64, device=dev)
    flags = kernel_flags(spec)
    two = route_triton(router._logits(x), router.e_score_correction_bias, **flags, slot_table=table,
                       record=LoadRecord(counts[0], pos, 2, row_mask))
    one = route_gate_triton(x, router.weight, router.bias, arrivals, router.e_score_correction_bias,
                            fp32_logits=router.fp32_logits, **flags, slot_table=table,
                            record=LoadRecord(counts[1], pos, 2, row_mask))
    for a, b in zip(one, two):
        assert torch.equal(a, b)
    assert torch.equal(one[2], table[one[0]])
    assert torch.equal(counts[0], counts[1])
    rows = torch.ones(x.shape[0], dtype=torch.int64, device=dev) if row_mask is None else row_mask
    want = torch.bincount(one[2][rows.bool()].flatten(), minlength=p + 1)
    assert torch.equal(counts[1][1, 2], want) and counts[1].sum() == want.sum() == int(rows.sum()) * spec.top_k
    assert not arrivals.any()
    return one, counts[1]


GATE_CASES = [
    ("qwen3-moe", torch.bfloat16, torch.bfloat16, {}),     # softmax, renormalised, logits and weights rounded
    ("qwen3-moe", torch.float32, torch.float32, {}),
    ("qwen3-moe", torch.float32, torch.float32, {"router_bias": True}),  # a gate bias (gpt-oss has one)
    ("deepseek-v3", torch.bfloat16, torch.bfloat16, {}),   # fp32 logits of bf16 x, sigmoid, groups, correction bias
    ("deepseek-v3", torch.bfloat16, torch.bfloat16, {"router_bias": True}),  # a bf16 gate bias widened too
]


@pytest.mark.interpret
@pytest.mark.parametrize("family,dtype,x_dtype,overrides", GATE_CASES)
def test_gate_fused_matches_two_launch_interpreter(family, dtype, x_dtype, overrides):
    """The gate in the router's launch chooses, weighs, maps and counts exactly as ``F.linear`` then the router
    kernel; two calls in a row (the counters were reset), 1 and 3 tokens, with and without a row mask."""
    spec = _tiny_spec(family, **overrides)
    gen = torch.Generator().manual_seed(11)
    router = _grid_router(spec, dtype, "cpu", gen, bias=bool(overrides))
    assert (router.bias is not None) == bool(overrides) and router.fp32_logits == (family == "deepseek-v3")
    arrivals = torch.zeros(4, dtype=torch.int32)
    for t, row_mask in ((1, None), (3, torch.tensor([1, 0, 1])), (3, None)):
        x = _grid_x(t, spec.hidden_size, x_dtype, "cpu", gen)
        _gate_fused_vs_two_launch(router, x, arrivals, row_mask)


@pytest.mark.interpret
@pytest.mark.parametrize("family,dtype", [("gpt-oss", torch.bfloat16), ("gpt-oss", torch.float32),
                                          ("llama4", torch.bfloat16)])
def test_chosen_logit_kinds_interpreter(family, dtype):
    """gpt-oss's ``topk_softmax`` (with its gate bias) and Llama-4's ``topk_sigmoid`` in the fused kernels: the gate
    in the router's launch routes, weighs, maps and counts exactly as ``F.linear`` then the router kernel, and both
    choose the PyTorch router's logits with its weights (float32: to float32 rounding; bfloat16: both round the same
    float32 values, so at most one unit of bfloat16 apart). The weights are a function of the chosen logits alone,
    so they are compared as sorted rows (exact ties of grid logits may be broken either way)."""
    spec = _tiny_spec(family)
    assert spec.router_kind == {"gpt-oss": "topk_softmax", "llama4": "topk_sigmoid"}[family]
    gen = torch.Generator().manual_seed(5)
    router = _grid_router(spec, dtype, "cpu", gen, bias=spec.router_bias)
    assert (router.bias is not None and bool(router.bias.any())) == (family == "gpt-oss")
    arrivals = torch.zeros(4, dtype=torch.int32)
    for t, row_mask in ((1, None), (3, torch.tensor([1, 0, 1])), (4, None)):
        x = _grid_x(t, spec.hidden_size, dtype, "cpu", gen)
        (idx, w, _), _ = _gate_fused_vs_two_launch(router, x, arrivals, row_mask)
        want_idx, want_w = router(x)
        logits = router._logits(x)
        assert torch.equal(logits.gather(1, idx).sort(dim=1).values, logits.gather(1, want_idx).sort(dim=1).values)
        got, want = w.sort(dim=1).values, want_w.sort(dim=1).values
        assert torch.allclose(got, want, rtol=1e-6 if dtype == torch.float32 else 2 ** -7, atol=0), (got, want)
        if family == "gpt-oss":
            assert torch.allclose(w.sum(dim=1), torch.ones(t), rtol=0, atol=1e-6 if dtype == torch.float32 else 1e-2)


@pytest.mark.interpret
def test_chosen_logit_routing_has_no_groups():
    from epmoe.routing.router_triton import route_triton

    with pytest.raises(ValueError, match="route_triton: chosen-logit routing .* has no expert groups, got n_group=4"):
        route_triton(torch.zeros(2, 8), None, top_k=2, sigmoid=False, n_group=4, topk_group=2, top2_sum=False,
                     normalize=False, round_weights=False, scale=1.0, chosen=True)


@pytest.mark.interpret
@pytest.mark.parametrize("family", ["qwen3-moe", "deepseek-v3"])
def test_row_mask_routes_padding_rows_nowhere_interpreter(family):
    """A routing row mask (the engine's padding rows): masked rows keep their experts and weights but get slots -1
    and are not counted, in both kernels; the mask replaces the record's own."""
    from epmoe.loads import LoadRecord
    from epmoe.routing.router import kernel_flags
    from epmoe.routing.router_triton import route_gate_triton, route_triton

    spec = _tiny_spec(family)
    gen = torch.Generator().manual_seed(3)
    router = _grid_router(spec, torch.float32, "cpu", gen)
    x = _grid_x(4, spec.hidden_size, torch.float32, "cpu", gen)
    e, p = spec.num_experts, spec.num_experts + 5
    table = torch.randperm(p, generator=gen)[:e]
    flags = kernel_flags(spec)
    mask = torch.tensor([1, 0, 1, 0])
    arrivals = torch.zeros(4, dtype=torch.int32)
    gate = (x, router.weight, None, arrivals, router.e_score_correction_bias)
    idx, w, slots = route_gate_triton(*gate, fp32_logits=router.fp32_logits, **flags, slot_table=table)
    for fused in (True, False):
        counts = torch.zeros(2, 3, p + 1, dtype=torch.int64)
        record = LoadRecord(counts, torch.ones(1, dtype=torch.int64), 2, torch.ones(4, dtype=torch.int64))
        if fused:
            got = route_gate_triton(*gate, fp32_logits=router.fp32_logits, **flags, slot_table=table, record=record,
                                    row_mask=mask)
        else:
            got = route_triton(router._logits(x), router.e_score_correction_bias, **flags, slot_table=table,
                               record=record, row_mask=mask)
        assert torch.equal(got[0], idx) and torch.equal(got[1], w)
        assert torch.equal(got[2], torch.where(mask.bool()[:, None], slots, -1))
        assert torch.equal(counts[1, 2], torch.bincount(slots[mask.bool()].flatten(), minlength=p + 1))
    with pytest.raises(ValueError, match=r"a \[T\] int64 row_mask: 4 tokens, row_mask \(4,\) torch.float32"):
        route_triton(router._logits(x), None, **flags, slot_table=table, row_mask=mask.float())
    with pytest.raises(ValueError, match="masks rows only with a slot_table"):
        route_triton(router._logits(x), None, **flags, row_mask=mask)


@pytest.mark.interpret
def test_gate_fused_random_float32_interpreter():
    """Unquantized float32 values (the logits then differ in the last bits with the summation order): the same
    experts and slots, weights within float32 rounding."""
    from epmoe.routing.router import kernel_flags
    from epmoe.routing.router_triton import route_gate_triton, route_triton

    spec = _tiny_spec("deepseek-v3")
    router = Router(spec, impl="torch")
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        router.weight.normal_(0, 0.3, generator=gen)
        router.e_score_correction_bias.normal_(0, 0.1, generator=gen)
    x = torch.randn(3, spec.hidden_size, generator=gen)
    flags = kernel_flags(spec)
    idx, w = route_gate_triton(x, router.weight, None, torch.zeros(3, dtype=torch.int32),
                               router.e_score_correction_bias, fp32_logits=True, **flags)
    ref_idx, ref_w = route_triton(router._logits(x), router.e_score_correction_bias, **flags)
    assert torch.equal(idx, ref_idx)
    assert torch.allclose(w, ref_w, rtol=2e-6, atol=0)


@pytest.mark.interpret
def test_gate_fused_rejects_bad_input():
    from epmoe.routing.router import kernel_flags
    from epmoe.routing.router_triton import route_gate_triton

    spec = _tiny_spec("qwen3-moe")
    router = Router(spec, dtype=torch.bfloat16, impl="torch")
    x = torch.zeros(3, spec.hidden_size, dtype=torch.bfloat16)
    flags = kernel_flags(spec)
    with pytest.raises(ValueError, match="3 tokens, arrivals \\(2,\\)"):
        route_gate_triton(x, router.weight, None, torch.zeros(2, dtype=torch.int32), None, fp32_logits=False, **flags)
    with pytest.raises(ValueError, match="torch.float32.*torch.bfloat16"):
        route_gate_triton(x.float(), router.weight, None, torch.zeros(3, dtype=torch.int32), None,
                          fp32_logits=False, **flags)
    with pytest.raises(ValueError, match="do not fit x \\(3, 32\\)"):
        route_gate_triton(x[:, :32], router.weight, None, torch.zeros(3, dtype=torch.int32), None,
                          fp32_logits=False, **flags)


def test_router_fused_gate_max_tokens_checked():
    from epmoe.routing.router import FUSED_GATE_MAX_TOKENS

    spec = _tiny_spec("qwen3-moe")
    assert Router(spec).fused_gate_max_tokens == FUSED_GATE_MAX_TOKENS
    assert Router(spec, fused_gate_max_tokens=0).fused_gate_max_tokens == 0
    with pytest.raises(ValueError, match=f"fused_gate_max_tokens must be in \\[0, {FUSED_GATE_MAX_TOKENS}\\], got 17"):
        Router(spec, fused_gate_max_tokens=FUSED_GATE_MAX_TOKENS + 1)


@pytest.fixture
def exact_bf16_matmul():
    """cuBLAS without bf16 reductions of split-K partial sums (``F.linear``'s bf16 logits then are the float32 sums
    rounded once, as the fused gate's)."""
    old = torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    yield
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = old


def _assert_same_routing(a: torch.Tensor, b: torch.Tensor) -> None:
    """Experts and slots equal; weights equal up to float32 summation order (the two kernels may run their
    reductions over different warp counts)."""
    if a.is_floating_point():
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-9)
    else:
        assert torch.equal(a, b)


def _two_launch(router: Router, x: torch.Tensor, table: torch.Tensor, recorder) -> tuple:
    """``router.route_to_slots`` through ``F.linear`` then ``route_triton`` (and ``forward``'s result)."""
    limit = router.fused_gate_max_tokens
    router.fused_gate_max_tokens = 0
    try:
        return router.route_to_slots(x, table, recorder.load_record(1, x.shape[0])), router(x)
    finally:
        router.fused_gate_max_tokens = limit


@pytest.mark.gpu
@pytest.mark.parametrize("name,dtype", [("qwen3-30b-a3b", torch.bfloat16), ("qwen3-30b-a3b", torch.float32),
                                        ("deepseek-v3", torch.bfloat16), ("kimi-k2-instruct", torch.bfloat16),
                                        ("gpt-oss-20b", torch.bfloat16)])
def test_gate_fused_router_on_gpu(name, dtype, exact_bf16_matmul):
    """``Router`` on CUDA at real widths, up to ``FUSED_GATE_MAX_TOKENS`` tokens: the gate in the router's launch
    routes, maps and counts exactly as the two launches, eagerly and as a CUDA graph replayed with new inputs
    (also for a router whose first call is the capture)."""
    from epmoe.loads import ExpertLoadRecorder
    from epmoe.routing.router import FUSED_GATE_MAX_TOKENS

    spec = parse_moe_spec(json.loads((CONFIGS / f"{name}.config.json").read_text()), name)
    gen = torch.Generator(device="cuda").manual_seed(7)
    router = _grid_router(spec, dtype, "cuda", gen, bias=spec.router_bias)
    router.impl = "auto"
    p = spec.num_experts + 8
    table = torch.randperm(p, device="cuda", generator=gen)[: spec.num_experts]
    recorders = [ExpertLoadRecorder(num_layers=2, num_slots=p, window=2, device="cuda") for _ in range(2)]
    for t in (1, 3, FUSED_GATE_MAX_TOKENS):
        x = _grid_x(t, spec.hidden_size, dtype, "cuda", gen)
        one = router.route_to_slots(x, table, recorders[0].load_record(1, t)), router(x)
        two = _two_launch(router, x, table, recorders[1])
        for a, b in zip(one[0] + one[1], two[0] + two[1]):
            _assert_same_routing(a, b)
        assert torch.equal(one[0][2], table[one[0][0]])
        assert torch.equal(recorders[0].current_counts(), recorders[1].current_counts()), t
        assert not router._arrivals.any()

    fresh = Router(spec, dtype=dtype, device="cuda")  # its first call is captured: counters zeroed in the graph
    fresh.load_state_dict(router.state_dict())
    for graphed in (router, fresh):
        for rec in recorders:
            rec.reset()
        static_x = _grid_x(3, spec.hidden_size, dtype, "cuda", gen)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = graphed.route_to_slots(static_x, table, recorders[0].load_record(1, 3))
        for _ in range(2):
            static_x.copy_(_grid_x(3, spec.hidden_size, dtype, "cuda", gen))
            graph.replay()
            two = _two_launch(router, static_x, table, recorders[1])
            for a, b in zip(out, two[0]):
                _assert_same_routing(a, b)
        assert torch.equal(recorders[0].current_counts(), recorders[1].current_counts())
        assert recorders[0].current_counts().sum() == 2 * 3 * spec.top_k
        torch.cuda.synchronize()
    assert fresh._arrivals is None  # the captured counters were not kept for eager calls
    x = _grid_x(2, spec.hidden_size, dtype, "cuda", gen)
    assert all(torch.equal(a, b) for a, b in zip(fresh(x), router(x)))
    assert not fresh._arrivals.any()


@pytest.mark.interpret
@pytest.mark.parametrize("family,dtype", [("qwen3-moe", torch.float32), ("qwen3-moe", torch.float16),
                                          ("deepseek-v3", torch.float16)])  # the interpreter has no bf16 norm
@pytest.mark.parametrize("weight_then_cast", [False, True])
def test_gate_fused_with_the_norm_before_it_interpreter(family, dtype, weight_then_cast):
    """``route_gate_triton(..., norm=NormBefore(...))`` of a block's output row and the residual routes, weighs,
    maps and counts as the fused norm (``FusedRMSNorm.add_forward``) then the router do, and writes the same sum
    and normalised row, bit for bit; the arrival counters are back at 0."""
    from epmoe.engine.fused_norm import FusedRMSNorm
    from epmoe.loads import LoadRecord
    from epmoe.routing.router import kernel_flags
    from epmoe.routing.router_triton import NormBefore, route_gate_triton

    spec = _tiny_spec(family)
    gen = torch.Generator().manual_seed(5)
    router = _grid_router(spec, dtype, "cpu", gen)
    d, e, p = spec.hidden_size, spec.num_experts, spec.num_experts + 5
    norm_weight = (torch.rand(d, generator=gen) + 0.5).to(torch.float32 if weight_then_cast else dtype)
    norm = FusedRMSNorm(torch.nn.Parameter(norm_weight, requires_grad=False), 1e-6, weight_then_cast)
    a = (torch.randn(1, d, generator=gen) * 3).to(dtype)
    r = (torch.randn(1, d, generator=gen) * 5).to(dtype)
    normed, summed = norm.add_forward(a, r)
    if weight_then_cast:
        normed = normed.to(dtype)
    table = torch.randperm(p, generator=gen)[:e]
    flags = kernel_flags(spec)
    arrivals = torch.zeros(2, dtype=torch.int32)
    counts = [torch.zeros(2, 3, p + 1, dtype=torch.int64) for _ in range(2)]
    pos = torch.ones(1, dtype=torch.int64)
    gate = (router.weight, router.bias, arrivals, router.e_score_correction_bias)
    want = route_gate_triton(normed, *gate, fp32_logits=router.fp32_logits, **flags, slot_table=table,
                             record=LoadRecord(counts[0], pos, 1, None))
    before = NormBefore(r, norm.weight, 1e-6, weight_then_cast, torch.empty_like(a), torch.full_like(a, 7))
    got = route_gate_triton(a, *gate, fp32_logits=router.fp32_logits, **flags, slot_table=table,
                            record=LoadRecord(counts[1], pos, 1, None), norm=before)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    assert torch.equal(counts[0], counts[1]) and counts[1].sum() == spec.top_k
    assert torch.equal(before.summed, summed) and torch.equal(before.normed, normed)
    assert not arrivals.any()


@pytest.mark.interpret  # router_triton imports Triton
def test_norm_before_refuses_what_does_not_fit_by_name():
    from epmoe.routing.router_triton import NormBefore

    x = torch.zeros(1, 64, dtype=torch.bfloat16)
    ok = dict(residual=x.clone(), weight=torch.ones(64, dtype=torch.bfloat16), eps=1e-6, weight_then_cast=False,
              summed=x.clone(), normed=x.clone())
    NormBefore(**ok).check(x)
    NormBefore(**{**ok, "weight": torch.ones(64), "weight_then_cast": True}).check(x)
    with pytest.raises(ValueError, match="normalises one token's row, got 2 tokens"):
        NormBefore(**ok).check(torch.zeros(2, 64, dtype=torch.bfloat16))
    shared = torch.zeros(1, 64, dtype=torch.bfloat16)
    bad = {
        r"norm: residual \(1, 64\) torch.float32 on cpu strides .* must match x \(1, 64\) torch.bfloat16":
            dict(residual=x.float()),
        r"norm: summed \(1, 32\)": dict(summed=x[:, :32]),
        r"norm: normed \(1, 64\) .* contiguous":
            dict(normed=torch.zeros(64, 2, dtype=torch.bfloat16)[:, 0].view(1, 64)),
        r"norm: weight \(64,\) torch.float32 on cpu must be a contiguous \[64\] float tensor":
            dict(weight=torch.ones(64)),
        r"norm: normed shares memory with summed": dict(summed=shared, normed=shared),
        r"norm: summed shares memory with x": dict(summed=x),
        r"norm: eps must be a finite real number >= 0, got inf": dict(eps=float("inf")),
        r"norm: summed must be a torch.Tensor, got NoneType": dict(summed=None),
        r"norm: weight_then_cast must be a bool, got 1": dict(weight_then_cast=1),
    }
    for message, change in bad.items():
        with pytest.raises((TypeError, ValueError), match=message):
            NormBefore(**{**ok, **change}).check(x)


def test_router_folds_norm_only_where_the_fused_gate_routes_one_row():
    """On the CPU (no fused router) never; ``route_folded`` then refuses by name rather than computing another
    way."""
    spec = _tiny_spec("qwen3-moe")
    router = Router(spec, dtype=torch.bfloat16)
    x = torch.zeros(1, spec.hidden_size, dtype=torch.bfloat16)
    w = torch.ones(spec.hidden_size, dtype=torch.bfloat16)
    assert not router.folds_norm(x, w, False)
    with pytest.raises(ValueError, match="the fused router does not fold this norm"):
        router.route_folded(x, x, w, 1e-6, False, x.clone(), torch.arange(spec.num_experts))
    with pytest.raises(ValueError, match="with a norm weight NoneType"):
        router.route_folded(x, x, None, 1e-6, False, x.clone(), torch.arange(spec.num_experts))
    with pytest.raises(ValueError, match="needs the layer's slot table, got NoneType"):
        router.route_folded(x, x, w, 1e-6, False, x.clone(), None)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "deepseek-v3", "gpt-oss-20b"])
def test_route_folded_on_gpu(name):
    """``Router.route_folded`` on CUDA at real widths (bf16 rows): the same experts, weights, slots and counts as
    ``FusedRMSNorm.add_forward`` then ``route_to_slots``, the same sum and normalised row, eagerly and replayed in a
    CUDA graph on new rows. The rows are multiples of 1/8 (their squares' sums exact in float32 in any order), so
    the two launches' different reductions give the same norm."""
    from epmoe.engine.fused_norm import FusedRMSNorm
    from epmoe.loads import ExpertLoadRecorder

    spec = parse_moe_spec(json.loads((CONFIGS / f"{name}.config.json").read_text()), name)
    gen = torch.Generator(device="cuda").manual_seed(9)
    router = _grid_router(spec, torch.bfloat16, "cuda", gen, bias=spec.router_bias)
    router.impl = "auto"
    d = spec.hidden_size
    norm = FusedRMSNorm(torch.nn.Parameter(torch.rand(d, device="cuda", generator=gen).to(torch.bfloat16) + 0.5,
                                           requires_grad=False), 1e-6)
    p = spec.num_experts + 8
    table = torch.randperm(p, device="cuda", generator=gen)[: spec.num_experts]
    recorders = [ExpertLoadRecorder(num_layers=2, num_slots=p, window=2, device="cuda") for _ in range(2)]
    a = _grid_x(1, d, torch.bfloat16, "cuda", gen)
    r = _grid_x(1, d, torch.bfloat16, "cuda", gen)
    assert router.folds_norm(a, norm.weight, False)
    assert not router.folds_norm(torch.cat([a, a]), norm.weight, False)  # one row only

    def folded():
        summed = torch.empty_like(a)
        return router.route_folded(a, r, norm.weight, norm.eps, False, summed, table,
                                   recorders[0].load_record(1, 1)), summed

    def unfolded():
        normed, summed = norm.add_forward(a, r)
        return router.route_to_slots(normed, table, recorders[1].load_record(1, 1)), normed, summed

    (*got, got_normed), got_sum = folded()
    want, want_normed, want_sum = unfolded()
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    assert torch.equal(got_normed, want_normed) and torch.equal(got_sum, want_sum)
    assert torch.equal(recorders[0].current_counts(), recorders[1].current_counts())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        (*g_out, g_normed), g_sum = folded()
    for _ in range(2):
        a.copy_(_grid_x(1, d, torch.bfloat16, "cuda", gen))
        r.copy_(_grid_x(1, d, torch.bfloat16, "cuda", gen))
        graph.replay()
        want, want_normed, want_sum = unfolded()
        for g, w in zip(g_out, want):
            assert torch.equal(g, w)
        assert torch.equal(g_normed, want_normed) and torch.equal(g_sum, want_sum)
    assert not router._arrivals.any()


def test_bfloat16_pieces_sum_exactly():
    """The fewest bfloat16 pieces summing to a float32 weight exactly: one for bf16 values, three for random float32
    values; none where three leave a residual (a value below bfloat16's normal range, a non-finite one); a weight
    that is not 2-D float32 is refused by name."""
    from epmoe.routing.router import MAX_BF16_PIECES, bfloat16_pieces

    w = torch.randn(24, 40, generator=torch.Generator().manual_seed(0)) * 0.05
    pieces = bfloat16_pieces(w)
    assert pieces.dtype == torch.bfloat16 and pieces.shape == (MAX_BF16_PIECES, 24, 40)
    assert torch.equal(pieces.float().sum(0), w)
    assert not torch.equal(pieces[:2].float().sum(0), w)
    one = bfloat16_pieces(w.bfloat16().float())
    assert one.shape == (1, 24, 40) and torch.equal(one[0], w.bfloat16())
    two = w.bfloat16().float() + (w - w.bfloat16().float()).bfloat16().float()
    assert bfloat16_pieces(two).shape[0] == 2
    assert bfloat16_pieces(torch.full((2, 2), 1.0 + 2.0 ** -23) * 2.0 ** -120) is None
    assert bfloat16_pieces(torch.tensor([[1.0, float("inf")]])) is None
    assert bfloat16_pieces(torch.tensor([[3.3963e38]])) is None  # the first piece would round past bfloat16's range
    for bad, shown in ((w.double(), "torch.float64"), (w[0], r"\(40,\)"), ([1.0], "list")):
        with pytest.raises(ValueError, match=f"bfloat16_pieces needs a 2-D float32 weight, got .*{shown}"):
            bfloat16_pieces(bad)


@pytest.mark.interpret
def test_fused_routing_names_bad_input():
    """Bad shapes and counts are refused by name before a launch, naming the function called."""
    from epmoe.routing.router_triton import route_gate_triton, route_triton

    flags = dict(top_k=2, sigmoid=False, n_group=1, topk_group=1, top2_sum=False, normalize=False,
                 round_weights=False, scale=1.0)
    with pytest.raises(ValueError, match=r"route_triton: logits must be a 2-D \[T, \.\.\.\] tensor, got a 1-D"):
        route_triton(torch.zeros(8), None, **flags)
    with pytest.raises(ValueError, match=r"route_triton: top_k must be an int in 1\.\.8 \(the experts\), got 9"):
        route_triton(torch.zeros(3, 8), None, **{**flags, "top_k": 9})
    with pytest.raises(ValueError, match=r"top_k must be an int in 1\.\.8 \(the experts\), got 0"):
        route_triton(torch.zeros(3, 8), None, **{**flags, "top_k": 0})
    with pytest.raises(ValueError, match="route_triton: n_group must be an int >= 1, got 0"):
        route_triton(torch.zeros(3, 8), None, **{**flags, "n_group": 0})
    gate = (torch.zeros(1, 16), torch.zeros(8, 16), None, torch.zeros(4, dtype=torch.int32), None)
    with pytest.raises(ValueError, match="route_gate_triton: chosen-logit routing .* got n_group=2"):
        route_gate_triton(*gate, fp32_logits=False, **{**flags, "n_group": 2}, chosen=True)
    with pytest.raises(ValueError, match=r"route_gate_triton: x must be a 2-D \[T, \.\.\.\] tensor, got a 3-D"):
        route_gate_triton(torch.zeros(1, 1, 16), *gate[1:], fp32_logits=False, **flags)


def test_fused_routing_outside_cuda_and_the_interpreter_is_refused(monkeypatch):
    pytest.importorskip("triton")
    from epmoe.routing.router_triton import route_triton

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match=r"route_triton runs on CUDA tensors \(or under TRITON_INTERPRET=1\), got "
                                         r"logits on cpu; routing.Router routes other devices in PyTorch"):
        route_triton(torch.zeros(3, 8), None, top_k=2, sigmoid=False, n_group=1, topk_group=1, top2_sum=False,
                     normalize=False, round_weights=False, scale=1.0)
