"""``epmoe run``: generate with an expert-parallel model across ranks and check it against transformers.

``run_job(RunConfig)`` is the whole main job: resolve the checkpoint (building the built-in small
Kimi-K2.5-architecture one on first use), start the EP ranks (``spawn``) or join ``torchrun``'s, load
each rank's share of the experts, generate greedily in lockstep, run the unsharded transformers model
on the same prompts, and return a ``RunReport``.
"""

from __future__ import annotations

import json
import resource
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from epmoe.comm import COLLECTIVE_KINDS, Comm
from epmoe.models.tiny import ensure_default_checkpoint
from epmoe.placement import ExpertPlacement
from epmoe.runtime.generate import GenerationResult, greedy_generate
from epmoe.runtime.launch import RankInfo, init_group, spawn, torchrun_rank_info, under_torchrun
from epmoe.spec import language_model_config, load_moe_spec, read_config

DEFAULT_PROMPTS = (
    "Expert parallelism places whole experts on ranks",
    "The quick brown fox",
    "def all_to_all(x):",
    "Mixture of experts",
)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class RunConfig:
    """Options of ``epmoe run`` (the CLI parses into this).

    Attributes:
        model: checkpoint directory; ``None`` = the built-in small Kimi-K2.5-architecture checkpoint.
        ep: EP ranks to spawn (ignored under torchrun, which sets the world size).
        device: ``cpu`` (gloo) or ``cuda`` (NCCL).
        placement: placement file (JSON or safetensors); ``None`` = contiguous trivial placement.
        redundant: redundant slots per layer for the trivial placement.
        layout: trivial placement layout, ``contiguous`` or ``round_robin``.
        prompts: prompt strings; empty = the built-in ones.
        max_new_tokens: tokens generated per prompt.
        dtype: ``float32``, ``bfloat16`` or ``float16``.
        dispatcher: dispatcher name (``all_to_all``, ``fixed_capacity``; ``local`` for EP 1). The
            fixed-capacity dispatcher gets the capacity no step can exceed: the most tokens one rank
            feeds in a step (its prefill batch).
        expert_backend: expert compute backend name.
        reference: run the unsharded transformers model and compare tokens.
        eplb_interval: rebalance every this many decode steps from the recorded loads (0 = never).
        eplb_max_moves: most expert copies one rebalance may move (``None`` = as few as reach the target).
        cache_dir: where the built-in checkpoint is cached.
    """

    model: str | None = None
    ep: int = 2
    device: str = "cpu"
    placement: str | None = None
    redundant: int = 0
    layout: str = "contiguous"
    prompts: tuple[str, ...] = ()
    max_new_tokens: int = 8
    dtype: str = "float32"
    dispatcher: str = "all_to_all"
    expert_backend: str = "reference"
    reference: bool = True
    eplb_interval: int = 0
    eplb_max_moves: int | None = None
    cache_dir: str | None = None

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first bad option."""
        if self.ep < 1:
            raise ValueError(f"--ep must be at least 1, got {self.ep}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"--device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda asked for, but CUDA is not available on this machine")
        if self.max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens must be at least 1, got {self.max_new_tokens}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"--dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if self.redundant < 0:
            raise ValueError(f"--redundant must be non-negative, got {self.redundant}")
        if self.eplb_interval < 0:
            raise ValueError(f"--eplb-interval must be non-negative, got {self.eplb_interval}")
        if self.eplb_max_moves is not None and self.eplb_max_moves < 0:
            raise ValueError(f"--max-moves must be non-negative, got {self.eplb_max_moves}")
        if self.eplb_max_moves is not None and not self.eplb_interval:
            raise ValueError("--max-moves limits live rebalancing: give --eplb-interval STEPS with it")
        from epmoe.dispatch import DISPATCHERS
        from epmoe.experts import EXPERT_BACKENDS

        if self.dispatcher not in DISPATCHERS:
            raise ValueError(f"--dispatcher {self.dispatcher!r} is not one of {sorted(DISPATCHERS)}")
        if self.expert_backend not in EXPERT_BACKENDS:
            raise ValueError(f"--expert-backend {self.expert_backend!r} is not one of {sorted(EXPERT_BACKENDS)}")
        if self.placement is not None and (self.redundant or self.layout != "contiguous"):
            raise ValueError(
                "--redundant and --layout shape the default placement; a --placement file fixes its own slots"
            )
        if self.model is not None and (not str(self.model) or not Path(self.model).is_dir()):
            raise ValueError(f"--model {self.model!r} is not a checkpoint directory (config.json + *.safetensors)")
        if any(not p for p in self.prompts):
            raise ValueError("--prompt must not be empty")


@dataclass
class RankReport:
    """What one rank measured.

    Attributes:
        rank: EP rank.
        prompts: indices of the prompts this rank served.
        tokens: generated token ids per served prompt.
        decode_ms: wall time of the decode steps (all but the prefill), ms.
        batch_tokens: tokens fed per step.
        rank_counts: ``[L, G]`` (token, expert) pairs this rank routed to each EP rank over the decode
            steps (summed across live rebalances).
        rebalances: the EPLB events (dicts of ``RebalanceEvent``), empty without ``--eplb-interval``.
        collectives: kind -> calls per decode step.
        bytes_per_step: kind -> bytes sent per decode step by this rank.
        peak_rss_mb: peak resident memory of the process, MiB.
        peak_cuda_mb: peak CUDA memory allocated, MiB (0 on CPU).
        expert_mb: routed-expert weights held by this rank, MiB.
        full_expert_mb: what all routed experts would take, MiB.
        last_logits: final-step logits ``[B, V]`` float32 (for the logits check).
    """

    rank: int
    prompts: list[int]
    tokens: list[list[int]]
    decode_ms: float
    batch_tokens: list[int]
    rank_counts: list[list[int]]
    rebalances: list[dict]
    collectives: dict[str, float]
    bytes_per_step: dict[str, float]
    peak_rss_mb: float
    peak_cuda_mb: float
    expert_mb: float
    full_expert_mb: float
    last_logits: torch.Tensor | None = None


@dataclass
class RunReport:
    """The result of ``run_job``.

    Attributes:
        model: checkpoint directory used.
        model_type: its ``model_type``.
        ep: EP size.
        device: ``cpu`` or ``cuda``.
        prompts: the prompt strings.
        outputs: generated text per prompt.
        ranks: per-rank reports.
        tokens_per_s: generated tokens over all ranks per second of decode wall time.
        balancedness: mean over ranks / max over ranks of routed tokens per rank in decode, averaged over layers.
        routed_tokens_per_step: per EP rank, (token, expert) pairs its slots computed per decode step and MoE layer.
        matches_reference: generated tokens equal the unsharded transformers model's (``None`` if skipped).
            Promised exactly in float32; in bf16/fp16 the sharded sums run in another order, so a near-tie
            between two tokens (or two experts) can flip.
        mismatches: prompt indices whose tokens differ from the reference.
        reference_outputs: token ids the reference generated per prompt (empty if skipped).
        first_mismatch: ``(prompt, step, ours, reference)`` of the first differing token, or ``None``.
        max_logits_rel_err: ``|ours - ref| / |ref|`` of the last-step logits (``None`` if skipped).
    """

    model: str
    model_type: str
    ep: int
    device: str
    prompts: list[str]
    outputs: list[str]
    ranks: list[RankReport]
    tokens_per_s: float
    balancedness: float
    routed_tokens_per_step: list[float]
    matches_reference: bool | None
    mismatches: list[int] = field(default_factory=list)
    reference_outputs: list[list[int]] = field(default_factory=list)
    first_mismatch: tuple[int, int, int, int] | None = None
    max_logits_rel_err: float | None = None

    def to_json(self) -> dict:
        """A JSON-ready dict (logits dropped)."""
        d = asdict(self)
        for r in d["ranks"]:
            r.pop("last_logits", None)
        return d


def _encode(model_dir: str, prompts: list[str]) -> tuple[list[list[int]], int, object | None]:
    """Token ids of the prompts, the pad id, and the tokenizer (``None``: raw UTF-8 bytes)."""
    spec_vocab = load_moe_spec(model_dir).vocab_size
    has_tok = any((Path(model_dir) / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json"))
    if has_tok:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model_dir)
        ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
        pad = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
        return ids, int(pad), tok
    return [[b % spec_vocab for b in p.encode()] for p in prompts], 0, None


def _check_context(model_dir: str, all_ids: list[list[int]], max_new_tokens: int) -> None:
    """Refuse prompts that would run past the model's ``max_position_embeddings``."""
    limit = language_model_config(read_config(model_dir)[0]).get("max_position_embeddings")
    longest = max(len(ids) for ids in all_ids) + max_new_tokens
    if isinstance(limit, int) and longest > limit:
        raise ValueError(
            f"the longest prompt ({longest - max_new_tokens} tokens) plus --max-new-tokens ({max_new_tokens}) "
            f"is {longest} positions, past the model's max_position_embeddings ({limit})"
        )


