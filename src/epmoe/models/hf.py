"""A Hugging Face MoE model whose MoE blocks are ``MoELayer``s, loaded rank by rank.

The transformers model is built on the ``meta`` device, its MoE blocks are swapped for ``MoELayer``s
that allocate only this rank's expert slots, and every tensor is then read from the checkpoint: the
non-expert weights in full (attention runs data-parallel), the experts only for the local slots.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from itertools import chain
from typing import Callable

import torch
from torch import nn

from epmoe.comm import Comm
from epmoe.dispatch import Dispatcher, make_dispatcher
from epmoe.experts.storage import ExpertStorage
from epmoe.layer import DPTPMoELayer, FoldedNorm, MoELayer, MoELayerOptions, check_tp_sizes
from epmoe.models.checkpoint import WEIGHT_HEADER_DTYPES, CheckpointReader
from epmoe.models.layout import (
    FamilyLayout,
    expert_tensor_names,
    expert_tensor_shapes,
    family_layout,
    read_expert,
    read_expert_packed,
)
from epmoe.models.materialise import LOAD_FORMATS, materialise, materialise_dummy, random_fill
from epmoe.placement import ExpertPlacement
from epmoe.spec import MoESpec, language_model_config, load_moe_spec, read_config


class _TupleBlock(nn.Module):
    """Adapter for families whose decoder layer unpacks ``(hidden, router_output)`` from the MoE block (gpt-oss,
    Llama-4). It folds the norm before it where its MoE layer does (``MoELayer.folds_norm``): the engine's decoder
    then hands it a ``layer.FoldedNorm``, which it passes on."""

    def __init__(self, moe: MoELayer | DPTPMoELayer) -> None:
        super().__init__()
        self.moe = moe

    def folds_norm(self, x: torch.Tensor, weight: torch.Tensor, weight_then_cast: bool) -> bool:
        """The MoE layer's ``folds_norm`` (``False`` for a layer without one)."""
        folds = getattr(self.moe, "folds_norm", None)
        return folds is not None and folds(x, weight, weight_then_cast)

    def forward(self, hidden: torch.Tensor | FoldedNorm) -> tuple[torch.Tensor, None]:
        return self.moe(hidden), None


@dataclass
class EPModel:
    """A causal LM with expert-parallel (or tensor-parallel) MoE layers, ready to run on one rank.

    Attributes:
        model: the transformers causal LM (its MoE blocks replaced).
        spec: the model's MoE facts.
        placement: the expert placement the layers were built with (``None`` for tensor-parallel experts,
            ``load_tp_model``).
        comm: the EP (or TP) group.
        moe_layers: the ``MoELayer`` (``DPTPMoELayer`` with ``load_tp_model``) of every MoE layer, in model
            order.
        expert_bytes: bytes of routed-expert weights held on this rank.
        full_expert_bytes: bytes all routed experts would take if every rank held them all.
    """

    model: nn.Module
    spec: MoESpec
    placement: ExpertPlacement | None
    comm: Comm
    moe_layers: list[MoELayer | DPTPMoELayer] = field(default_factory=list)
    expert_bytes: int = 0
    full_expert_bytes: int = 0

    def use_dispatcher(self, name_or_factory: str | Callable[..., Dispatcher], **options) -> None:
        """Give every MoE layer a new dispatcher (``MoELayer.set_dispatcher``), built for its EP group and slots.

        Args:
            name_or_factory: a registered dispatcher name (``epmoe.dispatch.DISPATCHERS``), or a factory called
                as ``factory(comm, slots_per_rank, **options)``.
            options: the dispatcher's options (``fixed_capacity``: ``capacity``).

        Raises:
            KeyError: an unknown name.
            ValueError: a dispatcher that does not fit the layers (see ``MoELayer.set_dispatcher``), or
                tensor-parallel layers (they have no dispatcher).
        """
        if self.placement is None:
            raise ValueError("tensor-parallel MoE layers (load_tp_model) have no dispatcher")
        for layer in self.moe_layers:
            if isinstance(name_or_factory, str):
                dispatcher = make_dispatcher(name_or_factory, self.comm, self.placement.slots_per_rank, **options)
            else:
                dispatcher = name_or_factory(self.comm, self.placement.slots_per_rank, **options)
            layer.set_dispatcher(dispatcher)

    def set_routing_simulation(self, simulation: str | None) -> None:
        """Every MoE layer's router routes by ``simulation`` (``None`` or a name of
        ``routing.ROUTING_SIMULATIONS``; ``Router.simulation``). Set it before graphs are captured: a captured
        graph keeps the routing it was captured with.

        Raises:
            ValueError: an unknown name (by the first router, before any changes).
        """
        for layer in self.moe_layers:
            layer.gate.simulation = simulation

    def idle_step(self) -> None:
        """Join every MoE layer's collectives with an empty batch (a rank with nothing to do this step)."""
        p = next(self.model.parameters())
        empty = torch.empty(0, self.spec.hidden_size, dtype=p.dtype, device=p.device)
        for layer in self.moe_layers:
            layer(empty)


