"""Expert-load dumps of other servers, read into one ``LoadDump``: tokens per logical expert per MoE layer,
with the decoder layer index of every row.

Formats (recognised by content; ``read_load_dump(..., fmt=...)`` forces one):

* ``epmoe``: epmoe's load files (``loads.read_loads``: JSON or safetensors); also what the vLLM plug-in dumps
  (``integrations.vllm``), one row per MoE layer.
* ``olmoe-csv``: the OLMoE routing-count CSV (``loads.read_csv_loads``).
* ``sglang-stat``: SGLang's expert distribution recorder in ``stat`` mode (``/dump_expert_distribution_record``):
  ``expert_distribution_recorder_{time}.pt`` (``torch.save``), or a JSON object, holding ``logical_count``
  ``[B, L_all, E]`` (or ``[L_all, E]``) int32 tokens summed over ranks, one row per decoder layer (dense
  layers zero), plus ``rank`` and ``average_utilization_rate_over_window``.
* ``sglang-per-pass``: the recorder in ``per_pass`` mode: one ``expert_distribution_recorder_{time}_{rank}.pt``
  per rank (a folder of them, or one file), each ``{"records": [{"global_physical_count": [L_all, P], ...}],
  "last_physical_to_logical_map": [L_all, P]}``; physical counts summed over records and ranks and mapped back
  to logical experts through the map they carry.
* ``trtllm``: TensorRT-LLM's expert statistic folder (``EXPERT_STATISTIC_PATH`` with
  ``EXPERT_STATISTIC_ITER_RANGE``): ``meta_info.json`` (``num_experts``, ``num_experts_per_token``) and
  ``rank{r}.safetensors`` holding int64 ``[E]`` counts under keys ``"{iter}_{decoder_layer}"``, summed over
  ranks and the iterations of ``iters``.

Checked against SGLang 0.5.23 (``sglang/srt/eplb/expert_distribution.py``) and TensorRT-LLM's
``tensorrt_llm/_torch/expert_statistic.py`` and ``examples/ep_load_balancer/utils.py``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from epmoe.checks import MAX_DATA_TEXT_BYTES, check_regular_file, read_text_file
from epmoe.loads import as_load_array, read_csv_loads, read_loads
from epmoe.spec import MoESpec

LOAD_FORMATS = ("auto", "epmoe", "olmoe-csv", "sglang-stat", "sglang-per-pass", "trtllm")


@dataclass(frozen=True)
class LoadDump:
    """A load table read from a file or folder.

    Attributes:
        load: ``[L, E]`` float64 tokens per logical expert, one row per MoE layer (dense rows dropped).
        layers: the decoder layer index of every row (``L`` ascending ints); ``0 .. L-1`` when the file does
            not say (epmoe files, the OLMoE CSV).
        num_decoder_layers: decoder layers of the model when the file covers all of them (SGLang), else None.
        format: the format read (one of ``LOAD_FORMATS`` but ``auto``).
        names: a label per row for reports (the decoder layer index, or the CSV's ``domain:layer``).
    """

    load: torch.Tensor
    layers: tuple[int, ...]
    num_decoder_layers: int | None
    format: str
    names: tuple[str, ...]


def parse_iters(text: str) -> tuple[int, int]:
    """``--iters a-b``: TensorRT-LLM's ``EXPERT_STATISTIC_ITER_RANGE`` convention, iterations ``a <= i < b``.

    Raises:
        ValueError: not two integers ``a-b`` with ``0 <= a < b``.
    """
    m = re.fullmatch(r"\s*(\d+)\s*-\s*(\d+)\s*", text)
    if not m or int(m.group(1)) >= int(m.group(2)):
        raise ValueError(f"iters must be 'a-b' with integers 0 <= a < b (iterations a <= i < b), got {text!r}")
    return int(m.group(1)), int(m.group(2))


def _torch_load(path: Path, what: str) -> Any:
    check_regular_file(path, what)  # a pipe would block torch.load, a device exhaust memory
    try:
        return torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as exc:  # truncated zip, pickle errors, disallowed globals: all mean "not readable"
        text = str(exc).strip()
        # torch's own advice (re-run with weights_only=False) would run arbitrary code: not passed on
        reason = ("it holds something other than tensors and plain values" if "Weights only load failed" in text
                  else text.splitlines()[0] if text else type(exc).__name__)
        raise ValueError(f"{what} {str(path)!r} could not be read by torch.load with weights_only=True (truncated, "
                         f"or not a torch.save file of tensors and plain values): {reason}") from None


def _as_tensor(value: Any, path: Path, field: str) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        t = value
    elif isinstance(value, list):
        try:
            t = torch.tensor(value)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"loads file {str(path)!r}: field {field!r} is not a rectangular list of numbers") from exc
    else:
        raise ValueError(f"loads file {str(path)!r}: field {field!r} must be a tensor or a list, got "
                         f"{type(value).__name__}")
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise ValueError(f"loads file {str(path)!r}: field {field!r} must hold integer token counts, got {t.dtype}")
    return t


def _file_doc(path: Path) -> Any:
    """The object stored in a single-file dump: torch.load for ``.pt``/``.pth``, JSON otherwise."""
    if path.suffix in (".pt", ".pth"):
        return _torch_load(path, "loads file")
    text = read_text_file(path, "loads file", MAX_DATA_TEXT_BYTES)
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"loads file {str(path)!r} is not JSON: {exc} (a loads file is read by its suffix: "
                         f"'.csv' the OLMoE routing CSV, '.safetensors', '.pt'/'.pth' a torch dump, any other JSON)"
                         ) from exc


def detect_load_format(path: str | Path) -> str:
    """The format of a load dump, from its content (see the module docstring).

    Raises:
        FileNotFoundError: no such file or folder.
        ValueError: a folder or file of no known format (what was found is named).
    """
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"loads {str(p)!r} does not exist")
    if p.is_dir():
        if (p / "meta_info.json").is_file():
            return "trtllm"
        if any(p.glob("*.pt")):
            return "sglang-per-pass"
        raise ValueError(f"loads folder {str(p)!r} holds neither TensorRT-LLM's meta_info.json nor SGLang's "
                         "per-pass .pt files")
    if p.suffix == ".csv":
        return "olmoe-csv"
    if p.suffix == ".safetensors":
        return "epmoe"
    doc = _file_doc(p)
    if isinstance(doc, dict):
        if "logical_count" in doc:
            return "sglang-stat"
        if "records" in doc:
            return "sglang-per-pass"
        if "load" in doc or "weight" in doc:
            return "epmoe"
        raise ValueError(f"loads file {str(p)!r} holds fields {sorted(map(str, doc))}; expected 'logical_count' "
                         "(SGLang stat dump), 'records' (SGLang per-pass dump) or 'load' (epmoe)")
    raise ValueError(f"loads file {str(p)!r} holds a {type(doc).__name__}; expected a JSON object or a torch.save "
                     "dict")


def _sglang_stat(path: Path) -> torch.Tensor:
    if path.is_dir():
        raise ValueError(f"loads {str(path)!r} is a folder; an SGLang stat dump is one file")
    doc = _file_doc(path)
    if not isinstance(doc, dict) or "logical_count" not in doc:
        keys = sorted(map(str, doc)) if isinstance(doc, dict) else type(doc).__name__
        raise ValueError(f"loads file {str(path)!r}: field 'logical_count' is missing (found {keys})")
    count = _as_tensor(doc["logical_count"], path, "logical_count")
    if count.dim() == 3:
        count = count.double().sum(0)  # in float64: int64 counts near 2**62 would wrap to negatives
    if count.dim() != 2:
        raise ValueError(f"loads file {str(path)!r}: field 'logical_count' must be [B, L, E] or [L, E], got shape "
                         f"{tuple(count.shape)}")
    return count.double()


def _sglang_per_pass(path: Path) -> torch.Tensor:
    files = sorted(path.glob("*.pt")) if path.is_dir() else [path]
    if not files:
        raise ValueError(f"loads folder {str(path)!r} holds no .pt files")
    total: torch.Tensor | None = None
    for f in files:
        doc = _torch_load(f, "loads file")
        if not isinstance(doc, dict) or "records" not in doc or "last_physical_to_logical_map" not in doc:
            keys = sorted(map(str, doc)) if isinstance(doc, dict) else type(doc).__name__
            raise ValueError(f"loads file {str(f)!r}: fields 'records' and 'last_physical_to_logical_map' are needed "
                             f"(found {keys})")
        phy2log = _as_tensor(doc["last_physical_to_logical_map"], f, "last_physical_to_logical_map").long()
        if phy2log.dim() != 2 or (phy2log < 0).any():
            raise ValueError(f"loads file {str(f)!r}: field 'last_physical_to_logical_map' must be [L, P] of expert "
                             f"ids >= 0, got shape {tuple(phy2log.shape)}")
        physical = torch.zeros(phy2log.shape, dtype=torch.float64)
        for i, rec in enumerate(doc["records"]):
            if not isinstance(rec, dict) or "global_physical_count" not in rec:
                raise ValueError(f"loads file {str(f)!r}: records[{i}] has no field 'global_physical_count' (a "
                                 "per_pass dump is needed; per_token dumps are not read)")
            c = _as_tensor(rec["global_physical_count"], f, f"records[{i}].global_physical_count")
            if tuple(c.shape) != tuple(phy2log.shape):
                raise ValueError(f"loads file {str(f)!r}: field 'records[{i}].global_physical_count' has shape "
                                 f"{tuple(c.shape)} but 'last_physical_to_logical_map' {tuple(phy2log.shape)}")
            physical += c.double()
        num_experts = int(phy2log.max()) + 1
        logical = torch.zeros(phy2log.shape[0], num_experts, dtype=torch.float64)
        logical.scatter_add_(1, phy2log, physical)
        if total is not None and total.shape != logical.shape:
            raise ValueError(f"loads file {str(f)!r}: {tuple(logical.shape)} (layers, experts) but the other rank "
                             f"files give {tuple(total.shape)}")
        total = logical if total is None else total + logical
    assert total is not None, "at least one file was read"
    return total


def _trtllm(path: Path, iters: tuple[int, int] | None) -> tuple[torch.Tensor, tuple[int, ...]]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if not path.is_dir():
        raise ValueError(f"loads {str(path)!r} is a file; a TensorRT-LLM statistic is a folder (EXPERT_STATISTIC_PATH)")
    meta_path = path / "meta_info.json"
    try:
        meta = json.loads(read_text_file(meta_path, "loads file", MAX_DATA_TEXT_BYTES))
    except FileNotFoundError as exc:
        raise ValueError(str(exc)) from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"loads file {str(meta_path)!r} could not be read: {exc}") from exc
    num_experts = meta.get("num_experts") if isinstance(meta, dict) else None
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"loads file {str(meta_path)!r}: field 'num_experts' must be a positive integer, got "
                         f"{num_experts!r}")
    files = sorted(path.glob("rank*.safetensors"))
    if not files:
        raise ValueError(f"loads folder {str(path)!r} holds no rank*.safetensors files")
    counts: dict[tuple[int, int], torch.Tensor] = {}
    for f in files:
        try:
            tensors = load_file(str(f))
        except (SafetensorError, OSError) as exc:
            raise ValueError(f"loads file {str(f)!r} could not be read: {exc}") from exc
        for key, t in tensors.items():
            m = re.fullmatch(r"(\d+)_(\d+)", key)
            if not m:
                raise ValueError(f"loads file {str(f)!r}: tensor {key!r} is not named '{{iter}}_{{layer}}'")
            if tuple(t.shape) != (num_experts,):
                raise ValueError(f"loads file {str(f)!r}: tensor {key!r} has shape {tuple(t.shape)}, expected "
                                 f"({num_experts},) (meta_info.json's num_experts)")
            k = (int(m.group(1)), int(m.group(2)))
            counts[k] = counts[k] + t.double() if k in counts else t.double()
    all_iters = sorted({i for i, _ in counts})
    layers = tuple(sorted({layer for _, layer in counts}))
    lo, hi = iters if iters is not None else (all_iters[0], all_iters[-1] + 1)
    chosen = [i for i in all_iters if lo <= i < hi]
    if not chosen:
        raise ValueError(f"iters ({lo}-{hi}) selects none of the iterations recorded in {str(path)!r} "
                         f"({all_iters[0]}-{all_iters[-1] + 1})")
    rows = []
    for layer in layers:
        missing = [i for i in chosen if (i, layer) not in counts]
        if missing:
            raise ValueError(f"loads folder {str(path)!r}: tensor '{missing[0]}_{layer}' is missing (layer {layer} "
                             f"lacks {len(missing)} of the {len(chosen)} iterations selected)")
        rows.append(torch.stack([counts[(i, layer)] for i in chosen]).sum(0))
    return torch.stack(rows), layers


def _check_rows(load: torch.Tensor, path: Path, field: str, spec: MoESpec | None, config: str | None) -> None:
    if spec is None:
        return
    if load.shape != (spec.num_layers, spec.num_experts):
        raise ValueError(f"loads {str(path)!r}: field {field!r} covers {load.shape[0]} decoder layers x "
                         f"{load.shape[1]} experts, but config {config!r} has {spec.num_layers} decoder layers x "
                         f"{spec.num_experts} experts (a dump of another model?)")
    dense = [layer for layer in spec.dense_layers if load[layer].sum() > 0]
    if dense:
        raise ValueError(f"loads {str(path)!r}: field {field!r} counts tokens on decoder layer {dense[0]}, which "
                         f"config {config!r} says is dense (a dump of another model?)")


def read_load_dump(path: str | Path, fmt: str = "auto", *, spec: MoESpec | None = None,
                   iters: tuple[int, int] | None = None) -> LoadDump:
    """Read a load dump of any format in ``LOAD_FORMATS`` and keep its MoE layers.

    Rows of dumps that cover every decoder layer (SGLang) are cut to the MoE layers: those ``spec`` names,
    or without ``spec`` the rows that counted any token (dense layers count none). TensorRT-LLM rows keep
    their decoder layer indices; with ``spec`` they must be its MoE layers. epmoe files and the CSV have one
    row per MoE layer; with ``spec`` their count must match.

    Args:
        path: the file, or the folder (SGLang per-pass, TensorRT-LLM).
        fmt: one of ``LOAD_FORMATS``; ``auto`` detects it (``detect_load_format``).
        spec: the served model (``--config``): layer and expert counts are checked against it.
        iters: TensorRT-LLM iterations ``(a, b)``, ``a <= i < b``; default all recorded. Other formats refuse it.

    Returns:
        The ``LoadDump`` (validated loads: finite, non-negative).

    Raises:
        FileNotFoundError: no such file or folder.
        ValueError: an empty ``path``, an unknown format, a file that cannot be read (truncated ``.pt`` included), a
            missing or malformed field, or counts that do not fit ``spec`` (file and field named).
    """
    if not str(path):  # Path("") is "." (the working directory, read as a folder): say what was given
        raise ValueError("loads is empty; expected a loads file or folder")
    p = Path(path)
    if fmt not in LOAD_FORMATS:
        raise ValueError(f"loads_format must be one of {', '.join(LOAD_FORMATS)}, got {fmt!r}")
    if not p.exists():
        raise FileNotFoundError(f"loads {str(p)!r} does not exist")
    kind = detect_load_format(p) if fmt == "auto" else fmt
    if iters is not None and kind != "trtllm":
        raise ValueError(f"iters applies to TensorRT-LLM statistic folders, but {str(p)!r} is {kind}")
    config = spec.source if spec is not None else None
    num_decoder: int | None = None
    if kind in ("epmoe", "olmoe-csv"):
        if p.is_dir():
            raise ValueError(f"loads {str(p)!r} is a folder; {kind} loads are one file")
        if (kind == "olmoe-csv") != (p.suffix == ".csv"):
            raise ValueError(f"loads {str(p)!r}: loads_format {kind} needs " + (
                "a .csv file" if kind == "olmoe-csv" else "a .json or .safetensors file"))
        if kind == "olmoe-csv":  # read once: the loads and their layer names
            load, csv_names = read_csv_loads(p)
            names = tuple(csv_names)
        else:
            load = read_loads(p)
            names = tuple(str(i) for i in range(load.shape[0]))
        if spec is not None and load.shape != (spec.num_moe_layers, spec.num_experts):
            raise ValueError(f"loads {str(p)!r}: the loads cover {load.shape[0]} MoE layers x {load.shape[1]} "
                             f"experts, but config {config!r} has {spec.num_moe_layers} MoE layers x "
                             f"{spec.num_experts} experts (a dump of another model?)")
        layers = spec.moe_layers if spec is not None else tuple(range(load.shape[0]))
        if spec is not None:
            names = tuple(str(layer) for layer in layers)
        return LoadDump(load, tuple(layers), None, kind, names)
    if kind in ("sglang-stat", "sglang-per-pass"):
        full = _sglang_stat(p) if kind == "sglang-stat" else _sglang_per_pass(p)
        field = "logical_count" if kind == "sglang-stat" else "last_physical_to_logical_map"
        _check_rows(full, p, field, spec, config)
        try:  # every row, before the layers that count tokens are picked (a negative count is no token count)
            as_load_array(full, field)
        except ValueError as exc:
            raise ValueError(f"loads {str(p)!r}: {exc}") from exc
        num_decoder = full.shape[0]
        if spec is not None:
            layers = spec.moe_layers
        else:
            layers = tuple(int(i) for i in torch.nonzero((full != 0).any(1)).flatten())
            if not layers:
                raise ValueError(f"loads {str(p)!r}: field {field!r} counts no token on any layer")
        load = full[list(layers)]
    else:
        load, layers = _trtllm(p, iters)
        if spec is not None:
            if load.shape[1] != spec.num_experts or tuple(layers) != spec.moe_layers:
                raise ValueError(f"loads {str(p)!r}: the tensors cover decoder layers {layers[0]}..{layers[-1]} "
                                 f"({len(layers)}) x {load.shape[1]} experts, but config {config!r} has MoE layers "
                                 f"{spec.moe_layers[0]}..{spec.moe_layers[-1]} ({spec.num_moe_layers}) x "
                                 f"{spec.num_experts} experts (a dump of another model?)")
    try:
        arr = as_load_array(load, "load")
    except ValueError as exc:
        raise ValueError(f"loads {str(p)!r}: {exc}") from exc
    return LoadDump(torch.from_numpy(np.ascontiguousarray(arr)), tuple(int(v) for v in layers), num_decoder, kind,
                    tuple(str(v) for v in layers))
