"""Hardware profiles: what one GPU and its links can do, read from JSON data files on demand.

A profile is a file ``<name>.json`` in this package (shipped: ``h200-sxm``, ``h100-sxm``,
``rtx-pro-6000``) or any path written by ``epmoe calibrate``. Every figure carries its unit in its
name (``_bytes``, ``_bytes_per_s``, ``_flops_per_s``, ``_us``) and every file names its sources.
Nothing is cached at module level: each call reads the file again.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

HARDWARE_FORMAT = "epmoe.hardware/1"
_LINK_FIELDS = (
    "all_reduce_latency_us",
    "all_reduce_busbw_bytes_per_s",
    "all_to_all_latency_us",
    "all_to_all_busbw_bytes_per_s",
)


@dataclass(frozen=True)
class LinkProfile:
    """Collective cost figures of one kind of link (NCCL's bus-bandwidth convention).

    Attributes:
        kind: what the link is, in words.
        all_reduce_latency_us: time of a tiny (8 B) all-reduce, µs; also used for reduce-scatter and all-gather.
        all_reduce_busbw_bytes_per_s: all-reduce bus bandwidth, bytes/s; an all-reduce of ``M`` bytes
            over ``n`` ranks takes ``2 (n-1)/n * M / busbw``.
        all_to_all_latency_us: time of a tiny all-to-all, µs.
        all_to_all_busbw_bytes_per_s: all-to-all bus bandwidth, bytes/s: bytes each rank sends to
            other ranks divided by the time.
    """

    kind: str
    all_reduce_latency_us: float
    all_reduce_busbw_bytes_per_s: float
    all_to_all_latency_us: float
    all_to_all_busbw_bytes_per_s: float


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
        matmul_flops_per_s: achievable dense matrix throughput by compute dtype (``bf16``, ``fp8``), FLOP/s.
        moe_layer_fixed_us: fixed cost of one MoE layer's expert compute (routing, permutation, launch), µs.
        moe_stream_matrix_overlap: the share, in ``[0, 1]``, of the shorter of an MoE layer's memory
            streaming and matrix work that the expert kernels hide under the longer one (0: the two add
            up; 1: a ``max`` roofline; ``costs.expert_layer_ms``). Absent from a file: 0.0.
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

    def flops_per_s(self, dtype: str) -> float:
        """Achievable matrix throughput for compute dtype ``dtype`` (falls back to ``bf16``), FLOP/s."""
        return self.matmul_flops_per_s.get(dtype, self.matmul_flops_per_s["bf16"])


def hardware_names() -> list[str]:
    """Names of the shipped profiles, sorted."""
    return sorted(p.name[: -len(".json")] for p in resources.files(__name__).iterdir() if p.name.endswith(".json"))


def _positive_number(doc: dict[str, Any], key: str, where: str) -> float:
    value = doc.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(f"{where}: field {key!r} must be a positive number, got {value!r}")
    return float(value)


def _link(doc: Any, where: str) -> LinkProfile:
    if not isinstance(doc, dict):
        raise ValueError(f"{where}: expected an object with {', '.join(_LINK_FIELDS)}, got {doc!r}")
    values = {k: _positive_number(doc, k, where) for k in _LINK_FIELDS}
    return LinkProfile(kind=str(doc.get("kind", "")), **values)


def parse_hardware(doc: dict[str, Any], source: str = "<dict>") -> HardwareProfile:
    """Validate a profile JSON object.

    Raises:
        ValueError: wrong ``format``, a missing or non-positive figure, no ``bf16`` matmul figure, no
            ``links.intra_node``, or a ``moe_stream_matrix_overlap`` that is not a number in ``[0, 1]``
            (the field and value are named).
    """
    if not isinstance(doc, dict):
        raise ValueError(f"{source}: expected a JSON object, got {type(doc).__name__}")
    if doc.get("format") != HARDWARE_FORMAT:
        raise ValueError(f"{source}: field 'format' must be {HARDWARE_FORMAT!r}, got {doc.get('format')!r}")
    flops = doc.get("matmul_flops_per_s")
    if not isinstance(flops, dict) or "bf16" not in flops:
        raise ValueError(f"{source}: field 'matmul_flops_per_s' must map dtypes to FLOP/s and hold 'bf16', got {flops!r}")
    flops = {k: _positive_number(flops, k, f"{source}: matmul_flops_per_s") for k in flops}
    links = doc.get("links")
    if not isinstance(links, dict) or "intra_node" not in links:
        raise ValueError(f"{source}: field 'links' must hold 'intra_node', got {links!r}")
    gpn = doc.get("gpus_per_node")
    if isinstance(gpn, bool) or not isinstance(gpn, int) or gpn <= 0:
        raise ValueError(f"{source}: field 'gpus_per_node' must be a positive integer, got {gpn!r}")
    fixed = doc.get("moe_layer_fixed_us", 0.0)
    if isinstance(fixed, bool) or not isinstance(fixed, (int, float)) or fixed < 0:
        raise ValueError(f"{source}: field 'moe_layer_fixed_us' must be a non-negative number, got {fixed!r}")
    overlap = doc.get("moe_stream_matrix_overlap", 0.0)
    if isinstance(overlap, bool) or not isinstance(overlap, (int, float)) or not 0.0 <= overlap <= 1.0:
        raise ValueError(f"{source}: field 'moe_stream_matrix_overlap' must be a number in [0, 1], got {overlap!r}")
    return HardwareProfile(
        name=str(doc.get("name") or Path(source).stem),
        description=str(doc.get("description", "")),
        gpu=str(doc.get("gpu", "")),
        gpus_per_node=gpn,
        memory_bytes=int(_positive_number(doc, "memory_bytes", source)),
        hbm_bytes_per_s=_positive_number(doc, "hbm_bytes_per_s", source),
        matmul_flops_per_s=flops,
        moe_layer_fixed_us=float(fixed),
        moe_stream_matrix_overlap=float(overlap),
        intra_node=_link(links["intra_node"], f"{source}: links.intra_node"),
        inter_node=_link(links["inter_node"], f"{source}: links.inter_node") if links.get("inter_node") else None,
        sources={str(k): str(v) for k, v in (doc.get("sources") or {}).items()},
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
    if text.endswith(".json") or path.is_file():
        if not path.is_file():
            raise ValueError(f"hardware profile file {text!r} does not exist")
        source, raw = str(path), path.read_text()
    else:
        names = hardware_names()
        if text not in names:
            raise ValueError(f"hardware {text!r} is not known; shipped profiles: {', '.join(names)} (or a profile JSON path)")
        res = resources.files(__name__).joinpath(f"{text}.json")
        source, raw = f"epmoe/hardware/{text}.json", res.read_text()
    try:
        doc = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{source}: not valid JSON ({exc})") from exc
    return parse_hardware(doc, source)
