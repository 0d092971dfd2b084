"""The decoder stack's forward in the engine: transformers' layers, their residual adds fused into the norms.

Every served family's decoder layer is pre-norm (transformers' ``*DecoderLayer.forward``)::

    r = h; x = input_layernorm(h);          h = r + self_attn(x)
    r = h; x = post_attention_layernorm(h); h = r + mlp(x)

and the model ends with ``norm(h)``: two residual adds a layer, each its own elementwise kernel, between kernels
that read the same rows again. ``decoder_forward`` runs the same modules in the same order but carries each sum to
the norm after it, which computes it (``add_norm``): ``x, r = add_norm(post_attention_layernorm, a, r)`` is
``r = r + a; x = post_attention_layernorm(r)``. Where the module after a norm folds it into its own first launch (on
Hopper, rows up to ``FOLD_NORM_MAX_WIDTH`` wide: the q/k/v projection at one or two rows, ``gemv.linear_after_norm``,
and the MoE layer's router at one row, ``layer.MoELayer.folds_norm``), ``fold_or_add_norm`` hands that module a
``layer.FoldedNorm`` instead and the norm's launch is gone. On CUDA the norms are ``FusedRMSNorm`` and do the add
in their own pass (one kernel where there were two); elsewhere ``add_norm`` is the add and the module, the layer's own
arithmetic. A layer's output ``h`` is so materialised by the next norm only: the aux layers' outputs (EAGLE-3's
hidden states) are the sums that norm returns, and the final norm closes the last layer.

The model's own ``forward`` does more than this loop: attention masks (the engine's attention works from the step's
``AttnBatch`` and reads none), caches, output collection; ``decoder_forward`` keeps what a step needs: the
embedding, the model's rotary module (every scaling variant it implements) and the layers' modules. Source: the
fused add and norm are vLLM's ``fused_add_rms_norm``; the loop is our own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from epmoe.engine.attention import AttnBatch
from epmoe.engine.fused_norm import FusedRMSNorm
from epmoe.experts.switches import enabled
from epmoe.layer import FoldedNorm

_BASE_PARTS = ("embed_tokens", "layers", "norm", "rotary_emb")
_LAYER_PARTS = ("input_layernorm", "self_attn", "post_attention_layernorm")


def check_decoder(base: nn.Module) -> None:
    """Check that ``base`` (a causal LM's ``model``) has the parts ``decoder_forward`` runs.

    Raises:
        ValueError: a missing part, named with the model class: the embedding, layers, final norm, rotary module;
            per layer the two norms, the attention and an ``mlp`` or ``feed_forward`` block.
    """
    name = type(base).__name__
    missing = [p for p in _BASE_PARTS if not isinstance(getattr(base, p, None), nn.Module)]
    if missing:
        raise ValueError(f"{name} has no {', '.join(missing)}: the engine runs pre-norm decoders with an embedding, "
                         f"layers, a final norm and a rotary module")
    for i, layer in enumerate(base.layers):
        gone = [p for p in _LAYER_PARTS if not isinstance(getattr(layer, p, None), nn.Module)]
        if not isinstance(_block(layer), nn.Module):
            gone.append("mlp (or feed_forward)")
        if gone:
            raise ValueError(f"{name} decoder layer {i} ({type(layer).__name__}) has no {', '.join(gone)}: the "
                             f"engine runs pre-norm decoder layers")


def _block(layer: nn.Module) -> nn.Module | None:
    """The layer's MLP or MoE block (``mlp``; Llama-4's ``feed_forward``)."""
    block = getattr(layer, "mlp", None)
    return block if block is not None else getattr(layer, "feed_forward", None)


def _check_rows(x: object, residual: object) -> None:
    for name, t in (("x", x), ("residual", residual)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if x.numel() != residual.numel():
        raise ValueError(f"the block's output {tuple(x.shape)} and the residual {tuple(residual.shape)} must have as "
                         f"many elements")


def add_norm(norm: nn.Module, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(norm(residual + x), residual + x)``: one kernel where ``norm`` is a ``FusedRMSNorm`` of ``x``'s dtype,
    else the add and the module (the decoder layer's own arithmetic).

    Args:
        norm: the RMSNorm module after the add.
        x: ``[..., D]`` the block's output (any shape of ``residual``'s elements).
        residual: ``[..., D]`` the residual stream (``x``'s dtype).

    Returns:
        Both in ``residual``'s shape.

    Raises:
        TypeError: ``x`` or ``residual`` is not a tensor.
        ValueError: ``x`` has not as many elements as ``residual``.
    """
    _check_rows(x, residual)
    x = x.view(residual.shape)
    if isinstance(norm, FusedRMSNorm) and x.dtype == residual.dtype and x.is_cuda:
        return norm.add_forward(x, residual)
    h = residual + x
    return norm(h), h


