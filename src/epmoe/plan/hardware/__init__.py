"""Hardware profiles: what one GPU and its links can do, read from JSON data files on demand.

A profile is a file ``<name>.json`` in this package (shipped: ``h200-sxm``, ``h100-sxm``,
``rtx-pro-6000``) or any path written by ``epmoe calibrate``. Every figure carries its unit in its
name (``_bytes``, ``_bytes_per_s``, ``_flops_per_s``, ``_us``) and every file names its sources.
Nothing is cached at module level: each call reads the file again.
"""

from __future__ import annotations

import difflib
import json
import math
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from epmoe.checks import check_positive_int, read_text_file

HARDWARE_FORMAT = "epmoe.hardware/1"
_LINK_FIELDS = (
    "all_reduce_latency_us",
    "all_reduce_busbw_bytes_per_s",
    "all_to_all_latency_us",
    "all_to_all_busbw_bytes_per_s",
)
# Every key a profile may hold (shipped profiles and what ``epmoe calibrate`` writes); any other is refused
# as a likely misspelling rather than silently ignored.
_TOP_FIELDS = (
    "format", "name", "description", "gpu", "gpus_per_node", "memory_bytes", "hbm_bytes_per_s",
    "matmul_flops_per_s", "moe_layer_fixed_us", "moe_stream_matrix_overlap", "dispatch_layout_fixed_us", "links",
    "engine_step_us", "engine_layer_step_us", "engine_seq_step_us", "engine_prefill_layer_us",
    "moe_w4a16_layer_fixed_us", "moe_w4a16_stream_efficiency", "moe_mxfp4_layer_fixed_us",
    "moe_mxfp4_stream_efficiency",
    "moe_w8a16_layer_fixed_us", "moe_w8a16_stream_efficiency", "mla_decode_read_efficiency", "sources", "measurements",
)
_LINK_KINDS = ("intra_node", "inter_node")
_LINK_CURVES = ("all_reduce_ms_by_bytes", "all_to_all_ms_by_bytes")
_LINK_KEYS = ("kind", *_LINK_FIELDS, *_LINK_CURVES)
# The compute dtypes ``costs.compute_dtype`` asks for.
_MATMUL_DTYPES = ("bf16", "fp8", "w4a16", "w8a16")



@dataclass(frozen=True)
class LinkProfile:
    """Collective cost figures of one kind of link (NCCL's bus-bandwidth convention).

    Attributes:
        kind: what the link is, in words.
        all_reduce_latency_us: time of a tiny all-reduce (the fastest size up to 4 KiB for a calibrated
            profile), µs; also used for reduce-scatter and all-gather.
        all_reduce_busbw_bytes_per_s: all-reduce bus bandwidth, bytes/s; an all-reduce of ``M`` bytes
            over ``n`` ranks takes ``2 (n-1)/n * M / busbw``.
        all_to_all_latency_us: time of a tiny all-to-all, µs.
        all_to_all_busbw_bytes_per_s: all-to-all bus bandwidth, bytes/s: bytes each rank sends to
            other ranks divided by the time.
        all_reduce_ms_by_bytes: measured ``(buffer bytes per rank, ms)`` points of one all-reduce, bytes
            increasing (written by ``epmoe calibrate``); when present ``costs.collective_ms`` interpolates
            them instead of the latency + bandwidth line. Empty for datasheet profiles.
        all_to_all_ms_by_bytes: the same for one all-to-all (buffer bytes per rank, self block included).
    """

    kind: str
    all_reduce_latency_us: float
    all_reduce_busbw_bytes_per_s: float
    all_to_all_latency_us: float
    all_to_all_busbw_bytes_per_s: float
    all_reduce_ms_by_bytes: tuple[tuple[float, float], ...] = ()
    all_to_all_ms_by_bytes: tuple[tuple[float, float], ...] = ()