def _decode(tok, ids: list[int]) -> str:
    if tok is None:
        return " ".join(str(i) for i in ids)
    return tok.decode(ids, skip_special_tokens=True)


def _peak_memory(device: str) -> tuple[float, float]:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    cuda = torch.cuda.max_memory_allocated() / 2**20 if device == "cuda" else 0.0
    return rss, cuda


def _rank_worker(
    info: RankInfo, cfg: RunConfig, model_dir: str, all_ids: list[list[int]], pad_id: int, gather: bool = False
) -> RankReport | list[RankReport] | None:
    """One EP rank: load its experts, generate its share, report. With ``gather`` (torchrun), rank 0
    returns every rank's report (collected over the EP group) and the others return ``None``."""
    from epmoe.loads import ExpertLoadRecorder
    from epmoe.models.hf import load_ep_model
    from epmoe.runtime.rebalance import EPLBController

    group = init_group(info, cfg.device)
    try:
        comm = Comm(group)
        device = torch.device("cuda", info.local_rank) if cfg.device == "cuda" else torch.device("cpu")
        spec = load_moe_spec(model_dir)
        placement = _placement(cfg, spec, comm.size)
        recorder = ExpertLoadRecorder(spec.num_moe_layers, placement.num_slots, window=cfg.max_new_tokens,
                                      device=device)
        mine = list(range(comm.rank, len(all_ids), comm.size))
        options = {}
        shares = [all_ids[r::comm.size] for r in range(comm.size)]
        if cfg.dispatcher == "fixed_capacity":  # the prefill's capacity: every prompt token of the busiest rank
            options["capacity"] = max(1, max(len(s) * max((len(p) for p in s), default=0) for s in shares))
        ep_model = load_ep_model(
            model_dir, placement, comm, dispatcher=cfg.dispatcher, dispatcher_options=options,
            expert_backend=cfg.expert_backend, load_recorder=recorder, dtype=_DTYPES[cfg.dtype], device=device,
        )
        marks: list = []
        carried = torch.zeros(spec.num_moe_layers, comm.size, dtype=torch.int64)

        def per_rank() -> torch.Tensor:
            return recorder.slot_counts().cpu().reshape(spec.num_moe_layers, comm.size, -1).sum(-1)
        eplb = (
            EPLBController(ep_model, recorder, cfg.eplb_interval, max_moves=cfg.eplb_max_moves)
            if cfg.eplb_interval else None
        )

        def on_step(step: int) -> None:
            if step == 0:  # measure decode steps only: drop the prefill's counts
                recorder.reset()
                marks.append(comm.stats.snapshot())
                if cfg.dispatcher == "fixed_capacity":  # a decode step feeds one token per prompt
                    decode_capacity = max(1, max(len(s) for s in shares))
                    ep_model.use_dispatcher("fixed_capacity", capacity=decode_capacity)
                return
            recorder.step()
            if eplb is not None and step % eplb.interval == 0:
                before = per_rank()
                eplb.on_step(step)
                if eplb.events[-1].committed:  # the recorder was reset for the new placement
                    carried.add_(before)

        gen: GenerationResult = greedy_generate(
            ep_model.model, [all_ids[i] for i in mine], cfg.max_new_tokens, pad_id, device,
            idle_step=ep_model.idle_step, on_step=on_step,
        )
        if cfg.device == "cuda":
            torch.cuda.synchronize()
        decode_steps = max(1, cfg.max_new_tokens - 1)
        delta = comm.stats.since(marks[0])
        rss, cuda = _peak_memory(cfg.device)
        report = RankReport(
            rank=comm.rank,
            prompts=mine,
            tokens=gen.tokens,
            decode_ms=sum(gen.step_ms[1:]),
            batch_tokens=gen.batch_tokens,
            rank_counts=(carried + per_rank()).tolist(),
            rebalances=[asdict(e) for e in eplb.events] if eplb is not None else [],
            collectives={k: delta.calls[k] / decode_steps for k in COLLECTIVE_KINDS},
            bytes_per_step={k: delta.bytes_sent[k] / decode_steps for k in COLLECTIVE_KINDS},
            peak_rss_mb=rss,
            peak_cuda_mb=cuda,
            expert_mb=ep_model.expert_bytes / 2**20,
            full_expert_mb=ep_model.full_expert_bytes / 2**20,
            last_logits=gen.last_logits,
        )
        if not gather:
            return report
        gathered: list | None = [None] * comm.size if comm.rank == 0 else None
        torch.distributed.gather_object(report, gathered, dst=0, group=group)
        return gathered
    finally:
        torch.distributed.destroy_process_group()


