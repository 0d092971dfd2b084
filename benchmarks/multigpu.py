"""Multi-GPU measurements in one process group: calibrate, the MoE layer (EP vs TP), ``epmoe run``, ``epmoe plan``.

Run on a machine with G GPUs (one process per GPU, NCCL)::

    PYTHONPATH=src torchrun --standalone --nproc-per-node G benchmarks/multigpu.py --out DIR

and on CPU with gloo to check the script itself (tiny sizes)::

    PYTHONPATH=src torchrun --standalone --nproc-per-node 2 benchmarks/multigpu.py --device cpu --small --out DIR

Parts (each in its own try block; a failure is reported with its rank and traceback and the next part runs):

1. ``calibrate``: all-reduce and all-to-all time over the group from 8 B to 256 MiB with
   ``epmoe.runtime.calibrate.measure_collectives`` (median, max over ranks), device copy/matmul rates, and the
   profile ``plan`` reads (``DIR/profile.json``, needs G >= 2). On CUDA also the small-message latency
   of a raw NCCL all-to-all and all-reduce timed with CUDA events, eager and as CUDA-graph replays (the
   peer of the graph-captured dispatch below).
2. ``layer``: one MoE layer at DeepSeek-V3 (256 experts) or Kimi-K2.5 (384 experts) size: hidden 7168,
   expert intermediate 2048, top-8, one shared expert, the model's real router (random bf16 weights;
   the same seed on every rank). Per tokens-per-rank ``T``: EP with the ``all_to_all`` dispatcher
   (eager: it syncs the host for the split sizes), EP with the ``fixed_capacity`` dispatcher (capacity
   ``T``; route + dispatch + experts + combine, ``GRAPH_REPS`` calls captured in one CUDA graph and
   replayed, time per call), and the TP
   layer (``TPMoELayer``, each rank a 1/G slice of every expert, on the ``T * G`` tokens of the whole
   batch, graph replay and eager); dispatch + combine alone for both dispatchers (bytes sent / time =
   bus bandwidth, against NCCL's all-to-all from part 1) and the TP all-reduce alone. Correctness: each
   variant against the single-rank ``MoELayer`` holding all experts (reference backend) on a few tokens,
   relative error, max over ranks, with the collectives one forward issues. Timings: CUDA events, median
   after warm-up, max over ranks (perf_counter on CPU).
3. ``run``: ``epmoe run --device cuda --ep G`` in a child process (rank 0 starts it after the layer
   buffers are freed; the other ranks wait) on a Qwen3-30B-A3B checkpoint at full width with random
   weights and ``--run-layers`` decoder layers (default 4), written with transformers' ``save_pretrained``
   into a temp dir. The run job checks its tokens and logits against the unsharded transformers model.
4. ``plan``: ``epmoe.plan.planner.plan`` on the profile of part 1 (the shipped ``h200-sxm`` when G = 1), at
   the batch ``T * G`` of each measured size; its per-MoE-layer dispatch+combine, all-reduce and expert
   times beside the measurements (ratio measured / predicted).

Writes ``DIR/multigpu.json`` (rewritten after each part), ``DIR/profile.json``, ``DIR/run.json`` and
``DIR/run.log``; prints a short table last. Exit code 0 when every part ran and every check passed.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
if str(REPO / "src") not in sys.path:  # runnable from a checkout without installing
    sys.path.insert(0, str(REPO / "src"))

# Keep NVLink multicast off on the lent machines (KINDS.md); respected if already set.
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from epmoe.comm import Comm  # noqa: E402
from epmoe.dispatch import AllToAllDispatcher  # noqa: E402
from epmoe.dispatch.fixed_capacity import FixedCapacityDispatcher  # noqa: E402
from epmoe.layer import MoELayer, TPMoELayer  # noqa: E402
from epmoe.placement import ExpertPlacement  # noqa: E402
from epmoe.runtime.calibrate import CalibrationConfig, build_profile, measure_collectives, measure_device, message_sizes  # noqa: E402
from epmoe.spec import MoESpec, language_model_config, parse_moe_spec  # noqa: E402

CONFIGS = REPO / "data" / "configs"
LAYER_MODELS = {256: "deepseek-v3", 384: "kimi-k2.5"}
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
                "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
                "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE")
# Checks: largest relative error accepted against the single-rank reference.
TOL = {"float32": 1e-5, "bfloat16": 2e-2}
# Sizes of --small (CPU check): hidden, expert intermediate, experts (top-8 kept).
SMALL = dict(hidden_size=128, moe_intermediate_size=64, experts=32)
PARTS = ("calibrate", "layer", "run", "plan")
H200_HBM, H200_BF16 = 4.3e12, 7.9e14  # DESIGN.md's floors: bytes/s, FLOP/s


@dataclass
class Ctx:
    """Where this rank stands and what it was asked."""

    args: argparse.Namespace
    rank: int
    world: int
    local_rank: int
    device: torch.device
    side: Any  # gloo group with a long timeout: object gathers, scalar reductions, waits
    out: Path
    doc: dict = field(default_factory=dict)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.cuda else torch.float32

    def log(self, msg: str) -> None:
        if self.rank == 0:
            print(f"[multigpu] {msg}", flush=True)


# ---------------------------------------------------------------------------------------------- helpers


def gather(ctx: Ctx, obj: Any) -> list[Any]:
    """Every rank's ``obj`` (over the gloo side group)."""
    out: list[Any] = [None] * ctx.world
    dist.all_gather_object(out, obj, group=ctx.side)
    return out


def all_max(ctx: Ctx, value: float) -> float:
    """The largest ``value`` over ranks."""
    t = torch.tensor([float(value)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=ctx.side)
    return float(t.item())


def all_mean(ctx: Ctx, value: float) -> float:
    t = torch.tensor([float(value)], dtype=torch.float64)
    dist.all_reduce(t, group=ctx.side)
    return float(t.item()) / ctx.world


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm().clamp(min=1e-30))


