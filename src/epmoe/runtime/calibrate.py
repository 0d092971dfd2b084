"""``epmoe calibrate``: measure collectives and the device, and write a hardware profile ``plan`` accepts.

Measures all-reduce and all-to-all time over the process group for buffer sizes from 8 B up to a
maximum (doubling), over gloo on CPU or NCCL on GPUs, plus device-memory bandwidth (a large copy)
and bf16 matmul throughput. Runs under ``torchrun`` (the group it starts) or spawns ``nprocs`` local
processes itself. Before the sweep a few untimed rounds of both collectives on the smallest buffer set up
the connections, and each size gets 2 untimed calls before its timed ones. Latency is the fastest of the
sizes up to 4 KiB (transfer time is negligible there, and one slow size, e.g. the first, does not set it);
bus bandwidth comes from the largest, with nccl-tests' factors (all-reduce ``2 (n-1)/n``, all-to-all
``(n-1)/n``).
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from epmoe.checks import check_int
from epmoe.files import atomic_path, check_output_path
from epmoe.plan.hardware import HARDWARE_FORMAT, LinkProfile, load_hardware, parse_hardware
from epmoe.runtime.launch import RankInfo, init_default_group, spawn

GPU_MAX_BYTES = 256 * 1024**2
CPU_MAX_BYTES = 4 * 1024**2
# Largest ``max_bytes`` accepted. At the planner's default batches (up to 256 sequences, up to 3 speculative
# tokens) over the model configs in data/configs, its largest dispatch/combine all-to-all is under 10 MiB,
# its largest all-reduce / reduce-scatter / all-gather of activations 14 MiB and its largest collective of
# all, the logits all-gather (Llama-4-Scout, 8 GPUs), 395 MiB; larger batches are priced from the bus
# bandwidth, which buffers far below 1 GiB already reach. Sizes double, so a bigger limit only adds minutes
# (or hours, or an allocation failure) for nothing.
MAX_BYTES_LIMIT = 1024**3
GLOO_MAX_NPROCS = 64  # also at most 4 x os.cpu_count(): each process is a full Python + torch interpreter
WARMUP_ROUNDS = 5  # untimed rounds of each collective on the smallest buffer before the sweep
GRAPH_REPS = 8  # collectives per captured CUDA graph when timing on CUDA
# Smallest ``max_bytes`` accepted: up to 256 KiB every size timed within 1.2x of the 8-byte latency on two
# H200s (NCCL, benchmarks/results/multigpu_h200x2.json), and a 4 KiB largest buffer gave a bus bandwidth of
# 18 MB/s on CPU (gloo).
MIN_MAX_BYTES = 2**20
MAX_ITERS = 1000  # timed repetitions per size, at most
LATENCY_MAX_BYTES = 4096  # latency: the fastest of the sizes up to this


@dataclass(frozen=True)
class CalibrationConfig:
    """What ``epmoe calibrate`` measures and where it writes.

    Attributes:
        out: path of the profile JSON to write.
        nprocs: local processes to spawn; ``None`` to use the group ``torchrun`` describes.
        backend: ``gloo`` or ``nccl``; ``None`` picks NCCL when CUDA is available, else gloo.
        max_bytes: largest buffer, bytes (default 256 MiB on GPU, 4 MiB on CPU; from ``MIN_MAX_BYTES``, 1 MiB,
            to ``MAX_BYTES_LIMIT``, 1 GiB).
        iters: timed repetitions per size (after 2 untimed warm-up calls).
        name: profile name written into the file (non-empty).
        base: a profile (name or path) supplying the link that was not measured (inter-node on one
            node, intra-node across nodes), the fp8 and w4a16 matmul figures and the MoE-layer model's fitted
            ``moe_layer_fixed_us``, ``moe_stream_matrix_overlap`` (0 without a base) and INT4 figures.
    """

    out: str
    nprocs: int | None = None
    backend: str | None = None
    max_bytes: int | None = None
    iters: int = 5
    name: str = "calibrated"
    base: str | None = None

    def __post_init__(self) -> None:
        if self.nprocs is not None:
            check_int("nprocs", self.nprocs, 2, wording=">= 2 (collectives need two ranks)")
        if self.backend not in (None, "gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {self.backend!r}")
        if self.max_bytes is not None:
            check_int("max_bytes", self.max_bytes, MIN_MAX_BYTES, wording=f">= {MIN_MAX_BYTES} (1 MiB: the bus "
                      "bandwidth is fitted on the largest buffer, and smaller ones measure only latency)")
        if self.max_bytes is not None and self.max_bytes > MAX_BYTES_LIMIT:
            raise ValueError(f"max_bytes must be <= {MAX_BYTES_LIMIT} (1 GiB, more than the planner's collectives "
                             f"need), got {self.max_bytes!r}")
        check_int("iters", self.iters, 1, wording=">= 1")
        if self.iters > MAX_ITERS:
            raise ValueError(f"iters must be at most {MAX_ITERS} (the median of that many is stable), got {self.iters}")
        if not isinstance(self.name, str) or not self.name.strip():
            raise ValueError(f"name must be a non-empty string, got {self.name!r}")

    def check_nprocs(self, backend: str) -> None:
        """Bound ``nprocs`` for ``backend``: at most the visible CUDA devices for ``nccl``; at most 64 and at
        most 4 x ``os.cpu_count()`` for ``gloo`` (each spawned process is a whole interpreter with torch).

        Raises:
            ValueError: ``nprocs`` above the bound (both named).
        """
        if self.nprocs is None:
            return
        if backend == "nccl":
            gpus = torch.cuda.device_count()
            if self.nprocs > gpus:
                raise ValueError(f"nprocs ({self.nprocs}) exceeds the {gpus} visible GPUs")
            return
        cpus = os.cpu_count() or 1
        limit = min(GLOO_MAX_NPROCS, 4 * cpus)
        if self.nprocs > limit:
            raise ValueError(f"nprocs ({self.nprocs}) exceeds {limit}, the most gloo processes on this machine "
                             f"(at most {GLOO_MAX_NPROCS}, and at most 4 x its {cpus} CPUs)")

    def resolved_backend(self) -> str:
        """The backend to use: as given, else ``nccl`` with CUDA and ``gloo`` without.

        Raises:
            ValueError: ``nccl`` asked for without CUDA.
        """
        backend = self.backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if backend == "nccl" and not torch.cuda.is_available():
            raise ValueError("backend 'nccl' needs CUDA, which is not available; use --backend gloo")
        return backend


def message_sizes(max_bytes: int, world_size: int) -> list[int]:
    """Buffer sizes from 8 B doubling to ``max_bytes``, each rounded up to a multiple of ``4 * world_size``
    (float32 elements, split evenly for all-to-all)."""
    unit = 4 * world_size
    sizes, s = [], 8
    while s <= max_bytes:
        sizes.append(-(-s // unit) * unit)
        s *= 2
    return sorted(set(sizes))


def _time_ms(fn, iters: int, device: torch.device, group) -> float:
    if device.type == "cuda":
        samples = _graph_samples_ms(fn, iters, device, group)
    else:
        for _ in range(2):
            fn()
        dist.barrier(group=group)
        samples = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
    t = torch.tensor([statistics.median(samples)], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)  # the slowest rank sets the pace
    return float(t.item())


def _graph_samples_ms(fn, iters: int, device: torch.device, group) -> list[float]:
    """Per-call ms of ``fn`` from ``iters`` replays of a CUDA graph of ``GRAPH_REPS`` calls (CUDA events)."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):  # NCCL's first calls on a stream are not capturable
        for _ in range(2):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    # thread_local: NCCL's watchdog thread may query events while this thread captures
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        for _ in range(GRAPH_REPS):
            fn()
    graph.replay()
    torch.cuda.synchronize(device)
    dist.barrier(group=group)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for start, end in events:
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize(device)
    return [start.elapsed_time(end) / GRAPH_REPS for start, end in events]


