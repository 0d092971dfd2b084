"""One MoE layer on one GPU as CUDA-graph replays, with the PyTorch router and with the fused Triton router.

    python3 benchmarks/router.py [--out results.json]

DeepSeek-V3 (grouped sigmoid routing over 256 experts) and Qwen3-30B-A3B (softmax over 128) layers with
random weights, all experts on the one GPU: router -> fixed_capacity dispatcher (one-rank path) ->
triton experts -> combine -> shared experts. Per size: the layer and the gate alone, each timed as 8
calls captured in one CUDA graph (per-call device time, median of 20 replays), and the relative
difference of the two layers' outputs. Prints a table last.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from epmoe.comm import Comm
from epmoe.layer import MoELayer, MoELayerOptions
from epmoe.placement import ExpertPlacement
from epmoe.spec import parse_moe_spec
from timing import graph_us

REPO = Path(__file__).resolve().parents[1]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="write the rows as JSON here")
    p.add_argument("--tokens", default="1,8,64", help="token counts (default 1,8,64)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    rows = []
    for name in ("deepseek-v3", "qwen3-30b-a3b"):
        spec = parse_moe_spec(json.loads((REPO / "data" / "configs" / f"{name}.config.json").read_text()), name)
        for t in (int(v) for v in args.tokens.split(",")):
            layer = MoELayer(spec, 0, ExpertPlacement.trivial(spec.num_moe_layers, spec.num_experts, 1), Comm(None),
                             MoELayerOptions(dispatcher="fixed_capacity", dispatcher_options={"capacity": t},
                                             expert_backend="triton"),
                             dtype=torch.bfloat16, device="cuda")
            row = {"model": name, "tokens": t}
            with torch.no_grad():
                for param in layer.parameters():
                    param.normal_(0, 0.02)
                x = torch.randn(t, spec.hidden_size, device="cuda").bfloat16()
                outs = {}
                for impl in ("torch", "auto"):
                    layer.gate.impl = impl
                    row[f"layer_{impl}_us"] = graph_us(lambda: layer(x))
                    row[f"gate_{impl}_us"] = graph_us(lambda: layer.gate(x))
                    outs[impl] = layer(x).float()
                row["out_rel_diff"] = ((outs["auto"] - outs["torch"]).norm() / outs["torch"].norm()).item()
            rows.append(row)
            torch.cuda.empty_cache()
    if args.out:
        Path(args.out).write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                                              "rows": rows}, indent=1))
    print(f"{'model':14s} {'T':>4s} | {'layer torch':>11s} {'fused':>8s} | {'gate torch':>10s} {'fused':>7s} | out "
          "diff")
    for r in rows:
        print(f"{r['model']:14s} {r['tokens']:4d} | {r['layer_torch_us']:11.1f} {r['layer_auto_us']:8.1f} | "
              f"{r['gate_torch_us']:10.1f} {r['gate_auto_us']:7.1f} | {r['out_rel_diff']:.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
