"""``epmoe doctor``: check a set-up before launch, one line per finding: what, why it matters, what to change.

Checks that the communication backends are there (gloo, NCCL, CUDA, peer access between GPUs), that
the visible GPUs cover the EP size, that the placement covers every MoE layer of the target model
and, for speculative decoding, of the draft model (a dense EAGLE-3 draft needs none), and that
weights and caches fit in memory (through the planner's memory model).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as dist

from epmoe.hardware import load_hardware
from epmoe.placement import ExpertPlacement
from epmoe.planner import GIB, PlanRequest, plan
from epmoe.spec import DenseModelError, MoESpec, load_moe_spec

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
        placement: placement file of the target (JSON or safetensors), or ``None`` for the trivial one.
        draft: draft model directory or ``config.json`` for speculative decoding, or ``None``.
        draft_placement: placement file of an MoE draft.
        ep: EP size ``G`` (``None``: 1).
        hardware: hardware profile name or path for the memory check (``None``: memory not checked).
        batch: sequences per step for the memory check.
        context: KV-cache length per sequence for the memory check, tokens.
        weights: expert storage override (``bf16``, ``fp8``, ``int4``), ``None`` for the checkpoint's.
        mem_fraction: share of GPU memory the server may use.
    """

    model: str
    placement: str | None = None
    draft: str | None = None
    draft_placement: str | None = None
    ep: int | None = None
    hardware: str | None = None
    batch: int = 64
    context: int = 4096
    weights: str | None = None
    mem_fraction: float = 0.9


def check_backends(ep: int) -> list[Finding]:
    """gloo, CUDA, NCCL, the GPU count against ``ep`` and peer access among the first ``ep`` GPUs."""
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
    if ep > n:
        out.append(Finding("error", f"EP size {ep} but {n} GPU(s) are visible on this node",
                           "each EP rank needs its own GPU", f"use --ep {n} or fewer, check CUDA_VISIBLE_DEVICES, "
                           "or launch across nodes with torchrun"))
    else:
        out.append(Finding("ok", f"{n} GPU(s) visible, EP size {ep}"))
    pairs = [(i, j) for i in range(min(ep, n)) for j in range(min(ep, n)) if i != j]
    missing = [(i, j) for i, j in pairs if not torch.cuda.can_device_access_peer(i, j)]
    if missing:
        shown = ", ".join(f"{i}->{j}" for i, j in missing[:8]) + (" ..." if len(missing) > 8 else "")
        out.append(Finding("warning", f"no peer access between GPUs {shown}",
                           "NCCL falls back to copies through host memory: all-to-all and all-reduce get slower",
                           "enable P2P (disable ACS / IOMMU passthrough on PCIe machines) or expect the slower links"))
    elif pairs:
        out.append(Finding("ok", f"peer access between all {min(ep, n)} GPUs"))
    return out


def _load_spec(path: str, what: str) -> tuple[MoESpec | None, list[Finding]]:
    try:
        return load_moe_spec(path), []
    except DenseModelError as exc:
        return None, [Finding("error", f"{what} has no MoE layers ({exc})", "there are no experts to place",
                              "run it without EP, or point --model at the MoE checkpoint")]
    except (ValueError, FileNotFoundError) as exc:
        return None, [Finding("error", f"{what} cannot be read: {exc}", "nothing can be checked or launched",
                              "pass a checkpoint directory or its config.json")]


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
        return 0, [Finding("ok", f"{what}: no placement given; the trivial placement ({spec.num_experts // ep} "
                                 f"experts per rank on {spec.num_moe_layers} MoE layers) will be used")]
    try:
        p = ExpertPlacement.load(placement, ep_size=ep)
        p.check_model(spec.num_moe_layers, spec.num_experts, what)
    except (ValueError, FileNotFoundError) as exc:
        return 0, [Finding("error", f"{what}: {exc}", "a layer without a matching placement cannot route its tokens",
                           f"build a placement for {spec.num_moe_layers} MoE layers x {spec.num_experts} experts at "
                           f"EP {ep} (epmoe's balancer or ExpertPlacement.trivial)")]
    return p.num_redundant, [Finding("ok", f"{what}: placement {Path(placement).name} covers all {spec.num_moe_layers} "
                                           f"MoE layers ({p.num_slots} slots, {p.num_redundant} redundant)")]


