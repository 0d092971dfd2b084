"""The short table printed last, and whether every check passed."""

from __future__ import annotations

from typing import Any

from .common import Ctx


def _fmt(v: Any, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec)


def summary(ctx: Ctx) -> tuple[str, bool]:
    doc, g = ctx.doc, ctx.world
    lines, ok = [], True
    parts = doc["parts"]
    lines.append("parts: " + ", ".join(f"{p} {'ok' if s.get('ok') else ('skipped' if s.get('skipped') else 'FAILED')}"
                                       for p, s in parts.items()))
    ok &= all(s.get("ok") or s.get("skipped") for s in parts.values())
    calib = doc.get("calibrate")
    a2a_lat = None
    if calib:
        rows = calib["rows"]
        a2a_lat = rows[0]["all_to_all_ms"] * 1e3
        lines.append(f"calibrate ({g} ranks): all-reduce {rows[0]['all_reduce_ms'] * 1e3:.1f} us @{rows[0]['bytes']} "
                     "B, "
                     f"{rows[-1]['all_reduce_busbw_gbs']:.1f} GB/s bus @{rows[-1]['bytes'] / 2**20:.2f} MiB; "
                     "all-to-all "
                     f"{a2a_lat:.1f} us, {rows[-1]['all_to_all_busbw_gbs']:.1f} GB/s bus")
        sm = calib.get("small_message_events")
        if sm:
            k0 = min(sm, key=int)
            v = sm[k0]
            lines.append(f"  small all-to-all ({k0} B, CUDA events): eager {v['all_to_all_eager_us']:.1f} us, "
                         f"graph {v['all_to_all_graph_us']:.1f} us; all-reduce eager {v['all_reduce_eager_us']:.1f}, "
                         f"graph {v['all_reduce_graph_us']:.1f} us")
    layer = doc.get("layer")
    plan_rows = {r["tokens_per_rank"]: r for r in (doc.get("plan") or {}).get("rows", [])}
    if layer:
        lines.append(f"layer {layer['model']} E {layer['spec']['experts']} over {g}, {layer['dtype']}: checks "
                     + ", ".join(f"{n} "
                                 f"{v['rel_err']:.1e}{'' if v['ok'] else ' FAIL'}" for n, v in layer["checks"].items()))
        ok &= layer["checks_ok"]
        hdr = (f"{'T/rank':>6} {'EP-a2a':>8} {'EP-fix(g)':>9} {'TP(g)':>8} {'TP-eag':>8} {'disp-a2a':>8} "
               f"{'disp-fix':>8} "
               f"{'pred-d+c':>8} {'TP-AR':>7} {'pred-AR':>7} {'EPfloor':>7} {'TPfloor':>7}")
        lines.append(hdr + "   (us per MoE layer, max over ranks)")
        for r in layer["rows"]:
            pr = plan_rows.get(r["tokens_per_rank"], {})
            lines.append(f"{r['tokens_per_rank']:6d} {r['ep_all_to_all_us']:8.1f} {r['ep_fixed_us']:9.1f} "
                         f"{r['tp_us']:8.1f} "
                         f"{r['tp_eager_us']:8.1f} {r['disp_all_to_all_us']:8.1f} {r['disp_fixed_us']:8.1f} "
                         f"{_fmt(pr.get('ep_pred_dispatch_combine_us')):>8} {r['tp_all_reduce_us']:7.1f} "
                         f"{_fmt(pr.get('tp_pred_all_reduce_us')):>7} {r['expert_floor_us']:7.1f} "
                         f"{r['tp_expert_floor_us']:7.1f}")
        drows = layer.get("dispatch_rows") or []
        if drows:
            peak = None
            if calib and calib.get("profile"):
                peak = calib["profile"]["intra_node"]["all_to_all_busbw_bytes_per_s"] / 1e9
            lines.append(f"dispatch+combine alone: GB/s to other ranks (ratio to NCCL all-to-all bus bw {_fmt(peak)} "
                         "GB/s "
                         f"at 256 MiB; same-size NCCL in brackets)")
            for r in drows:
                def pct(name: str) -> str:
                    bw = r[f"disp_{name}_busbw_gbs"]
                    same = r.get(f"disp_{name}_nccl_same_size_busbw_gbs")
                    return (f"{bw:7.1f}" + (f" {bw / peak:5.0%}" if peak else "") +
                            (f" [{same:.1f}]" if same else ""))
                lines.append(f"  T {r['tokens_per_rank']:5d}: a2a {r['disp_all_to_all_us']:8.1f} us "
                             f"{pct('all_to_all')}; "
                             f"fixed {r['disp_fixed_us']:8.1f} us {pct('fixed')}")
            if g > 1 and a2a_lat and layer["rows"]:
                first = layer["rows"][0]
                lat = [f"{a2a_lat:.1f} us (calibrate)"]
                sm = (calib or {}).get("small_message_events")
                if sm:
                    lat.append(f"{sm[min(sm, key=int)]['all_to_all_graph_us']:.1f} us (graph replay)")
                lines.append(f"  latency at T={first['tokens_per_rank']}: fixed "
                             f"dispatch+combine{' (graph)' if first['disp_fixed_graphed'] else ''} "
                             f"{first['disp_fixed_us']:.1f} us = {first['disp_fixed_us'] / a2a_lat:.2f}x NCCL's small "
                             f"all-to-all {' / '.join(lat)}; target <= 2x")
            if peak and drows:
                last = drows[-1]
                lines.append(f"  bandwidth at T={last['tokens_per_rank']}: fixed "
                             f"{last['disp_fixed_busbw_gbs'] / peak:.0%}, "
                             f"a2a {last['disp_all_to_all_busbw_gbs'] / peak:.0%} of NCCL all-to-all bus bw (target >= "
                             "80%)")
    pl = doc.get("plan")
    if pl and plan_rows:
        rr = [r for r in pl["rows"] if r.get("ep_disp_fixed_meas_over_pred")]
        if rr:
            lines.append(f"plan ({pl['hardware']}): measured/predicted dispatch+combine "
                         + " ".join(f"T{r['tokens_per_rank']}:{r['ep_disp_fixed_meas_over_pred']:.2f}" for r in rr)
                         + "; all-reduce " + " ".join(
                             f"T{r['tokens_per_rank']}:{_fmt(r.get('tp_all_reduce_meas_over_pred'), '.2f')}"
                             for r in rr)
                         + f" (target 0.75-1.25; dispatch_layout_fixed_us {pl['dispatch_layout_fixed_us']:.1f}, "
                         f"best fit {_fmt(pl.get('fit_dispatch_layout_fixed_us'))})")
    run = doc.get("run")
    if run:
        lines.append(f"run ({run['checkpoint']['family']}, {run['checkpoint']['layers']} layers, EP {g}): matches "
                     "reference "
                     f"{run['matches_reference']}, CUDA graphs {'on' if run['graphs'] else 'off'}, "
                     f"{run['tokens_per_s']:.1f} tok/s, collectives/step {run['collectives_per_step']}")
        ok &= bool(run["matches_reference"])
    return "\n".join(lines), ok
