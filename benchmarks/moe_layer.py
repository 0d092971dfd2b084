"""MoE expert compute on one GPU: our Triton backend vs the PyTorch composition vs transformers' grouped_mm.

Run on the device machine (needs CUDA, Triton, transformers):

    python3 benchmarks/moe_layer.py [--out PATH] [--sizes 1,8,...] [--sweep [--sweep-sizes 1,4096]]

Cases:
    qwen3: the routed experts of one Qwen3-30B-A3B MoE layer on one GPU: 128 experts, D 2048, F 768,
        top-8 softmax routing over all 128.
    dsv3: one rank's shard of a DeepSeek-V3 MoE layer under 8-way expert parallelism: 32 of the 256
        experts (global ids 0..31), D 7168, F 2048. Each of the T tokens picks top-8 of 256 uniformly at
        random; choices outside 0..31 are served by other ranks and enter as slot -1, so about 1/8 of the
        T*8 choices (about T rows of work) are local. This is what the rank's expert backend sees after
        a dispatcher that sends every token to every rank (the fixed-capacity layout).
    dsv3_fp8: the same shard with DeepSeek's 128x128 block FP8 weights (our backend only).
    kimi_int4 (``--cases kimi_int4``): one rank's shard of a Kimi-K2.5 MoE layer under 8-way expert parallelism,
        48 of the 384 experts, D 7168, F 2048, top-8 of 384 (as dsv3: choices outside the shard enter as slot -1),
        with Kimi-K2.5's INT4 weights (compressed-tensors pack-quantized, group 32, bf16 scales).
    kimi_full_int4 (``--cases kimi_full_int4``): all 384 experts of that layer on one GPU.
    gptoss_mxfp4, gptoss20b_mxfp4 (``--cases gptoss_mxfp4``): a gpt-oss-120b (128 experts) or gpt-oss-20b (32) MoE
        layer on one GPU, D = F = 2880, top-4, gpt-oss's clamped SwiGLU with biases, in MXFP4: the backend (``mxfp4``:
        the path ``mxfp4_path`` picks) against its floor (the MXFP4 bytes of the active experts, 17 per 32 weights, over
        the copy bandwidth, or the FLOPs over the bf16 rate), the decode kernels up to 16 tokens with the backend's
        tiles (``mxfp4_decode``, ``MXFP4_DECODE_CONFIG``; with ``--sweep`` also those of ``MXFP4_DECODE_SWEEP``), the
        grouped kernels widening the packed tiles in registers at every size (``mxfp4_grouped``), on Hopper the
        tensor-core kernels at every size (``mxfp4_mma``, ``mxfp4_wgmma``), the slots widened in memory then the bf16
        kernels (``mxfp4_widen``) and the bf16 backend on the dequantized weights (``bf16``).

The INT4 cases time, in the same run and on the same (dequantized) weight values: the ``triton`` backend on the packed
weights (``int4``, the path ``int4_path`` picks; floor = INT4 bytes + scales of the active slots over the copy
bandwidth, or the FLOPs), each INT4 path at every size whichever the backend takes (``int4_mma``: the tensor-core
kernels with the words widened into the MMA registers (16-row blocks), ``int4_mma8``/``int4_mma32`` with 8/32-row
blocks;
``int4_wgmma``: the prefill kernels on Hopper's warpgroup MMA, ``w4a16_wgmma``, with the tiles the backend takes
(``default_wgmma_config`` for the size), ``int4_wgmma4`` with one warpgroup of 64 weight rows a program,
``int4_wgmma_t32`` with tail row blocks (a slot's last block of 32, 64, 96 or 128 rows), ``int4_wgmma64_t32`` with
64-row blocks and 32-row tails; ``int4_grouped``: the fused grouped kernels; ``int4_dequant``: the used slots widened,
then the bf16 grouped kernels; ``int4_decode``: the decode kernels, up to 64 tokens), our bf16 Triton path (``bf16``;
its own floor, the bf16 bytes) and "dequantize, then grouped_mm" (``deq_gmm``: one Triton launch widening every local
expert to bf16, then ``torch._grouped_mm``); with ``--sweep`` (EP-8 shard only) also the decode tile configurations
``INT4_DECODE_SWEEP`` (sizes up to 64 tokens), the grouped ones ``INT4_GROUPED_SWEEP`` and the wgmma ones
``INT4_WGMMA_SWEEP`` (every sweep size), each sweep's best recorded.

A case's tokens are those of the whole EP group, its slots one rank's (``slots`` of ``num_experts``): the backend
(``ours``, ``int4``, ``bf16``) and the default tiles are given the pairs one rank's own tokens route,
``expected_pairs = T K slots / num_experts``, as ``layer.MoELayer`` does (exact for a case with every expert local).

Every row: the floor = max(weight bytes of the slots the routing touches / measured copy bandwidth,
FLOPs of the routed rows / measured bf16 matmul rate), both ceilings measured in the same run; the time
of each implementation as CUDA-graph replays (median of 100, each after a read that evicts L2, see
``time_fn``): device time, without the host's launch overhead, which a serving loop overlaps with the
previous layer's device work; ours also launched eagerly (column ``eager``) and, up to 64 tokens, after
a do_bench-style zeroing flush (``dirty``) and per layer inside one graph of ``MODEL_LAYERS`` layers
with their own weights and routing, as in a whole-model decode graph (``model``, its ratio to the
mean floor of those layers); ratios to the floor; the
relative error against the float32 reference. Then a full MoE layer
(router, fixed-capacity dispatcher on a one-rank group, Triton experts, combine) captured in a CUDA
graph is replayed and compared to eager execution. Writes JSON to ``--out`` (default
``$OUT/moe_layer.json`` when ``$OUT`` is set) and prints a table last.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from dataclasses import asdict

import torch

try:
    import triton
except ImportError:  # a GPU benchmark; Triton comes with PyTorch's CUDA build
    raise SystemExit(f"{__file__} times GPU kernels and needs Triton (installed with PyTorch's CUDA build)") from None

from epmoe.comm import Comm
from epmoe.dispatch import make_dispatcher
from epmoe.experts import Activation, ExpertWeights, get_expert_backend, reference_experts
from epmoe.experts.fp8 import block_fp8_expert_weights
from epmoe.experts.grouped_mm import grouped_mm_experts
from epmoe.experts.int4 import Int4ExpertWeights
from epmoe.experts.mxfp4 import MXFP4ExpertWeights
from epmoe.experts.triton.decode import DECODE_MAX_PAIRS, DecodeConfig, decode_experts, default_decode_config
from epmoe.experts.triton.grouped import TileConfig, act_code, default_config, default_int4_config, triton_experts
from epmoe.experts.triton.int4 import (
    dequantize_int4_triton,
    int4_dequantized_experts,
    int4_grouped_experts,
    int4_path,
)
from epmoe.experts.triton.mxfp4 import (
    MXFP4_DECODE_CONFIG,
    mxfp4_grouped_experts,
    mxfp4_wgmma_config,
    mxfp4_widened_experts,
)
from epmoe.experts.triton.w4a16_decode import PackedDecodeConfig, packed_decode_experts
from epmoe.experts.triton.w4a16_mma import packed_mma_experts
from epmoe.experts.triton.w4a16_mma_config import MmaConfig, default_mma_config
from epmoe.experts.triton.w4a16_wgmma import packed_wgmma_experts
from epmoe.experts.triton.w4a16_wgmma_config import WgmmaConfig, default_wgmma_config
from timing import measure_ceilings, rel_err, time_fn, time_in_model

CASES = {
    "qwen3": dict(num_experts=128, slots=128, d=2048, f=768, k=8),
    "dsv3": dict(num_experts=256, slots=32, d=7168, f=2048, k=8),
}
INT4_CASES = {
    "kimi_int4": dict(num_experts=384, slots=48, d=7168, f=2048, k=8),
    "kimi_full_int4": dict(num_experts=384, slots=384, d=7168, f=2048, k=8),
}
MXFP4_CASES = {
    "gptoss_mxfp4": dict(num_experts=128, slots=128, d=2880, f=2880, k=4),
    "gptoss20b_mxfp4": dict(num_experts=32, slots=32, d=2880, f=2880, k=4),
}
MXFP4_DECODE_MAX_TOKENS = 16  # the decode kernels are timed up to 64 pairs at top-4
INT4_GROUP = 32
# the decode tiles beside the default (4, 128, 8, 128, 1 warp, 2 stages: each thread one group of eight rows, the
# step's inputs loaded in the word tile's layout): the default before it (8, 64, 16, 64, 2 warps, 3 stages: the
# inputs moved between layouts through shared memory each step), the others of the 2026-12-03 H200 probe
INT4_DECODE_SWEEP = [
    PackedDecodeConfig(8, 64, 16, 64, 2, stages=3), PackedDecodeConfig(4, 128, 8, 128, 1, stages=3),
    PackedDecodeConfig(4, 128, 8, 128, 1, max_programs=4096), PackedDecodeConfig(2, 128, 4, 128, 1),
    PackedDecodeConfig(4, 256, 8, 256, 2), PackedDecodeConfig(8, 128, 8, 128, 1), PackedDecodeConfig(4, 128, 4, 128, 1),
    # the gate/up reduction over D not split / split up to 4 ways when few pairs are live (the default: 2)
    PackedDecodeConfig(split_max=1), PackedDecodeConfig(split_max=4),
]
# the MXFP4 decode tiles beside the backend's (MXFP4_DECODE_CONFIG): INT4's defaults (twice the rows a program), the
# nineteenth session's tiles (1024 programs a launch), the twentieth's (4096, four down rows), fewer programs with
# eight down rows, four down rows at 8192 programs, three stages
MXFP4_DECODE_SWEEP = [
    PackedDecodeConfig(), PackedDecodeConfig(2, 128, 4, 128, 1),
    PackedDecodeConfig(2, 128, 4, 128, 1, max_programs=4096), PackedDecodeConfig(2, 128, 8, 128, 1, max_programs=4096),
    PackedDecodeConfig(2, 128, 4, 128, 1, max_programs=8192),
    PackedDecodeConfig(2, 128, 4, 128, 1, max_programs=4096, stages=3),
]
# the fused INT4 grouped path (block_k in inputs: 16 or 32 words a step): the defaults of default_int4_config,
# 16-word steps, transposed products, 32-row blocks, 8 warps (none spills registers compiled for sm_90 by Triton 3.6)
INT4_GROUPED_SWEEP = [
    TileConfig(16, 32, 64, 256, 4, 3), TileConfig(16, 32, 64, 128, 4, 3), TileConfig(16, 64, 64, 256, 8, 3),
    TileConfig(16, 64, 64, 128, 4, 3, swap_ab=True), TileConfig(32, 32, 64, 256, 4, 3, half_tail=True),
    TileConfig(64, 64, 128, 256, 8, 3, half_tail=True), TileConfig(128, 64, 128, 128, 8, 3, half_tail=True),
    TileConfig(128, 64, 128, 256, 8, 2, half_tail=True),
]
DECODE_MAX = 64
MMA_BLOCK8 = MmaConfig(32, 32, 64, 32, 2, block_m=8)
MMA_BLOCK32 = MmaConfig(32, 16, 32, 16, 2, block_m=32)  # 16-word steps: 200 registers, none spilled (sm_90)
WGMMA_ONE_WARPGROUP = WgmmaConfig(num_warps=4, block_n1=64, block_n2=64)
# tail row blocks (WgmmaConfig.tail_rows): 128-row blocks whose last block per slot has 32, 64, 96 or 128 rows; 64 or
# 128 rows; 64-row blocks whose last block has 32 or 64 rows
WGMMA_TAIL32 = WgmmaConfig(tail_rows=32)
WGMMA_TAIL64 = WgmmaConfig(tail_rows=64)
WGMMA_BLOCK64_TAIL32 = WgmmaConfig(64, tail_rows=32)
# the wgmma variants int4_prefill.py times (None: the default): 128-row blocks with the gate/up words loaded into
# registers one step ahead (the default before WgmmaConfig.words_smem); 64-row blocks with the words in registers (the
# default below WGMMA_BLOCK128_MIN_PAIRS_PER_SLOT), and staged through shared memory in three and four buffers
WGMMA_PREFILL = {"wgmma": None, "wg_regs": WgmmaConfig(128, 16, 32, 3, tail_rows=32),
                 "wg64_regs": WgmmaConfig(64, 16, 32, 3, tail_rows=32),
                 "wg64_words": WgmmaConfig(64, 16, 32, 3, tail_rows=32, words_smem=True),
                 "wg64_words4": WgmmaConfig(64, 16, 32, 4, tail_rows=32, words_smem=True)}
# whole blocks: 128 rows, four buffers, 64-row blocks, one warpgroup (down: issuing its wgmma twice), 32-word steps;
# tail blocks (also with four buffers and with one warpgroup); with 32-row tails (the configurations of
# results/int4_wgmma_sweep_h200.txt): each warpgroup issuing its wgmma twice in either or both kernels, 32-word down
# steps (the default's), also with 64-row blocks and with 64-word steps, 32-word steps in both kernels
INT4_WGMMA_SWEEP = [
    WgmmaConfig(), WgmmaConfig(stages=4), WgmmaConfig(64), WGMMA_ONE_WARPGROUP,
    WgmmaConfig(num_warps=4, block_n1=64, block_n2=128), WgmmaConfig(64, 32, 32),
    WGMMA_TAIL32, WGMMA_TAIL64, WGMMA_BLOCK64_TAIL32, WgmmaConfig(stages=4, tail_rows=32),
    WgmmaConfig(num_warps=4, block_n1=64, block_n2=128, tail_rows=32),
    WgmmaConfig(block_n1=256, block_n2=256, tail_rows=32), WgmmaConfig(block_n1=256, tail_rows=32),
    WgmmaConfig(block_n2=256, tail_rows=32), WgmmaConfig(block_kw2=32, tail_rows=32),
    WgmmaConfig(block_kw2=32, block_n2=256, tail_rows=32), WgmmaConfig(64, block_kw2=32, tail_rows=32),
    WgmmaConfig(64, block_kw2=64, tail_rows=32), WgmmaConfig(block_kw1=32, block_kw2=32, tail_rows=32),
]
SWEEP = [
    TileConfig(16, 32, 64, 128, 4, 3), TileConfig(64, 64, 128, 64, 8, 3), TileConfig(128, 128, 256, 64, 8, 4),
    TileConfig(64, 128, 128, 64, 4, 4), TileConfig(64, 64, 128, 64, 4, 4, True),
    TileConfig(64, 128, 256, 64, 4, 4, True), TileConfig(128, 128, 256, 64, 8, 4, True),
    TileConfig(128, 128, 128, 64, 8, 4, True), TileConfig(64, 64, 128, 64, 4, 4, True, True),
    TileConfig(64, 128, 256, 64, 4, 4, True, True), TileConfig(128, 128, 256, 64, 8, 4, True, True),
    TileConfig(128, 128, 256, 64, 8, 3, True, True), TileConfig(128, 128, 128, 64, 8, 4, True, True),
    TileConfig(128, 64, 256, 64, 8, 4, True, True), TileConfig(128, 128, 256, 64, 8, 4, False, True),
    TileConfig(128, 64, 128, 64, 8, 6, True, True), TileConfig(128, 64, 128, 64, 4, 6, True, True),
    TileConfig(128, 64, 128, 128, 8, 3, True, True),
]
MODEL_LAYERS = 8
DECODE_SWEEP = [
    DecodeConfig(8, 256, 32, 128, 4, True), DecodeConfig(8, 256, 32, 128, 4, True, 512),
    DecodeConfig(8, 256, 32, 128, 4, True, 4096), DecodeConfig(8, 512, 32, 256, 4, True),
    DecodeConfig(4, 512, 16, 256, 4, True), DecodeConfig(4, 512, 16, 256, 4, True, 512),
    DecodeConfig(4, 512, 16, 256, 4, True, 768), DecodeConfig(4, 512, 16, 256, 4, True, 1536),
    DecodeConfig(4, 512, 16, 256, 4, True, 4096), DecodeConfig(8, 512, 16, 256, 4, True, 1024),
    DecodeConfig(4, 1024, 16, 512, 4, True, 1024), DecodeConfig(4, 512, 16, 256, 8, True, 1024),
    # a down program's whole w2 slice as its first tile (block_k2 >= F), requested before its wait for gate/up
    DecodeConfig(8, 256, 8, 1024, 4, True), DecodeConfig(8, 256, 16, 1024, 8, True),
    DecodeConfig(4, 512, 8, 2048, 8, True),
]


def ep_pairs(case: dict, t: int) -> int:
    """The pairs one rank of the case's EP group expects for ``t`` tokens of the whole group (``t K slots /
    num_experts``): what ``layer.MoELayer`` passes the backend as ``expected_pairs``."""
    return t * case["k"] * case["slots"] // case["num_experts"]


def flop_floor_us(case: dict, pairs: int, ceil: dict) -> float:
    """The FLOP floor of one call of the case's experts, us: ``2 pairs 3 D F`` (the three projections of ``pairs``
    routed rows) over the measured bf16 matmul rate ``ceil["bf16_flop_per_s"]`` (``timing.measure_ceilings``)."""
    return 2 * pairs * 3 * case["d"] * case["f"] / ceil["bf16_flop_per_s"] * 1e6


def int4_expert_bytes(case: dict) -> int:
    """Bytes of one INT4 expert's ``w13`` and ``w2``: 4-bit values and a bf16 scale per ``INT4_GROUP`` inputs."""
    d, f = case["d"], case["f"]
    return 3 * d * f // 2 + 3 * d * f // INT4_GROUP * 2


