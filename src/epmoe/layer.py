"""``MoELayer`` (expert parallel, composition only) and ``TPMoELayer`` (the tensor-parallel baseline).

Data flow of ``MoELayer.forward`` (DESIGN.md): router -> placement map -> load recorder -> dispatch ->
grouped experts -> combine (+ shared experts on every rank; on CUDA at a few rows on a stream of their own, beside
the rest: ``SHARED_OVERLAP_MAX_ROWS``). Everything a layer needs is a
constructor argument; a missing piece is an error at construction that names it. The layer's choices
(dispatcher, expert backend, replica policy, load recorder) travel as one frozen ``MoELayerOptions``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from epmoe.checks import check_add_norm
from epmoe.comm import Comm
from epmoe.dispatch import DISPATCHERS, Dispatcher, make_dispatcher
from epmoe.experts import EXPERT_BACKENDS, Activation, AnyExpertWeights, get_expert_backend
from epmoe.experts.storage import ExpertStorage
from epmoe.placement import ExpertPlacement
from epmoe.routing import REPLICA_POLICIES, ReplicaPolicy, Router, SlotMap
from epmoe.spec import MoESpec


@dataclass(frozen=True)
class FoldedNorm:
    """``RMSNorm(residual + x)`` still to compute, and where its consumer writes the sum.

    A pre-norm decoder layer computes ``h = residual + x; y = norm(h)`` and hands ``y`` to one module (the
    attention's q/k/v projection after the input norm, the MoE block after the post-attention norm). At decode sizes
    the norm is a launch of its own in the chain of dependent launches a layer is, and the module after it starts by
    reading the whole row anyway. A module that folds the norm (its ``folds_norm(x, weight, weight_then_cast)`` is
    true) is called with a ``FoldedNorm`` instead of ``y`` and computes the add and the norm within its own first
    launch, each of that launch's programs for itself (``engine.gemv.gemv_add_norm``; ``MoELayer`` through
    ``Router.route_folded``), writing the sum into ``summed``, the next residual. ``engine.decoder.fold_or_add_norm``
    builds it; the arithmetic and roundings are ``engine.fused_norm.FusedRMSNorm``'s (vLLM's ``fused_add_rms_norm``).

    Its operands are checked when it is made (``__post_init__``).

    Attributes:
        x: ``[..., D]`` the block's output (a float tensor, contiguous along ``D``).
        residual: ``[..., D]`` the residual stream (``x``'s shape, dtype and device).
        weight: ``[D]`` the norm's weight, contiguous, of ``x``'s dtype (any float dtype with ``weight_then_cast``).
        eps: the norm's epsilon, a finite real ``>= 0``.
        weight_then_cast: the norm multiplies by its weight in float32 and casts after (gpt-oss), instead of
            casting the normalised row first (``FusedRMSNorm.weight_then_cast``).
        summed: ``[..., D]`` (``x``'s shape, dtype and device, sharing no memory with ``x`` or ``residual``)
            where the consumer writes ``residual + x``, rounded to ``x``'s dtype.
    """

    x: torch.Tensor
    residual: torch.Tensor
    weight: torch.Tensor
    eps: float
    weight_then_cast: bool
    summed: torch.Tensor

    def __post_init__(self) -> None:
        """Raises TypeError or ValueError (named) for operands that do not fit (``checks.check_add_norm``: ``x`` and
        ``residual`` float tensors of one shape, dtype and device, contiguous along ``D``; ``weight`` a contiguous
        ``[D]`` float tensor of ``x``'s dtype unless ``weight_then_cast``; ``eps`` finite ``>= 0``; ``summed`` like
        ``x`` and sharing no memory with ``x`` or ``residual``)."""
        if not isinstance(self.summed, torch.Tensor):
            raise TypeError(f"FoldedNorm: summed must be a torch.Tensor, got {type(self.summed).__name__}")
        check_add_norm("FoldedNorm", self.x, self.residual, self.weight, self.eps, self.weight_then_cast,
                       {"summed": self.summed})

    def rows(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x``, ``residual`` and ``summed`` viewed as ``[T, D]`` rows (checked already: no new ``FoldedNorm``)."""
        d = self.x.shape[-1]
        return self.x.reshape(-1, d), self.residual.reshape(-1, d), self.summed.view(-1, d)


class LoadSink(Protocol):
    """Anything that records per-slot token counts (see ``epmoe.loads.ExpertLoadRecorder``)."""

    def record(self, layer: int, topk_slots: torch.Tensor) -> None:
        """Count ``topk_slots [T, K]`` global physical slot ids (-1 = none) for MoE layer ``layer``."""
        ...


@dataclass(frozen=True, kw_only=True)
class MoELayerOptions:
    """How an ``MoELayer`` dispatches and computes: one value for every MoE layer of a model.

    Attributes:
        dispatcher: a registered dispatcher name (``local``, ``all_to_all``, ``fixed_capacity``; see
            ``epmoe.dispatch.DISPATCHERS``) or a dispatcher instance (checked against each layer's group and
            slots, see ``MoELayer.set_dispatcher``).
        dispatcher_options: options of a named dispatcher (``fixed_capacity`` needs ``capacity``), kept as a
            read-only mapping; the dispatcher's factory checks their names when a layer builds it.
        expert_backend: a registered expert backend name (``reference``, ``grouped_mm``, ``triton``; see
            ``epmoe.experts.EXPERT_BACKENDS``).
        replica_policy: how a token picks among an expert's copies (``static``, ``round_robin``, ``random``).
        load_recorder: optional sink counting tokens per physical slot (``epmoe.loads.ExpertLoadRecorder``).

    Raises:
        KeyError: an unregistered ``dispatcher`` or ``expert_backend`` name (the registered ones listed).
        ValueError: an unknown ``replica_policy``; ``dispatcher_options`` given with a dispatcher instance.
        TypeError: a field of the wrong type (named, with the type given).
    """

    dispatcher: str | Dispatcher = "all_to_all"
    dispatcher_options: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    expert_backend: str = "reference"
    replica_policy: ReplicaPolicy = "static"
    load_recorder: LoadSink | None = None

    def __post_init__(self) -> None:
        name = type(self).__name__
        if isinstance(self.dispatcher, str):
            if self.dispatcher not in DISPATCHERS:
                raise KeyError(f"{name}.dispatcher: unknown dispatcher {self.dispatcher!r}; "
                               f"supported: {sorted(DISPATCHERS)}")
        elif not all(callable(getattr(self.dispatcher, m, None)) for m in ("dispatch", "combine")):
            raise TypeError(f"{name}.dispatcher must be a registered name or a Dispatcher (with dispatch and "
                            f"combine), got {type(self.dispatcher).__name__}")
        opts = self.dispatcher_options
        if not isinstance(opts, Mapping) or not all(isinstance(k, str) for k in opts):
            raise TypeError(f"{name}.dispatcher_options must be a mapping of option names to values, got {opts!r}")
        if opts and not isinstance(self.dispatcher, str):
            raise ValueError(f"{name}.dispatcher_options {dict(opts)} apply to a named dispatcher, but dispatcher is "
                             f"a {type(self.dispatcher).__name__} instance (build it with its options instead)")
        object.__setattr__(self, "dispatcher_options", MappingProxyType(dict(opts)))
        if not isinstance(self.expert_backend, str):
            raise TypeError(f"{name}.expert_backend must be a registered backend name, got "
                            f"{type(self.expert_backend).__name__}")
        if self.expert_backend not in EXPERT_BACKENDS:
            raise KeyError(f"{name}.expert_backend: unknown expert backend {self.expert_backend!r}; "
                           f"supported: {sorted(EXPERT_BACKENDS)}")
        if self.replica_policy not in REPLICA_POLICIES:
            raise ValueError(f"{name}.replica_policy must be one of {REPLICA_POLICIES}, got {self.replica_policy!r}")
        if self.load_recorder is not None and not callable(getattr(self.load_recorder, "record", None)):
            raise TypeError(f"{name}.load_recorder must have a record(layer, topk_slots) method, got "
                            f"{type(self.load_recorder).__name__}")


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


def activation_of(spec: MoESpec) -> Activation:
    """The expert activation a model uses."""
    return Activation(act=spec.hidden_act, swiglu_limit=spec.swiglu_limit, swiglu_alpha=spec.swiglu_alpha)


class _ExpertParams(nn.Module):
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
        return self.storage.weights(dict(self.named_parameters()))


class _MoEBase(nn.Module):
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
                or os.environ.get("EPMOE_SHARED_OVERLAP", "1") == "0"):
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


class MoELayer(_MoEBase):
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

    Parameters: ``gate`` (router), ``experts.w13 [P/G, 2F, D]``, ``experts.w2 [P/G, D, F]`` (+ biases) or, for INT4
    and MXFP4 checkpoints (``spec.expert_weight_format``), their packed tensors (``epmoe.experts.storage``),
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
        self.experts = _ExpertParams(spec, placement.slots_per_rank, spec.moe_intermediate_size, dtype, device,
                                     ExpertStorage.of(spec.expert_weight_format))
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


class TPMoELayer(_MoEBase):
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
        self.experts = _ExpertParams(spec, spec.num_experts, spec.moe_intermediate_size // comm.size, dtype, device)

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
