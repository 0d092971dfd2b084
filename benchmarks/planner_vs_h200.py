"""The planner's expert-compute model against measured MoE layer times on the H200.

Reads the results of ``benchmarks/moe_layer.py`` (default ``benchmarks/results/moe_layer_h200.json``),
predicts every row with ``epmoe.plan.costs.predict_moe_layer_time`` (the function whose formula, through
``expert_layer_ms``, prices the routed experts in ``epmoe plan``) and the shipped ``h200-sxm`` profile,
and compares with the measured time of our Triton backend (``ours_us``). CPU only, no device:

    python3 benchmarks/planner_vs_h200.py [--results PATH] [--hardware NAME|PATH]
        [--ceilings profile|run] [--out PATH] [--check]
    python3 benchmarks/planner_vs_h200.py --int4-results PATH [--hardware NAME|PATH] [--out PATH] [--check]
    python3 benchmarks/planner_vs_h200.py --fp8-results PATH [--hardware NAME|PATH] [--out PATH] [--check]

Columns: case, tokens, whether the row was timed as CUDA-graph replays, experts hit (measured in that
run's routing / expected ``n_local (1 - (1 - K/E)^T)``), measured µs, predicted µs, predicted / measured,
the prediction's parts (weight streaming, activation streaming, matrix work, fixed; the prediction is
``max(stream, matrix) + (1 - overlap) min(stream, matrix) + fixed`` with stream = weights + activations,
so the parts do not add up to it unless the overlap is 0), and the ratio ``r@hit`` of the same model
given the experts the run's random routing actually hit (separates the sampling noise of one routing
draw from the model's error).

It also fits the two free parameters, the stream/matrix overlap and the fixed per-layer cost, to the rows
by least squares on the relative error: for each overlap on a grid of step 0.001 over [0, 1] the
prediction is ``base_i + fixed``, so the best fixed cost has the closed form
``fixed = sum((m_i - base_i) / m_i^2) / sum(1 / m_i^2)`` (0 when that is negative: the objective is a
parabola in ``fixed``); the pair with the least sum of squared relative errors is kept and printed next to
the profile's values. After a new ``moe_layer.py`` run, copy them into ``moe_stream_matrix_overlap`` and
``moe_layer_fixed_us`` of ``src/epmoe/plan/hardware/h200-sxm.json`` with the run named in ``sources``.
``--ceilings run`` replaces the profile's bandwidth and bf16 rate by the ones measured in the same run
(``ceilings`` in the results). Writes ``planner_vs_h200.json`` next to the results file (or ``--out``);
``--check`` exits 1 when a row is outside the 25% target.

``--int4-results`` does the same for the W4A16 kernels' experts from an INT4 or MXFP4 run of ``moe_layer.py``
(``--cases kimi_int4,kimi_full_int4`` or ``--cases gptoss20b_mxfp4,gptoss_mxfp4``): an INT4 row's measured time is that
of the path the backend takes now for the row's size on an H200 (``int4.int4_path`` and
``w4a16_mma.default_mma_config``, so this mode imports Triton), an MXFP4 row's the backend's in that run (``mxfp4``);
the prediction is ``predict_moe_layer_time`` with ``int4_group32`` or ``mxfp4`` weights, and the fit is of the
profile's three W4A16 figures (MXFP4 rows alone in a profile with ``moe_mxfp4_*`` figures: those two and the rate;
rows of a few tokens do not determine the rate, and the fit then says so), the stream
efficiency (grid of step 0.01 over [0.3, 1]), the ``w4a16`` matrix rate (grid of 2 TFLOP/s steps) and the fixed
per-layer cost (closed form), at the profile's overlap; copy them into ``moe_w4a16_stream_efficiency``,
``matmul_flops_per_s.w4a16`` and ``moe_w4a16_layer_fixed_us``. Writes ``planner_vs_h200_int4.json`` next to the results
file (or ``--out``), which the CPU tests read.

``--fp8-results`` does the same for block-FP8 experts from a bf16 run's rows that also timed the FP8 weights
(``fp8_us``: ``moe_layer.py``'s ``dsv3`` case, the backend on the same weights quantized to block FP8): the prediction
is ``predict_moe_layer_time`` with ``fp8_block128`` weights, the fit of the profile's three W8A16 figures
(``moe_w8a16_stream_efficiency``, ``matmul_flops_per_s.w8a16``, ``moe_w8a16_layer_fixed_us``); it writes
``planner_vs_h200_fp8.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import sys
from pathlib import Path

from epmoe.plan.costs import (
    MoEDims,
    bytes_per_param,
    expected_distinct_experts,
    expert_activation_bytes,
    expert_layer_ms,
    predict_moe_layer_time,
)
from epmoe.plan.hardware import HardwareProfile, load_hardware

ROOT = Path(__file__).resolve().parent
DEFAULT_RESULTS = ROOT / "results" / "moe_layer_h200.json"
TARGET = 0.25  # |predicted / measured - 1| allowed at every measured size
OVERLAP_GRID = [i / 1000 for i in range(1001)]  # overlaps tried by fit_overlap_and_fixed
# The shapes of benchmarks/moe_layer.py's CASES: (MoE-layer shape, experts held by the GPU).
CASES = {
    "qwen3": (MoEDims(hidden_size=2048, moe_intermediate_size=768, num_experts=128, top_k=8), 128),
    "dsv3": (MoEDims(hidden_size=7168, moe_intermediate_size=2048, num_experts=256, top_k=8), 32),
}


KIMI = MoEDims(hidden_size=7168, moe_intermediate_size=2048, num_experts=384, top_k=8)
# The shapes of benchmarks/moe_layer.py's INT4_CASES (group 32).
INT4_CASES = {"kimi_int4": (KIMI, 48), "kimi_full_int4": (KIMI, 384)}
INT4_FORMAT = "int4_group32"
FP8_FORMAT = "fp8_block128"
GPTOSS = dict(hidden_size=2880, moe_intermediate_size=2880, top_k=4)
# The shapes of benchmarks/moe_layer.py's MXFP4_CASES (every expert on the GPU).
MXFP4_CASES = {"gptoss_mxfp4": (MoEDims(num_experts=128, **GPTOSS), 128),
               "gptoss20b_mxfp4": (MoEDims(num_experts=32, **GPTOSS), 32)}
EFFICIENCY_GRID = [i / 100 for i in range(30, 101)]
RATE_GRID = [r * 1e12 for r in range(50, 1001, 2)]


def case_shape(row: dict) -> tuple[MoEDims, int]:
    """The layer shape and local expert count of a results row, checked against the row's own numbers.

    Raises:
        ValueError: an unknown case, or a row whose bytes per active expert disagree with the shape.
    """
    if row["case"] not in CASES:
        raise ValueError(f"case {row['case']!r} is not known; known: {', '.join(CASES)}")
    dims, local = CASES[row["case"]]
    if row.get("active_slots") and row["weight_bytes"] != row["active_slots"] * dims.expert_params() * 2:
        raise ValueError(f"row {row['case']}/{row['tokens']}: weight_bytes {row['weight_bytes']} is not "
                         f"active_slots x 3 D F x 2 B for D {dims.hidden_size}, F {dims.moe_intermediate_size}")
    return dims, local


def hardware_for(results: dict, name: str, ceilings: str) -> HardwareProfile:
    """The profile to predict with: as shipped, or with the run's measured bandwidth and bf16 rate."""
    hw = load_hardware(name)
    if ceilings == "run":
        c = results["ceilings"]
        flops = dict(hw.matmul_flops_per_s, bf16=c["bf16_flop_per_s"])
        hw = dataclasses.replace(hw, hbm_bytes_per_s=c["copy_bytes_per_s"], matmul_flops_per_s=flops)
    return hw


