"""The logical -> physical expert map of one layer, with the replica policies."""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

from epmoe.placement import ExpertPlacement

ReplicaPolicy = Literal["static", "round_robin", "random"]
REPLICA_POLICIES = ("static", "round_robin", "random")


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

    @property
    def static_table(self) -> torch.Tensor | None:
        """``table`` when every token takes it (the ``static`` policy, or one copy of every expert), else
        ``None`` (the copy depends on the token)."""
        return self.table if self.policy == "static" or self.log2phy.shape[1] == 1 else None

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
