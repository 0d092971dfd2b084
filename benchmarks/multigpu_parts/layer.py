"""Part 2, ``layer``: one MoE layer expert-parallel (both dispatchers) against tensor-parallel, with
dispatch + combine alone and the correctness checks against the single-rank layer."""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

import torch
import torch.distributed as dist

from epmoe.comm import Comm
from epmoe.dispatch import AllToAllDispatcher
from epmoe.dispatch.fixed_capacity import FixedCapacityDispatcher
from epmoe.layer import MoELayer, MoELayerOptions, TPMoELayer
from epmoe.placement import ExpertPlacement
from epmoe.spec import MoESpec, language_model_config, parse_moe_spec
from timing import capture, rel_err

from .common import (
    CONFIGS,
    H200_BF16,
    H200_HBM,
    LAYER_MODELS,
    SMALL,
    TOL,
    Ctx,
    all_max,
    all_mean,
    free_memory,
    time_graph_us,
    time_us,
)


def layer_spec(args: argparse.Namespace) -> MoESpec:
    """The real DeepSeek-V3 / Kimi-K2.5 MoE facts (``--small``: hidden, F and E shrunk, routing kept)."""
    name = LAYER_MODELS[args.experts]
    raw = json.loads((CONFIGS / f"{name}.config.json").read_text())
    cfg = dict(language_model_config(raw))
    if args.small:
        e = SMALL["experts"] * args.experts // 256
        cfg.update(hidden_size=SMALL["hidden_size"], moe_intermediate_size=SMALL["moe_intermediate_size"],
                   n_routed_experts=e)
        if int(cfg.get("n_group") or 1) > 1:
            cfg.update(n_group=8, topk_group=4)
    return parse_moe_spec(cfg, f"{CONFIGS / name}.config.json" + (" (--small)" if args.small else ""))


