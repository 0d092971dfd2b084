"""Drop-in replacements for the EPLB entry points other code calls, backed by epmoe's balancer.

``rebalance_experts(weight, num_replicas, num_groups, num_nodes, num_gpus)`` has the signature and return values
of DeepSeek's EPLB (github.com/deepseek-ai/EPLB, ``eplb.py``), which SGLang and vLLM copied: swap the import and
the placements get epmoe's balancer (greedy replication, LPT packing without two copies of an expert on one
rank, local search). ``rebalance_placement`` is the same as an ``ExpertPlacement``, movement-aware when given the
map serving now; the SGLang and vLLM plug-ins (``epmoe.integrations``) call it.
"""

from __future__ import annotations

import numpy as np
import torch

from epmoe.balance.balancers import balance_deepseek
from epmoe.balance.moves import rebalance_with_moves
from epmoe.balance.problem import layer_balancedness
from epmoe.balance.registry import get_balancer
from epmoe.checks import check_int, check_positive_int
from epmoe.loads import as_load_array
from epmoe.placement import ExpertPlacement


def _hierarchy(num_groups: int | None, num_nodes: int, num_gpus: int, num_experts: int) -> tuple[int, int]:
    """``(num_nodes, num_groups)`` the balancer gets: DeepSeek's hierarchical policy where the groups divide over
    the nodes, else its global one (``(1, 1)``), as DeepSeek's ``rebalance_experts`` decides."""
    if (num_nodes > 1 and num_groups and num_groups % num_nodes == 0 and num_gpus % num_nodes == 0
            and num_experts % num_groups == 0):
        return num_nodes, num_groups
    return 1, 1


def _current(current: torch.Tensor | None, shape: tuple[int, int], num_experts: int, num_gpus: int
             ) -> ExpertPlacement | None:
    """The serving placement when ``current`` is a valid map of the same shape (servers may pass maps with -1
    holes, e.g. vLLM's elastic EP; those are balanced from scratch)."""
    if current is None or tuple(current.shape) != shape:
        return None
    try:
        return ExpertPlacement(current.detach().cpu().long(), num_experts=num_experts, ep_size=num_gpus)
    except (ValueError, TypeError):
        return None


def _tolerance(w: np.ndarray, num_gpus: int, redundant: int, algorithm: str) -> float:
    """The movement-aware tolerance that keeps every layer at least as balanced as DeepSeek's placement: the
    smaller of 2% and the least relative headroom of ``algorithm``'s from-scratch layers over DeepSeek's."""
    fresh = layer_balancedness(w, get_balancer(algorithm)(w, num_gpus, redundant))
    deepseek = layer_balancedness(w, balance_deepseek(w, num_gpus, redundant))
    return float(np.clip((1 - deepseek / fresh).min().item(), 0.0, 0.02))


def rebalance_placement(weight: torch.Tensor | np.ndarray, num_replicas: int, num_groups: int | None,
                        num_nodes: int, num_gpus: int, current: torch.Tensor | None = None,
                        algorithm: str = "epmoe") -> ExpertPlacement:
    """A balanced placement for ``weight``, deterministic and on the CPU.

    Layers that counted no token (the dense layers SGLang includes, or an idle window) keep the serving map's
    row when there is one, else get the trivial row ``p mod E``. With ``current`` (the map serving now, as vLLM
    passes it) the rest is rebalanced by ``balance.rebalance_with_moves``, moving few copies while every layer
    stays within 2% of the from-scratch balancedness and no less balanced than DeepSeek's placement; otherwise
    from scratch.

    Args:
        weight: ``[L, E]`` tokens per logical expert, any real dtype and device.
        num_replicas: ``P`` physical slots per layer, ``>= E``, divisible by ``num_gpus``.
        num_groups: expert groups (``None`` or 0: none).
        num_nodes: nodes; the hierarchical policy is used when the groups divide over them.
        num_gpus: ``G`` EP ranks.
        current: ``[L, P]`` the map serving now, or None.
        algorithm: epmoe balancer name (``balance.BALANCERS``).

    Returns:
        The ``ExpertPlacement`` (``P`` slots, ``G`` ranks).

    Raises:
        ValueError: bad loads (``loads.as_load_array``) or sizes (``num_replicas`` below ``E`` or not divisible by
            ``num_gpus``; ``num_nodes`` not positive, ``num_groups`` negative).
        KeyError: unknown ``algorithm``.
    """
    w = as_load_array(weight, "weight")
    num_layers, num_experts = w.shape
    check_positive_int("num_gpus", num_gpus)
    check_positive_int("num_replicas", num_replicas)
    check_positive_int("num_nodes", num_nodes)
    if num_groups is not None:
        check_int("num_groups", num_groups, 0, wording="a non-negative integer or None (0 and None: no groups)")
    if num_replicas < num_experts or num_replicas % num_gpus:
        raise ValueError(f"num_replicas ({num_replicas}) must be at least the {num_experts} logical experts and "
                         f"divisible by num_gpus ({num_gpus})")
    nodes, groups = _hierarchy(num_groups, num_nodes, num_gpus, num_experts)
    served = _current(current, (num_layers, num_replicas), num_experts, num_gpus)
    trivial = (torch.arange(num_replicas) % num_experts).expand(num_layers, -1)
    phy = served.phy2log.clone() if served is not None else trivial.clone()
    active = np.nonzero(w.sum(1) > 0)[0].tolist()
    if active:
        redundant = num_replicas - num_experts
        if served is not None and nodes == 1:
            now = ExpertPlacement(served.phy2log[active], num_experts=num_experts, ep_size=num_gpus)
            new = rebalance_with_moves(w[active], now, algorithm=algorithm,
                                       tolerance=_tolerance(w[active], num_gpus, redundant, algorithm)).placement
        else:
            new = get_balancer(algorithm)(w[active], num_gpus, redundant, num_nodes=nodes, num_groups=groups)
        phy[active] = new.phy2log
    return ExpertPlacement(phy, num_experts=num_experts, ep_size=num_gpus)


def placement_tables(placement: ExpertPlacement) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DeepSeek EPLB's three tables of a placement.

    Returns:
        ``(phy2log [L, P], log2phy [L, E, R + 1], logcnt [L, E])``, int64 on the CPU; ``log2phy`` lists each
        expert's slots ascending, padded with -1 to DeepSeek's width ``P - E + 1``.
    """
    width = placement.num_redundant + 1
    log2phy = torch.full((placement.num_layers, placement.num_experts, width), -1, dtype=torch.int64)
    own = placement.log2phy
    log2phy[:, :, : own.shape[2]] = own
    return placement.phy2log.clone(), log2phy, placement.logcnt.clone()


def rebalance_experts(weight: torch.Tensor, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DeepSeek EPLB's ``rebalance_experts``, computed by epmoe's balancer.

    Args:
        weight: ``[layers, num_logical_experts]`` load statistics (tokens), any real dtype.
        num_replicas: physical experts per layer, a multiple of ``num_gpus``.
        num_groups: expert groups.
        num_nodes: server nodes (hierarchical when the groups divide over them, as DeepSeek's).
        num_gpus: GPUs, a multiple of ``num_nodes``.

    Returns:
        ``(phy2log [L, num_replicas], log2phy [L, E, num_replicas - E + 1], logcnt [L, E])``, int64, CPU.

    Raises:
        ValueError: bad loads or sizes.
    """
    return placement_tables(rebalance_placement(weight, num_replicas, num_groups, num_nodes, num_gpus))
