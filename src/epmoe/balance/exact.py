"""Exact expert placement: the minimum possible maximum rank load, by a mixed-integer model (HiGHS).

Model, per layer (copies of one expert share its load evenly, as in ``balance``):

* ``y[e, k] in {0, 1}``: expert ``e`` has ``k`` copies; ``sum_k y[e, k] = 1``.
* ``z[e, g, k] in {0, 1}``: rank ``g`` holds a copy of ``e`` and ``e`` has ``k`` copies;
  ``sum_g z[e, g, k] = k * y[e, k]`` (so the ``k`` copies sit on ``k`` distinct ranks).
* every rank holds ``P / G`` slots: ``sum_{e,k} z[e, g, k] = P / G``.
* rank load ``sum_{e,k} (w_e / k) z[e, g, k] <= x``; minimise ``x``.
* rank loads in descending order (ranks are interchangeable: this removes symmetric solutions).

``k`` ranges over ``[max(1, ceil(w_e / U)), min(G, 1 + R)]`` with ``U`` the maximum rank load of
epmoe's heuristic (no optimum exceeds it, and a copy never outweighs its rank), and
``lower bound <= x <= U``. Solved with ``scipy.optimize.milp`` (HiGHS) under a time limit.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import torch

from epmoe.balance.balancers import balance_epmoe
from epmoe.balance.problem import check_problem, max_load_lower_bound, rank_loads_array
from epmoe.placement import ExpertPlacement


@dataclass(frozen=True)
class ExactSolution:
    """Result of ``solve_exact``.

    Attributes:
        placement: the best placement found (a layer the solver did not finish keeps the better of the
            solver's incumbent and epmoe's heuristic).
        optimal: ``[L]`` bool, the layer's maximum rank load is proven optimal.
        max_load: ``[L]`` float64, the maximum rank load of ``placement`` (tokens).
        solve_ms: wall time of the whole solve (ms).
    """

    placement: ExpertPlacement
    optimal: torch.Tensor
    max_load: torch.Tensor
    solve_ms: float


def _solve_layer(w: np.ndarray, ep_size: int, num_slots: int, lower: float, upper: float, time_limit_s: float):
    """``([G, S] experts, proven_optimal)`` or ``(None, False)`` when no solution was found in time."""
    # scipy is imported here, not at the top: rank processes and the CLI import this package without needing it
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import coo_matrix

    num_experts = w.size
    per_rank = num_slots // ep_size
    kmax = min(ep_size, 1 + num_slots - num_experts)
    choices = []  # (e, k)
    for e in range(num_experts):
        lo = max(1, math.ceil(w[e] / upper - 1e-9)) if upper > 0 else 1
        choices.extend((e, k) for k in range(lo, kmax + 1))
    num_y = len(choices)
    num_z = num_y * ep_size
    n = num_y + num_z + 1  # y, z (choice-major, rank-minor), x
    zi = lambda c, g: num_y + c * ep_size + g  # noqa: E731
    rows, cols, vals, lb, ub = [], [], [], [], []
    r = 0

    def add(entries, lo_, hi_):
        nonlocal r
        for c_, v_ in entries:
            rows.append(r)
            cols.append(c_)
            vals.append(v_)
        lb.append(lo_)
        ub.append(hi_)
        r += 1

    by_expert: dict[int, list[int]] = {}
    for c, (e, _) in enumerate(choices):
        by_expert.setdefault(e, []).append(c)
    for e in range(num_experts):
        add([(c, 1.0) for c in by_expert[e]], 1.0, 1.0)
    for c, (e, k) in enumerate(choices):
        add([(zi(c, g), 1.0) for g in range(ep_size)] + [(c, -float(k))], 0.0, 0.0)
    scale = max(upper, 1e-12)
    for g in range(ep_size):
        add([(zi(c, g), 1.0) for c in range(num_y)], per_rank, per_rank)
        add([(zi(c, g), w[e] / k / scale) for c, (e, k) in enumerate(choices)] + [(n - 1, -1.0)], -np.inf, 0.0)
    for g in range(ep_size - 1):
        add(
            [(zi(c, g), w[e] / k / scale) for c, (e, k) in enumerate(choices)]
            + [(zi(c, g + 1), -w[e] / k / scale) for c, (e, k) in enumerate(choices)],
            0.0,
            np.inf,
        )
    a = coo_matrix((vals, (rows, cols)), shape=(r, n)).tocsr()
    cost = np.zeros(n)
    cost[-1] = 1.0
    lo_b = np.zeros(n)
    hi_b = np.ones(n)
    lo_b[-1], hi_b[-1] = lower / scale * (1 - 1e-9), upper / scale * (1 + 1e-9)
    integrality = np.ones(n)
    integrality[-1] = 0
    res = milp(
        cost,
        constraints=LinearConstraint(a, lb, ub),
        integrality=integrality,
        bounds=Bounds(lo_b, hi_b),
        options={"time_limit": max(time_limit_s, 0.01), "disp": False},
    )
    if res.x is None:
        return None, False
    z = np.round(res.x[num_y:-1]).reshape(num_y, ep_size) > 0.5
    slots: list[list[int]] = [[] for _ in range(ep_size)]
    for c, g in zip(*np.nonzero(z)):
        slots[g].append(choices[c][0])
    if any(len(s) != per_rank for s in slots):
        return None, False
    return np.sort(np.array(slots, dtype=np.int64), axis=1), res.status == 0


def solve_exact(
    load: torch.Tensor | np.ndarray,
    ep_size: int,
    num_redundant: int = 0,
    *,
    num_nodes: int = 1,
    num_groups: int = 1,
    time_limit_s: float = 60.0,
) -> ExactSolution:
    """Minimum maximum rank load per layer, by the mixed-integer model in the module docstring.

    Placements keep the copies of one expert on distinct ranks (the model's constraint).

    Args:
        load: ``[L, E]`` tokens per logical expert.
        ep_size: ``G`` EP ranks.
        num_redundant: ``R`` redundant slots per layer.
        num_nodes: must be 1 (the hierarchical option has no exact model here).
        num_groups: ignored when ``num_nodes == 1`` beyond validation.
        time_limit_s: wall-time budget for all layers together (s); each layer gets the time left divided
            by the layers left.

    Returns:
        ``ExactSolution``; ``optimal[l]`` says whether layer ``l`` was proven optimal in time.

    Raises:
        ValueError: as ``check_problem``; ``num_nodes > 1``; or ``P / G > E`` (a rank would need two copies
            of one expert).
    """
    w = check_problem(load, ep_size, num_redundant, num_nodes, num_groups)
    if num_nodes != 1:
        raise ValueError(f"the exact balancer supports num_nodes = 1 only, got num_nodes = {num_nodes}")
    num_layers, num_experts = w.shape
    num_slots = num_experts + num_redundant
    if num_slots // ep_size > num_experts:
        raise ValueError(
            f"slots per rank ({num_slots // ep_size}) exceed num_experts ({num_experts}): copies of one expert "
            f"cannot all sit on distinct ranks"
        )
    start = time.perf_counter()
    heuristic = balance_epmoe(w, ep_size, num_redundant).phy2log.numpy()
    heur_max = rank_loads_array(w, heuristic, ep_size).max(1)
    lower = max_load_lower_bound(w, ep_size, num_redundant).numpy()
    phy = heuristic.copy()
    optimal = np.zeros(num_layers, dtype=bool)
    for layer in range(num_layers):
        if heur_max[layer] <= lower[layer] * (1 + 1e-12):
            optimal[layer] = True
            continue
        left = time_limit_s - (time.perf_counter() - start)
        if left <= 0:
            continue
        slots, proven = _solve_layer(
            w[layer], ep_size, num_slots, lower[layer], heur_max[layer], left / (num_layers - layer)
        )
        if slots is None:
            continue
        cand = slots.reshape(1, -1)
        if rank_loads_array(w[layer : layer + 1], cand, ep_size).max() <= heur_max[layer]:
            phy[layer] = cand[0]
        optimal[layer] = proven
    elapsed_ms = (time.perf_counter() - start) * 1e3
    placement = ExpertPlacement(torch.from_numpy(phy), num_experts=num_experts, ep_size=ep_size)
    return ExactSolution(
        placement=placement,
        optimal=torch.from_numpy(optimal),
        max_load=torch.from_numpy(rank_loads_array(w, phy, ep_size).max(1)),
        solve_ms=elapsed_ms,
    )


def balance_exact(
    load: torch.Tensor | np.ndarray, ep_size: int, num_redundant: int = 0, *, num_nodes: int = 1, num_groups: int = 1
) -> ExpertPlacement:
    """The ``"exact"`` balancer: ``solve_exact`` with its 60 s budget; returns its placement."""
    return solve_exact(load, ep_size, num_redundant, num_nodes=num_nodes, num_groups=num_groups).placement
