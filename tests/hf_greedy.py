"""Greedy tokens of a transformers causal LM through its own ``generate`` (a left-padded batch, exactly
``n`` new tokens: every call makes the same number of forward passes, so sharded ranks stay in step)."""

from __future__ import annotations

import torch


def hf_greedy(model, prompts: list[list[int]], n: int, pad_id: int) -> list[list[int]]:
    """``n`` greedy tokens for each prompt (token-id lists), in prompt order."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             eos_token_id=None, pad_token_id=pad_id)
    return out[:, width:].tolist()
