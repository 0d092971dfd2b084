"""Routers of every served family, and the logical -> physical expert map.

``Router`` reproduces the Hugging Face transformers MoE gates exactly (transformers 5.x
``modeling_*.py``): softmax or sigmoid scoring, grouped top-k, DeepSeek-V3's score-correction bias
(used for selection only), top-k normalisation, routed scaling, gpt-oss's router bias with a softmax
over the chosen logits, and Llama-4's sigmoid of the chosen logits.

``map_to_slots`` turns logical expert ids into physical slot ids with a replica policy.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from .placement import ExpertPlacement
from .spec import MoESpec

ReplicaPolicy = Literal["static", "round_robin", "random"]
REPLICA_POLICIES = ("static", "round_robin", "random")


class Router(nn.Module):
    """The gate of one MoE layer.

    Parameters (names as in the checkpoints): ``weight [E, D]``; ``bias [E]`` (gpt-oss);
    buffer ``e_score_correction_bias [E]`` float32 (DeepSeek-V3 / Kimi-K2).

    Args:
        spec: the model's MoE facts.
        dtype: parameter dtype of ``weight``/``bias`` (the correction bias stays float32).
        device: where the parameters live.
        impl: how the top-k after the logits runs: ``auto`` (one Triton kernel, ``kernels.triton_router``,
            for CUDA tensors when Triton imports and the router kind is supported; PyTorch otherwise),
            ``torch`` (always PyTorch: the reference that matches transformers bit for bit).

    Raises:
        ValueError: an unknown ``impl``.
    """

    def __init__(self, spec: MoESpec, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
                 impl: str = "auto"):
        super().__init__()
        if impl not in ("auto", "torch"):
            raise ValueError(f"router impl must be 'auto' or 'torch', got {impl!r}")
        self.spec = spec
        self.impl = impl
        e, d = spec.num_experts, spec.hidden_size
        self.fp32_logits = spec.model_type in ("deepseek_v2", "deepseek_v3", "kimi_k2")
        w_dtype = torch.float32 if self.fp32_logits else dtype
        self.weight = nn.Parameter(torch.empty(e, d, dtype=w_dtype, device=device), requires_grad=False)
        self.bias = (
            nn.Parameter(torch.zeros(e, dtype=dtype, device=device), requires_grad=False) if spec.router_bias else None
        )
        if spec.correction_bias:
            self.register_buffer("e_score_correction_bias", torch.zeros(e, dtype=torch.float32, device=device))
        else:
            self.e_score_correction_bias = None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Route tokens.

        Args:
            x: ``[T, D]`` hidden states.

        Returns:
            ``topk_idx [T, K]`` int64 logical expert ids and ``topk_weights [T, K]`` float32 weights
            (for Llama-4 the weight scales the expert input; for all others its output).
        """
        s = self.spec
        if self.fp32_logits:
            logits = F.linear(x.float(), self.weight.float())
        else:
            logits = F.linear(x, self.weight, self.bias)
        kind = s.router_kind
        fused = _fused_router(logits, s) if self.impl == "auto" else None
        if fused is not None:
            return fused.route_triton(logits, s, self.e_score_correction_bias)
        if kind == "softmax_topk":
            probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
            if s.n_group > 1:
                probs = _group_mask(probs, s, probs, fill=0.0)
            weights, idx = torch.topk(probs, s.top_k, dim=-1)
            if s.norm_topk_prob:
                weights = weights / weights.sum(dim=-1, keepdim=True)
            if s.model_type in ("qwen2_moe", "qwen3_moe", "olmoe"):
                weights = weights.to(logits.dtype)
            weights = weights * s.routed_scaling_factor if s.routed_scaling_factor != 1.0 else weights
        elif kind == "sigmoid_topk":
            scores = logits.sigmoid()
            choice = scores + self.e_score_correction_bias
            if s.n_group > 1:
                choice = _group_mask(choice, s, choice, fill=float("-inf"))
            idx = torch.topk(choice, s.top_k, dim=-1, sorted=False)[1]
            weights = scores.gather(1, idx)
            if s.norm_topk_prob:
                weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
            weights = weights * s.routed_scaling_factor
        elif kind == "topk_softmax":
            top, idx = torch.topk(logits, s.top_k, dim=-1)
            weights = torch.softmax(top, dim=1, dtype=top.dtype)
        else:  # topk_sigmoid (Llama-4)
            top, idx = torch.topk(logits, s.top_k, dim=1)
            weights = torch.sigmoid(top.float()).to(top.dtype)
        return idx, weights.float()


