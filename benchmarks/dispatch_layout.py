"""Time the dispatch layout steps (``epmoe.dispatch.layout``) on one GPU: Triton kernels vs the PyTorch ops.

    python3 benchmarks/dispatch_layout.py [--out results.json]

DeepSeek-V3 sizes (hidden 7168, top-8, 256 experts) spread over ``G`` EP ranks, fixed-capacity layout with
capacity ``T``; the rows are packed and combined locally (no collective: this is the local work around
the two all-to-alls). Each step is timed as CUDA-graph replays of 8 calls (per-call device time, median
of 20 replays, CUDA events). Prints a table last: µs per step and the HBM bytes each moves over its time.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from epmoe.dispatch.blocks import FixedBlocks
from epmoe.dispatch.layout import combine_rows, pack_rows, route_layout, unpack_rows
from timing import graph_us


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="write the rows as JSON here")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    d, k, e = 7168, 8, 256
    rows = []
    for g in (2, 8):
        for t in (1, 64, 1024, 4096):
            gen = torch.Generator(device="cuda").manual_seed(t)
            slots = torch.rand(t, e, generator=gen, device="cuda").topk(k, dim=1).indices
            x = torch.randn(t, d, generator=gen, device="cuda").bfloat16()
            w = torch.rand(t, k, generator=gen, device="cuda")
            s, cap = e // g, t
            row = {"ranks": g, "tokens": t}
            for impl in ("torch", "triton"):
                lay = route_layout(slots, s, g, cap, impl=impl)
                buf = pack_rows(x, slots, w, lay, s, FixedBlocks(cap), impl=impl)
                back = buf[:, :d].contiguous()
                row[f"route_{impl}_us"] = graph_us(lambda: route_layout(slots, s, g, cap, impl=impl))
                row[f"pack_{impl}_us"] = graph_us(lambda: pack_rows(x, slots, w, lay, s, FixedBlocks(cap), impl=impl))
                row[f"unpack_{impl}_us"] = graph_us(lambda: unpack_rows(buf, d, k, impl=impl))
                row[f"combine_{impl}_us"] = graph_us(lambda: combine_rows(back, lay.pos, FixedBlocks(cap), impl=impl))
            sent = int((lay.pos >= 0).sum())
            row["pack_bytes"] = (sent + g * cap) * d * 2  # read the sent rows, write the whole buffer
            row["combine_bytes"] = (sent + t) * d * 2  # read the returned rows, write one row per token
            rows.append(row)
    if args.out:
        Path(args.out).write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                                              "rows": rows}, indent=1))
    print(f"{'G':>2} {'T':>5} | {'route':>13} {'pack':>15} {'unpack':>13} {'combine':>15} | pack/combine TB/s (triton)")
    print(f"{'':>8} | {'torch  triton':>13} {'torch  triton':>15} {'torch  triton':>13} {'torch  triton':>15} |")
    for r in rows:
        steps = ("route", "pack", "unpack", "combine")
        cells = " ".join(f"{r[f'{st}_torch_us']:7.1f}{r[f'{st}_triton_us']:7.1f}" for st in steps)
        print(f"{r['ranks']:2d} {r['tokens']:5d} | {cells} | {r['pack_bytes'] / r['pack_triton_us'] / 1e6:.2f} / "
              f"{r['combine_bytes'] / r['combine_triton_us'] / 1e6:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