@dataclass(frozen=True)
class HardwareProfile:
    """One GPU model and the links between GPUs of one node and between nodes.

    Attributes:
        name: profile name (the file stem for shipped profiles).
        description: the machine, in words.
        gpu: GPU model.
        gpus_per_node: GPUs in one node.
        memory_bytes: device memory of one GPU, bytes.
        hbm_bytes_per_s: achievable device-memory bandwidth, bytes/s.
        matmul_flops_per_s: achievable dense matrix throughput by compute dtype (``bf16``, ``fp8``; ``w4a16``: the
            INT4 expert kernels' own rate, bf16 products of weights widened in registers; ``w8a16``: the block-FP8
            expert kernels' own rate, the same for FP8 weights), FLOP/s.
        moe_layer_fixed_us: fixed cost of one MoE layer's expert compute (routing, permutation, launch), µs.
        dispatch_layout_fixed_us: fixed cost of the send-buffer layout kernels of one expert-parallel
            dispatch + combine (route, pack, unpack, combine sum), µs; their memory traffic is priced on
            ``hbm_bytes_per_s`` (``costs.dispatch_layout_ms``). Absent from a file: 0.0.
        moe_stream_matrix_overlap: the share, in ``[0, 1]``, of the shorter of an MoE layer's memory
            streaming and matrix work that the expert kernels hide under the longer one (0: the two add
            up; 1: a ``max`` roofline; ``costs.expert_layer_ms``). Absent from a file: 0.0.
        engine_step_us, engine_layer_step_us, engine_seq_step_us: what one decode step of epmoe's engine
            costs beyond the rooflines, µs: fixed per step (graph launch, sampling, scheduling), per decoder
            layer (its small kernels inside the graph) and per sequence a rank serves (host work). Absent
            from a file: 0.0 (a step at the rooflines).
        engine_prefill_layer_us: what one decoder layer of a prompt's prefill (its first forward, the TTFT) costs
            beyond the rooflines, µs (the engine's piecewise graphs and the eager attention between them, the
            kernels' distance from their rooflines at prefill sizes); absent from a file: 0.0.
        moe_w4a16_layer_fixed_us: ``moe_layer_fixed_us`` of a layer of INT4 (W4A16) experts, µs; absent from a
            file: ``None``, the bf16 figure.
        moe_w4a16_stream_efficiency: the share, in ``(0, 1]``, of ``hbm_bytes_per_s`` at which the INT4 expert
            kernels stream their weights; absent from a file: 1.0.
        moe_mxfp4_layer_fixed_us, moe_mxfp4_stream_efficiency: the same two figures for a layer of MXFP4 experts,
            whose kernels (the same W4A16 kernels with tiles and widening of their own) may stream at another
            share; absent from a file: ``None``, the ``moe_w4a16_*`` figure.
        moe_w8a16_layer_fixed_us, moe_w8a16_stream_efficiency: the same two figures for a layer of block-FP8
            experts (served as stored).
        mla_decode_read_efficiency: the share, in ``(0, 1]``, of ``hbm_bytes_per_s`` at which the engine's MLA
            decode kernel reads its latent cache, each row once per block of query heads
            (``costs.kv_read_passes``); absent from a file: 1.0.
        intra_node: collectives among GPUs of one node.
        inter_node: collectives across nodes; ``None`` when the profile describes a single node.
        sources: where each figure comes from (field name -> text).
        path: the file it was read from.
    """

    name: str
    description: str
    gpu: str
    gpus_per_node: int
    memory_bytes: int
    hbm_bytes_per_s: float
    matmul_flops_per_s: dict[str, float]
    moe_layer_fixed_us: float
    intra_node: LinkProfile
    inter_node: LinkProfile | None
    sources: dict[str, str]
    path: str
    moe_stream_matrix_overlap: float = 0.0
    dispatch_layout_fixed_us: float = 0.0
    engine_step_us: float = 0.0
    engine_layer_step_us: float = 0.0
    engine_seq_step_us: float = 0.0
    engine_prefill_layer_us: float = 0.0
    moe_w4a16_layer_fixed_us: float | None = None
    moe_w4a16_stream_efficiency: float = 1.0
    moe_mxfp4_layer_fixed_us: float | None = None
    moe_mxfp4_stream_efficiency: float | None = None
    moe_w8a16_layer_fixed_us: float | None = None
    moe_w8a16_stream_efficiency: float = 1.0
    mla_decode_read_efficiency: float = 1.0

    def flops_per_s(self, dtype: str) -> float:
        """Achievable matrix throughput for compute dtype ``dtype`` (falls back to ``bf16``), FLOP/s."""
        return self.matmul_flops_per_s.get(dtype, self.matmul_flops_per_s["bf16"])

    def quantized_expert_figures(self, kind: str, mxfp4: bool = False) -> tuple[float, float]:
        """``(stream efficiency, fixed us a layer)`` of the quantized expert kernels of compute dtype ``kind``
        (``w4a16`` or ``w8a16``): the ``moe_{kind}_*`` figures, for MXFP4 experts (``mxfp4``) the ``moe_mxfp4_*`` ones
        where the profile has them, and the bf16 ``moe_layer_fixed_us`` where it has no fixed cost of the kind."""
        efficiency = getattr(self, f"moe_{kind}_stream_efficiency")
        fixed = getattr(self, f"moe_{kind}_layer_fixed_us")
        if mxfp4:
            efficiency = efficiency if self.moe_mxfp4_stream_efficiency is None else self.moe_mxfp4_stream_efficiency
            fixed = fixed if self.moe_mxfp4_layer_fixed_us is None else self.moe_mxfp4_layer_fixed_us
        return efficiency, self.moe_layer_fixed_us if fixed is None else fixed


