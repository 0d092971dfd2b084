"""``benchmarks/`` scripts loaded as modules, for the tests of their flags and helpers (the folder is not a
package)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from types import ModuleType

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(name: str, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """``benchmarks/<name>.py`` as a module, its folder on ``sys.path`` (the scripts import their siblings:
    ``timing``, ``engine``, ``serve``, ``multigpu_parts``) and the NCCL settings the multi-GPU scripts set at import
    when unset kept as they are; ``monkeypatch`` puts both back afterwards."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    for var, default in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")):
        monkeypatch.setenv(var, os.environ.get(var, default))
    spec = importlib.util.spec_from_file_location(f"{name}_benchmark", BENCHMARKS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def staggered_engine(tmp_path: Path, **config):
    """A tiny CPU engine (``qwen3-moe``, at most 4 sequences, 16 tokens a step) whose prompts of 4 requests take
    several steps, so the first requests decode while the last are still prefilled; ``config``: more
    ``EngineConfig`` fields."""
    from epmoe.engine import Engine, EngineConfig
    from epmoe.models.tiny import build_tiny_checkpoint

    return Engine(EngineConfig(model=str(build_tiny_checkpoint("qwen3-moe", tmp_path / "q")), device="cpu",
                               max_num_seqs=4, max_num_batched_tokens=16, **config))


def count_live_requests(monkeypatch: pytest.MonkeyPatch, engine) -> list[int]:
    """A list that ``engine.step`` (patched by ``monkeypatch``) extends with the number of unfinished requests at the
    start of each step; read it with ``before_the_aborts``."""
    seen: list[int] = []
    step = engine.step

    def counted_step():
        seen.append(sum(not s.finished for s in engine._seqs.values()))
        return step()

    monkeypatch.setattr(engine, "step", counted_step)
    return seen


def before_the_aborts(seen: list[int]) -> list[int]:
    """``count_live_requests``'s counts without the trailing steps that only reported the aborted requests."""
    end = len(seen)
    while end and seen[end - 1] == 0:
        end -= 1
    return seen[:end]