def capture(fn: Callable[[], Any], reps: int = 1) -> tuple[torch.cuda.CUDAGraph, Any]:
    """Warm ``fn`` up on a side stream, capture ``reps`` calls in one CUDA graph; return it and the last output."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    # thread_local: NCCL's watchdog thread may query events while this thread captures
    with torch.cuda.graph(g, capture_error_mode="thread_local"):
        for _ in range(reps):
            out = fn()
    torch.cuda.synchronize()
    return g, out


def time_us(ctx: Ctx, fn: Callable[[], Any], iters: int | None = None, warmup: int | None = None) -> float:
    """Median µs of ``fn()`` after warm-up (CUDA events on GPU, perf_counter on CPU), max over ranks."""
    iters = iters or ctx.args.iters
    warmup = ctx.args.warmup if warmup is None else warmup
    for _ in range(warmup):
        fn()
    if ctx.cuda:
        torch.cuda.synchronize()
    dist.barrier(group=ctx.side)
    samples = []
    if ctx.cuda:
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
        for a, b in ev:
            a.record()
            fn()
            b.record()
        torch.cuda.synchronize()
        samples = [a.elapsed_time(b) * 1e3 for a, b in ev]
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e6)
    return all_max(ctx, statistics.median(samples))


GRAPH_REPS = 8  # calls per captured graph: per-call device time, as in a graph-replayed decode step of many layers


def time_graph_us(ctx: Ctx, fn: Callable[[], Any]) -> tuple[float, bool]:
    """``fn`` per call from replays of a CUDA graph of ``GRAPH_REPS`` calls on GPU (eager on CPU); (µs, graphed)."""
    if not ctx.cuda:
        return time_us(ctx, fn), False
    g, _ = capture(fn, GRAPH_REPS)
    us = time_us(ctx, g.replay, iters=ctx.args.iters * 2) / GRAPH_REPS
    del g
    return us, True


def free_memory(ctx: Ctx) -> None:
    gc.collect()
    if ctx.cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def write_doc(ctx: Ctx) -> None:
    if ctx.rank != 0:
        return
    path = ctx.out / "multigpu.json"
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(ctx.doc, indent=1, default=str))
    tmp.replace(path)


def run_part(ctx: Ctx, name: str, fn: Callable[[Ctx], Any]) -> Any:
    """Run one part on every rank; record its result (rank 0's) or every rank's error; never hide one."""
    if name in ctx.args.skip:
        ctx.doc["parts"][name] = {"ok": None, "skipped": True}
        ctx.log(f"part {name}: skipped")
        write_doc(ctx)
        return None
    ctx.log(f"part {name}: start")
    t0 = time.perf_counter()
    try:
        value, err = fn(ctx), None
    except Exception as exc:  # noqa: BLE001 - reported below, with the traceback
        value, err = None, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
        print(f"[multigpu rank {ctx.rank}] PART {name} FAILED: {err}", file=sys.stderr, flush=True)
    errors = gather(ctx, err)
    failed = {r: e for r, e in enumerate(errors) if e}
    status = {"ok": not failed, "seconds": round(time.perf_counter() - t0, 2)}
    if failed:
        first = min(failed)
        status.update(failed_ranks=sorted(failed), error=failed[first])
        ctx.log(f"part {name}: FAILED on ranks {sorted(failed)}; rank {first}: {failed[first].splitlines()[0]}")
    else:
        ctx.doc[name] = value
        ctx.log(f"part {name}: ok in {status['seconds']} s")
    ctx.doc["parts"][name] = status
    free_memory(ctx)
    write_doc(ctx)
    return None if failed else value


# ---------------------------------------------------------------------------------------------- part 1


def part_calibrate(ctx: Ctx) -> dict:
    a = ctx.args
    max_bytes = a.max_bytes or (256 * 2**20 if ctx.cuda else (64 * 2**10 if a.small else 4 * 2**20))
    sizes = message_sizes(max_bytes, ctx.world)
    rows = measure_collectives(sizes, a.calib_iters, ctx.device, group=None)
    n = ctx.world
    for r in rows:  # nccl-tests' bus bandwidth per size
        r["all_reduce_busbw_gbs"] = 2 * (n - 1) / n * r["bytes"] / (r["all_reduce_ms"] * 1e-3) / 1e9
        r["all_to_all_busbw_gbs"] = (n - 1) / n * r["bytes"] / (r["all_to_all_ms"] * 1e-3) / 1e9
    facts = measure_device(ctx.device)
    res: dict[str, Any] = {"rows": rows, "device_facts": facts, "profile": None, "profile_path": None}
    gpu = torch.cuda.get_device_name(ctx.device) if ctx.cuda else "CPU"
    if n >= 2:
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", n))
        path = ctx.out / "profile.json"
        cfg = CalibrationConfig(out=str(path), name=f"calibrated-{n}x-{'gpu' if ctx.cuda else 'cpu'}",
                                base="h200-sxm" if ctx.cuda else None, iters=a.calib_iters)
        doc = build_profile(rows, facts, n, max(1, n // local_world), "nccl" if ctx.cuda else "gloo", gpu, cfg)
        if ctx.rank == 0:
            path.write_text(json.dumps(doc, indent=2))
        res["profile"], res["profile_path"] = doc["links"], str(path)
    else:
        res["profile_note"] = "one rank: no bus bandwidth to fit (factor (n-1)/n = 0); plan uses the shipped profile"
    if ctx.cuda:  # small-message latency with CUDA events, eager and as graph replays
        small = {}
        for nb in (sizes[0], 64 * 1024):
            x = torch.ones(nb // 4, device=ctx.device)
            y = torch.empty_like(x)
            z = torch.zeros(nb // 4, device=ctx.device)
            a2a = lambda: dist.all_to_all_single(y, x)  # noqa: E731
            ar = lambda: dist.all_reduce(z)  # noqa: E731
            small[str(nb)] = {
                "all_to_all_eager_us": time_us(ctx, a2a, iters=50), "all_reduce_eager_us": time_us(ctx, ar, iters=50),
                "all_to_all_graph_us": time_graph_us(ctx, a2a)[0], "all_reduce_graph_us": time_graph_us(ctx, ar)[0],
            }
        res["small_message_events"] = small
    return res


# ---------------------------------------------------------------------------------------------- part 2


def layer_spec(args: argparse.Namespace) -> MoESpec:
    """The real DeepSeek-V3 / Kimi-K2.5 MoE facts (``--small``: hidden, F and E shrunk, routing kept)."""
    name = LAYER_MODELS[args.experts]
    raw = json.loads((CONFIGS / f"{name}.config.json").read_text())
    cfg = dict(language_model_config(raw))
    if args.small:
        e = SMALL["experts"] * args.experts // 256
        cfg.update(hidden_size=SMALL["hidden_size"], moe_intermediate_size=SMALL["moe_intermediate_size"],
                   n_routed_experts=e)
        if int(cfg.get("n_group") or 1) > 1:
            cfg.update(n_group=8, topk_group=4)
    return parse_moe_spec(cfg, f"{CONFIGS / name}.config.json" + (" (--small)" if args.small else ""))


@torch.no_grad()
def fill_random(module: torch.nn.Module, seed: int, device: torch.device) -> None:
    """Deterministic random weights (the same on every rank): ``N(0, 1/in)``; correction bias ``N(0, 0.01^2)``."""
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, p in list(module.named_parameters()) + list(module.named_buffers()):
        if not p.dtype.is_floating_point:
            continue
        scale = 0.01 if name.endswith("e_score_correction_bias") or p.dim() == 1 else p.shape[-1] ** -0.5
        rows = p.view(p.shape[0], -1) if p.dim() > 1 else p.view(1, -1)
        step = max(1, (1 << 26) // max(1, rows.shape[1]))
        for i in range(0, rows.shape[0], step):
            chunk = rows[i:i + step]
            chunk.copy_(torch.randn(chunk.shape, generator=gen, device=device, dtype=torch.float32) * scale)


def _inputs(ctx: Ctx, t: int, d: int, seed: int, shared: bool) -> torch.Tensor:
    """``[t, d]`` hidden states: per rank, or the same on every rank (``shared``)."""
    gen = torch.Generator(device=ctx.device).manual_seed(seed * 1009 + (0 if shared else 7919 * (ctx.rank + 1)) + t)
    return torch.randn(t, d, generator=gen, device=ctx.device, dtype=torch.float32).to(ctx.dtype)


def _calls(comm: Comm, before) -> dict[str, int]:
    return {k: v for k, v in comm.stats.since(before).calls.items()}


def _nearest_row(rows: list[dict], sent_bytes: float, n: int) -> dict | None:
    """The calibration row whose all-to-all bytes sent to other ranks is closest (log scale) to ``sent_bytes``."""
    if not rows or n < 2 or sent_bytes <= 0:
        return None
    return min(rows, key=lambda r: abs(math.log((n - 1) / n * r["bytes"] / sent_bytes)))


def part_layer(ctx: Ctx) -> dict:
    a = ctx.args
    g, dev, dtype = ctx.world, ctx.device, ctx.dtype
    spec = layer_spec(a)
    d, f, e, k = spec.hidden_size, spec.moe_intermediate_size, spec.num_experts, spec.top_k
    backend = "triton" if ctx.cuda else "reference"
    group = dist.group.WORLD
    res: dict[str, Any] = {
        "model": LAYER_MODELS[a.experts], "spec": {"hidden": d, "intermediate": f, "experts": e, "top_k": k,
                                                  "shared_intermediate": spec.shared_intermediate_size,
                                                  "router": spec.router_kind, "n_group": spec.n_group},
        "ep": g, "dtype": str(dtype).replace("torch.", ""), "expert_backend": backend, "tolerance": TOL[str(dtype)[6:]],
    }
    ctx.log(f"layer: {res['model']} D {d} F {f} E {e} top-{k} over {g} rank(s), {res['dtype']}, backend {backend}")

    # the single-rank reference holding all experts; the EP and TP layers take their share of it
    full = MoELayer(spec, 0, ExpertPlacement.trivial(spec.num_moe_layers, e, 1), Comm(None), dispatcher="local",
                    expert_backend="reference", dtype=dtype, device=dev)
    fill_random(full, a.seed, dev)
    comm_a2a, comm_fixed, comm_tp = Comm(group), Comm(group), Comm(group)
    placement = ExpertPlacement.trivial(spec.num_moe_layers, e, g)
    ep = MoELayer(spec, 0, placement, comm_a2a, dispatcher="all_to_all", expert_backend=backend, dtype=dtype,
                  device=dev)
    with torch.no_grad():
        ep.gate.load_state_dict(full.gate.state_dict())
        if full.shared_experts is not None:
            ep.shared_experts.load_state_dict(full.shared_experts.state_dict())
        for j, expert in enumerate(ep.local_experts.tolist()):  # slot by slot: no E-sized temporary
            ep.experts.w13[j].copy_(full.experts.w13[expert])
            ep.experts.w2[j].copy_(full.experts.w2[expert])
    tp = TPMoELayer(spec, comm_tp, expert_backend=backend, dtype=dtype, device=dev)
    tp.load_from(full)
    a2a_disp = ep.dispatcher
    s = placement.slots_per_rank

    def fixed(cap: int) -> FixedCapacityDispatcher:
        return FixedCapacityDispatcher(comm_fixed, s, capacity=cap)

    # correctness on a few tokens, against the single-rank layer
    c = a.check_tokens
    checks: dict[str, Any] = {}
    with torch.no_grad():
        x = _inputs(ctx, c, d, a.seed + 1, shared=False)
        x_tp = _inputs(ctx, c * g, d, a.seed + 2, shared=True)
        ref, ref_tp = full(x), full(x_tp)
        before = comm_a2a.stats.snapshot()
        out = ep(x)
        checks["ep_all_to_all"] = {"rel_err": all_max(ctx, rel_err(out, ref)), "calls": _calls(comm_a2a, before)}
        ep.set_dispatcher(fixed(c))
        before = comm_fixed.stats.snapshot()
        out = ep(x)
        checks["ep_fixed_eager"] = {"rel_err": all_max(ctx, rel_err(out, ref)), "calls": _calls(comm_fixed, before)}
        if ctx.cuda:  # the captured graph, replayed on two fresh inputs
            static_x = torch.zeros_like(x)
            graph, static_out = capture(lambda: ep(static_x))
            errs = []
            for i in range(2):
                xi = _inputs(ctx, c, d, a.seed + 10 + i, shared=False)
                static_x.copy_(xi)
                graph.replay()
                errs.append(rel_err(static_out, full(xi)))
            checks["ep_fixed_graph"] = {"rel_err": all_max(ctx, max(errs))}
            del graph
        ep.set_dispatcher(a2a_disp)
        before = comm_tp.stats.snapshot()
        out = tp(x_tp)
        checks["tp"] = {"rel_err": all_max(ctx, rel_err(out, ref_tp)), "calls": _calls(comm_tp, before)}
        if ctx.cuda:
            static_x = x_tp.clone()
            graph, static_out = capture(lambda: tp(static_x))
            graph.replay()
            checks["tp_graph"] = {"rel_err": all_max(ctx, rel_err(static_out, ref_tp))}
            del graph
    tol = res["tolerance"]
    for v in checks.values():
        v["ok"] = v["rel_err"] < tol
    res["checks"] = checks
    res["checks_ok"] = all(v["ok"] for v in checks.values())
    ctx.log("layer checks: " + ", ".join(f"{n} {v['rel_err']:.2e}" for n, v in checks.items()))
    del full, ref, ref_tp, out
    free_memory(ctx)

    # floors: DESIGN.md's H200 figures on CUDA, the rates part 1 measured on CPU
    facts = (ctx.doc.get("calibrate") or {}).get("device_facts") or {}
    hbm = H200_HBM if ctx.cuda else facts.get("hbm_bytes_per_s", 2e10)
    peak = H200_BF16 if ctx.cuda else facts.get("bf16_flops_per_s", 1e11)
    expert_bytes = 3 * d * f * torch.finfo(dtype).bits // 8
    shared_bytes = 3 * d * spec.shared_intermediate_size * torch.finfo(dtype).bits // 8
    res["floor"] = {"hbm_bytes_per_s": hbm, "flops_per_s": peak,
                    "what": "max(bytes of the local experts hit + shared expert / HBM, FLOPs of the routed rows / "
                            "peak)"}
    calib_rows = (ctx.doc.get("calibrate") or {}).get("rows") or []
    rows = []
    with torch.no_grad():
        for t in a.tokens:
            row: dict[str, Any] = {"tokens_per_rank": t, "batch": t * g}
            x = _inputs(ctx, t, d, a.seed + 100, shared=False)
            x_tp = _inputs(ctx, t * g, d, a.seed + 200, shared=True)
            idx, w = ep.gate(x)
            slots = ep.slot_map(idx)
            mine = slots[(slots >= ctx.rank * s) & (slots < (ctx.rank + 1) * s)]
            touched, pairs = int(torch.unique(mine).numel()), int(mine.numel())
            floor = max((touched * expert_bytes + shared_bytes) / hbm,
                        2 * (pairs * 3 * d * f + t * 3 * d * spec.shared_intermediate_size) / peak) * 1e6
            row["touched_local_experts_max"] = int(all_max(ctx, touched))
            row["expert_floor_us"] = all_max(ctx, floor)
            tp_idx = tp.gate(x_tp)[0]
            tp_touched = int(torch.unique(tp_idx).numel())
            row["tp_expert_floor_us"] = max((tp_touched * expert_bytes + shared_bytes) / g / hbm,
                                            2 * (tp_idx.numel() * 3 * d * f
                                                 + t * g * 3 * d * spec.shared_intermediate_size)
                                            / g / peak) * 1e6

            ep.set_dispatcher(a2a_disp)
            row["ep_all_to_all_us"] = time_us(ctx, lambda: ep(x))
            ep.set_dispatcher(fixed(t))
            static_x = x.clone()
            row["ep_fixed_us"], row["ep_fixed_graphed"] = time_graph_us(ctx, lambda: ep(static_x))
            ep.set_dispatcher(a2a_disp)
            static_tp = x_tp.clone()
            row["tp_us"], row["tp_graphed"] = time_graph_us(ctx, lambda: tp(static_tp))
            row["tp_eager_us"] = time_us(ctx, lambda: tp(x_tp))
            ar_buf = torch.zeros(t * g, d, dtype=dtype, device=dev)
            # one rank: Comm skips the all-reduce, and an empty graph is not worth capturing
            row["tp_all_reduce_us"] = time_graph_us(ctx, lambda: comm_tp.all_reduce(ar_buf))[0] if g > 1 else 0.0
            row["tp_all_reduce_bytes"] = t * g * d * ar_buf.element_size()
            row.update(_dispatch_row(ctx, x, slots, w, a2a_disp, fixed(t), comm_a2a, comm_fixed, calib_rows))
            rows.append(row)
            ctx.log(f"layer T={t}: EP a2a {row['ep_all_to_all_us']:.1f} us, EP "
                    f"fixed{'+graph' if row['ep_fixed_graphed'] else ''} "
                    f"{row['ep_fixed_us']:.1f} us, TP {row['tp_us']:.1f} us (eager {row['tp_eager_us']:.1f}), "
                    f"dispatch+combine a2a {row['disp_all_to_all_us']:.1f} / fixed {row['disp_fixed_us']:.1f} us")
            static_x = static_tp = ar_buf = None  # free the buffers
            free_memory(ctx)
    res["rows"] = rows

    # dispatch + combine alone at larger token counts (bandwidth regime)
    drows = []
    with torch.no_grad():
        for t in a.dispatch_tokens:
            x = _inputs(ctx, t, d, a.seed + 300, shared=False)
            idx, w = ep.gate(x)
            slots = ep.slot_map(idx)
            r = {"tokens_per_rank": t}
            r.update(_dispatch_row(ctx, x, slots, w, a2a_disp, fixed(t), comm_a2a, comm_fixed, calib_rows))
            drows.append(r)
            ctx.log(f"dispatch T={t}: a2a {r['disp_all_to_all_us']:.1f} us {r['disp_all_to_all_busbw_gbs']:.1f} GB/s, "
                    f"fixed {r['disp_fixed_us']:.1f} us {r['disp_fixed_busbw_gbs']:.1f} GB/s")
            x = None  # free the buffer
            free_memory(ctx)
    res["dispatch_rows"] = drows
    return res


def _dispatch_row(ctx: Ctx, x, slots, w, a2a_disp: AllToAllDispatcher, fixed_disp: FixedCapacityDispatcher,
                  comm_a2a: Comm, comm_fixed: Comm, calib_rows: list[dict]) -> dict:
    """Dispatch + combine alone (the received rows sent straight back) for both dispatchers."""
    n = ctx.world
    row: dict[str, Any] = {}

    # combine gets a contiguous [R, D] tensor, as from the expert backend (recv_x is a view of the buffer)
    y_a2a = torch.zeros(a2a_disp.dispatch(x, slots, w).recv_x.shape, dtype=x.dtype, device=x.device)
    y_fixed = torch.zeros(fixed_disp.dispatch(x, slots, w).recv_x.shape, dtype=x.dtype, device=x.device)

    def a2a_round():
        return a2a_disp.combine(y_a2a, a2a_disp.dispatch(x, slots, w))

    static_x = x.clone()

    def fixed_round():
        return fixed_disp.combine(y_fixed, fixed_disp.dispatch(static_x, slots, w))

    for name, fn, comm in (("all_to_all", a2a_round, comm_a2a), ("fixed", fixed_round, comm_fixed)):
        before = comm.stats.snapshot()
        fn()
        delta = comm.stats.since(before)
        sent = delta.bytes_sent["all_to_all"]
        us, graphed = time_graph_us(ctx, fn) if name == "fixed" else (time_us(ctx, fn), False)
        mean_sent = all_mean(ctx, sent)
        row[f"disp_{name}_us"] = us
        row[f"disp_{name}_graphed"] = graphed
        row[f"disp_{name}_calls"] = delta.calls["all_to_all"]
        row[f"disp_{name}_bytes_sent"] = mean_sent  # to other ranks, dispatch + combine, mean over ranks
        row[f"disp_{name}_busbw_gbs"] = mean_sent / (us * 1e-6) / 1e9 if us > 0 else 0.0
        # NCCL all-to-all of about the same size (one of the two transfers), from part 1
        near = _nearest_row(calib_rows, mean_sent / 2, n)
        if near is not None:
            row[f"disp_{name}_nccl_same_size_busbw_gbs"] = near["all_to_all_busbw_gbs"]
            row[f"disp_{name}_nccl_same_size_bytes"] = near["bytes"]
    return row


# ---------------------------------------------------------------------------------------------- part 3


def build_qwen3_checkpoint(directory: Path, layers: int, device: torch.device) -> dict:
    """Qwen3-30B-A3B at full width (D 2048, 128 experts of F 768, top-8, 32/4 heads, vocab 151936) with
    ``layers`` decoder layers and transformers' random init, saved in bf16 with ``save_pretrained``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    raw = json.loads((CONFIGS / "qwen3-30b-a3b.config.json").read_text())
    raw.pop("source", None)
    raw.pop("transformers_version", None)
    raw.pop("architectures", None)
    mt = raw.pop("model_type")
    raw.update(num_hidden_layers=layers, max_window_layers=layers)
    config = AutoConfig.for_model(mt, **raw)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    n_params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(directory)
    del model
    return {"family": "qwen3_moe (Qwen3-30B-A3B config, full width)", "layers": layers, "params": n_params,
            "bytes_on_disk": sum(p.stat().st_size for p in directory.glob("*.safetensors"))}


def part_run(ctx: Ctx) -> dict | None:
    res: dict[str, Any] | None = None
    err: str | None = None
    if ctx.rank == 0:
        try:
            res = _run_on_rank0(ctx)
        except Exception as exc:  # noqa: BLE001 - re-raised after the other ranks are released
            err = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
    dist.barrier(group=ctx.side)  # the other ranks wait here while rank 0's child job runs
    if err:
        raise RuntimeError(f"rank 0: {err}")
    return res


def _run_on_rank0(ctx: Ctx) -> dict:
    a = ctx.args
    tmp = Path(tempfile.mkdtemp(prefix="epmoe-multigpu-"))
    ckpt = tmp / "ckpt"
    t0 = time.perf_counter()
    if a.small:
        from epmoe.models.tiny import build_tiny_checkpoint

        build_tiny_checkpoint("qwen3-moe", ckpt)
        info = {"family": "qwen3-moe tiny (epmoe.models.tiny)", "layers": 2}
    else:
        info = build_qwen3_checkpoint(ckpt, a.run_layers, ctx.device)
    free_memory(ctx)
    info["build_s"] = round(time.perf_counter() - t0, 1)
    run_json, log = ctx.out / "run.json", ctx.out / "run.log"
    cmd = [sys.executable, "-m", "epmoe.cli", "run", "--device", ctx.device.type, "--ep", str(ctx.world),
           "--model", str(ckpt), "--max-new-tokens", str(a.run_new_tokens), "--json", str(run_json)]
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_ENV}
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src")] + paths)
    ctx.log("run: " + " ".join(cmd))
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=a.run_timeout)
        output, code = proc.stdout, proc.returncode
    except subprocess.TimeoutExpired as exc:
        raw = exc.stdout or ""
        output, code = (raw.decode(errors="replace") if isinstance(raw, bytes) else raw), f"timeout ({a.run_timeout} s)"
    log.write_text(output)
    info["run_s"] = round(time.perf_counter() - t0, 1)
    import shutil

    shutil.rmtree(tmp, ignore_errors=True)
    if code != 0 or not run_json.is_file():
        tail = "\n".join(output.splitlines()[-25:])
        raise RuntimeError(f"`epmoe run` exited with {code}; last lines of {log}:\n{tail}")
    rep = json.loads(run_json.read_text())
    r0 = rep["ranks"][0]
    return {
        "command": " ".join(cmd[1:]), "checkpoint": info, "exit_code": code,
        "matches_reference": rep["matches_reference"], "mismatches": rep["mismatches"],
        "max_logits_rel_err": rep["max_logits_rel_err"], "tokens_per_s": rep["tokens_per_s"],
        "balancedness": rep["balancedness"], "collectives_per_step": r0["collectives"],
        "bytes_per_step": r0["bytes_per_step"], "peak_cuda_mb": [r["peak_cuda_mb"] for r in rep["ranks"]],
        "peak_rss_mb": [r["peak_rss_mb"] for r in rep["ranks"]], "expert_mb": [r["expert_mb"] for r in rep["ranks"]],
        "full_expert_mb": r0["full_expert_mb"], "model_type": rep["model_type"],
    }


