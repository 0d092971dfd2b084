"""The read-only registry of balancers (``BALANCERS``) and ``balance``, which runs one by name."""

from __future__ import annotations

from types import MappingProxyType
from typing import Mapping

import numpy as np
import torch

from epmoe.balance.balancers import balance_deepseek, balance_epmoe
from epmoe.balance.exact import balance_exact
from epmoe.balance.problem import Balancer
from epmoe.placement import ExpertPlacement

BALANCERS: Mapping[str, Balancer] = MappingProxyType(
    {"deepseek": balance_deepseek, "epmoe": balance_epmoe, "exact": balance_exact}
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
