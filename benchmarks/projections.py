"""A decode step's dense projections on one GPU: cuBLAS (``F.linear``) against the split-K kernel of
``engine.skinny``, per model, projection and row count, as one layer of an 8-layer CUDA graph (each layer its own
weight, L2 flushed before each replay), beside the weight-read floor at the copy bandwidth measured in the run.

    python3 benchmarks/projections.py [--rows 1,4,8,16] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from epmoe.engine.skinny import skinny_linear
from timing import measure_ceilings, rel_err, time_in_model

LAYERS = 8
# (model, projection, N, K): Qwen3-30B-A3B's fused q/k/v and o projections, DeepSeek-V3's o projection
SHAPES = [("qwen3-30b-a3b", "qkv_proj", 5120, 2048), ("qwen3-30b-a3b", "o_proj", 2048, 4096),
          ("deepseek-v3", "o_proj", 7168, 16384)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,4,8,16")
    p.add_argument("--out", help="write the rows as JSON here")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    ceil = measure_ceilings()
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    rows = []
    for model, name, n, k in SHAPES:
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5 for _ in range(LAYERS)]
        counters = [torch.zeros(-(-n // 32), dtype=torch.int32, device="cuda") for _ in range(LAYERS)]
        for m in (int(v) for v in args.rows.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            floor_us = n * k * 2 / ceil["copy_bytes_per_s"] * 1e6
            cublas = time_in_model([lambda w=w: F.linear(x, w) for w in weights], flush) * 1e3
            skinny = time_in_model([lambda w=w, c=c: skinny_linear(x, w, None, c) for w, c in zip(weights, counters)],
                                   flush) * 1e3
            err = rel_err(skinny_linear(x, weights[0], None, counters[0]), F.linear(x, weights[0]))
            rows.append({"model": model, "projection": name, "n": n, "k": k, "rows": m, "floor_us": floor_us,
                         "cublas_us": cublas, "skinny_us": skinny, "rel_err": err})
        del weights
        torch.cuda.empty_cache()
    if args.out:
        Path(args.out).write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "ceilings": ceil, "rows": rows},
                                             indent=1))
    print(f"us per layer (CUDA graph of {LAYERS} layers, L2 flushed); copy {ceil['copy_bytes_per_s'] / 1e12:.2f} TB/s")
    print(f"{'model':14s} {'proj':9s} {'M':>3s} {'floor':>7s} {'cuBLAS':>7s} {'skinny':>7s} {'rel err':>8s}")
    for r in rows:
        print(f"{r['model']:14s} {r['projection']:9s} {r['rows']:3d} {r['floor_us']:7.1f} {r['cublas_us']:7.1f} "
              f"{r['skinny_us']:7.1f} {r['rel_err']:8.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
