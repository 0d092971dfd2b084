"""The deployment on one multi-GPU machine: Kimi-K2.5 through the engine, EP against TP, plain and speculative decoding.

``--parallel ep`` against ``--parallel tp``, each with plain and speculative decoding, the planner beside every row,
then ``epmoe serve`` under ``epmoe bench serve``.

On 8 H200s (``nvidia-h200-x8``; one spawned rank per GPU, NCCL)::

    PYTHONPATH=src python benchmarks/deployment.py --gpus 8 --out $OUT

(24 of Kimi-K2.5's 61 layers with bf16 experts; ``--expert-format int4`` keeps the config's INT4 routed experts, a
quarter of the bytes, so more layers fit). On 4 H200s (``nvidia-h200-x4``), the model cut to what fits (13 layers
in bf16, 40 in INT4)::

    PYTHONPATH=src python benchmarks/deployment.py --gpus 4 --out $OUT

``--layers 0`` (the default) picks the layer count from the planner's memory model; give a number to fix it.

On CPU with gloo (the script's check: the built-in small Kimi checkpoint of ``epmoe.models.tiny``, 2 ranks, few
tokens)::

    PYTHONPATH=src python benchmarks/deployment.py --device cpu --out DIR

The model is ``data/configs/kimi-k2.5.config.json`` at full width with dummy weights (``--load-format dummy``),
cut to ``--layers`` decoder layers (0 = as many as the planner's memory estimate fits beside the KV cache at the
largest concurrency; the table says how many). ``--expert-format bf16`` drops the config's
``quantization_config`` (bf16 routed experts); ``int4`` keeps it (INT4 pack-quantized routed experts, as the
checkpoint says, served by the engine's INT4 kernels).

Ranks are spawned by ``epmoe.runtime.launch.spawn`` (gloo on CPU, NCCL on CUDA). For each of ``--parallel ep``
(attention data-parallel, experts EP over all ranks, fixed-capacity dispatch in the decode CUDA graphs) and
``--parallel tp`` (attention data-parallel, every expert sliced over the ranks), one engine per decoding mode:

- ``plain``, ``ngram`` (on repetitive prompts) and ``eagle3`` (``--eagle3-config``, random head weights), with
  ``--spec-k`` (3) speculative tokens; every mode serves the same repetitive prompts, request ``i`` on rank
  ``i mod G`` (``G`` ranks; ranks without a request run padded empty steps so the collectives line up).
- First a greedy check: ``--check-tokens`` tokens of ``G`` prompts generated; their tokens must be the same under
  ep and tp and with or without speculation (greedy speculation is lossless).
- Then per concurrency ``C`` in ``--concurrency`` (1, 16, 64 requests over the whole machine): ``--steps``
  engine steps timed once every request decodes (wall clock, host work included, max over ranks): the step
  time (TPOT for plain decoding), output tokens/s over all ranks, tokens/s per stream, the model forward alone
  (median; the verify step under speculation), the mean accepted length (tokens per request per verify step);
  then ``--profile-steps`` steps under ``torch.profiler``: the collectives a step issues (NCCL kernels on CUDA,
  gloo calls on CPU; count and ms per step, max over ranks); peak memory per rank (CUDA allocator, or the
  process's RSS on CPU).
- ``epmoe plan`` for the same model, GPUs and batches (the shipped ``h200-sxm`` profile, ``weights`` as the
  expert format) beside every row, ratio measured / planned. Plain rows: the step's ``total_ms``. Speculative
  rows: the verify step's ``total_ms`` (``price_speculation``) against the measured forward, and the planned
  tokens/s per stream at the measured accepted length (eagle3: the round with the draft forwards; ngram: the
  verify step alone). ``ep`` rows are priced as ``EP{G}+DPattn``; ``tp`` rows as ``TP{G}``, the planner's
  nearest strategy (it has no data-parallel-attention + tensor-parallel-experts strategy: its TP slices
  attention too).

After the ranks exit, ``epmoe serve --parallel ep --ep G`` (same model and expert format) under
``epmoe bench serve`` at ``--serve-concurrency`` (16): TTFT and TPOT percentiles, output throughput, failures.

Writes ``deployment.json`` under ``--out`` (``$OUT`` by default) and prints the table last. A machine call is
limited to 10 minutes: where the whole script does not fit one, split it over calls with ``--parallel ep``,
``--parallel tp`` (each with ``--skip-serve``) and ``--skip-engine`` (the server alone); ``--modes plain,ngram``
drops a decoding mode.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Keep NVLink multicast off on the lent machines (KINDS.md); respected if already set.
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")

import torch  # noqa: E402 - after the NCCL environment above
import torch.distributed as dist  # noqa: E402

from engine import CONFIGS, SPEC_PROMPTS, batch_losses, checkpoint, decode_room, prefilling  # noqa: E402
from epmoe.comm import Comm  # noqa: E402
from epmoe.engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from epmoe.runtime.launch import RankInfo, free_port, init_group, spawn  # noqa: E402
from epmoe.server.bench import BenchConfig, run_bench  # noqa: E402
from epmoe.spec import load_moe_spec  # noqa: E402
from serve import stop_server, wait_ready  # noqa: E402

MODES = ("plain", "ngram", "eagle3")
PARALLEL = ("ep", "tp")
KIMI_LAYERS = 61
# share of a GPU the planner may fill when --layers 0 picks the layer count: below the engine's mem_fraction_static
# (0.9), leaving room for the EAGLE-3 head, the graphs' pools and the allocator's slack
FIT_FRACTION = 0.8
# torch.profiler event names of one collective: NCCL kernels (CUDA) and gloo's record functions (CPU)
COLLECTIVE_NAMES = {"allreduce": "all_reduce", "all_reduce": "all_reduce", "allgather": "all_gather",
                    "all_gather": "all_gather", "alltoall": "all_to_all", "all_to_all": "all_to_all",
                    "sendrecv": "all_to_all"}


MAX_SPEC_K = 16
"""The engine's largest ``speculative_num_tokens`` (``EngineConfig``)."""

