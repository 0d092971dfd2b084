"""EPLB benchmark: DeepSeek's policy vs epmoe's on real OLMoE counts and a DeepSeek-V3-sized case.

    python benchmarks/eplb.py [--out benchmarks/results/eplb.json] [--exact-time 20] [--no-reference]

Per case: balancedness of DeepSeek's policy (ours, written from github.com/deepseek-ai/EPLB), of the
published reference (SGLang's ``eplb_algorithms/deepseek.py``, fetched with ``pip download --no-deps``
and loaded by file path; skipped with a message when unavailable), of epmoe's balancer, the lower bound
(as balancedness: mean / bound), the exact optimum on layers HiGHS proves within the time limit, and run
times. Also movement-aware rebalancing on the drift between OLMoE domains.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import numpy as np
import torch

from epmoe.balance import balance_deepseek, balance_epmoe, balancedness, max_load_lower_bound
from epmoe.balance.exact import solve_exact
from epmoe.balance.moves import align_placement, placement_moves, rebalance_with_moves
from epmoe.loads import read_csv_loads
from epmoe.placement import ExpertPlacement

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "data" / "loads"
REF_PATH = "sglang/srt/eplb/eplb_algorithms/deepseek.py"


def load_reference(workdir: Path):
    """SGLang's DeepSeek EPLB module loaded by file path, or ``(None, reason)``."""
    try:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "sglang",
                        "-d", str(workdir)],
                       check=True, capture_output=True, timeout=180)
        wheel = next(workdir.glob("sglang-*.whl"))
        with zipfile.ZipFile(wheel) as z:
            z.extract(REF_PATH, workdir)
        spec = importlib.util.spec_from_file_location("sglang_eplb_deepseek", workdir / REF_PATH)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod, wheel.name
    except Exception as exc:  # any failure means: skip the reference, say why
        return None, f"{type(exc).__name__}: {exc}"


def timed(fn, *args, repeat=3, **kw):
    out, best = None, np.inf
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn(*args, **kw)
        best = min(best, time.perf_counter() - t)
    return out, best * 1e3


def synthetic_deepseek_v3(seed: int = 0) -> tuple[np.ndarray, dict]:
    """58 layers x 256 experts, lognormal loads matching skew_quoted.json's per-slot std/mean (164.1/128)."""
    doc = json.loads((DATA / "skew_quoted.json").read_text())
    slot = doc["entries"][0]["table_1"][0]["by_expert_slot"]
    cv = slot["std_dev"] / slot["average"]
    sigma = float(np.sqrt(np.log1p(cv**2)))
    rng = np.random.default_rng(seed)
    w = np.round(rng.lognormal(0.0, sigma, (58, 256)) * slot["average"] / np.exp(sigma**2 / 2))
    trivial = ExpertPlacement.trivial(58, 256, 32)
    r = torch.from_numpy(w).reshape(58, 32, 8).sum(-1)
    stats = {
        "target_slot_std_over_mean": cv,
        "slot_std_over_mean": float((w.std(1) / w.mean(1)).mean()),
        "target_rank_imbalance_no_eplb": doc["entries"][0]["table_1"][0]["by_rank"]["imbalance_ratio"],
        "rank_imbalance_no_eplb": float(((r.max(1).values - r.mean(1)) / r.mean(1)).mean()),
        "target_slot_imbalance": slot["imbalance_ratio"],
        "slot_imbalance": float(((w.max(1) - w.mean(1)) / w.mean(1)).mean()),
        "trivial_balancedness": balancedness(w, trivial),
    }
    return w, stats


