"""Filling a model built on ``meta``: every tensor read from the checkpoint (dequantized), or, for
``--load-format dummy`` (vLLM's), given a random value of the right spread on the device; then the embeddings tied,
the rotary tables rebuilt and nothing left on ``meta``."""

from __future__ import annotations

import torch
from torch import nn

from epmoe.experts.mxfp4 import E8M0_BIAS
from epmoe.models.checkpoint import CheckpointReader
from epmoe.models.layout import FamilyLayout, read_expert

LOAD_FORMATS = ("auto", "dummy")
_DUMMY_STD = 0.02
_FILL_CHUNK = 1 << 26
"""The most elements of a tensor ``_fill_dummy`` draws at once where the draw needs a wider temporary (INT4 words
through int64, MXFP4 bytes through int32, FP8 values through float32): a layer's stacked experts drawn whole would
need several times their own size (DeepSeek-V3's FP8 experts: a 28 GiB float32 draw for 7 GiB of weights)."""


def _zero_mean_int4_words(shape: torch.Size, gen: torch.Generator, device: torch.device) -> torch.Tensor:
    """Random INT4 words (int32, ``shape``) whose eight values ``q`` lie in -7..7 with mean 0: random bits, each
    stored nibble 0 (``q = -8``) set to 8 (``q = 0``). Plain random bits would give ``q`` in -8..7 with mean -1/2:
    every dummy expert's output then shares a component along the all-ones direction, which grows layer by layer
    until every token routes to the same experts (a benchmark of such weights then reads fewer experts than
    uniform routing, the floor's assumption, would)."""
    words = torch.randint(-2**31, 2**31, shape, generator=gen, device=device, dtype=torch.int64).to(torch.int32)
    for j in range(8):
        words |= ((words >> (4 * j)) & 0xF == 0).to(torch.int32) << (4 * j + 3)
    return words


def _fill_dummy(name: str, tensor: torch.Tensor, gen: torch.Generator) -> None:
    """Dummy value of tensor ``name`` in place: norm weights 1, vectors (biases, sinks, correction
    biases) 0, matrices normal(0, 0.02); packed INT4 expert values random with mean 0 (``_zero_mean_int4_words``),
    MXFP4 ones random bits (symmetric already), FP8 ones normal(0, 4.2), with scales that give them about the same
    spread (INT4 and FP8 ``0.02 / 4.2``, MXFP4 ``2 ** -7``)."""
    leaf = name.rsplit(".", 1)[-1]
    if tensor.dtype == torch.int32:  # INT4 words: eight stored values q + 8 each
        for part in _parts(tensor):
            part.copy_(_zero_mean_int4_words(part.shape, gen, tensor.device))
    elif tensor.dtype == torch.uint8 and leaf.endswith("_scales"):  # MXFP4 E8M0 block scales
        tensor.fill_(E8M0_BIAS - 7)
    elif tensor.dtype == torch.uint8:  # MXFP4 values
        for part in _parts(tensor):
            part.copy_(torch.randint(0, 256, part.shape, generator=gen, device=tensor.device, dtype=torch.int32))
    elif tensor.dtype == torch.float8_e4m3fn:  # block-FP8 expert values, in the spread of INT4's
        for part in _parts(tensor):
            part.copy_(torch.randn(part.shape, generator=gen, device=tensor.device).mul_(4.2))
    elif leaf.endswith("_scale") and "experts" in name:
        tensor.fill_(_DUMMY_STD / 4.2)  # the std of q: sqrt(17.5)
    elif "norm" in name and leaf == "weight" and tensor.dim() == 1:
        tensor.fill_(1.0)
    elif tensor.dim() < 2 or "bias" in leaf:
        tensor.zero_()
    else:
        tensor.normal_(0.0, _DUMMY_STD, generator=gen)


