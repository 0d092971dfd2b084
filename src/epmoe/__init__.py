"""epmoe: expert-parallel Mixture-of-Experts inference for PyTorch.

The packages follow one MoE layer's data flow: ``routing`` -> ``dispatch`` -> ``experts`` -> ``dispatch``
(combine), composed by ``layer``; ``balance`` re-places experts from recorded ``loads``; ``plan`` prices
TP against EP; ``models`` loads real checkpoints; ``runtime`` runs processes. The public API is
re-exported here.
"""

from epmoe.comm import Comm
from epmoe.dispatch import DISPATCHERS, Dispatcher, make_dispatcher
from epmoe.experts import EXPERT_BACKENDS, Activation, ExpertWeights, get_expert_backend
from epmoe.layer import MoELayer, MoELayerOptions, TPMoELayer
from epmoe.loads import ExpertLoadRecorder
from epmoe.models.hf import EPModel, load_ep_model
from epmoe.placement import ExpertPlacement
from epmoe.spec import MoESpec, load_moe_spec

__all__ = [
    "DISPATCHERS", "EXPERT_BACKENDS", "Activation", "Comm", "Dispatcher", "EPModel", "ExpertLoadRecorder",
    "ExpertPlacement", "ExpertWeights", "MoELayer", "MoELayerOptions", "MoESpec", "TPMoELayer", "get_expert_backend",
    "load_ep_model", "load_moe_spec", "make_dispatcher",
]

__version__ = "0.1.0"
