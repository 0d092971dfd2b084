"""``epmoe run``: generate with an expert-parallel model across ranks and check it against transformers.

``run_job(RunConfig)`` is the whole main job: resolve the checkpoint (building the built-in small
Kimi-K2.5-architecture one on first use), start the EP ranks (``spawn``) or join ``torchrun``'s, start
an ``epmoe.engine.Engine`` on each (its share of the experts, a paged KV cache, CUDA graphs on GPUs),
generate with continuous batching (prompt ``i`` on rank ``i mod N``, arriving at ``--request-rate``),
run the unsharded transformers model on the same prompts (greedy runs), and return a ``RunReport``.
"""

from __future__ import annotations

import re
import resource
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from epmoe.balance import rank_balancedness
from epmoe.checks import check_arrival_span, valid_seed
from epmoe.comm import COLLECTIVE_KINDS, Comm
from epmoe.engine import Engine, EngineConfig, SamplingParams
from epmoe.engine.config import (
    COMMAND_DTYPES,
    COMMAND_FLAGS,
    DTYPES,
    EAGER_DISPATCHERS,
    PARALLEL_MODES,
    command_dtype,
    command_engine_config,
)
from epmoe.engine.group import check_group
from epmoe.engine.sampling import GREEDY_BELOW
from epmoe.engine.tokenizer import check_generation_config, decode_text, encode_text, generation_config, load_tokenizer
from epmoe.experts import describe_expert_backend
from epmoe.experts.storage import held_as
from epmoe.experts.switches import check_switches, switched_off
from epmoe.memory import free_bytes
from epmoe.models.checkpoint import CheckpointReader, check_index_for_transformers
from epmoe.models.hf import hf_config, needs_own_loader
from epmoe.models.tiny import ensure_default_checkpoint
from epmoe.plan.costs import model_params
from epmoe.plan.request import counted, format_bytes
from epmoe.runtime.launch import RankInfo, check_gpus, init_group, spawn, torchrun_rank_info, under_torchrun
from epmoe.runtime.near_tie import Divergence, exchanged, first_difference, measure, probe, router_ties
from epmoe.runtime.report import RankReport, RunReport, judge_mismatches
from epmoe.spec import MoESpec, check_checkpoint_dir, load_moe_spec

DEFAULT_PROMPTS = (
    "Expert parallelism places whole experts on ranks",
    "The quick brown fox",
    "def all_to_all(x):",
    "Mixture of experts",
)