PROMPT_ROOM = 128
"""Context tokens ``parse_args`` leaves for a window's prompt (96 tokens on CUDA, ``prompts``) and for the tokens
decoded while the others are prefilled."""


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",")]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cuda (NCCL) or cpu (gloo, small model)")
    p.add_argument("--gpus", type=int, default=None, help="ranks to spawn (default: every GPU; 2 on CPU)")
    p.add_argument("--layers", type=int, default=0, help="Kimi-K2.5 decoder layers (0: as many as fit)")
    p.add_argument("--expert-format", choices=("bf16", "int4"), default="bf16",
                   help="routed experts: bf16 dummy weights, or INT4 as the config says")
    p.add_argument("--concurrency", default=None, help="concurrent requests over the machine (default 1,16,64; "
                                                       "1,4 on CPU)")
    p.add_argument("--steps", type=int, default=None, help="engine steps timed per row (default 32; 4 on CPU)")
    p.add_argument("--profile-steps", type=int, default=None, help="steps profiled for the collectives (default 4; "
                                                                   "2 on CPU)")
    p.add_argument("--check-tokens", type=int, default=None, help="greedy tokens compared across ep/tp and modes "
                                                                  "(default 16; 6 on CPU)")
    p.add_argument("--spec-k", type=int, default=3, help="speculative tokens per verify step")
    p.add_argument("--modes", default=",".join(MODES), help="decoding modes (plain first)")
    p.add_argument("--parallel", default=",".join(PARALLEL), help="parallel modes to measure")
    p.add_argument("--eagle3-config", default=str(CONFIGS / "eagle3-draft-kimi-k2-instruct-aq-medai.config.json"))
    p.add_argument("--max-model-len", type=int, default=2048,
                   help="the engines' context limit on CUDA (on CPU the small model's own)")
    p.add_argument("--serve-concurrency", type=int, default=16)
    p.add_argument("--serve-prompts", type=int, default=None, help="requests sent to the server (default 4x the "
                                                                   "concurrency)")
    p.add_argument("--skip-serve", action="store_true", help="no epmoe serve part")
    p.add_argument("--skip-engine", action="store_true", help="only the epmoe serve part (a machine call of its own)")
    p.add_argument("--out", default=os.environ.get("OUT") or "deployment-out")
    a = p.parse_args(argv)
    cpu = a.device == "cpu"
    # a value given is checked, never replaced by the default (0 was taken as "not given")
    for flag in ("gpus", "steps", "profile_steps", "check_tokens", "spec_k", "max_model_len", "serve_concurrency",
                 "serve_prompts"):
        if getattr(a, flag) is not None and getattr(a, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(a, flag)}")
    if a.layers < 0:
        p.error(f"--layers must be at least 0 (0: as many as fit), got {a.layers}")
    if not Path(a.eagle3_config).is_file():
        p.error(f"--eagle3-config {a.eagle3_config!r} is not a file")
    if a.spec_k > MAX_SPEC_K:
        p.error(f"--spec-k must be at most {MAX_SPEC_K} (the engine's speculative_num_tokens), got {a.spec_k}")
    if a.skip_serve and a.skip_engine:
        p.error("--skip-serve and --skip-engine together leave nothing to run")
    if a.concurrency is not None:
        try:
            values = _ints(a.concurrency)
        except ValueError:
            values = []
        if not values or min(values) < 1:
            p.error(f"--concurrency must be comma-separated integers >= 1, got {a.concurrency!r}")
        if len(set(values)) != len(values):
            p.error(f"--concurrency repeats a value, got {a.concurrency!r}")
    a.gpus = a.gpus if a.gpus is not None else (2 if cpu else torch.cuda.device_count())
    a.concurrency = _ints(a.concurrency or ("1,4" if cpu else "1,16,64"))
    a.steps = a.steps if a.steps is not None else (4 if cpu else 32)
    a.profile_steps = a.profile_steps if a.profile_steps is not None else (2 if cpu else 4)
    a.check_tokens = a.check_tokens if a.check_tokens is not None else (6 if cpu else 16)
    modes, parallel = a.modes, a.parallel
    a.modes = [m for m in modes.split(",") if m]
    a.parallel = [m for m in parallel.split(",") if m]
    if not a.modes or a.modes[0] != "plain" or any(m not in MODES for m in a.modes) or len(set(a.modes)) != len(
            a.modes):
        p.error(f"--modes must start with plain and name each of {MODES} at most once, got {modes!r}")
    if not a.parallel or any(m not in PARALLEL for m in a.parallel) or len(set(a.parallel)) != len(a.parallel):
        p.error(f"--parallel must name each of {PARALLEL} at most once (at least one), got {parallel!r}")
    if not cpu and not torch.cuda.is_available():
        p.error("--device cuda (the default): no CUDA device here; use --device cpu without one")
    if a.gpus < 1:
        p.error(f"--gpus: no GPU found (got {a.gpus}); use --device cpu without one")
    if cpu and a.expert_format != "bf16":
        p.error(f"--expert-format {a.expert_format}: the CPU run uses the built-in small checkpoint, whose routed "
                f"experts are bf16; INT4 experts are timed with --device cuda")
    experts = routed_experts(cpu)
    if experts % a.gpus:
        p.error(f"--gpus {a.gpus}: the model's {experts} routed experts do not divide evenly among {a.gpus} ranks "
                f"(expert and tensor parallelism place the same number on each)")
    if not cpu and a.gpus > torch.cuda.device_count():
        p.error(f"--gpus {a.gpus}: this machine has {torch.cuda.device_count()} GPU(s)")
    # a window's requests decode from a prompt of up to 96 tokens through the warm-up, timed and profiled steps
    tokens = (a.spec_k + 1) * (a.steps + a.profile_steps + 3) + PROMPT_ROOM
    if not cpu and tokens > a.max_model_len:
        p.error(f"--steps {a.steps} and --profile-steps {a.profile_steps} (with --spec-k {a.spec_k}: up to {tokens} "
                f"tokens of context a request, a {PROMPT_ROOM}-token allowance for the prompt included) do not fit "
                f"--max-model-len {a.max_model_len}")
    return a