# ---------------------------------------------------------------------------------------------- part 4


def part_plan(ctx: Ctx) -> dict | None:
    if ctx.rank != 0:
        return None
    from epmoe.plan.hardware import load_hardware
    from epmoe.plan.planner import plan
    from epmoe.plan.request import PlanRequest

    a, g = ctx.args, ctx.world
    calib = ctx.doc.get("calibrate") or {}
    if calib.get("profile_path"):
        hw, hw_note = load_hardware(calib["profile_path"]), "calibrated in part 1"
    else:
        hw, hw_note = load_hardware("h200-sxm"), "shipped h200-sxm (no calibrated profile: one rank or part 1 failed)"
    spec = layer_spec(a)
    tokens = list(a.tokens)
    req = PlanRequest(spec=spec, hardware=hw, gpus=g, batches=tuple(t * g for t in tokens), weights="bf16",
                      balancedness=1.0, context=1)
    p = plan(req)
    n_moe = spec.num_moe_layers
    names = [sp.strategy.name for sp in p.strategies]
    ep_name = f"EP{g}+DPattn" if g > 1 else "TP1"
    tp_name = f"TP{g}"
    measured = {r["tokens_per_rank"]: r for r in (ctx.doc.get("layer") or {}).get("rows", [])}
    rows = []
    for i, t in enumerate(tokens):
        row: dict[str, Any] = {"tokens_per_rank": t, "batch": t * g}
        for label, name in (("ep", ep_name), ("tp", tp_name)):
            if name not in names:
                continue
            st = p.strategy(name).steps[i]
            a2a = [c for c in st.collectives if c.kind == "all_to_all"]
            ar = [c for c in st.collectives if c.kind == "all_reduce"]
            row[f"{label}_pred_expert_us"] = st.expert_ms / n_moe * 1e3
            if label == "ep":
                row["ep_pred_dispatch_combine_us"] = 2 * a2a[0].ms_each * 1e3 if a2a else 0.0  # dispatch + combine
                row["ep_pred_a2a_calls_per_layer"] = sum(c.count for c in a2a) / n_moe
                row["ep_pred_a2a_bytes_per_call"] = a2a[0].bytes_per_call if a2a else 0.0
            else:
                row["tp_pred_all_reduce_us"] = ar[0].ms_each * 1e3 if ar else 0.0
                row["tp_pred_all_reduce_bytes"] = ar[0].bytes_per_call if ar else 0.0
        m = measured.get(t)
        if m:
            def ratio(meas: float | None, pred: float | None) -> float | None:
                return meas / pred if meas and pred else None

            row["ep_disp_fixed_meas_over_pred"] = ratio(m.get("disp_fixed_us"), row.get("ep_pred_dispatch_combine_us"))
            row["ep_disp_a2a_meas_over_pred"] = ratio(m.get("disp_all_to_all_us"),
                                                      row.get("ep_pred_dispatch_combine_us"))
            row["tp_all_reduce_meas_over_pred"] = ratio(m.get("tp_all_reduce_us"), row.get("tp_pred_all_reduce_us"))
            ep_expert = m["ep_fixed_us"] - m.get("disp_fixed_us", 0.0)
            row["ep_expert_meas_us"] = ep_expert
            row["ep_expert_meas_over_pred"] = ratio(ep_expert, row.get("ep_pred_expert_us"))
            if "tp_pred_expert_us" in row:
                tp_expert = m["tp_us"] - m.get("tp_all_reduce_us", 0.0)
                row["tp_expert_meas_us"] = tp_expert
                row["tp_expert_meas_over_pred"] = ratio(tp_expert, row.get("tp_pred_expert_us"))
        rows.append(row)
    # the profile's dispatch_layout_fixed_us that would make the fixed dispatcher's rows fit best: the
    # median of measured - predicted without it (DESIGN.md's H200 profile takes its value from here)
    resid = [m["disp_fixed_us"] - r["ep_pred_dispatch_combine_us"] + hw.dispatch_layout_fixed_us
             for r in rows if (m := measured.get(r["tokens_per_rank"])) and r.get("ep_pred_dispatch_combine_us")]
    out = {"hardware": hw.name, "hardware_source": hw_note, "strategies": names, "skipped": list(p.skipped),
           "dispatch_layout_fixed_us": hw.dispatch_layout_fixed_us,
           "fit_dispatch_layout_fixed_us": statistics.median(resid) if resid else None,
           "rows": rows, "note": "per MoE layer; prediction = planner's step estimate divided by its MoE layer count; "
                                 "measured expert time = layer time minus dispatch+combine (fixed, graphed) or minus "
                                 "the all-reduce (TP)"}
    run = ctx.doc.get("run")
    if run and not a.small:  # the run model's collectives per decode step: planner vs measured
        from epmoe.spec import load_moe_spec  # noqa: F401 - the run checkpoint is gone; use the config
        raw = json.loads((CONFIGS / "qwen3-30b-a3b.config.json").read_text())
        raw["num_hidden_layers"] = a.run_layers
        rspec = parse_moe_spec(raw, "qwen3-30b-a3b (run layers)")
        if g > 1:
            rp = plan(PlanRequest(spec=rspec, hardware=hw, gpus=g, batches=(4,), weights="bf16", context=64))
            st = rp.strategy(f"EP{g}+DPattn").steps[0]
            out["run_collectives_per_step"] = {"planner_all_to_all": st.count("all_to_all"),
                                               "measured": run["collectives_per_step"],
                                               "note": "the all_to_all dispatcher adds one count exchange per layer"}
    return out


