"""Capturing an engine's step graphs: the decode buckets and the piecewise buckets its options ask for, with the
MoE layers' hooks of a static step (``ep_static_hooks`` under EP, the static token count under TP),
at start and again after a committed rebalance (the weights and slot tables are new tensors)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from epmoe.dispatch import make_dispatcher
from epmoe.engine.capacity import graph_sizes, piece_sizes
from epmoe.engine.config import EngineConfig
from epmoe.engine.model_runner import ModelRunner
from epmoe.loads import ExpertLoadRecorder
from epmoe.models.hf import EPModel


def ep_static_hooks(ep_model: EPModel, eager_dispatcher: str, recorder: ExpertLoadRecorder | None = None
                    ) -> tuple[Callable[[int, torch.Tensor], None], Callable[[], None]]:
    """``ModelRunner.capture``'s hooks for an expert-parallel model: during a static step of ``bs`` rows every
    MoE layer dispatches with ``fixed_capacity`` of capacity ``bs`` (``local`` on one rank), routes its padding rows
    to no expert (``MoELayer.set_row_mask``; a bucket of one row has none) and ``recorder`` counts only the real
    rows; after it, ``eager_dispatcher`` again and no mask."""
    comm, slots = ep_model.comm, ep_model.placement.slots_per_rank

    def activate(bs: int, valid_rows: torch.Tensor) -> None:
        if recorder is not None:
            recorder.mask_rows(valid_rows)
        for layer in ep_model.moe_layers:  # capacity bs: a token goes to a rank at most once
            layer.set_dispatcher(make_dispatcher("local", comm, slots) if comm.size == 1 else
                                 make_dispatcher("fixed_capacity", comm, slots, capacity=bs))
            layer.set_row_mask(valid_rows if bs > 1 else None)

    def deactivate() -> None:
        if recorder is not None:
            recorder.mask_rows(None)
        for layer in ep_model.moe_layers:
            layer.set_dispatcher(make_dispatcher(eager_dispatcher, comm, slots))
            layer.set_row_mask(None)

    return activate, deactivate


def tp_static_hooks(ep_model: EPModel) -> tuple[Callable[[int, torch.Tensor], None], Callable[[], None]]:
    """``ModelRunner.capture``'s hooks for a tensor-parallel model: during a static step of ``bs`` rows every MoE
    layer runs ``bs`` tokens (every rank runs the same bucket: no size exchange); after it, any count again."""
    def activate(bs: int, valid_rows: torch.Tensor) -> None:  # every rank runs bucket bs: no size exchange
        for layer in ep_model.moe_layers:
            layer.set_static_tokens(bs)

    def deactivate() -> None:
        for layer in ep_model.moe_layers:
            layer.set_static_tokens(None)

    return activate, deactivate


def capture_graphs(runner: ModelRunner, config: EngineConfig, num_spec_tokens: int, device: torch.device,
                   activate: Callable[[int, torch.Tensor], None], deactivate: Callable[[], None]) -> None:
    """Capture ``runner``'s piecewise and decode graphs (CUDA graphs on CUDA, static buckets elsewhere).

    Raises:
        ValueError: a bucket ran out of GPU memory (the options that size them named).
    """
    sizes = graph_sizes(config, num_spec_tokens)
    pieces = piece_sizes(config)
    if device.type == "cuda":
        # a capture cannot hand the allocator's cached blocks back to the driver (that would synchronise), so
        # a graph pool needing memory held there would run out: hand them back first
        torch.cuda.empty_cache()
    try:
        runner.capture_pieces(pieces, activate, deactivate, cuda_graphs=device.type == "cuda")
        runner.capture(sizes, activate, deactivate, cuda_graphs=device.type == "cuda")
    except torch.cuda.OutOfMemoryError:
        cfg = config
        raise ValueError(f"cuda_graph_max_bs {cfg.cuda_graph_max_bs}, cuda_graph_max_tokens "
                         f"{cfg.cuda_graph_max_tokens}, piecewise_cuda_graph_max_tokens "
                         f"{cfg.piecewise_cuda_graph_max_tokens}: capturing graphs of up to "
                         f"{max(sizes + pieces)} rows ran out of GPU memory; lower them or "
                         f"mem_fraction_static") from None