def compare(results: dict, hw: HardwareProfile) -> list[dict]:
    """One entry per measured row: measured and predicted µs of our backend, their ratio, the parts."""
    out = []
    for row in results["rows"]:
        dims, local = case_shape(row)
        t = row["tokens"]
        rows = t * dims.top_k * local / dims.num_experts
        touched = expected_distinct_experts(t, dims.num_experts, dims.top_k, local)
        pred_us = predict_moe_layer_time(dims, t, local, hw, "bf16") * 1e3
        # the same model with the experts this run's random routing actually hit, instead of the expectation
        hit = row.get("active_slots") or touched
        at_hit_us = expert_layer_ms(dims, rows, hit, 1, hw, "bf16") * 1e3
        out.append({
            "case": row["case"], "tokens": t, "graph": row.get("graph"),
            "active_measured": row.get("active_slots"), "active_expected": touched,
            "measured_us": row["ours_us"], "predicted_us": pred_us, "ratio": pred_us / row["ours_us"],
            "predicted_at_measured_hits_us": at_hit_us, "ratio_at_measured_hits": at_hit_us / row["ours_us"],
            "weights_us": touched * dims.expert_params() * 2 / hw.hbm_bytes_per_s * 1e6,
            "activations_us": expert_activation_bytes(dims, rows) / hw.hbm_bytes_per_s * 1e6,
            "matmul_us": rows * 2 * dims.expert_params() / hw.flops_per_s("bf16") * 1e6,
            "fixed_us": hw.moe_layer_fixed_us,
            "overlap": hw.moe_stream_matrix_overlap,
            "floor_us": row.get("floor_us"),
        })
    return out