def hardware_names() -> list[str]:
    """Names of the shipped profiles, sorted."""
    return sorted(p.name[: -len(".json")] for p in resources.files(__name__).iterdir() if p.name.endswith(".json"))


def _check_keys(doc: dict[str, Any], known: tuple[str, ...], source: str, where: str = "") -> None:
    """Refuse a key of ``doc`` not in ``known`` (``where``: the dotted path of ``doc``, ``""`` at the top)."""
    for key in doc:
        if key not in known:
            field = f"{where}.{key}" if where else str(key)
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            of = f" of {where}" if where else ""
            raise ValueError(f"{source}: unknown field {field!r}{hint}; known fields{of}: {', '.join(known)}")


def _number(doc: dict[str, Any], key: str, source: str, where: str = "", *, strict: bool = True,
            default: float | None = None) -> float:
    """``doc[key]`` as a float: a finite number (not a bool), ``> 0`` (``strict``) or ``>= 0``.

    ``default`` is used when the key is absent; ``None`` makes the key required.
    """
    field = f"{where}.{key}" if where else key
    if key not in doc:
        if default is None:
            raise ValueError(f"{source}: field {field!r} is missing")
        return default
    value = doc[key]
    try:
        number = float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan
    except OverflowError:  # an integer too large for a float
        number = math.inf
    if not math.isfinite(number) or number < 0 or (strict and number == 0):
        bound = "> 0" if strict else ">= 0"
        raise ValueError(f"{source}: field {field!r} must be a finite number {bound}, got {value!r}")
    return number


def _share(doc: dict[str, Any], key: str, source: str) -> float:
    """Field ``key`` of ``doc``, a number in ``(0, 1]`` (1.0 when absent)."""
    v = doc.get(key, 1.0)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 < v <= 1.0:
        raise ValueError(f"{source}: field {key!r} must be a number in (0, 1], got {v!r}")
    return float(v)


def _text(doc: dict[str, Any], key: str, source: str, where: str = "") -> str:
    value = doc.get(key)
    if value is None:
        return ""
    if not isinstance(value, str):
        field = f"{where}.{key}" if where else key
        raise ValueError(f"{source}: field {field!r} must be a string, got {value!r}")
    return value


def _link(doc: Any, source: str, where: str) -> LinkProfile:
    if not isinstance(doc, dict):
        raise ValueError(f"{source}: field {where!r} must be an object with {', '.join(_LINK_FIELDS)}, got {doc!r}")
    _check_keys(doc, _LINK_KEYS, source, where)
    values = {k: _number(doc, k, source, where, strict=not k.endswith("_latency_us")) for k in _LINK_FIELDS}
    curves = {k: _curve(doc.get(k, []), source, f"{where}.{k}") for k in _LINK_CURVES}
    return LinkProfile(kind=_text(doc, "kind", source, where), **values, **curves)


def _finite(value: Any) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:  # an integer too large for a float
        return False


