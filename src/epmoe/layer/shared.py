"""``SharedExpert``: the dense expert every token passes through on every rank (DeepSeek, Kimi, Qwen2-MoE, GLM),
and when it runs beside the routed experts on CUDA."""


from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from epmoe.experts import Activation

SHARED_DECODE_MAX_ROWS = 1
"""Most rows ``SharedExpert`` computes with the decode expert kernels (``experts.triton.decode``) on CUDA: each row
is its own matrix-vector product over the whole expert, so from two rows on the expert's weight would be streamed
once per row, where cuBLAS streams it once."""

SHARED_OVERLAP_MAX_ROWS = 64
"""Most rows at which an MoE layer on CUDA computes its shared experts on a stream of its own, forked after the
routing and joined before their sum with the routed experts' output, so that their weight stream runs beside the
dispatch and the routed experts' (which at a decode step leave the memory partly idle). Also inside a CUDA graph
(the fork and join are captured as the graph's edges). The EP and TP layers route first (their shared experts, forked
before the routing, would slow the router's reads down to their pace).
``EPMOE_SHARED_OVERLAP=0`` in the environment turns it off (for measuring what it gains)."""


class SharedExpert(nn.Module):
    """The shared-expert MLP ``down(act(gate(x)) * up(x))``, optionally gated by ``sigmoid(g(x))`` (Qwen2-MoE).

    Parameter names follow the checkpoints: ``gate_proj``, ``up_proj``, ``down_proj`` (and the gate,
    ``shared_expert_gate``, held by the owning layer). The gate and up weights are the two halves of one
    ``[2, F, D]`` tensor, so that on CUDA a decode step's single row (``SHARED_DECODE_MAX_ROWS``, bf16 or fp16)
    runs as a one-slot expert through the decode expert kernels (``experts.triton.decode.decode_experts``: two
    launches streaming the weights at about the memory's rate, dependent launches on Hopper) instead of three
    cuBLAS products and two elementwise kernels. ``h`` then stays in float32 between the two launches, where
    ``nn.Linear`` rounds ``gate(x)``, ``up(x)`` and their product to the model dtype. More CUDA rows take the gate and
    up halves in one product of twice the width (``[T, 2F]``: one launch with more tiles to spread over the SMs,
    each value rounded as ``nn.Linear``'s), then the activation and ``down_proj``. Were the two halves ever separated
    (weights replaced by tensors of their own), or on CPU, the module runs the three products of the checkpoint.

    Args:
        hidden_size: ``D``.
        intermediate_size: intermediate size of this rank's part.
        activation: the gated activation.
        dtype, device: of the parameters.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, activation: Activation,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> None:
        super().__init__()
        kw = dict(bias=False, dtype=dtype, device=device)
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, **kw)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, **kw)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, **kw)
        w13 = torch.empty(2, intermediate_size, hidden_size, dtype=dtype, device=device)
        with torch.no_grad():  # a plain tensor, not a node of an autograd graph (deep copies, no grad at call)
            w13[0].copy_(self.gate_proj.weight)
            w13[1].copy_(self.up_proj.weight)
        self.gate_proj.weight = nn.Parameter(w13[0])
        self.up_proj.weight = nn.Parameter(w13[1])
        self._w13 = w13  # not a parameter: the checkpoint's names are the two halves'
        self.activation = activation
        self.requires_grad_(False)
        # the decode kernels' one slot, weight 1, per row: constants made once (a graph replays their address)
        self.register_buffer("_slots", torch.zeros(SHARED_DECODE_MAX_ROWS, 1, dtype=torch.int64, device=device),
                             persistent=False)
        self.register_buffer("_ones", torch.ones(SHARED_DECODE_MAX_ROWS, 1, dtype=torch.float32, device=device),
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, D]`` -> ``[T, D]``."""
        w13 = self._w13
        joined = (x.is_cuda and w13.dtype == x.dtype and w13.device == x.device
                  and self.gate_proj.weight.data_ptr() == w13[0].data_ptr()
                  and self.up_proj.weight.data_ptr() == w13[1].data_ptr())
        if not joined:
            return self.down_proj(self.activation(self.gate_proj(x), self.up_proj(x)))
        if (0 < x.shape[0] <= SHARED_DECODE_MAX_ROWS and x.dtype in (torch.bfloat16, torch.float16)
                and x.stride(-1) == 1 and self.down_proj.weight.is_contiguous() and self._slots.device == x.device):
            from epmoe.experts.triton.decode import decode_experts
            from epmoe.experts.triton.grouped import act_code
            from epmoe.experts.weights import ExpertWeights

            t = x.shape[0]
            weights = ExpertWeights(w13=w13.view(1, -1, w13.shape[2]), w2=self.down_proj.weight[None])
            return decode_experts(x, self._slots[:t], self._ones[:t], weights, act_code(self.activation),
                                  self.activation)
        f = w13.shape[1]
        h = F.linear(x, w13.view(2 * f, w13.shape[2]))
        return self.down_proj(self.activation(h[..., :f], h[..., f:]))
