"""MoELayer pieces against references: the TP baseline layer and the EP layer over gloo ranks against
the single-rank layer, on random weights of several families; the Router against transformers' gates."""

from __future__ import annotations

import pytest
import torch

from epmoe.comm import Comm
from epmoe.layer import SHARED_OVERLAP_MAX_ROWS, MoELayer, MoELayerOptions, TPMoELayer
from epmoe.models.tiny import TINY_FAMILIES
from epmoe.placement import ExpertPlacement
from epmoe.runtime.launch import RankInfo, init_group, spawn
from epmoe.spec import load_moe_spec

FAMILIES = ["kimi-k2.5", "gpt-oss", "qwen2-moe", "llama4", "deepseek-v2"]


def _full_layer(spec, seed: int) -> MoELayer:
    torch.manual_seed(seed)
    layer = MoELayer(spec, 0, ExpertPlacement.trivial(spec.num_moe_layers, spec.num_experts, 1), Comm(None),
                     MoELayerOptions(dispatcher="local"))
    with torch.no_grad():
        for p in list(layer.parameters()) + list(layer.buffers()):
            if p.dtype.is_floating_point:
                    p.copy_(torch.randn_like(p) * 0.3)
    return layer


def _worker(info: RankInfo, dirs: dict[str, str]) -> dict:
    comm = Comm(init_group(info, "cpu"))
    out = {}
    for i, fam in enumerate(FAMILIES):
        spec = load_moe_spec(dirs[fam])
        full = _full_layer(spec, seed=i)
        x = torch.randn(11, spec.hidden_size, generator=torch.Generator().manual_seed(100 + comm.rank))
        x_tp = torch.randn(11, spec.hidden_size, generator=torch.Generator().manual_seed(99))  # same on all ranks
        with torch.no_grad():
            ref = full(x)
            ref_tp = full(x_tp)
            tp = TPMoELayer(spec, comm)
            tp.load_from(full)
            out[(fam, "tp")] = float((tp(x_tp) - ref_tp).norm() / ref_tp.norm())
            placement = ExpertPlacement.trivial(spec.num_moe_layers, spec.num_experts, comm.size,
                                                comm.size, "round_robin")
            ep = MoELayer(spec, 0, placement, comm, MoELayerOptions(dispatcher="all_to_all"))
            ep.gate.load_state_dict(full.gate.state_dict())
            if full.shared_experts is not None:
                ep.shared_experts.load_state_dict(full.shared_experts.state_dict())
            if full.shared_expert_gate is not None:
                ep.shared_expert_gate.load_state_dict(full.shared_expert_gate.state_dict())
            held = ep.local_experts
            for name in ("w13", "w2", "b13", "b2"):
                if getattr(full.experts, name) is not None:
                    getattr(ep.experts, name).copy_(getattr(full.experts, name)[held])
            out[(fam, "ep")] = float((ep(x) - ref).norm() / ref.norm())
            out[(fam, "calls")] = dict(comm.stats.calls)
    torch.distributed.destroy_process_group()
    return out


@pytest.mark.multiprocess
def test_tp_and_ep_layers_equal_single_rank(tiny_checkpoints):
    dirs = {fam: str(tiny_checkpoints(fam)) for fam in FAMILIES}
    for res in spawn(_worker, 2, (dirs,)):
        for fam in FAMILIES:
            assert res[(fam, "tp")] < 1e-6, fam
            assert res[(fam, "ep")] < 1e-6, fam
        # per family: one all-reduce for TP, three all-to-alls for EP
        assert res[(FAMILIES[-1], "calls")] == {"all_to_all": 3 * len(FAMILIES), "all_reduce": len(FAMILIES),
                                                "all_gather": 0}


