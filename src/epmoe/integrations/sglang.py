"""SGLang plug-in: SGLang's expert rebalancing (``--enable-eplb``, ``--init-expert-location`` with
``logical_count``) computed by epmoe's balancer.

Declared as the entry point ``epmoe`` of SGLang's general plug-in group ``sglang.srt.plugins`` (SGLang runs every
installed one, or those ``SGLANG_PLUGINS`` names, in every process). ``register`` does nothing unless
``EPMOE_EPLB=1``; then it replaces ``sglang.srt.eplb.eplb_algorithms.rebalance_experts`` through SGLang's
``HookRegistry`` (``HookType.REPLACE``) with ``rebalance_experts`` below, after checking that the installed
function has the signature this module implements.

Facts from SGLang 0.5.23: ``rebalance_experts(tokens_per_expert, num_physical_experts,
num_local_physical_experts, num_groups, num_nodes, algorithm) -> (physical_to_logical_map,
logical_to_all_physical_map, expert_count)``; ``tokens_per_expert`` is ``[B, L_all, E]`` over every decoder layer
(dense layers zero; ``ExpertLocationMetadata.init_by_eplb``); ``algorithm`` an ``EplbAlgorithm`` whose name ends
in ``_hierarchical`` for the hierarchical policy. SGLang does not pass the serving map, so its rebalances are
from scratch; dense rows keep the trivial row.
"""

from __future__ import annotations

import inspect
import os
from typing import Any, Callable

import torch

from epmoe.compat import placement_tables, rebalance_placement

TARGET = "sglang.srt.eplb.eplb_algorithms.rebalance_experts"
PARAMETERS = ("tokens_per_expert", "num_physical_experts", "num_local_physical_experts", "num_groups", "num_nodes",
              "algorithm")


def rebalance_experts(tokens_per_expert: torch.Tensor, num_physical_experts: int, num_local_physical_experts: int,
                      num_groups: int | None, num_nodes: int, algorithm: Any
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """SGLang's ``rebalance_experts``, computed by epmoe's balancer (deterministic, CPU).

    Args:
        tokens_per_expert: ``[B, L, E]`` (or ``[L, E]``) tokens per logical expert, summed over ``B``.
        num_physical_experts: ``P`` slots per layer.
        num_local_physical_experts: ``P / G`` slots per GPU.
        num_groups: expert groups of the model, or None.
        num_nodes: nodes.
        algorithm: SGLang's ``EplbAlgorithm`` (or its name): the hierarchical policy is used only for names
            ending in ``_hierarchical``, as SGLang's own ``deepseek`` / ``deepseek_hierarchical``.

    Returns:
        ``(physical_to_logical_map [L, P], logical_to_all_physical_map [L, E, P - E + 1] (-1 padded),
        expert_count [L, E])``, int64 on the CPU.

    Raises:
        ValueError: a ``tokens_per_expert`` that is not 2-D or 3-D, or sizes that do not fit.
    """
    t = tokens_per_expert.detach().cpu()
    if t.dim() == 3:
        t = t.sum(0)
    if t.dim() != 2:
        raise ValueError(f"tokens_per_expert must be [B, L, E] or [L, E], got shape {tuple(tokens_per_expert.shape)}")
    if num_local_physical_experts < 1 or num_physical_experts % num_local_physical_experts:
        raise ValueError(f"num_physical_experts ({num_physical_experts}) must be a multiple of "
                         f"num_local_physical_experts ({num_local_physical_experts})")
    name = str(getattr(algorithm, "name", algorithm))
    hierarchical = name.endswith("_hierarchical")
    placement = rebalance_placement(t, num_physical_experts, num_groups if hierarchical else None,
                                    num_nodes if hierarchical else 1,
                                    num_physical_experts // num_local_physical_experts)
    return placement_tables(placement)


def check_signature(fn: Callable[..., Any]) -> None:
    """Check that SGLang's installed ``rebalance_experts`` takes the parameters this module implements.

    Raises:
        RuntimeError: other parameters (both lists named).
    """
    names = tuple(inspect.signature(fn).parameters)
    if names != PARAMETERS:
        raise RuntimeError(f"epmoe's SGLang plug-in: {TARGET} takes ({', '.join(names)}), but this plug-in implements "
                           f"({', '.join(PARAMETERS)}); unset EPMOE_EPLB or use an SGLang version with that signature")


def register() -> None:
    """The ``sglang.srt.plugins`` entry point: with ``EPMOE_EPLB=1``, route SGLang's rebalancing to epmoe.

    Raises:
        RuntimeError: ``EPMOE_EPLB=1`` but SGLang has no plug-in hook registry or no ``rebalance_experts`` of
            the known signature (what was found is named).
    """
    if os.environ.get("EPMOE_EPLB") != "1":
        return
    try:
        from sglang.srt.eplb import eplb_algorithms
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    except ImportError as exc:
        raise RuntimeError(f"epmoe's SGLang plug-in needs sglang.srt.plugins.hook_registry and "
                           f"sglang.srt.eplb.eplb_algorithms (SGLang 0.5.x): {exc}") from exc
    check_signature(eplb_algorithms.rebalance_experts)
    HookRegistry.register(TARGET, rebalance_experts, HookType.REPLACE)