def _decoder_layers(model: nn.Module) -> nn.ModuleList:
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"{type(model).__name__} has no model.layers list of decoder layers")
    return layers


# model_type (of the config or of its text_config) -> the transformers architecture that runs it
_AS_DEEPSEEK_V3 = {"kimi_k2", "kimi_k25"}
_DROPPED_KEYS = ("auto_map", "architectures", "quantization_config", "model_type")


def hf_config(checkpoint_dir: str):
    """The transformers config that builds the plain (unquantized) language model of ``checkpoint_dir``.

    Kimi-K2 (``model_type: kimi_k2``) and Kimi-K2.5 (``kimi_k25`` with its language model under
    ``text_config``) are the DeepSeek-V3 architecture: they get a ``DeepseekV3Config`` from the dict (with
    ``auto_map``, ``architectures`` and ``quantization_config`` dropped). Any ``quantization_config`` is
    removed, so transformers builds plain Linear layers; the checkpoint reader dequantizes the weights.

    Raises:
        ValueError: transformers does not know the model type, or its config class refuses a field (the file named,
            with transformers' message: the field and the value).
    """
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig, DeepseekV3Config

    raw, path = read_config(checkpoint_dir)
    text = language_model_config(raw)
    try:
        if raw.get("model_type") in _AS_DEEPSEEK_V3 or text.get("model_type") in _AS_DEEPSEEK_V3:
            d = {k: v for k, v in text.items() if k not in _DROPPED_KEYS}
            return DeepseekV3Config.from_dict(d)
        config = AutoConfig.from_pretrained(checkpoint_dir)
    except (StrictDataclassError, ValueError, TypeError, KeyError) as exc:  # transformers' own field checks
        reason = exc.args[0] if isinstance(exc, KeyError) and exc.args else str(exc)
        raise ValueError(f"{path}: transformers cannot build the model's config from it: {type(exc).__name__}: "
                         f"{' '.join(str(reason).split())}") from None
    for cfg in (config, getattr(config, "text_config", None)):
        if cfg is not None and getattr(cfg, "quantization_config", None) is not None:
            del cfg.quantization_config
    return config


def build_meta_model(checkpoint_dir: str, dtype: torch.dtype, attn_implementation: str | None = None) -> nn.Module:
    """Instantiate the transformers causal LM of ``checkpoint_dir`` on the ``meta`` device (no memory),
    unquantized (see ``hf_config``).

    Args:
        checkpoint_dir: the checkpoint (its ``config.json``).
        dtype: parameter dtype.
        attn_implementation: a registered transformers attention implementation (the engine's paged
            attention); ``None`` = transformers' default.

    Raises:
        ValueError: transformers does not know the model type.
    """
    from transformers import AutoModelForCausalLM

    config = hf_config(checkpoint_dir)
    kwargs = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=dtype, **kwargs)


