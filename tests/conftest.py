"""Shared fixtures: paths of the real inputs and small real-format checkpoints built once per session."""

from __future__ import annotations

from pathlib import Path

import pytest

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