@torch.no_grad()
def fill_random(module: torch.nn.Module, seed: int, device: torch.device) -> None:
    """Deterministic random weights (the same on every rank): ``N(0, 1/in)``; correction bias ``N(0, 0.01^2)``."""
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, p in list(module.named_parameters()) + list(module.named_buffers()):
        if not p.dtype.is_floating_point:
            continue
        scale = 0.01 if name.endswith("e_score_correction_bias") or p.dim() == 1 else p.shape[-1] ** -0.5
        rows = p.view(p.shape[0], -1) if p.dim() > 1 else p.view(1, -1)
        step = max(1, (1 << 26) // max(1, rows.shape[1]))
        for i in range(0, rows.shape[0], step):
            chunk = rows[i:i + step]
            chunk.copy_(torch.randn(chunk.shape, generator=gen, device=device, dtype=torch.float32) * scale)


def _inputs(ctx: Ctx, t: int, d: int, seed: int, shared: bool) -> torch.Tensor:
    """``[t, d]`` hidden states: per rank, or the same on every rank (``shared``)."""
    gen = torch.Generator(device=ctx.device).manual_seed(seed * 1009 + (0 if shared else 7919 * (ctx.rank + 1)) + t)
    return torch.randn(t, d, generator=gen, device=ctx.device, dtype=torch.float32).to(ctx.dtype)


def _calls(comm: Comm, before) -> dict[str, int]:
    return {k: v for k, v in comm.stats.since(before).calls.items()}


def _nearest_row(rows: list[dict], sent_bytes: float, n: int) -> dict | None:
    """The calibration row whose all-to-all bytes sent to other ranks is closest (log scale) to ``sent_bytes``."""
    if not rows or n < 2 or sent_bytes <= 0:
        return None
    return min(rows, key=lambda r: abs(math.log((n - 1) / n * r["bytes"] / sent_bytes)))


def part_layer(ctx: Ctx) -> dict:
    a = ctx.args
    g, dev, dtype = ctx.world, ctx.device, ctx.dtype
    spec = layer_spec(a)
    d, f, e, k = spec.hidden_size, spec.moe_intermediate_size, spec.num_experts, spec.top_k
    backend = "triton" if ctx.cuda else "reference"
    group = dist.group.WORLD
    res: dict[str, Any] = {
        "model": LAYER_MODELS[a.experts], "spec": {"hidden": d, "intermediate": f, "experts": e, "top_k": k,
                                                  "shared_intermediate": spec.shared_intermediate_size,
                                                  "router": spec.router_kind, "n_group": spec.n_group},
        "ep": g, "dtype": str(dtype).replace("torch.", ""), "expert_backend": backend, "tolerance": TOL[str(dtype)[6:]],
    }
    ctx.log(f"layer: {res['model']} D {d} F {f} E {e} top-{k} over {g} rank(s), {res['dtype']}, backend {backend}")

    # the single-rank reference holding all experts; the EP and TP layers take their share of it
    full = MoELayer(spec, 0, ExpertPlacement.trivial(spec.num_moe_layers, e, 1), Comm(None),
                    MoELayerOptions(dispatcher="local", expert_backend="reference"), dtype=dtype, device=dev)
    fill_random(full, a.seed, dev)
    comm_a2a, comm_fixed, comm_tp = Comm(group), Comm(group), Comm(group)
    placement = ExpertPlacement.trivial(spec.num_moe_layers, e, g)
    ep = MoELayer(spec, 0, placement, comm_a2a, MoELayerOptions(dispatcher="all_to_all", expert_backend=backend),
                  dtype=dtype, device=dev)
    with torch.no_grad():
        ep.gate.load_state_dict(full.gate.state_dict())
        if full.shared_experts is not None:
            ep.shared_experts.load_state_dict(full.shared_experts.state_dict())
        for j, expert in enumerate(ep.local_experts.tolist()):  # slot by slot: no E-sized temporary
            ep.experts.w13[j].copy_(full.experts.w13[expert])
            ep.experts.w2[j].copy_(full.experts.w2[expert])
    tp = TPMoELayer(spec, comm_tp, expert_backend=backend, dtype=dtype, device=dev)
    tp.load_from(full)
    a2a_disp = ep.dispatcher
    s = placement.slots_per_rank

    def fixed(cap: int) -> FixedCapacityDispatcher:
        return FixedCapacityDispatcher(comm_fixed, s, capacity=cap)

    # correctness on a few tokens, against the single-rank layer
    c = a.check_tokens
    checks: dict[str, Any] = {}
    with torch.no_grad():
        x = _inputs(ctx, c, d, a.seed + 1, shared=False)
        x_tp = _inputs(ctx, c * g, d, a.seed + 2, shared=True)
        ref, ref_tp = full(x), full(x_tp)
        before = comm_a2a.stats.snapshot()
        out = ep(x)
        checks["ep_all_to_all"] = {"rel_err": all_max(ctx, rel_err(out, ref)), "calls": _calls(comm_a2a, before)}
        ep.set_dispatcher(fixed(c))
        before = comm_fixed.stats.snapshot()
        out = ep(x)
        checks["ep_fixed_eager"] = {"rel_err": all_max(ctx, rel_err(out, ref)), "calls": _calls(comm_fixed, before)}
        if ctx.cuda:  # the captured graph, replayed on two fresh inputs
            static_x = torch.zeros_like(x)
            graph, static_out = capture(lambda: ep(static_x))
            errs = []
            for i in range(2):
                xi = _inputs(ctx, c, d, a.seed + 10 + i, shared=False)
                static_x.copy_(xi)
                graph.replay()
                errs.append(rel_err(static_out, full(xi)))
            checks["ep_fixed_graph"] = {"rel_err": all_max(ctx, max(errs))}
            del graph
        ep.set_dispatcher(a2a_disp)
        before = comm_tp.stats.snapshot()
        out = tp(x_tp)
        checks["tp"] = {"rel_err": all_max(ctx, rel_err(out, ref_tp)), "calls": _calls(comm_tp, before)}
        if ctx.cuda:
            static_x = x_tp.clone()
            graph, static_out = capture(lambda: tp(static_x))
            graph.replay()
            checks["tp_graph"] = {"rel_err": all_max(ctx, rel_err(static_out, ref_tp))}
            del graph
    tol = res["tolerance"]
    for v in checks.values():
        v["ok"] = v["rel_err"] < tol
    res["checks"] = checks
    res["checks_ok"] = all(v["ok"] for v in checks.values())
    ctx.log("layer checks: " + ", ".join(f"{n} {v['rel_err']:.2e}" for n, v in checks.items()))
    del full, ref, ref_tp, out
    free_memory(ctx)

    # floors: DESIGN.md's H200 figures on CUDA, the rates part 1 measured on CPU
    facts = (ctx.doc.get("calibrate") or {}).get("device_facts") or {}
    hbm = H200_HBM if ctx.cuda else facts.get("hbm_bytes_per_s", 2e10)
    peak = H200_BF16 if ctx.cuda else facts.get("bf16_flops_per_s", 1e11)
    expert_bytes = 3 * d * f * torch.finfo(dtype).bits // 8
    shared_bytes = 3 * d * spec.shared_intermediate_size * torch.finfo(dtype).bits // 8
    res["floor"] = {"hbm_bytes_per_s": hbm, "flops_per_s": peak,
                    "what": "max(bytes of the local experts hit + shared expert / HBM, FLOPs of the routed rows / "
                            "peak)"}
    calib_rows = (ctx.doc.get("calibrate") or {}).get("rows") or []
    rows = []
    with torch.no_grad():
        for t in a.tokens:
            row: dict[str, Any] = {"tokens_per_rank": t, "batch": t * g}
            x = _inputs(ctx, t, d, a.seed + 100, shared=False)
            x_tp = _inputs(ctx, t * g, d, a.seed + 200, shared=True)
            idx, w = ep.gate(x)
            slots = ep.slot_map(idx)
            mine = slots[(slots >= ctx.rank * s) & (slots < (ctx.rank + 1) * s)]
            touched, pairs = int(torch.unique(mine).numel()), int(mine.numel())
            floor = max((touched * expert_bytes + shared_bytes) / hbm,
                        2 * (pairs * 3 * d * f + t * 3 * d * spec.shared_intermediate_size) / peak) * 1e6
            row["touched_local_experts_max"] = int(all_max(ctx, touched))
            row["expert_floor_us"] = all_max(ctx, floor)
            tp_idx = tp.gate(x_tp)[0]
            tp_touched = int(torch.unique(tp_idx).numel())
            row["tp_expert_floor_us"] = max((tp_touched * expert_bytes + shared_bytes) / g / hbm,
                                            2 * (tp_idx.numel() * 3 * d * f
                                                 + t * g * 3 * d * spec.shared_intermediate_size)
                                            / g / peak) * 1e6

            ep.set_dispatcher(a2a_disp)
            row["ep_all_to_all_us"] = time_us(ctx, lambda: ep(x))
            ep.set_dispatcher(fixed(t))
            static_x = x.clone()
            row["ep_fixed_us"], row["ep_fixed_graphed"] = time_graph_us(ctx, lambda: ep(static_x))
            ep.set_dispatcher(a2a_disp)
            static_tp = x_tp.clone()
            row["tp_us"], row["tp_graphed"] = time_graph_us(ctx, lambda: tp(static_tp))
            row["tp_eager_us"] = time_us(ctx, lambda: tp(x_tp))
            ar_buf = torch.zeros(t * g, d, dtype=dtype, device=dev)
            # one rank: Comm skips the all-reduce, and an empty graph is not worth capturing
            row["tp_all_reduce_us"] = time_graph_us(ctx, lambda: comm_tp.all_reduce(ar_buf))[0] if g > 1 else 0.0
            row["tp_all_reduce_bytes"] = t * g * d * ar_buf.element_size()
            row.update(_dispatch_row(ctx, x, slots, w, a2a_disp, fixed(t), comm_a2a, comm_fixed, calib_rows))
            rows.append(row)
            ctx.log(f"layer T={t}: EP a2a {row['ep_all_to_all_us']:.1f} us, EP "
                    f"fixed{'+graph' if row['ep_fixed_graphed'] else ''} "
                    f"{row['ep_fixed_us']:.1f} us, TP {row['tp_us']:.1f} us (eager {row['tp_eager_us']:.1f}), "
                    f"dispatch+combine a2a {row['disp_all_to_all_us']:.1f} / fixed {row['disp_fixed_us']:.1f} us")
            static_x = static_tp = ar_buf = None  # free the buffers
            free_memory(ctx)
    res["rows"] = rows

    # dispatch + combine alone at larger token counts (bandwidth regime)
    drows = []
    with torch.no_grad():
        for t in a.dispatch_tokens:
            x = _inputs(ctx, t, d, a.seed + 300, shared=False)
            idx, w = ep.gate(x)
            slots = ep.slot_map(idx)
            r = {"tokens_per_rank": t}
            r.update(_dispatch_row(ctx, x, slots, w, a2a_disp, fixed(t), comm_a2a, comm_fixed, calib_rows))
            drows.append(r)
            ctx.log(f"dispatch T={t}: a2a {r['disp_all_to_all_us']:.1f} us {r['disp_all_to_all_busbw_gbs']:.1f} GB/s, "
                    f"fixed {r['disp_fixed_us']:.1f} us {r['disp_fixed_busbw_gbs']:.1f} GB/s")
            x = None  # free the buffer
            free_memory(ctx)
    res["dispatch_rows"] = drows
    return res


def _dispatch_row(ctx: Ctx, x, slots, w, a2a_disp: AllToAllDispatcher, fixed_disp: FixedCapacityDispatcher,
                  comm_a2a: Comm, comm_fixed: Comm, calib_rows: list[dict]) -> dict:
    """Dispatch + combine alone (the received rows sent straight back) for both dispatchers."""
    n = ctx.world
    row: dict[str, Any] = {}

    # combine gets a contiguous [R, D] tensor, as from the expert backend (recv_x is a view of the buffer)
    y_a2a = torch.zeros(a2a_disp.dispatch(x, slots, w).recv_x.shape, dtype=x.dtype, device=x.device)
    y_fixed = torch.zeros(fixed_disp.dispatch(x, slots, w).recv_x.shape, dtype=x.dtype, device=x.device)

    def a2a_round():
        return a2a_disp.combine(y_a2a, a2a_disp.dispatch(x, slots, w))

    static_x = x.clone()

    def fixed_round():
        return fixed_disp.combine(y_fixed, fixed_disp.dispatch(static_x, slots, w))

    for name, fn, comm in (("all_to_all", a2a_round, comm_a2a), ("fixed", fixed_round, comm_fixed)):
        before = comm.stats.snapshot()
        fn()
        delta = comm.stats.since(before)
        sent = delta.bytes_sent["all_to_all"]
        us, graphed = time_graph_us(ctx, fn) if name == "fixed" else (time_us(ctx, fn), False)
        mean_sent = all_mean(ctx, sent)
        row[f"disp_{name}_us"] = us
        row[f"disp_{name}_graphed"] = graphed
        row[f"disp_{name}_calls"] = delta.calls["all_to_all"]
        row[f"disp_{name}_bytes_sent"] = mean_sent  # to other ranks, dispatch + combine, mean over ranks
        row[f"disp_{name}_busbw_gbs"] = mean_sent / (us * 1e-6) / 1e9 if us > 0 else 0.0
        # NCCL all-to-all of about the same size (one of the two transfers), from part 1
        near = _nearest_row(calib_rows, mean_sent / 2, n)
        if near is not None:
            row[f"disp_{name}_nccl_same_size_busbw_gbs"] = near["all_to_all_busbw_gbs"]
            row[f"disp_{name}_nccl_same_size_bytes"] = near["bytes"]
    return row
