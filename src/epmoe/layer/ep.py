"""``MoELayer``: the expert-parallel layer (composition only).

Data flow of ``MoELayer.forward`` (DESIGN.md): router -> placement map -> load recorder -> dispatch ->
grouped experts -> combine (+ shared experts on every rank; on CUDA at a few rows on a stream of their own, beside
the rest: ``shared.SHARED_OVERLAP_MAX_ROWS``). Everything a layer needs is a constructor argument; a missing piece is
an error at construction that names it."""


from __future__ import annotations

import torch

from epmoe.comm import Comm
from epmoe.dispatch import Dispatcher, make_dispatcher
from epmoe.experts import get_expert_backend
from epmoe.experts.storage import ExpertStorage
from epmoe.layer.base import ExpertParams, MoEBase
from epmoe.layer.options import FoldedNorm, MoELayerOptions
from epmoe.placement import ExpertPlacement
from epmoe.routing import SlotMap
from epmoe.spec import MoESpec


class MoELayer(MoEBase):
    """One expert-parallel MoE layer.

    Args:
        spec: the model's MoE facts.
        moe_index: index of this layer among the model's MoE layers, ``[0, L)``.
        placement: the expert placement (required: there is no default and no global).
        comm: the EP group (``Comm(None)`` for a single process).
        options: dispatcher, expert backend, replica policy and load recorder (``MoELayerOptions``; the
            default is the all-to-all dispatcher, the reference backend, the static policy, no recorder).
        dtype, device: of the parameters (keyword-only).

    Attributes: ``moe_index``, ``options`` (as built), ``dispatcher`` (change it with ``set_dispatcher``),
    ``expert_backend`` (the compute function), ``load_recorder``, ``experts`` (the weights), ``placement``,
    ``comm``, ``slot_map``; padding rows are set with ``set_row_mask``.

    Parameters: ``gate`` (router), ``experts.w13 [P/G, 2F, D]``, ``experts.w2 [P/G, D, F]`` (+ biases) or, for
    block-FP8, INT4 and MXFP4 checkpoints (``spec.expert_weight_format``), their tensors as stored
    (``epmoe.experts.storage``),
    ``shared_experts``, ``shared_expert_gate``; all filled by the checkpoint loader.

    Raises:
        TypeError: ``placement`` is missing or not an ``ExpertPlacement``; ``comm`` is not a ``Comm``;
            ``options`` is not an ``MoELayerOptions``; ``dispatcher_options`` the named dispatcher does not take.
        ValueError: the placement does not match the model or the EP group (sizes named), a dispatcher
            instance built for another group or slot count (see ``set_dispatcher``), or an expert weight format
            that is not served (``ExpertStorage.of``).
    """

    def __init__(
        self,
        spec: MoESpec,
        moe_index: int,
        placement: ExpertPlacement,
        comm: Comm,
        options: MoELayerOptions = MoELayerOptions(),
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        if not isinstance(spec, MoESpec):
            raise TypeError(f"MoELayer needs an MoESpec (epmoe.spec.load_moe_spec), got {type(spec).__name__}")
        if not isinstance(placement, ExpertPlacement):
            raise TypeError(
                f"MoELayer for MoE layer {moe_index} needs an ExpertPlacement, got {type(placement).__name__}; "
                f"build one with ExpertPlacement.trivial(...) or ExpertPlacement.load(path) and pass it explicitly"
            )
        if not isinstance(comm, Comm):
            raise TypeError(f"MoELayer needs its EP group as an epmoe.comm.Comm, got {type(comm).__name__}")
        if not isinstance(options, MoELayerOptions):
            raise TypeError(f"MoELayer options must be an epmoe.layer.MoELayerOptions, got {type(options).__name__}")
        placement.check_model(spec.num_moe_layers, spec.num_experts, what=f"model {spec.source}")
        if placement.ep_size != comm.size:
            raise ValueError(
                f"placement is for EP size {placement.ep_size} but the EP group has {comm.size} ranks"
            )
        super().__init__(spec, spec.shared_intermediate_size, dtype, device)
        self.moe_index = moe_index
        self.options = options
        self.placement = placement
        self.comm = comm
        self.slot_map = SlotMap(placement, moe_index, comm.rank, options.replica_policy, device)
        dispatcher = options.dispatcher
        self.set_dispatcher(
            make_dispatcher(dispatcher, comm, placement.slots_per_rank, **options.dispatcher_options)
            if isinstance(dispatcher, str) else dispatcher
        )
        self.expert_backend = get_expert_backend(options.expert_backend)
        self.load_recorder = options.load_recorder
        self.experts = ExpertParams(spec, placement.slots_per_rank, spec.moe_intermediate_size, dtype, device,
                                     ExpertStorage.of(spec.expert_weight_format, spec.moe_intermediate_size))
        self._row_mask: torch.Tensor | None = None

    def set_row_mask(self, row_mask: torch.Tensor | None) -> None:
        """Mark the padding rows of the next forwards (the engine's CUDA-graph steps run a bucket of rows, of which
        the last may be padding): a forward of ``T`` rows with a ``[T]`` mask routes its rows marked 0 to no
        expert (slots -1), so no expert computes them and no rank receives them; their output is the shared
        experts' alone. The tensor is read at each forward (in a captured graph: at each replay); a mask of another
        row count does not apply.

        Args:
            row_mask: ``[T]`` int64 on the layer's device, 1 = a real token, 0 = padding; ``None`` = no padding.

        Raises:
            ValueError: ``row_mask`` not a 1-D int64 tensor.
        """
        if row_mask is not None and (not isinstance(row_mask, torch.Tensor) or row_mask.dim() != 1
                                     or row_mask.dtype != torch.int64):
            shown = (f"{tuple(row_mask.shape)} {row_mask.dtype}" if isinstance(row_mask, torch.Tensor)
                     else type(row_mask).__name__)
            raise ValueError(f"MoE layer {self.moe_index}: row_mask must be a [T] int64 tensor, got {shown}")
        self._row_mask = row_mask

    @property
    def local_experts(self) -> torch.Tensor:
        """``[P/G]`` int64: the logical expert held in each local slot of this layer."""
        return self.placement.local_experts(self.comm.rank)[self.moe_index]

    def set_dispatcher(self, dispatcher: Dispatcher) -> None:
        """Serve the next calls through ``dispatcher`` (for example a fixed-capacity one sized for decode).

        Args:
            dispatcher: built for this layer's EP group and slots (``epmoe.dispatch.make_dispatcher``).

        Raises:
            ValueError: the dispatcher's process group, group size, slots per rank or slot count is not the
                layer's (both values named).
        """
        for what, got, want in (
            ("EP group size", dispatcher.comm.size, self.comm.size),
            ("slots_per_rank", dispatcher.slots_per_rank, self.placement.slots_per_rank),
            ("num_slots", dispatcher.num_slots, self.placement.num_slots),
        ):
            if got != want:
                raise ValueError(f"MoE layer {self.moe_index}: the {type(dispatcher).__name__} has {what} {got}, "
                                 f"the layer {want}")
        if dispatcher.comm.group is not self.comm.group:
            raise ValueError(f"MoE layer {self.moe_index}: the {type(dispatcher).__name__} runs over another process "
                             f"group than the layer's EP group")
        self.dispatcher = dispatcher

    def commit_placement(self, placement: ExpertPlacement, weights: dict[str, torch.Tensor]) -> None:
        """Switch this layer to ``placement`` with its already-staged local expert weights.

        The caller (``epmoe.runtime.rebalance``) stages every rank's weights first and commits only when
        all ranks hold theirs; this method only swaps references, so it cannot fail half-way.

        Args:
            placement: the new placement (same ``P``, ``E`` and EP size as the current one).
            weights: every expert parameter (``w13``, ``w2`` or their packed tensors and scales, and ``b13``,
                ``b2`` where the model has biases) for the new local slots, shaped like the current parameters.

        Raises:
            ValueError: a shape or placement-size mismatch (checked before anything changes).
        """
        old = self.placement
        new_sizes = (placement.num_slots, placement.num_experts, placement.ep_size)
        if new_sizes != (old.num_slots, old.num_experts, old.ep_size):
            raise ValueError(
                f"new placement has (P, E, G) = {new_sizes}, "
                f"the layer serves {(old.num_slots, old.num_experts, old.ep_size)}"
            )
        params = {n: p for n, p in self.experts.named_parameters()}
        for name, param in params.items():
            if name not in weights or weights[name].shape != param.shape or weights[name].dtype != param.dtype:
                got = None if name not in weights else (tuple(weights[name].shape), weights[name].dtype)
                raise ValueError(f"staged weight {name!r} is {got}, expected {(tuple(param.shape), param.dtype)}")
        slot_map = SlotMap(placement, self.moe_index, self.comm.rank, self.slot_map.policy, self.slot_map.table.device)
        for name, param in params.items():
            param.data = weights[name]
        self.slot_map = slot_map
        self.placement = placement

    def folds_norm(self, x: torch.Tensor, weight: torch.Tensor, weight_then_cast: bool) -> bool:
        """Whether ``forward`` takes a ``FoldedNorm`` of rows ``x [..., D]`` and an RMSNorm of ``weight``: one row
        that the fused router routes with a static slot table (``Router.folds_norm``)."""
        if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.shape[-1] != self.spec.hidden_size:
            return False
        return self.slot_map.static_table is not None and self.gate.folds_norm(x.reshape(-1, x.shape[-1]), weight,
                                                                                weight_then_cast)

    def forward(self, hidden: torch.Tensor | FoldedNorm) -> torch.Tensor:
        """``hidden [..., D]`` -> ``[..., D]``: routed experts (over the EP group) plus shared experts. ``hidden``
        may be a ``FoldedNorm`` that ``folds_norm`` accepted: the router adds and normalises the row in its launch.

        Raises:
            ValueError: the last dimension is not the model's hidden size; a ``FoldedNorm`` this layer does not
                fold (``folds_norm`` false: more than one row, no static slot table, the fused router not there).
        """
        folded = hidden if isinstance(hidden, FoldedNorm) else None
        if folded is not None:
            if not self.folds_norm(folded.x, folded.weight, folded.weight_then_cast):
                raise ValueError(f"MoE layer {self.moe_index}: handed a FoldedNorm of rows {tuple(folded.x.shape)} "
                                 f"{folded.x.dtype} on {folded.x.device} it does not fold (folds_norm is false)")
            hidden = folded.x
        shape = hidden.shape
        if shape[-1] != self.spec.hidden_size:
            raise ValueError(
                f"MoE layer {self.moe_index}: hidden states have size {shape[-1]}, expected {self.spec.hidden_size}"
            )
        x = hidden.reshape(-1, shape[-1])
        table = self.slot_map.static_table
        rec = self.load_recorder
        record = rec.load_record(self.moe_index, x.shape[0]) if rec is not None else None
        mask = self._row_mask if self._row_mask is not None and self._row_mask.shape[0] == x.shape[0] else None
        if folded is not None:  # routing with the norm before it; from here on the rows are the normalised ones
            rows, residual, summed = folded.rows()
            *fused, x = self.gate.route_folded(rows, residual, folded.weight, folded.eps, folded.weight_then_cast,
                                               summed, table, record, mask)
        else:
            fused = self.gate.route_to_slots(x, table, record, mask) if table is not None else None
        if fused is None:
            topk_idx, topk_weights = self.gate(x)
            topk_slots = self.slot_map(topk_idx)
            if mask is not None:
                topk_slots = topk_slots.masked_fill((mask == 0).unsqueeze(1), -1)
        else:  # routing, slot lookup, padding rows' slots (and the load count, with a record) in one launch
            _, topk_weights, topk_slots = fused
        if rec is not None and (fused is None or record is None):
            rec.record(self.moe_index, topk_slots)
        # forked after the routing: begun before it, their weight reads slow the router's down to their pace
        begun = self._shared_begin(x)
        handle = self.dispatcher.dispatch(x, topk_slots, topk_weights)
        # the kernels are chosen for the pairs this rank's tokens route (what it receives on average under a balanced
        # load), not for the receive buffer's rows times K (other ranks' pairs and padding rows too); a rank with no
        # tokens of its own (an idle rank's eager step) still receives other ranks' pairs, so it gives no estimate
        # (None: the backend counts the buffer's rows times K)
        y = self.expert_backend(
            handle.recv_x, handle.recv_slots, handle.recv_weights,
            self.experts.weights(), self.activation, self.weight_on_input, expected_pairs=topk_slots.numel() or None,
        )
        out = self._shared_end(x, self.dispatcher.combine(y, handle), begun)
        return out.reshape(shape)
