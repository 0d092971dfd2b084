"""Expert load balancing (EPLB): pure functions ``load [L, E] -> ExpertPlacement``.

Load model (the same as DeepSeek's EPLB): the ``c`` copies of one logical expert share its load
evenly, so a copy of expert ``e`` carries ``load[e] / logcnt[e]`` tokens, and an EP rank's load is the
sum over the slots it holds. ``balancedness`` of a layer is mean over ranks / max over ranks of that
per-rank load (1.0 = perfect); of a placement, the average over layers.

Balancers (all take ``load, ep_size, num_redundant`` and the keywords ``num_nodes``, ``num_groups``):

* ``"deepseek"``: DeepSeek's published EPLB (github.com/deepseek-ai/EPLB), see ``balance_deepseek``.
* ``"epmoe"``: ours (``balance_epmoe``): greedy replication, LPT packing without duplicate copies on a
  rank, then local search by swaps and by moving redundant copies from cold to hot experts. Every rank
  holds ``P / G`` slots, every expert at least one copy, and no rank two copies of one expert unless
  ``P / G > E``.
* ``"exact"``: the optimum of a mixed-integer model solved by scipy's HiGHS (``balance_exact``).

The hierarchical option (``num_nodes > 1``) keeps every expert group on one node, as DeepSeek's
hierarchical policy does: groups are packed onto nodes, then each node is balanced on its own slots.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Callable, Mapping

import numpy as np
import torch

from epmoe.balance_deepseek import deepseek_phy2log
from epmoe.balance_epmoe import epmoe_phy2log, replicate
from epmoe.placement import ExpertPlacement, check_redundant

Balancer = Callable[..., ExpertPlacement]



# ---- input checks -------------------------------------------------------------------------------
def as_load_array(load: torch.Tensor | np.ndarray, name: str = "load") -> np.ndarray:
    """Validate a logical load table and return it as a float64 array.

    Args:
        load: ``[L, E]`` tokens routed to each logical expert, any real dtype.
        name: the field name used in error messages.

    Returns:
        ``[L, E]`` float64 copy.

    Raises:
        ValueError: not 2-D, empty, NaN or infinite entries, negative entries (position named), or a
            layer whose sum (times the expert count, the balancers' headroom) overflows float64.
    """
    arr = load.detach().cpu().double().numpy() if isinstance(load, torch.Tensor) else np.asarray(load, dtype=np.float64)
    if arr.ndim != 2:
        raise ValueError(f"{name} must be 2-D [num_layers, num_experts], got shape {tuple(arr.shape)}")
    if arr.shape[0] == 0 or arr.shape[1] == 0:
        raise ValueError(f"{name} must have at least one layer and one expert, got shape {tuple(arr.shape)}")
    bad = ~np.isfinite(arr)
    if bad.any():
        layer, expert = (int(v) for v in np.argwhere(bad)[0])
        raise ValueError(f"{name}[{layer}, {expert}] = {arr[layer, expert]} is not a finite number")
    neg = arr < 0
    if neg.any():
        layer, expert = (int(v) for v in np.argwhere(neg)[0])
        raise ValueError(f"{name}[{layer}, {expert}] = {arr[layer, expert]} is negative; loads count tokens")
    with np.errstate(over="ignore"):
        total = arr.sum(axis=1) * arr.shape[1]
    if not np.isfinite(total).all():
        layer = int(np.argwhere(~np.isfinite(total))[0][0])
        raise ValueError(f"{name}[{layer}] is too large to balance: its entries (up to {arr[layer].max():g}) "
                         "overflow float64 when summed; loads count tokens")
    return arr.copy()


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def check_problem(
    load: torch.Tensor | np.ndarray, ep_size: int, num_redundant: int, num_nodes: int = 1, num_groups: int = 1
) -> np.ndarray:
    """Validate a balancing problem; return the loads as ``[L, E]`` float64.

    Raises:
        ValueError: bad loads (see ``as_load_array``), a non-positive count, more EP ranks than slots,
            more redundant slots than ``E * max(G - 1, 1)`` (every rank holding every expert), slots not divisible by the EP size, EP size not divisible by ``num_nodes``, experts not
            divisible by ``num_groups``, or ``num_groups`` not divisible by ``num_nodes``.
    """
    w = as_load_array(load)
    num_experts = w.shape[1]
    ep_size = _check_int("ep_size", ep_size, 1)
    num_redundant = _check_int("num_redundant", num_redundant, 0)
    num_nodes = _check_int("num_nodes", num_nodes, 1)
    num_groups = _check_int("num_groups", num_groups, 1)
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
            f"by the EP group size ({ep_size})"
        )
    if ep_size % num_nodes:
        raise ValueError(f"ep_size ({ep_size}) must be divisible by num_nodes ({num_nodes})")
    if num_experts % num_groups:
        raise ValueError(f"num_experts ({num_experts}) must be divisible by num_groups ({num_groups})")
    if num_groups % num_nodes:
        raise ValueError(f"num_groups ({num_groups}) must be divisible by num_nodes ({num_nodes})")
    return w


# ---- metrics ------------------------------------------------------------------------------------
def _rank_loads_np(w: np.ndarray, phy2log: np.ndarray, ep_size: int) -> np.ndarray:
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
    return torch.from_numpy(_rank_loads_np(w, placement.phy2log.numpy(), placement.ep_size))


def layer_balancedness(load: torch.Tensor | np.ndarray, placement: ExpertPlacement) -> torch.Tensor:
    """``[L]`` float64: per layer, mean over ranks / max over ranks of the rank load (1.0 if all zero)."""
    r = rank_loads(load, placement)
    mx = r.max(dim=1).values
    return torch.where(mx > 0, r.mean(dim=1) / torch.where(mx > 0, mx, 1.0), torch.ones_like(mx))


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


def _balance_exact(
    load: torch.Tensor | np.ndarray, ep_size: int, num_redundant: int = 0, *, num_nodes: int = 1, num_groups: int = 1
) -> ExpertPlacement:
    """The ``"exact"`` balancer: ``balance_exact.solve_exact`` with its 60 s budget; returns its placement."""
    from epmoe.balance_exact import solve_exact

    return solve_exact(load, ep_size, num_redundant, num_nodes=num_nodes, num_groups=num_groups).placement


BALANCERS: Mapping[str, Balancer] = MappingProxyType(
    {"deepseek": balance_deepseek, "epmoe": balance_epmoe, "exact": _balance_exact}
)


def get_balancer(name: str) -> Balancer:
    """The balancer registered as ``name``.

    Raises:
        KeyError: an unknown name (the supported names are listed).
    """
    if name not in BALANCERS:
        raise KeyError(f"unknown balancer {name!r}; supported: {', '.join(sorted(BALANCERS))}")
    return BALANCERS[name]


def balance(
    load: torch.Tensor | np.ndarray,
    ep_size: int,
    num_redundant: int = 0,
    *,
    algorithm: str = "epmoe",
    num_nodes: int = 1,
    num_groups: int = 1,
) -> ExpertPlacement:
    """Run the balancer named ``algorithm`` (see ``BALANCERS``).

    Raises:
        KeyError: unknown ``algorithm``.
        ValueError: as ``check_problem``.
    """
    return get_balancer(algorithm)(load, ep_size, num_redundant, num_nodes=num_nodes, num_groups=num_groups)