@pytest.mark.parametrize("family", sorted(TINY_FAMILIES))
def test_router_equals_transformers_gate(tiny_checkpoints, family):
    """Our Router picks the same experts with the same weights as the transformers block's gate."""
    from transformers import AutoModelForCausalLM

    from epmoe.models.layout import family_layout
    from epmoe.routing import Router

    directory = tiny_checkpoints(family)
    spec = load_moe_spec(directory)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    layout = family_layout(spec.model_type)
    block = getattr(model.model.layers[spec.moe_layers[-1]], layout.moe_attr)
    hf_gate = getattr(block, "gate", None) or block.router
    router = Router(spec)
    router.load_state_dict(hf_gate.state_dict())
    x = torch.randn(64, spec.hidden_size, generator=torch.Generator().manual_seed(3))
    idx, w = router(x)
    if spec.router_kind == "topk_sigmoid":  # Llama-4: dense scores, -inf outside the top-k before the sigmoid
        scores, _ = hf_gate(x)
        dense = torch.zeros_like(scores).scatter(1, idx, w.to(scores.dtype))
        assert torch.equal(dense, scores)
        return
    out = hf_gate(x)
    ref_w, ref_idx = (out[1], out[2]) if len(out) == 3 else (out[1], out[0])
    ours = torch.zeros(64, spec.num_experts).scatter(1, idx, w)
    theirs = torch.zeros(64, spec.num_experts).scatter(1, ref_idx, ref_w.float())
    assert torch.equal(ours, theirs)


def test_set_dispatcher_checks_the_group_and_slots(tiny_checkpoints):
    from epmoe.dispatch import FixedCapacityDispatcher, LocalDispatcher

    spec = load_moe_spec(tiny_checkpoints("kimi-k2.5"))
    layer = _full_layer(spec, seed=7)
    x = torch.randn(5, spec.hidden_size, generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        ref = layer(x)
        layer.set_dispatcher(FixedCapacityDispatcher(Comm(None), spec.num_experts, capacity=8))
        assert torch.allclose(layer(x), ref, rtol=1e-5, atol=1e-6)
    want = f"MoE layer 0: the LocalDispatcher has slots_per_rank {spec.num_experts + 1}, the layer {spec.num_experts}"
    with pytest.raises(ValueError, match=want):
        layer.set_dispatcher(LocalDispatcher(spec.num_experts + 1))
    with pytest.raises(ValueError, match=r"has slots_per_rank"):
        MoELayer(spec, 0, ExpertPlacement.trivial(spec.num_moe_layers, spec.num_experts, 1), Comm(None),
                 MoELayerOptions(dispatcher=FixedCapacityDispatcher(Comm(None), spec.num_experts - 1, capacity=4)))


def test_each_dispatcher_accepts_only_its_own_handle():
    from epmoe.dispatch import AllToAllDispatcher, FixedCapacityDispatcher, LocalDispatcher

    x, slots, w = torch.randn(3, 4), torch.tensor([[0, 1], [2, -1], [3, 0]]), torch.rand(3, 2)
    local, fixed = LocalDispatcher(4), FixedCapacityDispatcher(Comm(None), 4, capacity=4)
    a2a = AllToAllDispatcher(Comm(None), 4)
    handles = {"local": local.dispatch(x, slots, w), "fixed": fixed.dispatch(x, slots, w),
               "a2a": a2a.dispatch(x, slots, w)}
    for name, disp in (("local", local), ("fixed", fixed), ("a2a", a2a)):
        for other, handle in handles.items():
            if other != name:
                with pytest.raises(TypeError, match="needs the handle its dispatch returned"):
                    disp.combine(handle.recv_x, handle)


def test_layer_options_are_one_frozen_checked_value():
    import dataclasses

    from epmoe.dispatch import LocalDispatcher

    opts = MoELayerOptions(dispatcher="fixed_capacity", dispatcher_options={"capacity": 4})
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.dispatcher = "local"  # type: ignore[misc]
    with pytest.raises(TypeError):
        opts.dispatcher_options["capacity"] = 8  # type: ignore[index]  # read-only, not the caller's dict
    with pytest.raises(KeyError, match=r"MoELayerOptions.dispatcher: unknown dispatcher 'nope'; supported: \["):
        MoELayerOptions(dispatcher="nope")
    with pytest.raises(TypeError, match="MoELayerOptions.dispatcher must be a registered name or a Dispatcher.*int"):
        MoELayerOptions(dispatcher=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"MoELayerOptions.dispatcher_options \{'capacity': 4\} apply to a named"):
        MoELayerOptions(dispatcher=LocalDispatcher(4), dispatcher_options={"capacity": 4})
    with pytest.raises(TypeError, match="MoELayerOptions.dispatcher_options must be a mapping"):
        MoELayerOptions(dispatcher_options=[("capacity", 4)])  # type: ignore[arg-type]
    with pytest.raises(KeyError, match=r"MoELayerOptions.expert_backend: unknown expert backend 'fast'"):
        MoELayerOptions(expert_backend="fast")
    with pytest.raises(ValueError, match=r"MoELayerOptions.replica_policy must be one of .*, got 'hottest'"):
        MoELayerOptions(replica_policy="hottest")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="MoELayerOptions.load_recorder must have a record"):
        MoELayerOptions(load_recorder=object())  # type: ignore[arg-type]


