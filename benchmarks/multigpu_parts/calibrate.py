"""Part 1, ``calibrate``: collectives over the group and the profile ``plan`` reads."""

from __future__ import annotations

import json
import os
from typing import Any

import torch
import torch.distributed as dist

from epmoe.runtime.calibrate import CalibrationConfig, build_profile, measure_collectives, measure_device, message_sizes

from .common import Ctx, time_graph_us, time_us


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
