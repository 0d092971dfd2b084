"""epmoe: expert-parallel Mixture-of-Experts inference for PyTorch.

The packages follow one MoE layer's data flow: ``routing`` -> ``dispatch`` -> ``experts`` -> ``dispatch``
(combine), composed by ``layer``; ``balance`` re-places experts from recorded ``loads``; ``plan`` prices
TP against EP; ``models`` loads real checkpoints; ``runtime`` runs processes. The public API is
re-exported here.
"""

import importlib as _importlib
import importlib.util as _importlib_util
from typing import Any as _Any

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


def __getattr__(name: str) -> _Any:
    """A public name (``_EXPORTS``) or a subpackage (``epmoe.spec`` after ``import epmoe``), imported on first use."""
    module = _EXPORTS.get(name)
    if module is not None:
        value = getattr(_importlib.import_module(module), name)
    elif name.isidentifier() and not name.startswith("_") and _importlib_util.find_spec(f"{__name__}.{name}"):
        value = _importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module 'epmoe' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({n for n in globals() if not n.startswith("_")} | set(_EXPORTS) | {"__version__"})


__version__ = "0.1.0"