def test_layer_refuses_options_of_another_type(tiny_checkpoints):
    spec = load_moe_spec(tiny_checkpoints("kimi-k2.5"))
    placement = ExpertPlacement.trivial(spec.num_moe_layers, spec.num_experts, 1)
    with pytest.raises(TypeError, match="MoELayer options must be an epmoe.layer.MoELayerOptions, got str"):
        MoELayer(spec, 0, placement, Comm(None), "local")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="takes no options, got capacity"):
        MoELayer(spec, 0, placement, Comm(None),
                 MoELayerOptions(dispatcher="local", dispatcher_options={"capacity": 2}))
    layer = MoELayer(spec, 1, placement, Comm(None), MoELayerOptions(dispatcher="local"), dtype=torch.float64)
    assert layer.moe_index == 1 and layer.options.dispatcher == "local" and layer.experts.w13.dtype == torch.float64


def test_layer_tells_the_backend_the_pairs_its_tokens_route(tiny_checkpoints):
    # the fixed-capacity dispatcher hands the backend its padded receive buffer (16 rows here); the kernels are chosen
    # for the pairs the layer's own 3 tokens route, not for 16 rows times K
    spec = load_moe_spec(tiny_checkpoints("qwen2-moe"))
    placement = ExpertPlacement.trivial(spec.num_moe_layers, spec.num_experts, 1)
    layer = MoELayer(spec, 0, placement, Comm(None),
                     MoELayerOptions(dispatcher="fixed_capacity", dispatcher_options={"capacity": 16}))
    torch.manual_seed(0)
    for p in layer.parameters():  # the router's weight is made uninitialised (a checkpoint fills it)
        p.normal_(std=0.1)
    inner, seen = layer.expert_backend, []

    def recording(x, slots, *args, expected_pairs=None):
        seen.append((x.shape[0], slots.shape[1], expected_pairs))
        return inner(x, slots, *args, expected_pairs=expected_pairs)

    layer.expert_backend = recording
    x = torch.randn(3, spec.hidden_size)
    out = layer(x)
    assert seen == [(16, spec.top_k, 3 * spec.top_k)]
    # no tokens of its own (an idle rank): no estimate, the backend counts its receive buffer
    assert layer(x[:0]).shape == (0, spec.hidden_size)
    assert seen[1] == (16, spec.top_k, None)
    layer.expert_backend = inner
    assert out.abs().sum() > 0
    torch.testing.assert_close(out, layer(x))


