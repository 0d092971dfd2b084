"""The engine end to end on one GPU: decode step time (TPOT) and TTFT against the floor and against
transformers' own ``generate`` on the same model, in the same run (``--device cpu``: the speculation rows only).

    python benchmarks/engine.py [--models qwen3-30b-a3b,deepseek-v3,kimi-k2.5] [--batches 1,8,64,256]
                                [--peer static|eager|none] [--expert-format bf16,int4,mxfp4,fp8] [--out DIR]

Models are ``data/configs`` files at full width with dummy weights (``--load-format dummy``; gpt-oss-20b too);
DeepSeek-V3 and Kimi-K2.5 keep as many layers as fit one H200 (``--deepseek-layers``, ``--kimi-layers``).
Routed experts are bf16 (``--expert-format bf16``: a config's ``quantization_config`` is dropped) or, for the
models whose config names a format in ``--expert-format`` (``int4``: Kimi-K2.5's INT4 pack-quantized; ``mxfp4``:
gpt-oss's; ``fp8``: DeepSeek-V3's block FP8), as published. MLA models
(DeepSeek, Kimi) report their KV bytes per token and layer: the latent the engine caches, beside the
expanded per-head keys and values. Per batch size: every request gets a
128-token prompt (``--context N``: N tokens, for the decode step at a long context); once all are decoding,
``--steps`` engine steps are timed (wall clock, host work included). The floor of a step is max(bytes it must
read / measured copy bandwidth, FLOPs / measured bf16 matmul rate): the weights of the non-expert layers, the
experts its tokens touch (the number read back from the engine's load counts over a few steps after the timed ones,
the table's ``experts``), and the KV cache it attends over. ``uniform`` is the expected number under uniform
routing, the planner's assumption (the dummy weights route as uniform routing does; a row whose count falls short
of it read fewer experts than the plan prices). Every measured step runs the whole batch (``time_decode``). TTFT:
one request of 1k and 4k tokens, against the floor of its prefill (``prefill_floor``: FLOPs or weight reads, the
larger) and beside ``epmoe plan``'s price of that prompt, its tokens routed to experts drawn uniformly at random
(``--ttft-routing``: the gates of dummy weights send the tokens of one prompt to fewer and fewer experts layer by
layer, all of them to the same few after a handful of layers, so that its prefill reads a fraction of the expert
weights a trained model's would; an engine with ``moe_routing_simulation='uniform_random'`` built after the decode
rows); the plan's price is ``planned_ttft``, and ``ttft_fit`` the profile's per-layer prefill term fitted to the run's
TTFT rows. Writes
``engine_<gpu>.json`` under ``--out`` and prints a table last. ``--replan-ttft ROWS.json`` (no GPU) re-prices measured
TTFT rows of earlier runs with this commit's planner and fits ``engine_prefill_layer_us`` per profile
(``replan_ttft``; ``benchmarks/results/ttft_fit_rows.json`` lists the rows the shipped profiles were fitted to).
``--env-variants 'EPMOE_PDL=0;...'`` also times, per model, an engine built with each of those environment settings,
in the same process after the main rows (an A/B in the same run).

Speculation rows (``--spec``: only these, a few minutes): Qwen3-30B-A3B (``--spec-model``), ``ngram`` on
repetitive prompts (code, lists) and ``eagle3`` with random weights (``--eagle3-config``, the SpecForge
config for that target), at ``--spec-batches`` (1, 16) and K in ``--spec-k`` (1, 3). Per row: the mean
accepted length (tokens per verify step), the verify step's time (the target's forward over B x (K + 1)
rows, timed alone) against its floor (the same bytes and FLOPs model as a decode step, for B (K + 1)
tokens and B sequences' KV) and against a plain decode step of B rows in the same run, and tokens/s per
stream (whole engine steps: proposals, verification and sampling included) against plain decoding.
Targets: speculation not slower than plain at batch 1 when the accepted length is at least 2; the verify
step within 1.3x of a plain step for K <= 3 at batch 1. ``--device cpu --spec-model DIR`` runs the same rows
on a small checkpoint (no floors), to try the script without a GPU.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import shutil
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Collection
from pathlib import Path

import torch

from epmoe.engine import Engine, EngineConfig, SamplingParams
from epmoe.spec import load_moe_spec
from timing import gpu_file_name, measure_ceilings

CONFIGS = Path(__file__).resolve().parents[1] / "data" / "configs"
RESULTS = Path(__file__).resolve().parent / "results"
PROMPT = 128


def published_format(name: str) -> str:
    """The routed experts' format the model's config names, as ``MoESpec.expert_weight_format`` reads it, by its
    family: ``int4`` (``int4_group32``), ``mxfp4``, ``fp8`` (``fp8_block128``) or ``bf16``."""
    return load_moe_spec(str(CONFIGS / f"{name}.config.json")).expert_weight_format.split("_")[0]


def checkpoint(name: str, layers: int | None, root: Path, expert_format: str = "bf16") -> Path:
    """A directory holding only the model's config.json (optionally cut to ``layers`` decoder layers; the
    language model's config where it sits under ``text_config``). ``expert_format``: the formats, comma-separated,
    whose ``quantization_config`` is kept (``int4``, ``mxfp4``, ``fp8``); a model published in another is given bf16
    dummy weights (its ``quantization_config`` dropped), so ``bf16`` drops every one."""
    cfg = json.loads((CONFIGS / f"{name}.config.json").read_text())
    text = cfg.get("text_config", cfg)
    if layers:
        text["num_hidden_layers"] = layers
        if "layer_types" in text:  # gpt-oss: one attention kind a layer
            text["layer_types"] = text["layer_types"][:layers]
    if published_format(name) not in expert_format.split(","):
        for c in (cfg, text):
            c.pop("quantization_config", None)
    d = root / name
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def weight_bytes(engine: Engine) -> dict:
    """Bytes of the weights a decode step reads in full, and of one routed expert; the weights of one routed expert
    (``expert_params``: its three matrices, whatever their storage)."""
    model = engine.ep_model.model
    expert_params = {id(p) for layer in engine.ep_model.moe_layers for p in layer.experts.parameters()}
    embed = model.get_input_embeddings().weight
    dense = sum(p.numel() * p.element_size() for p in model.parameters()
                if id(p) not in expert_params and p is not embed)
    if model.get_output_embeddings().weight is embed:
        dense += embed.numel() * embed.element_size()
    layer = engine.ep_model.moe_layers[0]
    one = sum(p[0].numel() * p.element_size() for p in layer.experts.parameters())
    spec = engine.spec
    return {"dense": dense, "expert": one, "embed_row": embed[0].numel() * embed.element_size(),
            "expert_params": 3 * spec.hidden_size * spec.moe_intermediate_size}


def prefill_floor(spec, wb: dict, n: int, ceil: dict) -> tuple[float, float]:
    """The floors of one ``n``-token prompt's prefill, ms: its FLOPs over the bf16 rate (the products of every
    weight but the embedding, ``K`` experts' a token a MoE layer, whatever their storage, and the scores and weighted
    values of the (query, key) pairs each layer attends, ``costs.causal_pairs`` at ``costs.prefill_score_flops``:
    windowed layers their window) and its weight bytes over the copy bandwidth (the non-expert weights, and in each
    MoE layer the experts ``n`` tokens touch under uniform routing: ``E (1 - (1 - K / E)^n)``). The prefill's floor
    is the larger."""
    from epmoe.plan.costs import causal_pairs, prefill_score_flops

    e, k = spec.num_experts, spec.top_k
    params = wb["dense"] / 2 + spec.num_moe_layers * k * wb["expert_params"]
    spans = spec.attention.attended_positions(n, spec.num_layers)
    pairs = sum(layers * causal_pairs(n, span) for layers, span in spans)
    flops = 2 * params * n + pairs * prefill_score_flops(spec)
    touched = e * (1 - (1 - k / e) ** n)
    nbytes = wb["dense"] + spec.num_moe_layers * touched * wb["expert"]
    return flops / ceil["bf16_flop_per_s"] * 1e3, nbytes / ceil["copy_bytes_per_s"] * 1e3


def decode_floor(engine: Engine, wb: dict, bs: int, ctx: float, ceil: dict, touched: float | None = None) -> dict:
    """The step's floor, ms: its bytes over the copy bandwidth or its FLOPs over the bf16 rate, whichever is larger.
    The experts read are ``touched`` per MoE layer where measured (``floor_ms``), and the expected number under
    uniform routing (``floor_uniform_ms``, the planner's assumption; the two differ where the routing is not
    uniform). ``experts_touched_per_layer`` is the uniform count (its meaning in earlier results too)."""
    spec = engine.spec
    e, k = spec.num_experts, spec.top_k
    uniform = e * (1 - (1 - k / e) ** bs)
    kv = bs * ctx * engine.kv.layout.bytes_per_token(engine.config.torch_dtype)
    active = wb["dense"] / 2 + spec.num_moe_layers * k * wb["expert_params"]
    flops = 2 * active * bs

    def floor_ms(experts: float) -> tuple[float, float]:
        nbytes = wb["dense"] + spec.num_moe_layers * experts * wb["expert"] + kv + bs * wb["embed_row"]
        return nbytes, max(nbytes / ceil["copy_bytes_per_s"], flops / ceil["bf16_flop_per_s"]) * 1e3

    nbytes, ms = floor_ms(uniform if touched is None else touched)
    return {"floor_bytes": nbytes, "floor_flops": flops, "experts_touched_per_layer": uniform,
            "floor_ms": ms, "floor_uniform_ms": floor_ms(uniform)[1]}


def kernel_profile(engine: Engine, steps: int) -> tuple[list[dict], dict]:
    """CUDA kernels of ``steps`` engine steps, by total time (us per step), largest first; and the timeline:
    ``busy_us`` (union of the kernels' intervals per step), ``idle_us`` (the GPU idle between the first and last
    kernel, per step) and ``idle_before`` (that idle by the kernel that waited for it, largest first)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    rows = []
    for ev in prof.key_averages():
        dev_us = getattr(ev, "device_time_total", 0.0)
        if dev_us > 0:
            rows.append({"kernel": ev.key[:90], "us_per_step": dev_us / steps, "calls_per_step": ev.count / steps})
    rows.sort(key=lambda r: -r["us_per_step"])
    spans = sorted((ev.time_range.start, ev.time_range.end, ev.name[:60]) for ev in prof.events()
                   if ev.device_type == DeviceType.CUDA and ev.time_range.end > ev.time_range.start)
    busy = idle = 0.0
    before: dict[str, float] = {}
    end = spans[0][0] if spans else 0.0
    for s, e, name in spans:
        if s > end:
            idle += s - end
            before[name] = before.get(name, 0.0) + (s - end) / steps
        busy += max(0.0, e - max(s, end))
        end = max(end, e)
    top = sorted(before.items(), key=lambda kv: -kv[1])[:12]
    layer, count = median_layer(layer_windows(spans, steps, engine.runner.segment_starts()))
    timeline = {"busy_us": busy / steps, "idle_us": idle / steps,
                "idle_before": [{"kernel": k, "us_per_step": v} for k, v in top],
                "layer": layer, "layer_count": count}
    return rows, timeline