def _check_weight_format(spec: MoESpec, checkpoint_dir: str) -> None:
    try:
        ExpertStorage.of(spec.expert_weight_format, spec.moe_intermediate_size)
    except ValueError as exc:
        raise ValueError(f"checkpoint {checkpoint_dir}: {exc}") from None


def _copy_checked(dest: torch.Tensor, reader: CheckpointReader, name: str) -> None:
    """Copy checkpoint tensor ``name`` into ``dest``; a shape that config.json does not predict is named."""
    tensor = reader.get(name)
    if tuple(tensor.shape) != tuple(dest.shape):
        raise ValueError(f"checkpoint {reader.directory}: tensor {name!r} has shape {tuple(tensor.shape)}, expected "
                         f"{tuple(dest.shape)} from config.json (does config.json belong to these weights?)")
    dest.copy_(tensor)


def _load_moe_layer(moe: MoELayer, reader: CheckpointReader, layout: FamilyLayout, block: str) -> None:
    with torch.no_grad():
        for ours, suffix in layout.router.items():
            _copy_checked(getattr(moe.gate, ours), reader, f"{block}.{suffix}")
        if moe.shared_experts is not None:
            for proj in ("gate_proj", "up_proj", "down_proj"):
                _copy_checked(getattr(moe.shared_experts, proj).weight, reader,
                              f"{block}.{layout.shared}.{proj}.weight")
        if moe.shared_expert_gate is not None:
            _copy_checked(moe.shared_expert_gate.weight, reader, f"{block}.{layout.shared_gate}")
        cache: dict[int, dict[str, torch.Tensor]] = {}
        params = moe.experts
        storage = params.storage
        for slot, expert in enumerate(moe.local_experts.tolist()):
            if expert not in cache:
                try:
                    if storage.kind == "plain":
                        cache[expert] = read_expert(reader, layout, block, expert)
                    else:  # kept packed, as stored
                        cache[expert] = read_expert_packed(reader, layout, block, expert, storage,
                                                           moe.spec.hidden_size, moe.spec.moe_intermediate_size)
                except KeyError as exc:
                    raise KeyError(
                        f"checkpoint is missing a tensor of logical expert {expert} of {block}: {exc.args[0]}"
                    ) from None
            for name, tensor in cache[expert].items():
                dest = getattr(params, name)
                if dest is None:
                    continue
                if tuple(tensor.shape) != tuple(dest.shape[1:]):
                    raise ValueError(
                        f"{block} expert {expert} tensor {name} has shape {tuple(tensor.shape)}, "
                        f"expected {tuple(dest.shape[1:])} from config.json"
                    )
                dest[slot].copy_(tensor)


