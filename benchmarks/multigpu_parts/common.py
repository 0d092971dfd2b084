"""What every part shares: the run's constants, ``Ctx`` (this rank and its arguments), reductions over the
side group, timing over ranks (eager and as CUDA-graph replays) and the part runner that records failures."""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from epmoe.files import atomic_path
from timing import capture

REPO = Path(__file__).resolve().parents[2]
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
    with atomic_path(ctx.out / "multigpu.json") as tmp:
        tmp.write_text(json.dumps(ctx.doc, indent=1, default=str))


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
