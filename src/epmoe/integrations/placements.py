"""Expert placements in the formats of epmoe, SGLang and TensorRT-LLM: checked, written atomically, read back.

* ``epmoe``: ``ExpertPlacement.save`` / ``load`` (JSON or safetensors; MoE layers only, ``ep_size`` inside).
* ``sglang``: the file ``--init-expert-location`` takes, ``.json`` or ``.pt`` (``torch.save``), holding
  ``physical_to_logical_map`` alone: int64 ``[num_hidden_layers, P]`` over all decoder layers (dense rows
  trivial, ``p mod E``); slot ``p`` lives on GPU ``p // (P / ep_size)``. SGLang passes every key of the file
  to ``ExpertLocationMetadata.init_by_mapping`` as a keyword, so any other key stops its start-up with a
  ``TypeError``; the EP size is not in the file (SGLang takes it from ``--ep``).
* ``trtllm``: TensorRT-LLM's load-balancer YAML (``moe_config.load_balancer``): ``num_slots: P``,
  ``layer_updates_per_iter: 0`` and ``initial_global_assignments: {decoder_layer_index: [P expert ids]}``
  for every MoE layer, ranks' slots concatenated in rank order.

Before anything is written, the placement is checked as the server would check it: ``P = E + R`` with
``R >= 0``, ``P`` divisible by the EP size, every expert present in every layer, ids in range, one row per
MoE layer of the model. Checked against SGLang 0.5.23 (``sglang/srt/eplb/expert_location.py``) and
TensorRT-LLM's ``examples/ep_load_balancer`` (``generate_eplb_config.py``, ``README.md``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from epmoe.checks import read_text_file
from epmoe.files import atomic_path
from epmoe.placement import ExpertPlacement, placement_file
from epmoe.spec import MoESpec

PLACEMENT_FORMATS = ("epmoe", "sglang", "trtllm")
SGLANG_KEY = "physical_to_logical_map"
TRTLLM_KEYS = ("num_slots", "layer_updates_per_iter", "initial_global_assignments")


@dataclass(frozen=True)
class LayeredPlacement:
    """A placement with the decoder layer index of each of its rows.

    Attributes:
        placement: the MoE layers' placement (``[L, P]``).
        layers: decoder layer index of every row, ascending (``0 .. L-1`` when the file does not say).
        num_decoder_layers: the model's decoder layers when the file covers all of them (SGLang), else None.
        format: the format read or to write (one of ``PLACEMENT_FORMATS``).
    """

    placement: ExpertPlacement
    layers: tuple[int, ...]
    num_decoder_layers: int | None
    format: str


def format_for_path(path: str | Path) -> str:
    """The default output format of a file name: ``.yaml``/``.yml`` TensorRT-LLM, ``.pt`` SGLang, else epmoe."""
    suffix = Path(path).suffix
    return "trtllm" if suffix in (".yaml", ".yml") else "sglang" if suffix in (".pt", ".pth") else "epmoe"


def check_placement_path(path: str | Path, fmt: str | None = None) -> str:
    """The format a placement file will be written in (``fmt``, or ``format_for_path``), checked against its suffix.

    Raises:
        ValueError: an unknown format, or a suffix the format cannot take (``out`` and the suffixes named).
    """
    fmt = fmt or format_for_path(path)
    if fmt not in PLACEMENT_FORMATS:
        raise ValueError(f"out_format must be one of {', '.join(PLACEMENT_FORMATS)}, got {fmt!r}")
    allowed = {"epmoe": (".json", ".safetensors"), "sglang": (".json", ".pt"), "trtllm": (".yaml", ".yml")}[fmt]
    if Path(path).suffix not in allowed:
        raise ValueError(f"out ({str(path)!r}) must end in {' or '.join(allowed)} for out_format {fmt}")
    return fmt


def _check_layers(lp: LayeredPlacement, fmt: str, what: str) -> None:
    p = lp.placement
    if len(lp.layers) != p.num_layers or list(lp.layers) != sorted(set(lp.layers)):
        raise ValueError(f"{what}: the placement has {p.num_layers} rows but {len(lp.layers)} distinct "
                         "ascending decoder layer indices were given")
    if fmt == "sglang":
        if lp.num_decoder_layers is None:
            raise ValueError(f"{what}: SGLang's physical_to_logical_map covers every decoder layer; the "
                             "model's decoder layer count is unknown (pass --config)")
        if lp.layers[-1] >= lp.num_decoder_layers:
            raise ValueError(f"{what}: MoE layer {lp.layers[-1]} is past the model's "
                             f"{lp.num_decoder_layers} decoder layers")


def sglang_map(lp: LayeredPlacement) -> torch.Tensor:
    """``[num_decoder_layers, P]`` int64: SGLang's ``physical_to_logical_map``, dense rows trivial (``p mod E``).

    Raises:
        ValueError: the decoder layer count is unknown or a layer index is past it.
    """
    _check_layers(lp, "sglang", "SGLang's physical_to_logical_map")
    p = lp.placement
    full = (torch.arange(p.num_slots) % p.num_experts).expand(lp.num_decoder_layers, -1).clone()
    full[list(lp.layers)] = p.phy2log
    return full


def save_placement_as(lp: LayeredPlacement, path: str | Path, fmt: str | None = None) -> None:
    """Write ``lp`` in format ``fmt`` (default ``format_for_path``), atomically (temporary file + rename).

    Args:
        lp: the placement and its decoder layer indices (SGLang also needs ``num_decoder_layers``).
        path: the file; SGLang: ``.json`` or ``.pt``; TensorRT-LLM: ``.yaml``; epmoe: ``.json``/``.safetensors``.
        fmt: one of ``PLACEMENT_FORMATS``.

    Raises:
        ValueError: an unknown format, a suffix the format cannot take, or a placement the server would reject
            (the file and what is wrong named); nothing is written then.
    """
    path = Path(path)
    fmt = check_placement_path(path, fmt)
    _check_layers(lp, fmt, f"out ({str(path)!r})")
    p = lp.placement
    if fmt == "epmoe":
        p.save(path)
        return
    if fmt == "sglang":
        full = sglang_map(lp)
        with atomic_path(path) as tmp:
            if path.suffix == ".pt":
                torch.save({SGLANG_KEY: full}, str(tmp))
            else:
                tmp.write_text(json.dumps({SGLANG_KEY: full.tolist()}))
        return
    import yaml

    doc = {"num_slots": p.num_slots, "layer_updates_per_iter": 0,
           "initial_global_assignments": {int(layer): p.phy2log[i].tolist() for i, layer in enumerate(lp.layers)}}
    with atomic_path(path) as tmp:
        dumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)  # libyaml where PyYAML was built with it
        tmp.write_text(yaml.dump(doc, Dumper=dumper, default_flow_style=None, width=1 << 20, sort_keys=False))


def _read_doc(path: Path) -> tuple[str, Any]:
    """``(format, document)`` of a placement file, from its content."""
    if path.suffix == ".safetensors":
        return "epmoe", None
    if path.suffix in (".yaml", ".yml"):
        import yaml

        try:
            loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
            return "trtllm", yaml.load(read_text_file(path, "placement file"), Loader=loader)
        except yaml.YAMLError as exc:
            raise ValueError(f"placement file {str(path)!r} is not YAML: {exc}") from exc
    if path.suffix in (".pt", ".pth"):
        try:
            doc = torch.load(str(path), map_location="cpu", weights_only=True)
        except Exception as exc:  # truncated zip, pickle errors
            raise ValueError(f"placement file {str(path)!r} could not be read by torch.load (truncated, or not a "
                             f"torch.save file): {exc}") from exc
        return "sglang", doc
    try:
        doc = json.loads(read_text_file(path, "placement file"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"placement file {str(path)!r} is not JSON: {exc}") from exc
    if isinstance(doc, dict) and SGLANG_KEY in doc and "phy2log" not in doc:
        return "sglang", doc
    return "epmoe", doc


def _int_rows(value: Any, path: Path, field: str) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        t = value
    else:
        ok = isinstance(value, list) and all(isinstance(r, list) for r in value)
        if not ok or not all(isinstance(v, int) and not isinstance(v, bool) for r in value for v in r):
            raise ValueError(f"placement file {str(path)!r}: field {field!r} must be a list of per-layer lists of "
                             "integers")
        if len({len(r) for r in value}) > 1:
            raise ValueError(f"placement file {str(path)!r}: field {field!r} has layers of different lengths")
        t = torch.tensor(value, dtype=torch.int64)
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool or t.dim() != 2:
        raise ValueError(f"placement file {str(path)!r}: field {field!r} must be a 2-D integer table, got "
                         f"{t.dtype} of shape {tuple(t.shape)}")
    return t.long()


def _build(path: Path, field: str, phy2log: torch.Tensor, ep_size: int | None, num_experts: int | None
           ) -> ExpertPlacement:
    if ep_size is None:
        raise ValueError(f"placement file {str(path)!r} does not name its EP size; pass it (--ep)")
    try:
        return ExpertPlacement.from_phy2log(phy2log, ep_size=ep_size, num_experts=num_experts)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"placement file {str(path)!r}: field {field!r}: {exc}") from exc


def load_placement_as(path: str | Path, *, ep_size: int | None = None, spec: MoESpec | None = None,
                      model_experts: int | None = None) -> LayeredPlacement:
    """Read a placement file of any of ``PLACEMENT_FORMATS`` (recognised by suffix and content).

    SGLang files (``physical_to_logical_map`` alone, every decoder layer) are cut to the MoE layers of
    ``spec``, or without ``spec`` kept whole. TensorRT-LLM files keep their decoder layer indices. With
    ``spec`` the layer and expert counts must match it.

    Args:
        path: the file.
        ep_size: the EP size; needed for SGLang and TensorRT-LLM files (they do not carry it), checked
            against epmoe files.
        spec: the served model, or None.
        model_experts: the model's experts a layer where ``spec`` is not given, or None: an epmoe file that names
            no ``num_experts`` is read with the model's (``spec``'s, else this), so that an id past them is named as
            out of range.

    Raises:
        FileNotFoundError: no such file (or a directory).
        ValueError: an unreadable file, a field SGLang or TensorRT-LLM would reject (an extra key in an SGLang
            file, a missing or short layer in a YAML), or a placement that does not fit ``spec`` (file and field
            named).
    """
    path = placement_file(path)
    fmt, doc = _read_doc(path)
    config = spec.source if spec is not None else None
    num_experts = spec.num_experts if spec is not None else None
    if fmt == "epmoe":
        p = ExpertPlacement.load(path, ep_size=ep_size, model_experts=num_experts or model_experts)
        if spec is not None:
            try:
                p.check_model(spec.num_moe_layers, spec.num_experts, f"config {config!r}")
            except ValueError as exc:
                raise ValueError(f"placement file {str(path)!r}: field 'phy2log': {exc}") from exc
            return LayeredPlacement(p, spec.moe_layers, None, fmt)
        return LayeredPlacement(p, tuple(range(p.num_layers)), None, fmt)
    if fmt == "sglang":
        if not isinstance(doc, dict) or SGLANG_KEY not in doc:
            keys = sorted(map(str, doc)) if isinstance(doc, dict) else type(doc).__name__
            raise ValueError(f"placement file {str(path)!r}: field {SGLANG_KEY!r} is missing (found {keys})")
        extra = sorted(str(k) for k in doc if k != SGLANG_KEY)
        if extra:
            raise ValueError(f"placement file {str(path)!r}: field {extra[0]!r} is not accepted by SGLang's "
                             f"--init-expert-location (it passes every key to init_by_mapping, which raises "
                             f"TypeError); keep {SGLANG_KEY!r} alone")
        full = _int_rows(doc[SGLANG_KEY], path, SGLANG_KEY)
        if spec is not None:
            if full.shape[0] != spec.num_layers:
                raise ValueError(f"placement file {str(path)!r}: field {SGLANG_KEY!r} has {full.shape[0]} rows, but "
                                 f"config {config!r} has {spec.num_layers} decoder layers (SGLang needs one row each)")
            layers = spec.moe_layers
        else:
            layers = tuple(range(full.shape[0]))
        p = _build(path, SGLANG_KEY, full[list(layers)], ep_size, num_experts)
        return LayeredPlacement(p, tuple(layers), full.shape[0], fmt)
    if not isinstance(doc, dict):
        raise ValueError(f"placement file {str(path)!r}: expected a YAML mapping with {', '.join(TRTLLM_KEYS)}")
    for key in ("num_slots", "initial_global_assignments"):
        if key not in doc:
            raise ValueError(f"placement file {str(path)!r}: field {key!r} is missing")
    slots, table = doc["num_slots"], doc["initial_global_assignments"]
    if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
        raise ValueError(f"placement file {str(path)!r}: field 'num_slots' must be a positive integer, got {slots!r}")
    if not isinstance(table, dict) or not table or not all(isinstance(k, int) for k in table):
        raise ValueError(f"placement file {str(path)!r}: field 'initial_global_assignments' must map decoder layer "
                         "indices to lists of expert ids")
    layers = tuple(sorted(table))
    want = spec.moe_layers if spec is not None else layers
    missing = [layer for layer in want if layer not in table]
    if missing:
        raise ValueError(f"placement file {str(path)!r}: field 'initial_global_assignments' has no layer {missing[0]} "
                         f"({len(missing)} of config {config!r}'s {len(want)} MoE layers missing)")
    stray = [layer for layer in layers if layer not in want]
    if stray:
        raise ValueError(f"placement file {str(path)!r}: field 'initial_global_assignments' has layer {stray[0]}, "
                         f"which config {config!r} says is not an MoE layer")
    for layer in layers:
        row = table[layer]
        if not isinstance(row, list) or len(row) != slots:
            n = len(row) if isinstance(row, list) else type(row).__name__
            raise ValueError(f"placement file {str(path)!r}: field 'initial_global_assignments.{layer}' has {n} "
                             f"entries, but num_slots is {slots}")
    rows = _int_rows([table[layer] for layer in layers], path, "initial_global_assignments")
    return LayeredPlacement(_build(path, "initial_global_assignments", rows, ep_size, num_experts), layers, None, fmt)


def load_served_placement(path: str | Path, *, ep_size: int, spec: MoESpec) -> ExpertPlacement:
    """The placement of a served model's placement file (``--placement``, ``--speculative-draft-placement``):
    epmoe's file as ``ExpertPlacement.load`` reads it (its user checks it against the model, naming its own
    option), or SGLang's or TensorRT-LLM's, as doctor and the plug-ins read them, cut to ``spec``'s MoE layers.

    Raises:
        FileNotFoundError, ValueError: as ``load_placement_as``.
    """
    layered = load_placement_as(path, ep_size=ep_size, model_experts=spec.num_experts)
    if layered.format != "epmoe":
        layered = load_placement_as(path, ep_size=ep_size, spec=spec)
    return layered.placement