@dataclass(frozen=True)
class RunConfig:
    """Options of ``epmoe run`` (the CLI parses into this).

    Attributes:
        model: checkpoint directory; ``None`` = the built-in small Kimi-K2.5-architecture checkpoint.
        ep: EP ranks to spawn (ignored under torchrun, which sets the world size); with ``parallel='tp'``, the
            TP ranks.
        parallel: ``ep`` (experts expert-parallel) or ``tp`` (experts tensor-parallel: the baseline; no
            placement, dispatcher or EPLB options); attention is data-parallel in both.
        device: ``cpu`` (gloo) or ``cuda`` (NCCL).
        placement: placement file (JSON or safetensors); ``None`` = contiguous trivial placement.
        redundant: redundant slots per layer for the trivial placement.
        layout: trivial placement layout, ``contiguous`` or ``round_robin``.
        prompts: prompt strings; empty = the built-in ones.
        max_new_tokens: most tokens generated per prompt (fewer when the model emits EOS).
        dtype: ``auto`` (``engine.config.command_dtype``: float32 on CPU, on CUDA the checkpoint's bf16/fp16),
            ``float32``, ``bfloat16`` or ``float16``.
        dispatcher: dispatcher of eager steps (``all_to_all``; ``local`` for EP 1); ``None`` = the
            engine's choice. Graph-replayed decode steps use ``fixed_capacity`` on several ranks.
        expert_backend: expert compute backend name; ``None`` = ``triton`` on CUDA in bf16/fp16, ``reference`` on CPU
            and in float32.
        reference: run the unsharded transformers model and compare tokens (greedy runs only).
        eplb_interval: rebalance every this many engine steps from the recorded loads (0 = never).
        eplb_max_moves: most expert copies one rebalance may move (``None`` = as few as reach the target).
        replica_policy: how a token picks among an expert's copies (``static``, ``round_robin``, ``random``).
        moe_routing_simulation: ``None`` or ``uniform_random`` (``EngineConfig``; no reference check then).
        trust_remote_code: run a tokenizer shipped as code with the checkpoint (``EngineConfig``).
        save_loads: write the tokens routed per logical expert ``[L, E]`` (all ranks, the whole run) to this
            file, in the format ``epmoe balance --loads`` reads (``None``: not written).
        cache_dir: where the built-in checkpoint is cached.
        max_num_seqs: most sequences running at once per rank.
        max_num_batched_tokens: most tokens per step per rank (longer prompts are chunked).
        request_rate: prompts per second arriving on each rank (staggered arrival); ``None`` = all at once.
        temperature, top_p, top_k, seed: sampling (``temperature`` 0 = greedy, the default).
        cuda_graph_max_bs: largest decode batch replayed as a CUDA graph.
        cuda_graph_max_tokens: prompt chunks ending within this many tokens run in the replayed steps too
            (``EngineConfig``).
        piecewise_cuda_graph_max_tokens: steps of up to this many rows with longer chunks replay piecewise graphs
            (``EngineConfig``).
        enforce_eager: no CUDA graphs (float32 runs on CUDA are always eager: the graph-safe expert
            kernels compute in bf16/fp16).
        disable_overlap_schedule: read each step's tokens back before planning the next (``EngineConfig``).
        enable_prefix_caching: share computed KV blocks between prompts with a common prefix; ``None`` = on unless
            a draft model proposes (``EngineConfig``).
        load_format: ``auto`` or ``dummy`` (random weights; no reference check).
        num_kv_blocks: KV blocks per layer (``None`` = sized from memory).
        block_size: tokens per KV block.
        max_model_len: longest sequence (prompt + output); ``None`` = the model's context (``EngineConfig``).
        mem_fraction_static: on CUDA, the fraction of the GPU's memory for weights and KV cache (``EngineConfig``).
        speculative_algorithm, speculative_draft_model, speculative_num_tokens, speculative_draft_placement,
            speculative_draft_parallel, prompt_lookup_min, prompt_lookup_max: speculative decoding
            (``EngineConfig``'s fields of the same names).
    """

    model: str | None = None
    ep: int = 2
    parallel: str = "ep"
    device: str = "cpu"
    placement: str | None = None
    redundant: int = 0
    layout: str = "contiguous"
    prompts: tuple[str, ...] = ()
    max_new_tokens: int = 8
    dtype: str = "auto"
    dispatcher: str | None = None
    expert_backend: str | None = None
    reference: bool = True
    eplb_interval: int = 0
    eplb_max_moves: int | None = None
    replica_policy: str = "static"
    moe_routing_simulation: str | None = None
    trust_remote_code: bool = False
    save_loads: str | None = None
    cache_dir: str | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    request_rate: float | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    cuda_graph_max_bs: int = 256
    cuda_graph_max_tokens: int = 512
    piecewise_cuda_graph_max_tokens: int = 8192
    enforce_eager: bool = False
    disable_overlap_schedule: bool = False
    enable_prefix_caching: bool | None = None
    load_format: str = "auto"
    num_kv_blocks: int | None = None
    block_size: int = 16
    max_model_len: int | None = None
    mem_fraction_static: float = 0.9
    speculative_algorithm: str | None = None
    speculative_draft_model: str | None = None
    speculative_num_tokens: int | None = None
    speculative_draft_placement: str | None = None
    speculative_draft_parallel: str = "ep"
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first bad option (the engine checks the rest per rank)."""
        if self.ep < 1:
            raise ValueError(f"--ep must be an integer >= 1, got {self.ep}")
        if self.parallel not in PARALLEL_MODES:
            raise ValueError(f"--parallel must be one of {PARALLEL_MODES}, got {self.parallel!r}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"--device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda asked for, but CUDA is not available on this machine")
        if self.max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens must be at least 1, got {self.max_new_tokens}")
        if self.dtype not in COMMAND_DTYPES:
            raise ValueError(f"--dtype must be one of {list(COMMAND_DTYPES)}, got {self.dtype!r}")
        if self.redundant < 0:
            raise ValueError(f"--redundant must be non-negative, got {self.redundant}")
        if self.eplb_interval < 0:
            raise ValueError(f"--eplb-interval must be non-negative, got {self.eplb_interval}")
        if self.eplb_max_moves is not None and self.eplb_max_moves < 0:
            raise ValueError(f"--max-moves must be non-negative, got {self.eplb_max_moves}")
        check_switches()
        if self.request_rate is not None and not self.request_rate > 0:
            raise ValueError(f"--request-rate must be a positive number of requests per second, "
                             f"got {self.request_rate}")
        from epmoe.experts import EXPERT_BACKENDS

        if self.dispatcher == "fixed_capacity":
            raise ValueError("--dispatcher fixed_capacity is what the engine's CUDA-graph decode steps use on several "
                             "ranks already; the eager steps need all_to_all (or local on one rank)")
        if self.dispatcher is not None and self.dispatcher not in EAGER_DISPATCHERS:
            raise ValueError(f"--dispatcher {self.dispatcher!r} is not one of {list(EAGER_DISPATCHERS)}")
        if self.expert_backend is not None and self.expert_backend not in EXPERT_BACKENDS:
            raise ValueError(f"--expert-backend {self.expert_backend!r} is not one of {sorted(EXPERT_BACKENDS)}")
        if self.model is not None:
            check_checkpoint_dir(self.model, "--model")
        if any(not p for p in self.prompts):
            raise ValueError("--prompt must not be empty")
        if self.save_loads is not None:
            from epmoe.files import check_output_path

            if self.parallel == "tp":
                raise ValueError("--save-loads records expert loads of --parallel ep; tp computes every expert on "
                                 "every rank")
            suffix = Path(self.save_loads).suffix
            if suffix not in (".json", ".safetensors"):
                raise ValueError(f"--save-loads {self.save_loads!r}: loads are written as .json or .safetensors, not "
                                 f"{suffix or 'a file without a suffix'!r}"
                                 + (" (the CSV form is the OLMoE routing counts)" if suffix == ".csv" else ""))
            check_output_path("--save-loads", self.save_loads, "a loads file path (.json or .safetensors)")
        for p in self.prompts:
            try:
                p.encode()
            except UnicodeEncodeError as exc:  # command-line bytes that are not UTF-8 arrive as lone surrogates
                raw, at = p.encode(errors="surrogateescape"), len(p[:exc.start].encode(errors="surrogateescape"))
                shown = repr(raw) if len(raw) <= 40 else f"{raw[:40]!r}... ({len(raw)} bytes)"
                raise ValueError(f"--prompt {shown} is not valid UTF-8 text (byte {raw[at]:#04x} at position {at}); "
                                 f"pass prompts in UTF-8") from None
        if self.seed is not None and not valid_seed(self.seed):  # None: unset, which no flag spells
            raise ValueError(f"seed must be an integer in [0, 2**63), got {self.seed!r}")
        self.sampling()

    def sampling(self, prompt: int = 0) -> SamplingParams:
        """The sampling options of prompt ``prompt`` (its index in the run): with ``--seed`` its own seed,
        ``(seed + prompt) mod 2**63``, so that prompts draw apart (as ``epmoe serve`` seeds a request's choices)
        and a rerun draws the same.

        Raises:
            ValueError: a bad sampling value (named).
        """
        seed = None if self.seed is None else (self.seed + prompt) % 2**63
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, seed=seed,
                              max_tokens=self.max_new_tokens)

    def engine_config(self, model_dir: str) -> EngineConfig:
        """The engine's options for ``model_dir`` (``command_engine_config``; the sampling seed seeds the dummy
        weights and unseeded sampling too).

        Raises:
            ValueError: a bad engine option (named).
        """
        return command_engine_config(self, model_dir, seed=self.seed or 0)


def _encode(model_dir: str, prompts: list[str], trust_remote_code: bool) -> tuple[list[list[int]], object | None]:
    """Token ids of the prompts and the tokenizer (``None``: raw UTF-8 bytes modulo the vocabulary)."""
    vocab = load_moe_spec(model_dir).vocab_size
    tok = load_tokenizer(model_dir, trust_remote_code)
    return [encode_text(tok, vocab, p) for p in prompts], tok


def _check_context(spec: MoESpec, all_ids: list[list[int]], max_new_tokens: int, max_model_len: int | None) -> None:
    """Refuse prompts that with ``max_new_tokens`` would run past ``max_model_len`` (``--max-model-len``), or past
    the model's ``max_position_embeddings`` when it is not given."""
    limit = spec.max_position_embeddings if max_model_len is None else max_model_len
    what = (f"the model's max_position_embeddings ({limit})" if max_model_len is None else
            f"--max-model-len ({limit})")
    longest = max(len(ids) for ids in all_ids) + max_new_tokens
    if longest > limit:
        raise ValueError(
            f"the longest prompt ({counted(longest - max_new_tokens, 'token')}) plus --max-new-tokens "
            f"({max_new_tokens}) is {longest} positions, past {what}"
        )