def _fused_router(logits: torch.Tensor, spec: MoESpec):
    """The ``triton_router`` module when it can route these logits (CUDA, Triton importable, kind supported)."""
    if not logits.is_cuda:
        return None
    try:
        from .kernels import triton_router
    except ImportError:
        return None
    return triton_router if triton_router.supports(spec) else None


def _group_mask(values: torch.Tensor, s: MoESpec, scores_for_groups: torch.Tensor, fill: float) -> torch.Tensor:
    """Keep only experts of the ``topk_group`` best groups (DeepSeek grouped / device-limited routing)."""
    t = values.shape[0]
    grouped = scores_for_groups.view(t, s.n_group, s.num_experts // s.n_group)
    if s.group_score == "top2_sum":
        group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
    else:
        group_scores = grouped.max(dim=-1).values
    group_idx = torch.topk(group_scores, k=s.topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1.0).bool()
    expert_mask = group_mask.unsqueeze(-1).expand(-1, -1, s.num_experts // s.n_group).reshape(t, s.num_experts)
    return values.masked_fill(~expert_mask, fill)


class SlotMap(nn.Module):
    """Logical expert ids -> global physical slot ids for one layer, as seen from one EP rank.

    Buffers: ``table [E]`` int64 (the static choice: a copy on this rank first, else spread over
    senders; ``ExpertPlacement.dispatch_table``), ``log2phy [E, max_replicas]`` and ``logcnt [E]``.

    Args:
        placement: the expert placement.
        layer: index of this MoE layer in ``[0, L)``.
        rank: this rank in the EP group.
        policy: ``static`` (the table), ``round_robin`` (copy ``(token + k) mod logcnt``) or ``random``.
        device: where the tables live.

    Raises:
        ValueError: unknown policy, or a layer/rank outside the placement.
    """

    def __init__(
        self,
        placement: ExpertPlacement,
        layer: int,
        rank: int,
        policy: ReplicaPolicy = "static",
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if policy not in REPLICA_POLICIES:
            raise ValueError(f"replica policy {policy!r} is not one of {REPLICA_POLICIES}")
        if not 0 <= layer < placement.num_layers:
            raise ValueError(f"layer ({layer}) must lie in [0, {placement.num_layers}) of the placement")
        self.policy = policy
        self.register_buffer("table", placement.dispatch_table(rank)[layer].to(device), persistent=False)
        self.register_buffer("log2phy", placement.log2phy[layer].to(device), persistent=False)
        self.register_buffer("logcnt", placement.logcnt[layer].to(device), persistent=False)

    def forward(self, topk_idx: torch.Tensor) -> torch.Tensor:
        """``topk_idx [T, K]`` int64 logical ids -> ``[T, K]`` int64 global physical slot ids."""
        if self.policy == "static" or self.log2phy.shape[1] == 1:
            return self.table[topk_idx]
        cnt = self.logcnt[topk_idx]
        if self.policy == "round_robin":
            t, k = topk_idx.shape
            turn = torch.arange(t, device=topk_idx.device).unsqueeze(1) + torch.arange(k, device=topk_idx.device)
        else:
            turn = torch.randint(0, 1 << 30, topk_idx.shape, device=topk_idx.device)
        return self.log2phy[topk_idx, torch.remainder(turn, cnt)]
