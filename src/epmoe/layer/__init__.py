"""``MoELayer`` (expert parallel, composition only) and ``TPMoELayer`` (the tensor-parallel baseline).

Data flow of ``MoELayer.forward`` (DESIGN.md): router -> placement map -> load recorder -> dispatch ->
grouped experts -> combine (+ shared experts on every rank; on CUDA at a few rows on a stream of their own, beside
the rest: ``SHARED_OVERLAP_MAX_ROWS``). Everything a layer needs is a
constructor argument; a missing piece is an error at construction that names it. The layer's choices
(dispatcher, expert backend, replica policy, load recorder) travel as one frozen ``MoELayerOptions``.
"""

from epmoe.layer.base import activation_of
from epmoe.layer.ep import MoELayer
from epmoe.layer.options import FoldedNorm, LoadSink, MoELayerOptions
from epmoe.layer.shared import SHARED_DECODE_MAX_ROWS, SHARED_OVERLAP_MAX_ROWS, SharedExpert
from epmoe.layer.tp import DPTPMoELayer, TPMoELayer, check_tp_sizes

__all__ = ["DPTPMoELayer", "FoldedNorm", "LoadSink", "MoELayer", "MoELayerOptions", "SHARED_DECODE_MAX_ROWS",
           "SHARED_OVERLAP_MAX_ROWS", "SharedExpert", "TPMoELayer", "activation_of", "check_tp_sizes"]
