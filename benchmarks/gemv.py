"""A decode step's attention projections at one and two rows: ``engine.gemv``'s kernel against cuBLAS.

    python3 benchmarks/gemv.py [--out results.json] [--rows 1,2]

The projections of Qwen3-30B-A3B (q/k/v fused, o), DeepSeek-V3 and Kimi-K2.5 (MLA: q_a, q_b, kv_a with the
rotary key, o) and, as a large weight, DeepSeek-V3's dense gate/up projection, from ``data/configs``, bf16,
random weights. Each projection is timed as in a decode step: 8 calls, each after a small elementwise kernel
that makes its input row (the norm's place), captured in one CUDA graph, each call reading its own weight
(8 of them: the L2 holds none of them at the call), per-call device time, median of 20 replays. Beside it the
weight-read floor (bytes / the copy bandwidth measured in the same run) and the ratio. Prints a table last.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from epmoe.engine.gemv import GEMV_MAX_WEIGHT_BYTES, gemv
from timing import graph_us, measure_ceilings, rel_err

REPO = Path(__file__).resolve().parents[1]
REPS = 8


def projections() -> list[tuple[str, int, int]]:
    """``(name, N, K)`` of each timed projection, from the configs in ``data/configs``."""
    out = []
    q3 = json.loads((REPO / "data/configs/qwen3-30b-a3b.config.json").read_text())
    hd = q3["head_dim"]
    out += [("qwen3 qkv", (q3["num_attention_heads"] + 2 * q3["num_key_value_heads"]) * hd, q3["hidden_size"]),
            ("qwen3 o_proj", q3["hidden_size"], q3["num_attention_heads"] * hd)]
    for model, path in (("dsv3", "deepseek-v3.config.json"), ("kimi", "kimi-k2.5.config.json")):
        c = json.loads((REPO / "data/configs" / path).read_text())
        c = c.get("text_config", c)
        h, d = c["num_attention_heads"], c["hidden_size"]
        out += [(f"{model} q_a", c["q_lora_rank"], d),
                (f"{model} q_b", h * (c["qk_nope_head_dim"] + c["qk_rope_head_dim"]), c["q_lora_rank"]),
                (f"{model} kv_a", c["kv_lora_rank"] + c["qk_rope_head_dim"], d),
                (f"{model} o_proj", d, h * c["v_head_dim"])]
        if model == "dsv3":
            out.append(("dsv3 dense gate_up", 2 * c["intermediate_size"], d))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="write the rows as JSON here")
    p.add_argument("--rows", default="1,2", help="row counts (default 1,2)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    ceil = measure_ceilings()
    rows = []
    torch.manual_seed(0)
    for name, n, k in projections():
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(REPS)]
        nbytes = n * k * 2
        floor_us = nbytes / ceil["copy_bytes_per_s"] * 1e6
        for m in (int(v) for v in args.rows.split(",")):
            x0 = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            x = torch.empty_like(x0)
            calls = {"cublas": lambda w: F.linear(x, w), "gemv": lambda w: gemv(x, w, pdl=True)}
            row = {"projection": name, "rows": m, "N": n, "K": k, "weight_mb": nbytes / 1e6, "floor_us": floor_us,
                   "gemv_limit_applies": m > 1 and nbytes > GEMV_MAX_WEIGHT_BYTES}
            for impl, call in calls.items():
                def step(call=call):
                    for w in weights:
                        torch.mul(x0, 1.0, out=x)  # the input row made by the kernel before, as the norm does
                        call(w)
                row[f"{impl}_us"] = graph_us(step, reps=1) / REPS
            x.copy_(x0)
            row["rel_err"] = rel_err(gemv(x, weights[0]), F.linear(x, weights[0]))
            rows.append(row)
    result = {"device": torch.cuda.get_device_name(), "copy_tb_s": ceil["copy_bytes_per_s"] / 1e12, "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"copy bandwidth {result['copy_tb_s']:.2f} TB/s; us per call, {REPS} weights per graph")
    print(f"{'projection':20} {'rows':>4} {'MB':>6} {'floor':>6} {'cuBLAS':>7} {'gemv':>7} {'x floor':>7} {'err':>8}")
    for r in rows:
        print(f"{r['projection']:20} {r['rows']:4d} {r['weight_mb']:6.1f} {r['floor_us']:6.1f} {r['cublas_us']:7.1f} "
              f"{r['gemv_us']:7.1f} {r['gemv_us'] / r['floor_us']:7.2f} {r['rel_err']:8.1e}"
              + ("  (above the two-row limit)" if r["gemv_limit_applies"] else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