def int4_read_floor_us(case: dict, active: int, ceil: dict) -> float:
    """The INT4 weight-read floor of one call, us: the packed values and scales of the ``active`` slots the routing
    touches over the measured copy bandwidth ``ceil["copy_bytes_per_s"]`` (``timing.measure_ceilings``)."""
    return active * int4_expert_bytes(case) / ceil["copy_bytes_per_s"] * 1e6


def make_routing(case: dict, t: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Hidden states and top-k routing (local slot ids, -1 = another rank) for ``t`` tokens."""
    x = torch.randn(t, case["d"], device="cuda", dtype=torch.bfloat16, generator=gen)
    logits = torch.randn(t, case["num_experts"], device="cuda", generator=gen)
    w, idx = torch.topk(torch.softmax(logits, dim=-1), case["k"], dim=-1)
    w = w / w.sum(dim=-1, keepdim=True)
    slots = torch.where(idx < case["slots"], idx, -1)
    return x, slots, w


def transformers_experts(weights: ExpertWeights, case: dict):
    """transformers' Qwen3MoeExperts with ``experts_implementation="grouped_mm"`` sharing our weights."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    cfg = Qwen3MoeConfig(hidden_size=case["d"], moe_intermediate_size=case["f"], num_experts=case["slots"],
                         num_experts_per_tok=case["k"], hidden_act="silu")
    cfg._experts_implementation = "grouped_mm"
    with torch.device("meta"):
        mod = Qwen3MoeExperts(cfg)
    mod.gate_up_proj = torch.nn.Parameter(weights.w13, requires_grad=False)
    mod.down_proj = torch.nn.Parameter(weights.w2, requires_grad=False)
    sentinel = case["slots"]
    if case["slots"] < case["num_experts"]:
        mod._is_expert_parallel = True  # slots of other ranks enter as index S, weight 0 (transformers' EP path)

    def run(x, slots, tw):
        return mod(x, torch.where(slots >= 0, slots, sentinel), torch.where(slots >= 0, tw, 0.0))

    return run, cfg._experts_implementation


