"""``TPMoELayer`` (the tensor-parallel baseline: every rank a slice of every expert) and ``DPTPMoELayer``
(data-parallel attention beside it), and the sizes a TP group must divide."""


from __future__ import annotations

import torch

from epmoe.comm import Comm
from epmoe.experts import get_expert_backend
from epmoe.layer.base import ExpertParams, MoEBase
from epmoe.layer.ep import MoELayer
from epmoe.spec import MoESpec


class TPMoELayer(MoEBase):
    """The tensor-parallel baseline: every rank holds a ``1/G`` slice of every expert's intermediate
    dimension (and of the shared expert), computes all tokens, then all-reduces.

    Args:
        spec: the model's MoE facts.
        comm: the TP group.
        expert_backend: a registered expert backend name.
        dtype, device: of the parameters.

    Parameters: ``experts.w13 [E, 2F/G, D]`` (gate slice rows then up slice rows), ``experts.w2
    [E, D, F/G]``, biases (``b2`` non-zero on rank 0 only), shared expert slices.

    Raises:
        TypeError: ``comm`` is not a ``Comm``.
        ValueError: ``F`` (or the shared intermediate size) not divisible by the TP size.
    """

    def __init__(self, spec: MoESpec, comm: Comm, expert_backend: str = "reference",
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> None:
        if not isinstance(comm, Comm):
            raise TypeError(f"TPMoELayer needs its TP group as an epmoe.comm.Comm, got {type(comm).__name__}")
        for name, size in (("moe_intermediate_size", spec.moe_intermediate_size),
                           ("shared_intermediate_size", spec.shared_intermediate_size)):
            if size % comm.size:
                raise ValueError(f"{name} ({size}) must be divisible by the TP group size ({comm.size})")
        super().__init__(spec, spec.shared_intermediate_size // comm.size, dtype, device)
        self.comm = comm
        self.expert_backend = get_expert_backend(expert_backend)
        self.experts = ExpertParams(spec, spec.num_experts, spec.moe_intermediate_size // comm.size, dtype, device)

    @torch.no_grad()
    def load_from(self, full: MoELayer) -> None:
        """Copy this rank's slice of every weight from a single-rank ``MoELayer`` holding all experts.

        Raises:
            ValueError: ``full`` is not one rank holding exactly the ``E`` experts in order.
        """
        if full.comm.size != 1 or not torch.equal(full.local_experts, torch.arange(self.spec.num_experts)):
            raise ValueError("load_from needs a single-rank MoELayer holding experts 0..E-1 in slot order")
        g, r = self.comm.size, self.comm.rank
        f = self.spec.moe_intermediate_size
        part = slice(r * f // g, (r + 1) * f // g)
        src = full.experts
        self.gate.load_state_dict(full.gate.state_dict())
        self.experts.w13.copy_(torch.cat([src.w13[:, :f][:, part], src.w13[:, f:][:, part]], dim=1))
        self.experts.w2.copy_(src.w2[:, :, part])
        if src.b13 is not None:
            self.experts.b13.copy_(torch.cat([src.b13[:, :f][:, part], src.b13[:, f:][:, part]], dim=1))
            self.experts.b2.copy_(src.b2 if r == 0 else torch.zeros_like(src.b2))
        if full.shared_experts is not None:
            fs = self.spec.shared_intermediate_size
            sp = slice(r * fs // g, (r + 1) * fs // g)
            self.shared_experts.gate_proj.weight.copy_(full.shared_experts.gate_proj.weight[sp])
            self.shared_experts.up_proj.weight.copy_(full.shared_experts.up_proj.weight[sp])
            self.shared_experts.down_proj.weight.copy_(full.shared_experts.down_proj.weight[:, sp])
        if full.shared_expert_gate is not None:
            self.shared_expert_gate.weight.copy_(full.shared_expert_gate.weight)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [..., D]`` -> ``[..., D]``; one all-reduce over the TP group."""
        shape = hidden.shape
        x = hidden.reshape(-1, shape[-1])
        topk_idx, topk_weights = self.gate(x)
        begun = self._shared_begin(x)
        out = self.expert_backend(
            x, topk_idx, topk_weights, self.experts.weights(), self.activation, self.weight_on_input
        )
        return self.comm.all_reduce(self._shared_end(x, out, begun)).reshape(shape)


def check_tp_sizes(spec: MoESpec, tp_size: int) -> None:
    """Raise ``ValueError`` unless the TP group size divides the expert and shared-expert intermediate sizes.

    Raises:
        ValueError: ``moe_intermediate_size`` or ``shared_intermediate_size`` (the sizes named) not divisible
            by ``tp_size``.
    """
    for name, size in (("moe_intermediate_size", spec.moe_intermediate_size),
                       ("shared_intermediate_size", spec.shared_intermediate_size)):
        if size % tp_size:
            raise ValueError(f"{name} ({size}) of model {spec.source} must be divisible by the TP group size "
                             f"({tp_size}) for parallel 'tp'")


class DPTPMoELayer(TPMoELayer):
    """Tensor-parallel experts under data-parallel attention (the engine's ``parallel='tp'`` MoE layer).

    Every rank holds a ``1/G`` slice of every expert's intermediate dimension (and of the shared expert), as
    ``TPMoELayer`` does, but each rank brings its own tokens (its own requests). One call on a rank with ``T_r``
    tokens:

    1. the group's token counts: one ``all_gather`` of a ``[1]`` int64 tensor (with a host read of the result),
       skipped while a static size is set (``set_static_tokens``: every rank runs the same decode bucket);
    2. ``all_gather`` of this rank's hidden states padded to ``Tmax = max_r T_r`` rows: ``[G * Tmax, D]``;
    3. router, expert slices and shared-expert slice over all ``G * Tmax`` rows (padding rows are zeros and
       are computed, then dropped);
    4. ``all_reduce`` (sum) of the ``[G * Tmax, D]`` partial outputs; this rank keeps rows
       ``[rank * Tmax, rank * Tmax + T_r)``.

    A rank with no tokens still joins every collective (its rows are padding). With ``G == 1`` no
    collective runs. With a static size set the forward has static shapes and no host synchronisation
    (CUDA-graph safe).

    Args:
        spec: the model's MoE facts.
        moe_index: index of this layer among the model's MoE layers.
        comm: the TP group (the engine's whole group).
        expert_backend: a registered expert backend name.
        dtype, device: of the parameters (keyword-only).

    Parameters: as ``TPMoELayer`` (``experts.w13 [E, 2F/G, D]``, ``experts.w2 [E, D, F/G]``, biases with
    ``b2`` non-zero on rank 0 only, shared-expert slices); filled by ``epmoe.models.hf.load_tp_model``.

    Raises:
        TypeError: ``comm`` is not a ``Comm``.
        ValueError: ``F`` or the shared intermediate size not divisible by ``G`` (see ``check_tp_sizes``).
    """

    def __init__(self, spec: MoESpec, moe_index: int, comm: Comm, expert_backend: str = "reference", *,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> None:
        if not isinstance(comm, Comm):
            raise TypeError(f"DPTPMoELayer needs its TP group as an epmoe.comm.Comm, got {type(comm).__name__}")
        check_tp_sizes(spec, comm.size)
        super().__init__(spec, comm, expert_backend, dtype, device)
        self.moe_index = moe_index
        self.static_tokens: int | None = None

    def set_static_tokens(self, tokens: int | None) -> None:
        """Every rank calls the next forwards with exactly ``tokens`` rows (a static decode bucket): the size
        exchange is skipped. ``None`` = sizes vary (eager steps): exchange them.

        Raises:
            ValueError: ``tokens`` is not ``None`` or a non-negative integer.
        """
        if tokens is not None and (isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0):
            raise ValueError(f"static_tokens must be None or a non-negative integer, got {tokens!r}")
        self.static_tokens = tokens

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [..., D]`` (this rank's tokens) -> ``[..., D]``.

        Raises:
            ValueError: the last dimension is not the hidden size, or a static size is set and this rank's
                token count differs from it.
        """
        shape = hidden.shape
        d = self.spec.hidden_size
        if shape[-1] != d:
            raise ValueError(f"MoE layer {self.moe_index}: hidden states have size {shape[-1]}, expected {d}")
        x = hidden.reshape(-1, d)
        t = x.shape[0]
        g = self.comm.size
        if g == 1:
            return self._compute(x).reshape(shape)
        if self.static_tokens is not None:
            if t != self.static_tokens:
                raise ValueError(f"MoE layer {self.moe_index}: static size {self.static_tokens} set, got {t} tokens")
            tmax = t
        else:
            sizes = self.comm.all_gather(torch.tensor([t], dtype=torch.int64, device=x.device))
            tmax = int(sizes.max())
        if tmax == 0:
            return hidden.clone()
        if t < tmax:
            x = torch.cat([x, x.new_zeros(tmax - t, d)])
        gathered = self.comm.all_gather(x).reshape(g * tmax, d)
        out = self.comm.all_reduce(self._compute(gathered))
        start = self.comm.rank * tmax
        return out[start: start + t].reshape(shape)

    def _compute(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's partial sum for ``x [N, D]``: routed-expert slices plus the shared-expert slice."""
        topk_idx, topk_weights = self.gate(x)
        begun = self._shared_begin(x)
        out = self.expert_backend(
            x, topk_idx, topk_weights, self.experts.weights(), self.activation, self.weight_on_input
        )
        return self._shared_end(x, out, begun)