def test_padding_rows_route_to_no_expert(tiny_checkpoints):
    # the engine's CUDA-graph steps mark their padding rows: those get slots -1 (no expert computes them), the real
    # rows' outputs are unchanged, and a mask of another row count does not apply
    spec = load_moe_spec(tiny_checkpoints("qwen2-moe"))
    layer = _full_layer(spec, seed=2)
    x = torch.randn(5, spec.hidden_size, generator=torch.Generator().manual_seed(0))
    full = layer(x)
    inner, live = layer.expert_backend, []

    def recording(x, slots, *args, **kw):
        live.append(int((slots >= 0).sum()))
        return inner(x, slots, *args, **kw)

    layer.expert_backend = recording
    layer.set_row_mask(torch.tensor([1, 1, 1, 0, 0]))
    masked = layer(x)
    assert live == [3 * spec.top_k]
    torch.testing.assert_close(masked[:3], full[:3])
    torch.testing.assert_close(masked[3:], layer._shared(x[3:]))  # the shared experts' output alone
    layer(x[:4])  # a 4-row forward: the 5-row mask does not apply
    assert live[-1] == 4 * spec.top_k
    layer.set_row_mask(None)
    torch.testing.assert_close(layer(x), full)
    with pytest.raises(ValueError, match=r"row_mask must be a \[T\] int64 tensor, got \(5,\) torch.float32"):
        layer.set_row_mask(torch.ones(5))


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["kimi-k2.5", "qwen2-moe"])
def test_shared_experts_on_a_side_stream_equal_in_order(tiny_checkpoints, monkeypatch, family):
    # on CUDA at a few rows the shared experts run on the layer's own stream beside the routed experts,
    # joined before the sum: the same kernels in another order on the streams, so the same bits, eager and in a graph
    spec = load_moe_spec(tiny_checkpoints(family))
    torch.manual_seed(3)
    layer = MoELayer(spec, 0, ExpertPlacement.trivial(spec.num_moe_layers, spec.num_experts, 1), Comm(None),
                     MoELayerOptions(dispatcher="local", expert_backend="triton"), dtype=torch.bfloat16,
                     device="cuda")  # what a one-rank engine's graphs run
    for p in layer.parameters():
        p.normal_(std=0.1)
    x = torch.randn(SHARED_OVERLAP_MAX_ROWS, spec.hidden_size).to("cuda", torch.bfloat16)
    monkeypatch.setenv("EPMOE_SHARED_OVERLAP", "0")
    in_order = [layer(x[:t]) for t in (1, 3, SHARED_OVERLAP_MAX_ROWS)]
    assert layer._shared_stream is None
    monkeypatch.setenv("EPMOE_SHARED_OVERLAP", "1")
    for t, want in zip((1, 3, SHARED_OVERLAP_MAX_ROWS), in_order, strict=True):
        assert torch.equal(layer(x[:t]), want), t
    side = layer._shared_stream
    assert side is not None and side != torch.cuda.current_stream()
    capture = torch.cuda.Stream()
    capture.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(capture):
        layer(x[:3])  # warm-up on the capture stream
        with torch.cuda.graph(graph, stream=capture):
            out = layer(x[:3])
    torch.cuda.current_stream().wait_stream(capture)
    x.copy_(torch.randn(x.shape))
    graph.replay()
    monkeypatch.setenv("EPMOE_SHARED_OVERLAP", "0")
    assert torch.equal(out, layer(x[:3]))
    assert layer._shared_stream is side


