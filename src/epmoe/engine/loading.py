"""The model an engine serves, loaded on its rank: the expert placement and eager dispatcher (none under
``parallel='tp'``), the weights, and the fast paths installed in the model (MLA's latent attention, fused
projection and rotary attention, fused norms on CUDA)."""

from __future__ import annotations

import torch

from epmoe.comm import Comm
from epmoe.engine.attention import register_attention
from epmoe.engine.config import EngineConfig
from epmoe.engine.fused_norm import fuse_norms
from epmoe.engine.group import trivial_or_file_placement
from epmoe.engine.mla import install_mla
from epmoe.engine.rope_attention import install_rope_attention
from epmoe.layer import MoELayerOptions, check_tp_sizes
from epmoe.loads import ExpertLoadRecorder
from epmoe.models.hf import EPModel, load_ep_model, load_tp_model
from epmoe.placement import ExpertPlacement
from epmoe.spec import MoESpec


def placement_and_dispatcher(config: EngineConfig, spec: MoESpec,
                             comm: Comm) -> tuple[ExpertPlacement | None, str | None]:
    """The placement and the eager steps' dispatcher name (``None``, ``None`` under ``parallel='tp'``).

    Raises:
        ValueError: sizes the TP group does not divide, a placement that does not fit, dispatcher ``local`` on
            more than one rank (named).
    """
    if config.parallel == "tp":
        check_tp_sizes(spec, comm.size)
        return None, None
    placement = trivial_or_file_placement(config, spec.num_moe_layers, spec.num_experts, comm.size)
    if config.dispatcher == "local" and comm.size > 1:
        raise ValueError(f"dispatcher 'local' serves one rank; the EP group has {comm.size}")
    return placement, config.dispatcher or ("local" if comm.size == 1 else "all_to_all")


def simulation_seed(seed: int, rank: int) -> int:
    """The seed of a rank's default generators under ``EngineConfig.moe_routing_simulation``: ``seed`` and the rank
    together (``seed * 2**16 + rank``; every TP rank takes rank 0's), so that EP ranks draw their routes
    independently, TP ranks the same ones, and a run repeats."""
    return (seed << 16) + rank


def load_model(config: EngineConfig, comm: Comm, device: torch.device, placement: ExpertPlacement | None,
               eager_dispatcher: str | None, recorder: ExpertLoadRecorder) -> tuple[EPModel, int]:
    """This rank's model with its fast paths installed, and how many of its attention modules are MLA.

    Args:
        placement: the expert placement (``None``: ``parallel='tp'``, every rank a slice of every expert).
        eager_dispatcher: the eager steps' dispatcher (EP).
        recorder: counts the tokens routed to each slot (EP).
    """
    if config.parallel == "tp":
        ep_model: EPModel = load_tp_model(
            config.model, comm, expert_backend=config.expert_backend, dtype=config.torch_dtype,
            device=device, load_format=config.load_format, attn_implementation=register_attention(),
            seed=config.seed,
        )
    else:
        ep_model = load_ep_model(
            config.model, placement, comm,
            options=MoELayerOptions(dispatcher=eager_dispatcher, expert_backend=config.expert_backend,
                                    load_recorder=recorder, replica_policy=config.replica_policy),
            dtype=config.torch_dtype, device=device, load_format=config.load_format,
            attn_implementation=register_attention(), seed=config.seed,
        )
    ep_model.set_routing_simulation(config.moe_routing_simulation)
    if config.moe_routing_simulation is not None:
        # the draws take the default generators: an EP rank routes its own tokens and draws its own routes; TP ranks
        # route the same gathered tokens and must draw the same ones
        torch.manual_seed(simulation_seed(config.seed, comm.rank if config.parallel == "ep" else 0))
    mla_layers = install_mla(ep_model.model)  # DeepSeek/Kimi: attention over the latent KV cache
    install_rope_attention(ep_model.model)  # Qwen, Mixtral, GLM, gpt-oss: fused projection and rotary
    if device.type == "cuda":
        fuse_norms(ep_model.model)
    return ep_model, mla_layers