def _placement(cfg: RunConfig, spec, ep: int) -> ExpertPlacement:
    if cfg.dispatcher == "local" and ep != 1:
        raise ValueError(f"--dispatcher local serves EP size 1 only; EP size is {ep}: use all_to_all or fixed_capacity")
    if cfg.placement:
        placement = ExpertPlacement.load(cfg.placement, ep_size=ep)
    else:
        try:
            placement = ExpertPlacement.trivial(
                spec.num_moe_layers, spec.num_experts, ep, cfg.redundant, cfg.layout
            )
        except ValueError as exc:
            raise ValueError(f"--ep {ep} with --redundant {cfg.redundant}: {exc}") from None
    placement.check_model(spec.num_moe_layers, spec.num_experts, what=f"model {spec.source}")
    return placement


def _balancedness(rank_counts: torch.Tensor) -> float:
    """Per layer mean/max of ``rank_counts [L, G]`` (tokens per rank), averaged over layers."""
    per_rank = rank_counts.double()
    peak = per_rank.max(dim=1).values
    ratio = torch.where(peak > 0, per_rank.mean(dim=1) / peak.clamp(min=1e-12), torch.ones_like(peak))
    return float(ratio.mean())


def _reference(cfg: RunConfig, model_dir: str, all_ids: list[list[int]], pad_id: int, ep: int) -> list[GenerationResult]:
    """The unsharded transformers model on every rank's share of the prompts (no ``MoELayer``): transformers'
    own ``from_pretrained`` where it reads the checkpoint, else a full single-rank load of the dequantized
    tensors into the same transformers model (block-FP8 weights, a ``language_model.`` wrapper)."""
    from transformers import AutoModelForCausalLM

    from epmoe.models.hf import hf_config, load_full_model, needs_own_loader

    device = "cuda" if cfg.device == "cuda" else "cpu"
    dtype = _DTYPES[cfg.dtype]
    if needs_own_loader(model_dir):
        model = load_full_model(model_dir, dtype, device)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, config=hf_config(model_dir), dtype=dtype)
        model = model.to(device).eval()
    out = []
    for rank in range(ep):
        share = [all_ids[i] for i in range(rank, len(all_ids), ep)]
        out.append(greedy_generate(model, share, cfg.max_new_tokens, pad_id, device) if share else None)
    return out


