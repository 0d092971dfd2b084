"""The decode step's projections on one GPU: ``engine.gemv``'s Triton kernel against cuBLAS (``F.linear``).

    python benchmarks/gemv.py [--rows 1,8,16] [--sweep] [--out FILE.json]

Shapes: Qwen3-30B-A3B's fused q/k/v projection (5120 x 2048) and output projection (2048 x 4096), Qwen3's router
gate (128 x 2048). Each row: median of CUDA-graph replays (``triton.testing.do_bench_cudagraph``), the weight-read
floor (bytes over the copy bandwidth measured in the same run), cuBLAS, the kernel with its default tiles and,
with ``--sweep``, the best of ``SWEEP``. The kernel's output is checked against ``F.linear`` first. Table last.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
import triton

from epmoe.engine.gemv import DEFAULT_GEMV_CONFIG, GemvConfig, gemv_triton

SHAPES = {"qwen3 qkv": (5120, 2048), "qwen3 o_proj": (2048, 4096), "qwen3 gate": (128, 2048)}
SWEEP = [GemvConfig(n, k, w, s) for n in (8, 16, 32) for k in (128, 256, 512) for w in (2, 4) for s in (3, 4)]


def copy_bandwidth() -> float:
    """Bytes per second of a 2 GiB device-to-device copy (read + write)."""
    src = torch.empty(2**30, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src))
    return 2 * src.numel() * src.element_size() / (ms / 1e3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,8,16")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    bw = copy_bandwidth()
    rows = []
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda") / k ** 0.5
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            want = F.linear(x.float(), w.float())
            torch.testing.assert_close(gemv_triton(x, w).float(), want, rtol=2e-2, atol=2e-2)
            floor = (n * k + m * (k + n)) * 2 / bw * 1e6
            cublas = triton.testing.do_bench_cudagraph(lambda: F.linear(x, w)) * 1e3  # noqa: B023
            ours = triton.testing.do_bench_cudagraph(lambda: gemv_triton(x, w)) * 1e3  # noqa: B023
            best, best_cfg = ours, DEFAULT_GEMV_CONFIG
            if args.sweep:
                for cfg in SWEEP:
                    us = triton.testing.do_bench_cudagraph(lambda: gemv_triton(x, w, None, cfg)) * 1e3  # noqa: B023
                    if us < best:
                        best, best_cfg = us, cfg
            rows.append({"shape": name, "n": n, "k": k, "rows": m, "floor_us": floor, "cublas_us": cublas,
                         "triton_us": ours, "best_us": best, "best_config": best_cfg.__dict__})
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"device": torch.cuda.get_device_name(), "copy_bytes_per_s": bw, "rows": rows}, fh, indent=1)
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s")
    print(f"{'shape':14} {'rows':>4} {'floor us':>9} {'cuBLAS':>8} {'triton':>8} {'best':>8}  best tiles")
    for r in rows:
        c = r["best_config"]
        print(f"{r['shape']:14} {r['rows']:4d} {r['floor_us']:9.2f} {r['cublas_us']:8.2f} {r['triton_us']:8.2f} "
              f"{r['best_us']:8.2f}  n{c['block_n']} k{c['block_k']} w{c['num_warps']} s{c['num_stages']}")


if __name__ == "__main__":
    main()