def test_folded_norm_refuses_what_does_not_fit_by_name():
    """``FoldedNorm`` checks its operands when it is made (``checks.check_add_norm``), and a layer that does not
    fold the norm (here: on the CPU, no fused router) refuses one by name rather than computing something else."""
    from epmoe.layer import FoldedNorm

    x, r, w, s = torch.randn(1, 1, 64), torch.randn(1, 1, 64), torch.rand(64), torch.empty(1, 1, 64)
    FoldedNorm(x, r, w, 1e-6, False, s)
    bad = {
        r"residual must be a torch.Tensor, got NoneType": dict(residual=None),
        r"summed must be a torch.Tensor, got NoneType": dict(summed=None),
        r"weight_then_cast must be a bool, got 'no'": dict(weight_then_cast="no"),
        r"eps must be a finite real number >= 0, got nan": dict(eps=float("nan")),
        r"eps must be a finite real number >= 0, got -1": dict(eps=-1),
        r"eps must be a finite real number >= 0, got 'x'": dict(eps="x"),
        r"residual \(1, 1, 32\) torch.float32 on cpu strides .* must match x \(1, 1, 64\)": dict(residual=r[..., :32]),
        r"summed \(1, 1, 67\)": dict(summed=torch.empty(1, 1, 67)),
        r"weight \(32,\) torch.float32 on cpu must be a contiguous \[64\] float tensor": dict(weight=w[:32]),
        r"weight \(64,\) torch.int64 .* float tensor": dict(weight=torch.ones(64, dtype=torch.int64)),
        r"summed shares memory with residual": dict(summed=r),
        r"summed shares memory with x": dict(summed=x),
    }
    for message, change in bad.items():
        args = dict(x=x, residual=r, weight=w, eps=1e-6, weight_then_cast=False, summed=s) | change
        with pytest.raises((TypeError, ValueError), match=message):
            FoldedNorm(**args)
    spec = load_moe_spec_of("qwen3-moe")
    layer = MoELayer(spec, 0, ExpertPlacement.trivial(spec.num_moe_layers, spec.num_experts, 1), Comm(None),
                     MoELayerOptions(dispatcher="local"))
    d = spec.hidden_size
    folded = FoldedNorm(torch.randn(1, 1, d), torch.randn(1, 1, d), torch.rand(d), 1e-6, False, torch.empty(1, 1, d))
    assert not layer.folds_norm(folded.x, folded.weight, False) and not layer.folds_norm(torch.tensor(1.0), w, False)
    with pytest.raises(ValueError, match=r"MoE layer 0: handed a FoldedNorm of rows \(1, 1, \d+\) .* it does not fold"):
        layer(folded)


def load_moe_spec_of(family: str):
    from epmoe.models.tiny import _COMMON
    from epmoe.spec import parse_moe_spec

    return parse_moe_spec({**_COMMON, **TINY_FAMILIES[family]}, family)


def test_routing_simulation_sends_alike_rows_to_uniformly_drawn_experts(tiny_checkpoints):
    # 512 copies of one row: the gate sends them all to the same K experts; simulated, each row gets K distinct
    # experts drawn uniformly (every expert near 512 K / E rows), the gate's weights kept, the fused paths declined
    spec = load_moe_spec(tiny_checkpoints("qwen2-moe"))
    layer = _full_layer(spec, seed=2)
    e, k = spec.num_experts, spec.top_k
    x = torch.randn(1, spec.hidden_size, generator=torch.Generator().manual_seed(0)).expand(512, -1).contiguous()
    inner, seen = layer.expert_backend, []

    def recording(x, slots, *args, **kw):
        seen.append(slots.clone())
        return inner(x, slots, *args, **kw)

    layer.expert_backend = recording
    layer(x)
    assert torch.unique(seen[0]).numel() == k
    gate_idx, gate_w = layer.gate(x)
    layer.gate.simulation = "uniform_random"
    torch.manual_seed(1)
    layer(x)
    slots = seen[1]
    assert all(torch.unique(row).numel() == k for row in slots)
    counts = torch.bincount(slots.flatten(), minlength=e).float()
    mean = 512 * k / e
    assert counts.min() > 0.7 * mean and counts.max() < 1.3 * mean, counts
    idx, w = layer.gate(x)
    assert torch.equal(w, gate_w) and not torch.equal(idx, gate_idx)
    table = torch.arange(e)
    assert layer.gate.route_to_slots(x, table) is None
    assert not layer.gate.folds_norm(x[:1], torch.ones(spec.hidden_size), False)
    with pytest.raises(ValueError, match=r"routing simulation must be None or one of \['uniform_random'\], got 'zipf'"):
        layer.gate.simulation = "zipf"
    assert layer.gate.simulation == "uniform_random"
    layer.gate.simulation = None
    layer(x)
    assert torch.equal(seen[2], seen[0])