def load_ep_model(
    checkpoint_dir: str,
    placement: ExpertPlacement,
    comm: Comm,
    *,
    options: MoELayerOptions = MoELayerOptions(),
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    load_format: str = "auto",
    attn_implementation: str | None = None,
    seed: int = 0,
) -> EPModel:
    """Load a local Hugging Face MoE checkpoint for one EP rank.

    Args:
        checkpoint_dir: directory with ``config.json`` and safetensors weights in the published layout.
        placement: the expert placement (checked against the model: layers and experts).
        comm: the EP group; its rank decides which slots are loaded.
        options: the options of every ``MoELayer`` (dispatcher, expert backend, replica policy, load
            recorder; ``epmoe.layer.MoELayerOptions``).
        dtype: compute dtype of the model.
        device: where this rank's weights live.
        load_format: ``auto`` (read the safetensors) or ``dummy`` (vLLM's name: random weights at the
            full size of ``config.json``, made on ``device``; the directory needs only ``config.json``).
        attn_implementation: passed to ``build_meta_model``.
        seed: seed of the dummy weights (the same on every rank, so replicated weights agree).

    Returns:
        The ``EPModel``; every parameter is materialised from the checkpoint (or random).

    Raises:
        FileNotFoundError: no checkpoint there.
        TypeError: ``options`` not an ``MoELayerOptions``, ``comm`` not a ``Comm``.
        ValueError: placement/model mismatch; a tensor with the wrong shape.
        KeyError: a tensor is missing from the checkpoint (named), or an unsupported family.
    """
    if not isinstance(options, MoELayerOptions):
        raise TypeError(f"load_ep_model options must be an epmoe.layer.MoELayerOptions, got {type(options).__name__}")
    if not isinstance(comm, Comm):
        raise TypeError(f"load_ep_model comm must be an epmoe.comm.Comm (Comm(group) wraps a process group, Comm(None) "
                        f"is one process), got {type(comm).__name__}")
    spec = load_moe_spec(checkpoint_dir)
    if not isinstance(placement, ExpertPlacement):
        raise TypeError(f"checkpoint {checkpoint_dir}: its MoE layers need an ExpertPlacement of their own "
                        f"({spec.num_moe_layers} layers x {spec.num_experts} experts, e.g. ExpertPlacement.trivial); "
                        f"got {type(placement).__name__}")
    placement.check_model(spec.num_moe_layers, spec.num_experts, what=f"checkpoint {checkpoint_dir}")
    ep = _load_model(
        checkpoint_dir, spec, comm, placement,
        lambda moe_index: MoELayer(spec, moe_index, placement, comm, options, dtype=dtype, device=device),
        _load_moe_layer, dtype=dtype, device=device, load_format=load_format,
        attn_implementation=attn_implementation, seed=seed,
    )
    per_expert = ep.expert_bytes // max(1, placement.slots_per_rank * spec.num_moe_layers)
    ep.full_expert_bytes = per_expert * spec.num_experts * spec.num_moe_layers
    return ep


def _load_model(checkpoint_dir: str, spec: MoESpec, comm: Comm, placement: ExpertPlacement | None,
                make_layer, load_layer, *, dtype: torch.dtype, device: torch.device | str, load_format: str,
                attn_implementation: str | None, seed: int) -> EPModel:
    """The loaders' common skeleton: the model on ``meta``, each MoE block replaced by ``make_layer(moe_index)``
    and filled by ``load_layer(layer, reader, layout, block)`` (or with dummy weights), then every other
    tensor read (or made) on ``device``. ``expert_bytes`` counts this rank's expert parameters."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
    dummy = load_format == "dummy"
    layout = family_layout(spec.model_type)
    model = build_meta_model(checkpoint_dir, dtype, attn_implementation)
    reader = None
    if not dummy:
        local = None if placement is None else (lambda i: placement.local_experts(comm.rank)[i].tolist())
        reader = check_checkpoint(checkpoint_dir, local, model)  # before any weight is read
    gen = torch.Generator(device=device).manual_seed(seed) if dummy else None
    layers = _decoder_layers(model)
    loaded = EPModel(model=model, spec=spec, placement=placement, comm=comm)
    for moe_index, layer_index in enumerate(spec.moe_layers):
        moe = make_layer(moe_index)
        block = f"model.layers.{layer_index}.{layout.ckpt_block}"
        if dummy:
            random_fill(moe, gen)
        else:
            load_layer(moe, reader, layout, block)
        setattr(layers[layer_index], layout.moe_attr, _TupleBlock(moe) if layout.returns_tuple else moe)
        loaded.moe_layers.append(moe)
        loaded.expert_bytes += sum(p.numel() * p.element_size() for p in moe.experts.parameters())
    if dummy:
        materialise_dummy(model, device, gen)
    else:
        materialise(model, reader, checkpoint_dir, device)
    return loaded


def load_dense_model(checkpoint_dir: str, *, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                     load_format: str = "auto", attn_implementation: str | None = None, seed: int = 0) -> nn.Module:
    """A dense (no routed experts) transformers causal LM of any family, whole on this rank: a speculative
    decoding draft. Built on ``meta``, then every tensor read from the checkpoint (or random with ``dummy``).

    Raises:
        ValueError: an unknown ``load_format`` or model type.
        KeyError: a tensor missing from the checkpoint (named).
        FileNotFoundError: no safetensors there (``auto``).
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
    model = build_meta_model(checkpoint_dir, dtype, attn_implementation)
    if load_format == "dummy":
        materialise_dummy(model, device, torch.Generator(device=device).manual_seed(seed))
    else:
        materialise(model, CheckpointReader(checkpoint_dir), checkpoint_dir, device)
    return model