# ---------------------------------------------------------------------------------------------- summary


def _fmt(v: Any, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec)


def summary(ctx: Ctx) -> tuple[str, bool]:
    doc, g = ctx.doc, ctx.world
    lines, ok = [], True
    parts = doc["parts"]
    lines.append("parts: " + ", ".join(f"{p} {'ok' if s.get('ok') else ('skipped' if s.get('skipped') else 'FAILED')}"
                                       for p, s in parts.items()))
    ok &= all(s.get("ok") or s.get("skipped") for s in parts.values())
    calib = doc.get("calibrate")
    a2a_lat = None
    if calib:
        rows = calib["rows"]
        a2a_lat = rows[0]["all_to_all_ms"] * 1e3
        lines.append(f"calibrate ({g} ranks): all-reduce {rows[0]['all_reduce_ms'] * 1e3:.1f} us @{rows[0]['bytes']} "
                     "B, "
                     f"{rows[-1]['all_reduce_busbw_gbs']:.1f} GB/s bus @{rows[-1]['bytes'] / 2**20:.2f} MiB; "
                     "all-to-all "
                     f"{a2a_lat:.1f} us, {rows[-1]['all_to_all_busbw_gbs']:.1f} GB/s bus")
        sm = calib.get("small_message_events")
        if sm:
            k0 = min(sm, key=int)
            v = sm[k0]
            lines.append(f"  small all-to-all ({k0} B, CUDA events): eager {v['all_to_all_eager_us']:.1f} us, "
                         f"graph {v['all_to_all_graph_us']:.1f} us; all-reduce eager {v['all_reduce_eager_us']:.1f}, "
                         f"graph {v['all_reduce_graph_us']:.1f} us")
    layer = doc.get("layer")
    plan_rows = {r["tokens_per_rank"]: r for r in (doc.get("plan") or {}).get("rows", [])}
    if layer:
        lines.append(f"layer {layer['model']} E {layer['spec']['experts']} over {g}, {layer['dtype']}: checks "
                     + ", ".join(f"{n} "
                                 f"{v['rel_err']:.1e}{'' if v['ok'] else ' FAIL'}" for n, v in layer["checks"].items()))
        ok &= layer["checks_ok"]
        hdr = (f"{'T/rank':>6} {'EP-a2a':>8} {'EP-fix(g)':>9} {'TP(g)':>8} {'TP-eag':>8} {'disp-a2a':>8} "
               f"{'disp-fix':>8} "
               f"{'pred-d+c':>8} {'TP-AR':>7} {'pred-AR':>7} {'EPfloor':>7} {'TPfloor':>7}")
        lines.append(hdr + "   (us per MoE layer, max over ranks)")
        for r in layer["rows"]:
            pr = plan_rows.get(r["tokens_per_rank"], {})
            lines.append(f"{r['tokens_per_rank']:6d} {r['ep_all_to_all_us']:8.1f} {r['ep_fixed_us']:9.1f} "
                         f"{r['tp_us']:8.1f} "
                         f"{r['tp_eager_us']:8.1f} {r['disp_all_to_all_us']:8.1f} {r['disp_fixed_us']:8.1f} "
                         f"{_fmt(pr.get('ep_pred_dispatch_combine_us')):>8} {r['tp_all_reduce_us']:7.1f} "
                         f"{_fmt(pr.get('tp_pred_all_reduce_us')):>7} {r['expert_floor_us']:7.1f} "
                         f"{r['tp_expert_floor_us']:7.1f}")
        drows = layer.get("dispatch_rows") or []
        if drows:
            peak = None
            if calib and calib.get("profile"):
                peak = calib["profile"]["intra_node"]["all_to_all_busbw_bytes_per_s"] / 1e9
            lines.append(f"dispatch+combine alone: GB/s to other ranks (ratio to NCCL all-to-all bus bw {_fmt(peak)} "
                         "GB/s "
                         f"at 256 MiB; same-size NCCL in brackets)")
            for r in drows:
                def pct(name: str) -> str:
                    bw = r[f"disp_{name}_busbw_gbs"]
                    same = r.get(f"disp_{name}_nccl_same_size_busbw_gbs")
                    return (f"{bw:7.1f}" + (f" {bw / peak:5.0%}" if peak else "") +
                            (f" [{same:.1f}]" if same else ""))
                lines.append(f"  T {r['tokens_per_rank']:5d}: a2a {r['disp_all_to_all_us']:8.1f} us "
                             f"{pct('all_to_all')}; "
                             f"fixed {r['disp_fixed_us']:8.1f} us {pct('fixed')}")
            if g > 1 and a2a_lat and layer["rows"]:
                first = layer["rows"][0]
                lat = [f"{a2a_lat:.1f} us (calibrate)"]
                sm = (calib or {}).get("small_message_events")
                if sm:
                    lat.append(f"{sm[min(sm, key=int)]['all_to_all_graph_us']:.1f} us (graph replay)")
                lines.append(f"  latency at T={first['tokens_per_rank']}: fixed "
                             f"dispatch+combine{' (graph)' if first['disp_fixed_graphed'] else ''} "
                             f"{first['disp_fixed_us']:.1f} us = {first['disp_fixed_us'] / a2a_lat:.2f}x NCCL's small "
                             f"all-to-all {' / '.join(lat)}; target <= 2x")
            if peak and drows:
                last = drows[-1]
                lines.append(f"  bandwidth at T={last['tokens_per_rank']}: fixed "
                             f"{last['disp_fixed_busbw_gbs'] / peak:.0%}, "
                             f"a2a {last['disp_all_to_all_busbw_gbs'] / peak:.0%} of NCCL all-to-all bus bw (target >= "
                             "80%)")
    pl = doc.get("plan")
    if pl and plan_rows:
        rr = [r for r in pl["rows"] if r.get("ep_disp_fixed_meas_over_pred")]
        if rr:
            lines.append(f"plan ({pl['hardware']}): measured/predicted dispatch+combine "
                         + " ".join(f"T{r['tokens_per_rank']}:{r['ep_disp_fixed_meas_over_pred']:.2f}" for r in rr)
                         + "; all-reduce " + " ".join(
                             f"T{r['tokens_per_rank']}:{_fmt(r.get('tp_all_reduce_meas_over_pred'), '.2f')}"
                             for r in rr)
                         + f" (target 0.75-1.25; dispatch_layout_fixed_us {pl['dispatch_layout_fixed_us']:.1f}, "
                         f"best fit {_fmt(pl.get('fit_dispatch_layout_fixed_us'))})")
    run = doc.get("run")
    if run:
        lines.append(f"run ({run['checkpoint']['family']}, {run['checkpoint']['layers']} layers, EP {g}): matches "
                     "reference "
                     f"{run['matches_reference']}, logits rel err {_fmt(run['max_logits_rel_err'], '.1e')}, "
                     f"{run['tokens_per_s']:.1f} tok/s, collectives/step {run['collectives_per_step']}")
        ok &= bool(run["matches_reference"])
    return "\n".join(lines), ok