def measure_collectives(sizes: list[int], iters: int, device: torch.device, group=None) -> list[dict[str, float]]:
    """Median time (max over ranks) of one all-reduce and one all-to-all per buffer size.

    First ``WARMUP_ROUNDS`` untimed rounds of both on the smallest buffer; then, per size, 2 untimed
    calls of each before the ``iters`` timed ones. On CUDA a timed call is one of ``GRAPH_REPS``
    back-to-back collectives captured in a CUDA graph and replayed, timed with CUDA events: the device
    time a collective adds to a graph-replayed decode step, without the host's launch and sync time
    (which measured 2-3x the device time for small messages on two H200s and varied between runs).
    Elsewhere (gloo) it is wall-clock time per call.

    Args:
        sizes: buffer bytes per rank, multiples of ``4 * world_size``.
        iters: timed repetitions per size.
        device: where the buffers live (``cuda:i`` for NCCL, ``cpu`` for gloo).
        group: the process group (``None``: the default group).

    Returns:
        One ``{"bytes", "all_reduce_ms", "all_to_all_ms"}`` per size.
    """
    if sizes:  # connection set-up and first-call costs, untimed
        x = torch.ones(sizes[0] // 4, dtype=torch.float32, device=device)
        y = torch.empty_like(x)
        for _ in range(WARMUP_ROUNDS):
            dist.all_reduce(x, group=group)
            dist.all_to_all_single(y, x, group=group)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    rows = []
    for size in sizes:
        x = torch.ones(size // 4, dtype=torch.float32, device=device)
        y = torch.empty_like(x)
        ar = _time_ms(lambda: dist.all_reduce(x, group=group), iters, device, group)
        a2a = _time_ms(lambda: dist.all_to_all_single(y, x, group=group), iters, device, group)
        rows.append({"bytes": size, "all_reduce_ms": ar, "all_to_all_ms": a2a})
    return rows


def measure_device(device: torch.device) -> dict[str, float]:
    """Memory size (bytes), copy bandwidth (bytes/s, read + write) and bf16 matmul throughput (FLOP/s)."""
    if device.type == "cuda":
        memory = torch.cuda.get_device_properties(device).total_memory
        n_copy, n_mm = 512 * 1024**2, 8192
    else:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        n_copy, n_mm = 32 * 1024**2, 256
    src = torch.empty(n_copy // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    a = torch.randn(n_mm, n_mm, dtype=torch.bfloat16, device=device)
    b = torch.randn(n_mm, n_mm, dtype=torch.bfloat16, device=device)

    def best_s(fn) -> float:
        fn()
        times = []
        for _ in range(5):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - t0)
        return min(times)

    copy_s = best_s(lambda: dst.copy_(src))
    mm_s = best_s(lambda: a @ b)
    return {"memory_bytes": float(memory), "hbm_bytes_per_s": 2 * n_copy / copy_s,
            "bf16_flops_per_s": 2 * n_mm**3 / mm_s}


def fit_link(rows: list[dict[str, float]], key: str, factor: float) -> tuple[float, float]:
    """(latency µs, bus bandwidth bytes/s): latency the fastest size up to ``LATENCY_MAX_BYTES`` (the
    smallest size if none is that small), bandwidth from the largest buffer."""
    small = [r[key] for r in rows if r["bytes"] <= LATENCY_MAX_BYTES] or [rows[0][key]]
    lat_ms = min(small)
    big = rows[-1]
    transfer_ms = big[key] - lat_ms if big[key] > lat_ms else big[key]
    return lat_ms * 1e3, factor * big["bytes"] / (transfer_ms * 1e-3)


def _envelope(rows: list[dict[str, float]], key: str) -> list[list[float]]:
    """``[[bytes, ms], ...]`` with each time the least measured at that size or any larger one: a larger
    message never takes less time, so a slower small size is noise (a gloo run on a busy 2-core machine
    timed 512 B at 2.93 ms and 1 KiB at 0.28 ms)."""
    out: list[list[float]] = []
    best = math.inf
    for r in reversed(rows):
        best = min(best, r[key])
        out.append([r["bytes"], best])
    return out[::-1]


def _link_doc(link: LinkProfile) -> dict[str, Any]:
    return {"kind": link.kind, "all_reduce_latency_us": link.all_reduce_latency_us,
            "all_reduce_busbw_bytes_per_s": link.all_reduce_busbw_bytes_per_s,
            "all_to_all_latency_us": link.all_to_all_latency_us,
            "all_to_all_busbw_bytes_per_s": link.all_to_all_busbw_bytes_per_s,
            **({"all_reduce_ms_by_bytes": [list(p) for p in link.all_reduce_ms_by_bytes]}
               if link.all_reduce_ms_by_bytes else {}),
            **({"all_to_all_ms_by_bytes": [list(p) for p in link.all_to_all_ms_by_bytes]}
               if link.all_to_all_ms_by_bytes else {})}


def build_profile(rows: list[dict[str, float]], device_facts: dict[str, float], world_size: int, nodes: int,
                  backend: str, gpu: str, cfg: CalibrationConfig) -> dict[str, Any]:
    """The profile document from measurements (format ``epmoe.hardware/1``).

    Raises:
        ValueError: measured across nodes without a ``base`` for the intra-node link.
    """
    n = world_size
    ar_lat, ar_bw = fit_link(rows, "all_reduce_ms", 2 * (n - 1) / n)
    a2a_lat, a2a_bw = fit_link(rows, "all_to_all_ms", (n - 1) / n)
    link = {"kind": f"measured: {backend} over {n} ranks on {nodes} node(s)", "all_reduce_latency_us": ar_lat,
            "all_reduce_busbw_bytes_per_s": ar_bw, "all_to_all_latency_us": a2a_lat,
            "all_to_all_busbw_bytes_per_s": a2a_bw,
            "all_reduce_ms_by_bytes": _envelope(rows, "all_reduce_ms"),
            "all_to_all_ms_by_bytes": _envelope(rows, "all_to_all_ms")}
    base = load_hardware(cfg.base) if cfg.base else None
    if nodes > 1:
        if base is None:
            raise ValueError("calibrating across nodes measures the inter-node link only; pass --base NAME for the "
                             "intra-node one")
        links = {"intra_node": _link_doc(base.intra_node), "inter_node": link}
    else:
        links = {"intra_node": link}
        if base is not None and base.inter_node is not None:
            links["inter_node"] = _link_doc(base.inter_node)
    flops = {"bf16": device_facts["bf16_flops_per_s"]}
    for kind in ("fp8", "w4a16"):
        if base is not None and kind in base.matmul_flops_per_s:
            flops[kind] = base.matmul_flops_per_s[kind]
    sources = {
        "links": f"measured by `epmoe calibrate` ({backend}, {n} ranks, sizes {rows[0]['bytes']}..{rows[-1]['bytes']} "
                 "B, "
                 f"median of {cfg.iters}, max over ranks); the *_ms_by_bytes curves are the non-decreasing envelope of "
                 "the "
                 f"measurements (each time the least at that size or a larger one); latency = fastest size up to "
                 f"{LATENCY_MAX_BYTES} B, bandwidth = largest (used beyond the curves)",
        "hbm_bytes_per_s": "measured: best of 5 device-to-device copies, read + write bytes",
        "matmul_flops_per_s": "measured: best of 5 bf16 matmuls"
                              + "".join(f"; {k} copied from {base.name}" for k in ("fp8", "w4a16") if k in flops),
    }
    if base is not None:
        sources["base"] = (f"links not measured here, moe_layer_fixed_us, moe_stream_matrix_overlap, "
                           f"dispatch_layout_fixed_us, the moe_w4a16_* and moe_mxfp4_* figures and "
                           f"mla_decode_read_efficiency copied from {base.path}")
    doc = {
        "format": HARDWARE_FORMAT, "name": cfg.name,
        "description": f"calibrated on {nodes} node(s) x {world_size // nodes} {gpu}",
        "gpu": gpu, "gpus_per_node": world_size // nodes, "memory_bytes": int(device_facts["memory_bytes"]),
        "hbm_bytes_per_s": device_facts["hbm_bytes_per_s"], "matmul_flops_per_s": flops,
        "moe_layer_fixed_us": base.moe_layer_fixed_us if base else 0.0,
        "moe_stream_matrix_overlap": base.moe_stream_matrix_overlap if base else 0.0,
        "dispatch_layout_fixed_us": base.dispatch_layout_fixed_us if base else 0.0,
        **({"moe_w4a16_layer_fixed_us": base.moe_w4a16_layer_fixed_us}
           if base is not None and base.moe_w4a16_layer_fixed_us is not None else {}),
        "moe_w4a16_stream_efficiency": base.moe_w4a16_stream_efficiency if base else 1.0,
        **{k: getattr(base, k) for k in ("moe_mxfp4_layer_fixed_us", "moe_mxfp4_stream_efficiency")
           if base is not None and getattr(base, k) is not None},
        "mla_decode_read_efficiency": base.mla_decode_read_efficiency if base else 1.0,
        "links": links, "sources": sources, "measurements": rows,
    }
    parse_hardware(doc, cfg.out)  # what we write must load
    return doc


def _measure_and_write(cfg: CalibrationConfig, backend: str, group: dist.ProcessGroup) -> dict[str, Any] | None:
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count())))
        torch.cuda.set_device(device)
        gpu = torch.cuda.get_device_name(device)
    else:
        device, gpu = torch.device("cpu"), "CPU"
    max_bytes = cfg.max_bytes or (GPU_MAX_BYTES if device.type == "cuda" else CPU_MAX_BYTES)
    rows = measure_collectives(message_sizes(max_bytes, world), cfg.iters, device, group)
    facts = measure_device(device)
    if rank != 0:
        return None
    doc = build_profile(rows, facts, world, max(1, world // local_world), backend, gpu, cfg)
    with atomic_path(cfg.out) as tmp:
        tmp.write_text(json.dumps(doc, indent=2))
    return doc


def _spawned_rank(info: RankInfo, cfg: CalibrationConfig, backend: str) -> None:
    """One rank spawned by ``launch.spawn``: join the group, measure, and (rank 0) write the profile."""
    os.environ["LOCAL_WORLD_SIZE"] = str(info.world_size)
    os.environ["LOCAL_RANK"] = str(info.local_rank)
    init_default_group(info, backend)
    try:
        _measure_and_write(cfg, backend, dist.group.WORLD)
    finally:
        dist.destroy_process_group()


def check_outputs(cfg: CalibrationConfig) -> None:
    """What can be checked before measuring: ``base`` names a readable profile and ``out`` can be written
    (its directory exists, it is not a directory itself).

    Raises:
        ValueError: a bad ``base`` or ``out`` (the value and the reason named).
    """
    if cfg.base is not None:
        try:
            load_hardware(cfg.base)
        except ValueError as exc:
            raise ValueError(f"base ({cfg.base!r}) is not a usable profile: {exc}") from None
    check_output_path("out", cfg.out, "the path of the profile JSON to write")


def calibrate(cfg: CalibrationConfig) -> dict[str, Any] | None:
    """Measure and write the profile ``cfg.out``.

    With ``cfg.nprocs``, spawns that many local processes; otherwise joins the process group that
    ``torchrun`` describes (``RANK``/``WORLD_SIZE`` in the environment), starting it if needed.

    Returns:
        The profile document on rank 0 (and in the parent of spawned processes); ``None`` on other ranks.

    Raises:
        ValueError: a ``base`` that is no profile or an ``out`` that cannot be written (checked before
            measuring), neither ``nprocs`` nor a torchrun environment, ``nccl`` without CUDA, ``nprocs`` above
            its bound (``CalibrationConfig.check_nprocs``: the visible GPUs under NCCL, 64 and 4 x the CPUs
            under gloo), or a multi-node run without ``base``.
    """
    check_outputs(cfg)
    backend = cfg.resolved_backend()
    if cfg.nprocs is not None:
        cfg.check_nprocs(backend)
        spawn(_spawned_rank, cfg.nprocs, (cfg, backend))
        return json.loads(Path(cfg.out).read_text())
    if not dist.is_initialized():
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            raise ValueError("no process group: run under torchrun, or pass --nprocs N to spawn N local processes")
        dist.init_process_group(backend)
    group = dist.group.WORLD
    if dist.get_world_size(group) < 2:
        raise ValueError(f"the process group has {dist.get_world_size(group)} rank; collectives need at least 2")
    return _measure_and_write(cfg, backend, group)
