"""INT4 prefill kernels at Kimi-K2.5 shapes: the wgmma kernels (``w4a16_wgmma``) against the MMA path with 16-row
blocks (``w4a16_mma``), on the same packed weights and routing.

    python benchmarks/int4_prefill.py [--sizes 1024,4096]

The EP-8 shard (48 of 384 experts, other ranks' pairs skipped) and all 384 experts on one GPU (hidden 7168,
intermediate 2048, top-8, group 32), random packed weights and routing. Per case and size: each path's median time
as CUDA-graph replays after an L2 flush (``timing.time_fn``) and the relative error of the wgmma output against the
MMA path's (which the GPU tests check against the float64 reference). A quick check, without the bf16 weights that
``moe_layer.py --cases kimi_int4,kimi_full_int4`` also builds (its columns ``int4_wgmma``, ``bf16``).
"""

from __future__ import annotations

import argparse

import torch

from epmoe.experts.triton.w4a16_mma import MmaConfig, int4_mma_experts
from epmoe.experts.triton.w4a16_wgmma import int4_wgmma_experts
from epmoe.experts.weights import Activation
from moe_layer import INT4_CASES, make_routing, random_int4_weights
from timing import rel_err, time_fn


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="1024,4096")
    args = p.parse_args()
    flush = torch.empty(256 << 20, device="cuda", dtype=torch.float16)
    gen = torch.Generator(device="cuda").manual_seed(2)
    act, mma16 = Activation(), MmaConfig(block_m=16)
    for name, case in INT4_CASES.items():
        q = random_int4_weights(case, gen)
        for t in [int(v) for v in args.sizes.split(",")]:
            x, slots, tw = make_routing(case, t, gen)
            ref = int4_mma_experts(x, slots, tw, q, act, config=mma16)
            err = rel_err(int4_wgmma_experts(x, slots, tw, q, act), ref)
            wg_us = time_fn(lambda: int4_wgmma_experts(x, slots, tw, q, act), True, flush) * 1e3
            mma_us = time_fn(lambda: int4_mma_experts(x, slots, tw, q, act, config=mma16), True, flush) * 1e3
            print(f"{name:15} T={t:5d} wgmma {wg_us:9.1f} us  mma16 {mma_us:9.1f} us  "
                  f"rel_err(wgmma, mma16) {err:.2e}", flush=True)


if __name__ == "__main__":
    main()
