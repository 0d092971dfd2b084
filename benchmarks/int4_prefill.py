"""INT4 prefill at Kimi-K2.5 shapes: the wgmma kernels, default and other tiles, against MMA16 and bf16.

The wgmma kernels (``w4a16_wgmma``) against the MMA path with 16-row blocks (``w4a16_mma``) and our bf16 path, on the
same weights and routing.

    python benchmarks/int4_prefill.py [--sizes 1024,4096] [--cases kimi_int4,kimi_full_int4] [--out PATH]

The EP-8 shard (48 of 384 experts, other ranks' pairs skipped) and all 384 experts on one GPU (hidden 7168, intermediate
2048, top-8, group 32), random packed weights and routing. The wgmma variants (``WGMMA_PREFILL``): ``wgmma`` the tiles
the backend takes (``default_wgmma_config`` for the size: 64-row blocks below 64 pairs a slot with the gate/up weight
words loaded into registers one step ahead, 128-row ones from there with the words staged through shared memory,
``WgmmaConfig.words_smem``; 32-row tails), ``wg_regs`` the 128-row blocks with the words in registers, ``wg64_regs`` the
64-row blocks with the words in registers, ``wg64_words`` / ``wg64_words4`` 64-row blocks with the words staged through
shared memory in three / four buffers. Per case, size and path: the median time as CUDA-graph replays after an L2 flush
(``timing.time_fn``), for the wgmma variants the token rows they compute per routed pair (padding included, from the
alignment) and the relative error of the output against the MMA path's (which the GPU tests check against the float64
reference); ``bf16``: the ``triton`` backend on the dequantized weights (the target: INT4 prefill no slower). Beside
each row its floors, as ``moe_layer.py`` computes them from the ceilings measured first in the same run
(``timing.measure_ceilings``): the FLOPs of the routed pairs (``2 pairs 3 D F``) over the bf16 matmul rate
(``flop_fl``), the packed INT4 values and scales of the slots the routing touches over the copy bandwidth (``read_fl``),
and the ``wgmma`` time over the larger of the two (``wg/fl``). Prints the ceilings, one line a path, then a table
(times, and below them the time over bf16's); writes JSON to ``--out`` (default ``$OUT/int4_prefill.json`` when ``$OUT``
is set).
"""

from __future__ import annotations

import argparse
import json
import os

import torch

try:
    import triton
except ImportError:  # a GPU benchmark; Triton comes with PyTorch's CUDA build
    raise SystemExit(f"{__file__} times GPU kernels and needs Triton (installed with PyTorch's CUDA build)") from None

from epmoe.experts import ExpertWeights, get_expert_backend
from epmoe.experts.triton.align_kernels import align_triton
from epmoe.experts.triton.int4 import dequantize_int4_triton
from epmoe.experts.triton.w4a16_mma import packed_mma_experts
from epmoe.experts.triton.w4a16_mma_config import MmaConfig
from epmoe.experts.triton.w4a16_wgmma import packed_wgmma_experts
from epmoe.experts.triton.w4a16_wgmma_config import default_wgmma_config
from epmoe.experts.weights import Activation
from moe_layer import (
    INT4_CASES,
    INT4_GROUP,
    WGMMA_PREFILL,
    ep_pairs,
    flop_floor_us,
    int4_read_floor_us,
    make_routing,
    random_int4_weights,
)
from timing import measure_ceilings, rel_err, time_fn


