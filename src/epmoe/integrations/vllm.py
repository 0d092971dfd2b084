"""vLLM plug-in: vLLM's expert rearrangement (``--enable-eplb``) computed by epmoe's balancer; optionally dumps the
loads vLLM hands it and serves a fixed placement file at the first rearrangement.

Declared as the entry point ``epmoe`` of vLLM's group ``vllm.general_plugins`` (vLLM runs every installed one, or
those ``VLLM_PLUGINS`` names, in every process). ``register`` does nothing unless ``EPMOE_EPLB=1``. Other
variables: ``EPMOE_EPLB_DUMP_DIR`` (each rearrangement's loads ``[L_moe, E]`` written there by rank 0 as
``epmoe_loads_{n}.json``, an epmoe load file ``epmoe balance --loads`` reads) and ``EPMOE_EPLB_PLACEMENT`` (a
placement file, any format of ``integrations.placements``, one row per MoE layer, returned at the first
rearrangement; later ones rebalance from it).

The three generations of vLLM's EPLB entry point (checked against the wheels of vLLM 0.10.2, 0.12.0, 0.14.0 and
0.33.0):

1. ``vllm.distributed.eplb.rebalance_algo.rebalance_experts(weight, num_replicas, num_groups, num_nodes,
   num_gpus) -> (phy2log, log2phy, logcnt)``, imported by name into ``eplb_state`` (0.10 - 0.12);
2. a policy class in ``vllm.distributed.eplb.policy.EPLB_POLICIES["default"]`` whose classmethod
   ``rebalance_experts(weight, num_replicas, num_groups, num_nodes, num_ranks, old_global_expert_indices=None)``
   returns the same three tables (0.14);
3. the same classmethod returning ``phy2log`` alone (0.33). ``old_global_expert_indices`` is the serving
   ``physical_to_logical_map [L, P]``: rearrangements are movement-aware from it.

``EPLBConfig.policy`` accepts only ``"default"``, so generations 2 and 3 replace that entry of the registry.
"""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from epmoe.compat import placement_tables, rebalance_placement
from epmoe.integrations.placements import load_placement_as
from epmoe.loads import save_loads
from epmoe.placement import ExpertPlacement

FUNCTION_PARAMETERS = ("weight", "num_replicas", "num_groups", "num_nodes", "num_gpus")
POLICY_PARAMETERS = ("weight", "num_replicas", "num_groups", "num_nodes", "num_ranks", "old_global_expert_indices")


def generation_of(signature: inspect.Signature) -> int:
    """Which generation (1, 2 or 3, see the module docstring) of vLLM's EPLB entry point has ``signature``.

    Args:
        signature: of the module function (generation 1) or of the policy's bound classmethod.

    Raises:
        RuntimeError: parameters of none of the generations (they are named).
    """
    names = tuple(n for n in signature.parameters if n != "cls")
    if names == FUNCTION_PARAMETERS:
        return 1
    if names == POLICY_PARAMETERS:
        return 2 if "tuple" in str(signature.return_annotation).lower() else 3  # a class, alias or string
    raise RuntimeError(f"epmoe's vLLM plug-in does not know an EPLB entry point taking ({', '.join(names)}); known: "
                       f"({', '.join(FUNCTION_PARAMETERS)}) and ({', '.join(POLICY_PARAMETERS)})")


