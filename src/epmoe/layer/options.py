"""A layer's choices as one frozen value (``MoELayerOptions``: dispatcher, expert backend, replica policy, load
recorder) and the norm a layer may fold into its router (``FoldedNorm``)."""


from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Protocol

import torch

from epmoe.checks import check_add_norm
from epmoe.dispatch import DISPATCHERS, Dispatcher
from epmoe.experts import EXPERT_BACKENDS
from epmoe.routing import REPLICA_POLICIES, ReplicaPolicy


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
