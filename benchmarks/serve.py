"""``epmoe serve`` under ``epmoe bench serve`` on one GPU, against the offline engine on the same work.

    python benchmarks/serve.py [--model-config qwen3-30b-a3b] [--out DIR]

Starts ``epmoe serve --load-format dummy`` (full-size model from ``data/configs``, bf16, CUDA graphs),
benchmarks it at concurrency 1 and 64 (random 128-token prompts, 64 output tokens), stops it, then runs
the same requests through ``Engine.generate`` offline: the server's TPOT at concurrency 1 against the
offline TPOT, and its output throughput at concurrency 64 against the offline one. Writes
``serve_<gpu>.json`` and prints a table last.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import torch

from epmoe.engine import Engine, EngineConfig, SamplingParams
from epmoe.runtime.launch import free_port
from epmoe.server.bench import BenchConfig, run_bench

CONFIGS = Path(__file__).resolve().parents[1] / "data" / "configs"
IN_LEN, OUT_LEN = 128, 64


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float = 300.0) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"epmoe serve exited with {proc.returncode}")
        try:
            if urllib.request.urlopen(url + "/health", timeout=2).status == 200:
                return
        except OSError:
            pass
        time.sleep(1)
    raise RuntimeError(f"epmoe serve not ready after {timeout_s} s")


def offline(d: Path, n: int, conc: int) -> dict:
    """``n`` random requests, at most ``conc`` at once, through the engine: output tokens/s and TPOT."""
    engine = Engine(EngineConfig(model=str(d), dtype="bfloat16", device="cuda", expert_backend="triton",
                                 load_format="dummy", max_num_seqs=conc, cuda_graph_max_bs=conc, max_model_len=4096))
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, engine.vocab_size, (IN_LEN,), generator=gen).tolist() for _ in range(n)]
    params = SamplingParams(temperature=0, max_tokens=OUT_LEN, ignore_eos=True)
    engine.generate(prompts[:conc], params)  # warm-up
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    tokens = sum(len(o.token_ids) for o in outs)
    del engine
    torch.cuda.empty_cache()
    return {"output_throughput": tokens / dt, "duration_s": dt, "tpot_ms": dt * 1e3 / (tokens / conc)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-config", default="qwen3-30b-a3b")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    d = Path(tempfile.mkdtemp()) / args.model_config
    d.mkdir()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text((CONFIGS / f"{args.model_config}.config.json").read_text())
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "epmoe.cli", "serve", "--model", str(d), "--ep", "1", "--device", "cuda",
           "--dtype", "bfloat16", "--load-format", "dummy", "--max-num-seqs", "64", "--cuda-graph-max-bs", "64",
           "--max-model-len", "4096", "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    result = {"gpu": torch.cuda.get_device_name(), "command": " ".join(cmd[1:]), "server": {}}
    try:
        wait_ready(url, proc)
        for conc, n in ((1, 8), (64, 256)):
            run_bench(BenchConfig(base_url=url, num_prompts=4, input_len=IN_LEN, output_len=8,
                                  max_concurrency=conc), progress=False)  # warm-up
            rep = run_bench(BenchConfig(base_url=url, num_prompts=n, input_len=IN_LEN, output_len=OUT_LEN,
                                        max_concurrency=conc), progress=False)
            result["server"][conc] = rep.to_json()
            print(f"serve c={conc}: {rep.output_throughput:.0f} tok/s, TPOT p50 {rep.tpot_ms['p50']:.2f} ms, "
                  f"TTFT p50 {rep.ttft_ms['p50']:.1f} p99 {rep.ttft_ms['p99']:.1f} ms, failed {rep.failed}", flush=True)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        (Path(args.out) / "serve.log").write_text(proc.stdout.read() if proc.stdout else "")
    result["server_exit_code"] = proc.returncode
    result["offline"] = {1: offline(d, 8, 1), 64: offline(d, 256, 64)}
    out = Path(args.out)
    gpu = torch.cuda.get_device_name().split()[-1].lower()
    (out / f"serve_{gpu}.json").write_text(json.dumps(result, indent=2, default=str))
    s1, o1 = result["server"][1], result["offline"][1]
    s64, o64 = result["server"][64], result["offline"][64]
    print(f"\nconcurrency 1: server TPOT p50 {s1['tpot_ms']['p50']:.2f} ms (mean {s1['tpot_ms']['mean']:.2f}), "
          f"offline {o1['tpot_ms']:.2f} ms, ratio {s1['tpot_ms']['mean'] / o1['tpot_ms']:.2f}")
    print(f"concurrency 64: server {s64['output_throughput']:.0f} output tok/s, "
          f"offline {o64['output_throughput']:.0f}, "
          f"ratio {s64['output_throughput'] / o64['output_throughput']:.2f}; TTFT p99 {s64['ttft_ms']['p99']:.1f} ms; "
          f"failed {s1['failed'] + s64['failed']}; server exit code {result['server_exit_code']}")


if __name__ == "__main__":
    main()