def _curve(points: Any, source: str, field: str) -> tuple[tuple[float, float], ...]:
    """``[[bytes, ms], ...]``: bytes > 0 strictly increasing, finite ms >= 0 never decreasing (a larger
    message never takes less time; ``epmoe calibrate`` writes the envelope of its measurements)."""
    out: list[tuple[float, float]] = []
    if not isinstance(points, list):
        raise ValueError(f"{source}: field {field!r} must be a list of [bytes, ms] pairs, got {points!r}")
    for i, point in enumerate(points):
        ok = isinstance(point, list) and len(point) == 2 and all(_finite(v) for v in point)
        if (not ok or point[0] <= 0 or point[1] < 0
                or (out and (float(point[0]) <= out[-1][0] or float(point[1]) < out[-1][1]))):
            raise ValueError(f"{source}: field {field!r} item {i} must be [bytes > 0, ms >= 0] with bytes increasing "
                             f"and ms not decreasing, got {point!r}")
        out.append((float(point[0]), float(point[1])))
    return tuple(out)


_REQUIRED_FIELDS = ("format", "gpus_per_node", "memory_bytes", "hbm_bytes_per_s", "matmul_flops_per_s", "links")


def _missing_fields(doc: dict[str, Any]) -> list[str]:
    """The required fields ``doc`` lacks, by their path: all of them, so that one message names every gap of an
    incomplete profile (a ``null`` is a bad value, named where the field is read)."""
    missing = [k for k in _REQUIRED_FIELDS if k not in doc]
    flops, links = doc.get("matmul_flops_per_s"), doc.get("links")
    if isinstance(flops, dict) and "bf16" not in flops:
        missing.append("matmul_flops_per_s.bf16")
    if isinstance(links, dict):
        if "intra_node" not in links:
            missing.append("links.intra_node")
        for kind in _LINK_KINDS:
            if isinstance(links.get(kind), dict):
                missing += [f"links.{kind}.{k}" for k in _LINK_FIELDS if k not in links[kind]]
    return missing


