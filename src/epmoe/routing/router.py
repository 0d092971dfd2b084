"""Routers of every served family: ``Router`` reproduces the Hugging Face transformers MoE gates exactly
(transformers 5.x ``modeling_*.py``): softmax or sigmoid scoring, grouped top-k, DeepSeek-V3's
score-correction bias (used for selection only), top-k normalisation, routed scaling, gpt-oss's router
bias with a softmax over the chosen logits, and Llama-4's sigmoid of the chosen logits. Every family fact
it uses is a field or property of ``MoESpec``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from epmoe.checks import norm_weight_fits
from epmoe.loads import LoadRecord
from epmoe.spec import MoESpec

FUSED_GATE_MAX_TOKENS = 16
"""The most tokens ``Router`` routes through ``router_triton.route_gate_triton`` (the gate's logits computed in the
routing kernel's launch) by default, and the arrival counters it keeps for it. Each token's programs there read the
whole gate weight (all but the first token's reads hit L2), so that launch reads more with every token, while
a matrix product reads the weight once: above a few tokens the router computes the logits with a matrix product
and routes them with ``router_triton.route_triton``."""

ROUTING_SIMULATIONS = ("uniform_random",)
"""What ``Router.simulation`` may name besides ``None`` (vLLM's ``VLLM_MOE_ROUTING_SIMULATION_STRATEGY`` has the same
``uniform_random``): each token's ``K`` experts drawn uniformly at random, ``K`` distinct ones."""

MAX_BF16_PIECES = 3
"""The most bfloat16 pieces ``bfloat16_pieces`` splits a float32 weight into: three hold a float32 value exactly (8
significant bits each, the rounding's sign giving the residual one more) from about ``2**-110`` up to bfloat16's
largest finite value (about ``3.39e38``); below, the last residuals fall under bfloat16's normal range."""


def bfloat16_pieces(weight: torch.Tensor) -> torch.Tensor | None:
    """A float32 matrix as the fewest bfloat16 matrices that sum to it exactly, for float32 products on bfloat16
    matrix units: a bfloat16 row times each piece, each product exact in float32 and summed in float32, is the float32
    product up to the order of its sums (the split of the Ozaki scheme, Ozaki et al., "Error-free transformations of
    matrix multiplication by using fast routines of matrix multiplication and its applicability", Numerical
    Algorithms 59, 2012; with bfloat16 rows no split of the rows is needed).

    Piece ``i`` is the residual after pieces ``0..i-1`` rounded to bfloat16 (to nearest): one piece for a weight that
    is bfloat16 already (a checkpoint's bf16 gate widened to float32), three for other float32 values of ordinary
    magnitudes (``MAX_BF16_PIECES``).

    Args:
        weight: ``[E, D]`` float32.

    Returns:
        ``[n, E, D]`` bfloat16 with ``n <= MAX_BF16_PIECES`` and ``sum(pieces.float()) == weight`` exactly, or
        ``None`` where three pieces leave a residual (values too small for bfloat16 to hold their low bits, too large
        for bfloat16's range, or not finite). Reads the residual back to the host once per piece.

    Raises:
        ValueError: ``weight`` not a 2-D float32 tensor.
    """
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.dtype != torch.float32:
        shown = (f"{tuple(weight.shape)} {weight.dtype}" if isinstance(weight, torch.Tensor)
                 else type(weight).__name__)
        raise ValueError(f"bfloat16_pieces needs a 2-D float32 weight, got {shown}")
    if not bool(torch.isfinite(weight).all()):
        return None
    pieces, rest = [], weight
    for _ in range(MAX_BF16_PIECES):
        piece = rest.to(torch.bfloat16)
        pieces.append(piece)
        rest = rest - piece.float()
        if not bool(rest.any()):
            return torch.stack(pieces)
    return None


class Router(nn.Module):
    """The gate of one MoE layer.

    Parameters (names as in the checkpoints): ``weight [E, D]``; ``bias [E]`` (gpt-oss);
    buffer ``e_score_correction_bias [E]`` float32 (DeepSeek-V3 / Kimi-K2).

    Args:
        spec: the model's MoE facts.
        dtype: parameter dtype of ``weight``/``bias`` (the correction bias stays float32).
        device: where the parameters live.
        impl: how the top-k after the logits runs: ``auto`` (one Triton kernel, ``router_triton``,
            for CUDA tensors when Triton imports and the router kind is supported; PyTorch otherwise),
            ``torch`` (always PyTorch: the reference that matches transformers bit for bit).
        fused_gate_max_tokens: with ``impl='auto'``, up to this many tokens the gate's logits are computed in
            the Triton kernel's launch too (``router_triton.route_gate_triton``); 0 = never (cuBLAS, then the
            kernel). ``None``: ``FUSED_GATE_MAX_TOKENS``.
        simulation: ``None`` (route by the gate), or a name of ``ROUTING_SIMULATIONS``: the gate still computes its
            routing (its cost stays in the step), then each token's experts are replaced by simulated ones, its
            weights kept. For benchmarks of random (``--load-format dummy``) weights, whose tokens of one prompt
            come to route alike layer by layer, so that a prefill of them reads a few experts where a trained
            model's prompt reads nearly all. The routes go through ``forward`` (``route_to_slots`` answers
            ``None``, ``folds_norm`` false). On CUDA the draws take the default generator, which CUDA graphs
            capture and advance at each replay.

    Attributes:
        impl, fused_gate_max_tokens, simulation: as the arguments (settable; benchmarks compare the paths on one
            router; ``simulation`` is checked when set).

    Raises:
        ValueError: an unknown ``impl`` or ``simulation``, or ``fused_gate_max_tokens`` negative or above
            ``FUSED_GATE_MAX_TOKENS``.
    """

    def __init__(self, spec: MoESpec, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
                 impl: str = "auto", fused_gate_max_tokens: int | None = None, simulation: str | None = None):
        super().__init__()
        if impl not in ("auto", "torch"):
            raise ValueError(f"router impl must be 'auto' or 'torch', got {impl!r}")
        if fused_gate_max_tokens is not None and not 0 <= fused_gate_max_tokens <= FUSED_GATE_MAX_TOKENS:
            raise ValueError(f"fused_gate_max_tokens must be in [0, {FUSED_GATE_MAX_TOKENS}], "
                             f"got {fused_gate_max_tokens}")
        self.spec = spec
        self.impl = impl
        self.simulation = simulation
        self.fused_gate_max_tokens = FUSED_GATE_MAX_TOKENS if fused_gate_max_tokens is None else fused_gate_max_tokens
        self._arrivals: torch.Tensor | None = None  # route_gate_triton's counters on the device (_arrival_counters)
        self._pieces: tuple[tuple, torch.Tensor | None] | None = None  # (weight's identity, bfloat16_pieces)
        e, d = spec.num_experts, spec.hidden_size
        self.fp32_logits = spec.router_fp32_logits
        w_dtype = torch.float32 if self.fp32_logits else dtype
        self.weight = nn.Parameter(torch.empty(e, d, dtype=w_dtype, device=device), requires_grad=False)
        self.bias = (
            nn.Parameter(torch.zeros(e, dtype=dtype, device=device), requires_grad=False) if spec.router_bias else None
        )
        if spec.correction_bias:
            self.register_buffer("e_score_correction_bias", torch.zeros(e, dtype=torch.float32, device=device))
        else:
            self.e_score_correction_bias = None

    @property
    def simulation(self) -> str | None:
        return self._simulation

    @simulation.setter
    def simulation(self, name: str | None) -> None:
        if name is not None and name not in ROUTING_SIMULATIONS:
            raise ValueError(f"routing simulation must be None or one of {list(ROUTING_SIMULATIONS)}, got {name!r}")
        self._simulation = name

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Route tokens (with ``simulation``, the gate's routing and then simulated experts).

        Args:
            x: ``[T, D]`` hidden states.

        Returns:
            ``topk_idx [T, K]`` int64 logical expert ids and ``topk_weights [T, K]`` float32 weights
            (for Llama-4 the weight scales the expert input; for all others its output).
        """
        idx, weights = self._route(x)
        if self._simulation is not None:
            idx = uniform_random_topk(idx.shape[0], self.spec.num_experts, self.spec.top_k, idx.device)
        return idx, weights

    def _route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The gate's routing of ``x [T, D]``, as ``forward`` returns it."""
        s = self.spec
        kind = s.router_kind
        fused = _fused_router(x, kind) if self.impl == "auto" else None
        if fused is not None:
            return self._route_fused(fused, x, None, None)
        logits = self._logits(x)
        if kind == "softmax_topk":
            probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
            if s.n_group > 1:
                probs = _group_mask(probs, s, probs, fill=0.0)
            weights, idx = torch.topk(probs, s.top_k, dim=-1)
            if s.norm_topk_prob:
                weights = weights / weights.sum(dim=-1, keepdim=True)
            if s.round_router_weights:
                weights = weights.to(logits.dtype)
            weights = weights * s.routed_scaling_factor if s.routed_scaling_factor != 1.0 else weights
        elif kind == "sigmoid_topk":
            scores = logits.sigmoid()
            choice = scores + self.e_score_correction_bias
            if s.n_group > 1:
                choice = _group_mask(choice, s, choice, fill=float("-inf"))
            idx = torch.topk(choice, s.top_k, dim=-1, sorted=False)[1]
            weights = scores.gather(1, idx)
            if s.norm_topk_prob:
                weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
            weights = weights * s.routed_scaling_factor
        elif kind == "topk_softmax":
            top, idx = torch.topk(logits, s.top_k, dim=-1)
            weights = torch.softmax(top, dim=1, dtype=top.dtype)
        else:  # topk_sigmoid (Llama-4)
            top, idx = torch.topk(logits, s.top_k, dim=1)
            weights = torch.sigmoid(top.float()).to(top.dtype)
        return idx, weights.float()

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, E]`` gate logits: float32 with ``fp32_logits`` (``x``, weight and bias widened), else ``x``'s dtype."""
        if self.fp32_logits:
            return F.linear(x.float(), self.weight.float(), None if self.bias is None else self.bias.float())
        return F.linear(x, self.weight, self.bias)

    def route_to_slots(self, x: torch.Tensor, slot_table: torch.Tensor, record: LoadRecord | None = None,
                       row_mask: torch.Tensor | None = None,
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Route tokens and look their experts up in ``slot_table`` (and add them to ``record``) in the fused
        kernel's one launch; ``None`` where the fused kernel does not serve these logits (``impl='torch'``, CPU,
        another router kind): the caller routes with ``forward`` and maps the ids itself.

        Args:
            x: ``[T, D]`` hidden states.
            slot_table: ``[E]`` int64 physical slot of each expert (``SlotMap.static_table``).
            record: the load recorder's counts (``ExpertLoadRecorder.load_record``), or ``None``.
            row_mask: ``[T]`` int64, 0 = a padding row (slots -1, not counted), or ``None``.

        Returns:
            ``topk_idx``, ``topk_weights`` as ``forward`` and ``topk_slots [T, K]`` int64, or ``None``.
        """
        fused = _fused_router(x, self.spec.router_kind) if self.impl == "auto" and self._simulation is None else None
        if fused is None:
            return None
        return self._route_fused(fused, x, slot_table, record, row_mask)

    def folds_norm(self, x: torch.Tensor, weight: torch.Tensor, weight_then_cast: bool) -> bool:
        """Whether ``route_folded`` routes the row ``x [1, D]`` normalised by an RMSNorm of ``weight`` in the fused
        gate's launch: one token through ``router_triton.route_gate_triton`` (``impl='auto'``, CUDA, a kernel for
        this router kind, the gate in the launch), rows of the gate's dtype (or a float32 gate), a contiguous
        ``[D]`` norm weight of the rows' dtype (any float dtype with ``weight_then_cast``) on their device."""
        return (isinstance(x, torch.Tensor) and isinstance(weight, torch.Tensor) and self.impl == "auto"
                and self._simulation is None
                and x.dim() == 2 and x.shape[0] == 1 and self.fused_gate_max_tokens >= 1
                and _fused_router(x, self.spec.router_kind) is not None
                and (self.fp32_logits or x.dtype == self.weight.dtype)
                and (self.bias is None or self.fp32_logits or self.bias.dtype == x.dtype)
                and norm_weight_fits(x, weight, weight_then_cast))

    def route_folded(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                     weight_then_cast: bool, summed: torch.Tensor, slot_table: torch.Tensor,
                     record: LoadRecord | None = None, row_mask: torch.Tensor | None = None,
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``route_to_slots`` of ``RMSNorm(residual + x)`` (``layer.FoldedNorm``'s norm), the add and the norm
        computed in the routing launch: for a row ``folds_norm`` accepted.

        Args:
            x: ``[1, D]`` the block's output row.
            residual: ``[1, D]`` the residual stream (``x``'s dtype, contiguous).
            weight: ``[D]`` the norm's weight; eps, weight_then_cast: the norm's (``FusedRMSNorm``'s).
            summed: ``[1, D]`` written with ``residual + x``.
            slot_table: ``[E]`` int64 physical slot of each expert (required here).
            record, row_mask: as ``route_to_slots``.

        Returns:
            ``topk_idx``, ``topk_weights``, ``topk_slots`` as ``route_to_slots`` and the normalised row ``[1, D]``.

        Raises:
            ValueError: a row ``folds_norm`` refuses, no slot table, or tensors that do not fit it (named).
            TypeError: as ``router_triton.NormBefore.check``.
        """
        if not isinstance(slot_table, torch.Tensor):
            raise ValueError(f"Router.route_folded needs the layer's slot table, got {type(slot_table).__name__}")
        if not self.folds_norm(x, weight, weight_then_cast):
            shown = (f"rows {tuple(x.shape)} {x.dtype} on {x.device}" if isinstance(x, torch.Tensor)
                     else f"rows {type(x).__name__}")
            wshown = (f"{tuple(weight.shape)} {weight.dtype}" if isinstance(weight, torch.Tensor)
                      else type(weight).__name__)
            raise ValueError(f"Router.route_folded: {shown} with a norm weight {wshown}: the fused router does not "
                             f"fold this norm (folds_norm is false)")
        fused = _fused_router(x, self.spec.router_kind)
        normed = torch.empty_like(x, memory_format=torch.contiguous_format)
        norm = fused.NormBefore(residual, weight, float(eps), bool(weight_then_cast), summed, normed)
        out = fused.route_gate_triton(x, self.weight, self.bias, self._arrival_counters(x.device),
                                      self.e_score_correction_bias, fp32_logits=self.fp32_logits,
                                      **kernel_flags(self.spec), slot_table=slot_table, record=record,
                                      row_mask=row_mask, norm=norm)
        return (*out, normed)

    def _route_fused(self, fused, x: torch.Tensor, slot_table: torch.Tensor | None, record: LoadRecord | None,
                     row_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        """Route through ``router_triton``: the gate in the kernel's launch up to ``fused_gate_max_tokens`` tokens,
        else ``F.linear`` then the kernel."""
        flags = kernel_flags(self.spec)
        if 0 < x.shape[0] <= self.fused_gate_max_tokens:
            return fused.route_gate_triton(x, self.weight, self.bias, self._arrival_counters(x.device),
                                           self.e_score_correction_bias, fp32_logits=self.fp32_logits, **flags,
                                           slot_table=slot_table, record=record, row_mask=row_mask)
        return fused.route_triton(self._gate_logits(x), self.e_score_correction_bias, **flags, slot_table=slot_table,
                                  record=record, row_mask=row_mask)

    def _gate_logits(self, x: torch.Tensor) -> torch.Tensor:
        """``_logits`` for the fused path: float32 logits of bfloat16 rows ``x [T, D]`` on CUDA through the weight's
        ``bfloat16_pieces`` (one matrix product with float32 output over the ``[n * E, D]`` pieces, the ``n`` partial
        logits summed), where ``F.linear`` would widen ``x`` and run a float32 product on the CUDA cores; else
        ``_logits``."""
        pieces = (self._weight_pieces() if self.fp32_logits and x.is_cuda and x.dtype == torch.bfloat16
                  and self.weight.dtype == torch.float32 else None)
        if pieces is None:
            return self._logits(x)
        n, e, d = pieces.shape
        logits = torch.mm(x, pieces.view(n * e, d).t(), out_dtype=torch.float32)
        logits = logits.view(x.shape[0], n, e).sum(dim=1) if n > 1 else logits
        return logits if self.bias is None else logits + self.bias.float()

    def _weight_pieces(self) -> torch.Tensor | None:
        """The gate weight's ``bfloat16_pieces``, made once per weight (its storage, and its version counter where
        the tensor keeps one: an inference-mode tensor does not, and is taken as changed only with its storage):
        ``None`` where it has none, and during a CUDA-graph capture that finds none made (the engine's warm-up steps
        make them before capturing; the graph then keeps the float32 product)."""
        w = self.weight
        key = (w.data_ptr(), None if w.is_inference() else w._version, w.device)
        if self._pieces is not None and self._pieces[0] == key:
            return self._pieces[1]
        if w.is_cuda and torch.cuda.is_current_stream_capturing():
            return None
        self._pieces = (key, bfloat16_pieces(w.detach()))
        return self._pieces[1]

    def _arrival_counters(self, device: torch.device) -> torch.Tensor:
        """``route_gate_triton``'s ``[FUSED_GATE_MAX_TOKENS]`` int32 arrival counters on ``device``: zeroed once,
        kept at 0 by the kernel, so a captured graph holds their address (one router's launches run one after
        another on a stream). Made during a CUDA-graph capture (no eager call came first) they are zeroed inside
        the graph and not kept: eager calls after the capture would otherwise find them unset."""
        counters = self._arrivals
        if counters is None or counters.device != device:
            counters = torch.zeros(FUSED_GATE_MAX_TOKENS, dtype=torch.int32, device=device)
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                return counters
            self._arrivals = counters
        return counters


def uniform_random_topk(tokens: int, num_experts: int, top_k: int, device: torch.device | str) -> torch.Tensor:
    """``[tokens, top_k]`` int64 expert ids, each row ``top_k`` distinct experts drawn uniformly at random (the top
    ``top_k`` of uniform draws): the ``uniform_random`` routing simulation, the routing the planner prices. Draws
    from ``device``'s default generator (no host synchronisation; CUDA-graph safe).

    Raises:
        ValueError: ``top_k`` not in ``1..num_experts``.
    """
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"uniform_random_topk: top_k must be in 1..num_experts ({num_experts}), got {top_k}")
    return torch.rand(tokens, num_experts, device=device).topk(top_k, dim=1, sorted=False).indices


def kernel_flags(spec: MoESpec) -> dict[str, object]:
    """The keyword flags of ``router_triton.route_triton`` for a model (the kernel never sees ``MoESpec``)."""
    return dict(top_k=spec.top_k, sigmoid=spec.scoring == "sigmoid", n_group=spec.n_group,
                topk_group=spec.topk_group, top2_sum=spec.group_score == "top2_sum", normalize=spec.norm_topk_prob,
                round_weights=spec.round_router_weights, scale=spec.routed_scaling_factor,
                chosen=spec.router_kind in ("topk_softmax", "topk_sigmoid"))


def _fused_router(x: torch.Tensor, router_kind: str):
    """The ``router_triton`` module when it can route these tokens (CUDA, Triton importable, kind supported)."""
    if not x.is_cuda:
        return None
    try:
        from epmoe.routing import router_triton
    except ImportError:
        return None
    return router_triton if router_triton.supports(router_kind) else None


def router_choices(spec: MoESpec, logits: torch.Tensor,
                   correction_bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The values ``Router`` picks a token's experts by, from its gate logits, before any group mask: the softmax
    probabilities (``softmax_topk``), the sigmoid scores plus the correction bias (``sigmoid_topk``), or the logits
    themselves (``topk_softmax``, ``topk_sigmoid``); with expert groups also the groups' scores, by which the
    ``topk_group`` groups are kept (``_group_scores``). ``runtime.near_tie`` reads how close the choices were.

    Args:
        spec: the model's MoE facts.
        logits: ``[T, E]`` float32 gate logits.
        correction_bias: ``[E]`` float32 ``e_score_correction_bias`` (``sigmoid_topk``), or ``None``.

    Returns:
        ``[T, E]`` float32 choice values and ``[T, n_group]`` float32 group scores (``None`` without groups).
    """
    kind = spec.router_kind
    if kind == "softmax_topk":
        choice = torch.softmax(logits.float(), dim=-1)
    elif kind == "sigmoid_topk":
        choice = logits.float().sigmoid()
        if correction_bias is not None:
            choice = choice + correction_bias.float()
    else:
        choice = logits.float()
    return choice, (_group_scores(choice, spec) if spec.n_group > 1 else None)


def _group_scores(scores_for_groups: torch.Tensor, s: MoESpec) -> torch.Tensor:
    """``[T, n_group]``: each group's best score, or the sum of its two best (``group_score == "top2_sum"``)."""
    grouped = scores_for_groups.view(scores_for_groups.shape[0], s.n_group, s.num_experts // s.n_group)
    if s.group_score == "top2_sum":
        return grouped.topk(2, dim=-1)[0].sum(dim=-1)
    return grouped.max(dim=-1).values


def kept_groups(group_scores: torch.Tensor, s: MoESpec) -> torch.Tensor:
    """``[T, n_group]`` bool: the ``topk_group`` groups ``Router`` keeps by their scores (``torch.topk``, so an exact
    tie breaks as transformers' routers break it)."""
    group_idx = torch.topk(group_scores, k=s.topk_group, dim=-1, sorted=False)[1]
    return torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)


def _group_mask(values: torch.Tensor, s: MoESpec, scores_for_groups: torch.Tensor, fill: float) -> torch.Tensor:
    """Keep only experts of the ``topk_group`` best groups (DeepSeek grouped / device-limited routing)."""
    t = values.shape[0]
    group_mask = kept_groups(_group_scores(scores_for_groups, s), s)
    expert_mask = group_mask.unsqueeze(-1).expand(-1, -1, s.num_experts // s.n_group).reshape(t, s.num_experts)
    return values.masked_fill(~expert_mask, fill)
