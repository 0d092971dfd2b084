"""One MoE layer on one GPU as CUDA-graph replays, with the PyTorch router and with the fused Triton router.

    python3 benchmarks/router.py [--out results.json] [--tokens 1,8,64] [--models deepseek-v3,qwen3-30b-a3b,gpt-oss-20b]

DeepSeek-V3 (grouped sigmoid routing over 256 experts), Qwen3-30B-A3B (softmax over 128) and gpt-oss-20b (top-4 of
32 biased logits, then a softmax over the chosen ones) layers, or those of other ``data/configs`` models, with
random weights, all experts on the one GPU: router -> fixed_capacity dispatcher (one-rank path) ->
triton experts -> combine -> shared experts. Three routers: ``torch`` (PyTorch ops), ``two-launch``
(cuBLAS gate, then the Triton routing kernel) and, up to ``FUSED_GATE_MAX_TOKENS`` tokens, ``fused gate``
(the gate's logits in the routing kernel's launch). Per size and router: the layer and the gate alone, each
timed as 8 calls captured in one CUDA graph (per-call device time, median of 20 replays), and the relative
difference of the layer's output from the ``torch`` router's. Prints a table last.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from engine import CONFIGS, model_names
from epmoe.comm import Comm
from epmoe.layer import MoELayer, MoELayerOptions
from epmoe.placement import ExpertPlacement
from epmoe.routing.router import FUSED_GATE_MAX_TOKENS
from epmoe.spec import parse_moe_spec
from timing import graph_us

# (name, Router.impl, Router.fused_gate_max_tokens): PyTorch; cuBLAS gate then the routing kernel; the gate in it
ROUTERS = (("torch", "torch", 0), ("two-launch", "auto", 0), ("fused-gate", "auto", FUSED_GATE_MAX_TOKENS))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="write the rows as JSON here")
    p.add_argument("--tokens", default="1,8,64", help="token counts (default 1,8,64)")
    p.add_argument("--models", default="deepseek-v3,qwen3-30b-a3b,gpt-oss-20b",
                   help="configs of data/configs, comma-separated (default deepseek-v3,qwen3-30b-a3b,gpt-oss-20b)")
    args = p.parse_args()
    known = model_names()
    for name in args.models.split(","):
        if name not in known:
            p.error(f"--models: {name!r} is not a MoE model config of data/configs (known: {', '.join(known)})")
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    rows = []
    for name in args.models.split(","):
        spec = parse_moe_spec(json.loads((CONFIGS / f"{name}.config.json").read_text()), name)
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
                for router, impl, fused_gate in ROUTERS:
                    if t > fused_gate > 0:  # the fused gate serves up to FUSED_GATE_MAX_TOKENS tokens
                        continue
                    layer.gate.impl, layer.gate.fused_gate_max_tokens = impl, fused_gate
                    row[f"layer_{router}_us"] = graph_us(lambda: layer(x))
                    row[f"gate_{router}_us"] = graph_us(lambda: layer.gate(x))
                    outs[router] = layer(x).float()
                for router in outs:
                    if router != "torch":
                        row[f"out_rel_diff_{router}"] = ((outs[router] - outs["torch"]).norm()
                                                         / outs["torch"].norm()).item()
            rows.append(row)
            torch.cuda.empty_cache()
    if args.out:
        Path(args.out).write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                                              "rows": rows}, indent=1))
    names = [router for router, _, _ in ROUTERS]
    columns = ([(f"layer {n}", f"layer_{n}_us", ".1f") for n in names] + [(f"gate {n}", f"gate_{n}_us", ".1f")
               for n in names] + [(f"diff {n}", f"out_rel_diff_{n}", ".1e") for n in names[1:]])
    print("us per call (CUDA-graph replays); diff: the layer's output against the torch router's")
    print(f"{'model':14s} {'T':>4s} " + " ".join(f"{head:>16s}" for head, _, _ in columns))
    for r in rows:
        print(f"{r['model']:14s} {r['tokens']:4d} " + " ".join(f"{_cell(r, key, fmt):>16s}" for _, key, fmt in columns))
    return 0


def _cell(row: dict, key: str, fmt: str) -> str:
    """``row[key]`` formatted, or ``-`` where the router did not run at that size."""
    return format(row[key], fmt) if key in row else "-"


if __name__ == "__main__":
    sys.exit(main())
