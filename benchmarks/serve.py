"""``epmoe serve`` under ``epmoe bench serve`` on one GPU, against the offline engine on the same work.

    python benchmarks/serve.py [--model-config qwen3-30b-a3b] [--out DIR]
    python benchmarks/serve.py --device cpu   # the script's smoke test: the built-in small checkpoint on CPU

Starts ``epmoe serve --load-format dummy`` (full-size model from ``data/configs``, bf16, CUDA graphs),
benchmarks it at concurrency 1 and 64 (random 128-token prompts, 64 output tokens), stops it (SIGTERM:
it drains and exits 0), then runs the same requests through ``Engine.generate`` offline: the server's
TPOT at concurrency 1 against the offline TPOT, and its output throughput at concurrency 64 against the
offline one (targets: within 1.2x, within 10%), with the TTFT p99 at concurrency 64. Writes
``serve_<gpu>.json`` (``serve_cpu.json``) and prints a table last.

Around each measured run it scrapes the server's ``/metrics`` and reports what the engine core did in it
(``core`` in the JSON): engine steps by kind, the core's busy seconds (inside rounds that stepped) against
the run's wall duration, its idle seconds, tokens fed per step and the mean round time. Busy near the
duration: the engine is the bottleneck; well below it: the core waits on the HTTP side. The idle seconds
also hold the core's wait for the run's first request (at most the server's idle round, 1 s).
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
from prometheus_client.parser import text_string_to_metric_families

from epmoe.engine import Engine, EngineConfig, SamplingParams
from epmoe.models.tiny import ensure_default_checkpoint
from epmoe.runtime.launch import free_port
from epmoe.server.bench import BenchConfig, run_bench
from epmoe.server.ranks import STEP_KINDS
from timing import gpu_file_name

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


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the server's ``/metrics``: ``(name, sorted labels) -> value``."""
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def core_deltas(before: dict, after: dict, duration_s: float) -> dict:
    """What the engine core did between two scrapes, against the run's wall duration (seconds)."""
    def delta(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    kinds = {kind: int(delta("epmoe:engine_steps_total", kind=kind)) for kind in STEP_KINDS}
    busy, idle = delta("epmoe:engine_core_busy_seconds_total"), delta("epmoe:engine_core_idle_seconds_total")
    fed_steps = delta("epmoe:iteration_tokens_total_count")
    rounds = delta("epmoe:engine_round_seconds_count")
    return {"engine_steps": kinds["graph"] + kinds["eager"] + kinds["idle"], "steps_by_kind": kinds,
            "busy_s": busy, "idle_s": idle, "bench_duration_s": duration_s,
            "busy_fraction_of_bench": busy / duration_s,
            "tokens_per_step": delta("epmoe:iteration_tokens_total_sum") / fed_steps if fed_steps else 0.0,
            "stepping_rounds": int(rounds),
            "round_ms_mean": delta("epmoe:engine_round_seconds_sum") * 1e3 / rounds if rounds else 0.0}


def core_line(conc: int, c: dict) -> str:
    k = c["steps_by_kind"]
    return (f"core c={conc}: busy {c['busy_s']:.2f} s of the run's {c['bench_duration_s']:.2f} s "
            f"({c['busy_fraction_of_bench']:.2f}), idle {c['idle_s']:.2f} s; {c['engine_steps']} steps (graph "
            f"{k['graph']}, of them with prompt tokens {k['graph_prefill']}; eager {k['eager']}; idle {k['idle']}), "
            f"{c['tokens_per_step']:.1f} tokens/step, round {c['round_ms_mean']:.2f} ms")


def offline(engine_config: dict, n: int, conc: int, in_len: int, out_len: int) -> dict:
    """``n`` random requests, at most ``conc`` at once, through the engine: output tokens/s and TPOT."""
    engine = Engine(EngineConfig(**engine_config, max_num_seqs=conc, cuda_graph_max_bs=conc))
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, engine.vocab_size, (in_len,), generator=gen).tolist() for _ in range(n)]
    params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    engine.generate(prompts[:conc], params)  # warm-up
    sync()
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params)
    sync()
    dt = time.perf_counter() - t0
    tokens = sum(len(o.token_ids) for o in outs)
    del engine
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {"output_throughput": tokens / dt, "duration_s": dt, "tpot_ms": dt * 1e3 / (tokens / conc)}


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM to the server alone (it drains and stops its ranks); its whole session killed if it hangs."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-config", default="qwen3-30b-a3b", help="config of data/configs (CUDA)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cpu: the built-in small checkpoint, float32, shorter requests (a smoke test)")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    if Path(args.out).exists() and not Path(args.out).is_dir():
        ap.error(f"--out {args.out!r} is a file; it names the folder the results are written to")
    if args.device == "cpu" and args.model_config != ap.get_default("model_config"):
        ap.error(f"--model-config {args.model_config!r} is for --device cuda; on CPU the built-in small checkpoint "
                 f"runs and the flag would be ignored")
    if args.device == "cuda" and not (CONFIGS / f"{args.model_config}.config.json").is_file():
        known = ", ".join(sorted(p.name.removesuffix(".config.json") for p in CONFIGS.glob("*.config.json")))
        ap.error(f"--model-config {args.model_config!r} is not in {CONFIGS}; known: {known}")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda (the default): no CUDA device here; on CPU the built-in small checkpoint runs: "
                 "--device cpu")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.device == "cuda":
        d = Path(tempfile.mkdtemp()) / args.model_config
        d.mkdir()
        (d / "config.json").write_text((CONFIGS / f"{args.model_config}.config.json").read_text())
        engine_config = dict(model=str(d), dtype="bfloat16", device="cuda", expert_backend="triton",
                             load_format="dummy", max_model_len=4096)
        flags = ["--device", "cuda", "--dtype", "bfloat16", "--load-format", "dummy", "--max-model-len", "4096"]
        in_len, out_len, runs, gpu = IN_LEN, OUT_LEN, ((1, 8), (64, 256)), torch.cuda.get_device_name()
    else:
        d = ensure_default_checkpoint()
        engine_config = dict(model=str(d))
        flags = []
        in_len, out_len, runs, gpu = 16, 16, ((1, 4), (64, 128)), "cpu"
    # no prefix caching on either side: the warm-ups send the measured runs' first prompts, which would then come
    # from the cache (random prompts share nothing otherwise)
    engine_config["enable_prefix_caching"] = False
    flags.append("--no-enable-prefix-caching")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "epmoe.cli", "serve", "--model", str(d), "--ep", "1", *flags, "--max-num-seqs", "64",
           "--cuda-graph-max-bs", "64", "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    result = {"gpu": gpu, "command": " ".join(cmd[1:]), "input_len": in_len, "output_len": out_len, "server": {}}
    try:
        wait_ready(url, proc)
        for conc, n in runs:
            # warm-up with as many requests as the measured run keeps open, as the offline engine's warm-up
            # does: the batched prefill and decode shapes are compiled before either is timed
            run_bench(BenchConfig(base_url=url, num_prompts=conc, input_len=in_len, output_len=8,
                                  max_concurrency=conc), progress=False)
            before = scrape(url)
            rep = run_bench(BenchConfig(base_url=url, num_prompts=n, input_len=in_len, output_len=out_len,
                                        max_concurrency=conc), progress=False)
            result["server"][conc] = dict(rep.to_json(), core=core_deltas(before, scrape(url), rep.duration_s))
            print(f"serve c={conc}: {rep.output_throughput:.0f} tok/s, TPOT p50 {rep.tpot_ms['p50']:.2f} ms, "
                  f"TTFT p50 {rep.ttft_ms['p50']:.1f} p99 {rep.ttft_ms['p99']:.1f} ms, failed {rep.failed}", flush=True)
    finally:
        stop_server(proc)
        (out / "serve.log").write_text(proc.stdout.read() if proc.stdout else "")
    result["server_exit_code"] = proc.returncode
    result["offline"] = {conc: offline(engine_config, n, conc, in_len, out_len) for conc, n in runs}
    name = gpu_file_name(gpu)
    (out / f"serve_{name}.json").write_text(json.dumps(result, indent=2, default=str))
    (c1, _), (cn, _) = runs
    s1, o1 = result["server"][c1], result["offline"][c1]
    sn, on = result["server"][cn], result["offline"][cn]
    print(f"\nconcurrency {c1}: server TPOT p50 {s1['tpot_ms']['p50']:.2f} ms (mean {s1['tpot_ms']['mean']:.2f}), "
          f"offline {o1['tpot_ms']:.2f} ms, ratio {s1['tpot_ms']['mean'] / o1['tpot_ms']:.2f} (target <= 1.2)")
    print(f"concurrency {cn}: server {sn['output_throughput']:.0f} output tok/s, "
          f"offline {on['output_throughput']:.0f}, ratio {sn['output_throughput'] / on['output_throughput']:.2f} "
          f"(target >= 0.9); TTFT p50 {sn['ttft_ms']['p50']:.1f} ms, p99 {sn['ttft_ms']['p99']:.1f} ms; "
          f"failed {s1['failed'] + sn['failed']}; server exit code {result['server_exit_code']}")
    for conc, _ in runs:
        print(core_line(conc, result["server"][conc]["core"]))


if __name__ == "__main__":
    main()
