"""INT4 MMA path (``experts/triton/w4a16_mma.py``) at decode sizes: tile, split and register configurations.

    python benchmarks/int4_mma_configs.py [--configs default,r168,...] [--sizes 1,8,64] [--out FILE]

Kimi-K2.5's routed experts (hidden 7168, intermediate 2048, top-8, INT4 group 32): the EP-8 shard (48 of 384
experts) and all 384 on one GPU, random routing. Per size, each configuration's median time as CUDA-graph replays
after an L2 flush (``timing.time_fn``), against the INT4 weight-read floor of the active slots (bytes over the copy
bandwidth measured in the same run), and its error against the default configuration's output. A configuration is
an ``MmaConfig`` and the warps an SM the split-K choice aims at (``w4a16_mma._WARPS_PER_SM``). Prints one line per
case and size; with ``--out``, the rows as JSON.
"""

from __future__ import annotations

import argparse
import json

import torch

try:
    import triton  # noqa: F401
except ImportError:  # a GPU benchmark; Triton comes with PyTorch's CUDA build
    raise SystemExit(f"{__file__} times GPU kernels and needs Triton (installed with PyTorch's CUDA build)") from None

import epmoe.experts.triton.w4a16_mma as mma
from epmoe.experts.weights import Activation
from moe_layer import INT4_CASES, INT4_GROUP, make_routing, random_int4_weights
from timing import measure_ceilings, rel_err, time_fn

C = mma.MmaConfig
CONFIGS = {
    "default": (C(), 16),
    "wps32": (C(), 32),
    "split16_wps32": (C(split_max=16), 32),
    "split16_wps64": (C(split_max=16), 64),
    "n16_n32": (C(16, 32, 32, 32, 1), 16),
    "n16_n32_wps32": (C(16, 32, 32, 32, 1), 32),
    "w4_n64_n128": (C(64, 32, 128, 32, 4), 16),
    "kw16": (C(32, 16, 64, 16, 2), 16),
    "kw64": (C(32, 64, 64, 64, 2), 16),
    "kw64_split16_wps32": (C(32, 64, 64, 64, 2, split_max=16), 32),
    "r168": (C(maxnreg=168), 16),
    "r168_wps24": (C(maxnreg=168), 24),
    "r128": (C(maxnreg=128), 16),
    "r128_wps32": (C(maxnreg=128), 32),
    "kw16_r128_wps32": (C(32, 16, 64, 16, 2, maxnreg=128), 32),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"of {sorted(CONFIGS)}")
    p.add_argument("--sizes", default="1,2,8,16,64")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    names = args.configs.split(",")
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        p.error(f"--configs: unknown {unknown}; known: {sorted(CONFIGS)}")
    ceil = measure_ceilings()
    flush = torch.empty(256 << 20, device="cuda", dtype=torch.float16)
    gen = torch.Generator(device="cuda").manual_seed(2)
    g, act = INT4_GROUP, Activation()
    rows = []
    for case_name, case in INT4_CASES.items():
        d, f = case["d"], case["f"]
        q = random_int4_weights(case, gen)
        expert_bytes = 3 * d * f // 2 + 3 * d * f // g * 2
        for t in [int(v) for v in args.sizes.split(",")]:
            x, slots, tw = make_routing(case, t, gen)
            active = int(torch.unique(slots[slots >= 0]).numel())
            if active == 0:  # no local pair
                continue
            floor_us = active * expert_bytes / ceil["copy_bytes_per_s"] * 1e6
            ref = mma.packed_mma_experts(x, slots, tw, q, act, config=C())
            line = f"{case_name:15} T={t:4d} act={active:3d} floor={floor_us:7.1f}"
            for name in names:
                cfg, wps = CONFIGS[name]
                mma._WARPS_PER_SM = wps
                try:
                    err = rel_err(mma.packed_mma_experts(x, slots, tw, q, act, config=cfg), ref)
                    us = time_fn(lambda: mma.packed_mma_experts(x, slots, tw, q, act, config=cfg), True, flush) * 1e3
                finally:
                    mma._WARPS_PER_SM = CONFIGS["default"][1]
                rows.append({"case": case_name, "tokens": t, "active_slots": active, "config": name,
                             "us": us, "floor_us": floor_us, "rel_err_to_default": err})
                line += f" | {name} {us:7.1f} ({us / floor_us:5.2f}x{'' if err < 1e-2 else ' ERR'})"
            print(line, flush=True)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"ceilings": ceil, "rows": rows}, fh, indent=2)


if __name__ == "__main__":
    main()