def fit_overlap_and_fixed(entries: list[dict]) -> tuple[float, float, float]:
    """Least-squares ``(overlap, fixed µs, sum of squared relative errors)`` over all rows.

    For each overlap of ``OVERLAP_GRID`` the prediction is ``base_i + fixed`` with ``base_i = max(s_i, x_i)
    + (1 - overlap) min(s_i, x_i)`` (``s``: weight + activation streaming, ``x``: matrix work); the fixed
    cost minimising ``sum((base_i + fixed - m_i)^2 / m_i^2)`` is the closed form, or 0 when that is
    negative. Ties keep the smaller overlap.
    """
    parts = [(e["weights_us"] + e["activations_us"], e["matmul_us"], e["measured_us"]) for e in entries]
    best = None
    for overlap in OVERLAP_GRID:
        base = [(max(s, x) + (1 - overlap) * min(s, x), m) for s, x, m in parts]
        fixed = max(0.0, sum((m - b) / m**2 for b, m in base) / sum(1 / m**2 for _, m in base))
        sse = sum(((b + fixed) / m - 1) ** 2 for b, m in base)
        if best is None or sse < best[2]:
            best = (overlap, fixed, sse)
    return best


def int4_measured_us(row: dict, dims: MoEDims, local: int) -> float | None:
    """The measured time of the INT4 path the backend takes now at the row's size (``None``: not timed in the
    run). For the MMA path, ``int4_mma`` is the default tiles of the run that wrote the row (``moe_layer.py``)."""
    import torch

    from epmoe.experts.triton.int4 import int4_path

    pairs = row["tokens"] * dims.top_k * local // dims.num_experts  # the pairs an EP rank's tokens route
    return row.get(f"int4_{int4_path(pairs, torch.bfloat16, local, hopper=True)}_us")


def compare_int4(results: dict, hw: HardwareProfile) -> list[dict]:
    """One entry per INT4 row (measured: the path taken now) and per MXFP4 row (measured: the backend, the path
    ``mxfp4.mxfp4_path`` took in that run): measured and predicted µs, their ratio, the parts."""
    out = []
    rows = [(row, INT4_CASES, INT4_FORMAT) for row in results.get("int4_rows", [])]
    rows += [(row, MXFP4_CASES, "mxfp4") for row in results.get("mxfp4_rows", [])]
    for row, cases, fmt in rows:
        if row["case"] not in cases:
            raise ValueError(f"{fmt} case {row['case']!r} is not known; known: {', '.join(cases)}")
        dims, local = cases[row["case"]]
        measured = int4_measured_us(row, dims, local) if fmt == INT4_FORMAT else row.get("mxfp4_us")
        if measured is not None:
            out.append(_packed_entry(row, dims, local, measured, fmt, hw))
    return out