def needs_own_loader(checkpoint: str | CheckpointReader) -> bool:
    """True when transformers' ``from_pretrained`` cannot read the checkpoint (its directory, or its reader where the
    caller opened one: the headers are not read again) as a plain model: block-FP8 weights (its FP8 path needs
    ``accelerate`` and a GPU, and computes in FP8), INT4 pack-quantized or MXFP4 weights (its quantizers compute in
    their own kernels, not from the dequantized weights) or a wrapper prefix.

    Raises:
        FileNotFoundError, ValueError: as ``CheckpointReader`` for a directory.
    """
    reader = checkpoint if isinstance(checkpoint, CheckpointReader) else CheckpointReader(checkpoint)
    return reader.has_fp8 or reader.has_packed or bool(reader.prefix)


def load_full_model(checkpoint_dir: str, dtype: torch.dtype = torch.float32,
                    device: torch.device | str = "cpu") -> nn.Module:
    """The unsharded transformers causal LM with every tensor read (dequantized) from the checkpoint.

    The reference for checkpoints ``from_pretrained`` cannot load (``needs_own_loader``): built on
    ``meta`` from ``hf_config`` and filled in transformers' own module layout, experts included (no
    ``MoELayer``: an independent computation of the same weights).

    Raises:
        ValueError: an unsupported weight format, a float8 tensor without scales, a shape mismatch.
        KeyError: a tensor missing from the checkpoint (named).
    """
    spec = load_moe_spec(checkpoint_dir)
    model = build_meta_model(checkpoint_dir, dtype)
    reader = check_checkpoint(checkpoint_dir, model=model)
    materialise(model, reader, checkpoint_dir, device, fused_experts=family_layout(spec.model_type))
    return model


