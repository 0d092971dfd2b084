"""Shared fixtures (paths of the real inputs, small real-format checkpoints built once per session) and the
markers' skips: ``gpu`` tests need a CUDA device, ``interpret`` tests ``TRITON_INTERPRET=1`` (a CPU Triton
on the path); ``multiprocess`` tests start several processes (``-m "not multiprocess"`` leaves them out).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

# One thread for torch's CPU ops in this process and in the processes the tests start (they inherit the variable;
# epmoe's ranks read it, runtime.launch.set_rank_threads): the tests' tensors are tiny, and threads of two processes
# waiting on each other's cores cost more than they save (a one-rank engine test took twice as long with two).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

# A verbatim copy of ../shared/data (the project's real inputs), so a clean checkout tests alone.
DATA = Path(__file__).resolve().parents[1] / "data"
CONFIGS = DATA / "configs"
LOADS = DATA / "loads"


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory):
    """Build (lazily, once) a small checkpoint per family with transformers' save_pretrained."""
    from epmoe.models.tiny import build_tiny_checkpoint

    root = tmp_path_factory.mktemp("tiny")
    built: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in built:
            built[family] = build_tiny_checkpoint(family, root / family)
        return built[family]

    return get


def pytest_collection_modifyitems(config, items):
    """Skip ``gpu`` tests without a CUDA device and ``interpret`` tests without ``TRITON_INTERPRET=1`` or without
    Triton."""
    interpret = None
    if os.environ.get("TRITON_INTERPRET") != "1":
        interpret = pytest.mark.skip(reason="needs TRITON_INTERPRET=1")
    elif importlib.util.find_spec("triton") is None:
        interpret = pytest.mark.skip(reason="needs triton (TRITON_INTERPRET=1 is set, but triton is not installed)")
    skips = {
        "gpu": None if torch.cuda.is_available() else pytest.mark.skip(reason="needs a CUDA device"),
        "interpret": interpret,
    }
    for item in items:
        for name, skip in skips.items():
            if skip is not None and item.get_closest_marker(name) is not None:
                item.add_marker(skip)