def compare_fp8(results: dict, hw: HardwareProfile) -> list[dict]:
    """One entry per row of a bf16 run that also timed the backend on block-FP8 weights (``fp8_us``): measured and
    predicted µs, their ratio, the parts."""
    out = []
    for row in results["rows"]:
        if row.get("fp8_us") is not None:
            dims, local = case_shape(row)
            out.append(_packed_entry(row, dims, local, row["fp8_us"], FP8_FORMAT, hw))
    return out


def _packed_entry(row: dict, dims: MoEDims, local: int, measured: float, fmt: str, hw: HardwareProfile) -> dict:
    """A quantized row's entry: measured and predicted µs of ``fmt`` experts, their ratio, and what the fit needs
    (the bytes streamed at the full bandwidth, the FLOPs)."""
    t = row["tokens"]
    rows_on = t * dims.top_k * local / dims.num_experts
    touched = expected_distinct_experts(t, dims.num_experts, dims.top_k, local)
    pred_us = predict_moe_layer_time(dims, t, local, hw, fmt) * 1e3
    return {
        "case": row["case"], "tokens": t, "active_measured": row.get("active_slots"),
        "active_expected": touched, "measured_us": measured, "predicted_us": pred_us,
        "ratio": pred_us / measured,
        # at the full bandwidth (the fit divides it by the stream efficiency)
        "stream_us": (touched * dims.expert_params() * bytes_per_param(fmt)
                      + expert_activation_bytes(dims, rows_on)) / hw.hbm_bytes_per_s * 1e6,
        "flops": rows_on * 2 * dims.expert_params(),
    }


def fit_packed(entries: list[dict], overlap: float) -> tuple[float, float, float, float]:
    """Least-squares ``(stream efficiency, matrix FLOP/s, fixed µs, sum of squared relative errors)`` over the rows
    of one quantized format at ``overlap``: for each efficiency of ``EFFICIENCY_GRID`` and rate of ``RATE_GRID`` the
    prediction is ``base_i + fixed``, the fixed cost in closed form as in ``fit_overlap_and_fixed``."""
    best = None
    for eff in EFFICIENCY_GRID:
        for rate in RATE_GRID:
            base = []
            for e in entries:
                s, x = e["stream_us"] / eff, e["flops"] / rate * 1e6
                base.append((max(s, x) + (1 - overlap) * min(s, x), e["measured_us"]))
            fixed = max(0.0, sum((m - b) / m**2 for b, m in base) / sum(1 / m**2 for _, m in base))
            sse = sum(((b + fixed) / m - 1) ** 2 for b, m in base)
            if best is None or sse < best[3]:
                best = (eff, rate, fixed, sse)
    return best


