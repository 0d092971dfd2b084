"""The logical -> physical slot map: every replica policy sends each token to a copy of its own expert, and the
round-robin and random policies spread an expert's tokens over all of its copies."""

from __future__ import annotations

import pytest
import torch

from epmoe.placement import ExpertPlacement
from epmoe.routing import SlotMap

# Two layers of 6 experts in 10 slots on 2 ranks; layer 1: expert 2 has three copies, experts 1 and 5 two.
PHY2LOG = torch.tensor([[0, 1, 2, 3, 4, 5, 0, 1, 2, 3],
                        [2, 1, 0, 5, 4, 3, 2, 1, 2, 5]])
PLACEMENT = ExpertPlacement.from_phy2log(PHY2LOG, ep_size=2, num_experts=6)


def _topk(num_tokens: int, k: int = 3, seed: int = 0) -> torch.Tensor:
    """``[T, K]`` distinct random logical ids per token."""
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(6, generator=g)[:k] for _ in range(num_tokens)])


def test_round_robin_takes_copy_t_plus_k_mod_logcnt():
    topk_idx = _topk(23)
    for layer in range(2):
        slots = SlotMap(PLACEMENT, layer, rank=1, policy="round_robin")(topk_idx)
        for t in range(topk_idx.shape[0]):
            for k in range(topk_idx.shape[1]):
                e = int(topk_idx[t, k])
                copy = (t + k) % int(PLACEMENT.logcnt[layer, e])
                assert int(slots[t, k]) == int(PLACEMENT.log2phy[layer, e, copy]), (layer, t, k)


@pytest.mark.parametrize("policy", ["static", "round_robin", "random"])
def test_every_policy_sends_tokens_to_a_copy_of_their_expert(policy):
    torch.manual_seed(0)
    topk_idx = _topk(50)
    for layer in range(2):
        for rank in range(2):
            slots = SlotMap(PLACEMENT, layer, rank, policy)(topk_idx)
            assert slots.dtype == torch.int64 and slots.shape == topk_idx.shape
            assert torch.equal(PLACEMENT.phy2log[layer][slots], topk_idx), (layer, rank)
            if policy == "static":
                assert torch.equal(slots, PLACEMENT.dispatch_table(rank)[layer][topk_idx])


@pytest.mark.parametrize("policy", ["round_robin", "random"])
def test_replicated_experts_use_every_copy_evenly(policy):
    """600 tokens per expert: every copy of expert 2 (three) and of experts 1 and 5 (two) takes its share."""
    torch.manual_seed(0)
    topk_idx = torch.arange(6).repeat(600, 1)[:, :3]  # every token picks experts 0, 1, 2
    topk_idx = torch.cat([topk_idx, torch.arange(6).flip(0).repeat(600, 1)[:, :3]])  # and then 5, 4, 3
    counts = torch.bincount(SlotMap(PLACEMENT, 1, rank=0, policy=policy)(topk_idx).reshape(-1), minlength=10)
    for expert in range(6):
        copies = PLACEMENT.log2phy[1, expert, : int(PLACEMENT.logcnt[1, expert])]
        share = counts[copies].double() / counts[copies].sum()
        assert counts[copies].sum() == 600, expert
        assert torch.all((share - 1 / len(copies)).abs() < 0.06), (expert, counts[copies].tolist())
