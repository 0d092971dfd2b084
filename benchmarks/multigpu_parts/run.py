"""Part 3, ``run``: ``epmoe run --device cuda --ep G`` on a Qwen3-30B-A3B checkpoint with random weights."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .common import CONFIGS, TORCHRUN_ENV, Ctx, free_memory


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
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_ENV}  # the child runs the same epmoe
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
        "graphs": rep["graphs"], "tokens_per_s": rep["tokens_per_s"],
        "balancedness": rep["balancedness"], "collectives_per_step": r0["collectives"],
        "bytes_per_step": r0["bytes_per_step"], "peak_cuda_mb": [r["peak_cuda_mb"] for r in rep["ranks"]],
        "peak_rss_mb": [r["peak_rss_mb"] for r in rep["ranks"]], "expert_mb": [r["expert_mb"] for r in rep["ranks"]],
        "full_expert_mb": r0["full_expert_mb"], "model_type": rep["model_type"],
    }
