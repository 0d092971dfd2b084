"""The balancing problem: input checks, per-rank loads, balancedness and the lower bound on the max load.

Load model (the same as DeepSeek's EPLB): the ``c`` copies of one logical expert share its load
evenly, so a copy of expert ``e`` carries ``load[e] / logcnt[e]`` tokens, and an EP rank's load is the
sum over the slots it holds. ``balancedness`` of a layer is mean over ranks / max over ranks of that
per-rank load (1.0 = perfect); of a placement, the average over layers. ``max/mean`` (``rank_max_over_mean``) is
its reciprocal. A layer where every rank is idle (all-zero loads: 0 / 0) counts as perfectly balanced: balancedness
1.0 and max/mean 1.0, wherever either is reported.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from epmoe.balance.local_search import replicate
from epmoe.checks import check_int
from epmoe.loads import as_load_array
from epmoe.placement import ExpertPlacement, check_redundant

Balancer = Callable[..., ExpertPlacement]


def check_problem(
    load: torch.Tensor | np.ndarray, ep_size: int, num_redundant: int, num_nodes: int = 1, num_groups: int = 1
) -> np.ndarray:
    """Validate a balancing problem; return the loads as ``[L, E]`` float64.

    Raises:
        ValueError: bad loads (see ``as_load_array``), a non-positive count, more EP ranks than slots,
            more redundant slots than ``E * max(G - 1, 1)`` (every rank holding every expert), slots not
            divisible by the EP size, EP size not divisible by ``num_nodes``, experts not divisible by
            ``num_groups``, or ``num_groups`` not divisible by ``num_nodes``.
    """
    w = as_load_array(load)
    num_experts = w.shape[1]
    ep_size = check_int("ep_size", ep_size, 1)
    num_redundant = check_int("num_redundant", num_redundant, 0)
    num_nodes = check_int("num_nodes", num_nodes, 1)
    num_groups = check_int("num_groups", num_groups, 1)
    num_slots = num_experts + num_redundant
    if ep_size > num_slots:
        raise ValueError(
            f"ep_size ({ep_size}) is larger than the number of slots ({num_slots} = {num_experts} experts + "
            f"{num_redundant} redundant): every EP rank needs at least one slot"
        )
    check_redundant(num_redundant, num_experts, ep_size)
    if num_slots % ep_size:
        raise ValueError(
            f"num_slots ({num_slots} = {num_experts} experts + {num_redundant} redundant) must be divisible "
            f"by ep_size ({ep_size})"
        )
    if ep_size % num_nodes:
        raise ValueError(f"ep_size ({ep_size}) must be divisible by num_nodes ({num_nodes})")
    if num_experts % num_groups:
        raise ValueError(f"num_experts ({num_experts}) must be divisible by num_groups ({num_groups})")
    if num_groups % num_nodes:
        raise ValueError(f"num_groups ({num_groups}) must be divisible by num_nodes ({num_nodes})")
    return w


# ---- metrics ------------------------------------------------------------------------------------
def rank_loads_array(w: np.ndarray, phy2log: np.ndarray, ep_size: int) -> np.ndarray:
    """``[L, G]`` float64 tokens per EP rank for loads ``w [L, E]`` float64 (checked) and ``phy2log [L, P]``:
    the ``c`` copies of an expert share its load evenly."""
    num_layers, num_experts = w.shape
    cnt = np.zeros((num_layers, num_experts))
    np.add.at(cnt, (np.arange(num_layers)[:, None], phy2log), 1.0)
    per_slot = np.take_along_axis(w / np.maximum(cnt, 1.0), phy2log, axis=1)
    return per_slot.reshape(num_layers, ep_size, -1).sum(-1)


def _check_pair(load: torch.Tensor | np.ndarray, placement: ExpertPlacement) -> np.ndarray:
    w = as_load_array(load)
    if w.shape != (placement.num_layers, placement.num_experts):
        raise ValueError(
            f"load has shape {tuple(w.shape)} but the placement covers "
            f"[{placement.num_layers}, {placement.num_experts}] (layers, experts)"
        )
    return w


def rank_loads(load: torch.Tensor | np.ndarray, placement: ExpertPlacement) -> torch.Tensor:
    """Tokens each EP rank computes, copies of an expert sharing its load evenly.

    Args:
        load: ``[L, E]`` tokens per logical expert.
        placement: the placement to evaluate.

    Returns:
        ``[L, G]`` float64 tokens per EP rank.

    Raises:
        ValueError: bad loads or a shape that does not match the placement.
    """
    w = _check_pair(load, placement)
    return torch.from_numpy(rank_loads_array(w, placement.phy2log.numpy(), placement.ep_size))


def rank_balancedness(per_rank: torch.Tensor | np.ndarray) -> torch.Tensor:
    """The one definition of balancedness: ``per_rank [..., G]`` tokens per EP rank -> ``[...]`` float64
    mean over ranks / max over ranks, in ``(0, 1]`` (1.0 where every rank is idle: 0 / 0 counts as balanced)."""
    r = torch.as_tensor(per_rank).double()
    mx = r.max(dim=-1).values
    return torch.where(mx > 0, r.mean(dim=-1) / torch.where(mx > 0, mx, 1.0), torch.ones_like(mx))


def rank_max_over_mean(per_rank: torch.Tensor | np.ndarray) -> torch.Tensor:
    """``per_rank [..., G]`` tokens per EP rank -> ``[...]`` float64 max over ranks / mean over ranks, in ``[1, G]``:
    the reciprocal of ``rank_balancedness``, so 1.0 where every rank is idle too (0 / 0 counts as balanced)."""
    return 1.0 / rank_balancedness(per_rank)


def layer_balancedness(load: torch.Tensor | np.ndarray, placement: ExpertPlacement) -> torch.Tensor:
    """``[L]`` float64: per layer, mean over ranks / max over ranks of the rank load (1.0 if all zero)."""
    return rank_balancedness(rank_loads(load, placement))


def balancedness(load: torch.Tensor | np.ndarray, placement: ExpertPlacement) -> float:
    """Mean over layers of ``layer_balancedness`` (1.0 = every rank equally busy).

    Raises:
        ValueError: bad loads or a shape that does not match the placement.
    """
    return float(layer_balancedness(load, placement).mean())


def max_load_lower_bound(load: torch.Tensor | np.ndarray, ep_size: int, num_redundant: int = 0) -> torch.Tensor:
    """A proven lower bound on the maximum rank load of any placement, per layer.

    Bound = max of (i), (ii) and, when ``num_redundant == 0``, (iii):

    (i) ``W / G`` with ``W`` the layer's total load: the rank loads sum to ``W``, so the largest is at
    least their mean.

    (ii) ``m* = min over copy counts c (c_e >= 1, sum c_e = P) of max_e w_e / c_e``: a rank holding a copy
    of ``e`` carries at least ``w_e / c_e`` (loads are non-negative). ``m*`` is what greedy replication
    reaches (each extra copy to the largest ``w_e / c_e``): greedy gave expert ``e`` its last copy when
    ``w_e / (c_e - 1)`` was the current maximum, which never increases, so ``w_e / (c_e - 1) >= m_g``
    (the final maximum, attained by some ``e*``). A count vector ``c'`` with maximum below ``m_g`` needs
    ``c'_e > c_e - 1`` for all ``e`` and ``c'_e* > c_e*``, hence ``sum c' > sum c = P``: impossible.

    (iii) with one copy per expert: among the ``G + 1`` heaviest experts two share a rank
    (pigeonhole), so some rank carries ``>= w_(G) + w_(G+1)`` (sorted descending); and the rank holding
    the heaviest expert holds ``P/G - 1`` other experts, so it carries ``>= w_(1) +`` the sum of the
    ``P/G - 1`` lightest other experts.

    Args:
        load: ``[L, E]`` tokens per logical expert.
        ep_size: ``G`` EP ranks.
        num_redundant: ``R`` redundant slots (``P = E + R``).

    Returns:
        ``[L]`` float64 lower bound on the maximum rank load (tokens).

    Raises:
        ValueError: as ``check_problem``.
    """
    w = check_problem(load, ep_size, num_redundant)
    num_layers, num_experts = w.shape
    bound = w.sum(1) / ep_size
    counts = replicate(w, num_experts + num_redundant, cap=None)
    bound = np.maximum(bound, (w / counts).max(1))
    if num_redundant == 0:
        desc = -np.sort(-w, axis=1)
        if num_experts > ep_size:
            bound = np.maximum(bound, desc[:, ep_size - 1] + desc[:, ep_size])
        per_rank = num_experts // ep_size
        bound = np.maximum(bound, desc[:, 0] + desc[:, num_experts - (per_rank - 1):].sum(1) * (per_rank > 1))
    return torch.from_numpy(bound)