def main_packed(args, kind: str) -> int:
    """``--int4-results`` (``kind`` ``w4a16``) or ``--fp8-results`` (``w8a16``): the rows against the profile's
    figures of that kind, and their fit."""
    path = Path(args.int4_results if kind == "w4a16" else args.fp8_results)
    results = json.loads(path.read_text())
    hw = load_hardware(args.hardware)
    entries = compare_int4(results, hw) if kind == "w4a16" else compare_fp8(results, hw)
    eff, rate, fixed, sse = fit_packed(entries, hw.moe_stream_matrix_overlap)
    outside = [e for e in entries if abs(e["ratio"] - 1) > TARGET]
    out = Path(args.out) if args.out else path.with_name(f"planner_vs_h200_{'int4' if kind == 'w4a16' else 'fp8'}"
                                                         f".json")
    # MXFP4 rows alone are priced with, and fit, the profile's moe_mxfp4_* figures where it has them
    own = hw.moe_mxfp4_stream_efficiency is not None or hw.moe_mxfp4_layer_fixed_us is not None
    figures = "mxfp4" if kind == "w4a16" and not results.get("int4_rows") and own else kind
    profile_eff, profile_fixed = hw.quantized_expert_figures(kind, mxfp4=figures == "mxfp4")
    doc = {"results": path.name, "device": results.get("device"), "hardware": hw.name,
           f"moe_{figures}_stream_efficiency": profile_eff, f"{kind}_flops_per_s": hw.flops_per_s(kind),
           f"moe_{figures}_layer_fixed_us": profile_fixed,
           "fitted_stream_efficiency": eff,
           f"fitted_{kind}_flops_per_s": rate, "fitted_fixed_us": fixed, "fitted_sum_sq_rel_err": sse,
           "target": TARGET, "all_within_target": not outside, "rows": entries}
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"{figures.upper()} results {path} ({results.get('device')}); model {hw.name}: stream efficiency "
          f"{profile_eff:.2f}, {kind} {hw.flops_per_s(kind) / 1e12:.0f} TFLOP/s, fixed "
          f"{profile_fixed} us, overlap {hw.moe_stream_matrix_overlap:.3f}")
    print(f"{'case':15} {'T':>5} {'hit':>4} {'E[hit]':>6} {'measured':>9} {'predicted':>9} {'ratio':>6}")
    for e in entries:
        flag = "" if abs(e["ratio"] - 1) <= TARGET else "  OUTSIDE"
        print(f"{e['case']:15} {e['tokens']:5d} {e['active_measured'] or 0:4d} {e['active_expected']:6.1f} "
              f"{e['measured_us']:9.1f} {e['predicted_us']:9.1f} {e['ratio']:6.2f}{flag}")
    print(f"{len(entries) - len(outside)}/{len(entries)} rows within {TARGET:.0%}")
    bound = " (the grid's bound: these rows do not determine the rate)" if rate in (RATE_GRID[0], RATE_GRID[-1]) else ""
    print(f"least-squares fit: stream efficiency {eff:.2f}, {kind} {rate / 1e12:.0f} TFLOP/s{bound}, fixed {fixed:.1f} "
          f"us; sum of squared relative errors {sse:.4f} (the profile's figures: moe_{figures}_stream_efficiency, "
          f"moe_{figures}_layer_fixed_us, matmul_flops_per_s.{kind})")
    print(f"wrote {out}")
    return 1 if args.check and outside else 0


def _bad_packed_row(results: dict) -> str | None:
    """What is wrong with the INT4 and MXFP4 rows of ``results`` (``None``: nothing): none at all, an unknown case, a
    ``tokens`` that is not a positive integer, or a time (``mxfp4_us``, each ``int4_*_us``) that is not a positive
    finite number; the row and field named."""
    rows = [(f"int4_rows[{i}]", row, INT4_CASES) for i, row in enumerate(results.get("int4_rows") or [])]
    rows += [(f"mxfp4_rows[{i}]", row, MXFP4_CASES) for i, row in enumerate(results.get("mxfp4_rows") or [])]
    if not rows:
        return "holds no INT4 or MXFP4 row to compare"
    for where, row, cases in rows:
        if not isinstance(row, dict) or row.get("case") not in cases:
            case = row.get("case") if isinstance(row, dict) else row
            return f"{where} has case {case!r}; known: {', '.join(cases)}"
        tokens = row.get("tokens")
        if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 1:
            return f"{where} has tokens {tokens!r}; expected a positive integer"
        times = {k: v for k, v in row.items() if k.endswith("_us") and (k == "mxfp4_us" or k.startswith("int4_"))
                 and not k.endswith("floor_us")}
        if cases is MXFP4_CASES and "mxfp4_us" not in times:
            return f"{where} has no 'mxfp4_us' (the backend's time)"
        for k, v in times.items():
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v <= 0:
                return f"{where} has {k} {v!r}; expected a positive finite number of us"
    return None


