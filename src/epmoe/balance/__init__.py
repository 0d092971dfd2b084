"""Expert load balancing (EPLB): pure functions ``load [L, E] -> ExpertPlacement``.

Load model (the same as DeepSeek's EPLB): the ``c`` copies of one logical expert share its load
evenly, so a copy of expert ``e`` carries ``load[e] / logcnt[e]`` tokens, and an EP rank's load is the
sum over the slots it holds. ``balancedness`` of a layer is mean over ranks / max over ranks of that
per-rank load (1.0 = perfect); of a placement, the average over layers.

Balancers (all take ``load, ep_size, num_redundant`` and the keywords ``num_nodes``, ``num_groups``):

* ``"deepseek"``: DeepSeek's published EPLB (github.com/deepseek-ai/EPLB), see ``deepseek``.
* ``"epmoe"``: ours (``local_search``): greedy replication, LPT packing without duplicate copies on a
  rank, then local search by swaps and by moving redundant copies from cold to hot experts. Every rank
  holds ``P / G`` slots, every expert at least one copy, and no rank two copies of one expert unless
  ``P / G > E``.
* ``"exact"``: the optimum of a mixed-integer model solved by scipy's HiGHS (``exact``).

The hierarchical option (``num_nodes > 1``) keeps every expert group on one node, as DeepSeek's
hierarchical policy does: groups are packed onto nodes, then each node is balanced on its own slots.

Modules, in the order a balance runs: ``problem`` (checks, per-rank loads, balancedness, the lower bound),
``deepseek`` and ``local_search`` (the algorithms, pure numpy), ``balancers`` (checked inputs to a
placement), ``exact`` (the MILP), ``registry`` (``BALANCERS``, ``balance``), ``moves`` (movement-aware
rebalancing) and ``report`` (the ``epmoe balance`` command's table and plot).
"""

from __future__ import annotations

from epmoe.balance.balancers import balance_deepseek, balance_epmoe
from epmoe.balance.moves import align_placement, placement_moves, rebalance_with_moves
from epmoe.balance.problem import (
    Balancer,
    balancedness,
    check_problem,
    layer_balancedness,
    max_load_lower_bound,
    rank_balancedness,
    rank_loads,
    rank_loads_array,
    rank_max_over_mean,
)
from epmoe.balance.registry import BALANCERS, balance, get_balancer

__all__ = [
    "BALANCERS", "Balancer", "align_placement", "balance", "balance_deepseek", "balance_epmoe", "balancedness",
    "check_problem", "get_balancer", "layer_balancedness", "max_load_lower_bound", "placement_moves",
    "rank_balancedness", "rank_loads", "rank_loads_array", "rank_max_over_mean", "rebalance_with_moves",
]