def parse_hardware(doc: dict[str, Any], source: str = "<dict>") -> HardwareProfile:
    """Validate a profile JSON object; every check of a profile is made here.

    Every numeric field must be a finite number (not a bool; JSON's ``NaN`` and ``Infinity`` are refused):
    bandwidths, rates and ``memory_bytes`` ``> 0``, latencies and ``moe_layer_fixed_us`` ``>= 0``,
    ``moe_stream_matrix_overlap`` in ``[0, 1]`` and ``gpus_per_node`` a positive integer. Keys other than
    the known ones (at the top, in ``links``, ``links.<kind>`` and ``matmul_flops_per_s``) are refused
    as misspellings; ``sources`` is free-form (field name -> text) and ``measurements`` (written by
    ``epmoe calibrate``) is kept in the file but not read.

    Raises:
        ValueError: wrong ``format``, an unknown key, a missing, non-finite or out-of-range figure, no
            ``bf16`` matmul figure, no ``links.intra_node``, or a ``sources`` that is not an object of
            strings; the message names ``source``, the field and the value.
    """
    if not isinstance(doc, dict):
        raise ValueError(f"{source}: expected a JSON object, got {type(doc).__name__}")
    missing = _missing_fields(doc)
    if missing:
        names = ", ".join(map(repr, missing))
        raise ValueError(f"{source}: field {names} is missing" if len(missing) == 1
                         else f"{source}: fields {names} are missing (an incomplete profile)")
    if doc.get("format") != HARDWARE_FORMAT:
        raise ValueError(f"{source}: field 'format' must be {HARDWARE_FORMAT!r}, got {doc.get('format')!r}")
    _check_keys(doc, _TOP_FIELDS, source)
    flops = doc.get("matmul_flops_per_s")
    if not isinstance(flops, dict) or "bf16" not in flops:
        raise ValueError(f"{source}: field 'matmul_flops_per_s' must map dtypes to FLOP/s and hold 'bf16', got "
                         f"{flops!r}")
    _check_keys(flops, _MATMUL_DTYPES, source, "matmul_flops_per_s")
    flops = {k: _number(flops, k, source, "matmul_flops_per_s") for k in flops}
    links = doc.get("links")
    if not isinstance(links, dict) or "intra_node" not in links:
        raise ValueError(f"{source}: field 'links' must hold 'intra_node', got {links!r}")
    _check_keys(links, _LINK_KINDS, source, "links")
    gpn = doc.get("gpus_per_node")
    check_positive_int(f"{source}: field 'gpus_per_node'", gpn)
    overlap = doc.get("moe_stream_matrix_overlap", 0.0)
    if isinstance(overlap, bool) or not isinstance(overlap, (int, float)) or not 0.0 <= overlap <= 1.0:
        raise ValueError(f"{source}: field 'moe_stream_matrix_overlap' must be a number in [0, 1], got {overlap!r}")
    efficiency, fp8_efficiency, mla_efficiency = (_share(doc, f, source) for f in (
        "moe_w4a16_stream_efficiency", "moe_w8a16_stream_efficiency", "mla_decode_read_efficiency"))
    sources = doc.get("sources") or {}
    if not isinstance(sources, dict) or not all(isinstance(v, str) for v in sources.values()):
        raise ValueError(f"{source}: field 'sources' must be an object of strings (field name -> text), got "
                         f"{sources!r}")
    measurements = doc.get("measurements", [])
    if not isinstance(measurements, list):
        raise ValueError(f"{source}: field 'measurements' must be a list, got {measurements!r}")
    return HardwareProfile(
        name=_text(doc, "name", source) or Path(source).stem,
        description=_text(doc, "description", source),
        gpu=_text(doc, "gpu", source),
        gpus_per_node=gpn,
        memory_bytes=int(_number(doc, "memory_bytes", source)),
        hbm_bytes_per_s=_number(doc, "hbm_bytes_per_s", source),
        matmul_flops_per_s=flops,
        moe_layer_fixed_us=_number(doc, "moe_layer_fixed_us", source, strict=False, default=0.0),
        moe_stream_matrix_overlap=float(overlap),
        dispatch_layout_fixed_us=_number(doc, "dispatch_layout_fixed_us", source, strict=False, default=0.0),
        engine_step_us=_number(doc, "engine_step_us", source, strict=False, default=0.0),
        engine_layer_step_us=_number(doc, "engine_layer_step_us", source, strict=False, default=0.0),
        engine_seq_step_us=_number(doc, "engine_seq_step_us", source, strict=False, default=0.0),
        engine_prefill_layer_us=_number(doc, "engine_prefill_layer_us", source, strict=False, default=0.0),
        moe_w4a16_layer_fixed_us=(_number(doc, "moe_w4a16_layer_fixed_us", source, strict=False)
                                  if "moe_w4a16_layer_fixed_us" in doc else None),
        moe_w4a16_stream_efficiency=efficiency,
        moe_mxfp4_layer_fixed_us=(_number(doc, "moe_mxfp4_layer_fixed_us", source, strict=False)
                                  if "moe_mxfp4_layer_fixed_us" in doc else None),
        moe_mxfp4_stream_efficiency=(_share(doc, "moe_mxfp4_stream_efficiency", source)
                                     if "moe_mxfp4_stream_efficiency" in doc else None),
        moe_w8a16_layer_fixed_us=(_number(doc, "moe_w8a16_layer_fixed_us", source, strict=False)
                                  if "moe_w8a16_layer_fixed_us" in doc else None),
        moe_w8a16_stream_efficiency=fp8_efficiency,
        mla_decode_read_efficiency=mla_efficiency,
        intra_node=_link(links["intra_node"], source, "links.intra_node"),
        inter_node=_link(links["inter_node"], source, "links.inter_node") if links.get("inter_node") else None,
        sources=dict(sources),
        path=source,
    )


def load_hardware(name_or_path: str | Path) -> HardwareProfile:
    """Read a hardware profile by shipped name (``h200-sxm``) or by the path of a JSON file.

    Raises:
        ValueError: an unknown name (the shipped names are listed), a file that is not JSON, or an
            invalid profile.
    """
    text = str(name_or_path)
    path = Path(text)
    # a path: a .json name, a file, or anything else there that is no shipped name (a directory is named as such)
    if text.endswith(".json") or path.is_file() or (path.exists() and text not in hardware_names()):
        try:
            source, raw = str(path), read_text_file(path, "hardware profile file")
        except FileNotFoundError as exc:
            raise ValueError(str(exc)) from None
    else:
        names = hardware_names()
        if text not in names:
            raise ValueError(f"hardware {text!r} is not known; shipped profiles: {', '.join(names)} (or a profile JSON "
                             "path)")
        res = resources.files(__name__).joinpath(f"{text}.json")
        source, raw = f"epmoe/plan/hardware/{text}.json", res.read_text()
    try:
        doc = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{source}: not valid JSON ({exc})") from exc
    return parse_hardware(doc, source)
