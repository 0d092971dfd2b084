"""epmoe: expert-parallel Mixture-of-Experts inference for PyTorch.

The packages follow one MoE layer's data flow: ``routing`` -> ``dispatch`` -> ``experts`` -> ``dispatch``
(combine), composed by ``layer``; ``balance`` re-places experts from recorded ``loads``; ``plan`` prices
TP against EP; ``models`` loads real checkpoints; ``runtime`` runs processes. The public API is
re-exported here.
"""

import importlib
from typing import Any

_EXPORTS = {
    "Comm": "epmoe.comm", "DISPATCHERS": "epmoe.dispatch", "Dispatcher": "epmoe.dispatch",
    "make_dispatcher": "epmoe.dispatch", "EXPERT_BACKENDS": "epmoe.experts", "Activation": "epmoe.experts",
    "ExpertWeights": "epmoe.experts", "get_expert_backend": "epmoe.experts", "MoELayer": "epmoe.layer",
    "MoELayerOptions": "epmoe.layer", "TPMoELayer": "epmoe.layer", "ExpertLoadRecorder": "epmoe.loads",
    "EPModel": "epmoe.models.hf", "load_ep_model": "epmoe.models.hf", "ExpertPlacement": "epmoe.placement",
    "MoESpec": "epmoe.spec", "load_moe_spec": "epmoe.spec",
}
"""The public API, name -> the module that defines it. Imported on first use (PEP 562), so that ``import epmoe``
(and the ``epmoe`` command's start: its help, argument errors, Ctrl-C) does not wait for PyTorch."""

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'epmoe' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


__version__ = "0.1.0"
