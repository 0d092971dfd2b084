"""Part 4, ``plan``: the planner's predictions on part 1's profile beside the measurements."""

from __future__ import annotations

import json
import statistics
from typing import Any

from epmoe.spec import parse_moe_spec

from .common import CONFIGS, Ctx
from .layer import layer_spec


def part_plan(ctx: Ctx) -> dict | None:
    if ctx.rank != 0:
        return None
    from epmoe.plan.hardware import load_hardware
    from epmoe.plan.planner import plan
    from epmoe.plan.request import PlanRequest

    a, g = ctx.args, ctx.world
    calib = ctx.doc.get("calibrate") or {}
    if calib.get("profile_path"):
        hw, hw_note = load_hardware(calib["profile_path"]), "calibrated in part 1"
    else:
        hw, hw_note = load_hardware("h200-sxm"), "shipped h200-sxm (no calibrated profile: one rank or part 1 failed)"
    spec = layer_spec(a)
    tokens = list(a.tokens)
    req = PlanRequest(spec=spec, hardware=hw, gpus=g, batches=tuple(t * g for t in tokens), weights="bf16",
                      balancedness=1.0, context=1)
    p = plan(req)
    n_moe = spec.num_moe_layers
    names = [sp.strategy.name for sp in p.strategies]
    ep_name = f"EP{g}+DPattn" if g > 1 else "TP1"
    tp_name = f"TP{g}"
    measured = {r["tokens_per_rank"]: r for r in (ctx.doc.get("layer") or {}).get("rows", [])}
    rows = []
    for i, t in enumerate(tokens):
        row: dict[str, Any] = {"tokens_per_rank": t, "batch": t * g}
        for label, name in (("ep", ep_name), ("tp", tp_name)):
            if name not in names:
                continue
            st = p.strategy(name).steps[i]
            a2a = [c for c in st.collectives if c.kind == "all_to_all"]
            ar = [c for c in st.collectives if c.kind == "all_reduce"]
            row[f"{label}_pred_expert_us"] = st.expert_ms / n_moe * 1e3
            if label == "ep":
                row["ep_pred_dispatch_combine_us"] = 2 * a2a[0].ms_each * 1e3 if a2a else 0.0  # dispatch + combine
                row["ep_pred_a2a_calls_per_layer"] = sum(c.count for c in a2a) / n_moe
                row["ep_pred_a2a_bytes_per_call"] = a2a[0].bytes_per_call if a2a else 0.0
            else:
                row["tp_pred_all_reduce_us"] = ar[0].ms_each * 1e3 if ar else 0.0
                row["tp_pred_all_reduce_bytes"] = ar[0].bytes_per_call if ar else 0.0
        m = measured.get(t)
        if m:
            def ratio(meas: float | None, pred: float | None) -> float | None:
                return meas / pred if meas and pred else None

            row["ep_disp_fixed_meas_over_pred"] = ratio(m.get("disp_fixed_us"), row.get("ep_pred_dispatch_combine_us"))
            row["ep_disp_a2a_meas_over_pred"] = ratio(m.get("disp_all_to_all_us"),
                                                      row.get("ep_pred_dispatch_combine_us"))
            row["tp_all_reduce_meas_over_pred"] = ratio(m.get("tp_all_reduce_us"), row.get("tp_pred_all_reduce_us"))
            ep_expert = m["ep_fixed_us"] - m.get("disp_fixed_us", 0.0)
            row["ep_expert_meas_us"] = ep_expert
            row["ep_expert_meas_over_pred"] = ratio(ep_expert, row.get("ep_pred_expert_us"))
            if "tp_pred_expert_us" in row:
                tp_expert = m["tp_us"] - m.get("tp_all_reduce_us", 0.0)
                row["tp_expert_meas_us"] = tp_expert
                row["tp_expert_meas_over_pred"] = ratio(tp_expert, row.get("tp_pred_expert_us"))
        rows.append(row)
    # the profile's dispatch_layout_fixed_us that would make the fixed dispatcher's rows fit best: the
    # median of measured - predicted without it (DESIGN.md's H200 profile takes its value from here)
    resid = [m["disp_fixed_us"] - r["ep_pred_dispatch_combine_us"] + hw.dispatch_layout_fixed_us
             for r in rows if (m := measured.get(r["tokens_per_rank"])) and r.get("ep_pred_dispatch_combine_us")]
    out = {"hardware": hw.name, "hardware_source": hw_note, "strategies": names, "skipped": list(p.skipped),
           "dispatch_layout_fixed_us": hw.dispatch_layout_fixed_us,
           "fit_dispatch_layout_fixed_us": statistics.median(resid) if resid else None,
           "rows": rows, "note": "per MoE layer; prediction = planner's step estimate divided by its MoE layer count; "
                                 "measured expert time = layer time minus dispatch+combine (fixed, graphed) or minus "
                                 "the all-reduce (TP)"}
    run = ctx.doc.get("run")
    if run and not a.small:  # the run model's collectives per decode step: planner vs measured
        from epmoe.spec import load_moe_spec  # noqa: F401 - the run checkpoint is gone; use the config
        raw = json.loads((CONFIGS / "qwen3-30b-a3b.config.json").read_text())
        raw["num_hidden_layers"] = a.run_layers
        rspec = parse_moe_spec(raw, "qwen3-30b-a3b (run layers)")
        if g > 1:
            rp = plan(PlanRequest(spec=rspec, hardware=hw, gpus=g, batches=(4,), weights="bf16", context=64))
            st = rp.strategy(f"EP{g}+DPattn").steps[0]
            out["run_collectives_per_step"] = {"planner_all_to_all": st.count("all_to_all"),
                                               "measured": run["collectives_per_step"],
                                               "note": "the all_to_all dispatcher adds one count exchange per layer"}
    return out