def bench_case(name: str, case: dict, sizes: list[int], ceil: dict, sweep: set[int], fp8: bool, rows: list[dict],
               save: Callable[[], None]) -> None:
    """Our bf16 (and for ``fp8`` block-FP8) expert kernels vs their floor and PyTorch's and transformers' grouped_mm,
    each size's row appended to ``rows`` and ``save()`` called after it (a run cut short keeps the rows it finished)."""
    flush = torch.empty(256 << 20, device="cuda", dtype=torch.float16)
    gen = torch.Generator(device="cuda").manual_seed(0)
    s, d, f = case["slots"], case["d"], case["f"]
    w = ExpertWeights(
        (torch.randn(s, 2 * f, d, device="cuda", generator=gen) / d**0.5).to(torch.bfloat16),
        (torch.randn(s, d, f, device="cuda", generator=gen) / f**0.5).to(torch.bfloat16),
    )
    w32 = ExpertWeights(w.w13.float(), w.w2.float())
    qw = block_fp8_expert_weights(w) if fp8 else None
    q32 = qw.dequantize(torch.float32) if fp8 else None
    act = Activation()
    ours = get_expert_backend("triton")
    torch_comp = get_expert_backend("grouped_mm")
    hf, hf_impl = transformers_experts(w, case)
    model_weights = [w] + [ExpertWeights(torch.randn_like(w.w13) / d**0.5, torch.randn_like(w.w2) / f**0.5)
                           for _ in range(MODEL_LAYERS - 1)] if any(t <= DECODE_MAX for t in sizes) else []
    expert_bytes = 3 * d * f * 2

    def floors(slots: torch.Tensor) -> tuple[int, int, float, float]:
        """Active slots, live pairs, and the weight-read and FLOP floors (us) of one routing."""
        active = int(torch.unique(slots[slots >= 0]).numel())
        pairs = int((slots >= 0).sum())
        return active, pairs, active * expert_bytes / ceil["copy_bytes_per_s"] * 1e6, flop_floor_us(case, pairs, ceil)

    first = len(rows)
    for t in sizes:
        x, slots, tw = make_routing(case, t, gen)
        active, pairs, floor_mem, floor_flop = floors(slots)
        flops = 2 * pairs * 3 * d * f
        decode = t <= DECODE_MAX
        expected = ep_pairs(case, t)
        ref = reference_experts(x.float(), slots, tw, w32, act)
        impls = {"ours": lambda: ours(x, slots, tw, w, act, expected_pairs=expected),
                 "torch_grouped_mm": lambda: torch_comp(x, slots, tw, w, act),
                 "hf_grouped_mm": lambda: hf(x, slots, tw)}
        row = {"case": name, "tokens": t, "active_slots": active, "pairs": pairs,
               "weight_bytes": active * expert_bytes, "flops": flops, "graph": True,
               "default_config": asdict(default_decode_config(d, f, 2) if expected <= DECODE_MAX_PAIRS
                                         else default_config(expected, s, False))}
        row["floor_mem_us"], row["floor_flop_us"] = floor_mem, floor_flop
        row["floor_us"] = max(floor_mem, floor_flop)
        for key, fn in impls.items():
            row[f"{key}_err"] = rel_err(fn(), ref)
            try:
                row[f"{key}_us"] = time_fn(fn, True, flush) * 1e3
            except RuntimeError as err:  # not capturable in a CUDA graph: timed as launched
                row[f"{key}_us"] = time_fn(fn, False, flush) * 1e3
                row[f"{key}_eager_because"] = str(err)[:300]
        row["ours_eager_us"] = time_fn(impls["ours"], False, flush) * 1e3
        if decode:
            row["ours_dirty_flush_us"] = time_fn(impls["ours"], True, flush, dirty=True) * 1e3
            layers = [(lw, *make_routing(case, t, gen)) for lw in model_weights]
            # each layer has its own routing: in an expert-parallel shard the number of active slots
            # differs between layers, so the in-model floor is the layers' mean
            row["floor_in_model_us"] = sum(max(floors(sl)[2:]) for _, _, sl, _ in layers) / len(layers)
            row["ours_in_model_us"] = time_in_model(
                [lambda lw=lw, x=x, sl=sl, tw=tw: ours(x, sl, tw, lw, act, expected_pairs=expected)
                 for lw, x, sl, tw in layers], flush) * 1e3
            row["torch_grouped_mm_in_model_us"] = time_in_model(
                [lambda lw=lw, x=x, sl=sl, tw=tw: torch_comp(x, sl, tw, lw, act) for lw, x, sl, tw in layers],
                flush) * 1e3
        if t in sweep:
            best = None
            few = expected <= DECODE_MAX_PAIRS
            for cfg in DECODE_SWEEP if few else SWEEP:
                if few:
                    fn = lambda: decode_experts(x, slots, tw, w, act_code(act), act, config=cfg)  # noqa: E731
                else:
                    fn = lambda: triton_experts(x, slots, tw, w, act, config=cfg)  # noqa: E731
                us = time_fn(fn, True, flush) * 1e3
                row.setdefault("sweep", []).append({**asdict(cfg), "us": us})
                best = (us, cfg) if best is None or us < best[0] else best
            row["best_us"], row["best_config"] = best[0], asdict(best[1])
        if fp8:
            qref = reference_experts(x.float(), slots, tw, q32, act)
            fn = lambda: ours(x, slots, tw, qw, act, expected_pairs=expected)  # noqa: E731
            row["fp8_err"] = rel_err(fn(), qref)
            row["fp8_us"] = time_fn(fn, True, flush) * 1e3
            fp8_bytes = active * 3 * d * f * (1 + 4 / 128**2)
            row["fp8_floor_us"] = max(fp8_bytes / ceil["copy_bytes_per_s"] * 1e6, row["floor_flop_us"])
        rows.append(row)
        print(json.dumps(row), flush=True)
        save()
    if len(rows) > first:
        rows[first]["hf_experts_implementation"] = hf_impl
        save()