@torch.no_grad()
def _load_tp_layer(moe: DPTPMoELayer, reader: CheckpointReader, layout: FamilyLayout, block: str) -> None:
    """Fill ``moe`` with this rank's slices, reading one expert at a time (rows/cols as ``TPMoELayer.load_from``)."""
    g, r = moe.comm.size, moe.comm.rank
    f = moe.spec.moe_intermediate_size
    part = slice(r * f // g, (r + 1) * f // g)
    for ours, suffix in layout.router.items():
        _copy_checked(getattr(moe.gate, ours), reader, f"{block}.{suffix}")
    if moe.shared_experts is not None:
        fs = moe.spec.shared_intermediate_size
        sp = slice(r * fs // g, (r + 1) * fs // g)
        for proj in ("gate_proj", "up_proj", "down_proj"):
            name = f"{block}.{layout.shared}.{proj}.weight"
            tensor = reader.get(name)
            want = (fs, moe.spec.hidden_size) if proj != "down_proj" else (moe.spec.hidden_size, fs)
            if tuple(tensor.shape) != want:
                raise ValueError(f"checkpoint {reader.directory}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                                 f"expected {want} from config.json")
            getattr(moe.shared_experts, proj).weight.copy_(tensor[sp] if proj != "down_proj" else tensor[:, sp])
    if moe.shared_expert_gate is not None:
        _copy_checked(moe.shared_expert_gate.weight, reader, f"{block}.{layout.shared_gate}")
    params = moe.experts
    d = moe.spec.hidden_size
    for expert in range(moe.spec.num_experts):
        try:
            full = read_expert(reader, layout, block, expert)
        except KeyError as exc:
            raise KeyError(f"checkpoint is missing a tensor of logical expert {expert} of {block}: "
                           f"{exc.args[0]}") from None
        want = {"w13": (2 * f, d), "w2": (d, f), "b13": (2 * f,), "b2": (d,)}
        for name, tensor in full.items():
            if getattr(params, name) is None:
                continue
            if tuple(tensor.shape) != want[name]:
                raise ValueError(f"{block} expert {expert} tensor {name} has shape {tuple(tensor.shape)}, "
                                 f"expected {want[name]} from config.json")
        params.w13[expert].copy_(torch.cat([full["w13"][:f][part], full["w13"][f:][part]]))
        params.w2[expert].copy_(full["w2"][:, part])
        if params.b13 is not None:
            params.b13[expert].copy_(torch.cat([full["b13"][:f][part], full["b13"][f:][part]]))
            params.b2[expert].copy_(full["b2"] if r == 0 else torch.zeros_like(full["b2"]))


def load_tp_model(
    checkpoint_dir: str,
    comm: Comm,
    *,
    expert_backend: str = "reference",
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    load_format: str = "auto",
    attn_implementation: str | None = None,
    seed: int = 0,
) -> EPModel:
    """Load a local Hugging Face MoE checkpoint for one rank of data-parallel attention + tensor-parallel experts.

    Every MoE block becomes a ``DPTPMoELayer`` holding this rank's ``1/G`` slice of every expert's (and the
    shared expert's) intermediate dimension, read one expert at a time; the non-expert weights are read in full.

    Args:
        checkpoint_dir: directory with ``config.json`` and safetensors weights in the published layout.
        comm: the TP group; its rank decides which slice is loaded.
        expert_backend: a registered expert backend name.
        dtype, device, load_format, attn_implementation, seed: as ``load_ep_model``.

    Returns:
        An ``EPModel`` with ``placement=None``; ``expert_bytes`` is this rank's slice, ``full_expert_bytes``
        all experts in full.

    Raises:
        FileNotFoundError: no checkpoint there.
        ValueError: ``moe_intermediate_size`` or the shared size not divisible by the group size (named,
            before anything is read); a tensor with the wrong shape; a bad ``load_format``.
        KeyError: a tensor is missing from the checkpoint (named), or an unsupported family.
    """
    spec = load_moe_spec(checkpoint_dir)
    check_tp_sizes(spec, comm.size)
    tp = _load_model(checkpoint_dir, spec, comm, None,
                     lambda moe_index: DPTPMoELayer(spec, moe_index, comm, expert_backend, dtype=dtype, device=device),
                     _load_tp_layer, dtype=dtype, device=device,
                     load_format=load_format, attn_implementation=attn_implementation, seed=seed)
    if load_format == "dummy" and comm.rank:  # the second bias is added once, on rank 0
        for moe in tp.moe_layers:
            if moe.experts.b2 is not None:
                moe.experts.b2.zero_()
    tp.full_expert_bytes = tp.expert_bytes * comm.size
    return tp


def check_checkpoint(checkpoint_dir: str, experts: Callable[[int], Iterable[int]] | None = None,
                     model: nn.Module | None = None, reader: CheckpointReader | None = None) -> CheckpointReader:
    """Check, before any weight is read, that a checkpoint holds what the loaders read: a weight format they
    support, every tensor with the shape ``config.json`` predicts, stored as a float (or packed as the format says),
    and no tensor the model ``config.json`` describes has no place for (names, shapes and dtypes from the
    safetensors headers). The loaders call it first and ``epmoe doctor`` calls it alone, so both refuse the same
    checkpoints with the same message.

    Args:
        checkpoint_dir: the checkpoint directory.
        experts: MoE layer index -> the logical experts to check (a rank's own); ``None`` = every expert.
        model: the model ``build_meta_model`` built for it (built here when ``None``), MoE blocks not replaced yet.
        reader: the checkpoint's reader where the caller opened one (its headers are not read again); opened here
            when ``None``.

    Returns:
        The checkpoint's reader (``reader`` where given).

    Raises:
        FileNotFoundError: no checkpoint there.
        ValueError: a weight format the loader does not support; a tensor whose shape is not the one
            ``config.json`` predicts (name and both shapes), or stored in a dtype that is not a float's (name and
            dtype); tensors no loader reads, such as the layers past ``num_hidden_layers`` (the count and the first
            named); a model type transformers does not know.
        KeyError: a missing tensor (named; for routed experts, which expert of which MoE block); an unsupported
            family.
    """
    spec = load_moe_spec(checkpoint_dir)
    _check_weight_format(spec, checkpoint_dir)
    layout = family_layout(spec.model_type)
    reader = CheckpointReader(checkpoint_dir) if reader is None else reader
    if model is None:
        model = build_meta_model(checkpoint_dir, torch.float32)
    fmt = spec.expert_weight_format
    packed = "mxfp4" if fmt == "mxfp4" else "int4" if fmt.startswith("int4") else None  # how routed experts are stored
    served_fp8 = ExpertStorage.of(fmt, spec.moe_intermediate_size).kind == "fp8"  # read as stored: checked for it
    every = _expected_tensors(model, spec, layout, None)
    for name, (shape, owner) in (every if experts is None else _expected_tensors(model, spec, layout, experts)).items():
        if name not in reader:
            full = reader.prefix + name
            strays = sorted(k for k in reader.unindexed if k == full or k.startswith(full + "_"))
            parts = sorted(k for k in reader.weight_map if k.startswith(full + "_") and not k.endswith("_bias"))
            if strays:
                held = (f" (shard file {reader.unindexed[strays[0]]!r} holds {strays[0]!r}, but "
                        f"model.safetensors.index.json does not list it)")
            elif parts:
                held = f" (it holds {', '.join(map(repr, parts))} without the tensor they belong with)"
            else:
                held = ""
            if owner:
                raise KeyError(f"checkpoint is missing a tensor of {owner}: checkpoint {reader.directory} has no "
                               f"tensor {name!r}{held}")
            raise KeyError(f"checkpoint {checkpoint_dir} is missing tensor {name!r}{held}")
        stored = reader.packed_format(name)
        if owner and stored != packed and not name.endswith("bias"):  # expert biases stay unpacked
            raise ValueError(f"checkpoint {reader.directory}: tensor {name!r} of {owner} is stored "
                             f"{stored or 'unpacked'}, but config.json's quantization_config says the routed experts "
                             f"are {spec.expert_weight_format}")
        if stored == "int4":  # weight_shape against config.json, the packed values and scales against both
            reader.check_int4(name, shape)
            continue
        if stored == "mxfp4":  # its scales companion, dtypes and shapes, then the blocks against config.json
            reader.check_mxfp4(name)
        found = reader.shape(name)
        if found != shape:
            as_stored = (f" (stored as {name + '_blocks'!r} of shape {reader.stored_shape(name + '_blocks')}, read "
                         f"as {found})" if stored == "mxfp4" else f" has shape {found}")
            raise ValueError(f"checkpoint {reader.directory}: tensor {name!r}{as_stored}, expected {shape} from "
                             f"config.json (does config.json belong to these weights?)")
        if stored == "mxfp4":
            continue
        dtype = reader.dtype(name)
        if served_fp8 and owner and not name.endswith("bias"):
            reader.check_fp8(name)  # as the expert kernels read it, its scales included
        elif dtype.startswith("F8_"):  # its scales, which dequantizing it on load reads
            reader.check_fp8_scales(name)
        if dtype not in WEIGHT_HEADER_DTYPES:  # an integer tensor would be copied into the float weight as numbers
            raise ValueError(f"checkpoint {reader.directory}: tensor {name!r}{' of ' + owner if owner else ''} is "
                             f"{dtype}, expected a float dtype ({', '.join(WEIGHT_HEADER_DTYPES)})")
    blocks = tuple(f"model.layers.{i}.{layout.moe_attr}." for i in spec.moe_layers)
    unread, own_in_blocks = _unread_tensors(reader, model, every, spec.num_layers, blocks)
    if unread:
        first = unread[0]
        why = (f"config.json makes it {own_in_blocks[first]}, the checkpoint holds {reader.shape(first)}"
               if first in own_in_blocks else f"num_hidden_layers {spec.num_layers}")
        raise ValueError(f"checkpoint {reader.directory} holds {len(unread)} tensor{'s' if len(unread) > 1 else ''} "
                         f"the model config.json describes has no place for, the first {first!r} ({why}; does "
                         f"config.json belong to these weights?)")
    return reader


def _unread_tensors(reader: CheckpointReader, model: nn.Module, expected: Iterable[str], num_layers: int,
                    blocks: tuple[str, ...]) -> tuple[list[str], dict[str, tuple[int, ...]]]:
    """The checkpoint's tensors that no loader reads, in the checkpoint's order, and the shapes of the model's own
    tensors inside its MoE blocks (the prefixes ``blocks``). Read are: the model's own outside those blocks (RoPE
    tables and a tied LM head included, though they are rebuilt); inside them, those in ``expected`` (the blocks'
    in the checkpoint layout, every expert) and the model's own where the checkpoint's shape is the model's (the
    empty shared expert transformers saves for ``n_shared_experts: 0``, not a real one ``config.json`` leaves out);
    and a multi-token-prediction module's: a layer past the ``num_layers`` decoder layers that holds an ``eh_proj``
    (DeepSeek-V3, GLM-4.5 store one; transformers loads it apart)."""
    own, in_blocks = set(), {}
    for name, t in chain(model.named_parameters(remove_duplicate=False), model.named_buffers(remove_duplicate=False)):
        if name.startswith(blocks):
            in_blocks[name] = tuple(t.shape)
        else:
            own.add(name)
    known = own.union(expected)
    names = reader.keys()
    marked = (re.fullmatch(r"model\.layers\.(\d+)\.eh_proj\.weight", name) for name in names)
    mtp = tuple(f"model.layers.{m[1]}." for m in marked if m and int(m[1]) >= num_layers)
    unread = [name for name in names if name not in known and not name.startswith(mtp)
              and not (name in in_blocks and tuple(reader.shape(name)) == in_blocks[name])]
    return unread, in_blocks


def _expected_tensors(model: nn.Module, spec: MoESpec, layout: FamilyLayout,
                      experts: Callable[[int], Iterable[int]] | None) -> dict[str, tuple[tuple[int, ...], str]]:
    """Checkpoint tensor name -> (shape, the routed experts it belongs to or ``""``) of everything the loaders
    read: the model's own tensors outside the MoE blocks (RoPE tables and a tied LM head are rebuilt, not read),
    then per MoE block its router, shared expert and routed experts in the checkpoint's layout."""
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    blocks = tuple(f"model.layers.{i}.{layout.moe_attr}." for i in spec.moe_layers)
    out = {name: (tuple(t.shape), "") for name, t in chain(model.named_parameters(), model.named_buffers())
           if not name.endswith("inv_freq") and not (tied and name == "lm_head.weight")
           and not name.startswith(blocks)}
    d, e = spec.hidden_size, spec.num_experts
    shapes = expert_tensor_shapes(layout, e, d, spec.moe_intermediate_size)
    for moe_index, layer_index in enumerate(spec.moe_layers):
        block = f"model.layers.{layer_index}.{layout.ckpt_block}"
        for ours, suffix in layout.router.items():
            out[f"{block}.{suffix}"] = ((e, d) if ours == "weight" else (e,), "")
        if spec.shared_intermediate_size:
            fs = spec.shared_intermediate_size
            for proj, shape in (("gate_proj", (fs, d)), ("up_proj", (fs, d)), ("down_proj", (d, fs))):
                out[f"{block}.{layout.shared}.{proj}.weight"] = (shape, "")
        if spec.shared_expert_gate:
            out[f"{block}.{layout.shared_gate}"] = ((1, d), "")
        if layout.experts != "per_expert":
            for name, shape in zip(expert_tensor_names(layout, block, 0), shapes):
                out[name] = (shape, f"the fused experts of {block}")
            continue
        for expert in sorted(set(range(e) if experts is None else experts(moe_index))):
            for name, shape in zip(expert_tensor_names(layout, block, expert), shapes):
                out[name] = (shape, f"logical expert {expert} of {block}")
    return out