def _peak_memory(device: str) -> tuple[float, float]:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    cuda = torch.cuda.max_memory_allocated() / 2**20 if device == "cuda" else 0.0
    return rss, cuda


def _rank_worker(
    info: RankInfo, cfg: RunConfig, model_dir: str, all_ids: list[list[int]], gather: bool = False,
    progress: bool = False,
) -> RankReport | list[RankReport] | None:
    """One EP rank: start its engine, generate its share of the prompts, report. With ``gather``
    (torchrun), rank 0 returns every rank's report (collected over the EP group), the others ``None``.
    With ``progress``, rank 0 draws progress bars (loading, then tokens generated)."""
    group = init_group(info, cfg.device)
    try:
        comm = Comm(group)
        if cfg.device == "cuda":
            torch.cuda.set_device(info.local_rank)
        mine = list(range(comm.rank, len(all_ids), comm.size))
        show = progress and comm.rank == 0
        report = _serve_share(cfg, model_dir, all_ids, mine, comm, show)
        if not gather:
            return report
        gathered: list | None = [None] * comm.size if comm.rank == 0 else None
        torch.distributed.gather_object(report, gathered, dst=0, group=group)
        return gathered
    finally:
        torch.distributed.destroy_process_group()


def _serve_share(cfg: RunConfig, model_dir: str, all_ids: list[list[int]], mine: list[int], comm: Comm,
                 show: bool) -> RankReport:
    from rich.console import Console
    from rich.progress import Progress

    # on stderr, as the reference's: stdout holds the report (``--json -``: the JSON alone)
    with Progress(transient=True, disable=not show, console=Console(stderr=True)) as bar:
        task = bar.add_task("loading the model", total=None)
        engine = Engine(cfg.engine_config(model_dir), comm, progress=lambda msg: bar.update(task, description=msg))
        if show and engine.proposer is not None:
            bar.console.print(f"speculative decoding, K = {engine.num_spec_tokens}: {engine.proposer.describe()}")
        bar.update(task, description="generating (tokens, rank 0)", total=len(mine) * cfg.max_new_tokens,
                   completed=0)
        arrivals = [k / cfg.request_rate for k in range(len(mine))] if cfg.request_rate else None
        mark = comm.stats.snapshot()
        steps0 = engine.num_steps
        t0 = time.perf_counter()
        outs = engine.generate([all_ids[i] for i in mine], [cfg.sampling(i) for i in mine], arrivals,
                               on_output=lambda o: bar.advance(task, len(o.new_token_ids)))
        if cfg.device == "cuda":
            torch.cuda.synchronize()
        gen_s = time.perf_counter() - t0
    steps = max(1, engine.num_steps - steps0)
    delta = comm.stats.since(mark)
    rss, cuda = _peak_memory(cfg.device)
    if engine.tp:  # no expert lives on one rank: nothing routed to ranks
        per_rank = torch.zeros(engine.spec.num_moe_layers, comm.size, dtype=torch.int64)
    else:
        per_rank = engine.loads.slot_totals.cpu().reshape(engine.spec.num_moe_layers, comm.size, -1).sum(-1)
    ran = engine.stats["graph_steps"] + engine.stats["piecewise_steps"] + engine.stats["eager_steps"]
    fed = sum(len(all_ids[i]) + len(o.token_ids) - 1 for i, o in zip(mine, outs))
    return RankReport(
        rank=comm.rank, prompts=mine, tokens=[o.token_ids for o in outs],
        finish_reasons=[o.finish_reason for o in outs], gen_s=gen_s, steps=steps,
        step_kinds=dict(engine.stats, prefix_cache_queries=engine.scheduler.prefix_queries,
                        prefix_cache_hits=engine.scheduler.prefix_hits),
        tokens_per_step=fed / max(1, ran), ttft_ms=[(o.ttft_s or 0.0) * 1e3 for o in outs],
        rank_counts=per_rank.tolist(),
        rebalances=[asdict(e) for e in engine.eplb.events] if engine.eplb is not None else [],
        collectives={k: delta.calls[k] / steps for k in COLLECTIVE_KINDS},
        bytes_per_step={k: delta.bytes_sent[k] / steps for k in COLLECTIVE_KINDS},
        peak_rss_mb=rss, peak_cuda_mb=cuda, expert_mb=engine.ep_model.expert_bytes / 2**20,
        full_expert_mb=engine.ep_model.full_expert_bytes / 2**20, kv=engine.kv_report(),
        speculative=_spec_report(engine, outs),
        logical_loads=engine.logical_loads().tolist() if cfg.save_loads else [],
    )