# ---------------------------------------------------------------------------------------------- main


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT") or "multigpu-out",
                   help="output directory (default $OUT, else ./multigpu-out)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cuda (NCCL) or cpu (gloo)")
    p.add_argument("--small", action="store_true", help="tiny sizes everywhere (checking the script)")
    p.add_argument("--experts", type=int, choices=sorted(LAYER_MODELS), default=256,
                   help="256 = DeepSeek-V3 layer, 384 = Kimi-K2.5 layer (default 256)")
    p.add_argument("--tokens", type=_ints, help="tokens per rank of the layer sweep (default 1,2,4,...,256)")
    p.add_argument("--dispatch-tokens", type=_ints, help="tokens per rank of the dispatch-alone sweep")
    p.add_argument("--check-tokens", type=int, default=4, help="tokens per rank of the correctness check")
    p.add_argument("--iters", type=int, default=20, help="timed calls per measurement (graphs: twice as many)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--calib-iters", type=int, default=10, help="timed calls per calibration size")
    p.add_argument("--max-bytes", type=int, help="largest calibration buffer (default 256 MiB GPU, 4 MiB CPU)")
    p.add_argument("--run-layers", type=int, default=4, help="decoder layers of the Qwen3-30B-A3B run model")
    p.add_argument("--run-new-tokens", type=int, default=8, help="--max-new-tokens of epmoe run")
    p.add_argument("--run-timeout", type=int, default=900, help="seconds for the epmoe run child job")
    p.add_argument("--timeout", type=int, default=900, help="seconds before a stuck collective fails")
    p.add_argument("--skip", type=lambda s: [v for v in s.split(",") if v], default=[],
                   help=f"parts to skip, comma-separated: {','.join(PARTS)}")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--replan", metavar="JSON", help="only part 4, on a saved multigpu.json (no GPU, no torchrun)")
    args = p.parse_args(argv)
    unknown = [s for s in args.skip if s not in PARTS]
    if unknown:
        p.error(f"--skip: unknown parts {unknown}; parts: {PARTS}")
    if args.tokens is None:
        args.tokens = [1, 2, 8] if args.small else [1, 2, 4, 8, 16, 32, 64, 128, 256]
    if args.dispatch_tokens is None:
        args.dispatch_tokens = [1, 64, 512] if args.small else [1, 16, 256, 1024, 4096]
    return args