def run_case(name, w, ep, red, ref, exact_time):
    row = {"case": name, "ep": ep, "redundant": red, "layers": int(w.shape[0]), "experts": int(w.shape[1])}
    ds, row["deepseek_ms"] = timed(balance_deepseek, w, ep, red)
    ours, row["epmoe_ms"] = timed(balance_epmoe, w, ep, red)
    row["deepseek"] = balancedness(w, ds)
    row["epmoe"] = balancedness(w, ours)
    bound = max_load_lower_bound(w, ep, red).numpy()
    row["bound"] = float((w.sum(1) / ep / bound).mean())
    if ref is not None:
        out, row["reference_ms"] = timed(ref.rebalance_experts, torch.from_numpy(w).float(), w.shape[1] + red, 1, 1, ep,
                                         False)
        row["reference"] = balancedness(w, ExpertPlacement(out[0], num_experts=w.shape[1], ep_size=ep))
    if exact_time > 0:
        sol = solve_exact(w, ep, red, time_limit_s=exact_time)
        solved = sol.optimal.numpy()
        row["exact_layers_solved"] = int(solved.sum())
        row["exact_ms"] = sol.solve_ms
        if solved.any():
            mean = w.sum(1) / ep
            ours_max = mean / np.array([
                balancedness(w[i:i + 1], ExpertPlacement(ours.phy2log[i:i + 1], w.shape[1], ep)) for i in range(len(w))
            ])
            gap = ours_max[solved] / sol.max_load.numpy()[solved] - 1
            row["epmoe_gap_to_exact_max"] = float(gap.max())
    return row


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "eplb.json"))
    ap.add_argument("--exact-time", type=float, default=20.0, help="HiGHS budget per OLMoE case (s; 0: none)")
    ap.add_argument("--no-reference", action="store_true", help="skip the published reference")
    args = ap.parse_args(argv)
    if not args.exact_time >= 0:  # NaN too
        ap.error(f"--exact-time must be a number of seconds >= 0 (0: no exact solve), got {args.exact_time}")
    torch.set_num_threads(1)
    load, names = read_csv_loads(DATA / "olmoe_expert_counts.csv")
    w = load.numpy()
    with tempfile.TemporaryDirectory() as tmp:
        ref, ref_note = (None, "skipped (--no-reference)") if args.no_reference else load_reference(Path(tmp))
        if ref is None:
            print(f"reference DeepSeek EPLB not run: {ref_note}")
        rows = []
        for ep in (4, 8, 16):
            for red in (0, ep, 2 * ep):
                if (64 + red) % ep == 0:
                    rows.append(run_case("olmoe", w, ep, red, ref, args.exact_time))
        v3, v3_stats = synthetic_deepseek_v3()
        rows.append(run_case("deepseek-v3-synthetic", v3, 32, 32, ref, 0.0))
    drift = []
    for a, b in (("arxiv", "github"), ("c4", "wikipedia"), ("book", "github")):
        for ep, red in ((8, 8), (16, 16)):
            old = w[[names.index(f"{a}:{layer}") for layer in (0, 7, 15)]]
            new = w[[names.index(f"{b}:{layer}") for layer in (0, 7, 15)]]
            cur = balance_epmoe(old, ep, red)
            fresh = balance_epmoe(new, ep, red)
            rb = rebalance_with_moves(new, cur)
            drift.append({
                "from": a, "to": b, "ep": ep, "redundant": red, "stale": balancedness(new, cur),
                "fresh": balancedness(new, fresh), "fresh_moves": len(placement_moves(cur, fresh)),
                "fresh_aligned_moves": len(placement_moves(cur, align_placement(cur, fresh))),
                "rebalanced": balancedness(new, rb.placement), "moves": len(rb.moves),
            })
    doc = {"reference": ref_note, "deepseek_v3_synthetic": v3_stats, "cases": rows, "drift": drift}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1))
    print(f"{'case':22} {'G':>3} {'R':>3} {'deepseek':>9} {'ref':>7} {'epmoe':>7} {'bound':>7} {'exact':>9} {'gap':>7} "
          f"{'ds ms':>6} {'ours ms':>7}")
    for r in rows:
        ex = f"{r['exact_layers_solved']}/{r['layers']}" if "exact_layers_solved" in r else "-"
        gap = f"{r['epmoe_gap_to_exact_max'] * 100:.3f}%" if "epmoe_gap_to_exact_max" in r else "-"
        ref_b = f"{r['reference']:.4f}" if "reference" in r else "-"
        print(f"{r['case']:22} {r['ep']:>3} {r['redundant']:>3} {r['deepseek']:>9.4f} {ref_b:>7} {r['epmoe']:>7.4f} "
              f"{r['bound']:>7.4f} {ex:>9} {gap:>7} {r['deepseek_ms']:>6.1f} {r['epmoe_ms']:>7.1f}")
    print("drift (3 layers): from -> to, G, R: stale, from-scratch (moves, aligned moves), movement-aware (moves)")
    for d in drift:
        print(f"  {d['from']}->{d['to']} G={d['ep']} R={d['redundant']}: {d['stale']:.4f}, {d['fresh']:.4f} "
              f"({d['fresh_moves']}, {d['fresh_aligned_moves']}), {d['rebalanced']:.4f} ({d['moves']})")
    print(f"synthetic DeepSeek-V3 loads: {v3_stats}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
