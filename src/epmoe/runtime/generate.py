"""Greedy generation in lockstep across EP ranks.

Each rank serves its own share of the prompts (attention is data-parallel) as one left-padded batch;
every rank makes the same number of forward calls, and a rank with no prompts joins each step's MoE
collectives with an empty batch. The same function runs the unsharded reference model.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn


@dataclass
class GenerationResult:
    """Output of ``greedy_generate``.

    Attributes:
        tokens: new token ids per prompt, in prompt order.
        step_ms: wall time of each forward step in ms (step 0 is the prefill).
        batch_tokens: tokens this rank fed to the model at each step.
        last_logits: ``[B, V]`` float32 logits of the final step (``None`` without prompts).
    """

    tokens: list[list[int]]
    step_ms: list[float] = field(default_factory=list)
    batch_tokens: list[int] = field(default_factory=list)
    last_logits: torch.Tensor | None = None


@torch.no_grad()
def greedy_generate(
    model: nn.Module,
    prompts: list[list[int]],
    max_new_tokens: int,
    pad_id: int,
    device: torch.device | str = "cpu",
    idle_step: Callable[[], None] | None = None,
    on_step: Callable[[int], None] | None = None,
) -> GenerationResult:
    """Greedy-decode ``max_new_tokens`` tokens for each prompt, as one left-padded batch.

    Args:
        model: a transformers causal LM (sharded or not).
        prompts: token ids per prompt; may be empty (the rank then only calls ``idle_step``).
        max_new_tokens: tokens to generate per prompt (forward steps: 1 prefill + ``max_new_tokens - 1``).
        pad_id: the padding token id.
        device: where the inputs go.
        idle_step: called once per step when ``prompts`` is empty (joins the collectives).
        on_step: called after every step with the step index (the EPLB hook, for instance).

    Raises:
        ValueError: ``max_new_tokens`` < 1, an empty prompt, or no prompts and no ``idle_step``.
    """
    from transformers import DynamicCache

    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    result = GenerationResult(tokens=[[] for _ in prompts])
    if not prompts:
        if idle_step is None:
            raise ValueError("no prompts on this rank and no idle_step to join the collectives with")
        for step in range(max_new_tokens):
            t0 = time.perf_counter()
            idle_step()
            result.step_ms.append((time.perf_counter() - t0) * 1e3)
            result.batch_tokens.append(0)
            if on_step is not None:
                on_step(step)
        return result

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    ids, mask = ids.to(device), mask.to(device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache()
    cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    step_ids = ids
    for step in range(max_new_tokens):
        t0 = time.perf_counter()
        out = model(input_ids=step_ids, attention_mask=mask, position_ids=positions, use_cache=True,
                    **{cache_arg: cache})
        logits = out.logits[:, -1, :].float()
        nxt = logits.argmax(dim=-1)
        result.step_ms.append((time.perf_counter() - t0) * 1e3)
        result.batch_tokens.append(int(step_ids.numel()))
        for i, tok in enumerate(nxt.tolist()):
            result.tokens[i].append(tok)
        if on_step is not None:
            on_step(step)
        step_ids = nxt.unsqueeze(1)
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        positions = positions[:, -1:] + 1
    result.last_logits = logits.cpu()
    return result