def _spec_report(engine: Engine, outs) -> dict | None:
    if engine.proposer is None:
        return None
    from epmoe.engine.speculative import SpecStats

    per_request = [SpecStats(o.num_verify_steps, o.num_draft_tokens, o.num_accepted_tokens).to_json() for o in outs]
    return {**engine.spec_stats.to_json(), "proposer": engine.proposer.describe(), "requests": per_request}


# EngineConfig field -> the flag that sets it, for the engine's errors (which name the field); plain words such as
# ``model`` or ``layout`` stand in prose too, so only ``seed`` of them (``RunConfig.validate`` names the others)
_FLAGS = {name: flag for name, flag in COMMAND_FLAGS.items() if "_" in name} | {"seed": "--seed"}


def _engine_config(cfg: RunConfig, model_dir: str) -> EngineConfig:
    """The engine's options, its errors in the CLI's flag names."""
    try:
        return cfg.engine_config(model_dir)
    except ValueError as exc:
        msg = str(exc)
        for field_name, flag in _FLAGS.items():
            msg = re.sub(rf"\b{field_name}\b", flag, msg)
        raise ValueError(msg) from None


def _check_before_start(cfg: RunConfig, model_dir: str, ep: int, all_ids: list[list[int]],
                        info: RankInfo | None = None, reader: CheckpointReader | None = None) -> None:
    """Everything that can be checked before any rank starts: a GPU for each rank on CUDA (``launch.check_gpus``;
    ``info``: this rank's under torchrun), the request rate's arrival span (``checks.check_arrival_span``), the
    engine options, the weights (from ``reader``'s headers where ``run_job`` opened the checkpoint already), whether
    ``generation_config.json`` is a JSON object, the KV pool when its size is given, and what the group must fit
    (``engine.group.check_group``: the target's and a draft model's placements, or the sizes tp divides)."""
    if cfg.dispatcher == "local" and ep != 1:
        raise ValueError(f"--dispatcher local serves EP size 1 only; EP size is {ep}: use all_to_all")
    if cfg.request_rate is not None:  # the ranks of the group (torchrun's world size, else --ep) share the prompts
        check_arrival_span("--request-rate", cfg.request_rate, -(-len(all_ids) // ep), "prompts on a rank")
    check_gpus(cfg.device, ep, info)
    engine_cfg = _engine_config(cfg, model_dir)
    spec = load_moe_spec(model_dir)
    _check_context(spec, all_ids, cfg.max_new_tokens, cfg.max_model_len)
    if cfg.load_format == "auto":  # the loader's checks from the file headers (doctor's) but the routed experts',
        from epmoe.models.hf import check_checkpoint  # which each rank checks for its own slots as it loads them

        try:
            check_checkpoint(model_dir, experts=lambda _layer: (), reader=reader)
        except KeyError as exc:  # a missing tensor: its message without the quotes a KeyError's str() adds
            raise ValueError(exc.args[0] if exc.args else str(exc)) from None
        except FileNotFoundError as exc:
            raise ValueError(f"--model: {exc} (--load-format dummy runs a config.json alone)") from None
    generation_config(model_dir)  # not a JSON object: named here, whether or not the reference runs
    if cfg.num_kv_blocks is not None:
        pool = (cfg.num_kv_blocks - 1) * cfg.block_size
        longest = max(len(ids) for ids in all_ids) + cfg.max_new_tokens - 1
        if longest > pool:
            raise ValueError(f"the longest prompt with --max-new-tokens {cfg.max_new_tokens} needs {longest} KV slots; "
                             f"--num-kv-blocks {cfg.num_kv_blocks} of --block-size {cfg.block_size} hold {pool} "
                             f"(one block is the padding block)")
    check_group(engine_cfg, ep)


def _reference_not_asked(cfg: RunConfig) -> str | None:
    """Why ``cfg`` does not ask for the reference check (the first reason that applies, as the flag that gave it),
    or ``None`` where it does."""
    if not cfg.reference:
        return "--no-reference"
    if cfg.temperature >= GREEDY_BELOW:
        return f"sampling: --temperature {cfg.temperature:g}"
    if cfg.load_format == "dummy":
        return "--load-format dummy: random weights"
    if cfg.moe_routing_simulation is not None:
        return f"--moe-routing-simulation {cfg.moe_routing_simulation}"
    return None


def reference_room(spec: MoESpec, dtype_name: str, device: str, via_host: bool = False) -> str | None:
    """Why the unsharded transformers model in ``dtype_name`` would not fit on ``device`` (``plan.costs.model_params``
    parameters of that dtype against ``free_bytes``; with ``via_host`` on CUDA the host's memory too, where
    transformers' ``from_pretrained`` builds the model before it moves to the device), or ``None`` where it fits or
    the free memory is unknown. The reference check loads it whole on one device, so a model served only sharded
    (DeepSeek-V3 on 8 GPUs) skips it with this reason instead of dying of an out-of-memory error after its run."""
    need = model_params(spec) * DTYPES[dtype_name].itemsize
    places = [(device, free_bytes(device))]
    if via_host and device == "cuda":
        places.append(("cpu", free_bytes("cpu")))
    for place, free in places:
        if free is not None and need > free:
            shown = (format_bytes(need), format_bytes(free))
            if shown[0] == shown[1]:
                shown = (f"{need} B", f"{free} B")
            where = "the CUDA device" if place == "cuda" else "the host"
            return (f"the unsharded transformers model needs about {shown[0]} in {dtype_name}, and {where} has "
                    f"{shown[1]} free")
    return None


def _reference(cfg: RunConfig, model_dir: str, all_ids: list[list[int]], eos_ids: list[int],
               dtype_name: str) -> tuple[list[list[int]], list[tuple[int, int]]]:
    """Greedy tokens of the unsharded transformers model, prompt by prompt with its own ``generate`` (no
    ``MoELayer``, no engine): transformers' ``from_pretrained`` where it reads the checkpoint, else a full
    single-rank load of the dequantized tensors into the same transformers model (block-FP8 weights, a
    ``language_model.`` wrapper); plain greedy search, whatever ``generation_config.json`` asks besides.

    Returns:
        The tokens per prompt, and ``(prompt, step)`` of each prompt's first step whose logits hold NaN or
        infinite values (greedy search picks a token from them all the same).
    """
    from rich.console import Console
    from rich.progress import Progress
    from transformers import GenerationConfig

    device = cfg.device
    out, not_finite = [], []
    with Progress(transient=True, console=Console(stderr=True)) as bar:
        task = bar.add_task(f"loading the unsharded transformers reference ({dtype_name})", total=None)
        model = _load_reference(model_dir, dtype_name, device)
        # greedy decoding alone, as the engine runs it: generation_config.json's beams, stop strings and penalties
        # are not the engine's (--temperature and friends are; serve reads the file's sampling defaults)
        model.generation_config = GenerationConfig(do_sample=False, num_beams=1)
        bar.update(task, description=f"transformers reference ({dtype_name}, prompts)", total=len(all_ids),
                   completed=0)
        with torch.no_grad():
            for i, ids in enumerate(all_ids):
                x = torch.tensor([ids], device=device)
                watch = _FiniteWatch()
                y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=cfg.max_new_tokens,
                                   do_sample=False, eos_token_id=eos_ids or None,
                                   pad_token_id=eos_ids[0] if eos_ids else 0, logits_processor=[watch])
                out.append(y[0, len(ids):].tolist())
                if watch.first_bad is not None:
                    not_finite.append((i, watch.first_bad))
                bar.advance(task)
    return out, not_finite


def _load_reference(model_dir: str, dtype_name: str, device: str) -> torch.nn.Module:
    """The unsharded transformers model in ``dtype_name`` on ``device``, in eval mode: transformers'
    ``from_pretrained`` where it reads the checkpoint, else ``load_full_model``."""
    from transformers import AutoModelForCausalLM

    from epmoe.models.hf import load_full_model

    if needs_own_loader(model_dir):
        return load_full_model(model_dir, DTYPES[dtype_name], device)
    model = AutoModelForCausalLM.from_pretrained(model_dir, config=hf_config(model_dir), dtype=DTYPES[dtype_name])
    return model.to(device).eval()


def _divergences(cfg: RunConfig, model_dir: str, spec: MoESpec, all_ids: list[list[int]], tokens: list[list[int]],
                 ref32: dict[int, list[int]], prompts: list[int]) -> list[Divergence]:
    """For each of ``prompts`` (a half-precision run's prompts that differ from the float32 reference), its first
    differing step weighed by ``near_tie``: the prompt and our tokens before it fed through the run's-dtype and then
    the float32 transformers model (each loaded once more, one at a time, only here), the float32 one again with each
    router tie's experts exchanged."""
    from rich.console import Console
    from rich.progress import Progress

    cases = {i: s for i in prompts if (s := first_difference(tokens[i], ref32[i])) is not None}
    if not cases:
        return []
    device = cfg.device
    seqs = {i: all_ids[i] + tokens[i][:step] for i, step in cases.items()}  # the tokens both runs share
    out = []
    with Progress(transient=True, console=Console(stderr=True)) as bar:
        task = bar.add_task(f"weighing where the tokens differ ({cfg.dtype} reference)", total=len(cases))
        model = _load_reference(model_dir, cfg.dtype, device)
        half = {}
        for i in cases:
            half[i] = probe(model, spec, seqs[i], device)
            bar.advance(task)
        del model
        task = bar.add_task("weighing where the tokens differ (float32 reference)", total=len(cases))
        model = _load_reference(model_dir, "float32", device)
        for i, step in cases.items():
            full = probe(model, spec, seqs[i], device)
            ties = router_ties(full, half[i], spec)
            swapped = exchanged(model, spec, seqs[i], ties, device)
            out.append(measure(spec, i, step, tokens[i][step], ref32[i][step], full, half[i], ties, swapped))
            bar.advance(task)
        del model
    return out


class _FiniteWatch:
    """A transformers logits processor that leaves the scores as they are and notes the first step whose scores
    hold NaN or infinite values (``first_bad``), so that no step's logits are kept."""

    def __init__(self) -> None:
        self.step, self.first_bad = 0, None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.first_bad is None and not bool(torch.isfinite(scores).all()):
            self.first_bad = self.step
        self.step += 1
        return scores


def run_job(cfg: RunConfig) -> RunReport:
    """Run the main job (see the module docstring).

    Under torchrun only rank 0 returns a report (it gathers the other ranks' reports) and writes
    ``save_loads``; other ranks return ``None``.

    Raises:
        ValueError: a bad option or placement (named); FileNotFoundError: no such checkpoint.
        epmoe.runtime.launch.RankFailure: a spawned rank failed (every rank's first error, named by rank).
        RuntimeError: under torchrun, this rank's collective failed (a peer went away).
    """
    cfg.validate()
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    model_dir = str(cfg.model) if cfg.model is not None else str(ensure_default_checkpoint(cfg.cache_dir))
    spec = load_moe_spec(model_dir)
    cfg = replace(cfg, dtype=command_dtype(cfg.dtype, cfg.device, spec))
    hf_config(model_dir)  # transformers' own checks of config.json, before the tokenizer (which reads it too) fails
    not_asked = _reference_not_asked(cfg)
    reference = not_asked is None
    # from_pretrained builds the reference on the host, our loader does not (dummy weights: no files to ask about);
    # the headers read here are checked before the start too, not read again
    try:
        reader = CheckpointReader(model_dir) if reference else None
        via_host = reader is not None and not needs_own_loader(reader)
        if via_host:  # from_pretrained reads the files; our own loader does not
            check_generation_config(model_dir)
            check_index_for_transformers(model_dir)
    except FileNotFoundError as exc:  # no weights files: as the checks before the start name it
        raise ValueError(f"--model: {exc} (--load-format dummy runs a config.json alone)") from None
    prompts = list(cfg.prompts) or list(DEFAULT_PROMPTS)
    all_ids, tok = _encode(model_dir, prompts, cfg.trust_remote_code)
    if under_torchrun():
        info = torchrun_rank_info()
        _check_before_start(cfg, model_dir, info.world_size, all_ids, info, reader)
        ranks = _rank_worker(info, cfg, model_dir, all_ids, gather=True, progress=True)
        if ranks is None:
            return None  # type: ignore[return-value]
        ep = info.world_size
    else:
        ep = cfg.ep
        _check_before_start(cfg, model_dir, ep, all_ids, reader=reader)  # fail here, before any process starts
        ranks = spawn(_rank_worker, ep, (cfg, model_dir, all_ids, False, True))

    tokens: list[list[int]] = [[] for _ in prompts]
    for r in ranks:
        for i, t in zip(r.prompts, r.tokens):
            tokens[i] = t
    gen_s = max(r.gen_s for r in ranks)
    rank_counts = torch.tensor([r.rank_counts for r in ranks]).sum(0)  # [L, G]
    steps = max(r.steps for r in ranks)
    report = RunReport(
        model=model_dir, model_type=spec.model_type, ep=ep, parallel=cfg.parallel, device=cfg.device, prompts=prompts,
        outputs=[decode_text(tok, t) for t in tokens], ranks=ranks,
        tokens_per_s=sum(len(t) for t in tokens) / gen_s if gen_s > 0 else float("nan"),
        balancedness=float(rank_balancedness(rank_counts).mean()),
        routed_tokens_per_step=(rank_counts.sum(0).double() / (steps * spec.num_moe_layers)).tolist(),
        matches_reference=None, reference_not_asked=not_asked, dtype=cfg.dtype, load_format=cfg.load_format,
        moe_routing_simulation=cfg.moe_routing_simulation,
        expert_backend=describe_expert_backend(_engine_config(cfg, model_dir).expert_backend, cfg.device),
        expert_storage=held_as(spec.expert_weight_format, spec.moe_intermediate_size, cfg.parallel, cfg.dtype),
        graphs=any(r.step_kinds.get("graph_steps", 0) + r.step_kinds.get("piecewise_steps", 0) for r in ranks),
        overlap=not cfg.disable_overlap_schedule and cfg.speculative_algorithm is None,
        switched_off=switched_off(),
    )
    if ranks[0].kv.get("prefix_caching"):
        report.prefix_cache = {"queried_tokens": sum(r.step_kinds.get("prefix_cache_queries", 0) for r in ranks),
                               "hit_tokens": sum(r.step_kinds.get("prefix_cache_hits", 0) for r in ranks)}
    if cfg.speculative_algorithm is not None:
        from epmoe.engine.speculative import SpecStats

        total = SpecStats()
        for r in ranks:
            total.verify_steps += r.speculative["verify_steps"]
            total.draft_tokens += r.speculative["draft_tokens"]
            total.accepted_tokens += r.speculative["accepted_tokens"]
        requests: list[dict] = [{} for _ in prompts]
        for r in ranks:
            for i, stats in zip(r.prompts, r.speculative["requests"]):
                requests[i] = stats
        report.speculative = {**total.to_json(), "algorithm": cfg.speculative_algorithm,
                              "num_tokens": _engine_config(cfg, model_dir).num_speculative_tokens,
                              "proposer": ranks[0].speculative["proposer"], "requests": requests}
    if cfg.save_loads is not None:
        from epmoe.files import write_failed
        from epmoe.loads import save_loads

        try:
            save_loads(cfg.save_loads, torch.tensor([r.logical_loads for r in ranks]).sum(0))
        except OSError as exc:  # a full or read-only file system: named by the flag, not the temporary file
            raise write_failed("--save-loads", cfg.save_loads, exc) from exc
    if reference:
        report.reference_skipped = reference_room(spec, cfg.dtype, cfg.device, via_host)
    if reference and report.reference_skipped is None:
        from epmoe.engine.tokenizer import eos_token_ids

        eos = sorted(eos_token_ids(model_dir, tok, vocab_size=spec.vocab_size))
        ref_tokens, not_finite = _reference(cfg, model_dir, all_ids, eos, cfg.dtype)
        differ = [i for i in range(len(prompts)) if tokens[i] != ref_tokens[i]]
        ref32: dict[int, list[int]] = {}
        if differ and cfg.dtype != "float32":
            report.float32_skipped = reference_room(spec, "float32", cfg.device, via_host)
        if differ and cfg.dtype != "float32" and report.float32_skipped is None:
            ref32 = dict(zip(differ, _reference(cfg, model_dir, [all_ids[i] for i in differ], eos, "float32")[0]))
        report.reference_outputs = ref_tokens
        report.mismatches, report.float32_judged = judge_mismatches(tokens, ref_tokens, ref32)
        unexplained = [i for i in report.mismatches if i in ref32]
        if unexplained and not not_finite:
            divergences = _divergences(cfg, model_dir, spec, all_ids, tokens, ref32, unexplained)
            report.divergences = [d.to_json() for d in divergences]
            tied = {d.prompt for d in divergences if d.near_tie}
            report.mismatches = [i for i in report.mismatches if i not in tied]
        if not_finite:
            report.reference_not_finite = not_finite[0]
            report.mismatches = sorted(set(report.mismatches) | {i for i, _ in not_finite})
        report.matches_reference = not report.mismatches
        token_differ = [i for i in report.mismatches if tokens[i] != ref_tokens[i]]
        if token_differ:
            i = token_differ[0]
            pairs = list(zip(tokens[i], ref_tokens[i]))
            step = next((k for k, (a, b) in enumerate(pairs) if a != b), len(pairs))
            ours = tokens[i][step] if step < len(tokens[i]) else -1
            theirs = ref_tokens[i][step] if step < len(ref_tokens[i]) else -1
            report.first_mismatch = (i, step, ours, theirs)
    return report