FOLD_NORM_MAX_WIDTH = 4096
"""Widest rows ``fold_or_add_norm`` hands to a consumer: every program of the consumer's launch reads the whole row
and the residual to normalise them itself, extra reads that grow with the width (for ``gemv``'s q/k/v projection,
whose programs hold 16384 weight elements each, ``width / 8192`` of its weight's bytes, from the L2).
Chosen from the H200 measurements in ``benchmarks/HISTORY.md`` ("Norms folded into the kernels after them")."""


def fold_or_add_norm(norm: nn.Module, x: torch.Tensor, residual: torch.Tensor, consumer: nn.Module
                     ) -> tuple[torch.Tensor | FoldedNorm, torch.Tensor]:
    """``add_norm(norm, x, residual)``, or, where ``norm`` is a ``FusedRMSNorm`` and ``consumer`` (the module the
    normalised rows go to) folds it into its own launch (its ``folds_norm(x, weight, weight_then_cast)``) and the
    rows are at most ``FOLD_NORM_MAX_WIDTH`` wide, the ``FoldedNorm`` to hand it and the tensor it writes the sum
    into: the same two results, one launch fewer.
    ``EPMOE_FOLD_NORM=0`` in the environment turns the folding off (for measuring what it gains).

    Args:
        norm: the RMSNorm module after the add.
        x: ``[..., D]`` the block's output.
        residual: ``[..., D]`` the residual stream.
        consumer: the module called next with the normalised rows.

    Returns:
        ``(normalised rows or FoldedNorm, residual + x)``; the sum is complete once the consumer has run.

    Raises:
        TypeError: ``x`` or ``residual`` is not a tensor.
        ValueError: ``x`` has not as many elements as ``residual``.
    """
    _check_rows(x, residual)
    x = x.view(residual.shape)
    folds = getattr(consumer, "folds_norm", None)
    if (folds is not None and isinstance(norm, FusedRMSNorm) and enabled("EPMOE_FOLD_NORM")
            and x.shape[-1] <= FOLD_NORM_MAX_WIDTH and x.dtype == residual.dtype
            and residual.stride(-1) == 1 and x.stride(-1) == 1 and folds(x, norm.weight, norm.weight_then_cast)):
        summed = torch.empty_like(residual, memory_format=torch.contiguous_format)
        return FoldedNorm(x, residual, norm.weight, norm.eps, norm.weight_then_cast, summed), summed
    return add_norm(norm, x, residual)


def decoder_forward(base: nn.Module, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttnBatch,
                    aux_layers: Sequence[int] = (), before_layer: Callable[[int], None] | None = None,
                    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The decoder's final hidden states for one engine step (see the module docstring).

    Args:
        base: the causal LM's ``model`` (checked by ``check_decoder``), attention modules of the engine.
        input_ids: ``[T]`` int64 token ids of the step's rows.
        positions: ``[T]`` int64 their positions.
        batch: the step's ``AttnBatch`` (passed to every attention module as ``epmoe_batch``).
        aux_layers: decoder layers whose outputs are also returned, in this order (a layer may repeat).
        before_layer: called with each layer's index before its first kernel (graph capture cuts there).

    Returns:
        ``[T, D]`` the final norm's output, and ``[T, D]`` the output of each ``aux_layers`` layer.
    """
    h = base.embed_tokens(input_ids.unsqueeze(0))
    pos = positions.unsqueeze(0)
    rotary = base.rotary_emb(h, position_ids=pos)
    want = set(aux_layers)
    kept: dict[int, torch.Tensor] = {}
    residual = None
    for i, layer in enumerate(base.layers):
        if before_layer is not None:
            before_layer(i)
        if residual is None:
            residual = h
            x = layer.input_layernorm(h)
        else:
            x, residual = fold_or_add_norm(layer.input_layernorm, h, residual, layer.self_attn)
            if i - 1 in want:
                kept[i - 1] = residual[0]
        a = layer.self_attn(hidden_states=x, attention_mask=None, position_ids=pos, position_embeddings=rotary,
                            use_cache=False, epmoe_batch=batch)[0]
        block = _block(layer)
        x, residual = fold_or_add_norm(layer.post_attention_layernorm, a, residual, block)
        h = block(x)
        if isinstance(h, tuple):  # gpt-oss and Llama-4's MoE blocks also return their router scores
            h = h[0]
    if residual is None:  # no layers
        return base.norm(h)[0], []
    out, residual = add_norm(base.norm, h, residual)
    kept[len(base.layers) - 1] = residual[0]
    return out[0], [kept[i] for i in aux_layers]
