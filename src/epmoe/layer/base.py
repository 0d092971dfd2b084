"""What the EP and TP layers share: the router, the shared experts and their forward glue, and the routed
experts' parameters."""


from __future__ import annotations

import torch
from torch import nn

from epmoe.experts import Activation, AnyExpertWeights
from epmoe.experts.storage import ExpertStorage
from epmoe.experts.switches import enabled
from epmoe.layer.shared import SHARED_OVERLAP_MAX_ROWS, SharedExpert
from epmoe.routing import Router
from epmoe.spec import MoESpec


def activation_of(spec: MoESpec) -> Activation:
    """The expert activation a model uses."""
    return Activation(act=spec.hidden_act, swiglu_limit=spec.swiglu_limit, swiglu_alpha=spec.swiglu_alpha)


class ExpertParams(nn.Module):
    """Expert weights of ``S`` slots in ``storage`` (``experts.storage``): plain ``w13 [S, 2F, D]``, ``w2 [S, D, F]``,
    or their INT4 / MXFP4 packed tensors; biases ``b13 [S, 2F]``, ``b2 [S, D]``."""

    def __init__(self, spec: MoESpec, num_slots: int, inter: int, dtype: torch.dtype, device,
                 storage: ExpertStorage = ExpertStorage()) -> None:
        super().__init__()
        self.storage = storage
        self.b13: nn.Parameter | None = None
        self.b2: nn.Parameter | None = None
        for name, (shape, dt) in storage.shapes(num_slots, spec.hidden_size, inter, spec.expert_bias).items():
            t = torch.zeros(*shape, dtype=dt or dtype, device=device)
            setattr(self, name, nn.Parameter(t, requires_grad=False))

    def weights(self) -> AnyExpertWeights:
        """The slots' weights as the expert backends take them (``storage``'s value type over these tensors)."""
        return self.storage.weights(dict(self.named_parameters()))


class MoEBase(nn.Module):
    """Router, shared experts and their forward glue, common to the EP and TP layers."""

    def __init__(self, spec: MoESpec, shared_inter: int, dtype: torch.dtype, device) -> None:
        super().__init__()
        if not isinstance(spec, MoESpec):
            raise TypeError(f"spec must be an MoESpec, got {type(spec).__name__}")
        self.spec = spec
        self.activation = activation_of(spec)
        self.weight_on_input = spec.weight_on_input
        self.gate = Router(spec, dtype=dtype, device=device)
        self.shared_experts = (
            SharedExpert(spec.hidden_size, shared_inter, self.activation, dtype, device) if shared_inter else None
        )
        self.shared_expert_gate = (
            nn.Linear(spec.hidden_size, 1, bias=False, dtype=dtype, device=device).requires_grad_(False)
            if spec.shared_expert_gate else None
        )
        self._shared_stream: torch.cuda.Stream | None = None

    def _shared(self, x: torch.Tensor) -> torch.Tensor | None:
        if self.shared_experts is None:
            return None
        y = self.shared_experts(x)
        if self.shared_expert_gate is not None:
            y = torch.sigmoid(self.shared_expert_gate(x)) * y
        return y

    def _side_stream(self, x: torch.Tensor) -> torch.cuda.Stream | None:
        """The stream the shared experts of ``x [T, D]`` run on beside the routed ones, or ``None`` (in order, on the
        current stream): CUDA rows, at most ``SHARED_OVERLAP_MAX_ROWS`` of them, a shared expert, not turned off. The
        layer's stream is made at its first such forward (eager: the engine warms each bucket up before capturing it);
        a forward captured before that, or one whose current stream is that stream, runs in order."""
        if (self.shared_experts is None or not x.is_cuda or not 0 < x.shape[0] <= SHARED_OVERLAP_MAX_ROWS
                or not enabled("EPMOE_SHARED_OVERLAP")):
            return None
        side = self._shared_stream
        if side is None or side.device != x.device:
            if torch.cuda.is_current_stream_capturing():
                return None
            side = self._shared_stream = torch.cuda.Stream(device=x.device)
        return None if side == torch.cuda.current_stream(x.device) else side

    def _shared_begin(self, x: torch.Tensor) -> tuple[torch.Tensor | None, torch.cuda.Stream | None]:
        """Fork the shared experts of ``x [T, D]`` onto the side stream (``_side_stream``): ``(their [T, D] output,
        the stream)``, or ``(None, None)`` when they run in order (``_shared_end`` computes them then)."""
        side = self._side_stream(x)
        if side is None:
            return None, None
        side.wait_stream(torch.cuda.current_stream(x.device))
        with torch.cuda.stream(side):
            return self._shared(x), side

    def _shared_end(self, x: torch.Tensor, out: torch.Tensor,
                    begun: tuple[torch.Tensor | None, torch.cuda.Stream | None]) -> torch.Tensor:
        """``out [T, D]`` plus the shared experts' output of ``x`` (``begun`` from ``_shared_begin``: joined to the
        current stream, or computed now)."""
        shared, side = begun
        if side is not None:
            current = torch.cuda.current_stream(x.device)
            current.wait_stream(side)
            shared.record_stream(current)  # made on the side stream, read and freed on this one
        else:
            shared = self._shared(x)
        return out if shared is None else out + shared