def _nccl_version() -> str:
    v = torch.cuda.nccl.version()
    return ".".join(map(str, v)) if isinstance(v, (tuple, list)) else str(v)


def replan(args: argparse.Namespace) -> int:
    """Part 4 again on a saved ``multigpu.json`` (no GPU, no torchrun): the planner's current model priced on
    that run's calibration, beside that run's measurements. Writes ``--out``/``multigpu.json`` and
    ``profile.json``; prints the summary."""
    src = Path(args.replan)
    try:
        doc = json.loads(src.read_text())
        calib, world, gpu = doc["calibrate"], int(doc["world_size"]), doc["gpus"][0]
        rows, facts = calib["rows"], calib["device_facts"]
        if not rows or world < 1:
            raise ValueError("no calibration rows" if not rows else f"world_size {world}")
        for r in rows:
            float(r["bytes"]), float(r["all_reduce_ms"]), float(r["all_to_all_ms"])
        float(facts["memory_bytes"]), float(facts["hbm_bytes_per_s"]), float(facts["bf16_flops_per_s"])
    except (OSError, ValueError, KeyError, TypeError, IndexError) as err:
        print(f"--replan {src}: not a multigpu.json with calibration rows ({type(err).__name__}: {err})",
              file=sys.stderr)
        return 2
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        print(f"--out {out}: exists and is not a directory", file=sys.stderr)
        return 2
    if (out / "multigpu.json").resolve() == src.resolve():
        print(f"--out {out}: would overwrite the --replan source {src}; give another directory", file=sys.stderr)
        return 2
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        print(f"--out {out}: cannot be created ({err.strerror or err})", file=sys.stderr)
        return 2
    run_args = parse_args(doc.get("argv") or [])
    run_args.tokens = doc.get("tokens") or run_args.tokens
    ctx = Ctx(args=run_args, rank=0, world=world, local_rank=0, device=torch.device(doc.get("device", "cpu")),
              side=None, out=out, doc=doc)
    calib["profile_path"] = None  # the saved run's own path is on its machine; part 4 reads the one written here
    if world >= 2:
        path = out / "profile.json"
        cfg = CalibrationConfig(out=str(path), name=f"calibrated-{world}x-{'gpu' if ctx.cuda else 'cpu'}",
                                base="h200-sxm" if ctx.cuda else None, iters=run_args.calib_iters)
        profile = build_profile(rows, facts, world, 1, "nccl" if ctx.cuda else "gloo", gpu, cfg)
        path.write_text(json.dumps(profile, indent=2))
        calib["profile_path"] = str(path)
    doc["plan"] = part_plan(ctx)
    doc["replanned_from"] = str(src)
    text, ok = summary(ctx)
    doc["summary"] = text
    write_doc(ctx)
    print(text + f"\nreplanned from {src}; JSON in {out / 'multigpu.json'}", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.replan is not None:
        return replan(args)
    if not all(v in os.environ for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        print("multigpu.py runs under torchrun: torchrun --standalone --nproc-per-node G benchmarks/multigpu.py ...",
              file=sys.stderr)
        return 2
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if args.device == "cuda":
        if not torch.cuda.is_available():
            print("--device cuda: CUDA is not available (use --device cpu)", file=sys.stderr)
            return 2
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = False
        dist.init_process_group("nccl", timeout=timedelta(seconds=args.timeout), device_id=device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))
    side = dist.new_group(backend="gloo", timeout=timedelta(seconds=args.timeout + args.run_timeout))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ctx = Ctx(args=args, rank=rank, world=world, local_rank=local_rank, device=device, side=side, out=out)
    ctx.doc = {
        "script": "benchmarks/multigpu.py", "argv": sys.argv[1:], "world_size": world, "device": device.type,
        "gpus": gather(ctx, torch.cuda.get_device_name(device) if ctx.cuda else "cpu"),
        "torch": torch.__version__, "nccl": _nccl_version() if ctx.cuda else None,
        "small": args.small, "tokens": args.tokens, "dispatch_tokens": args.dispatch_tokens, "parts": {},
    }
    ctx.log(f"{world} rank(s) on {device.type} ({ctx.doc['gpus'][0]}), out {out}")
    run_part(ctx, "calibrate", part_calibrate)
    run_part(ctx, "layer", part_layer)
    run_part(ctx, "run", part_run)
    run_part(ctx, "plan", part_plan)
    ok = True
    if rank == 0:
        text, ok = summary(ctx)
        ctx.doc["summary"] = text
        ctx.doc["ok"] = ok
        write_doc(ctx)
        print("\n" + text + f"\nresult: {'OK' if ok else 'NOT OK'}; JSON in {out / 'multigpu.json'}", flush=True)
    ok = bool(gather(ctx, ok)[0])
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