LAYER_ANCHORS = ("paged_decode_kernel", "mla_decode_kernel")
"""Kernels launched once per attention layer of a decode step (``layer_windows`` cuts the timeline at them)."""


def layer_windows(spans: list[tuple[float, float, str]], steps: int, cuts: Collection[int] = ()) -> list[list[dict]]:
    """The decoder layers of the last profiled step, each the kernels in launch order from one decode attention
    launch (``LAYER_ANCHORS``) to the next: each kernel's start after the layer's first (us), its duration and the
    GPU's idle time before it (negative: it started before the kernels ahead of it ended, as a programmatic
    dependent launch does). ``cuts``: the layers that begin a new graph of the step
    (``ModelRunner.segment_starts``); a layer followed by one is left out (the next graph's replay begins in it, a
    gap no other layer has)."""
    at = [i for i, (_, _, name) in enumerate(spans) if name.startswith(LAYER_ANCHORS)]
    per_step = len(at) // max(1, steps)
    last = at[len(at) - per_step:]
    out = []
    for layer in range(per_step - 1):
        if layer + 1 in cuts:
            continue
        first, stop = last[layer], last[layer + 1]
        t0 = spans[first][0]
        window, end = [], spans[first - 1][1] if first else t0
        for s, e, name in spans[first:stop]:
            window.append({"kernel": name, "start_us": s - t0, "us": e - s, "gap_us": s - end})
            end = max(end, e)
        out.append(window)
    return out


def median_layer(windows: list[list[dict]]) -> tuple[list[dict], int]:
    """One decoder layer as the median of ``layer_windows``'s layers that launch the most common sequence of
    kernels: per kernel the median start, duration and gap (us). Returns ``(kernels, layers)``, the layers
    the medians are over (``([], 0)`` with no whole layer)."""
    if not windows:
        return [], 0
    names = Counter(tuple(k["kernel"] for k in w) for w in windows).most_common(1)[0][0]
    same = [w for w in windows if tuple(k["kernel"] for k in w) == names]
    return [{"kernel": name, **{f: statistics.median(w[i][f] for w in same) for f in ("start_us", "us", "gap_us")}}
            for i, name in enumerate(names)], len(same)