def _parts(tensor: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``tensor`` as 1-D views of at most ``_FILL_CHUNK`` elements that cover it once (a tensor that is not contiguous:
    itself, whole)."""
    return tensor.view(-1).split(_FILL_CHUNK) if tensor.is_contiguous() else (tensor,)


@torch.no_grad()
def random_fill(module: nn.Module, gen: torch.Generator) -> None:
    """Every floating-point parameter and buffer of ``module`` (block-FP8 expert values included), and its packed INT4
    / MXFP4 expert parameters, get their dummy value (``_fill_dummy``); integer buffers (slot tables) are structure,
    not weights, and stay."""
    for name, t in module.named_parameters():
        _fill_dummy(name, t, gen)
    for name, t in module.named_buffers():
        if t.is_floating_point():
            _fill_dummy(name, t, gen)


@torch.no_grad()
def materialise_dummy(model: nn.Module, device: torch.device | str, gen: torch.Generator) -> None:
    """Allocate every tensor still on ``meta`` on ``device`` with its dummy value, rebuild RoPE."""
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    state: dict[str, torch.Tensor] = {}
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        if not tensor.is_meta or name.endswith("inv_freq") or (tied and name == "lm_head.weight"):
            continue
        state[name] = torch.zeros(tensor.shape, dtype=tensor.dtype, device=device)
        if tensor.is_floating_point():
            _fill_dummy(name, state[name], gen)
    model.load_state_dict(state, strict=False, assign=True)
    _finish(model, device, tied, "dummy weights")


def materialise(
    model: nn.Module, reader: CheckpointReader, checkpoint_dir: str, device: torch.device | str,
    fused_experts: FamilyLayout | None = None,
) -> None:
    """Read every tensor of ``model`` still on ``meta`` from the checkpoint (dequantized), rebuild RoPE.

    With ``fused_experts`` (the unsharded reference), transformers' fused expert parameters
    ``<block>.experts.gate_up_proj [E, 2F, D]`` / ``down_proj [E, D, F]`` are stacked from the
    per-expert checkpoint tensors of that layout.
    """
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    state: dict[str, torch.Tensor] = {}
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        if not tensor.is_meta:
            continue
        if name in reader:
            state[name] = reader.get(name).to(device=device, dtype=tensor.dtype)
        elif tied and name == "lm_head.weight":
            continue
        elif name.endswith("inv_freq"):
            continue  # RoPE tables are rebuilt from the config below
        elif fused_experts is not None and name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            block, _, proj = name.rpartition(".experts.")
            key = "w13" if proj == "gate_up_proj" else "w2"
            try:
                rows = [read_expert(reader, fused_experts, block, e)[key] for e in range(tensor.shape[0])]
            except KeyError as exc:
                raise KeyError(f"checkpoint {checkpoint_dir} is missing an expert tensor of {block}: "
                               f"{exc.args[0]}") from None
            stacked = torch.stack(rows)
            if stacked.shape != tensor.shape:
                raise ValueError(f"{name}: experts stack to {tuple(stacked.shape)}, the model expects "
                                 f"{tuple(tensor.shape)}")
            state[name] = stacked.to(device=device, dtype=tensor.dtype)
        else:
            raise KeyError(f"checkpoint {checkpoint_dir} is missing tensor {name!r}")
    model.load_state_dict(state, strict=False, assign=True)
    _finish(model, device, tied, f"reading {checkpoint_dir}")


def _finish(model: nn.Module, device: torch.device | str, tied: bool, what: str) -> None:
    """Tie the embeddings, rebuild RoPE tables from the config, check nothing is left on ``meta``."""
    if tied:
        model.tie_weights()
    for parent in list(model.modules()):
        for child_name, child in parent.named_children():
            if type(child).__name__.endswith("RotaryEmbedding"):
                setattr(parent, child_name, type(child)(config=child.config).to(device))
    still_meta = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if still_meta:
        raise ValueError(f"tensors left unloaded after {what}: {still_meta[:5]}")
    model.eval()