def check_draft(draft: str, draft_placement: str | None, ep: int) -> list[Finding]:
    """A dense (EAGLE-3) draft needs no placement; an MoE draft needs its own."""
    try:
        spec = load_moe_spec(draft)
    except DenseModelError:
        return [Finding("ok", f"draft {Path(draft).name} is a dense model (an EAGLE-3 draft has one dense decoder "
                              "layer): it needs no placement")]
    except (ValueError, FileNotFoundError) as exc:
        return [Finding("error", f"draft cannot be read: {exc}", "speculative decoding cannot start",
                        "pass the draft checkpoint directory or its config.json")]
    if draft_placement is None:
        return [Finding("error", f"draft is an MoE model ({spec.num_moe_layers} MoE layers x {spec.num_experts} "
                                 "experts) with no placement of its own",
                        "it must not reuse the target's placement: layer counts and experts differ",
                        "pass --draft-placement FILE built for the draft")]
    return check_placement(spec, draft_placement, ep, "the draft model")[1]


def check_memory(spec: MoESpec, cfg: DoctorConfig, ep: int, redundant: int) -> list[Finding]:
    """Weights and caches against GPU memory, through the planner, for the best-fitting all-to-all EP strategy."""
    if cfg.hardware is None:
        return [Finding("warning", "memory not checked", "weights or KV cache may not fit",
                        "pass --hardware NAME (or a calibrated profile) to check")]
    try:
        req = PlanRequest(spec=spec, hardware=load_hardware(cfg.hardware), gpus=ep, batches=(cfg.batch,),
                          redundant=redundant, context=cfg.context, weights=cfg.weights, mem_fraction=cfg.mem_fraction)
        result = plan(req)
    except ValueError as exc:
        return [Finding("error", f"memory cannot be planned: {exc}", "the set-up is inconsistent", "fix the named value")]
    # epmoe's EP runtime dispatches and combines by all-to-all; EP 1 is the single-GPU plan
    candidates = [s for s in result.strategies if s.strategy.mode != "all_reduce" or ep == 1]
    best = min(candidates, key=lambda s: s.steps[0].memory.over)
    m = best.steps[0].memory
    where = f"{best.strategy.name} at batch {cfg.batch}, context {cfg.context}"
    if m.fits:
        return [Finding("ok", f"weights and caches fit: {m.total / GIB:.1f} of {m.capacity / GIB:.1f} GiB per GPU ({where})")]
    return [Finding("error", f"weights and caches need {m.total / GIB:.1f} GiB per GPU, {m.over / GIB:.1f} GiB over the "
                             f"{m.capacity / GIB:.1f} GiB usable ({where}; weights {m.weights / GIB:.1f}, KV cache "
                             f"{m.kv_cache / GIB:.1f})",
                    "the server runs out of memory at start-up or at CUDA-graph capture",
                    "use more GPUs, --weights fp8/int4, a smaller batch or a shorter context")]


def diagnose(cfg: DoctorConfig) -> list[Finding]:
    """All checks of ``cfg``, in order: backends, target model and placement, draft, memory."""
    ep = cfg.ep or 1
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
        raise ValueError(f"ep must be a positive integer, got {cfg.ep!r}")
    findings = check_backends(ep)
    spec, problems = _load_spec(cfg.model, "the target model")
    findings += problems
    redundant = 0
    if spec is not None:
        redundant, placed = check_placement(spec, cfg.placement, ep, "the target model")
        findings += placed
    if cfg.draft is not None:
        findings += check_draft(cfg.draft, cfg.draft_placement, ep)
    elif cfg.draft_placement is not None:
        findings.append(Finding("warning", "--draft-placement given without --draft", "it is not checked",
                                "pass --draft DIR as well"))
    if spec is not None:
        findings += check_memory(spec, cfg, ep, redundant)
    return findings


def run_doctor(cfg: DoctorConfig) -> int:
    """Print every finding, one line each; return 1 when any is an error, else 0."""
    findings = diagnose(cfg)
    for f in findings:
        print(f.line())
    return 1 if any(f.severity == "error" for f in findings) else 0
