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