# ---- the model ---------------------------------------------------------------------------------------------------


def routed_experts(cpu: bool) -> int:
    """Routed experts of the model the run serves: the built-in small checkpoint on CPU, Kimi-K2.5 on CUDA."""
    if cpu:
        from epmoe.models.tiny import ensure_default_checkpoint

        return load_moe_spec(str(ensure_default_checkpoint())).num_experts
    return load_moe_spec(str(CONFIGS / "kimi-k2.5.config.json")).num_experts


def fitting_layers(args: argparse.Namespace, root: Path) -> int:
    """Most Kimi-K2.5 decoder layers whose planned memory per GPU (weights, KV cache at the largest concurrency and
    ``--max-model-len``, buffers) fits the planner's capacity under both strategies."""
    from epmoe.plan.hardware import load_hardware
    from epmoe.plan.planner import plan
    from epmoe.plan.request import PlanRequest

    hw = load_hardware("h200-sxm")
    best = 0
    for n in range(2, KIMI_LAYERS + 1):
        spec = load_moe_spec(str(checkpoint("kimi-k2.5", n, root / f"fit{n}", args.expert_format)))
        req = PlanRequest(spec=spec, hardware=hw, gpus=args.gpus, batches=(max(args.concurrency),),
                          context=args.max_model_len, weights=args.expert_format, mem_fraction=FIT_FRACTION)
        p = plan(req)
        names = [f"EP{args.gpus}+DPattn" if args.gpus > 1 else "TP1"]
        if not all(p.strategy(name).steps[0].memory.fits for name in names):
            break
        best = n
    if not best:
        raise ValueError(f"not even 2 Kimi-K2.5 layers fit {args.gpus} GPUs by the planner's memory model")
    return best