def _bad_fp8_row(results: dict) -> str | None:
    """What is wrong with the FP8 rows of ``results`` (``None``: nothing): none at all, an unknown case, or a
    ``tokens`` or ``fp8_us`` that is not a positive number; the row and field named."""
    rows = [(f"rows[{i}]", row) for i, row in enumerate(results["rows"]) if isinstance(row, dict) and "fp8_us" in row]
    if not rows:
        return "holds no row with an 'fp8_us' (moe_layer.py's dsv3 case times the FP8 weights)"
    for where, row in rows:
        if row.get("case") not in CASES:
            return f"{where} has case {row.get('case')!r}; known: {', '.join(CASES)}"
        tokens, us = row.get("tokens"), row["fp8_us"]
        if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 1:
            return f"{where} has tokens {tokens!r}; expected a positive integer"
        if not isinstance(us, (int, float)) or isinstance(us, bool) or not math.isfinite(us) or us <= 0:
            return f"{where} has fp8_us {us!r}; expected a positive finite number of us"
    return None


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """A bad flag is an argparse error (exit 2) naming the flag, before any work: an unreadable or wrong results
    file, an unknown or unreadable profile, an --out whose folder is missing, --int4-results of INT4 rows without
    Triton."""
    if args.int4_results and args.fp8_results:
        p.error("--int4-results and --fp8-results each choose a mode: give one")
    if args.int4_results:
        flag, name, lists = "--int4-results", args.int4_results, ("int4_rows", "mxfp4_rows")
    else:
        flag, name, lists = ("--fp8-results", args.fp8_results, ("rows",)) if args.fp8_results else (
            "--results", args.results, ("rows",))
    try:
        results = json.loads(Path(name).read_text())
    except (OSError, ValueError) as exc:
        p.error(f"{flag} {name!r} cannot be read as JSON: {exc}")
    if not isinstance(results, dict) or not any(isinstance(results.get(k), list) for k in lists):
        bf16 = args.int4_results and isinstance(results, dict) and isinstance(results.get("rows"), list)
        hint = " (its 'rows' are a bf16 run's: --results takes them)" if bf16 else ""
        p.error(f"{flag} {name!r} holds no {' or '.join(repr(k) for k in lists)} list: not a results JSON of "
                f"benchmarks/moe_layer.py{hint}")
    if args.int4_results:
        bad = _bad_packed_row(results)
        if bad:
            p.error(f"{flag} {name!r}: {bad}")
    if args.fp8_results:
        bad = _bad_fp8_row(results)
        if bad:
            p.error(f"{flag} {name!r}: {bad}")
    if args.ceilings == "run" and not isinstance(results.get("ceilings"), dict):
        p.error(f"--ceilings run needs the run's 'ceilings' in {flag} {name!r}, which has none")
    try:
        load_hardware(args.hardware)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        p.error(f"--hardware {args.hardware!r}: {exc.args[0] if isinstance(exc, KeyError) and exc.args else exc}")
    if args.out and Path(args.out).is_dir():
        p.error(f"--out {args.out!r} is a folder; it names the JSON file to write")
    if args.out and not Path(args.out).resolve().parent.is_dir():
        p.error(f"--out {args.out!r}: folder '{Path(args.out).resolve().parent}' does not exist")
    if args.int4_results and results.get("int4_rows") and importlib.util.find_spec("triton") is None:
        p.error("--int4-results takes each row's time from the INT4 path the backend picks, which imports Triton; "
                "Triton is not installed here")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--results", default=str(DEFAULT_RESULTS), help=f"moe_layer.py results JSON (default: "
                   f"{DEFAULT_RESULTS.relative_to(DEFAULT_RESULTS.parents[2])})")
    p.add_argument("--hardware", default="h200-sxm", help="profile name or path (default: h200-sxm)")
    p.add_argument("--ceilings", choices=("profile", "run"), default="profile",
                   help="bandwidth and bf16 rate from the profile (as epmoe plan, the default) or from the run's "
                        "measurement")
    p.add_argument("--out", help="output JSON (default: planner_vs_h200.json next to --results)")
    p.add_argument("--check", action="store_true", help=f"exit 1 when a row is off by more than {TARGET * 100:.0f}%%")
    p.add_argument("--int4-results", help="an INT4 or MXFP4 moe_layer.py results JSON: those rows and the fit of the "
                   "W4A16 figures instead (MXFP4 rows alone: of the profile's moe_mxfp4_* figures where it has them)")
    p.add_argument("--fp8-results", help="a bf16 moe_layer.py results JSON whose rows timed block-FP8 weights "
                   "(fp8_us): those and the fit of the W8A16 figures instead")
    args = p.parse_args(argv)
    check_args(p, args)
    if args.int4_results:
        return main_packed(args, "w4a16")
    if args.fp8_results:
        return main_packed(args, "w8a16")
    path = Path(args.results)
    results = json.loads(path.read_text())
    hw = hardware_for(results, args.hardware, args.ceilings)
    entries = compare(results, hw)
    fitted_overlap, fitted, fitted_sse = fit_overlap_and_fixed(entries)
    worst = max(entries, key=lambda e: abs(e["ratio"] - 1))
    outside = [e for e in entries if abs(e["ratio"] - 1) > TARGET]
    c = results.get("ceilings", {})
    doc = {
        "results": (str(path.resolve().relative_to(ROOT.parent)) if path.resolve().is_relative_to(ROOT.parent)
                    else str(path)),
        "device": results.get("device"), "torch": results.get("torch"),
        "triton": results.get("triton"), "hardware": hw.name, "ceilings": args.ceilings,
        "hbm_bytes_per_s": hw.hbm_bytes_per_s, "bf16_flops_per_s": hw.flops_per_s("bf16"),
        "moe_layer_fixed_us": hw.moe_layer_fixed_us, "moe_stream_matrix_overlap": hw.moe_stream_matrix_overlap,
        "run_ceilings": c, "fitted_fixed_us": fitted, "fitted_overlap": fitted_overlap,
        "fitted_sum_sq_rel_err": fitted_sse, "target": TARGET, "worst_ratio": worst["ratio"],
        "all_within_target": not outside, "rows": entries,
    }
    out = Path(args.out) if args.out else path.with_name("planner_vs_h200.json")
    out.write_text(json.dumps(doc, indent=1) + "\n")

    print(f"results {path} ({results.get('device')}, torch {results.get('torch')}, triton {results.get('triton')})")
    print(f"model: {hw.name} ({args.ceilings}): hbm {hw.hbm_bytes_per_s / 1e12:.3f} TB/s, "
          f"bf16 {hw.flops_per_s('bf16') / 1e12:.0f} TFLOP/s, fixed {hw.moe_layer_fixed_us:.1f} us, "
          f"overlap {hw.moe_stream_matrix_overlap:.3f}"
          + (f"; run measured copy {c['copy_bytes_per_s'] / 1e12:.3f} TB/s, bf16 {c['bf16_flop_per_s'] / 1e12:.0f} "
             "TFLOP/s" if c else ""))
    print(f"{'case':5} {'T':>5} {'graph':>5} {'hit':>4} {'E[hit]':>6} {'measured':>9} {'predicted':>9} {'ratio':>6}"
          f"  {'weights':>7} {'acts':>6} {'matmul':>6} {'fixed':>5} {'r@hit':>6}")
    for e in entries:
        flag = "" if abs(e["ratio"] - 1) <= TARGET else "  OUTSIDE"
        print(f"{e['case']:5} {e['tokens']:5d} {str(e['graph'])[0]:>5} {e['active_measured'] or 0:4d} "
              f"{e['active_expected']:6.1f} {e['measured_us']:9.1f} {e['predicted_us']:9.1f} {e['ratio']:6.2f}  "
              f"{e['weights_us']:7.1f} {e['activations_us']:6.1f} {e['matmul_us']:6.1f} {e['fixed_us']:5.1f} "
              f"{e['ratio_at_measured_hits']:6.2f}{flag}")
    print(f"worst: {worst['case']} T={worst['tokens']} ratio {worst['ratio']:.2f}; "
          f"{len(entries) - len(outside)}/{len(entries)} rows within {TARGET:.0%}")
    print(f"least-squares fit for these rows: overlap {fitted_overlap:.3f} (profile: "
          f"{hw.moe_stream_matrix_overlap:.3f}), "
          f"fixed per-layer cost {fitted:.1f} us (profile: {hw.moe_layer_fixed_us:.1f} us); "
          f"sum of squared relative errors {fitted_sse:.4f}")
    print(f"wrote {out}")
    return 1 if args.check and outside else 0


if __name__ == "__main__":
    sys.exit(main())