def bench_case(name: str, case: dict, sizes: list[int], ceil: dict, flush: torch.Tensor,
               gen: torch.Generator) -> list[dict]:
    """One line a path and size (printed) and one row a size (returned), with its floors from the measured ceilings
    ``ceil``; the case's weights are freed on return."""
    s, d, f, g = case["slots"], case["d"], case["f"], INT4_GROUP
    act, mma16 = Activation(), MmaConfig(block_m=16)
    backend = get_expert_backend("triton")
    q = random_int4_weights(case, gen)
    w = ExpertWeights(
        dequantize_int4_triton(q.w13_packed, q.w13_scale, g, torch.empty(s, 2 * f, d, device="cuda",
                                                                         dtype=torch.bfloat16)),
        dequantize_int4_triton(q.w2_packed, q.w2_scale, g, torch.empty(s, d, f, device="cuda", dtype=torch.bfloat16)))
    rows = []
    for t in sizes:
        x, slots, tw = make_routing(case, t, gen)
        pairs = int((slots >= 0).sum())
        active = int(torch.unique(slots[slots >= 0]).numel())
        expected = ep_pairs(case, t)
        ref = packed_mma_experts(x, slots, tw, q, act, config=mma16)
        row = {"case": name, "tokens": t, "pairs": pairs, "slots": s, "active_slots": active,
               "floor_flop_us": flop_floor_us(case, pairs, ceil),
               "floor_int4_read_us": int4_read_floor_us(case, active, ceil)}
        row["floor_us"] = max(row["floor_flop_us"], row["floor_int4_read_us"])
        print(f"{name:15} T={t:5d} floors: FLOPs {row['floor_flop_us']:9.1f} us, INT4 weight read "
              f"{row['floor_int4_read_us']:9.1f} us ({active} slots)", flush=True)
        for key, cfg in WGMMA_PREFILL.items():
            c = cfg if cfg is not None else default_wgmma_config(g, expected, s)
            aln = align_triton(slots, s, c.block_m, tail_rows=c.tail_rows)
            row[f"{key}_rows_per_pair"] = int(aln.block_rows.sum()) / max(pairs, 1)
            row[f"{key}_err"] = rel_err(packed_wgmma_experts(x, slots, tw, q, act, config=c), ref)
            row[f"{key}_us"] = time_fn(lambda c=c: packed_wgmma_experts(x, slots, tw, q, act, config=c), True,
                                       flush) * 1e3
            print(f"{name:15} T={t:5d} {key:9} {row[f'{key}_us']:9.1f} us  rows/pair "
                  f"{row[f'{key}_rows_per_pair']:5.2f}  rel_err(vs mma16) {row[f'{key}_err']:.2e}", flush=True)
        row["mma16_us"] = time_fn(lambda: packed_mma_experts(x, slots, tw, q, act, config=mma16), True, flush) * 1e3
        row["bf16_err"] = rel_err(backend(x, slots, tw, w, act, expected_pairs=expected), ref)
        row["bf16_us"] = time_fn(lambda: backend(x, slots, tw, w, act, expected_pairs=expected), True, flush) * 1e3
        print(f"{name:15} T={t:5d} {'mma16':9} {row['mma16_us']:9.1f} us", flush=True)
        print(f"{name:15} T={t:5d} {'bf16':9} {row['bf16_us']:9.1f} us  rel_err(vs mma16) {row['bf16_err']:.2e}",
              flush=True)
        row["wgmma_x_floor"] = row["wgmma_us"] / row["floor_us"] if row["floor_us"] else float("nan")
        rows.append(row)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="1024,4096")
    p.add_argument("--cases", default=",".join(INT4_CASES), help=f"of {list(INT4_CASES)}")
    p.add_argument("--out", default=os.path.join(os.environ["OUT"], "int4_prefill.json") if "OUT" in os.environ
                   else None)
    args = p.parse_args()
    ceil = measure_ceilings()
    print(f"ceilings: copy {ceil['copy_bytes_per_s'] / 1e12:.2f} TB/s, bf16 {ceil['bf16_flop_per_s'] / 1e12:.0f} "
          "TFLOP/s", flush=True)
    flush = torch.empty(256 << 20, device="cuda", dtype=torch.float16)
    gen = torch.Generator(device="cuda").manual_seed(2)
    sizes = [int(v) for v in args.sizes.split(",")]
    rows = [r for name in args.cases.split(",") for r in bench_case(name, INT4_CASES[name], sizes, ceil, flush, gen)]
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "triton": triton.__version__, "ceilings": ceil, "rows": rows}, fh, indent=1)
    keys = list(WGMMA_PREFILL) + ["mma16", "bf16"]
    print(f"\n{'case':15} {'T':>5} {'flop_fl':>8} {'read_fl':>8} " + " ".join(f"{k:>9}" for k in keys)
          + f" {'wg/fl':>6}  (us; below: x bf16)")
    for r in rows:
        print(f"{r['case']:15} {r['tokens']:5d} {r['floor_flop_us']:8.1f} {r['floor_int4_read_us']:8.1f} "
              + " ".join(f"{r[k + '_us']:9.1f}" for k in keys) + f" {r['wgmma_x_floor']:6.2f}")
        print(f"{'':15} {'':5} {'':8} {'':8} " + " ".join(f"{r[k + '_us'] / r['bf16_us']:9.2f}" for k in keys))

if __name__ == "__main__":
    main()