def prepare(args: argparse.Namespace, root: Path) -> dict:
    """The target checkpoint and the EAGLE-3 head's directory: full-size Kimi-K2.5 configs on CUDA, the built-in
    small Kimi checkpoint and a head config scaled to it on CPU."""
    eagle = root / "eagle3"
    if args.device == "cpu":
        from epmoe.models.tiny import build_tiny_eagle3_config, ensure_default_checkpoint

        d = ensure_default_checkpoint()
        build_tiny_eagle3_config(eagle, args.eagle3_config, d)
        return {"model": str(d), "eagle3": str(eagle), "layers": load_moe_spec(str(d)).num_layers,
                "load_format": "auto", "model_name": "kimi-k2.5 (epmoe.models.tiny)"}
    layers = args.layers or fitting_layers(args, root)
    d = checkpoint("kimi-k2.5", layers, root, args.expert_format)
    eagle.mkdir()
    shutil.copy(args.eagle3_config, eagle / "config.json")
    return {"model": str(d), "eagle3": str(eagle), "layers": layers, "load_format": "dummy",
            "model_name": f"kimi-k2.5 ({layers} of {KIMI_LAYERS} layers, {args.expert_format} experts)"}


def engine_config(args: argparse.Namespace, model: dict, parallel: str, mode: str) -> EngineConfig:
    cuda = args.device == "cuda"
    spec = {} if mode == "plain" else dict(
        speculative_algorithm=mode, speculative_num_tokens=args.spec_k,
        speculative_draft_model=model["eagle3"] if mode == "eagle3" else None)
    per_rank = max(1, math.ceil(max(args.concurrency) / args.gpus))
    return EngineConfig(model=model["model"], dtype="bfloat16" if cuda else "float32", device=args.device,
                        parallel=parallel, expert_backend="triton" if cuda else "reference",
                        load_format=model["load_format"], max_num_seqs=per_rank, cuda_graph_max_bs=per_rank,
                        max_model_len=args.max_model_len if cuda else None, enforce_eager=not cuda,
                        enable_prefix_caching=False,  # the repeated prompts are timed as computed, each time
                        **spec)


def prompts(n: int, vocab: int, text: bool) -> list:
    """``n`` repetitive prompts: the speculation prompts of ``benchmarks/engine.py`` as text (a tokenizer), or
    token ids repeating a short random pattern (dummy weights, no tokenizer)."""
    if text:
        return [SPEC_PROMPTS[i % len(SPEC_PROMPTS)] for i in range(n)]
    gen = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        pattern = torch.randint(0, vocab, (8 + i % 5,), generator=gen).tolist()
        out.append((pattern * 16)[:96])
    return out


# ---- one rank ----------------------------------------------------------------------------------------------------


class Rank:
    """This rank's group, side group and device."""

    def __init__(self, info: RankInfo, args: argparse.Namespace) -> None:
        self.args = args
        self.group = init_group(info, args.device)
        self.side = dist.new_group(list(range(info.world_size)), backend="gloo")
        self.rank, self.world = info.rank, info.world_size
        self.cuda = args.device == "cuda"

    def any(self, flag: bool) -> bool:
        t = torch.tensor([int(flag)])
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.side)
        return bool(t.item())

    def max(self, value: float) -> float:
        t = torch.tensor([float(value)], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.side)
        return float(t.item())

    def min(self, value: float) -> float:
        t = torch.tensor([float(value)], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.side)
        return float(t.item())

    def sum(self, value: float) -> float:
        t = torch.tensor([float(value)], dtype=torch.float64)
        dist.all_reduce(t, group=self.side)
        return float(t.item())

    def gather(self, obj) -> list:
        out: list = [None] * self.world
        dist.all_gather_object(out, obj, group=self.side)
        return out

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def log(self, msg: str) -> None:
        if self.rank == 0:
            print(f"[deployment] {msg}", flush=True)


