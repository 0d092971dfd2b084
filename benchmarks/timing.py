"""The timing and error helpers every benchmark shares (imported as ``timing`` by the scripts in this folder).

- ``rel_err``: ``‖out − ref‖ / ‖ref‖`` in float64.
- ``capture``: warm-up on a side stream, then ``reps`` calls captured in one CUDA graph.
- ``graph_us``: per-call device time from replays of one graph holding several calls.
- ``time_fn`` / ``time_in_model``: median ms per call after evicting L2, eager or as graph replays, alone or
  as one layer of a graph of several.
"""

from __future__ import annotations

import re
import statistics
from typing import Any, Callable

import torch


def gpu_file_name(device_name: str) -> str:
    """A GPU's name as a result file's suffix: lower case, each run of other characters than letters, digits and
    ``.`` one ``-``, the vendor's leading word dropped (``"NVIDIA H100 80GB HBM3"`` -> ``"h100-80gb-hbm3"``,
    ``"NVIDIA H100 PCIe"`` -> ``"h100-pcie"``), so that variants of one model (memory, bus, MIG slice) keep apart."""
    slug = re.sub(r"[^a-z0-9.]+", "-", device_name.lower()).strip("-")
    return re.sub(r"^(nvidia|tesla|amd|nvidia-tesla)-(?=.)", "", slug) or "gpu"


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``‖out − ref‖ / ‖ref‖`` computed in float64 (a zero ``ref`` counts as ``1e-30``)."""
    return float((out.double() - ref.double()).norm() / ref.double().norm().clamp(min=1e-30))


def capture(fn: Callable[[], Any], reps: int = 1) -> tuple[torch.cuda.CUDAGraph, Any]:
    """Warm ``fn`` up on a side stream, capture ``reps`` calls in one CUDA graph; return it and the last output."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    # thread_local: NCCL's watchdog thread may query events while this thread captures
    with torch.cuda.graph(g, capture_error_mode="thread_local"):
        for _ in range(reps):
            out = fn()
    torch.cuda.synchronize()
    return g, out


def graph_us(fn: Callable[[], Any], reps: int = 8, replays: int = 20) -> float:
    """µs per call of ``fn``: ``reps`` calls captured in one CUDA graph, median over ``replays`` replays
    timed with CUDA events (the launch cost of a graph replay is spread over ``reps`` calls, as in a
    decode step of many layers)."""
    graph, _ = capture(fn, reps)
    samples = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / reps)
    return statistics.median(samples)


def time_fn(fn: Callable[[], Any], graph: bool, flush: torch.Tensor, dirty: bool = False, reps: int = 100) -> float:
    """Median ms of ``fn()`` over ``reps`` runs, each after ``flush`` evicted the L2 cache.

    ``flush`` (a buffer several times the 50 MB L2) is read by a sum before each run, so the run starts
    from a cold L2 holding clean lines, as in serving, where other layers' weights were read last.
    ``dirty`` zeroes it instead, as ``triton.testing.do_bench`` does: the run then also pays the
    write-back of up to 50 MB of dirty lines (12 us at 4.25 TB/s), which inflates decode sizes. With
    ``graph`` the runs are CUDA-graph replays (device time without the host's launch overhead).
    """
    run = capture(fn)[0].replay if graph else fn
    for _ in range(5):
        run()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in events:
        if dirty:
            flush.zero_()
        else:
            flush.sum()
        start.record()
        run()
        end.record()
    torch.cuda.synchronize()
    return sorted(start.elapsed_time(end) for start, end in events)[reps // 2]


def time_in_model(fns: list[Callable[[], Any]], flush: torch.Tensor, reps: int = 50) -> float:
    """Median ms per layer when ``len(fns)`` layers (each its own weights and routing) run in one CUDA graph.

    A whole-model decode step is one graph replay, so its fixed replay cost (several us, also for an
    empty graph) is paid once per step, not once per MoE layer; this is the per-layer time in that
    setting. ``flush`` evicts L2 before each replay; each layer's weights are its own, so none of
    them is in L2 when it runs.
    """
    return time_fn(lambda: [fn() for fn in fns], True, flush, reps=reps) / len(fns)


def measure_ceilings() -> dict:
    """Copy bandwidth (bytes read + written per s) and bf16 matmul rate (FLOP/s), on random data."""
    import triton.testing

    n = 1 << 30
    src = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    bw = 2 * n * 2 / (ms * 1e-3)
    src = dst = None  # free the buffers
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = triton.testing.do_bench(lambda: a @ b, warmup=100, rep=500, return_mode="median")
    return {"copy_bytes_per_s": bw, "bf16_flop_per_s": 2 * 8192**3 / (ms * 1e-3)}
