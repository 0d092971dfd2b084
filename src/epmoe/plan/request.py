"""What the planner takes and returns: the request (checked when built) and its frozen results.

``PlanRequest`` holds the ``epmoe plan`` flags with their bounds; ``Strategy`` names one way to spread a
model over the GPUs; a ``Plan`` holds, per strategy and batch size, a ``StepEstimate`` (times, the
collectives as ``CollectiveCost`` and the memory as ``MemoryEstimate``). The model that fills them in
is ``planner``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from epmoe.checks import MAX_SPECULATIVE_TOKENS, check_int
from epmoe.experts.storage import ExpertStorage, dequantized_reason, served_format
from epmoe.placement import max_redundant_slots
from epmoe.plan.costs import WEIGHT_CHOICES, CollectiveKind
from epmoe.plan.hardware import HardwareProfile
from epmoe.spec import MoESpec

GIB = 1024**3


def format_bytes(n: float) -> str:
    """``n`` bytes in the largest binary unit that leaves at least 1 (``B``, ``KiB``, ``MiB``, ``GiB``): whole bytes,
    else one decimal (``"12.0 KiB"``, ``"66.4 GiB"``)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def counted(n: int, noun: str, plural: str = "") -> str:
    """``n`` and ``noun`` in the number ``n`` takes, for messages and reports: ``counted(1, "slot")`` is
    ``"1 slot"``, ``counted(2, "slot")`` ``"2 slots"``, ``counted(3, "copy", "copies")`` ``"3 copies"``."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"


# Sanity bounds of a plan request (far above any serving set-up; they keep nonsense from running for minutes):
# sequences per decode step, KV-cache tokens per sequence, GPUs (draft tokens per step: what the engine verifies,
# ``checks.MAX_SPECULATIVE_TOKENS``).
MAX_BATCH = 1 << 20
MAX_CONTEXT = 1 << 24
MAX_GPUS = 1 << 16

DEFAULT_CONTEXT = 4096
"""The KV-cache tokens a sequence a plan prices unless told: ``PlanRequest.context``'s default, and what ``epmoe plan``
and ``epmoe doctor`` take without ``--context`` (the model's ``max_position_embeddings`` where shorter)."""


def nodes_needed(gpus: int, gpus_per_node: int) -> int:
    """The fewest nodes ``gpus`` GPUs fit on with as many on each (at most ``gpus_per_node``): the smallest divisor
    of ``gpus`` at least ``gpus / gpus_per_node`` (9 GPUs of 8-GPU nodes: 3 nodes of 3)."""
    return next(n for n in range(math.ceil(gpus / gpus_per_node), gpus + 1) if gpus % n == 0)


def default_context(spec: MoESpec) -> int:
    """The KV-cache tokens a sequence ``epmoe plan`` and ``epmoe doctor`` price without ``--context``:
    ``DEFAULT_CONTEXT``, or the model's ``max_position_embeddings`` where shorter."""
    return min(DEFAULT_CONTEXT, spec.max_position_embeddings)

Mode = Literal["all_reduce", "a2a_tp_attn", "a2a_dp_attn"]


@dataclass(frozen=True)
class PlanRequest:
    """What to plan (the ``epmoe plan`` flags).

    Attributes:
        spec: the model.
        hardware: the machine.
        gpus: ``G``, GPUs in total.
        nodes: nodes the GPUs are spread over (``G / nodes`` per node).
        batches: batch sizes (sequences per step) to evaluate.
        spec_tokens: ``S`` draft tokens verified per step (0 = plain decode).
        redundant: ``R`` redundant expert slots per MoE layer (EP strategies).
        context: KV-cache length per sequence, tokens.
        weights: routed expert storage: ``bf16``, ``fp8``, ``int4``, or ``None`` for the checkpoint's.
        mem_fraction: share of GPU memory the server may use (the rest: CUDA context, NCCL, fragmentation).
        balancedness: expected mean/max tokens per EP rank from routing skew (1.0 = perfect).
        input_lens: prompt lengths, tokens, whose prefill alone (the time to first token) is priced as well (``()``:
            none); each at most ``context``.

    Raises:
        ValueError: a value out of its bounds (named with the value), or routed experts in a format ``epmoe run``
            does not serve, e.g. an INT4 ``group_size`` its kernels do not take (``experts.storage.ExpertStorage.of``,
            the check the loader and ``epmoe doctor`` make; the config file and the value named).
    """

    spec: MoESpec
    hardware: HardwareProfile
    gpus: int
    nodes: int = 1
    batches: tuple[int, ...] = (1, 8, 64, 256)
    spec_tokens: int = 0
    redundant: int = 0
    context: int = DEFAULT_CONTEXT
    weights: str | None = None
    mem_fraction: float = 0.9
    balancedness: float = 0.8
    input_lens: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        def pos_int(name: str, value: object, minimum: int = 1, maximum: int | None = None) -> None:
            check_int(name, value, minimum)
            if maximum is not None and value > maximum:
                raise ValueError(f"{name} must be at most {maximum}, got {value!r}")

        pos_int("gpus", self.gpus, 1, MAX_GPUS)
        pos_int("nodes", self.nodes)
        pos_int("spec_tokens", self.spec_tokens, 0, MAX_SPECULATIVE_TOKENS)
        pos_int("redundant", self.redundant, 0, max_redundant_slots(self.spec.num_experts, self.gpus))
        pos_int("context", self.context, 1, MAX_CONTEXT)
        if not self.batches:
            raise ValueError("batches must name at least one batch size")
        for b in self.batches:
            pos_int("batch", b, 1, MAX_BATCH)
        for n in self.input_lens:
            pos_int("input_len", n, 1, MAX_CONTEXT)
            if n > self.context:
                raise ValueError(f"input_len {n} is longer than the context ({self.context} KV-cache tokens a "
                                 f"sequence): its prefill would not fit its own cache")
        if self.weights is not None and self.weights not in WEIGHT_CHOICES:
            raise ValueError(f"weights must be one of {', '.join(WEIGHT_CHOICES)}, got {self.weights!r}")
        try:
            ExpertStorage.of(self.expert_format, self.spec.moe_intermediate_size)
        except ValueError as exc:
            raise ValueError(f"{self.spec.source}: routed experts: {exc}; epmoe run refuses to load these experts "
                             f"(--weights prices them converted to another format)") from None
        if not 0 < self.mem_fraction <= 1:
            raise ValueError(f"mem_fraction must lie in (0, 1], got {self.mem_fraction}")
        if not 0 < self.balancedness <= 1:
            raise ValueError(f"balancedness must lie in (0, 1], got {self.balancedness}")
        if self.gpus % self.nodes:
            raise ValueError(f"gpus ({self.gpus}) must be divisible by nodes ({self.nodes})")
        per_node = self.gpus // self.nodes
        if per_node > self.hardware.gpus_per_node:
            advice = (f"pass --nodes {nodes_needed(self.gpus, self.hardware.gpus_per_node)}"
                      if self.hardware.inter_node is not None else
                      f"it has no inter_node link, so at most {self.hardware.gpus_per_node} GPUs")
            raise ValueError(f"gpus ({self.gpus}) on {self.nodes} node(s) is {per_node} per node but "
                             f"{self.hardware.name} has {self.hardware.gpus_per_node}; {advice}")
        if self.nodes > 1 and self.hardware.inter_node is None:
            raise ValueError(f"nodes ({self.nodes}) > 1 but hardware {self.hardware.name} has no inter_node link")
        slots = self.spec.num_experts + self.redundant
        if self.gpus > slots:
            raise ValueError(
                f"gpus ({self.gpus}) exceeds the expert slots per layer ({self.spec.num_experts} experts + "
                f"{self.redundant} redundant): EP needs a slot on every GPU; use --redundant "
                f"{self.gpus - self.spec.num_experts} or fewer GPUs"
            )

    @property
    def expert_format(self) -> str:
        """Format the routed experts are served in (``--weights``, else the checkpoint's), as ``epmoe run`` serves
        it: ``bf16`` for FP8 experts it dequantizes on load (``experts.storage.served_format``)."""
        return served_format(self._asked_format, self.spec.moe_intermediate_size)

    @property
    def expert_format_note(self) -> str:
        """Why the routed experts are priced in bf16 though ``--weights`` or the checkpoint names FP8
        (``experts.storage.dequantized_reason``), ``""`` when they are not."""
        return dequantized_reason(self._asked_format, self.spec.moe_intermediate_size)

    @property
    def _asked_format(self) -> str:
        """The routed experts' format as asked: ``--weights``, else the checkpoint's."""
        return WEIGHT_CHOICES[self.weights] if self.weights else self.spec.expert_weight_format

    @property
    def dense_format(self) -> str:
        """Storage of the other linear weights: ``bf16``, as ``epmoe run`` serves them (its modules compute in the
        compute dtype; a checkpoint's FP8 attention and dense weights are dequantized on load)."""
        return "bf16"


@dataclass(frozen=True)
class Strategy:
    """One way to spread the model over ``G`` GPUs.

    Attributes:
        name: short name (``TP8``, ``TP2xEP4``, ``EP8+DPattn``).
        description: in words.
        attn_tp: attention TP size (``G``, or 1 for DP attention).
        moe_tp: slices of each expert.
        moe_ep: groups the experts are spread over (``attn_tp`` x DP = ``moe_tp`` x ``moe_ep`` = ``G``).
        mode: how MoE outputs are combined: ``all_reduce``, ``a2a_tp_attn``, ``a2a_dp_attn``.
    """

    name: str
    description: str
    attn_tp: int
    moe_tp: int
    moe_ep: int
    mode: Mode


@dataclass(frozen=True)
class CollectiveCost:
    """Collectives of one kind and purpose in a step: ``count`` calls of ``bytes_per_call`` bytes per rank.

    Attributes:
        kind: ``all_reduce``, ``reduce_scatter``, ``all_gather`` or ``all_to_all``.
        what: the tensor it moves (``attention and MLP outputs``, ``logits``, ``dispatch and combine``).
        count: calls per step.
        bytes_per_call: buffer per rank (all-reduce, reduce-scatter input, all-gather output) or bytes
            each rank sends to other ranks (all-to-all, mean rank), bytes.
        ms_each: time of one call, ms (all-to-all: priced on the busiest receiver).
    """

    kind: CollectiveKind
    what: str
    count: int
    bytes_per_call: float
    ms_each: float

    @property
    def ms_total(self) -> float:
        """``count * ms_each``, ms."""
        return self.count * self.ms_each


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one GPU needs, by kind, against what it may use.

    Attributes:
        weights: all weights on the rank, bytes (``expert_weights`` included).
        expert_weights: routed expert slots on the rank, redundant copies included, bytes.
        kv_cache: KV cache of the rank's sequences at the planned context, bytes.
        comm_buffers: dispatch/combine or all-reduce buffers, bytes.
        graph_pool: CUDA-graph memory pool, bytes.
        capacity: ``memory_bytes * mem_fraction``, bytes.
    """

    weights: float
    expert_weights: float
    kv_cache: float
    comm_buffers: float
    graph_pool: float
    capacity: float

    @property
    def total(self) -> float:
        """Bytes needed in total."""
        return self.weights + self.kv_cache + self.comm_buffers + self.graph_pool

    @property
    def fits(self) -> bool:
        """True when ``total <= capacity``."""
        return self.total <= self.capacity

    @property
    def over(self) -> float:
        """Bytes beyond capacity (0 when it fits)."""
        return max(0.0, self.total - self.capacity)


@dataclass(frozen=True)
class StepEstimate:
    """One step of one strategy at one batch size, on the busiest rank.

    Attributes:
        batch: sequences in the step.
        tokens: positions computed in the step, ``batch * (S + 1)``.
        attention_ms: attention, dense MLPs, shared experts, router and LM head, ms.
        expert_ms: routed expert compute, ms.
        collectives: per kind, count and cost.
        memory: per-GPU memory at this batch size.
        engine_ms: the engine's step cost beyond the rooflines (launches, host work; the profile's
            ``engine_*`` fields), ms.
    """

    batch: int
    tokens: int
    attention_ms: float
    expert_ms: float
    collectives: tuple[CollectiveCost, ...]
    memory: MemoryEstimate
    engine_ms: float = 0.0

    @property
    def comm_ms(self) -> float:
        """Communication time, ms."""
        return sum(c.ms_total for c in self.collectives)

    @property
    def total_ms(self) -> float:
        """Step time, ms (no overlap assumed)."""
        return self.attention_ms + self.expert_ms + self.comm_ms + self.engine_ms

    def count(self, kind: CollectiveKind) -> int:
        """Calls of collective ``kind`` in the step."""
        return sum(c.count for c in self.collectives if c.kind == kind)


@dataclass(frozen=True)
class StrategyPlan:
    """A strategy, its estimate at every batch size and, where the request names prompt lengths, one prompt's
    prefill alone at each (``StepEstimate`` of batch 1 and ``n`` tokens: its ``total_ms`` is the time to first
    token)."""

    strategy: Strategy
    steps: tuple[StepEstimate, ...]
    prefills: tuple[StepEstimate, ...] = ()


@dataclass(frozen=True)
class Plan:
    """The answer of ``plan``: every strategy at every batch, and why some strategies were left out."""

    request: PlanRequest
    strategies: tuple[StrategyPlan, ...]
    skipped: tuple[str, ...] = field(default=())

    def fastest_fitting(self, i: int) -> StrategyPlan | None:
        """The fastest strategy whose memory fits at batch index ``i`` (None when none fits)."""
        fitting = [s for s in self.strategies if s.steps[i].memory.fits]
        return min(fitting, key=lambda s: s.steps[i].total_ms) if fitting else None

    def strategy(self, name: str) -> StrategyPlan:
        """The plan of strategy ``name``.

        Raises:
            KeyError: no such strategy (the planned ones are listed).
        """
        for s in self.strategies:
            if s.strategy.name == name:
                return s
        raise KeyError(f"strategy {name!r} was not planned; planned: "
                       f"{', '.join(s.strategy.name for s in self.strategies)}")
