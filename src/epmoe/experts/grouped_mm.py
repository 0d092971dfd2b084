"""The plain PyTorch composition: sort pairs by slot, ``torch._grouped_mm`` twice, ``index_add_``.

Graph-safe (the group offsets stay on the device) and runs wherever ``torch._grouped_mm`` does (CUDA
sm80+ in bf16; CPU). It is the peer the Triton backend is measured against, registered as the
``grouped_mm`` expert backend.
"""

from __future__ import annotations

import torch

from epmoe.experts.weights import Activation, ExpertWeights


def grouped_mm_experts(
    x: torch.Tensor,
    topk_slots: torch.Tensor,
    topk_weights: torch.Tensor,
    weights: ExpertWeights,
    activation: Activation,
    weight_on_input: bool = False,
) -> torch.Tensor:
    """Expert compute through ``torch._grouped_mm`` (contract of ``experts.ExpertBackend``).

    Args:
        x: ``[T, D]`` rows, same dtype as the weights.
        topk_slots: ``[T, K]`` int64 local slot ids, ``-1`` = skip.
        topk_weights: ``[T, K]`` float routing weights.
        weights: ``w13 [S, 2F, D]``, ``w2 [S, D, F]`` (+ optional biases).
        activation: the gated activation.
        weight_on_input: scale the expert input by the weight instead of its output.

    Returns:
        ``[T, D]`` in ``x.dtype``.
    """
    t, k = topk_slots.shape
    s = weights.num_slots
    key = torch.where((topk_slots >= 0) & (topk_slots < s), topk_slots, s).reshape(-1)
    order = torch.argsort(key, stable=True)
    sorted_key = key[order]
    valid = (sorted_key < s).unsqueeze(1)
    safe_key = sorted_key.clamp(max=s - 1)
    counts = torch.zeros(s + 1, dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, key, torch.ones_like(key, dtype=torch.int32))
    offs = torch.cumsum(counts[:s], 0, dtype=torch.int32)
    token_idx = order // k
    w = topk_weights.reshape(-1)[order].unsqueeze(1)

    h = x[token_idx]
    if weight_on_input:
        h = h * w.to(h.dtype)
    gate_up = torch._grouped_mm(h, weights.w13.transpose(1, 2), offs=offs)
    if weights.b13 is not None:
        gate_up = gate_up + weights.b13[safe_key]
    gate, up = gate_up.chunk(2, dim=-1)
    y = torch._grouped_mm(activation(gate, up).to(x.dtype), weights.w2.transpose(1, 2), offs=offs)
    if weights.b2 is not None:
        y = y + weights.b2[safe_key]
    if not weight_on_input:
        y = y * w.to(y.dtype)
    y = torch.where(valid, y, 0)
    out = torch.zeros_like(x)
    out.index_add_(0, token_idx, y.to(x.dtype))
    return out
