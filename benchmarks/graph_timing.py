"""Per-call device time of a function from replays of one CUDA graph holding several calls (shared by the
single-GPU benchmarks): warm-up calls, capture of ``reps`` calls, median of ``replays`` timed replays."""

from __future__ import annotations

import statistics
from typing import Any, Callable

import torch


def graph_us(fn: Callable[[], Any], reps: int = 8, replays: int = 20) -> float:
    """µs per call of ``fn``: ``reps`` calls captured in one CUDA graph, median over ``replays`` replays
    timed with CUDA events (the launch cost of a graph replay is spread over ``reps`` calls, as in a
    decode step of many layers)."""
    for _ in range(3):
        fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    samples = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / reps)
    return statistics.median(samples)