def host_profile(engine: Engine, steps: int) -> list[dict]:
    """Host functions of ``steps`` engine steps by own time (ms per step); waits for the GPU show up in the
    call that synchronises (``tolist``)."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    prof.disable()
    stats = pstats.Stats(prof).stats
    rows = [{"function": f"{Path(f).name}:{line}:{name}", "ms_per_step": tt * 1e3 / steps, "calls": nc / steps}
            for (f, line, name), (_, nc, tt, _, _) in stats.items()]
    rows.sort(key=lambda r: -r["ms_per_step"])
    return rows[:25]


def time_decode(engine: Engine, bs: int, steps: int, vocab: int, profile_steps: int = 0,
                prompt: int = PROMPT, temperature: float = 0.0) -> dict:
    """One decode row: ``bs`` requests prefilled, then ``steps`` timed steps, the profiles and ``ROUTING_STEPS``
    routing steps, all on the whole batch. The requests may generate up to the context limit (``decode_room``), so
    that those that start decoding while the others are still prefilled do not finish during the measured steps;
    they are aborted at the end, also when the row is refused.

    Raises:
        RuntimeError: a request finished or was preempted before the routing steps ended (the batch shrank)."""
    gen = torch.Generator().manual_seed(bs)
    prompts = [torch.randint(0, vocab, (prompt,), generator=gen).tolist() for _ in range(bs)]
    room = decode_room(engine, prompts[0])
    params = SamplingParams(temperature=temperature, ignore_eos=True, max_tokens=room)
    ids = [engine.add_request(p, params) for p in prompts]
    try:
        while prefilling(engine):
            engine.step()
        before = dict(engine.stats)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        ends = []
        for _ in range(steps):
            engine.step()
            ends.append(time.perf_counter())
        torch.cuda.synchronize()
        ms = (time.perf_counter() - t0) * 1e3 / steps
        walls = [(b - a) * 1e3 for a, b in zip([t0] + ends[:-1], ends)]
        graph = engine.stats["graph_steps"] - before["graph_steps"]
        kernels, timeline = kernel_profile(engine, profile_steps) if profile_steps else ([], {})
        host = host_profile(engine, profile_steps) if profile_steps else []
        touched = experts_touched(engine, ROUTING_STEPS)
        done, preempted = batch_losses(engine, ids, before["preemptions"])
        if done or preempted:
            raise RuntimeError(
                f"batch {bs}: of {bs} requests {done} finished and {preempted} were preempted before the routing "
                f"steps ended, so the steps ran fewer; each may generate {room} tokens (the context limit or the KV "
                f"pool less the {prompt}-token prompt), and the KV pool must hold the whole batch")
    finally:
        for rid in ids:
            engine.abort(rid)
        while engine.has_unfinished():
            engine.step()
    return {"tpot_ms": ms, "step_spread_ms": step_spread(walls), "graph_steps": graph, "ctx": prompt + 4 + steps / 2,
            "kernels": kernels, "timeline": timeline, "host": host, "experts_touched_measured": touched}


def step_spread(walls: list[float]) -> dict:
    """The spread of a window's step times, ms (each ``engine.step()`` call's wall time; with the overlap schedule a
    step's call returns once the step before it is read back, so in a steady window these follow the GPU's steps):
    ``median``, ``min``, ``max``. A GPU at its power cap runs some steps slower than others (the README's "step at
    the GPU's power cap"); the first call of a window returns early (nothing in flight yet)."""
    return {"median": statistics.median(walls), "min": min(walls), "max": max(walls)} if walls else {}


def prefilling(engine: Engine) -> bool:
    """True while a request of ``engine`` still prefills or has no output token yet (a measured window starts once
    none does)."""
    return any(s.num_computed < len(s.prompt_token_ids) or not s.output_token_ids for s in engine._seqs.values())


def batch_losses(engine: Engine, ids: Collection[int], preemptions_before: int) -> tuple[int, int]:
    """``(finished, preempted)``: how many of the requests ``ids`` have left ``engine`` (finished, at ``max_tokens``
    or the context limit), and how many preemptions it counted since it counted ``preemptions_before``. A measured
    window with either ran fewer requests than it says."""
    return len(ids) - sum(rid in engine._seqs for rid in ids), engine.stats["preemptions"] - preemptions_before


def decode_room(engine: Engine, prompt: str | list[int]) -> int:
    """The most tokens a request of ``prompt`` may be asked for so that it stops only at ``engine``'s context limit
    and its KV still fits the whole pool (``Engine.check_request``): a window's requests then decode through it,
    however far ahead of the others they started."""
    n = len(engine.encode(prompt))
    return max(1, min(engine.max_model_len - n, engine.allocator.capacity * engine.config.block_size - n + 1))


CONTEXT_MARGIN = 512
"""Tokens of the engine's context limit past a decode row's prompt (``build_engine``): the measured steps, and the
tokens that the requests whose prompts are done first generate while the others are prefilled."""


def context_limit(context: int) -> int:
    """The benchmark engine's ``max_model_len`` for ``context``-token prompts: 8192 tokens, or ``CONTEXT_MARGIN``
    past the prompt where that is more."""
    return max(8192, context + CONTEXT_MARGIN)


ROUTING_STEPS = 4
"""Steps after the timed ones whose routing ``experts_touched`` reads back (each step synchronised)."""


def experts_touched(engine: Engine, steps: int) -> float | None:
    """Mean number of physical slots given at least one token, per MoE layer and step, over the next ``steps``
    engine steps (the engine's own load counts, read back after each step); ``None`` without MoE layers.

    Raises:
        ValueError: ``steps`` below 1."""
    if steps < 1:
        raise ValueError(f"experts_touched: steps must be at least 1, got {steps}")
    if not engine.spec.num_moe_layers:
        return None
    counts = []
    prev = engine.loads.slot_totals.clone()
    for _ in range(steps):
        engine.step()
        cur = engine.loads.slot_totals.clone()
        counts.append(((cur - prev) > 0).sum(1).double().mean().item())
        prev = cur
    return statistics.mean(counts)


def time_ttft(engine: Engine, tokens: int, vocab: int) -> float:
    ids = torch.randint(0, vocab, (tokens,), generator=torch.Generator().manual_seed(tokens)).tolist()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    engine.add_request(ids, SamplingParams(temperature=0, max_tokens=1))
    while engine.has_unfinished():
        engine.step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def peer(model_dir: Path, batches: list[int], mode: str, steps: int, out: dict, saved: Callable[[], None],
         prompt: int = PROMPT) -> None:
    """transformers' generate on the same architecture (its own random init, same sizes) from ``prompt``-token
    prompts: ms per new token from two generation lengths (``mode`` static: static cache, which transformers
    compiles), into ``out`` by batch, ``saved`` called after each batch (a run cut short keeps the batches done)."""
    from transformers import AutoModelForCausalLM

    from epmoe.models.hf import hf_config

    config = hf_config(str(model_dir))
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    for bs in batches:
        ids = torch.randint(0, config.vocab_size, (bs, prompt), device="cuda")
        kw = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
        if mode == "static":
            kw["cache_implementation"] = "static"
        try:
            _generate_s(model, ids, kw, 4)
            _generate_s(model, ids, kw, 4 + steps)
            out[bs] = (_generate_s(model, ids, kw, 4 + steps) - _generate_s(model, ids, kw, 4)) * 1e3 / steps
            print(f"    peer {mode} bs {bs}: {out[bs]:.2f} ms per token", flush=True)
        except Exception as exc:  # noqa: BLE001 - report the peer's failure and go on
            out[bs] = f"failed: {type(exc).__name__}: {str(exc)[:200]}"
        saved()
    # generate's static cache leaves the compiled forward on the model, which refers back to the model: a cycle that
    # only the collection below frees, once no name here holds the model (else its weights stay on the GPU into the
    # next model's engine)
    del model, ids, kw
    if mode == "static":  # the compiled graphs hold the model's weights: drop them, or the next model may not fit
        torch._dynamo.reset()
    gc.collect()
    torch.cuda.empty_cache()


def _generate_s(model, ids: torch.Tensor, kw: dict, n: int) -> float:
    """Seconds ``model.generate`` takes for ``n`` new tokens after ``ids`` (int64 ``[B, T]`` on CUDA)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def attention_dims(config) -> tuple[int, int, int]:
    """Heads, key and value head dims of the attention as prefill computes it (MLA: expanded)."""
    h = config.num_attention_heads
    if getattr(config, "kv_lora_rank", None) is not None:
        return h, config.qk_nope_head_dim + config.qk_rope_head_dim, config.v_head_dim
    d = getattr(config, "head_dim", None) or config.hidden_size // h
    return h, d, d


def profile_of(gpu_name: str) -> str:
    """The shipped hardware profile of a GPU by its CUDA name: ``h100-sxm`` for an H100, else ``h200-sxm``."""
    return "h100-sxm" if "H100" in gpu_name else "h200-sxm"


def planned(d: Path, batches: list[int], ctx: float, weights: str | None = "bf16",
            profile: str = "h200-sxm") -> dict[int, tuple[float, float]]:
    """What ``epmoe plan`` predicts for one GPU of ``profile`` (the TP1 strategy): per batch, ms per decode step and
    the part of it that is the profile's engine step costs (``engine_*``)."""
    from epmoe.plan.hardware import load_hardware
    from epmoe.plan.planner import plan
    from epmoe.plan.request import PlanRequest

    req = PlanRequest(load_moe_spec(str(d)), load_hardware(profile), gpus=1, batches=tuple(batches),
                      context=int(ctx), weights=weights)  # None: the format the checkpoint's config names
    return {b: (st.total_ms, st.engine_ms) for b, st in zip(batches, plan(req).strategies[0].steps)}


def planned_ttft(d: Path, lens: list[int], weights: str | None = "bf16",
                 profile: str = "h200-sxm") -> dict[int, tuple[float, float]]:
    """What ``epmoe plan`` predicts for one prompt of each of ``lens`` tokens prefilled alone on one GPU of
    ``profile`` (the TP1 strategy's ``prefills``): ms to the first token and the part of it that is the profile's
    per-layer prefill term (``engine_prefill_layer_us``)."""
    from epmoe.plan.hardware import load_hardware
    from epmoe.plan.planner import plan
    from epmoe.plan.request import PlanRequest

    spec, hw = load_moe_spec(str(d)), load_hardware(profile)
    req = PlanRequest(spec, hw, gpus=1, batches=(1,), context=max(lens), weights=weights, input_lens=tuple(lens))
    layer_ms = spec.num_layers * hw.engine_prefill_layer_us / 1e3
    return {n: (st.total_ms, layer_ms) for n, st in zip(lens, plan(req).strategies[0].prefills)}


def fit_prefill_term(rows: list[dict]) -> dict:
    """The profile's ``engine_prefill_layer_us`` fitted to measured times to first token: least squares on the
    relative error of ``roofline + layers x term`` (``rows``: ``ttft_ms``, ``roofline_ms`` = the plan without the
    term, ``layers``), the term at least 0, with the ratios measured / planned after the fit."""
    import numpy as np

    m = np.array([r["ttft_ms"] for r in rows])
    a = np.array([r["layers"] for r in rows]) / m
    y = 1.0 - np.array([r["roofline_ms"] for r in rows]) / m
    x = max(0.0, float(a @ y / (a @ a)))
    after = [r["roofline_ms"] + r["layers"] * x for r in rows]
    return {"engine_prefill_layer_us": x * 1e3, "ratios_after": [t / p for t, p in zip(m.tolist(), after)]}


def replan_ttft(rows_file: Path, out: Path) -> dict:
    """Re-price measured times to first token with this commit's planner, no GPU: ``rows_file`` is a JSON list of
    ``{"results": an engine JSON under benchmarks/results, "model": its model name, "layers": the decoder layers it
    ran (null: the config's), "expert_format": as --expert-format, "profile": the hardware profile of its GPU,
    optionally "fit": false and "why"}``; each TTFT row of that model in that file is priced by ``planned_ttft`` and
    ``engine_prefill_layer_us`` is fitted per profile (``fit_prefill_term``) to the rows not marked ``"fit": false``
    (those are priced with the fitted term and reported). Prints one line a row and the fits; writes
    ``ttft_replan.json`` under ``out``.

    Raises:
        ValueError: a row naming a results file, model or TTFT row that is not there (named).
    """
    entries = json.loads(Path(rows_file).read_text())
    root = Path(tempfile.mkdtemp())
    rows = []
    try:
        for e in entries:
            path = RESULTS / e["results"]
            if not path.is_file():
                raise ValueError(f"{rows_file}: results file {str(path)!r} does not exist")
            model = json.loads(path.read_text())["models"].get(e["model"])
            if not model or not model.get("ttft"):
                raise ValueError(f"{rows_file}: {e['results']} has no TTFT rows of {e['model']!r}")
            d = checkpoint(e["model"], e["layers"], root / e["results"], e["expert_format"])
            kept = published_format(e["model"]) in e["expert_format"].split(",")
            lens = [int(n) for n in model["ttft"]]
            layers = load_moe_spec(str(d)).num_layers
            for n, (total, layer_part) in planned_ttft(d, lens, None if kept else "bf16", e["profile"]).items():
                rows.append({**e, "input_len": n, "ttft_ms": model["ttft"][str(n)]["ms"], "plan_ms": total,
                             "roofline_ms": total - layer_part, "layers": layers})
    finally:
        shutil.rmtree(root, ignore_errors=True)
    fits = {}
    for profile in sorted({r["profile"] for r in rows}):
        mine = [r for r in rows if r["profile"] == profile]
        fits[profile] = fit_prefill_term([r for r in mine if r.get("fit", True)])
        term_ms = fits[profile]["engine_prefill_layer_us"] / 1e3
        for r in mine:
            r["ratio_after_fit"] = r["ttft_ms"] / (r["roofline_ms"] + r["layers"] * term_ms)
    print(f"{'model':14} {'layers':>6} {'profile':9} {'tokens':>6} {'TTFT ms':>8} {'plan ms':>8} {'/plan':>6} "
          f"{'/plan after fit':>15}  results")
    for r in rows:
        print(f"{r['model']:14} {r['layers']:6d} {r['profile']:9} {r['input_len']:6d} {r['ttft_ms']:8.1f} "
              f"{r['plan_ms']:8.1f} {r['ttft_ms'] / r['plan_ms']:6.2f} {r['ratio_after_fit']:15.2f}  {r['results']}"
              + ("" if r.get("fit", True) else f" (not fitted: {r.get('why', '')})"))
    for profile, fit in fits.items():
        print(f"{profile}: engine_prefill_layer_us {fit['engine_prefill_layer_us']:.0f}, fitted to "
              f"{len(fit['ratios_after'])} rows, measured / planned after: "
              f"{min(fit['ratios_after']):.2f}-{max(fit['ratios_after']):.2f}")
    result = {"rows": rows, "fits": fits}
    out.mkdir(parents=True, exist_ok=True)
    (out / "ttft_replan.json").write_text(json.dumps(result, indent=2))
    return result


def fit_engine_terms(rows: list[dict]) -> dict:
    """The profile's ``engine_step_us``, ``engine_layer_step_us`` and ``engine_seq_step_us`` fitted to the measured
    steps: non-negative least squares on the relative error of ``roofline + step + layers x layer + batch x seq``
    (``rows``: ``tpot_ms``, ``roofline_ms`` = the plan without its engine terms, ``layers``, ``bs``), with the
    ratios measured / planned after the fit."""
    import numpy as np
    from scipy.optimize import nnls

    m = np.array([r["tpot_ms"] for r in rows])
    a = np.array([[1.0, r["layers"], r["bs"]] for r in rows]) / m[:, None]
    y = 1.0 - np.array([r["roofline_ms"] for r in rows]) / m
    x, _ = nnls(a, y)
    x = x.tolist()
    after = [r["roofline_ms"] + x[0] + r["layers"] * x[1] + r["bs"] * x[2] for r in rows]
    return {"engine_step_us": x[0] * 1e3, "engine_layer_step_us": x[1] * 1e3, "engine_seq_step_us": x[2] * 1e3,
            "ratios_after": [t / p for t, p in zip(m.tolist(), after)]}


def build_engine(d: Path, batches: list[int], context: int = PROMPT, routing: str | None = None) -> Engine:
    """The benchmark's engine on checkpoint ``d`` (dummy weights, graphs up to the largest batch, a context of 8192
    tokens or room for a ``context``-token prompt and its decode steps); no prefix caching: the TTFT rows time one
    prompt again and again, each must compute it whole. ``routing``: ``EngineConfig.moe_routing_simulation``."""
    return Engine(EngineConfig(model=str(d), dtype="bfloat16", device="cuda", expert_backend="triton",
                               load_format="dummy", max_num_seqs=max(batches),
                               max_model_len=context_limit(context),
                               cuda_graph_max_bs=max(batches), enable_prefix_caching=False,
                               moe_routing_simulation=routing))


def measure_variant(d: Path, batches: list[int], args, variant: str) -> dict[int, float]:
    """TPOT ms per batch of an engine built and run with the environment assignments ``variant`` (``"NAME=VALUE
    ..."``, e.g. ``EPMOE_PDL=0``) in force, in this process after the main rows: an A/B in the same run. The
    environment is restored afterwards."""
    assign = dict(a.split("=", 1) for a in variant.split())
    saved = {k: os.environ.get(k) for k in assign}
    os.environ.update(assign)
    try:
        engine = build_engine(d, batches, args.context)
        vocab = load_moe_spec(str(d)).vocab_size
        tpot = {bs: time_decode(engine, bs, args.steps, vocab, prompt=args.context,
                                temperature=args.temperature)["tpot_ms"] for bs in batches}
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    del engine
    gc.collect()
    torch.cuda.empty_cache()
    print(f"  variant {variant}: " + ", ".join(f"bs {b} {t:.2f} ms" for b, t in tpot.items()), flush=True)
    return tpot


def measure_engine(name: str, d: Path, batches: list[int], args, ceil: dict) -> dict:
    """Decode rows, TTFT rows, memory of the engine on model ``name``."""
    spec = load_moe_spec(str(d))
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    engine = build_engine(d, batches, args.context)
    start_s = time.perf_counter() - t0
    wb = weight_bytes(engine)
    kv = engine.kv_report(4096)
    cfg = engine.ep_model.model.config
    heads, dk, dv = attention_dims(cfg)
    kv["expanded_bytes_per_token_layer"] = heads * (dk + dv) * torch.empty(0, dtype=torch.bfloat16).element_size()
    print(f"{name}: engine start {start_s:.1f} s, KV {kv}", flush=True)
    m = {"layers": engine.ep_model.model.config.num_hidden_layers, "start_s": start_s, "kv": kv,
         "weights": wb, "rows": {}, "ttft": {}}
    for bs in batches:
        prof = args.profile_steps if bs in int_list(args.profile) else 0
        r = time_decode(engine, bs, args.steps, spec.vocab_size, prof, args.context, args.temperature)
        r.update(decode_floor(engine, wb, bs, r["ctx"], ceil, r["experts_touched_measured"]))
        r["ratio_to_floor"] = r["tpot_ms"] / r["floor_ms"]
        m["rows"][bs] = r
        touched = r["experts_touched_measured"]
        spread = r["step_spread_ms"]
        print(f"  bs {bs}: TPOT {r['tpot_ms']:.2f} ms (steps: median {spread['median']:.2f}, min {spread['min']:.2f},"
              f" max {spread['max']:.2f}), floor {r['floor_ms']:.2f} ms, graph steps {r['graph_steps']}"
              + (f", experts touched per MoE layer {touched:.1f} (uniform routing: "
                 f"{r['experts_touched_per_layer']:.1f}, floor {r['floor_uniform_ms']:.2f} ms)"
                 if touched is not None else ""), flush=True)
        if bs in int_list(args.sequential_batches) and engine.overlap:
            engine.overlap = False  # the same engine, each step's tokens read back before the next is planned
            r["tpot_sequential_ms"] = time_decode(engine, bs, args.steps, spec.vocab_size,
                                                  prompt=args.context, temperature=args.temperature)["tpot_ms"]
            engine.overlap = True
            print(f"  bs {bs}: TPOT {r['tpot_sequential_ms']:.2f} ms without the overlap schedule", flush=True)
        if r["kernels"]:
            print(f"    kernels: {sum(k['us_per_step'] for k in r['kernels']) / 1e3:.2f} ms per step on the GPU")
        for k in r["kernels"][:10]:
            print(f"    {k['us_per_step']:9.1f} us {k['calls_per_step']:6.1f}x  {k['kernel']}")
        if r["timeline"]:
            tl = r["timeline"]
            print(f"    timeline: busy {tl['busy_us']:.1f} us, idle {tl['idle_us']:.1f} us per step; idle before:")
            for k in tl["idle_before"][:8]:
                print(f"    {k['us_per_step']:9.1f} us  {k['kernel']}")
            if tl["layer"]:
                span = tl["layer"][-1]["start_us"] + tl["layer"][-1]["us"]
                print(f"    one layer, median of {tl['layer_count']} ({span:.1f} us): start, duration, gap before, us")
                for k in tl["layer"]:
                    print(f"    {k['start_us']:7.1f} {k['us']:6.1f} {k['gap_us']:6.1f}  {k['kernel']}")
        for h in r["host"][:8]:
            print(f"    host {h['ms_per_step']:7.3f} ms {h['calls']:6.1f}x  {h['function']}")
    if int_list(args.ttft) and args.ttft_routing != "model":
        # the prompts' routing simulated (see --ttft-routing): a new engine, whose graphs capture the simulation
        del engine
        gc.collect()
        torch.cuda.empty_cache()
        engine = build_engine(d, batches, args.context, args.ttft_routing)
    m["ttft_routing"] = args.ttft_routing
    time_ttft(engine, 256, spec.vocab_size)  # warm-up: first prefill-sized launches compile their kernels
    for n in int_list(args.ttft):
        time_ttft(engine, n, spec.vocab_size)  # warm-up at this length: kernels specialise and tune per shape
        ms = min(time_ttft(engine, n, spec.vocab_size) for _ in range(2))
        floors = prefill_floor(spec, wb, n, ceil)
        floor = max(floors)
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            time_ttft(engine, n, spec.vocab_size)
        gpu = sorted(({"kernel": ev.key[:90], "us": ev.device_time_total, "calls": ev.count}
                      for ev in prof.key_averages() if getattr(ev, "device_time_total", 0.0) > 0),
                     key=lambda r: -r["us"])
        gpu_ms = sum(r["us"] for r in gpu) / 1e3
        before = dict(engine.stats)
        time_ttft(engine, n, spec.vocab_size)
        path = next((k for k in ("graph_prefill", "piecewise", "eager") if engine.stats[f"{k}_steps"] > before[
            f"{k}_steps"]), "eager")
        m["ttft"][n] = {"ms": ms, "floor_ms": floor, "ratio": ms / floor, "flop_floor_ms": floors[0],
                        "read_floor_ms": floors[1], "gpu_kernels_ms": gpu_ms, "path": path, "kernels": gpu[:25]}
        if path == "piecewise":  # the same prompt with the piecewise graphs set aside: the eager step it replaces
            pieces, engine.runner.piece_graphs = engine.runner.piece_graphs, {}
            try:
                time_ttft(engine, n, spec.vocab_size)
                m["ttft"][n]["eager_ms"] = min(time_ttft(engine, n, spec.vocab_size) for _ in range(2))
            finally:
                engine.runner.piece_graphs = pieces
        eager = f", eager {m['ttft'][n]['eager_ms']:.1f} ms" if "eager_ms" in m["ttft"][n] else ""
        print(f"  ttft {n}: {ms:.1f} ms, floor {floor:.1f} ms, GPU kernels {gpu_ms:.1f} ms, {path}{eager}",
              flush=True)
        if args.profile:
            for k in gpu[:10]:
                print(f"    {k['us'] / 1e3:9.2f} ms {k['calls']:6d}x  {k['kernel']}")
            import cProfile
            import pstats

            host = cProfile.Profile()
            host.enable()
            time_ttft(engine, n, spec.vocab_size)
            host.disable()
            rows = [{"function": f"{Path(f).name}:{line}:{fn}", "ms": tt * 1e3, "calls": nc}
                    for (f, line, fn), (_, nc, tt, _, _) in pstats.Stats(host).stats.items()]
            m["ttft"][n]["host"] = sorted(rows, key=lambda r: -r["ms"])[:25]
            for h in m["ttft"][n]["host"][:8]:
                print(f"    host {h['ms']:7.2f} ms {h['calls']:6d}x  {h['function']}")
    m["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    del engine
    gc.collect()
    torch.cuda.empty_cache()
    return m


SPEC_PROMPTS = (
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n    return a * b\n",
    "- apples\n- pears\n- plums\n- apples\n- pears\n- plums\n- apples\n- pears\n- plums\n- apples\n",
    "for i in range(10):\n    print(i)\nfor j in range(10):\n    print(j)\nfor k in range(10):\n    print(k)\n",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28,",
)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


SPEC_CONTEXT = 2048
"""The speculation rows' context limit on CUDA (``spec_rows``' ``max_model_len``)."""

SPEC_PROMPT_ROOM = 128
"""Tokens ``check_spec_args`` leaves for a speculation prompt (``SPEC_PROMPTS``: about 100 characters) and the tokens
its request decodes while the others are prefilled."""


def spec_window(engine: Engine, bs: int, steps: int, device: str) -> dict:
    """``bs`` repetitive prompts decoding; ``steps`` engine steps timed: ms per step, tokens per stream per
    second, the verify forward alone (ms), accepted length over the window. The requests may generate up to the
    context limit (``decode_room``) and are aborted at the end, also when the window is refused.

    Raises:
        RuntimeError: a request finished or was preempted before the timed steps ended (the batch shrank)."""
    prompts = [SPEC_PROMPTS[i % len(SPEC_PROMPTS)] for i in range(bs)]
    room = min(decode_room(engine, p) for p in prompts)
    params = SamplingParams(temperature=0, max_tokens=room, ignore_eos=True)
    forward_ms: list[float] = []
    run = engine.runner.run

    def timed_run(*a, **kw):
        _sync(device)
        t = time.perf_counter()
        out = run(*a, **kw)
        _sync(device)
        forward_ms.append((time.perf_counter() - t) * 1e3)
        return out

    ids = [engine.add_request(p, params) for p in prompts]
    try:
        while prefilling(engine):
            engine.step()
        engine.runner.run = timed_run
        preemptions0 = engine.stats["preemptions"]
        for _ in range(3):  # warm-up of the verify buckets and the draft's steps
            engine.step()
        forward_ms.clear()
        stats0 = (engine.spec_stats.verify_steps, engine.spec_stats.draft_tokens, engine.spec_stats.accepted_tokens)
        graphs0 = engine.stats["graph_steps"]
        tokens = 0
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(steps):
            tokens += sum(len(o.new_token_ids) for o in engine.step())
        _sync(device)
        wall = time.perf_counter() - t0
        verify_steps = engine.spec_stats.verify_steps - stats0[0]
        accepted = engine.spec_stats.accepted_tokens - stats0[2]
        done, preempted = batch_losses(engine, ids, preemptions0)
        if done or preempted:
            raise RuntimeError(
                f"speculative window, batch {bs}: of {bs} requests {done} finished and {preempted} were preempted "
                f"before the timed steps ended, so the steps ran fewer; each may generate {room} tokens (the context "
                f"limit or the KV pool less its prompt), and the KV pool must hold the whole batch")
    finally:
        engine.runner.run = run
        for rid in ids:
            engine.abort(rid)
        while engine.has_unfinished():
            engine.step()
        engine.step()
    return {"step_ms": wall * 1e3 / steps, "forward_ms": sorted(forward_ms)[len(forward_ms) // 2],
            "tokens_per_s_per_stream": tokens / wall / bs, "graph_steps": engine.stats["graph_steps"] - graphs0,
            "accepted_length": (accepted + verify_steps) / verify_steps if verify_steps else 1.0,
            "verify_steps": verify_steps}


def verify_floor(engine: Engine, wb: dict, bs: int, k: int, ctx: float, ceil: dict) -> float:
    """Floor of a verify step, ms: the experts ``bs (k + 1)`` tokens touch, the dense weights, ``bs`` sequences'
    KV read once; or its FLOPs."""
    spec = engine.spec
    e, top = spec.num_experts, spec.top_k
    tokens = bs * (k + 1)
    touched = e * (1 - (1 - top / e) ** tokens)
    kv = bs * ctx * engine.kv.layout.bytes_per_token(engine.config.torch_dtype)
    nbytes = wb["dense"] + spec.num_moe_layers * touched * wb["expert"] + kv + tokens * wb["embed_row"]
    flops = 2 * (wb["dense"] / 2 + spec.num_moe_layers * top * wb["expert_params"]) * tokens
    return max(nbytes / ceil["copy_bytes_per_s"], flops / ceil["bf16_flop_per_s"]) * 1e3


def spec_rows(args, ceil: dict | None) -> list[dict]:
    """The speculation rows (see the module docstring)."""
    root = Path(tempfile.mkdtemp())
    if args.spec_model:
        d = Path(args.spec_model)
        load = "auto"
    else:
        d = checkpoint("qwen3-30b-a3b", None, root)
        load = "dummy"
    eagle = root / "eagle3"
    eagle.mkdir()
    shutil.copy(args.eagle3_config, eagle / "config.json")
    batches = [int(b) for b in args.spec_batches.split(",")]
    cuda = args.device == "cuda"
    base = dict(model=str(d), device=args.device, dtype="bfloat16" if cuda else "float32",
                expert_backend="triton" if cuda else "reference", load_format=load, max_num_seqs=max(batches),
                max_model_len=SPEC_CONTEXT if cuda else None, cuda_graph_max_bs=max(batches), enforce_eager=not cuda)
    runs = [("plain", None, 0)] + [(algo, eagle if algo == "eagle3" else None, k)
                                   for algo in ("ngram", "eagle3") for k in [int(x) for x in args.spec_k.split(",")]]
    out = []
    plain: dict[int, dict] = {}
    for algo, draft, k in runs:
        spec = {} if algo == "plain" else dict(speculative_algorithm=algo, speculative_num_tokens=k,
                                               speculative_draft_model=str(draft) if draft else None)
        engine = Engine(EngineConfig(**base, **spec))
        wb = weight_bytes(engine)
        for bs in batches:
            r = spec_window(engine, bs, args.spec_steps, args.device)
            r.update(algo=algo, k=k, bs=bs)
            ctx = PROMPT + 2 * args.spec_steps
            if ceil is not None:
                r["floor_ms"] = verify_floor(engine, wb, bs, k, ctx, ceil)
            if algo == "plain":
                plain[bs] = r
            else:
                r["verify_over_plain_step"] = r["forward_ms"] / plain[bs]["forward_ms"]
                r["speedup_per_stream"] = r["tokens_per_s_per_stream"] / plain[bs]["tokens_per_s_per_stream"]
            out.append(r)
            print(f"  {algo:6} K {k} bs {bs:3d}: accepted length {r['accepted_length']:.2f}, step {r['step_ms']:.2f} "
                  f"ms, forward {r['forward_ms']:.2f} ms, {r['tokens_per_s_per_stream']:.1f} tok/s per stream",
                  flush=True)
        del engine
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    shutil.rmtree(root, ignore_errors=True)
    return out


def print_spec_rows(rows: list[dict]) -> None:
    print(f"\n{'spec':7} {'K':>2} {'bs':>4} {'acc len':>7} {'fwd ms':>7} {'floor':>7} {'/floor':>6} {'/plain':>6} "
          f"{'tok/s/str':>9} {'x plain':>7}  target")
    for r in rows:
        floor = r.get("floor_ms")
        fl = f"{floor:7.2f} {r['forward_ms'] / floor:6.2f}" if floor else f"{'-':>7} {'-':>6}"
        if r["algo"] == "plain":
            print(f"{'plain':7} {'-':>2} {r['bs']:4d} {'-':>7} {r['forward_ms']:7.2f} {fl} {'-':>6} "
                  f"{r['tokens_per_s_per_stream']:9.1f} {'-':>7}")
            continue
        checks = []
        if r["bs"] == 1 and r["k"] <= 3:
            checks.append("verify <= 1.3x plain: " + ("yes" if r["verify_over_plain_step"] <= 1.3 else "NO"))
        if r["bs"] == 1 and r["accepted_length"] >= 2:
            checks.append("not slower: " + ("yes" if r["speedup_per_stream"] >= 1 else "NO"))
        print(f"{r['algo']:7} {r['k']:2d} {r['bs']:4d} {r['accepted_length']:7.2f} {r['forward_ms']:7.2f} {fl} "
              f"{r['verify_over_plain_step']:6.2f} {r['tokens_per_s_per_stream']:9.1f} {r['speedup_per_stream']:7.2f}  "
              f"{'; '.join(checks)}")


def check_spec_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The speculation rows' flags (``--spec`` or ``--device cpu``): a bad one is an argparse error naming it."""
    if not (args.spec or args.device == "cpu"):
        return
    rows = "--device cpu" if args.device == "cpu" else "--spec"
    for flag in ("models", "batches", "expert_format", "context", "ttft", "peer", "profile", "env_variants"):
        if getattr(args, flag) != ap.get_default(flag):
            ap.error(f"{rows} runs only the speculation rows (on --spec-model, with an EAGLE-3 head for it: "
                     f"--eagle3-config); --{flag.replace('_', '-')} is for the decode rows and would be ignored")
    if args.device == "cpu" and not args.spec_model:
        ap.error("--device cpu needs --spec-model DIR (a small checkpoint; and --eagle3-config, an EAGLE-3 head's "
                 "config.json for it): the default target is the full-size Qwen3-30B-A3B")
    if args.spec_model and not (Path(args.spec_model) / "config.json").is_file():
        ap.error(f"--spec-model {args.spec_model!r} is not a checkpoint directory (no config.json)")
    if not Path(args.eagle3_config).is_file():
        ap.error(f"--eagle3-config {args.eagle3_config!r} is not a file")
    for flag, text, high in (("--spec-batches", args.spec_batches, None), ("--spec-k", args.spec_k, 16)):
        try:
            values = [int(v) for v in text.split(",")]
        except ValueError:
            ap.error(f"{flag} must be comma-separated integers, got {text!r}")
        if any(v < 1 or (high is not None and v > high) for v in values):
            ap.error(f"{flag} values must be integers >= 1{f' and <= {high}' if high else ''}, got {text!r}")
    if args.spec_steps < 1:
        ap.error(f"--spec-steps must be at least 1, got {args.spec_steps}")
    target = json.loads((Path(args.spec_model) / "config.json").read_text()) if args.spec_model else None
    context = SPEC_CONTEXT if args.device == "cuda" else target.get("max_position_embeddings", SPEC_CONTEXT)
    k = max(int(v) for v in args.spec_k.split(","))
    tokens = (k + 1) * (args.spec_steps + 3)
    if tokens + SPEC_PROMPT_ROOM > context:
        ap.error(f"--spec-steps {args.spec_steps} with --spec-k up to {k} may generate {tokens} tokens a request in a "
                 f"window (its 3 warm-up steps included), more than fit the speculation rows' context of {context} "
                 f"tokens past a prompt of up to {SPEC_PROMPT_ROOM}")
    if args.spec_model:  # the EAGLE-3 head reads the target's hidden states and token ids (engine.eagle3)
        draft = json.loads(Path(args.eagle3_config).read_text())
        target = target.get("text_config", target)
        for field in ("hidden_size", "vocab_size"):
            if draft.get(field) != target.get(field):
                ap.error(f"--eagle3-config {args.eagle3_config!r} has {field} {draft.get(field)!r}, --spec-model "
                         f"{args.spec_model!r} {target.get(field)!r}: the EAGLE-3 head must be one for that model")


def check_env_variants(ap: argparse.ArgumentParser, text: str) -> None:
    """``--env-variants``: ';'-separated variants, each space-separated ``NAME=VALUE`` settings (an argparse error
    naming the first bad one, before anything is measured)."""
    for variant in (v for v in text.split(";") if v.strip()):
        for setting in variant.split():
            name, eq, _ = setting.partition("=")
            if not eq or not name.isidentifier():
                ap.error(f"--env-variants: {setting!r} in {variant!r} is not NAME=VALUE")


def int_list(text: str) -> list[int]:
    """``"1,8"`` -> ``[1, 8]``; ``""`` -> ``[]``.

    Raises:
        ValueError: an item that is not an integer."""
    return [int(v) for v in text.split(",")] if text else []


def peer_modes(args: argparse.Namespace) -> list[str]:
    """The transformers modes ``--peer`` asks for, in its order."""
    return [m for m in args.peer.split(",") if m != "none"]


def peer_batch_lists(text: str, modes: list[str]) -> dict[str, list[int]]:
    """``--peer-batches``: one list for every peer mode (``"1,8"``) or one per mode (``"static=1,8;eager=64,256"``,
    a mode left out is not timed) -> ``{mode: [batch, ...]}`` over ``modes`` (``{}`` when there is none).

    Raises:
        ValueError: a mode not in ``modes`` or given twice, a part without ``=`` among parts with one, a batch that
            is not an integer >= 1, or one repeated in a list."""
    if not modes:
        return {}
    per_mode = "=" in text
    parts = {} if per_mode else {m: text for m in modes}
    for part in filter(None, (p.strip() for p in text.split(";"))) if per_mode else ():
        mode, sep, batches = (v.strip() for v in part.partition("="))
        if not sep or mode not in modes:
            raise ValueError(f"{part!r} is not MODE=BATCHES with MODE one of the --peer modes {modes}")
        if mode in parts:
            raise ValueError(f"{mode} is given batches twice")
        parts[mode] = batches
    lists = {}
    for mode, batches in parts.items():
        what = f"{mode}'s batches" if per_mode else "the batches"
        try:
            lists[mode] = int_list(batches.strip())
        except ValueError:
            raise ValueError(f"{what} must be comma-separated integers, got {batches!r}") from None
        if not lists[mode] or any(v < 1 for v in lists[mode]) or len(set(lists[mode])) != len(lists[mode]):
            raise ValueError(f"{what} must be distinct integers >= 1, at least one, got {batches!r}")
    return lists


def check_decode_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The decode rows' flags (and the models, peers and TTFT sizes they run with): a bad one is an argparse error
    naming it, before anything is measured."""
    if args.steps < 1:
        ap.error(f"--steps must be at least 1, got {args.steps}")
    unknown = [f for f in args.expert_format.split(",") if f not in ("bf16", "int4", "mxfp4", "fp8")]
    if unknown:
        ap.error(f"--expert-format takes bf16, int4, mxfp4 or fp8 (comma-separated), got {unknown} in "
                 f"{args.expert_format!r}")
    lists = {}
    for flag, text in (("--batches", args.batches), ("--profile", args.profile),
                       ("--sequential-batches", args.sequential_batches), ("--ttft", args.ttft)):
        if not text and flag == "--batches":
            ap.error(f"{flag} must name at least one batch size")
        try:
            lists[flag] = int_list(text)
        except ValueError:
            ap.error(f"{flag} must be comma-separated integers, got {text!r}")
        if any(v < 1 for v in lists[flag]):
            ap.error(f"{flag} values must be integers >= 1, got {text!r}")
        if len(set(lists[flag])) != len(lists[flag]):
            ap.error(f"{flag} repeats a value, got {text!r}")
    for flag in ("--profile", "--sequential-batches"):
        extra = sorted(set(lists[flag]) - set(lists["--batches"]))
        if extra:
            ap.error(f"{flag} {extra} are not among --batches {args.batches!r}")
    if lists["--profile"] and args.profile_steps < 1:
        ap.error(f"--profile-steps must be at least 1, got {args.profile_steps}")
    measured = args.steps + (2 * args.profile_steps if lists["--profile"] else 0) + ROUTING_STEPS
    room = context_limit(args.context) - args.context - CONTEXT_MARGIN // 2
    if measured > room:
        ap.error(f"--steps {args.steps} (with the profile and routing steps: {measured} a row) is more than fit the "
                 f"context limit past a {args.context}-token prompt ({room}; the rest is for requests that decode "
                 f"while others are prefilled)")
    limit = context_limit(args.context)
    long = [n for n in lists["--ttft"] if n >= limit]
    if long:
        ap.error(f"--ttft {long} leave no room in the engine's context of {limit} tokens (max_model_len: 8192, or "
                 f"--context {args.context} plus {CONTEXT_MARGIN}); each TTFT prompt must be shorter")
    peer = args.peer.split(",")
    if any(m not in ("eager", "static", "none") for m in peer) or len(set(peer)) != len(peer) or (
            "none" in peer and len(peer) > 1):
        ap.error(f"--peer takes eager and/or static (each once), or none, got {args.peer!r}")
    try:
        peer_lists = peer_batch_lists(args.peer_batches, peer_modes(args))
    except ValueError as e:
        ap.error(f"--peer-batches {args.peer_batches!r}: {e}")
    extra = sorted({b for v in peer_lists.values() for b in v} - set(lists["--batches"]))
    if extra:
        ap.error(f"--peer-batches {extra} are not among --batches {args.batches!r} (the table compares the peer "
                 f"with the engine's rows)")
    known = model_names()
    missing = [m for m in args.models.split(",") if m not in known]
    if missing:
        ap.error(f"--models {missing} have no model config under {CONFIGS} (known: {', '.join(known)})")
    for flag, value in (("--deepseek-layers", args.deepseek_layers), ("--kimi-layers", args.kimi_layers)):
        if value < 1:
            ap.error(f"{flag} must be at least 1, got {value}")


def model_names() -> list[str]:
    """The models ``--models`` takes: the ``data/configs`` files of MoE models (not the EAGLE-3 drafts'), by name."""
    return sorted(f.name.removesuffix(".config.json") for f in CONFIGS.glob("*.config.json")
                  if not f.name.startswith("eagle3-draft-"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "),
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--models", default="qwen3-30b-a3b,deepseek-v3",
                    help="configs of data/configs to build with dummy weights, comma-separated, among: "
                         + ", ".join(model_names()))
    ap.add_argument("--batches", default="1,8,64,256", help="decode batch sizes timed (TPOT rows)")
    ap.add_argument("--steps", type=int, default=32, help="decode steps timed a batch size")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="sampling temperature of the decode rows' requests (0: greedy)")
    ap.add_argument("--context", type=int, default=PROMPT,
                    help="prompt tokens of every decode row's requests (the step's context is about this plus the "
                         "steps)")
    ap.add_argument("--ttft", default="1024,4096", help="prompt lengths whose time to first token is measured, "
                                                        "e.g. 1024,4096 ('' for none); each shorter than the "
                                                        "engine's context (8192, or --context plus 512)")
    ap.add_argument("--ttft-routing", choices=("uniform_random", "model"), default="uniform_random",
                    help="how the TTFT prompts' tokens pick their experts: uniform_random (default; an engine "
                         "with --moe-routing-simulation uniform_random, built after the decode rows) or model (the "
                         "dummy gates, under which one prompt's tokens come to route alike layer by layer)")
    ap.add_argument("--deepseek-layers", type=int, default=7,
                    help="DeepSeek-V3 decoder layers (the first three dense), as many as fit one GPU")
    ap.add_argument("--kimi-layers", type=int, default=4,
                    help="Kimi-K2.5 decoder layers (4: the dense one and 3 MoE layers, 100.6 GiB in bf16; 5 take "
                         "132.4 GiB, over the engine's mem_fraction_static 0.9 of an H200)")
    ap.add_argument("--expert-format", default="bf16",
                    help="the published routed-expert formats to keep, comma-separated: a model whose config.json "
                         "names one of them (int4: Kimi-K2.5's INT4, mxfp4: gpt-oss's MXFP4, fp8: DeepSeek-V3's "
                         "block FP8) gets dummy experts in it, every other model bf16 experts (bf16 alone: every "
                         "model in bf16)")
    ap.add_argument("--peer", default="eager,static", help="transformers modes to time: eager, static, none")
    ap.add_argument("--peer-batches", default="1,8,64,256",
                    help="batch sizes (among --batches) the peer is timed at, for every --peer mode (1,8) or per "
                         "mode (static=1,8;eager=64,256: a mode left out is not timed)")
    ap.add_argument("--sequential-batches", default="",
                    help="batch sizes also timed without the overlap schedule, e.g. 1,64")
    ap.add_argument("--profile", default="", help="batch sizes whose kernels are profiled, e.g. 1,64; with any, "
                                                  "each --ttft prompt's kernels and host time are profiled too")
    ap.add_argument("--profile-steps", type=int, default=5,
                    help="decode steps each profile covers (its idle time includes the first step's launch)")
    ap.add_argument("--env-variants", default="",
                    help="';'-separated environment settings, each timed as a second engine in the same run after "
                         "the main rows, e.g. 'EPMOE_PDL=0'")
    ap.add_argument("--out", default="benchmarks/results",
                    help="folder the results JSON (engine_<gpu>.json) is written to")
    ap.add_argument("--replan-ttft", metavar="ROWS.json",
                    help="no GPU: re-price the measured TTFT rows the file lists with this commit's planner and fit "
                         "the profiles' engine_prefill_layer_us (writes ttft_replan.json under --out)")
    ap.add_argument("--spec", action="store_true", help="only the speculation rows")
    ap.add_argument("--spec-model", default=None, help="checkpoint of the speculation rows (None: Qwen3-30B-A3B, "
                                                      "dummy weights)")
    ap.add_argument("--eagle3-config",
                    default=os.path.relpath(CONFIGS / "eagle3-draft-qwen3-30b-a3b-specforge.config.json"),
                    help="config.json of the EAGLE-3 draft of the speculation rows (random weights)")
    ap.add_argument("--spec-batches", default="1,16", help="batch sizes of the speculation rows")
    ap.add_argument("--spec-k", default="1,3", help="draft tokens a step of the speculation rows")
    ap.add_argument("--spec-steps", type=int, default=24, help="decode steps timed a speculation row")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: the speculation rows only")
    args = ap.parse_args()
    if args.context < 1:
        ap.error(f"--context must be at least 1 prompt token, got {args.context}")
    if not math.isfinite(args.temperature) or args.temperature < 0:
        ap.error(f"--temperature must be a finite number >= 0, got {args.temperature}")
    check_spec_args(ap, args)
    check_decode_args(ap, args)
    check_env_variants(ap, args.env_variants)
    if Path(args.out).exists() and not Path(args.out).is_dir():
        ap.error(f"--out {args.out!r} is a file; it names the folder the results are written to")
    if args.replan_ttft:
        try:
            replan_ttft(Path(args.replan_ttft), Path(args.out))
        except (ValueError, KeyError, OSError) as exc:
            ap.error(f"--replan-ttft: {exc}")
        return
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda (the default): no CUDA device here; the decode, TTFT, peer and speculation rows on "
                 "CUDA need one (on CPU the speculation rows run: --device cpu --spec-model DIR)")
    if args.spec or args.device == "cpu":
        ceil = measure_ceilings() if args.device == "cuda" else None
        rows = spec_rows(args, ceil)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        name = gpu_file_name(torch.cuda.get_device_name()) if args.device == "cuda" else "cpu"
        (out / f"engine_spec_{name}.json").write_text(json.dumps({"ceilings": ceil, "rows": rows}, indent=2))
        print_spec_rows(rows)
        return
    batches = int_list(args.batches)
    ceil = measure_ceilings()
    print(f"ceilings: copy {ceil['copy_bytes_per_s'] / 1e12:.2f} TB/s, "
          f"bf16 {ceil['bf16_flop_per_s'] / 1e12:.0f} TFLOP/s", flush=True)
    root = Path(tempfile.mkdtemp())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    gpu = gpu_file_name(torch.cuda.get_device_name())
    result = {"gpu": torch.cuda.get_device_name(), "ceilings": ceil, "models": {}}

    def save() -> None:
        (out / f"engine_{gpu}.json").write_text(json.dumps(result, indent=2, default=str))

    rows = []
    fit_rows: list[dict] = []
    ttft_fit_rows: list[dict] = []
    for name in args.models.split(","):
        layers = {"deepseek": args.deepseek_layers, "kimi": args.kimi_layers}.get(name.split("-")[0])
        d = checkpoint(name, layers, root, args.expert_format)
        m = measure_engine(name, d, batches, args, ceil)
        kept = published_format(name) in args.expert_format.split(",")
        plan_ms = planned(d, batches, m["rows"][batches[0]]["ctx"], None if kept else "bf16",
                          profile_of(torch.cuda.get_device_name()))
        m["plan_ms"] = {b: v[0] for b, v in plan_ms.items()}
        m["plan_engine_ms"] = {b: v[1] for b, v in plan_ms.items()}
        if m["ttft"]:
            for n, (total, layer_part) in planned_ttft(d, list(m["ttft"]), None if kept else "bf16",
                                                       profile_of(torch.cuda.get_device_name())).items():
                m["ttft"][n]["plan_ms"] = total
                ttft_fit_rows.append({"ttft_ms": m["ttft"][n]["ms"], "roofline_ms": total - layer_part,
                                      "layers": m["layers"]})
        # a step faster than the plan's roofline read fewer bytes than the plan prices (fewer experts than uniform
        # routing touches): it says nothing of the engine's own costs, so it is left out of the fit
        fit_rows += [{"tpot_ms": m["rows"][b]["tpot_ms"], "roofline_ms": v[0] - v[1], "layers": m["layers"], "bs": b}
                     for b, v in plan_ms.items() if m["rows"][b]["tpot_ms"] > v[0] - v[1]]
        m["peer"] = {}
        result["models"][name] = m
        m["variants"] = {v.strip(): measure_variant(d, batches, args, v.strip())
                         for v in args.env_variants.split(";") if v.strip()}
        save()
        for mode, peer_batches in peer_batch_lists(args.peer_batches, peer_modes(args)).items():
            m["peer"][mode] = {}
            peer(d, peer_batches, mode, 16, m["peer"][mode], save, args.context)
            print(f"  peer {mode}: {m['peer'][mode]}", flush=True)
        for bs, r in m["rows"].items():
            times = [v[bs] for v in m["peer"].values() if isinstance(v.get(bs), float)]
            rows.append((name, bs, r["tpot_ms"], r["floor_ms"], min(times) if times else None, m["plan_ms"][bs],
                         r["experts_touched_measured"], r["experts_touched_per_layer"]))
    shutil.rmtree(root, ignore_errors=True)
    if len(fit_rows) >= 3:
        result["engine_fit"] = fit_engine_terms(fit_rows)
        save()
    if len(ttft_fit_rows) >= 2:
        result["ttft_fit"] = fit_prefill_term(ttft_fit_rows)
        save()
    print(f"\n{'model':14} {'bs':>4} {'TPOT ms':>8} {'floor':>7} {'/floor':>6} {'peer ms':>8} {'peer/us':>7} "
          f"{'plan ms':>8} {'us/plan':>7} {'experts':>7} {'uniform':>7}")
    for model, bs, t, f, p, pl, touched, uniform in rows:
        ps = f"{p:8.2f} {p / t:7.2f}" if p else f"{'-':>8} {'-':>7}"
        ts = f"{touched:7.1f}" if touched is not None else f"{'-':>7}"
        print(f"{model:14} {bs:4d} {t:8.2f} {f:7.2f} {t / f:6.2f} {ps} {pl:8.2f} {t / pl:7.2f} {ts} {uniform:7.1f}")
    for model, m in result["models"].items():
        for variant, tpot in m.get("variants", {}).items():
            print(f"{model:14} with {variant}: " + ", ".join(
                f"bs {b} {t:.2f} ms ({t / m['rows'][b]['tpot_ms']:.2f}x the rows above)" for b, t in tpot.items()))
        kv = m["kv"]
        print(f"{model:14} KV per token and layer: {kv['bytes_per_token_layer']} B ({kv['kind']}; expanded per-head "
              f"keys and values: {kv['expanded_bytes_per_token_layer']} B)")
        for n, r in m["ttft"].items():
            eager = f", eager step {r['eager_ms']:.1f} ms" if "eager_ms" in r else ""
            print(f"{model:14} TTFT {n}: {r['ms']:.1f} ms {r.get('path', '')} (GPU kernels {r['gpu_kernels_ms']:.1f} "
                  f"ms{eager}), routing {m['ttft_routing']}, floor {r['floor_ms']:.1f} ms (FLOPs "
                  f"{r['flop_floor_ms']:.1f}, weight reads {r['read_floor_ms']:.1f}), "
                  f"ratio {r['ratio']:.2f}; plan {r['plan_ms']:.1f} ms "
                  f"({r['ms'] / r['plan_ms']:.2f}x); peak {m['peak_gib']:.1f} GiB")
    if "ttft_fit" in result:
        fit = result["ttft_fit"]
        print(f"prefill term fitted to the {len(fit['ratios_after'])} TTFT rows: "
              f"{fit['engine_prefill_layer_us']:.0f} us a layer; measured / planned after: "
              f"{min(fit['ratios_after']):.2f}-{max(fit['ratios_after']):.2f}")
    if "engine_fit" in result:
        fit = result["engine_fit"]
        print(f"engine terms fitted to the {len(fit['ratios_after'])} rows above their roofline: step "
              f"{fit['engine_step_us']:.0f} us, layer "
              f"{fit['engine_layer_step_us']:.1f} us, sequence {fit['engine_seq_step_us']:.1f} us; measured / "
              f"planned after: {min(fit['ratios_after']):.2f}-{max(fit['ratios_after']):.2f}")


if __name__ == "__main__":
    main()
