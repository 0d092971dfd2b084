"""The reference expert backend: exact, one dense matmul per active slot (every fast backend is tested
against it)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from epmoe.experts.weights import Activation, ExpertWeights


def reference_experts(
    x: torch.Tensor,
    topk_slots: torch.Tensor,
    topk_weights: torch.Tensor,
    weights: ExpertWeights,
    activation: Activation,
    weight_on_input: bool = False,
) -> torch.Tensor:
    """The exact reference: one dense matmul per active slot, results added with ``index_add_``.

    Shapes and dtypes as in ``ExpertBackend``. Host-syncs (it reads which slots are active), so it is
    not CUDA-graph safe; the fast backends are.
    """
    out = torch.zeros_like(x)
    if x.shape[0] == 0:
        return out
    valid = (topk_slots >= 0) & (topk_slots < weights.num_slots)  # others skip (ExpertBackend)
    flat_slots = torch.where(valid, topk_slots, weights.num_slots).reshape(-1)
    order = torch.argsort(flat_slots, stable=True)
    counts = torch.bincount(flat_slots, minlength=weights.num_slots + 1)[: weights.num_slots].tolist()
    k = topk_slots.shape[1]
    start = 0
    for slot, n in enumerate(counts):
        if n == 0:
            continue
        pairs = order[start:start + n]
        start += n
        token_idx = pairs // k
        w = topk_weights.reshape(-1)[pairs].unsqueeze(-1)
        h = x[token_idx]
        if weight_on_input:
            h = h * w.to(h.dtype)
        gate_up = F.linear(h, weights.w13[slot], None if weights.b13 is None else weights.b13[slot])
        gate, up = gate_up.chunk(2, dim=-1)
        y = F.linear(activation(gate, up), weights.w2[slot], None if weights.b2 is None else weights.b2[slot])
        if not weight_on_input:
            y = y * w.to(y.dtype)
        out.index_add_(0, token_idx, y.to(out.dtype))
    return out
