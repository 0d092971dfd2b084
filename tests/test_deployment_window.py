"""benchmarks/deployment.py's measured window on one gloo rank and a tiny engine (``staggered_engine``): every timed
step runs the whole batch, and a window whose batch shrinks (requests finished at the context limit) is refused, its
requests aborted."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from .benchmark_scripts import before_the_aborts, count_live_requests, load_benchmark, staggered_engine


class _OneRank:
    """``deployment.Rank``'s interface for a single process (world 1, the default gloo group)."""

    rank, world, cuda, side = 0, 1, False, None

    def __init__(self, steps: int) -> None:
        self.args = SimpleNamespace(steps=steps, profile_steps=1, spec_k=0)

    def any(self, flag: bool) -> bool:
        return bool(flag)

    def max(self, value: float) -> float:
        return float(value)

    def min(self, value: float) -> float:
        return float(value)

    def sum(self, value: float) -> float:
        return float(value)

    def gather(self, obj) -> list:
        return [obj]

    def sync(self) -> None:
        """Nothing to wait for: one process on the CPU."""

    def log(self, msg: str) -> None:
        """The window logs nothing the tests read."""


@pytest.fixture
def gloo():
    import torch.distributed as dist

    from epmoe.runtime.launch import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


PROMPTS = [[7 + i] * 12 for i in range(4)]


def test_window_measures_the_whole_batch(monkeypatch, tmp_path, gloo):
    mod = load_benchmark("deployment", monkeypatch)
    engine = staggered_engine(tmp_path)
    seen = count_live_requests(monkeypatch, engine)
    row = mod.window(_OneRank(steps=5), engine, PROMPTS, 4)
    seen = before_the_aborts(seen)
    assert seen[-(3 + 5 + 1):] == [4] * (3 + 5 + 1)   # warm-up, timed and profiled steps
    assert row["output_tokens_per_s"] > 0 and row["accepted_length"] == 1.0
    assert not engine.has_unfinished() and not engine._seqs
    assert engine.allocator.num_free == engine.allocator.capacity


def test_window_refuses_a_shrinking_batch(monkeypatch, tmp_path, gloo):
    mod = load_benchmark("deployment", monkeypatch)
    engine = staggered_engine(tmp_path, max_model_len=24)   # 12 past the prompts: the first finish in the window
    with pytest.raises(RuntimeError, match=r"concurrency 4: of 4 requests [1-4] finished and 0 were preempted before "
                                           r"the window ended, so its steps ran fewer; each may generate 12 tokens"):
        mod.window(_OneRank(steps=20), engine, PROMPTS, 4)
    assert not engine.has_unfinished() and not engine._seqs
    assert engine.allocator.num_free == engine.allocator.capacity