def int4_reference(x: torch.Tensor, slots: torch.Tensor, tw: torch.Tensor, q: Int4ExpertWeights,
                   act: Activation) -> torch.Tensor:
    """float32 reference on the dequantized weights, one active slot at a time (a whole float32 copy of the
    384 experts would not fit beside the others)."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for slot in torch.unique(slots[slots >= 0]).tolist():
        t, j = torch.nonzero(slots == slot, as_tuple=True)
        w13 = dequantize_int4_triton(q.w13_packed[slot], q.w13_scale[slot], q.group_size,
                                     torch.empty(2 * q.intermediate_size, q.hidden_size, device=x.device))
        w2 = dequantize_int4_triton(q.w2_packed[slot], q.w2_scale[slot], q.group_size,
                                    torch.empty(q.hidden_size, q.intermediate_size, device=x.device))
        gate, up = (x[t].float() @ w13.t()).chunk(2, dim=-1)
        out.index_add_(0, t, (act(gate, up) @ w2.t()) * tw[t, j, None])
    return out


def random_int4_weights(case: dict, gen: torch.Generator) -> Int4ExpertWeights:
    """Packed INT4 weights (group ``INT4_GROUP``) of an ``INT4_CASES`` case on CUDA: random words, scales about the
    spread of a bf16 weight of std ``1/sqrt(K)``."""
    s, d, f, g = case["slots"], case["d"], case["f"], INT4_GROUP

    def words(*shape):
        return torch.randint(-2**31, 2**31, shape, device="cuda", dtype=torch.int64, generator=gen).to(torch.int32)

    def scales(n, kin):
        return ((torch.rand(s, n, kin // g, device="cuda", generator=gen) + 0.5) / (4.6 * kin**0.5)).bfloat16()

    return Int4ExpertWeights(words(s, 2 * f, d // 8), scales(2 * f, d), words(s, d, f // 8), scales(d, f),
                             group_size=g)


def bench_int4_case(name: str, case: dict, sizes: list[int], ceil: dict, sweep: set[int], rows: list[dict],
                    save: Callable[[], None]) -> None:
    """INT4 kernels vs their floor, our bf16 path and dequantize-then-grouped_mm on the same weight values, each size's
    row appended to ``rows`` and ``save()`` called after it (a run cut short keeps the rows it finished)."""
    flush = torch.empty(256 << 20, device="cuda", dtype=torch.float16)
    gen = torch.Generator(device="cuda").manual_seed(2)
    s, d, f, g = case["slots"], case["d"], case["f"], INT4_GROUP
    q = random_int4_weights(case, gen)
    w = ExpertWeights(torch.empty(s, 2 * f, d, device="cuda", dtype=torch.bfloat16),
                      torch.empty(s, d, f, device="cuda", dtype=torch.bfloat16))

    def dequantize_all():
        dequantize_int4_triton(q.w13_packed, q.w13_scale, g, w.w13)
        dequantize_int4_triton(q.w2_packed, q.w2_scale, g, w.w2)
        return w

    dequantize_all()
    act = Activation()
    ours = get_expert_backend("triton")
    int4_bytes = int4_expert_bytes(case)
    bf16_bytes = 3 * d * f * 2
    for t in sizes:
        x, slots, tw = make_routing(case, t, gen)
        active = int(torch.unique(slots[slots >= 0]).numel())
        pairs = int((slots >= 0).sum())
        flop_us = flop_floor_us(case, pairs, ceil)
        expected = ep_pairs(case, t)
        row = {"case": name, "tokens": t, "active_slots": active, "pairs": pairs,
               "int4_weight_bytes": active * int4_bytes, "bf16_weight_bytes": active * bf16_bytes,
               "floor_flop_us": flop_us,
               "int4_floor_us": max(int4_read_floor_us(case, active, ceil), flop_us),
               "bf16_floor_us": max(active * bf16_bytes / ceil["copy_bytes_per_s"] * 1e6, flop_us),
               "int4_path": int4_path(expected, x.dtype, s, torch.cuda.get_device_capability() == (9, 0)),
               "int4_grouped_config": asdict(default_int4_config(expected, s))}
        ref = int4_reference(x, slots, tw, q, act)
        impls = {"int4": lambda: ours(x, slots, tw, q, act, expected_pairs=expected),
                 "bf16": lambda: ours(x, slots, tw, w, act, expected_pairs=expected),
                 "deq_gmm": lambda: grouped_mm_experts(x, slots, tw, dequantize_all(), act),
                 # each path at every size, whichever the backend takes
                 "int4_grouped": lambda: int4_grouped_experts(x, slots, tw, q, act),
                 "int4_mma": lambda: packed_mma_experts(x, slots, tw, q, act,
                                                      config=default_mma_config(g, expected, s)),
                 # fewer or more token rows a block: each widened register feeds up to 1 or 4 MMAs
                 "int4_mma8": lambda: packed_mma_experts(x, slots, tw, q, act, config=MMA_BLOCK8),
                 "int4_mma32": lambda: packed_mma_experts(x, slots, tw, q, act, config=MMA_BLOCK32),
                 # 64-128 token rows a block on the warpgroup MMA (prefill sizes)
                 "int4_wgmma": lambda: packed_wgmma_experts(x, slots, tw, q, act,
                                                          config=default_wgmma_config(g, expected, s)),
                 "int4_wgmma4": lambda: packed_wgmma_experts(x, slots, tw, q, act, config=WGMMA_ONE_WARPGROUP),
                 # tail row blocks: fewer padding rows computed
                 "int4_wgmma_t32": lambda: packed_wgmma_experts(x, slots, tw, q, act, config=WGMMA_TAIL32),
                 "int4_wgmma64_t32": lambda: packed_wgmma_experts(x, slots, tw, q, act, config=WGMMA_BLOCK64_TAIL32),
                 "int4_dequant": lambda: int4_dequantized_experts(x, slots, tw, q, act)}
        if t <= DECODE_MAX:
            impls["int4_decode"] = lambda: packed_decode_experts(x, slots, tw, q, act)
        for key, fn in impls.items():
            row[f"{key}_err"], row[f"{key}_us"] = _checked_time(fn, ref, flush)
        if t in sweep and t <= DECODE_MAX:  # the decode kernels' cost grows with the pairs: decode sizes only
            _sweep(row, "int4", INT4_DECODE_SWEEP, lambda cfg: packed_decode_experts(x, slots, tw, q, act, config=cfg),
                   ref, flush)
        if t in sweep:
            _sweep(row, "int4_grouped", INT4_GROUPED_SWEEP,
                   lambda cfg: int4_grouped_experts(x, slots, tw, q, act, config=cfg), ref, flush)
            _sweep(row, "int4_wgmma", INT4_WGMMA_SWEEP,
                   lambda cfg: packed_wgmma_experts(x, slots, tw, q, act, config=cfg), ref, flush)
        rows.append(row)
        print(json.dumps(row), flush=True)
        save()


def bench_mxfp4_case(name: str, case: dict, sizes: list[int], ceil: dict, sweep: set[int], rows: list[dict],
                     save: Callable[[], None]) -> None:
    """The MXFP4 backend against its floor, its decode kernels (up to ``MXFP4_DECODE_MAX_TOKENS``; at the ``sweep``
    sizes also the tiles of ``MXFP4_DECODE_SWEEP``), its grouped kernels, the widening path and bf16 on the same
    weight values at the ``sizes``; each row appended to ``rows`` and ``save()`` called after it."""
    flush = torch.empty(256 << 20, device="cuda", dtype=torch.float16)
    gen = torch.Generator(device="cuda").manual_seed(3)
    s, d, f = case["slots"], case["d"], case["f"]
    blocks = [torch.randint(0, 256, shape, device="cuda", dtype=torch.uint8, generator=gen)
              for shape in ((s, 2 * f, d // 32, 16), (s, d, f // 32, 16))]
    scales = [torch.randint(118, 122, shape, device="cuda", dtype=torch.uint8, generator=gen)
              for shape in ((s, 2 * f, d // 32), (s, d, f // 32))]
    bias = [torch.randn(s, n, device="cuda", generator=gen).bfloat16() * 0.1 for n in (2 * f, d)]
    q = MXFP4ExpertWeights(blocks[0], scales[0], blocks[1], scales[1], *bias)
    w = q.dequantize(torch.bfloat16)
    w32 = q.dequantize(torch.float32)
    act = Activation("silu", 7.0, 1.702)
    ours = get_expert_backend("triton")
    mx_bytes = 3 * d * f * 17 // 32
    for t in sizes:
        x, slots, tw = make_routing(case, t, gen)
        active = int(torch.unique(slots[slots >= 0]).numel())
        ref = reference_experts(x.float(), slots, tw, ExpertWeights(w32.w13, w32.w2, w32.b13.float(), w32.b2.float()),
                                act)
        flop_us = flop_floor_us(case, slots.numel(), ceil)
        row = {"case": name, "tokens": t, "active_slots": active, "flop_floor_us": flop_us,
               "mxfp4_floor_us": max(active * mx_bytes / ceil["copy_bytes_per_s"] * 1e6, flop_us),
               "bf16_floor_us": max(active * 3 * d * f * 2 / ceil["copy_bytes_per_s"] * 1e6, flop_us)}
        impls = {"mxfp4": lambda: ours(x, slots, tw, q, act),
                 "mxfp4_grouped": lambda: mxfp4_grouped_experts(x, slots, tw, q, act),
                 "mxfp4_widen": lambda: mxfp4_widened_experts(x, slots, tw, q, act),
                 "bf16": lambda: ours(x, slots, tw, w, act)}
        if t <= MXFP4_DECODE_MAX_TOKENS:
            impls["mxfp4_decode"] = lambda: packed_decode_experts(x, slots, tw, q, act, config=MXFP4_DECODE_CONFIG)
        if torch.cuda.get_device_capability() == (9, 0):
            n = slots.numel()
            impls["mxfp4_mma"] = lambda: packed_mma_experts(x, slots, tw, q, act,
                                                            config=default_mma_config(32, n, s))
            impls["mxfp4_wgmma"] = lambda: packed_wgmma_experts(x, slots, tw, q, act,
                                                                config=mxfp4_wgmma_config(n, s))
        for key, fn in impls.items():
            row[f"{key}_err"], row[f"{key}_us"] = _checked_time(fn, ref, flush)
        if t in sweep and t <= MXFP4_DECODE_MAX_TOKENS:
            _sweep(row, "mxfp4_decode", MXFP4_DECODE_SWEEP,
                   lambda cfg: packed_decode_experts(x, slots, tw, q, act, config=cfg), ref, flush)
        rows.append(row)
        print(json.dumps(row), flush=True)
        save()


def print_mxfp4_table(rows: list[dict]) -> None:
    """One line a row: the backend against its MXFP4 floor, the decode kernels (where they ran), the grouped kernels,
    the widening path and bf16 (with its own floor), and the errors of the backend and the grouped kernels."""
    nan = float("nan")
    print(f"\n{'case':16} {'T':>5} {'act':>4} {'mxfloor':>7} {'mxfp4':>8} {'x_fl':>5} {'decode':>7} {'grouped':>8} "
          f"{'mma':>8} {'wgmma':>8} {'widen':>8} {'bf16':>8} {'bf16fl':>7} {'bf16/mx':>7} {'err_mx':>8} "
          f"{'err_mma':>8} {'err_wg':>8}")
    for r in rows:
        fl = r["mxfp4_floor_us"]
        print(f"{r['case']:16} {r['tokens']:5d} {r['active_slots']:4d} {fl:7.1f} {r['mxfp4_us']:8.1f} "
              f"{r['mxfp4_us'] / fl:5.2f} {r.get('mxfp4_decode_us', nan):7.1f} {r['mxfp4_grouped_us']:8.1f} "
              f"{r.get('mxfp4_mma_us', nan):8.1f} {r.get('mxfp4_wgmma_us', nan):8.1f} {r['mxfp4_widen_us']:8.1f} "
              f"{r['bf16_us']:8.1f} {r['bf16_floor_us']:7.1f} {r['bf16_us'] / r['mxfp4_us']:7.2f} "
              f"{r['mxfp4_err']:8.1e} {r.get('mxfp4_mma_err', nan):8.1e} {r.get('mxfp4_wgmma_err', nan):8.1e}")


def _sweep(row: dict, key: str, configs: list, run, ref: torch.Tensor, flush: torch.Tensor) -> None:
    """Time ``run(cfg)`` for each config into ``row[key + "_sweep"]``, the fastest as ``row[key + "_best_us"]`` and
    ``row[key + "_best_config"]``."""
    for cfg in configs:
        err, us = _checked_time(lambda: run(cfg), ref, flush)
        row.setdefault(f"{key}_sweep", []).append({**asdict(cfg), "err": err, "us": us})
    best = min(row[f"{key}_sweep"], key=lambda e: e["us"] if e["us"] == e["us"] else float("inf"))
    row[f"{key}_best_us"], row[f"{key}_best_config"] = best["us"], {k: v for k, v in best.items()
                                                                    if k not in ("us", "err")}


def _checked_time(fn, ref: torch.Tensor, flush: torch.Tensor) -> tuple[float, float]:
    """``(relative error, us as a CUDA-graph replay)``; NaN for both (and the error printed) when ``fn`` fails,
    so that one failing variant does not end the run."""
    try:
        return rel_err(fn(), ref), time_fn(fn, True, flush) * 1e3
    except Exception as exc:  # a compile or launch failure of one variant
        print(f"failed: {type(exc).__name__}: {str(exc)[:400]}", flush=True)
        return float("nan"), float("nan")


def print_int4_table(rows: list[dict]) -> None:
    """One line a row: the backend's path and time against the INT4 floor, each path's time
    (``dbest``/``gbest``/``wbest``: the decode/grouped/wgmma sweeps' best), bf16 and dequantize-then-grouped_mm, errors
    of the backend, the grouped path and the wgmma kernels."""
    nan = float("nan")
    print(f"\n{'case':14} {'T':>5} {'act':>4} {'path':>7} {'i4floor':>7} {'int4':>8} {'x_fl':>6} {'i4mma':>8} "
          f"{'mma8':>8} {'mma32':>8} {'wgmma':>8} {'wgmma4':>8} {'wg_t32':>8} {'wg64t32':>8} {'wbest':>8} "
          f"{'i4dec':>8} "
          f"{'dbest':>7} {'i4grp':>8} {'gbest':>7} {'gb_x_fl':>7} {'i4deq':>8} {'bf16':>7} {'bf16/i4':>7} "
          f"{'deq_gmm':>8} {'err_i4':>8} {'err_grp':>8} {'err_wg':>8}")
    for r in rows:
        floor = r["int4_floor_us"] or nan  # no local pair: no floor
        print(f"{r['case']:14} {r['tokens']:5d} {r['active_slots']:4d} {r['int4_path']:>7} {r['int4_floor_us']:7.1f} "
              f"{r['int4_us']:8.1f} {r['int4_us'] / floor:6.2f} {r['int4_mma_us']:8.1f} "
              f"{r.get('int4_mma8_us', nan):8.1f} "
              f"{r['int4_mma32_us']:8.1f} {r['int4_wgmma_us']:8.1f} {r['int4_wgmma4_us']:8.1f} "
              f"{r['int4_wgmma_t32_us']:8.1f} {r['int4_wgmma64_t32_us']:8.1f} "
              f"{r.get('int4_wgmma_best_us', nan):8.1f} "
              f"{r.get('int4_decode_us', nan):8.1f} "
              f"{r.get('int4_best_us', nan):7.1f} {r['int4_grouped_us']:8.1f} "
              f"{r.get('int4_grouped_best_us', nan):7.1f} {r.get('int4_grouped_best_us', nan) / floor:7.2f} "
              f"{r['int4_dequant_us']:8.1f} {r['bf16_us']:7.1f} "
              f"{r['bf16_us'] / r['int4_us']:7.2f} {r['deq_gmm_us']:8.1f} {r['int4_err']:8.1e} "
              f"{r['int4_grouped_err']:8.1e} {r['int4_wgmma_err']:8.1e}")


def full_layer_graph(tokens: int) -> dict:
    """Router + fixed-capacity dispatcher (one-rank group) + Triton experts + combine: graph vs eager."""
    case = CASES["qwen3"]
    gen = torch.Generator(device="cuda").manual_seed(1)
    e, d, f, k = case["num_experts"], case["d"], case["f"], case["k"]
    w = ExpertWeights(
        (torch.randn(e, 2 * f, d, device="cuda", generator=gen) / d**0.5).to(torch.bfloat16),
        (torch.randn(e, d, f, device="cuda", generator=gen) / f**0.5).to(torch.bfloat16),
    )
    router = (torch.randn(e, d, device="cuda", generator=gen) / d**0.5).to(torch.bfloat16)
    disp = make_dispatcher("fixed_capacity", Comm(None), e, capacity=tokens)
    experts = get_expert_backend("triton")
    act = Activation()

    def layer(x):
        probs = torch.softmax((x @ router.t()).float(), dim=-1)
        tw, idx = torch.topk(probs, k, dim=-1)
        tw = tw / tw.sum(dim=-1, keepdim=True)
        h = disp.dispatch(x, idx, tw)
        y = experts(h.recv_x, h.recv_slots, h.recv_weights, w, act)
        return disp.combine(y, h), h

    static_x = torch.randn(tokens, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        layer(static_x)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static_out, static_h = layer(static_x)
    errs = []
    for _ in range(3):
        static_x.copy_(torch.randn(tokens, d, device="cuda", dtype=torch.bfloat16, generator=gen))
        g.replay()
        static_h.check_capacity()
        eager, _ = layer(static_x.clone())
        errs.append(((static_out.float() - eager.float()).norm() / eager.float().norm()).item())
    return {"tokens": tokens, "replay_vs_eager_rel_err": errs, "equal": all(e == 0.0 for e in errs),
            "replay_us": time_fn(g.replay, False, torch.empty(256 << 20, device="cuda", dtype=torch.float16)) * 1e3}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.path.join(os.environ["OUT"], "moe_layer.json") if "OUT" in os.environ else None)
    p.add_argument("--sizes", default="1,8,32,64,128,256,1024,4096")
    p.add_argument("--cases", default="qwen3,dsv3",
                   help=f"of {sorted(CASES) + sorted(INT4_CASES) + sorted(MXFP4_CASES)}")
    p.add_argument("--sweep", action="store_true",
                   help="also time the tile configurations of the sweep lists (bf16: DECODE_SWEEP, SWEEP; INT4: "
                        "INT4_DECODE_SWEEP, INT4_GROUPED_SWEEP, INT4_WGMMA_SWEEP; MXFP4: MXFP4_DECODE_SWEEP)")
    p.add_argument("--sweep-sizes", default=None, help="sizes to sweep (default: all of --sizes)")
    args = p.parse_args(argv)
    sizes = [int(v) for v in args.sizes.split(",")]
    sweep = set()
    if args.sweep:
        sweep = {int(v) for v in args.sweep_sizes.split(",")} if args.sweep_sizes else set(sizes)
    torch.backends.cuda.matmul.allow_tf32 = False
    ceil = measure_ceilings()
    print(json.dumps(ceil), flush=True)
    rows, int4_rows, mxfp4_rows, graph = [], [], [], {}
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "ceilings": ceil, "rows": rows, "int4_rows": int4_rows, "mxfp4_rows": mxfp4_rows,
              "full_layer_graph": graph}

    def save() -> None:
        """Write the results so far (each finished row), so that a run cut short by a time limit keeps them."""
        if args.out:
            with open(args.out, "w") as fh:
                json.dump(result, fh, indent=1)

    for name in args.cases.split(","):
        if name in MXFP4_CASES:
            bench_mxfp4_case(name, MXFP4_CASES[name], sizes, ceil, sweep, mxfp4_rows, save)
        elif name in INT4_CASES:
            # the tile sweep on the EP-8 shard only (the full layer's compiles and runs would not fit one call)
            bench_int4_case(name, INT4_CASES[name], sizes, ceil, sweep if name == "kimi_int4" else set(), int4_rows,
                            save)
        else:
            bench_case(name, CASES[name], sizes, ceil, sweep, name == "dsv3", rows, save)
    if rows:
        graph.update({f"t{t}": full_layer_graph(t) for t in (1, 8, 64)})
        save()
    print(f"\nceilings: copy {ceil['copy_bytes_per_s'] / 1e12:.2f} TB/s, bf16 {ceil['bf16_flop_per_s'] / 1e12:.0f} "
          "TFLOP/s")
    for key, gr in graph.items():
        print(f"full layer graph {key}: replay==eager {gr['equal']} errs {gr['replay_vs_eager_rel_err']} "
              f"replay {gr['replay_us']:.1f} us")
    if int4_rows:
        print_int4_table(int4_rows)
    if mxfp4_rows:
        print_mxfp4_table(mxfp4_rows)
    if not rows:
        return
    nan = float("nan")
    hdr = (f"{'case':6} {'T':>5} {'act':>4} {'floor':>7} {'lim':>4} {'ours':>7} {'x_fl':>5} {'%peak':>5} {'eager':>7} "
           f"{'torch':>7} {'x_ours':>6} {'hf':>7} {'x_ours':>6} {'best':>7} {'fp8':>7} {'fp8fl':>6} {'dirty':>7} "
           f"{'model':>6} {'x_fl':>5} {'torch_m':>7} {'x_ours':>6} {'err_ours':>8}")
    print(hdr)
    for r in rows:
        lim = "mem" if r["floor_mem_us"] >= r["floor_flop_us"] else "flop"
        model, torch_m = r.get("ours_in_model_us", nan), r.get("torch_grouped_mm_in_model_us", nan)
        print(f"{r['case']:6} {r['tokens']:5d} {r['active_slots']:4d} {r['floor_us']:7.1f} {lim:>4} "
              f"{r['ours_us']:7.1f} {r['ours_us'] / r['floor_us']:5.2f} "
              f"{100 * r['floor_flop_us'] / r['ours_us']:5.1f} {r['ours_eager_us']:7.1f} "
              f"{r['torch_grouped_mm_us']:7.1f} {r['torch_grouped_mm_us'] / r['ours_us']:6.2f} "
              f"{r['hf_grouped_mm_us']:7.1f} {r['hf_grouped_mm_us'] / r['ours_us']:6.2f} {r.get('best_us', nan):7.1f} "
              f"{r.get('fp8_us', nan):7.1f} {r.get('fp8_floor_us', nan):6.1f} {r.get('ours_dirty_flush_us', nan):7.1f} "
              f"{model:6.1f} {model / r.get('floor_in_model_us', nan):5.2f} {torch_m:7.1f} {torch_m / model:6.2f} "
              f"{r['ours_err']:8.1e}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
