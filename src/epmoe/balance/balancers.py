"""The balancers behind names: checked inputs in, an ``ExpertPlacement`` out."""

from __future__ import annotations

import numpy as np
import torch

from epmoe.balance.deepseek import deepseek_phy2log
from epmoe.balance.local_search import epmoe_phy2log
from epmoe.balance.problem import check_problem
from epmoe.placement import ExpertPlacement


def balance_epmoe(
    load: torch.Tensor | np.ndarray,
    ep_size: int,
    num_redundant: int = 0,
    *,
    num_nodes: int = 1,
    num_groups: int = 1,
) -> ExpertPlacement:
    """epmoe's balancer: greedy replication, LPT packing, then local search (moves and swaps).

    Args:
        load: ``[L, E]`` tokens per logical expert (non-negative, finite).
        ep_size: ``G`` EP ranks.
        num_redundant: ``R`` redundant slots per layer; ``E + R`` divisible by ``G``.
        num_nodes: nodes; ``> 1`` selects the hierarchical option (every group stays on one node).
        num_groups: expert groups (contiguous blocks of ``E / num_groups`` experts).

    Returns:
        The placement (``P = E + R`` slots, each rank ``P / G``, every expert at least one copy).

    Raises:
        ValueError: as ``check_problem``.
    """
    w = check_problem(load, ep_size, num_redundant, num_nodes, num_groups)
    phy = epmoe_phy2log(w, w.shape[1] + num_redundant, ep_size, num_nodes, num_groups)
    return ExpertPlacement(torch.from_numpy(phy), num_experts=w.shape[1], ep_size=ep_size)


def balance_deepseek(
    load: torch.Tensor | np.ndarray,
    ep_size: int,
    num_redundant: int = 0,
    *,
    num_nodes: int = 1,
    num_groups: int = 1,
) -> ExpertPlacement:
    """DeepSeek's EPLB (github.com/deepseek-ai/EPLB): hierarchical when ``num_nodes > 1``, else global.

    With ``num_nodes == 1`` and ``num_groups > 1`` this is DeepSeek's hierarchical policy on one node,
    as its ``rebalance_experts`` does whenever the groups divide over the nodes.

    Args:
        load: ``[L, E]`` tokens per logical expert.
        ep_size: ``G`` EP ranks (DeepSeek's ``num_gpus``).
        num_redundant: ``R``; DeepSeek's ``num_replicas`` is ``E + R``.
        num_nodes: nodes.
        num_groups: expert groups.

    Raises:
        ValueError: as ``check_problem`` (DeepSeek silently falls back to the global policy when the
            groups do not divide over the nodes; epmoe reports it).
    """
    w = check_problem(load, ep_size, num_redundant, num_nodes, num_groups)
    phy = deepseek_phy2log(w, w.shape[1] + num_redundant, num_groups, num_nodes, ep_size)
    return ExpertPlacement(torch.from_numpy(phy), num_experts=w.shape[1], ep_size=ep_size)