def run_job(cfg: RunConfig) -> RunReport:
    """Run the main job (see the module docstring).

    Under torchrun only rank 0 returns a report (it gathers the other ranks' reports); other ranks
    return ``None``.

    Raises:
        ValueError: a bad option or placement (named); FileNotFoundError: no such checkpoint.
        RuntimeError: a rank failed (its error in the message).
    """
    cfg.validate()
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    model_dir = str(cfg.model) if cfg.model is not None else str(ensure_default_checkpoint(cfg.cache_dir))
    spec = load_moe_spec(model_dir)
    prompts = list(cfg.prompts) or list(DEFAULT_PROMPTS)
    all_ids, pad_id, tok = _encode(model_dir, prompts)
    _check_context(model_dir, all_ids, cfg.max_new_tokens)
    if under_torchrun():
        info = torchrun_rank_info()
        _placement(cfg, spec, info.world_size)
        ranks = _rank_worker(info, cfg, model_dir, all_ids, pad_id, gather=True)
        if ranks is None:
            return None  # type: ignore[return-value]
        ep = info.world_size
    else:
        ep = cfg.ep
        _placement(cfg, spec, ep)  # fail here, before any process starts, on a bad placement
        ranks = spawn(_rank_worker, ep, (cfg, model_dir, all_ids, pad_id))

    tokens: list[list[int]] = [[] for _ in prompts]
    for r in ranks:
        for i, t in zip(r.prompts, r.tokens):
            tokens[i] = t
    decode_s = max(r.decode_ms for r in ranks) / 1e3
    new_tokens = len(prompts) * max(0, cfg.max_new_tokens - 1)
    rank_counts = torch.tensor([r.rank_counts for r in ranks]).sum(0)  # [L, G]
    decode_steps = max(1, cfg.max_new_tokens - 1)
    report = RunReport(
        model=model_dir, model_type=spec.model_type, ep=ep, device=cfg.device, prompts=prompts,
        outputs=[_decode(tok, t) for t in tokens], ranks=ranks,
        tokens_per_s=new_tokens / decode_s if decode_s > 0 else float("nan"),
        balancedness=_balancedness(rank_counts),
        routed_tokens_per_step=(rank_counts.sum(0).double() / (decode_steps * spec.num_moe_layers)).tolist(),
        matches_reference=None,
    )
    if cfg.reference:
        ref = _reference(cfg, model_dir, all_ids, pad_id, ep)
        ref_tokens: list[list[int]] = [[] for _ in prompts]
        errs = []
        for r in ranks:
            if ref[r.rank] is None:
                continue
            for i, t_ref in zip(r.prompts, ref[r.rank].tokens):
                ref_tokens[i] = t_ref
                if tokens[i] != t_ref:
                    report.mismatches.append(i)
            a, b = r.last_logits, ref[r.rank].last_logits
            errs.append(float((a - b).norm() / b.norm()))
        report.mismatches.sort()
        report.matches_reference = not report.mismatches
        report.reference_outputs = ref_tokens
        if report.mismatches:
            i = report.mismatches[0]
            step = next(k for k, (a, b) in enumerate(zip(tokens[i], ref_tokens[i])) if a != b)
            report.first_mismatch = (i, step, tokens[i][step], ref_tokens[i][step])
        report.max_logits_rel_err = max(errs) if errs else None
    return report


def write_json(report: RunReport, path: str | Path) -> None:
    """Write ``report.to_json()`` to ``path``."""
    Path(path).write_text(json.dumps(report.to_json(), indent=2))
