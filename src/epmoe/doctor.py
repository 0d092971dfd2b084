"""``epmoe doctor``: check a set-up before launch, one line per finding: what, why it matters, what to change.

Checks that the communication backends are there (gloo, NCCL, CUDA, peer access between GPUs), that
the visible GPUs cover the EP size, that a checkpoint directory passes the loader's own checks (a
supported weight format, every tensor present with its shape, from the safetensors headers; the same
function ``epmoe run`` calls before reading weights), the routed experts' weight format and their bytes per
rank, that the placement
covers every MoE layer of the target model and, for speculative decoding, of the draft model (a
dense EAGLE-3 draft needs none), that the draft's hidden and vocabulary sizes match the target's, and
that weights and caches (the draft's included) fit in memory (through the planner's memory model).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as dist

from epmoe.checks import check_int
from epmoe.config_fields import json_text
from epmoe.experts.storage import ExpertStorage, dequantized_reason
from epmoe.integrations.placements import load_placement_as
from epmoe.plan.costs import WEIGHT_CHOICES, weights_hint
from epmoe.plan.draft import DraftModel, draft_bytes, read_draft
from epmoe.plan.hardware import HardwareProfile, load_hardware
from epmoe.plan.planner import plan
from epmoe.plan.request import (
    GIB,
    MAX_BATCH,
    MAX_CONTEXT,
    MAX_GPUS,
    PlanRequest,
    StrategyPlan,
    counted,
    default_context,
    format_bytes,
    nodes_needed,
)
from epmoe.spec import DenseModelError, MoESpec, check_config_path, load_moe_spec

Severity = Literal["error", "warning", "ok"]


@dataclass(frozen=True)
class Finding:
    """One result of a check.

    Attributes:
        severity: ``error`` (the launch would fail or be wrong), ``warning`` (slower or unchecked), ``ok``.
        what: what was found.
        why: why it matters (empty for ``ok``).
        fix: what to change (empty for ``ok``).
    """

    severity: Severity
    what: str
    why: str = ""
    fix: str = ""

    def line(self) -> str:
        """The finding as one line: ``error: what; why; fix``."""
        return "; ".join(part for part in (f"{self.severity}: {self.what}", self.why, self.fix) if part)


@dataclass(frozen=True)
class DoctorConfig:
    """What ``epmoe doctor`` checks.

    Attributes:
        model: target checkpoint directory or ``config.json`` path.
        placement: placement file of the target (epmoe JSON or safetensors, SGLang .json/.pt, TensorRT-LLM .yaml;
            ``integrations.placements``), or ``None`` for the trivial one.
        draft: draft model directory or ``config.json`` for speculative decoding, or ``None``.
        draft_placement: placement file of an MoE draft.
        ep: EP size ``G`` (``None``: 1).
        nodes: nodes the ``G`` ranks are spread over (``G / nodes`` GPUs per node).
        hardware: hardware profile name or path for the memory check (``None``: memory not checked).
        batch: sequences per step for the memory check.
        context: KV-cache length per sequence for the memory check, tokens (``None``: the model's
            ``max_position_embeddings``, at most 4096: ``plan.request.default_context``).
        weights: expert storage override (``bf16``, ``fp8``, ``int4``), ``None`` for the checkpoint's.
        mem_fraction: share of GPU memory the server may use.
    """

    model: str
    placement: str | None = None
    draft: str | None = None
    draft_placement: str | None = None
    ep: int | None = None
    nodes: int = 1
    hardware: str | None = None
    batch: int = 64
    context: int | None = None
    weights: str | None = None
    mem_fraction: float = 0.9


def check_backends(ep: int, nodes: int = 1) -> list[Finding]:
    """gloo, CUDA, NCCL, the GPU count against the ``ep / nodes`` ranks of this node and peer access among them."""
    out: list[Finding] = []
    if not dist.is_available() or not dist.is_gloo_available():
        out.append(Finding("error", "torch.distributed has no gloo backend",
                           "CPU EP runs and the multi-rank tests use gloo", "install a standard PyTorch build"))
    else:
        out.append(Finding("ok", "gloo backend available"))
    if not torch.cuda.is_available():
        out.append(Finding("warning", "CUDA is not available", "EP can only run on CPU with gloo here",
                           "check the NVIDIA driver and that torch is a CUDA build (torch.version.cuda)"))
        return out
    if not dist.is_nccl_available():
        out.append(Finding("error", "CUDA is available but torch.distributed has no NCCL backend",
                           "GPU EP uses NCCL for dispatch and combine", "install a PyTorch build with NCCL"))
    n = torch.cuda.device_count()
    per_node = ep // nodes
    if per_node > n:
        out.append(Finding("error", f"EP size {ep} on {nodes} node(s) needs {counted(per_node, 'GPU')} per node but "
                                    f"{n} GPU(s) are visible on this node",
                           "each EP rank needs its own GPU", f"use --ep {n * nodes} or fewer, --nodes "
                           f"{math.ceil(ep / max(n, 1))} (launched across nodes with torchrun), or check "
                           "CUDA_VISIBLE_DEVICES"))
    else:
        out.append(Finding("ok", f"{n} GPU(s) visible, EP size {ep} ({per_node} per node)"))
    local = min(per_node, n)
    pairs = [(i, j) for i in range(local) for j in range(local) if i != j]
    missing = [(i, j) for i, j in pairs if not torch.cuda.can_device_access_peer(i, j)]
    if missing:
        shown = ", ".join(f"{i}->{j}" for i, j in missing[:8]) + (" ..." if len(missing) > 8 else "")
        out.append(Finding("warning", f"no peer access between GPUs {shown}",
                           "NCCL falls back to copies through host memory: all-to-all and all-reduce get slower",
                           "enable P2P (disable ACS / IOMMU passthrough on PCIe machines) or expect the slower links"))
    elif pairs:
        out.append(Finding("ok", f"peer access between all {local} GPUs"))
    return out


def _load_spec(path: str, what: str) -> tuple[MoESpec | None, list[Finding]]:
    try:
        spec = load_moe_spec(path)
    except DenseModelError as exc:
        return None, [Finding("error", f"{what} is not an MoE model: {exc}", "EP spreads routed experts over ranks",
                              "run it without EP, or point --model at the MoE checkpoint")]
    except (ValueError, FileNotFoundError) as exc:
        return None, [Finding("error", f"{what} cannot be read: {exc}", "nothing can be checked or launched",
                              "pass a checkpoint directory or its config.json")]
    if spec.defaults:
        return spec, [Finding("warning", f"{what}: {spec.describe_defaults()}",
                              "transformers builds the model with the same values, but a config.json that lost "
                              "fields may not describe these weights", "check them against the model's own config")]
    return spec, []


def check_placement(spec: MoESpec, placement: str | None, ep: int, what: str) -> tuple[int, list[Finding]]:
    """Check that a placement file (or the trivial placement when ``None``) covers ``spec`` at EP ``ep``.

    Returns:
        The redundant slots per layer of the placement (0 for the trivial one) and the findings.
    """
    if placement is None:
        if spec.num_experts % ep:
            return 0, [Finding("error", f"{what}: {spec.num_experts} experts are not divisible by EP size {ep}",
                               "the default (trivial) placement needs the same number of slots on every rank",
                               f"pass a placement with {-spec.num_experts % ep} redundant slot(s) per layer, or "
                               f"an EP size dividing {spec.num_experts}")]
        return 0, [Finding("ok", f"{what}: no placement given; the trivial placement "
                                 f"({counted(spec.num_experts // ep, 'expert')} per rank on "
                                 f"{counted(spec.num_moe_layers, 'MoE layer')}) will be used")]
    try:
        p = load_placement_as(placement, ep_size=ep, spec=spec).placement  # epmoe, SGLang or TensorRT-LLM file
    except (ValueError, FileNotFoundError) as exc:
        return 0, [Finding("error", f"{what}: {exc}", "a layer without a matching placement cannot route its tokens",
                           f"build a placement for {counted(spec.num_moe_layers, 'MoE layer')} x {spec.num_experts} "
                           f"experts at EP {ep} (epmoe's balancer or ExpertPlacement.trivial)")]
    layers = f"{'all ' if spec.num_moe_layers > 1 else ''}{counted(spec.num_moe_layers, 'MoE layer')}"
    return p.num_redundant, [Finding("ok", f"{what}: placement {Path(placement).name} covers {layers} "
                                           f"({counted(p.num_slots, 'slot')}, {p.num_redundant} redundant)")]


def check_checkpoint(spec: MoESpec, directory: str, what: str = "the target model") -> list[Finding]:
    """Run the loader's own checks on a checkpoint directory, without reading any weight
    (``models.hf.check_checkpoint``): a weight format the loader supports, and every tensor it reads present
    with the shape ``config.json`` predicts. The loader's message is the finding.
    """
    from epmoe.models.hf import check_checkpoint as loader_check

    try:
        loader_check(directory)
    except (FileNotFoundError, ValueError, KeyError, OSError) as exc:
        msg = exc.args[0] if isinstance(exc, KeyError) and exc.args else str(exc)
        return [Finding("error", f"{what}: {msg}", "epmoe run refuses this checkpoint with the same message",
                        "point --model at the complete checkpoint whose config.json came with these weights")]
    except Exception as exc:  # safetensors header / JSON parser errors of other types
        return [Finding("error", f"{what}: checkpoint {directory} cannot be read ({type(exc).__name__}: {exc})",
                        "epmoe run cannot read the weights", "re-download the checkpoint")]
    return [Finding("ok", f"{what}: checkpoint holds every tensor the loader reads, with the shapes config.json "
                          f"predicts ({spec.num_experts} routed experts x {counted(spec.num_moe_layers, 'MoE layer')}, "
                          f"{spec.expert_format_name} weights)")]


def check_stop_ids(spec: MoESpec, directory: str, what: str = "the target model") -> list[Finding]:
    """The end-of-sequence ids ``epmoe run`` and ``serve`` read from ``config.json`` and ``generation_config.json``
    (``engine.tokenizer.eos_token_ids``, without the tokenizer's own; ``directory`` may name a config file, whose
    ids alone are read): an error finding with its message where they refuse them (an unreadable
    ``generation_config.json``, an id that is not one or is outside the vocabulary)."""
    from epmoe.engine.tokenizer import eos_token_ids

    try:
        eos_token_ids(directory, None, vocab_size=spec.vocab_size)
    except ValueError as exc:
        return [Finding("error", f"{what}: {exc}", "epmoe run and serve refuse this checkpoint with the same message",
                        "mend or remove the field")]
    return []


def check_generation_files(directory: str, what: str = "the target model") -> list[Finding]:
    """What ``epmoe run`` and ``serve`` read beside the weights and refuse at start: ``generation_config.json``'s
    sampling defaults (``serve``: ``engine.sampling.sampling_defaults``) and its fields transformers checks (``run``'s
    reference: ``engine.tokenizer.check_generation_config``), and the tokenizer (``engine.tokenizer.load_tokenizer``;
    one shipped as code is not run here, and named). An error finding with the message they refuse with, each."""
    from epmoe.engine.sampling import sampling_defaults
    from epmoe.engine.tokenizer import check_generation_config, load_tokenizer, remote_tokenizer

    findings = []
    for check, who in ((sampling_defaults, "epmoe serve refuses"), (check_generation_config, "epmoe run refuses")):
        try:
            check(directory)
        except ValueError as exc:
            findings.append(Finding("error", f"{what}: {exc}", f"{who} this checkpoint with the same message",
                                    "mend or remove the field"))
            break  # the same file: its first refusal is enough
    try:
        code = remote_tokenizer(directory)
        tokenizer = load_tokenizer(directory) if code is None else None
    except ValueError as exc:
        findings.append(Finding("error", f"{what}: {exc}", "epmoe run and serve refuse this checkpoint with the same "
                                "message", "mend the tokenizer files"))
    else:
        if code is not None:
            findings.append(Finding("warning", f"{what}: the tokenizer is code shipped with the checkpoint ({code})",
                                    "not run by doctor", "epmoe run and serve need --trust-remote-code for it"))
        findings += _chat_template_findings(tokenizer, what)
    return findings


def _chat_template_findings(tokenizer, what: str) -> list[Finding]:
    """A warning for each of the tokenizer's chat templates (one, or named ones) that does not compile as ``serve``
    renders it (``server.text.template_problem``): ``serve`` starts, and answers the chats that use it with a 400."""
    from epmoe.server.text import template_problem

    template = getattr(tokenizer, "chat_template", None)
    named = template.items() if isinstance(template, dict) else [] if template is None else [(None, template)]
    findings = []
    for name, t in named:
        problem = template_problem(t) if isinstance(t, str) else f"it is not text: {json_text(t)}"
        if problem is not None:
            which = "the tokenizer's chat template" + ("" if name is None else f" {name!r}")
            findings.append(Finding("warning", f"{what}: {which} does not compile: {problem}",
                                    "epmoe serve starts, and answers the chats that use it with a 400",
                                    "mend it (tokenizer_config.json's chat_template, or chat_template.jinja), or "
                                    "pass --chat-template FILE"))
    return findings


def draft_mismatches(model: DraftModel, eagle: bool, target: MoESpec) -> list[tuple[str, int, int]]:
    """What a draft must share with its target and does not: ``(label, draft's value, target's value)`` for the
    vocabulary size (every draft) and the hidden size (an EAGLE-style head, ``eagle``: it reads the target's hidden
    states); empty when the pair fits."""
    checks = [("vocab size", model.vocab_size, target.vocab_size)]
    if eagle:
        checks.insert(0, ("hidden size", model.hidden_size, target.hidden_size))
    return [(label, dv, tv) for label, dv, tv in checks if dv != tv]


def is_eagle_head(path: str) -> bool:
    """The draft is an EAGLE-style head (it reads the target's hidden states): its config has ``eagle_config`` or
    an ``*Eagle*`` architecture."""
    from epmoe.spec import language_model_config, read_config

    cfg = language_model_config(read_config(path)[0])
    return "eagle_config" in cfg or any("eagle" in str(a).lower() for a in cfg.get("architectures") or [])


def check_draft(draft: str, draft_placement: str | None, ep: int,
                target: MoESpec | None = None) -> tuple[DraftModel | None, int, list[Finding]]:
    """A dense draft needs no placement; an MoE draft has its own (the file given, else the trivial placement of
    its own experts: never the target's). Every draft must share the target's vocabulary; an EAGLE-style head
    also its hidden size (it reads the target's hidden states), a standalone draft model need not.

    Returns:
        The draft (``None`` when unreadable), the redundant slots of an MoE draft's placement, the findings.
    """
    try:
        model = read_draft(draft)
        eagle = is_eagle_head(draft)
    except (ValueError, FileNotFoundError) as exc:
        return None, 0, [Finding("error", f"draft cannot be read: {exc}", "speculative decoding cannot start",
                                 "pass the draft checkpoint directory or its config.json")]
    out: list[Finding] = []
    if target is not None:
        for label, dv, tv in draft_mismatches(model, eagle, target):
            if dv != tv:
                why = ("the EAGLE head reads the target's hidden states and token ids: it was trained for another "
                       "target" if eagle else "the draft's token ids must mean the target's tokens")
                out.append(Finding("error", f"draft {model.name} has {label} {dv} but the target model "
                                            f"{Path(target.source).name} has {label} {tv}", why,
                                   "pass a draft trained for this target model" if eagle else
                                   "pass a draft with the target's tokenizer"))
    spec = model.spec
    if spec is None:
        kind = "an EAGLE-style head" if eagle else "a standalone dense draft"
        out.append(Finding("ok", f"draft {model.name} is a dense model ({kind}): it needs no placement"))
        return model, 0, out
    redundant, found = check_placement(spec, draft_placement, ep, f"the draft model {model.name}")
    if draft_placement is None and target is not None and all(f.severity == "ok" for f in found):
        same = (spec.num_moe_layers, spec.num_experts) == (target.num_moe_layers, target.num_experts)
        found.append(Finding("ok", f"draft {model.name} ({counted(spec.num_moe_layers, 'MoE layer')} x "
                                   f"{spec.num_experts} experts) gets a placement of its own, not the target's"
                                   + (" (the same shape as the target's: a rebalance of either never moves the "
                                      "other's experts)" if same else "")))
    return model, redundant, out + found


_SERVED = {"plain": "in the compute dtype (counted in bf16; --dtype float32 doubles it)",
           "fp8": "as stored: FP8 values + float32 128x128 block scales",
           "int4": "packed: INT4 values + bf16 scales", "mxfp4": "packed: MXFP4 values + E8M0 scales"}


def check_expert_storage(spec: MoESpec, ep: int, redundant: int, weights: str | None = None,
                         what: str = "the target model") -> list[Finding]:
    """The routed experts' weight format (unquantized ones named by the checkpoint's dtype,
    ``MoESpec.expert_format_name``; ``weights`` as planned), how ``epmoe run`` serves it
    (``experts.storage.ExpertStorage``) and their bytes per rank (quantized values and scales; bf16 for plain
    checkpoints and FP8 ones dequantized on load, with the reason)."""
    fmt = WEIGHT_CHOICES[weights] if weights else spec.expert_weight_format
    try:
        storage = ExpertStorage.of(fmt, spec.moe_intermediate_size)
        per_expert = storage.bytes_per_expert(spec.hidden_size, spec.moe_intermediate_size)
    except ValueError as exc:
        return [Finding("error", f"{what}: routed experts: {exc}", "epmoe run refuses to load these experts",
                        "use a checkpoint in a served format (README: supported weight formats)")]
    slots = math.ceil((spec.num_experts + redundant) / ep)
    per_rank = per_expert * slots * spec.num_moe_layers
    reason = dequantized_reason(fmt, spec.moe_intermediate_size)
    dequantized = f" ({reason})" if reason else ""
    name = fmt if weights else spec.expert_format_name
    return [Finding("ok", f"{what}: routed experts {name}, served {_SERVED[storage.kind]}{dequantized}: "
                          f"{format_bytes(per_expert)} per expert, {format_bytes(per_rank)} per rank "
                          f"({counted(slots, 'slot')} x {counted(spec.num_moe_layers, 'MoE layer')})")]


def check_memory(spec: MoESpec, cfg: DoctorConfig, ep: int, redundant: int, draft: DraftModel | None = None,
                 draft_redundant: int = 0) -> list[Finding]:
    """Weights and caches (the draft's included) against GPU memory, through the planner, for the
    best-fitting all-to-all EP strategy, at ``cfg.context`` positions a sequence (``None``: the model's
    ``max_position_embeddings``, at most 4096: ``plan.request.default_context``)."""
    if cfg.hardware is None:
        return [Finding("warning", "memory not checked", "weights or KV cache may not fit",
                        "pass --hardware NAME (or a calibrated profile) to check")]
    try:
        hw: HardwareProfile = load_hardware(cfg.hardware)
    except ValueError as exc:
        return [Finding("error", f"hardware cannot be read: {exc}", "memory cannot be checked",
                        "pass a shipped profile name or a profile JSON written by epmoe calibrate")]
    nodes = cfg.nodes
    if ep // nodes > hw.gpus_per_node:
        return [Finding("error", f"EP size {ep} on {nodes} node(s) is {ep // nodes} GPUs per node but {hw.name} has "
                                 f"{hw.gpus_per_node}", "one node cannot hold that many EP ranks",
                        f"pass --nodes {nodes_needed(ep, hw.gpus_per_node)} or a smaller --ep"
                        if hw.inter_node is not None else
                        f"pass --ep {hw.gpus_per_node} or less: {hw.name} has no inter_node link")]
    slots = spec.num_experts + redundant
    if ep > 1 and (ep > slots or slots % ep):
        return [Finding("warning", f"memory not checked: {slots} expert slots per layer cannot be spread evenly over "
                                   f"EP size {ep}", "no EP strategy can be planned",
                        "fix the placement first (see the error above)")]
    context = cfg.context if cfg.context is not None else default_context(spec)
    try:
        req = PlanRequest(spec=spec, hardware=hw, gpus=ep, nodes=nodes, batches=(cfg.batch,), redundant=redundant,
                          context=context, weights=cfg.weights, mem_fraction=cfg.mem_fraction)
        result = plan(req)
    except ValueError as exc:
        return [Finding("error", "memory cannot be planned: "
                                 f"{exc}", "the set-up is inconsistent", "fix the named value")]
    draft_plan: dict[str, StrategyPlan] = {}
    if draft is not None and draft.spec is not None:
        try:
            dreq = PlanRequest(spec=draft.spec, hardware=hw, gpus=ep, nodes=nodes, batches=(cfg.batch,),
                               redundant=draft_redundant, context=context, mem_fraction=cfg.mem_fraction)
            draft_plan = {s.strategy.name: s for s in plan(dreq).strategies}
        except ValueError as exc:
            return [Finding("error", f"memory of the draft cannot be planned: {exc}", "the set-up is inconsistent",
                            "fix the draft's placement or the EP size")]
    # epmoe's EP runtime dispatches and combines by all-to-all; EP 1 is the single-GPU plan
    candidates = [s for s in result.strategies if s.strategy.mode != "all_reduce" or ep == 1]
    if not candidates:
        return [Finding("warning", f"memory not checked: no all-to-all EP strategy on {counted(ep, 'GPU')} "
                                   f"({'; '.join(result.skipped)})", "no EP strategy can be planned",
                        "choose an EP size the model's slots divide")]
    extra = {id(s): draft_bytes(draft, draft_plan, s, cfg.batch, ep) for s in candidates}
    best = min(candidates, key=lambda s: s.steps[0].memory.total + extra[id(s)] - s.steps[0].memory.capacity)
    m, dbytes = best.steps[0].memory, extra[id(best)]
    total = m.total + dbytes
    where = f"{best.strategy.name} at batch {cfg.batch}, context {context}"
    with_draft = f", draft {draft.name} {dbytes / GIB:.1f}" if draft is not None else ""
    if total <= m.capacity:
        return [Finding("ok", f"weights and caches fit: {total / GIB:.1f} of {m.capacity / GIB:.1f} GiB per "
                              f"GPU ({where}{with_draft})")]
    hint = weights_hint(req.expert_format)
    over = (f"weights and caches need {total / GIB:.1f} GiB per GPU, {(total - m.capacity) / GIB:.1f} GiB over the "
            f"{m.capacity / GIB:.1f} GiB usable ({where}; weights {m.weights / GIB:.1f}, KV cache "
            f"{m.kv_cache / GIB:.1f}{with_draft})")
    return [Finding("error", over, "the server runs out of memory at start-up or at CUDA-graph capture",
                    f"use more GPUs, {hint + ', ' if hint else ''}a smaller batch or a shorter context")]


def diagnose(cfg: DoctorConfig) -> list[Finding]:
    """All checks of ``cfg``, in order: backends, target model, checkpoint and placement, draft, memory.

    Raises:
        ValueError: a bad ``ep``, ``nodes``, ``batch``, ``context``, ``weights`` or ``mem_fraction``, a ``hardware``
            profile that is unknown, unreadable or incomplete, or a ``model`` or ``draft`` path to no config (named).
    """
    ep = check_int("ep", 1 if cfg.ep is None else cfg.ep, 1)
    if ep > MAX_GPUS:  # as plan's --gpus
        raise ValueError(f"ep must be at most {MAX_GPUS}, got {ep}")
    nodes = check_int("nodes", cfg.nodes, 1)
    check_int("batch", cfg.batch, 1)
    if cfg.batch > MAX_BATCH:
        raise ValueError(f"batch must be at most {MAX_BATCH}, got {cfg.batch}")
    if cfg.context is not None:
        check_int("context", cfg.context, 1)
        if cfg.context > MAX_CONTEXT:
            raise ValueError(f"context must be at most {MAX_CONTEXT}, got {cfg.context}")
    if ep % nodes:
        raise ValueError(f"ep ({ep}) must be divisible by nodes ({nodes})")
    if cfg.weights is not None and cfg.weights not in WEIGHT_CHOICES:
        raise ValueError(f"weights must be one of {', '.join(WEIGHT_CHOICES)}, got {cfg.weights!r}")
    if not 0 < cfg.mem_fraction <= 1:
        raise ValueError(f"mem_fraction must lie in (0, 1], got {cfg.mem_fraction}")
    if cfg.hardware is not None:
        load_hardware(cfg.hardware)  # an unknown, unreadable or incomplete profile is a bad argument, named first
    for name in ("model", "draft"):  # a path to no config at all is a bad argument; a config that is wrong, a finding
        path = getattr(cfg, name)
        if path is not None:
            check_config_path(path, name)
    findings = check_backends(ep, nodes)
    spec, problems = _load_spec(cfg.model, "the target model")
    findings += problems
    redundant = 0
    if spec is not None:
        weights = check_checkpoint(spec, cfg.model) if Path(cfg.model).is_dir() else []
        stop_ids = check_stop_ids(spec, cfg.model)  # an unreadable generation_config.json is named here first
        findings += weights + stop_ids
        if Path(cfg.model).is_dir() and not stop_ids and not any(f.severity == "error" for f in weights):
            findings += check_generation_files(cfg.model)  # (the tokenizer reads config.json too: its error first)
        redundant, placed = check_placement(spec, cfg.placement, ep, "the target model")
        findings += placed
        placed_ok = not any(f.severity == "error" for f in placed)
        storage = check_expert_storage(spec, ep, redundant, cfg.weights) if placed_ok else []
        findings += storage
    draft, draft_redundant = None, 0
    if cfg.draft is not None:
        draft, draft_redundant, found = check_draft(cfg.draft, cfg.draft_placement, ep, spec)
        findings += found
    elif cfg.draft_placement is not None:
        findings.append(Finding("warning", "--draft-placement given without --draft", "it is not checked",
                                "pass --draft DIR as well"))
    if spec is not None and not placed_ok:
        findings.append(Finding("warning", "expert bytes per rank and memory not checked: the placement is refused",
                                "no rank layout to size", "fix the placement first (see the error above)"))
    elif spec is not None and any(f.severity == "error" for f in storage):
        findings.append(Finding("warning", "memory not checked: the routed experts' format is refused",
                                "the planner prices only what epmoe run serves",
                                "fix the weight format first (see the error above)"))
    elif spec is not None:
        findings += check_memory(spec, cfg, ep, redundant, draft, draft_redundant)
    if spec is not None and cfg.context is not None and cfg.context > spec.max_position_embeddings:
        findings.append(Finding("warning", f"--context {cfg.context} is above the model's max_position_embeddings "
                                           f"{spec.max_position_embeddings}",
                                "its positions do not reach it; the memory check prices it as asked",
                                f"pass --context {spec.max_position_embeddings} or less"))
    return findings


def run_doctor(cfg: DoctorConfig) -> int:
    """Print every finding, one line each; return 1 when any is an error, else 0."""
    findings = diagnose(cfg)
    for f in findings:
        print(f.line())
    return 1 if any(f.severity == "error" for f in findings) else 0