def drain(r: Rank, engine: Engine) -> None:
    """Abort this rank's requests and step until no rank has one."""
    for rid in list(engine._seqs):
        engine.abort(rid)
    while r.any(engine.has_unfinished()):
        engine.step()


def collectives(r: Rank, engine: Engine, steps: int) -> dict:
    """Collectives of ``steps`` engine steps under ``torch.profiler``: per kind, calls and ms per step (max over
    ranks). NCCL kernels on CUDA (graph replays included), gloo calls on CPU."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if r.cuda else [])
    with profile(activities=acts) as prof:
        for _ in range(steps):
            engine.step()
        r.sync()
    found: dict[str, dict] = {}
    for ev in prof.key_averages():
        name = ev.key.lower()
        if r.cuda:  # the kernels only: the host-side "nccl:..." ranges would count their kernels twice
            if "nccl" not in name or ev.device_type != torch.autograd.DeviceType.CUDA:
                continue
        elif "gloo" not in name:
            continue
        kind = next((k for key, k in COLLECTIVE_NAMES.items() if key in name.replace("nccldevkernel_", "")), None)
        if kind is None:
            continue
        us = ev.device_time_total if r.cuda else ev.cpu_time_total
        e = found.setdefault(kind, {"calls": 0.0, "ms": 0.0})
        e["calls"] += ev.count / steps
        e["ms"] += us / 1e3 / steps
    kinds = sorted(set().union(*r.gather(sorted(found))))
    return {k: {"calls_per_step": r.max(found.get(k, {}).get("calls", 0.0)),
                "ms_per_step": r.max(found.get(k, {}).get("ms", 0.0))} for k in kinds}


def window(r: Rank, engine: Engine, prompt_set: list, conc: int) -> dict:
    """``conc`` requests over the machine (request ``i`` on rank ``i mod G``) decoding; ``--steps`` steps timed, then
    ``--profile-steps`` under the profiler. The requests may generate up to the context limit (``decode_room``), so
    that those that start decoding while others are prefilled do not finish inside the window; they are aborted at
    the end.

    Raises:
        RuntimeError: on every rank, when a request of any rank finished or was preempted before the window ended
            (the batch shrank)."""
    a = r.args
    mine = [prompt_set[i % len(prompt_set)] for i in range(conc) if i % r.world == r.rank]
    room = int(r.min(min((decode_room(engine, p) for p in mine), default=2**31)))  # the least over the ranks
    params = SamplingParams(temperature=0, max_tokens=room, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in mine]
    while r.any(prefilling(engine)):
        engine.step()
    forward_ms: list[float] = []
    run = engine.runner.run

    def timed_run(*args, **kw):
        r.sync()
        t = time.perf_counter()
        out = run(*args, **kw)
        r.sync()
        forward_ms.append((time.perf_counter() - t) * 1e3)
        return out

    engine.runner.run = timed_run
    preemptions0 = engine.stats["preemptions"]
    for _ in range(3):  # warm-up: the verify buckets and the draft's steps
        engine.step()
    forward_ms.clear()
    s0 = (engine.spec_stats.verify_steps, engine.spec_stats.accepted_tokens)
    graphs0 = engine.stats["graph_steps"]
    tokens = 0
    dist.barrier(group=r.side)
    r.sync()
    t0 = time.perf_counter()
    for _ in range(a.steps):
        tokens += sum(len(o.new_token_ids) for o in engine.step())
    r.sync()
    wall = r.max(time.perf_counter() - t0)
    engine.runner.run = run
    verify = r.sum(engine.spec_stats.verify_steps - s0[0])
    accepted = r.sum(engine.spec_stats.accepted_tokens - s0[1])
    total = r.sum(tokens)
    fwd = r.max(statistics.median(forward_ms) if forward_ms else 0.0)  # a rank without requests may not run
    graph_steps = r.max(engine.stats["graph_steps"] - graphs0)
    coll = collectives(r, engine, a.profile_steps)
    done, preempted = batch_losses(engine, ids, preemptions0)
    shrank = r.any(bool(done or preempted))
    done, preempted = int(r.sum(done)), int(r.sum(preempted))
    drain(r, engine)
    if shrank:
        raise RuntimeError(f"concurrency {conc}: of {conc} requests {done} finished and {preempted} were preempted "
                           f"before the window ended, so its steps ran fewer; each may generate {room} tokens (the "
                           f"context limit or the KV pool less its prompt), and the KV pools must hold the batch")
    return {"step_ms": wall * 1e3 / a.steps, "forward_ms": fwd, "output_tokens_per_s": total / wall,
            "tokens_per_s_per_stream": total / wall / conc, "graph_steps": graph_steps,
            "accepted_length": (accepted + verify) / verify if verify else 1.0, "verify_steps": verify,
            "collectives": coll}


def check_tokens(r: Rank, engine: Engine, prompt_set: list) -> list[list[int]]:
    """Greedy tokens of ``G`` prompts (one per rank), gathered in prompt order."""
    params = SamplingParams(temperature=0, max_tokens=r.args.check_tokens, ignore_eos=True)
    out = engine.generate([prompt_set[r.rank % len(prompt_set)]], params)
    return [t for per_rank in r.gather([o.token_ids for o in out]) for t in per_rank]


def peak_memory_gib(r: Rank) -> list[float]:
    if r.cuda:
        mine = torch.cuda.max_memory_allocated() / 2**30
    else:
        mine = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return r.gather(mine)


def check_expert_format(engine: Engine, expert_format: str) -> None:
    """Raise ``ValueError`` when ``int4`` experts were asked for but the engine holds them in a float dtype."""
    if expert_format != "int4":
        return
    experts = engine.ep_model.moe_layers[0].experts
    dtypes = {t.dtype for t in [*experts.parameters(), *experts.buffers()]}
    if all(d.is_floating_point for d in dtypes):
        raise ValueError(f"--expert-format int4: the engine loaded the routed experts as {sorted(map(str, dtypes))}, "
                         f"not packed INT4; use --expert-format bf16")


def rank_main(info: RankInfo, args: argparse.Namespace, model: dict) -> dict | None:
    """One rank: every parallel mode and decoding mode; rank 0 returns the rows and the greedy checks."""
    r = Rank(info, args)
    rows, tokens = [], {}
    try:
        vocab = load_moe_spec(model["model"]).vocab_size
        prompt_set = prompts(max(max(args.concurrency), r.world), vocab, text=args.device == "cpu")
        for parallel in args.parallel:
            for mode in args.modes:
                if r.cuda:
                    torch.cuda.reset_peak_memory_stats()
                t0 = time.perf_counter()
                engine = Engine(engine_config(args, model, parallel, mode), Comm(r.group))
                start_s = r.max(time.perf_counter() - t0)
                check_expert_format(engine, args.expert_format)
                r.log(f"{parallel} {mode}: engine up in {start_s:.1f} s")
                tokens[f"{parallel}/{mode}"] = check_tokens(r, engine, prompt_set)
                for conc in args.concurrency:
                    row = window(r, engine, prompt_set, conc)
                    row.update(parallel=parallel, mode=mode, concurrency=conc, k=0 if mode == "plain" else args.spec_k,
                               start_s=start_s)
                    rows.append(row)
                    r.log(f"  C {conc:3d}: step {row['step_ms']:.2f} ms, {row['output_tokens_per_s']:.1f} tok/s, "
                          f"accepted {row['accepted_length']:.2f}, collectives {row['collectives']}")
                mem = peak_memory_gib(r)
                for row in rows:
                    if (row["parallel"], row["mode"]) == (parallel, mode):
                        row["memory_gib_per_rank"] = mem
                del engine
                gc.collect()
                if r.cuda:
                    torch.cuda.empty_cache()
                dist.barrier(group=r.side)
        return {"rows": rows, "tokens": tokens} if r.rank == 0 else None
    finally:
        dist.destroy_process_group()


# ---- the planner -------------------------------------------------------------------------------------------------


def add_plan(args: argparse.Namespace, model: dict, rows: list[dict]) -> dict:
    """The planner's step times beside every row (``h200-sxm``, the model's spec, ``G`` GPUs); ratio = measured /
    planned."""
    from epmoe.plan.draft import read_draft
    from epmoe.plan.hardware import load_hardware
    from epmoe.plan.planner import plan
    from epmoe.plan.request import PlanRequest
    from epmoe.plan.speculative import price_speculation

    g = args.gpus
    names = {"ep": f"EP{g}+DPattn" if g > 1 else "TP1", "tp": f"TP{g}"}
    spec = load_moe_spec(model["model"])
    ctx = 96 + (args.spec_k + 1) * args.steps
    req = PlanRequest(spec=spec, hardware=load_hardware("h200-sxm"), gpus=g, batches=tuple(args.concurrency),
                      context=ctx, weights=args.expert_format, balancedness=1.0)
    base = plan(req)
    draft = read_draft(str(Path(model["eagle3"]) / "config.json"))
    priced = {}
    for row in rows:
        i = args.concurrency.index(row["concurrency"])
        name = names[row["parallel"]]
        if row["mode"] == "plain":
            st = base.strategy(name).steps[i]
            row["plan"] = {"strategy": name, "step_ms": st.total_ms,
                           "collectives": {c.kind: c.count for c in st.collectives}}
            row["plan_ratio"] = row["step_ms"] / st.total_ms
            continue
        key = (row["mode"], row["accepted_length"])
        if key not in priced:
            a = min(max(1.0, row["accepted_length"]), args.spec_k + 1.0)
            priced[key] = price_speculation(dataclasses.replace(req, spec_tokens=args.spec_k),
                                            draft if row["mode"] == "eagle3" else None, a)
        sp = priced[key].strategy(name).steps[i]
        round_ms = sp.round_ms if row["mode"] == "eagle3" else sp.verify.total_ms
        per_stream = sp.accept_length * 1e3 / round_ms
        row["plan"] = {"strategy": name, "verify_ms": sp.verify.total_ms, "round_ms": round_ms,
                       "tokens_per_s_per_stream": per_stream}
        row["plan_ratio"] = row["forward_ms"] / sp.verify.total_ms
        row["plan_tokens_ratio"] = row["tokens_per_s_per_stream"] / per_stream
    faster = {}
    for c in args.concurrency:
        steps = {p: base.strategy(names[p]).steps[args.concurrency.index(c)].total_ms for p in PARALLEL}
        faster[c] = min(steps, key=steps.get)
    return {"hardware": "h200-sxm", "context": ctx, "strategies": names, "planned_faster": faster}


# ---- epmoe serve -------------------------------------------------------------------------------------------------


def serve_part(args: argparse.Namespace, model: dict, out: Path) -> dict:
    """``epmoe serve --parallel ep --ep G`` under ``bench serve`` at ``--serve-concurrency``."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    conc = args.serve_concurrency
    per_rank = max(1, math.ceil(conc / args.gpus))
    flags = ["--device", args.device, "--parallel", "ep", "--ep", str(args.gpus), "--max-num-seqs", str(per_rank),
             "--cuda-graph-max-bs", str(per_rank)]
    if args.device == "cuda":
        flags += ["--dtype", "bfloat16", "--load-format", "dummy", "--max-model-len", str(args.max_model_len)]
    in_len, out_len = (128, 64) if args.device == "cuda" else (16, 8)
    cmd = [sys.executable, "-m", "epmoe.cli", "serve", "--model", model["model"], *flags, "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        wait_ready(url, proc, timeout_s=1200.0 if args.device == "cuda" else 300.0)
        if args.device == "cuda":  # warm-up: the batched prefill and decode shapes compile before timing
            run_bench(BenchConfig(base_url=url, num_prompts=conc, input_len=in_len, output_len=8,
                                  max_concurrency=conc), progress=False)
        rep = run_bench(BenchConfig(base_url=url, num_prompts=args.serve_prompts or 4 * conc, input_len=in_len,
                                    output_len=out_len, max_concurrency=conc), progress=False)
    finally:
        stop_server(proc)
        (out / "serve.log").write_text(proc.stdout.read() if proc.stdout else "")
    return {"command": " ".join(cmd[1:]), "concurrency": conc, "input_len": in_len, "output_len": out_len,
            "report": rep.to_json(), "exit_code": proc.returncode}


# ---- the table ---------------------------------------------------------------------------------------------------


def _coll(c: dict) -> str:
    short = {"all_to_all": "a2a", "all_reduce": "ar", "all_gather": "ag"}
    return " ".join(f"{short.get(k, k)} {v['calls_per_step']:.0f}x/{v['ms_per_step']:.2f}ms" for k, v in c.items()) \
        or "-"


def print_table(doc: dict) -> None:
    print(f"\n{doc['model']['model_name']} on {doc['gpus']} x {doc['device_name']}; greedy tokens equal across "
          f"ep/tp and modes: {doc['checks']['tokens_equal']}; planner's faster strategy: "
          f"{doc['plan']['planned_faster']}")
    print(f"{'par':3} {'mode':6} {'C':>3} {'step ms':>8} {'fwd ms':>7} {'tok/s':>8} {'tok/s/str':>9} {'x plain':>7} "
          f"{'acc len':>7} {'plan ms':>8} {'/plan':>6} {'GiB/rank':>8}  collectives per step (no prop: nothing "
          f"proposed in the window, plain steps)")
    for row in doc["rows"]:
        p = row["plan"]
        planned = p.get("step_ms", p.get("verify_ms"))
        acc = "-" if row["mode"] == "plain" else f"{row['accepted_length']:7.2f}" if row["verify_steps"] else "no prop"
        speed = "-" if row["mode"] == "plain" else f"{row['speedup_per_stream']:7.2f}"
        print(f"{row['parallel']:3} {row['mode']:6} {row['concurrency']:3d} {row['step_ms']:8.2f} "
              f"{row['forward_ms']:7.2f} {row['output_tokens_per_s']:8.1f} {row['tokens_per_s_per_stream']:9.1f} "
              f"{speed:>7} {acc:>7} {planned:8.2f} {row['plan_ratio']:6.2f} {max(row['memory_gib_per_rank']):8.2f}  "
              f"{_coll(row['collectives'])}")
    for c, v in doc["ep_over_tp"].items():
        print(f"C {c}: ep step / tp step = {v:.2f} (ep faster: {'yes' if v < 1 else 'NO'})")
    print_serve(doc)


def print_serve(doc: dict) -> None:
    s = doc.get("serve")
    if s:
        rep = s["report"]

        def ms(stats: dict, key: str, digits: int) -> str:  # None: nothing measured (no request completed)
            return "-" if stats[key] is None else f"{stats[key]:.{digits}f}"

        print(f"serve --parallel ep --ep {doc['gpus']} at concurrency {s['concurrency']}: TTFT p50 "
              f"{ms(rep['ttft_ms'], 'p50', 1)} p99 {ms(rep['ttft_ms'], 'p99', 1)} ms, TPOT p50 "
              f"{ms(rep['tpot_ms'], 'p50', 2)} p99 {ms(rep['tpot_ms'], 'p99', 2)} ms, {rep['output_throughput']:.1f} "
              f"tok/s, failed {rep['failed']}, exit code {s['exit_code']}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp())
    try:
        model = prepare(args, root)
        print(f"[deployment] {model['model_name']}, {args.gpus} ranks on {args.device}", flush=True)
        if args.skip_engine:
            doc = {"device": args.device, "gpus": args.gpus, "model": model, "args": vars(args),
                   "serve": serve_part(args, model, out)}
            (out / "deployment.json").write_text(json.dumps(doc, indent=1, default=str))
            print_serve(doc)
            return
        res = spawn(rank_main, args.gpus, (args, model))[0]
        rows = res["rows"]
        plain = {(r["parallel"], r["concurrency"]): r for r in rows if r["mode"] == "plain"}
        for row in rows:
            base = plain[(row["parallel"], row["concurrency"])]
            row["speedup_per_stream"] = row["tokens_per_s_per_stream"] / base["tokens_per_s_per_stream"]
        toks = res["tokens"]
        ref = next(iter(toks.values()))
        doc = {"device": args.device, "gpus": args.gpus,
               "device_name": torch.cuda.get_device_name() if args.device == "cuda" else "cpu (gloo)",
               "model": model, "args": vars(args),
               "checks": {"tokens": toks, "tokens_equal": all(t == ref for t in toks.values())},
               "rows": rows}
        doc["plan"] = add_plan(args, model, rows)
        doc["ep_over_tp"] = {c: plain[("ep", c)]["step_ms"] / plain[("tp", c)]["step_ms"] for c in args.concurrency
                             if ("ep", c) in plain and ("tp", c) in plain}
        (out / "deployment.json").write_text(json.dumps(doc, indent=1, default=str))
        if not args.skip_serve:
            doc["serve"] = serve_part(args, model, out)
            (out / "deployment.json").write_text(json.dumps(doc, indent=1, default=str))
        print_table(doc)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