@dataclass
class VllmEplb:
    """The plug-in's balancer with its options; ``rebalance`` serves every generation.

    Attributes:
        dump_dir: folder for the loads of every rearrangement (rank 0 writes), or None.
        placement_file: placement returned at the first rearrangement, or None.
        calls: rearrangements served so far.
    """

    dump_dir: Path | None = None
    placement_file: Path | None = None
    calls: int = field(default=0)

    @classmethod
    def from_env(cls) -> "VllmEplb":
        """Options from ``EPMOE_EPLB_DUMP_DIR`` and ``EPMOE_EPLB_PLACEMENT``.

        Raises:
            ValueError: a dump folder that is not a writable folder, or a placement file that does not exist.
        """
        dump, fixed = os.environ.get("EPMOE_EPLB_DUMP_DIR"), os.environ.get("EPMOE_EPLB_PLACEMENT")
        if dump and not (Path(dump).is_dir() and os.access(dump, os.W_OK)):
            raise ValueError(f"EPMOE_EPLB_DUMP_DIR ({dump!r}) is not a writable folder")
        if fixed and not Path(fixed).is_file():
            raise ValueError(f"EPMOE_EPLB_PLACEMENT ({fixed!r}) does not exist")
        return cls(Path(dump) if dump else None, Path(fixed) if fixed else None)

    def _dump(self, weight: torch.Tensor) -> None:
        if self.dump_dir is None:
            return
        if torch.distributed.is_available() and torch.distributed.is_initialized() and torch.distributed.get_rank():
            return
        save_loads(self.dump_dir / f"epmoe_loads_{self.calls:06d}.json", weight.detach().cpu().long())

    def rebalance(self, weight: torch.Tensor, num_replicas: int, num_groups: int, num_nodes: int, num_ranks: int,
                  current: torch.Tensor | None = None) -> ExpertPlacement:
        """The placement for one rearrangement: the fixed file's at the first, else epmoe's (movement-aware from
        ``current``).

        Args:
            weight: ``[L_moe, E]`` tokens per logical expert over vLLM's window.
            num_replicas: ``P`` physical experts per layer. num_groups, num_nodes: as DeepSeek's EPLB.
            num_ranks: ``G`` EP ranks.
            current: ``[L_moe, P]`` the serving map (generations 2 and 3), or None.

        Raises:
            ValueError: a fixed placement that does not fit ``weight`` and ``num_replicas`` (file named), bad sizes.
        """
        first = self.calls == 0
        self._dump(weight)
        self.calls += 1
        if first and self.placement_file is not None:
            fixed = load_placement_as(self.placement_file, ep_size=num_ranks).placement
            want = (weight.shape[0], num_replicas, weight.shape[1])
            if (fixed.num_layers, fixed.num_slots, fixed.num_experts) != want:
                raise ValueError(f"EPMOE_EPLB_PLACEMENT ({str(self.placement_file)!r}) covers {fixed.num_layers} "
                                 f"layers x {fixed.num_slots} slots of {fixed.num_experts} experts, but vLLM "
                                 f"rearranges {want[0]} MoE layers x {want[1]} slots of {want[2]} experts")
            return fixed
        return rebalance_placement(weight, num_replicas, num_groups, num_nodes, num_ranks, current)

    def entry_point(self, generation: int) -> Any:
        """What vLLM calls for ``generation``: a function (1) or a policy class (2, 3) with vLLM's signature.

        Raises:
            ValueError: a generation other than 1, 2, 3.
        """
        plugin = self
        if generation == 1:
            def rebalance_experts(weight: torch.Tensor, num_replicas: int, num_groups: int, num_nodes: int,
                                  num_gpus: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
                return placement_tables(plugin.rebalance(weight, num_replicas, num_groups, num_nodes, num_gpus))

            return rebalance_experts
        if generation not in (2, 3):
            raise ValueError(f"generation must be 1, 2 or 3, got {generation!r}")

        class EpmoeEplbPolicyTables:
            """vLLM EPLB policy (generation 2) backed by epmoe's balancer."""

            @classmethod
            def rebalance_experts(cls, weight: torch.Tensor, num_replicas: int, num_groups: int, num_nodes: int,
                                  num_ranks: int, old_global_expert_indices: torch.Tensor | None = None
                                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
                return placement_tables(plugin.rebalance(weight, num_replicas, num_groups, num_nodes, num_ranks,
                                                         old_global_expert_indices))

        class EpmoeEplbPolicy:
            """vLLM EPLB policy (generation 3) backed by epmoe's balancer."""

            @classmethod
            def rebalance_experts(cls, weight: torch.Tensor, num_replicas: int, num_groups: int, num_nodes: int,
                                  num_ranks: int, old_global_expert_indices: torch.Tensor | None = None
                                  ) -> torch.Tensor:
                return plugin.rebalance(weight, num_replicas, num_groups, num_nodes, num_ranks,
                                        old_global_expert_indices).phy2log.clone()

        return EpmoeEplbPolicyTables if generation == 2 else EpmoeEplbPolicy


def _installed() -> tuple[int, Callable[[Any], None]]:
    """The installed vLLM's generation and how to install an entry point into it."""
    try:
        from vllm.distributed.eplb import policy
    except ImportError:
        policy = None
    if policy is not None:
        def install(cls: Any) -> None:
            policy.EPLB_POLICIES["default"] = cls

        return generation_of(inspect.signature(policy.EPLB_POLICIES["default"].rebalance_experts)), install
    try:
        from vllm.distributed.eplb import eplb_state, rebalance_algo
    except ImportError as exc:
        raise RuntimeError(f"epmoe's vLLM plug-in found neither vllm.distributed.eplb.policy nor "
                           f"vllm.distributed.eplb.rebalance_algo: {exc}") from exc

    def patch(fn: Any) -> None:
        eplb_state.rebalance_experts = fn

    return generation_of(inspect.signature(rebalance_algo.rebalance_experts)), patch


def register() -> None:
    """The ``vllm.general_plugins`` entry point: with ``EPMOE_EPLB=1``, vLLM's EPLB uses epmoe's balancer.

    Raises:
        RuntimeError: a vLLM whose EPLB entry point is of no known generation (its parameters named).
        ValueError: bad ``EPMOE_EPLB_DUMP_DIR`` / ``EPMOE_EPLB_PLACEMENT``.
    """
    if os.environ.get("EPMOE_EPLB") != "1":
        return
    plugin = VllmEplb.from_env()
    generation, install = _installed()
    install(plugin.entry_point(generation))
